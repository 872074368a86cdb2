"""Context parallelism (model.context_parallel): ring and Ulysses attention over the `sequence` mesh axis give the
whole model's loss and gradients of one device, with packed documents, a sliding window, GQA and the zigzag
layout; the zigzag layout balances causal work; impossible settings are refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import parallel
from model import transformer
from parallel import context as context_lib
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from flax import nnx

B, L = 4, 64


def _model_config(**model):
  c = configs.load("tiny")
  # Layer 0 attends in a 12-token window, layer 1 globally; 4 query heads read 2 kv heads (GQA).
  c.model.update(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=L, sliding_window=12, global_every=2, attention_block_size=4)
  c.model.update(**model)
  return c


def _batch(length=L):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 256, size=(B, length + 1)).astype(np.int32)
  segments = np.ones((B, length), np.int32)  # packed documents of uneven lengths, and padding at the end of one row
  segments[0, 23:] = 2
  segments[1, 9:41], segments[1, 41:] = 2, 3
  segments[2, 50:] = 0
  return tokens[:, :-1], tokens[:, 1:], segments


def _loss_and_grads(config, mesh_shape=None, hlo=False, length=L):
  """Mean next-token cross-entropy over the real tokens and its gradients, jitted on one device or on a mesh
  (data, tensor, sequence); parameters from the same seed. hlo=True: the mesh program's optimised HLO instead."""
  model = transformer.Transformer(config.model, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  inputs, targets, segments = _batch(length)

  def loss(state):
    logits = nnx.merge(graphdef, state)(inputs, segments)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(nll * (segments > 0)) / jnp.sum(segments > 0)

  fn = jax.jit(jax.value_and_grad(loss))
  if mesh_shape is None:
    with jax.default_device(jax.devices()[0]):
      return jax.device_get(fn(state))
  config.mesh.update(data=mesh_shape[0], tensor=mesh_shape[1], sequence=mesh_shape[2], fsdp=1)
  mesh = mesh_lib.make_mesh(config.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), config.model, mesh)

  def sharded(state):
    with parallel.activate(mesh, rules, inside_jit=True):
      return jax.value_and_grad(loss)(state)

  with jax.set_mesh(mesh):
    if hlo:
      return jax.jit(sharded).lower(state).compile().as_text()
    return jax.device_get(jax.jit(sharded)(state))


HEADS = [(4, 2), (4, 4), (8, 2)]  # (query heads, kv heads) of the models compared


@pytest.fixture(scope="module")
def references():
  return {(h, kv): _loss_and_grads(_model_config(num_heads=h, num_kv_heads=kv)) for h, kv in HEADS}


CASES = [  # (context_parallel, context_layout, (data, tensor, sequence), (query heads, kv heads))
    ("ring", "zigzag", (1, 1, 8), (4, 2)),
    ("ring", "contiguous", (1, 1, 8), (4, 2)),
    ("ring", "zigzag", (2, 1, 4), (4, 2)),
    ("ring", "zigzag", (2, 2, 2), (4, 2)),
    ("ulysses", "zigzag", (1, 1, 8), (8, 2)),  # one query head per device; 2 kv heads gathered, 1 kept
    ("ulysses", "zigzag", (2, 1, 4), (4, 2)),  # 2 kv heads on 4 devices: K/V gathered, each keeps the head it reads
    ("ulysses", "zigzag", (2, 1, 4), (4, 4)),  # 4 kv heads: K/V by all-to-all like the queries
    ("ulysses", "zigzag", (2, 2, 2), (4, 2)),
]


@pytest.mark.parametrize("mode,layout,mesh_shape,heads", CASES)
def test_context_parallel_equals_one_device(references, mode, layout, mesh_shape, heads):
  loss_ref, grads_ref = references[heads]
  loss, grads = _loss_and_grads(_model_config(num_heads=heads[0], num_kv_heads=heads[1], context_parallel=mode,
                                              context_layout=layout), mesh_shape)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), (leaf for _, leaf in flat_ref)):
    scale = float(np.max(np.abs(g_ref)))
    assert float(np.max(np.abs(np.asarray(g) - g_ref))) <= 1e-5 * scale, jax.tree_util.keystr(path)


