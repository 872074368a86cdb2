"""2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) reproduce 1 process x 8 devices."""
import json

import numpy as np
import pytest

from parallel import mesh as mesh_lib
import multihost_testing
import configs
from train.core import step as step_lib

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
  args = [f"--config.{k}={v}" for k, v in OVERRIDES.items()] + ["--fast_compile"]
  with multihost_testing.processes("train.step", args) as procs:
    # The single-process reference runs meanwhile, on this process's 8 devices.
    config = configs.load("tiny", **OVERRIDES)
    mesh = mesh_lib.make_mesh(config.mesh)
    assert (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]) == (2, 2, 2)
    expected = step_lib.run_synthetic(step_lib.Trainer(config, mesh, step_lib.FAST_COMPILE), 3)
    outputs = multihost_testing.outputs(procs, timeout=400)
  lines = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
  header, steps = lines[0], lines[1:]
  assert header["processes"] == 2 and header["mesh"].startswith("data=2 fsdp=2 tensor=2")
  assert not [line for line in outputs[1][0].splitlines() if line.startswith("{")]  # only process 0 reports
  assert [s["step"] for s in steps] == [1, 2, 3]
  for key in ("loss", "grad_norm", "param_norm", "tokens"):
    np.testing.assert_allclose([s[key] for s in steps], [e[key] for e in expected], rtol=1e-5, err_msg=key)
