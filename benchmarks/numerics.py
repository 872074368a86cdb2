"""Numerics on the built-in corpus: `python benchmarks/numerics.py [--steps 200] [--variants ...]`.

Trains the tiny CPU config (`python -m train --config=tiny`) for `--steps` steps once per variant — a
computation dtype (float32, bfloat16, float16 with dynamic loss scaling), int8 or fp8 (float32 with
model.quant=int8 / fp8 on the attention and MLP projections) — same seed and data, and prints one JSON object: per
variant the training loss at the last step, its mean over the last 5 logged steps, the held-out loss at
the end, the last logged loss scale, wall seconds; and each dtype's relative difference to bfloat16 and float32.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


VARIANTS = {"float32": ["--config.model.dtype=float32"], "bfloat16": ["--config.model.dtype=bfloat16"],
            "float16": ["--config.model.dtype=float16"],
            "int8": ["--config.model.dtype=float32", "--config.model.quant=int8"],
            "fp8": ["--config.model.dtype=float32", "--config.model.quant=fp8"]}


def run(dtype: str, steps: int, tmp: str, extra) -> dict:
  workdir = os.path.join(tmp, dtype)
  args = [sys.executable, "-m", "train", "--config=tiny", f"--workdir={workdir}", *VARIANTS[dtype],
          f"--config.train.steps={steps}", f"--config.train.eval_every={steps}", "--config.train.log_every=10",
          "--config.checkpoint.every=0", "--config.log.progress=false", *extra]
  start = time.perf_counter()
  proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f"{dtype}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if r.get("loss") is not None]
  evals = [r for r in records if "eval_loss" in r]
  out = {"final_loss": train[-1]["loss"], "mean_loss_last5": sum(r["loss"] for r in train[-5:]) / 5,
         "eval_loss": evals[-1]["eval_loss"], "wall_s": round(time.perf_counter() - start, 1),
         "nonfinite_logged": sum(r.get("nonfinite", 0) for r in train)}
  if "loss_scale" in train[-1]:
    out["loss_scale_last"] = train[-1]["loss_scale"]
    out["overflow_logged"] = sum(r.get("overflow", 0) for r in train)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--variants", dest="dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                 choices=sorted(VARIANTS))
  args, extra = p.parse_known_args(argv)
  load = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as tmp:
    # The first run trains the tokenizer; the others reuse it, so every dtype sees the same token ids.
    results = {}
    for dtype in args.dtypes:
      tok = os.path.join(tmp, args.dtypes[0], "tokenizer.model")
      results[dtype] = run(dtype, args.steps, tmp, extra + ([f"--config.data.tokenizer={tok}"]
                                                            if dtype != args.dtypes[0] else []))
  for ref in ("bfloat16", "float32"):
    if ref in results:
      for dtype, r in results.items():
        r[f"rel_diff_vs_{ref}"] = abs(r["mean_loss_last5"] - results[ref]["mean_loss_last5"]) / results[ref][
            "mean_loss_last5"]
  print(json.dumps({"command": "python benchmarks/numerics.py " + " ".join(argv or sys.argv[1:]),
                    "steps": args.steps, "load_average_at_start": load, "cpus": os.cpu_count(),
                    "results": results}, indent=1))


if __name__ == "__main__":
  main()
