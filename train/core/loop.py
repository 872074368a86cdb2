"""The training run behind `python -m train`: set-up, resume, the step loop, evaluation, checkpoints, faults.

Order of work (the set-up steps are train/core/setup.py's, shared with `python -m train.rl`): range checks ->
workdir check -> distributed start-up -> the config settled against the run directory's checkpoint and
`train.init_from` (read only) -> mesh and Trainer -> the data plan (config.data parsed once) -> tokenizer -> data
sources -> init (or `train.init_from`) -> config.json and checkpoints/ -> restore the latest checkpoint -> steps.
A start that fails any check exits 2 having written no config.json and no checkpoints/. Everything that affects a
step lives in the checkpoint (state with step/RNG/optimizer, data-iterator position, non-finite counter), so a
resumed run continues bit-identically. Metrics are fetched from the device one step late (and in full only every
`log_every` steps) so the host never waits on the step it has just dispatched.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from train.core import hostmem
from train.core import logger as logger_lib
from train.core import setup
# The run's errors, checkpoint metadata keys and start-up helpers, under the names callers use.
from train.core.setup import (CHAT_TEMPLATE_KEY, TOKENIZER_KEY, SetupError, TrainingError,  # noqa: F401
                              WorkdirError, check_workdir, restore_model_params)


def run(config: ml_collections.ConfigDict, workdir: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint); returns a summary dict.

  Args:
    config: the resolved config (configs.parse / configs.load); not modified.
    workdir: the run directory; created if needed. Nothing in it is written until every check has passed.
    overrides: the dotted keys given explicitly on the command line (configs.parse's `args.overrides`): with
      `train.init_from`, only those may disagree with the checkpoint's model config (and only where harmless).

  Returns:
    {"step": last step run, "loss": its training loss, "eval_loss": last eval loss or None, "stopped": what
    stopped the run early (signal name) or None}. Raises SetupError (bad config, or one that does not match
    the run directory's checkpoint or init_from), TrainingError (non-finite halt, full disk) and WorkdirError.
  """
  config, warnings = setup.validated(config, overrides)
  return setup.launch(config, workdir, warnings, lambda c, w, stop: _run(c, w, stop, overrides), train_base=run)


