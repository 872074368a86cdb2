"""Ahead-of-time compilation of the real train step for a TPU slice, on a machine without TPUs.

`python -m train.compile --config=llama2_7b --topology=v4-64 [--num_slices=N] [--config.mesh.fsdp=-1 ...]
[--json]` lowers and compiles `train.step.Trainer(config, mesh).step_fn` (the jitted step that training runs)
for abstract TPU devices from `jax.experimental.topologies` (libtpu's compiler; no weights are allocated), and
reports per-chip memory against the chip's HBM, model and compiled FLOPs, collectives by kind and the compile
time, beside the planner's estimate. When the step does not fit it searches remat policies and grad_accum values
by compiling them and exits 1 with the lightest candidate that fits. See docs/planning.md.
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
from typing import Sequence

import ml_collections

import configs
from train import hardware, memory

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def abstract_devices(tpu: hardware.TpuSlice) -> list:
  """The slice's compile-only TPU devices (libtpu must be installed; no TPU needs to be attached)."""
  from jax.experimental import topologies
  # Compile-only use never owns TPU chips, so several processes (pytest workers, a search) may load libtpu.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=tpu.topology,
                                             **tpu.topology_kwargs()).devices)
  except RuntimeError as e:
    raise RuntimeError(f"cannot build TPU topology {tpu.topology!r}: {e}. Ahead-of-time compilation needs the "
                       "TPU compiler: pip install -c constraints.txt libtpu") from e


# ---- reading the compiled HLO --------------------------------------------------------------------------
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


