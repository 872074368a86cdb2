"""`python -m train.lifecycle --config=lifecycle_tiny [--workdir DIR] [--from STAGE | --only STAGE]
[--config.STAGE.KEY=VALUE ...]`: raw text to an evaluated, exported model, one stage after another.

Stages run in the order `lifecycle.stages` gives, each in WORKDIR/<stage>/ by its own command (stages.py). The
state is WORKDIR/lifecycle.json: per stage its status (running / done), a digest of its settings and of the
stages it reads, its command and its seconds. Rerunning the command:
- skips a finished stage whose digest is unchanged;
- reruns a stage whose settings (or an input stage's) changed, and so every stage after it that reads it, saying
  so; the old output is moved to WORKDIR/.previous/<stage>/ (the one before that is deleted);
- resumes an interrupted stage (killed, or stopped by SIGINT / SIGTERM, which go to the stage's command) by running
  its command again, which resumes as it does on its own (training from its last checkpoint);
- `--from STAGE` reruns STAGE and everything after it, `--only STAGE` that stage alone (the stages it reads must be
  done).
Bad input (an unknown stage or key, a stage whose input stage is not in the sequence, a key for a stage that is not
in it) exits 2 before anything runs. After every stage WORKDIR/report.html is rewritten; the export stage writes
the model card (README.md) into the exported directory. On several hosts the same command runs on each, process
0 leading (pod.py).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

import ml_collections

from train.lifecycle import pod as pod_lib
from train.lifecycle import stages as stages_lib

STATE_FILE = "lifecycle.json"


class LifecycleError(ValueError):
  """Bad input: the message names the stage or key and the fix (exit 2, nothing run)."""


# ---- configuration -------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.lifecycle", description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="lifecycle_tiny", help="lifecycle config: a name under configs/ or a path")
  p.add_argument("--workdir", default="", help="where every stage writes (default: runs/<config name>)")
  part = p.add_mutually_exclusive_group()
  part.add_argument("--from", dest="from_", default="", metavar="STAGE", help="rerun STAGE and every later one")
  part.add_argument("--only", default="", metavar="STAGE", help="rerun STAGE alone")
  return p


def _set_command_key(section: ml_collections.ConfigDict, key: str, text: str) -> None:
  from configs import loader  # pylint: disable=g-import-not-at-top
  node = section.config
  *parents, leaf = key.split(".")
  for part in parents:
    if part not in node:
      node[part] = ml_collections.ConfigDict()
    node = node[part]
  try:
    node[leaf] = loader._parse_value(text)  # pylint: disable=protected-access  (the loader's one value parser)
  except (TypeError, AttributeError, KeyError) as e:  # the lifecycle config already gives the key another type
    raise LifecycleError(f"cannot set {key!r} to {text!r}: {e}") from None


def load(argv: Sequence[str] | None) -> tuple[ml_collections.ConfigDict, list[str], argparse.Namespace]:
  """(config with the overrides, the stage sequence, args); LifecycleError for anything that cannot run."""
  import configs  # pylint: disable=g-import-not-at-top
  from configs import loader  # pylint: disable=g-import-not-at-top
  args, rest = _parser().parse_known_args(argv)
  try:
    cfg = ml_collections.ConfigDict(loader.load_config_file(args.config).to_dict())
  except configs.ConfigError as e:
    raise LifecycleError(str(e)) from None
  given = set()
  try:
    overrides = loader.split_overrides(rest, "--config.pretrain.train.steps=100")
  except configs.ConfigError as e:
    raise LifecycleError(str(e)) from None
  for key, text in overrides:
    stage, _, sub = key.partition(".")
    if stage != "lifecycle" and stage not in stages_lib.STAGES:
      raise LifecycleError(f"--config.{key}: no stage {stage!r}; stages: {', '.join(stages_lib.STAGES)}")
    top = sub.split(".")[0]
    try:
      if stage == "lifecycle" or (top in stages_lib.STAGES[stage].own_keys and top != "config"):
        loader.apply_override(cfg, key, text)
      elif "config" in stages_lib.STAGES[stage].own_keys:
        _set_command_key(cfg[stage], sub[len("config."):] if top == "config" else sub, text)
      else:
        raise LifecycleError(f"--config.{key}: stage {stage!r} has no key {top!r}; its keys: "
                             f"{', '.join(stages_lib.STAGES[stage].own_keys)}")
    except configs.ConfigError as e:
      raise LifecycleError(str(e)) from None
    given.add(stage)
  sequence = _sequence(cfg)
  if cfg.lifecycle.get("pod_timeout_s", 900) <= 0:
    raise LifecycleError(f"lifecycle.pod_timeout_s={cfg.lifecycle.pod_timeout_s}: give the seconds each host waits "
                         "for the others (> 0)")
  absent = sorted(given - set(sequence) - {"lifecycle"})
  if absent:
    raise LifecycleError(f"keys given for {absent}, which lifecycle.stages={cfg.lifecycle.stages!r} does not run; "
                         "add the stage to lifecycle.stages or drop the keys")
  for stage in sequence:
    _check_command_keys(stage, cfg[stage], cfg)
  for flag, stage in (("--from", args.from_), ("--only", args.only)):
    if stage and stage not in sequence:
      raise LifecycleError(f"{flag} {stage}: not one of this lifecycle's stages ({', '.join(sequence)})")
  return cfg, sequence, args


def _sequence(cfg) -> list[str]:
  sequence = [s.strip() for s in cfg.lifecycle.stages.split(",") if s.strip()]
  unknown = [s for s in sequence if s not in stages_lib.STAGES]
  if unknown:
    raise LifecycleError(f"lifecycle.stages: unknown stages {unknown}; stages: {', '.join(stages_lib.STAGES)}")
  if len(set(sequence)) != len(sequence):
    raise LifecycleError(f"lifecycle.stages={cfg.lifecycle.stages!r} names a stage twice")
  for i, stage in enumerate(sequence):
    missing = [n for n in stages_lib.STAGES[stage].needs if n not in sequence[:i]]
    if missing:
      raise LifecycleError(f"stage {stage!r} reads the output of {missing}, which lifecycle.stages does not run "
                           f"before it; add them before {stage!r} or drop {stage!r}")
  for stage in ("evaluate", "export"):  # they act on the final models: every model stage comes before them
    later = [s for s in sequence[sequence.index(stage) + 1:] if s in stages_lib.POLICY] if stage in sequence else []
    if later:
      raise LifecycleError(f"lifecycle.stages puts {later} after {stage!r}; {stage!r} must follow every stage that "
                           "changes the model")
  if "evaluate" in sequence and "export" in sequence and sequence.index("export") < sequence.index("evaluate"):
    raise LifecycleError("lifecycle.stages puts 'export' before 'evaluate'; the model card carries the evaluation: "
                         "put 'evaluate' first")
  return sequence


def _check_command_keys(stage: str, section, cfg) -> None:
  """A stage's settings, checked as its command would check them, before anything runs."""
  import configs  # pylint: disable=g-import-not-at-top
  from configs import loader, validate  # pylint: disable=g-import-not-at-top
  keys = stages_lib.config_args_dict(section)
  try:
    if stage in stages_lib.TRAINING:
      config = configs.load(section.recipe, **dict(keys))
      validate.check(config, [k for k, _ in keys])
      if stage == "pretrain" and "tokenizer" in cfg and config.model.vocab_size != cfg.tokenizer.vocab_size:
        raise LifecycleError(f"tokenizer.vocab_size={cfg.tokenizer.vocab_size} but pretrain's model.vocab_size="
                             f"{config.model.vocab_size}: set --config.pretrain.model.vocab_size="
                             f"{cfg.tokenizer.vocab_size} (or the tokenizer's to the model's)")
    elif stage == "curate":
      curate = loader.load_config_file("curate")
      for k, v in keys:
        loader.apply_override(curate, k, v)
    elif stage == "tokenizer" and section.model_type not in ("bpe", "unigram"):
      raise LifecycleError(f"tokenizer.model_type={section.model_type!r}: use bpe or unigram")
    elif stage == "export" and section.dtype not in ("float32", "bfloat16", "float16"):
      raise LifecycleError(f"export.dtype={section.dtype!r}: use float32, bfloat16 or float16")
    elif stage == "evaluate":
      from evals import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
      if section.batch_size < 1 or section.per_family < 1 or section.max_new_tokens < 1:
        raise LifecycleError("evaluate.batch_size, per_family and max_new_tokens must be >= 1")
      for name, path in tasks_lib.parse_specs(section.tasks) if section.tasks else []:
        if not os.path.exists(path):
          raise LifecycleError(f"evaluate.tasks: {path}: no such file or directory (task {name})")
  except (configs.ConfigError, ValueError) as e:
    if isinstance(e, LifecycleError):
      raise
    raise LifecycleError(f"stage {stage!r}: {e}") from None


