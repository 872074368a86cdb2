"""Predicted step time and MFU of a compiled train step, from its optimised HLO: TPU performance without a TPU.

The model (docs/planning.md):
- every kernel the program runs (a fusion, convolution, copy, ...; loop bodies times their trip counts, each
  branch of a conditional weighted 1 / branches) costs its roofline time
      max(FLOPs / (MATMUL_EFFICIENCY x peak), bytes accessed / HBM bandwidth),
  with FLOPs and bytes from XLA's own cost analysis (HloCostAnalysis) of that one instruction;
- every collective costs its ring time: bytes moved per chip / ring bandwidth, where an all-gather or
  reduce-scatter over a group of n chips moves (n - 1) / n of the full array per chip, an all-reduce twice that,
  and the ring bandwidth is 2 directions x link bandwidth x the torus axes the group spans (ICI), NVLink within a
  GPU node, or the per-GPU InfiniBand bandwidth beyond; a cross-slice (DCN) collective is the ring over the
  slices at the per-chip DCN bandwidth plus NCCL's ring latency between nodes (DCN_*: per collective, per step);
- overlap: collectives the schedule issues asynchronously (start/done pairs, TPU async collective fusions) hide
  behind the kernels of the same computation (the loop body they are issued in); the excess and every
  synchronous collective are exposed;
- transfers between HBM and host memory (the offloading remat policies' residuals: `hlo.host_transfers`) cost
  bytes / the chip's host link bandwidth; asynchronous ones hide behind the kernels of their computation on an
  engine of their own (apart from the collectives'), the excess and synchronous ones are exposed.
Step time = kernel time + exposed collective time + exposed host-transfer time.

Units: seconds, bytes, FLOP/s; figures are per chip per optimizer step.
"""
from __future__ import annotations

import json
import math
import re

from train.planning import hardware
from train.planning import hlo

# One global factor: the fraction of the data-sheet bf16 peak that FLOP-bound kernels reach. Fitted once, on the
# 16B / v5e-256 row of the calibration table (benchmarks/predict_maxtext.py --fit 16b: the model MaxText measured
# in 2023, splash attention, the recipe's overlap flags, compiled whole; 0.7975 on 2026-12-06's program, within its
# physical range, nothing clipped) and used unchanged for every other model, chip and mesh (the other rows are held
# out; docs/planning.md).
MATMUL_EFFICIENCY = 0.7975

# The latency of a collective across the data-centre network, which Google does not publish for DCN: NCCL's cost
# model of a ring collective between nodes taken whole, nothing fitted (NVIDIA/nccl src/graph/tuning.cc, Simple
# protocol): a base latency per collective, one network latency per ring step, and, for an all-reduce between
# nodes of at least n/16 x 64 KiB, the latency x 1.9 ("plateau effect of ring").
DCN_BASE_SECONDS = 8.4e-6  # baseLat[Ring][Simple]
DCN_STEP_SECONDS = 9.6e-6  # hwLat[NET][Ring][Simple]
DCN_ALL_REDUCE_PLATEAU = 1.9

# Instructions that launch no kernel of their own (bookkeeping, control flow, asynchronous copies and slices,
# whose DMA overlaps compute), or whose cost is counted as a collective.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "copy-start", "copy-done", "slice-start",
         "slice-done", "async-start", "async-done", "async-update", "send", "send-done", "recv", "recv-done",
         "add-dependency", "domain", "all-gather-done", "all-reduce-done", "collective-permute-done",
         "dynamic-slice-done", "dynamic-update-slice-done"}
_FREE_CUSTOM_CALLS = ("AllocateBuffer", "AssumeGatherIndicesInBound", "ConcatBitcast", "AsyncCollectiveStart",
                      "AsyncCollectiveDone")
_DROP_ATTRS = ("metadata", "backend_config", "frontend_attributes", "control-predecessors", "statistics")


