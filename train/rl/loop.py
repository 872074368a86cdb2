"""Reinforcement learning from feedback behind `python -m train.rl`: PPO, GRPO and rejection sampling.

`python -m train.rl [--config=grpo_tiny] [--config.rl.KEY=VALUE ...] [--workdir=runs/<config name>]`

One iteration (rl.algorithm):
  ppo        sample rl.prompts_per_iteration x rl.samples_per_prompt completions with the shared sampler
             (model.generate.sample, temperature rl.temperature); score them (rl.reward); recompute the old
             log-probs, the reference's log-probs and the values with the training forward pass (so the ratio is 1
             at the first epoch; the sampler's own log-probs are compared with them: `logp_diff`); per-token reward
             -kl_coef * (logp - ref_logp) plus the score at the final token; GAE; whitened advantages; rl.epochs
             passes of minibatches (train.batch_size rows) of the `ppo` objective (train/objectives/ppo.py).
  grpo       the same rollouts in groups of G = rl.samples_per_prompt per prompt, group-normalised advantages,
             the `grpo` objective (clipped, k3 KL to the reference when rl.kl_coef > 0); no critic.
  best_of_n  K = rl.samples_per_prompt samples per prompt, the best by reward kept (ties broken by a draw from
             the iteration's seed), rl.epochs passes of the `sft` objective on the kept answers (one round).
Rewards: `py:MODULE:FUNCTION` called with (prompt text, completion text) -> float, or `rm:RUN`, a reward-model
run scored through `train.rundir.reward.load_scorer` on the conversation + completion as a chat record. A reward that raises or
is not finite drops its sample (zero loss mask) and is counted (`bad_rewards`); the run halts once
rl.max_bad_rewards have been counted. Optional penalties: rl.length_penalty per token, rl.missing_eos_penalty.

The run directory is `python -m train`'s (train/core/loop.py): config.json, metrics.jsonl, TensorBoard, progress
bar, orbax checkpoints at iteration boundaries (the Trainer's state: policy, value head, optimizer, frozen
reference; metadata: the reference's source, the KL coefficient, the bad-reward count, the rollout seed),
SIGTERM/SIGINT -> checkpoint and exit 0, the same command resumes. Every random draw of iteration i comes from
seeds derived from (rl.seed, i), so a resumed run repeats an uninterrupted one exactly. Without
train.init_from the run starts from train.base_recipe's run (loop._resolve_start). Exit codes as `python -m train`.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import sys
import time
from typing import Any, Sequence

if __name__ == "__main__":  # pin the platform as `python -m train` does, before JAX is imported
  from train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  train_main._default_platform()  # pylint: disable=protected-access

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import ml_collections  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from train.core import checkpoint as ckpt_lib
from train.core import logger as logger_lib
from train.core import loop

OBJECTIVE = {"ppo": "ppo", "grpo": "grpo", "best_of_n": "sft"}  # rl.algorithm -> train.objective
_ROLLOUT, _EPOCHS, _EVAL, _TIES = range(4)  # seed streams


def seed_for(base: int, stream: int, iteration: int, extra: int = 0) -> int:
  """A sampling / shuffling seed in [0, 2^31) for (rl.seed, stream, iteration, extra): independent streams."""
  return int(np.random.SeedSequence([base, stream, iteration, extra]).generate_state(1)[0] & 0x7FFFFFFF)


def reward_text(conversation: Sequence[dict], completion: str) -> str:
  """What a reward model scores for one rollout: the conversation and the completion as a JSON chat record, which
  `train.reward` renders with the reward run's own template, as its preference pairs were in training."""
  return json.dumps({"messages": list(conversation) + [{"role": "assistant", "content": completion}]})


