"""python -m train.export: a run's checkpoint as a Hugging Face directory.

The program lives in `train/rundir/export.py`; this module is the command's name."""
import sys

from train.rundir.export import main

if __name__ == "__main__":
  sys.exit(main())
