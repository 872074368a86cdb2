"""The planner: compute-optimal sizes (Hoffmann et al. 2022, "Chinchilla"), compute in PF-days, and per-device
memory of a configured run, before launching it. `python -m train.plan --help`; see docs/planning.md.

Units: parameters N and tokens D are counts, compute C in FLOPs (training: C = 6 N D), loss in nats per token,
memory in bytes (GiB = 2^30 bytes in the printed table).
"""
from __future__ import annotations

import argparse
import decimal
import json
import math
import sys
from typing import Sequence

import ml_collections

import configs
from train.planning import hardware
from train.planning import memory

PF_DAY = 1e15 * 86400  # FLOPs in one petaFLOP/s-day

# Approach 1 (Table 2: N_opt ∝ C^a, D_opt ∝ C^b), calibrated on Table 3's row 1B parameters <-> 20.2B tokens.
A1_A, A1_B = 0.50, 0.50
A1_REF_PARAMS, A1_REF_TOKENS = 1e9, 20.2e9

# Approach 3: the parametric loss L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. eq. 10).
E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28


def training_flops(params: float, tokens: float) -> float:
  """Training FLOPs by the 6·N·D rule (2 forward + 4 backward per parameter per token)."""
  return 6.0 * params * tokens


def pf_days(flops: float) -> float:
  """FLOPs -> petaFLOP/s-days (1 PF-day = 8.64e19 FLOPs)."""
  return flops / PF_DAY


def loss(params: float, tokens: float) -> float:
  """Approach-3 predicted loss (nats/token) of a model of `params` parameters trained on `tokens` tokens."""
  return E + A / params**ALPHA + B / tokens**BETA


def _a1_ref_flops() -> float:
  return training_flops(A1_REF_PARAMS, A1_REF_TOKENS)


def approach1_from_flops(flops: float) -> tuple[float, float]:
  """(N_opt, D_opt) for a compute budget by approach 1."""
  ratio = flops / _a1_ref_flops()
  return A1_REF_PARAMS * ratio**A1_A, A1_REF_TOKENS * ratio**A1_B


def approach1_flops_for_params(params: float) -> float:
  """The budget whose approach-1 optimum has `params` parameters."""
  return _a1_ref_flops() * (params / A1_REF_PARAMS)**(1.0 / A1_A)


def approach1_flops_for_tokens(tokens: float) -> float:
  """The budget whose approach-1 optimum trains on `tokens` tokens."""
  return _a1_ref_flops() * (tokens / A1_REF_TOKENS)**(1.0 / A1_B)


# Approach 3 in closed form: minimising L under C = 6ND gives N_opt = G (C/6)^a, D_opt = (C/6)^b / G with
# a = beta/(alpha+beta), b = alpha/(alpha+beta), G = (alpha A / (beta B))^(1/(alpha+beta)).
_A3_A = BETA / (ALPHA + BETA)
_A3_B = ALPHA / (ALPHA + BETA)
_A3_G = (ALPHA * A / (BETA * B))**(1.0 / (ALPHA + BETA))


def approach3_from_flops(flops: float) -> tuple[float, float]:
  """(N_opt, D_opt) for a compute budget by approach 3."""
  half = flops / 6.0
  return _A3_G * half**_A3_A, half**_A3_B / _A3_G


def approach3_flops_for_params(params: float) -> float:
  return 6.0 * (params / _A3_G)**(1.0 / _A3_A)


def approach3_flops_for_tokens(tokens: float) -> float:
  return 6.0 * (tokens * _A3_G)**(1.0 / _A3_B)


def optimum(*, flops: float | None = None, params: float | None = None, tokens: float | None = None) -> dict:
  """The compute-optimal allocation given exactly one of flops, params (model size) or tokens (dataset size).

  Returns {"approach1": {...}, "approach3": {...}}, each with params, tokens, flops, pf_days, tokens_per_param,
  loss (approach 3's L at that allocation).
  """
  given = [k for k, v in (("flops", flops), ("params", params), ("tokens", tokens)) if v is not None]
  if len(given) != 1:
    raise ValueError(f"optimum() takes exactly one of flops, params, tokens; got {given or 'none'}")
  for k, v in (("flops", flops), ("params", params), ("tokens", tokens)):
    if v is not None and not (v > 0 and math.isfinite(v)):
      raise ValueError(f"{k} must be a positive number, got {v}")
  out = {}
  for name, from_flops, for_params, for_tokens in (
      ("approach1", approach1_from_flops, approach1_flops_for_params, approach1_flops_for_tokens),
      ("approach3", approach3_from_flops, approach3_flops_for_params, approach3_flops_for_tokens)):
    c = flops if flops is not None else for_params(params) if params is not None else for_tokens(tokens)
    n, d = from_flops(c)
    out[name] = allocation(n, d)
    out[name]["training"] = "compute-optimal"  # each approach's own optimum, whatever its tokens per parameter
  return out


