"""python -m train.rl: PPO, GRPO and rejection-sampling fine-tuning (the loop is `train/rl/loop.py`)."""
import sys

from train.rl.loop import main

if __name__ == "__main__":
  sys.exit(main())
