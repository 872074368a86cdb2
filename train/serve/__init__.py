"""`python -m train.serve`: an OpenAI-compatible HTTP server over the inference engine (docs/serve.md).

    python -m train.serve --workdir RUN | --hf DIR [--host 127.0.0.1] [--port 8000] [--max_seqs 16]
        [--max_queue 64] [--max_len N] [--page_size 16] [--num_pages N] [--chunk 64] [--speculative 0 [--draft_workdir RUN | --draft_hf DIR | --draft_mtp]]
        [--served_model_name NAME] [--no_warmup] [--shutdown_timeout 30] [--config.mesh.tensor=2 ...]

The program lives in `train/serve/main.py`, the routes in `api.py`, the engine's thread in `worker.py`.
"""
