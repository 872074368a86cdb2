"""muP learning-rate transfer: `python benchmarks/mup_lr_sweep.py [--parametrizations mup sp] [--steps 60]`.

For 3 widths (64, 128, 256; base width 64, head_dim 16, mlp 2 x width, 2 layers) and a x2 grid of learning
rates, trains `--steps` Adam steps (the one Trainer, constant lr after 5 warmup steps) on the same batches of the
built-in corpus (tokenizer of the tiny config, 16 x 64 tokens), 3 seeds each, and records the mean training loss
of the last 10 steps. Prints JSON: per parametrization and width the loss per lr (mean over seeds) and the best
lr per seed, and whether the best lrs of all widths lie within one grid point (x2) of each other.
"""
import argparse
import json
import os
import sys
import tempfile

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import configs  # pylint: disable=wrong-import-position
from data import pipeline  # pylint: disable=wrong-import-position
from data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from parallel import mesh as mesh_lib  # pylint: disable=wrong-import-position
from train.core import step as step_lib  # pylint: disable=wrong-import-position


def _config(width, parametrization, lr, seed):
  c = configs.load("tiny")
  c.model.update(num_layers=2, d_model=width, num_heads=width // 16, num_kv_heads=width // 16, head_dim=16,
                 mlp_dim=2 * width, max_seq_len=64, parametrization=parametrization, mup_base_width=64)
  c.train.update(batch_size=16, seq_len=64, lr=lr, warmup_steps=5, schedule="constant", seed=seed)
  c.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  return c


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--parametrizations", nargs="+", default=["mup", "sp"])
  p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--lrs", type=float, nargs="+", default=[2.0 ** -k for k in range(3, 11)])
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--steps", type=int, default=60)
  args = p.parse_args(argv)
  load = os.getloadavg()[0]
  with tempfile.TemporaryDirectory() as tmp:
    c = _config(64, "sp", 1e-3, 0)
    tok = tokenizer_lib.load(tokenizer_lib.prepare(c, tmp))
    it = pipeline.make_iterator(c, tok, process_index=0, process_count=1)
    batches = [next(it) for _ in range(args.steps)]
    it.close()
  results = {}
  for parametrization in args.parametrizations:
    results[parametrization] = {}
    for width in args.widths:
      losses = np.zeros((args.seeds, len(args.lrs)))
      for j, lr in enumerate(args.lrs):
        trainer = None
        for s in range(args.seeds):
          c = _config(width, parametrization, lr, s)
          trainer = trainer or step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]))
          state, tail = trainer.init(seed=s), []
          for i, batch in enumerate(batches):
            state, metrics = trainer.step_fn(state, trainer.batch_to_device(batch))
            if i >= args.steps - 10:
              tail.append(float(metrics["loss"]))
          losses[s, j] = np.mean(tail) if np.all(np.isfinite(tail)) else np.inf
      best = [args.lrs[int(np.argmin(losses[s]))] for s in range(args.seeds)]
      results[parametrization][width] = {"loss_by_lr": dict(zip(map(str, args.lrs), losses.mean(0).tolist())),
                                         "best_lr_per_seed": best}
      print(json.dumps({parametrization: {width: results[parametrization][width]}}), file=sys.stderr, flush=True)
    bests = [b for r in results[parametrization].values() for b in r["best_lr_per_seed"]]
    results[parametrization]["best_lrs_within_x2"] = max(bests) / min(bests) <= 2.0
  print(json.dumps({"command": "python benchmarks/mup_lr_sweep.py " + " ".join(argv or sys.argv[1:]),
                    "load_average_at_start": load, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
  main()
