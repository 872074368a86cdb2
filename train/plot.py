"""`python -m train.plot WORKDIR [--out FILE]`: a PNG of training and eval loss, learning rate and tokens/s, and for
post-training runs held-out exact match, reward accuracy, reward and KL to the reference.

Reads WORKDIR/metrics.jsonl (written by `python -m train` or `python -m train.rl`) and writes WORKDIR/metrics.png
by default; panels without any data in the run are left out.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from train.core import logger

PANELS = (  # (title, [(metric key, legend label), ...], y scale)
    ("loss", [("loss", "train"), ("eval_loss", "eval")], "linear"),
    ("learning rate", [("lr", "lr")], "linear"),
    ("tokens / s", [("tokens_per_sec", "tokens/s")], "linear"),
    ("held-out exact match", [("eval_exact_match", "all families")], "linear"),
    ("reward accuracy", [("reward_accuracy", "train"), ("eval_reward_accuracy", "eval")], "linear"),
    ("reward", [("reward_mean", "train rollouts"), ("eval_reward_mean", "eval")], "linear"),
    ("KL to reference", [("kl", "kl"), ("kl_k3", "kl (k3, per token)"), ("eval_kl", "eval")], "linear"),
)


def panels(records: Sequence[dict]) -> list[tuple]:
  """The PANELS with data in these metrics records (the loss panel when none has)."""
  return [p for p in PANELS if any(series(records, key)[0] for key, _ in p[1])] or list(PANELS[:1])


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of one metric, skipping records without it or with a null (non-finite) value."""
  pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [s for s, _ in pairs], [v for _, v in pairs]


def plot(workdir: str, out: str | None = None) -> str:
  """Draws the run in `workdir` into a PNG; returns its path. Raises FileNotFoundError without metrics."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  records = logger.read_metrics(workdir)
  if not records:
    raise FileNotFoundError(f"no metrics in {os.path.join(workdir, logger.METRICS_FILE)}: run "
                            f"`python -m train --workdir={workdir}` first")
  out = out or os.path.join(workdir, "metrics.png")
  shown = panels(records)
  fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.6), squeeze=False)
  for ax, (title, keys, scale) in zip(axes[0], shown):
    for key, label in keys:
      steps, values = series(records, key)
      if steps:
        ax.plot(steps, values, marker="o" if key.startswith("eval") else None, markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_yscale(scale)
    ax.grid(alpha=0.3)
    if len(keys) > 1:
      ax.legend()
  fig.suptitle(os.path.basename(os.path.abspath(workdir)))
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.splitlines()[0])
  parser.add_argument("workdir", help="run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None, help="PNG path (default: WORKDIR/metrics.png)")
  args = parser.parse_args(argv)
  try:
    path = plot(args.workdir, args.out)
  except (FileNotFoundError, ValueError) as e:  # no metrics, or a damaged line (named in the message)
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
