"""Reinforcement learning from feedback behind `python -m train.rl`: PPO, GRPO and rejection sampling.

`python -m train.rl [--config=grpo_tiny] [--config.rl.KEY=VALUE ...] [--workdir=runs/<config name>]`

One iteration (rl.algorithm):
  ppo        sample rl.prompts_per_iteration x rl.samples_per_prompt completions with the shared sampler
             (model.generate.sample, temperature rl.temperature); score them (rl.reward); recompute the old
             log-probs, the reference's log-probs and the values with the training forward pass (so the ratio is 1
             at the first epoch; the sampler's own log-probs are compared with them: `logp_diff`); per-token reward
             -kl_coef * (logp - ref_logp) plus the score at the final token; GAE; whitened advantages; rl.epochs
             passes of minibatches (train.batch_size rows) of the `ppo` objective (train/objectives/ppo.py).
  grpo       the same rollouts in groups of G = rl.samples_per_prompt per prompt, group-normalised advantages
             (rl.scale_rewards), the `grpo` objective (clipped, k3 KL to the reference when rl.kl_coef > 0;
             rl.loss = grpo | dr_grpo | dapo | gspo, train/objectives/grpo.py); no critic. With
             rl.dynamic_sampling (DAPO) groups whose rewards are all equal are dropped and more prompts sampled,
             up to rl.dynamic_sampling_rounds rounds, until rl.prompts_per_iteration groups carry a signal.
  best_of_n  K = rl.samples_per_prompt samples per prompt, the best by reward kept (ties broken by a draw from
             the iteration's seed), rl.epochs passes of the `sft` objective on the kept answers (one round).
  gkd        on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models", GKD with
             lambda = 1): the same rollouts from the student, rl.epochs passes of the `distill` objective
             (train/objectives/distill.py) on their completion tokens against the frozen teacher
             (train.distill_teacher / distill_teacher_recipe); the reward is reported, not trained on.
Multi-turn episodes (rl.env, train/rl/env.py and episodes.py): the policy's turns alternate with an environment's
observations (user turns, no loss) for up to rl.max_turns turns; the environment's rewards replace rl.reward.
Rewards: `py:MODULE:FUNCTION` called with (prompt text, completion text) -> float, or `rm:RUN`, a reward-model
run scored through `train.rundir.reward.load_scorer` on the conversation + completion as a chat record. A reward
that raises or is not finite drops its sample (zero loss mask) and is counted (`bad_rewards`); the run halts once
rl.max_bad_rewards have been counted. Optional penalties: rl.length_penalty per token, rl.missing_eos_penalty,
DAPO's soft overlong punishment (rl.overlong_buffer); rl.mask_truncated trains on no completion that was cut off.
Rewards live in train/rl/rewards.py, rollouts and the updates on them (the Session) in train/rl/rollouts.py.

The run directory is `python -m train`'s, set up by the same steps (train/core/setup.py): config.json,
metrics.jsonl, TensorBoard, progress bar, orbax checkpoints at iteration boundaries (the Trainer's state: policy,
value head, optimizer, frozen reference; metadata: the reference's source, the KL coefficient, the bad-reward
count, the rollout seed), SIGTERM/SIGINT -> checkpoint and exit 0, the same command resumes. Every random draw of
iteration i comes from seeds derived from (rl.seed, i), so a resumed run repeats an uninterrupted one exactly.
Without train.init_from the run starts from train.base_recipe's run (setup.resolve_start). Exit codes as
`python -m train`.
"""
from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
from typing import Any, Sequence

if __name__ == "__main__":  # pin the platform as `python -m train` does, before JAX is imported
  from train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  train_main._default_platform()  # pylint: disable=protected-access

import ml_collections  # pylint: disable=g-import-not-at-top,wrong-import-position

from train.core import loop  # pylint: disable=wrong-import-position
from train.core import setup  # pylint: disable=wrong-import-position
from train.rl import rewards  # pylint: disable=wrong-import-position
from train.rl import rollouts  # pylint: disable=wrong-import-position

