"""MaxText's global_parameter_scale=64 model (MaxText/configs/v5e/64b.sh): d_model 8192, 64 layers, 64 heads x 128, mlp 28672: 62.8B parameters.

Global batch 2 x 256 = 512 sequences of 2048 tokens (per-device batch 2 on a v5e-256), remat full,
FSDP over the slice; see configs/_maxtext.py for the scaling rule.
"""
from configs import _maxtext


def get_config():
  return _maxtext.scaled(64, per_device_batch=2)