def allocation(params: float, tokens: float) -> dict:
  """Figures for a given (N, D): FLOPs (6ND), PF-days, tokens per parameter, approach-3 loss, and how it
  compares with the approach-1 (Chinchilla) ratio of 20.2 tokens per parameter."""
  ratio = tokens / params
  chinchilla = A1_REF_TOKENS / A1_REF_PARAMS
  if ratio < chinchilla / 1.25:
    verdict = "under-trained"  # too few tokens for the size: a smaller model would reach a lower loss
  elif ratio > chinchilla * 1.25:
    verdict = "over-trained"  # more tokens than compute-optimal (fine when inference cost matters)
  else:
    verdict = "compute-optimal"
  flops = training_flops(params, tokens)
  return {"params": params, "tokens": tokens, "flops": flops, "pf_days": pf_days(flops),
          "tokens_per_param": ratio, "chinchilla_tokens_per_param": chinchilla, "training": verdict,
          "loss": loss(params, tokens)}


def budget_flops(chip: str, count: int, days: float, mfu: float) -> float:
  """FLOPs delivered by `count` accelerators of kind `chip` over `days` days at model FLOPs utilisation `mfu`."""
  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu} must be in (0, 1], e.g. 0.4")
  return hardware.find_chip(chip).peak_tflops * 1e12 * count * days * 86400 * mfu


GIB = 2**30


def plan_config(config: ml_collections.ConfigDict, *, chip: str = "tpu_v4", num_devices: int | None = None,
                mfu: float = 0.4) -> dict:
  """Everything the planner says about a configured run.

  Args:
    config: a full meshlm config (configs/*.py with overrides).
    chip: accelerator for wall time and the memory verdict (a hardware.CHIPS key or alias).
    num_devices: devices the mesh spans (default: the product of the fixed mesh axes, -1 axes counted as 1).
    mfu: assumed model FLOPs utilisation for the wall time.
  Returns:
    A JSON-ready dict: params, tokens, flops, pf_days, loss, wall_days, mesh, state (per-device bytes by
    precision and ZeRO stage, and meshlm's own layout), activations (per-device bytes by remat policy), fits and
    max_micro_batch per chip.
  """
  import model  # local: the model package is only needed for config-based plans

  t = config.train
  acc = hardware.find_chip(chip)
  counts = model.count_params(config.model)
  sizes = memory.mesh_sizes(config, num_devices)
  devices = math.prod(sizes.values())
  tokens = float(t.steps) * t.batch_size * t.seq_len
  flops = model.flops_per_token(config.model, t.seq_len) * tokens
  if t.batch_size % t.grad_accum:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
  micro = t.batch_size // t.grad_accum
  fsdp, tensor = sizes["fsdp"], sizes["tensor"]
  n = counts["total"]
  own = memory.meshlm_state(config, n, sizes)
  state = {p: {f"zero{z}": memory.state_memory(n, p, zero_stage=z, fsdp=fsdp, tensor=tensor,
                                                 weight_dtype=config.model.param_dtype)
               for z in range(4)} for p in (*memory.PRECISIONS, "seeds")}
  acts = {r: memory.activation_memory(config, micro, remat=r, sizes=sizes, platform=acc.platform)
          for r in dict.fromkeys(("none", "full", t.remat))}
  needed = own["total"] + acts[t.remat]["total"]
  per_chip = {}
  for c in hardware.CHIPS.values():
    per_chip[c.name] = {"hbm_gib": c.hbm_gib, "fits": needed <= c.hbm_bytes,
                        "max_micro_batch": {r: memory.max_micro_batch(config, c.hbm_bytes, own["total"],
                                                                      remat=r, sizes=sizes, platform=c.platform)
                                            for r in ("none", "full")}}
  out = allocation(n, tokens)
  out.update({
      "params": counts["total"], "params_non_embedding": counts["non_embedding"], "tokens": tokens,
      "flops": flops, "pf_days": pf_days(flops), "flops_6nd": out["flops"],
      "chip": acc.name, "num_devices": devices, "mfu": mfu,
      "wall_days": flops / (devices * acc.peak_tflops * 1e12 * mfu) / 86400,
      "mesh": sizes, "micro_batch": micro, "remat": t.remat,
      "state": {"meshlm": own, **state}, "activations": acts,
      "memory_per_device": needed, "fits": per_chip[acc.name]["fits"], "per_chip": per_chip,
  })
  if "active" in counts:  # MoE: FLOPs above count these; memory counts all parameters
    out["params_active"] = counts["active"]
  pipe = memory.pipeline_schedule(config, sizes)
  if pipe:  # every stage holds the same share: num_layers / S layers plus the replicated embedding and head
    out["pipeline"] = dict(pipe, per_stage_bytes={"state": own["total"], "activations": acts[t.remat]["total"],
                                                  "total": needed})
  out["chinchilla_optimal"] = optimum(tokens=tokens)["approach1"]
  return out


