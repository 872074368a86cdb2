"""The one set-up path of a run: `python -m train` (train/core/loop.py) and `python -m train.rl` (train/rl/loop.py).

Steps, in order (each loop calls them; `Run` carries what they settle):
  validated / launch    the config checked (configs.validate), the workdir checked writable, the stop signals
                        installed, the start resolved (`resolve_start`: train.base_recipe, train.init_from, a
                        distillation teacher's train.distill_teacher_recipe)
  settle                distributed start-up; the config settled against the run directory's latest checkpoint
                        and train.init_from, reading only (`reconcile`); the step to resume from
  build_trainer         the mesh and the Trainer (validates the model, mesh and batch settings)
  resolve_data          config.data parsed once into the run's DataPlan (data/plan.py), which every later stage
                        receives; `check_data_kind` (pretraining and post-training)
  check_resume          a resumed run's checkpoint checked against the Trainer's state; its tokenizer file back
  load_tokenizer        the run's tokenizer (trained on the plan's sources when absent), checked against the model
  init_state            a fresh run's state (with train.init_from's parameters, a distillation teacher's loaded)
  write_config          config.json: only once every check above has passed
  open_checkpoints      the checkpointer; `restore` resumes the state (and the data iterator) from it
  open_log              metrics.jsonl / TensorBoard / progress bar
  Run.training          the loop's guard: a checkpoint error -> TrainingError; logger, iterators, checkpointer closed
A start that fails a check raises SetupError (exit 2) having written no config.json and no checkpoints/.

The model and data stacks are imported inside the steps, not at import: `python -m train` checks its arguments
before they load.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import functools
import json
import os
import shutil
import signal
import sys
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from train.core import checkpoint as ckpt_lib
from train.core import logger as logger_lib

TOKENIZER_KEY = "tokenizer"
CHAT_TEMPLATE_KEY = "chat_template"  # checkpoint metadata: the run's chat template in Jinja form (chat data only)
# Trains a recipe's run in a directory and returns its summary: train.core.loop.run (passed in, as that module
# imports this one).
TrainBase = Callable[[ml_collections.ConfigDict, str], dict]


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
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"workdir {path} is a file, not a directory; choose another --workdir")
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


class StopSignal:
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


def print0(*args) -> None:
  """print on process 0 only (flushed)."""
  if jax.process_index() == 0:
    print(*args, flush=True)


def write_json(path: str, obj: Any) -> None:
  """Writes `obj` as JSON to `path` atomically (a temporary file renamed over it)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """`config` as the JSON-ready dict config.json and the checkpoints' metadata hold."""
  return json.loads(config.to_json_best_effort())


# ---- before any device work ----------------------------------------------------------------------------------
def validated(config: ml_collections.ConfigDict,
              overrides: Sequence[str] = ()) -> tuple[ml_collections.ConfigDict, list[str]]:
  """(the run's own copy of `config`, configs.validate's warnings); SetupError for a config that cannot run.
  `overrides`: the keys given explicitly; an inert conditional key that only the config file set is a warning."""
  import configs  # pylint: disable=g-import-not-at-top
  config = copy.deepcopy(config)  # the run's own copy: resume and init_from may settle some keys
  try:
    warnings = configs.validate.check(config, tuple(overrides))
  except configs.ConfigError as e:
    raise SetupError(str(e)) from None
  return config, warnings


def launch(config: ml_collections.ConfigDict, workdir: str, warnings: Sequence[str],
           body: Callable[[ml_collections.ConfigDict, str, StopSignal], Any], train_base: TrainBase) -> Any:
  """Checks `workdir`, prints `warnings`, installs the stop signals, resolves the start (`resolve_start`, with
  `train_base` making a base recipe's run) and returns body(config, absolute workdir, stop)."""
  check_workdir(workdir)
  for warning in warnings:
    print(f"warning: {warning}", file=sys.stderr, flush=True)
  workdir = os.path.abspath(workdir)
  with StopSignal() as stop:  # installed first: a SIGTERM during start-up stops after the first step
    config = resolve_start(config, workdir, train_base)
    return body(config, workdir, stop)


