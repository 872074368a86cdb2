"""Context parallelism on the 8-device CPU mesh (mesh.sequence=8): compiled per-device memory of a training step
at growing sequence lengths for model.context_parallel = all_gather / ring / ulysses, the growth exponent of the
temporaries, the K/V transfers in ring's program, and step times where they fit this machine.

  JAX_PLATFORMS=cpu python benchmarks/context_parallel.py [--lengths 4096,8192,16384,32768] [--time_lengths 4096,8192]
  python benchmarks/context_parallel.py --aot llama3_8b [--topology v5p-128] [--aot_lengths 32768,131072]

The second form compiles the preset ahead of time for a TPU slice (libtpu: the `tpu` extra) with each mode at each
length and prints per-chip memory and the performance model's predicted step time.

Model: 2 layers, d 64, 8 heads of 16 (MHA, so Ulysses can split the heads over 8 devices), batch 1, remat full,
float32, attention_block_size 256. Modes: all_gather (K/V gathered, the CPU's default xla kernel), all_gather_blockwise
(the same with the blockwise kernel), ring, ulysses (blockwise on each device's whole sequences). Memory is XLA's `memory_analysis` of the compiled step
(arguments, outputs and temporaries per device); the exponent is the least-squares slope of log(temp bytes)
against log(length). `collective_permutes` counts the collective-permute instructions of ring's optimised HLO
(per layer and direction: the K/V blocks and, backward, their gradient accumulators), `all_gathers` those of
every program. With lengths doubling, `temp_increment_ratio` is the last increase of the temporaries over the one
before: 2 for linear growth, 4 for quadratic (the exponent alone is pulled down by the fixed part). Step times
are the fastest of 3 steps after the compile (only where --time_lengths asks, and where the 8 devices'
temporaries fit in HOST_BUDGET of this machine's memory).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

# mode -> (model.context_parallel, model.attention_impl): all_gather with the CPU's default kernel (xla: scores of
# the local queries against the whole gathered sequence) and with the blockwise kernel; Ulysses runs blockwise
# attention over each device's whole sequences; the ring's steps always run the blockwise math.
MODES = {"all_gather": ("all_gather", "auto"), "all_gather_blockwise": ("all_gather", "blockwise"),
         "ring": ("ring", "auto"), "ulysses": ("ulysses", "blockwise")}


def _setup() -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer(mode: str, length: int):
  import jax
  import configs
  from parallel import mesh as mesh_lib
  from train.core import step as step_lib
  config = configs.load("tiny", **{
      "model.vocab_size": 512, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 8,
      "model.num_kv_heads": 8, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": length,
      "model.context_parallel": MODES[mode][0], "model.attention_impl": MODES[mode][1],
      "model.attention_block_size": 256, "train.batch_size": 1, "train.seq_len": length, "train.remat": "full",
      "mesh.data": 1, "mesh.sequence": 8})
  return step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()))


HOST_BUDGET = 8 * 2**30  # the simulated devices' temporaries together, bytes: timed only below this


def _measure(mode: str, length: int, timed: bool) -> dict:
  import jax
  from train.core import step as step_lib
  trainer = _trainer(mode, length)
  start = time.perf_counter()
  mem = trainer.memory_analysis()
  hlo = trainer.compiled().as_text()
  row = {"compile_s": round(time.perf_counter() - start, 1), "temp_bytes": mem["temp_bytes"],
         "argument_bytes": mem["argument_bytes"], "collective_permutes": len(re.findall(r"collective-permute-start|"
                                                                                  r" collective-permute\(", hlo)),
         "all_gathers": len(re.findall(r"all-gather-start|\ball-gather\(", hlo)),
         "all_to_alls": len(re.findall(r"\ball-to-all\(", hlo))}
  if timed and mem["temp_bytes"] * 8 > HOST_BUDGET:
    row["step_s"] = f"not run: 8 devices x {mem['temp_bytes'] / 2**30:.1f} GiB exceed this host"
  elif timed:
    state = trainer.init()
    batch = trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 0))
    times = []
    for _ in range(4):
      t0 = time.perf_counter()
      state, metrics = trainer.step_fn(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    row["step_s"] = round(min(times[1:]), 3)
    row["loss"] = float(metrics["loss"])
  return row


def _slope(lengths, values) -> float:
  xs, ys = [math.log(x) for x in lengths], [math.log(y) for y in values]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


AOT_MODES = ("all_gather", "ring", "ulysses")


def aot_rows(preset: str, topology: str, lengths, sequence: int, batch: int) -> dict:
  """`python -m train.compile` of `preset` at each length and mode (bf16, remat full, fsdp over the rest of the
  chips, mesh.sequence = `sequence`): per-chip bytes, whether they fit, the predicted step, seconds to compile."""
  import subprocess
  rows = {}
  for length in lengths:
    for mode in AOT_MODES:
      cmd = [sys.executable, "-m", "train.compile", f"--config={preset}", f"--topology={topology}", "--json",
             "--max_compiles=0",  # a program that does not fit is reported, not searched for one that does
             "--config.mesh.data=1", "--config.mesh.fsdp=-1", f"--config.mesh.sequence={sequence}",
             f"--config.model.context_parallel={mode}", "--config.model.param_dtype=bfloat16",
             "--config.model.dtype=bfloat16", "--config.train.remat=full", f"--config.train.batch_size={batch}",
             f"--config.train.seq_len={length}", f"--config.model.max_seq_len={length}"]
      done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
          os.path.abspath(__file__))), env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
      if done.returncode not in (0, 1):  # 1: compiled, does not fit
        rows[f"{mode}@{length}"] = {"error": done.stderr.strip().splitlines()[-1][:300]}
        continue
      out = json.loads(done.stdout.strip().splitlines()[-1])
      predicted = out.get("predicted") or {}  # none for a program the compiler refused for lack of HBM
      rows[f"{mode}@{length}"] = {
          "bytes_per_chip": out["memory"].get("total_bytes"), "temp_bytes": out["memory"].get("temp_bytes"),
          "fits": out["fits"], "hbm_bytes": out["hbm_bytes"], "compile_s": round(out["compile_seconds"], 1),
          "predicted_step_s": round(predicted["step_seconds"], 2) if predicted else None,
          "predicted_mfu": round(predicted["mfu"], 3) if predicted else None,
          "dominant": predicted.get("dominant")}
      print(json.dumps({f"{mode}@{length}": rows[f"{mode}@{length}"]}), file=sys.stderr, flush=True)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="4096,8192,16384,32768")
  parser.add_argument("--time_lengths", default="4096,8192",
                      help="lengths whose steps are also run and timed")
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--aot", default="", help="instead: a preset compiled ahead of time for TPU, e.g. llama3_8b")
  parser.add_argument("--topology", default="v5p-128")
  parser.add_argument("--aot_lengths", default="32768,131072")
  parser.add_argument("--aot_sequence", type=int, default=2, help="mesh.sequence (inside one host: its chips)")
  parser.add_argument("--aot_batch", type=int, default=32)
  args = parser.parse_args()
  if args.aot:
    print(json.dumps({"preset": args.aot, "topology": args.topology, "sequence": args.aot_sequence,
                      "batch": args.aot_batch, "rows": aot_rows(args.aot, args.topology,
                                                                [int(x) for x in args.aot_lengths.split(",")],
                                                                args.aot_sequence, args.aot_batch)}, indent=1))
    return
  _setup()
  lengths = [int(x) for x in args.lengths.split(",")]
  timed = {int(x) for x in args.time_lengths.split(",") if x}
  out = {"mesh": "sequence=8 (8 simulated CPU devices)", "rows": {}}
  for mode in args.modes.split(","):
    rows = {}
    for length in lengths:
      rows[length] = _measure(mode, length, length in timed)
      print(json.dumps({mode: {length: rows[length]}}), file=sys.stderr, flush=True)
    out["rows"][mode] = rows
    if len(lengths) > 1:
      temps = [rows[n]["temp_bytes"] for n in lengths]
      out["rows"][mode]["temp_growth_exponent"] = round(_slope(lengths, temps), 3)
    if len(lengths) > 2:  # a fixed part hides the growth in the exponent: the last increment over the one before
      out["rows"][mode]["temp_increment_ratio"] = round((temps[-1] - temps[-2]) / (temps[-2] - temps[-3]), 2)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
