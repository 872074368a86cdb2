"""PPO recipe (`python -m train.rl --config=ppo_tiny`): the tiny SFT model (configs/sft_tiny.py, made first in
WORKDIR/../sft_tiny when missing) trained with PPO in the calculator tool environment (train/rl/env.py, as
grpo_tiny): 32 episodes per iteration, value head on the policy trunk (GAE over the policy's tokens only),
per-token KL penalty beta = 0.05 to the frozen reference, GAE (gamma 1, lambda 0.95), 2 epochs of 2 minibatches,
and PPO-ptx (held-in SFT conversations in every update, rl.ptx_coef = 2, lr 1e-4) to keep the other skills.
"""
from configs import sft_tiny


def get_config():
  c = sft_tiny.get_config()
  c.train.update(objective="ppo", base_recipe="sft_tiny", batch_size=16, seq_len=96, lr=1e-4, schedule="constant",
                 warmup_steps=0, weight_decay=0.0, z_loss=0.0, eval_every=0, eval_generations=64)
  c.rl.update(algorithm="ppo", env="builtin:calculator", prompts="builtin:calculator", max_turns=2,
              iterations=20, prompts_per_iteration=32, samples_per_prompt=1, max_new_tokens=24,
              kl_coef=0.05, epochs=2, vf_coef=0.1, eval_every=5, eval_prompts=64, ptx_coef=2.0)
  c.checkpoint.update(every=10, async_save=False)
  return c
