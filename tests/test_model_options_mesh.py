"""The family options under the mesh and LoRA (issue 36): a training step of a model with every Gemma-3-like
option on, and one with Qwen 2's q/k/v biases and OLMo 2's projection-wide q/k norms and post-norms, on data 2 x
fsdp 2 x tensor 2 (8 CPU devices) equals the same step on one device (loss, and every updated weight), in full
fine-tuning and with LoRA adapters on every projection (the frozen base, the adapters trained)."""
import jax
import numpy as np
import pytest

import configs
from parallel import mesh as mesh_lib
from train.core import step as step_lib

SMALL = {"model.vocab_size": 256, "model.d_model": 32, "model.num_layers": 3, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.max_seq_len": 32,
         "model.attention_impl": "xla", "train.seq_len": 32, "train.batch_size": 8, "train.lr": 1e-2,
         "train.warmup_steps": 1, "train.weight_decay": 0.0, "train.schedule": "constant",
         "train.lora_alpha": 8.0, "train.lora_targets": ("q", "k", "v", "o", "gate", "up", "down"),
         # A first Adam step is about lr * sign(g): a gradient entry near 0 flips with float32 summation order.
         # eps = 1 makes the update smooth in g, so the updated weights compare the gradients.
         "train.eps": 1.0}
OPTIONS = {
    "gemma3_like": {"model.layer_types": ("sliding", "sliding", "full"), "model.sliding_window": 8,
                    "model.rope_local_theta": 100.0, "model.rope_scaling": "linear",
                    "model.rope_scaling_factor": 2.0, "model.qk_norm": "head", "model.norm_position": "sandwich",
                    "model.norm_offset": True, "model.embed_scale": True, "model.attn_logit_softcap": 5.0,
                    "model.final_logit_softcap": 10.0, "model.query_pre_attn_scalar": 12.0,
                    "model.mlp_type": "geglu", "model.tie_embeddings": True},
    "qwen2_bias_olmo2_norms": {"model.qkv_bias": True, "model.qk_norm": "proj", "model.norm_position": "post",
                               "model.rope_scaling": "yarn", "model.rope_scaling_factor": 2.0,
                               "model.rope_original_max_len": 16},
}


def _step(options: dict, rank: int, shape: tuple[int, int, int] | None):
  c = configs.load("tiny", **{**SMALL, **options, "train.lora_rank": rank})
  if shape:
    c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2])
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, None if shape else jax.devices()[:1]),
                             step_lib.FAST_COMPILE)
  state = trainer.init()
  state, metrics = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(c, 0)))
  return float(metrics["loss"]), jax.tree.map(np.asarray, jax.device_get(state["params"]))


@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_step_on_the_mesh_equals_one_device(name, rank):
  loss, params = _step(OPTIONS[name], rank, (2, 2, 2))
  want_loss, want = _step(OPTIONS[name], rank, None)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  leaves, want_leaves = jax.tree.leaves_with_path(params), jax.tree.leaves(want)
  assert len(leaves) == len(want_leaves) > 0
  for (path, got), ref in zip(leaves, want_leaves):
    np.testing.assert_allclose(got, ref, atol=1e-7, err_msg=jax.tree_util.keystr(path))