def _run(config: ml_collections.ConfigDict, workdir: str, stop: setup.StopSignal,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
  """`run` once the workdir is known to be writable and the signal handlers are in place."""
  # The model and data stacks load here, not at import: `python -m train` checks its arguments first.
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  run = setup.settle(config, workdir, overrides, compile_cache=True)
  setup.build_trainer(run)
  setup.resolve_data(run)
  setup.check_data_kind(run)
  setup.check_resume(run)
  setup.load_tokenizer(run)
  task_evaluator = _task_evaluator(run)
  run.template = _template(run)
  train_ds, eval_ds = _datasets(run)
  state = setup.init_state(run)
  if run.primary:
    print(config, flush=True)
  setup.write_config(run)
  setup.print0(f"mesh {mesh_lib.describe(run.mesh)} on {jax.device_count()} {jax.devices()[0].platform} "
               f"device(s), {jax.process_count()} process(es); workdir {workdir}")
  if run.latest is None and config.train.init_from:
    setup.print0(f"initialised the parameters from {config.train.init_from}")
  setup.open_checkpoints(run)
  train_iter = iter(train_ds)  # starts prefetch threads / worker processes: only once the start is settled
  nonfinite_run = 0  # consecutive non-finite steps so far (checkpointed, so the halt rule survives restarts)
  if run.latest is not None:
    state, meta = setup.restore(run, train_iter)
    nonfinite_run = int(meta.get("nonfinite_run", 0))
  setup.open_log(run, config.train.steps, train_iter)
  summary = _Training(run, state, train_iter, eval_ds, task_evaluator, nonfinite_run).train(stop)
  if summary["stopped"] is None:
    figures = "".join(f", {k.replace('_', ' ')} {summary[k]:.4f}" for k in ("loss", "eval_loss")
                      if summary[k] is not None)
    setup.print0(f"done: step {summary['step']}{figures}; checkpoints in {run.checkpointer.directory}; "
                 f"plot: python -m train.plot {workdir}")
  return summary


def _task_evaluator(run: setup.Run):
  """train.eval_tasks' evaluator (None without tasks or evaluation); its task files are checked here, before any
  step (SetupError)."""
  tc = run.config.train
  if not (tc.eval_tasks and tc.eval_every > 0):
    return None
  from train.core import eval_tasks  # pylint: disable=g-import-not-at-top
  try:
    return eval_tasks.TaskEvaluator(tc.eval_tasks, tc.eval_tasks_limit, run.tokenizer, run.mesh, run.trainer.rules)
  except (ValueError, FileNotFoundError) as e:
    raise SetupError(str(e)) from None


def _template(run: setup.Run):
  """The run's chat template (train/core/chat_eval.py template_for; None without chat or preference data)."""
  from train.core import chat_eval  # pylint: disable=g-import-not-at-top
  try:
    return chat_eval.template_for(run.config, run.tokenizer, run.plan)
  except ValueError as e:
    raise SetupError(str(e)) from None


def _datasets(run: setup.Run):
  """(training dataset, evaluation dataset or None) on the run's data plan. Opening the sources checks them
  (empty sources, weights, an empty eval split) before any step (SetupError)."""
  from data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top

  def make_dataset(split):
    return pipeline_lib.make_dataset(run.config, run.tokenizer, split=split, process_index=jax.process_index(),
                                     process_count=jax.process_count(), plan=run.plan)

  try:
    train_ds = make_dataset("train")
    # Each evaluation iterates this afresh (the same batches); opening sources indexes files once per run.
    eval_ds = make_dataset("eval") if run.config.train.eval_every > 0 else None
  except (ValueError, FileNotFoundError) as e:
    raise SetupError(str(e)) from None
  return train_ds, eval_ds


class _Training:
  """The step loop of one set-up run: its state, data, evaluators, non-finite count and throughput window."""

  def __init__(self, run: setup.Run, state, train_iter, eval_ds, task_evaluator, nonfinite_run: int):
    from train.core import profiling  # pylint: disable=g-import-not-at-top
    from train.planning import mfu as mfu_lib  # pylint: disable=g-import-not-at-top
    self.run, self.trainer, self.tc = run, run.trainer, run.config.train
    self.state, self.train_iter, self.eval_ds, self.task_evaluator = state, train_iter, eval_ds, task_evaluator
    self.nonfinite_run = nonfinite_run
    self.eval_prompts = None  # held-out chat prompts for eval_exact_match, read at the first evaluation
    self.tokens_per_step = self.tc.batch_size * self.tc.seq_len
    self.peak = mfu_lib.peak_flops_per_device(jax.devices(), self.tc.peak_tflops)
    self.profiler = profiling.StepProfiler(self.tc.profile_steps, run.workdir)
    self.summary = {"step": run.start, "loss": None, "eval_loss": None, "stopped": None}

  def save(self, step: int) -> None:
    self.run.save(step, self.state, self.train_iter, {"nonfinite_run": self.nonfinite_run})

  def evaluate(self) -> dict[str, float]:
    """eval_steps batches of the eval split (and held-out chat generations, eval tasks): the eval metrics."""
    import parallel  # pylint: disable=g-import-not-at-top
    from train.core import chat_eval  # pylint: disable=g-import-not-at-top
    run, trainer, tc = self.run, self.trainer, self.tc
    eval_iter = iter(self.eval_ds)
    # Dispatch every batch before fetching, so the host prepares batch i+1 while the device computes batch i.
    outs = [trainer.eval_fn(self.state, trainer.batch_to_device(next(eval_iter))) for _ in range(tc.eval_steps)]
    sums = {k: sum(float(out[k]) for out in jax.device_get(outs)) for k in trainer.objective.eval_keys}
    setup.close_iterator(eval_iter)
    try:
      metrics = trainer.objective.eval_metrics(sums)
    except ValueError as e:
      raise TrainingError(str(e)) from None
    if tc.eval_generations > 0 and run.template is not None:
      if self.eval_prompts is None:
        self.eval_prompts = chat_eval.eval_items(run.config, run.template, run.plan)
      with parallel.activate(run.mesh, trainer.rules):  # generation shards its batch and cache like training
        metrics.update(chat_eval.exact_match(trainer.model(self.state), run.tokenizer, run.template,
                                             self.eval_prompts, tc.eval_max_new_tokens))
    if self.task_evaluator is not None:
      metrics.update(self.task_evaluator(trainer.model(self.state)))
    return metrics

  def train(self, stop: setup.StopSignal) -> dict[str, Any]:
    """Steps to train.steps (or a stop signal); returns the run's summary (see `run`)."""
    with self.run.training(self.train_iter):
      try:
        self._loop(stop)
      finally:
        self.profiler.stop()
    return self.summary

  def _loop(self, stop: setup.StopSignal) -> None:
    tc, run, summary = self.tc, self.run, self.summary
    start = step = run.start
    if start == 0 and tc.eval_every > 0:  # the starting point of the eval curve
      summary["eval_loss"] = _log_eval(run.log, 0, self.evaluate())
    pending = None  # (step, device metrics) of the step in flight, read one step late
    self.window = [time.perf_counter(), 0.0, 0]  # throughput window: start time, data wait (s), steps
    while step < tc.steps:
      step += 1
      metrics = self._step(step, first=step == start + 1)
      if pending is not None:
        self._count_nonfinite(*pending)
      pending = (step, metrics)
      run.log.advance(step)
      stopping = stop.should_stop(step)
      log_now = step % tc.log_every == 0 or step == tc.steps or stopping
      eval_now = tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.steps)
      save_now = (run.config.checkpoint.every > 0 and step % run.config.checkpoint.every == 0) or \
          step == tc.steps or stopping
      if not (log_now or eval_now or save_now):
        continue
      self._count_nonfinite(*pending)
      pending = None
      if log_now:
        self._log(step, metrics)
      if eval_now:
        summary["eval_loss"] = _log_eval(run.log, step, self.evaluate())
      if save_now:
        self.save(step)
      summary["step"] = step
      hostmem.release_freed_host_memory()  # CPU: holes the steps' buffers no longer fit go back to the system
      self.window = [time.perf_counter(), 0.0, 0]
      if stopping:
        summary["stopped"] = run.stopped(stop, "step", step)
        break

  def _step(self, step: int, first: bool) -> dict[str, Any]:
    """Dispatches training step `step` on the next batch; returns its (device) metrics."""
    t0 = time.perf_counter()
    local = next(self.train_iter)
    self.window[1] += time.perf_counter() - t0
    if step in self.tc.debug_nan_steps:  # fault injection: a NaN loss mask makes this step's loss and grads NaN
      local = {k: np.full_like(v, np.nan) if k.endswith("loss_mask") else v for k, v in local.items()}
    self.profiler.before(step)
    self.state, metrics = self.trainer.step_fn(self.state, self.trainer.batch_to_device(local))
    self.profiler.after(step, metrics)
    if first:
      # This process's first step compiles: wait for it and open the throughput window after it, so that the
      # first logged tokens/s and MFU measure training, not compilation.
      jax.block_until_ready(metrics)
      self.window[:2] = [time.perf_counter(), 0.0]
    else:
      self.window[2] += 1
    return metrics

  def _log(self, step: int, metrics: dict[str, Any]) -> None:
    """Logs `step`'s metrics with the window's throughput, MFU and the data pipeline's statistics."""
    from data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
    from train.planning import mfu as mfu_lib  # pylint: disable=g-import-not-at-top
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    window_start, window_wait, window_steps = self.window
    elapsed = time.perf_counter() - window_start
    if window_steps:  # none when the window held only the compiling first step
      host["tokens_per_sec"] = window_steps * self.tokens_per_step / elapsed
      host["data_wait_frac"] = window_wait / elapsed
      host.update(mfu_lib.utilisation(host["tokens_per_sec"], self.run.config.model, self.tc.seq_len,
                                      jax.device_count(), self.peak))
    host.update(pipeline_lib.stats(self.train_iter))  # realised mixture and packing efficiency so far
    self.run.log.log(step, host)
    self.summary["loss"] = host["loss"]

  def _count_nonfinite(self, step: int, metrics: dict[str, Any]) -> None:
    self.nonfinite_run = _count_nonfinite(step, metrics, self.nonfinite_run, self.tc.max_nonfinite,
                                          self.run.checkpointer)


