"""`python -m train.rl` end to end on a small model: GRPO, PPO and best-of-N runs from a base run, the sampler's
log-probs against the training forward pass, resume after SIGKILL, bad rewards and bad input."""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import checkpoint_testing
import multihost_testing

import configs
import rl_testing
from chat_testing import TEXT
from data import tokenizer as tokenizer_lib
from train.core import loop
from train.rl import loop as rl
from train.rl import rollouts

BASE = """from configs import tiny
def get_config():
  c = tiny.get_config()
  c.model.update(vocab_size=320, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=64)
  c.train.update(steps=2, batch_size=8, seq_len=64, eval_every=0, log_every=1)
  c.data.update(tokenizer={tokenizer!r})
  c.log.progress = False
  return c
"""


def _records(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]



@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A tokenizer, a 2-step base run's recipe and a prompts file; the base run is made by the first RL run."""
  root = tmp_path_factory.mktemp("rl")
  tok = tokenizer_lib.train(TEXT, str(root / "tok.model"), 320)
  recipe = root / "base_small.py"
  recipe.write_text(BASE.format(tokenizer=tok))
  prompts = root / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(200)))
  return {"root": root, "recipe": str(recipe), "prompts": str(prompts), "tokenizer": tok}


def _config(base, algorithm, **overrides):
  recipe = {"ppo": "ppo_tiny", "grpo": "grpo_tiny", "best_of_n": "best_of_n_tiny", "gkd": "gkd_tiny"}[algorithm]
  values = {"model.vocab_size": 320, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
            "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": 64,
            "train.base_recipe": base["recipe"], "train.batch_size": 8, "train.seq_len": 48, "train.lr": 1e-3,
            "data.tokenizer": base["tokenizer"], "rl.prompts": base["prompts"], "rl.reward": "py:rl_testing:length", "rl.iterations": 3,
            "rl.prompts_per_iteration": 4, "rl.samples_per_prompt": 4 if algorithm != "ppo" else 2,
            "rl.max_new_tokens": 6, "rl.eval_every": 3, "rl.eval_prompts": 4, "checkpoint.every": 1,
            "checkpoint.keep": 5, "log.progress": False, "log.tensorboard": False, "train.eval_generations": 0,
            "rl.ptx_coef": 0.0, "rl.env": ""}
  if algorithm == "best_of_n":
    values.update({"rl.prompts_per_iteration": 8, "rl.eval_best_of": 3})
  if algorithm == "grpo":  # DAPO's pieces on DeepSeekMath's per-sequence loss, so the loop runs each of them
    values.update({"rl.loss": "grpo", "rl.clip_high": 0.28, "rl.dynamic_sampling": True,
                   "rl.dynamic_sampling_rounds": 2, "rl.overlong_buffer": 2})
  values.update(overrides)
  return configs.load(recipe, **values)


@pytest.fixture(scope="module")
def grpo_run(base):
  workdir = str(base["root"] / "runs" / "grpo")
  summary = rl.run(_config(base, "grpo", **{"train.eval_generations": 2}), workdir)
  return {"workdir": workdir, "summary": summary, "records": _records(workdir)}


