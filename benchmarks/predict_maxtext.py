"""Calibration of the performance model (train/planning/predict.py) against MaxText's published TPU v5e-256 MFUs.

  python benchmarks/predict_maxtext.py [--rows 16b,32b,64b,128b] [--hlo_dir DIR] [--fit] [--layers A,B]
      [--set KEY=VALUE,...]

(docs/planning.md's table: `--rows 16b,32b,64b --fit --hlo_dir DIR`, then `--rows 128b --layers 2,4 --hlo_dir DIR`;
its splash-vs-xla section: `--rows 16b,32b --layers 2,4 --set model.attention_impl=splash`, then `=xla`.)

For each row, compiles meshlm's step for the MaxText-equivalent preset (configs/maxtext_*.py: MaxText's
global_parameter_scale model, per-device batch and remat of MaxText/configs/v5e/*.sh) on an abstract v5e-256
(libtpu, no TPU needed) and predicts its step time. `--set` applies config overrides (comma-separated KEY=VALUE,
values parsed as benchmarks/kernels.py's `--set`: int, float, true/false, else text) to every row, e.g.
`--set model.attention_impl=splash` (the presets run meshlm's blockwise attention). Each row records the attention
the compiled step ran (the Trainer's resolved `attention_impl`) and the Mosaic (Pallas TPU) kernels in its program.
`--hlo_dir` keeps each compiled program's HLO text there and reuses it on the next run (a 16B-64B compile takes
minutes on a small CPU machine); the file name carries the requested attention and a digest of everything that
decides the program (the whole resolved config, overrides and depth included; the jax and libtpu versions; the
source of the packages the step is built from), which the report beside it repeats and a read checks, so a program
compiled with other overrides, by another compiler or from other code is never read back. With `--fit`, the matmul
efficiency is fitted on the 16B row (bisection on the predicted MFU in MaxText's convention, capped at 1.0) and
then used unchanged on every row; otherwise train.planning.predict.MATMUL_EFFICIENCY is used. With `--layers A,B` each
row is compiled at depths A and B instead of its own and every step-time term is extrapolated linearly in depth to
the preset's (each term is the layer scan's per-iteration cost times its trip count plus a depth-independent rest;
the compile time of these models grows with depth); rows say which way they were obtained.

MFU is shown in two FLOP conventions, both over the 197 TFLOP/s bf16 peak of a v5e chip:
- MaxText's of the time (max_utils.calculate_tflops_training_per_device): 6 x all parameters (input embedding
  included) x tokens + the causal attention 12 x heads x layers x head_dim x seq^2 per sequence, halved for the mask;
- meshlm's (model.flops_per_token): 6 x (non-embedding parameters + d_model x vocab) + 12 x heads x head_dim x
  the mean attended length (seq + 1) / 2, per layer and token.
Prints one JSON object: the rows (published MFU, predicted MFU in both conventions, relative error, step-time
terms, the dominant term, the attention requested and run, the Mosaic kernels, the overrides; per compiled program
its memory, compile time, whether it was read from --hlo_dir, and the digest of the step's source it was compiled
from) and the efficiency used.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import time

import configs
import model
from train.planning import compile as aot
from train.planning import hardware
from train.planning import hlo
from train.planning import mfu
from train.planning import predict

# MaxText/configs/v5e/README.md, one v5e-256 slice (MFU) and the recipes' layouts (MaxText/configs/v5e/*.sh).
ROWS = {
    "16b": {"config": "maxtext_16b", "overrides": {}, "published_mfu": 0.6110},
    "32b": {"config": "maxtext_32b", "overrides": {}, "published_mfu": 0.6686},
    "64b": {"config": "maxtext_64b", "overrides": {}, "published_mfu": 0.5990},
    # 128b.sh: ici_fsdp 16 x ici_tensor 16, per-device batch 1, remat minimal_offloaded (activations offloaded to
    # host memory). meshlm has no host offloading and its tensor axis does not shard the residual stream, so that
    # layout needs 38 GB (remat full) to 149 GB (minimal) of activations per 16 GiB chip (train.plan's estimate):
    # the row is compiled with the layout of the other rows (FSDP over the slice, remat full), which fits.
    "128b": {"config": "maxtext_128b", "overrides": {}, "published_mfu": 0.5606},
}
V5E_256 = hardware.tpu_slice("v5e-256")


def maxtext_flops_per_chip(c) -> float:
  """MaxText's training FLOPs per chip per step (its MFU numerator at the time of the v5e table)."""
  m, t = c.model, c.train
  per_device_batch = t.batch_size / V5E_256.num_chips
  weights = 6 * model.count_params(m)["total"] * t.seq_len * per_device_batch
  attention = 12 * m.num_heads * m.num_layers * m.head_dim * t.seq_len**2 * per_device_batch / 2
  return weights + attention


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