def _log_eval(log: logger_lib.MetricLogger, step: int, ev: dict[str, float]) -> float:
  log.log(step, ev)
  extra = "".join(f", {k.removeprefix('eval_').replace('_', ' ')} {v:.3f}" for k, v in ev.items()
                  if k not in ("eval_loss", "eval_perplexity") and "/" not in k)
  perplexity = f", perplexity {ev['eval_perplexity']:.2f}" if "eval_perplexity" in ev else ""
  log.message(f"step {step}: eval loss {ev['eval_loss']:.4f}{perplexity}{extra}")
  return ev["eval_loss"]


def _count_nonfinite(step: int, metrics: dict[str, Any], run: int, limit: int, checkpointer) -> int:
  """Updates the consecutive non-finite count with `step`'s flag; raises TrainingError at `limit` in a row."""
  if not bool(jax.device_get(metrics["nonfinite"])):
    return 0
  run += 1
  if run >= limit:
    latest = checkpointer.latest_step()
    raise TrainingError(
        f"halting at step {step}: the loss or gradient was non-finite for {run} consecutive steps "
        f"(steps {step - run + 1}..{step}; updates were skipped). Latest checkpoint: "
        f"{'step ' + str(latest) if latest is not None else 'none'}. Lower train.lr, raise train.warmup_steps or "
        "check the data; train.max_nonfinite sets the limit.")
  if jax.process_index() == 0:
    print(f"warning: step {step}: non-finite loss or gradient, update skipped ({run} in a row, halting at "
          f"{limit})", file=sys.stderr, flush=True)
  return run