def _settings(stage: str, section) -> dict:
  """What a stage's output depends on: its section, for a training stage the whole config its recipe resolves to
  (an edited recipe file reruns the stage), for curation of the user's files their paths and sizes."""
  out = {"section": section.to_dict()}
  if stage == "curate" and section.input != "builtin":  # the user's files: added, removed or grown ones count
    import glob  # pylint: disable=g-import-not-at-top
    files = sorted({f for pattern in section.input.split(",") if pattern for f in glob.glob(pattern)})
    out["files"] = [(f, os.path.getsize(f)) for f in files]
  if stage in stages_lib.TRAINING:
    import configs  # pylint: disable=g-import-not-at-top
    out["config"] = configs.load(section.recipe, **dict(stages_lib.config_args_dict(section))).to_dict()
  return out


def digests(cfg, sequence: list[str]) -> dict[str, str]:
  """Per stage: sha256 of its settings and of the digests of the stages it reads."""
  out: dict[str, str] = {}
  for stage in sequence:
    payload = {"stage": stage, "settings": _settings(stage, cfg[stage]),
               "reads": {r: out[r] for r in stages_lib.reads(stage, sequence)}}
    out[stage] = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]
  return out


# ---- state ---------------------------------------------------------------------------------------------------
def _read_state(workdir: str) -> dict:
  path = os.path.join(workdir, STATE_FILE)
  if not os.path.exists(path):
    return {"records": {}, "evaluations": {}}
  with open(path) as f:
    return json.load(f)


