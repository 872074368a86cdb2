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
  everything = rewards[valid]
  for scale in ("group", "batch", "none"):
    got = policy.group_advantages(np.where(valid, rewards, np.nan), valid, scale)
    for n in range(4):
      r = rewards[n][valid[n]]
      std = {"group": r.std(ddof=1), "batch": everything.std(ddof=1), "none": None}[scale]
      expect = (r - r.mean()) / (std + 1e-4) if std is not None else r - r.mean()
      np.testing.assert_allclose(got[n][valid[n]], expect, rtol=1e-5, atol=1e-6)
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
      "temperature": 0.7, "clip": 0.2, "clip_high": 0.0, "value_clip": 0.3, "vf_coef": 0.5, "ent_coef": 0.01,
      "kl_coef": 0.1, "ptx_coef": 0.0, "loss": "dapo", "max_new_tokens": L}})
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


def _numpy_grpo_family(config, batch, emb, w, w_ref):
  """(loss, dloss/dW) of rl.loss written out in NumPy (TRL's trl/trainer/grpo_trainer.py `_compute_loss`): the
  per-token (or, for gspo, per-sequence) clipped term plus beta k3, aggregated per rl.loss; the gradient by the
  chain rule through log_softmax(x W / T)."""
  r, m = config.rl, batch["loss_mask"]
  x = emb[batch["inputs"]]
  probs = np.exp(_log_softmax(x @ w / r.temperature))
  logp = np.log(np.take_along_axis(probs, batch["targets"][..., None], -1)[..., 0])
  ref = np.take_along_axis(_log_softmax(x @ w_ref / r.temperature), batch["targets"][..., None], -1)[..., 0]
  lo, hi = 1 - r.clip, 1 + (r.clip_high or r.clip)
  a, length = batch["advantages"], np.maximum(m.sum(1), 1)
  if r.loss == "gspo":  # one ratio per sequence: exp of the mean token log-ratio
    s = np.exp(((logp - batch["old_logp"]) * m).sum(1) / length)[:, None]
    a_seq = (a * m).sum(1, keepdims=True) / length[:, None]
    pg = -np.minimum(s * a_seq, np.clip(s, lo, hi) * a_seq) * np.ones_like(m)
    dpg = np.where(s * a_seq <= np.clip(s, lo, hi) * a_seq, -s * a_seq, 0.0) * m / length[:, None]
  else:
    ratio = np.exp(logp - batch["old_logp"])
    pg = -np.minimum(ratio * a, np.clip(ratio, lo, hi) * a)
    dpg = np.where(ratio * a <= np.clip(ratio, lo, hi) * a, -ratio * a, 0.0)
  tis = batch.get("tis_weight", np.ones_like(m))  # truncated importance weights multiply the clipped term
  if r.loss == "gspo":  # the sequence term depends on every token: d/dlogp_t carries the row's mean weight
    pg, dpg = pg * tis, dpg * ((tis * m).sum(1, keepdims=True) / length[:, None])
  else:
    pg, dpg = pg * tis, dpg * tis
  per_token = pg + r.kl_coef * (np.exp(ref - logp) - (ref - logp) - 1)
  dkl = r.kl_coef * (1 - np.exp(ref - logp))
  rows, tokens = m.shape[0], m.sum()
  if r.loss in ("grpo", "gspo"):
    weight = m / length[:, None] / rows
    loss = ((per_token * m).sum(1) / length).mean()
    dpg_w = dpg / rows if r.loss == "gspo" else dpg * weight  # gspo's dpg already carries 1 / |y|
  else:
    norm = tokens if r.loss == "dapo" else rows * r.max_new_tokens
    weight, loss, dpg_w = m / norm, (per_token * m).sum() / norm, dpg * m / norm
  dlogp = dpg_w + dkl * weight
  onehot = np.eye(w.shape[1])[batch["targets"]]
  grad = np.einsum("bld,blv->dv", x, dlogp[..., None] * (onehot - probs)) / r.temperature
  return loss, grad


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_grpo_family_loss_and_gradient_equal_numpy(setup, loss):
  """Every rl.loss with clip-higher (eps_low 0.2, eps_high 0.28) and truncated importance weights (cap 1.3) on one
  batch: the objective's loss and its gradient equal the formulas in NumPy; advantages constant per row as the
  loop writes them; the TIS weights are the capped ratio of the learner's to the sampler's probabilities."""
  config, batch, emb, w, w_ref, _ = setup
  cfg = ml_collections.ConfigDict(config.to_dict())
  cfg.rl.loss, cfg.rl.clip_high = loss, 0.28
  rng = np.random.default_rng(11)
  rows = {k: v for k, v in batch.items() if k not in ("returns", "old_values")}
  rows["advantages"] = (rng.normal(size=(len(batch["inputs"]), 1)) * batch["loss_mask"]).astype(np.float32)
  logp = np.take_along_axis(_log_softmax(emb[rows["inputs"]] @ w / cfg.rl.temperature), rows["targets"][..., None],
                            -1)[..., 0]
  rows["old_logp"] = (logp + rng.normal(scale=0.3, size=logp.shape)).astype(np.float32)  # ratios around 1
  sampler = rows["old_logp"] + rng.normal(scale=0.5, size=logp.shape)  # an asynchronous sampler's log-probs
  rows["tis_weight"] = policy.tis_weights(rows["old_logp"], sampler, rows["loss_mask"], 1.3)
  expect_w = np.where(rows["loss_mask"] > 0, np.minimum(np.exp(rows["old_logp"] - sampler), 1.3), 1.0)
  np.testing.assert_allclose(rows["tis_weight"], expect_w, rtol=1e-6)
  assert (expect_w[rows["loss_mask"] > 0] == 1.3).any() and (expect_w < 1).any()
  ratio, m = np.exp(logp - rows["old_logp"]), rows["loss_mask"] > 0
  assert (ratio[m] > 1.28).any() and (ratio[m] < 0.8).any() and ((ratio[m] > 0.8) & (ratio[m] < 1.2)).any()
  expect_loss, expect_grad = _numpy_grpo_family(cfg, rows, emb, w, w_ref)
  objective = grpo.GroupRelativePolicyOptimization(cfg)
  jbatch = jax.tree.map(jnp.asarray, rows)
  reference = {"reference": _Linear(jnp.asarray(emb), jnp.asarray(w_ref))}

  def f(w_):
    return objective.loss(objective.sums(_Linear(jnp.asarray(emb), w_), jbatch, {}, reference)) / (
        objective.normalizer(jbatch))

  got_loss, got_grad = jax.value_and_grad(f)(jnp.asarray(w))
  np.testing.assert_allclose(float(got_loss), expect_loss, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(got_grad), expect_grad, rtol=1e-3, atol=1e-6)


