"""Start-up of `python -m train` against what is already on disk: a resumed run's saved model config, its
learning-rate horizon, `train.init_from`'s model config, bad data sources. Every refused start exits 2, names
the keys, and writes neither config.json nor checkpoints/.

One 4-step run is trained once (module fixture) and copied by each test that resumes it.
"""
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from data import tokenizer as tokenizer_lib
from model import hf
from train import __main__ as train_main
from train.core import loop
from train.core import setup
from train.rundir import runconfig

SMALL = {"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2,
         "model.head_dim": 16, "model.mlp_dim": 128, "model.vocab_size": 512, "model.max_seq_len": 64,
         "train.seq_len": 64, "train.batch_size": 8, "train.steps": 4, "train.warmup_steps": 2, "train.lr": 1e-2,
         "train.min_lr_ratio": 0.1, "train.log_every": 1, "train.eval_every": 0, "checkpoint.every": 2,
         "log.progress": False, "log.tensorboard": False}


def _config(tokenizer, **extra):
  return configs.load("tiny", **{**SMALL, "data.tokenizer": tokenizer, **extra})


def _argv(workdir, tokenizer, *extra):
  return [f"--workdir={workdir}", f"--config.data.tokenizer={tokenizer}",
          *[f"--config.{k}={v}" for k, v in SMALL.items()], *extra]


def _lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "lr" in r}


def _cosine_lr(step0, peak, warmup, horizon, floor):
  """The cosine schedule written out (warmup, then cosine to floor * peak at `horizon`), 0-based step."""
  if step0 < warmup:
    return peak * (step0 + 1) / warmup
  p = min(max((step0 - warmup) / (horizon - warmup), 0.0), 1.0)
  return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  return tokenizer_lib.prepare(configs.load("tiny", **SMALL, **{"data.tokenizer_max_sentences": 2000}), str(root))


@pytest.fixture(scope="module")
def finished(tokenizer, tmp_path_factory):
  """A run of 4 steps with checkpoints at 2 and 4 (never modified: tests copy it)."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  loop.run(_config(tokenizer), str(workdir))
  return workdir


def _copy(finished, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  return workdir


def _snapshot(workdir):
  return {p: open(os.path.join(workdir, p), "rb").read() for p in ("config.json", "metrics.jsonl")} | {
      "checkpoints": sorted(os.listdir(os.path.join(workdir, "checkpoints")))}


@pytest.mark.slow
def test_resume_with_another_model_config_is_refused_before_anything_is_written(finished, tokenizer, tmp_path,
                                                                                capsys):
  workdir = _copy(finished, tmp_path)
  before = _snapshot(workdir)
  rc = train_main.main(_argv(workdir, tokenizer, "--config.model.d_model=128", "--config.model.norm_eps=1e-6"))
  err = capsys.readouterr().err
  assert rc == 2, err
  assert "model.d_model: checkpoint 64, requested 128" in err
  assert "model.norm_eps: checkpoint 1e-05, requested 1e-06" in err
  assert _snapshot(workdir) == before  # config.json, metrics and checkpoints untouched
  # The same model with another optimizer structure (no clipping: one part fewer in optax's chain).
  rc = train_main.main(_argv(workdir, tokenizer, "--config.train.clip_norm=0"))
  err = capsys.readouterr().err
  assert rc == 2, err
  assert "does not fit this config" in err and "opt_state/1/count" in err and "train.clip_norm" in err
  assert _snapshot(workdir) == before


@pytest.mark.parametrize("case", ["mesh", "one_weight_two_sources", "empty_source", "one_document_source"])
def test_a_refused_fresh_start_writes_no_config_and_no_checkpoints(case, tokenizer, tmp_path, capsys):
  one_doc, empty = tmp_path / "one.jsonl", tmp_path / "empty.jsonl"
  one_doc.write_text(json.dumps({"text": "a single document " * 50}) + "\n")
  empty.write_text("")
  extra, needle = {
      "mesh": (["--config.mesh.data=3"], "mesh"),
      "one_weight_two_sources": (["--config.data.sources=a=builtin:prose,b=builtin:code", "--config.data.weights=0.5"],
                                 "config.data.weights has 1 entries"),
      "empty_source": ([f"--config.data.sources=jsonl:{empty}"], "has no documents"),
      "one_document_source": ([f"--config.data.sources=jsonl:{one_doc}", "--config.train.eval_every=2"],
                              "set config.train.eval_every=0"),
  }[case]
  workdir = tmp_path / "fresh"
  rc = train_main.main(_argv(workdir, tokenizer, *extra))
  err = capsys.readouterr().err
  assert rc == 2, err
  assert needle in err and "Traceback" not in err
  assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()


@pytest.mark.slow
def test_raising_steps_on_resume_keeps_the_schedule_unless_schedule_steps_is_set(finished, tokenizer, tmp_path,
                                                                                 capsys):
  peak, warmup, floor = SMALL["train.lr"], SMALL["train.warmup_steps"], SMALL["train.min_lr_ratio"]
  kept = _copy(finished, tmp_path / "kept")
  loop.run(_config(tokenizer, **{"train.steps": 6}), str(kept))
  err = capsys.readouterr().err
  assert "keeping the checkpoint's cosine schedule" in err and "horizon of 4 steps" in err
  lines = _lines(kept)
  for step in range(1, 7):  # logged step s applied lr(s - 1) of the original 4-step schedule
    np.testing.assert_allclose(lines[step]["lr"], _cosine_lr(step - 1, peak, warmup, 4, floor), rtol=1e-6)
  assert json.load(open(kept / "config.json"))["train"]["schedule_steps"] == 4

  stretched = _copy(finished, tmp_path / "stretched")
  loop.run(_config(tokenizer, **{"train.steps": 6, "train.schedule_steps": 6}), str(stretched))
  assert "the cosine schedule now spans 6 steps" in capsys.readouterr().err
  lines = _lines(stretched)
  for step in (5, 6):
    np.testing.assert_allclose(lines[step]["lr"], _cosine_lr(step - 1, peak, warmup, 6, floor), rtol=1e-6)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A Hugging Face directory whose config differs from tiny's in function-changing keys."""
  cfg = configs.load("tiny", **SMALL).model
  cfg.update(rope_theta=500000.0, norm_eps=1e-6)
  path = tmp_path_factory.mktemp("hf") / "hf"
  hf.save(model_lib.Transformer(cfg, rngs=nnx.Rngs(params=jax.random.PRNGKey(3))), str(path))
  return path


