"""Distillation recipe (`python -m train --config=distill_tiny`): a 2-layer, d_model 64 student (0.36M parameters)
trained from scratch for 300 steps to match the frozen 4-layer `tiny` model's next-token distributions (forward
KL(p_T || p_S) per token, temperature 1; train/objectives/distill.py) on the same built-in corpus.

With no train.distill_teacher the teacher is the `tiny` recipe's run in WORKDIR/../tiny (runs/tiny by default),
made first when missing and reused when its config matches; the student takes its tokenizer (and so its
vocabulary). metrics.jsonl carries `loss` (= distill_divergence, nats per token), `lm_loss` and `teacher_lm_loss`
(the two models' cross-entropy on the data); evaluations the same with an `eval_` prefix. Measured on 2 CPU cores
(about 70 s, plus about 75 s for the teacher's run when missing): eval_distill_divergence 2.55 at step 0, 0.057 at
step 300; the student's eval cross-entropy 7.63 -> 5.02 against the teacher's 4.95.
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.update(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=192)
  c.train.update(objective="distill", distill_teacher_recipe="tiny", distill_loss="forward_kl", steps=300, lr=3e-3,
                 warmup_steps=30, eval_every=100, eval_steps=4)
  c.checkpoint.every = 100
  return c
