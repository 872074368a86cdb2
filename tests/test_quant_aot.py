"""model.quant=int8 compiled ahead of time for a TPU v5e chip (libtpu's compiler, no TPU attached): the optimised
HLO multiplies the seven projections of a layer as s8 x s8 -> s32 and nothing else in 8 bits."""
import collections

import pytest

import configs
from train.planning import compile as aot
from train.planning import hardware

# One layer: q, k, v (k and v share a spec under GQA), o; MLP gate and up (same spec), down.
from train.planning import hlo

# One layer: q, k, v (k and v share a spec under GQA), o; MLP gate and up (same spec), down.
PROJECTIONS = collections.Counter({"bld,dhk->blhk": 1, "bld,dgk->blgk": 2, "blhk,hkd->bld": 1, "bld,df->blf": 2,
                                   "blf,fd->bld": 1})


@pytest.fixture(scope="module")
def int8_matmuls():
  config = configs.load("tiny", **{"model.quant": "int8", "model.num_layers": 1, "model.vocab_size": 256,
                                   "mesh.data": 1, "train.batch_size": 4, "train.seq_len": 64,
                                   "model.max_seq_len": 64})
  _, compiled = aot.compile_trainer(config, aot.abstract_devices(hardware.tpu_slice("v5e-1")))
  text = compiled.as_text()
  return hlo.matmuls(text), aot.matmul_types(text)


def test_the_projections_compile_to_int8_matmuls_with_int32_results(int8_matmuls):
  found, types = int8_matmuls
  eight_bit = [m for m in found if {"s8", "u8"} & set(m["operands"])]
  assert all(m["operands"] == ("s8", "s8") and m["result"] == "s32" for m in eight_bit), eight_bit
  # The jax op behind each: the forward projection einsums, none from the backward pass (straight-through in float).
  specs = collections.Counter(m["source"].split("/")[-2] for m in eight_bit)
  assert specs == PROJECTIONS
  assert not any("transpose" in m["source"] for m in eight_bit)
  assert types["s8 x s8 -> s32"] == sum(PROJECTIONS.values())
  # The output projection and every gradient matmul stay in floating point.
  assert any("bld,dv->blv" in m["source"] and m["operands"][0] != "s8" for m in found)
  assert sum(m["result"] in ("f32", "bf16") for m in found) > len(eight_bit)