def test_init_from_hugging_face_takes_its_model_config(hf_dir, tokenizer, tmp_path, capsys):
  written = json.load(open(hf_dir / "config.json"))
  assert (written["rope_theta"], written["rms_norm_eps"]) == (500000.0, 1e-6)
  config = _config(tokenizer, **{"train.init_from": str(hf_dir), "model.attention_impl": "blockwise"})
  setup.reconcile(config, str(tmp_path / "checkpoints"), overrides=["model.attention_impl"])
  assert config.model.rope_theta == written["rope_theta"] and config.model.norm_eps == written["rms_norm_eps"]
  assert config.model.attention_impl == "blockwise"  # an explicit, function-preserving override is kept
  assert "model.rope_theta=500000.0 (config file: 10000.0)" in capsys.readouterr().out

  for key, value in (("rope_theta", "10000.0"), ("norm_eps", "1e-5")):
    argv = _argv(tmp_path / key, tokenizer, f"--config.train.init_from={hf_dir}", f"--config.model.{key}={value}")
    assert train_main.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--config.model.{key}=" in err and f"which has model.{key}=" in err and "changes the function" in err
    assert not (tmp_path / key / "config.json").exists()

  no_tokenizer = [a for a in _argv(tmp_path / "tok", tokenizer, f"--config.train.init_from={hf_dir}")
                  if not a.startswith("--config.data.tokenizer=")]
  assert train_main.main(no_tokenizer) == 2
  assert "set data.tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_initialised_from_hugging_face_trains_with_its_rope_and_norm(hf_dir, tokenizer, tmp_path):
  workdir = tmp_path / "run"
  summary = loop.run(_config(tokenizer, **{"train.init_from": str(hf_dir), "train.steps": 1}), str(workdir))
  assert summary["step"] == 1
  saved = json.load(open(workdir / "config.json"))["model"]
  assert (saved["rope_theta"], saved["norm_eps"]) == (500000.0, 1e-6)


@pytest.mark.slow
def test_init_from_a_meshlm_run_takes_its_model_config(finished, tokenizer, tmp_path):
  config = _config(tokenizer, **{"train.init_from": str(finished), "model.d_model": 128})
  setup.reconcile(config, str(tmp_path / "checkpoints"), overrides=[])  # d_model came from a "config file"
  assert config.model.d_model == json.load(open(finished / "config.json"))["model"]["d_model"] == 64
  with pytest.raises(loop.SetupError, match=r"--config.model.d_model=128 contradicts .* model.d_model=64"):
    setup.reconcile(_config(tokenizer, **{"train.init_from": str(finished), "model.d_model": 128}),
                    str(tmp_path / "checkpoints"), overrides=["model.d_model"])


