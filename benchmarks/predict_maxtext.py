"""The performance model (train/planning/predict.py) against MaxText's published TPU figures, from today's code.

  python benchmarks/predict_maxtext.py [--rows ROW,...|all|v5e|multislice|tiering] [--hlo_dir DIR] [--fit ROW,...]
      [--layers A,B | --full] [--set KEY=VALUE,...] [--json FILE]

Each row (ROWS below) is one run MaxText published: its model as a meshlm preset (configs/maxtext2023_*.py for
the 2023 v5e table, configs/llama*.py for the tiering rows), the recipe's batch, sequence, remat and mesh as
config overrides, and the slice (one or several over DCN). For every row the script compiles meshlm's train step
for that slice ahead of time (libtpu, no TPU needed), runs the compiled program through the predictor, and prints
a Markdown table (published and predicted MFU in the row's FLOP convention, relative error of the step time, the
terms, the dominant one) on stdout; `--json FILE` also writes every figure.

- **Depth.** A row is compiled whole (`depths` None in ROWS) or at two depths and every step-time term and the
  per-chip memory extrapolated linearly to the model's (each is the layer scan's per-iteration cost times its
  trip count plus a depth-independent rest); the table says which. `--layers A,B` extrapolates every row from A
  and B, `--full` compiles every row whole. The error of the extrapolation is measured where a row is run both
  ways (`--rows 16b --full` beside the default).
- **Cache.** `--hlo_dir DIR` keeps each compiled program there under a digest of everything that decides it (the
  resolved config, overrides and depth included; the slice; the jax and libtpu versions; the source of the
  packages the step is built from), which a read checks: a program compiled from other settings, compiler or
  code is never read back; the rows say whether they were compiled or read.
- **Fit.** One global constant, `MATMUL_EFFICIENCY` (the fraction of the bf16 peak FLOP-bound kernels reach),
  fitted by bisection on the summed step time of the `--fit` rows (docs/planning.md: 16b) over (0.05, 2): a fit above 1.0 is not
  clipped but reported as out of its physical range (the model then misses a term). Every other row is held out.
  Without `--fit` train.planning.predict.MATMUL_EFFICIENCY is used.
- **FLOP conventions.** Each table counted MFU its own way (MaxText's `calculate_training_tflops` at the time);
  the row's `convention` names it (CONVENTIONS); rows that also published tokens/s per chip take their step time
  from that (no convention needed). meshlm's own count (model.flops_per_token) is shown beside.

Prints the table (stdout) and progress (stderr); the JSON holds the rows, the efficiency and the fit, the wall
time of the run, and per compiled program its memory, compile time, cache state and source digest.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import time

import configs
import model
from configs import _maxtext
from train.planning import compile as aot
from train.planning import hardware
from train.planning import hlo
from train.planning import mfu
from train.planning import predict


@dataclasses.dataclass(frozen=True)
class Row:
  """One published MaxText run as meshlm compiles it: preset + recipe overrides on `topology` x `num_slices`."""
  config: str
  overrides: dict
  topology: str
  published_mfu: float
  convention: str  # CONVENTIONS key: how the published MFU counted FLOPs
  source: str  # where MaxText publishes the figure, and its recipe
  num_slices: int = 1
  tokens_per_sec_per_chip: float | None = None  # published throughput, where the table gives it
  depths: tuple[int, int] | None = (2, 4)  # compiled depths (None: the whole program)
  differs: str = ""  # how meshlm's program differs from MaxText's run, where it must


# MaxText's v5e table (src/maxtext/configs/tpu/v5e/README.md, unchanged since MaxText/configs/v5e/README.md at
# 76bd53b0f, 2023-12-15): MFU by model and slices of v5e-256. Rows 1-16 slices were published 2023-10-27
# (5ebcd67fe, 9bc243c95) when MaxText/train.py counted non-causal attention; the 32-slice row 2023-12-08
# (28816574b), after 64ee4e938 (2023-11-08) halved it. Recipes: MaxText/configs/largest_job/{16,32,64,128}b.sh
# at 9bc243c95 (per-device batch 6/4/2/1, remat full, flash attention, seq 2048, FSDP over each slice, data
# parallelism over the slices: base.yml's dcn_data_parallelism -1).
_V5E_MFU = {16: (0.6110, 0.5937, 0.5914, 0.5827, 0.5656, 0.5465), 32: (0.6686, 0.6481, 0.6410, 0.6367, 0.6226, 0.6040),
            64: (0.5990, 0.5666, 0.5585, 0.5496, 0.5329, 0.5018), 128: (0.5606, 0.5582, 0.5493, 0.5293, 0.5086, 0.4625)}
_V5E_BATCH = {16: 6, 32: 4, 64: 2, 128: 1}
_V5E_SOURCE = "MaxText configs/v5e/README.md (2023); recipe MaxText/configs/largest_job/{}b.sh @9bc243c95"
_128B_LAYOUT = ("MaxText ran ici_fsdp 16 x ici_tensor 16; meshlm's tensor axis leaves the residual stream whole "
                "(38 GB of activations per chip at remat full), so FSDP over the slice")


def _v5e_rows() -> dict[str, Row]:
  rows = {}
  for scale, mfus in _V5E_MFU.items():
    for slices, published in zip((1, 2, 4, 8, 16, 32), mfus):
      batch = _V5E_BATCH[scale] * _maxtext.V5E_256_CHIPS * slices
      overrides = {"train.batch_size": batch, **({"mesh.dcn_data": slices} if slices > 1 else {})}
      rows[f"{scale}b" + (f"_x{slices}" if slices > 1 else "")] = Row(
          f"maxtext2023_{scale}b", overrides, "v5e-256", published,
          "2023_causal" if slices == 32 else "2023_noncausal", _V5E_SOURCE.format(scale), num_slices=slices,
          depths=None if (scale, slices) == (16, 1) else (2, 4),  # the fit's row whole, the rest extrapolated
          differs=_128B_LAYOUT if scale == 128 else "")
  return rows


# MaxText's tiering table (docs/reference/models/tiering.md @e591f30c). Both figures come from MaxText releases
# before PR #1988 (2adc3bab1, 2025-07-22) halved causal attention in calculate_tflops_training_per_device.
_TIERING = {
    # tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-256 (MaxText tpu-recipes-v0.1.4 = 9f1820b4):
    # benchmarks/maxtext_trillium_model_configs.py `llama3_1_8b_8192`: per_device_batch_size 4,
    # max_target_length 8192, ici_fsdp -1, flash attention with every sa_block_* 2048, remat custom with
    # decoder_layer_input and q/k/v/out projections offloaded to host (meshlm's offload_qkv_out), the fused
    # backward kernel. Log: 4.546 s, 7207.336 tokens/s/device. Compiled whole: libtpu unrolls the 2-layer scan,
    # which puts the host transfers beside the whole step's kernels instead of one layer's.
    "llama3_1_8b_v6e": Row(
        "llama3_1_8b", {"train.seq_len": 8192, "train.batch_size": 4 * 256, "model.max_seq_len": 8192,
                        "model.dtype": "bfloat16", "model.attention_impl": "splash", "mesh.data": 1,
                        "mesh.fsdp": -1, "train.remat": "offload_qkv_out", "train.xla_overlap": True,
                        **{f"model.{k}": 2048 for k in model.config.SPLASH_BLOCK_KEYS},
                        # 2048-tiles in the dkv kernel need 32.5 MiB of VMEM, over libtpu's 32 MiB scoped default;
                        # the recipe raises the limit (--xla_tpu_scoped_vmem_limit_kib=98304), meshlm halves them
                        "model.splash_block_q_bwd": 1024, "model.splash_block_kv_bwd": 1024},
        "v6e-256", 0.4546, "matmul_noncausal", "MaxText docs/reference/models/tiering.md; tpu-recipes "
        "training/trillium/Llama3.1-8B-MaxText/v6e-256 (llama3_1_8b_8192)", tokens_per_sec_per_chip=7207.336,
        depths=None,
        differs="backward splash tiles 1024 (MaxText 2048 with a 96 MiB scoped-VMEM limit and its fused "
                "backward kernel)"),
    # benchmarks/maxtext_v5p_model_configs.py#L156 @92e59fdf (`llama2_70b_v5p_128`): per_device_batch_size 4,
    # max_target_length 4096, ici_fsdp -1, remat save_dot_except_mlpwi; "512 Chips" are TensorCores: 256 chips
    # (configs/tpu/v5p/llama2_70b.sh: "4M token global batch size on 1 x v5p-512"). 692 tokens/s/device.
    "llama2_70b_v5p": Row(
        "llama2_70b", {"train.seq_len": 4096, "train.batch_size": 4 * 256, "model.dtype": "bfloat16",
                       "model.attention_impl": "splash", "mesh.data": 1, "mesh.fsdp": -1,
                       "train.remat": "save_dot_except_mlpwi", "train.xla_overlap": True},
        "v5p-512", 0.654, "matmul_noncausal", "MaxText docs/reference/models/tiering.md; "
        "benchmarks/maxtext_v5p_model_configs.py#L156 @92e59fdf (llama2_70b_v5p_128)",
        tokens_per_sec_per_chip=692.0),
}
ROWS: dict[str, Row] = {**_v5e_rows(), **_TIERING}
GROUPS = {"all": list(ROWS), "v5e": [r for r in ROWS if r[-1] == "b"],
          "multislice": [r for r in ROWS if "_x" in r], "tiering": list(_TIERING)}
TERMS = ("step_seconds", "compute_seconds", "memory_bound_seconds", "collective_seconds",
         "exposed_collective_seconds", "host_transfer_seconds", "exposed_host_seconds")


def row_slice(row: Row) -> hardware.TpuSlice:
  return hardware.tpu_slice(row.topology, row.num_slices)


def row_config(row: Row, depth: int | None = None, extra: dict | None = None):
  """The row's meshlm config (its preset, the recipe's overrides, `extra`, and `model.num_layers=depth`)."""
  overrides = {**row.overrides, **(extra or {}), **({"model.num_layers": depth} if depth else {})}
  return configs.load(row.config, **{k: str(v) for k, v in overrides.items()})


# ---- FLOP conventions ---------------------------------------------------------------------------------------
def _matmul_flops(m, seq: int, causal: bool) -> float:
  """MaxText's calculate_tflops_training_per_device (May 2024 on) per sequence: every projection's matmuls,
  attention 4·T²·H·D per layer (halved when `causal`, PR #1988), the unembedding; x3 for the backward pass."""
  gated = 2 if m.mlp_type in model.config.GATED else 1
  ffn = 2 * seq * m.mlp_dim * m.d_model * gated + 2 * seq * m.mlp_dim * m.d_model
  qkv = 2 * seq * m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
  proj = 2 * seq * m.d_model * m.num_heads * m.head_dim
  attention = 4 * seq**2 * m.num_heads * m.head_dim / (2 if causal else 1)
  return 3 * (m.num_layers * (ffn + qkv + proj + attention) + 2 * seq * m.d_model * m.vocab_size)


def _2023_flops(m, seq: int, causal: bool) -> float:
  """MaxText/train.py's calculate_training_tflops of 2023 per sequence: 6 x all parameters (the tied embedding
  once) x tokens + 12·H·L·D·T² (6·H·L·D·T² once causal, 64ee4e938)."""
  return 6 * model.count_params(m)["total"] * seq + (6 if causal else 12) * m.num_heads * m.num_layers * \
      m.head_dim * seq**2


CONVENTIONS = {"2023_noncausal": lambda m, s: _2023_flops(m, s, False),
               "2023_causal": lambda m, s: _2023_flops(m, s, True),
               "matmul_noncausal": lambda m, s: _matmul_flops(m, s, False),
               "matmul_causal": lambda m, s: _matmul_flops(m, s, True)}


def published_flops_per_chip(row: Row, c) -> float:
  """The row's training FLOPs per chip per step in its table's convention."""
  chips = row_slice(row).num_chips * row.num_slices
  return CONVENTIONS[row.convention](c.model, c.train.seq_len) * c.train.batch_size / chips


def published_step_seconds(row: Row, c) -> float:
  """The published step time: tokens per chip / published tokens/s where given, else the convention's FLOPs /
  (published MFU x peak)."""
  tpu = row_slice(row)
  if row.tokens_per_sec_per_chip:
    return c.train.batch_size * c.train.seq_len / (tpu.num_chips * row.num_slices) / row.tokens_per_sec_per_chip
  return published_flops_per_chip(row, c) / (row.published_mfu * tpu.chip.peak_tflops * 1e12)


# ---- compiled programs, keyed by what decides them ----------------------------------------------------------
def _overrides(text: str) -> dict:
  """`--set KEY=VALUE,...` as config overrides."""
  out = {}
  for kv in (kv for kv in text.split(",") if kv):
    if "=" not in kv:
      raise argparse.ArgumentTypeError(f"--set {kv!r}: KEY=VALUE, e.g. model.attention_impl=splash")
    key, value = kv.split("=", 1)
    out[key.strip()] = value.strip()  # configs.load parses the text and checks it against the key's type
  return out


# Packages the compiled step is built from (train.core.step.Trainer and what it imports); configs are keyed by the
# resolved config itself.
_SOURCES = ("model", "parallel", "train/core", "train/objectives", "common")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
  """sha256 of the step's source files, taken once per process: main() imports the step's modules first, so the
  digest is of the code this process compiles with even if the files change while it runs."""
  h = hashlib.sha256()
  for top in _SOURCES:
    for root, dirs, files in os.walk(os.path.join(_REPO, top)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      for f in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(root, f)
        h.update(os.path.relpath(path, _REPO).encode() + b"\0")
        with open(path, "rb") as fh:
          h.update(fh.read() + b"\0")
  return h.hexdigest()


def _version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return ""


def program_key(config, tpu: hardware.TpuSlice) -> dict:
  """What decides a compiled program: the resolved config (overrides and depth included), the slice(s), the
  compiler and jax versions, and the step's source code."""
  import jax  # pylint: disable=g-import-not-at-top
  key = {"config": json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str)),
         "topology": tpu.topology, "jax": jax.__version__,
         "libtpu": _version("libtpu") or _version("libtpu-nightly"), "source": _source_digest()}
  return key | ({"num_slices": tpu.num_slices} if tpu.num_slices > 1 else {})


