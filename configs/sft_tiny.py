"""Supervised fine-tuning recipe (`python -m train --config=sft_tiny`): the tiny model fine-tuned on the built-in
instruction task (data/instruct.py: addition, letter reversal, digit sorting, unit conversion) and, for half of
the conversations, the RL tasks with tagged answers (data/tasks.py: arithmetic, number sorting, countdown, the
calculator tool's episodes): the cold start that teaches `<answer>...</answer>` and `<tool>...</tool>` before
train.rl rewards them.

With no train.init_from it starts from the `tiny` recipe's run in WORKDIR/../tiny (runs/tiny by default), made
first when missing and reused when its config matches. Loss on assistant tokens only; every evaluation logs the
held-out eval_loss and the exact match of greedy answers to 64 held-out prompts per family
(eval_exact_match, eval_exact_match/<family>).
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.train.update(objective="sft", base_recipe="tiny", steps=1200, lr=2e-3, warmup_steps=20, min_lr_ratio=0.1,
                 weight_decay=0.0, eval_every=200, eval_steps=2, eval_generations=64, eval_max_new_tokens=24)
  c.data.update(sources="instruct=builtin:instruct@0.5,tasks=builtin:tasks@0.5", chat_template="meshlm")
  c.checkpoint.every = 100
  return c
