"""Accelerator facts used for MFU, planning and ahead-of-time compilation: one table, kept in code.

Peaks are dense bf16 matmul TFLOP/s per chip (the MFU denominator in DESIGN.md); HBM is per chip in GiB.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  peak_tflops: float  # dense bf16 TFLOP/s per chip
  hbm_gib: float  # memory per chip, GiB


CHIPS: dict[str, Chip] = {c.name: c for c in [
    Chip("tpu_v4", 275.0, 32.0),
    Chip("tpu_v5e", 197.0, 16.0),
    Chip("tpu_v5p", 459.0, 95.0),
    Chip("a100_40gb", 312.0, 40.0),
    Chip("a100_80gb", 312.0, 80.0),
    Chip("h100", 989.0, 80.0),
    Chip("h200", 989.0, 141.0),
]}

# Substrings of jax's `device.device_kind` -> CHIPS key (first match wins; order matters: v5 lite before v5).
_DEVICE_KINDS = (
    ("tpu v4", "tpu_v4"),
    ("tpu v5 lite", "tpu_v5e"),
    ("tpu v5e", "tpu_v5e"),
    ("tpu v5p", "tpu_v5p"),
    ("tpu v5", "tpu_v5p"),
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100-sxm4-80gb", "a100_80gb"),
    ("a100 80gb", "a100_80gb"),
    ("a100", "a100_40gb"),
)


def chip_for_device_kind(device_kind: str) -> Chip | None:
  """The Chip for a jax `device.device_kind` string, or None (e.g. a CPU) when the peak is unknown."""
  kind = device_kind.lower()
  for needle, key in _DEVICE_KINDS:
    if needle in kind:
      return CHIPS[key]
  return None


def peak_flops_per_device(device_kind: str, override_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device (override in TFLOP/s wins); None where unknown, so MFU is omitted."""
  if override_tflops > 0:
    return override_tflops * 1e12
  chip = chip_for_device_kind(device_kind)
  return chip.peak_tflops * 1e12 if chip else None
