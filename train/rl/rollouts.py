"""Rollouts of `python -m train.rl` and the updates on them: the `Session` of one run (train/rl/loop.py).

A Session samples completions from the policy with the shared sampler (model.generate.sample), scores them with
the run's Reward, builds the training rows (`rows`) of the algorithm's objective (PPO / GRPO advantages, or
best-of-N's kept answers) and trains rl.epochs passes on them. Every random draw of iteration i comes from seeds
derived from (rl.seed, stream, i) (`seed_for`), so a resumed run repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np

from parallel import sharding as sharding_lib
from train.objectives import policy
from train.rl import async_rollouts
from train.rl.rewards import reward_text

_ROLLOUT, _EPOCHS, _EVAL, _TIES, _PTX, _REFILL, _TURN = range(7)  # seed streams
PTX_POOL = 1024  # held-in conversations per family read for rl.ptx_coef's rows


def seed_for(base: int, stream: int, iteration: int, extra: int = 0) -> int:
  """A sampling / shuffling seed in [0, 2^31) for (rl.seed, stream, iteration, extra): independent streams."""
  return int(np.random.SeedSequence([base, stream, iteration, extra]).generate_state(1)[0] & 0x7FFFFFFF)


def rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], seq_len: int,
         masks: Sequence[Sequence[int]] | None = None) -> dict[str, np.ndarray]:
  """Prompt + completion rows of a training batch, each [N, seq_len], right-padded.

  inputs = sequence[:-1], targets = sequence[1:], segment 1 on real tokens (0 = padding), positions 0, 1, ...;
  loss_mask is 1 where the target is a completion token, and with `masks` (one 0/1 per completion token: a
  multi-turn episode's policy tokens 1, the environment's 0) where it is also marked 1.
  """
  batch = _empty_rows(len(prompts), seq_len)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = list(p) + list(c)
    loss_mask = np.zeros(len(seq) - 1, np.float32)
    loss_mask[len(p) - 1:] = 1.0 if masks is None else np.asarray(masks[i], np.float32)[:len(c)]
    _put_row(batch, i, seq[:-1], seq[1:], loss_mask)
  return batch


def _empty_rows(n: int, seq_len: int) -> dict[str, np.ndarray]:
  batch = {k: np.zeros((n, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  batch["loss_mask"] = np.zeros((n, seq_len), np.float32)
  return batch


def _put_row(batch, i: int, inputs, targets, loss_mask) -> None:
  """Row i of a batch from `_empty_rows`: one segment from position 0, right-padded."""
  m = len(inputs)
  batch["inputs"][i, :m], batch["targets"][i, :m], batch["loss_mask"][i, :m] = inputs, targets, loss_mask
  batch["segment_ids"][i, :m], batch["positions"][i, :m] = 1, np.arange(m)


def conversation_rows(template, conversations, seq_len: int, weight: float) -> dict[str, np.ndarray]:
  """Training rows [N, seq_len] of whole conversations, encoded as the SFT pipeline encodes them
  (data.chat.ChatEncoder: truncated at seq_len, loss on the assistant tokens), with loss_mask scaled by `weight`."""
  from data import chat as chat_lib  # pylint: disable=g-import-not-at-top
  encode = chat_lib.ChatEncoder(template, seq_len)
  batch = _empty_rows(len(conversations), seq_len)
  for i, messages in enumerate(conversations):
    row = encode(json.dumps({"messages": messages}), "rl.ptx_coef conversation")
    if row is not None:  # None: nothing left to learn from it (counted by the encoder), an empty row
      _put_row(batch, i, row["inputs"], row["targets"], weight * row["loss_mask"])
  return batch


def _scatter(values: Sequence[Sequence[float]], mask_BL: np.ndarray) -> np.ndarray:
  """Per-completion lists (e.g. the sampler's log-probs) placed on the masked positions of each row [N, L]."""
  out = np.zeros(mask_BL.shape, np.float32)
  for i, v in enumerate(values):
    where = np.flatnonzero(mask_BL[i])
    out[i, where] = np.asarray(v, np.float32)[:len(where)]
  return out


def _part_means(roll, prefix: str) -> dict[str, float]:
  """{PREFIXreward_<name>_mean} over the valid samples for each named part of the rewards (rewards.Reward.scored)."""
  valid = roll["valid"]
  return {f"{prefix}reward_{name}_mean": float(np.mean(values[valid])) if valid.any() else math.nan
          for name, values in roll["parts"].items()}


class Session:
  """One RL run's pieces: the Trainer and its state, tokenizer, template, prompts and reward (see `run`)."""

  def __init__(self, config, trainer, mesh, tokenizer, template, prompts, reward):
    self.config, self.trainer, self.mesh = config, trainer, mesh
    self.tokenizer, self.template, self.prompts, self.reward = tokenizer, template, prompts, reward
    self.stop_ids = tuple(template.stop_ids())
    self.state = None
    self.kl_coef = float(config.rl.kl_coef)
    self.bad_rewards = 0
    self.chat_items = None  # train.eval_generations' held-out chat prompts, read at the first evaluation
    self.ptx_pool = None  # rl.ptx_coef's held-in conversations, read at the first update
    self.env_factory = None  # rl.env's environment maker (train/rl/env.py), set by the loop
    self.worker = None  # rl.async_rollouts' rollout thread (train/rl/async_rollouts.py), set by the loop

  # ---- rollouts ---------------------------------------------------------------------------------------
  def sample(self, conversations, repeats: int, seed: int, policy=None, part: tuple[int, int] = (0, 1),
             count: bool = True) -> dict[str, Any]:
    """`repeats` completions of each conversation (rows prompt-major), scored: tokens, texts, rewards; with rl.env
    whole episodes (train/rl/episodes.py), whose `masks` mark the policy's tokens among the completion's.
    `policy`: (state, mesh) to sample with (the asynchronous worker's copy); default the learner's. `part` = (k, K):
    only the k-th of K equal blocks of the rows, drawn as in the whole batch (the worker's share on process k of
    K). `failures` lists the rewards' errors; `count` adds them to the bad-reward count here (the worker's are
    counted when the learner takes them)."""
    conversations = [c for c in conversations for _ in range(repeats)]
    first, stop = async_rollouts.block(len(conversations), *part)
    conversations = conversations[first:stop]
    if self.env_factory is not None:
      from train.rl import episodes  # pylint: disable=g-import-not-at-top
      roll = episodes.run(self, conversations, seed, policy, first)
    else:
      roll = self._single_turn(conversations, seed, policy, first)
    if count:
      self.count_bad(roll["raw"], roll["failures"])
    return roll

  def _single_turn(self, conversations, seed: int, policy, first_row: int) -> dict[str, Any]:
    prompt_ids = [self.template.prompt(c) for c in conversations]
    gen = self.generate(prompt_ids, seed, policy, first_row)
    completions = [self.tokenizer.decode([t for t in toks if t not in self.stop_ids]) for toks in gen.tokens]
    texts = [reward_text(c, completion) for c, completion in zip(conversations, completions)]
    failures = len(self.reward.failures)
    raw, parts = self.reward.scored([c[-1]["content"] for c in conversations], completions, texts)
    ended = np.array([bool(t) and t[-1] in self.stop_ids for t in gen.tokens])
    return {"prompt_ids": prompt_ids, "tokens": gen.tokens, "logprobs": gen.logprobs,
            **self.shaped(raw, ended, np.array([len(t) for t in gen.tokens], np.float64)), "stats": gen.stats,
            "parts": parts, "failures": self.reward.failures[failures:]}

  def generate(self, prompt_ids, seed: int, policy=None, first_row: int = 0):
    """The policy's completions of token prompts (rl.engine's continuous batching or the static sampler):
    model.generate's Generation (tokens, logprobs, stats). `policy` as for `sample`; `first_row`: the row of
    prompt_ids[0] in the sampler's keys."""
    import parallel  # pylint: disable=g-import-not-at-top
    from model import generate as generate_lib  # pylint: disable=g-import-not-at-top
    r = self.config.rl
    state, mesh = policy if policy is not None else (self.state, None)
    with parallel.activate(mesh or self.mesh, self.trainer.rules):
      model = self.trainer.model(state)
      if r.engine:  # continuous batching over a paged cache; every rollout fits train.seq_len + 1 (checked)
        from model import engine as engine_lib  # pylint: disable=g-import-not-at-top
        return engine_lib.sample(model, prompt_ids, r.max_new_tokens, temperature=r.temperature,
                                 stop_ids=self.stop_ids, seed=seed, max_len=self.config.train.seq_len + 1,
                                 rows=range(first_row, first_row + len(prompt_ids)))
      return generate_lib.sample(model, prompt_ids, r.max_new_tokens, temperature=r.temperature,
                                 stop_ids=self.stop_ids, seed=seed, first_row=first_row)

  def turn_seed(self, seed: int, turn: int) -> int:
    """The sampling seed of a multi-turn episode's turn `turn` >= 1 (turn 0 samples with the rollout's `seed`)."""
    return seed_for(seed, _TURN, turn)

  def rollout_seed(self, iteration: int) -> int:
    """The sampling seed of iteration `iteration`'s rollouts (the first round, with or without async rollouts)."""
    return seed_for(self.config.rl.seed, _ROLLOUT, iteration)

  def shaped(self, raw, ended, lengths, longest=None) -> dict[str, np.ndarray]:
    """{raw, shaped, valid, ended, lengths}: the rewards with rl.length_penalty (per policy token),
    rl.missing_eos_penalty and DAPO's overlong punishment applied (to `longest`, an episode's longest turn, which
    rl.max_new_tokens caps; default `lengths`); invalid where the reward is not finite."""
    r = self.config.rl
    shaped = (raw - r.length_penalty * lengths - r.missing_eos_penalty * (~ended)
              + policy.overlong_penalty(lengths if longest is None else longest, r.max_new_tokens,
                                        r.overlong_buffer))
    return {"raw": raw, "shaped": shaped, "valid": np.isfinite(raw), "ended": ended, "lengths": lengths}

  def count_bad(self, raw, failures) -> None:
    """Counts the non-finite rewards (dropped samples) toward rl.max_bad_rewards, with a warning naming the first."""
    bad = int(np.sum(~np.isfinite(raw)))
    if bad:
      self.bad_rewards += bad
      print(f"warning: {bad} reward(s) raised or were not finite (dropped; {self.bad_rewards} so far, halting "
            f"at rl.max_bad_rewards={self.config.rl.max_bad_rewards}); first: {failures[:1] or ['NaN']}",
            file=sys.stderr, flush=True)

  def _mine(self, batch):
    """This process's consecutive block of a global batch's rows (every process builds the same rollouts)."""
    n = next(iter(batch.values())).shape[0] // jax.process_count()
    return {k: v[jax.process_index() * n:(jax.process_index() + 1) * n] for k, v in batch.items()}

  def _full(self, batch):
    """A batch with every key of the objective (zeros for those not computed yet)."""
    shape = batch["inputs"].shape
    return {k: batch[k] if k in batch else np.zeros(shape, dt) for k, dt in self.trainer.batch_keys.items()}

  def score(self, batch) -> dict[str, np.ndarray]:
    """Per-token rollout scores of the objective's `eval_sums` ([N, L] each), batch_size rows at a time."""
    B, out = self.config.train.batch_size, {}
    full = self._full(batch)
    for start in range(0, batch["inputs"].shape[0], B):
      chunk = self._mine({k: v[start:start + B] for k, v in full.items()})
      scores = self.trainer.eval_fn(self.state, self.trainer.batch_to_device(chunk))
      for k, v in sharding_lib.to_host(scores).items():
        out.setdefault(k, []).append(np.asarray(v))
    return {k: np.concatenate(v) for k, v in out.items()}

  def train(self, batch, iteration: int) -> dict[str, float]:
    """rl.epochs shuffled passes of train.batch_size-row minibatches; the steps' metrics averaged, plus the
    first minibatch's ratio deviation (`ratio_dev_first`, 0 up to rounding: old log-probs are recomputed)."""
    r, B = self.config.rl, self.config.train.batch_size
    full = self._full(batch)
    n = full["inputs"].shape[0]
    collected = []
    for epoch in range(r.epochs):
      order = np.random.default_rng(seed_for(r.seed, _EPOCHS, iteration, epoch)).permutation(n)
      for start in range(0, n, B):
        idx = order[start:start + B]
        chunk = {k: v[idx] for k, v in full.items()}
        if r.ptx_coef:
          chunk = self._with_ptx(chunk, iteration, epoch * n + start)
        chunk = self._mine(chunk)
        self.state, metrics = self.trainer.step_fn(self.state, self.trainer.batch_to_device(chunk))
        collected.append(metrics)
    collected = jax.device_get(collected)
    out = {k: float(np.mean([m[k] for m in collected])) for k in collected[0]}
    out["nonfinite"] = float(sum(m["nonfinite"] for m in collected))
    if "ratio_dev" in collected[0]:
      out["ratio_dev_first"] = float(collected[0]["ratio_dev"])
    return out

  def _with_ptx(self, chunk, iteration: int, offset: int) -> dict[str, np.ndarray]:
    """The minibatch with train.batch_size held-in conversations of data.sources' chat sources (none whose prompt
    is an RL prompt) appended (PPO-ptx, Ouyang et al. 2022 eq. 2): their assistant tokens carry loss_mask =
    rl.ptx_coef for best-of-N's SFT objective, and `ptx_mask` = 1 for PPO / GRPO, whose objectives add
    rl.ptx_coef x their negative log-likelihood; every other key is 0 on them (no advantage, no KL, no value
    target)."""
    from data import chat as chat_lib  # pylint: disable=g-import-not-at-top
    r, B = self.config.rl, self.config.train.batch_size
    if self.ptx_pool is None:
      # Never the RL prompts themselves: their reference answers would teach the task the rewards are to teach.
      rl_prompts = {c[-1]["content"] for split in (self.prompts or {}).values() for c in split}
      items = [item for item in chat_lib.eval_items(self.config.data, per_family=PTX_POOL, split="train")
               if not any(m["role"] == "user" and m["content"] in rl_prompts for m in item.messages)]
      if not items:
        raise ValueError("rl.ptx_coef > 0 mixes in conversations of data.sources' chat sources (other than the "
                         "RL prompts), and they have none in their training split; add a chat source or set "
                         "rl.ptx_coef=0")
      self.ptx_pool = [item.messages + [{"role": "assistant", "content": item.answer}] for item in items]
    pick = np.random.default_rng(seed_for(r.seed, _PTX, iteration, offset)).choice(len(self.ptx_pool), B)
    extra = conversation_rows(self.template, [self.ptx_pool[i] for i in pick], self.config.train.seq_len, 1.0)
    if r.algorithm == "best_of_n":
      extra["loss_mask"] = r.ptx_coef * extra["loss_mask"]
    else:
      extra["ptx_mask"], extra["loss_mask"] = extra["loss_mask"], np.zeros_like(extra["loss_mask"])
    shape = (B, chunk["inputs"].shape[1])
    return {k: np.concatenate([v, extra[k] if k in extra else np.zeros(shape, v.dtype)]) for k, v in chunk.items()}

  # ---- iterations ----------------------------------------------------------------------------------------
  def _prompts_for(self, iteration: int):
    """The iteration's training prompts: consecutive slices of a per-pass shuffle of the training split."""
    r, pool = self.config.rl, self.prompts["train"]
    per = r.prompts_per_iteration
    picked = []
    for j in range(iteration * per, (iteration + 1) * per):
      epoch, k = divmod(j, len(pool))
      picked.append(pool[np.random.default_rng(seed_for(r.seed, _ROLLOUT, epoch, 1)).permutation(len(pool))[k]])
    return picked

  def iterate(self, iteration: int) -> dict[str, float]:
    """One rollout-and-update iteration of rl.algorithm; returns its metrics (module docstring)."""
    r = self.config.rl
    t0 = time.perf_counter()
    sampled = {}
    if self.worker is not None:  # made by the rollout thread (train/rl/async_rollouts.py); gen_s is the wait
      roll = self.worker.take(iteration)
      if "worker_seconds" in roll:  # the worker's own time for these rollouts (absent when restored from disk)
        sampled["worker_generate_seconds"] = roll["worker_seconds"]
    else:
      roll = self.sample(self._prompts_for(iteration), r.samples_per_prompt, self.rollout_seed(iteration))
    trained, sampling = roll, {}  # the reward figures below are the first round's: the policy's, unfiltered
    if r.algorithm == "grpo" and r.dynamic_sampling:
      trained, sampling = self._dynamic_sampling(roll, iteration)
    gen_s = time.perf_counter() - t0
    valid = roll["valid"]
    metrics = {"reward_mean": float(np.mean(roll["raw"][valid])) if valid.any() else math.nan,
               "bad_rewards": float(np.sum(~valid)), "bad_rewards_total": float(self.bad_rewards),
               "completion_length": float(np.mean(roll["lengths"])), "eos_fraction": float(np.mean(roll["ended"])),
               "generate_seconds": gen_s,
               # sampler time without compilation (the first iteration compiles the sampler)
               "rollout_tokens_per_sec": float(np.sum(roll["lengths"])) / max(
                   roll["stats"]["prefill_seconds"] + roll["stats"]["decode_seconds"], 1e-9)
               if "stats" in roll else math.nan}
    if r.length_penalty or r.missing_eos_penalty or r.overlong_buffer:
      metrics["reward_shaped_mean"] = float(np.mean(roll["shaped"][valid])) if valid.any() else math.nan
    if r.algorithm == "grpo":
      G = r.samples_per_prompt
      metrics["zero_std_fraction"] = float(np.mean(policy.zero_variance_groups(
          roll["shaped"].reshape(-1, G), valid.reshape(-1, G))))
    metrics.update(sampling, **sampled)
    metrics.update(_part_means(roll, ""))
    if "turns" in roll:  # rl.env: the episodes' policy turns
      metrics["turns_mean"] = float(np.mean(roll["turns"]))
    t1 = time.perf_counter()
    if r.algorithm == "best_of_n":
      batch = self._best_of_n_batch(roll, iteration, metrics)
    elif r.algorithm == "gkd":  # every completion, whatever its reward: the teacher scores each token
      batch = rows(roll["prompt_ids"], roll["tokens"], self.config.train.seq_len, roll.get("masks"))
    else:
      batch = self._policy_batch(trained, metrics)
    metrics.update(self.train(batch, iteration))
    metrics["train_seconds"] = time.perf_counter() - t1
    if self.worker is not None:  # idle it before the loop's checkpoint and stop check (async_rollouts: Weights)
      t2 = time.perf_counter()
      self.worker.settle(iteration)
      metrics["worker_wait_seconds"] = time.perf_counter() - t2
    metrics["generate_fraction"] = gen_s / (gen_s + metrics["train_seconds"])
    metrics["iteration_seconds"] = time.perf_counter() - t0  # with async rollouts generate_seconds is the wait
    if r.algorithm == "ppo" and r.kl_target > 0:  # Ziegler et al. 2019's proportional controller
      error = float(np.clip(metrics["kl"] / r.kl_target - 1.0, -0.2, 0.2))
      self.kl_coef *= 1.0 + error * len(roll["tokens"]) / r.kl_horizon
    metrics["kl_coef"] = self.kl_coef
    return metrics

  def _dynamic_sampling(self, roll, iteration: int) -> tuple[dict[str, Any], dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): the groups of `roll` whose rewards differ, topped up
    with the differing groups of further rounds (rl.prompts_per_iteration fresh training prompts each, seeds from
    (rl.seed, iteration, round)) until rl.prompts_per_iteration groups are kept or rl.dynamic_sampling_rounds
    rounds are spent; a batch still short is completed with zero-variance groups (zero advantage), counted as
    `filled_groups`. Returns (the rollouts to train on, their metrics)."""
    r = self.config.rl
    G, need = r.samples_per_prompt, r.prompts_per_iteration
    kept, spare, rounds = [], [], 1
    while True:
      zero_N = policy.zero_variance_groups(roll["shaped"].reshape(-1, G), roll["valid"].reshape(-1, G))
      kept += [(roll, n) for n in np.flatnonzero(~zero_N)]
      spare += [(roll, n) for n in np.flatnonzero(zero_N)]
      if len(kept) >= need or rounds >= r.dynamic_sampling_rounds:
        break
      pool = self.prompts["train"]
      pick = np.random.default_rng(seed_for(r.seed, _REFILL, iteration, rounds)).choice(len(pool), need,
                                                                                         replace=need > len(pool))
      roll = self.sample([pool[i] for i in pick], G, seed_for(r.seed, _ROLLOUT, iteration, rounds))
      rounds += 1
    groups = (kept + spare)[:need]
    rows_ = [i for source, n in groups for i in range(n * G, (n + 1) * G)]
    sources = [source for source, _ in groups for _ in range(G)]
    lists = ("prompt_ids", "tokens", "logprobs", "masks") if "masks" in roll else ("prompt_ids", "tokens", "logprobs")
    out = {k: [source[k][i] for source, i in zip(sources, rows_)] for k in lists}
    out.update({k: np.array([source[k][i] for source, i in zip(sources, rows_)])
                for k in ("raw", "shaped", "valid", "ended", "lengths")})
    return out, {"sampling_rounds": float(rounds), "filled_groups": float(max(need - len(kept), 0))}

  def _policy_batch(self, roll, metrics) -> dict[str, np.ndarray]:
    """PPO / GRPO batch: rows, recomputed old log-probs, advantages (and returns / values for PPO)."""
    r = self.config.rl
    batch = rows(roll["prompt_ids"], roll["tokens"], self.config.train.seq_len, roll.get("masks"))
    trained = roll["valid"] & (roll["ended"] | (not r.mask_truncated))  # DAPO's overlong filtering
    batch["loss_mask"] *= trained[:, None]
    mask = batch["loss_mask"]
    scores = self.score(batch)
    logp = scores["logp"]
    sampler = _scatter(roll["logprobs"], mask)
    metrics["logp_diff"] = float(np.max(np.abs(sampler - logp) * mask))
    batch["tis_weight"] = np.ones_like(mask)
    if r.async_rollouts:  # truncated importance weights (policy.tis_weights) where the sampler's policy lagged;
      # with no lag the two differ by rounding only (logp_diff), which the synchronous loop does not correct either
      if roll["lag"] > 0:
        batch["tis_weight"] = policy.tis_weights(logp, sampler, mask, r.tis_cap)
      m = mask > 0
      metrics["tis_weight_mean"] = float(batch["tis_weight"][m].mean()) if m.any() else 1.0
      metrics["tis_clip_frac"] = float((np.exp(logp - sampler)[m] > r.tis_cap).mean()) if m.any() else 0.0
      metrics["policy_lag"] = float(roll["lag"])
    kl_BL = (logp - scores["ref_logp"]) * mask
    valid = roll["valid"]
    metrics["kl"] = float(np.mean(kl_BL.sum(axis=1)[valid])) if valid.any() else 0.0
    batch["old_logp"] = logp
    if r.algorithm == "ppo":
      values = scores["values"]
      rewards_BL = np.asarray(policy.ppo_token_rewards(np.where(valid, np.nan_to_num(roll["shaped"]), 0.0), kl_BL,
                                                       mask, self.kl_coef))
      adv, returns = (np.asarray(x) for x in policy.gae(rewards_BL, values, mask, r.gamma, r.lam))
      if r.whiten_advantages and mask.any():
        adv = policy.whiten(adv, mask)
      m = mask > 0
      residual = returns[m] - values[m]
      metrics["explained_variance"] = (float(1.0 - np.var(residual) / np.var(returns[m]))
                                       if m.any() and np.var(returns[m]) > 0 else math.nan)
      metrics["value_mean"] = float(np.mean(values[m])) if m.any() else math.nan
      batch.update(advantages=adv, returns=returns, old_values=values * mask)
    else:
      G = r.samples_per_prompt
      scale = r.scale_rewards if r.scale_rewards != "auto" else ("none" if r.loss == "dr_grpo" else "group")
      adv_NG = policy.group_advantages(np.nan_to_num(roll["shaped"]).reshape(-1, G), valid.reshape(-1, G), scale)
      batch["advantages"] = np.asarray(adv_NG).reshape(-1)[:, None] * mask
    return batch

  def _best_of_n_batch(self, roll, iteration: int, metrics) -> dict[str, np.ndarray]:
    """The best valid sample of each prompt by shaped reward (ties broken by a draw from the iteration's seed)
    as SFT rows; prompts whose samples were all dropped contribute an all-zero loss mask."""
    r = self.config.rl
    K = r.samples_per_prompt
    shaped = np.where(roll["valid"], roll["shaped"], -np.inf).reshape(-1, K)
    ties = np.random.default_rng(seed_for(r.seed, _TIES, iteration)).random(shaped.shape)
    best = np.array([max(range(K), key=lambda k: (row[k], tie[k])) for row, tie in zip(shaped, ties)])
    pick = np.arange(shaped.shape[0]) * K + best
    batch = rows([roll["prompt_ids"][i] for i in pick], [roll["tokens"][i] for i in pick],
                 self.config.train.seq_len, [roll["masks"][i] for i in pick] if "masks" in roll else None)
    kept = np.isfinite(shaped[np.arange(len(best)), best])
    batch["loss_mask"] *= kept[:, None]
    metrics["best_reward_mean"] = float(np.mean(roll["raw"][pick][kept])) if kept.any() else math.nan
    return batch

  def evaluate(self) -> dict[str, float]:
    """eval_reward_mean: one sample (temperature rl.temperature) for each of the first rl.eval_prompts held-out
    prompts, the same seed at every evaluation; with rl.eval_best_of = K also eval_best_of_n_reward_mean, the
    mean over prompts of the best of K samples' reward; with train.eval_generations, the greedy exact match on the
    held-out prompts of data.sources' chat and preference sources (eval_exact_match, and per family: what the run
    keeps of the skills it does not train)."""
    r = self.config.rl
    prompts = self.prompts["eval"][:r.eval_prompts]
    roll = self.sample(prompts, 1, seed_for(r.seed, _EVAL, 0))
    out = {"eval_reward_mean": float(np.nanmean(roll["raw"])) if roll["valid"].any() else math.nan,
           **_part_means(roll, "eval_"), **({"eval_turns_mean": float(np.mean(roll["turns"]))} if "turns" in roll
                                              else {})}
    if r.eval_best_of:
      best = self.sample(prompts, r.eval_best_of, seed_for(r.seed, _EVAL, 1))["raw"].reshape(-1, r.eval_best_of)
      out["eval_best_of_n_reward_mean"] = float(np.mean(np.nanmax(np.where(np.isfinite(best), best, -np.inf),
                                                                  axis=1)))
    if self.config.train.eval_generations:
      out.update(self._exact_match())
    return out

  def _exact_match(self) -> dict[str, float]:
    import parallel  # pylint: disable=g-import-not-at-top
    from train.core import chat_eval  # pylint: disable=g-import-not-at-top
    if self.chat_items is None:
      self.chat_items = chat_eval.eval_items(self.config, self.template, None)
    with parallel.activate(self.mesh, self.trainer.rules):
      return chat_eval.exact_match(self.trainer.model(self.state), self.tokenizer, self.template, self.chat_items,
                                   self.config.train.eval_max_new_tokens)
