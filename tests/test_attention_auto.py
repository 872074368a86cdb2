"""`model.attention_impl=auto` and `cudnn`: the choice per platform (faked for GPU and TPU, real on this CPU),
refusals before compiling, the Trainer's record of what it runs, and the cuDNN call's arguments checked off GPU
(the same `jax.nn.dot_product_attention` call through XLA's implementation, values and gradients, also under a
data x tensor mesh)."""
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import parallel
from model import attention, megablox, moe, splash
from model import layers as layers_lib
from model.transformer import Transformer
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from train.planning import memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(**overrides):
  return configs.load("tiny", **{f"model.{k}": v for k, v in overrides.items()}).model


# ---- the choice -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("platform, overrides, expected", [
    ("tpu", {}, "splash"),
    ("tpu", {"dtype": "bfloat16"}, "splash"),
    ("gpu", {"dtype": "bfloat16"}, "cudnn"),
    ("gpu", {"dtype": "float16"}, "cudnn"),
    ("gpu", {}, "xla"),  # float32: cuDNN has no kernel
    ("gpu", {"dtype": "bfloat16", "head_dim": 12}, "xla"),  # not a multiple of 8
    ("gpu", {"dtype": "bfloat16", "head_dim": 512}, "xla"),  # wider than cuDNN's 256
    ("cpu", {}, attention.AUTO_CPU),
    ("cpu", {"dtype": "bfloat16"}, "xla"),
])
def test_auto_picks_the_platforms_fast_path(platform, overrides, expected):
  assert _model(**overrides).attention_impl == "auto"  # the default
  assert attention.resolve_impl(_model(**overrides), platform) == expected
  assert attention.AUTO_CPU == "xla"  # what every CPU test before `auto` ran (docs/model.md: measured)


@pytest.mark.parametrize("impl, platform, overrides, needle", [
    ("splash", "gpu", {}, "does not compile for gpu devices"),
    ("splash", "cpu", {}, "model.pallas_interpret=true"),
    ("cudnn", "cpu", {"dtype": "bfloat16"}, "does not compile for cpu devices"),
    ("cudnn", "tpu", {"dtype": "bfloat16"}, "does not compile for tpu devices"),
    ("cudnn", "gpu", {}, "needs model.dtype=bfloat16 or float16"),
    ("cudnn", "gpu", {"dtype": "bfloat16", "head_dim": 12}, "multiple of 8"),
])
def test_an_explicit_choice_that_cannot_run_is_refused_naming_what_would(impl, platform, overrides, needle):
  with pytest.raises(ValueError, match=f"model.attention_impl='{impl}'") as e:
    attention.resolve_impl(_model(attention_impl=impl, **overrides), platform)
  assert needle in str(e.value) and "model.attention_impl=auto" in str(e.value)


@pytest.mark.parametrize("impl", ["xla", "dot_product", "blockwise"])
def test_portable_choices_run_everywhere(impl):
  for platform in ("cpu", "gpu", "tpu"):
    assert attention.resolve_impl(_model(attention_impl=impl), platform) == impl
  assert attention.resolve_impl(_model(attention_impl="splash"), "tpu") == "splash"
  assert attention.resolve_impl(_model(attention_impl="splash", pallas_interpret=True), "cpu") == "splash"
  assert attention.resolve_impl(_model(attention_impl="cudnn", dtype="bfloat16"), "gpu") == "cudnn"


def test_the_model_resolves_auto_for_the_platform_it_is_built_for(monkeypatch, caplog):
  attention._REPORTED.clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.INFO, logger="model.attention"):
    on_cpu = nnx.eval_shape(lambda: Transformer(_model(), rngs=nnx.Rngs(0)))
    nnx.eval_shape(lambda: Transformer(_model(), rngs=nnx.Rngs(0)))
  impls = {a.impl for _, a in nnx.iter_graph(on_cpu) if isinstance(a, layers_lib.Attention)}
  assert impls == {"xla"}
  assert [r.getMessage() for r in caplog.records].count("model.attention_impl=auto: xla on cpu (float32)") == 1
  monkeypatch.setattr(splash, "target_platform", lambda: "tpu")
  on_tpu = nnx.eval_shape(lambda: Transformer(_model(), rngs=nnx.Rngs(0)))
  (attn,) = {id(a): a for _, a in nnx.iter_graph(on_tpu) if isinstance(a, layers_lib.Attention)}.values()
  assert attn.impl == "splash" and attn.splash == splash.options(_model())