def test_overlong_punishment_and_zero_variance_groups():
  """DAPO eq. 13 at L_max = 100, L_cache = 20 (TRL's example: 90 tokens -> -0.5), and the groups dynamic sampling
  drops: all valid rewards equal, or fewer than two valid."""
  got = policy.overlong_penalty([10, 80, 90, 100, 101], 100, 20)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])
  assert not policy.overlong_penalty([90], 100, 0).any()
  rewards = np.array([[1, 1, 1], [0, 1, 0], [np.nan, 2, 2], [np.nan, 3, np.nan], [0.5, 0.5, 0.25]])
  valid = np.isfinite(rewards)
  expect = [len(set(r[v])) < 2 for r, v in zip(rewards, valid)]
  np.testing.assert_array_equal(policy.zero_variance_groups(rewards, valid), expect)


def _stub_session(rounds, G=3, need=4):
  """A train.rl Session whose sampler is replaced: prompt "p<i>"'s group of G rewards is all equal when i % 3 == 0
  (no signal), else 0, 1, 2, ...; everything else is the real class."""
  from train.rl import rollouts
  session = object.__new__(rollouts.Session)
  session.config = ml_collections.ConfigDict({"rl": {"samples_per_prompt": G, "prompts_per_iteration": need,
                                                     "dynamic_sampling_rounds": rounds, "seed": 0}})
  session.prompts = {"train": [[{"role": "user", "content": f"p{i}"}] for i in range(60)]}

  def sample(conversations, repeats, seed):
    del seed
    ids = [int(c[-1]["content"][1:]) for c in conversations]
    raw = np.array([0.5 if i % 3 == 0 else float(k) for i in ids for k in range(repeats)])
    n = len(raw)
    return {"prompt_ids": [[i] for i in ids for _ in range(repeats)], "tokens": [[i, k] for i in ids
                                                                                  for k in range(repeats)],
            "logprobs": [[0.0]] * n, "raw": raw, "shaped": raw, "valid": np.ones(n, bool),
            "ended": np.ones(n, bool), "lengths": np.full(n, 2.0)}

  session.sample = sample
  return session, sample


@pytest.mark.parametrize("rounds", [1, 2, 8])
def test_dynamic_sampling_keeps_exactly_the_groups_with_a_signal(rounds):
  """Session._dynamic_sampling (DAPO): the groups kept are, in sampling order, exactly the ones whose rewards
  differ, until prompts_per_iteration are kept; rounds stop there or at rl.dynamic_sampling_rounds, and a batch
  still short is completed with zero-variance groups, counted as filled_groups."""
  G, need = 3, 4
  session, sample = _stub_session(rounds, G, need)
  first = sample([[{"role": "user", "content": f"p{i}"}] for i in (0, 3, 4, 6)], G, 0)  # one group with a signal
  out, stats = session._dynamic_sampling(first, iteration=1)
  prompts = [ids[0] for ids in out["prompt_ids"][::G]]
  assert len(out["raw"]) == need * G and all(len(v) == need * G for v in out.values())
  signal = [p for p in prompts if p % 3]
  # every kept prompt's group is its own G samples, in order
  for g, p in enumerate(prompts):
    assert out["tokens"][g * G:(g + 1) * G] == [[p, k] for k in range(G)]
  # the signal groups come first and include the first round's only one (prompt 4); then fillers with none
  assert prompts[:len(signal)] == signal and prompts[0] == 4 and all(p % 3 == 0 for p in prompts[len(signal):])
  assert stats["filled_groups"] == need - len(signal)
  assert stats["sampling_rounds"] <= rounds
  if stats["sampling_rounds"] < rounds:
    assert stats["filled_groups"] == 0
  if rounds == 1:
    assert prompts == [4, 0, 3, 6]


def test_ppo_token_rewards_put_the_score_on_the_last_completion_token():
  rng = np.random.default_rng(12)
  _, kl, mask = _rows(rng, B=4, L=9)
  mask[2] = 0  # a dropped rollout: no reward anywhere
  scores = np.array([1.0, -2.0, 5.0, 0.5])
  got = np.asarray(policy.ppo_token_rewards(scores, kl, mask, 0.3))
  for b in range(4):
    expect = -0.3 * kl[b] * mask[b]
    if mask[b].any():
      expect[np.flatnonzero(mask[b])[-1]] += scores[b]
    np.testing.assert_allclose(got[b], expect, rtol=1e-6, atol=1e-7)
