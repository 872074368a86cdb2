"""Optimizer (clipping, AdamW, decay mask), schedules and the loss, against independent references."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import configs
from train.core import loss as loss_lib
from train.core import optimizer as opt_lib


def _train_cfg(**kw):
  t = configs.load("tiny").train
  t.update(lr=1e-3, steps=100, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
  t.update(**kw)
  return t


@pytest.mark.parametrize("step", [0, 4, 9, 10, 37, 55, 80, 99, 150])
def test_schedule_values_match_formulas(step):
  peak, W, T, m = 1e-3, 10, 100, 0.1
  warm = min(1.0, (step + 1) / W)
  p = min(max((step - W) / (T - W), 0.0), 1.0)
  cosine = peak * warm if step < W else peak * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)))
  decay_start = T - 20
  q = min(max((step - decay_start) / 20, 0.0), 1.0)
  wsd = peak * warm if step < W else peak * (1 - (1 - m) * q)
  expected = {"cosine": cosine, "wsd": wsd, "constant": peak * warm}
  for kind, value in expected.items():
    got = float(opt_lib.schedule(_train_cfg(schedule=kind))(step))
    assert got == pytest.approx(value, rel=1e-5, abs=1e-12), (kind, step)


def test_schedule_rejects_unknown_kind():
  with pytest.raises(ValueError, match="config.train.schedule='linear'"):
    opt_lib.schedule(_train_cfg(schedule="linear"))


def _numpy_adamw(params, grads_per_step, lrs, t):
  """Textbook AdamW with global-norm clipping and a decay mask (no 'norm'/'embedding' decay), in float64."""
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(x) for k, x in params.items()}
  for i, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
    norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))
    scale = min(1.0, t.clip_norm / norm)
    for k in params:
      g = np.asarray(grads[k], np.float64) * scale
      m[k] = t.b1 * m[k] + (1 - t.b1) * g
      v[k] = t.b2 * v[k] + (1 - t.b2) * g * g
      update = (m[k] / (1 - t.b1 ** i)) / (np.sqrt(v[k] / (1 - t.b2 ** i)) + t.eps)
      if not any(s in k for s in t.decay_exclude):
        update = update + t.weight_decay * params[k]
      params[k] = params[k] - lr * update
  return params


def test_adamw_with_clipping_and_mask_matches_textbook():
  t = _train_cfg(clip_norm=1.0, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8,
                 decay_exclude=("norm", "bias", "embedding"))
  rng = np.random.default_rng(0)
  params = {"layers/mlp/up": rng.normal(size=(4, 3)).astype(np.float32),
            "final_norm/scale": rng.normal(size=(3,)).astype(np.float32),
            "embed/embedding": rng.normal(size=(5, 3)).astype(np.float32),
            "unembed": rng.normal(size=(3, 5)).astype(np.float32)}
  # Step norms ~5 (clipped), ~0.1 (not clipped), ~20 (clipped).
  grads = [{k: (s * rng.normal(size=p.shape) / math.sqrt(sum(x.size for x in params.values()))).astype(np.float32)
            for k, p in params.items()} for s in (5.0, 0.1, 20.0)]
  lrs = [1e-2, 3e-2, 2e-2]
  tx = opt_lib.make(t)
  p = jax.tree.map(jnp.asarray, params)
  state = tx.init(p)
  @jax.jit
  def step(g, state, p, lr):
    updates, state = tx.update(g, state, p)
    return opt_lib.apply_lr(p, updates, lr), state
  for g, lr in zip(grads, lrs):
    p, state = step(g, state, p, jnp.float32(lr))
  expected = _numpy_adamw(params, grads, lrs, t)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), expected[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_clipping_caps_global_norm():
  # Clipping at c must act exactly like feeding the unclipped optimizer gradients rescaled to norm min(|g|, c).
  clipped_tx = opt_lib.make(_train_cfg(clip_norm=0.5, weight_decay=0.0))
  plain_tx = opt_lib.make(_train_cfg(clip_norm=0.0, weight_decay=0.0))
  rng = np.random.default_rng(3)
  params = {"w": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}
  steps = [{"w": jnp.asarray(rng.normal(size=(6,)), jnp.float32) * s} for s in (10.0, 0.01, 3.0)]
  capped = [jax.tree.map(lambda g: g * min(1.0, 0.5 / float(optax.tree.norm(grads))), grads) for grads in steps]
  assert [float(optax.tree.norm(g)) for g in capped] == pytest.approx([0.5, float(optax.tree.norm(steps[1])), 0.5])
  sa, sb, sc = clipped_tx.init(params), plain_tx.init(params), plain_tx.init(params)
  for raw, cap in zip(steps, capped):
    ua, sa = clipped_tx.update(raw, sa, params)
    ub, sb = plain_tx.update(cap, sb, params)
    uc, sc = plain_tx.update(raw, sc, params)
    np.testing.assert_allclose(ua["w"], ub["w"], rtol=1e-5, atol=1e-7)
  assert not np.allclose(ua["w"], uc["w"], rtol=1e-3)  # without clipping the history differs


def test_decay_mask_leaves_excluded_parameters_undecayed():
  t = _train_cfg(weight_decay=0.5, clip_norm=0.0)
  params = {"layers": {"attn_norm": {"scale": jnp.ones(3)}, "mlp": {"up": jnp.ones((2, 3))}},
            "embed": {"embedding": jnp.ones((4, 3))}, "unembed": jnp.ones((3, 4)),
            "q_bias": jnp.ones(3)}
  mask = opt_lib.decay_mask(params, t.decay_exclude)
  assert mask == {"layers": {"attn_norm": {"scale": False}, "mlp": {"up": True}},
                  "embed": {"embedding": False}, "unembed": True, "q_bias": False}
  tx = opt_lib.make(t)

  @jax.jit
  def step(params):
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return opt_lib.apply_lr(params, updates, jnp.float32(0.1))

  new = step(params)
  # Zero gradients: only decay moves a parameter, by lr * wd * p = 0.05.
  np.testing.assert_allclose(new["layers"]["mlp"]["up"], 0.95, rtol=1e-6)
  np.testing.assert_allclose(new["unembed"], 0.95, rtol=1e-6)
  for excluded in (new["layers"]["attn_norm"]["scale"], new["embed"]["embedding"], new["q_bias"]):
    np.testing.assert_array_equal(excluded, 1.0)


def test_cross_entropy_matches_torch_under_mask():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
  mask = (rng.random((2, 5)) > 0.3).astype(np.float32)
  ce, z = loss_lib.mean_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), 1e-2)
  per_token = torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, 7),
                                                torch.tensor(targets).reshape(-1).long(), reduction="none")
  m = torch.tensor(mask).reshape(-1)
  expected_ce = float((per_token * m).sum() / m.sum())
  logz = torch.logsumexp(torch.tensor(logits).reshape(-1, 7), -1)
  expected_z = float(1e-2 * (logz ** 2 * m).sum() / m.sum())
  assert float(ce) == pytest.approx(expected_ce, rel=1e-6)
  assert float(z) == pytest.approx(expected_z, rel=1e-6)


def test_z_loss_gradient_matches_finite_differences():
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(2, 3, 5)).astype(np.float32))
  targets = jnp.asarray(rng.integers(0, 5, size=(2, 3)).astype(np.int32))
  mask = jnp.asarray(np.array([[1, 1, 0], [1, 0, 1]], np.float32))
  z_only = jax.jit(lambda x: loss_lib.loss_sums(x, targets, mask, 0.3)["z"])
  grad = np.asarray(jax.grad(z_only)(logits))
  h = 1e-2
  fd = np.zeros_like(grad)
  for idx in np.ndindex(*logits.shape):
    e = np.zeros(logits.shape, np.float32)
    e[idx] = h
    fd[idx] = (float(z_only(logits + e)) - float(z_only(logits - e))) / (2 * h)
  np.testing.assert_allclose(grad, fd, rtol=2e-3, atol=2e-4)
  assert np.abs(grad[0, 2]).max() == 0.0  # masked-out token: no gradient