def test_zigzag_balances_causal_work():
  """Every device of the zigzag layout holds the same number of visible causal (query, key) pairs, counted by
  brute force; the contiguous layout's last device has 2n-1 times its first's."""
  T, n = 64, 4
  order = context_lib.zigzag(T, n)
  assert sorted(order.tolist()) == list(range(T))
  per_device = [int(sum(i + 1 for i in order[d * T // n:(d + 1) * T // n])) for d in range(n)]
  assert len(set(per_device)) == 1 and sum(per_device) == T * (T + 1) // 2
  contiguous = [sum(i + 1 for i in range(d * T // n, (d + 1) * T // n)) for d in range(n)]
  assert contiguous[-1] / contiguous[0] == pytest.approx(2 * n - 1, rel=0.1)


def test_refusals_name_the_keys():
  c = _model_config(context_parallel="ulysses")
  c.mesh.update(data=1, tensor=1, sequence=8, fsdp=1)
  with pytest.raises(ValueError, match="ulysses.*mesh.sequence=8"):
    rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh_lib.make_mesh(c.mesh))
  c = _model_config(context_parallel="ulysses", num_heads=12, num_kv_heads=3)
  c.mesh.update(data=4, tensor=1, sequence=2, fsdp=1)
  with pytest.raises(ValueError, match="3 kv heads per tensor shard on mesh.sequence=2"):
    rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh_lib.make_mesh(c.mesh))
  with pytest.raises(ValueError, match="train.seq_len=24 does not divide by 16"):
    context_lib.zigzag(24, 8)
  with pytest.raises(ValueError, match="model.context_parallel"):
    transformer.Transformer(_model_config(context_parallel="ring2").model, rngs=nnx.Rngs(0))
  c = _model_config(context_parallel="ring")
  c.mesh.update(data=1, tensor=1, sequence=2, fsdp=1, stage=4)
  with pytest.raises(ValueError, match="context_parallel='ring' with mesh.stage > 1"):
    rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh_lib.make_mesh(c.mesh))


def test_ring_moves_kv_blocks_by_permutes_and_gathers_none():
  """The compiled training step of ring sends the local K/V blocks [1, L/8, 2 kv heads, 16] (and their gradients)
  by collective-permutes and all-gathers no whole-sequence K/V [1, L, 2, 16], which all_gather's step does."""
  from train.core import step as step_lib

  def ops(mode, kind):
    c = _model_config(context_parallel=mode)
    c.train.update(batch_size=1, seq_len=L)
    c.mesh.update(data=1, fsdp=1, tensor=1, sequence=8)
    text = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh)).compiled().as_text()
    return [line for line in text.splitlines() if f" {kind}(" in line or f" {kind}-start(" in line]
  block, whole = f"f32[1,{L // 8},2,16]", f"f32[1,{L},2,16]"
  permutes = ops("ring", "collective-permute")
  assert sum(block in line for line in permutes) >= 6  # K, V and dK, dV (forward and backward rotations)
  assert not any(whole in line for line in ops("ring", "all-gather"))
  assert any(whole in line for line in ops("all_gather", "all-gather"))


def _masks():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 64, h, 8)), jnp.float32) for h in (4, 2, 2))
  seg, prefix, branch = np.ones((2, 64), np.int32), np.zeros((2, 64), np.int32), np.zeros((2, 64), np.int32)
  seg[0, 30:] = 2
  prefix[0, :10], prefix[0, 30:40], prefix[1, :20] = 1, 1, 1  # prefix-LM: bidirectional document prefixes
  branch[1, 40:50], branch[1, 50:60] = 1, 2  # tree attention: two continuations of one trunk
  return q, k, v, jnp.asarray(seg), jnp.asarray(prefix), jnp.asarray(branch)


@pytest.mark.parametrize("mask", ["prefix", "branch", "bidirectional", "softcap"])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_attention_masks_across_the_sequence_axis(mask, mode):
  """Prefix-LM, tree (branch), bidirectional and soft-capped attention through ring (zigzag layout) and Ulysses on
  data 2 x sequence 4: values and gradients equal the single-device reference attention."""
  from model import attention
  q, k, v, seg, prefix, branch = _masks()
  kw = dict(causal=mask != "bidirectional", prefix_BT=prefix if mask == "prefix" else None,
            branch_BT=branch if mask == "branch" else None, softcap=3.0 if mask == "softcap" else 0.0)
  weights = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
  ref = jax.grad(lambda *a: jnp.sum(attention.xla_attention(*a, seg, **kw) * weights), argnums=(0, 1, 2))(q, k, v)
  c = _model_config()
  c.mesh.update(data=2, fsdp=1, tensor=1, sequence=4)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.logical_rules(c.mesh)
  order = context_lib.zigzag(64, 4) if mode == "ring" else None
  lay = (lambda a: a if a is None else a[:, order]) if order is not None else (lambda a: a)

  def loss(q, k, v):
    with parallel.activate(mesh, rules, inside_jit=True):
      o = attention.context_attend(mode, "xla", lay(q), lay(k), lay(v), lay(seg), 0, 4, kw["causal"],
                                   lay(kw["prefix_BT"]), lay(kw["branch_BT"]), softcap=kw["softcap"], order_T=order)
    return jnp.sum((o[:, np.argsort(order)] if order is not None else o) * weights)

  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for g, r in zip(got, ref):
    assert float(jnp.max(jnp.abs(g - r))) <= 1e-5 * float(jnp.max(jnp.abs(r)))


def test_a_length_the_zigzag_cannot_split_runs_contiguous():
  """Scoring pads lengths to a multiple of the sequence axis only: 60 tokens on sequence=4 (not a multiple of 8)
  run the contiguous layout and still equal one device; training refuses such a train.seq_len by name."""
  loss_ref, grads_ref = _loss_and_grads(_model_config(), length=60)
  loss, grads = _loss_and_grads(_model_config(context_parallel="ring"), (2, 1, 4), length=60)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert float(np.max(np.abs(np.asarray(g) - g_ref))) <= 1e-5 * float(np.max(np.abs(g_ref)))
  from train.core import step as step_lib
  c = configs.load("tiny", **{"model.context_parallel": "ring", "mesh.data": 2, "mesh.sequence": 4,
                              "train.seq_len": 36, "train.batch_size": 4})
  with pytest.raises(ValueError, match="train.seq_len=36: the ring's zigzag layout"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))
