"""Test setup: 8 simulated CPU devices, configured before JAX initialises."""
import os

# Must happen before the first `import jax` anywhere in the test process.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _compilation_cache_dir():
  """One persistent XLA compilation cache per test session, shared by the xdist workers and the subprocesses
  tests start (they inherit the environment): many tests compile the same tiny programs (the same step, sampler or
  forward in another run directory), and loading an executable costs a fraction of compiling it. Set
  JAX_COMPILATION_CACHE_DIR yourself to keep a cache between sessions, or to "" to compile everything."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  import tempfile
  # xdist workers inherit the controller's environment, so they find its directory above.
  return os.path.join(tempfile.gettempdir(), f"meshlm-test-xla-cache-{os.getpid()}")


os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache_dir()
# Tiny programs compile in well under jax's default 1 s threshold; cache them all.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# As every meshlm command does on the CPU: each compiled call's temporaries stay mapped between calls instead of
# being page-faulted in again (train/core/hostmem.py).
from train.core.hostmem import keep_freed_host_memory  # noqa: E402

keep_freed_host_memory()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8, jax.devices()


def pytest_sessionfinish(session):
  """The session's own compilation cache goes with it (the controller removes it after the workers finish)."""
  if hasattr(session.config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ:
    return
  directory = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
  if os.path.basename(directory).startswith("meshlm-test-xla-cache-"):
    import shutil
    shutil.rmtree(directory, ignore_errors=True)


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Each XLA:CPU executable keeps ~6 memory mappings of its code until it is freed, and a worker that runs
  hundreds of modules without freeing them passes Linux's 65,530 mappings per process (vm.max_map_count): the
  next mmap fails and XLA aborts mid-compile. jax's caches are dropped after each module (the persistent cache
  on disk makes a later recompile a load)."""
  yield
  import gc
  jax.clear_caches()
  gc.collect()
  if os.environ.get("MESHLM_TEST_MAPS"):
    print(f"\n[maps after module: {_memory_maps()}]")
