"""Reading collectives from compiled HLO (train/planning/hlo.py): programs compiled for TPU v4 by libtpu on this CPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train.planning import compile as aot
from train.planning import hardware
from train.planning import hlo


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(aot.abstract_devices(hardware.tpu_slice("v4-16"))), ("x",))  # 8 chips


def _compile(mesh, body, out_specs, *shapes):
  f = jax.shard_map(body, mesh=mesh, in_specs=tuple(P("x") for _ in shapes), out_specs=out_specs, check_vma=False)
  sharding = NamedSharding(mesh, P("x"))
  return jax.jit(f).lower(*(jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes)).compile()


def test_collectives_from_one_source_line_in_a_shard_map_are_counted_apart(mesh):
  # Three dependent psums written once in a loop: inside a shard_map every collective carries channel_id=1 and
  # these three also share their source op, yet they are three all-reduces of a [256, 128] float32 shard each.
  def body(a):
    out = []
    for _ in range(3):
      a = jax.lax.psum(a * 2.0, "x")
      out.append(a)
    return out

  text = _compile(mesh, body, [P("x")] * 3, (8 * 256, 128)).as_text()
  lines = [l for l in text.splitlines() if re.search(r"= \S+ all-reduce\(", l)]
  assert len(lines) == 3 and all("channel_id=1," in l for l in lines)  # the premise: one channel id
  ops = hlo.collective_ops(text, 8)
  assert [(o["kind"], o["bytes"], o["group"], o["per_step"]) for o in ops] == [("all-reduce", 256 * 128 * 4, 8, 1)] * 3
  assert hlo.collectives(text) == {"all-reduce": {"ops": 3, "per_step": 3, "bytes_per_step": 3 * 256 * 128 * 4}}


def test_two_gathers_of_different_arrays_keep_their_sizes(mesh):
  def body(a, b):
    g1 = jax.lax.all_gather(a, "x", tiled=True)
    return g1, jax.lax.all_gather(b * g1.sum(), "x", tiled=True)  # depends on g1: not combined with it

  text = _compile(mesh, body, (P(), P()), (8 * 256, 128), (8 * 32, 512)).as_text()
  ops = hlo.collective_ops(text, 8)
  assert sorted((o["kind"], o["bytes"], o["group"]) for o in ops) == [
      ("all-gather", 8 * 32 * 512 * 4, 8), ("all-gather", 8 * 256 * 128 * 4, 8)]