# ---- collectives -----------------------------------------------------------------------------------------
def ring_bandwidth(group: int, chip: hardware.Chip, torus: tuple[int, ...] = ()) -> float:
  """Bytes/s per chip that a ring collective over `group` chips gets.

  TPU: bidirectional rings over each torus axis the group spans (the fewest largest axes whose product reaches
  the group size), so 2 x link bandwidth per axis. GPU: NVLink within the node (ici_domain chips), otherwise the
  per-GPU InfiniBand bandwidth.
  """
  if chip.ici_domain:
    return (chip.ici_link_gbps if group <= chip.ici_domain else chip.dcn_gbps) * 1e9
  axes, covered = 0, 1
  for d in sorted(torus or (group,), reverse=True):
    if covered >= group:
      break
    covered *= d
    axes += 1
  return 2 * max(axes, 1) * chip.ici_link_gbps * 1e9


def ring_steps(kind: str, group: int) -> int:
  """Sequential transfers of a ring collective over `group` participants: an all-reduce is a reduce-scatter then
  an all-gather, 2 (group - 1) steps; an all-gather or reduce-scatter group - 1; a permute or all-to-all 1."""
  if group <= 1:
    return 0
  return {"all-reduce": 2 * (group - 1), "all-gather": group - 1, "reduce-scatter": group - 1}.get(kind, 1)


def dcn_seconds(kind: str, nbytes: float, slices: int, chip: hardware.Chip) -> float:
  """Time of one cross-slice (DCN) collective per chip: the ring over `slices` participants (each chip with its
  counterpart in every other slice) at the chip's DCN bandwidth, plus NCCL's ring latency between nodes (the
  DCN_* constants). `nbytes` as for collective_seconds."""
  if slices <= 1 or nbytes <= 0:
    return 0.0
  latency = DCN_BASE_SECONDS + ring_steps(kind, slices) * DCN_STEP_SECONDS
  if kind == "all-reduce" and nbytes >= slices / 16 * 65536:
    latency *= DCN_ALL_REDUCE_PLATEAU
  return collective_seconds(kind, nbytes, slices, chip.dcn_gbps * 1e9) + latency


def collective_seconds(kind: str, nbytes: float, group: int, bandwidth: float) -> float:
  """Ring-algorithm time of one collective: `nbytes` is the per-chip result (the gathered array of an
  all-gather, the shard of a reduce-scatter, the reduced array of an all-reduce), `group` the chips in each
  replica group, `bandwidth` bytes/s per chip (ring_bandwidth). A ragged all-to-all's result is its worst-case
  buffer (every chip sending all its rows to one); under balanced routing 1/group of it is filled."""
  if group <= 1 or nbytes <= 0:
    return 0.0
  frac = (group - 1) / group
  moved = {"all-gather": frac * nbytes, "reduce-scatter": (group - 1) * nbytes, "all-reduce": 2 * frac * nbytes,
           "all-to-all": frac * nbytes, "ragged-all-to-all": frac * nbytes / group,
           "collective-permute": nbytes}.get(kind, nbytes)
  return moved / bandwidth


# ---- per-kernel cost from XLA's cost analysis ------------------------------------------------------------
def _matching_paren(text: str, start: int = 0) -> int:
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "({":
      depth += 1
    elif text[i] in ")}":
      if depth == 0:
        return i
      depth -= 1
  return len(text)


def _strip_attr(text: str, key: str) -> str:
  """Removes `, key=...` (a braced value or a plain token) from an instruction's attribute text."""
  while True:
    i = text.find(f", {key}=")
    if i < 0:
      return text
    j = i + len(key) + 3
    if j < len(text) and text[j] == "{":
      end = _matching_paren(text, j + 1) + 1
    else:
      m = re.match(r"[^,]*", text[j:])
      end = j + m.end()
    text = text[:i] + text[end:]


def _callees(program: hlo.Program, names: list[str]) -> list[str]:
  """The computations called from `names`, transitively, callees first."""
  out: list[str] = []

  def add(name: str):
    if name in out or name not in program.text:
      return
    for _, c in hlo._CALLED.findall(program.text[name]):
      if c != name:
        add(c)
    out.append(name)

  for n in names:
    add(n)
  return out


