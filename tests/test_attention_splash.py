"""Splash attention (model/splash.py) in Pallas interpret mode against the XLA reference: values and gradients for
causal, packed, windowed, GQA, MQA and padded inputs; the whole model on a data x tensor mesh; remat; refusals.

Each interpret-mode compile takes seconds on the CPU, so the cases share compiled functions: the window is traced
(one compile runs both window kernels through lax.switch) and segment layouts are values, not shapes.
"""
import contextlib
import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import configs
import parallel
from configs import validate as config_validate
from model import attention, remat, splash
from model.transformer import Transformer
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 16
# 128-token tiles (the smallest the TPU kernel takes): T = 200 pads to 256 = 2 x 2 tiles.
OPTS = splash.SplashOptions(block_q=128, block_kv=128, block_kv_compute=128, block_q_bwd=128, block_kv_bwd=128,
                            interpret=True, windows=(0, WINDOW))
TOL = 1e-5
MEASURED = {}  # case -> max |diff| over output and the three gradients, printed at the end of the module


def _inputs(T, H, G, K=16, B=2, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, G, G))
  w = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)  # weights of the loss sum(o * w)
  return q, k, v, w


def _value_and_grads(impl):
  """jit(q, k, v, w, segment_ids, window) -> (o, (dq, dk, dv)) of loss sum(o * w); the window is traced."""
  def fn(q, k, v, w, seg, window):
    o, vjp = jax.vjp(lambda q, k, v: impl(q, k, v, seg, window), q, k, v)
    return o, vjp(w)
  return jax.jit(fn)


SPLASH = _value_and_grads(lambda q, k, v, seg, window: splash.splash_attention(q, k, v, seg, window, True, OPTS))
XLA = _value_and_grads(attention.xla_attention)


def _packed(T):
  """Row 0: one document; row 1: three packed documents and trailing padding (segment 0)."""
  a, b = T // 3, T // 2
  return jnp.asarray([[1] * T, [1] * a + [2] * (b - a) + [3] * (T - b - 5) + [0] * 5], jnp.int32)


def _check(case, inputs, seg, window):
  q, k, v, w = inputs
  (o, grads), (o_ref, grads_ref) = SPLASH(q, k, v, w, seg, jnp.int32(window)), XLA(q, k, v, w, seg, jnp.int32(window))
  diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip((o, *grads), (o_ref, *grads_ref))]
  MEASURED[case] = max(diffs)
  assert max(diffs) <= TOL, (case, diffs)


# GQA: 8 query heads on 2 kv heads (4 per kv head), T = 128, one tile: causal, packed, windowed share one compile.
@pytest.fixture(scope="module")
def gqa():
  return _inputs(T=128, H=8, G=2)


def test_causal(gqa):
  _check("causal (GQA 4 per kv head)", gqa, jnp.ones((2, 128), jnp.int32), 0)


def test_packed_segments(gqa):
  _check("packed segments", gqa, _packed(128), 0)


def test_sliding_window_shorter_than_the_sequence(gqa):
  _check(f"window {WINDOW} of 128", gqa, _packed(128), WINDOW)


# MQA: 4 query heads on one kv head, T = 200: not a multiple of the 128-token tile, padded to 256.
@pytest.fixture(scope="module")
def mqa():
  return _inputs(T=200, H=4, G=1, seed=1)


def test_mqa_with_a_length_not_a_multiple_of_the_block(mqa):
  _check("MQA, T=200 (padded to 256)", mqa, _packed(200), 0)
  _check(f"MQA, T=200, window {WINDOW}", mqa, _packed(200), WINDOW)