@pytest.mark.slow
def test_grpo_run_logs_rewards_kl_and_consistent_logprobs(grpo_run):
  records = grpo_run["records"]
  train = [r for r in records if "reward_mean" in r]
  evals = [r for r in records if "eval_reward_mean" in r]
  assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [0, 3]
  for r in train:
    # the rewards are the completions' lengths / 10: between 0 and 6 tokens' worth of characters
    # (kl is the k1 estimate over the sampled sequences: unbiased for KL >= 0, but one batch's can be negative)
    assert 0 <= r["reward_mean"] and np.isfinite(r["kl"]) and r["nonfinite"] == 0
    assert r["logp_diff"] <= 1e-4  # the sampler's log-probs vs the training forward pass
    assert r["ratio_dev_first"] <= 1e-6  # old log-probs recomputed with the same pass: ratio 1 at first
  assert train[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
  assert any(r["kl"] > 1e-6 for r in train[1:])  # and moves away from it
  assert grpo_run["summary"]["iteration"] == 3
  for r in train:  # dynamic sampling's rounds and fillers, the first round's share of groups without a signal
    assert r["sampling_rounds"] in (1, 2) and 0 <= r["filled_groups"] <= 4 and 0 <= r["zero_std_fraction"] <= 1
    assert r["filled_groups"] == 0 or r["sampling_rounds"] == 2
    assert r["reward_shaped_mean"] <= r["reward_mean"]  # the overlong punishment only subtracts
  # train.eval_generations=2: what the run keeps of the SFT families it does not train, at every evaluation
  for r in evals:
    families = [v for k, v in r.items() if k.startswith("eval_exact_match/")]
    assert len(families) == 8  # the instruct task's four and data.tasks' four (sft_tiny's sources)
    assert all(v in (0.0, 0.5, 1.0) for v in families)  # 2 held-out prompts per family
    assert r["eval_exact_match"] == pytest.approx(np.mean(families))


@pytest.mark.slow
def test_ppo_run_trains_value_head_and_policy(base):
  workdir = str(base["root"] / "runs" / "ppo")
  rl.run(_config(base, "ppo", **{"rl.ptx_coef": 2.0}), workdir)  # with the recipe's held-in SFT rows
  train = [r for r in _records(workdir) if "reward_mean" in r]
  assert len(train) == 3
  for r in train:
    assert r["logp_diff"] <= 1e-4 and r["ratio_dev_first"] <= 1e-6 and r["nonfinite"] == 0
    assert 0 < r["ptx_nll"] < 20  # their answers' mean token NLL, beside the rollout rows
    assert np.isfinite(r["explained_variance"]) and r["value_loss"] > 0 and 0 <= r["clip_frac"] <= 1
  state = checkpoint_testing.saved(workdir, 3)
  assert ("params", "value_head") in state and ("frozen", "reference", "embed", "embedding") in state
  # the reference stays the starting model while the policy moves
  start = checkpoint_testing.saved(workdir, 1)
  key = ("params", "model", "embed", "embedding")
  assert not np.array_equal(state[key], start[key])
  assert np.array_equal(state[("frozen", "reference", "embed", "embedding")],
                        start[("frozen", "reference", "embed", "embedding")])


@pytest.mark.slow
def test_best_of_n_keeps_the_best_answers(base):
  workdir = str(base["root"] / "runs" / "bon")
  rl.run(_config(base, "best_of_n"), workdir)
  records = _records(workdir)
  train = [r for r in records if "reward_mean" in r]
  assert len(train) == 3
  for r in train:
    assert r["best_reward_mean"] >= r["reward_mean"]  # the kept answer is each prompt's best
  evals = [r for r in records if "eval_reward_mean" in r]
  assert all(r["eval_best_of_n_reward_mean"] >= r["eval_reward_mean"] - 0.3 for r in evals)


@pytest.mark.slow
def test_gkd_distills_the_teacher_on_the_students_own_samples(base):
  """rl.algorithm=gkd: a 3-layer teacher (a recipe made first) scores every token of the 2-layer student's own
  completions; the divergence on fresh samples falls over 6 iterations and the teacher stays frozen."""
  teacher = base["root"] / "teacher_small.py"
  teacher.write_text(BASE.format(tokenizer=base["tokenizer"]).replace("num_layers=2", "num_layers=3")
                     .replace("steps=2", "steps=20"))
  workdir = str(base["root"] / "runs" / "gkd")
  rl.run(_config(base, "gkd", **{"train.distill_teacher_recipe": str(teacher), "train.lr": 1e-2,
                                 "rl.iterations": 6, "rl.eval_every": 6}), workdir)
  train = [r for r in _records(workdir) if "distill_divergence" in r]
  assert len(train) == 6 and all(r["nonfinite"] == 0 and np.isfinite(r["reward_mean"]) for r in train)
  divergence = [r["distill_divergence"] for r in train]
  assert divergence[0] > 0 and np.mean(divergence[-2:]) < 0.8 * np.mean(divergence[:2]), divergence
  first, last = checkpoint_testing.saved(workdir, 2), checkpoint_testing.saved(workdir, 6)  # checkpoint.keep=5
  key = ("frozen", "teacher", "embed", "embedding")
  assert np.array_equal(first[key], last[key])
  assert first[("frozen", "teacher", "layers", "attn", "q")].shape[0] == 3  # the teacher's own 3 layers


@pytest.mark.slow
def test_rollouts_through_the_engine_equal_the_static_sampler(base):
  """rl.engine=True (model.engine: continuous batching over a paged cache) against model.generate's static batch:
  the engine draws each row with the static sampler's keys, so the same seeds give the same rollouts, rewards,
  training step and held-out evaluation."""
  records = {}
  for engine in (False, True):
    workdir = str(base["root"] / "runs" / f"bon_engine_{engine}")
    rl.run(_config(base, "best_of_n", **{"rl.engine": engine, "rl.iterations": 1, "rl.eval_every": 1,
                                          "rl.eval_best_of": 0, "rl.prompts_per_iteration": 8,
                                          "rl.samples_per_prompt": 2, "rl.max_new_tokens": 4}), workdir)
    records[engine] = _records(workdir)
  keys = ("reward_mean", "completion_length", "eos_fraction", "best_reward_mean", "loss", "eval_reward_mean")
  pick = lambda rs: [{k: r[k] for k in keys if k in r} for r in rs if any(k in r for k in keys)]
  assert pick(records[True]) == pick(records[False]) and len(pick(records[True])) == 3  # evals 0 and 1, one step


def test_best_of_n_choice_breaks_ties_by_the_seed():
  """`_best_of_n_batch` keeps the highest reward; equal rewards are settled by the iteration's seed alone."""
  class Fake:
    config = configs.load("best_of_n_tiny", **{"rl.samples_per_prompt": 3, "train.seq_len": 8})
  roll = {"shaped": np.array([0.1, 0.9, 0.9, np.nan, 0.2, 0.1]), "valid": np.array([1, 1, 1, 0, 1, 1], bool),
          "raw": np.array([0.1, 0.9, 0.9, np.nan, 0.2, 0.1]), "prompt_ids": [[1, 2]] * 6,
          "tokens": [[3], [4], [5], [6], [7], [8]]}
  picks = []
  for iteration in range(20):
    metrics = {}
    batch = rollouts.Session._best_of_n_batch(Fake(), roll, iteration, metrics)
    picks.append(int(batch["targets"][0, 1]))
    assert int(batch["targets"][1, 1]) == 7 and metrics["best_reward_mean"] == pytest.approx(0.55)
    again = rollouts.Session._best_of_n_batch(Fake(), roll, iteration, {})
    assert int(again["targets"][0, 1]) == picks[-1]
  assert set(picks) == {4, 5}


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_exact(base, grpo_run):
  """A run killed (SIGKILL) after its first checkpoint and restarted ends with the same parameters, rewards and
  KL as the uninterrupted run."""
  workdir = str(base["root"] / "runs" / "grpo_killed")
  _kill_after_first_checkpoint_and_resume(base, "grpo_small", _config_overrides(base), workdir)
  want, got = checkpoint_testing.saved(grpo_run["workdir"], 3), checkpoint_testing.saved(workdir, 3)
  assert got.keys() == want.keys()
  for k in want:
    assert np.array_equal(got[k], want[k]), k
  pick = lambda records: [(r["step"], r.get("reward_mean"), r.get("kl"), r.get("eval_reward_mean")) for r in records]
  assert pick(_records(workdir)) == pick(grpo_run["records"])


def assert_exists(path):
  assert os.path.exists(path), path


def _kill_after_first_checkpoint_and_resume(base, name, overrides, workdir, after_kill=lambda: None):
  """`python -m train.rl` on grpo_tiny with `overrides` in `workdir`: SIGKILLed once checkpoint 1 exists, then
  (after `after_kill()`) run again to the end."""
  config_file = base["root"] / f"{name}.py"
  config_file.write_text("import configs\ndef get_config():\n  return configs.load('grpo_tiny', **%r)\n" % overrides)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.path.dirname(__file__)]), JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "train.rl", f"--config={config_file}", f"--workdir={workdir}"]
  proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 600
  while not os.path.isdir(os.path.join(workdir, "checkpoints", "1")) and time.time() < deadline:
    assert proc.poll() is None, proc.stderr.read().decode()
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  after_kill()
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr


def _config_overrides(base):
  """The grpo fixture's overrides as a dict (so a subprocess loads the same config)."""
  config = _config(base, "grpo")
  reference = configs.load("grpo_tiny")
  out = {}
  for section in ("model", "train", "data", "rl", "checkpoint", "log"):
    for key, value in config[section].items():
      if value != reference[section][key]:
        out[f"{section}.{key}"] = value
  return out


@pytest.mark.slow
def test_bad_rewards_are_dropped_counted_and_halt_the_run(base, grpo_run):
  del grpo_run  # (the base run exists)
  rl_testing.CALLS.update(flaky=0, bad=0)
  workdir = str(base["root"] / "runs" / "flaky")
  rl.run(_config(base, "grpo", **{"rl.reward": "py:rl_testing:flaky", "rl.max_bad_rewards": 1000,
                                  "rl.iterations": 2, "rl.eval_every": 0, "rl.dynamic_sampling": False}), workdir)
  train = [r for r in _records(workdir) if "reward_mean" in r]
  # calls 0..15 and 16..31: those with i % 5 in (0, 1) are bad, 7 in each iteration
  assert rl_testing.CALLS["flaky"] == 32 and train[-1]["bad_rewards_total"] == rl_testing.CALLS["bad"] == 14
  assert [r["bad_rewards"] for r in train] == [7, 7] and all(np.isfinite(r["loss"]) for r in train)
  rl_testing.CALLS.update(flaky=0, bad=0)
  with pytest.raises(loop.TrainingError, match="rl.max_bad_rewards"):
    rl.run(_config(base, "grpo", **{"rl.reward": "py:rl_testing:flaky", "rl.max_bad_rewards": 5,
                                    "rl.eval_every": 0}), str(base["root"] / "runs" / "halted"))


