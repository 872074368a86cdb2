"""The training run behind `python -m train`: set-up, resume, the step loop, evaluation, checkpoints, faults.

Order of work: range checks -> workdir check -> distributed start-up -> the config settled against the run
directory's checkpoint and `train.init_from` (read only) -> mesh and Trainer -> tokenizer -> data sources -> init
(or `train.init_from`) -> config.json and checkpoints/ -> restore the latest checkpoint -> steps. A start that
fails any check exits 2 having written no config.json and no checkpoints/. Everything that affects a step lives
in the checkpoint (state with step/RNG/optimizer, data-iterator position, non-finite counter), so a resumed run
continues bit-identically. Metrics are fetched from the device one step late (and in full only every
`log_every` steps) so the host never waits on the step it has just dispatched.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import signal
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from train.core import checkpoint as ckpt_lib
from train.core import hostmem
from train.core import logger as logger_lib

TOKENIZER_KEY = "tokenizer"
CHAT_TEMPLATE_KEY = "chat_template"  # checkpoint metadata: the run's chat template in Jinja form (chat data only)


class WorkdirError(RuntimeError):
  """The run directory cannot be created or written; the message names the path and the fix."""


class SetupError(ValueError):
  """The config does not fit these devices or is inconsistent (mesh, model, batch); nothing was trained."""


class TrainingError(RuntimeError):
  """Training cannot go on (non-finite halt, full disk, a bad checkpoint); the message says why and what to do."""


def check_workdir(workdir: str) -> None:
  """Fails fast (before any device work) if `workdir` cannot be created or written."""
  if "://" in workdir:
    raise WorkdirError(f"workdir {workdir}: URLs are not supported (metrics and config are written with local file "
                       "I/O); use a local or mounted path (NFS, or the bucket mounted with gcsfuse)")
  path = os.path.abspath(workdir)
  fix = "choose another --workdir or fix the permissions"
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"cannot create workdir {path}: {e.strerror or e}; {fix}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise WorkdirError(f"workdir {path} is not writable; {fix}")
  probe = os.path.join(path, f".write-test-{os.getpid()}")
  try:
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
      raise WorkdirError(f"no space left in workdir {path}; free disk space or choose another --workdir") from None
    raise WorkdirError(f"workdir {path} is not writable: {e.strerror or e}; {fix}") from None


class _StopSignal:
  """SIGTERM/SIGINT -> finish the current step, checkpoint, exit 0. A second SIGINT interrupts at once."""

  def __init__(self):
    self.received: str | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. run() called from a worker thread): no handler
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = self.received or signal.Signals(signum).name  # the first signal names the stop
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)
      # JAX's preemption service (which agrees on a stop step across processes) listens for SIGTERM only: hand
      # it this SIGINT as a SIGTERM to ourselves, so the other processes stop at the same step. (Asking
      # jax.process_count() here could start JAX's backends before jax.distributed is initialised.)
      if jax.distributed.is_initialized():
        os.kill(os.getpid(), signal.SIGTERM)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def reason(self) -> str:
    """The signal that stopped the run, as this process saw it."""
    return self.received or "SIGTERM/SIGINT on another process"

  def should_stop(self, step: int) -> bool:
    """True on every process once any of them was signalled (multi-host: at an agreed step)."""
    if jax.process_count() == 1:
      return self.received is not None
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # no preemption service: fall back to the local flag, synced over all processes
      flags = multihost_utils.process_allgather(np.array(self.received is not None))
      return bool(np.any(flags))


def _print0(*args) -> None:
  if jax.process_index() == 0:
    print(*args, flush=True)


def _write_json(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def _config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return json.loads(config.to_json_best_effort())


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
  import configs  # pylint: disable=g-import-not-at-top
  config = copy.deepcopy(config)  # the run's own copy: resume and init_from may settle some keys
  try:
    warnings = configs.validate.check(config)
  except configs.ConfigError as e:
    raise SetupError(str(e)) from None
  check_workdir(workdir)
  for warning in warnings:
    print(f"warning: {warning}", file=sys.stderr, flush=True)
  with _StopSignal() as stop:  # installed first: a SIGTERM during start-up stops after the first step
    config = _resolve_start(config, os.path.abspath(workdir))
    return _run(config, os.path.abspath(workdir), stop, overrides)


def _resolve_start(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """Fills in what a fine-tuning run takes from the run it starts from, before anything else reads the config.

  - train.base_recipe without train.init_from: the recipe's run WORKDIR/../<recipe> is made first (or reused
    when its config.json matches the recipe and it reached its last step) and becomes init_from.
  - init_from a Hugging Face directory: unless data.tokenizer is set, its tokenizer (tokenizer.json or
    tokenizer.model); config.model is settled against the checkpoint's by `_reconcile`.
  - init_from a meshlm run: unless data.tokenizer is set, that run's tokenizer (copied into this workdir).
  """
  tc = config.train
  if not (tc.init_from or tc.base_recipe):
    return config
  import parallel  # pylint: disable=g-import-not-at-top
  parallel.distributed.initialize(config.distributed)  # before any JAX call (idempotent; _run calls it again)
  if not tc.init_from and tc.base_recipe:
    name = os.path.splitext(os.path.basename(tc.base_recipe))[0]  # a recipe name or a config file path
    tc.init_from = _make_base_run(tc.base_recipe, os.path.join(os.path.dirname(workdir), name))
  if not tc.init_from:
    return config
  if not os.path.isdir(tc.init_from):
    raise SetupError(f"train.init_from={tc.init_from!r} is not a directory; give a meshlm run directory, a "
                     "checkpoints/<step> directory or a Hugging Face model directory")
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  if runconfig.is_hf_dir(tc.init_from):  # (config.model is settled from the checkpoint by _reconcile)
    if not config.data.tokenizer:
      from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
      if not hf_tokenizer_load.is_hf_dir(tc.init_from):
        raise SetupError(f"train.init_from={tc.init_from!r} has no tokenizer.json or tokenizer.model; set "
                         "data.tokenizer to the model's tokenizer")
      config.data.tokenizer = tc.init_from
  elif not config.data.tokenizer and jax.process_index() == 0:
    run_tokenizer = os.path.join(_run_dir(tc.init_from), "tokenizer.model")
    target = os.path.join(workdir, "tokenizer.model")
    if os.path.isfile(run_tokenizer):
      if not os.path.exists(target):
        shutil.copyfile(run_tokenizer, target + ".tmp")
        os.replace(target + ".tmp", target)
    else:
      directory, step = ckpt_lib.find_checkpoint_dir(tc.init_from)
      entry = ckpt_lib.Checkpointer(directory, read_only=True).metadata(step).get(TOKENIZER_KEY)
      if entry and "base64" in entry:  # under the name this run looks for (the file may have had another name)
        ckpt_lib.decode_file(dict(entry, name="tokenizer.model"), workdir)
  return config


def _run_dir(path: str) -> str:
  """The run directory of a meshlm run / checkpoints / checkpoints/<step> path."""
  directory, _ = ckpt_lib.find_checkpoint_dir(path)
  return os.path.dirname(directory)


def _make_base_run(recipe: str, base_workdir: str) -> str:
  """Trains (or resumes, or reuses) the recipe `recipe` in `base_workdir`; returns that directory."""
  import configs  # pylint: disable=g-import-not-at-top
  try:
    base = configs.load(recipe)
  except configs.ConfigError as e:
    raise SetupError(f"train.base_recipe={recipe!r}: {e}") from None
  saved = os.path.join(base_workdir, "config.json")
  if os.path.exists(saved):
    with open(saved) as f:
      found = json.load(f)
    want = _config_dict(base)
    if base.train.base_recipe and not base.train.init_from:  # a chained recipe's run saved its resolved start
      found = dict(found, train=dict(found.get("train", {}), init_from=""))
    # What the weights depend on; logging, checkpoint cadence, mesh and process settings may differ.
    if any(found.get(section) != want[section] for section in ("model", "train", "data")):
      raise SetupError(f"{base_workdir} holds a run whose model, train or data config differs from the "
                       f"{recipe!r} recipe; remove it, or start from it explicitly with "
                       f"--config.train.init_from={base_workdir}")
    directory = os.path.join(base_workdir, ckpt_lib.CHECKPOINT_DIR)
    steps = ckpt_lib.Checkpointer(directory, read_only=True).all_steps() if os.path.isdir(directory) else []
    if steps and steps[-1] >= base.train.steps:
      _print0(f"reusing the {recipe!r} run in {base_workdir} (step {steps[-1]})")
      return base_workdir
  _print0(f"making the {recipe!r} run this one starts from in {base_workdir}")
  summary = run(base, base_workdir)
  if summary["stopped"]:
    raise TrainingError(f"stopped while making the {recipe!r} run in {base_workdir}; run the same command to "
                        "resume")
  return base_workdir


def _reconcile(config: ml_collections.ConfigDict, checkpoint_dir: str, overrides: Sequence[str]) -> int | None:
  """Settles `config` (in place) against the run directory's latest checkpoint and train.init_from, reading
  only; returns the step to resume from (None: a fresh run). Raises SetupError naming the keys."""
  import configs  # pylint: disable=g-import-not-at-top
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  try:
    saved = runconfig.saved_run_config(checkpoint_dir)
    if config.train.init_from:  # resuming, the run's own checkpoint says what init_from gave it
      source, where = ((saved[1]["model"], f"{checkpoint_dir}/{saved[0]}") if saved and "model" in saved[1]
                       else runconfig.source_model(config))
      for note in runconfig.model_from(config, source, where, overrides):
        _print0(f"from {where}: {note}")
    if saved is None:
      return None
    step, saved_config = saved
    runconfig.check_resume(config, saved_config, f"{checkpoint_dir}/{step}")
    warning = runconfig.keep_schedule(config, saved_config)
    if warning and jax.process_index() == 0:
      print(f"warning: {warning}", file=sys.stderr, flush=True)
    return step
  except (configs.ConfigError, ckpt_lib.CheckpointError) as e:
    raise SetupError(str(e)) from None


def _run(config: ml_collections.ConfigDict, workdir: str, stop: _StopSignal,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
  """`run` once the workdir is known to be writable and the signal handlers are in place."""
  # The model and data stacks load here, not at import: `python -m train` checks its arguments first.
  import parallel  # pylint: disable=g-import-not-at-top
  from data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.planning import mfu as mfu_lib  # pylint: disable=g-import-not-at-top
  from train.core import chat_eval  # pylint: disable=g-import-not-at-top
  from train.core import profiling  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top

  parallel.distributed.initialize(config.distributed)
  profiling.enable_compile_cache(config.train.compile_cache)  # before the first compile of this run
  primary = jax.process_index() == 0
  tc, ck = config.train, config.checkpoint
  # Every check reads only; config.json and checkpoints/ are written once they have all passed.
  checkpoint_dir = os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)
  latest = _reconcile(config, checkpoint_dir, overrides)
  config_dict = _config_dict(config)
  try:
    mesh = mesh_lib.make_mesh(config.mesh)
    trainer = step_lib.Trainer(config, mesh)  # validates the model, mesh and batch settings before any work
  except ValueError as e:  # MeshError and config checks: the message names the key
    raise SetupError(str(e)) from None
  _check_data_kind(config, trainer)
  if latest is not None:
    _check_state_layout(trainer, checkpoint_dir, latest)
    if primary:
      _restore_tokenizer_file(checkpoint_dir, latest, workdir)
  try:
    tokenizer_path = tokenizer_lib.prepare(config, workdir)  # checks its vocabulary against config.model
    tokenizer = tokenizer_lib.load(tokenizer_path)
    task_evaluator = None
    if tc.eval_tasks and tc.eval_every > 0:  # task files are checked here, before any step
      from train.core import eval_tasks  # pylint: disable=g-import-not-at-top
      task_evaluator = eval_tasks.TaskEvaluator(tc.eval_tasks, tc.eval_tasks_limit, tokenizer, mesh, trainer.rules)
  except (ValueError, FileNotFoundError) as e:
    raise SetupError(str(e)) from None

  try:
    template = chat_eval.template_for(config, tokenizer)
  except ValueError as e:
    raise SetupError(str(e)) from None

  def make_dataset(split):
    return pipeline_lib.make_dataset(config, tokenizer, split=split, process_index=jax.process_index(),
                                     process_count=jax.process_count())

  try:  # opening the sources checks them (empty sources, weights, an empty eval split) before any step
    train_ds = make_dataset("train")
    # Each evaluation iterates this afresh (the same batches); opening sources indexes files once per run.
    eval_ds = make_dataset("eval") if tc.eval_every > 0 else None
  except (ValueError, FileNotFoundError) as e:
    raise SetupError(str(e)) from None
  if latest is None:
    state = trainer.init(tc.seed)
    if tc.init_from:
      state = trainer.with_model_params(state, _init_from(trainer, tc.init_from))
  if primary:
    print(config, flush=True)
    _write_json(os.path.join(workdir, "config.json"), config_dict)
  _print0(f"mesh {mesh_lib.describe(mesh)} on {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{jax.process_count()} process(es); workdir {workdir}")
  if latest is None and tc.init_from:
    _print0(f"initialised the parameters from {tc.init_from}")
  checkpointer = ckpt_lib.Checkpointer(checkpoint_dir, ck)
  eval_prompts = None  # held-out chat prompts for eval_exact_match, read at the first evaluation
  train_iter = iter(train_ds)  # starts prefetch threads / worker processes: only once the start is settled
  nonfinite_run = 0  # consecutive non-finite steps so far (checkpointed, so the halt rule survives restarts)
  if latest is not None:
    try:
      state, meta = checkpointer.restore(trainer.abstract_state(), train_iter, step=latest)
    except Exception as e:  # pylint: disable=broad-except
      _close(train_iter)  # orbax's and grain's threads must not outlive the failed start
      _close_checkpointer(checkpointer, raise_errors=False)
      if isinstance(e, ValueError):
        raise TrainingError(f"cannot resume from {checkpointer.directory}/{latest}: {e}") from None
      raise
    nonfinite_run = int(meta.get("nonfinite_run", 0))
    _print0(f"resumed from {checkpointer.directory}/{latest}")
  start = latest or 0

  tokenizer_entry = (ckpt_lib.encode_file(tokenizer_path) if os.path.isfile(tokenizer_path)
                     else {"directory": tokenizer_path})  # a Hugging Face directory: named, not copied
  try:
    log = logger_lib.MetricLogger(workdir, config.log, total_steps=tc.steps, start_step=start, enabled=primary,
                                  run_config=config_dict)
  except ValueError as e:  # a damaged metrics.jsonl (the message names the line)
    _close(train_iter)
    _close_checkpointer(checkpointer, raise_errors=False)
    raise SetupError(str(e)) from None
  tokens_per_step = tc.batch_size * tc.seq_len
  peak = mfu_lib.peak_flops_per_device(jax.devices(), tc.peak_tflops)
  profiler = profiling.StepProfiler(tc.profile_steps, workdir)

  def save(step: int) -> None:
    meta = {"nonfinite_run": nonfinite_run, "config": config_dict, "mesh": dict(mesh.shape),
            TOKENIZER_KEY: tokenizer_entry}
    if template is not None:  # generation and HF export render chats with the template the run trained on
      meta[CHAT_TEMPLATE_KEY] = template.jinja
    checkpointer.save(step, state, train_iter, meta)

  def evaluate() -> dict[str, float]:
    nonlocal eval_prompts
    eval_iter = iter(eval_ds)
    # Dispatch every batch before fetching, so the host prepares batch i+1 while the device computes batch i.
    outs = [trainer.eval_fn(state, trainer.batch_to_device(next(eval_iter))) for _ in range(tc.eval_steps)]
    sums = {k: sum(float(out[k]) for out in jax.device_get(outs)) for k in trainer.objective.eval_keys}
    _close(eval_iter)
    try:
      metrics = trainer.objective.eval_metrics(sums)
    except ValueError as e:
      raise TrainingError(str(e)) from None
    if tc.eval_generations > 0 and template is not None:
      if eval_prompts is None:
        eval_prompts = chat_eval.eval_items(config, template)
      with parallel.activate(mesh, trainer.rules):  # generation shards its batch and cache like training
        metrics.update(chat_eval.exact_match(trainer.model(state), tokenizer, template, eval_prompts,
                                             tc.eval_max_new_tokens))
    if task_evaluator is not None:
      metrics.update(task_evaluator(trainer.model(state)))
    return metrics

  summary = {"step": start, "loss": None, "eval_loss": None, "stopped": None}
  step = start
  finished = False
  try:
    if start == 0 and tc.eval_every > 0:  # the starting point of the eval curve
      summary["eval_loss"] = _log_eval(log, 0, evaluate())
    pending = None  # (step, device metrics) of the step in flight, read one step late
    window_start, window_wait, window_steps = time.perf_counter(), 0.0, 0
    while step < tc.steps:
      t0 = time.perf_counter()
      local = next(train_iter)
      window_wait += time.perf_counter() - t0
      step += 1
      if step in tc.debug_nan_steps:  # fault injection: a NaN loss mask makes this step's loss and grads NaN
        local = {k: np.full_like(v, np.nan) if k.endswith("loss_mask") else v for k, v in local.items()}
      profiler.before(step)
      state, metrics = trainer.step_fn(state, trainer.batch_to_device(local))
      profiler.after(step, metrics)
      if step == start + 1:
        # This process's first step compiles: wait for it and open the throughput window after it, so that the
        # first logged tokens/s and MFU measure training, not compilation.
        jax.block_until_ready(metrics)
        window_start, window_wait = time.perf_counter(), 0.0
      else:
        window_steps += 1
      if pending is not None:
        nonfinite_run = _count_nonfinite(*pending, nonfinite_run, tc.max_nonfinite, checkpointer)
      pending = (step, metrics)
      log.advance(step)

      stopping = stop.should_stop(step)
      log_now = step % tc.log_every == 0 or step == tc.steps or stopping
      eval_now = tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.steps)
      save_now = (ck.every > 0 and step % ck.every == 0) or step == tc.steps or stopping
      if not (log_now or eval_now or save_now):
        continue
      nonfinite_run = _count_nonfinite(*pending, nonfinite_run, tc.max_nonfinite, checkpointer)
      pending = None
      if log_now:
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        elapsed = time.perf_counter() - window_start
        if window_steps:  # none when the window held only the compiling first step
          host["tokens_per_sec"] = window_steps * tokens_per_step / elapsed
          host["data_wait_frac"] = window_wait / elapsed
          host.update(mfu_lib.utilisation(host["tokens_per_sec"], config.model, tc.seq_len, jax.device_count(),
                                          peak))
        host.update(pipeline_lib.stats(train_iter))  # realised mixture and packing efficiency so far
        log.log(step, host)
        summary["loss"] = host["loss"]
      if eval_now:
        summary["eval_loss"] = _log_eval(log, step, evaluate())
      if save_now:
        save(step)
      summary["step"] = step
      hostmem.release_freed_host_memory()  # CPU: holes the steps' buffers no longer fit go back to the system
      window_start, window_wait, window_steps = time.perf_counter(), 0.0, 0
      if stopping:
        summary["stopped"] = stop.reason()
        checkpointer.wait()
        log.message(f"{summary['stopped']}: stopped after step {step}; checkpoint saved to "
                    f"{checkpointer.directory}/{step}. Run the same command to resume.")
        break
    checkpointer.wait()
    finished = True
  except ckpt_lib.CheckpointError as e:
    raise TrainingError(str(e)) from None
  finally:
    profiler.stop()
    log.close()
    _close(train_iter)
    _close_checkpointer(checkpointer, raise_errors=finished)
  if summary["stopped"] is None:
    figures = "".join(f", {k.replace('_', ' ')} {summary[k]:.4f}" for k in ("loss", "eval_loss")
                      if summary[k] is not None)
    _print0(f"done: step {summary['step']}{figures}; checkpoints in {checkpointer.directory}; "
            f"plot: python -m train.plot {workdir}")
  return summary


def _log_eval(log: logger_lib.MetricLogger, step: int, ev: dict[str, float]) -> float:
  log.log(step, ev)
  extra = "".join(f", {k.removeprefix('eval_').replace('_', ' ')} {v:.3f}" for k, v in ev.items()
                  if k not in ("eval_loss", "eval_perplexity") and "/" not in k)
  perplexity = f", perplexity {ev['eval_perplexity']:.2f}" if "eval_perplexity" in ev else ""
  log.message(f"step {step}: eval loss {ev['eval_loss']:.4f}{perplexity}{extra}")
  return ev["eval_loss"]


def _close(iterator) -> None:
  close = getattr(iterator, "close", None)
  if close is not None:
    close()


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


def _close_checkpointer(checkpointer: ckpt_lib.Checkpointer, raise_errors: bool) -> None:
  """Closes the checkpointer (waiting for the last save). Its errors fail the run (TrainingError) when the run
  had finished; while another error is propagating they are reported on stderr, not swallowed or masking it."""
  try:
    checkpointer.close()
  except Exception as e:  # pylint: disable=broad-except
    message = f"closing the checkpoints in {checkpointer.directory} failed: {type(e).__name__}: {e}"
    if raise_errors:
      raise TrainingError(message + "; the last checkpoint may be incomplete (run the same command to resume "
                          "from the latest complete one)") from e
    print(f"error: {message}", file=sys.stderr, flush=True)


def _check_data_kind(config, trainer) -> None:
  """SetupError unless the objective and the data agree on pairs: reward/dpo read preference sources only."""
  from data import preference  # pylint: disable=g-import-not-at-top
  from data import sources as sources_lib  # pylint: disable=g-import-not-at-top
  try:
    specs = sources_lib.parse_spec(config.data.sources, tuple(config.data.weights))
  except ValueError as e:
    raise SetupError(str(e)) from None
  pair_data = any(preference.is_preference_source(s) for s in specs)
  pair_objective = set(trainer.batch_keys) == set(preference.BATCH_KEYS)
  if pair_objective and not pair_data:
    raise SetupError(f"config.train.objective={config.train.objective!r} trains on preference pairs but "
                     f"config.data.sources={config.data.sources!r} has no preference source; use "
                     "preference:PATH.jsonl (prompt/chosen/rejected lines) or builtin:preference")
  if pair_data and not pair_objective:
    raise SetupError(f"config.data.sources={config.data.sources!r} holds preference pairs, which "
                     f"config.train.objective={config.train.objective!r} cannot read; use train.objective=reward "
                     "or dpo")


def _check_state_layout(trainer, checkpoint_dir: str, step: int) -> None:
  """SetupError unless checkpoint `step` holds exactly the state `trainer` builds (leaves, shapes, dtypes)."""
  import configs  # pylint: disable=g-import-not-at-top
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  checkpointer = ckpt_lib.Checkpointer(checkpoint_dir, read_only=True)
  try:
    runconfig.check_state_layout(runconfig.layout(trainer.abstract_state()), checkpointer.state_layout(step),
                                 f"{checkpoint_dir}/{step}")
  except configs.ConfigError as e:
    raise SetupError(str(e)) from None
  finally:
    checkpointer.close()


def _restore_tokenizer_file(checkpoint_dir: str, step: int, workdir: str) -> None:
  """Puts the run's tokenizer file back into the workdir from the checkpoint if it went missing."""
  checkpointer = ckpt_lib.Checkpointer(checkpoint_dir, read_only=True)
  try:
    entry = checkpointer.metadata(step).get(TOKENIZER_KEY)
  finally:
    checkpointer.close()
  if entry and "base64" in entry:
    ckpt_lib.decode_file(entry, workdir)


