"""python -m train.compile: ahead-of-time compilation of the train step for a TPU topology.

The program lives in `train/planning/compile.py`; this module is the command's name."""
import sys

from train.planning.compile import main

if __name__ == "__main__":
  sys.exit(main())