class Reward:
  """rl.reward as a batch function: (prompts, completions, texts) -> float64 [N], NaN where a reward raised or
  was not finite. `texts` (`reward_text`: the conversation + completion as a chat record) is what a reward model scores."""

  def __init__(self, spec: str):
    self.spec, self.failures = spec, []
    kind, _, target = spec.partition(":")
    self._pair = self._batch = None
    if kind == "py":
      module, _, name = target.rpartition(":")
      if not module or not name:
        raise loop.SetupError(f"rl.reward={spec!r} must be py:MODULE:FUNCTION, e.g. "
                              "py:data.rl_prompts:greater_reward")
      try:
        self._pair = getattr(importlib.import_module(module), name)
      except (ImportError, AttributeError) as e:
        raise loop.SetupError(f"rl.reward={spec!r}: cannot load {name} from module {module} ({e}); give an "
                              "importable module (on PYTHONPATH) and a function (prompt, completion) -> float") from None
      if not callable(self._pair):
        raise loop.SetupError(f"rl.reward={spec!r}: {module}.{name} is not callable")
    elif kind == "rm":
      if not os.path.isdir(target):
        raise loop.SetupError(f"rl.reward={spec!r}: no reward-model run directory {target!r}; train one "
                              "(docs/post-training.md) or fix the path")
      try:
        from train.rundir import reward as reward_lib  # pylint: disable=g-import-not-at-top
        self._batch = reward_lib.load_scorer(target)
      except (ImportError, ValueError, FileNotFoundError, ckpt_lib.CheckpointError) as e:
        raise loop.SetupError(f"rl.reward={spec!r}: cannot load a reward model from {target}: {e}") from None
    else:
      raise loop.SetupError(f"rl.reward={spec!r} must be py:MODULE:FUNCTION or rm:RUN_DIRECTORY")

  def _fail(self, what: str) -> float:
    self.failures.append(what)
    return math.nan

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], texts: Sequence[str]) -> np.ndarray:
    if self._batch is not None:
      try:
        out = np.asarray(self._batch(list(texts)), np.float64).reshape(-1)
        if out.shape[0] != len(texts):
          raise ValueError(f"the scorer returned {out.shape[0]} rewards for {len(texts)} texts")
      except Exception as e:  # pylint: disable=broad-except  (a bad scorer call drops the batch, counted)
        return np.array([self._fail(f"{type(e).__name__}: {e}") for _ in texts])
      for i in np.flatnonzero(~np.isfinite(out)):
        out[i] = self._fail(f"the reward model's score {out[i]} for text {texts[i]!r} is not finite")
    else:
      out = np.empty(len(prompts))
      for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        try:
          out[i] = float(self._pair(prompt, completion))
        except Exception as e:  # pylint: disable=broad-except  (user code: any error drops this sample)
          out[i] = self._fail(f"{type(e).__name__}: {e}")
          continue
        if not math.isfinite(out[i]):
          out[i] = self._fail(f"the reward {out[i]} for completion {completion!r} is not finite")
    return out


def rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], seq_len: int) -> dict[str, np.ndarray]:
  """Prompt + completion rows of a training batch, each [N, seq_len], right-padded.

  inputs = sequence[:-1], targets = sequence[1:], segment 1 on real tokens (0 = padding), positions 0, 1, ...;
  loss_mask is 1 where the target is a completion token.
  """
  n = len(prompts)
  batch = {k: np.zeros((n, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  batch["loss_mask"] = np.zeros((n, seq_len), np.float32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = list(p) + list(c)
    m = len(seq) - 1
    batch["inputs"][i, :m], batch["targets"][i, :m] = seq[:-1], seq[1:]
    batch["segment_ids"][i, :m], batch["positions"][i, :m] = 1, np.arange(m)
    batch["loss_mask"][i, len(p) - 1:m] = 1.0
  return batch


def _scatter(values: Sequence[Sequence[float]], mask_BL: np.ndarray) -> np.ndarray:
  """Per-completion lists (e.g. the sampler's log-probs) placed on the masked positions of each row [N, L]."""
  out = np.zeros(mask_BL.shape, np.float32)
  for i, v in enumerate(values):
    where = np.flatnonzero(mask_BL[i])
    out[i, where] = np.asarray(v, np.float32)[:len(where)]
  return out


class Session:
  """One RL run's pieces: the Trainer and its state, tokenizer, template, prompts and reward (see `run`)."""

  def __init__(self, config, trainer, mesh, tokenizer, template, prompts, reward):
    self.config, self.trainer, self.mesh = config, trainer, mesh
    self.tokenizer, self.template, self.prompts, self.reward = tokenizer, template, prompts, reward
    self.stop_ids = tuple(template.stop_ids())
    self.state = None
    self.kl_coef = float(config.rl.kl_coef)
    self.bad_rewards = 0

  # ---- rollouts ---------------------------------------------------------------------------------------
  def sample(self, conversations, repeats: int, seed: int) -> dict[str, Any]:
    """`repeats` completions of each conversation (rows prompt-major), scored: tokens, texts, rewards."""
    import parallel  # pylint: disable=g-import-not-at-top
    from model import generate as generate_lib  # pylint: disable=g-import-not-at-top
    r = self.config.rl
    prompt_ids = [self.template.prompt(c) for c in conversations for _ in range(repeats)]
    with parallel.activate(self.mesh, self.trainer.rules):
      gen = generate_lib.sample(self.trainer.model(self.state), prompt_ids, r.max_new_tokens,
                                temperature=r.temperature, stop_ids=self.stop_ids, seed=seed)
    completions = [self.tokenizer.decode([t for t in toks if t not in self.stop_ids]) for toks in gen.tokens]
    prompt_texts = [c[-1]["content"] for c in conversations for _ in range(repeats)]
    texts = [reward_text(c, completion) for c, completion in
             zip([c for c in conversations for _ in range(repeats)], completions)]
    failures = len(self.reward.failures)
    raw = self.reward(prompt_texts, completions, texts)
    ended = np.array([bool(t) and t[-1] in self.stop_ids for t in gen.tokens])
    lengths = np.array([len(t) for t in gen.tokens], np.float64)
    shaped = raw - r.length_penalty * lengths - r.missing_eos_penalty * (~ended)
    bad = int(np.sum(~np.isfinite(raw)))
    if bad:
      self.bad_rewards += bad
      print(f"warning: {bad} reward(s) raised or were not finite (dropped; {self.bad_rewards} so far, halting "
            f"at rl.max_bad_rewards={r.max_bad_rewards}); first: {self.reward.failures[failures:][:1] or ['NaN']}",
            file=sys.stderr, flush=True)
    return {"prompt_ids": prompt_ids, "tokens": gen.tokens, "logprobs": gen.logprobs, "raw": raw,
            "shaped": shaped, "valid": np.isfinite(raw), "ended": ended, "lengths": lengths, "stats": gen.stats}

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
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        scores = multihost_utils.process_allgather(scores, tiled=True)
      for k, v in jax.device_get(scores).items():
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
        chunk = self._mine({k: v[idx] for k, v in full.items()})
        self.state, metrics = self.trainer.step_fn(self.state, self.trainer.batch_to_device(chunk))
        collected.append(metrics)
    collected = jax.device_get(collected)
    out = {k: float(np.mean([m[k] for m in collected])) for k in collected[0]}
    out["nonfinite"] = float(sum(m["nonfinite"] for m in collected))
    if "ratio_dev" in collected[0]:
      out["ratio_dev_first"] = float(collected[0]["ratio_dev"])
    return out

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
    roll = self.sample(self._prompts_for(iteration), r.samples_per_prompt, seed_for(r.seed, _ROLLOUT, iteration))
    gen_s = time.perf_counter() - t0
    valid = roll["valid"]
    metrics = {"reward_mean": float(np.mean(roll["raw"][valid])) if valid.any() else math.nan,
               "bad_rewards": float(np.sum(~valid)), "bad_rewards_total": float(self.bad_rewards),
               "completion_length": float(np.mean(roll["lengths"])), "eos_fraction": float(np.mean(roll["ended"])),
               "generate_seconds": gen_s,
               # sampler time without compilation (the first iteration compiles the sampler)
               "rollout_tokens_per_sec": float(np.sum(roll["lengths"])) / max(
                   roll["stats"]["prefill_seconds"] + roll["stats"]["decode_seconds"], 1e-9)}
    if r.length_penalty or r.missing_eos_penalty:
      metrics["reward_shaped_mean"] = float(np.mean(roll["shaped"][valid])) if valid.any() else math.nan
    t1 = time.perf_counter()
    if r.algorithm == "best_of_n":
      batch = self._best_of_n_batch(roll, iteration, metrics)
    else:
      batch = self._policy_batch(roll, metrics)
    metrics.update(self.train(batch, iteration))
    metrics["train_seconds"] = time.perf_counter() - t1
    metrics["generate_fraction"] = gen_s / (gen_s + metrics["train_seconds"])
    if r.algorithm == "ppo" and r.kl_target > 0:  # Ziegler et al. 2019's proportional controller
      error = float(np.clip(metrics["kl"] / r.kl_target - 1.0, -0.2, 0.2))
      self.kl_coef *= 1.0 + error * len(roll["tokens"]) / r.kl_horizon
    metrics["kl_coef"] = self.kl_coef
    return metrics

  def _policy_batch(self, roll, metrics) -> dict[str, np.ndarray]:
    """PPO / GRPO batch: rows, recomputed old log-probs, advantages (and returns / values for PPO)."""
    from train.objectives import policy  # pylint: disable=g-import-not-at-top
    r = self.config.rl
    batch = rows(roll["prompt_ids"], roll["tokens"], self.config.train.seq_len)
    batch["loss_mask"] *= roll["valid"][:, None]
    mask = batch["loss_mask"]
    scores = self.score(batch)
    logp = scores["logp"]
    sampler = _scatter(roll["logprobs"], mask)
    metrics["logp_diff"] = float(np.max(np.abs(sampler - logp) * mask))
    kl_BL = (logp - scores["ref_logp"]) * mask
    valid = roll["valid"]
    metrics["kl"] = float(np.mean(kl_BL.sum(axis=1)[valid])) if valid.any() else 0.0
    batch["old_logp"] = logp
    if r.algorithm == "ppo":
      values = scores["values"]
      rewards_BL = -self.kl_coef * kl_BL
      last = np.where(mask.any(axis=1), mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
      rewards_BL[np.arange(len(last)), last] += np.where(valid, np.nan_to_num(roll["shaped"]), 0.0)
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
      adv_NG = policy.group_advantages(np.nan_to_num(roll["shaped"]).reshape(-1, G), valid.reshape(-1, G))
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
                 self.config.train.seq_len)
    kept = np.isfinite(shaped[np.arange(len(best)), best])
    batch["loss_mask"] *= kept[:, None]
    metrics["best_reward_mean"] = float(np.mean(roll["raw"][pick][kept])) if kept.any() else math.nan
    return batch

  def evaluate(self) -> dict[str, float]:
    """eval_reward_mean: one sample (temperature rl.temperature) for each of the first rl.eval_prompts held-out
    prompts, the same seed at every evaluation; with rl.eval_best_of = K also eval_best_of_n_reward_mean, the
    mean over prompts of the best of K samples' reward."""
    r = self.config.rl
    prompts = self.prompts["eval"][:r.eval_prompts]
    roll = self.sample(prompts, 1, seed_for(r.seed, _EVAL, 0))
    out = {"eval_reward_mean": float(np.nanmean(roll["raw"])) if roll["valid"].any() else math.nan}
    if r.eval_best_of:
      best = self.sample(prompts, r.eval_best_of, seed_for(r.seed, _EVAL, 1))["raw"].reshape(-1, r.eval_best_of)
      out["eval_best_of_n_reward_mean"] = float(np.mean(np.nanmax(np.where(np.isfinite(best), best, -np.inf),
                                                                  axis=1)))
    return out


def _check_rl(config) -> None:
  """The rl section's consistency with train.* (SetupError naming the keys and the fix)."""
  r, t = config.rl, config.train
  if r.algorithm not in OBJECTIVE:
    raise loop.SetupError(f"rl.algorithm={r.algorithm!r} must be one of {', '.join(OBJECTIVE)}")
  want = OBJECTIVE[r.algorithm]
  if t.objective != want:
    raise loop.SetupError(f"rl.algorithm={r.algorithm} trains the {want!r} objective but train.objective="
                          f"{t.objective!r}; set --config.train.objective={want}")
  rows_per_iteration = r.prompts_per_iteration * (1 if r.algorithm == "best_of_n" else r.samples_per_prompt)
  if rows_per_iteration % t.batch_size:
    raise loop.SetupError(f"an iteration trains on {rows_per_iteration} rows (rl.prompts_per_iteration x "
                          f"{'1 kept answer' if r.algorithm == 'best_of_n' else 'rl.samples_per_prompt'}), not a "
                          f"multiple of train.batch_size={t.batch_size}; change one of them")
  if r.algorithm == "grpo" and r.samples_per_prompt < 2:
    raise loop.SetupError("rl.algorithm=grpo needs rl.samples_per_prompt >= 2 (a group to normalise within)")
  if t.lora_rank:
    raise loop.SetupError("train.rl does not support train.lora_rank > 0 yet; set --config.train.lora_rank=0")


def steps_per_iteration(config) -> int:
  """Optimizer steps of one iteration: rl.epochs x the rows trained on / train.batch_size."""
  r = config.rl
  rows_per_iteration = r.prompts_per_iteration * (1 if r.algorithm == "best_of_n" else r.samples_per_prompt)
  return r.epochs * rows_per_iteration // config.train.batch_size


def _check_lengths(prompts, template, config) -> None:
  """SetupError naming the first prompt that leaves no room for rl.max_new_tokens in train.seq_len + 1."""
  r, t = config.rl, config.train
  for split, items in prompts.items():
    for i, conversation in enumerate(items):
      n = len(template.prompt(conversation))
      if n + r.max_new_tokens > t.seq_len + 1:
        raise loop.SetupError(f"{split} prompt {i} ({conversation[-1]['content'][:60]!r}...) has {n} tokens: with "
                              f"rl.max_new_tokens={r.max_new_tokens} it exceeds train.seq_len + 1 = {t.seq_len + 1}; "
                              "shorten or drop the prompt, lower rl.max_new_tokens or raise train.seq_len")


def run(config: ml_collections.ConfigDict, workdir: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """Runs rl.iterations iterations of rl.algorithm in `workdir` (resuming from its latest checkpoint).

  Returns {"iteration", "reward_mean", "eval_reward_mean", "stopped"}. Raises loop.SetupError (bad config,
  prompts or reward; nothing written), loop.TrainingError (bad-reward or non-finite halt) and loop.WorkdirError.
  """
  import configs  # pylint: disable=g-import-not-at-top
  config = copy.deepcopy(config)
  try:
    warnings = configs.validate.check(config)
  except configs.ConfigError as e:
    raise loop.SetupError(str(e)) from None
  _check_rl(config)
  reward = Reward(config.rl.reward)  # importable / present before any work
  config.train.steps = config.rl.iterations * steps_per_iteration(config)
  loop.check_workdir(workdir)
  for warning in warnings:
    print(f"warning: {warning}", file=sys.stderr, flush=True)
  workdir = os.path.abspath(workdir)
  with loop._StopSignal() as stop:  # pylint: disable=protected-access
    config = loop._resolve_start(config, workdir)  # pylint: disable=protected-access
    return _run(config, workdir, stop, overrides, reward)


def _run(config, workdir: str, stop, overrides, reward: Reward) -> dict[str, Any]:
  import parallel  # pylint: disable=g-import-not-at-top
  from data import chat as chat_lib  # pylint: disable=g-import-not-at-top
  from data import rl_prompts  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top

  parallel.distributed.initialize(config.distributed)
  r, ck = config.rl, config.checkpoint
  checkpoint_dir = os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)
  latest = loop._reconcile(config, checkpoint_dir, overrides)  # pylint: disable=protected-access
  if not config.train.init_from:
    raise loop.SetupError("train.rl starts from a trained model: set train.init_from or train.base_recipe")
  config_dict = loop._config_dict(config)  # pylint: disable=protected-access
  try:
    mesh = mesh_lib.make_mesh(config.mesh)
    trainer = step_lib.Trainer(config, mesh)
  except ValueError as e:
    raise loop.SetupError(str(e)) from None
  if latest is not None:
    loop._check_state_layout(trainer, checkpoint_dir, latest)  # pylint: disable=protected-access
    if jax.process_index() == 0:
      loop._restore_tokenizer_file(checkpoint_dir, latest, workdir)  # pylint: disable=protected-access
  try:
    tokenizer_path = tokenizer_lib.prepare(config, workdir)
    tokenizer = tokenizer_lib.load(tokenizer_path)
    template = chat_lib.make_template(config.data, tokenizer)
    prompts = rl_prompts.load(r.prompts, r.eval_fraction)
  except (ValueError, FileNotFoundError) as e:
    raise loop.SetupError(str(e)) from None
  _check_lengths(prompts, template, config)
  session = Session(config, trainer, mesh, tokenizer, template, prompts, reward)
  if latest is None:
    # with_model_params gives the frozen reference its own buffers (the step donates the state).
    session.state = trainer.with_model_params(trainer.init(config.train.seed),
                                              loop._init_from(trainer, config.train.init_from))  # pylint: disable=protected-access
  primary = jax.process_index() == 0
  if primary:
    loop._write_json(os.path.join(workdir, "config.json"), config_dict)  # pylint: disable=protected-access
  checkpointer = ckpt_lib.Checkpointer(checkpoint_dir, ck)
  if latest is not None:
    try:
      session.state, meta = checkpointer.restore(trainer.abstract_state(), None, step=latest)
    except ValueError as e:
      loop._close_checkpointer(checkpointer, raise_errors=False)  # pylint: disable=protected-access
      raise loop.TrainingError(f"cannot resume from {checkpointer.directory}/{latest}: {e}") from None
    session.kl_coef, session.bad_rewards = float(meta["rl"]["kl_coef"]), int(meta["rl"]["bad_rewards"])
    loop._print0(f"resumed from {checkpointer.directory}/{latest}")  # pylint: disable=protected-access
  else:
    loop._print0(f"{r.algorithm}: starting from {config.train.init_from}")  # pylint: disable=protected-access
  start = latest or 0
  tokenizer_entry = (ckpt_lib.encode_file(tokenizer_path) if os.path.isfile(tokenizer_path)
                     else {"directory": tokenizer_path})
  try:
    log = logger_lib.MetricLogger(workdir, config.log, total_steps=r.iterations, start_step=start,
                                  enabled=primary, run_config=config_dict)
  except ValueError as e:
    loop._close_checkpointer(checkpointer, raise_errors=False)  # pylint: disable=protected-access
    raise loop.SetupError(str(e)) from None

  def save(iteration: int) -> None:
    meta = {"config": config_dict, "mesh": dict(mesh.shape), loop.TOKENIZER_KEY: tokenizer_entry,
            loop.CHAT_TEMPLATE_KEY: template.jinja,
            "rl": {"kl_coef": session.kl_coef, "bad_rewards": session.bad_rewards,
                   "reference": config.train.init_from, "rollout_seed": r.seed}}
    checkpointer.save(iteration, session.state, None, meta)

  def evaluate(iteration: int) -> None:
    ev = session.evaluate()
    log.log(iteration, ev)
    summary["eval_reward_mean"] = ev["eval_reward_mean"]
    log.message(f"iteration {iteration}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))

  summary = {"iteration": start, "reward_mean": None, "eval_reward_mean": None, "stopped": None}
  finished = False
  try:
    if start == 0 and r.eval_every:
      evaluate(0)
    for iteration in range(start + 1, r.iterations + 1):
      metrics = session.iterate(iteration)
      if session.bad_rewards >= r.max_bad_rewards:
        raise loop.TrainingError(
            f"halting at iteration {iteration}: {session.bad_rewards} rewards raised or were not finite (first: "
            f"{(reward.failures or ['a non-finite value'])[0]}); fix rl.reward={r.reward!r}. rl.max_bad_rewards sets "
            "the limit")
      if metrics["nonfinite"] and not math.isfinite(metrics["loss"]):
        raise loop.TrainingError(f"halting at iteration {iteration}: every update was non-finite; lower train.lr")
      log.log(iteration, metrics)
      log.advance(iteration)
      summary.update(iteration=iteration, reward_mean=metrics["reward_mean"])
      if r.eval_every and (iteration % r.eval_every == 0 or iteration == r.iterations):
        evaluate(iteration)
      stopping = stop.should_stop(iteration)
      if (ck.every and iteration % ck.every == 0) or iteration == r.iterations or stopping:
        save(iteration)
      if stopping:
        summary["stopped"] = stop.reason()
        checkpointer.wait()
        log.message(f"{summary['stopped']}: stopped after iteration {iteration}; checkpoint saved to "
                    f"{checkpointer.directory}/{iteration}. Run the same command to resume.")
        break
    checkpointer.wait()
    finished = True
  except ckpt_lib.CheckpointError as e:
    raise loop.TrainingError(str(e)) from None
  finally:
    log.close()
    loop._close_checkpointer(checkpointer, raise_errors=finished)  # pylint: disable=protected-access
  if summary["stopped"] is None:
    loop._print0(f"done: iteration {summary['iteration']}, eval reward mean {summary['eval_reward_mean']}; "  # pylint: disable=protected-access
                 f"plot: python -m train.plot {workdir}")
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m train.rl`: exit 0 done (or stopped with a checkpoint), 1 training failed, 2 bad input."""
  import configs  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m train.rl", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default=None, help="run directory (default: runs/<config name>)")
  try:
    config, args = configs.parse(sys.argv[1:] if argv is None else argv, parser, default="grpo_tiny")
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  return train_main.run_in_workdir(run, config, args)


if __name__ == "__main__":
  sys.exit(main())
