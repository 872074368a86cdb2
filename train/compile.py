"""python -m train.compile: ahead-of-time compilation of the train step for a TPU topology.

The program lives in `train/planning/compile.py`; this module is the command's name."""
import sys

from train.__main__ import _default_platform

if __name__ == "__main__":
  _default_platform()  # before the first JAX import: no TPU probe (and its warnings) on a CPU-only host
  from train.planning.compile import main  # pylint: disable=g-import-not-at-top
  sys.exit(main())
