"""The performance model (train/planning/predict.py) on MaxText's own compiled train step, beside meshlm's program
for the same recipe (RECIPES: MaxText configs/tpu/v5e/{16b,32b,64b}.sh on today's model, and the v6e-256 Llama
3.1 8B tiering recipe), no TPU needed.

  python benchmarks/predict_vs_maxtext.py --maxtext_venv VENV [--row 16b] [--layers 2,4 | --full] [--hlo_dir DIR]
      [--set KEY=VALUE,...] [--maxtext_mask causal|full] [--json FILE]

MaxText runs in its own virtual environment (Python 3.12, its own jax), as a subprocess: VENV must hold the PyPI
`maxtext` package and the libtpu wheel its jax pairs with (`bash shared/peers/maxtext/install.sh VENV`, then
`VENV/bin/pip install "libtpu==<jax[tpu]'s pin>"`, e.g. 0.0.50.* for jax 0.12.0). Without them this script says
what is missing and exits 0. MaxText's `train_compile` (its ahead-of-time compile for the recipe's topology) is
run with the recipe's flags and LIBTPU_INIT_ARGS, `base_num_decoder_layers` chosen for each depth of `--layers`
(global_parameter_scale multiplies it: x2 for 16b and 32b, x4 for 64b, whose depths must be multiples of 4), and
XLA's dump of the train step; its optimised HLO (`*.jit_train_step*.after_optimizations.txt`) is the program
predicted. meshlm's program is the same model, batch, sequence, remat and mesh (the recipe's preset and overrides:
splash attention, `train.xla_overlap` for the recipe's libtpu flags; `--set` adds overrides) at the same depths,
compiled on this process's libtpu through benchmarks/predict_maxtext.py's keyed cache.

Both programs go through the same predictor (predict.MATMUL_EFFICIENCY, the v5e-256 of hardware.py) and every
figure is extrapolated linearly in depth from the two compiled depths to the recipe's (predict_maxtext's rule).
Two adaptations of MaxText's text, both printed in the output:
- newer XLA prints a tuple element operand as `%name#i` (no get-tuple-element); the predictor looks operands up by
  name, so the text is rewritten with explicit get-tuple-element instructions first (`train.planning.hlo.untuple_refs`); without it
  every kernel fed by a multi-output fusion, a while loop's parameter or an async collective is left uncosted;
- MaxText's splash kernels carry no meshlm mask scope, so the predictor would price them with every tile visible;
  `--maxtext_mask causal` (default; MaxText's llama2 decoder is causal) adds the scope `splash_mask_causal`.

Prints a summary on stderr and one JSON object on stdout: per side the step-time terms, MFU in MaxText's FLOP
convention (published 16b: 61.10%), per-chip memory (arguments + outputs + temporaries - aliased, as the TPU
compiler reports it), collective bytes and predicted seconds by kind, the time by kernel category, the top ops of
the deepest compiled program, the Mosaic kernels; and the ratio MaxText / meshlm of each step-time term.
`--hlo_dir DIR` keeps MaxText's HLO and report (maxtext_native_<row>_L<depth>_<digest>.{hlo,json}, the digest of
the command, the libtpu flags and the versions) and meshlm's (predict_maxtext's files) and reads them back.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import configs
import predict_maxtext as pm  # benchmarks/predict_maxtext.py (this script's folder is on sys.path)
from train.planning import compile as aot
from train.planning import hardware
from train.planning import hlo
from train.planning import predict

# MaxText configs/tpu/v5e/<row>.sh: the recipe's flags and libtpu flags (16b/32b/64b share them but for the scale
# and the per-device batch). gcs_metrics is off here (no cloud); the rest decide the program.
RECIPE_FLAGS = ("steps=15", "enable_checkpointing=false", "remat_policy=full", "max_target_length=2048",
                "use_iota_embed=true", "reuse_example_batch=1", "dataset_type=synthetic", "attention=flash",
                "gcs_metrics=false", "enable_goodput_recording=false", "monitor_goodput=false", "jax_cache_dir=")
RECIPE_LIBTPU_ARGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true")
_SA_BLOCKS = tuple(f"sa_block_{k}=2048" for k in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute",
                                                    "q_dq", "kv_dq"))


def _v5e(scale: int, batch: int) -> dict:
  return {"config": f"maxtext_{scale}b", "overrides": {}, "topology": "v5e-256", "libtpu": RECIPE_LIBTPU_ARGS,
          "model_args": (f"global_parameter_scale={scale}", f"per_device_batch_size={batch}"), "flags": RECIPE_FLAGS,
          "layers_per_base": 2**((scale.bit_length() - 1) // 3),  # layers grow by 2^(log2(scale) // 3)
          "published_mfu": pm.ROWS[f"{scale}b"].published_mfu}


# One row per recipe: meshlm's preset and overrides, MaxText's train_compile flags (both the same model, batch,
# sequence, remat and mesh) and libtpu flags, the slice. The v6e row is MaxText's tiering recipe
# (benchmarks/maxtext_trillium_model_configs.py `llama3_1_8b_8192`) with its remat policy (the layer input and
# q/k/v/out offloaded to host: meshlm's offload_qkv_out) and its XLA flags less the SparseCore and
# continuation-fusion sets.
RECIPES = {
    "16b": _v5e(16, 6), "32b": _v5e(32, 4), "64b": _v5e(64, 2),
    "llama3_1_8b_v6e": {
        "config": "llama3_1_8b", "overrides": pm.ROWS["llama3_1_8b_v6e"].overrides, "topology": "v6e-256",
        "model_args": ("model_name=llama3.1-8b", "override_model_config=true", "per_device_batch_size=4"),
        "flags": ("max_target_length=8192", "remat_policy=custom", "decoder_layer_input=offload",
                  "query_proj=offload", "key_proj=offload", "value_proj=offload", "out_proj=offload",
                  "attention=flash", *_SA_BLOCKS,
                  "use_iota_embed=true", "reuse_example_batch=1", "dataset_type=synthetic", "steps=15",
                  "enable_checkpointing=false", "gcs_metrics=false", "enable_goodput_recording=false",
                  "monitor_goodput=false", "jax_cache_dir="),
        # the recipe's DENSE_VMEM_LIMIT + DATA_PARALLEL_OVERLAP + HOST_OFFLOAD_FLAGS (benchmarks/xla_flags_library.py:
        # the scheduler settings that let the host transfers run asynchronously); its CF_FOR_ALL_GATHER
        # (continuation fusion) is refused by libtpu 0.0.50 on v6e ("not supported/recommended on platforms other
        # than TPU v5e")
        "libtpu": "--xla_tpu_scoped_vmem_limit_kib=98304 --xla_tpu_enable_data_parallel_all_reduce_opt=true "
                  "--xla_tpu_data_parallel_opt_different_sized_ops=true --xla_enable_async_all_gather=true "
                  "--xla_tpu_enable_all_experimental_scheduler_features=true "
                  "--xla_tpu_enable_scheduler_memory_pressure_tracking=true --xla_tpu_host_transfer_overlap_limit=24 "
                  "--xla_tpu_aggressive_opt_barrier_removal=ENABLED --xla_lhs_prioritize_async_depth_over_stall=ENABLED "
                  "--xla_tpu_enable_ag_backward_pipelining=true "
                  "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
                  "--xla_should_add_loop_invariant_op_in_chain=ENABLED --xla_max_concurrent_host_send_recv=100 "
                  "--xla_tpu_scheduler_percent_shared_memory_limit=100 --xla_latency_hiding_scheduler_rerun=2",
        "layers_per_base": 1,
        "published_mfu": None},
}
TERMS = pm.TERMS


def say(*args) -> None:
  print(*args, file=sys.stderr, flush=True)


# ---- MaxText's side ----------------------------------------------------------------------------------------
_PROBE = r"""
import importlib.metadata as m, json
out = {}
for d in ("maxtext", "jax", "jaxlib", "libtpu"):
  try:
    out[d] = m.version(d)
  except m.PackageNotFoundError:
    out[d] = None
