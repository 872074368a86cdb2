"""MFU arithmetic (train/mfu.py): model FLOPs per second over the hardware peak, omitted where the peak is unknown."""
import jax
import pytest

from model import count_params
import configs
from train import hardware
from train import mfu


def test_mfu_formula_and_unknown_peak():
  # 2 H100s at 989 TFLOP/s each; 10k tokens/s of a model costing 6e9 FLOPs per token -> 6e13 / 1.978e15.
  peak = hardware.peak_flops_per_device("NVIDIA H100 80GB HBM3")
  assert peak == 989e12
  assert mfu.mfu(1e4, 6e9, 2, peak) == pytest.approx(6e13 / (2 * 989e12))
  assert mfu.mfu(1e4, 6e9, 2, None) is None


def test_cpu_peak_is_unknown_unless_given():
  assert mfu.peak_flops_per_device(jax.devices()) is None
  assert mfu.peak_flops_per_device(jax.devices(), override_tflops=2.5) == 2.5e12


def test_flops_per_step_scales_flops_per_token():
  c = configs.load("tiny")
  per_token = mfu.flops_per_token(c.model, c.train.seq_len)
  assert mfu.flops_per_step(c.model, c.train.seq_len, 3) == pytest.approx(per_token * c.train.seq_len * 3)
  # At least the 6 * N matmul term of the non-embedding parameters (model.flops_per_token's definition).
  assert per_token >= 6 * count_params(c.model)["non_embedding"]
