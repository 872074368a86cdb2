"""Ahead-of-time compilation of the real train step for a TPU slice, on a machine without TPUs.

`python -m train.compile --config=llama2_7b --topology=v4-64 [--num_slices=N] [--config.mesh.fsdp=-1 ...]
[--fastest] [--json]` lowers and compiles `train.core.step.Trainer(config, mesh).step_fn` (the jitted step that
training runs) for abstract TPU devices from `jax.experimental.topologies` (libtpu's compiler; no weights are
allocated), and reports per-chip memory against the chip's HBM, model and compiled FLOPs, collectives by kind,
the compile time, the planner's estimate, and the predicted step time and MFU (train/planning/predict.py). When the step
does not fit it searches remat policies and grad_accum values by compiling them and exits 1 with the lightest
candidate that fits; `--fastest` compiles candidate meshes and remat policies and reports the predicted-fastest
layout that fits. See docs/planning.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import sys
import time
import warnings
from typing import Sequence

import ml_collections

import configs
from train.planning import hardware
from train.planning import memory
from train.planning import predict
from train.planning.hlo import collective_ops, collectives, matmuls  # noqa: F401  (the report's readers, re-exported)

class NoTpuCompiler(RuntimeError):
  """libtpu (the TPU compiler) is missing or cannot describe the requested topology."""


def _libtpu_installed() -> bool:
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None


def abstract_devices(tpu: hardware.TpuSlice) -> list:
  """The slice's compile-only TPU devices (libtpu must be installed; no TPU needs to be attached).

  Raises NoTpuCompiler naming the fix when libtpu is missing or rejects the topology.
  """
  install = ("pip install -c constraints.txt libtpu (or the project's `tpu` extra: pip install -c constraints.txt "
             "-e '.[tpu]')")
  if not _libtpu_installed():
    raise NoTpuCompiler(f"ahead-of-time compilation for {tpu.topology} needs the TPU compiler, which is not "
                        f"installed: {install}")
  from jax.experimental import topologies
  # Compile-only use never owns TPU chips, so several processes (pytest workers, a search) may load libtpu.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from train.__main__ import _accelerator_devices  # pylint: disable=g-import-not-at-top
  if not _accelerator_devices():  # a CPU host: libtpu's start-up would warn that it finds no TPU host to join
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v4-8")
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=tpu.topology,
                                             **tpu.topology_kwargs()).devices)
  except RuntimeError as e:
    raise NoTpuCompiler(f"cannot build TPU topology {tpu.topology!r}: {e}. Ahead-of-time compilation needs the "
                        f"TPU compiler: {install}") from e


# ---- compiling -----------------------------------------------------------------------------------------
def compile_trainer(config: ml_collections.ConfigDict, devices: list):
  """(trainer, compiled): `Trainer(config, mesh).compiled()`, i.e. `step_fn.lower(abstract_state(),
  abstract_batch()).compile()` on a mesh of `devices` -- the same jitted function that training runs."""
  from parallel import mesh as mesh_lib
  from train.core import step

  trainer = step.Trainer(config, mesh_lib.make_mesh(config.mesh, devices=devices))
  return trainer, trainer.compiled()


_GIGS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _oom_bytes(message: str) -> tuple[float | None, float | None]:
  """(required, available) bytes from libtpu's "...required for HLO temporaries (39.96G) exceeds available HBM
  (30.75G)" message; None where absent."""
  found = [float(v) * _GIGS[u] for v, u in re.findall(r"\((\d+(?:\.\d+)?)([KMGT])\)", message)]
  return (found[0], found[1]) if len(found) >= 2 else (None, None)


