"""A short arithmetic SFT stage (`python -m train --config=sft_arithmetic_tiny`): the tiny SFT model
(configs/sft_tiny.py, made first in WORKDIR/../sft_tiny when missing) fine-tuned for 500 more steps on the
arithmetic family's conversations alone (the chat source builtin:arithmetic, data/tasks.py: "Compute 47 + 85." ->
"<answer>132</answer>", training split only), the starting point of grpo_arithmetic_tiny.

sft_tiny answers 5% of the held-out arithmetic prompts (greedy exact match on 256 of them), too few for GRPO's
groups to carry a signal; this stage takes it to 38%, and is kept short so that RL starts from a policy that
answers some but not most of them (the same SFT continued longer reaches 93%: docs/post-training.md).
"""
from configs import sft_tiny


def get_config():
  c = sft_tiny.get_config()
  c.train.update(base_recipe="sft_tiny", steps=500, lr=2e-3, warmup_steps=20, eval_every=100,
                 eval_generations=256)
  c.data.sources = "arithmetic=builtin:arithmetic"
  return c