def _instruction_module(program: hlo.Program, shapes: dict[str, str], instr: hlo.Instruction) -> str:
  """HLO text of a module whose entry runs `instr` alone on parameters of its operands' shapes."""
  close = _matching_paren(instr.rest)
  operands = [o.strip() for o in re.sub(r"/\*.*?\*/", "", instr.rest[:close]).split(",") if o.strip()]
  attrs = instr.rest[close + 1:]
  for key in _DROP_ATTRS:
    attrs = _strip_attr(attrs, key)
  params, args = [], []
  for i, operand in enumerate(operands):
    name = operand.split()[-1].lstrip("%")
    params.append(f"  %p{i} = {shapes[name]} parameter({i})")
    args.append(f"%p{i}")
  called = [c for _, c in hlo._CALLED.findall(attrs)]
  for group in hlo._BRANCHES.findall(attrs):
    called += [c.strip().lstrip("%") for c in group.split(",")]
  # Metadata is dropped: it only names source lines, and its stack-frame ids refer to the whole module's table.
  deps = ["\n".join(_strip_attr(line, "metadata") for line in program.text[c].splitlines())
          for c in _callees(program, called)]
  body = "\n".join(params + [f"  ROOT %op = {instr.shape} {instr.opcode}({', '.join(args)}){attrs}"])
  return "HloModule op\n\n" + "\n\n".join(deps + [f"ENTRY %main {{\n{body}\n}}"]) + "\n"


def _on_chip(shape: str) -> bool:
  """Whether an array lives in on-chip memory: the TPU layout's memory space S(n), n > 0 (VMEM, SMEM, ...), other
  than the host's."""
  return hlo.memory_space(shape) not in (0, hlo.HOST_MEMORY_SPACE)


def _on_chip_bytes(cost: dict, instr: hlo.Instruction, shapes: dict[str, str]) -> float:
  """The part of XLA's "bytes accessed" of one instruction that stays in on-chip memory (TPU memory spaces
  S(1) and up): its per-operand and per-output entries whose layout names such a space. HBM time counts the rest."""
  close = _matching_paren(instr.rest)
  operands = [o.strip().split()[-1].lstrip("%") for o in re.sub(r"/\*.*?\*/", "", instr.rest[:close]).split(",")
              if o.strip()]
  out = 0.0
  for i, name in enumerate(operands):
    if _on_chip(shapes.get(name, "")):
      out += sum(float(v) for k, v in cost.items() if k.startswith(f"bytes accessed{i}{{"))
  elements = hlo.split_tuple(instr.shape)
  for j, element in enumerate(elements):
    if _on_chip(element):
      key = "bytes accessedout{}" if len(elements) == 1 and not instr.shape.startswith("(") else \
          f"bytes accessedout{{{j}}}"
      out += float(cost.get(key, 0.0))
  return out


# ---- custom calls: kernels XLA cannot see into, costed by their closed forms --------------------------------
_FLOAT_TYPES = ("f32", "bf16", "f16")
_SPLASH_TILES = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq"),
                 "dkv": ("block_q_dkv", "block_kv_dkv")}


