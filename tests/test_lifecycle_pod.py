"""`python -m train.lifecycle` on a pod: the same command in 2 processes on localhost (the launcher's JAX_*
variables), process 0 running the single-host stages alone and both running pretraining as one 2-process
program, whose parameters equal the same command's on one process with 2 devices; a rerun skips everything on
both; hosts that run different settings are refused before anything runs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import checkpoint_testing

import ports
from parallel import distributed
from train.lifecycle import pod as pod_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = "curate,tokenizer,pretrain,export"
ARGS = [f"--config.lifecycle.stages={STAGES}", "--config.curate.documents=200", "--config.tokenizer.vocab_size=1024",
        "--config.pretrain.train.steps=6", "--config.pretrain.checkpoint.every=3",
        "--config.pretrain.train.log_every=1", "--config.pretrain.train.eval_every=0",
        "--config.pretrain.train.warmup_steps=2", "--config.pretrain.train.batch_size=8",
        "--config.pretrain.model.d_model=32", "--config.pretrain.model.num_layers=1",
        "--config.pretrain.model.mlp_dim=64", "--config.pretrain.model.vocab_size=1024"]


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTEST_"))}
  return {**env, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "", **extra}


def _pod(workdir, extra=((), ()), timeout=400):
  """The lifecycle in processes 0 and 1 at once; their (returncode, stdout + stderr)."""
  coordinator, rendezvous = ports.free_port(), ports.free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "train.lifecycle", f"--workdir={workdir}", *ARGS, *extra[i],
       f"--config.lifecycle.pod_address=127.0.0.1:{rendezvous}"], cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True,
      env=_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
      for i in range(2)]
  try:
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
  finally:
    for p in procs:
      p.kill()


@pytest.fixture(scope="module")
def pod_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pod") / "run"
  results = _pod(workdir)
  for rc, out in results:
    assert rc == 0, out[-4000:]
  return workdir, results



@pytest.mark.slow
def test_process_0_runs_single_host_stages_and_both_pretrain_as_one_program(pod_run, tmp_path):
  workdir, [(_, leader), (_, follower)] = pod_run
  state = json.loads((workdir / "lifecycle.json").read_text())
  assert [state["records"][s]["status"] for s in STAGES.split(",")] == ["done"] * 4
  assert os.path.exists(workdir / "export" / "README.md")
  for stage in ("curate", "tokenizer", "export"):  # process 0's alone: the follower waited
    assert f"[lifecycle process 1] {stage}: on process 0" in follower
  assert "[lifecycle process 1] pretrain: start, on every host" in follower
  assert "wrote " not in follower and "Training tokenizer" not in follower  # no single-host stage ran there
  assert "2 process(es)" in leader and "[Gloo] Rank 1 is connected" in follower
  # The same pretraining command on one process with 2 devices (the pod's global mesh) gives the same parameters.
  argv = [a.replace(str(workdir / "pretrain"), str(tmp_path / "one")) for a in state["records"]["pretrain"]["command"]]
  one = subprocess.run(argv, cwd=REPO, env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                       capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stderr[-3000:]
  assert "2 devices) on 2 cpu device(s), 1 process(es)" in one.stdout + one.stderr
  got = checkpoint_testing.saved(workdir / "pretrain", 6, part="params")
  want = checkpoint_testing.saved(tmp_path / "one", 6, part="params")
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=str(key))


@pytest.mark.slow
def test_a_rerun_on_the_pod_skips_every_finished_stage(pod_run):
  workdir, _ = pod_run
  before = (workdir / "lifecycle.json").read_text()
  [(rc0, leader), (rc1, follower)] = _pod(workdir)
  assert (rc0, rc1) == (0, 0), leader[-3000:] + follower[-3000:]
  assert leader.count("done earlier, skipped") == 4
  assert follower.count("done earlier, skipped") == 4 and "start, on every host" not in follower
  assert json.loads((workdir / "lifecycle.json").read_text())["records"] == json.loads(before)["records"]


def test_hosts_with_different_settings_are_refused_before_anything_runs(tmp_path):
  workdir = tmp_path / "run"
  [(rc0, leader), (rc1, follower)] = _pod(workdir, extra=((), ("--config.pretrain.train.steps=7",)), timeout=120)
  assert (rc0, rc1) == (2, 2), leader + follower
  for out in (leader, follower):
    assert "process 1's stage settings" in out and "['pretrain', 'export']" in out
  assert not workdir.exists()


def test_place_and_address_come_from_the_launchers_environment(monkeypatch):
  for name in ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.process_of_environment() is None
  monkeypatch.setenv("TPU_WORKER_ID", "3")
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t0,t1,t2,t3")
  assert distributed.process_of_environment() == (3, 4)
  assert pod_lib.address({}) == ("t0", 8477)
  monkeypatch.setenv("SLURM_PROCID", "1")
  monkeypatch.setenv("SLURM_NTASKS", "2")
  assert distributed.process_of_environment() == (1, 2)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "[::1]:1234")
  assert pod_lib.address({}) == ("::1", 1235)
  assert pod_lib.address({"pod_address": "h:99"}) == ("h", 99)
  with pytest.raises(pod_lib.PodError, match="HOST:PORT"):
    pod_lib.address({"pod_address": "h"})
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "")
  monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
  with pytest.raises(pod_lib.PodError, match="pod_address"):
    pod_lib.address({})
  assert "JAX_PROCESS_ID" not in pod_lib.single_host_env() and "SLURM_PROCID" not in pod_lib.single_host_env()