def _count(text: str) -> float:
  """'7e9', '7B', '1.4T', '300G' -> float (K, M, B/G, T, P suffixes), scaled in decimal so that 7B is exactly
  7e9 (binary 7.0 * 1e9 would print as 7000000000.000001)."""
  scale = {"k": 3, "m": 6, "b": 9, "g": 9, "t": 12, "p": 15}
  s = text.strip().lower().replace("_", "")
  try:
    if s and s[-1] in scale:
      return float(decimal.Decimal(s[:-1]).scaleb(scale[s[-1]]))
    return float(s)
  except (ValueError, decimal.InvalidOperation):
    raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 7e9, 7B, 1.4T)") from None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m train.plan", description=__doc__.split("\n\n")[0],
      epilog="With --config=FILE (a path or a name under configs/, e.g. llama2_7b) and any "
             "--config.SECTION.KEY=VALUE overrides (as python -m train takes them): the plan of that run -- "
             "parameters, FLOPs, wall time, per-device memory; add --compile (TPU chips) for the compiled program's "
             "memory and predicted step time, or --scale N,N,... for predicted scaling over slice sizes.")
  p.add_argument("--flops", type=_count, help="compute budget in FLOPs: the compute-optimal N and D")
  p.add_argument("--params", type=_count, help="model size: optimal tokens (or, with --tokens, the verdict)")
  p.add_argument("--tokens", type=_count, help="dataset size: the compute-optimal model for it")
  p.add_argument("--chip", default="tpu_v4", help=f"accelerator: {', '.join(hardware.CHIPS)} (default tpu_v4)")
  p.add_argument("--chips", type=int, help="accelerator count (budget with --days; devices with --config)")
  p.add_argument("--days", type=float, help="with --chip/--chips/--mfu: the compute budget of that many days")
  p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
  p.add_argument("--compile", action="store_true",
                 help="with --config and a TPU --chip/--chips: compile the step (train.compile) and predict its time")
  p.add_argument("--scale", type=_sizes, help="with --config and a TPU --chip: chip counts, e.g. 64,128,256: "
                 "the predicted step time and MFU of the fastest layout that fits, per slice size (compiled)")
  p.add_argument("--batch_per_chip", type=int, default=0,
                 help="with --scale: global batch = this x chips (weak scaling); 0 keeps train.batch_size")
  p.add_argument("--max_compiles", type=int, default=6, help="with --scale: compiles per slice size")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  return p


def _sizes(text: str) -> list[int]:
  try:
    sizes = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"--scale {text!r}: give chip counts separated by commas, e.g. 64,128,256")
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f"--scale {text!r}: chip counts must be positive")
  return sizes


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  try:
    if any(a == "--config" or a.startswith("--config.") or a.startswith("--config=") for a in argv):
      config, args = configs.parse(argv, parser)
      result = plan_config(config, chip=args.chip, num_devices=args.chips, mfu=args.mfu)
      if args.compile:
        result["compiled"] = compile_plan(config, args.chip, args.chips or result["num_devices"])
      if args.scale:
        result["scaling"] = scaling(config, args.chip, args.scale, batch_per_chip=args.batch_per_chip,
                                    max_compiles=args.max_compiles)
    else:
      args = parser.parse_args(argv)
      if args.compile or args.scale:
        parser.error("--compile and --scale need --config")
      result = _plan_sizes(args, parser)
  except (configs.ConfigError, ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(_clean(result)) if args.json else format_table(result))
  return 0


