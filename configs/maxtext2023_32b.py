"""MaxText's global_parameter_scale=32 model as measured for its v5e table (2023, MaxText/configs/v5e/README.md):
the V5E_2023 decoder of configs/_maxtext.py (ungated relu MLP, tied embedding, head_dim 256), 32.55B parameters.

Global batch 4 x 256 sequences of 2048 tokens (per-device batch 4 on a v5e-256; MaxText/configs/largest_job/32b.sh),
remat full, splash attention, FSDP over the slice, the recipe's overlap flags.
"""
from configs import _maxtext


def get_config():
  return _maxtext.scaled(32, per_device_batch=4, base_model=_maxtext.V5E_2023)
