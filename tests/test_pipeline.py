"""Pipeline parallelism (parallel/pipeline.py): GPipe and circular schedules composed with data, FSDP and tensor
axes equal the one-device run (loss, gradients, 3 optimizer steps); checkpoints move between stage counts
exactly; bad schedules fail before compiling with the key named."""
import jax
import numpy as np
import pytest

import configs
import parallel
from parallel import mesh as mesh_lib
from parallel import pipeline as pipeline_lib
from train.core import checkpoint as ckpt_lib
from train.core import step as step_lib

STEPS = 3
# (stage, data, fsdp, tensor, microbatches, repeats): the three layouts.
LAYOUTS = {
    "stage4xdata2": (4, 2, 1, 1, 4, 1),
    "stage2xfsdp2xtensor2": (2, 1, 2, 2, 2, 1),
    "stage2_repeats2xdata4": (2, 4, 1, 1, 2, 2),
}
SEQUENCE = "stage2xsequence2xdata2"  # beyond the three: sequence parallelism inside the stages


def _config(stage=1, data=1, fsdp=1, tensor=1, microbatches=0, repeats=1, sequence=1, **model):
  c = configs.load("tiny")
  # Layers 0 and 2 attend in an 8-token window, 1 and 3 globally: the windows must travel with their stage.
  c.model.update(vocab_size=256, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=32, sliding_window=8, global_every=2)
  c.model.update(**model)
  # Adam's eps 1e-6 (not 1e-8): an embedding row first used at step 2 with a gradient element near 1e-8 would
  # otherwise turn float noise in that gradient into a 5% difference of a step's update.
  c.train.update(batch_size=8, seq_len=32, lr=1e-2, warmup_steps=1, z_loss=1e-3, clip_norm=0.5, eps=1e-6,
                 pipeline_microbatches=microbatches, pipeline_repeats=repeats)
  c.mesh.update(data=data, fsdp=fsdp, tensor=tensor, stage=stage, sequence=sequence)
  return c


_TRAINERS = {}


def _trainer(c, devices=None):
  return step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)


def _layout_trainer(name):
  """One Trainer per layout, shared by this module's tests so each compiles once."""
  if name not in _TRAINERS:
    _TRAINERS[name] = _trainer(_config(2, 2, sequence=2) if name == SEQUENCE else _config(*LAYOUTS[name]))
  return _TRAINERS[name]


def _grads(trainer, state, batch):
  """Gradient of the step's objective (the Trainer's own accumulation path) and its sums, on the host."""
  def fn(params, batch):
    with parallel.activate(trainer.mesh, trainer.rules, inside_jit=True):
      return trainer._grads(params, {}, batch, trainer.objective.normalizer(batch))  # pylint: disable=protected-access
  return jax.device_get(jax.jit(fn)(state["params"], batch))


def _run(trainer, state, steps=STEPS):
  losses = []
  for i in range(steps):
    state, m = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, i)))
    losses.append(float(m["loss"]))
  return losses, state


def _flat(tree):
  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def reference():
  """One device, no stages: the independent reference."""
  trainer = _trainer(_config(), jax.devices()[:1])
  state = trainer.init()
  grads, sums = _grads(trainer, state, trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 0)))
  losses, state = _run(trainer, state)
  return {"grads": grads, "sums": sums, "losses": losses, "params": jax.device_get(state["params"])}


@pytest.mark.parametrize("name", [*LAYOUTS, pytest.param(SEQUENCE, marks=pytest.mark.slow)])
def test_pipelined_gradients_match_single_device(reference, name):
  trainer = _layout_trainer(name)
  state = trainer.init()
  q = state["params"]["layers"]["attn"]["q"]
  assert q.shape[0] == 4 and q.sharding.spec[0] == "stage"  # the plain [layers, ...] stack, split by stage
  assert q.addressable_shards[0].data.shape[0] == 4 // trainer.mesh.shape["stage"]
  grads, sums = _grads(trainer, state, trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, 0)))
  for key, value in sums.items():
    np.testing.assert_allclose(value, reference["sums"][key], rtol=1e-5, err_msg=key)
  for path, g in _flat(grads).items():
    np.testing.assert_allclose(g, _flat(reference["grads"])[path], rtol=0, atol=1e-5, err_msg=path)


# The 3D layout runs in the fast loop; the other two compile a second step function each (CI runs them all).
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "stage2xfsdp2xtensor2" else pytest.mark.slow)
                                  for n in LAYOUTS])
def test_three_optimizer_steps_match_single_device(reference, name):
  trainer = _layout_trainer(name)
  losses, state = _run(trainer, trainer.init())
  np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
  for path, p in _flat(jax.device_get(state["params"])).items():
    # Adam divides by sqrt(v): elements with gradients near eps amplify float noise, so parameters are compared
    # to 5% of one step's learning rate (as in test_step_meshes).
    np.testing.assert_allclose(p, _flat(reference["params"])[path], rtol=0, atol=5e-4, err_msg=path)


def test_schedule_bubble_formula():
  # Circular: each stage is busy R*M of the R*M + S - 1 iterations.
  s = pipeline_lib.Schedule(stages=4, microbatches=8, repeats=2)
  assert s.iterations == 2 * 8 + 3 and s.bubble == pytest.approx(3 / 19)
  assert pipeline_lib.Schedule(stages=1, microbatches=1).bubble == 0