req = [r for r in (m.requires("jax") or []) if r.startswith("libtpu") and "tpu" in r.split(";", 1)[-1]]
out["libtpu_pin"] = req[0].split(";")[0].strip() if req else None
print(json.dumps(out))
"""


def maxtext_versions(venv: str) -> tuple[dict | None, str]:
  """({maxtext, jax, jaxlib, libtpu, libtpu_pin}, "") of VENV's Python, or (None, why not)."""
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(python):
    return None, f"{venv} has no bin/python"
  try:
    done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                          env=_clean_env())
  except (OSError, subprocess.TimeoutExpired) as e:
    return None, f"{python} does not run: {e}"
  if done.returncode != 0:
    return None, f"{python} failed: {done.stderr.strip()[-500:]}"
  return json.loads(done.stdout.strip().splitlines()[-1]), ""


def _clean_env() -> dict:
  """This process's environment less what would steer MaxText's interpreter at meshlm's packages or settings:
  importing jax here sets TPU_LIBRARY_PATH to this environment's libtpu, which MaxText's jax would then load
  instead of its own (an older libtpu rejects its Pallas kernels: "no such field: 'debug_locations'")."""
  return {k: v for k, v in os.environ.items()
          if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XLA_FLAGS", "LIBTPU_INIT_ARGS",
                       "TPU_LIBRARY_PATH")
          and not k.startswith("JAX_")}