def compile_step(config: ml_collections.ConfigDict, tpu: hardware.TpuSlice, devices: list | None = None) -> dict:
  """Compiles the train step of `config` for `tpu` and returns the report (a JSON-ready dict; bytes per chip).

  A program that the TPU compiler rejects for lack of HBM is reported with "fits": False and the compiler's
  figures ("memory": {"error", "temp_bytes" = total_bytes = required, "available_bytes"}).
  """
  import jax

  devices = abstract_devices(tpu) if devices is None else devices
  start = time.perf_counter()
  try:
    trainer, _ = compile_trainer(config, devices)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    required, available = _oom_bytes(str(e))
    sizes = memory.mesh_sizes(config, len(devices))
    return _report(config, tpu, sizes, len(devices), time.perf_counter() - start, fits=False, memory_={
        "error": str(e).strip().splitlines()[0], "temp_bytes": required, "total_bytes": required,
        "available_bytes": available}, flops=None, hlo="")
  return summarize(config, tpu, trainer, time.perf_counter() - start)


def summarize(config: ml_collections.ConfigDict, tpu: hardware.TpuSlice, trainer, seconds: float) -> dict:
  """The report of a compiled Trainer (`trainer.compiled()` is cached, so this compiles nothing new)."""
  compiled = trainer.compiled()
  mem = trainer.memory_analysis()
  mem["generated_code_bytes"] = int(compiled.memory_analysis().generated_code_size_in_bytes)
  mem["total_bytes"] += mem["generated_code_bytes"]
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return _report(config, tpu, dict(trainer.mesh.shape), trainer.mesh.devices.size, seconds,
                 fits=mem["total_bytes"] <= tpu.chip.hbm_bytes, memory_=mem,
                 flops=cost.get("flops"), hlo=compiled.as_text())


def matmul_types(hlo: str) -> dict[str, int]:
  """Matmul instructions of the compiled program by operand and result type, e.g. {"s8 x s8 -> s32": 7}: with
  model.quant=int8 the quantised projections show as s8 x s8 -> s32 (the MXU's integer path)."""
  counts: dict[str, int] = {}
  for m in matmuls(hlo):
    key = f"{m['operands'][0]} x {m['operands'][-1]} -> {m['result']}"
    counts[key] = counts.get(key, 0) + 1
  return dict(sorted(counts.items()))


def _report(config, tpu, sizes, devices, seconds, *, fits, memory_, flops, hlo) -> dict:
  from train.planning import mfu

  t = config.train
  model_flops = mfu.flops_per_step(config.model, t.seq_len, t.batch_size) / devices
  report = {
      "topology": tpu.topology, "num_slices": tpu.num_slices, "chip": tpu.chip.name, "num_devices": devices,
      "mesh": sizes, "remat": t.remat, "grad_accum": t.grad_accum, "batch_size": t.batch_size,
      "micro_batch": t.batch_size // t.grad_accum, "seq_len": t.seq_len,
      "memory": memory_, "hbm_bytes": tpu.chip.hbm_bytes, "fits": fits,
      "estimate": _estimate(config, sizes, tpu.chip.platform),
      "flops": {"model_per_chip": model_flops, "compiled_per_chip": flops},
      "collectives": collectives(hlo),
      "matmuls": matmul_types(hlo),
      "compile_seconds": seconds,
  }
  pipe = memory.pipeline_schedule(config, sizes)
  if pipe:  # the stage-to-stage traffic: collective-permutes (with the step's other collectives above)
    permutes = [op for op in collective_ops(hlo, devices) if op["kind"] == "collective-permute"] if hlo else []
    report["pipeline"] = dict(pipe, collective_permutes=[
        {k: op[k] for k in ("name", "shapes", "bytes", "per_step", "async")} for op in permutes])
  report["predicted"] = predict.for_report(hlo, report, tpu.chip, tpu.torus) if hlo else None
  return report


