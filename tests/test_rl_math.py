"""The RL math (train/objectives/policy.py, ppo.py, grpo.py) against plain NumPy references on random inputs."""
import ml_collections
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from train.objectives import grpo
from train.objectives import policy
from train.objectives import ppo


def _rows(rng, B=5, L=12):
  """Random per-token arrays and a completion mask: row b's completion spans [start_b, end_b)."""
  mask = np.zeros((B, L), np.float32)
  for b in range(B):
    start = int(rng.integers(0, L - 2))
    mask[b, start:int(rng.integers(start + 1, L + 1))] = 1
  return rng.normal(size=(B, L)).astype(np.float32), rng.normal(size=(B, L)).astype(np.float32), mask


def test_gae_equals_a_plain_loop():
  rng = np.random.default_rng(0)
  rewards, values, mask = _rows(rng)
  gamma, lam = 0.97, 0.9
  adv, ret = policy.gae(rewards, values, mask, gamma, lam)
  for b in range(mask.shape[0]):
    steps = np.flatnonzero(mask[b])
    expect, running = np.zeros(mask.shape[1]), 0.0
    for i in reversed(range(len(steps))):
      t = steps[i]
      next_value = values[b, steps[i + 1]] if i + 1 < len(steps) else 0.0
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      running = delta + gamma * lam * running
      expect[t] = running
    np.testing.assert_allclose(adv[b], expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret[b], (expect + values[b]) * mask[b], rtol=1e-5, atol=1e-5)


def test_clipped_losses_and_kl_estimators_equal_numpy():
  rng = np.random.default_rng(1)
  logp, old, _ = _rows(rng)
  logp, old = -np.abs(logp), -np.abs(old)
  adv = rng.normal(size=logp.shape).astype(np.float32)
  clip = 0.2
  ratio = np.exp(logp - old)
  expect = np.array([[-min(r * a, np.clip(r, 1 - clip, 1 + clip) * a) for r, a in zip(rr, aa)]
                     for rr, aa in zip(ratio, adv)])
  got, clipped = policy.clipped_policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), clip)
  np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped) > 0, expect > -(ratio * adv) + 1e-9)

  values, old_values, returns = (rng.normal(size=logp.shape).astype(np.float32) for _ in range(3))
  vc = old_values + np.clip(values - old_values, -clip, clip)
  expect_v = 0.5 * np.maximum((values - returns) ** 2, (vc - returns) ** 2)
  got_v, _ = policy.clipped_value_loss(jnp.asarray(values), jnp.asarray(old_values), jnp.asarray(returns), clip)
  np.testing.assert_allclose(got_v, expect_v, rtol=1e-5, atol=1e-6)

  d = logp - old
  for kind, ref in (("k1", d), ("k2", 0.5 * d * d), ("k3", np.exp(-d) - 1 + d)):
    np.testing.assert_allclose(policy.kl_estimate(jnp.asarray(logp), jnp.asarray(old), kind), ref, rtol=1e-5,
                               atol=1e-6)


def test_kl_estimators_are_unbiased_on_a_categorical():
  """k1 and k3 average to the closed-form KL(p || q) over samples of p (k3 being never negative)."""
  rng = np.random.default_rng(2)
  p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
  exact = float(np.sum(p * np.log(p / q)))
  draws = rng.choice(6, size=400_000, p=p)
  for kind in ("k1", "k3"):
    est = np.asarray(policy.kl_estimate(jnp.log(p[draws]), jnp.log(q[draws]), kind))
    assert abs(est.mean() - exact) < 0.01 * max(exact, 0.1)
  assert np.asarray(policy.kl_estimate(jnp.log(p[draws]), jnp.log(q[draws]), "k3")).min() >= 0