def test_auto_on_cpu_gives_the_numbers_of_xla():
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 2048, size=(2, 32)), jnp.int32)
  auto = Transformer(_model(), rngs=nnx.Rngs(0))(tokens)
  xla = Transformer(_model(attention_impl="xla"), rngs=nnx.Rngs(0))(tokens)
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))


def test_attend_resolves_auto_by_platform_and_dtype(monkeypatch):
  seen = []
  monkeypatch.setitem(attention.IMPLEMENTATIONS, "cudnn", lambda *args: seen.append("cudnn") or args[0])
  monkeypatch.setattr(splash, "target_platform", lambda: "gpu")
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  attention.attend("auto", q, q, q, jnp.ones((1, 8), jnp.int32))
  assert seen == ["cudnn"]
  want = attention.xla_attention(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32),
                                 jnp.ones((1, 8), jnp.int32))
  got = attention.attend("auto", *(q.astype(jnp.float32),) * 3, jnp.ones((1, 8), jnp.int32))  # float32: xla
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert seen == ["cudnn"]


def test_settings_auto_does_not_use_are_warned_about():
  cfg = _model(splash_block_q=256)
  (warning,) = attention.auto_inert_keys(cfg, {"attention_impl": "xla", "moe_impl": "none"})
  assert "model.splash_block_q=256 has no effect: model.attention_impl=auto runs xla here" in warning
  assert attention.auto_inert_keys(cfg, {"attention_impl": "splash", "moe_impl": "none"}) == []
  moe_cfg = configs.load("tiny_moe", **{"model.moe_impl": "auto", "model.megablox_tile_m": 256}).model
  (warning,) = attention.auto_inert_keys(moe_cfg, {"attention_impl": "xla", "moe_impl": "tiled"})
  assert "model.megablox_tile_m=256 has no effect: model.attention_impl=auto runs xla, model.moe_impl=auto runs " \
         "tiled here" in warning
  assert attention.auto_inert_keys(moe_cfg, {"attention_impl": "xla", "moe_impl": "megablox"}) == []


@pytest.mark.parametrize("platform, expected", [("tpu", "megablox"), ("gpu", "ragged"), ("cpu", "tiled")])
def test_moe_auto_picks_the_platforms_grouped_matmul(platform, expected):
  config = configs.load("tiny_moe", **{"model.moe_impl": "auto"}).model
  assert configs.load("tiny").model.moe_impl == "auto"  # the default
  assert moe.resolve_impl(config, platform) == expected
  assert moe.resolve_impl(configs.load("tiny").model, platform) == "none"  # dense: no experts
  assert moe.resolve_impl(configs.load("tiny_moe").model, platform) == "tiled"  # explicit, portable: kept


def test_moe_auto_builds_what_it_picks(monkeypatch):
  config = configs.load("tiny_moe", **{"model.moe_impl": "auto"}).model
  monkeypatch.setattr(megablox, "target_platform", lambda: "tpu")
  (layer,) = {type(m.impl) for _, m in nnx.iter_graph(Transformer(config, rngs=nnx.Rngs(0)))
              if isinstance(m, moe.MoE)}
  assert layer is megablox.MegabloxOptions
  monkeypatch.setattr(megablox, "target_platform", lambda: "cpu")
  impls = {m.impl for _, m in nnx.iter_graph(Transformer(config, rngs=nnx.Rngs(0))) if isinstance(m, moe.MoE)}
  assert impls == {"tiled"}


def test_the_planner_sizes_what_auto_runs():
  config = configs.load("tiny", **{"train.seq_len": 128})
  assert memory.attention_impl(config.model, "tpu") == "splash"
  assert memory.attention_impl(config.model, "cpu") == "xla"
  on_tpu = memory.activation_memory(config, 16, remat="none", platform="tpu")["total"]
  on_cpu = memory.activation_memory(config, 16, remat="none", platform="cpu")["total"]
  splash_cfg = configs.load("tiny", **{"train.seq_len": 128, "model.attention_impl": "splash"})
  assert on_tpu == memory.activation_memory(splash_cfg, 16, remat="none")["total"] < on_cpu