def maxtext_command(venv: str, row: str, depth: int, out_dir: str) -> list[str]:
  """MaxText's train_compile of `row`'s recipe at `depth` decoder layers for one slice of its topology."""
  recipe = RECIPES[row]
  per_base = recipe["layers_per_base"]
  if depth % per_base:
    raise SystemExit(f"--layers: {row}'s MaxText model builds multiples of {per_base} layers; {depth} is not one")
  return [os.path.join(venv, "bin", "python"), "-m", "maxtext.trainers.pre_train.train_compile",
          f"run_name=predict_vs_maxtext_{row}_L{depth}", f"base_output_directory={out_dir}/out",
          f"compile_topology={recipe['topology']}", "compile_topology_num_slices=1", *recipe["model_args"],
          f"base_num_decoder_layers={depth // per_base}", *recipe["flags"]]


_MEMORY = re.compile(r"Memory analysis: CompiledMemoryStats\(([^)]*)\)")


def parse_memory(log: str) -> dict:
  """MaxText's printed CompiledMemoryStats as meshlm's memory dict (bytes per chip)."""
  m = _MEMORY.search(log)
  if not m:
    return {}
  stats = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}
  out = {"argument_bytes": stats["argument_size_in_bytes"], "output_bytes": stats["output_size_in_bytes"],
         "temp_bytes": stats["temp_size_in_bytes"], "alias_bytes": stats["alias_size_in_bytes"],
         "generated_code_bytes": stats["generated_code_size_in_bytes"]}
  out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
  return out