def program_key(config) -> dict:
  """What decides a compiled program, beyond the abstract v5e-256: the resolved config (overrides and depth
  included), the compiler and jax versions, and the step's source code."""
  import jax  # pylint: disable=g-import-not-at-top
  return {"config": json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str)),
          "topology": V5E_256.topology, "jax": jax.__version__,
          "libtpu": _version("libtpu") or _version("libtpu-nightly"), "source": _source_digest()}


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


def compiled_hlo(name: str, config, hlo_dir: str | None, devices) -> tuple[str, dict]:
  """(HLO text, compile report) of `config`; with `hlo_dir` read from / written to
  DIR/maxtext_<name>_<attention>_<digest>.hlo and the report (memory, fits, the attention the step ran, the key) to
  .json beside it. A file is read back only when its report's key equals this config's (program_key), so a
  program compiled with other overrides, compiler or code is compiled afresh, never re-read."""
  key = program_key(config)
  path = keyed_path(hlo_dir, f"maxtext_{name}_{config.model.attention_impl}", key) if hlo_dir else None
  found = read_keyed(path, key) if path else None
  if found and "attention_impl_runs" in found[1]:
    return found[0], dict(found[1], cached=True, hlo_file=path, source=key["source"])
  start = time.perf_counter()
  trainer, compiled = aot.compile_trainer(config, devices)
  text = compiled.as_text()
  report = aot.summarize(config, V5E_256, trainer, time.perf_counter() - start)
  report = {k: report[k] for k in ("memory", "fits", "compile_seconds", "mesh", "remat")}
  report["attention_impl_runs"] = trainer.attention_impl
  if path:
    write_keyed(path, text, report, key)
  return text, dict(report, cached=False, hlo_file=path, source=key["source"])


TERMS = ("step_seconds", "compute_seconds", "memory_bound_seconds", "collective_seconds",
         "exposed_collective_seconds")


def predict_terms(programs: list[tuple[int, str]], c, efficiency: float) -> dict:
  """The step-time terms of config `c` (seconds per chip) and the dominant one, from its compiled program
  [(depth, HLO)] or from two programs at other depths, extrapolated linearly in depth to c.model.num_layers."""
  t = c.train
  preds = [(depth, predict.predict(text, V5E_256.chip, num_devices=V5E_256.num_chips, torus=V5E_256.torus,
                                   model_flops_per_chip=0.0, tokens_per_chip=1.0, efficiency=efficiency))
           for depth, text in programs]
  if len(preds) == 1:
    out = {k: preds[0][1][k] for k in TERMS}
  else:
    (a, pa), (b, pb) = preds
    out = {k: pa[k] + (pb[k] - pa[k]) * (c.model.num_layers - a) / (b - a) for k in TERMS}
  out["uncosted_kernels"] = max(p["uncosted_kernels"] for _, p in preds)
  terms = {"compute": out["compute_seconds"], "memory": out["memory_bound_seconds"],
           "collective": out["exposed_collective_seconds"]}
  out["dominant"] = max(terms, key=terms.get)
  peak = V5E_256.chip.peak_tflops * 1e12
  out["mfu_maxtext_convention"] = maxtext_flops_per_chip(c) / (out["step_seconds"] * peak)
  out["mfu_meshlm_convention"] = (mfu.flops_per_step(c.model, t.seq_len, t.batch_size) / V5E_256.num_chips
                                  / (out["step_seconds"] * peak))
  return out


def fit_efficiency(programs, c, target_mfu: float) -> tuple[float, bool]:
  """The efficiency whose predicted MFU (MaxText's convention) equals `target_mfu`, by bisection on (0.05, 1];
  (1.0, False) when even the peak cannot reach it."""
  if predict_terms(programs, c, 1.0)["mfu_maxtext_convention"] < target_mfu:
    return 1.0, False
  lo, hi = 0.05, 1.0
  for _ in range(30):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if predict_terms(programs, c, mid)["mfu_maxtext_convention"] < target_mfu else (lo, mid)
  return hi, True


