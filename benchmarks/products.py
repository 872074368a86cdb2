"""The matrix products of a compiled XLA program, timed alone: the floor under any program that computes them.

`products_only(compiled.as_text())` reads every float32 `dot` of an optimised HLO module (fused or not; a while
loop's body once per iteration of XLA's known trip count) and runs the same products (operand shapes, dimension
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

_DOT = re.compile(r"%[\w.\-]+ = f32\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)((?:, \w+=\{[\d,]*\})*)")
_COMPUTATION = re.compile(r"^(ENTRY )?(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}$", re.M | re.S)


def _executions(hlo_text: str) -> dict[str, int]:
  """How many times each computation of an optimised HLO module runs per call: a while loop's body (and what it
  calls) as many times as XLA's known trip count, everything else (each branch of a conditional too) once per
  caller."""
  bodies = {m.group(2): m.group(3) for m in _COMPUTATION.finditer(hlo_text)}
  entry = next(m.group(2) for m in _COMPUTATION.finditer(hlo_text) if m.group(1))
  runs = {name: 0 for name in bodies}

  def visit(name, times):
    runs[name] += times
    for line in bodies[name].split("\n"):
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
      for key, callees in re.findall(r"(calls|to_apply|body|condition|branch_computations|true_computation|"
                                     r"false_computation)=(\{[^}]*\}|%[\w.\-]+)", line):
        for callee in re.findall(r"%[\w.\-]+", callees):
          if callee in bodies:
            visit(callee, times * (int(trips.group(1)) if trips and key == "body" else 1))

  visit(entry, 1)
  return runs


def products_only(hlo_text: str, reps: int = 10) -> dict:
  """The matrix products of a compiled step, alone: every float32 `dot` of its optimised HLO (fused or not, a
  loop body's once per iteration) with the same operand shapes and dimension numbers, on random operands, in one
  jitted function; fastest of `reps`.

  -> {"seconds", "gflop", "count"}: no step of that model can run faster on this machine than its products do
  here, unless the products themselves get faster.
  """
  shapes = {m.group(1): [int(x) for x in m.group(2).split(",") if x]
            for m in re.finditer(r"%([\w.\-]+) = f32\[([\d,]*)\]", hlo_text)}
  runs = _executions(hlo_text)
  dots, flops = [], 0
  for computation in _COMPUTATION.finditer(hlo_text):
    for m in _DOT.finditer(computation.group(3)):
      out, lhs, rhs, dims = m.groups()
      d = {k: tuple(int(x) for x in v.split(",") if x) for k, v in re.findall(r"(\w+)=\{([\d,]*)\}", dims)}
      numbers = ((d.get("lhs_contracting_dims", ()), d.get("rhs_contracting_dims", ())),
                 (d.get("lhs_batch_dims", ()), d.get("rhs_batch_dims", ())))
      contracted = math.prod(shapes[lhs][i] for i in numbers[0][0])
      for _ in range(runs[computation.group(2)]):
        dots.append((shapes[lhs], shapes[rhs], numbers))
        flops += 2 * math.prod(int(x) for x in out.split(",") if x) * contracted
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
