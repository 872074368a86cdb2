"""LoRA (train.lora_rank): frozen base weights bit for bit, optimizer state only for the adapters, the PEFT export
loads onto the exported base in `peft` and gives the adapted logits, so does the merged export, and rank = full
width learns like full fine-tuning."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import parallel
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
  # rsLoRA and dropout on: PEFT's export must then scale by alpha / sqrt(r) (its use_rslora) and ignore dropout
  trainer = _trainer(4, **{"train.lora_rslora": True, "train.lora_dropout": 0.1})
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


def _with_random_b(state, seed=0):
  """The adapters with B drawn at random (B = 0 at init would make every product with B vanish)."""
  rng = np.random.default_rng(seed)
  def draw(path, x):
    return jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype) if path[-1].key == "b" else x
  return dict(state["params"], lora=jax.tree_util.tree_map_with_path(draw, state["params"]["lora"]))


def _exact_merged(base, adapters, s):
  """W' = W + s A B for every adapted kernel, formed in float64 by NumPy and rounded once to float32."""
  out = jax.tree.map(np.asarray, jax.device_get(base))
  for path, ab in lora_lib._walk_adapters(jax.device_get(adapters)):
    w = np.asarray(lora_lib._get(out, path), np.float64)
    a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
    lead = a.ndim - lora_lib.TARGETS[path[-1]][1] - 1
    d = np.matmul(a.reshape(a.shape[:lead] + (-1, a.shape[-1])), b.reshape(b.shape[:lead + 1] + (-1,)))
    lora_lib._set(out, path, (w + s * d.reshape(w.shape)).astype(np.float32))
  return out


def test_side_path_equals_the_merged_kernels_logits_and_gradients():
  """y = x W + s (x A) B with W frozen (the step's side path) against the definition W' = W + s A B, with
  s = alpha / sqrt(r) (rsLoRA) computed here, under data x fsdp x tensor: logits against W' formed exactly (NumPy,
  float64, rounded once to float32) within 1e-6 (or the float32 merged model's own error), loss and d loss / d(A, B)
  against the merged kernels within 1e-6."""
  rank, alpha = 4, 8.0
  trainer = _trainer(rank, **{"train.lora_rslora": True})
  state = trainer.init()
  params, frozen = _with_random_b(state), state["frozen"]
  batch = trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 3))
  s = alpha / np.sqrt(rank)

  def losses(p):
    def loss(model):
      sums = trainer.objective.sums(model, batch, {}, {})
      return trainer.objective.loss(sums) / trainer.objective.normalizer(batch), model(batch["inputs"])
    with parallel.activate(trainer.mesh, trainer.rules, inside_jit=True):
      side_model = trainer._merge(lora_lib.side(frozen["model"], p["lora"], trainer.lora_scale))
      merged_model = trainer._merge(lora_lib.merge(frozen["model"], p["lora"], s))
      return loss(side_model), loss(merged_model)

  def logits(tree):
    with parallel.activate(trainer.mesh, trainer.rules, inside_jit=True):
      return trainer._merge(tree)(batch["inputs"])

  (side_loss, side_logits), (merged_loss, merged_logits) = jax.jit(losses)(params)
  exact = np.asarray(jax.jit(logits)(jax.tree.map(jnp.asarray, _exact_merged(frozen["model"], params["lora"], s))))
  # 1e-6, or 3x the float32 merged formulation's own distance from W' exact where that is larger: both are float32
  # sums of the same function in different orders, whose error depends on the CPU's vector width (merged 0.6e-6 on
  # one device, 0.7-1.1e-6 on this mesh; the side path measured 0.6e-6, 0.95e-6 and, on another machine, 1.6e-6),
  # while a wrong scale or a wrong factor shows at ~1e-2
  merged_error = np.abs(np.asarray(merged_logits) - exact).max()
  np.testing.assert_allclose(np.asarray(side_logits), exact, rtol=0,
                             atol=max(1e-6 * max(1.0, np.abs(exact).max()), 3 * merged_error))
  assert float(side_loss) == pytest.approx(float(merged_loss), rel=1e-6)
  g_side, g_merged = jax.jit(lambda p: (jax.grad(lambda q: losses(q)[0][0])(p),
                                        jax.grad(lambda q: losses(q)[1][0])(p)))(params)  # one compile
  leaves = jax.tree_util.tree_leaves_with_path(g_side)
  assert len(leaves) == 14  # A and B of 7 projections
  for (path, a), b in zip(leaves, jax.tree.leaves(g_merged)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(b).max() > 0, path
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, np.abs(b).max()), err_msg=str(path))