def keyed_path(hlo_dir: str, stem: str, key: dict) -> str:
  """DIR/<stem>_<digest of key>.hlo: where a compiled program decided by `key` is kept."""
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(hlo_dir, f"{stem}_{digest}.hlo")


def read_keyed(path: str, key: dict) -> tuple[str, dict] | None:
  """(HLO text, report without its key) kept at `path` (`write_keyed`), or None unless the report beside it was
  written for exactly `key`: a program compiled from other settings, compiler or code is never re-read."""
  saved = path[:-len(".hlo")] + ".json"
  if not (os.path.exists(path) and os.path.exists(saved)):
    return None
  with open(saved) as f:
    report = json.load(f)
  if report.pop("key", None) != key:
    return None
  with open(path) as f:
    return f.read(), report


def write_keyed(path: str, text: str, report: dict, key: dict) -> None:
  """Keeps `text` at `path` and `report` with its `key` beside it (.json), each file written whole (a temporary
  renamed), so an interrupted write leaves no readable pair."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  for target, payload in ((path, text), (path[:-len(".hlo")] + ".json", json.dumps(dict(report, key=key)))):
    with open(target + ".tmp", "w") as f:
      f.write(payload)
    os.replace(target + ".tmp", target)


@functools.lru_cache(maxsize=None)
def _devices(topology: str, num_slices: int) -> list:
  return aot.abstract_devices(hardware.tpu_slice(topology, num_slices))


def compiled_hlo(name: str, config, hlo_dir: str | None, tpu: hardware.TpuSlice) -> tuple[str, dict]:
  """(HLO text, compile report) of `config` on `tpu`; with `hlo_dir` read from / written to
  DIR/maxtext_<name>_<attention>_<digest>.hlo and the report (memory, fits, the attention the step ran, the key)
  to .json beside it. A file is read back only when its report's key equals this program's (program_key)."""
  key = program_key(config, tpu)
  path = keyed_path(hlo_dir, f"maxtext_{name}_{config.model.attention_impl}", key) if hlo_dir else None
  found = read_keyed(path, key) if path else None
  if found and "attention_impl_runs" in found[1]:
    return found[0], dict(found[1], cached=True, hlo_file=path, source=key["source"])
  start = time.perf_counter()
  trainer, compiled = aot.compile_trainer(config, _devices(tpu.topology, tpu.num_slices))
  text = compiled.as_text()
  report = aot.summarize(config, tpu, trainer, time.perf_counter() - start)
  report = {k: report[k] for k in ("memory", "fits", "compile_seconds", "mesh", "remat")}
  report["attention_impl_runs"] = trainer.attention_impl
  if path:
    write_keyed(path, text, report, key)
  return text, dict(report, cached=False, hlo_file=path, source=key["source"])


# ---- the prediction ---------------------------------------------------------------------------------------
def lerp(values: list[float], depths: list[int], target: int) -> float:
  """`values` at `depths` (one, or two for a linear extrapolation) carried to depth `target`."""
  if len(values) == 1:
    return values[0]
  (a, b), (va, vb) = depths, values
  return va + (vb - va) * (target - a) / (b - a)


def predict_terms(programs: list[tuple[int, str]], row: Row, c, efficiency: float) -> dict:
  """The step-time terms (seconds per chip) of row `row` with config `c`, from its compiled programs
  [(depth, HLO)] (one whole program, or two depths extrapolated to c.model.num_layers), and the dominant term."""
  tpu = row_slice(row)
  preds = [predict.predict(text, tpu.chip, num_devices=tpu.num_chips * tpu.num_slices, torus=tpu.torus,
                           model_flops_per_chip=0.0, tokens_per_chip=1.0, efficiency=efficiency)
           for _, text in programs]
  depths = [d for d, _ in programs]
  out = {k: lerp([p[k] for p in preds], depths, c.model.num_layers) for k in TERMS}
  out["uncosted_kernels"] = max(p["uncosted_kernels"] for p in preds)
  terms = {"compute": out["compute_seconds"], "memory": out["memory_bound_seconds"],
           "collective": out["exposed_collective_seconds"], "host": out["exposed_host_seconds"]}
  out["dominant"] = max(terms, key=terms.get)
  peak = tpu.chip.peak_tflops * 1e12
  out["mfu_published_convention"] = published_flops_per_chip(row, c) / (out["step_seconds"] * peak)
  out["mfu_meshlm_convention"] = (mfu.flops_per_step(c.model, c.train.seq_len, c.train.batch_size)
                                  / (tpu.num_chips * tpu.num_slices) / (out["step_seconds"] * peak))
  return out


def fit_efficiency(fits: list[tuple[list, Row, object]]) -> dict:
  """The efficiency whose predicted step time equals the published one, summed over the fit rows
  [(programs, row, config)], by bisection on (0.05, 2.0): nothing is clipped at 1.0; `physical` says whether
  the fit stayed within the peak."""
  target = sum(published_step_seconds(row, c) for _, row, c in fits)

  def predicted(eff):
    return sum(predict_terms(p, row, c, eff)["step_seconds"] for p, row, c in fits)

  lo, hi = 0.05, 2.0
  if not predicted(hi) <= target <= predicted(lo):
    return {"efficiency": None, "reached": False, "physical": False, "why": "outside (0.05, 2.0)"}
  for _ in range(40):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if predicted(mid) > target else (lo, mid)
  eff = (lo + hi) / 2
  return {"efficiency": eff, "reached": True, "physical": eff <= 1.0}


def compile_row(name: str, row: Row, args) -> tuple[list[tuple[int, str]], list[dict]]:
  """The row's compiled programs [(depth, HLO)] and their reports, whole or at the extrapolation depths."""
  depths = None if args.full else (args.layers or row.depths)
  programs, reports = [], []
  for depth in depths or (None,):
    c = row_config(row, depth, args.set)
    start = time.perf_counter()
    text, report = compiled_hlo(name + (f"_L{depth}" if depth else ""), c, args.hlo_dir or None, row_slice(row))
    programs.append((c.model.num_layers, text))
    reports.append(report)
    print(f"{'read' if report['cached'] else 'compiled'} {name} at {c.model.num_layers} layers "
          f"(attention {report['attention_impl_runs']}) in {time.perf_counter() - start:.0f} s", file=sys.stderr,
          flush=True)
  return programs, reports


