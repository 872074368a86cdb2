"""train.checkpoint: round trip onto another mesh, retention, a SIGKILL mid async save, a full disk."""
import errno
import os
import signal
import subprocess
import sys
import textwrap

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from etils import epath

from train.core import checkpoint as ckpt_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(keep=3, keep_period=0, async_save=True):
  return ml_collections.ConfigDict(dict(every=1, keep=keep, keep_period=keep_period, async_save=async_save))


def _dataset():
  return grain.MapDataset.range(1000).shuffle(seed=3).to_iter_dataset().batch(4)


def test_round_trip_reshards_onto_another_mesh_and_resumes_data(tmp_path):
  mesh_a = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
  state = {
      "params": {"w": jax.device_put(w, NamedSharding(mesh_a, P("fsdp", "tensor")))},
      "opt": {"mu": jax.device_put(2 * w, NamedSharding(mesh_a, P(("data", "fsdp"), None)))},
      "step": jnp.int32(7),
  }
  it = iter(_dataset())
  for _ in range(5):
    next(it)
  ck = ckpt_lib.Checkpointer(str(tmp_path), _cfg())
  ck.save(5, state, it, {"note": "x"})
  ck.close()
  expected_next = [next(it) for _ in range(3)]  # the uninterrupted iterator is the reference

  mesh_b = jax.make_mesh((8,), ("data",))
  row = NamedSharding(mesh_b, P("data"))
  abstract = {
      "params": {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=row)},
      "opt": {"mu": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=row)},
      "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh_b, P())),
  }
  fresh = iter(_dataset())
  restored, meta = ckpt_lib.Checkpointer(str(tmp_path), _cfg()).restore(abstract, fresh)
  assert meta["step"] == 5 and meta["note"] == "x"
  assert restored["params"]["w"].sharding == row
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), w)
  np.testing.assert_array_equal(np.asarray(restored["opt"]["mu"]), 2 * w)
  assert int(restored["step"]) == 7
  for want in expected_next:
    np.testing.assert_array_equal(next(fresh), want)

  params_only = ckpt_lib.Checkpointer(str(tmp_path), read_only=True).restore_subtree(
      {"params": abstract["params"]})
  assert set(params_only) == {"params"}
  np.testing.assert_array_equal(np.asarray(params_only["params"]["w"]), w)


def test_retention_keeps_last_k_and_every_period(tmp_path):
  ck = ckpt_lib.Checkpointer(str(tmp_path), _cfg(keep=2, keep_period=3, async_save=False))
  for step in range(1, 8):
    ck.save(step, {"x": jnp.full((2,), step)}, None, {})
  ck.close()
  # last two (6, 7) plus the multiples of 3 (3, 6)
  assert ckpt_lib.Checkpointer(str(tmp_path), _cfg()).all_steps() == [3, 6, 7]


def test_tokenizer_file_round_trip(tmp_path):
  src = tmp_path / "tok.model"
  src.write_bytes(bytes(range(256)) * 3)
  out = tmp_path / "restored"
  out.mkdir()
  path = ckpt_lib.decode_file(ckpt_lib.encode_file(str(src)), str(out))
  assert open(path, "rb").read() == src.read_bytes()


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import jax.numpy as jnp, ml_collections
    from train.core.checkpoint import Checkpointer
    cfg = ml_collections.ConfigDict(dict(every=1, keep=3, keep_period=0, async_save=True))
    ck = Checkpointer(sys.argv[1], cfg)
    w = jnp.arange(8 * 2**20, dtype=jnp.float32)  # 32 MiB: the background write takes a while
    ck.save(1, {"w": w}, None, {"k": 1})
    ck.wait()
    ck.save(2, {"w": w + 1}, None, {"k": 2})  # returns while the files are still being written
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.slow  # a second process, killed mid-save
def test_sigkill_during_async_save_leaves_previous_checkpoint(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  leftovers = [d for d in os.listdir(tmp_path) if d.startswith("2") and d != "2"]
  assert leftovers, f"the kill was meant to land mid-save: {os.listdir(tmp_path)}"
  ck = ckpt_lib.Checkpointer(str(tmp_path), _cfg())
  assert ck.all_steps() == [1]
  abstract = {"w": jax.ShapeDtypeStruct((8 * 2**20,), jnp.float32,
                                        sharding=NamedSharding(jax.make_mesh((8,), ("d",)), P("d")))}
  state, meta = ck.restore(abstract)
  assert meta["k"] == 1
  np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(8 * 2**20, dtype=np.float32))
  ck.save(2, {"w": state["w"]}, None, {"k": 2})  # the half-written step does not block a new save
  ck.close()
  assert ckpt_lib.Checkpointer(str(tmp_path), _cfg()).all_steps() == [1, 2]


def _fail_checkpoint_writes(monkeypatch, error):
  """Makes orbax's own file writes inside a checkpoint being written fail with `error`, after it has started
  (its step marker and array data are written first): the disk fills up mid-save."""
  original = epath.Path.write_text
  failed = []

  def write_text(self, *args, **kwargs):
    if ".orbax-checkpoint-tmp" in str(self) and not str(self).endswith("_CHECKPOINT_METADATA"):
      failed.append(str(self))
      raise error
    return original(self, *args, **kwargs)

  monkeypatch.setattr(epath.Path, "write_text", write_text)
  return failed


def test_full_disk_names_the_problem_and_keeps_previous(tmp_path, monkeypatch):
  ck = ckpt_lib.Checkpointer(str(tmp_path / "a"), _cfg(async_save=False))
  ck.save(1, {"w": jnp.full((4,), 1.0)}, None, {"k": 1})
  failed = _fail_checkpoint_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
  with pytest.raises(ckpt_lib.CheckpointError, match=r"disk full.*previous checkpoint \(step 1\) is intact"):
    ck.save(2, {"w": jnp.full((4,), 2.0)}, None, {"k": 2})
  assert failed and any(d.startswith("2.") for d in os.listdir(tmp_path / "a"))  # it failed mid-save
  monkeypatch.undo()
  reopened = ckpt_lib.Checkpointer(str(tmp_path / "a"), _cfg())
  assert reopened.all_steps() == [1]
  abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(jax.make_mesh((8,), ("d",)),
                                                                                   P()))}
  state, meta = reopened.restore(abstract)
  assert meta["k"] == 1 and np.asarray(state["w"]).tolist() == [1.0] * 4  # step 1 really is intact

  # Without an earlier checkpoint the message says so; an error that is not a full disk is not called one.
  _fail_checkpoint_writes(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
  with pytest.raises(ckpt_lib.CheckpointError, match="disk full.*no earlier checkpoint exists"):
    ckpt_lib.Checkpointer(str(tmp_path / "b"), _cfg(async_save=False)).save(1, {"w": jnp.ones(4)}, None, {})
  monkeypatch.undo()
  _fail_checkpoint_writes(monkeypatch, PermissionError(errno.EACCES, "Permission denied"))
  with pytest.raises(Exception) as e:
    ckpt_lib.Checkpointer(str(tmp_path / "c"), _cfg(async_save=False)).save(1, {"w": jnp.ones(4)}, None, {})
  assert not isinstance(e.value, ckpt_lib.CheckpointError) and "Permission denied" in str(e.value)
