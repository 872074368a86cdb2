"""Calibration of the performance model (train/planning/predict.py) against MaxText's published TPU v5e-256 MFUs.

  python benchmarks/predict_maxtext.py [--rows 16b,32b,64b,128b] [--hlo_dir DIR] [--fit] [--layers A,B]

(docs/planning.md's table: `--rows 16b,32b,64b --fit --hlo_dir DIR`, then `--rows 128b --layers 2,4 --hlo_dir DIR`.)

For each row, compiles meshlm's step for the MaxText-equivalent preset (configs/maxtext_*.py: MaxText's
global_parameter_scale model, per-device batch and remat of MaxText/configs/v5e/*.sh) on an abstract v5e-256
(libtpu, no TPU needed) and predicts its step time. `--hlo_dir` keeps each compiled program's HLO text there and
reuses it on the next run (a 16B-64B compile takes minutes on a small CPU machine). With `--fit`, the matmul
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
terms, the dominant term) and the efficiency used.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import configs
import model
from train.planning import compile as aot
from train.planning import hardware

# MaxText/configs/v5e/README.md, one v5e-256 slice (MFU) and the recipes' layouts (MaxText/configs/v5e/*.sh).
from train.planning import mfu

# MaxText/configs/v5e/README.md, one v5e-256 slice (MFU) and the recipes' layouts (MaxText/configs/v5e/*.sh).
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


def compiled_hlo(name: str, config, hlo_dir: str | None, devices) -> tuple[str, dict | None]:
  """(HLO text, compile report) of `config`; with `hlo_dir` read from / written to DIR/maxtext_<name>.hlo (and
  the report's memory fields to .json; None when an HLO file has no report beside it)."""
  path = os.path.join(hlo_dir, f"maxtext_{name}.hlo") if hlo_dir else None
  if path and os.path.exists(path):
    with open(path) as f:
      text = f.read()
    saved = path[:-len(".hlo")] + ".json"
    if os.path.exists(saved):
      with open(saved) as f:
        return text, json.load(f)
    return text, None
  start = time.perf_counter()
  trainer, compiled = aot.compile_trainer(config, devices)
  text = compiled.as_text()
  report = aot.summarize(config, V5E_256, trainer, time.perf_counter() - start)
  report = {k: report[k] for k in ("memory", "fits", "compile_seconds", "mesh", "remat")}
  if path:
    os.makedirs(hlo_dir, exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
    with open(path[:-len(".hlo")] + ".json", "w") as f:
      json.dump(report, f)
  return text, report


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
  args = p.parse_args(argv)
  names = [r for r in args.rows.split(",") if r]
  if args.fit and "16b" not in names:
    p.error("--fit fits on the 16b row: include it in --rows")
  devices = aot.abstract_devices(V5E_256)
  programs, reports = {}, {}
  for name in names:
    row = ROWS[name]
    programs[name] = []
    for depth in args.layers or (None,):
      overrides = dict(row["overrides"], **({"model.num_layers": depth} if depth else {}))
      c = configs.load(row["config"], **overrides)
      text, report = compiled_hlo(name + (f"_L{depth}" if depth else ""), c, args.hlo_dir or None, devices)
      programs[name].append((c.model.num_layers, text))
      reports.setdefault(name, []).append(report)
      print(f"compiled {name} at {c.model.num_layers} layers", file=sys.stderr)
  configs_ = {name: configs.load(ROWS[name]["config"], **ROWS[name]["overrides"]) for name in names}
  efficiency, reached = predict.MATMUL_EFFICIENCY, None
  if args.fit:
    efficiency, reached = fit_efficiency(programs["16b"], configs_["16b"], ROWS["16b"]["published_mfu"])
  rows = []
  for name in names:
    row, c = ROWS[name], configs_[name]
    pr = predict_terms(programs[name], c, efficiency)
    totals = [r["memory"]["total_bytes"] if r else None for r in reports[name]]
    if len(totals) == 2 and None not in totals:  # per-chip memory, linear in depth like the step time
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
        "compiled": [{k: r[k] for k in ("fits", "compile_seconds")} | {"total_bytes": r["memory"]["total_bytes"]}
                     if r else None for r in reports[name]],
        "total_bytes_per_chip": total,
        "fits": None if total is None else total <= V5E_256.chip.hbm_bytes,
        "overrides": row["overrides"], "batch_size": c.train.batch_size, "remat": c.train.remat,
    })
  print(json.dumps({"matmul_efficiency": efficiency, "fitted_on_16b": args.fit, "fit_reached_target": reached,
                    "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
