"""python -m train.step: the training step on synthetic packed data, one JSON line of metrics per step.

The program lives in `train/core/step.py`; this module is the command's name."""
import sys

from train.__main__ import _default_platform

if __name__ == "__main__":
  _default_platform()  # before the first JAX import: no TPU probe (and its warnings) on a CPU-only host
  from train.core.step import main  # pylint: disable=g-import-not-at-top
  sys.exit(main())
