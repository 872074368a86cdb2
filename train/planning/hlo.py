"""Reading the optimised HLO text of a compiled program: computations, executed instructions with their loop
multiplicities, collectives (kind, bytes, group size) and matmuls with their operand types. Used by
`train.compile` and `train.predict`.

Sizes are bytes per device (the program is the SPMD-partitioned one that every device runs).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterator

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # the result shape text, e.g. "bf16[8,128]{1,0:T(8,128)}" or a tuple "(f32[2], s32[])"
  opcode: str
  rest: str  # everything after "opcode(": operands, then attributes
  line: str  # the whole line as printed


@dataclasses.dataclass
class Program:
  computations: dict[str, list[Instruction]]
  text: dict[str, str]  # computation name -> its full text (header to closing brace)
  entry: str | None


def shape_bytes(shape: str) -> list[int]:
  """Bytes of each array in an HLO shape string (one entry per tuple element)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      out.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
  return out


def _open_braces(line: str) -> int:
  """`{` minus `}` in a line, outside double-quoted strings (with backslash escapes)."""
  depth, quoted, escaped = 0, False, False
  for ch in line:
    if escaped:
      escaped = False
    elif ch == "\\":
      escaped = True
    elif ch == '"':
      quoted = not quoted
    elif not quoted:
      depth += (ch == "{") - (ch == "}")
  return depth


def _logical_lines(text: str) -> Iterator[str]:
  """The module's lines, an instruction printed over several lines joined into one (with newlines): a Pallas
  kernel's frontend attributes hold a multi-line value, after which come its metadata and backend config."""
  pending, depth = [], 0
  for line in text.splitlines():
    if pending:
      pending.append(line)
      depth += _open_braces(line)
      if depth <= 0:
        yield "\n".join(pending)
        pending = []
      continue
    depth = _open_braces(line)
    if depth > 0 and not _COMPUTATION.match(line) and _INSTRUCTION.match(line):
      pending = [line]
    else:
      yield line
  if pending:
    yield "\n".join(pending)


def parse(text: str) -> Program:
  """Splits HLO module text into computations of instructions."""
  comps: dict[str, list[Instruction]] = {}
  blocks: dict[str, list[str]] = {}
  entry, current = None, None
  for line in _logical_lines(text):
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      comps[current], blocks[current] = [], [line]
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    blocks[current].append(line)
    if line.startswith("}"):
      current = None
      continue
    first, _, more = line.partition("\n")
    m = _INSTRUCTION.match(first)
    if m:
      name, shape, opcode, rest = m.groups()
      comps[current].append(Instruction(name, shape, opcode, rest + ("\n" + more if more else ""), line=line))
  return Program(comps, {k: "\n".join(v) for k, v in blocks.items()}, entry)


_MOSAIC = re.compile(r'%([\w\-]+?)(?:\.\d+)?\s*=[^\n]*custom_call_target="tpu_custom_call"')


def mosaic_kernels(text: str) -> dict[str, int]:
  """Mosaic (Pallas TPU) custom calls of HLO module `text` by kernel name, e.g. {"splash_mqa_fwd_...": 1, "gmm": 9}:
  each instruction once (a layer scan's body counts once)."""
  return dict(sorted(collections.Counter(_MOSAIC.findall(text)).items()))


def split_tuple(shape: str) -> list[str]:
  """The element shapes of a tuple shape string (the shape itself when it is an array)."""
  if not shape.startswith("("):
    return [shape]
  out, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
      if depth == 0:
        out.append(shape[start:i])
    elif ch == "," and depth == 1:
      out.append(shape[start:i])
      start = i + 1
  return [re.sub(r"/\*.*?\*/", "", e).strip() for e in out if e.strip()]


_TUPLE_REF = re.compile(r"%([\w.\-]+)#(\d+)\b")


