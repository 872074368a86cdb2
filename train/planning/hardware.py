"""Accelerator facts used for MFU, planning, ahead-of-time compilation and the performance model: one table.

Peaks are dense bf16 matmul TFLOP/s per chip (the MFU denominator, `train.mfu`); HBM capacity is per chip as the data sheet
gives it (read as GiB), bandwidths in GB/s (1e9 bytes/s). Interconnect bandwidths are one-way per link: a bidirectional ring over one torus axis moves
2 x link bandwidth per chip. Sources (vendor data sheets, read 2026-11):
  TPU v4: cloud.google.com/tpu/docs/v4 (275 TFLOP/s, 32 GiB, 1200 GBps HBM, 3-D torus); ICI from Jouppi et al.
    2023, "TPU v4: An Optically Reconfigurable Supercomputer" (6 links per chip, ~50 GB/s each way).
  TPU v5e: cloud.google.com/tpu/docs/v5e (197 TFLOP/s, 16 GB, 819 GBps, 400 GBps bidirectional ICI over 4 ports,
    2-D torus, 6.4 Tbps DCN per 256-chip pod).
  TPU v5p: cloud.google.com/tpu/docs/v5p (459 TFLOP/s, 95 GiB, 2765 GBps, 1200 GBps bidirectional ICI over 6 ports,
    3-D torus, 50 Gbps DCN per chip).
  TPU v6e (Trillium): cloud.google.com/tpu/docs/v6e (918 TFLOP/s, 32 GB, 1638 GBps, 800 GBps bidirectional ICI over
    4 ports, 2-D torus, 4 x 200 Gbps NICs per 8-chip host).
  H100 / H200 SXM: NVIDIA H100 and H200 Tensor Core GPU data sheets (989 TFLOP/s dense bf16; 80 GB at 3.35 TB/s,
    141 GB at 4.8 TB/s; NVLink 4 900 GB/s bidirectional per GPU through NVSwitch within an 8-GPU node); between
    nodes one 400 Gb/s InfiniBand NDR adapter per GPU (DGX H100 / HGX H200 reference designs).
  A100: NVIDIA A100 data sheet (312 TFLOP/s, 1555 / 2039 GB/s, NVLink 3 600 GB/s, 200 Gb/s HDR per GPU).
  Host links (what offloaded activations cross): TPUs ~16 GB/s one way per chip (PCIe Gen4 x8; the JAX scaling book,
    "How to Think About TPUs", works with 1.5e10 B/s for v6e), A100 PCIe Gen4 x16 (32 GB/s), H100 / H200 PCIe Gen5
    x16 (64 GB/s).
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  peak_tflops: float  # dense bf16 TFLOP/s per chip
  hbm_gib: float  # memory per chip, GiB
  tpu_family: str = ""  # jax topology prefix ("v4", "v5e", "v5p", "v6e"); empty for GPUs
  cores_per_chip: int = 1  # TensorCores per chip; v4/v5p run them as one megacore jax device
  hbm_gbps: float = 0.0  # HBM bandwidth per chip, GB/s
  ici_links: int = 0  # TPU: ICI ports per chip (2 per torus axis); GPU: 1 (NVSwitch: one fat link per GPU)
  ici_link_gbps: float = 0.0  # one-way GB/s per ICI link (GPU: NVLink one-way per GPU)
  dcn_gbps: float = 0.0  # one-way GB/s per chip across slices (TPU DCN) or nodes (GPU InfiniBand)
  ici_domain: int = 0  # GPUs: chips reachable over NVLink (the node); 0 for TPUs (the whole slice)
  host_gbps: float = 0.0  # one-way GB/s per chip between its memory and the host's (PCIe)

  @property
  def hbm_bytes(self) -> float:
    return self.hbm_gib * 2**30

  @property
  def platform(self) -> str:
    """jax's platform name for the chip: "tpu" or "gpu" (what model.attention_impl=auto decides by)."""
    return "tpu" if self.tpu_family else "gpu"


