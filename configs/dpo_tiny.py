"""DPO recipe (`python -m train --config=dpo_tiny`): the tiny SFT model trained with direct preference
optimisation (the standard sigmoid loss, beta = train.dpo_beta = 0.1) against a frozen copy of itself, on the
built-in preference task (data/preference.py: correct answer chosen, a programmatically wrong one rejected).

The chosen answers' NLL is added with weight train.dpo_rpo_alpha = 2 (RPO): without it the run widened the margins
(held-out implicit-reward accuracy 0.97) while greedy exact match on the held-out prompts fell from the SFT
model's 0.605 to 0.188 (answers with stray byte pieces; an earlier revision's SFT model); with it exact match rises
(0.637 -> 0.664 on today's, implicit-reward accuracy 0.993 on 400 held-out pairs; docs/post-training.md).

With no train.init_from it starts from the `sft_tiny` recipe's run in WORKDIR/../sft_tiny (runs/sft_tiny by
default), made first when missing. metrics.jsonl carries `loss` (the DPO loss, ln 2 at step 0), `reward_accuracy`,
the implicit rewards and margin, and `kl` to the reference; evaluations the same with an `eval_` prefix.
"""
from configs import sft_tiny


def get_config():
  c = sft_tiny.get_config()
  c.train.update(objective="dpo", base_recipe="sft_tiny", steps=300, batch_size=16, seq_len=48, lr=3e-4,
                 warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0, z_loss=0.0, eval_every=100, eval_steps=25,
                 eval_generations=64, dpo_beta=0.1, dpo_loss="sigmoid", dpo_rpo_alpha=2.0)
  c.data.update(sources="pairs=builtin:preference", chat_template="meshlm")
  c.checkpoint.every = 100
  return c
