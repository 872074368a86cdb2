"""Rotary position embeddings in the Hugging Face Llama convention (rotate the two halves of each head).

Frequency i (of K/2) rotates dimensions i and i + K/2, so Hugging Face q/k projection weights load unpermuted.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def inv_frequencies(cfg) -> np.ndarray:
  """float32 [K/2] angular frequencies (radians per position), with Llama-3 scaling when configured."""
  K = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, K, 2, dtype=np.float32) / np.float32(K)))
  if cfg.rope_scaling == "llama3":
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between.
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def cos_sin(positions_BL: jax.Array, inv_freq_F: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """float32 cos, sin [B, L, K/2] of position * frequency."""
  angle_BLF = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
  return jnp.cos(angle_BLF), jnp.sin(angle_BLF)


def apply(x_BLNK: jax.Array, cos_BLF: jax.Array, sin_BLF: jax.Array) -> jax.Array:
  """Rotates each head of x [B, L, N, K] by its position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
  x1, x2 = jnp.split(x_BLNK.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_BLF[:, :, None], sin_BLF[:, :, None]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLNK.dtype)