def _shape_bytes(shape: str) -> list[int]:
  """Bytes of each array in an HLO shape string (one entry per tuple element)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      out.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
  return out


def _parse_hlo(text: str):
  comps: dict[str, list[tuple[str, str, str, str]]] = {}
  entry, current = None, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      comps[current].append(m.groups())
  return comps, entry


def _trip_count(condition: list[tuple[str, str, str, str]]) -> int:
  """Iterations of a while loop whose condition is `counter < constant` (scan's form); 1 when unknown."""
  constants = [int(m.group(1)) for _, _, op, rest in condition if op == "constant"
               for m in [re.match(r"(-?\d+)\)", rest)] if m]
  compares = [rest for _, _, op, rest in condition if op == "compare" and "direction=LT" in rest]
  return constants[0] if len(constants) == 1 and len(compares) == 1 and constants[0] > 0 else 1


def _collective_kind(opcode: str, rest: str) -> str | None:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  if base in KINDS:
    return base
  if opcode == "fusion":  # TPU fuses reduce-scatter as all-reduce + slice inside a custom fusion
    m = re.search(r"calls=%([\w\-]+)", rest)
    if m and m.group(1).startswith("all-reduce-scatter"):
      return "reduce-scatter"
  return None


def collective_ops(hlo_text: str) -> list[dict]:
  """Every collective of a compiled program: [{"kind", "name", "shapes", "bytes", "per_step"}].

  `per_step` counts executions: ops inside while loops (scan over layers, gradient accumulation) are multiplied
  by the loops' trip counts. `bytes` is the per-device result size (the gathered array for all-gather, the
  shard for reduce-scatter). Cross-slice (DCN) collectives, which libtpu lowers to megascale host transfers,
  have kind `dcn-<kind>`.
  """
  comps, entry = _parse_hlo(hlo_text)
  ops: dict[tuple[str, str], dict] = {}

  def visit(name: str, mult: int, depth: int = 0):
    if depth > 64 or name not in comps:
      return
    for instr, shape, opcode, rest in comps[name]:
      kind = _collective_kind(opcode, rest)
      sizes = _shape_bytes(shape)
      if kind is None and opcode == "send" and "xla_megascale_runtime" in rest:
        m = re.search(r'_xla_host_transfer_rendezvous="([a-z\-]+)', rest)
        kind = "dcn-" + (m.group(1).rstrip("-.") if m else "transfer")
        sizes = sizes[:1]
      if kind is not None:
        if opcode.endswith("-start") and len(sizes) > 1:
          # async forms return (operands..., results...) or, for permutes, (operand, result, context...)
          sizes = sizes[1:2] if kind == "collective-permute" else sizes[len(sizes) // 2:]
        op = ops.setdefault((name, instr), {"kind": kind, "name": instr, "shapes": shape, "bytes": sum(sizes),
                                            "per_step": 0})
        op["per_step"] += mult
        if opcode == "fusion":
          continue  # the all-reduce inside a reduce-scatter fusion is the same collective
      called = [c for _, c in _CALLED.findall(rest)]
      for group in _BRANCHES.findall(rest):
        called += [c.strip().lstrip("%") for c in group.split(",")]
      for callee in called:
        factor = 1
        if opcode == "while" and f"body=%{callee}" in rest:
          cond = re.search(r"condition=%([\w.\-]+)", rest)
          factor = _trip_count(comps.get(cond.group(1), [])) if cond else 1
        visit(callee, mult * factor, depth + 1)

  if entry is not None:
    visit(entry, 1)
  return list(ops.values())


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Collectives by kind: {kind: {"ops": instructions in the program, "per_step": executions per step,
  "bytes_per_step": per-device bytes moved per step}} (see collective_ops)."""
  out: dict[str, dict[str, int]] = {}
  for op in collective_ops(hlo_text):
    s = out.setdefault(op["kind"], {"ops": 0, "per_step": 0, "bytes_per_step": 0})
    s["ops"] += 1
    s["per_step"] += op["per_step"]
    s["bytes_per_step"] += op["per_step"] * op["bytes"]
  return dict(sorted(out.items()))


# ---- compiling -----------------------------------------------------------------------------------------
def compile_trainer(config: ml_collections.ConfigDict, devices: list):
  """(trainer, compiled): `Trainer(config, mesh).compiled()`, i.e. `step_fn.lower(abstract_state(),
  abstract_batch()).compile()` on a mesh of `devices` -- the same jitted function that training runs."""
  from parallel import mesh as mesh_lib
  from train import step

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


def _report(config, tpu, sizes, devices, seconds, *, fits, memory_, flops, hlo) -> dict:
  from train import mfu

  t = config.train
  model_flops = mfu.flops_per_step(config.model, t.seq_len, t.batch_size) / devices
  return {
      "topology": tpu.topology, "num_slices": tpu.num_slices, "chip": tpu.chip.name, "num_devices": devices,
      "mesh": sizes, "remat": t.remat, "grad_accum": t.grad_accum, "batch_size": t.batch_size,
      "micro_batch": t.batch_size // t.grad_accum, "seq_len": t.seq_len,
      "memory": memory_, "hbm_bytes": tpu.chip.hbm_bytes, "fits": fits,
      "estimate": _estimate(config, sizes),
      "flops": {"model_per_chip": model_flops, "compiled_per_chip": flops},
      "collectives": collectives(hlo),
      "compile_seconds": seconds,
  }


def _estimate(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> dict:
  """The planner's per-device figures for the same config and mesh (train/memory.py), split as the compiler
  splits them: arguments = weights + optimizer state; temporaries = gradients + activations."""
  import model
  state = memory.meshlm_state(config, model.count_params(config.model)["total"], sizes)
  t = config.train
  acts = memory.activation_memory(config, t.batch_size // t.grad_accum, sizes=sizes)
  return {"argument_bytes": state["weights"] + state["optimizer"],
          "temp_bytes": state["gradients"] + acts["total"], "activation_bytes": acts["total"],
          "total_bytes": state["total"] + acts["total"]}


def _with(config: ml_collections.ConfigDict, **train) -> ml_collections.ConfigDict:
  c = copy.deepcopy(config)
  with c.unlocked():
    c.train.update(train)
  return c


def _policies_light_to_heavy(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> list[str]:
  """Remat policies ordered by the planner's activation estimate, most memory (least recompute) first."""
  from model import remat
  micro = config.train.batch_size // config.train.grad_accum
  names = [p for p in remat.POLICIES if p != "full" and p in memory.SAVED_BY_POLICY]
  names.sort(key=lambda p: -memory.activation_memory(config, micro, remat=p, sizes=sizes)["total"])
  return names + ["full"]


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
  activation estimate) for the lightest that fits. Returns {"found", "remat", "grad_accum", "micro_batch",
  "report" (of the suggestion), "tried": [{"remat", "grad_accum", "total_bytes", "fits"}]}.
  """
  devices = abstract_devices(tpu) if devices is None else devices
  sizes = memory.mesh_sizes(config, len(devices))
  policies = _policies_light_to_heavy(config, sizes)
  tried: list[dict] = []
  reports: dict[tuple[str, int], dict] = {}

  def fits(remat: str, ga: int) -> bool | None:
    if (remat, ga) not in reports:
      if len(tried) >= max_compiles:
        return None
      r = compile_step(_with(config, remat=remat, grad_accum=ga), tpu, devices)
      reports[(remat, ga)] = r
      tried.append({"remat": remat, "grad_accum": ga, "total_bytes": r["memory"]["total_bytes"],
                    "fits": r["fits"]})
    return reports[(remat, ga)]["fits"]

  for ga in _grad_accum_candidates(config, memory.batch_shards(sizes)):
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
    best = policies[hi]
    return {"found": True, "remat": best, "grad_accum": ga, "micro_batch": config.train.batch_size // ga,
            "report": reports[(best, ga)], "tried": tried}
  return {"found": False, "tried": tried}


# ---- command line --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.compile", description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", required=True,
                 help="TPU slice: v4-32 (TensorCores; 16 chips), v5p-16, v5e-16 (chips), or raw v4:2x2x4")
  p.add_argument("--num_slices", type=int, default=1, help="slices joined over DCN (multi-slice)")
  p.add_argument("--max_compiles", type=int, default=12, help="compile budget of the fit search")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Exit status: 0 fits, 1 does not fit (a suggestion is printed when one was found), 2 bad input."""
  parser = _parser()
  try:
    config, args = configs.parse(sys.argv[1:] if argv is None else argv, parser)
    tpu = hardware.tpu_slice(args.topology, args.num_slices)
    if tpu.num_slices > 1 and config.mesh.dcn_data == 1 and config.mesh.dcn_fsdp == 1:
      configs.apply_override(config, "mesh.dcn_data", str(tpu.num_slices))  # data parallelism across slices
    devices = abstract_devices(tpu)
    report = compile_step(config, tpu, devices)
  except (configs.ConfigError, ValueError) as e:
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
  sug = r.get("suggestion")
  if sug is not None:
    for t in sug["tried"]:
      lines.append(f"  tried remat={t['remat']:16} grad_accum={t['grad_accum']:<4d} "
                   f"{t['total_bytes'] / gib:8.3f} GiB  {'fits' if t['fits'] else 'no'}")
    if sug["found"]:
      lines.append(f"suggestion: --config.train.remat={sug['remat']} --config.train.grad_accum={sug['grad_accum']}"
                   f" (micro-batch {sug['micro_batch']}; compiled: {sug['report']['memory']['total_bytes'] / gib:.3f}"
                   " GiB per chip)")
    else:
      lines.append("nothing tried fits: shard the state over more chips (a larger --topology, config.mesh.fsdp), "
                   "add tensor parallelism, or raise --max_compiles")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
