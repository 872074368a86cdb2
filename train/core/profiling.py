"""Performance tools of the run loop: a jax.profiler trace of chosen steps and the persistent compilation cache.

`train.profile_steps = "A:B"` traces steps A <= step < B into WORKDIR/tensorboard (the TensorBoard profile
plugin and Perfetto read it); `train.compile_cache` points XLA's persistent compilation cache at a directory so
that a repeated or resumed run loads its executables instead of compiling them (docs/throughput.md).
"""
from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from configs import validate
from train.core.logger import TENSORBOARD_DIR


class StepProfiler:
  """Starts a jax.profiler trace before step A is dispatched and stops it once step B-1 has finished."""

  def __init__(self, spec: str, workdir: str):
    self.window = validate.profile_window(spec)
    self.directory = os.path.join(workdir, TENSORBOARD_DIR)
    self.active = False

  def before(self, step: int) -> None:
    """Call before dispatching `step`."""
    if self.window and step == self.window[0]:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after(self, step: int, outputs) -> None:
    """Call after dispatching `step` (its `outputs` are awaited when the trace ends here)."""
    if self.active and step == self.window[1] - 1:
      jax.block_until_ready(outputs)  # the trace must hold the device work, not only its dispatch
      self.stop()

  def stop(self) -> None:
    """Ends the trace (also when the run stops inside the window); a no-op when none is running."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()


def compile_cache_dir(setting: str) -> str | None:
  """The directory `train.compile_cache` names: "auto" -> $XDG_CACHE_HOME (else ~/.cache)/meshlm/xla; "" -> None."""
  if not setting:
    return None
  if setting == "auto":
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "meshlm", "xla")
  return os.path.abspath(os.path.expanduser(setting))


def enable_compile_cache(setting: str) -> str | None:
  """Points JAX's persistent compilation cache at `compile_cache_dir(setting)`; returns the directory (None = off).
  With "auto", a directory already given to JAX (JAX_COMPILATION_CACHE_DIR) is kept.

  Every executable that took at least a second to compile is written there, keyed by the computation, the
  devices and the compiler flags, so only an identical program on identical devices loads it. A directory
  that cannot be created turns the cache off with a warning (the run itself does not depend on it).
  """
  if setting == "auto" and jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir  # set by the user (JAX_COMPILATION_CACHE_DIR): theirs wins
  path = compile_cache_dir(setting)
  if path is None:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    print(f"warning: train.compile_cache={setting!r}: cannot create {path} ({e.strerror or e}); compiling "
          "without a persistent cache", flush=True)
    return None
  if jax.config.jax_compilation_cache_dir != path:
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()  # a cache initialised earlier in this process (or off) would keep its path
  return path