def resolve_start(config: ml_collections.ConfigDict, workdir: str,
                  train_base: TrainBase | None = None) -> ml_collections.ConfigDict:
  """Fills in what a run takes from the runs it starts from, before anything else reads the config.

  - train.base_recipe without train.init_from: the recipe's run WORKDIR/../<recipe> is made first by
    `train_base` (train.core.loop.run; or reused when its config.json matches the recipe and it reached its last
    step) and becomes init_from.
  - train.objective=distill with train.distill_teacher_recipe and no train.distill_teacher: the same for the
    teacher, whose run becomes distill_teacher (the student starts from init_from, or fresh).
  - init_from (else the teacher) a Hugging Face directory: unless data.tokenizer is set, its tokenizer
    (tokenizer.json or tokenizer.model); config.model is settled against init_from's checkpoint by `reconcile`.
  - init_from (else the teacher) a meshlm run: unless data.tokenizer is set, that run's tokenizer (copied into this
    workdir).
  """
  tc = config.train
  keys = ("init_from", "distill_teacher") if tc.objective == "distill" else ("init_from",)
  recipes = {"init_from": "base_recipe", "distill_teacher": "distill_teacher_recipe"}
  if not any(tc[key] or tc[recipes[key]] for key in keys):
    return config
  import parallel  # pylint: disable=g-import-not-at-top
  parallel.distributed.initialize(config.distributed)  # before any JAX call (idempotent; settle calls it again)
  for key in keys:
    recipe = tc[recipes[key]]
    if not tc[key] and recipe:
      name = os.path.splitext(os.path.basename(recipe))[0]  # a recipe name or a config file path
      tc[key] = _make_base_run(recipe, os.path.join(os.path.dirname(workdir), name), train_base, recipes[key], key)
    if tc[key] and not os.path.isdir(tc[key]):
      raise SetupError(f"train.{key}={tc[key]!r} is not a directory; give a meshlm run directory, a "
                       "checkpoints/<step> directory or a Hugging Face model directory")
  source = next((key for key in keys if tc[key]), None)
  if source and not config.data.tokenizer:
    _take_tokenizer(config, source, workdir)
  return config


def _take_tokenizer(config: ml_collections.ConfigDict, key: str, workdir: str) -> None:
  """The tokenizer of the directory train.<key> names: a Hugging Face directory's becomes data.tokenizer, a meshlm
  run's is copied into `workdir` (process 0)."""
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  path = config.train[key]
  if runconfig.is_hf_dir(path):  # (init_from: config.model is settled from the checkpoint by reconcile)
    from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
    if not hf_tokenizer_load.is_hf_dir(path):
      raise SetupError(f"train.{key}={path!r} has no tokenizer.json or tokenizer.model; set data.tokenizer to the "
                       "model's tokenizer")
    config.data.tokenizer = path
  elif jax.process_index() == 0:
    _copy_run_tokenizer(path, workdir)


def _copy_run_tokenizer(init_from: str, workdir: str) -> None:
  """A meshlm run's tokenizer (its file, else its checkpoint's copy) into `workdir` as tokenizer.model."""
  run_tokenizer = os.path.join(_run_dir(init_from), "tokenizer.model")
  target = os.path.join(workdir, "tokenizer.model")
  if os.path.isfile(run_tokenizer):
    if not os.path.exists(target):
      shutil.copyfile(run_tokenizer, target + ".tmp")
      os.replace(target + ".tmp", target)
  else:
    directory, step = ckpt_lib.find_checkpoint_dir(init_from)
    entry = ckpt_lib.Checkpointer(directory, read_only=True).metadata(step).get(TOKENIZER_KEY)
    if entry and "base64" in entry:  # under the name this run looks for (the file may have had another name)
      ckpt_lib.decode_file(dict(entry, name="tokenizer.model"), workdir)


def _run_dir(path: str) -> str:
  """The run directory of a meshlm run / checkpoints / checkpoints/<step> path."""
  directory, _ = ckpt_lib.find_checkpoint_dir(path)
  return os.path.dirname(directory)


KERNEL_CHOICES = ("attention_impl", "moe_impl")  # model keys that pick a kernel, not the function


