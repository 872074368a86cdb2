"""muP coordinate check (Tensor Programs V, sec. 5 / fig. 5): `python benchmarks/mup_coord_check.py [--out FILE]`.

For widths 64 .. 1024 (base width 64, head_dim 16, mlp 2 x width, 2 layers, unrolled) and each parametrization
(sp, mup) it trains `--steps` Adam steps (the one Trainer, lr --lr, no warmup) on the same batches of the
built-in corpus (the tiny config's tokenizer, 8 x 64 tokens), then measures the mean absolute coordinate of the
embedding output, every block's output and the logits on one held batch. Prints JSON: per parametrization and
layer the values per width and the ratio largest/smallest over widths (muP: flat, within 2x; SP: grows with
width); writes a PNG (one panel per parametrization) to --out.

`--data synthetic` trains on uniformly random tokens instead (train.core.step.synthetic_batch). Their targets carry no
signal, so every gradient is noise and the check then measures the O(1/sqrt(width)) fluctuation of Adam's
sign-like updates, which muP lets vanish with width: the blocks' coordinates fall with width (block 1 by ~3x
from 64 to 1024) although the parametrization is unchanged. Tensor Programs V's coordinate checks train on text.
"""
import argparse
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import configs  # pylint: disable=g-import-not-at-top,wrong-import-position
from common.segments import positions_from_segments  # pylint: disable=wrong-import-position
from data import pipeline  # pylint: disable=wrong-import-position
from data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from model import config as config_lib  # pylint: disable=wrong-import-position
from model import rope  # pylint: disable=wrong-import-position
from parallel import mesh as mesh_lib  # pylint: disable=wrong-import-position
from train.core import step as step_lib  # pylint: disable=wrong-import-position


def _config(width, parametrization, lr, steps):
  c = configs.load("tiny")
  c.model.update(d_model=width, num_layers=2, num_heads=width // 16, num_kv_heads=width // 16,
                 head_dim=16, mlp_dim=2 * width, max_seq_len=64, parametrization=parametrization,
                 mup_base_width=64, scan_layers=False)
  c.train.update(batch_size=8, seq_len=64, lr=lr, warmup_steps=0, schedule="constant", steps=steps)
  c.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  return c


def batches(data: str, steps: int) -> list[dict]:
  """`steps` training batches and one held batch: the built-in corpus or random tokens."""
  c = _config(64, "sp", 1e-3, steps)
  if data == "synthetic":
    return [step_lib.synthetic_batch(c, i) for i in range(steps)] + [step_lib.synthetic_batch(c, 10_000)]
  with tempfile.TemporaryDirectory() as tmp:
    tok = tokenizer_lib.load(tokenizer_lib.prepare(c, tmp))
    it = pipeline.make_iterator(c, tok, process_index=0, process_count=1)
    out = [next(it) for _ in range(steps + 1)]
    it.close()
  return out


def coordinates(model, batch) -> dict[str, float]:
  """Mean |x| of the embedding output, each block's output and the logits (the blocks applied one by one)."""
  tokens, seg = jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_ids"])
  cos, sin = rope.cos_sin(jnp.asarray(positions_from_segments(batch["segment_ids"])),
                          rope.inv_frequencies(model.cfg))
  x = model.embed(tokens)
  out = {"embed": float(jnp.mean(jnp.abs(x)))}
  for i, (block, window) in enumerate(zip(model.layers, config_lib.layer_windows(model.cfg))):
    x, _ = block(x, seg, cos, sin, window)
    out[f"block{i}"] = float(jnp.mean(jnp.abs(x)))
  out["logits"] = float(jnp.mean(jnp.abs(model.logits(model.final_norm(x)))))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--lr", type=float, default=1e-2)
  p.add_argument("--out", default="mup_coord_check.png")
  p.add_argument("--data", choices=("corpus", "synthetic"), default="corpus")
  args = p.parse_args(argv)
  data = batches(args.data, args.steps)
  results = {}
  for parametrization in ("sp", "mup"):
    per_width = {}
    for width in args.widths:
      c = _config(width, parametrization, args.lr, args.steps)
      trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]))
      state = trainer.init()
      for i in range(args.steps):
        state, _ = trainer.step_fn(state, trainer.batch_to_device(data[i]))
      per_width[width] = coordinates(trainer.model(state), data[-1])
      print(json.dumps({parametrization: {width: per_width[width]}}), file=sys.stderr, flush=True)
    layers = list(per_width[args.widths[0]])
    results[parametrization] = {
        layer: {"by_width": {w: per_width[w][layer] for w in args.widths},
                "max_over_min": max(per_width[w][layer] for w in args.widths) /
                                min(per_width[w][layer] for w in args.widths)} for layer in layers}
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, (parametrization, layers) in zip(axes, results.items()):
    for layer, r in layers.items():
      ax.plot(args.widths, [r["by_width"][w] for w in args.widths], marker="o", label=layer)
    ax.set(xscale="log", yscale="log", xlabel="width (d_model)",
           title=f"{parametrization}, {args.steps} Adam steps, {args.data} data")
  axes[0].set_ylabel("mean |coordinate|")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(json.dumps({"command": "python benchmarks/mup_coord_check.py " + " ".join(argv or sys.argv[1:]),
                    "load_average_at_start": os.getloadavg()[0], "data": args.data, "plot": args.out, "results": results}, indent=1))


if __name__ == "__main__":
  main()
