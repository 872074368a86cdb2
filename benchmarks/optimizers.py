"""Optimizers at a fixed token budget: `python benchmarks/optimizers.py [--model 50m|tiny] [--steps 200]
[--optimizers adamw muon ...] [--seeds 2]`.

For each train.optimizer, trains the model on the built-in corpus (the tiny config's tokenizer trained once at the
model's vocabulary, the same batches for every run) for `--steps` steps of batch x seq_len tokens (constant lr after
10% warmup, the same for every optimizer so that the only difference is the update rule), at 3 learning rates (the
optimizer's centre x 1/2, 1, 2; `--factors` or `--lrs` override) and `--seeds` seeds each; the tuned lr is the one with the lowest
mean final held-out loss. Prints one JSON object: per optimizer, the final eval loss per lr (mean and per seed),
the tuned lr and its eval loss, the training throughput in tokens/s (steps after the first, excluding compile) and
the optimizer state in bytes (the train state's own leaves), and each optimizer's eval-loss difference to AdamW's.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import configs  # pylint: disable=wrong-import-position
from data import pipeline  # pylint: disable=wrong-import-position
from data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from parallel import mesh as mesh_lib  # pylint: disable=wrong-import-position
from train.core import step as step_lib  # pylint: disable=wrong-import-position

MODELS = {
    # ~58M parameters (the serving benchmark's 50m model at its vocabulary).
    "50m": dict(vocab_size=32000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536,
                max_seq_len=256),
    "tiny": dict(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
                 max_seq_len=128),
}
BATCH = {"50m": (16, 256), "tiny": (16, 128)}
# Centres of the lr sweep: Muon with train.muon_rms=0.2 matches AdamW's update RMS (same centre); Lion's sign
# update has RMS 1 (its paper: 3-10x smaller lr than AdamW); Adafactor's clipped update is about as large as Adam's.
CENTRES = {"adamw": 1e-3, "muon": 1e-3, "adafactor": 1e-3, "lion": 1e-4, "schedule_free_adamw": 1e-3}


def _config(model, optimizer, lr, seed, steps):
  c = configs.load("tiny")
  c.model.update(**MODELS[model])
  batch, seq = BATCH[model]
  c.train.update(optimizer=optimizer, batch_size=batch, seq_len=seq, lr=lr, steps=steps, seed=seed,
                 warmup_steps=max(1, steps // 10), schedule="constant")
  if optimizer == "lion":
    c.train.b2 = 0.99  # the paper's
  c.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  return c


def _batches(model, steps, eval_batches):
  with tempfile.TemporaryDirectory() as tmp:
    c = _config(model, "adamw", 1e-3, 0, steps)
    c.data.tokenizer_vocab_size = MODELS[model]["vocab_size"]
    tok = tokenizer_lib.load(tokenizer_lib.prepare(c, tmp))
    it = pipeline.make_iterator(c, tok, process_index=0, process_count=1)
    train = [next(it) for _ in range(steps)]
    it.close()
    it = pipeline.make_iterator(c, tok, split="eval", process_index=0, process_count=1)
    held_out = [next(it) for _ in range(eval_batches)]
    it.close()
  return train, held_out


def _run(trainer, seed, train, held_out):
  state = trainer.init(seed=seed)
  times = []
  for batch in train:
    start = time.perf_counter()
    state, metrics = trainer.step_fn(state, trainer.batch_to_device(batch))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  sums = [jax.device_get(trainer.eval_fn(state, trainer.batch_to_device(b))) for b in held_out]
  loss = sum(float(s["loss_sum"]) for s in sums) / sum(float(s["tokens"]) for s in sums)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["opt_state"]))
  return (loss if np.isfinite(loss) else float("inf")), float(np.median(times[1:])), state_bytes


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", choices=sorted(MODELS), default="50m")
  p.add_argument("--optimizers", nargs="+", default=list(CENTRES))
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--seeds", type=int, default=2)
  p.add_argument("--eval_batches", type=int, default=8)
  p.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                 help="the lr grid: these multiples of each optimizer's centre (CENTRES)")
  p.add_argument("--lrs", type=float, nargs="+", default=None, help="one grid for every optimizer")
  args = p.parse_args(argv)
  load = os.getloadavg()[0]
  train, held_out = _batches(args.model, args.steps, args.eval_batches)
  batch, seq = BATCH[args.model]
  results = {}
  for optimizer in args.optimizers:
    lrs = args.lrs or [CENTRES[optimizer] * f for f in args.factors]
    by_lr, speed, state_bytes = {}, [], 0
    for lr in lrs:
      c = _config(args.model, optimizer, lr, 0, args.steps)
      trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]))
      runs = [_run(trainer, seed, train, held_out) for seed in range(args.seeds)]
      by_lr[lr] = [r[0] for r in runs]
      speed += [batch * seq / r[1] for r in runs]
      state_bytes = runs[0][2]
    tuned = min(by_lr, key=lambda lr: np.mean(by_lr[lr]))
    results[optimizer] = {"eval_loss_by_lr": {str(lr): {"mean": float(np.mean(v)), "seeds": v}
                                              for lr, v in by_lr.items()},
                          "tuned_lr": tuned, "eval_loss": float(np.mean(by_lr[tuned])),
                          "eval_loss_seeds": by_lr[tuned], "tokens_per_s": float(np.median(speed)),
                          "state_bytes": int(state_bytes)}
    print(json.dumps({optimizer: results[optimizer]}), file=sys.stderr, flush=True)
  if "adamw" in results:
    for r in results.values():
      r["eval_loss_minus_adamw"] = r["eval_loss"] - results["adamw"]["eval_loss"]
  print(json.dumps({"command": "python benchmarks/optimizers.py " + " ".join(argv or sys.argv[1:]),
                    "device": jax.devices()[0].device_kind, "load_average_at_start": load, "model": args.model,
                    "tokens": args.steps * batch * seq, "seeds": args.seeds, "results": results}, indent=1))


if __name__ == "__main__":
  main()
