"""`python -m train.evaluate --workdir RUN [--step N] | --hf DIR --tasks NAME:PATH[,...] [options]`.

Runs benchmark, perplexity, generation, bias and toxicity tasks (evals/, docs/evaluation.md) on a run's
checkpoint or a Hugging Face directory, sharded on the mesh; prints a table (task, metric, value, stderr) and
writes lm-eval-shaped JSON with plain metric names to --output. Exit codes: 0 done, 2 bad arguments, run
directory or task file (nothing evaluated).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Sequence


def _mesh_arg(text: str) -> dict[str, int]:
  out = {}
  for item in [s for s in text.split(",") if s]:
    key, sep, value = item.partition("=")
    try:
      out[key.strip()] = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected AXIS=INT[,AXIS=INT...], e.g. data=1,fsdp=-1")
    if not sep:
      raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected AXIS=INT[,AXIS=INT...]")
  return out


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a meshlm run directory (latest checkpoint unless --step)")
  src.add_argument("--hf", help="a Hugging Face directory (config.json, safetensors, tokenizer.json)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step of --workdir")
  p.add_argument("--tasks", required=True, help="NAME:PATH[,NAME:PATH...], e.g. piqa:data/piqa,mc:task.jsonl")
  p.add_argument("--num_fewshot", type=int, default=0, help="few-shot examples before each prompt")
  p.add_argument("--limit", type=int, default=None, help="evaluate only the first N documents of each task")
  p.add_argument("--batch_size", type=int, default=16, help="rows per forward pass")
  p.add_argument("--max_len", type=int, default=None,
                 help="tokens a request may span (default: the model's max_seq_len); longer than the model was "
                      "trained on measures extrapolation (position_ppl, passkey)")
  p.add_argument("--output", default=None, help="write the results JSON here")
  p.add_argument("--log_samples", action="store_true", help="add per-document log-likelihoods/predictions")
  p.add_argument("--mesh", type=_mesh_arg, default=None, help="mesh axes, e.g. data=1,fsdp=-1 (default: the run's)")
  p.add_argument("--seed", type=int, default=1234, help="few-shot sampling seed")
  p.add_argument("--toxicity_scorer", default="profanity",
                 help="'profanity' (offline alt-profanity-check) or a local Hugging Face classifier directory")
  p.add_argument("--toxicity_samples", type=int, default=25, help="continuations sampled per toxicity prompt")
  p.add_argument("--no_progress", action="store_true", help="no progress bar")
  return p


def format_table(results: dict[str, dict[str, Any]]) -> str:
  """Rows `task | metric | value | stderr` (metrics with a `_stderr` partner show it)."""
  rows = [("task", "metric", "value", "stderr")]
  for task, metrics in results.items():
    for name, value in metrics.items():
      if name.endswith("_stderr"):
        continue
      err = metrics.get(f"{name}_stderr")
      fmt = lambda v: "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"
      rows.append((task, name, fmt(value), fmt(err) if f"{name}_stderr" in metrics else ""))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "-+-".join("-" * w for w in widths))
  return "\n".join(lines)


def open_lm(args):
  """(evals.LM, description) for --workdir / --hf."""
  import evals  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  specials = None
  if args.workdir:
    run = restore.load_run(args.workdir, args.step, args.mesh, max_seq_len=args.max_len)
    tok = tokenizer_lib.Tokenizer.load(run.tokenizer_path)
    model, mesh, rules, what = run.model, run.mesh, run.rules, f"{args.workdir} step {run.step}"
    # the chat markers written in a task's text (a chat-formatted prompt, an <|end_of_turn|> stop) are one id each,
    # as the run's chat template renders them (a Hugging Face tokenizer.json matches its specials itself)
    specials = {p: tok.special_id(p) for p in tokenizer_lib.RESERVED}
  else:
    model, tok, mesh, rules = restore.load_hf(args.hf, args.mesh)
    what = args.hf
    if args.max_len and args.max_len > model.cfg.max_seq_len:
      raise restore.RunError(f"--max_len={args.max_len} exceeds {args.hf}'s max_position_embeddings="
                             f"{model.cfg.max_seq_len}; use at most that")
  return evals.LM(model, tok, mesh, rules, batch_size=args.batch_size, max_len=args.max_len,
                  progress=not args.no_progress, specials=specials), what


def main(argv: Sequence[str] | None = None) -> int:
  from train.__main__ import _default_platform  # pylint: disable=g-import-not-at-top
  _default_platform()
  args = build_parser().parse_args(argv)
  from evals import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
  from evals import harness as evaluate_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  for flag in ("num_fewshot", "batch_size", "toxicity_samples", "max_len"):
    if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "num_fewshot" else 1):
      print(f"error: --{flag}={getattr(args, flag)} is out of range", file=sys.stderr)
      return 2
  if args.log_samples and not args.output:
    print("error: --log_samples adds each document's samples to the results JSON, which only --output writes; "
          "give --output FILE (or drop --log_samples)", file=sys.stderr)
    return 2
  try:
    specs = tasks_lib.parse_specs(args.tasks)
    for name, path in specs:  # every task file is read (and checked) before the model is loaded
      tasks_lib.load_task(name, path)
    t0 = time.perf_counter()
    lm, what = open_lm(args)
    scorer = None
    if any(name == "toxicity" for name, _ in specs):
      from evals import toxicity  # pylint: disable=g-import-not-at-top
      scorer = toxicity.make_scorer(args.toxicity_scorer)
    out = evaluate_lib.evaluate(lm, specs, num_fewshot=args.num_fewshot, limit=args.limit, seed=args.seed,
                                log_samples=args.log_samples, toxicity_scorer=scorer,
                                toxicity={"samples": args.toxicity_samples})
  except (tasks_lib.TaskError, restore.RunError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out["config"].update(model=what, wall_seconds=time.perf_counter() - t0)
  print(format_table(out["results"]))
  if "toxicity_note" in out["config"]:
    print(f"note: {out['config']['toxicity_note']}")
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
      json.dump(out, f, indent=2)
    print(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