def _make_base_run(recipe: str, base_workdir: str, train_base: TrainBase | None, key: str = "base_recipe",
                   path_key: str = "init_from") -> str:
  """Trains (or resumes, or reuses) the recipe `recipe` (given by train.<key>) in `base_workdir` with `train_base`;
  returns that directory (which train.<path_key> may name explicitly instead)."""
  import configs  # pylint: disable=g-import-not-at-top
  try:
    base = configs.load(recipe)
  except configs.ConfigError as e:
    raise SetupError(f"train.{key}={recipe!r}: {e}") from None
  saved = os.path.join(base_workdir, "config.json")
  if os.path.exists(saved):
    with open(saved) as f:
      found = json.load(f)
    want = config_dict(base)
    for chained, resolved in (("base_recipe", "init_from"), ("distill_teacher_recipe", "distill_teacher")):
      if base.train[chained] and not base.train[resolved]:  # a chained recipe's run saved its resolved start
        found = dict(found, train=dict(found.get("train", {}), **{resolved: ""}))
    # What the weights depend on; logging, checkpoint cadence, mesh and process settings may differ, and so may the
    # kernels (same function; a run saved before model.*_impl=auto became the defaults says xla / ragged).
    found = dict(found, model={**found.get("model", {}), **{k: want["model"][k] for k in KERNEL_CHOICES}})
    if any(found.get(section) != want[section] for section in ("model", "train", "data")):
      raise SetupError(f"{base_workdir} holds a run whose model, train or data config differs from the "
                       f"{recipe!r} recipe; remove it, or start from it explicitly with "
                       f"--config.train.{path_key}={base_workdir}")
    directory = os.path.join(base_workdir, ckpt_lib.CHECKPOINT_DIR)
    steps = ckpt_lib.Checkpointer(directory, read_only=True).all_steps() if os.path.isdir(directory) else []
    if steps and steps[-1] >= base.train.steps:
      print0(f"reusing the {recipe!r} run in {base_workdir} (step {steps[-1]})")
      return base_workdir
  role = "starts from" if path_key == "init_from" else f"takes as train.{path_key}"
  print0(f"making the {recipe!r} run this one {role} in {base_workdir}")
  if train_base is None:
    raise SetupError(f"train.{key}={recipe!r}: no trainer was given to make its run in {base_workdir}")
  summary = train_base(base, base_workdir)
  if summary["stopped"]:
    raise TrainingError(f"stopped while making the {recipe!r} run in {base_workdir}; run the same command to "
                        "resume")
  return base_workdir


def reconcile(config: ml_collections.ConfigDict, checkpoint_dir: str, overrides: Sequence[str]) -> int | None:
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
        print0(f"from {where}: {note}")
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


# ---- the run being set up ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
  """What the set-up steps have settled so far (module docstring), and the checkpoint and log plumbing both loops
  share. Fields are filled step by step; a loop reads them once set-up is done."""
  config: ml_collections.ConfigDict
  workdir: str  # absolute
  latest: int | None  # the checkpoint step resumed from; None: a fresh run
  config_dict: dict[str, Any]  # config.json's content and the checkpoints' "config" metadata
  mesh: Any = None
  devices: Any = None  # the devices the mesh spans (None: all; train.rl keeps some for rollouts)
  trainer: Any = None  # train.core.step.Trainer
  plan: Any = None  # data.plan.DataPlan: config.data parsed once
  tokenizer_path: str = ""
  tokenizer: Any = None
  template: Any = None  # the chat template (None: no chat data)
  checkpointer: ckpt_lib.Checkpointer | None = None
  tokenizer_entry: dict[str, Any] | None = None  # the tokenizer as checkpoint metadata
  log: logger_lib.MetricLogger | None = None

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.workdir, ckpt_lib.CHECKPOINT_DIR)

  @property
  def primary(self) -> bool:
    return jax.process_index() == 0

  @property
  def start(self) -> int:
    """The step (or iteration) the loop starts after."""
    return self.latest or 0

  def save(self, step: int, state: Any, data_iter: Any, extra: dict[str, Any]) -> None:
    """Checkpoints `state` (and `data_iter`'s position) at `step` with the run's metadata and `extra`."""
    meta = {**extra, "config": self.config_dict, "mesh": dict(self.mesh.shape), TOKENIZER_KEY: self.tokenizer_entry}
    if self.template is not None:  # generation and HF export render chats with the template the run trained on
      meta[CHAT_TEMPLATE_KEY] = self.template.jinja
    self.checkpointer.save(step, state, data_iter, meta)

  def stopped(self, stop: StopSignal, unit: str, step: int) -> str:
    """Waits for the checkpoint of `step` saved on a stop signal and says so; returns the signal's name."""
    reason = stop.reason()
    self.checkpointer.wait()
    self.log.message(f"{reason}: stopped after {unit} {step}; checkpoint saved to {self.checkpointer.directory}/"
                     f"{step}. Run the same command to resume.")
    return reason

  @contextlib.contextmanager
  def training(self, *iterators):
    """Guards a loop: waits for its last checkpoint; a checkpoint error becomes TrainingError; the logger,
    `iterators` and the checkpointer are closed whatever happens (a close error fails only a finished loop)."""
    finished = False
    try:
      yield
      self.checkpointer.wait()
      finished = True
    except ckpt_lib.CheckpointError as e:
      raise TrainingError(str(e)) from None
    finally:
      self.log.close()
      for iterator in iterators:
        close_iterator(iterator)
      close_checkpointer(self.checkpointer, raise_errors=finished)


