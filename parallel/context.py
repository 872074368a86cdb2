"""Context parallelism over the `sequence` mesh axis: ring attention, Ulysses (all-to-all) attention, and the
zigzag token layout that gives every device of a causal ring the same work.

Both collectives run per device inside `shard_map` (parallel.kernels.shard_heads with a length axis): each device
holds T/n consecutive rows of the layout (q_bTHK, k_bSGK, v_bSGK with T = S) and the attention math comes in as
functions, so this module knows nothing of the model.

- `ring`: the K/V blocks travel around the ring of n devices by `ppermute`; each device attends its queries to the
  block it holds (`block_fwd`: online-softmax partial results o, lse) and combines them by their logsumexp. The
  next block is sent before the current one is used, so the transfer can overlap the block's compute. The backward
  pass (a custom VJP, as Liu et al.'s ring attention) recomputes each block's scores from the saved output and
  logsumexp (`block_bwd`) and sends each block's dK/dV accumulators around the ring with it; after n hops they are
  home. Per device the memory is that of one K/V block in flight plus the kernel's tiles: linear in T.
- `ulysses` (DeepSpeed-Ulysses): an all-to-all turns sequence-split q/k/v into head-split ones over the whole
  sequence, any single-device attention runs on them, and an all-to-all turns the output back. The query heads
  of a device must divide by n; K/V heads that do not are all-gathered instead and each device keeps those its
  query heads read (GQA / MQA with fewer kv heads than devices).
- `zigzag(T, n)`: device i holds chunks i and 2n-1-i of 2n equal chunks (Megatron / MaxText's load-balanced causal
  layout): under a causal mask every device then has the same number of visible (query, key) pairs.

Shapes: b rows, T local queries (S local keys), H / G query / kv heads, K head width.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # logsumexp of a query that saw nothing (finite: exp(NEG - x) is 0, never NaN)


def zigzag(length: int, shards: int) -> np.ndarray:
  """int32 [length]: the token index held at each position of the balanced layout (position p holds token
  order[p]); device i's T/n positions hold chunks i and 2n-1-i of 2n chunks. length must divide by 2 * shards."""
  if length % (2 * shards):
    raise ValueError(f"the zigzag layout splits the sequence into 2 x {shards} (mesh.sequence) equal chunks: "
                     f"train.seq_len={length} does not divide by {2 * shards}; choose a multiple or "
                     "model.context_layout='contiguous'")
  chunks = np.arange(length, dtype=np.int32).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def _combine(o, lse, o_s, lse_s):
  """Two partial attentions of the same queries over disjoint keys -> their union's (o [..., K], lse [...])."""
  lse_new = jnp.logaddexp(lse, lse_s)
  o = o * jnp.exp(lse - lse_new)[..., None] + o_s * jnp.exp(lse_s - lse_new)[..., None]
  return o, lse_new


def _rotate(tree, axis: str, shards: int):
  """Every device's `tree` to the next device of the ring (device j -> j + 1 mod n)."""
  perm = [(j, (j + 1) % shards) for j in range(shards)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), tree)


def ring(block_fwd: Callable, block_bwd: Callable, q, k, v, q_side, k_side, *, axis: str, shards: int):
  """Ring attention on one device's shard -> o_bTHK in q's dtype.

  block_fwd(q, k, v, q_side, k_side) -> (o_bTHK float32, lse_bTH float32): this device's queries against one
  K/V block (o = 0, lse = NEG for a query that sees none of it). block_bwd(q, k, v, q_side, k_side, lse_bTH,
  delta_bTH, do_bTHK) -> (dq, dk, dv) float32: that block's share of the gradients given the final lse and
  delta = sum(do * o). q_side / k_side: pytrees of this device's per-token operands (indices, segments...); k_side
  travels with its block.
  """
  return _ring(block_fwd, block_bwd, axis, shards, q, k, v, q_side, k_side)


def _ring_forward(block_fwd, axis, shards, q, k, v, q_side, k_side):
  def step(carry, _):
    o, lse, block = carry
    sent = _rotate(block, axis, shards)  # issued before this block's compute, which it does not depend on
    o, lse = _combine(o, lse, *block_fwd(q, *block[:2], q_side, block[2]))
    return (o, lse, sent), None

  o, lse = block_fwd(q, k, v, q_side, k_side)  # the device's own block first: no transfer to wait for
  if shards > 1:
    (o, lse, last), _ = jax.lax.scan(step, (o, lse, _rotate((k, v, k_side), axis, shards)), None,
                                     length=shards - 2)
    o, lse = _combine(o, lse, *block_fwd(q, *last[:2], q_side, last[2]))
  return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(block_fwd, block_bwd, axis, shards, q, k, v, q_side, k_side):
  return _ring_forward(block_fwd, axis, shards, q, k, v, q_side, k_side)[0].astype(q.dtype)