def _estimate(config: ml_collections.ConfigDict, sizes: dict[str, int], platform: str = "tpu") -> dict:
  """The planner's per-device figures for the same config and mesh (train/planning/memory.py), split as the compiler
  splits them: arguments = weights + optimizer state; temporaries = gradients + activations."""
  import model
  state = memory.meshlm_state(config, model.count_params(config.model)["total"], sizes)
  t = config.train
  acts = memory.activation_memory(config, t.batch_size // t.grad_accum, sizes=sizes, platform=platform)
  return {"argument_bytes": state["weights"] + state["optimizer"],
          "temp_bytes": state["gradients"] + acts["total"], "activation_bytes": acts["total"],
          "total_bytes": state["total"] + acts["total"]}


def _with(config: ml_collections.ConfigDict, **train) -> ml_collections.ConfigDict:
  c = copy.deepcopy(config)
  with c.unlocked():
    c.train.update(train)
  return c


def _policies_light_to_heavy(config: ml_collections.ConfigDict, sizes: dict[str, int],
                             platform: str = "tpu") -> list[str]:
  """Every remat policy of model.remat, ordered by the planner's activation estimate, most memory (least
  recompute) first; `full` last. A policy the planner has no activation model for is still searched, placed just
  before `full`, with a warning naming it."""
  from model import remat
  micro = config.train.batch_size // config.train.grad_accum
  known = [p for p in remat.POLICIES if p != "full" and p in memory.SAVED_BY_POLICY]
  unknown = [p for p in remat.POLICIES if p != "full" and p not in memory.SAVED_BY_POLICY]
  if unknown:
    warnings.warn(f"remat policies {unknown} have no activation estimate in train/planning/memory.py; the fit search "
                  "tries them just before 'full'", stacklevel=2)
  known.sort(key=lambda p: -memory.activation_memory(config, micro, remat=p, sizes=sizes,
                                                     platform=platform)["total"])
  return known + unknown + ["full"]


def _grad_accum_candidates(config: ml_collections.ConfigDict, rows: int) -> list[int]:
  """grad_accum values from the configured one upward (doubling) whose micro-batch splits over `rows`."""
  t, out, ga = config.train, [], config.train.grad_accum
  while ga <= t.batch_size:
    if t.batch_size % ga == 0 and (t.batch_size // ga) % rows == 0:
      out.append(ga)
    ga *= 2
  return out


def suggest(config: ml_collections.ConfigDict, tpu: hardware.TpuSlice, *, max_compiles: int = 12,
            devices: list | None = None) -> dict:
  """Finds, by compiling, the lightest remat policy and smallest grad_accum that fit (as MaxText's estimator).

  For each grad_accum (the configured one, then doubled while the micro-batch still splits over data x fsdp),
  compile with `full` remat; once that fits, binary-search the policies ordered light to heavy (by the planner's
  activation estimate) for the lightest that fits, and suggest, of the fitting policies compiled at that
  grad_accum, the one with the smallest predicted step time (usually the lightest). Returns {"found", "remat",
  "grad_accum", "micro_batch", "report" (of the suggestion), "tried": [{"remat", "grad_accum", "total_bytes",
  "fits", "step_seconds"}]}.
  """
  devices = abstract_devices(tpu) if devices is None else devices
  sizes = memory.mesh_sizes(config, len(devices))
  policies = _policies_light_to_heavy(config, sizes, tpu.chip.platform)
  tried: list[dict] = []
  reports: dict[tuple[str, int], dict] = {}

  def fits(remat: str, ga: int) -> bool | None:
    if (remat, ga) not in reports:
      if len(tried) >= max_compiles:
        return None
      r = compile_step(_with(config, remat=remat, grad_accum=ga), tpu, devices)
      reports[(remat, ga)] = r
      tried.append({"remat": remat, "grad_accum": ga, "total_bytes": r["memory"]["total_bytes"],
                    "fits": r["fits"], "step_seconds": (r.get("predicted") or {}).get("step_seconds")})
    return reports[(remat, ga)]["fits"]

  pipe = memory.pipeline_schedule(config, sizes)  # each accumulation step is split again into M microbatches
  for ga in _grad_accum_candidates(config, memory.batch_shards(sizes) * (pipe["microbatches"] if pipe else 1)):
    ok = fits("full", ga)
    if ok is None:
      break
    if not ok:
      continue
    lo, hi = 0, len(policies) - 1  # policies[hi] fits; find the smallest index that fits
    while lo < hi:
      mid = (lo + hi) // 2
      ok = fits(policies[mid], ga)
      if ok is None:
        break
      lo, hi = (lo, mid) if ok else (mid + 1, hi)
    fitting = [(reports[(p, ga)]["predicted"]["step_seconds"], i) for i, p in enumerate(policies)
               if reports.get((p, ga), {}).get("fits") and reports[(p, ga)].get("predicted")]
    best = policies[min(fitting)[1] if fitting else hi]
    return {"found": True, "remat": best, "grad_accum": ga, "micro_batch": config.train.batch_size // ga,
            "report": reports[(best, ga)], "tried": tried}
  return {"found": False, "tried": tried}


# ---- the fastest layout that fits -----------------------------------------------------------------------
# Recomputed forward FLOPs per layer (fraction of one forward) by remat policy, for ordering candidates only:
# `full` recomputes the whole layer, the name-saving policies part of it, `none` nothing.
_RECOMPUTE_ORDER = ("none", "save_dots", "save_qkv_mlp_in", "save_attn", "minimal", "save_dot_except_mlpwi",
                    "save_qkv_proj", "save_out_proj", "full")


def layouts(config: ml_collections.ConfigDict, num_devices: int, *,
            remats: Sequence[str] = ("none", "save_dots", "minimal", "full")) -> list[dict]:
  """Candidate layouts for `num_devices` chips as config overrides ({"mesh.data", "mesh.fsdp", "mesh.tensor",
  "train.remat"}), in the order the search compiles them: least recomputation first, then least tensor
  parallelism, then least pure data parallelism. Meshes: fsdp over all chips; tensor = 2, 4, 8 (when heads,
  kv heads and mlp divide) with fsdp over the rest; data = 2, 4, ... with fsdp over the rest; every mesh's
  data x fsdp must divide the micro-batch. `fastest` checks each before compiling it (`layout_error`, and the
  planner's estimate, a lower bound of the compiled figure, against the chip's HBM)."""
  m, t = config.model, config.train
  micro = t.batch_size // t.grad_accum
  meshes = []
  for tensor in (1, 2, 4, 8):
    if num_devices % tensor or (tensor > 1 and (m.num_heads % tensor or m.num_kv_heads % tensor
                                                or m.mlp_dim % tensor)):
      continue
    rest = num_devices // tensor
    data = 1
    while data <= rest:
      if rest % data == 0 and micro % rest == 0 and (tensor == 1 or data == 1):
        meshes.append({"mesh.data": data, "mesh.fsdp": rest // data, "mesh.tensor": tensor})
      data *= 2
  out = []
  for remat in sorted(remats, key=_RECOMPUTE_ORDER.index):
    for mesh in sorted(meshes, key=lambda x: (x["mesh.tensor"], x["mesh.data"])):
      out.append({**mesh, "train.remat": remat})
  return out


def _apply(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  c = copy.deepcopy(config)
  with c.unlocked():
    for key, value in overrides.items():
      section, name = key.split(".")
      c[section][name] = value
    c.mesh.sequence, c.mesh.dcn_fsdp = 1, 1
  return c


def layout_error(config: ml_collections.ConfigDict, devices: list) -> str | None:
  """Why `config`'s layout cannot run on `devices`, or None when it can: the message of the checks the Trainer
  makes before it compiles anything (mesh sizes against the devices, rows per process -- only the batch's axes
  may span hosts --, heads and dimensions against their mesh axes, micro-batch against data x fsdp). Builds the
  mesh and the abstract state only (a fraction of a second even for a 70B model); nothing is compiled."""
  from parallel import mesh as mesh_lib
  from train.core import step

  with warnings.catch_warnings():  # a placement warning is given again by the compile, if it comes to one
    warnings.simplefilter("ignore")
    try:
      step.Trainer(config, mesh_lib.make_mesh(config.mesh, devices=devices))
    except ValueError as e:
      return str(e)
  return None


def _over_hbm(config: ml_collections.ConfigDict, tpu: hardware.TpuSlice, num_devices: int) -> str | None:
  """Why the planner's estimate rules `config` out (a lower bound of the compiled figure), or None."""
  import model
  sizes = memory.mesh_sizes(config, num_devices)
  micro = config.train.batch_size // config.train.grad_accum
  need = (memory.meshlm_state(config, model.count_params(config.model)["total"], sizes)["total"]
          + memory.activation_memory(config, micro, sizes=sizes, platform=tpu.chip.platform)["total"])
  if need <= tpu.chip.hbm_bytes:
    return None
  return (f"planner estimate {need / 2**30:.1f} GiB per chip exceeds the chip's {tpu.chip.hbm_bytes / 2**30:.0f} "
          "GiB of HBM")


def fastest(config: ml_collections.ConfigDict, tpu: hardware.TpuSlice, *, max_compiles: int = 8,
            devices: list | None = None, remats: Sequence[str] = ("none", "save_dots", "minimal", "full")) -> dict:
  """Compiles candidate layouts (see `layouts`) and picks the one with the smallest predicted step time that
  fits. Returns {"found", "overrides" (of the winner), "report" (its compile report), "tried": [{"overrides",
  "fits", "total_bytes", "step_seconds", "mfu"}], "skipped": [{"overrides", "reason"}]}; at most `max_compiles`
  compiles.

  Before compiling, each candidate goes through the Trainer's own checks (`layout_error`: e.g. on a multi-host
  slice, tensor parallelism wider than one host's chips would make hosts share batch rows, which training
  rejects) and the planner's memory estimate; those that fail are listed in "skipped" with the reason and cost
  no compile, so the search ends with the fastest layout that can run on the topology."""
  devices = abstract_devices(tpu) if devices is None else devices
  chips = len(devices) // max(tpu.num_slices, 1)
  tried, skipped, best = [], [], None
  for overrides in layouts(config, chips, remats=remats):
    candidate = _apply(config, overrides)
    with candidate.unlocked():
      candidate.mesh.dcn_data = tpu.num_slices
    reason = layout_error(candidate, devices) or _over_hbm(candidate, tpu, len(devices))
    if reason:
      skipped.append({"overrides": overrides, "reason": reason})
      continue
    if len(tried) >= max_compiles:
      break
    r = compile_step(candidate, tpu, devices)
    p = r.get("predicted") or {}
    tried.append({"overrides": overrides, "fits": r["fits"], "total_bytes": r["memory"]["total_bytes"],
                  "step_seconds": p.get("step_seconds"), "mfu": p.get("mfu")})
    if r["fits"] and p and (best is None or p["step_seconds"] < best[1]["predicted"]["step_seconds"]):
      best = (overrides, r)
  if best is None:
    return {"found": False, "tried": tried, "skipped": skipped}
  return {"found": True, "overrides": best[0], "report": best[1], "tried": tried, "skipped": skipped}


# ---- command line --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m train.compile", description=__doc__.split("\n\n")[0],
      epilog="Also takes --config=FILE (a path or a name under configs/) and --config.SECTION.KEY=VALUE overrides, "
             "as python -m train does.")
  p.add_argument("--topology", required=True,
                 help="TPU slice: v4-32 (TensorCores; 16 chips), v5p-16, v5e-16, v6e-16 (chips), raw v4:2x2x4, or "
                      "local (the attached GPUs, e.g. 8 x H100, compiled by XLA's GPU compiler)")
  p.add_argument("--num_slices", type=int, default=1, help="slices joined over DCN (multi-slice)")
  p.add_argument("--max_compiles", type=int, default=12, help="compile budget of the fit / fastest search")
  p.add_argument("--fastest", action="store_true",
                 help="compile candidate meshes and remat policies and report the predicted-fastest that fits")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Exit status: 0 fits, 1 does not fit (a suggestion is printed when one was found), 2 bad input or no TPU
  compiler."""
  parser = _parser()
  try:
    config, args = configs.parse(sys.argv[1:] if argv is None else argv, parser)
    if args.topology == "local":  # the attached GPUs (XLA's GPU compiler), predicted with their data sheet
      import jax
      devices = jax.devices()
      tpu = hardware.local_slice(devices)
    else:
      tpu = hardware.tpu_slice(args.topology, args.num_slices)
      if tpu.num_slices > 1 and config.mesh.dcn_data == 1 and config.mesh.dcn_fsdp == 1:
        configs.apply_override(config, "mesh.dcn_data", str(tpu.num_slices))  # data parallelism across slices
      devices = abstract_devices(tpu)
    if args.fastest:
      search = fastest(config, tpu, max_compiles=args.max_compiles, devices=devices)
      report = search.pop("report") if search["found"] else compile_step(config, tpu, devices)
      report["fastest"] = search
    else:
      report = compile_step(config, tpu, devices)
  except (configs.ConfigError, ValueError, NoTpuCompiler) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not report["fits"]:
    report["suggestion"] = suggest(config, tpu, max_compiles=args.max_compiles, devices=devices)
  print(json.dumps(report) if args.json else format_report(report))
  return 0 if report["fits"] else 1


def format_report(r: dict) -> str:
  """The human-readable form of a compile report (see compile_step)."""
  gib = 2**30
  m, e = r["memory"], r["estimate"]
  mesh = " ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
  lines = [
      f"{r['topology']} x {r['num_slices']} slice(s): {r['num_devices']} x {r['chip']} ({r['hbm_bytes'] / gib:.0f}"
      f" GiB each); mesh {mesh}; remat {r['remat']}, grad_accum {r['grad_accum']} (micro-batch "
      f"{r['micro_batch']} x {r['seq_len']} tokens)",
      f"compiled in {r['compile_seconds']:.1f} s",
  ]
  if "error" in m:
    lines.append(f"the TPU compiler refused the program: {m['error']}")
    lines.append(f"  planner estimate: {e['total_bytes'] / gib:.3f} GiB per chip (weights + optimizer "
                 f"{e['argument_bytes'] / gib:.3f}, gradients + activations {e['temp_bytes'] / gib:.3f})")
  else:
    lines += [
        "per-chip memory (GiB)    compiled   planner",
        f"  arguments           {m['argument_bytes'] / gib:10.3f}{e['argument_bytes'] / gib:10.3f}  (weights, "
        "optimizer state, batch)",
        f"  outputs             {m['output_bytes'] / gib:10.3f}  (aliased with donated arguments: "
        f"{m['alias_bytes'] / gib:.3f})",
        f"  temporaries         {m['temp_bytes'] / gib:10.3f}{e['temp_bytes'] / gib:10.3f}  (gradients, "
        f"activations {e['activation_bytes'] / gib:.3f})",
        f"  generated code      {m['generated_code_bytes'] / gib:10.3f}",
        f"  total               {m['total_bytes'] / gib:10.3f}{e['total_bytes'] / gib:10.3f}  of "
        f"{r['hbm_bytes'] / gib:.0f}: {'FITS' if r['fits'] else 'DOES NOT FIT'}",
        f"FLOPs per chip per step: model {r['flops']['model_per_chip']:.4g}, compiled (XLA cost analysis) "
        f"{r['flops']['compiled_per_chip']:.4g}",
        "collectives              ops  per step  MiB per step",
    ]
    for kind, c in r["collectives"].items():
      lines.append(f"  {kind:20}{c['ops']:7d}{c['per_step']:10d}{c['bytes_per_step'] / 2**20:14.2f}")
    if not r["collectives"]:
      lines.append("  (none)")
    if r.get("matmuls"):
      lines.append("matmul instructions by type: " + ", ".join(f"{k}: {n}" for k, n in r["matmuls"].items()))
    pipe = r.get("pipeline")
    if pipe:
      lines.append(f"pipeline: {pipe['stages']} stages, {pipe['microbatches']} microbatches, {pipe['repeats']} "
                   f"repeat(s), bubble {pipe['bubble']:.1%}; collective-permutes (per step, MiB each, async):")
      for op in pipe["collective_permutes"]:
        lines.append(f"  {op['name'][:40]:40}{op['per_step']:7d}{op['bytes'] / 2**20:10.3f}  "
                     f"{'async' if op['async'] else 'sync'}")
    lines += format_prediction(r["predicted"])
  fast = r.get("fastest")
  if fast is not None:
    lines.append("fastest-layout search (compiled; predicted step time):")
    for t in fast["tried"]:
      o = t["overrides"]
      time_ = f"{t['step_seconds']:.3f} s, MFU {t['mfu']:.1%}" if t["step_seconds"] else "-"
      lines.append(f"  data={o['mesh.data']:<4d} fsdp={o['mesh.fsdp']:<5d} tensor={o['mesh.tensor']:<3d} "
                   f"remat={o['train.remat']:10} {t['total_bytes'] / gib:8.3f} GiB  "
                   f"{'fits' if t['fits'] else 'no  '}  {time_}")
    lines += _format_skipped(fast.get("skipped", []))
    if fast["found"]:
      lines.append("fastest that fits: " + " ".join(f"--config.{k}={v}" for k, v in fast["overrides"].items()))
    else:
      lines.append("no compiled layout fits; the report above is of the configured layout")
  sug = r.get("suggestion")
  if sug is not None:
    for t in sug["tried"]:
      lines.append(f"  tried remat={t['remat']:16} grad_accum={t['grad_accum']:<4d} "
                   f"{t['total_bytes'] / gib:8.3f} GiB  {'fits' if t['fits'] else 'no  '}"
                   + (f"  predicted {t['step_seconds']:.3f} s" if t.get("step_seconds") else ""))
    if sug["found"]:
      lines.append(f"suggestion: --config.train.remat={sug['remat']} --config.train.grad_accum={sug['grad_accum']}"
                   f" (micro-batch {sug['micro_batch']}; compiled: {sug['report']['memory']['total_bytes'] / gib:.3f}"
                   " GiB per chip)")
    else:
      lines.append("nothing tried fits: shard the state over more chips (a larger --topology, config.mesh.fsdp), "
                   "add tensor parallelism, or raise --max_compiles")
  return "\n".join(lines)


def _format_skipped(skipped: list[dict]) -> list[str]:
  """Lines of the layouts the fastest-layout search ruled out before compiling, each with the first clause of its
  reason (the --json output has the whole message)."""
  if not skipped:
    return []
  lines = ["skipped before compiling (cannot run on this topology, or cannot fit by the planner's estimate):"]
  for s in skipped:
    o = s["overrides"]
    lines.append(f"  data={o['mesh.data']:<4d} fsdp={o['mesh.fsdp']:<5d} tensor={o['mesh.tensor']:<3d} "
                 f"remat={o['train.remat']:10} {s['reason'].split(': ')[0][:100]}")
  return lines


def format_prediction(p: dict | None) -> list[str]:
  """Lines of the predicted step time (train/planning/predict.py) for a report."""
  if not p:
    return []
  lines = [f"predicted step {p['step_seconds']:.3f} s: MFU {p['mfu']:.1%}, {p['tokens_per_sec_per_chip']:,.0f} "
           f"tokens/s per chip (matmul efficiency {p['matmul_efficiency']:.2f}; dominant: {p['dominant']})",
           f"  compute-bound kernels {p['compute_seconds']:.3f} s, memory-bound kernels "
           f"{p['memory_bound_seconds']:.3f} s, collectives {p['collective_seconds']:.3f} s of which exposed "
           f"{p['exposed_collective_seconds']:.3f} s",
           "  top ops                      seconds  per step  bound       what"]
  for o in p["top_ops"][:8]:
    lines.append(f"  {o['name'][:26]:26}{o['seconds']:10.4f}{o['per_step']:10.4g}  {o['bound'][:10]:10}  "
                 f"{o['op_name'][-60:]}")
  return lines


if __name__ == "__main__":
  sys.exit(main())
