"""Fallbacks say so: the attention path that runs is logged once, the device-id mesh order warns, and a malformed
metrics line fails (only a torn last line is skipped)."""
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from model import attention
from parallel import mesh as mesh_lib
from train.core import logger as logger_lib
from train import plot as plot_lib


def _qkv(dtype):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 8, 2, 4)), dtype)
  k = jnp.asarray(rng.standard_normal((1, 8, 1, 4)), dtype)
  return q, k, k, jnp.ones((1, 8), jnp.int32)


def test_dot_product_attention_logs_its_path_once(caplog, monkeypatch):
  attention._REPORTED.clear()
  with caplog.at_level(logging.INFO, logger="model.attention"):
    for _ in range(3):
      attention.dot_product_attention(*_qkv(jnp.float32))
  assert [r.getMessage() for r in caplog.records].count(
      "attention_impl=dot_product: the XLA implementation on cpu (float32; cuDNN needs a GPU and half precision)") == 1

  # On a GPU in half precision cuDNN is tried; when it refuses (here: there is no cuDNN on the CPU backend) the
  # XLA path runs and a warning says why, once.
  caplog.clear()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with caplog.at_level(logging.INFO, logger="model.attention"):
    outs = [attention.dot_product_attention(*_qkv(jnp.bfloat16)) for _ in range(2)]
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "cuDNN refused" in warnings[0].getMessage()
  assert "running the XLA implementation" in warnings[0].getMessage()
  want = attention.xla_attention(*_qkv(jnp.bfloat16))
  np.testing.assert_allclose(np.asarray(outs[0], np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_device_id_mesh_order_warns(monkeypatch):
  def no_layout(*args, **kwargs):
    raise NotImplementedError("no topology for these devices")
  monkeypatch.setattr(mesh_lib.mesh_utils, "create_device_mesh", no_layout)
  config = configs.load("tiny", **{"mesh.data": 2, "mesh.fsdp": 4})
  with pytest.warns(RuntimeWarning, match="no topology-aware device layout.*placing devices in id order"):
    mesh = mesh_lib.make_mesh(config.mesh)
  assert (mesh.shape["data"], mesh.shape["fsdp"]) == (2, 4)
  assert [d.id for d in mesh.devices.ravel()] == sorted(d.id for d in jax.devices())


def _write(tmp_path, text):
  (tmp_path / logger_lib.METRICS_FILE).write_text(text)


def test_only_a_torn_last_metrics_line_is_skipped(tmp_path):
  good = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
  _write(tmp_path, "".join(good) + '{"step": 4, "lo')  # killed mid-write: no newline
  assert [r["step"] for r in logger_lib.read_metrics(str(tmp_path))] == [1, 2, 3]

  _write(tmp_path, good[0] + '{"step": 2, "lo\n' + good[2])  # damage in the middle: refuse, naming the line
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: malformed metrics line"):
    logger_lib.read_metrics(str(tmp_path))
  _write(tmp_path, "".join(good) + "not json\n")  # a complete last line that is not JSON is damage too
  with pytest.raises(ValueError, match=r"metrics.jsonl:4: malformed"):
    logger_lib.read_metrics(str(tmp_path))
  # The plot command says so too (exit 2, the line named), instead of drawing a curve with a hole.
  assert plot_lib.main([str(tmp_path)]) == 2
