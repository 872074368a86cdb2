"""Parameters with logical axis names and the dense feed-forward block: the pieces model/layers.py and
model/moe.py (routed and shared experts) both build on."""
from __future__ import annotations

import jax
from flax import nnx

from model import axes
from model import mup
from model import quant as quant_lib
from model import remat
from model.axes import BATCH, EMBED, LENGTH, MLP
from model.config import DTYPES, GATED


def param(rngs: nnx.Rngs, shape, names, cfg, init: str = "normal") -> nnx.Param:
  """A parameter of `shape` in cfg.param_dtype with logical axis `names`; init normal(init_std) | zeros | ones
  (under muP the normal's std depends on the kind of parameter: model/mup.py)."""
  inits = {"normal": nnx.initializers.normal(mup.init_std(cfg, names)), "zeros": nnx.initializers.zeros,
           "ones": nnx.initializers.ones}
  make = axes.param_init(inits[init], names)
  return nnx.Param(make(rngs.params(), tuple(shape), DTYPES[cfg.param_dtype]))


def _value(p: nnx.Param, dtype) -> jax.Array:
  return p[...].astype(dtype)


class Mlp(nnx.Module):
  """Feed-forward block: swiglu down(silu(gate x) * up x), geglu (gelu gate), or the ungated gelu
  down(gelu(up x)) and relu down(relu(up x)) (MaxText's 2023 default decoder)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, F = cfg.d_model, cfg.mlp_dim
    self.kind, self.dtype, self.use_bias = cfg.mlp_type, DTYPES[cfg.dtype], cfg.use_bias
    self.quant = cfg.quant if "mlp" in cfg.quant_layers else "none"
    if self.kind in GATED:
      self.gate = param(rngs, (D, F), (EMBED, MLP), cfg)
    self.up = param(rngs, (D, F), (EMBED, MLP), cfg)
    self.down = param(rngs, (F, D), (MLP, EMBED), cfg)
    if cfg.use_bias:
      if self.kind in GATED:
        self.gate_bias = param(rngs, (F,), (MLP,), cfg, "zeros")
      self.up_bias = param(rngs, (F,), (MLP,), cfg, "zeros")
      self.down_bias = param(rngs, (D,), (EMBED,), cfg, "zeros")

  def _project(self, x_BLD, name):
    h_BLF = quant_lib.einsum("bld,df->blf", x_BLD, _value(getattr(self, name), self.dtype), self.quant)
    if self.use_bias:
      h_BLF = h_BLF + _value(getattr(self, name + "_bias"), self.dtype)
    return remat.tag(axes.constrain(h_BLF, (BATCH, LENGTH, MLP)), remat.MLP_IN)

  def __call__(self, x_BLD) -> jax.Array:
    up_BLF = self._project(x_BLD, "up")
    if self.kind not in GATED:
      h_BLF = jax.nn.relu(up_BLF) if self.kind == "relu" else jax.nn.gelu(up_BLF, approximate=True)
    else:
      act = jax.nn.silu if self.kind == "swiglu" else lambda g: jax.nn.gelu(g, approximate=True)
      h_BLF = act(self._project(x_BLD, "gate")) * up_BLF
    h_BLF = remat.tag(h_BLF, remat.MLP_HIDDEN)
    y_BLD = quant_lib.einsum("blf,fd->bld", h_BLF, _value(self.down, self.dtype), self.quant)
    if self.use_bias:
      y_BLD = y_BLD + _value(self.down_bias, self.dtype)
    return remat.tag(axes.constrain(y_BLD, (BATCH, LENGTH, EMBED)), remat.MLP_OUT)
