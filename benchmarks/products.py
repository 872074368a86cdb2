"""The matrix products of a compiled XLA program, timed alone: the floor under any program that computes them.

`products_only(compiled.as_text())` takes every float32 `dot` the optimised HLO module executes (`train.hlo`:
fused or not; a while loop's body once per iteration) and runs the same products (operand shapes, dimension
numbers) on random operands in one jitted function. benchmarks/train_step.py and benchmarks/evals.py compare it
with the peers' whole step or request times: PyTorch's step time over this floor is the most any meshlm step
could reach against it on the machine, however little time everything besides the products took.
"""
from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from train.planning import hlo


def _dims(shape: str) -> list[int]:
  return [int(d) for d in re.match(r"\w+\[([\d,]*)\]", shape).group(1).split(",") if d]


def products_only(hlo_text: str, reps: int = 10) -> dict:
  """The matrix products of a compiled step, alone: every float32 `dot` it executes (fused or not, a loop body's
  once per iteration, `train.planning.hlo.executed`) with the same operand shapes and dimension numbers, on random
  operands, in one jitted function; fastest of `reps`.

  -> {"seconds", "gflop", "count"}: no step of that model can run faster on this machine than its products do
  here, unless the products themselves get faster.
  """
  program = hlo.parse(hlo_text)
  shapes = {i.name: i.shape for instrs in program.computations.values() for i in instrs}
  dots, flops = [], 0
  for _, instr, runs in hlo.executed(program, into_fusions=True):
    if instr.opcode != "dot" or not instr.shape.startswith("f32"):
      continue
    lhs, rhs = (_dims(shapes[o.split()[-1].lstrip("%")]) for o in hlo.operands(instr.rest)[:2])
    d = {k: tuple(int(x) for x in v.split(",") if x) for k, v in re.findall(r"(\w+_dims)=\{([\d,]*)\}", instr.rest)}
    numbers = ((d.get("lhs_contracting_dims", ()), d.get("rhs_contracting_dims", ())),
               (d.get("lhs_batch_dims", ()), d.get("rhs_batch_dims", ())))
    for _ in range(round(runs)):  # a conditional's branches count as their mean
      dots.append((lhs, rhs, numbers))
      flops += 2 * math.prod(_dims(instr.shape)) * math.prod(lhs[i] for i in numbers[0][0])
  rng = np.random.default_rng(0)
  operands = [(jnp.asarray(rng.normal(size=a), jnp.float32), jnp.asarray(rng.normal(size=b), jnp.float32))
              for a, b, _ in dots]

  @jax.jit
  def products(operands):
    return [jax.lax.dot_general(a, b, numbers) for (a, b), (_, _, numbers) in zip(operands, dots)]

  jax.block_until_ready(products(operands))
  best = math.inf
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(products(operands))
    best = min(best, time.perf_counter() - start)
  return {"seconds": best, "gflop": flops / 1e9, "count": len(dots)}