CHIPS: dict[str, Chip] = {c.name: c for c in [
    Chip("tpu_v4", 275.0, 32.0, "v4", 2, hbm_gbps=1200, ici_links=6, ici_link_gbps=50, dcn_gbps=3.125,
         host_gbps=16),
    Chip("tpu_v5e", 197.0, 16.0, "v5e", 1, hbm_gbps=819, ici_links=4, ici_link_gbps=50, dcn_gbps=3.125,
         host_gbps=16),
    Chip("tpu_v5p", 459.0, 95.0, "v5p", 2, hbm_gbps=2765, ici_links=6, ici_link_gbps=100, dcn_gbps=6.25,
         host_gbps=16),
    Chip("tpu_v6e", 918.0, 32.0, "v6e", 1, hbm_gbps=1638, ici_links=4, ici_link_gbps=100, dcn_gbps=12.5,
         host_gbps=16),
    Chip("a100_40gb", 312.0, 40.0, hbm_gbps=1555, ici_links=1, ici_link_gbps=300, dcn_gbps=25, ici_domain=8,
         host_gbps=32),
    Chip("a100_80gb", 312.0, 80.0, hbm_gbps=2039, ici_links=1, ici_link_gbps=300, dcn_gbps=25, ici_domain=8,
         host_gbps=32),
    Chip("h100", 989.0, 80.0, hbm_gbps=3350, ici_links=1, ici_link_gbps=450, dcn_gbps=50, ici_domain=8,
         host_gbps=64),
    Chip("h200", 989.0, 141.0, hbm_gbps=4800, ici_links=1, ici_link_gbps=450, dcn_gbps=50, ici_domain=8,
         host_gbps=64),
]}

# Substrings of jax's `device.device_kind` -> CHIPS key (first match wins; order matters: v5 lite before v5).
_DEVICE_KINDS = (
    ("tpu v4", "tpu_v4"),
    ("tpu v5 lite", "tpu_v5e"),
    ("tpu v5e", "tpu_v5e"),
    ("tpu v5p", "tpu_v5p"),
    ("tpu v5", "tpu_v5p"),
    ("tpu v6", "tpu_v6e"),
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100-sxm4-80gb", "a100_80gb"),
    ("a100 80gb", "a100_80gb"),
    ("a100", "a100_40gb"),
)


def chip_for_device_kind(device_kind: str) -> Chip | None:
  """The Chip for a jax `device.device_kind` string, or None (e.g. a CPU) when the peak is unknown."""
  kind = device_kind.lower()
  for needle, key in _DEVICE_KINDS:
    if needle in kind:
      return CHIPS[key]
  return None