def _operand_arrays(instr: hlo.Instruction, shapes: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of each array operand of an instruction, in order."""
  out = []
  for operand in hlo.operands(re.sub(r"/\*.*?\*/", "", instr.rest)):
    text = operand if hlo._ARRAY.search(operand) else shapes.get(operand.split()[-1].lstrip("%"), "")
    m = hlo._ARRAY.search(text)
    if m:
      out.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
  return out


def _splash_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> tuple[float, float] | None:
  """A splash attention kernel (model/splash.py): its phase from the kernel name (splash_mqa_dq_...), q and k (the
  first two float operands) and the tiles from the kernel's own metadata, the mask from the named scope."""
  from model import splash  # pylint: disable=g-import-not-at-top  (the closed form lives next to the kernel)
  phase = re.match(r"splash_m[qh]a_(fwd|dq|dkv)", instr.name)
  floats = [(t, dims) for t, dims in _operand_arrays(instr, shapes) if t in _FLOAT_TYPES]
  meta = re.search(r'"xprof_metadata":"(.*?[^\\])"', instr.rest)
  if not phase or len(floats) < 2 or not meta:
    return None
  tiles = json.loads(meta.group(1).replace('\\"', '"'))
  (dtype, q), (_, k) = floats[:2]
  # QKVLayout.SEQ_MINOR (2) stores [..., head_dim, seq]; meshlm builds HEAD_DIM_MINOR (1) kernels.
  q = q[:-2] + q[:-3:-1] if tiles.get("q_layout") == 2 else q
  k = k[:-2] + k[:-3:-1] if tiles.get("k_layout") == 2 else k
  mask = re.search(splash.MASK_SCOPE + r"(\w+)", instr.rest)
  block_q, block_kv = (tiles.get(key) for key in _SPLASH_TILES[phase.group(1)])
  if not block_q or not block_kv:
    return None
  itemsize = hlo.shape_bytes(f"{dtype}[1]")[0]
  # Without the scope (a kernel built elsewhere) every tile counts: the kernel skips only what its mask hides.
  return splash.kernel_cost(phase.group(1), q, k, itemsize, block_q, block_kv, mask.group(1) if mask else "full")


def _megablox_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> tuple[float, float] | None:
  """A megablox grouped matmul (model/megablox.py: `gmm`, and `tgmm` for the weights' gradient): the two float
  operands and the result, priced by the kernel's closed form."""
  from model import megablox  # pylint: disable=g-import-not-at-top  (the closed form lives next to the kernel)
  kind = re.match(r"(t?gmm)(\.\d+)?$", instr.name)
  floats = [(t, dims) for t, dims in _operand_arrays(instr, shapes) if t in _FLOAT_TYPES]
  out = hlo._ARRAY.search(instr.shape)
  if not kind or len(floats) != 2 or not out:
    return None
  (dtype, lhs), (_, rhs) = floats
  out_dims = tuple(int(d) for d in out.group(2).split(",") if d)
  return _filled(instr, megablox.kernel_cost(kind.group(1), lhs, rhs, out_dims, hlo.shape_bytes(f"{dtype}[1]")[0]))


def _filled(instr: hlo.Instruction, cost: tuple[float, float] | None) -> tuple[float, float] | None:
  """A grouped matmul over an expert-parallel receive buffer (model.experts.RECEIVED_SCOPE + G in its op name):
  the kernels skip the row tiles no group covers, and balanced routing fills 1/G of the buffer, so its FLOPs are
  the closed form's / G (the closed form's upper bound is G times the expected work); bytes stay (the weights
  dominate and are read whole)."""
  from model import experts  # pylint: disable=g-import-not-at-top
  scope = re.search(re.escape(experts.RECEIVED_SCOPE) + r"(\d+)", instr.rest)
  if cost is None or not scope:
    return cost
  return cost[0] / int(scope.group(1)), cost[1]


def _online_softmax_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> tuple[float, float] | None:
  """XLA:TPU's own `online-softmax` kernel (a Mosaic call it emits for softmax(scores) @ v): scores [..., M, S]
  and v [..., S, K] -> [..., M, K]; the product's 2·M·S·K plus 4 vector FLOPs per score (max, subtract, exp,
  sum) per batch element; bytes: operands and result once."""
  arrays = _operand_arrays(instr, shapes)
  out = hlo._ARRAY.search(instr.shape)
  if not instr.name.startswith("online-softmax") or len(arrays) != 2 or not out:
    return None
  (_, s), (_, v) = arrays
  if len(s) < 2 or len(v) < 2 or s[:-2] != v[:-2] or s[-1] != v[-2]:
    return None
  batch, (m, n), k = math.prod(s[:-2]), s[-2:], v[-1]
  nbytes = sum(math.prod(dims) * hlo.shape_bytes(f"{t}[1]")[0] for t, dims in arrays) + sum(
      hlo.shape_bytes(instr.shape))
  return float(batch * (2 * m * n * k + 4 * m * n)), float(nbytes)


def _ragged_dot_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> tuple[float, float] | None:
  """XLA:TPU's own grouped-matmul kernels for `jax.lax.ragged_dot` (model.moe_impl=ragged): `ragged-dot-*` is a
  gmm (lhs [M, X] rows sorted by group, rhs [G, X, Y] or transposed -> [M, Y]), priced by megablox's closed form
  (each row against its own group's matrix); `ragged-dot-metadata` computes the groups' tile offsets: its bytes,
  no FLOPs."""
  from model import megablox  # pylint: disable=g-import-not-at-top
  if not instr.name.startswith("ragged-dot"):
    return None
  arrays = _operand_arrays(instr, shapes)
  out = hlo._ARRAY.search(instr.shape)
  if instr.name.startswith("ragged-dot-metadata"):
    return 0.0, float(sum(math.prod(d) * hlo.shape_bytes(f"{t}[1]")[0] for t, d in arrays) +
                      sum(hlo.shape_bytes(instr.shape)))
  floats = [(t, dims) for t, dims in arrays if t in _FLOAT_TYPES]
  if len(floats) != 2 or not out:
    return None
  (dtype, lhs), (_, rhs) = floats
  out_dims = tuple(int(d) for d in out.group(2).split(",") if d)
  return _filled(instr, megablox.kernel_cost("gmm", lhs, rhs, out_dims, hlo.shape_bytes(f"{dtype}[1]")[0]))


# Closed forms of custom-call kernels: each (instruction, shapes of its computation) -> (FLOPs, HBM bytes) of one
# execution, or None when the call is not its kernel. A custom call none of them takes counts as uncosted.
CLOSED_FORMS = (_splash_cost, _megablox_cost, _ragged_dot_cost, _online_softmax_cost)


def _custom_call_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> dict | None:
  """{"flops", "bytes", "costed": True} of a custom call a closed form knows; None for one it does not."""
  for closed_form in CLOSED_FORMS:
    cost = closed_form(instr, shapes)
    if cost is not None:
      return {"flops": cost[0], "bytes": cost[1], "costed": True}
  return None


def _is_free(instr: hlo.Instruction) -> bool:
  if instr.opcode in _FREE or hlo.collective_kind(instr.opcode, instr.rest):
    return True
  if instr.opcode == "custom-call":
    return any(f'"{t}"' in instr.rest for t in _FREE_CUSTOM_CALLS)
  return instr.opcode == "fusion" and "async-collective" in instr.name


def kernel_costs(hlo_text: str, program: hlo.Program | None = None) -> list[dict]:
  """Every kernel the program runs with its cost of one execution: [{"name", "opcode", "computation",
  "per_step", "flops", "bytes", "op_name", "costed"}]. FLOPs and bytes are XLA's cost analysis of the instruction
  alone, or for a custom call (a Pallas/Mosaic kernel, which XLA sees as zero work) its closed form
  (CLOSED_FORMS). "costed" False marks an instruction neither prices: a custom call no closed form knows, or an op
  the cost analysis could not take alone; its bytes then are its operands' and result's sizes, its FLOPs 0.
  `program`: hlo.parse(hlo_text) when the caller has parsed it already."""
  import jax
  from jax._src.lib import _jax
  from jaxlib import _hlo

  client = jax.devices("cpu")[0].client
  program = program or hlo.parse(hlo_text)
  shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in program.computations.items()}
  host = {(t["where"], t["name"]) for t in hlo.host_transfers(program)}  # priced by `predict` apart
  by_key: dict[tuple[str, str], dict] = {}
  for comp, instr, mult in hlo.executed(program):
    if _is_free(instr) or (comp, instr.name) in host:
      continue
    key = (comp, instr.name)
    if key in by_key:
      by_key[key]["per_step"] += mult
      continue
    m = re.search(r'op_name="([^"]*)"', instr.line)
    entry = by_key[key] = {"name": instr.name, "opcode": instr.opcode, "computation": comp, "per_step": mult,
                           "op_name": m.group(1) if m else "", "costed": True}
    if instr.opcode == "custom-call":
      entry.update(_custom_call_cost(instr, shapes[comp]) or _sizes_cost(instr, shapes[comp]))
      continue
    try:
      module = _hlo.hlo_module_from_text(_instruction_module(program, shapes[comp], instr))
      cost = _jax.hlo_module_cost_analysis(client, module)
      entry["flops"] = float(cost.get("flops", 0.0))
      entry["bytes"] = float(cost.get("bytes accessed", 0.0)) - _on_chip_bytes(cost, instr, shapes[comp])
    except Exception:  # noqa: BLE001 -- an op the CPU parser cannot take alone: counted by its sizes, flagged
      entry.update(_sizes_cost(instr, shapes[comp]))
  return list(by_key.values())


