"""GRPO recipe (`python -m train.rl --config=grpo_tiny`): the tiny SFT model (configs/sft_tiny.py, made first in
WORKDIR/../sft_tiny when missing) trained with GRPO on the built-in verifiable task builtin:greater ("Write a
number greater than N.", reward 1 for a whole number > N; data/rl_prompts.py): 8 prompts x 4 samples per
iteration, group-normalised advantages, k3 KL to the reference with beta = 0.04 (DeepSeekMath's value), and
PPO-ptx: 16 held-in SFT conversations ride along in every update with weight rl.ptx_coef = 1 at lr 1e-4, so the run
keeps the SFT model's held-out exact match (eval_exact_match; at lr 3e-4 without them it fell from 0.605 to 0.156).
"""
from configs import sft_tiny


def get_config():
  c = sft_tiny.get_config()
  c.train.update(objective="grpo", base_recipe="sft_tiny", batch_size=16, seq_len=32, lr=1e-4, schedule="constant",
                 warmup_steps=0, weight_decay=0.0, z_loss=0.0, eval_every=0, eval_generations=64)
  c.rl.update(algorithm="grpo", iterations=40, prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=8,
              kl_coef=0.04, epochs=1, eval_every=5, eval_prompts=64, ptx_coef=1.0)
  c.checkpoint.update(every=10, async_save=False)
  return c
