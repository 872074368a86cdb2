"""python -m train.serve (train/serve/main.py)."""
import sys

from train.serve.main import main

if __name__ == "__main__":
  sys.exit(main())