OBJECTIVE = {"ppo": "ppo", "grpo": "grpo", "best_of_n": "sft", "gkd": "distill"}  # rl.algorithm -> train.objective


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
  from train.objectives import policy  # pylint: disable=g-import-not-at-top
  if r.loss not in policy.LOSSES:
    raise loop.SetupError(f"rl.loss={r.loss!r} must be one of {', '.join(policy.LOSSES)}")
  if r.scale_rewards not in ("auto", "group", "batch", "none"):
    raise loop.SetupError(f"rl.scale_rewards={r.scale_rewards!r} must be auto, group, batch or none")
  if r.overlong_buffer >= r.max_new_tokens:
    raise loop.SetupError(f"rl.overlong_buffer={r.overlong_buffer} must be below rl.max_new_tokens="
                          f"{r.max_new_tokens} (the punishment ramps over the last overlong_buffer tokens)")
  if r.async_rollouts and r.algorithm not in ("ppo", "grpo"):
    raise loop.SetupError(f"rl.async_rollouts supports rl.algorithm ppo and grpo (their importance weights correct "
                          f"for the sampler's lag), not {r.algorithm}; set --config.rl.async_rollouts=False")
  if r.async_rollouts and r.dynamic_sampling:
    raise loop.SetupError("rl.dynamic_sampling's extra rounds sample with the learner's policy, which asynchronous "
                          "rollouts do not hold still; set rl.dynamic_sampling=False or rl.async_rollouts=False")
  if r.algorithm == "grpo" and r.samples_per_prompt < 2:
    raise loop.SetupError("rl.algorithm=grpo needs rl.samples_per_prompt >= 2 (a group to normalise within)")
  if t.lora_rank:
    raise loop.SetupError("train.rl does not support train.lora_rank > 0 yet; set --config.train.lora_rank=0")
  import configs  # pylint: disable=g-import-not-at-top
  try:  # keys only `python -m train` reads (its evaluations) do nothing here
    for warning in configs.validate.check_conditional(config, command="rl"):
      print(f"warning: {warning}", file=sys.stderr, flush=True)
  except configs.ConfigError as e:
    raise loop.SetupError(str(e)) from None


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
  config, warnings = setup.validated(config, overrides)
  _check_rl(config)
  reward = rewards.Reward(config.rl.reward)  # importable / present before any work
  from train.rl import env as env_lib  # pylint: disable=g-import-not-at-top
  try:
    make_env = env_lib.factory(config.rl.env) if config.rl.env else None
  except ValueError as e:
    raise loop.SetupError(str(e)) from None
  config.train.steps = config.rl.iterations * steps_per_iteration(config)
  return setup.launch(config, workdir, warnings, lambda c, w, stop: _run(c, w, stop, overrides, reward, make_env),
                      train_base=loop.run)


def _run(config, workdir: str, stop: setup.StopSignal, overrides, reward: rewards.Reward,
         make_env=None) -> dict[str, Any]:
  """`run` once the workdir is known to be writable and the signal handlers are in place: the set-up steps of
  `python -m train` (train/core/setup.py), the prompts and the Session, then the iterations."""
  from data import chat as chat_lib  # pylint: disable=g-import-not-at-top
  from data import rl_prompts  # pylint: disable=g-import-not-at-top
  r = config.rl
  run = setup.settle(config, workdir, overrides)
  if not config.train.init_from:
    raise loop.SetupError("train.rl starts from a trained model: set train.init_from or train.base_recipe")
  rollout_mesh = _split_devices(run)
  setup.build_trainer(run)
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  setup.print0(f"mesh {mesh_lib.describe(run.mesh)} training" + (
      f", {mesh_lib.describe(rollout_mesh)} sampling" if rollout_mesh is not None else ""))
  setup.resolve_data(run)  # a tokenizer trained here reads config.data's sources
  setup.check_resume(run)
  setup.load_tokenizer(run)
  try:
    run.template = chat_lib.make_template(config.data, run.tokenizer)
    prompts = rl_prompts.load(r.prompts, r.eval_fraction)
  except (ValueError, FileNotFoundError) as e:
    raise loop.SetupError(str(e)) from None
  _check_lengths(prompts, run.template, config)
  session = rollouts.Session(config, run.trainer, run.mesh, run.tokenizer, run.template, prompts, reward)
  session.env_factory = make_env
  session.state = setup.init_state(run)  # None when resuming: restored below
  setup.write_config(run)
  setup.open_checkpoints(run)
  if run.latest is not None:
    session.state, meta = setup.restore(run)
    session.kl_coef, session.bad_rewards = float(meta["rl"]["kl_coef"]), int(meta["rl"]["bad_rewards"])
  else:
    setup.print0(f"{r.algorithm}: starting from {config.train.init_from}")
  setup.open_log(run, r.iterations)
  if r.async_rollouts:
    from train.rl import async_rollouts  # pylint: disable=g-import-not-at-top
    session.worker = async_rollouts.Worker(session, run.start, r.iterations, _load_pending(run), rollout_mesh)
    session.worker.publish(run.start, session.state)
  try:
    summary = _iterate(run, session, stop)
  finally:
    if session.worker is not None:
      session.worker.close()
  if summary["stopped"] is None:
    setup.print0(f"done: iteration {summary['iteration']}, eval reward mean {summary['eval_reward_mean']}; "
                 f"plot: python -m train.plot {workdir}")
  return summary


