"""LoRA (train.lora_rank): frozen base weights bit for bit, optimizer state only for the adapters, the PEFT export
loads onto the exported base in `peft` and gives the adapted logits, so does the merged export, and rank = full
width learns like full fine-tuning."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from model import lora as lora_lib
from parallel import mesh as mesh_lib
from train.rundir import adapters
from train.core import step as step_lib

SMALL = {"model.vocab_size": 256, "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.max_seq_len": 32,
         "train.seq_len": 32, "train.batch_size": 8, "train.lr": 1e-2, "train.warmup_steps": 1,
         "train.weight_decay": 0.0, "train.schedule": "constant", "train.lora_alpha": 8.0,
         "train.lora_targets": ("q", "k", "v", "o", "gate", "up", "down")}
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _trainer(rank, shape=(2, 2, 2, 1), **over):
  c = configs.load("tiny", **{**SMALL, "train.lora_rank": rank, **over})
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], sequence=shape[3])
  devices = jax.devices()[:1] if shape == (1, 1, 1, 1) else None
  return step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)


def _train(trainer, steps, state=None, same_batch=False):
  state = trainer.init() if state is None else state
  losses = []
  for i in range(steps):
    batch = step_lib.synthetic_batch(trainer.config, 0 if same_batch else i)
    state, m = trainer.step_fn(state, trainer.batch_to_device(batch))
    losses.append(float(m["loss"]))
  return state, losses


@pytest.fixture(scope="module")
def lora_run():
  trainer = _trainer(4)
  start = trainer.init()
  base_before = jax.device_get(start["frozen"]["model"])
  state, losses = _train(trainer, 4, start, same_batch=True)  # one batch: its loss must fall
  return {"trainer": trainer, "state": state, "base_before": base_before, "losses": losses}


def test_base_weights_frozen_and_optimizer_state_only_for_adapters(lora_run):
  trainer, state = lora_run["trainer"], lora_run["state"]
  after = jax.device_get(state["frozen"]["model"])
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(lora_run["base_before"])):
    np.testing.assert_array_equal(a, b)
  b_leaves = [ab["b"] for _, ab in lora_lib._walk_adapters(state["params"]["lora"])]
  assert len(b_leaves) == 7 and all(float(jnp.abs(b).max()) > 0 for b in b_leaves)  # the adapters trained
  assert lora_run["losses"][-1] < lora_run["losses"][0]
  adapter_sizes = sorted(x.size for x in jax.tree.leaves(state["params"]))
  moments = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
  assert sorted(x.size for x in jax.tree.leaves(moments[0].mu)) == adapter_sizes
  assert sorted(x.size for x in jax.tree.leaves(moments[0].nu)) == adapter_sizes
  model_size = sum(x.size for x in jax.tree.leaves(after))
  opt_size = sum(x.size for x in jax.tree.leaves(state["opt_state"]))
  assert opt_size < 2 * sum(adapter_sizes) + 8 < model_size


def test_peft_adapter_and_merged_export_give_the_adapted_logits(lora_run, tmp_path):
  import peft
  import torch
  import transformers
  trainer, state = lora_run["trainer"], lora_run["state"]
  adapters.save_base(trainer, state, str(tmp_path / "base"))
  adapters.save_peft(trainer, state, str(tmp_path / "adapter"), str(tmp_path / "base"))
  adapters.save_merged(trainer, state, str(tmp_path / "merged"))
  tokens = step_lib.synthetic_batch(trainer.config, 7, packed=False)["inputs"][:2]
  # The adapted model as trained: the Trainer's forward with the adapters (jax).
  ours = np.asarray(jax.device_get(trainer.model(state)(jnp.asarray(tokens))))
  base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
  with torch.no_grad():
    base_logits = base(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))  # LoRA branches beside frozen W
    peft_logits = adapted(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    merged_logits = merged(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert np.abs(peft_logits - base_logits).max() > 1e-3  # the adapters change the output ...
  np.testing.assert_allclose(peft_logits, ours, rtol=1e-4, atol=1e-4)  # ... exactly as in training
  np.testing.assert_allclose(merged_logits, peft_logits, rtol=1e-4, atol=1e-4)


def test_full_rank_lora_approaches_full_fine_tuning():
  """On one repeated batch, LoRA with rank = the model width on every projection lowers the loss about as far as
  fine-tuning those same projections (embeddings and norms frozen: train.freeze), and far more than rank 1."""
  steps = 25
  full_trainer = _trainer(0, (1, 1, 1, 1), **{"train.freeze": ("embed", "norm")})
  start = full_trainer.init()
  embedding_before = np.asarray(jax.device_get(start["params"]["embed"]["embedding"]))
  state, full = _train(full_trainer, steps, start, same_batch=True)
  np.testing.assert_array_equal(np.asarray(jax.device_get(state["params"]["embed"]["embedding"])), embedding_before)
  _, wide = _train(_trainer(32, (1, 1, 1, 1), **{"train.lora_alpha": 32.0}), steps, same_batch=True)
  _, narrow = _train(_trainer(1, (1, 1, 1, 1), **{"train.lora_alpha": 1.0}), steps, same_batch=True)
  assert full[0] == pytest.approx(wide[0], rel=1e-6) == pytest.approx(narrow[0], rel=1e-6)  # same start (B = 0)
  drop = lambda losses: losses[0] - losses[-1]
  print({"full": drop(full), "rank32": drop(wide), "rank1": drop(narrow)})
  assert drop(wide) > 0.8 * drop(full)
  assert drop(wide) > drop(narrow)


def test_lora_config_errors():
  with pytest.raises(ValueError, match="lora_targets"):
    _trainer(4, (1, 1, 1, 1), **{"train.lora_targets": ("q", "qq")})
  with pytest.raises(ValueError, match="lora_rank=-1"):
    _trainer(-1, (1, 1, 1, 1))


def test_a_lora_checkpoint_restores_as_merged_weights(lora_run, tmp_path):
  """init_from / generation read a LoRA run's checkpoint as W + alpha/r * A @ B (train.core.loop.restore_model_params)."""
  import json
  from train.core import checkpoint as ckpt_lib
  from train.core import loop
  trainer, state = lora_run["trainer"], lora_run["state"]
  ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), None)
  ck.save(4, state, None, {"config": json.loads(trainer.config.to_json_best_effort())})
  ck.close()
  got = loop.restore_model_params(ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), read_only=True), None,
                                  trainer.abstract_model_params())
  from flax import nnx
  want = nnx.to_pure_dict(nnx.state(trainer.model(state), nnx.Param))
  for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7, err_msg=str(path))
  q = np.asarray(got["layers"]["attn"]["q"])
  assert not np.allclose(q, np.asarray(lora_run["base_before"]["layers"]["attn"]["q"]))  # the adapters are in
