"""SIGINT, like SIGTERM, stops a 2-process run (jax.distributed on localhost, 2 x 4 CPU devices) at one agreed step:
both processes save that step's checkpoint and exit 0, even when only one of them was signalled."""
import json
import os
import signal
import time

import pytest

import multihost_testing
import configs
from data import tokenizer as tokenizer_lib

STEPS = 200  # far more than the test waits for: the run must stop on the signal, not by finishing
SMALL = {"model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2,
         "model.head_dim": 16, "model.mlp_dim": 64, "model.vocab_size": 512, "model.max_seq_len": 32,
         "train.seq_len": 32, "train.batch_size": 8, "train.steps": STEPS, "train.warmup_steps": 2,
         "train.log_every": 1, "train.eval_every": 0, "checkpoint.every": 0, "log.progress": False,
         "log.tensorboard": False, "mesh.data": -1, "mesh.fsdp": 2, "mesh.tensor": 2}


def _logged_steps(workdir) -> list[int]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n")]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_one_process_stops_both_with_a_checkpoint(tmp_path, sig):
  tokenizer = tokenizer_lib.prepare(configs.load("tiny", **SMALL, **{"data.tokenizer_max_sentences": 2000}),
                                    str(tmp_path))
  workdir = tmp_path / "run"
  args = [f"--config.{k}={v}" for k, v in SMALL.items()] + [
      f"--workdir={workdir}", f"--config.data.tokenizer={tokenizer}"]
  with multihost_testing.processes("train", args) as procs:
    deadline = time.time() + 300
    while max(_logged_steps(workdir), default=0) < 2:
      assert time.time() < deadline, "the 2-process run did not reach step 2"
      assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
      time.sleep(0.05)
    procs[1].send_signal(sig)  # only the non-primary process: the stop must reach process 0 too
    outputs = multihost_testing.outputs(procs, timeout=180)
  stopped = [line for line in outputs[0][0].splitlines() if ": stopped after step" in line]
  assert stopped, outputs[0][0][-2000:]
  step = int(stopped[0].split("stopped after step ")[1].split(";")[0])
  assert 2 <= step < STEPS
  assert max(_logged_steps(workdir)) == step  # both processes stopped at the same step (the last one logged)
  assert sorted(os.listdir(workdir / "checkpoints")) == [str(step)]
  # Every process wrote its part of the checkpoint: the data-iterator state of each.
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(workdir / "checkpoints" / str(step) / "data"))
  if sig != signal.SIGTERM:
    return
  # The same command, two steps further, resumes on both processes (every process opens the checkpoints: orbax
  # synchronises them there) and trains on from the saved step.
  with multihost_testing.processes("train", args + [f"--config.train.steps={step + 2}"]) as resumed:
    outputs = multihost_testing.outputs(resumed, timeout=300)
  assert f"resumed from {workdir / 'checkpoints'}/{step}" in outputs[0][0], outputs[0][0][-2000:]
  assert max(_logged_steps(workdir)) == step + 2 and str(step + 2) in os.listdir(workdir / "checkpoints")