def test_runs_keep_their_own_choice_over_a_checkpoints():
  """A checkpoint saved with xla (the default before auto) taken up by a run under auto: the same function, so the
  run's choice stands (init_from; a resume may change it too)."""
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  config = configs.load("tiny")
  saved = dict(config.model.to_dict(), attention_impl="xla")
  assert runconfig.model_from(config, saved, "a checkpoint", overrides=[]) == []
  assert config.model.attention_impl == "auto"
  assert "attention_impl" in runconfig.FUNCTION_PRESERVING and "attention_impl" in runconfig.RESUME_FREE


# ---- the Trainer: resolved once, said once, refused before compiling ------------------------------------------
def test_the_trainer_records_and_says_what_it_runs(capsys):
  from train.core import step  # pylint: disable=g-import-not-at-top
  step._SAID.clear()  # pylint: disable=protected-access  (said once per process: other tests may have built one)
  config = configs.load("tiny", **{"model.splash_block_q": 256})
  mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
  trainer = step.Trainer(config, mesh)
  step.Trainer(config, mesh)
  assert trainer.attention_impl == "xla" and trainer.moe_impl == "none"
  assert trainer.runtime() == {"platform": "cpu", "devices": 1, "attention_impl": "xla", "moe_impl": "none",
                               "jax": jax.__version__}
  err = capsys.readouterr().err
  assert err.count("kernels: model.attention_impl=auto runs xla on cpu") == 1
  assert err.count("model.splash_block_q=256 has no effect") == 1
  with pytest.raises(ValueError, match="model.attention_impl='cudnn' runs NVIDIA's cuDNN kernel"):
    step.Trainer(configs.load("tiny", **{"model.attention_impl": "cudnn", "model.dtype": "bfloat16"}), mesh)


def test_the_training_cli_exits_2_for_cudnn_on_cpu(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "train", f"--workdir={tmp_path / 'run'}",
                         "--config.model.attention_impl=cudnn"], cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert "model.attention_impl='cudnn'" in proc.stderr and "Traceback" not in proc.stderr
  assert not (tmp_path / "run" / "config.json").exists()


# ---- the cuDNN call, checked through XLA's implementation -----------------------------------------------------
def _inputs(T=64, H=4, G=2, K=16, B=2):
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, G, G))
  w = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
  seg = jnp.asarray([[1] * T, [1] * 20 + [2] * 30 + [0] * (T - 50)], jnp.int32)
  return q, k, v, w, seg


def _value_and_grads(fn, q, k, v, w):
  o, vjp = jax.vjp(fn, q, k, v)
  return (o, *vjp(w))


CASES = {
    "causal": {}, "window 8": {"window": 8}, "bidirectional": {"causal": False},
    "prefix": {"prefix_BT": jnp.asarray(np.arange(64) < 10, jnp.int32)[None].repeat(2, 0)},
    "branches": {"branch_BT": jnp.asarray([[0] * 30 + [1] * 17 + [2] * 17, [0] * 64], jnp.int32)},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cudnn_call_computes_meshlms_mask(case):
  q, k, v, w, seg = _inputs()
  kw = CASES[case]
  got = _value_and_grads(lambda q, k, v: attention.cudnn_attention(q, k, v, seg, implementation="xla", **kw),
                         q, k, v, w)
  want = _value_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, seg, **kw), q, k, v, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_a_traced_window_and_a_mesh():
  """The layer scan's traced window goes in through the mask; under a data=2 x tensor=4 mesh each device runs the
  call on its rows and heads (shard_heads)."""
  q, k, v, w, seg = _inputs(H=8, G=4)
  want = _value_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, seg, 8), q, k, v, w)
  config = configs.load("tiny", **{"mesh.data": 2, "mesh.tensor": 4, "model.num_heads": 8, "model.num_kv_heads": 4})
  mesh = mesh_lib.make_mesh(config.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), config.model, mesh)
  with parallel.activate(mesh, rules):
    fn = jax.jit(lambda q, k, v, w, window: _value_and_grads(
        lambda q, k, v: attention.cudnn_attention(q, k, v, seg, window, implementation="xla"), q, k, v, w))
    got = fn(q, k, v, w, jnp.int32(8))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_cudnn_kernel_is_refused_off_gpu_when_traced():
  q, k, v, _, seg = _inputs()
  with pytest.raises(ValueError, match="model.attention_impl='cudnn' runs NVIDIA's cuDNN kernel"):
    attention.cudnn_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), seg)