def test_static_window_and_bidirectional_attention():
  """A Python-int window (unrolled layers) builds its one kernel; causal=False (encoders) is the full mask."""
  q, k, v, _ = _inputs(T=128, H=2, G=2, seed=2)
  seg = _packed(128)
  for window, causal in ((WINDOW, True), (0, False)):
    got = jax.jit(lambda q, k, v, s: splash.splash_attention(q, k, v, s, window, causal, OPTS))(q, k, v, seg)
    want = attention.xla_attention(q, k, v, seg, window, causal)
    MEASURED[f"static window {window}, causal={causal}"] = float(jnp.max(jnp.abs(got - want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL)


def test_prefix_masks_run_blockwise_and_say_so(caplog):
  q, k, v, _ = _inputs(T=24, H=2, G=1, seed=3)
  seg = jnp.ones((2, 24), jnp.int32)
  prefix = jnp.asarray(np.arange(24) < 6, jnp.int32)[None].repeat(2, 0)
  with caplog.at_level("WARNING", logger="model.attention"):
    got = attention.attend("splash", q, k, v, seg, 0, 8, True, prefix, splash_options=OPTS)
  want = attention.xla_attention(q, k, v, seg, 0, True, prefix)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL)
  assert any("prefix or tree masks" in r.getMessage() for r in caplog.records)


def test_the_context_name_lets_save_attn_keep_the_kernel_residuals():
  """save_attn keeps the kernel's output and logsumexp (both named attn_context), so the backward pass runs only
  the backward kernels; `full` keeps neither and reruns the forward kernel."""
  q, k, v, _ = _inputs(T=128, H=2, G=1, seed=4)
  seg = jnp.ones((2, 128), jnp.int32)
  f = lambda q, k, v: splash.splash_attention(q, k, v, seg, 0, True, OPTS).sum()

  def kernel_residuals(policy):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      print_saved_residuals(jax.checkpoint(f, policy=remat.POLICIES[policy].checkpoint), q, k, v)
    return sorted(line.split()[0] for line in buf.getvalue().splitlines() if "_splash_attention" in line)

  # [B, G, R, T, K] output and [B, G, R, T] logsumexp
  assert kernel_residuals("save_attn") == ["f32[2,1,2,128,16]", "f32[2,1,2,128]"]
  assert kernel_residuals("full") == []


def test_refused_off_tpu_without_interpret_mode():
  q, k, v, _ = _inputs(T=8, H=2, G=1)
  with pytest.raises(ValueError, match=r"model.attention_impl='splash'.*model.pallas_interpret=true.*xla or "
                                       r"blockwise"):
    splash.splash_attention(q, k, v, jnp.ones((2, 8), jnp.int32), 0, True, splash.SplashOptions())
  splash.check_platform(False, "tpu")  # an ahead-of-time compile for TPUs (a TPU mesh on a CPU host) passes


def test_the_training_cli_exits_2_on_cpu(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "train", f"--workdir={tmp_path / 'run'}",
                         "--config.model.attention_impl=splash"], cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert "model.attention_impl='splash'" in proc.stderr and "model.pallas_interpret=true" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_config_checks_block_sizes():
  base = configs.load("tiny", **{"model.attention_impl": "splash"})
  for key, value, needle in (("splash_block_q", 100, "positive multiple of 128"),
                             ("splash_block_kv_compute", 384, "must divide model.splash_block_kv=512")):
    with pytest.raises(configs.ConfigError, match=f"model.{key}={value}.*{needle}"):
      config_validate.check(configs.load("tiny", **{"model.attention_impl": "splash", f"model.{key}": value}))
  assert splash.options(base.model).windows == (0,)


# ---- the whole model on a data=2 x tensor=4 mesh -----------------------------------------------------------
def _model_config(impl):
  c = configs.load("tiny")
  # Layer 0 attends in an 8-token window, layer 1 globally: the scanned layers' traced window picks the kernel.
  c.model.update(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=64, sliding_window=8, global_every=2, attention_impl=impl)
  if impl == "splash":
    c.model.update(pallas_interpret=True, splash_block_q=128, splash_block_kv=128, splash_block_kv_compute=128,
                   splash_block_q_bwd=128, splash_block_kv_bwd=128)
  c.mesh.update(data=2, tensor=4)
  return c


def _logits_and_grads(impl, remat_policy, tokens, seg):
  c = _model_config(impl)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  with parallel.activate(mesh, rules):
    m = Transformer(c.model, rngs=nnx.Rngs(0), remat=remat_policy)
    graphdef, state = nnx.split(m)

    def loss(state):
      logits = nnx.merge(graphdef, state)(tokens, seg)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
      return jnp.mean(ce), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return np.asarray(logits), {jax.tree_util.keystr(p): np.asarray(g)
                              for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


def test_model_logits_and_gradients_equal_xla_on_a_data_tensor_mesh():
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(1, 128, size=(4, 48)), jnp.int32)
  seg = jnp.asarray([[1] * 48, [1] * 20 + [2] * 28, [1] * 30 + [0] * 18, [1] * 10 + [2] * 10 + [3] * 28], jnp.int32)
  # The splash model keeps q, k, v and the context (save_attn): its gradients must not change with remat.
  logits, grads = _logits_and_grads("splash", "save_attn", tokens, seg)
  logits_ref, grads_ref = _logits_and_grads("xla", "none", tokens, seg)
  MEASURED["model logits"] = float(np.max(np.abs(logits - logits_ref)))
  MEASURED["model gradients"] = max(float(np.max(np.abs(grads[k] - grads_ref[k]))) for k in grads_ref)
  np.testing.assert_allclose(logits, logits_ref, atol=TOL)
  assert sorted(grads) == sorted(grads_ref)
  for k in grads_ref:
    np.testing.assert_allclose(grads[k], grads_ref[k], atol=TOL, err_msg=str(k))


def test_ahead_of_time_tpu_compile_holds_the_mosaic_kernels():
  """The real train step for a v5e-4 slice (data=2 x tensor=2), windowed and global layers, save_attn: each
  window's kernel is a forward, a dq and a dk/dv Mosaic custom call (libtpu's compiler, no TPU attached)."""
  from train.planning import compile as aot  # pylint: disable=g-import-not-at-top
  from train.planning import hardware  # pylint: disable=g-import-not-at-top
  if not aot._libtpu_installed():  # pylint: disable=protected-access
    pytest.skip("libtpu (the TPU compiler) is not installed")
  config = configs.load("tiny", **{"model.attention_impl": "splash", "model.sliding_window": 64,
                                   "model.global_every": 2, "mesh.data": 2, "mesh.tensor": 2,
                                   "train.remat": "save_attn"})
  _, compiled = aot.compile_trainer(config, aot.abstract_devices(hardware.tpu_slice("v5e-4")))
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 6
  for kernel in ("splash_mqa_fwd_segmented_residuals", "splash_mqa_dq_segmented_no_residuals",
                 "splash_mqa_dkv_segmented_no_residuals"):
    assert kernel in hlo


def teardown_module():
  for case, diff in MEASURED.items():
    print(f"splash vs xla, {case}: max |diff| {diff:.2e}")