class _FailingClose:
  directory = "/nowhere/checkpoints"

  def close(self):
    raise OSError(28, "No space left on device")


def test_checkpointer_close_errors_are_not_swallowed(capsys):
  with pytest.raises(loop.TrainingError, match="closing the checkpoints in /nowhere/checkpoints failed"):
    setup.close_checkpointer(_FailingClose(), raise_errors=True)
  # While another error propagates, the close error is reported, not raised over it.
  setup.close_checkpointer(_FailingClose(), raise_errors=False)
  assert "No space left on device" in capsys.readouterr().err


def test_schedule_horizon_bookkeeping_across_resumes():
  def settle(saved_train, **requested):
    config = configs.load("tiny", **{f"train.{k}": v for k, v in requested.items()})
    return runconfig.keep_schedule(config, {"train": saved_train}), config.train.schedule_steps

  assert settle({"steps": 4, "schedule_steps": 0}, steps=4) == (None, 0)  # a plain resume
  warning, horizon = settle({"steps": 4, "schedule_steps": 0}, steps=6)  # steps raised: keep 4, say so
  assert horizon == 4 and "keeping the checkpoint's cosine schedule" in warning
  assert settle({"steps": 6, "schedule_steps": 4}, steps=6) == (None, 4)  # resumed again: kept, said once
  warning, horizon = settle({"steps": 6, "schedule_steps": 4}, steps=8, schedule_steps=8)
  assert horizon == 8 and "now spans 8 steps (the checkpoint's spanned 4)" in warning


def test_a_checkpoint_from_before_a_config_key_existed_still_loads(finished, tmp_path):
  """A run saved by an older meshlm lacks the model keys added since: it loads with their defaults (the behaviour of
  its time); a key this version does not know is refused by name."""
  from train.rundir import restore
  workdir = _copy(finished, tmp_path)
  path = os.path.join(workdir, "checkpoints", "4", "metadata", "metadata")
  with open(path) as f:
    meta = json.load(f)
  del meta["config"]["model"]["attention_query_block"]  # added after such a run was written
  with open(path, "w") as f:
    json.dump(meta, f)
  run = restore.load_run(str(workdir))
  assert run.step == 4 and run.config.model.attention_query_block == configs.load("base").model.attention_query_block
  assert run.config.model.d_model == SMALL["model.d_model"] and run.config.train.steps == SMALL["train.steps"]
  want = restore.load_run(str(finished)).model
  for got_leaf, want_leaf in zip(jax.tree.leaves(nnx.state(run.model)), jax.tree.leaves(nnx.state(want))):
    np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))
  meta["config"]["model"]["retired_key"] = 1
  with open(path, "w") as f:
    json.dump(meta, f)
  with pytest.raises(restore.RunError, match="model.retired_key is unknown"):
    restore.load_run(str(workdir))


def test_config_json_says_which_kernels_the_run_ran(finished):
  """model.*_impl=auto is resolved on the machine: config.json's "runtime" record says what the step ran (auto on
  this CPU: xla attention; the dense model has no experts), beside the config as given (auto)."""
  written = json.load(open(finished / "config.json"))
  assert written["model"]["attention_impl"] == written["model"]["moe_impl"] == "auto"
  assert {k: written["runtime"][k] for k in ("platform", "attention_impl", "moe_impl")} == {
      "platform": "cpu", "attention_impl": "xla", "moe_impl": "none"}


def test_a_state_mismatch_names_the_objective_it_came_from():
  """Resuming a workdir trained with another objective: the refusal names both objectives and the way on
  (init_from in a new workdir), not the optimizer keys; a clip_norm switch names clip_norm."""
  import configs
  from train.rundir import runconfig
  saved = json.loads(configs.load("tiny").to_json_best_effort())
  wanted = {"params/head": (((4,), "float32"))}
  dpo = configs.load("tiny", **{"train.objective": "dpo"})
  with pytest.raises(configs.ConfigError) as e:
    runconfig.check_state_layout(wanted, {}, "ckpt/5", cause=runconfig.layout_cause(dpo, saved))
  assert "train.objective='lm'" in str(e.value) and "asks for 'dpo'" in str(e.value)
  assert "init_from" in str(e.value) and "clip_norm" not in str(e.value)
  unclipped = configs.load("tiny", **{"train.clip_norm": 0.0})
  assert runconfig.layout_cause(unclipped, saved).startswith("train.clip_norm changed")