def maxtext_program(venv: str, versions: dict, row: str, depth: int, hlo_dir: str | None) -> tuple[str, dict]:
  """(optimised HLO text, report) of MaxText's train step for `row` at `depth` layers: compiled by MaxText's
  train_compile in `venv`, or read back from `hlo_dir` when a report there has the same key."""
  with tempfile.TemporaryDirectory(prefix="maxtext_compile_") as tmp:
    cmd = maxtext_command(venv, row, depth, tmp)
    key = {"args": cmd[3:], "libtpu_init_args": RECIPES[row]["libtpu"],
           "versions": {k: versions[k] for k in ("maxtext", "jax", "jaxlib", "libtpu")}}
    key["args"] = [a for a in key["args"] if not a.startswith("base_output_directory=")]
    path = pm.keyed_path(hlo_dir, f"maxtext_native_{row}_L{depth}", key) if hlo_dir else None
    found = pm.read_keyed(path, key) if path else None
    if found:
      return found[0], dict(found[1], cached=True, hlo_file=path)
    dump = os.path.join(tmp, "xla_dump")
    env = dict(_clean_env(), DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               LIBTPU_INIT_ARGS=RECIPES[row]["libtpu"],
               XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=jit_train_step --xla_dump_hlo_as_text")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = done.stdout + done.stderr
    if done.returncode != 0 or "Jitting and compilation complete!" not in log:
      raise RuntimeError(f"MaxText's train_compile failed (exit {done.returncode}): {' '.join(cmd)}\n"
                         + log[-4000:])
    files = [f for f in glob.glob(os.path.join(dump, "*jit_train_step*.after_optimizations.txt"))]
    if len(files) != 1:
      raise RuntimeError(f"expected one optimised train-step module in {dump}, found {files}")
    with open(files[0]) as f:
      text = f.read()
    memory = parse_memory(log)
    report = {"compile_seconds": seconds, "memory": memory, "command": " ".join(cmd),
              "dump_file": os.path.basename(files[0])}
    if path:
      pm.write_keyed(path, text, report, key)
    return text, dict(report, cached=False, hlo_file=path)


# ---- making MaxText's text readable by the predictor ------------------------------------------------------
def add_mask_scope(text: str, mask: str) -> str:
  """Puts `splash_mask_<mask>` at the head of the op_name of every splash kernel call that has no mask scope
  (the predictor reads the mask of a splash kernel from that scope; train/planning/predict.py's _splash_cost)."""
  from model import splash  # pylint: disable=g-import-not-at-top
  out = []
  for line in hlo._logical_lines(text):  # pylint: disable=protected-access
    if re.match(r"\s*(?:ROOT\s+)?%splash_m[qh]a_", line) and splash.MASK_SCOPE not in line:
      line = line.replace('metadata={op_name="', f'metadata={{op_name="{splash.MASK_SCOPE}{mask}/', 1)
    out.append(line)
  return "\n".join(out) + "\n"


def for_predictor(text: str, mask: str) -> str:
  return add_mask_scope(hlo.untuple_refs(text), mask) if mask != "none" else hlo.untuple_refs(text)


# ---- the prediction ---------------------------------------------------------------------------------------
def _category(row: dict) -> str:
  if row["op"] in hlo.KINDS or row["op"].startswith("dcn-"):
    return f"collective {row['op']}"
  if re.match(r"splash_m[qh]a_", row["name"]):
    return "splash attention kernels"
  if row["op"] == "custom-call":
    return "other custom calls"
  return f"{row['bound']}-bound kernels"


def maxtext_flops_per_chip(c, tpu) -> float:
  """MaxText's own count today (calculate_tflops_training_per_device, causal attention halved) per chip: the
  same numerator for both sides, so the MFUs compare like the step times."""
  return pm.CONVENTIONS["matmul_causal"](c.model, c.train.seq_len) * c.train.batch_size / tpu.num_chips


def analyse(programs: list[tuple[int, str]], memories: list[dict], c, tpu, top: int) -> dict:
  """The predictor's figures for programs [(depth, text)] of config `c` on slice `tpu`, extrapolated to
  c.model.num_layers."""
  depths = [d for d, _ in programs]
  target = c.model.num_layers
  preds, categories, coll_bytes, coll_seconds = [], [], [], []
  for _, text in programs:
    p = predict.predict(text, tpu.chip, num_devices=tpu.num_chips, torus=tpu.torus,
                        model_flops_per_chip=0.0, tokens_per_chip=1.0, top=10**9)
    preds.append(p)
    cat: dict[str, float] = {}
    for r in p["top_ops"]:
      cat[_category(r)] = cat.get(_category(r), 0.0) + r["seconds"]
    categories.append(cat)
    nbytes: dict[str, float] = {}
    for op in hlo.collective_ops(text, tpu.num_chips):
      nbytes[op["kind"]] = nbytes.get(op["kind"], 0.0) + op["bytes"] * op["per_step"]
    coll_bytes.append(nbytes)
  out = {k: pm.lerp([p[k] for p in preds], depths, target) for k in TERMS + ("hardware_flops_per_chip",)}
  out["uncosted_kernels"] = max(p["uncosted_kernels"] for p in preds)
  peak = tpu.chip.peak_tflops * 1e12
  out["mfu_maxtext_convention"] = maxtext_flops_per_chip(c, tpu) / (out["step_seconds"] * peak)
  names = sorted(set().union(*categories))
  out["seconds_by_category"] = {n: pm.lerp([cat.get(n, 0.0) for cat in categories], depths, target) for n in names}
  kinds = sorted(set().union(*coll_bytes))
  out["collective_bytes_per_chip"] = {k: pm.lerp([b.get(k, 0.0) for b in coll_bytes], depths, target)
                                      for k in kinds}
  keys = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes")
  out["memory_per_chip"] = {k: pm.lerp([m.get(k, 0) for m in memories], depths, target) for k in keys}
  out["memory_per_chip"]["fits"] = out["memory_per_chip"]["total_bytes"] <= tpu.chip.hbm_bytes
  out["top_ops_deepest_program"] = [
      {k: r[k] for k in ("name", "op", "bound", "per_step", "seconds", "flops", "bytes")}
      | {"op_name": r["op_name"][-90:]} for r in preds[-1]["top_ops"][:top]]
  out["mosaic_kernels_deepest_program"] = hlo.mosaic_kernels(programs[-1][1])
  out["compiled_depths"], out["num_layers"] = depths, target
  return out


def summary(row: str, sides: dict, ratio: dict) -> str:
  depths = sides["meshlm"]["compiled_depths"]
  how = "compiled whole" if len(depths) == 1 else f"extrapolated to {sides['meshlm']['num_layers']} layers from {depths}"
  lines = [f"{row} on {RECIPES[row]['topology']}, {how}: predicted seconds per step (MaxText / meshlm = ratio)"]
  for k in TERMS:
    lines.append(f"  {k:28s} {sides['maxtext'][k]:8.3f}  {sides['meshlm'][k]:8.3f}  {ratio[k]:6.3f}")
  lines.append(f"  {'MFU (MaxText FLOPs today)':28s} "
               f"{sides['maxtext']['mfu_maxtext_convention']:8.2%}  {sides['meshlm']['mfu_maxtext_convention']:8.2%}")
  for side in ("maxtext", "meshlm"):
    s = sides[side]
    mem = s["memory_per_chip"]
    lines.append(f"{side}: memory/chip {mem['total_bytes'] / 2**30:.2f} GiB (temp {mem['temp_bytes'] / 2**30:.2f});"
                 f" collective GB/chip " + ", ".join(f"{k} {v / 1e9:.1f}"
                                                     for k, v in s["collective_bytes_per_chip"].items())
                 + f"; uncosted kernels {s['uncosted_kernels']}")
    lines.append("  by category: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                               sorted(s["seconds_by_category"].items(), key=lambda kv: -kv[1])))
    for r in s["top_ops_deepest_program"][:8]:
      lines.append(f"    {r['seconds']:.4f} s x{r['per_step']:<4g} {r['op']:12s} {r['bound']:19s} {r['name'][:34]:34s}"
                   f" {r['op_name'][-55:]}")
  return "\n".join(lines)


def _maxtext_ready(venv: str) -> dict | None:
  """VENV's MaxText versions, or None after saying what is missing (the script then exits 0)."""
  versions, why = maxtext_versions(venv)
  if versions is None or not versions.get("maxtext"):
    print(f"no MaxText in {venv}: {why or 'the maxtext package is not installed'} "
          f"(install: bash shared/peers/maxtext/install.sh {venv}); nothing compared")
    return None
  if not versions.get("libtpu"):
    pin = versions.get("libtpu_pin") or "libtpu"
    print(f"{venv} has MaxText {versions['maxtext']} but no libtpu, the TPU compiler its AOT compile "
          f"needs: {venv}/bin/pip install '{pin}'; nothing compared")
    return None
  say(f"MaxText {versions['maxtext']} (jax {versions['jax']}, libtpu {versions['libtpu']}) in {venv}")
  return versions


def meshlm_config(name: str, overrides: dict, depth: int | None = None):
  """meshlm's config of recipe `name` (its preset, the recipe's and the command's overrides, the depth)."""
  recipe = RECIPES[name]
  extra = {"model.num_layers": depth} if depth else {}
  return configs.load(recipe["config"], **{k: str(v) for k, v in {**recipe["overrides"], **overrides,
                                                                    **extra}.items()})


def meshlm_programs(name: str, overrides: dict, depths, hlo_dir) -> tuple[list, list]:
  """meshlm's compiled programs [(depth, HLO)] of recipe `name` and their reports (predict_maxtext's cache)."""
  from train.core import step  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (then the digest)
  pm._source_digest()  # pylint: disable=protected-access
  tpu = hardware.tpu_slice(RECIPES[name]["topology"])
  programs, reports = [], []
  for depth in depths:
    start = time.perf_counter()
    text, report = pm.compiled_hlo(f"{name}_L{depth}", meshlm_config(name, overrides, depth), hlo_dir, tpu)
    programs.append((depth, text))
    reports.append(report)
    say(f"{'read' if report['cached'] else 'compiled'} meshlm {name} at {depth} layers "
        f"(attention {report['attention_impl_runs']}) in {time.perf_counter() - start:.0f} s")
  return programs, reports


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--maxtext_venv", required=True, help="virtual environment with maxtext and libtpu")
  p.add_argument("--row", default="16b", choices=sorted(RECIPES))
  depth = p.add_mutually_exclusive_group()
  depth.add_argument("--layers", type=pm._depths, default=(2, 4),  # pylint: disable=protected-access
                     help="the two depths A,B compiled on both sides (then extrapolated to the recipe's)")
  depth.add_argument("--full", action="store_true",
                     help="compile both programs whole (the v6e row: libtpu unrolls 2-4 layer loops, which moves "
                          "the host transfers of its offloaded activations beside the whole step's kernels)")
  p.add_argument("--hlo_dir", default="", help="keep and reuse both sides' compiled programs here")
  p.add_argument("--set", type=pm._overrides, default={}, metavar="KEY=VALUE,...",  # pylint: disable=protected-access
                 help="meshlm config overrides on top of the recipe's (e.g. model.attention_impl=xla)")
  p.add_argument("--maxtext_mask", default="causal", choices=("causal", "full", "none"),
                 help="mask scope given to MaxText's splash kernels for the predictor (none: leave as is)")
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--json", default="", help="also write the JSON object here")
  args = p.parse_args(argv)
  versions = _maxtext_ready(args.maxtext_venv)
  if versions is None:
    return 0
  name, hlo_dir = args.row, args.hlo_dir or None
  if args.full:
    args.layers = (meshlm_config(name, args.set).model.num_layers,)
  mt_programs, mt_reports = [], []
  for depth in args.layers:
    start = time.perf_counter()
    text, report = maxtext_program(args.maxtext_venv, versions, name, depth, hlo_dir)
    mt_programs.append((depth, for_predictor(text, args.maxtext_mask)))
    mt_reports.append(report)
    say(f"{'read' if report['cached'] else 'compiled'} MaxText {name} at {depth} layers in "
        f"{time.perf_counter() - start:.0f} s")
  try:
    ml_programs, ml_reports = meshlm_programs(name, args.set, args.layers, hlo_dir)
  except aot.NoTpuCompiler as e:
    print(f"meshlm's side cannot be compiled here: {e}; nothing compared")
    return 0
  c_full, tpu = meshlm_config(name, args.set), hardware.tpu_slice(RECIPES[name]["topology"])
  sides = {"maxtext": analyse(mt_programs, [r["memory"] for r in mt_reports], c_full, tpu, args.top),
           "meshlm": analyse(ml_programs, [r["memory"] for r in ml_reports], c_full, tpu, args.top)}
  sides["maxtext"]["compiled"] = [{k: r.get(k) for k in ("compile_seconds", "cached", "hlo_file", "command")}
                                  for r in mt_reports]
  sides["meshlm"]["compiled"] = [{k: r.get(k) for k in ("compile_seconds", "cached", "hlo_file",
                                                        "attention_impl_runs")} for r in ml_reports]
  ratio = {k: (sides["maxtext"][k] / sides["meshlm"][k] if sides["meshlm"][k] else math.nan) for k in TERMS}
  say(summary(name, sides, ratio))
  out = json.dumps({"row": name, "topology": RECIPES[name]["topology"], "maxtext_versions": versions,
                    "meshlm_config": RECIPES[name]["config"], "meshlm_overrides": {**RECIPES[name]["overrides"],
                                                                                  **args.set},
                    "maxtext_mask": args.maxtext_mask, "matmul_efficiency": predict.MATMUL_EFFICIENCY,
                    "published_mfu": RECIPES[name]["published_mfu"], "ratio_maxtext_over_meshlm": ratio,
                    **sides}, indent=1, default=str)
  print(out)
  if args.json:
    with open(args.json, "w") as f:
      f.write(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
