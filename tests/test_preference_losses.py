"""Preference losses against NumPy formulas, and DPO's closed-form optimum on a one-step bandit.

The bandit: one prompt, K single-token answers with known rewards r and a reference policy pi_ref. Every pair of
answers appears; with Bradley-Terry soft labels p_ij = sigmoid(r_i - r_j) the expected DPO loss is minimised by
pi* = pi_ref exp(r / beta) / Z (Rafailov et al. 2023, eq. 4). Optimising the tabular policy's logits must reach
pi* within 1e-2 in total variation (exact expected loss), and within 0.05 from sampled hard-label pairs fed
through the dpo objective itself.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import configs
from train.objectives import dpo
from train.objectives import reward

BETA = 0.5
REWARDS = np.array([1.0, 0.4, 0.0, -0.7])


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
def test_dpo_losses_equal_numpy(loss_type, smoothing):
  rng = np.random.default_rng(0)
  pc, pr, rc, rr = (rng.normal(-20, 5, size=64) for _ in range(4))
  beta = 0.3
  h = (pc - rc) - (pr - rr)
  log_sigmoid = lambda x: -np.log1p(np.exp(-x))
  want = {"sigmoid": -(1 - smoothing) * log_sigmoid(beta * h) - smoothing * log_sigmoid(-beta * h),
          "ipo": (h - 1 / (2 * beta)) ** 2, "hinge": np.maximum(0.0, 1 - beta * h)}[loss_type]
  got = dpo.dpo_losses(*(jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)), beta, loss_type, smoothing)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_dpo_loss_is_ln2_when_policy_equals_reference():
  logp = jnp.asarray(np.random.default_rng(1).normal(-30, 8, size=(2, 16)), jnp.float32)
  got = dpo.dpo_losses(logp[0], logp[1], logp[0], logp[1], 0.1)
  np.testing.assert_array_equal(np.asarray(got), np.float32(math.log(2)))


def test_bradley_terry_and_token_kl_equal_numpy():
  rng = np.random.default_rng(2)
  rc, rr, m = rng.normal(size=32), rng.normal(size=32), rng.uniform(0, 1, size=32)
  np.testing.assert_allclose(np.asarray(reward.bradley_terry(*(jnp.asarray(x, jnp.float32) for x in (rc, rr, m)))),
                             -np.log(1 / (1 + np.exp(-(rc - rr - m)))), rtol=1e-5)
  a, b = rng.normal(size=(2, 3, 7)), rng.normal(size=(2, 3, 7))
  p, q = np.exp(a) / np.exp(a).sum(-1, keepdims=True), np.exp(b) / np.exp(b).sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(dpo.token_kl(jnp.asarray(a), jnp.asarray(b))),
                             (p * np.log(p / q)).sum(-1), rtol=1e-5)


def _optimum(reference_logits):
  pi = np.exp(reference_logits - reference_logits.max()) * np.exp(REWARDS / BETA)
  return pi / pi.sum()


def _minimise(loss_fn, theta, steps=3000, lr=0.05):
  tx = optax.adam(lr)

  @jax.jit
  def run(theta):
    def body(carry, _):
      theta, opt = carry
      grads = jax.grad(loss_fn)(theta)
      updates, opt = tx.update(grads, opt)
      return (optax.apply_updates(theta, updates), opt), None
    return jax.lax.scan(body, (theta, tx.init(theta)), None, length=steps)[0][0]

  return run(theta)


def _tv(theta, want):
  pi = np.asarray(jax.nn.softmax(theta))
  return 0.5 * np.abs(pi - want).sum()


def test_dpo_reaches_the_closed_form_optimum_with_soft_labels():
  """Exact expected loss: every ordered pair (i, j), i < j, chosen i with soft label p_ij (label smoothing
  1 - p_ij turns the sigmoid loss into the cross-entropy against p_ij)."""
  ref = np.random.default_rng(3).normal(size=len(REWARDS))
  i, j = np.triu_indices(len(REWARDS), k=1)
  p = 1 / (1 + np.exp(-(REWARDS[i] - REWARDS[j])))
  logq = jax.nn.log_softmax(jnp.asarray(ref, jnp.float32))

  def expected_loss(theta):
    logpi = jax.nn.log_softmax(theta)
    return jnp.mean(dpo.dpo_losses(logpi[i], logpi[j], logq[i], logq[j], BETA, "sigmoid", jnp.asarray(1 - p)))

  theta = _minimise(expected_loss, jnp.asarray(ref, jnp.float32))
  assert _tv(theta, _optimum(ref)) < 1e-2


class _Tabular:
  """A one-step policy over a vocabulary: the same logits theta [V] at every position of every row."""

  def __init__(self, theta_V):
    self.theta_V = theta_V

  def __call__(self, tokens_BL, segment_ids_BL=None, positions_BL=None, *, return_aux=False):
    logits_BLV = jnp.broadcast_to(self.theta_V, (*tokens_BL.shape, self.theta_V.shape[0]))
    return (logits_BLV, {}) if return_aux else logits_BLV


def test_dpo_objective_reaches_the_optimum_from_sampled_hard_labels():
  """Pairs of answers (tokens 1..K after a prompt token 0) drawn uniformly, the winner drawn from Bradley-Terry
  with the known rewards, go through train.objectives.dpo (sequence log-probs over the completion token only)."""
  K, n = len(REWARDS), 12_000
  rng = np.random.default_rng(4)
  ref = np.concatenate([[0.0], rng.normal(size=K)])  # token 0 is the prompt; its logit does not matter
  a, b = (rng.integers(0, K, size=4 * n) for _ in range(2))
  keep = np.flatnonzero(a != b)[:n]
  a, b = a[keep], b[keep]
  a_wins = rng.uniform(size=n) < 1 / (1 + np.exp(-(REWARDS[a] - REWARDS[b])))
  winner, loser = np.where(a_wins, a, b) + 1, np.where(a_wins, b, a) + 1
  ones = np.ones((n, 2), np.int32)
  batch = {"margin": np.zeros((n, 2), np.float32)}
  for side, answer in (("chosen", winner), ("rejected", loser)):
    batch.update({f"{side}_inputs": np.stack([np.zeros(n), answer], 1).astype(np.int32),
                  f"{side}_targets": np.stack([answer, np.zeros(n)], 1).astype(np.int32),
                  f"{side}_segment_ids": ones, f"{side}_positions": np.tile([0, 1], (n, 1)).astype(np.int32),
                  f"{side}_loss_mask": np.tile([1.0, 0.0], (n, 1)).astype(np.float32)})
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  objective = dpo.DirectPreference(configs.load("tiny", **{"train.objective": "dpo", "train.dpo_beta": BETA}))
  reference = _Tabular(jnp.asarray(ref, jnp.float32))

  def loss(theta):
    sums = objective.sums(_Tabular(theta), batch, {}, {"reference": reference})
    return objective.loss(sums) / objective.normalizer(batch)

  theta = _minimise(loss, jnp.asarray(ref, jnp.float32), steps=1500)
  assert _tv(theta[1:], _optimum(ref[1:])) < 0.05


def test_rpo_adds_the_chosen_answers_mean_token_nll():
  """train.dpo_rpo_alpha = a adds a x (1/N) sum_pairs -log pi(chosen) / |chosen| (Pang et al. 2024) to the DPO
  loss: the objective's loss with a = 0.7 minus its loss with a = 0 equals that term from a NumPy log-softmax over
  the tabular policy's logits, with chosen completions of 1 and 2 tokens."""
  rng = np.random.default_rng(7)
  V, n = 6, 5
  theta, ref = rng.normal(size=V), rng.normal(size=V)
  lengths = np.array([1, 2, 1, 2, 2])
  batch = {"margin": np.zeros((n, 3), np.float32)}
  for side in ("chosen", "rejected"):
    targets = rng.integers(1, V, size=(n, 3)).astype(np.int32)
    mask = (np.arange(3)[None, :] < lengths[:, None]).astype(np.float32)
    batch.update({f"{side}_inputs": np.zeros((n, 3), np.int32), f"{side}_targets": targets,
                  f"{side}_segment_ids": np.ones((n, 3), np.int32),
                  f"{side}_positions": np.tile(np.arange(3), (n, 1)).astype(np.int32), f"{side}_loss_mask": mask})
  logp = theta - np.log(np.sum(np.exp(theta)))
  chosen_logp = np.sum(logp[batch["chosen_targets"]] * batch["chosen_loss_mask"], axis=1)
  want = 0.7 * np.mean(-chosen_logp / lengths)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  losses = {}
  for alpha in (0.0, 0.7):
    objective = dpo.DirectPreference(configs.load("tiny", **{"train.objective": "dpo", "train.dpo_rpo_alpha": alpha}))
    sums = objective.sums(_Tabular(jnp.asarray(theta, jnp.float32)), batch, {},
                          {"reference": _Tabular(jnp.asarray(ref, jnp.float32))})
    losses[alpha] = float(objective.loss(sums) / objective.normalizer(batch))
    metrics = objective.metrics(sums, objective.normalizer(batch))
  np.testing.assert_allclose(losses[0.7] - losses[0.0], want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["nll"]), want / 0.7, rtol=1e-5)
