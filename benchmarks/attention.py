"""Attention implementations: time and compiled memory of forward + backward versus sequence length.

  JAX_PLATFORMS=cpu python benchmarks/attention.py [--seq_lens 512,1024,2048,4096,8192] [--repeats 2]

Prints one JSON object: per implementation and length, `temp_bytes` (XLA's compiled temporary memory for
value-and-grad, from `memory_analysis()`) and `seconds` (median wall time per step; null when the temporaries
exceed --max_run_bytes, then only compiled). The blockwise implementation's memory grows linearly with length,
the others' quadratically.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import attention


def measure(impl, seq_len, args):
  B, H, G, K = args.batch, args.heads, args.kv_heads, args.head_dim
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, seq_len, H, K)), jnp.float32)
  kv = jnp.asarray(rng.normal(size=(B, seq_len, G, K)), jnp.float32)
  seg = jnp.ones((B, seq_len), jnp.int32)
  fn = functools.partial(attention.attend, impl, block_size=args.block_size)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg, args.window).astype(jnp.float32) ** 2)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  t0 = time.perf_counter()
  compiled = step.lower(q, kv, kv).compile()
  compile_s = time.perf_counter() - t0
  temp = compiled.memory_analysis().temp_size_in_bytes
  result = {"temp_bytes": int(temp), "compile_seconds": round(compile_s, 3), "seconds": None}
  if temp <= args.max_run_bytes:
    jax.block_until_ready(compiled(q, kv, kv))
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(q, kv, kv))
      times.append(time.perf_counter() - t0)
    result["seconds"] = round(statistics.median(times), 4)
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq_lens", default="512,1024,2048,4096,8192")
  p.add_argument("--impls", default="xla,dot_product,blockwise")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv_heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--block_size", type=int, default=512)
  p.add_argument("--window", type=int, default=0, help="sliding window in tokens (0 = full causal)")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--max_run_bytes", type=float, default=1.5 * 2**30,
                 help="only compile (no timing) when temporaries exceed this many bytes")
  args = p.parse_args()
  lens = [int(s) for s in args.seq_lens.split(",")]
  out = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
         "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
         "block_size": args.block_size, "window": args.window, "what": "value_and_grad of sum(attention^2)",
         "results": {}}
  for impl in args.impls.split(","):
    out["results"][impl] = {str(t): measure(impl, t, args) for t in lens}
  # Memory growth from the shortest to the longest length, relative to the growth in length.
  for impl, rows in out["results"].items():
    first, last = rows[str(lens[0])]["temp_bytes"], rows[str(lens[-1])]["temp_bytes"]
    out.setdefault("memory_growth_per_length_growth", {})[impl] = round((last / first) / (lens[-1] / lens[0]), 2)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
