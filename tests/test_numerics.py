"""Mixed precision: dynamic loss scaling (float16) and non-finite handling (bfloat16, float16)."""
import jax
import numpy as np
import pytest

from parallel import mesh as mesh_lib
import configs
from train.core import checkpoint as ckpt_lib
from train.core import optimizer as optimizer_lib
from train.core import step as step_lib


def _config(dtype, loss_scale="auto", period=2000):
  c = configs.load("tiny")
  c.model.update(vocab_size=128, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                 max_seq_len=16, dtype=dtype)
  c.train.update(batch_size=4, seq_len=16, steps=10, lr=1e-2, warmup_steps=1, loss_scale=loss_scale,
                 loss_scale_period=period)
  c.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  return c


_TRAINERS = {}


def _trainer(dtype, loss_scale="auto", period=2000):
  key = (dtype, loss_scale, period)
  if key not in _TRAINERS:
    c = _config(dtype, loss_scale, period)
    _TRAINERS[key] = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]), step_lib.FAST_COMPILE)
  return _TRAINERS[key]


def _batch(trainer, i, nan=False):
  batch = step_lib.synthetic_batch(trainer.config, i)
  if nan:  # the loop's fault injection (train.debug_nan_steps): a NaN loss mask
    batch["loss_mask"] = np.full_like(batch["loss_mask"], np.nan)
  return trainer.batch_to_device(batch)


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_loss_scale_rule_matches_a_written_out_simulation():
  t = _config("float16", period=3).train
  ls = optimizer_lib.loss_scale_init(t)
  scale, good = 32768.0, 0
  pattern = [True, True, True, True, False, True, False, False, True, True, True] + [False] * 20
  for finite in pattern:
    ls = optimizer_lib.loss_scale_update(ls, np.bool_(finite), t)
    if finite:
      good += 1
      if good == 3:
        scale, good = scale * 2, 0
    else:
      scale, good = max(scale / 2, 1.0), 0
    assert float(ls["scale"]) == scale and int(ls["good_steps"]) == good
  assert scale == 1.0  # twenty overflows in a row end at the floor


def test_loss_scaling_is_on_by_default_only_for_float16():
  assert optimizer_lib.uses_loss_scaling(_config("float16"))
  assert not optimizer_lib.uses_loss_scaling(_config("bfloat16"))
  assert not optimizer_lib.uses_loss_scaling(_config("float32"))
  assert optimizer_lib.uses_loss_scaling(_config("float32", "dynamic"))
  assert not optimizer_lib.uses_loss_scaling(_config("float16", "none"))
  with pytest.raises(ValueError, match="train.loss_scale='x'"):
    optimizer_lib.uses_loss_scaling(_config("float16", "x"))


