"""python -m train.generate: text from a run directory or a Hugging Face directory.

The program lives in `train/rundir/generate.py`; this module is the command's name."""
import sys

from train.rundir.generate import main

if __name__ == "__main__":
  sys.exit(main())
