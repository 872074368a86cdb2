"""Rotary position embeddings in the Hugging Face Llama convention (rotate the two halves of each head).

Frequency i (of K/2) rotates dimensions i and i + K/2, so Hugging Face q/k projection weights load unpermuted.

Frequencies follow transformers' `modeling_rope_utils` (float32 as it computes them): the default
1 / theta^(2i/K), and with `model.rope_scaling` llama3 (Llama 3.1), linear (divided by the factor), dynamic (NTK:
the base grows with the input's length once it exceeds rope_original_max_len) or yarn (YaRN, which also scales
cos and sin by its attention factor). With `model.rope_local_theta` the layers with a window use plain frequencies
of that base instead (Gemma 3): `tables` then returns both sets stacked, [2, B, L, K/2] (global, local), and each
layer picks its own with `for_window` from its (possibly traced) window.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rotated_dim(cfg) -> int:
  """Dimensions per head that RoPE rotates: head_dim, or qk_rope_head_dim of Multi-head Latent Attention."""
  return cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim


def default_frequencies(theta: float, K: int) -> np.ndarray:
  """float32 [K/2] unscaled angular frequencies 1 / theta^(2i/K) (radians per position)."""
  return (1.0 / (theta ** (np.arange(0, K, 2, dtype=np.float32) / np.float32(K)))).astype(np.float32)


def inv_frequencies(cfg, seq_len: jax.Array | int | None = None) -> np.ndarray | jax.Array:
  """float32 [K/2] angular frequencies of the global layers (every layer without model.rope_local_theta), scaled
  as model.rope_scaling says. Dynamic scaling depends on the input: `seq_len` (max position + 1, may be traced)
  gives its frequencies; None gives the unscaled ones (transformers' before any input, and for seq_len <=
  rope_original_max_len)."""
  K = rotated_dim(cfg)
  inv_freq = default_frequencies(cfg.rope_theta, K)
  if cfg.rope_scaling == "llama3":
    return _llama3(cfg, inv_freq)
  if cfg.rope_scaling == "linear":
    return (inv_freq / np.float32(cfg.rope_scaling_factor)).astype(np.float32)
  if cfg.rope_scaling == "yarn":
    return _yarn(cfg)
  if cfg.rope_scaling == "dynamic" and seq_len is not None:
    return _dynamic(cfg, seq_len, inv_freq)
  return inv_freq


def _llama3(cfg, inv_freq: np.ndarray) -> np.ndarray:
  """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between."""
  factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old_len = cfg.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(cfg) -> np.ndarray:
  """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters`: dimensions rotating fewer than
  beta_slow times over the original context are interpolated (frequency / factor), those rotating more than
  beta_fast times kept, with a linear ramp over the dimensions in between."""
  K, base, factor = rotated_dim(cfg), cfg.rope_theta, cfg.rope_scaling_factor
  old_len = cfg.rope_original_max_len

  def dimension(rotations):  # the dimension whose wavelength fits `rotations` times into old_len
    return K * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = dimension(cfg.rope_yarn_beta_fast), dimension(cfg.rope_yarn_beta_slow)
  if cfg.rope_yarn_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, K - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(K // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
  pos_freqs = base ** (np.arange(0, K, 2, dtype=np.float32) / np.float32(K))
  keep = 1 - ramp  # the share of the original (extrapolated) frequency
  inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
  return inv_freq.astype(np.float32)


def _dynamic(cfg, seq_len, inv_freq: np.ndarray) -> jax.Array:
  """Dynamic NTK scaling (transformers' `_compute_dynamic_ntk_parameters` with `dynamic_rope_update`): for inputs
  longer than rope_original_max_len the base becomes theta * (factor * len / orig - (factor - 1))^(K / (K - 2));
  shorter ones keep the original frequencies. float32, like transformers."""
  K, orig, factor = rotated_dim(cfg), cfg.rope_original_max_len, cfg.rope_scaling_factor
  length = jnp.maximum(jnp.asarray(seq_len), orig).astype(jnp.float32)
  base = jnp.float32(cfg.rope_theta) * ((jnp.float32(factor) * length / orig) - jnp.float32(factor - 1)) ** (
      jnp.float32(K / (K - 2)))
  scaled = 1.0 / (base ** (jnp.arange(0, K, 2, dtype=jnp.float32) / jnp.float32(K)))
  return jnp.where(jnp.asarray(seq_len) > orig, scaled, jnp.asarray(inv_freq))


def attention_factor(cfg) -> float:
  """The factor on cos and sin (so scores grow by its square): YaRN's rope_attention_factor, by default
  0.1 ln(factor) + 1 (1 for factor <= 1); 1 for every other scaling."""
  if cfg.rope_scaling != "yarn":
    return 1.0
  if cfg.rope_attention_factor:
    return float(cfg.rope_attention_factor)
  factor = cfg.rope_scaling_factor
  return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def cos_sin(positions_BL: jax.Array, inv_freq_F, factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """float32 cos, sin [B, L, K/2] of position * frequency, times `factor` (YaRN's attention factor)."""
  angle_BLF = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F, jnp.float32)
  cos_BLF, sin_BLF = jnp.cos(angle_BLF), jnp.sin(angle_BLF)
  if factor != 1.0:
    cos_BLF, sin_BLF = cos_BLF * jnp.float32(factor), sin_BLF * jnp.float32(factor)
  return cos_BLF, sin_BLF


def tables(cfg, positions_BL: jax.Array, seq_len: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
  """The cos and sin tables of a model config for positions_BL: float32 [B, L, K/2], or [2, B, L, K/2] (global,
  local) with model.rope_local_theta. `seq_len` (dynamic scaling only) defaults to max(positions_BL) + 1, as
  transformers takes it from the input's position ids (over the whole batch)."""
  if cfg.rope_scaling == "dynamic" and seq_len is None:
    seq_len = jnp.max(positions_BL) + 1
  cos, sin = cos_sin(positions_BL, inv_frequencies(cfg, seq_len), attention_factor(cfg))
  if not cfg.rope_local_theta:
    return cos, sin
  local_cos, local_sin = cos_sin(positions_BL, default_frequencies(cfg.rope_local_theta, rotated_dim(cfg)))
  return jnp.stack([cos, local_cos]), jnp.stack([sin, local_sin])


def for_window(cos, sin, window) -> tuple[jax.Array, jax.Array]:
  """One layer's cos_BLF, sin_BLF from `tables`: the local set for a layer with a window (> 0) when there are two
  sets. `window` may be traced (the layer scan's per-layer windows): the set is then indexed, not branched on."""
  if cos.ndim == 3:
    return cos, sin
  local = (jnp.asarray(window) > 0).astype(jnp.int32)
  return cos[local], sin[local]


def apply(x_BLNK: jax.Array, cos_BLF: jax.Array, sin_BLF: jax.Array) -> jax.Array:
  """Rotates each head of x [B, L, N, K] by its position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
  x1, x2 = jnp.split(x_BLNK.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_BLF[:, :, None], sin_BLF[:, :, None]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLNK.dtype)