def _depths(text: str) -> tuple[int, int]:
  a, b = (int(v) for v in text.split(","))
  if not 0 < a < b:
    raise argparse.ArgumentTypeError(f"--layers {text!r}: two depths A < B, e.g. 4,8")
  return a, b


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="16b,32b,64b,128b")
  p.add_argument("--hlo_dir", default="")
  p.add_argument("--fit", action="store_true", help="fit the matmul efficiency on the 16B row")
  p.add_argument("--layers", type=_depths, help="compile at depths A,B and extrapolate to each preset's depth")
  p.add_argument("--set", type=_overrides, default={}, metavar="KEY=VALUE,...",
                 help="config overrides for every row, e.g. model.attention_impl=splash")
  args = p.parse_args(argv)
  names = [r for r in args.rows.split(",") if r]
  if args.fit and "16b" not in names:
    p.error("--fit fits on the 16b row: include it in --rows")
  overrides_ = {name: dict(ROWS[name]["overrides"], **args.set) for name in names}
  from train.core import step  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import  (then the digest)
  _source_digest()
  devices = aot.abstract_devices(V5E_256)
  programs, reports = {}, {}
  for name in names:
    row = ROWS[name]
    programs[name] = []
    for depth in args.layers or (None,):
      overrides = dict(overrides_[name], **({"model.num_layers": depth} if depth else {}))
      c = configs.load(row["config"], **overrides)
      start = time.perf_counter()
      text, report = compiled_hlo(name + (f"_L{depth}" if depth else ""), c, args.hlo_dir or None, devices)
      programs[name].append((c.model.num_layers, text))
      reports.setdefault(name, []).append(report)
      print(f"{'read' if report['cached'] else 'compiled'} {name} at {c.model.num_layers} layers "
            f"(attention {report['attention_impl_runs']}) in {time.perf_counter() - start:.0f} s", file=sys.stderr)
  configs_ = {name: configs.load(ROWS[name]["config"], **overrides_[name]) for name in names}
  efficiency, reached = predict.MATMUL_EFFICIENCY, None
  if args.fit:
    efficiency, reached = fit_efficiency(programs["16b"], configs_["16b"], ROWS["16b"]["published_mfu"])
  rows = []
  for name in names:
    row, c = ROWS[name], configs_[name]
    pr = predict_terms(programs[name], c, efficiency)
    runs = sorted({r["attention_impl_runs"] for r in reports[name]})
    kernels = [hlo.mosaic_kernels(text) for _, text in programs[name]]
    totals = [r["memory"]["total_bytes"] for r in reports[name]]
    if len(totals) == 2:  # per-chip memory, linear in depth like the step time
      (a, _), (b, _) = programs[name]
      total = totals[0] + (totals[1] - totals[0]) * (c.model.num_layers - a) / (b - a)
    else:
      total = totals[0]
    rows.append({
        "row": name, "published_mfu": row["published_mfu"],
        "predicted_mfu_maxtext_convention": pr["mfu_maxtext_convention"],
        "predicted_mfu_meshlm_convention": pr["mfu_meshlm_convention"],
        "relative_error": pr["mfu_maxtext_convention"] / row["published_mfu"] - 1,
        "published_step_seconds":
            maxtext_flops_per_chip(c) / (row["published_mfu"] * V5E_256.chip.peak_tflops * 1e12),
        **{k: pr[k] for k in TERMS}, "dominant": pr["dominant"],
        "compiled_depths": [d for d, _ in programs[name]], "num_layers": c.model.num_layers,
        "attention_impl": c.model.attention_impl, "attention_impl_runs": runs[0] if len(runs) == 1 else runs,
        # Mosaic kernels by name in the deepest compiled program (each program's under "compiled"), and the
        # kernels the performance model could not price (0: every kernel's work is in the prediction).
        "mosaic_kernels": kernels[-1], "mosaic_kernel_count": sum(kernels[-1].values()),
        "uncosted_kernels": pr["uncosted_kernels"],
        "compiled": [{k: r[k] for k in ("fits", "compile_seconds", "cached", "attention_impl_runs", "hlo_file", "source")}
                     | {"total_bytes": r["memory"]["total_bytes"], "mosaic_kernels": kern,
                        "mosaic_kernel_count": sum(kern.values())}
                     for r, kern in zip(reports[name], kernels)],
        "total_bytes_per_chip": total,
        "fits": total <= V5E_256.chip.hbm_bytes,
        "overrides": overrides_[name], "batch_size": c.train.batch_size, "remat": c.train.remat,
    })
  print(json.dumps({"matmul_efficiency": efficiency, "fitted_on_16b": args.fit, "fit_reached_target": reached,
                    "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
