"""Reward-model recipe (`python -m train --config=reward_tiny`): the tiny SFT model with a scalar head, trained
with the Bradley-Terry loss on the built-in preference task (data/preference.py: the instruct prompts with the
correct answer chosen and a programmatically wrong one rejected).

With no train.init_from it starts from the `sft_tiny` recipe's run in WORKDIR/../sft_tiny (runs/sft_tiny by
default), made first when missing (and that one from runs/tiny). Every evaluation logs the held-out pairwise
accuracy `eval_reward_accuracy` and margin; `python -m train.reward --workdir runs/reward_tiny --input FILE`
scores texts with the result. 600 steps: held-out accuracy 0.940 at 300, 0.975 at 600 on 400 pairs
(benchmarks/preference_eval.py: 0.9625, the letter-reversal pairs 0.86; docs/post-training.md).
"""
from configs import sft_tiny


def get_config():
  c = sft_tiny.get_config()
  c.train.update(objective="reward", base_recipe="sft_tiny", steps=600, batch_size=16, seq_len=48, lr=1e-3,
                 warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0, z_loss=0.0, eval_every=100, eval_steps=25,
                 eval_generations=0)
  c.data.update(sources="pairs=builtin:preference", chat_template="meshlm")
  c.checkpoint.every = 100
  return c