def _write_state(workdir: str, state: dict) -> None:
  from data import files  # pylint: disable=g-import-not-at-top
  files.atomic_write(os.path.join(workdir, STATE_FILE), json.dumps(state, indent=1, default=str))


def say(message: str) -> None:
  print(f"[lifecycle] {message}", flush=True)


# ---- running -------------------------------------------------------------------------------------------------
class _Child:
  """The stage command being run; SIGINT / SIGTERM to the lifecycle go to it (it stops as it does on its own)."""
  proc: subprocess.Popen | None = None
  signalled: int = 0


def _die_with_parent() -> None:
  # A killed lifecycle takes its stage down with it (PR_SET_PDEATHSIG = 1), as a killed stage command would be.
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
  except OSError:
    pass


def _forward(signum, frame) -> None:
  del frame
  _Child.signalled = signum
  if _Child.proc is not None and _Child.proc.poll() is None:
    _Child.proc.send_signal(signum)


def _exit_code(rc: int) -> int:
  """A stage command's exit code as the lifecycle's: killed by signal N -> 128 + N; its own exit 2 (bad input to it)
  -> 1, since the lifecycle's 2 means that nothing ran."""
  return 128 - rc if rc < 0 else 1 if rc == 2 else rc


def run_command(argv: list[str], env: dict[str, str] | None = None) -> int:
  """Runs a stage command to its end (in `env`, default this process's); 128 + N when signal N reached the
  lifecycle (before or while it ran)."""
  if _Child.signalled:
    return 128 + _Child.signalled
  # its own process group: a terminal's Ctrl-C reaches the lifecycle only, which forwards it once
  _Child.proc = subprocess.Popen(argv, preexec_fn=_die_with_parent,  # pylint: disable=subprocess-popen-preexec-fn
                                 process_group=0, env=env)
  try:
    if _Child.signalled:  # arrived between the check and the start
      _Child.proc.send_signal(_Child.signalled)
    rc = _Child.proc.wait()
  finally:
    _Child.proc = None
  return 128 + _Child.signalled if _Child.signalled else _exit_code(rc)


def _move_aside(workdir: str, stage: str) -> None:
  out = os.path.join(workdir, stage)
  if not os.path.exists(out):
    return
  previous = os.path.join(workdir, ".previous", stage)
  if os.path.exists(previous):
    shutil.rmtree(previous)
  os.makedirs(os.path.dirname(previous), exist_ok=True)
  os.replace(out, previous)
  say(f"{stage}: its earlier output is in {previous}")


