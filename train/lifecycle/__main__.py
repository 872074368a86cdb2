"""`python -m train.lifecycle`: train/lifecycle/runner.py."""
import sys

from train.lifecycle import runner

if __name__ == "__main__":
  sys.exit(runner.main())