def settle(config: ml_collections.ConfigDict, workdir: str, overrides: Sequence[str],
           compile_cache: bool = False) -> Run:
  """Distributed start-up (and, with `compile_cache`, the persistent compilation cache, before the first compile
  of this run), then `reconcile`: every check reads only; config.json and checkpoints/ are written once all of
  them have passed."""
  import parallel  # pylint: disable=g-import-not-at-top
  parallel.distributed.initialize(config.distributed)
  if compile_cache:
    from train.core import profiling  # pylint: disable=g-import-not-at-top
    profiling.enable_compile_cache(config.train.compile_cache)
  latest = reconcile(config, os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR), overrides)
  return Run(config, workdir, latest, config_dict(config))


def build_trainer(run: Run) -> None:
  """The mesh and the Trainer, which validates the model, mesh and batch settings before any work."""
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top
  try:
    run.mesh = mesh_lib.make_mesh(run.config.mesh, run.devices)
    run.trainer = step_lib.Trainer(run.config, run.mesh)
  except ValueError as e:  # MeshError and config checks: the message names the key
    raise SetupError(str(e)) from None


def resolve_data(run: Run) -> None:
  """config.data's sources, weights and objective mixture parsed once into the run's DataPlan."""
  from data import plan as plan_lib  # pylint: disable=g-import-not-at-top
  try:
    run.plan = plan_lib.resolve(run.config.data)
  except ValueError as e:
    raise SetupError(str(e)) from None


def check_data_kind(run: Run) -> None:
  """SetupError unless the objective and the data agree on pairs: reward/dpo read preference sources only."""
  from data import preference  # pylint: disable=g-import-not-at-top
  config = run.config
  pair_data = run.plan.has_preference
  pair_objective = set(run.trainer.batch_keys) == set(preference.BATCH_KEYS)
  if pair_objective and not pair_data:
    raise SetupError(f"config.train.objective={config.train.objective!r} trains on preference pairs but "
                     f"config.data.sources={config.data.sources!r} has no preference source; use "
                     "preference:PATH.jsonl (prompt/chosen/rejected lines) or builtin:preference")
  if pair_data and not pair_objective:
    raise SetupError(f"config.data.sources={config.data.sources!r} holds preference pairs, which "
                     f"config.train.objective={config.train.objective!r} cannot read; use train.objective=reward "
                     "or dpo")


def check_resume(run: Run) -> None:
  """A resumed run: its checkpoint must hold exactly the Trainer's state; a missing tokenizer file comes back
  (written by the primary process; every process opens the checkpoints, as orbax synchronises them there)."""
  if run.latest is None:
    return
  import configs  # pylint: disable=g-import-not-at-top
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  checkpointer = ckpt_lib.Checkpointer(run.checkpoint_dir, read_only=True)
  try:
    metadata = checkpointer.metadata(run.latest)
    cause = runconfig.layout_cause(run.trainer.config, metadata.get("config", {}))
    runconfig.check_state_layout(runconfig.layout(run.trainer.abstract_state()),
                                 checkpointer.state_layout(run.latest), f"{run.checkpoint_dir}/{run.latest}",
                                 cause=cause)
  except configs.ConfigError as e:
    raise SetupError(str(e)) from None
  finally:
    checkpointer.close()
  entry = metadata.get(TOKENIZER_KEY)
  if run.primary and entry and "base64" in entry:
    ckpt_lib.decode_file(entry, run.workdir)