def restore_model_params(checkpointer: ckpt_lib.Checkpointer, step: int | None, abstract: Any) -> Any:
  """The model weights of a meshlm checkpoint onto `abstract`'s shardings (ShapeDtypeStructs of the model's
  parameter tree); a LoRA run's (train.lora_rank > 0) come with its adapters merged in (W + alpha/r * A @ B); a
  run with an objective head (reward) gives its trunk."""
  saved = checkpointer.metadata(step).get("config", {}).get("train", {})
  if not saved.get("lora_rank", 0):
    if any(k.startswith("params/model/") for k in checkpointer.state_layout(step)):  # beside a head (reward run)
      return checkpointer.restore_subtree({"params": {"model": abstract}}, step)["params"]["model"]
    return checkpointer.restore_subtree({"params": abstract}, step)["params"]
  from model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  rank, targets = int(saved["lora_rank"]), tuple(saved["lora_targets"])
  adapters = jax.eval_shape(lambda: lora_lib.init(jax.random.PRNGKey(0), abstract, targets, rank))
  if not adapters:  # `abstract` (a part of the tree, as train.export restores it) holds no adapted kernel
    return checkpointer.restore_subtree({"frozen": {"model": abstract}}, step)["frozen"]["model"]
  first = jax.tree.leaves(abstract)[0].sharding
  replicated = jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
  adapters = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), adapters)
  tree = checkpointer.restore_subtree({"params": {"lora": adapters}, "frozen": {"model": abstract}}, step)
  merged = lora_lib.merge(tree["frozen"]["model"], tree["params"]["lora"], float(saved["lora_alpha"]) / rank)
  return jax.device_put(merged, jax.tree.map(lambda a: a.sharding, abstract))


