"""python -m train.plan: compute-optimal sizes, FLOPs and per-device memory before launching.

The program lives in `train/planning/plan.py`; this module is the command's name."""
import sys

from train.planning.plan import main

if __name__ == "__main__":
  sys.exit(main())
