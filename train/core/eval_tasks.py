"""Benchmark tasks during training (`train.eval_tasks`): run at every evaluation, logged next to eval_loss.

Metric names in metrics.jsonl and TensorBoard are `eval_<task>/<metric>` (e.g. `eval_piqa/acc`,
`eval_crows_pairs/pct_stereotype`); standard errors are left to `python -m train.evaluate`.
"""
from __future__ import annotations

import math

from evals import harness
from evals import tasks as tasks_lib


class TaskEvaluator:
  """Checks the task files once at start-up (TaskError naming the file and line), then evaluates models."""

  def __init__(self, spec: str, limit: int, tokenizer, mesh, rules, batch_size: int = 16):
    self.specs = tasks_lib.parse_specs(spec)
    for name, path in self.specs:
      tasks_lib.load_task(name, path)
    self.limit = limit or None
    self._tokenizer, self._mesh, self._rules, self._batch_size = tokenizer, mesh, rules, batch_size
    self._lm = None

  def __call__(self, model) -> dict[str, float]:
    """{"eval_<task>/<metric>": value} for `model` (the training state's parameters, used in place)."""
    from evals.requests import LM  # pylint: disable=g-import-not-at-top
    if self._lm is None:
      self._lm = LM(model, self._tokenizer, self._mesh, self._rules, batch_size=self._batch_size)
    else:
      self._lm.update(model)
    out = harness.evaluate(self._lm, self.specs, limit=self.limit)
    return {f"eval_{task}/{name}": value for task, metrics in out["results"].items()
            for name, value in metrics.items()
            if not name.endswith("_stderr") and value is not None and math.isfinite(value)}