@pytest.mark.parametrize("overrides, key", [
    (dict(stage=8), "config.model.num_layers=4"),  # 4 layers over 8 stages
    (dict(stage=2, data=4, repeats=4), "pipeline_repeats"),  # 4 layers over 2 stages x 4 repeats
    (dict(stage=4, data=2, microbatches=2), "pipeline_microbatches=2"),  # M < S
    (dict(stage=2, data=4, microbatches=4), "pipeline_microbatches=4"),  # 2-row microbatches over 4 batch shards
    (dict(data=8, repeats=2), "mesh.stage > 1"),  # pipeline keys without stages
    (dict(stage=2, data=4, scan_layers=False), "scan_layers"),
])
def test_bad_schedules_fail_before_compiling(overrides, key):
  model = {k: overrides.pop(k) for k in ("scan_layers",) if k in overrides}
  c = _config(**overrides, **model)
  with pytest.raises(ValueError, match=key):
    _trainer(c)


def test_checkpoint_moves_between_stage_counts_exactly(tmp_path):
  """Saved with 4 stages, restored onto 1 (and back): every array equal, the stored stack [layers, ...]."""
  staged, flat = _layout_trainer("stage4xdata2"), _trainer(_config(1, 8))
  state = staged.init()
  saved = jax.device_get(state)
  ck = ckpt_lib.Checkpointer(str(tmp_path / "a"))
  ck.save(1, state, None, {})
  ck.close()
  reader = ckpt_lib.Checkpointer(str(tmp_path / "a"), read_only=True)
  assert reader.state_layout()["params/layers/attn/q"][0] == (4, 64, 4, 16)
  restored, _ = reader.restore(flat.abstract_state())
  assert restored["params"]["layers"]["attn"]["q"].addressable_shards[0].data.shape[0] == 4  # whole stack
  for path, a in _flat(jax.device_get(restored)).items():
    np.testing.assert_array_equal(a, _flat(saved)[path], err_msg=path)
  ck = ckpt_lib.Checkpointer(str(tmp_path / "b"))
  ck.save(1, restored, None, {})
  ck.close()
  back, _ = ckpt_lib.Checkpointer(str(tmp_path / "b"), read_only=True).restore(staged.abstract_state())
  assert back["params"]["layers"]["attn"]["q"].addressable_shards[0].data.shape[0] == 1  # one layer per stage
  for path, a in _flat(jax.device_get(back)).items():
    np.testing.assert_array_equal(a, _flat(saved)[path], err_msg=path)


def test_tpu_compile_reports_the_pipeline_with_async_collectives():
  """train.compile for a TPU v4 slice: the bubble, the stage-to-stage collective-permutes once per schedule
  iteration, and (train.xla_overlap) asynchronous permutes and all-gathers in the compiled HLO."""
  from train.planning import compile as aot
  from train.planning import hardware
  from train.planning.hlo import collective_ops
  tpu = hardware.tpu_slice("v4-16")  # 8 chips: stage 2 x fsdp 2 x tensor 2
  config = configs.load("tiny", **{
      "model.num_layers": 4, "model.vocab_size": 512, "model.d_model": 128, "model.mlp_dim": 256,
      "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 64, "model.max_seq_len": 64,
      "train.seq_len": 64, "train.batch_size": 16, "train.pipeline_microbatches": 4, "train.xla_overlap": True,
      "mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.stage": 2})
  trainer, compiled = aot.compile_trainer(config, aot.abstract_devices(tpu))
  report = aot.summarize(config, tpu, trainer, 0.0)
  pipe = report["pipeline"]
  assert (pipe["stages"], pipe["microbatches"], pipe["iterations"]) == (2, 4, 5) and pipe["bubble"] == 1 / 5
  assert pipe["collective_permutes"] and all(op["async"] for op in pipe["collective_permutes"])
  assert any(op["per_step"] == 5 for op in pipe["collective_permutes"])  # one shift per iteration
  ops = collective_ops(compiled.as_text(), 8)
  # Without the overlap options libtpu issues every all-gather synchronously (measured: 0 of 19 async).
  assert any(op["async"] for op in ops if op["kind"] == "all-gather")


def test_evaluation_scores_through_the_pipeline():
  """evals.LM on a pipelined model (what train.eval_tasks scores during training) equals the unstaged model on
  one device: rows rounded to whole microbatches of whole row shards, every batch size."""
  from evals.requests import LM  # pylint: disable=g-import-not-at-top
  trainer = _layout_trainer("stage4xdata2")  # 4 microbatches over 2 row shards
  params = trainer.init()["params"]
  flat = _trainer(_config(), jax.devices()[:1])
  rng = np.random.default_rng(0)
  context = list(rng.integers(1, 256, 9))
  pairs = [(context, [5, 6]), (context, [7]), ([1], [9, 8, 7]), (list(rng.integers(1, 256, 40)), [3, 4])] + [
      (list(rng.integers(1, 256, n)), list(rng.integers(1, 256, 3))) for n in (20, 22, 24, 26)]  # 6 rows
  want = LM(flat.model({"params": jax.device_get(params)}), None, flat.mesh, flat.rules).loglikelihood_tokens(pairs)
  staged = LM(trainer.model({"params": params}), None, trainer.mesh, trainer.rules, batch_size=3)
  assert staged.batch_size == 8  # 4 microbatches x 2 row shards (with 4 rows, a 2-row last batch would not split)
  got = staged.loglikelihood_tokens(pairs)
  np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-5)
  assert [g[1] for g in got] == [w[1] for w in want]
