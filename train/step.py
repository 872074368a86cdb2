"""python -m train.step: the training step on synthetic packed data, one JSON line of metrics per step.

The program lives in `train/core/step.py`; this module is the command's name."""
import sys

from train.core.step import main

if __name__ == "__main__":
  sys.exit(main())
