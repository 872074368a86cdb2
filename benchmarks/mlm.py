"""The tiny masked-LM encoder learns: `python benchmarks/mlm.py [--steps 300] [--config.KEY=VALUE ...]`.

Trains `python -m train --config=tiny --config.model.causal=false --config.train.objective=mlm` on the built-in
corpus and prints one JSON object: the held-out masked-token accuracy and loss at step 0 and at the end, the
training masked accuracy of the first and last logged steps, and wall seconds. A model that only learned unigram
frequencies would stay near the accuracy of always predicting the most frequent token.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=300)
  args, extra = p.parse_known_args(argv)
  load = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as tmp:
    workdir = os.path.join(tmp, "mlm")
    cmd = [sys.executable, "-m", "train", "--config=tiny", f"--workdir={workdir}", "--config.model.causal=false",
           "--config.train.objective=mlm", f"--config.train.steps={args.steps}",
           f"--config.train.eval_every={max(args.steps // 3, 1)}", "--config.checkpoint.every=0",
           "--config.log.progress=false", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
      raise SystemExit(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
  train = [r for r in records if r.get("masked_accuracy") is not None]
  evals = [r for r in records if "eval_masked_accuracy" in r]
  print(json.dumps({
      "command": "python benchmarks/mlm.py " + " ".join(argv or sys.argv[1:]), "load_average_at_start": load,
      "wall_s": round(time.perf_counter() - start, 1),
      "eval": [{"step": r["step"], "eval_loss": r["eval_loss"], "eval_masked_accuracy": r["eval_masked_accuracy"]}
               for r in evals],
      "train_first": {k: train[0][k] for k in ("step", "loss", "masked_accuracy")},
      "train_last": {k: train[-1][k] for k in ("step", "loss", "masked_accuracy")}}, indent=1))


if __name__ == "__main__":
  main()