def untuple_refs(text: str) -> str:
  """HLO module `text` with each tuple-element operand `%x#i` (XLA 0.12's printing, e.g. MaxText's programs under
  jax 0.12) replaced by `%x.gte<i>`, a get-tuple-element inserted right after x: the form this module's parser
  reads (an operand is an instruction's name). Text without such references comes back unchanged but for line
  joins."""
  out: list[str] = []

  def flush(block: list[str]) -> None:
    shapes = {}
    for line in block:
      first = line.partition("\n")[0]
      m = _INSTRUCTION.match(first)
      if m and not _COMPUTATION.match(first):
        shapes[m.group(1)] = m.group(2)
    refs: dict[str, set[int]] = {}
    for line in block:
      for name, idx in _TUPLE_REF.findall(line):
        if name in shapes:
          refs.setdefault(name, set()).add(int(idx))
    for line in block:
      out.append(_TUPLE_REF.sub(lambda r: f"%{r.group(1)}.gte{r.group(2)}" if r.group(1) in shapes
                                else r.group(0), line))
      first = line.partition("\n")[0]
      m = _INSTRUCTION.match(first)
      if m and not _COMPUTATION.match(first) and m.group(1) in refs:
        elements = split_tuple(m.group(2))
        indent = re.match(r"\s*", first).group(0)
        for idx in sorted(refs[m.group(1)]):
          out.append(f"{indent}%{m.group(1)}.gte{idx} = {elements[idx]} get-tuple-element(%{m.group(1)}), "
                     f"index={idx}")

  block: list[str] = []
  for line in _logical_lines(text):
    block.append(line)
    if line.startswith("}"):  # one computation at a time: names are scoped to their computation
      flush(block)
      block = []
  flush(block)
  return "\n".join(out) + "\n"


def trip_count(condition: list[Instruction]) -> int:
  """Iterations of a while loop whose condition is `counter < constant` (scan's form); 1 when unknown."""
  constants = [int(m.group(1)) for i in condition if i.opcode == "constant"
               for m in [re.match(r"(-?\d+)\)", i.rest)] if m]
  compares = [i for i in condition if i.opcode == "compare" and "direction=LT" in i.rest]
  return constants[0] if len(constants) == 1 and len(compares) == 1 and constants[0] > 0 else 1


def _name(operand: str) -> str:
  return operand.split()[-1].lstrip("%") if operand else ""


def counter_start(instrs: list[Instruction], loop: Instruction, condition: list[Instruction]) -> int:
  """The initial value of a while loop's counter: the constant that `loop`'s operand tuple (in `instrs`, the
  loop's computation) holds at the index the condition's `counter < constant` reads; 0 when it cannot be read.
  Not always 0: to overlap the gradients' data-parallel all-reduce with the backward pass, libtpu peels the first
  iteration of the backward layer loop out of it and starts the counter at 1."""
  by_name = {i.name: i for i in instrs}
  compares = [i for i in condition if i.opcode == "compare" and "direction=LT" in i.rest]
  cond = {i.name: i for i in condition}
  reads = [cond.get(_name(o)) for o in (operands(compares[0].rest) if len(compares) == 1 else [])]
  index = [re.search(r"index=(\d+)", i.rest) for i in reads if i is not None and i.opcode == "get-tuple-element"]
  loop_operands = operands(loop.rest)
  tup = by_name.get(_name(loop_operands[0])) if len(index) == 1 and index[0] and loop_operands else None
  elements = operands(tup.rest) if tup is not None and tup.opcode == "tuple" else []
  if not elements or int(index[0].group(1)) >= len(elements):
    return 0
  node = by_name.get(_name(elements[int(index[0].group(1))]))
  for _ in range(4):  # through copies and bitcasts to the constant
    if node is None or node.opcode == "constant":
      break
    node = by_name.get(_name(operands(node.rest)[0])) if node.opcode in ("copy", "bitcast", "convert") else None
  m = re.match(r"(-?\d+)\)", node.rest) if node is not None and node.opcode == "constant" else None
  return int(m.group(1)) if m else 0