def row_result(name: str, row: Row, programs, reports, c, efficiency: float) -> dict:
  """One row of the table: published vs predicted, the terms, how it was obtained, memory per chip."""
  pr = predict_terms(programs, row, c, efficiency)
  tpu, depths = row_slice(row), [d for d, _ in programs]
  published = published_step_seconds(row, c)
  compiled_totals = [r["memory"]["total_bytes"] for r in reports]
  total = lerp(compiled_totals, depths, c.model.num_layers)
  if total < max(compiled_totals):  # the compiler's memory fell with depth (libtpu laid the programs out apart)
    total = None
  kernels = hlo.mosaic_kernels(programs[-1][1])
  return {
      "row": name, "config": row.config, "topology": row.topology, "num_slices": row.num_slices,
      "published_mfu": row.published_mfu, "convention": row.convention,
      "published_tokens_per_sec_per_chip": row.tokens_per_sec_per_chip,
      "predicted_mfu_published_convention": pr["mfu_published_convention"],
      "predicted_mfu_meshlm_convention": pr["mfu_meshlm_convention"],
      "published_step_seconds": published, "relative_error": published / pr["step_seconds"] - 1,
      **{k: pr[k] for k in TERMS}, "dominant": pr["dominant"], "uncosted_kernels": pr["uncosted_kernels"],
      "obtained": "whole program" if len(depths) == 1 else f"extrapolated from {depths[0]} and {depths[1]} layers",
      "compiled_depths": depths, "num_layers": c.model.num_layers,
      "attention_impl_runs": sorted({r["attention_impl_runs"] for r in reports}),
      "mosaic_kernels": kernels, "total_bytes_per_chip": total,
      "fits": None if total is None else total <= tpu.chip.hbm_bytes,
      "compiled": [{k: r[k] for k in ("fits", "compile_seconds", "cached", "hlo_file", "source")}
                   | {"total_bytes": r["memory"]["total_bytes"]} for r in reports],
      "overrides": row.overrides, "batch_size": c.train.batch_size,
      "seq_len": c.train.seq_len, "remat": c.train.remat, "source": row.source, "differs": row.differs,
  }


