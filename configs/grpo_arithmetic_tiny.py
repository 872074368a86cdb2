"""GRPO on tool-free arithmetic (`python -m train.rl --config=grpo_arithmetic_tiny`): the arithmetic SFT stage
(configs/sft_arithmetic_tiny.py, made first in WORKDIR/../sft_arithmetic_tiny when missing) trained with GRPO
(rl.loss=grpo, DeepSeekMath's per-sequence mean) on the training split of "Compute 47 + 85." (data/tasks.py,
rl.prompts=builtin:arithmetic), answered at once in <answer>...</answer>: reward 1 for the right number, the
format penalty for anything but one tagged answer. 64 prompts x 8 samples per iteration and one optimizer step
over all 512 (train.batch_size = the rollout batch): with minibatches of 16 rows (2 prompts per step) held-out
greedy exact match fell from 0.379 to 0.305 in 60 iterations at lr 1e-4, and with one step over 16 prompts at lr
2e-4 to 0.254; steps that follow a few prompts' groups fit those prompts. Group-normalised advantages, k3 KL to the
SFT model with beta = 0.04, lr 1e-4, and no PPO-ptx (the update is RL alone, so the held-out gain is RL's). Every
evaluation scores 256 held-out prompts twice: one sample each at temperature 1 (eval_reward_correct_mean) and
greedy (eval_exact_match/arithmetic).
"""
from configs import grpo_tiny


def get_config():
  c = grpo_tiny.get_config()
  c.train.update(base_recipe="sft_arithmetic_tiny", batch_size=512, seq_len=64, lr=1e-4, eval_generations=256)
  c.data.sources = "arithmetic=builtin:arithmetic"
  c.rl.update(env="", prompts="builtin:arithmetic", iterations=100, prompts_per_iteration=64, samples_per_prompt=8,
              max_new_tokens=20, eval_every=20, eval_prompts=256, ptx_coef=0.0)
  return c
