"""PPO and GRPO on a one-step bandit with a known optimum, using the objectives' own loss functions.

K answers with rewards r_k; the policy is a softmax over K logits, sampled in batches. PPO with the per-token
KL penalty in the reward (policy.ppo_token_rewards, the loop's own shaping) must reach the KL-regularised optimum
pi*(k) = pi_ref(k) exp(r_k / beta) / Z; GRPO without KL must put its mass on the best answer. Total variation
<= 0.05 in both cases.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.objectives import policy

K = 5
REWARDS = jnp.array([0.1, 0.9, 0.4, 1.0, 0.0])
REF_LOGITS = jnp.array([1.0, 0.5, 0.0, -0.5, 0.2])


def _train(loss_fn, advantages_fn, iterations, samples, epochs=2, lr=0.05, seed=0):
  """Generic rollout -> clipped-update loop on (policy logits, value); returns the final policy."""
  params = {"logits": REF_LOGITS, "value": jnp.zeros(())}
  tx = optax.chain(optax.adam(optax.cosine_decay_schedule(lr, iterations * epochs, alpha=0.02)))
  opt = tx.init(params)

  def iteration(carry, key):
    params, opt = carry
    actions = jax.random.categorical(key, params["logits"], shape=(samples,))
    old_logp = jax.nn.log_softmax(params["logits"])[actions]
    adv, returns = advantages_fn(actions, old_logp, params["value"])

    def epoch(carry, _):
      params, opt = carry
      grads = jax.grad(loss_fn)(params, actions, old_logp, adv, returns)
      updates, opt = tx.update(grads, opt, params)
      return (optax.apply_updates(params, updates), opt), None

    return jax.lax.scan(epoch, (params, opt), None, length=epochs)[0], None

  keys = jax.random.split(jax.random.PRNGKey(seed), iterations)
  (params, _), _ = jax.jit(lambda c, k: jax.lax.scan(iteration, c, k))((params, opt), keys)
  return np.asarray(jax.nn.softmax(params["logits"]))


def _policy_loss(params, actions, old_logp, adv, clip=0.2):
  logp = jax.nn.log_softmax(params["logits"])[actions]
  return jnp.mean(policy.clipped_policy_loss(logp[None], old_logp[None], adv[None], clip)[0])


def test_ppo_with_kl_penalty_reaches_the_regularised_optimum():
  beta = 0.25
  ref_logp_K = jax.nn.log_softmax(REF_LOGITS)

  def advantages(actions, old_logp, value):
    # One token per episode: the loop's per-token rewards (r - beta * (log pi - log pi_ref) at the final, only,
    # token), GAE over it.
    mask = jnp.ones((actions.shape[0], 1))
    shaped = policy.ppo_token_rewards(REWARDS[actions], (old_logp - ref_logp_K[actions])[:, None], mask, beta)
    adv, returns = policy.gae(shaped, jnp.broadcast_to(value, (actions.shape[0], 1)), mask, 1.0, 0.95)
    adv = adv[:, 0]
    return (adv - adv.mean()) / (adv.std() + 1e-8), returns[:, 0]

  def loss(params, actions, old_logp, adv, returns):
    values = jnp.broadcast_to(params["value"], returns.shape)
    value_loss, _ = policy.clipped_value_loss(values, jax.lax.stop_gradient(values), returns, 10.0)
    return _policy_loss(params, actions, old_logp, adv) + 0.5 * jnp.mean(value_loss)

  pi = _train(loss, advantages, iterations=150, samples=1024)
  target = np.asarray(jax.nn.softmax(REF_LOGITS + REWARDS / beta))
  assert 0.5 * np.abs(pi - target).sum() <= 0.05, (pi, target)
  # and it is not simply the reference or the greedy answer
  assert 0.5 * np.abs(np.asarray(jax.nn.softmax(REF_LOGITS)) - target).sum() > 0.3
  assert target.max() < 0.9


def test_grpo_without_kl_reaches_the_best_answer():
  groups, G = 128, 8

  def advantages(actions, old_logp, value):
    del old_logp, value
    rewards = REWARDS[actions].reshape(groups, G)
    adv = policy.group_advantages(rewards, jnp.ones(rewards.shape, bool))
    return adv.reshape(-1), jnp.zeros(actions.shape)

  def loss(params, actions, old_logp, adv, returns):
    del returns
    return _policy_loss(params, actions, old_logp, adv)

  pi = _train(loss, advantages, iterations=150, samples=groups * G)
  best = np.eye(K)[int(jnp.argmax(REWARDS))]
  assert 0.5 * np.abs(pi - best).sum() <= 0.05, pi