def _gib(r: dict) -> str:
  if r["total_bytes_per_chip"] is None:  # not linear in depth: the compiled depths' own figures
    return "not linear: " + " / ".join(f"{c['total_bytes'] / 2**30:.1f}" for c in r["compiled"])
  return f"{r['total_bytes_per_chip'] / 2**30:.1f}"


def table(rows: list[dict], fit_rows: list[str]) -> str:
  """The rows as a Markdown table."""
  out = ["| row | slice | published MFU | predicted MFU | step s (pub. / pred.) | error | compute / memory / "
         "collectives (exposed) / host transfers (exposed) s | dominant | GiB/chip | obtained |", "|" + "---|" * 10]
  for r in rows:
    role = "fit" if r["row"] in fit_rows else "held out"
    out.append(
        f"| {r['row']} ({role}) | {r['topology']} x {r['num_slices']} | {r['published_mfu']:.2%} | "
        f"{r['predicted_mfu_published_convention']:.2%} | {r['published_step_seconds']:.2f} / "
        f"{r['step_seconds']:.2f} | {r['relative_error']:+.1%} | {r['compute_seconds']:.2f} / "
        f"{r['memory_bound_seconds']:.2f} / {r['collective_seconds']:.2f} ({r['exposed_collective_seconds']:.2f}) / "
        f"{r['host_transfer_seconds']:.2f} ({r['exposed_host_seconds']:.2f}) | "
        f"{r['dominant']} | {_gib(r)} | {r['obtained']} |")
  return "\n".join(out)