def _run_evaluate(workdir: str, cfg, sequence: list[str], state: dict, env: dict[str, str] | None) -> int:
  """Evaluates every model stage before `evaluate` whose evaluation is missing or was made of another version of
  that stage or with other evaluation settings (state["evaluated"]: model stage -> the digests it was made with)."""
  section = cfg.evaluate
  chat = next((s for s in ("sft", "dpo", "rl") if s in sequence), None)
  stages_lib.write_task_prompts(workdir, section, cfg[chat] if chat else None)
  heldout = cfg.curate.input == "builtin"
  made = state.setdefault("evaluated", {})
  h = hashlib.sha256(json.dumps(section.to_dict(), sort_keys=True).encode())
  for path in [stages_lib.tasks_path(workdir)] + ([stages_lib.heldout_path(workdir)] if heldout else []):
    with open(path, "rb") as f:
      h.update(f.read())
  settings = h.hexdigest()[:16]
  for model_stage in [s for s in sequence[:sequence.index("evaluate")] if s in stages_lib.POLICY]:
    # the model's own run (a forced rerun of an unchanged config is a new model) and the task set
    version = f"{state['records'][model_stage].get('run_id')}/{settings}"
    if made.get(model_stage) == version and os.path.exists(stages_lib.evaluation_path(workdir, model_stage)):
      say(f"evaluate: {model_stage} evaluated earlier, kept")
      continue
    say(f"evaluate: {model_stage}")
    state["evaluations"].pop(model_stage, None)  # until the new one exists, no figures for this model
    rc = run_command(stages_lib.evaluate_command(model_stage, workdir, section, heldout), env)
    if rc:
      return rc
    stages_lib.write_samples(workdir, model_stage, section.samples)
    state["evaluations"][model_stage] = stages_lib.evaluation_path(workdir, model_stage)
    made[model_stage] = version
    _write_state(workdir, state)
  return 0


def run_stage(stage: str, workdir: str, cfg, sequence: list[str], state: dict, record: dict,
              pod: pod_lib.Pod | None) -> int:
  """Runs (or resumes) one stage; returns its exit code (0 when it finished). On a pod a training stage runs on
  every host, any other on this one (process 0) alone."""
  env = None
  if pod is not None and stage not in stages_lib.TRAINING:
    pod.tell({"stage": stage, "action": "on process 0"})
    env = pod_lib.single_host_env()
  if stage == "curate" and cfg.curate.input == "builtin":
    record["raw"] = stages_lib.write_raw(workdir, cfg.curate)
  if stage == "evaluate":
    return _run_evaluate(workdir, cfg, sequence, state, env)
  argv = stages_lib.command(stage, workdir, cfg, sequence)
  record["command"] = argv
  _write_state(workdir, state)
  if pod is not None and stage in stages_lib.TRAINING:
    return pod.run_everywhere(stage, argv, run_command)
  return run_command(argv, env)


def _plan(sequence, records, current, args) -> dict[str, str]:
  """What happens to each stage: "skip" (done, unchanged), "run", "resume" or "rerun" (changed or asked for)."""
  forced = set(sequence[sequence.index(args.from_):]) if args.from_ else {args.only} if args.only else set()
  plan = {}
  for stage in sequence:
    rec = records.get(stage)
    if args.only and stage != args.only:
      plan[stage] = "skip"
    elif stage in forced or (rec and rec["digest"] != current[stage]):
      plan[stage] = "rerun" if rec else "run"
    elif rec and rec["status"] == "stale":
      plan[stage] = "rerun"
    elif rec and rec["status"] == "done":
      plan[stage] = "skip"
    else:
      plan[stage] = "resume" if rec else "run"
  if args.only:
    missing = [s for s in stages_lib.reads(args.only, sequence)
               if not (records.get(s, {}).get("status") == "done" and records[s]["digest"] == current[s])]
    if missing:
      raise LifecycleError(f"--only {args.only}: the stages it reads are not done with this config: {missing}; "
                           f"run them first (e.g. --from {missing[0]})")
  return plan


def _mark_stale(stage: str, sequence: list[str], records: dict) -> None:
  """After `stage` was rerun alone (--only), every later stage reading it, directly or not, is stale: the next run
  reruns it."""
  changed = {stage}
  for later in sequence[sequence.index(stage) + 1:]:
    if changed & set(stages_lib.reads(later, sequence)):
      changed.add(later)
      if later in records:
        records[later]["status"] = "stale"


def workdir_of(args) -> str:
  return os.path.abspath(args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0]))