def test_lora_dropout_masks_the_adapter_input_in_training_only():
  """SideKernel.einsum with dropout p against NumPy: x W + s ((x * m / (1 - p)) A) B with the keep mask m of its key;
  about 1 - p of the inputs kept; without a key (evaluation) no dropout."""
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((2, 5, 16)).astype(np.float32), rng.standard_normal((16, 3, 4)).astype(np.float32)
  a, b = rng.standard_normal((16, 2)).astype(np.float32), rng.standard_normal((2, 3, 4)).astype(np.float32)
  key = jax.random.key_data(jax.random.PRNGKey(5))
  p, s = 0.25, 1.5
  kernel = lora_lib.SideKernel(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), key, scale=s, dropout=p)
  plain = lambda spec, x_, w_: jnp.einsum(spec, x_, w_)
  got = np.asarray(kernel.einsum("bld,dhk->blhk", jnp.asarray(x), plain))
  keep = np.asarray(jax.random.bernoulli(key, 1 - p, x.shape))
  assert abs(keep.mean() - (1 - p)) < 0.1
  want = np.einsum("bld,dhk->blhk", x, w) + s * np.einsum("blr,rhk->blhk", np.einsum("bld,dr->blr",
                                                                                      x * keep / (1 - p), a), b)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  no_key = lora_lib.SideKernel(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), None, scale=s, dropout=p)
  want = np.einsum("bld,dhk->blhk", x, w) + s * np.einsum("blr,rhk->blhk", np.einsum("bld,dr->blr", x, a), b)
  np.testing.assert_allclose(np.asarray(no_key.einsum("bld,dhk->blhk", jnp.asarray(x), plain)), want,
                             rtol=1e-5, atol=1e-5)


def test_side_kernel_equals_the_merged_projection():
  """One projection of each layout (q: [D | H, K], o: [H, K | D]): x W + s (x A) B against x (W + s A B), float32."""
  rng = np.random.default_rng(1)
  for spec, x_shape, w_shape in (("bld,dhk->blhk", (2, 6, 32), (32, 4, 8)), ("blhk,hkd->bld", (2, 6, 4, 8), (4, 8, 32))):
    n_in = len(x_shape) - 2
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    a = rng.standard_normal(w_shape[:n_in] + (3,)).astype(np.float32)
    b = rng.standard_normal((3,) + w_shape[n_in:]).astype(np.float32)
    kernel = lora_lib.SideKernel(*(jnp.asarray(v) for v in (w, a, b)), scale=0.7)
    got = np.asarray(kernel.einsum(spec, jnp.asarray(x), lambda sp, x_, w_: jnp.einsum(sp, x_, w_)))
    merged = w.astype(np.float64) + 0.7 * np.tensordot(a.astype(np.float64), b, axes=1)
    want = np.einsum(spec, x.astype(np.float64), merged)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_expert_adapters_side_path_equals_merged(moe_impl="tiled", shape=(1, 2, 2, 1, 2)):
  """Per-expert adapters on the routed experts (A [E, D, r], B [E, r, F]) and the shared expert, as side paths inside
  the grouped matmuls (model.moe_impl=tiled runs them through ragged_dot), against the merged experts
  W_e + s A_e B_e: loss and gradients under fsdp x tensor x expert (D gathered, F split, the all-to-all)."""
  c = configs.load("tiny_moe", **{**SMALL, "model.num_experts": 4, "model.expert_mlp_dim": 32,
                                  "model.num_shared_experts": 1, "model.moe_impl": moe_impl,
                                  "model.capacity_factor": 0.0, "train.lora_rank": 4,
                                  "train.lora_targets": ("q", "gate", "up", "down")})
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], sequence=shape[3], expert=shape[4])
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh), step_lib.FAST_COMPILE)
  state = trainer.init()
  lora = state["params"]["lora"]["layers"]
  assert lora["moe"]["gate"]["a"].shape == (2, 4, 32, 4) and "shared" in lora["moe"]  # [layers, E, D, r]
  params, frozen = _with_random_b(state), state["frozen"]
  batch = trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 3))

  def loss(p, merged):
    with parallel.activate(trainer.mesh, trainer.rules, inside_jit=True):
      tree = (lora_lib.merge(frozen["model"], p["lora"], trainer.lora_scale) if merged else
              lora_lib.side(frozen["model"], p["lora"], trainer.lora_scale))
      sums = trainer.objective.sums(trainer._merge(tree), batch, {}, {})
      return trainer.objective.loss(sums) / trainer.objective.normalizer(batch)
  both = jax.jit(lambda p: (jax.value_and_grad(lambda q: loss(q, False))(p),
                            jax.value_and_grad(lambda q: loss(q, True))(p)))  # one compile
  (side_loss, side_grads), (merged_loss, merged_grads) = both(params)
  assert float(side_loss) == pytest.approx(float(merged_loss), rel=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(side_grads), jax.tree.leaves(merged_grads)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(b).max() > 0, path
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, np.abs(b).max()), err_msg=str(path))


def test_side_path_through_pipeline_stages_equals_one_device():
  """LoRA (side path, rsLoRA) with the layer stack split over 2 pipeline stages x fsdp 2 x tensor 2: one step's
  loss and updated adapters equal one device's."""
  over = {"train.lora_rslora": True, "train.eps": 1.0}  # eps 1: the first Adam step is smooth in the gradient
  def step(shape, stage):
    staged = {"train.pipeline_microbatches": 2} if stage > 1 else {}
    c = configs.load("tiny", **{**SMALL, "train.lora_rank": 4, **over, **staged})
    c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], stage=stage)
    devices = jax.devices()[:1] if stage == 1 else None
    trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)
    state, metrics = trainer.step_fn(trainer.init(), trainer.batch_to_device(step_lib.synthetic_batch(c, 0)))
    return float(metrics["loss"]), jax.device_get(state["params"]["lora"])
  loss, lora = step((1, 2, 2), 2)
  want_loss, want = step((1, 1, 1), 1)
  assert loss == pytest.approx(want_loss, rel=1e-6)
  for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(lora), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-7, err_msg=jax.tree_util.keystr(path))