def load_tokenizer(run: Run) -> None:
  """The run's tokenizer (data.tokenizer.prepare: trained on the plan's sources when absent), checked against
  config.model."""
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  try:
    run.tokenizer_path = tokenizer_lib.prepare(run.config, run.workdir, run.plan)
    run.tokenizer = tokenizer_lib.load(run.tokenizer_path)
  except (ValueError, FileNotFoundError) as e:
    raise SetupError(str(e)) from None


def init_state(run: Run) -> Any:
  """A fresh run's state (train.init_from's parameters when set, and the objective's frozen models of their own
  config loaded: `load_frozen_configs`); None when resuming."""
  if run.latest is not None:
    return None
  trainer, tc = run.trainer, run.config.train
  state = trainer.init(tc.seed)
  if tc.init_from:
    # with_model_params gives a frozen reference its own buffers (the step donates the state).
    state = trainer.with_model_params(state, init_from(trainer, tc.init_from))
  return load_frozen_configs(trainer, state)


def load_frozen_configs(trainer, state: Any) -> Any:
  """`state` with the weights of each of the objective's frozen models of their own config (`frozen_configs`, e.g.
  a distillation teacher) read from their directories onto the Trainer's shardings (`load_params`); each random
  placeholder is freed first, so the devices hold one copy of that model at a time."""
  for name, frozen in trainer.objective.frozen_configs.items():
    jax.tree.map(lambda a: a.delete(), state["frozen"][name])
    params = load_params(trainer, frozen.path, trainer.abstract_frozen_params(name), frozen.model, frozen.key,
                         f"the {name}'s model config (read from it)")
    state = trainer.with_frozen_params(state, name, params)
    print0(f"loaded the {name} from {frozen.path}")
  return state


def init_from(trainer, path: str) -> dict[str, Any]:
  """Model parameters (sharded like `trainer`'s) from a meshlm run/checkpoint directory or a Hugging Face
  directory; a meshlm run trained with LoRA gives its adapters merged into the weights. A QLoRA run
  (train.lora_base_quant) reads a Hugging Face directory's base kernels quantized while streaming."""
  return load_params(trainer, path, trainer.abstract_model_params(), trainer.config.model, quantize_base=True)


@functools.lru_cache(maxsize=None)
def _quantizer(lead: int, n_in: int, kind: str, double: bool) -> Callable:
  """A jitted quantizer of one layout (compiled once per kernel shape; eager ops would compile every primitive)."""
  from model import basequant  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda w: basequant.as_dict(basequant.quantize(w, lead, n_in, kind, double=double)))


def _base_quantizer(trainer) -> Callable | None:
  """hf.load's `transform` for a QLoRA run: each base kernel read one leading slice (layer) at a time in float32,
  quantized and kept only quantized, then placed on the frozen base's shardings; no float copy of a whole stacked
  kernel ever exists on the host. None without quantized kernels."""
  from model import basequant  # pylint: disable=g-import-not-at-top
  kernels = {"/".join(map(str, path)): (path, lead, n_in) for path, (lead, n_in) in trainer._base_kernels.items()}
  if not kernels:
    return None
  shardings = trainer.state_shardings["frozen"]["model"]

  def transform(name: str, shape: tuple, read: Callable) -> dict | None:
    if name not in kernels:
      return None
    path, lead, n_in = kernels[name]
    one = _quantizer(lead, n_in, trainer.base_quant, trainer.base_double_quant)
    rest = (slice(None),) * (len(shape) - 1)
    if not lead:
      children = jax.device_get(one(read(rest + (slice(None),))))
    else:  # layer by layer into one host buffer per child (the quantized size, once)
      children = None
      for i in range(shape[0]):
        part = jax.device_get(one(read((slice(i, i + 1),) + rest)))
        if children is None:
          children = {k: np.empty((shape[0],) + v.shape[1:], v.dtype) for k, v in part.items()}
        for k, v in part.items():
          children[k][i:i + 1] = v
    target = basequant._get(shardings, path)  # pylint: disable=protected-access
    return {k: jax.device_put(v, target[k]) for k, v in children.items()}
  return transform


