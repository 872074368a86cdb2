"""Rejection-sampling fine-tuning recipe (`python -m train.rl --config=best_of_n_tiny`): the tiny SFT model
(configs/sft_tiny.py, made first in WORKDIR/../sft_tiny when missing) in the calculator tool environment
(train/rl/env.py, as grpo_tiny): each round runs K = 8 episodes for 16 prompts, keeps the best by reward and
fine-tunes on it with the SFT objective (the policy's turns only; 2 epochs) beside as many held-in SFT
conversations weighted rl.ptx_coef = 2, at lr 5e-5 for 16 rounds; eval_best_of_n_reward_mean reports best-of-8 on
held-out prompts at every evaluation.
"""
from configs import sft_tiny


def get_config():
  c = sft_tiny.get_config()
  c.train.update(objective="sft", base_recipe="sft_tiny", batch_size=16, seq_len=96, lr=5e-5, schedule="constant",
                 warmup_steps=0, weight_decay=0.0, eval_every=0, eval_generations=64)
  c.rl.update(algorithm="best_of_n", env="builtin:calculator", prompts="builtin:calculator", max_turns=2,
              iterations=16, prompts_per_iteration=16, samples_per_prompt=8,
              max_new_tokens=24, epochs=2, eval_every=2, eval_prompts=64, eval_best_of=8, ptx_coef=2.0)
  c.checkpoint.update(every=5, async_save=False)
  return c
