"""meshlm model: a Flax NNX decoder-only transformer with logical axis names (see docs/model.md)."""
from model import axes
from model import moe
from model import remat
from model.counting import count_params, flops_per_token
from model.transformer import Transformer
from model import hf  # after Transformer: hf builds models

__all__ = ["Transformer", "axes", "count_params", "flops_per_token", "hf", "moe", "remat"]