def _init_from(trainer, path: str) -> dict[str, Any]:
  """Model parameters (sharded like `trainer`'s) from a meshlm run/checkpoint directory or a Hugging Face
  directory; a meshlm run trained with LoRA gives its adapters merged into the weights."""
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  abstract = trainer.abstract_model_params()
  if not os.path.isdir(path):
    raise TrainingError(f"train.init_from={path!r} is not a directory; give a meshlm run directory, a "
                        "checkpoints/<step> directory or a Hugging Face model directory")
  if not runconfig.is_hf_dir(path):
    directory, step = ckpt_lib.find_checkpoint_dir(path)
    try:
      return restore_model_params(ckpt_lib.Checkpointer(directory, read_only=True), step, abstract)
    except (ValueError, KeyError) as e:
      raise TrainingError(f"train.init_from={path!r}: its parameters do not fit config.model ({e}); use the "
                          "model config of the run it came from") from None
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import hf  # pylint: disable=g-import-not-at-top
  m = trainer.config.model
  try:
    hf.check_compatible(m, path)  # names the differing config fields (hidden_size, ...) with both values
  except ValueError as e:
    raise TrainingError(f"train.init_from={path!r}: {e}") from None
  try:  # each device reads its own blocks of the weights: the model never passes whole through one host
    loaded = hf.load(path, dtype=m.param_dtype, compute_dtype=m.dtype, scan_layers=m.scan_layers,
                     mesh=trainer.mesh, rules=trainer.rules)
  except ValueError as e:  # a missing or truncated file, a tensor that does not fit: named in the message
    raise TrainingError(f"train.init_from={path!r}: {e}") from None
  params = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
  want = jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
  got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
  if want != got:
    raise TrainingError(f"train.init_from={path!r}: the Hugging Face model's parameters do not match "
                        "config.model; set the model keys from its config.json (model.hf.config_from_hf)")
  return jax.device_put(params, trainer.param_shardings)
