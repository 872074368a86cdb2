"""MaxText's global_parameter_scale=32 model (MaxText/configs/v5e/32b.sh): d_model 8192, 32 layers, 64 heads x 128, mlp 28672: 31.7B parameters.

Global batch 4 x 256 = 1024 sequences of 2048 tokens (per-device batch 4 on a v5e-256), remat full,
FSDP over the slice; see configs/_maxtext.py for the scaling rule.
"""
from configs import _maxtext


def get_config():
  return _maxtext.scaled(32, per_device_batch=4)
