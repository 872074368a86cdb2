"""DAPO recipe (`python -m train.rl --config=dapo_tiny`): grpo_tiny's run (the tiny SFT model in the calculator
tool environment) with DAPO's pieces (Yu et al. 2025): the token-level loss (rl.loss=dapo), clip-higher
(eps_low 0.2, eps_high 0.28), dynamic sampling (groups whose rewards are all equal are dropped and more prompts
sampled, up to 4 rounds), the soft overlong punishment over the last 4 of 24 tokens per turn, and no KL term
(beta = 0: no reference model), at lr 1e-4.
"""
from configs import grpo_tiny


def get_config():
  c = grpo_tiny.get_config()
  c.train.lr = 1e-4
  c.rl.update(loss="dapo", clip_high=0.28, dynamic_sampling=True, dynamic_sampling_rounds=4, overlong_buffer=4,
              kl_coef=0.0)
  return c
