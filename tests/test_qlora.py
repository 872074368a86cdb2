"""QLoRA (train.lora_base_quant): the frozen base's projection kernels stored as int8 / NF4 in the train state and
dequantized inside the layers; the adapters train against exactly that dequantized base, checkpoints restore it,
and the loss tracks the float-base LoRA run's."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import parallel
from model import basequant
from model import lora as lora_lib
from parallel import mesh as mesh_lib
from train.core import step as step_lib

SMALL = {"model.vocab_size": 256, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": 32,
         "train.seq_len": 32, "train.batch_size": 8, "train.lr": 1e-2, "train.warmup_steps": 1,
         "train.weight_decay": 0.0, "train.schedule": "constant", "train.lora_rank": 4, "train.lora_alpha": 8.0,
         "train.lora_targets": ("q", "v", "gate", "up", "down")}


def _trainer(quant, double=False, shape=(2, 2, 2)):
  c = configs.load("tiny", **{**SMALL, "train.lora_base_quant": quant, "train.lora_base_double_quant": double})
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2])
  devices = jax.devices()[:1] if shape == (1, 1, 1) else None
  return step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)


def _nf4_numpy(w, lead, n_in, block=64):
  """NF4 round trip of a kernel in NumPy: blocks of `block` consecutive inputs per output channel, nearest level."""
  shape = w.shape
  ins, outs = shape[lead:lead + n_in], shape[lead + n_in:]
  x = w.reshape(shape[:lead] + (-1, block) + (int(np.prod(outs)),))
  absmax = np.abs(x).max(axis=lead + 1, keepdims=True)
  safe = np.where(absmax > 0, absmax, 1)
  idx = np.abs((x / safe)[..., None] - basequant.NF4_LEVELS).argmin(-1)
  return (basequant.NF4_LEVELS[idx] * absmax).reshape(shape)


@pytest.fixture(scope="module")
def nf4_run():
  trainer = _trainer("nf4")
  state = trainer.init()
  losses = []
  for i in range(3):
    state, m = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 0)))
    losses.append(float(m["loss"]))
  return trainer, state, losses


def test_the_state_holds_nf4_codes_and_the_adapters_train(nf4_run):
  trainer, state, losses = nf4_run
  q = state["frozen"]["model"]["layers"]["attn"]["q"]
  assert set(q) == {"codes", "absmax"} and q["codes"].dtype == jnp.uint8
  d, h, k = 64, 4, 16
  assert q["codes"].shape == (2, d // 64, 32, h, k)  # [layers, blocks, 64 / 2 packed, H, K]
  assert state["frozen"]["model"]["embed"]["embedding"].dtype == jnp.float32  # embeddings stay float
  assert losses[-1] < losses[0]
  stored = sum(x.nbytes for x in jax.tree.leaves(state["frozen"]["model"]["layers"]["mlp"]))
  floats = 2 * 3 * 64 * 128 * 4  # the float32 MLP kernels of both layers
  assert stored < 0.2 * floats  # 4 bits + a float32 constant per 64 weights: 0.5625 / 4 bytes per weight


def test_the_adapters_see_the_nf4_dequantized_base(nf4_run):
  """Logits of the QLoRA side path (dequantized inside the layers) equal those of the float model whose kernels are
  the NumPy NF4 round trip of the starting weights, adapters merged: the QLoRA base is exactly that."""
  trainer, state, _ = nf4_run
  start = _trainer("none").init()  # same seed: the same starting float weights
  base = jax.device_get(start["frozen"]["model"])
  for path, (_, lead, n_in) in lora_lib.kernels(base, tuple(lora_lib.TARGETS)).items():
    w = np.asarray(lora_lib._get(base, path))
    lora_lib._set(base, path, _nf4_numpy(w, lead, n_in).astype(np.float32))
  want_params = lora_lib.merge(base, jax.device_get(state["params"]["lora"]), trainer.lora_scale)
  tokens = jnp.asarray(step_lib.synthetic_batch(trainer.config, 5, packed=False)["inputs"])

  def side_logits(params, frozen):
    with parallel.activate(trainer.mesh, trainer.rules, inside_jit=True):
      return trainer._merge(trainer._decompose(params, frozen)[0])(tokens)
  got = np.asarray(jax.jit(side_logits)(state["params"], state["frozen"]))
  want = np.asarray(trainer._merge(jax.tree.map(jnp.asarray, want_params))(tokens))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  merged = np.asarray(trainer.model(state)(tokens))  # generation / export: dequantized once and merged
  np.testing.assert_allclose(merged, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_qlora_checkpoint_restores_dequantized_and_merged(nf4_run, tmp_path):
  from flax import nnx
  from train.core import checkpoint as ckpt_lib
  from train.core import loop
  trainer, state, _ = nf4_run
  ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), None)
  ck.save(3, state, None, {"config": json.loads(trainer.config.to_json_best_effort())})
  ck.close()
  got = loop.restore_model_params(ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), read_only=True), None,
                                  trainer.abstract_model_params())
  want = nnx.to_pure_dict(nnx.state(trainer.model(state), nnx.Param))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7, err_msg=str(path))


def test_int8_and_double_quantized_bases_track_the_float_base():
  """Two steps on one batch: the losses of int8 and NF4 + double quantization stay near the float base's (same
  start, same adapters), int8 nearer than 4 bits."""
  runs = {}
  for quant, double in (("none", False), ("int8", False), ("nf4", True)):
    trainer = _trainer(quant, double, shape=(1, 1, 1))  # the mesh is the nf4 fixture's business
    state = trainer.init()
    losses = []
    for _ in range(2):
      state, m = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 0)))
      losses.append(float(m["loss"]))
    runs[quant] = np.array(losses)
  print({k: v.tolist() for k, v in runs.items()})
  assert np.abs(runs["int8"] - runs["none"]).max() < 1e-3
  assert np.abs(runs["nf4"] - runs["none"]).max() < 2e-2
  assert np.abs(runs["int8"] - runs["none"]).max() < np.abs(runs["nf4"] - runs["none"]).max()


def test_qlora_keys_are_checked():
  one = lambda **over: step_lib.Trainer(configs.load("tiny", **{**SMALL, **over}),
                                        mesh_lib.make_mesh(configs.load("tiny").mesh, jax.devices()[:1]))
  with pytest.raises(ValueError, match="lora_base_quant='nf5'"):
    one(**{"train.lora_base_quant": "nf5"})
  with pytest.raises(ValueError, match="lora_base_double_quant"):
    one(**{"train.lora_base_quant": "int8", "train.lora_base_double_quant": True})
  with pytest.raises(ValueError, match="frozen reference"):  # DPO's float reference vs the quantized base
    one(**{"train.lora_base_quant": "nf4", "train.objective": "dpo"})


def test_a_hugging_face_directory_loads_quantized_while_streaming(tmp_path):
  """train.init_from a Hugging Face directory under QLoRA: the loader quantizes each base kernel layer by layer
  (model.hf.load's transform) and the result equals quantizing the float weights whole."""
  from model import hf
  from train.core import setup
  float_trainer = _trainer("none", shape=(1, 8, 1))
  start = float_trainer.init()
  hf.save(float_trainer.model(start), str(tmp_path / "hf"))
  trainer = _trainer("nf4", shape=(1, 8, 1))
  got = jax.device_get(setup.init_from(trainer, str(tmp_path / "hf")))
  want = jax.device_get(basequant.quantize_params(jax.device_get(start["frozen"]["model"]), trainer._base_kernels,
                                                  "nf4"))
  assert got["layers"]["mlp"]["down"]["codes"].dtype == np.uint8
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))
  state = trainer.with_model_params(trainer.init(), setup.init_from(trainer, str(tmp_path / "hf")))
  assert state["frozen"]["model"]["layers"]["attn"]["q"]["codes"].dtype == jnp.uint8