def _ring_fwd(block_fwd, block_bwd, axis, shards, q, k, v, q_side, k_side):
  o, lse = _ring_forward(block_fwd, axis, shards, q, k, v, q_side, k_side)
  o = o.astype(q.dtype)
  return o, (q, k, v, q_side, k_side, o, lse)


def _ring_bwd(block_fwd, block_bwd, axis, shards, res, do):
  q, k, v, q_side, k_side, o, lse = res
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)

  def grads(block, dq):
    dq_s, dk_s, dv_s = block_bwd(q, *block[:2], q_side, block[2], lse, delta, do)
    return dq + dq_s, dk_s, dv_s

  def step(carry, _):
    dq, block, dk, dv = carry
    sent = _rotate(block, axis, shards)  # K/V go on ahead; their gradient accumulators follow once added to
    dq, dk_s, dv_s = grads(block, dq)
    dk, dv = _rotate((dk + dk_s, dv + dv_s), axis, shards)
    return (dq, sent, dk, dv), None

  zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
  carry = (zeros(q), (k, v, k_side), zeros(k), zeros(v))
  (dq, last, dk, dv), _ = jax.lax.scan(step, carry, None, length=shards - 1)
  dq, dk_s, dv_s = grads(last, dq)
  # n hops in all: every block's accumulators have met every device's queries and are back on their own device
  dk, dv = _rotate((dk + dk_s, dv + dv_s), axis, shards)
  none = lambda tree: jax.tree.map(lambda _: None, tree)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), none(q_side), none(k_side)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ulysses(attention: Callable, q, k, v, segment_ids, *, axis: str, shards: int):
  """DeepSpeed-Ulysses on one device's shard -> o_bTHK: all-to-all to the whole sequence with H/n query heads,
  `attention(q_bSHK, k_bSGK, v_bSGK, segment_ids_bS) -> o` (a single-device kernel over the whole sequence, its
  tokens in their natural order), all-to-all back. ValueError when the H local query heads do not divide by n."""
  b, T, H, K = q.shape
  G = k.shape[2]
  if H % shards:
    raise ValueError(f"model.context_parallel='ulysses' splits each device's {H} query heads over mesh.sequence="
                     f"{shards}: they do not divide; use a sequence size dividing the query heads per tensor shard "
                     "(num_heads / mesh.tensor) or model.context_parallel='ring'")
  to_heads = lambda a: jax.lax.all_to_all(a, axis, split_axis=2, concat_axis=1, tiled=True)
  seg_bS = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
  h = H // shards
  if G % shards == 0:
    k, v = to_heads(k), to_heads(v)
  else:  # fewer kv heads than devices: the whole K/V, and the kv heads this device's query heads read
    R = H // G
    if h % R and R % h:
      raise ValueError(f"model.context_parallel='ulysses': {h} query heads per device and {R} query heads per kv "
                       f"head: neither divides the other; choose mesh.sequence dividing the {G} kv heads per tensor "
                       "shard or model.context_parallel='ring'")
    g = max(1, h // R)
    first = jax.lax.axis_index(axis) * h // R
    gather = lambda a: jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(a, axis, axis=1, tiled=True), first, g, 2)
    k, v = gather(k), gather(v)
  o = attention(to_heads(q), k, v, seg_bS)
  return jax.lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)


def unzigzag(x_bTD: jax.Array, *, axis: str, shards: int) -> jax.Array:
  """One device's shard of the zigzag layout (chunks i and 2n-1-i, each T/2 rows of x_bTD) -> its shard of the
  natural order (chunks 2i and 2i+1), by two collective-permutes of one chunk each: the chunk a device needs first
  comes from device 2i (its first chunk) or 2n-1-2i (its second), a bijection over the devices, and likewise for
  the second; so every device sends and receives T/2 rows twice and holds no more than its own shard. n even."""
  if shards % 2:
    raise ValueError(f"the zigzag layout's reordering needs an even mesh.sequence; got {shards}")
  half = x_bTD.shape[1] // 2
  parity = jax.lax.axis_index(axis) % 2
  first, second = x_bTD[:, :half], x_bTD[:, half:]
  n = shards
  # device s sends (to slot 0 of its target) its first chunk when s is even, its second when odd; for slot 1 the
  # other way round
  to_slot0 = [(2 * j if 2 * j < n else 2 * n - 1 - 2 * j, j) for j in range(n)]
  to_slot1 = [(2 * j + 1 if 2 * j + 1 < n else 2 * n - 2 - 2 * j, j) for j in range(n)]
  slot0 = jax.lax.ppermute(jnp.where(parity == 0, first, second), axis, to_slot0)
  slot1 = jax.lax.ppermute(jnp.where(parity == 1, first, second), axis, to_slot1)
  return jnp.concatenate([slot0, slot1], axis=1)