def load_params(trainer, path: str, abstract: Any, model_cfg, key: str = "train.init_from",
                what: str = "config.model", quantize_base: bool = False) -> dict[str, Any]:
  """The parameters of a model of config `model_cfg` onto `abstract` (its parameter tree as ShapeDtypeStructs
  with shardings on `trainer`'s mesh) from a meshlm run/checkpoint directory (`restore_model_params`) or a Hugging
  Face directory (each device reading its own blocks). TrainingError naming `key` (the config key that gave `path`)
  and `what` (the config the parameters must fit)."""
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(path):
    raise TrainingError(f"{key}={path!r} is not a directory; give a meshlm run directory, a "
                        "checkpoints/<step> directory or a Hugging Face model directory")
  if not runconfig.is_hf_dir(path):
    directory, step = ckpt_lib.find_checkpoint_dir(path)
    try:
      return restore_model_params(ckpt_lib.Checkpointer(directory, read_only=True), step, abstract)
    except (ValueError, KeyError) as e:
      raise TrainingError(f"{key}={path!r}: its parameters do not fit {what} ({e}); use the "
                          "model config of the run it came from") from None
  return _hf_params(trainer, path, abstract, model_cfg, key, what, quantize_base)


def _hf_params(trainer, path: str, abstract: Any, m, key: str, what: str, quantize_base: bool = False
               ) -> dict[str, Any]:
  """A Hugging Face directory's weights for model config `m`, each device reading its own blocks, checked against
  `abstract`; with `quantize_base` a QLoRA run's base kernels come quantized (`_base_quantizer`)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import hf  # pylint: disable=g-import-not-at-top
  try:
    hf.check_compatible(m, path)  # names the differing config fields (hidden_size, ...) with both values
  except ValueError as e:
    raise TrainingError(f"{key}={path!r}: {e}") from None
  try:  # each device reads its own blocks of the weights: the model never passes whole through one host
    transform = _base_quantizer(trainer) if quantize_base else None
    loaded = hf.load(path, dtype=m.param_dtype, compute_dtype=m.dtype, scan_layers=m.scan_layers,
                     mesh=trainer.mesh, rules=trainer.rules, transform=transform)
    if transform is not None:
      abstract = trainer.abstract_state()["frozen"]["model"]
  except ValueError as e:  # a missing or truncated file, a tensor that does not fit: named in the message
    raise TrainingError(f"{key}={path!r}: {e}") from None
  params = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
  want = jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
  got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
  if want != got:
    raise TrainingError(f"{key}={path!r}: the Hugging Face model's parameters do not match {what}; set the "
                        "model keys from its config.json (model.hf.config_from_hf)")
  return jax.device_put(params, jax.tree.map(lambda a: a.sharding, abstract))


def _abstract_base(abstract: Any, saved: dict) -> tuple[Any, dict]:
  """(the frozen base as a LoRA run saved it, the quantized kernels' templates): `abstract` itself, or under
  train.lora_base_quant (QLoRA) its projection kernels as the stored quantized children, sharded as the run's
  trainer shards them (basequant.spec_tree of `abstract`'s specs)."""
  from model import basequant  # pylint: disable=g-import-not-at-top
  from model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  kind, double = saved.get("lora_base_quant", "none"), bool(saved.get("lora_base_double_quant", False))
  kernels = {path: (lead, n_in) for path, (_, lead, n_in) in
             lora_lib.kernels(abstract, tuple(lora_lib.TARGETS)).items()} if kind != "none" else {}
  templates = basequant.templates(abstract, kernels, kind, double)
  if not templates:
    return abstract, templates
  mesh = jax.tree.leaves(abstract)[0].sharding.mesh
  specs = basequant.spec_tree(jax.tree.map(lambda a: a.sharding.spec, abstract), kernels, templates, dict(mesh.shape))
  base = jax.eval_shape(lambda tree: basequant.quantize_params(tree, kernels, kind, double), abstract)
  on = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
  return jax.tree.map(on, base, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)), templates


def restore_model_params(checkpointer: ckpt_lib.Checkpointer, step: int | None, abstract: Any) -> Any:
  """The model weights of a meshlm checkpoint onto `abstract`'s shardings (ShapeDtypeStructs of the model's
  parameter tree); a LoRA run's (train.lora_rank > 0) come with its adapters merged in (W + scale * A @ B); a
  run with an objective head (reward) gives its trunk."""
  saved = checkpointer.metadata(step).get("config", {}).get("train", {})
  if not saved.get("lora_rank", 0):
    if any(k.startswith("params/model/") for k in checkpointer.state_layout(step)):  # beside a head (reward run)
      return checkpointer.restore_subtree({"params": {"model": abstract}}, step)["params"]["model"]
    return checkpointer.restore_subtree({"params": abstract}, step)["params"]
  from model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  rank, targets = int(saved["lora_rank"]), tuple(saved["lora_targets"])
  from model import basequant  # pylint: disable=g-import-not-at-top
  adapters = jax.eval_shape(lambda: lora_lib.init(jax.random.PRNGKey(0), abstract, targets, rank))
  first = jax.tree.leaves(abstract)[0].sharding
  replicated = jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
  base, templates = _abstract_base(abstract, saved)  # QLoRA: the kernels as stored, quantized
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  if not adapters:  # `abstract` (a part of the tree, as train.export restores it) holds no adapted kernel
    tree = checkpointer.restore_subtree({"frozen": {"model": base}}, step)["frozen"]["model"]
    return jax.jit(lambda t: basequant.dequantize_params(t, templates), out_shardings=shardings)(tree)
  adapters = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), adapters)
  tree = checkpointer.restore_subtree({"params": {"lora": adapters}, "frozen": {"model": base}}, step)
  scale = lora_lib.scale(saved["lora_alpha"], rank, bool(saved.get("lora_rslora", False)))
  merge = lambda t: lora_lib.merge(basequant.dequantize_params(t["frozen"]["model"], templates), t["params"]["lora"],
                                   scale)
  return jax.jit(merge, out_shardings=shardings)(tree)  # dequantized and merged shard by shard