def test_scaled_gradients_equal_unscaled_ones_in_float32():
  """A power-of-two scale is exact: the float32 run with loss scaling trains exactly like the one without."""
  plain, scaled = _trainer("float32", "none"), _trainer("float32", "dynamic")
  s_plain, s_scaled = plain.init(), scaled.init()
  assert "loss_scale" not in s_plain and float(s_scaled["loss_scale"]["scale"]) == 32768.0
  for i in range(2):
    s_plain, m_plain = plain.step_fn(s_plain, _batch(plain, i))
    s_scaled, m_scaled = scaled.step_fn(s_scaled, _batch(scaled, i))
    assert float(m_scaled["loss_scale"]) == 32768.0 and float(m_scaled["overflow"]) == 0.0
    assert float(m_scaled["grad_norm"]) == pytest.approx(float(m_plain["grad_norm"]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(_host(s_plain["params"])), jax.tree.leaves(_host(s_scaled["params"]))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def fp16():
  trainer = _trainer("float16", period=2)
  state = trainer.init()
  state, metrics = trainer.step_fn(state, _batch(trainer, 0))
  return trainer, state, metrics


def test_float16_step_trains_and_logs_the_scale(fp16):
  trainer, state, metrics = fp16
  assert "loss_scale" in trainer.metric_keys
  assert float(metrics["loss_scale"]) == 32768.0 and float(metrics["nonfinite"]) == 0.0
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  assert int(state["loss_scale"]["good_steps"]) == 1


def test_injected_overflow_skips_the_step_halves_the_scale_and_training_continues(fp16):
  trainer, state, _ = fp16
  state = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input
  before = _host(state)
  state, metrics = trainer.step_fn(state, _batch(trainer, 1, nan=True))
  after = _host(state)
  assert float(metrics["nonfinite"]) == 1.0 and float(metrics["loss_scale"]) == 32768.0
  assert float(after["loss_scale"]["scale"]) == 16384.0 and int(after["loss_scale"]["good_steps"]) == 0
  assert int(after["step"]) == int(before["step"]) + 1
  _assert_same(after["params"], before["params"])
  _assert_same(after["opt_state"], before["opt_state"])
  # Training continues at the halved scale; two finite steps (loss_scale_period=2) double it again.
  for i in (2, 3):
    state, metrics = trainer.step_fn(state, _batch(trainer, i))
    assert float(metrics["nonfinite"]) == 0.0 and float(metrics["loss_scale"]) == 16384.0
  assert float(state["loss_scale"]["scale"]) == 32768.0
  assert not np.array_equal(_host(state["params"]["unembed"]), after["params"]["unembed"])


def test_float16_gradient_overflow_with_a_finite_loss_is_absorbed_by_the_scale(fp16):
  """A scale of 2^40 overflows float16's backward pass (max 65504): the loss is finite, the update skipped, the
  scale halved, and the run does not count it toward the non-finite halt."""
  trainer, state, _ = fp16
  state = jax.tree.map(lambda x: x.copy(), state)
  state["loss_scale"] = {"scale": jax.device_put(np.float32(2.0 ** 40), state["loss_scale"]["scale"].sharding),
                         "good_steps": state["loss_scale"]["good_steps"]}
  before = _host(state["params"])
  state, metrics = trainer.step_fn(state, _batch(trainer, 4))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["overflow"]) == 1.0
  assert float(metrics["nonfinite"]) == 0.0
  assert float(state["loss_scale"]["scale"]) == 2.0 ** 39
  _assert_same(_host(state["params"]), before)


def test_loss_scale_state_is_checkpointed(fp16, tmp_path):
  trainer, state, _ = fp16
  state = jax.tree.map(lambda x: x.copy(), state)
  state["loss_scale"] = {"scale": jax.device_put(np.float32(512.0), state["loss_scale"]["scale"].sharding),
                         "good_steps": jax.device_put(np.int32(1), state["loss_scale"]["good_steps"].sharding)}
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  checkpointer.save(7, state, None, {})
  checkpointer.wait()
  restored, _ = checkpointer.restore(trainer.abstract_state(), step=7)
  checkpointer.close()
  assert float(restored["loss_scale"]["scale"]) == 512.0 and int(restored["loss_scale"]["good_steps"]) == 1
  _assert_same(_host(restored["params"]), _host(state["params"]))


def test_bfloat16_nonfinite_step_is_skipped_without_loss_scaling():
  trainer = _trainer("bfloat16")
  state = trainer.init()
  assert "loss_scale" not in state and "loss_scale" not in trainer.metric_keys
  before = _host(state)
  state, metrics = trainer.step_fn(state, _batch(trainer, 0, nan=True))
  assert float(metrics["nonfinite"]) == 1.0
  _assert_same(_host(state["params"]), before["params"])
  state, metrics = trainer.step_fn(state, _batch(trainer, 1))
  assert float(metrics["nonfinite"]) == 0.0 and np.isfinite(float(metrics["loss"]))
  assert not np.array_equal(_host(state["params"]["unembed"]), before["params"]["unembed"])
