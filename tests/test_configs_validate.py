"""Range checks of every numeric config key (configs/validate.py), explicit-override bookkeeping, and the model's
defaults living in model/config.py."""
import argparse
import ast
import os
import re
import subprocess
import sys

import ml_collections
import pytest

import configs
from configs import base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(*argv):
  return configs.parse(list(argv), argparse.ArgumentParser())


@pytest.mark.parametrize("override,needle", [
    ("train.batch_size=-8", "train.batch_size=-8 is out of range: it must be >= 1"),
    ("train.lr=-1", "train.lr=-1.0 is out of range: it must be > 0"),
    ("train.lr=0", "train.lr=0.0 is out of range: it must be > 0"),
    ("train.b2=1.0", "train.b2=1.0 is out of range: it must be in [0, 1)"),
    ("train.eval_every=-1", "train.eval_every=-1 is out of range: it must be >= 1, or 0 (no evaluation)"),
    ("train.lr=nan", None),  # a bare word stays a string: the type check refuses it first
    ("mesh.fsdp=0", "mesh.fsdp=0 is out of range: it must be >= 1, or -1 (all remaining devices)"),
    ("data.eval_fraction=1.0", "data.eval_fraction=1.0 is out of range: it must be in [0, 1)"),
    ("data.weights=(0.5,0)", "data.weights=(0.5, 0) (element 0) is out of range: it must be > 0"),
    ("checkpoint.keep=0", "checkpoint.keep=0 is out of range: it must be >= 1"),
    ("model.num_layers=0", "model.num_layers=0 must be a positive integer"),
])
def test_out_of_range_values_are_refused_naming_the_key(override, needle):
  with pytest.raises(configs.ConfigError) as e:
    _parse(f"--config.{override}")
  if needle is not None:
    assert needle in str(e.value)


def _numeric_keys(config, prefix=""):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _numeric_keys(value, f"{prefix}{key}.")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield prefix + key
    elif isinstance(value, tuple) and key in ("weights", "debug_nan_steps", "local_device_ids"):
      yield prefix + key


def test_every_numeric_key_has_a_range():
  """Every int/float key of configs/base.py outside `model` has a rule (model keys: model/config.py)."""
  keys = [k for k in _numeric_keys(base.get_config()) if not k.startswith("model.")]
  assert len(keys) > 40
  assert sorted(set(keys) - set(configs.validate.RANGES)) == []


def test_every_preset_passes_and_ranges_are_checked_on_the_boundaries():
  for name in ("tiny", "base", "llama2_7b", "llama2_70b", "llama3_8b", "meshlm_125m", "meshlm_350m", "meshlm_1b",
               "mistral_7b", "curate"):
    configs.validate.check(configs.load(name))
  # The edges: the smallest legal values pass, one below fails.
  configs.validate.check(configs.load("tiny", **{"train.warmup_steps": 0, "train.clip_norm": 0.0,
                                                 "data.eval_fraction": 0.0, "checkpoint.every": 0}))
  for key, bad in (("train.warmup_steps", -1), ("train.clip_norm", -0.5), ("data.eval_fraction", -0.1)):
    with pytest.raises(configs.ConfigError, match=re.escape(key)):
      configs.validate.check(configs.load("tiny", **{key: bad}))


def test_warmup_longer_than_training_warns():
  warnings = configs.validate.check(configs.load("tiny", **{"train.steps": 20, "train.warmup_steps": 40}))
  # lr(step 19) = lr * 20 / 40: the peak is never reached.
  assert warnings == ["train.warmup_steps=40 exceeds train.steps=20: the learning rate never reaches "
                      "train.lr=0.003 (it ends at 0.0015)"]
  assert configs.validate.check(configs.load("tiny")) == []


def test_cli_exits_2_on_a_negative_batch_size_without_a_traceback(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "train", f"--workdir={tmp_path / 'run'}",
                         "--config.train.batch_size=-8"], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "train.batch_size=-8 is out of range" in proc.stderr and "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()


def test_parse_records_which_keys_were_given_explicitly():
  config, args = _parse("--config.model.rope_theta=5e5", "--config.train.steps", "7")
  assert args.overrides == ["model.rope_theta", "train.steps"]
  assert config.model.rope_theta == 5e5 and config.train.steps == 7
  assert _parse()[1].overrides == []


def test_model_defaults_live_in_the_model_package():
  # model/config.py does not import configs: its defaults are its own.
  with open(os.path.join(REPO, "model", "config.py")) as f:
    tree = ast.parse(f.read())
  imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
      a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  assert not [m for m in imported if m and m.split(".")[0] == "configs"]
