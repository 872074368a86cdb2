"""Throughput tools (docs/throughput.md): projections as 2-D matmuls, the profiler trace of `train.profile_steps`,
the persistent compilation cache, the loop's MFU figures with the compiling first step kept out of the window, and
the host-memory setting that keeps a step's temporaries mapped between steps.

One 3-step run (module fixture) serves the loop tests.
"""
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

import configs
from configs.loader import ConfigError
from configs import validate
from model import quant
from train.core import loop
from train.planning import mfu
from train.core import profiling

SMALL = {"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2,
         "model.head_dim": 16, "model.mlp_dim": 128, "model.vocab_size": 512, "model.max_seq_len": 64,
         "train.seq_len": 64, "train.batch_size": 8, "train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1,
         "train.eval_every": 0, "checkpoint.every": 0, "log.progress": False, "log.tensorboard": False,
         "train.peak_tflops": 1.0, "train.profile_steps": "2:4", "data.tokenizer_max_sentences": 2000}


@pytest.mark.parametrize("spec,x_shape,w_shape", [("bld,dhk->blhk", (2, 3, 4), (4, 5, 6)),
                                                  ("blhk,hkd->bld", (2, 3, 5, 6), (5, 6, 4)),
                                                  ("bld,df->blf", (2, 3, 4), (4, 7)),
                                                  ("bld,vd->blv", (2, 3, 4), (7, 4))])  # not a projection: einsum
