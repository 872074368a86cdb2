"""Pipeline parallelism on the 8-device CPU mesh: tokens/s and bubble for S stages x M microbatches, the fit of
step time to the schedule's formula, and compiled memory against M with and without per-stage remat.

  JAX_PLATFORMS=cpu python benchmarks/pipeline.py [--steps 3] [--stages 1,2,4]

Prints one JSON object. For S in --stages (the rest of the 8 devices on `data`) and M in {S, 2S, 4S}: the bubble
(S-1)/(M+S-1), the best step time of --steps steps on one fixed global batch, tokens/s, and per-device compiled
memory (temporaries). With a fixed global batch B, a stage runs T = M+S-1 iterations on B/M rows each, so the
step time should follow a + b * (M+S-1)/M = a + b / (1 - bubble); "fit" gives a, b and R^2 over the S > 1 runs.
The 8 simulated devices share the machine's cores, so only ratios mean anything (and only on an idle machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import configs  # noqa: E402
from parallel import mesh as mesh_lib  # noqa: E402
from train.core import step as step_lib  # noqa: E402

MODEL = {"model.vocab_size": 512, "model.d_model": 128, "model.num_layers": 8, "model.num_heads": 4,
         "model.num_kv_heads": 4, "model.head_dim": 32, "model.mlp_dim": 512, "model.max_seq_len": 128,
         "train.batch_size": 32, "train.seq_len": 128}


def measure(stages: int, microbatches: int, remat: bool, steps: int) -> dict:
  """Compiles the step for S stages (data = 8 / S) and M microbatches; times `steps` steps when steps > 0."""
  overrides = {**MODEL, "mesh.data": 8 // stages, "mesh.stage": stages}
  if stages > 1:
    overrides.update({"train.pipeline_microbatches": microbatches, "train.pipeline_remat": remat})
  config = configs.load("tiny", **overrides)
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh))
  start = time.perf_counter()
  compiled = trainer.compiled()
  out = {"stages": stages, "microbatches": microbatches, "pipeline_remat": remat,
         "bubble": (stages - 1) / (microbatches + stages - 1), "compile_s": time.perf_counter() - start,
         "temp_bytes": trainer.memory_analysis()["temp_bytes"]}
  if steps:
    state = trainer.init()
    batch = trainer.batch_to_device(step_lib.synthetic_batch(config, 0))
    times = []
    for _ in range(steps + 1):  # the first call also transfers; keep the best of the rest
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    out["step_s"] = min(times[1:])
    out["tokens_per_sec"] = config.train.batch_size * config.train.seq_len / out["step_s"]
    out["loss"] = float(metrics["loss"])
  return out


def fit(runs: list[dict]) -> dict:
  """Least squares step_s = a + b * (M+S-1)/M over the pipelined runs; R^2 of the fit."""
  x = np.array([(r["microbatches"] + r["stages"] - 1) / r["microbatches"] for r in runs])
  y = np.array([r["step_s"] for r in runs])
  A = np.stack([np.ones_like(x), x], axis=1)
  (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
  residual = y - A @ np.array([a, b])
  r2 = 1 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum())
  return {"a_s": float(a), "b_s": float(b), "r2": r2}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--stages", default="1,2,4")
  args = p.parse_args()
  runs, memory = [], []
  for S in [int(s) for s in args.stages.split(",")]:
    for M in ([1] if S == 1 else [S, 2 * S, 4 * S]):
      runs.append(measure(S, M, False, args.steps))
      if S > 1:
        memory.append(measure(S, M, True, 0))
      print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
  pipelined = [r for r in runs if r["stages"] > 1]
  print(json.dumps({"runs": runs, "pipeline_remat_memory": memory,
                    "fit": fit(pipelined) if len(pipelined) > 2 else None}, indent=1))


if __name__ == "__main__":
  main()