def _iterate(run: setup.Run, session: rollouts.Session, stop: setup.StopSignal) -> dict[str, Any]:
  """Iterations run.start + 1 .. rl.iterations (or up to a stop signal): metrics, evaluations, checkpoints at
  iteration boundaries; returns the run's summary (see `run`)."""
  config, r, ck = run.config, run.config.rl, run.config.checkpoint
  summary = {"iteration": run.start, "reward_mean": None, "eval_reward_mean": None, "stopped": None}

  def save(iteration: int) -> None:
    if session.worker is not None:  # the rollouts made ahead of the learner, so a resume repeats them
      _save_pending(run, iteration, session.worker.pending(iteration))
    run.save(iteration, session.state, None, {"rl": {
        "kl_coef": session.kl_coef, "bad_rewards": session.bad_rewards, "reference": config.train.init_from,
        "rollout_seed": r.seed}})

  def evaluate(iteration: int) -> None:
    ev = session.evaluate()
    run.log.log(iteration, ev)
    summary["eval_reward_mean"] = ev["eval_reward_mean"]
    run.log.message(f"iteration {iteration}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))

  with run.training():
    if run.start == 0 and r.eval_every:
      evaluate(0)
    for iteration in range(run.start + 1, r.iterations + 1):
      metrics = session.iterate(iteration)
      _check_halt(session, iteration, metrics)
      run.log.log(iteration, metrics)
      run.log.advance(iteration)
      summary.update(iteration=iteration, reward_mean=metrics["reward_mean"])
      if r.eval_every and (iteration % r.eval_every == 0 or iteration == r.iterations):
        evaluate(iteration)
      stopping = stop.should_stop(iteration)
      if (ck.every and iteration % ck.every == 0) or iteration == r.iterations or stopping:
        save(iteration)
      if session.worker is not None and not stopping:  # only now: the worker is idle until it has this version
        session.worker.publish(iteration, session.state)
      if stopping:
        summary["stopped"] = run.stopped(stop, "iteration", iteration)
        break
  return summary


def _split_devices(run: setup.Run):
  """With rl.async_rollouts and rl.rollout_devices = k: the training mesh on the other devices (run.devices) and
  the rollout mesh (data parallel) on the last k of every process's; None otherwise (rollouts on the training
  mesh)."""
  r = run.config.rl
  import jax  # pylint: disable=g-import-not-at-top
  if r.async_rollouts and not r.rollout_devices and jax.process_count() > 1:
    raise loop.SetupError(f"rl.async_rollouts with {jax.process_count()} processes needs a rollout mesh of its own: "
                          "set rl.rollout_devices to the devices per process that sample (e.g. half of them); "
                          "sharing the training devices, the sampler's and the learner's collectives could "
                          "interleave differently on each process and hang")
  if not (r.async_rollouts and r.rollout_devices):
    return None
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.rl import async_rollouts  # pylint: disable=g-import-not-at-top
  try:
    run.devices, rollout_devices = async_rollouts.split_devices(r.rollout_devices)
    sampler_mesh = ml_collections.ConfigDict({k: 1 for k in run.config.mesh if k != "rules"})
    sampler_mesh.update(data=-1, dcn_data=-1)
    return mesh_lib.make_mesh(sampler_mesh, rollout_devices)
  except ValueError as e:
    raise loop.SetupError(str(e)) from None


def _pending_path(run: setup.Run, iteration: int) -> str:
  return os.path.join(run.workdir, "rollouts", f"{iteration}.pkl")


def _save_pending(run: setup.Run, iteration: int, pending) -> None:
  """Writes the rollouts made ahead of iteration `iteration` (atomically, process 0) and drops those of
  iterations with no checkpoint left."""
  from train.rl import async_rollouts  # pylint: disable=g-import-not-at-top
  if not run.primary:
    return
  path = _pending_path(run, iteration)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "wb") as f:
    pickle.dump(async_rollouts.encode(pending), f)
  os.replace(path + ".tmp", path)
  kept = set(os.listdir(run.checkpoint_dir)) if os.path.isdir(run.checkpoint_dir) else set()
  for name in os.listdir(os.path.dirname(path)):
    step = name.split(".")[0]
    if step.isdigit() and int(step) < iteration and step not in kept:
      os.remove(os.path.join(os.path.dirname(path), name))


def _load_pending(run: setup.Run) -> dict:
  """The rollouts saved with the checkpoint resumed from ({} for a fresh run or a checkpoint without them)."""
  if run.latest is None or not os.path.exists(_pending_path(run, run.latest)):
    return {}
  with open(_pending_path(run, run.latest), "rb") as f:
    return pickle.load(f)


def _check_halt(session: rollouts.Session, iteration: int, metrics: dict[str, float]) -> None:
  """TrainingError once rl.max_bad_rewards rewards have failed, or when every update of the iteration was
  non-finite."""
  r = session.config.rl
  if session.bad_rewards >= r.max_bad_rewards:
    raise loop.TrainingError(
        f"halting at iteration {iteration}: {session.bad_rewards} rewards raised or were not finite (first: "
        f"{(session.reward.failures or ['a non-finite value'])[0]}); fix rl.reward={r.reward!r}. rl.max_bad_rewards "
        "sets the limit")
  if metrics["nonfinite"] and not math.isfinite(metrics["loss"]):
    raise loop.TrainingError(f"halting at iteration {iteration}: every update was non-finite; lower train.lr")


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