def iterations(instrs: list[Instruction], loop: Instruction, condition: list[Instruction]) -> int:
  """Bodies a while loop runs: `counter < constant` (trip_count) less the counter's start (counter_start)."""
  limit = trip_count(condition)
  return max(limit - counter_start(instrs, loop, condition), 0) if limit > 1 else limit


def collective_kind(opcode: str, rest: str) -> str | None:
  """The collective an instruction performs ("all-gather", ...), or None."""
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  if base in KINDS:
    return base
  if opcode == "fusion":  # TPU fuses reduce-scatter as all-reduce + slice inside a custom fusion
    m = re.search(r"calls=%([\w\-]+)", rest)
    if m and m.group(1).startswith("all-reduce-scatter"):
      return "reduce-scatter"
  return None


def group_size(rest: str, num_devices: int) -> int:
  """Devices in each replica group of a collective, from any of the printed forms: `{{0,1},{2,3}}`,
  the iota form `[groups,size]<=[n]`, or the mesh form `mesh['axis_0'=8,'axis_1'=2] {'axis_0'}`; all devices
  when the groups are empty or absent."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)) if a in sizes)
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
  if m and m.group(1):
    return len(m.group(1).split(","))
  m = re.search(r"source_target_pairs=\{", rest)
  if m:
    return 2
  return num_devices


def megascale_slices(rest: str) -> int | None:
  """Slices a megascale (DCN) transfer spans: its `_xla_megascale_target="{1,2,...}x{0:255}"` names the slices
  (first set) and the chips of each (second); None when the attribute is absent."""
  m = re.search(r'_xla_megascale_target="\{([\d,]*)\}', rest)
  return len(m.group(1).split(",")) if m and m.group(1) else None


def executed(program: Program, *, into_fusions: bool = False) -> Iterator[tuple[str, Instruction, float]]:
  """(computation, instruction, executions per step) for every instruction the program runs.

  While bodies count their trip count (XLA's `known_trip_count` annotation, else read from a `counter < constant`
  condition less the counter's initial value, `counter_start`; XLA:CPU wraps that compare in a fusion, which
  `trip_count` does not read); each branch of a
  conditional counts 1 / branches (the predicate is unknown at compile time: the mean branch); calls and async
  wrappers count once. Fused computations are entered only
  with `into_fusions` (their instructions run inside the fusion, not as separate kernels).
  """
  comps = program.computations

  def visit(name: str, mult: float, depth: int):
    if depth > 64 or name not in comps:
      return
    for instr in comps[name]:
      yield name, instr, mult
      op, rest = instr.opcode, instr.rest
      if op == "while":
        body = re.search(r"body=%([\w.\-]+)", rest)
        cond = re.search(r"condition=%([\w.\-]+)", rest)
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)  # XLA's own count, where it found one
        trips = int(known.group(1)) if known else iterations(comps[name], instr, comps.get(cond.group(1), [])) \
            if cond else 1
        if body:
          yield from visit(body.group(1), mult * trips, depth + 1)
      elif op == "conditional":
        branches = [c for _, c in _CALLED.findall(rest) if _ in ("true_computation", "false_computation")]
        for group in _BRANCHES.findall(rest):
          branches += [c.strip().lstrip("%") for c in group.split(",")]
        for b in branches:
          yield from visit(b, mult / max(len(branches), 1), depth + 1)
      elif op in ("call", "async-start") or (op == "fusion" and into_fusions):
        for _, callee in _CALLED.findall(rest):
          yield from visit(callee, mult, depth + 1)

  if program.entry is not None:
    yield from visit(program.entry, 1.0, 0)


# XLA's memory space of host memory in a TPU layout (`{...:T(8,128)S(5)}`): what the offloading remat policies
# (model/remat.py `offload_*`) move their residuals to.
HOST_MEMORY_SPACE = 5
_MEMORY_SPACE = re.compile(r":[^}]*S\((\d+)\)")
# (opcode, operand index of the host buffer or -1 for the result, operand index of the moved array or -1 for
# the result): a slice written into a host buffer, a slice read out of one, a whole array copied either way.
_HOST_MOVES = {"dynamic-update-slice": ((-1, 1),), "dynamic-slice": ((0, -1),), "copy": ((0, -1), (-1, 0))}


def memory_space(shape: str) -> int:
  """The memory space of an array's layout: 0 (HBM) unless the layout names S(n)."""
  m = _MEMORY_SPACE.search(shape)
  return int(m.group(1)) if m else 0


