"""On-policy distillation recipe (`python -m train.rl --config=gkd_tiny`): the 2-layer student of
configs/distill_tiny.py (made first in WORKDIR/../distill_tiny when missing) samples answers to the built-in
arithmetic prompts (builtin:arithmetic, "Compute 47 + 85.", data/tasks.py), and learns the frozen SFT model's
(configs/sft_tiny.py, WORKDIR/../sft_tiny) next-token distributions on its own completion tokens: GKD with
lambda = 1 (Agarwal et al. 2024), forward KL at temperature 1 (train/objectives/distill.py). 8 prompts x 4 samples
per iteration; the task's reward is reported (reward_mean, eval_reward_mean), not trained on.
"""
from configs import distill_tiny
from configs import sft_tiny


def get_config():
  c = distill_tiny.get_config()
  c.data.update(sources=sft_tiny.get_config().data.sources, chat_template="meshlm")
  c.train.update(objective="distill", base_recipe="distill_tiny", distill_teacher_recipe="sft_tiny", batch_size=16,
                 seq_len=64, lr=1e-3, schedule="constant", warmup_steps=0, weight_decay=0.0, z_loss=0.0,
                 eval_every=0)
  c.rl.update(algorithm="gkd", iterations=40, prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=24,
              epochs=1, eval_every=10, eval_prompts=64)
  c.checkpoint.update(every=10, async_save=False)
  return c
