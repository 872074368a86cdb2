"""Context extension recipe (`python -m train --config=long_tiny`): the tiny model, pretrained on 128-token
sequences, continues pretraining on 2048-token sequences of the built-in corpus with YaRN RoPE scaling (factor 16
over the original 128 positions), as Llama 3.1, Qwen 2.5 and DeepSeek extend their context.

With no train.init_from it starts from the `tiny` recipe's run in WORKDIR/../tiny (runs/tiny by default), made
first when missing. train.context_extension lets this config's max_seq_len and RoPE keys replace the checkpoint's.
Same tokens per step as tiny (2 x 2048 against 16 x 128). Evaluate the positions the extension reaches with
`python -m train.evaluate --tasks position_ppl:FILE` and the passkey task (docs/long-context.md).
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.update(max_seq_len=2048, rope_scaling="yarn", rope_scaling_factor=16.0, rope_original_max_len=128)
  c.train.update(base_recipe="tiny", context_extension=True, steps=200, batch_size=2, seq_len=2048, lr=1e-3,
                 warmup_steps=20, eval_every=50, eval_steps=4)
  # Two sequences a step: the devices of a larger host split the sequence (mesh.sequence) instead of the rows.
  c.mesh.update(data=1, sequence=-1)
  c.checkpoint.every = 100
  return c