def test_group_advantages_and_whitening_equal_numpy():
  rng = np.random.default_rng(3)
  rewards = rng.normal(size=(4, 6))
  valid = rng.random((4, 6)) > 0.2
  got = policy.group_advantages(rewards, valid)
  for n in range(4):
    r = rewards[n][valid[n]]
    np.testing.assert_allclose(got[n][valid[n]], (r - r.mean()) / (r.std() + 1e-4), rtol=1e-5)
    assert np.all(got[n][~valid[n]] == 0)
  x, _, mask = _rows(rng)
  m = mask > 0
  np.testing.assert_allclose(policy.whiten(x, mask)[m], (x[m] - x[m].mean()) / (x[m].std() + 1e-8), rtol=1e-5)


class _Linear:
  """A stand-in model: features = embedding lookup, logits = features @ W (enough for the objectives' sums)."""

  def __init__(self, emb, w):
    self.emb, self.w = emb, w

  def features(self, inputs, segment_ids=None, positions=None):
    return self.emb[inputs]

  def logits(self, x):
    return x @ self.w

  def __call__(self, inputs, segment_ids=None, positions=None):
    return self.logits(self.features(inputs))


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(4)
  V, D, B, L = 7, 5, 3, 6
  emb, w, w_ref = rng.normal(size=(V, D)), rng.normal(size=(D, V)), rng.normal(size=(D, V))
  inputs, targets = rng.integers(0, V, (B, L)), rng.integers(0, V, (B, L))
  _, _, mask = _rows(rng, B, L)
  batch = {"inputs": inputs, "targets": targets, "segment_ids": np.ones((B, L), np.int32),
           "positions": np.tile(np.arange(L), (B, 1)), "loss_mask": mask,
           **{k: rng.normal(size=(B, L)).astype(np.float32) for k in ("advantages", "returns", "old_values")},
           "old_logp": -rng.random((B, L)).astype(np.float32)}
  config = ml_collections.ConfigDict({"model": {"d_model": D}, "train": {"grad_accum": 1}, "rl": {
      "temperature": 0.7, "clip": 0.2, "value_clip": 0.3, "vf_coef": 0.5, "ent_coef": 0.01, "kl_coef": 0.1,
      "ptx_coef": 0.0}})
  extras = {"value_head": rng.normal(size=(D,)).astype(np.float32), "value_bias": np.array([0.3], np.float32)}
  return config, batch, emb, w, w_ref, extras


def _numpy_terms(config, batch, emb, w):
  r = config.rl
  x = emb[batch["inputs"]]
  logp_all = _log_softmax(x @ w / r.temperature)
  logp = np.take_along_axis(logp_all, batch["targets"][..., None], -1)[..., 0]
  ratio = np.exp(logp - batch["old_logp"])
  a = batch["advantages"]
  pg = -np.minimum(ratio * a, np.clip(ratio, 1 - r.clip, 1 + r.clip) * a)
  ent = -(np.exp(logp_all) * logp_all).sum(-1)
  return x, logp, pg, ent


