"""Named rematerialisation (activation checkpointing) policies for the transformer layer body.

The layer body tags its main intermediates with `jax.ad_checkpoint.checkpoint_name` (the names below); a policy
decides which of them are kept for the backward pass, everything else is recomputed. `none` means no checkpoint
wrapping at all (everything kept); `full` keeps only the layer inputs. The `offload_*` policies move what they
save to the host's pinned memory after the forward pass and back for the backward pass (jax's
`save_and_offload_only_these_names`): HBM holds none of it, the host-to-device link carries it twice per step.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

LAYER_INPUT = "decoder_layer_input"  # the layer input (the scan carry) [B, L, D]
QUERY_PROJ = "query_proj"  # q after projection and RoPE   [B, L, H, K]
KEY_PROJ = "key_proj"  # k after projection and RoPE     [B, L, G, K]
VALUE_PROJ = "value_proj"  # v after projection          [B, L, G, K]
ATTN_CONTEXT = "attn_context"  # attention output before the output projection [B, L, H, K]
ATTN_OUT = "attn_out"  # after the output projection     [B, L, D]
MLP_IN = "mlp_in"  # gate and up projections             [B, L, F]
MLP_HIDDEN = "mlp_hidden"  # activation(gate) * up       [B, L, F]
MLP_OUT = "mlp_out"  # after the down projection         [B, L, D]
NAMES = (LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_CONTEXT, ATTN_OUT, MLP_IN, MLP_HIDDEN, MLP_OUT)

# What one layer can keep for its backward pass, in groups (train/planning/memory.py sizes each group per token):
#   input      the layer input (the scan carry)             norms      normalisation intermediates and outputs
#   qkv        q, k, v after projection and RoPE            context    attention output before its projection
#   scores     the [H, S] attention scores per query        attn_out   the attention block's output projection
#   mlp_in     gate and up projections                      mlp_other  the activation's intermediates, gate * up
#   mlp_out    the MLP's down projection
GROUPS = ("input", "norms", "qkv", "context", "scores", "attn_out", "mlp_in", "mlp_other", "mlp_out")


class Policy(NamedTuple):
  """A remat policy: `checkpoint` for `jax.checkpoint` (None = no checkpoint wrapping, everything kept), the
  GROUPS it keeps in device memory and those it keeps in host memory (`offloads`); everything else is recomputed
  in the backward pass."""
  checkpoint: Callable | None
  keeps: tuple[str, ...]
  offloads: tuple[str, ...] = ()


_cp = jax.checkpoint_policies


def _offload(*names: str) -> Callable:
  return _cp.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
                                               offload_src="device", offload_dst="pinned_host")


# The one table of remat policies: name -> what jax is told and what the layer therefore keeps.
POLICIES: dict[str, Policy] = {
    "none": Policy(None, ("input", "norms", "qkv", "context", "scores", "mlp_in", "mlp_other")),
    "full": Policy(_cp.nothing_saveable, ("input",)),
    # every matmul output, attention scores included
    "save_dots": Policy(_cp.dots_saveable, ("input", "qkv", "scores", "context", "attn_out", "mlp_in", "mlp_out")),
    # projection matmuls only, attention recomputed
    "minimal": Policy(_cp.dots_with_no_batch_dims_saveable, ("input", "qkv", "attn_out", "mlp_in", "mlp_out")),
    "save_qkv_proj": Policy(_cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ), ("input", "qkv")),
    "save_attn": Policy(_cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_CONTEXT),
                        ("input", "qkv", "context")),
    "save_out_proj": Policy(_cp.save_only_these_names(ATTN_OUT, MLP_OUT), ("input", "attn_out", "mlp_out")),
    "save_qkv_mlp_in": Policy(_cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ, MLP_IN),
                              ("input", "qkv", "mlp_in")),
    # MaxText's policy of the same name: every projection but the MLP's gate and up (recomputed with attention)
    "save_dot_except_mlpwi": Policy(_cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_OUT, MLP_OUT),
                                    ("input", "qkv", "attn_out", "mlp_out")),
    # MaxText's remat_policy=custom with decoder_layer_input: offload (its 405B recipes): recompute everything,
    # the layer input kept on the host
    "offload_input": Policy(_offload(LAYER_INPUT), (), ("input",)),
    # MaxText's custom policy of its Llama 3.1 8B / 70B v6e recipes: the layer input, q, k, v and the attention's
    # output projection on the host, the rest recomputed
    "offload_qkv_out": Policy(_offload(LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_OUT), (),
                              ("input", "qkv", "attn_out")),
}


def tag(x: jax.Array, name: str) -> jax.Array:
  """Names an intermediate for the remat policies (identity in the forward pass)."""
  return checkpoint_name(x, name)


def wrap(fn: Callable, policy_name: str, *, prevent_cse: bool = True) -> Callable:
  """`fn` wrapped in `jax.checkpoint` with the named policy (`fn` itself for `none`); the name was validated
  with the model config."""
  policy = POLICIES[policy_name].checkpoint
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