def peak_flops_per_device(device_kind: str, override_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device (override in TFLOP/s wins); None where unknown, so MFU is omitted."""
  if override_tflops > 0:
    return override_tflops * 1e12
  chip = chip_for_device_kind(device_kind)
  return chip.peak_tflops * 1e12 if chip else None


def find_chip(name: str) -> Chip:
  """A Chip by table key or common spelling: `tpu_v4`, `v4`, `v5litepod`, `a100-80gb`, `H100`."""
  key = name.strip().lower().replace("-", "_").replace(" ", "_")
  aliases = {"v5litepod": "tpu_v5e", "v5lite": "tpu_v5e", "trillium": "tpu_v6e", "a100": "a100_40gb",
             "a100_40g": "a100_40gb", "a100_80g": "a100_80gb"}
  key = aliases.get(key, key)
  for candidate in (key, "tpu_" + key):
    if candidate in CHIPS:
      return CHIPS[candidate]
  raise ValueError(f"unknown accelerator {name!r}; use one of: {', '.join(CHIPS)} (or add it to train/planning/hardware.py)")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """A TPU slice as jax.experimental.topologies names it, plus the chip facts."""
  chip: Chip
  topology: str  # e.g. "v4:2x2x4"
  num_chips: int  # chips per slice (= jax devices: megacore where the chip has two cores)
  num_slices: int = 1  # slices joined over DCN

  def topology_kwargs(self) -> dict:
    """Keyword arguments of `get_topology_desc(platform="tpu", topology_name=self.topology, **kw)`."""
    kw: dict = {"num_slices": self.num_slices}
    if self.chip.cores_per_chip > 1:
      kw["chip_config_name"] = "megacore"  # one device per chip, as on real v4/v5p pods
    if self.num_chips < 4:  # a host holds 2x2x1 chips by default; smaller slices are one host
      dims = [int(d) for d in self.topology.split(":")[1].split("x")]
      kw["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
    return kw


  @property
  def torus(self) -> tuple[int, ...]:
    """Chips along each physical axis of one slice, e.g. (16, 16) for v5e:16x16; () for GPUs."""
    if not self.chip.tpu_family:
      return ()
    return tuple(int(d) for d in self.topology.split(":")[1].split("x"))


# Slice shapes as Cloud TPU names them: 3-D tori grown by doubling the smallest (last) axis, 2-D for v5e/v6e.
_V5E_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def _torus_shape(chips: int) -> str:
  dims = [2, 2, 1]
  while dims[0] * dims[1] * dims[2] < chips:
    smallest = min(dims)
    i = max(j for j, d in enumerate(dims) if d == smallest)
    dims[i] *= 2
  return "x".join(map(str, dims))


def tpu_slice(name: str, num_slices: int = 1) -> TpuSlice:
  """Parses a slice name: `v4-32`, `v5p-16`, `v5e-16` / `v5litepod-16`, `v6e-256`, or the raw `v4:2x2x4` form.

  In `v4-N` and `v5p-N`, N counts TensorCores (two per chip), so v4-32 is 16 chips ("v4:2x2x4"); in `v5e-N`
  N counts chips (also `v6e-N`). Raises ValueError naming the accepted forms.
  """
  text = name.strip().lower().replace("v5litepod", "v5e").replace("tpu", "").lstrip("_-")
  if num_slices < 1:
    raise ValueError(f"num_slices must be >= 1, got {num_slices}")
  if ":" in text:
    family, shape = text.split(":", 1)
    chip = _chip_for_family(family, name)
    try:
      dims = [int(d) for d in shape.split("x")]
    except ValueError:
      raise ValueError(f"topology {name!r}: shape {shape!r} must look like 2x2x4") from None
    return TpuSlice(chip, f"{chip.tpu_family}:{shape}", math.prod(dims), num_slices)
  family, _, count = text.partition("-")
  chip = _chip_for_family(family, name)
  if not count.isdigit():
    raise ValueError(f"topology {name!r}: expected e.g. {chip.tpu_family}-32 or {chip.tpu_family}:2x2x4")
  n = int(count)
  if chip.cores_per_chip == 1:  # v5e, v6e: 2-D slices named by chips
    if n not in _V5E_SHAPES:
      raise ValueError(f"topology {name!r}: {chip.tpu_family} slices have {sorted(_V5E_SHAPES)} chips")
    return TpuSlice(chip, f"{chip.tpu_family}:{_V5E_SHAPES[n]}", n, num_slices)
  chips = n // chip.cores_per_chip
  if n % chip.cores_per_chip or chips < 4 or chips & (chips - 1):
    raise ValueError(f"topology {name!r}: {chip.tpu_family}-N counts TensorCores (2 per chip); N must be 8, 16, "
                     f"32, ... (a power of two >= 8); other shapes in the raw form, e.g. {chip.tpu_family}:4x4x12")
  return TpuSlice(chip, f"{chip.tpu_family}:{_torus_shape(chips)}", chips, num_slices)


def _chip_for_family(family: str, name: str) -> Chip:
  for chip in CHIPS.values():
    if chip.tpu_family and chip.tpu_family == family:
      return chip
  families = sorted(c.tpu_family for c in CHIPS.values() if c.tpu_family)
  raise ValueError(f"topology {name!r}: unknown TPU generation {family!r}; use one of {families}")


def slice_for_chips(chip: Chip | str, chips: int) -> TpuSlice:
  """The TPU slice(s) of `chips` chips: one slice where the generation has one that large (v4/v5p: a torus
  named by TensorCores; v5e/v6e: up to 256 chips), else 256-chip v5e/v6e slices joined over DCN."""
  chip = find_chip(chip) if isinstance(chip, str) else chip
  if not chip.tpu_family:
    raise ValueError(f"{chip.name} is not a TPU; ahead-of-time compilation targets TPU slices")
  if chip.cores_per_chip == 1 and chips > 256:
    if chips % 256:
      raise ValueError(f"{chips} {chip.tpu_family} chips: beyond one 256-chip slice use multiples of 256")
    return tpu_slice(f"{chip.tpu_family}-256", chips // 256)
  return tpu_slice(f"{chip.tpu_family}-{chips * chip.cores_per_chip}")


def local_slice(devices: list) -> TpuSlice:
  """The attached accelerators (e.g. 8 GPUs of one host) as a slice, for compiling and predicting on them;
  ValueError when their peak is unknown (a CPU)."""
  chip = chip_for_device_kind(devices[0].device_kind)
  if chip is None:
    raise ValueError(f"--topology=local: no data-sheet figures for device kind {devices[0].device_kind!r}; "
                     "use a TPU topology (v5e-256, ...) or run on GPUs listed in train/planning/hardware.py")
  return TpuSlice(chip, f"local:{len(devices)}x{chip.name}", len(devices))
