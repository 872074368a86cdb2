"""MaxText's global_parameter_scale=128 model (MaxText/configs/v5e/128b.sh): d_model 8192, 64 layers, 128 heads x 128, mlp 57344: 125B parameters.

Global batch 1 x 256 = 256 sequences of 2048 tokens (per-device batch 1 on a v5e-256), remat full,
FSDP over the slice; see configs/_maxtext.py for the scaling rule.
"""
from configs import _maxtext


def get_config():
  return _maxtext.scaled(128, per_device_batch=1)
