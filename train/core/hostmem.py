"""Host memory on the CPU platform: keep the buffers XLA frees mapped between steps, and give back what piles up.

XLA:CPU allocates each call's temporaries as one buffer (207 MB for the tiny config's training step) from its
worker threads. glibc serves a buffer that large with mmap (a thread's own arena cannot hold more than 64 MB) and
unmaps it when freed, so every step page-faults ~50,000 kernel-zeroed pages back in: 15-25% of a CPU training step
(docs/throughput.md). `keep_freed_host_memory` makes glibc keep freed memory (one arena, no mmap, no trimming), so
the next step reuses the pages. Small allocations made between steps then split the freed block, and one that
lives on leaves a hole too small for the next step's buffer: the heap grows by a buffer now and then (600 tiny
steps: peak RSS 0.65 -> 1.4 GB). `release_freed_host_memory` (`malloc_trim`, called by the training loop after
each logging step) returns free pages to the system, holes included; the step after pays the faults once.

Only standard-library imports: `train/__main__.py` calls `keep_freed_host_memory` before JAX starts.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

_libc = None  # set once keep_freed_host_memory has applied its settings


def keep_freed_host_memory() -> bool:
  """Makes glibc's malloc keep freed memory mapped (one arena, no mmap, no trimming); returns whether it did.

  Call it before JAX starts its CPU backend: a thread chooses its arena at its first allocation. A no-op (False)
  without glibc, or with MESHLM_SYSTEM_MALLOC=1 (to compare, or to keep an LD_PRELOADed allocator's settings).
  """
  global _libc
  if os.environ.get("MESHLM_SYSTEM_MALLOC", "") not in ("", "0") or not sys.platform.startswith("linux"):
    return False
  if platform.libc_ver()[0] != "glibc":
    return False
  try:
    libc = ctypes.CDLL("libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # <malloc.h>
  # Trim threshold -1 is SIZE_MAX as glibc reads it: never trim. Without mmap, glibc still falls back to it when
  # the heap cannot grow.
  if all(mallopt(option, value) == 1 for option, value in ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, -1))):
    _libc = libc
  return _libc is not None


def release_freed_host_memory() -> None:
  """Returns the heap's free pages to the system (`malloc_trim(0)`); a no-op unless the settings above apply."""
  if _libc is not None:
    _libc.malloc_trim(0)
