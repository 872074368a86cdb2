"""Model FLOPs utilisation (docs/interfaces.md, `model.flops_per_token`): model FLOPs per second over the hardware peak; None where unknown."""
from __future__ import annotations

from typing import Sequence

import model as model_lib
from train.planning import hardware


def flops_per_token(model_cfg, seq_len: int, causal_halving: bool = True) -> float:
  """Training FLOPs per token as `model.flops_per_token` defines them (6 x non-embedding parameters, plus the output
  projection's 6·d_model·vocab, plus the attention term: halved for the causal mask, or with
  causal_halving=False the full T keys per query of PaLM / torchtitan), as a float."""
  return float(model_lib.flops_per_token(model_cfg, seq_len, causal_halving))


def flops_per_step(model_cfg, seq_len: int, batch_size: int, causal_halving: bool = True) -> float:
  """Training FLOPs of one optimizer step over `batch_size` sequences of `seq_len` tokens."""
  return flops_per_token(model_cfg, seq_len, causal_halving) * seq_len * batch_size


def utilisation(tokens_per_sec: float, model_cfg, seq_len: int, num_devices: int,
                peak_flops_per_device: float | None) -> dict[str, float]:
  """The logged MFU figures: `mfu` (causal attention FLOPs halved) and `mfu_full_attention` (not halved, as
  PaLM and torchtitan report it); {} when the peak is unknown."""
  if not peak_flops_per_device:
    return {}
  return {key: mfu(tokens_per_sec, flops_per_token(model_cfg, seq_len, halving), num_devices,
                   peak_flops_per_device) for key, halving in (("mfu", True), ("mfu_full_attention", False))}


def peak_flops_per_device(devices: Sequence, override_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device from train.hardware (override in TFLOP/s wins); None for unknown kinds (CPU)."""
  return hardware.peak_flops_per_device(devices[0].device_kind, override_tflops)


def mfu(tokens_per_sec: float, flops_per_token: float, num_devices: int,
        peak_flops_per_device: float | None) -> float | None:
  """Fraction of peak (0..1): tokens/s * FLOPs/token / (devices * peak FLOP/s); None when the peak is unknown."""
  if not peak_flops_per_device:
    return None
  return tokens_per_sec * flops_per_token / (num_devices * peak_flops_per_device)