def test_ppo_objective_loss_equals_numpy(setup):
  config, batch, emb, w, w_ref, extras = setup
  r, m = config.rl, batch["loss_mask"]
  x, logp, pg, ent = _numpy_terms(config, batch, emb, w)
  v = x @ extras["value_head"] + extras["value_bias"][0]
  vc = batch["old_values"] + np.clip(v - batch["old_values"], -r.value_clip, r.value_clip)
  vf = 0.5 * np.maximum((v - batch["returns"]) ** 2, (vc - batch["returns"]) ** 2)
  expect = ((pg + r.vf_coef * vf - r.ent_coef * ent) * m).sum() / m.sum()
  objective = ppo.ProximalPolicyOptimization(config)
  jbatch = jax.tree.map(jnp.asarray, batch)
  sums = objective.sums(_Linear(jnp.asarray(emb), jnp.asarray(w)), jbatch, extras, {})
  np.testing.assert_allclose(objective.loss(sums) / objective.normalizer(jbatch), expect, rtol=1e-4)
  scores = objective.eval_sums(_Linear(jnp.asarray(emb), jnp.asarray(w)), jbatch, extras,
                               {"reference": _Linear(jnp.asarray(emb), jnp.asarray(w_ref))})
  ref = np.take_along_axis(_log_softmax(x @ w_ref / r.temperature), batch["targets"][..., None], -1)[..., 0]
  np.testing.assert_allclose(scores["logp"], logp, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(scores["ref_logp"], ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(scores["values"], v, rtol=1e-4, atol=1e-5)


def test_grpo_objective_loss_equals_numpy(setup):
  config, batch, emb, w, w_ref, _ = setup
  r, m = config.rl, batch["loss_mask"]
  x, logp, pg, _ = _numpy_terms(config, batch, emb, w)
  ref = np.take_along_axis(_log_softmax(x @ w_ref / r.temperature), batch["targets"][..., None], -1)[..., 0]
  k3 = np.exp(ref - logp) - (ref - logp) - 1
  expect = ((pg + r.kl_coef * k3) * m).sum() / m.sum()
  objective = grpo.GroupRelativePolicyOptimization(config)
  jbatch = jax.tree.map(jnp.asarray, {k: v for k, v in batch.items() if k not in ("returns", "old_values")})
  sums = objective.sums(_Linear(jnp.asarray(emb), jnp.asarray(w)), jbatch, {},
                        {"reference": _Linear(jnp.asarray(emb), jnp.asarray(w_ref))})
  np.testing.assert_allclose(objective.loss(sums) / objective.normalizer(jbatch), expect, rtol=1e-4)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_ptx_rows_add_their_nll_at_temperature_one(setup, name):
  """rl.ptx_coef = 1.5 with SFT rows appended (loss_mask 0, ptx_mask 1 on their answer tokens): the loss is the
  rollout rows' loss plus 1.5 x the SFT tokens' summed -log softmax(logits) (temperature 1, not rl.temperature)
  over the rollout tokens T, and ptx_nll their mean; the rollout terms are unchanged by the extra rows."""
  config, batch, emb, w, w_ref, extras = setup
  rng = np.random.default_rng(9)
  B, L = batch["inputs"].shape
  sft = {"inputs": rng.integers(0, 7, (2, L)), "targets": rng.integers(0, 7, (2, L)),
         "ptx_mask": (rng.random((2, L)) < 0.6).astype(np.float32)}
  both = {k: np.concatenate([v, sft[k] if k in sft else np.zeros((2, L), v.dtype)])
          for k, v in batch.items()}
  both["segment_ids"][B:], both["positions"][B:] = 1, np.arange(L)
  both["ptx_mask"] = np.concatenate([np.zeros((B, L), np.float32), sft["ptx_mask"]])
  nll = -np.take_along_axis(_log_softmax(emb[sft["inputs"]] @ w), sft["targets"][..., None], -1)[..., 0]
  ptx = (nll * sft["ptx_mask"]).sum()
  losses = {}
  for coef, rows in ((0.0, batch), (1.5, both)):
    cfg = ml_collections.ConfigDict(config.to_dict())
    cfg.rl.ptx_coef = coef
    objective = ppo.ProximalPolicyOptimization(cfg) if name == "ppo" else grpo.GroupRelativePolicyOptimization(cfg)
    keep = {k: v for k, v in rows.items() if k in objective.batch_keys}
    jbatch = jax.tree.map(jnp.asarray, {**keep, **({"ptx_mask": np.zeros((B, L), np.float32)} if not coef else {})})
    sums = objective.sums(_Linear(jnp.asarray(emb), jnp.asarray(w)), jbatch, extras,
                          {"reference": _Linear(jnp.asarray(emb), jnp.asarray(w_ref))})
    losses[coef] = float(objective.loss(sums) / objective.normalizer(jbatch))
    if coef:
      metrics = objective.metrics(sums, objective.normalizer(jbatch))
  np.testing.assert_allclose(losses[1.5] - losses[0.0], 1.5 * ptx / batch["loss_mask"].sum(), rtol=1e-4)
  np.testing.assert_allclose(float(metrics["ptx_nll"]), ptx / sft["ptx_mask"].sum(), rtol=1e-4)