def host_transfers(program: Program) -> list[dict]:
  """Every transfer between device and host memory the program runs: [{"name", "where", "computation", "direction"
  ("to_host" / "from_host"), "bytes" (of one execution), "per_step", "async"}]. Asynchronous transfers are the
  `-start` forms (their `-done` only waits) and the transfers inside a computation an `async-start` runs (newer
  XLA's form), whose "computation" (the scope it overlaps with) is the one issuing that `async-start` ("where":
  the computation holding the instruction); `bytes` is the slice or array moved,
  not the host buffer."""
  issuer = {callee: comp for comp, instrs in program.computations.items() for i in instrs
            if i.opcode == "async-start" for _, callee in _CALLED.findall(i.rest)}
  out, by_comp = [], {}
  for comp, instr, mult in executed(program):
    op = instr.opcode.removesuffix("-start")
    if op not in _HOST_MOVES:
      continue
    shapes = by_comp.setdefault(comp, {i.name: i.shape for i in program.computations[comp]})
    args = [shapes.get(_name(o), "") for o in operands(instr.rest)]
    # the -start forms return (operands, result, context): the result is the tuple's second element
    result = split_tuple(instr.shape)[1] if instr.opcode.endswith("-start") else instr.shape
    for host, moved in _HOST_MOVES[op]:
      host_shape = result if host < 0 else (args[host] if host < len(args) else "")
      if memory_space(host_shape) != HOST_MEMORY_SPACE:
        continue
      moved_shape = result if moved < 0 else (args[moved] if moved < len(args) else "")
      out.append({"name": instr.name, "where": comp, "computation": issuer.get(comp, comp),
                  "direction": "to_host" if host < 0 else "from_host",
                  "bytes": float(sum(shape_bytes(moved_shape))), "per_step": mult,
                  "async": instr.opcode.endswith("-start") or comp in issuer})
  return out