@pytest.mark.slow
def test_bad_input_exits_2_and_writes_nothing(base, grpo_run, capsys):
  del grpo_run
  cases = [
      ({"rl.reward": f"rm:{base['root']}/no_such_run"}, "no reward-model run directory"),
      ({"rl.reward": "py:rl_testing:no_such_function"}, "cannot load no_such_function"),
      ({"rl.max_new_tokens": 40}, "exceeds train.seq_len"),
      ({"train.objective": "sft"}, "--config.train.objective=grpo"),
      ({"rl.loss": "ppo2"}, "rl.loss='ppo2' must be one of grpo, dr_grpo, dapo, gspo"),
      ({"rl.overlong_buffer": 6}, "rl.overlong_buffer=6 must be below rl.max_new_tokens=6"),
  ]
  for overrides, message in cases:
    workdir = base["root"] / "runs" / "bad"
    config = _config(base, "grpo", **overrides)
    with pytest.raises(loop.SetupError, match=message):
      rl.run(config, str(workdir))
    assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()
  assert rl.main([f"--workdir={base['root']}/runs/bad2", "--config.rl.env=",
                  "--config.rl.reward=rm:/nonexistent/run"]) == 2
  assert "no reward-model run directory" in capsys.readouterr().err
  # grpo_tiny's environment gives the rewards: a reward set beside it is refused, naming both keys
  assert rl.main([f"--workdir={base['root']}/runs/bad2", "--config.rl.reward=rm:/nonexistent/run"]) == 2
  assert "rl.reward='rm:/nonexistent/run' has no effect unless rl.env is empty" in capsys.readouterr().err
  assert rl.main([f"--workdir={base['root']}/runs/bad2", "--config.rl.env=py:nowhere:Env"]) == 2
  assert "rl.env='py:nowhere:Env': cannot load Env from module nowhere" in capsys.readouterr().err
  assert not os.path.exists(f"{base['root']}/runs/bad2/config.json")


def test_greater_reward_and_prompt_files(tmp_path):
  from data import rl_prompts
  prompt = "Write a number greater than 4321."
  cases = {"4322": 1.0, " 99999\n": 1.0, "4321": 0.0, "04322": 0.0, "-5000": 0.0, "5000 apples": 0.0, "": 0.0}
  assert {c: rl_prompts.greater_reward(prompt, c) for c in cases} == cases
  with pytest.raises(ValueError, match="not a builtin:greater prompt"):
    rl_prompts.greater_reward("Say hi.", "1")
  split = rl_prompts.load("builtin:greater", 0.05)
  assert not {s[0]["content"] for s in split["train"]} & {s[0]["content"] for s in split["eval"]}
  assert 0.03 < len(split["eval"]) / rl_prompts.GREATER_SIZE < 0.07
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n{"completion": "c"}\n')
  with pytest.raises(ValueError, match="p.jsonl line 3"):
    rl_prompts.load(str(path), 0.5)
  with pytest.raises(ValueError, match="no such file"):
    rl_prompts.load(str(tmp_path / "missing.jsonl"), 0.5)