def _sizes_cost(instr: hlo.Instruction, shapes: dict[str, str]) -> dict:
  """The uncosted fallback: no FLOPs, its operands' and result's sizes as bytes, flagged costed=False."""
  operands = re.findall(r"%([\w.\-]+)", instr.rest[:_matching_paren(instr.rest)])
  nbytes = sum(sum(hlo.shape_bytes(shapes.get(o, ""))) for o in operands) + sum(hlo.shape_bytes(instr.shape))
  return {"flops": 0.0, "bytes": float(nbytes), "costed": False}


# ---- the prediction --------------------------------------------------------------------------------------
def predict(hlo_text: str, chip: hardware.Chip, *, num_devices: int, torus: tuple[int, ...] = (),
            model_flops_per_chip: float, tokens_per_chip: float, efficiency: float = MATMUL_EFFICIENCY,
            top: int = 10) -> dict:
  """Predicted time of one step of a compiled program (per chip; see the module docstring).

  Args:
    hlo_text: `compiled.as_text()` of the SPMD-partitioned step.
    chip: the accelerator (peak, HBM and interconnect bandwidths from train/planning/hardware.py).
    num_devices: chips the program runs on (for collectives whose groups are not printed).
    torus: chips along each physical axis of one slice (TpuSlice.torus); empty for GPUs.
    model_flops_per_chip: model FLOPs per chip per step (the MFU numerator).
    tokens_per_chip: tokens per chip per step.
    efficiency: fraction of the peak that FLOP-bound kernels reach.
  Returns:
    {"step_seconds", "mfu", "tokens_per_sec_per_chip", "compute_seconds" (FLOP-bound kernels),
    "memory_bound_seconds" (HBM-bound kernels), "collective_seconds" (all collectives, as if serial),
    "exposed_collective_seconds", "host_transfer_seconds" (HBM <-> host, as if serial), "exposed_host_seconds", "hardware_flops_per_chip", "dominant", "matmul_efficiency",
    "uncosted_kernels", "top_ops": the `top` most expensive kernels and collectives}.
  """
  peak = chip.peak_tflops * 1e12 * efficiency
  hbm = chip.hbm_gbps * 1e9
  rows, scope_kernels = [], {}
  compute = memory_bound = hw_flops = 0.0
  program = hlo.parse(hlo_text)
  kernels = kernel_costs(hlo_text, program)
  for k in kernels:
    t_flops, t_bytes = k["flops"] / peak, k["bytes"] / hbm
    seconds = max(t_flops, t_bytes) * k["per_step"]
    bound = "compute" if t_flops >= t_bytes else "memory"
    if bound == "compute":
      compute += seconds
    else:
      memory_bound += seconds
    hw_flops += k["flops"] * k["per_step"]
    scope_kernels[k["computation"]] = scope_kernels.get(k["computation"], 0.0) + seconds
    rows.append({"name": k["name"], "op": k["opcode"], "op_name": k["op_name"], "per_step": k["per_step"],
                 "seconds": seconds, "bound": bound, "flops": k["flops"], "bytes": k["bytes"]})
  collective = exposed_sync = 0.0
  scope_async: dict[str, float] = {}
  for c in hlo.collective_ops(hlo_text, num_devices):
    if c["kind"].startswith("dcn-"):
      seconds = dcn_seconds(c["kind"][4:], c["bytes"], c["group"], chip)
    else:
      bw = ring_bandwidth(c["group"], chip, torus)
      seconds = collective_seconds(c["kind"], c["bytes"], c["group"], bw)
    seconds *= c["per_step"]
    collective += seconds
    if c["async"]:
      scope_async[c["scope"]] = scope_async.get(c["scope"], 0.0) + seconds
    else:
      exposed_sync += seconds
    rows.append({"name": c["name"], "op": c["kind"], "op_name": f"group {c['group']}", "per_step": c["per_step"],
                 "seconds": seconds, "bound": "collective" + (" (async)" if c["async"] else ""),
                 "flops": 0.0, "bytes": float(c["bytes"])})
  exposed = exposed_sync + sum(max(0.0, t - scope_kernels.get(s, 0.0)) for s, t in scope_async.items())
  host, exposed_host = _host_seconds(hlo.host_transfers(program), chip, scope_kernels, rows)
  step = compute + memory_bound + exposed + exposed_host
  terms = {"compute": compute, "memory": memory_bound, "collective": exposed, "host": exposed_host}
  rows.sort(key=lambda r: -r["seconds"])
  return {
      "step_seconds": step,
      "mfu": model_flops_per_chip / (step * chip.peak_tflops * 1e12) if step > 0 else None,
      "tokens_per_sec_per_chip": tokens_per_chip / step if step > 0 else None,
      "compute_seconds": compute, "memory_bound_seconds": memory_bound, "collective_seconds": collective,
      "exposed_collective_seconds": exposed, "host_transfer_seconds": host, "exposed_host_seconds": exposed_host,
      "hardware_flops_per_chip": hw_flops,
      "dominant": max(terms, key=terms.get), "matmul_efficiency": efficiency,
      "uncosted_kernels": sum(1 for k in kernels if not k["costed"]),
      "top_ops": rows[:top],
  }


