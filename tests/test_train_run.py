"""`python -m train` end to end, as real processes: resume after SIGTERM and SIGKILL is bit-exact against an
uninterrupted run, a checkpoint restores onto another mesh, NaN steps are skipped, counted and halt the run.

All runs use one very small config on 8 simulated CPU devices; they share a persistent XLA compilation cache so
that only the first run of each mesh pays for compilation.
"""
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import checkpoint_testing

from data import tokenizer as tokenizer_lib
import configs

pytestmark = pytest.mark.slow  # end to end: real `python -m train` processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
MESH_222 = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
MESH_8 = ["--config.mesh.data=8", "--config.mesh.fsdp=1", "--config.mesh.tensor=1"]
SMALL = {"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2,
         "model.head_dim": 16, "model.mlp_dim": 128, "model.vocab_size": 512, "model.max_seq_len": 64,
         "train.seq_len": 64, "train.batch_size": 8, "train.steps": STEPS, "train.warmup_steps": 2,
         "train.log_every": 1, "train.eval_every": 8, "train.eval_steps": 1, "checkpoint.every": 4,
         "checkpoint.keep": 10, "log.progress": False}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """Environment and shared files: the tokenizer (trained once) and the compilation cache."""
  root = _shared_dir(tmp_path_factory)
  environ = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(root / "xla"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  return {"root": root, "environ": environ, "tokenizer": str(root / "tokenizer.model")}


def _shared_dir(tmp_path_factory):
  """One directory for the whole session: under pytest-xdist, shared by the workers (their basetemps' parent)."""
  base = tmp_path_factory.getbasetemp()
  root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "train_run_shared"
  root.mkdir(exist_ok=True)
  return root


@contextlib.contextmanager
def _once(root, name):
  """Yields True to the first caller across xdist workers (which must create `name`), False to later ones."""
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here while the first one builds `name`
    try:
      yield not (root / f"{name}.done").exists()
      (root / f"{name}.done").touch()
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _args(env, workdir, *extra):
  flags = [f"--config.{k}={v}" for k, v in SMALL.items()]
  return [sys.executable, "-m", "train", f"--workdir={workdir}", f"--config.data.tokenizer={env['tokenizer']}",
          *flags, *extra]


def _run(env, workdir, *extra, timeout=300):
  return subprocess.run(_args(env, workdir, *extra), cwd=REPO, env=env["environ"], capture_output=True, text=True,
                        timeout=timeout)


def _start(env, workdir, *extra):
  return subprocess.Popen(_args(env, workdir, *extra), cwd=REPO, env=env["environ"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _metrics(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def _train_lines(workdir):
  return {r["step"]: r for r in _metrics(workdir) if "loss" in r}


def _wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if proc.poll() is not None:
      raise AssertionError(f"run ended (rc {proc.returncode}) before the condition: {proc.stderr.read()[-3000:]}")
    time.sleep(0.02)
  proc.kill()
  raise AssertionError("timed out waiting for the run")


def _iterator_state(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "data", "process_0-of-1.json")) as f:
    return json.load(f)


def _kill_after_first_checkpoint_and_resume(env, workdir, *extra):
  """SIGKILL once checkpoint 4 exists (before the last step), then rerun the same command to the end."""
  proc = _start(env, workdir, *extra)
  _wait_for(lambda: os.path.isdir(workdir / "checkpoints" / "4"), proc)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL and max(_train_lines(workdir), default=0) < STEPS
  proc = _run(env, workdir, *extra)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from" in proc.stdout


def _assert_same_run(workdir, reference):
  got, want = _train_lines(workdir), _train_lines(reference)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in want:  # bit-identical per-step losses and the same number of loss tokens (same batches)
    assert (got[step]["loss"], got[step]["tokens"]) == (want[step]["loss"], want[step]["tokens"]), step
  flat_a = checkpoint_testing.saved(workdir, STEPS, part="params")
  flat_b = checkpoint_testing.saved(reference, STEPS, part="params")
  assert flat_a.keys() == flat_b.keys()
  for k in flat_a:
    assert np.array_equal(flat_a[k], flat_b[k]), k
  got_data, want_data = _iterator_state(workdir, STEPS), _iterator_state(reference, STEPS)
  assert got_data["pipeline"] == want_data["pipeline"]  # same data position after the same batches


@pytest.fixture(scope="module")
def reference(env):
  """The uninterrupted run on mesh data=2, fsdp=2, tensor=2 (run once per session, shared by xdist workers)."""
  workdir = env["root"] / "reference"
  with _once(env["root"], "reference") as first:
    if first:
      tokenizer_lib.prepare(configs.load("tiny", **SMALL, **{"data.tokenizer_max_sentences": 3000}), str(env["root"]))
      shutil.rmtree(workdir, ignore_errors=True)
      proc = _run(env, workdir, *MESH_222)
      assert proc.returncode == 0, proc.stderr[-3000:]
  lines = _train_lines(workdir)
  assert sorted(lines) == list(range(1, STEPS + 1))
  evals = [r["eval_loss"] for r in _metrics(workdir) if "eval_loss" in r]
  assert len(evals) == 1 + STEPS // 8 and evals[-1] < evals[0]
  return workdir


def test_sigterm_saves_exits_0_and_resume_is_bit_exact(env, reference):
  workdir = env["root"] / "sigterm"
  proc = _start(env, workdir, *MESH_222)
  _wait_for(lambda: max(_train_lines(workdir), default=0) >= 3, proc)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  stopped = [line for line in out.splitlines() if line.startswith("SIGTERM: stopped after step")]
  assert stopped, out[-2000:]
  step = int(stopped[0].split("step ")[1].split(";")[0])
  assert 3 <= step < STEPS
  assert os.path.isdir(workdir / "checkpoints" / str(step))

  proc = _run(env, workdir, *MESH_222)  # N steps + restart + the rest
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resumed from {workdir}/checkpoints/{step}" in proc.stdout
  _assert_same_run(workdir, reference)


def test_a_second_sigint_stops_at_once_in_one_line(env):
  """Ctrl-C twice: the first asks for a checkpoint, the second stops the run at once with one line and no
  traceback (exit 130, as a shell reports an interrupted command)."""
  workdir = env["root"] / "sigint"
  proc = _start(env, workdir)
  _wait_for(lambda: max(_train_lines(workdir), default=0) >= 1, proc)
  proc.send_signal(signal.SIGINT)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode in (0, 130), err[-3000:]  # 0 when the checkpoint was written between the two
  assert "Traceback" not in err, err[-3000:]
  if proc.returncode == 130:
    assert err.strip().splitlines()[-1].startswith("interrupted: a second SIGINT stopped the run at once")


def test_sigkill_mid_training_resumes_to_the_same_result(env, reference):
  workdir = env["root"] / "sigkill"
  proc = _start(env, workdir, *MESH_222)
  _wait_for(lambda: os.path.isdir(workdir / "checkpoints" / "4"), proc)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  killed_at = max(_train_lines(workdir), default=0)
  assert killed_at < STEPS

  proc = _run(env, workdir, *MESH_222)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from" in proc.stdout
  assert _train_lines(workdir)[STEPS]["loss"] == _train_lines(reference)[STEPS]["loss"]
  _assert_same_run(workdir, reference)


def test_checkpoint_from_mesh_222_restores_on_mesh_8(env, reference):
  workdir = env["root"] / "remesh"
  (workdir / "checkpoints").mkdir(parents=True)
  shutil.copytree(reference / "checkpoints" / "4", workdir / "checkpoints" / "4")
  proc = _run(env, workdir, *MESH_8, "--config.train.eval_every=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resumed from" in proc.stdout and "data=8 fsdp=1 tensor=1" in proc.stdout
  got, want = _train_lines(workdir), _train_lines(reference)
  assert min(got) == 5  # it continued from the checkpoint, not from scratch
  # Another mesh sums in another order: equal up to float32 rounding, not bit for bit.
  np.testing.assert_allclose(got[5]["loss"], want[5]["loss"], rtol=1e-6, atol=0)
  np.testing.assert_allclose(got[5]["param_norm"], want[5]["param_norm"], rtol=1e-6, atol=0)


def test_nan_steps_are_skipped_counted_and_halt(env, reference):
  workdir = env["root"] / "nan"
  proc = _run(env, workdir, *MESH_222, "--config.train.debug_nan_steps=(2,5,6)", "--config.train.max_nonfinite=2")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "halting at step 6" in proc.stderr and "2 consecutive steps" in proc.stderr
  assert "step 2: non-finite loss or gradient, update skipped (1 in a row" in proc.stderr
  lines, ref = _train_lines(workdir), _train_lines(reference)
  assert lines[1]["loss"] == ref[1]["loss"]
  assert lines[2]["nonfinite"] == 1.0 and lines[2]["loss"] is None
  assert lines[2]["param_norm"] == lines[1]["param_norm"]  # the update was skipped
  assert lines[3]["nonfinite"] == 0.0 and np.isfinite(lines[3]["loss"])
  assert lines[3]["param_norm"] != lines[2]["param_norm"]  # and training went on
  assert lines[5]["nonfinite"] == 1.0 and 6 not in lines  # halted at step 6, before logging it


# A DeepSeek-style model: MLA, sigmoid routing in 2 groups with score-bias updates, the first layer dense, one
# multi-token head; its state adds the biases (moved by their own rule, not the optimizer) and the head.
DEEPSEEK = ["--config.model.num_experts=4", "--config.model.expert_mlp_dim=32", "--config.model.router=sigmoid",
            "--config.model.router_groups=2", "--config.model.first_dense_layers=1",
            "--config.model.attention_type=mla", "--config.model.q_lora_rank=16", "--config.model.kv_lora_rank=16",
            "--config.model.qk_nope_head_dim=8", "--config.model.qk_rope_head_dim=8", "--config.model.v_head_dim=16",
            "--config.model.mtp_depth=1", "--config.train.router_bias_update_rate=0.01"]


def test_sigkill_resume_is_bit_exact_with_score_biases_and_mtp_heads(env, reference):
  del reference  # it trains the shared tokenizer
  want = env["root"] / "deepseek_reference"
  proc = _run(env, want, *MESH_222, *DEEPSEEK)
  assert proc.returncode == 0, proc.stderr[-3000:]
  workdir = env["root"] / "deepseek_sigkill"
  _kill_after_first_checkpoint_and_resume(env, workdir, *MESH_222, *DEEPSEEK)
  _assert_same_run(workdir, want)  # every parameter bit-equal, the biases and the head included
  # the biases moved (the sign rule can swing a layer's biases back to 0 on even steps: any layer or head counts)
  biases = [v for k, v in checkpoint_testing.saved(workdir, STEPS, part="params").items() if k[-1] == "score_bias"]
  assert len(biases) == 2 and any(np.any(b != 0) for b in biases)
  assert "mtp_loss" in _train_lines(workdir)[STEPS]


OPTIMIZERS = {
    "schedule_free_bf16": ["--config.train.optimizer=schedule_free_adamw", "--config.train.schedule=constant",
                           "--config.train.opt_state_dtype=bfloat16"],
    "muon": ["--config.train.optimizer=muon"],
    "adafactor": ["--config.train.optimizer=adafactor"],
    "lion": ["--config.train.optimizer=lion"],
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sigkill_resume_is_bit_exact_with_every_optimizer(env, reference, name):
  """Each optimizer's own state (schedule-free's averaged parameters beside z with bfloat16 moments, Muon's
  partitioned momentum, Adafactor's factored moments, Lion's single moment): killed after the first checkpoint and
  resumed, every parameter equals an uninterrupted run's (AdamW: the tests above)."""
  del reference  # it trains the shared tokenizer
  extra = OPTIMIZERS[name]
  want = env["root"] / f"{name}_reference"
  proc = _run(env, want, *MESH_222, *extra)
  assert proc.returncode == 0, proc.stderr[-3000:]
  workdir = env["root"] / f"{name}_sigkill"
  _kill_after_first_checkpoint_and_resume(env, workdir, *MESH_222, *extra)
  _assert_same_run(workdir, want)