def test_project_equals_the_einsum_with_its_gradients(spec, x_shape, w_shape):
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=x_shape).astype(np.float32), rng.normal(size=w_shape).astype(np.float32)
  g = rng.normal(size=np.einsum(spec, x, w).shape).astype(np.float32)
  # Reference in NumPy: y = einsum(x, w); with cotangent g, dx = einsum(g, w), dw = einsum(x, g) over the free axes.
  inputs, out = spec.split("->")
  a, b = inputs.split(",")
  want_dx = np.einsum(f"{out},{b}->{a}", g, w)
  want_dw = np.einsum(f"{a},{out}->{b}", x, g)
  y, vjp = jax.vjp(lambda x, w: quant.project(spec, x, w), jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  np.testing.assert_allclose(y, np.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_profile_steps_are_checked():
  assert validate.profile_window("10:13") == (10, 13)
  assert validate.profile_window("") is None
  for bad in ("3:3", "0:2", "5", "a:b", "2:1"):
    with pytest.raises(ConfigError, match="train.profile_steps"):
      validate.check(configs.load("tiny", **{"train.profile_steps": bad}))


def test_compile_cache_dir_follows_the_setting(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert profiling.compile_cache_dir("auto") == str(tmp_path / "meshlm" / "xla")
  assert profiling.compile_cache_dir("") is None
  assert profiling.compile_cache_dir(str(tmp_path / "c")) == str(tmp_path / "c")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 3-step run tracing steps 2..3 with its own compilation cache; jax's cache settings restored after."""
  root = tmp_path_factory.mktemp("throughput")
  cache = root / "xla"
  saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  # Every executable is written whatever its compile time, so the check does not depend on this machine's speed.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  try:
    config = configs.load("tiny", **SMALL, **{"train.compile_cache": str(cache)})
    loop.run(config, str(root / "run"))
  finally:
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    compilation_cache.reset_cache()
  with open(root / "run" / "metrics.jsonl") as f:
    lines = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
  return {"root": root, "cache": cache, "lines": lines, "config": config}


def test_profile_trace_is_written(run):
  traces = glob.glob(str(run["root"] / "run" / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert traces and os.path.getsize(traces[0]) > 0


def test_compile_cache_gets_entries(run):
  assert [p for p in os.listdir(run["cache"]) if not p.startswith(".")]


def test_first_window_excludes_compilation_and_both_mfus_are_logged(run):
  lines, c = run["lines"], run["config"]
  # Step 1 compiles: its window holds no timed step, so it reports no throughput; later steps do.
  assert "tokens_per_sec" not in lines[1] and "mfu" not in lines[1]
  for step in (2, 3):
    line = lines[step]
    flops = {h: mfu.flops_per_token(c.model, c.train.seq_len, h) for h in (True, False)}
    assert line["mfu"] == pytest.approx(line["tokens_per_sec"] * flops[True] / (jax.device_count() * 1e12))
    assert line["mfu_full_attention"] == pytest.approx(line["mfu"] * flops[False] / flops[True])
    assert line["mfu_full_attention"] > line["mfu"]


# A jitted gradient whose temporaries (the [8192, 2048] float32 hidden activations and their gradient) are one
# 128 MiB buffer per call. Prints whether the setting applied, the temporaries' bytes, the fewest minor page
# faults of 8 calls after warm-up (a call that reuses the last one's pages takes none; now and then the kept heap
# grows by a buffer, see train/core/hostmem.py), and the faults of one call after release_freed_host_memory().
_FAULTS_PROBE = """
import resource, time
from train.core import hostmem
applied = hostmem.keep_freed_host_memory()
import jax, jax.numpy as jnp
f = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w[0]) @ w[1])))
w, x = (jnp.full((256, 2048), 1e-3), jnp.full((2048, 4), 1e-3)), jnp.ones((8192, 256))
temp = f.lower(w, x).compile().memory_analysis().temp_size_in_bytes
def faults():
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(f(w, x))
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(2):
  faults()
steady = min(faults() for _ in range(8))
time.sleep(0.5)  # the runtime frees a call's temporaries on its own thread, after the result is ready
hostmem.release_freed_host_memory()
print(applied, temp, steady, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_host_memory_stays_mapped_between_steps():
  """With glibc's defaults each call maps its temporaries afresh and faults in every page (reference: temporary
  bytes / page size per call); with `keep_freed_host_memory()` a call reuses the previous call's pages, until
  `release_freed_host_memory()` gives them back."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = {}
  for system in ("1", "0"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=root, MESHLM_SYSTEM_MALLOC=system)
    out = subprocess.run([sys.executable, "-c", _FAULTS_PROBE], env=env, capture_output=True, text=True, check=True)
    applied, temp, steady, after_release = out.stdout.split()[-4:]
    results[system] = (applied, int(temp), float(steady), int(after_release))
  pages = results["0"][1] / os.sysconf("SC_PAGE_SIZE")
  (applied_off, temp, steady_off, _), (applied_on, _, steady_on, after_release) = results["1"], results["0"]
  assert (applied_off, applied_on) == ("False", "True") and temp >= 100 * 2**20
  assert steady_off > 0.5 * pages  # glibc's defaults: the buffer is unmapped at free and faulted in again
  assert steady_on < 0.01 * pages
  assert after_release > 0.5 * pages  # released: the next call faults its buffer in once more


def test_products_floor_counts_every_product_once_per_loop_iteration(monkeypatch):
  # benchmarks/products.py times a program's matmuls alone; its count must equal the closed form: 3 scanned
  # [8, 16] x [16, 16] products, a batched [4 x (8, 16) . (16, 8)] one and, in the gradient, two per scanned one.
  monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  from products import products_only

  def f(x, ws, a):
    y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)  # [8, 16] @ [16, 16], 3 times
    return jnp.sum(y) + jnp.sum(jnp.einsum("bik,bjk->bij", a, a))

  x, ws, a = jnp.ones((8, 16)), jnp.ones((3, 16, 16)) * 0.01, jnp.ones((4, 8, 16))
  forward = products_only(jax.jit(f).lower(x, ws, a).compile().as_text(), reps=1)
  assert forward["count"] == 4
  assert forward["gflop"] * 1e9 == 3 * 2 * 8 * 16 * 16 + 2 * 4 * 8 * 8 * 16
  backward = products_only(jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, ws, a).compile().as_text(), reps=1)
  assert backward["gflop"] * 1e9 == 3 * 3 * 2 * 8 * 16 * 16  # per step: forward, input and weight gradients
  assert backward["seconds"] > 0
