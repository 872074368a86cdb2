"""python -m train.evaluate: benchmarks, perplexity, bias and toxicity on a run or an HF directory.

The program lives in `train/rundir/evaluate.py`; this module is the command's name."""
import sys

from train.rundir.evaluate import main

if __name__ == "__main__":
  sys.exit(main())
