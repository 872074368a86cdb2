"""Named rematerialisation (activation checkpointing) policies for the transformer layer body.

The layer body tags its main intermediates with `jax.ad_checkpoint.checkpoint_name` (the names below); a policy
decides which of them are kept for the backward pass, everything else is recomputed. `none` means no checkpoint
wrapping at all (everything kept); `full` keeps only the layer inputs.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

QUERY_PROJ = "query_proj"  # q after projection and RoPE   [B, L, H, K]
KEY_PROJ = "key_proj"  # k after projection and RoPE     [B, L, G, K]
VALUE_PROJ = "value_proj"  # v after projection          [B, L, G, K]
ATTN_CONTEXT = "attn_context"  # attention output before the output projection [B, L, H, K]
ATTN_OUT = "attn_out"  # after the output projection     [B, L, D]
MLP_IN = "mlp_in"  # gate and up projections             [B, L, F]
MLP_HIDDEN = "mlp_hidden"  # activation(gate) * up       [B, L, F]
MLP_OUT = "mlp_out"  # after the down projection         [B, L, D]
NAMES = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_CONTEXT, ATTN_OUT, MLP_IN, MLP_HIDDEN, MLP_OUT)

_cp = jax.checkpoint_policies

# name -> checkpoint policy; None = no checkpointing (keep everything).
POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": _cp.nothing_saveable,
    "save_dots": _cp.dots_saveable,  # every matmul output, attention scores included
    "minimal": _cp.dots_with_no_batch_dims_saveable,  # projection matmuls only, attention recomputed
    "save_qkv_proj": _cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ),
    "save_attn": _cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_CONTEXT),
    "save_out_proj": _cp.save_only_these_names(ATTN_OUT, MLP_OUT),
    "save_qkv_mlp_in": _cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ, MLP_IN),
}


def tag(x: jax.Array, name: str) -> jax.Array:
  """Names an intermediate for the remat policies (identity in the forward pass)."""
  return checkpoint_name(x, name)


def wrap(fn: Callable, policy_name: str, *, prevent_cse: bool = True) -> Callable:
  """`fn` wrapped in `jax.checkpoint` with the named policy (`fn` itself for `none`); the name was validated
  with the model config."""
  policy = POLICIES[policy_name]
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
