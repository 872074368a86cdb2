"""2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) reproduce 1 process x 8 devices."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from parallel import mesh as mesh_lib
import ports
import configs
from train.core import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {
    "model.vocab_size": 256, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
    "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": 32,
    "model.sliding_window": 8, "model.global_every": 2,
    "train.batch_size": 8, "train.seq_len": 32, "train.steps": 3, "train.lr": 1e-2, "train.warmup_steps": 1,
    # ICI: data=-1 (1 per process), fsdp 2, tensor 2; DCN: dcn_data=-1 -> data 2 across the processes.
    "mesh.data": -1, "mesh.fsdp": 2, "mesh.tensor": 2,
}


@pytest.mark.slow
def test_two_processes_match_one_process():
  port = ports.free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTEST_"))}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  args = [f"--config.{k}={v}" for k, v in OVERRIDES.items()] + [
      "--fast_compile", f"--config.distributed.coordinator_address=localhost:{port}",
      "--config.distributed.num_processes=2"]
  procs = [subprocess.Popen([sys.executable, "-m", "train.step", *args, f"--config.distributed.process_id={i}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    # The single-process reference runs meanwhile, on this process's 8 devices.
    config = configs.load("tiny", **OVERRIDES)
    mesh = mesh_lib.make_mesh(config.mesh)
    assert (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]) == (2, 2, 2)
    expected = step_lib.run_synthetic(step_lib.Trainer(config, mesh, step_lib.FAST_COMPILE), 3)
    outputs = [p.communicate(timeout=400) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  lines = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
  header, steps = lines[0], lines[1:]
  assert header["processes"] == 2 and header["mesh"].startswith("data=2 fsdp=2 tensor=2")
  assert not [line for line in outputs[1][0].splitlines() if line.startswith("{")]  # only process 0 reports
  assert [s["step"] for s in steps] == [1, 2, 3]
  for key in ("loss", "grad_norm", "param_norm", "tokens"):
    np.testing.assert_allclose([s[key] for s in steps], [e[key] for e in expected], rtol=1e-5, err_msg=key)
