"""train.logger (metrics.jsonl, TensorBoard events read back by TensorBoard itself) and train.plot."""
import json
import math
import os

import ml_collections
import numpy as np

from train.core import logger as logger_lib
from train import plot as plot_lib


def _log_cfg(tensorboard=True):
  return ml_collections.ConfigDict(dict(tensorboard=tensorboard, wandb=False, wandb_project="x", progress=True))


def _write_run(workdir, steps, start=0):
  log = logger_lib.MetricLogger(str(workdir), _log_cfg(), total_steps=max(steps), start_step=start)
  for s in steps:
    log.log(s, {"loss": 10.0 / s, "lr": 1e-3 * s, "tokens_per_sec": 100.0 + s, "grad_norm": float("nan")})
    log.advance(s)
    if s % 2 == 0:
      log.log(s, {"eval_loss": 9.0 / s, "eval_perplexity": math.exp(9.0 / s)})
  log.close()


def test_jsonl_tensorboard_and_resume_truncation(tmp_path):
  _write_run(tmp_path, range(1, 7))
  # A resumed run from step 4 drops what the interrupted run logged after its checkpoint, then appends.
  _write_run(tmp_path, range(5, 9), start=4)
  records = logger_lib.read_metrics(str(tmp_path))
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in train] == list(range(1, 9))
  assert all(r["grad_norm"] is None for r in train)  # non-finite -> null, never invalid JSON
  assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 6, 8]
  for line in open(os.path.join(tmp_path, logger_lib.METRICS_FILE)):
    json.loads(line)

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  tb_dir = os.path.join(tmp_path, logger_lib.TENSORBOARD_DIR)
  assert len(os.listdir(tb_dir)) == 2  # one event file per run
  steps_seen = {}
  for name in os.listdir(tb_dir):
    acc = EventAccumulator(os.path.join(tb_dir, name))
    acc.Reload()
    assert "grad_norm" not in acc.Tags()["scalars"]
    for e in acc.Scalars("loss"):
      steps_seen[e.step] = e.value
  assert set(steps_seen) == set(range(1, 9))
  for s, v in steps_seen.items():
    np.testing.assert_allclose(v, 10.0 / s, rtol=1e-6)


def test_plot_writes_png(tmp_path):
  _write_run(tmp_path, range(1, 11))
  assert plot_lib.main([str(tmp_path)]) == 0
  import matplotlib.image
  img = matplotlib.image.imread(os.path.join(tmp_path, "metrics.png"))
  assert img.shape[0] > 100 and img.shape[1] > 300
  assert img[..., :3].std() > 0.05  # something was drawn
  assert plot_lib.main([str(tmp_path / "missing")]) == 2


def test_plot_draws_the_post_training_metrics_a_run_logged():
  """A DPO run's reward accuracy and KL, an SFT run's held-out exact match: each gets its panel, and a pretraining
  run's metrics none of them."""
  dpo = [{"step": 1, "loss": 0.69, "reward_accuracy": 0.5, "kl": 0.0},
         {"step": 2, "eval_loss": 0.6, "eval_reward_accuracy": 0.7, "eval_kl": 0.1, "eval_exact_match": 0.4}]
  titles = [title for title, _, _ in plot_lib.panels(dpo)]
  assert titles == ["loss", "held-out exact match", "reward accuracy", "KL to reference"]
  grpo = [{"step": 1, "loss": 0.1, "reward_mean": 0.3, "kl_k3": 0.01}]
  assert [t for t, _, _ in plot_lib.panels(grpo)] == ["loss", "reward", "KL to reference"]
  assert [t for t, _, _ in plot_lib.panels([{"step": 1, "loss": 3.0, "lr": 1e-3}])] == ["loss", "learning rate"]
