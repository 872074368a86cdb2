"""Several `python -m MODULE` processes joined by jax.distributed on localhost (4 simulated CPU devices each), as
the multi-host tests start them."""
import contextlib
import os
import subprocess
import sys

import ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def processes(module: str, args, count: int = 2, devices: int = 4):
  """Starts `count` processes of `python -m module *args` (process ids 0..count-1, a fresh coordinator port),
  stdout/stderr piped as text; yields the Popen list and kills whatever still runs on the way out."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTEST_"))}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(os.path.abspath(__file__))]), PYTHONUNBUFFERED="1")
  distributed = [f"--config.distributed.coordinator_address=localhost:{ports.free_port()}",
                 f"--config.distributed.num_processes={count}"]
  procs = [subprocess.Popen([sys.executable, "-m", module, *args, *distributed,
                             f"--config.distributed.process_id={i}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(count)]
  try:
    yield procs
  finally:
    for p in procs:
      p.kill()


def outputs(procs, timeout: float) -> list[tuple[str, str]]:
  """(stdout, stderr) of each process once all have ended; AssertionError (with its stderr's tail) unless each
  exited 0."""
  out = [p.communicate(timeout=timeout) for p in procs]
  for p, (_, err) in zip(procs, out):
    assert p.returncode == 0, err[-3000:]
  return out
