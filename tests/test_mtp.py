"""Multi-token prediction (DeepSeek-V3 sec. 2.2, model.mtp_depth): the objective's MTP cross-entropy equals a
NumPy reference of the heads' chain (norms, projection, shifted embeddings, the shared output projection, shifted
targets masked at document ends), and the heads leave the main model's parameters, logits and loss unchanged."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from model import rope
from model import transformer
from parallel import mesh as mesh_lib
from train.core import step as step_lib
from train.objectives import lm

D_MTP = 2


def _config(depth):
  return configs.load("tiny", **{"model.mtp_depth": depth, "model.num_layers": 2, "train.batch_size": 4,
                                 "train.seq_len": 32, "mesh.data": 1})


def _rms(x, scale, eps):
  x = x.astype(np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def test_mtp_cross_entropy_equals_a_numpy_reference():
  config = _config(D_MTP)
  model = transformer.Transformer(config.model, rngs=nnx.Rngs(3))
  batch = {k: jnp.asarray(v) for k, v in step_lib.synthetic_batch(config, 0).items()}  # packed documents
  got = float(lm.mtp_ce(model, model(batch["inputs"], batch["segment_ids"], batch["positions"], return_aux=True,
                                     mtp=True)[1][transformer.MTP_FEATURES], batch))
  # The main model's representation before its final norm (what depth 1 reads): the blocks applied one by one.
  cfg, eps = model.cfg, config.model.norm_eps
  x = model.embed(batch["inputs"])
  cos, sin = rope.tables(cfg, batch["positions"])
  graphdef, state = nnx.split(model.layers)
  for i in range(cfg.num_layers):
    block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
    x, _ = block(x, batch["segment_ids"], cos, sin, 0)
  h = np.asarray(x)
  emb = np.asarray(model.embed.embedding[...], np.float64)
  unembed = np.asarray(model.unembed[...], np.float64)
  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  mask, seg = np.asarray(batch["loss_mask"]), np.asarray(batch["segment_ids"])
  want = 0.0
  L = inputs.shape[1]
  for d in range(1, D_MTP + 1):
    head = model.mtp[d - 1]
    ahead = lambda a, d=d: np.pad(a[:, d:], ((0, 0), (0, d)))
    proj = np.asarray(head.proj[...], np.float64)
    xin = (_rms(emb[ahead(inputs)], np.asarray(head.enorm.scale[...]), eps) @ proj[0]
           + _rms(h, np.asarray(head.hnorm.scale[...]), eps) @ proj[1])
    h_next, _ = head.block(jnp.asarray(xin, jnp.float32), batch["segment_ids"], cos, sin, 0)
    h = np.asarray(h_next)
    logits = _rms(h, np.asarray(head.norm.scale[...]), eps) @ unembed
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    t = ahead(targets)
    m = ahead(mask) * (ahead(seg) == seg) * (np.arange(L) < L - d)
    want += -np.sum(np.take_along_axis(logp, t[..., None], -1)[..., 0] * m)
  np.testing.assert_allclose(got, want, rtol=2e-5)


def test_mtp_heads_leave_the_main_model_unchanged():
  trainers = {d: step_lib.Trainer(_config(d), mesh_lib.make_mesh(_config(d).mesh, jax.devices()[:1]))
              for d in (0, 1)}
  states = {d: t.init() for d, t in trainers.items()}
  main = {k: v for k, v in states[1]["params"].items() if k != "mtp"}
  for a, b in zip(jax.tree.leaves(main), jax.tree.leaves(states[0]["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same draws for the same seed
  batch = step_lib.synthetic_batch(_config(0), 0)
  logits = {d: np.asarray(trainers[d].model(states[d])(jnp.asarray(batch["inputs"]))) for d in (0, 1)}
  np.testing.assert_array_equal(logits[1], logits[0])
  metrics = {d: trainers[d].step_fn(states[d], trainers[d].batch_to_device(batch))[1] for d in (0, 1)}
  np.testing.assert_allclose(float(metrics[1]["loss"]), float(metrics[0]["loss"]), rtol=1e-6)
  assert "mtp_loss" not in metrics[0] and float(metrics[1]["mtp_loss"]) > 0
  np.testing.assert_allclose(float(metrics[1]["total_loss"]), float(metrics[0]["total_loss"])
                             + 0.3 * float(metrics[1]["mtp_loss"]), rtol=1e-6)