def _depths(text: str) -> tuple[int, int]:
  a, b = (int(v) for v in text.split(","))
  if not 0 < a < b:
    raise argparse.ArgumentTypeError(f"--layers {text!r}: two depths A < B, e.g. 4,8")
  return a, b


def _names(text: str) -> list[str]:
  names = [n for part in text.split(",") if part for n in GROUPS.get(part, [part])]
  unknown = [n for n in names if n not in ROWS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown rows {unknown}; rows: {', '.join(ROWS)}; groups: "
                                     f"{', '.join(GROUPS)}")
  return list(dict.fromkeys(names))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=_names, default=_names("16b,32b,64b,128b"), help="rows or groups, comma-separated")
  p.add_argument("--hlo_dir", default="")
  p.add_argument("--fit", type=_names, default=None, help="fit MATMUL_EFFICIENCY on these rows (e.g. 16b)")
  depth = p.add_mutually_exclusive_group()
  depth.add_argument("--layers", type=_depths, help="compile every row at depths A,B and extrapolate")
  depth.add_argument("--full", action="store_true", help="compile every row whole")
  p.add_argument("--set", type=_overrides, default={}, metavar="KEY=VALUE,...",
                 help="config overrides for every row, e.g. model.attention_impl=xla")
  p.add_argument("--json", default="", help="also write every figure here")
  args = p.parse_args(argv)
  if args.fit and set(args.fit) - set(args.rows):
    p.error(f"--fit rows {sorted(set(args.fit) - set(args.rows))} must be among --rows")
  start = time.perf_counter()
  from train.core import step  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (then the digest)
  _source_digest()
  compiled = {name: compile_row(name, ROWS[name], args) for name in args.rows}
  cfgs = {name: row_config(ROWS[name], None, args.set) for name in args.rows}
  fit = {"efficiency": predict.MATMUL_EFFICIENCY, "rows": [], "reached": None}
  if args.fit:
    fit = fit_efficiency([(compiled[n][0], ROWS[n], cfgs[n]) for n in args.fit]) | {"rows": args.fit}
  efficiency = fit["efficiency"] or predict.MATMUL_EFFICIENCY
  rows = [row_result(n, ROWS[n], *compiled[n], cfgs[n], efficiency) for n in args.rows]
  result = {"matmul_efficiency": efficiency, "fit": fit, "overrides": args.set, "rows": rows,
            "wall_seconds": time.perf_counter() - start, "source": _source_digest()}
  print(table(rows, args.fit or []))
  print(f"\nmatmul efficiency {efficiency:.4f} ({'fitted on ' + ','.join(args.fit) if args.fit else 'default'}"
        f"{'' if fit.get('physical', True) else ', OUT OF ITS PHYSICAL RANGE'}); wall time "
        f"{result['wall_seconds']:.0f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