@pytest.mark.parametrize("algorithm", ["grpo", "best_of_n"])
def test_ptx_rows_are_held_in_answers_appended_to_the_minibatch(base, algorithm):
  """rl.ptx_coef = 1.5: each minibatch of B rollout rows gets B conversations of data.sources' chat sources from
  their training split appended, none of whose prompts is an RL prompt (here the calculator task's, whose chat
  conversations are then all left out). On them the scored tokens are exactly the assistant turns' tokens and
  their end-of-turn markers (ptx_mask for PPO / GRPO, loss_mask = 1.5 for best-of-N's SFT objective); no rollout
  key is set."""
  from data import chat as chat_lib
  from data import rl_prompts
  config = _config(base, algorithm, **{"rl.ptx_coef": 1.5})
  tokenizer = tokenizer_lib.load(base["tokenizer"])
  template = chat_lib.make_template(config.data, tokenizer)
  rl_split = rl_prompts.load("builtin:calculator", 0.05)
  session = rollouts.Session(config, None, None, tokenizer, template, rl_split, None)
  keys = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "old_logp", "advantages", "ptx_mask")
  chunk = {k: np.full((8, 48), 7, np.float32 if k in ("loss_mask", "old_logp", "advantages", "ptx_mask") else
                      np.int32) for k in keys}
  out = session._with_ptx(chunk, 3, 0)  # pylint: disable=protected-access
  assert all(v.shape == (16, 48) and np.all(v[:8] == 7) for v in out.values())
  held_out = {item.messages[0]["content"] for item in chat_lib.eval_items(config.data, per_family=10**6)}
  rl_texts = {c[-1]["content"] for split in rl_split.values() for c in split}
  assert session.ptx_pool and not any(c[0]["content"] in rl_texts for c in session.ptx_pool)
  assert not any(c[0]["content"].startswith("Calculate ") for c in session.ptx_pool)
  for i in range(8, 16):
    scored = out["ptx_mask"][i] if algorithm == "grpo" else out["loss_mask"][i] / 1.5
    assert set(np.unique(scored)) <= {0.0, 1.0} and scored.any()
    if algorithm == "grpo":
      assert not out["loss_mask"][i].any() and not out["advantages"][i].any() and not out["old_logp"][i].any()
    length = int(out["segment_ids"][i].sum())  # the conversation whose rendering the row holds
    conversation = next(c for c in session.ptx_pool
                        if template.render(c)[0][1:length + 1] == list(out["targets"][i][:length]))
    assert conversation[0]["content"] not in held_out
    # the assistant turns' tokens with their end-of-turn markers (cut where the row is cut at train.seq_len)
    ids, flags = template.render(conversation)
    assert list(out["targets"][i][scored > 0]) == [t for t, f in zip(ids[1:length + 1], flags[1:length + 1]) if f]


