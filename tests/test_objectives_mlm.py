"""Masked-LM encoder: bidirectional attention against a brute-force reference, the model's bidirectionality,
BERT's selection / replacement proportions, the mask token, and a step whose loss counts only selected tokens."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from data import tokenizer as tokenizer_lib
from model import generate as generate_lib
from parallel import mesh as mesh_lib
from train.core import step as step_lib
from train.objectives import mlm

from attention_testing import brute_force_attention

B, T, H, G, K = 2, 21, 4, 2, 8


def brute_force_bidirectional(q, k, v, seg):
  """Every key of the query's own segment is visible."""
  return brute_force_attention(q, k, v, seg[:, :, None] == seg[:, None, :])


@pytest.mark.parametrize("impl", ["xla", "dot_product", "blockwise"])
def test_bidirectional_attention_matches_brute_force_on_packed_rows(impl):
  from model import attention  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k, v = (rng.normal(size=(B, T, G, K)).astype(np.float32) for _ in range(2))
  seg = np.array([[1] * T, [1] * 6 + [2] * 9 + [3] * 3 + [0] * 3], np.int32)
  fn = {"xla": attention.xla_attention, "dot_product": attention.dot_product_attention,
        "blockwise": functools.partial(attention.blockwise_attention, block_size=8)}[impl]
  got = jax.jit(functools.partial(fn, causal=False))(q, k, v, seg, 0)
  np.testing.assert_allclose(np.asarray(got), brute_force_bidirectional(q, k, v, seg), atol=2e-5)
  if impl == "blockwise":  # the custom VJP against autodiff of the reference
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, seg, 0, causal=False))))
    want = jax.grad(loss(attention.xla_attention), argnums=(0, 1, 2))(q, k, v)
    have = jax.grad(loss(functools.partial(attention.blockwise_attention, block_size=8)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(have, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def _model_config(causal):
  c = configs.load("tiny").model
  c.update(vocab_size=128, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
           max_seq_len=16, causal=causal, init_std=0.2)
  return c


def test_a_token_changes_earlier_logits_only_in_the_encoder():
  tokens = np.random.default_rng(1).integers(30, 128, size=(1, 16)).astype(np.int32)
  seg = np.array([[1] * 10 + [2] * 6], np.int32)
  changed = tokens.copy()
  changed[0, 7] = (tokens[0, 7] + 1) % 128
  for causal in (False, True):
    m = model_lib.Transformer(_model_config(causal), rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, x: m(x, jnp.asarray(seg)))
    a, b = (np.asarray(forward(m, jnp.asarray(x))) for x in (tokens, changed))
    moved = np.abs(a - b).max(axis=-1)[0]
    assert moved[10:].max() == 0.0  # another document never sees it (segment-aware, both)
    if causal:
      assert moved[:7].max() == 0.0 and moved[7] > 0
    else:
      assert (moved[:10] > 1e-6).all()
  with pytest.raises(ValueError, match="causal"):
    generate_lib.generate(model_lib.Transformer(_model_config(False), rngs=nnx.Rngs(0)), [[2, 40]], 2)


def test_selection_and_replacement_proportions_within_one_percent():
  V = 2048
  tokens = jax.random.randint(jax.random.PRNGKey(0), (256, 512), mlm.FIRST_TEXT_ID, V, jnp.int32)
  eligible = jnp.ones(tokens.shape, bool).at[:, :64].set(False)
  corrupted, selected = jax.jit(functools.partial(mlm.mask_tokens, rate=0.15, mask_fraction=0.8,
                                                  random_fraction=0.1, vocab_size=V))(
      jax.random.PRNGKey(1), tokens, eligible)
  tokens, corrupted, selected, eligible = (np.asarray(x) for x in (tokens, corrupted, selected, eligible))
  sel = selected > 0
  assert not sel[~eligible].any() and (corrupted[~sel] == tokens[~sel]).all()
  assert abs(sel.sum() / eligible.sum() - 0.15) < 0.01
  masked = corrupted[sel] == mlm.MASK_ID
  random = (corrupted[sel] != mlm.MASK_ID) & (corrupted[sel] != tokens[sel])
  assert abs(masked.mean() - 0.8) < 0.01
  assert abs(random.mean() - 0.1 * (1 - 1 / (V - mlm.FIRST_TEXT_ID))) < 0.01
  assert abs(1 - masked.mean() - random.mean() - 0.1) < 0.01
  assert corrupted[sel][random].min() >= mlm.FIRST_TEXT_ID and corrupted.max() < V


def test_mask_token_is_a_reserved_piece_of_the_tokenizer(tmp_path):
  texts = ["the quick brown fox jumps over the lazy dog " * 20, "def f(x):\n    return x + 1\n" * 20]
  tok = tokenizer_lib.load(tokenizer_lib.train(texts, str(tmp_path / "tok.model"), 320))
  assert tok.special_id(mlm.MASK_PIECE) == mlm.MASK_ID
  assert max(tok.special_id(p) for p in tokenizer_lib.RESERVED) == mlm.FIRST_TEXT_ID - 1
  assert min(tok.encode(texts[0] + texts[1] + " ünïcode")) >= mlm.FIRST_TEXT_ID


def _trainer_config(objective="mlm", causal=False):
  c = configs.load("tiny")
  c.model.update(dict(_model_config(causal)))
  c.train.update(batch_size=4, seq_len=16, lr=1e-2, warmup_steps=1, objective=objective, z_loss=0.0)
  c.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  return c


def test_step_loss_counts_only_selected_positions():
  c = _trainer_config()
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]), step_lib.FAST_COMPILE)
  batch = step_lib.synthetic_batch(c, 0)
  batch["inputs"] = np.maximum(batch["inputs"], mlm.FIRST_TEXT_ID)
  state = trainer.init()
  params = jax.device_get(state["params"])
  key = jax.random.fold_in(state["rng"], 0)
  prepared = jax.device_get(trainer.objective.prepare({k: jnp.asarray(v) for k, v in batch.items()}, key))
  sel = prepared["loss_mask"] > 0
  assert sel.sum() > 0 and (sel <= (batch["segment_ids"] > 0)).all()
  assert (prepared["targets"] == batch["inputs"]).all()
  # Reference: the encoder's log-softmax at the selected positions of the corrupted batch (NumPy mean).
  m = nnx.merge(trainer._graphdef, params)
  logits = np.asarray(nnx.jit(lambda m, *a: m(*a))(m, *(jnp.asarray(x) for x in (
      prepared["inputs"], batch["segment_ids"], batch["positions"]))), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, batch["inputs"][..., None].astype(np.int64), -1)[..., 0]
  hits = logits.argmax(-1) == batch["inputs"]
  state, metrics = trainer.step_fn(state, trainer.batch_to_device(batch))
  assert float(metrics["tokens"]) == sel.sum()
  assert float(metrics["loss"]) == pytest.approx(nll[sel].mean(), rel=1e-5)
  assert float(metrics["masked_accuracy"]) == pytest.approx(hits[sel].mean(), abs=1e-6)
  ev = jax.device_get(trainer.eval_fn(state, trainer.batch_to_device(batch)))
  assert float(ev["tokens"]) > 0 and float(ev["correct"]) <= float(ev["tokens"])


@pytest.mark.parametrize("objective,causal", [("mlm", True), ("lm", False)])
def test_objective_and_attention_direction_must_agree(objective, causal):
  c = _trainer_config(objective, causal)
  with pytest.raises(ValueError, match="model.causal"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]))