def _clean(x):
  """JSON-ready copy with floats rounded to 12 significant digits (no 7000000000.000001 noise)."""
  if isinstance(x, float):
    return float(f"{x:.12g}") if math.isfinite(x) else x
  if isinstance(x, dict):
    return {k: _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean(v) for v in x]
  return x


def compile_plan(config: ml_collections.ConfigDict, chip: str, chips: int) -> dict:
  """train.compile's report (memory, collectives, predicted step time) of `config` on `chips` TPU chips."""
  from train.planning import compile as aot
  tpu = hardware.slice_for_chips(chip, chips)
  return aot.compile_step(config, tpu, aot.abstract_devices(tpu))


def scaling(config: ml_collections.ConfigDict, chip: str, sizes: Sequence[int], *, batch_per_chip: int = 0,
            max_compiles: int = 6) -> list[dict]:
  """Predicted step time and MFU per slice size: for each chip count, the fastest layout that fits
  (train.planning.compile.fastest: compiled candidate meshes and remat policies, each program analysed whole -- the
  scanned layer body is compiled once and counted num_layers times). Returns one row per size: {"chips",
  "topology", "num_slices", "batch_size", "found", "overrides", "step_seconds", "mfu", "tokens_per_sec_per_chip",
  "compiles", "tried", "skipped" (layouts ruled out before compiling, each with its reason)}."""
  from train.planning import compile as aot
  rows = []
  for n in sizes:
    tpu = hardware.slice_for_chips(chip, n)
    c = _with_batch(config, batch_per_chip * n) if batch_per_chip else config
    search = aot.fastest(c, tpu, max_compiles=max_compiles, devices=aot.abstract_devices(tpu))
    p = search["report"]["predicted"] if search["found"] else {}
    rows.append({"chips": n, "topology": tpu.topology, "num_slices": tpu.num_slices,
                 "batch_size": c.train.batch_size, "found": search["found"], "overrides": search.get("overrides"),
                 "step_seconds": p.get("step_seconds"), "mfu": p.get("mfu"),
                 "tokens_per_sec_per_chip": p.get("tokens_per_sec_per_chip"), "compiles": len(search["tried"]),
                 "tried": search["tried"], "skipped": search["skipped"]})
  return rows


def _with_batch(config: ml_collections.ConfigDict, batch: int) -> ml_collections.ConfigDict:
  import copy
  c = copy.deepcopy(config)
  with c.unlocked():
    c.train.batch_size = batch
  return c


def _plan_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
  flops = args.flops
  if args.days is not None:
    if flops is not None or not args.chips:
      parser.error("--days needs --chips (and --chip, --mfu) and excludes --flops")
    flops = budget_flops(args.chip, args.chips, args.days, args.mfu)
  if flops is not None and (args.params or args.tokens):
    parser.error("give --flops (or --days) alone, --params and/or --tokens, or --config")
  if args.params and args.tokens:
    out = allocation(args.params, args.tokens)
    out["chinchilla_optimal"] = optimum(params=args.params)["approach1"]
    return out
  if flops is None and not args.params and not args.tokens:
    parser.error("nothing to plan: give --flops, --params, --tokens, --chips/--days or --config")
  opt = optimum(flops=flops, params=args.params, tokens=args.tokens)
  return {**opt["approach1"], **opt}