@pytest.mark.slow
def test_multi_turn_episodes_mask_the_environment_and_score_like_one_forward(base, grpo_run, monkeypatch):
  """rl.env with a two-turn environment, every token a stop token so each policy turn is one token: the training
  batch has loss weight on exactly the two policy tokens of each row and none on the observation turn between
  them, and the sampler's turn-by-turn log-probs equal the scoring forward pass over the whole transcript
  (logp_diff); the environment's named reward parts are logged."""
  del grpo_run  # (the base run exists)
  captured, init, train = [], rollouts.Session.__init__, rollouts.Session.train

  def every_token_stops(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.stop_ids = tuple(range(self.tokenizer.vocab_size))

  monkeypatch.setattr(rollouts.Session, "__init__", every_token_stops)
  monkeypatch.setattr(rollouts.Session, "train", lambda self, batch, i: captured.append(batch) or train(self, batch, i))
  workdir = str(base["root"] / "runs" / "episodes")
  rl.run(_config(base, "grpo", **{"rl.env": "py:rl_testing:EchoEnv", "rl.iterations": 1, "rl.eval_every": 1,
                                  "rl.dynamic_sampling": False, "rl.overlong_buffer": 0}), workdir)
  train_record = next(r for r in _records(workdir) if "reward_mean" in r)
  assert train_record["turns_mean"] == 2 and train_record["logp_diff"] <= 1e-4
  assert train_record["reward_done_mean"] == 1.0 and train_record["reward_mean"] == pytest.approx(1.0)
  assert next(r for r in _records(workdir) if "eval_turns_mean" in r)["eval_turns_mean"] == 2
  tok = tokenizer_lib.load(base["tokenizer"])
  observation = tok.encode(rl_testing.EchoEnv.OBSERVATION)
  batch = captured[0]
  for row_targets, row_mask, segments in zip(batch["targets"], batch["loss_mask"], batch["segment_ids"]):
    real = row_targets[segments > 0]
    weighted = np.flatnonzero(row_mask)
    assert len(weighted) == 2 and weighted[1] > weighted[0] + len(observation)  # two turns, the observation between
    between = list(real[weighted[0] + 1:weighted[1]])
    assert any(between[j:j + len(observation)] == observation for j in range(len(between)))
    assert weighted[1] == np.flatnonzero(segments)[-1]  # the last target is the second policy token


def _async(base, **overrides):
  return _config(base, "grpo", **{"rl.dynamic_sampling": False, "rl.eval_every": 0, **overrides})


@pytest.mark.slow
def test_async_rollouts_without_staleness_equal_the_synchronous_loop(base, grpo_run):
  """rl.async_rollouts with rl.max_staleness=0 samples iteration i with the policy after i - 1 updates, as the
  synchronous loop does: the same rewards, losses and final parameters, bit for bit."""
  del grpo_run
  runs = {}
  for name, extra in (("sync", {}), ("async0", {"rl.async_rollouts": True, "rl.max_staleness": 0})):
    workdir = str(base["root"] / "runs" / name)
    rl.run(_async(base, **extra), workdir)
    runs[name] = ([(r["step"], r["reward_mean"], r["loss"]) for r in _records(workdir) if "loss" in r],
                  checkpoint_testing.saved(workdir, 3))
  assert runs["sync"][0] == runs["async0"][0]
  for k, v in runs["sync"][1].items():
    assert np.array_equal(v, runs["async0"][1][k]), k


ASYNC1 = {"rl.async_rollouts": True, "rl.max_staleness": 1, "rl.rollout_devices": 4, "rl.tis_cap": 1.5}


@pytest.fixture(scope="module")
def async1_run(base, grpo_run):
  """max_staleness=1 with 4 of the 8 devices sampling, the other 4 training: the run directory and its stdout."""
  del grpo_run  # (the base run exists)
  workdir = str(base["root"] / "runs" / "async1")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rl.run(_async(base, **ASYNC1), workdir)
  return {"workdir": workdir, "stdout": out.getvalue()}


@pytest.mark.slow
def test_async_rollouts_on_their_own_devices_lag_one_version_and_resume_exactly(base, async1_run):
  """max_staleness=1 with 4 of the 8 devices sampling (training on the other 4): iteration i >= 2 trains on
  rollouts of the policy one update older (policy_lag 1) with truncated importance weights logged; a run killed
  after its first checkpoint and restarted reloads the rollouts made ahead and ends exactly as the uninterrupted
  one."""
  extra, workdir = ASYNC1, async1_run["workdir"]
  train = [r for r in _records(workdir) if "loss" in r]
  assert [r["policy_lag"] for r in train] == [0, 1, 1]
  for r in train:
    assert 0 < r["tis_weight_mean"] <= 1.5 and 0 <= r["tis_clip_frac"] <= 1 and r["nonfinite"] == 0
  assert train[0]["tis_weight_mean"] == 1.0 and train[1]["tis_weight_mean"] != 1.0  # weights only where it lagged
  assert ("mesh data=4 fsdp=1 tensor=1 sequence=1 expert=1 stage=1 (4 devices) training, data=4 fsdp=1 tensor=1 "
          "sequence=1 expert=1 stage=1 (4 devices) sampling") in async1_run["stdout"]
  killed = str(base["root"] / "runs" / "async1_killed")
  overrides = {**_config_overrides(base), "rl.dynamic_sampling": False, "rl.eval_every": 0, **extra}
  made_ahead = os.path.join(killed, "rollouts", "1.pkl")  # iteration 2's rollouts, saved with checkpoint 1
  _kill_after_first_checkpoint_and_resume(base, "async1", overrides, killed,
                                          lambda: assert_exists(made_ahead))
  want, got = checkpoint_testing.saved(workdir, 3), checkpoint_testing.saved(killed, 3)
  for k in want:
    assert np.array_equal(got[k], want[k]), k
  pick = lambda records: [(r["step"], r.get("reward_mean"), r.get("loss")) for r in records if "loss" in r]
  assert pick(_records(killed)) == pick(_records(workdir))


@pytest.mark.slow
def test_two_processes_split_into_rollout_and_training_meshes_match_one_and_resume(base, async1_run):
  """2 processes x 4 devices (jax.distributed on localhost), each keeping 2 devices for sampling (a mesh of its own)
  and training on the other 2 (one mesh over both processes), the worker and the learner running concurrently.
  Killed (SIGKILL, both processes) after the first checkpoint and restarted, the run ends as the one-process 4 + 4
  run does: the same rewards and policy lags every iteration (the rollouts made ahead were reloaded, not remade),
  losses and final parameters within float32 reduction-order noise."""
  workdir = str(base["root"] / "runs" / "async1_2proc")
  # Evaluations (iterations 0 and 3) sample on the training mesh, across the processes.
  overrides = {**_config_overrides(base), "rl.dynamic_sampling": False, "rl.eval_every": 3, **ASYNC1,
               "rl.rollout_devices": 2}
  config_file = base["root"] / "async1_2proc.py"
  config_file.write_text("import configs\ndef get_config():\n  return configs.load('grpo_tiny', **%r)\n" % overrides)
  args = [f"--config={config_file}", f"--workdir={workdir}"]
  with multihost_testing.processes("train.rl", args) as procs:
    deadline = time.time() + 400
    while not os.path.isdir(os.path.join(workdir, "checkpoints", "1")):
      assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate()[1][-3000:]
                                                                                for p in procs]
      time.sleep(0.2)
    for p in procs:
      p.send_signal(signal.SIGKILL)
      p.wait()
  assert os.path.exists(os.path.join(workdir, "rollouts", "1.pkl"))  # iteration 2's, made ahead
  with multihost_testing.processes("train.rl", args) as procs:
    outputs = multihost_testing.outputs(procs, timeout=400)
  assert "(4 devices) training, " in outputs[0][0] and "(2 devices) sampling" in outputs[0][0]  # each its own
  evaluations = [r for r in _records(workdir) if "eval_reward_mean" in r]
  assert [r["step"] for r in evaluations] == [0, 3] and all(np.isfinite(r["eval_reward_mean"]) for r in evaluations)
  got = [r for r in _records(workdir) if "loss" in r]
  want = [r for r in _records(async1_run["workdir"]) if "loss" in r]
  assert [(r["step"], r["reward_mean"], r["policy_lag"]) for r in got] == [
      (r["step"], r["reward_mean"], r["policy_lag"]) for r in want]
  for key in ("loss", "tis_weight_mean", "kl"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5, atol=1e-7, err_msg=key)
  final, reference = checkpoint_testing.saved(workdir, 3), checkpoint_testing.saved(async1_run["workdir"], 3)
  assert final.keys() == reference.keys()
  for k in reference:
    np.testing.assert_allclose(final[k], reference[k], rtol=1e-5, atol=1e-6, err_msg=str(k))


def test_async_rollouts_on_several_processes_need_their_own_devices(base, monkeypatch):
  """Sharing the training devices, two threads' collectives could interleave differently on each process: refused."""
  import jax  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  run = type("Run", (), {"config": _async(base, **{"rl.async_rollouts": True, "rl.rollout_devices": 0})})()
  with pytest.raises(loop.SetupError, match="rl.rollout_devices"):
    rl._split_devices(run)  # pylint: disable=protected-access