# ---- writing: only once every check has passed ---------------------------------------------------------------
def write_config(run: Run) -> None:
  """WORKDIR/config.json (process 0): the config, and under "runtime" what the step runs on this machine (the
  kernels model.*_impl=auto chose, the platform; Trainer.runtime)."""
  if run.primary:
    write_json(os.path.join(run.workdir, "config.json"), {**run.config_dict, "runtime": run.trainer.runtime()})


def open_checkpoints(run: Run) -> None:
  """The run's checkpointer, and its tokenizer as checkpoint metadata (a Hugging Face directory is named, not
  copied)."""
  run.checkpointer = ckpt_lib.Checkpointer(run.checkpoint_dir, run.config.checkpoint)
  run.tokenizer_entry = (ckpt_lib.encode_file(run.tokenizer_path) if os.path.isfile(run.tokenizer_path)
                         else {"directory": run.tokenizer_path})


def restore(run: Run, data_iter: Any = None) -> tuple[Any, dict[str, Any]]:
  """(state, metadata) of the checkpoint resumed from, `data_iter` put back to its position. A checkpoint that
  does not fit -> TrainingError; on any failure `data_iter` and the checkpointer are closed first."""
  try:
    state, meta = run.checkpointer.restore(run.trainer.abstract_state(), data_iter, step=run.latest)
  except Exception as e:  # pylint: disable=broad-except
    close_iterator(data_iter)  # orbax's and grain's threads must not outlive the failed start
    close_checkpointer(run.checkpointer, raise_errors=False)
    if isinstance(e, ValueError):
      raise TrainingError(f"cannot resume from {run.checkpointer.directory}/{run.latest}: {e}") from None
    raise
  print0(f"resumed from {run.checkpointer.directory}/{run.latest}")
  return state, meta


def open_log(run: Run, total_steps: int, *iterators) -> None:
  """The metric logger (metrics.jsonl, TensorBoard, progress bar) from `run.start`; SetupError for a damaged
  metrics.jsonl (the message names the line), with `iterators` and the checkpointer closed."""
  try:
    run.log = logger_lib.MetricLogger(run.workdir, run.config.log, total_steps=total_steps, start_step=run.start,
                                      enabled=run.primary, run_config=run.config_dict)
  except ValueError as e:
    for iterator in iterators:
      close_iterator(iterator)
    close_checkpointer(run.checkpointer, raise_errors=False)
    raise SetupError(str(e)) from None


def close_iterator(iterator) -> None:
  """Closes a data iterator that has a close() (prefetch threads, worker processes); None is fine."""
  close = getattr(iterator, "close", None)
  if close is not None:
    close()


def close_checkpointer(checkpointer: ckpt_lib.Checkpointer, raise_errors: bool) -> None:
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
