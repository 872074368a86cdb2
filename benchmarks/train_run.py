"""The default training run, timed end to end: `python benchmarks/train_run.py [--config.KEY=VALUE ...]`.

Runs `python -m train` (the tiny CPU default unless overridden) in a fresh temporary workdir and prints one JSON
object: wall seconds, steps, the first and last eval loss, median tokens/s and data-wait fraction over the logged
steps, the checkpoint sizes, and the machine's CPU count and load average at the start.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
  if {"-h", "--help"} & set(argv):  # the rest of argv goes to python -m train, whose help is not this script's
    print(__doc__)
    return 0
  with tempfile.TemporaryDirectory() as tmp:
    workdir = os.path.join(tmp, "run")
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "train", f"--workdir={workdir}", *argv], cwd=REPO,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
      print(proc.stderr[-3000:], file=sys.stderr)
      return proc.returncode
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    ckpt_dir = os.path.join(workdir, "checkpoints")
    sizes = {}
    for step in os.listdir(ckpt_dir):
      sizes[step] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ckpt_dir, step))
                        for f in fs)
    print(json.dumps({
        "command": "python -m train " + " ".join(argv),
        "wall_s": round(wall, 1),
        "steps": train[-1]["step"],
        "eval_loss_first": round(evals[0]["eval_loss"], 4),
        "eval_loss_last": round(evals[-1]["eval_loss"], 4),
        "train_loss_last": round(train[-1]["loss"], 4),
        "tokens_per_sec_median": round(statistics.median(r["tokens_per_sec"] for r in train[1:] or train)),
        "data_wait_frac_median": round(statistics.median(r["data_wait_frac"] for r in train), 4),
        "checkpoint_mb": round(max(sizes.values()) / 2**20, 2),
        "cpus": os.cpu_count(),
        "load_avg_at_start": round(load, 2),
    }))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