def run(cfg, sequence: list[str], args, current: dict[str, str], pod: pod_lib.Pod | None = None) -> int:
  """Every stage in order (see the module docstring); the exit code of the first that did not finish, else 0.
  `current`: the stages' digests; `pod`: process 0's connections to the other hosts, if any."""
  workdir = workdir_of(args)
  os.makedirs(workdir, exist_ok=True)
  state = _read_state(workdir)
  records = state["records"]
  plan = _plan(sequence, records, current, args)
  state.update(name=os.path.splitext(os.path.basename(args.config))[0], stages=sequence,
               training_stages=[s for s in sequence if s in stages_lib.TRAINING],
               license=cfg.lifecycle.license)
  for i, stage in enumerate(sequence, 1):
    what = plan[stage]
    if what == "skip":
      if pod is not None:
        pod.tell({"stage": stage, "action": "done earlier, skipped"})
      if not args.only:
        say(f"{i}/{len(sequence)} {stage}: done earlier, skipped")
      continue
    if what == "rerun":
      why = "asked for" if args.from_ or args.only else "its config or an input stage changed"
      say(f"{i}/{len(sequence)} {stage}: {why}; rerunning it" + ("" if args.only else " and the stages after it"))
      _move_aside(workdir, stage)
    elif what == "resume":
      say(f"{i}/{len(sequence)} {stage}: interrupted earlier, resuming")
    say(f"{i}/{len(sequence)} {stage}: start")
    if _Child.signalled:
      break
    record = records[stage] = {"run_id": time.time_ns(), **(records.get(stage, {}) if what == "resume" else {}),
                               "status": "running", "digest": current[stage],
                               "settings": dict(stages_lib.flat_overrides(cfg[stage])),
                               "dir": os.path.join(workdir, stage)}
    start = time.perf_counter()
    _write_state(workdir, state)
    rc = run_stage(stage, workdir, cfg, sequence, state, record, pod)
    record["seconds"] = record.get("seconds", 0.0) + time.perf_counter() - start
    if rc:
      _write_state(workdir, state)
      _report(workdir, state)
      say(f"{stage}: stopped (exit {rc}) after {record['seconds']:.0f} s; run the same command to resume")
      return rc
    record["status"] = "done"
    if args.only:
      _mark_stale(stage, sequence, records)
    _write_state(workdir, state)
    if stage == "export":
      from train.lifecycle import card  # pylint: disable=g-import-not-at-top
      card.write_model_card(os.path.join(workdir, "export"), state, workdir)
    _report(workdir, state)
    say(f"{i}/{len(sequence)} {stage}: done in {record['seconds']:.1f} s")
  if _Child.signalled:
    say(f"stopped by signal {_Child.signalled}; run the same command to resume")
    return 128 + _Child.signalled
  print(summary(workdir, state), flush=True)
  return 0


def _report(workdir: str, state: dict) -> None:
  from train.lifecycle import report  # pylint: disable=g-import-not-at-top
  report.write_report(workdir, state)


def summary(workdir: str, state: dict) -> str:
  """The console's closing table: stage, status, seconds; then the per-stage evaluation table."""
  from train.lifecycle import report  # pylint: disable=g-import-not-at-top
  lines = [f"{'stage':10} {'status':8} {'seconds':>9}"]
  for stage in state["stages"]:
    rec = state["records"].get(stage, {})
    lines.append(f"{stage:10} {rec.get('status', 'not run'):8} {rec.get('seconds', 0.0):9.1f}")
  columns, rows = report.evaluation_table(state)
  if rows:
    lines += ["", "  ".join(columns)]
    lines += ["  ".join(str(v if not isinstance(v, float) else f"{v:.4g}") for v in row) for row in rows]
  lines.append(f"\nreport: {os.path.join(workdir, 'report.html')}")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  try:
    cfg, sequence, args = load(sys.argv[1:] if argv is None else argv)
  except LifecycleError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _Child.signalled = 0
  previous = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
  pod, rc = None, 1
  try:
    current = digests(cfg, sequence)
    pod = pod_lib.join(cfg.lifecycle, current, sequence, workdir_of(args), args)
    if pod is not None and not pod.leader:
      return pod_lib.follow(pod, run_command)
    if pod is not None:
      pod_lib.accepted(pod)
    rc = run(cfg, sequence, args, current, pod)
    return rc
  except (LifecycleError, pod_lib.PodError) as e:
    print(f"error: {e}", file=sys.stderr)
    rc = 2
    return rc
  finally:
    if pod is not None and pod.leader:
      pod.close(rc)
    for s, handler in previous.items():
      signal.signal(s, handler)
