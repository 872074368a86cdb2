"""python -m train.reward: score texts with a reward-model run.

The program lives in `train/rundir/reward.py`; this module is the command's name."""
import sys

from train.rundir.reward import load_scorer, main, score  # noqa: F401  (train.reward.score is the API)

if __name__ == "__main__":
  sys.exit(main())
