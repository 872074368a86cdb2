"""python -m train.adapters: a LoRA run's adapters as PEFT files, with the base and merged models.

The program lives in `train/rundir/adapters.py`; this module is the command's name."""
import sys

from train.rundir.adapters import main

if __name__ == "__main__":
  sys.exit(main())