def collective_ops(hlo_text: str, num_devices: int = 1) -> list[dict]:
  """Every collective of a compiled program: [{"kind", "name", "shapes", "bytes", "per_step", "group",
  "async", "scope"}].

  `per_step` counts executions: ops inside while loops (scan over layers, gradient accumulation) are multiplied
  by the loops' trip counts. `bytes` is the per-device result size (the gathered array for all-gather, the
  shard for reduce-scatter). `group` is the replica-group size; `async` whether the schedule issues it as a
  start/done pair or inside a TPU async collective fusion (so compute may run while it is in flight); `scope`
  the computation (entry or loop body) that issues it. Cross-slice (DCN) collectives, which libtpu
  lowers to megascale host transfers, have kind `dcn-<kind>` and `group` the slices they span (each chip
  reduces or gathers with its counterpart in every other slice).
  """
  program = parse(hlo_text)
  ops: dict[tuple[str, str], dict] = {}
  inside_collective: set[str] = set()  # fused computations of reduce-scatter fusions (one collective already)
  parent: dict[str, tuple[str, bool]] = {}  # fused computation -> (the computation issuing it, async?)
  for comp, instr, mult in executed(program, into_fusions=True):
    if comp in inside_collective:
      continue
    scope, is_async = parent.get(comp, (comp, False))
    if instr.opcode == "fusion":
      for _, callee in _CALLED.findall(instr.rest):
        starts = "AsyncCollectiveStart" in program.text.get(callee, "")
        parent.setdefault(callee, (scope, is_async or starts))
    kind = collective_kind(instr.opcode, instr.rest)
    sizes = shape_bytes(instr.shape)
    group = None
    if kind is None and instr.opcode == "send" and "xla_megascale_runtime" in instr.rest:
      m = re.search(r'_xla_host_transfer_rendezvous="([a-z\-]+)', instr.rest)
      kind = "dcn-" + (m.group(1).rstrip("-.") if m else "transfer")
      sizes = sizes[:1]
      group = megascale_slices(instr.rest) or 2  # no target printed: the fewest slices a transfer can span
    if kind is None:
      continue
    if instr.opcode.endswith("-start") and len(sizes) > 1:
      # async forms return (operands..., results...) or, for permutes, (operand, result, context...)
      sizes = sizes[1:2] if kind == "collective-permute" else sizes[len(sizes) // 2:]
    # An async collective that the TPU compiler advances in steps appears inside each step's fusion (start,
    # continuations fused with compute, done), always with the same channel id and source op: one collective.
    # A collective instruction of its own (not inside a fusion) is always one: channel ids are not unique (every
    # collective inside a shard_map carries channel_id=1, and one source line may issue several).
    channel = re.search(r"channel_id=(\d+)", instr.rest)
    source = re.search(r'op_name="([^"]*)"(?: stack_frame_id=(\d+))?', instr.rest)
    fused = comp in parent
    key = ((scope, "channel " + channel.group(1), kind, source.group(0) if source else "") if channel and fused
           else (comp, instr.name))
    is_async = is_async or instr.opcode.endswith("-start")
    if key in ops:
      ops[key]["async"] |= is_async
      if ops[key]["name"] == instr.name:  # the same instruction reached again (a computation called twice)
        ops[key]["per_step"] += mult
      continue
    op = ops[key] = {"kind": kind, "name": instr.name, "shapes": instr.shape, "bytes": sum(sizes), "per_step": mult,
                     "group": group or group_size(instr.rest, num_devices), "async": is_async, "scope": scope}
    if instr.opcode == "fusion":  # the all-reduce inside a reduce-scatter fusion is the same collective
      called = re.search(r"calls=%([\w.\-]+)", instr.rest)
      if called:
        inside_collective.add(called.group(1))
  for op in ops.values():
    op["per_step"] = int(round(op["per_step"]))
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


def _dtype(shape: str) -> str:
  m = _ARRAY.search(shape)
  return m.group(1) if m else shape


def operands(rest: str) -> list[str]:
  """The operand segment of an instruction's `rest`, split at top-level commas (layouts hold parentheses)."""
  depth, cur, out = 0, "", []
  for ch in rest:
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      if depth == 0 and ch == ")":
        break
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return out + ([cur.strip()] if cur.strip() else [])


def matmuls(hlo_text: str) -> list[dict]:
  """Every dot and convolution of a compiled program (the TPU compiler writes matmuls as convolutions), fused
  computations included: [{"name", "opcode", "operands": (lhs dtype, rhs dtype), "result": dtype, "source"}],
  dtypes as HLO spells them (s8, s32, bf16, f32, f8e4m3fn, ...), `source` the jax op that emitted it (metadata
  op_name, e.g. ".../bld,df->blf/dot_general")."""
  out = []
  for instrs in parse(hlo_text).computations.values():
    shapes = {i.name: i.shape for i in instrs}
    for i in instrs:
      if i.opcode not in ("dot", "convolution"):
        continue
      types = []
      for operand in operands(i.rest)[:2]:
        # Operands print as "%name" or, in some dumps, "f32[8,4]{1,0} %name".
        name = _name(operand)
        types.append(_dtype(operand) if _ARRAY.search(operand) else _dtype(shapes.get(name, "?")))
      source = re.search(r'op_name="([^"]*)"', i.rest)
      out.append({"name": i.name, "opcode": i.opcode, "operands": tuple(types), "result": _dtype(i.shape),
                  "source": source.group(1) if source else ""})
  return out
