"""MaxText's global_parameter_scale=16 model (MaxText/configs/v5e/16b.sh): d_model 4096, 32 layers, 64 heads x 128, mlp 28672: 15.8B parameters.

Global batch 6 x 256 = 1536 sequences of 2048 tokens (per-device batch 6 on a v5e-256), remat full,
FSDP over the slice; see configs/_maxtext.py for the scaling rule.
"""
from configs import _maxtext


def get_config():
  return _maxtext.scaled(16, per_device_batch=6)