def format_table(r: dict) -> str:
  """The human-readable form of a plan (the JSON dict of plan_config / optimum / allocation)."""
  lines = []
  if "approach3" in r:
    lines.append(f"{'':18}{'params':>12}{'tokens':>12}{'FLOPs':>12}{'PF-days':>11}{'tok/param':>11}{'loss':>8}")
    for k in ("approach1", "approach3"):
      a = r[k]
      lines.append(f"{k:18}{a['params']:12.3e}{a['tokens']:12.3e}{a['flops']:12.3e}{a['pf_days']:11.4g}"
                   f"{a['tokens_per_param']:11.3g}{a['loss']:8.4f}")
    return "\n".join(lines)
  lines += [f"parameters        {r['params']:.4g}" + (f" ({r['params_non_embedding']:.4g} non-embedding)"
                                                       if "params_non_embedding" in r else ""),
            f"tokens            {r['tokens']:.4g}  ({r['tokens_per_param']:.3g} per parameter: {r['training']}; "
            f"Chinchilla: {r['chinchilla_tokens_per_param']:.3g})",
            f"training FLOPs    {r['flops']:.4g}  ({r['pf_days']:.4g} PF-days)",
            f"predicted loss    {r['loss']:.4f} nats/token (approach 3)"]
  co = r.get("chinchilla_optimal")
  if co and "mesh" in r:
    lines.append(f"optimal for data  {co['params']:.4g} parameters for {co['tokens']:.4g} tokens")
  if "mesh" not in r:
    if co:
      lines.append(f"optimal for size  {co['tokens']:.4g} tokens ({co['flops']:.4g} FLOPs)")
    return "\n".join(lines)
  mesh = " ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
  lines += [f"wall time         {r['wall_days']:.3g} days on {r['num_devices']} x {r['chip']} at "
            f"{r['mfu']:.0%} MFU",
            f"mesh              {mesh}; micro-batch {r['micro_batch']} sequences, remat {r['remat']}", "",
            f"per-device memory (GiB)  {'weights':>10} {'grads':>10} {'optimizer':>10} {'total':>10}"]
  rows = [("meshlm (as run)", r["state"]["meshlm"])] + [
      (f"{p} ZeRO-{z}", r["state"][p][f"zero{z}"]) for p in (*memory.PRECISIONS, "seeds") for z in range(4)]
  for label, st in rows:
    lines.append(f"  {label:22} {st['weights'] / GIB:10.3f} {st['gradients'] / GIB:10.3f} "
                 f"{st['optimizer'] / GIB:10.3f} {st['total'] / GIB:10.3f}")
  lines.append(f"activations (GiB)      {'per layer':>10} {'all layers':>11} {'recompute':>10} {'logits':>9} "
               f"{'total':>10} {'on host':>9}")
  for name, a in r["activations"].items():
    lines.append(f"  remat {name:15} {a['per_layer_saved'] / GIB:10.4f} {a['layers'] / GIB:11.3f} "
                 f"{a['recompute_peak'] / GIB:10.3f} {a['logits'] / GIB:9.3f} {a['total'] / GIB:10.3f} "
                 f"{a.get('host', 0.0) / GIB:9.3f}")
  verdict = "fits" if r["fits"] else "does NOT fit"
  pipe = r.get("pipeline")
  if pipe:
    per = pipe["per_stage_bytes"]
    lines.append(f"pipeline          {pipe['stages']} stages x {pipe['layers_per_stage']} layers, "
                 f"{pipe['microbatches']} microbatches, {pipe['repeats']} repeat(s), stage remat {'on' if pipe['remat'] else 'off'}: bubble "
                 f"{pipe['bubble']:.1%} ((S-1)/(R*M+S-1)); per stage {per['state'] / GIB:.3f} GiB state + "
                 f"{per['activations'] / GIB:.3f} GiB activations")
  lines += [f"total per device  {r['memory_per_device'] / GIB:.3f} GiB: {verdict} on {r['chip']}", "",
            "largest micro-batch (global sequences) per chip:  remat none  remat full"]
  for name, c in r["per_chip"].items():
    mb = c["max_micro_batch"]
    lines.append(f"  {name:12} {c['hbm_gib']:6.0f} GiB {mb['none']:20d} {mb['full']:11d}")
  if r.get("compiled"):
    from train.planning import compile as aot
    lines += ["", "compiled (train.compile):", aot.format_report(r["compiled"])]
  if r.get("scaling"):
    lines += ["", "scaling (fastest layout that fits per size; compiled programs, predicted times):",
              f"  {'chips':>6} {'topology':12} {'slices':>6} {'batch':>6} {'step s':>9} {'MFU':>7} "
              f"{'tok/s/chip':>11}  layout"]
    for row in r["scaling"]:
      if not row["found"]:
        lines.append(f"  {row['chips']:6d} {row['topology']:12} {row['num_slices']:6d} {row['batch_size']:6d}  "
                     f"nothing tried fits ({row['compiles']} compiles, {len(row.get('skipped', []))} layouts "
                     "skipped before compiling)")
        continue
      layout = " ".join(f"{k.split('.')[1]}={v}" for k, v in row["overrides"].items())
      lines.append(f"  {row['chips']:6d} {row['topology']:12} {row['num_slices']:6d} {row['batch_size']:6d} "
                   f"{row['step_seconds']:9.3f} {row['mfu']:7.1%} {row['tokens_per_sec_per_chip']:11,.0f}  {layout}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
