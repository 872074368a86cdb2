"""Where training metrics go: WORKDIR/metrics.jsonl, TensorBoard event files, a console progress bar, and
(optionally) Weights & Biases.

Only process 0 writes. Each logged step is one JSON object per line in metrics.jsonl (`step` plus float
metrics); eval lines carry `eval_loss` and `eval_perplexity`. On resume, lines past the restored step (written
after the checkpoint by the interrupted run) are dropped so that the file reads like one uninterrupted run.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import ml_collections

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """All records of WORKDIR/metrics.jsonl in file order.

  Only a torn last line (no newline: the process was killed mid-write) is skipped; any other malformed line
  raises ValueError naming the file and line, since skipping it would silently drop logged steps.
  """
  path = os.path.join(workdir, METRICS_FILE)
  records = []
  if not os.path.exists(path):
    return records
  with open(path) as f:
    lines = f.readlines()
  for number, line in enumerate(lines, 1):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number == len(lines) and not line.endswith("\n"):
        break
      raise ValueError(f"{path}:{number}: malformed metrics line ({e}): {line[:80]!r}; fix or delete the line "
                       "(only a torn last line, from a kill mid-write, is skipped)") from None
  return records


def _truncate_after(path: str, step: int) -> None:
  """Rewrites the metrics file without records whose step is beyond `step` (atomically, via rename)."""
  if not os.path.exists(path):
    return
  kept = [r for r in read_metrics(os.path.dirname(path)) if r.get("step", 0) <= step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in kept:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)


class _TensorBoard:
  """Scalars into a TensorBoard event file without TensorFlow (tensorboard's own event writer and protos)."""

  def __init__(self, logdir: str):
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # pylint: disable=g-import-not-at-top
    self._writer = EventFileWriter(logdir, flush_secs=30)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2  # pylint: disable=g-import-not-at-top
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                                         for k, v in values.items()])
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()


class MetricLogger:
  """Fans one dict of scalars per logged step out to every enabled sink.

  Args:
    workdir: run directory (must exist).
    log_config: `config.log` (tensorboard, wandb, wandb_project, progress).
    total_steps: config.train.steps, for the progress bar and ETA.
    start_step: the step training resumes from (0 for a fresh run); later records are dropped.
    enabled: False on every process but 0 (then all methods are no-ops).
    run_config: the resolved config as a dict, handed to W&B.
  """

  def __init__(self, workdir: str, log_config: ml_collections.ConfigDict, *, total_steps: int,
               start_step: int = 0, enabled: bool = True, run_config: Mapping[str, Any] | None = None):
    self._enabled = enabled
    self._path = os.path.join(workdir, METRICS_FILE)
    self._tb = None
    self._wandb = None
    self._bar = None
    self._latest: dict[str, float] = {}  # last value of every metric, for the progress-bar suffix
    if not enabled:
      return
    _truncate_after(self._path, start_step if start_step else -1)  # a fresh start keeps no old step-0 lines
    self._file = open(self._path, "a")
    if log_config.tensorboard:
      self._tb = _TensorBoard(os.path.join(workdir, TENSORBOARD_DIR))
    if log_config.wandb:
      try:
        import wandb  # pylint: disable=g-import-not-at-top
      except ImportError:
        print("log.wandb=true but wandb is not installed (pip install wandb); continuing without it",
              file=sys.stderr)
      else:
        self._wandb = wandb.init(project=log_config.wandb_project, config=dict(run_config or {}),
                                 dir=workdir, name=os.path.basename(os.path.abspath(workdir)),
                                 resume="allow")
    if log_config.progress:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                       file=sys.stdout, mininterval=1.0, smoothing=0.3)

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records `metrics` (host scalars) for `step` in every sink; non-finite values are written as null."""
    if not self._enabled:
      return
    values = {k: float(v) for k, v in metrics.items()}
    record = {"step": int(step), **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      self._tb.scalars(step, {k: v for k, v in values.items() if math.isfinite(v)})
    if self._wandb is not None:
      self._wandb.log(values, step=int(step))
    if self._bar is not None:
      self._latest.update(values)
      self._bar.set_postfix_str(_postfix(self._latest), refresh=False)

  def advance(self, step: int) -> None:
    """Moves the progress bar to `step` (called every step; cheap)."""
    if self._bar is not None and step > self._bar.n:
      self._bar.update(step - self._bar.n)

  def message(self, text: str) -> None:
    """A console line that does not break the progress bar (process 0 only)."""
    if not self._enabled:
      return
    if self._bar is not None:
      self._bar.write(text, file=sys.stdout)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if not self._enabled:
      return
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None
    self._file.close()
    self._enabled = False


def _postfix(values: Mapping[str, float]) -> str:
  """The progress-bar suffix: loss, tokens/s, MFU where known (the bar itself shows step and ETA)."""
  parts = []
  if "loss" in values:
    parts.append(f"loss {values['loss']:.4f}")
  if "eval_loss" in values:
    parts.append(f"eval {values['eval_loss']:.4f}")
  if "tokens_per_sec" in values:
    parts.append(f"{values['tokens_per_sec']:,.0f} tok/s")
  if "mfu" in values:
    parts.append(f"MFU {100 * values['mfu']:.1f}%")
  return ", ".join(parts)