def _host_seconds(transfers: list[dict], chip: hardware.Chip, scope_kernels: dict[str, float],
                  rows: list[dict]) -> tuple[float, float]:
  """(all host-transfer seconds, the exposed part) of `hlo.host_transfers`; each transfer is also added to `rows`.
  A program that moves data to or from the host on a chip whose host bandwidth is unknown is an error."""
  if transfers and chip.host_gbps <= 0:
    raise ValueError(f"the program moves data between HBM and host memory but {chip.name} has no host_gbps "
                     "(train/planning/hardware.py)")
  total = exposed = 0.0
  scope_async: dict[str, float] = {}
  for t in transfers:
    seconds = t["bytes"] / (chip.host_gbps * 1e9) * t["per_step"]
    total += seconds
    if t["async"]:
      scope_async[t["computation"]] = scope_async.get(t["computation"], 0.0) + seconds
    else:
      exposed += seconds
    rows.append({"name": t["name"], "op": t["direction"], "op_name": "host transfer", "per_step": t["per_step"],
                 "seconds": seconds, "bound": "host" + (" (async)" if t["async"] else ""), "flops": 0.0,
                 "bytes": t["bytes"]})
  exposed += sum(max(0.0, t - scope_kernels.get(s, 0.0)) for s, t in scope_async.items())
  return total, exposed


def for_report(hlo_text: str, report: dict, chip: hardware.Chip, torus: tuple[int, ...]) -> dict:
  """`predict` for a train.compile report (model FLOPs per chip and tokens from the report's own fields)."""
  tokens = report["batch_size"] * report["seq_len"] / report["num_devices"]
  return predict(hlo_text, chip, num_devices=report["num_devices"], torus=torus,
                 model_flops_per_chip=report["flops"]["model_per_chip"], tokens_per_chip=tokens)


def roofline_seconds(flops: float, nbytes: float, chip: hardware.Chip,
                     efficiency: float = MATMUL_EFFICIENCY) -> float:
  """The roofline time of one kernel: max(flops / (efficiency x peak), bytes / HBM bandwidth)."""
  return max(flops / (chip.peak_tflops * 1e12 * efficiency), nbytes / (chip.hbm_gbps * 1e9))
