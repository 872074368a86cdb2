"""Multi-process start-up: `jax.distributed.initialize` when the environment (or config) says so.

Decision (config.distributed.mode = "auto"):
  1. an explicit coordinator (config.distributed.coordinator_address or JAX_COORDINATOR_ADDRESS) -> start with
     it; num_processes / process_id from config, else JAX_NUM_PROCESSES / JAX_PROCESS_ID;
  2. a SLURM job step with several tasks, or an Open MPI launch with several ranks -> let jax detect them;
  3. a multi-host Cloud TPU (TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES listing several hosts, or
     MEGASCALE_COORDINATOR_ADDRESS for multi-slice) -> let jax detect them;
  4. otherwise a single process: nothing to do.
mode "on" always calls jax.distributed.initialize (jax's own detection: use it on GCE TPU pods, whose hosts are
found through the metadata server); mode "off" never does.
Must run before any other JAX call in the process.
"""
from __future__ import annotations

import os
from typing import Any

import jax

MODES = ("auto", "on", "off")
# Every variable through which a launcher makes a process one of several (read below); a process started without
# them runs alone.
LAUNCHER_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                      "SLURM_NTASKS", "SLURM_PROCID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_RANK", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_ID",
                      "MEGASCALE_COORDINATOR_ADDRESS")


def _env_int(name: str) -> int | None:
  value = os.environ.get(name, "")
  return int(value) if value.strip() else None


def _detected_cluster() -> str | None:
  """Name of a multi-process launcher found in the environment, or None."""
  if "SLURM_JOB_ID" in os.environ and (_env_int("SLURM_NTASKS") or 1) > 1:
    return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "ompi"
  hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES") or ""
  if len([h for h in hosts.split(",") if h.strip()]) > 1 or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "tpu"
  return None


def process_of_environment() -> tuple[int, int] | None:
  """(process id, process count) that a launcher gave this process, read from the environment without starting
  JAX (for a parent that runs multi-host programs as its children): JAX_PROCESS_ID / JAX_NUM_PROCESSES, a SLURM
  step's SLURM_PROCID / SLURM_NTASKS, Open MPI's OMPI_COMM_WORLD_RANK / _SIZE, or a Cloud TPU host's TPU_WORKER_ID
  among TPU_WORKER_HOSTNAMES. None when no launcher says.
  """
  pairs = (("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"), ("SLURM_PROCID", "SLURM_NTASKS"),
           ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
  for id_name, count_name in pairs:
    pid, count = _env_int(id_name), _env_int(count_name)
    if pid is not None and count is not None:
      return pid, count
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  worker = _env_int("TPU_WORKER_ID")
  if worker is not None and hosts:
    return worker, len(hosts)
  return None


def plan(dist_cfg) -> dict[str, Any] | None:
  """The keyword arguments `initialize` would pass to `jax.distributed.initialize`, or None for one process.

  Pure function of config and environment (no JAX calls), so it can be tested and logged.
  """
  mode = dist_cfg.get("mode", "auto")
  if mode not in MODES:
    raise ValueError(f"config.distributed.mode={mode!r} is not one of {', '.join(MODES)}")
  if mode == "off":
    return None
  kwargs: dict[str, Any] = {}
  if dist_cfg.get("timeout_s", 0):
    kwargs["initialization_timeout"] = int(dist_cfg.timeout_s)
  if dist_cfg.local_device_ids:
    kwargs["local_device_ids"] = [int(i) for i in dist_cfg.local_device_ids]
  address = dist_cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if address:
    num = dist_cfg.num_processes or _env_int("JAX_NUM_PROCESSES")
    pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else _env_int("JAX_PROCESS_ID")
    cluster = _detected_cluster()
    if (num is None or pid is None) and cluster is None:
      raise ValueError(
          f"coordinator address {address!r} given but the process count / id are unknown: set "
          "config.distributed.num_processes and config.distributed.process_id (or JAX_NUM_PROCESSES and "
          "JAX_PROCESS_ID)")
    kwargs.update(coordinator_address=address, num_processes=num, process_id=pid)
    return kwargs
  if dist_cfg.num_processes > 1 or dist_cfg.process_id >= 0:
    raise ValueError("config.distributed.num_processes / process_id are set but no coordinator: set "
                     "config.distributed.coordinator_address=HOST:PORT (process 0's address)")
  if mode == "on" or _detected_cluster():
    return kwargs
  return None


def initialize(dist_cfg) -> bool:
  """Starts `jax.distributed` when `plan` says so (idempotent); returns True when running multi-process.

  On CPU, also selects the cross-process collectives (config.distributed.cpu_collectives, default gloo), which
  CPU computations spanning processes need.
  """
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  kwargs = plan(dist_cfg)
  if kwargs is None:
    return False
  collectives = dist_cfg.get("cpu_collectives", "gloo")
  if collectives:
    jax.config.update("jax_cpu_collectives_implementation", collectives)
  jax.distributed.initialize(**kwargs)
  return jax.process_count() > 1
