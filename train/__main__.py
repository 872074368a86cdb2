"""`python -m train [--config=tiny] [--config.SECTION.KEY=VALUE ...] [--workdir=runs/<config name>]`.

Trains, evaluates and checkpoints; the same command on the same workdir resumes from the latest checkpoint.
Exit codes: 0 done (or stopped cleanly by SIGTERM/SIGINT, with a checkpoint), 1 training failed (non-finite
halt, full disk), 2 bad command line, config or workdir (nothing was run).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Sequence

from train.core import hostmem


def _accelerator_devices() -> bool:
  """Whether this host has TPU or GPU device files."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"))


def _accelerator_present() -> bool:
  """Whether this host looks like it has a TPU or GPU, judged without initialising JAX."""
  return any(k.startswith(("TPU_", "CLOUD_TPU")) for k in os.environ) or _accelerator_devices()


def _default_platform() -> None:
  # With libtpu installed (the test extra), every JAX start on a CPU-only machine probes for a TPU and prints
  # warnings. Pin JAX to the CPU only when the user chose no platform and the host has no accelerator device.
  if "JAX_PLATFORMS" not in os.environ and not _accelerator_present():
    os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
    hostmem.keep_freed_host_memory()


def main(argv: Sequence[str] | None = None) -> int:
  _default_platform()  # before the first JAX import
  import configs  # pylint: disable=g-import-not-at-top
  from train.core import loop  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(
      prog="python -m train", description="Train a meshlm model; the same command on the same workdir resumes.",
      epilog="Override any config key with --config.SECTION.KEY=VALUE (every key: configs/base.py), e.g. "
             "--config.train.steps=500. Exit codes: 0 done or stopped by SIGTERM/SIGINT with a checkpoint, "
             "1 training failed, 2 bad arguments/config/workdir.")
  parser.add_argument("--workdir", default=None,
                      help="run directory: config, metrics, checkpoints, tokenizer (default: runs/<config name>)")
  try:
    config, args = configs.parse(sys.argv[1:] if argv is None else argv, parser)
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  # loop.run checks the workdir before any device work
  return run_in_workdir(loop.run, config, args)


def run_in_workdir(run, config, args) -> int:
  """`run(config, workdir, overrides)` in --workdir (default runs/<config name>) -> the exit code: 0 done, 2 bad
  config or workdir (loop.SetupError / WorkdirError), 1 training failed (loop.TrainingError); errors on stderr."""
  from train.core import loop  # pylint: disable=g-import-not-at-top
  workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
  existed = os.path.exists(workdir)
  try:
    run(config, workdir, args.overrides)
  except (loop.SetupError, loop.WorkdirError) as e:
    print(f"error: {e}", file=sys.stderr)
    if not existed and os.path.isdir(workdir) and not os.listdir(workdir):
      os.rmdir(workdir)  # a refused start leaves nothing behind, not even the directory it made
    return 2
  except loop.TrainingError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:  # the second Ctrl-C: stop at once, in one line
    print(f"interrupted: a second SIGINT stopped the run at once; {workdir} keeps its last complete checkpoint, "
          "and the same command resumes from it", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
