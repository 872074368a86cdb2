"""The `python -m train.serve` program: load a model, start the engine's thread, serve HTTP until SIGTERM/SIGINT.

Exit codes: 0 after a shutdown (SIGTERM or SIGINT: no new connections, in-flight requests finish within
--shutdown_timeout seconds, then the rest are cancelled), 2 bad arguments or an unusable run/model directory.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from typing import Sequence

import configs
from train.rundir import generate as generate_cli


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.serve", description="An OpenAI-compatible server for a meshlm "
                              "run or a Hugging Face directory.",
                              epilog="Mesh and model overrides: --config.SECTION.KEY=VALUE. Exit codes: 0 shut "
                                     "down, 2 bad arguments or directory.")
  generate_cli.add_source_arguments(p)
  p.add_argument("--host", default="127.0.0.1", help="address to listen on")
  p.add_argument("--port", type=int, default=8000, help="TCP port")
  p.add_argument("--served_model_name", default=None, help="the model id clients name (default: the directory's)")
  p.add_argument("--max_seqs", type=int, default=16, help="sequences decoded at once (the engine's batch)")
  p.add_argument("--max_queue", type=int, default=64, help="requests waiting beyond max_seqs before 429s")
  p.add_argument("--max_len", type=int, default=None, help="prompt + completion tokens (default: model.max_seq_len)")
  p.add_argument("--page_size", type=int, default=16, help="KV-cache slots per page")
  p.add_argument("--num_pages", type=int, default=None, help="pages in the pool (default: max_seqs full sequences)")
  p.add_argument("--chunk", type=int, default=64, help="prompt tokens per sequence per step (chunked prefill)")
  p.add_argument("--speculative", type=int, default=0,
                 help="draft tokens verified per step (0 = off): n-gram prompt lookup, or the --draft_* model's")
  p.add_argument("--draft_workdir", default=None, help="a smaller meshlm run drafting for --speculative")
  p.add_argument("--draft_hf", default=None, help="a smaller Hugging Face model drafting for --speculative")
  p.add_argument("--draft_mtp", action="store_true",
                 help="the model's own first multi-token head drafts (model.mtp_depth >= 1; one token per step: "
                      "--speculative 1)")
  p.add_argument("--no_warmup", action="store_true",
                 help="start without compiling every engine program first (a faster start; the first requests of "
                      "each shape wait for their compilation)")
  p.add_argument("--shutdown_timeout", type=float, default=30.0,
                 help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
  return p


def _check(args) -> None:
  if args.step is not None and args.hf:
    raise generate_cli.GenerateError("--step applies to --workdir runs only")
  if not 0 <= args.port < 65536:
    raise generate_cli.GenerateError(f"--port={args.port} must be in [0, 65535]")
  if sum(map(bool, (args.draft_workdir, args.draft_hf, args.draft_mtp))) > 1:
    raise generate_cli.GenerateError("give one of --draft_workdir, --draft_hf and --draft_mtp")
  if args.draft_mtp and args.speculative != 1:
    raise generate_cli.GenerateError(f"--draft_mtp drafts one token per step; set --speculative 1 (got "
                                     f"{args.speculative})")
  if (args.draft_workdir or args.draft_hf) and args.speculative < 1:
    raise generate_cli.GenerateError("a draft model drafts --speculative tokens per step; set --speculative >= 1")
  if args.max_queue < 0 or args.shutdown_timeout < 0:
    raise generate_cli.GenerateError(f"--max_queue={args.max_queue} and --shutdown_timeout="
                                     f"{args.shutdown_timeout} must be >= 0")


def build(args, overrides: Sequence[tuple[str, str]]):
  """(the FastAPI app, the worker) for parsed arguments: the model loaded, the engine compiled and warm."""
  import parallel  # pylint: disable=g-import-not-at-top
  from model import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import chat  # pylint: disable=g-import-not-at-top
  from train.serve import api, worker as worker_lib  # pylint: disable=g-import-not-at-top

  config, tokenizer, saved_template, model, mesh, rules = generate_cli.load(args.workdir, args.hf, args.step,
                                                                            overrides)
  template = chat.template_for_run(config, tokenizer, saved_template)
  draft = "mtp" if args.draft_mtp else None
  if args.draft_workdir or args.draft_hf:
    mesh_overrides = [(k, v) for k, v in overrides if k.startswith("mesh.")]  # the model keys are the target's
    _, draft_tokenizer, _, draft, _, _ = generate_cli.load(args.draft_workdir, args.draft_hf, None, mesh_overrides)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
      raise generate_cli.GenerateError(f"the draft's tokenizer has {draft_tokenizer.vocab_size} pieces, the "
                                       f"model's {tokenizer.vocab_size}: a draft must share the tokenizer")
  engine = engine_lib.Engine(model, max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
                             chunk=args.chunk, max_len=args.max_len, speculative=args.speculative, draft=draft)
  scope = lambda: parallel.activate(mesh, rules)  # pylint: disable=unnecessary-lambda-assignment
  if not args.no_warmup:
    with scope():
      engine.warmup()  # every program the engine can call, compiled before serving
  worker = worker_lib.Worker(engine, max_queue=args.max_queue, scope=scope)
  name = args.served_model_name or os.path.basename(os.path.normpath(args.workdir or args.hf))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    worker.start()
    yield
    worker.stop()  # after uvicorn's graceful shutdown: whatever is still pending is cancelled

  return api.build_app(api.Service(worker, tokenizer, template, name), lifespan), worker


def main(argv: Sequence[str] | None = None) -> int:
  from train.__main__ import _default_platform  # pylint: disable=g-import-not-at-top
  _default_platform()  # before the first JAX import
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  try:
    own, overrides = generate_cli.split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = _parser().parse_args(own)
    _check(args)
    app, _ = build(args, overrides)
  except (generate_cli.GenerateError, configs.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import uvicorn  # pylint: disable=g-import-not-at-top
  server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                         timeout_graceful_shutdown=args.shutdown_timeout))
  # uvicorn re-raises the signal that stopped it once it has shut down; a handler here makes that a clean exit 0.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  server.run()
  return 0
