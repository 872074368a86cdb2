"""`train.objective=distill`: the per-token divergences equal a NumPy reference (forward / reverse KL, TRL's
generalised JSD, temperature, top-k); a Trainer step on an 8-device mesh with a larger teacher read from a Hugging
Face directory reports exactly the divergence of the two models' logits on one device; a teacher from a meshlm run
loads its own weights; a vocab mismatch is refused naming both sizes; the distill keys are conditional on the
objective; train.distill_teacher_recipe makes the teacher's run and takes its tokenizer."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from configs import validate
from model import hf
from parallel import mesh as mesh_lib
from train.core import checkpoint as ckpt_lib
from train.core import setup
from train.core import step as step_lib
from train.objectives import distill

# Wide initialisations, so that both models' distributions are far from uniform and from each other.
STUDENT = {"model.vocab_size": 256, "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
           "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.max_seq_len": 32,
           "model.init_std": 0.3, "train.seq_len": 32, "train.batch_size": 8, "train.warmup_steps": 1,
           "mesh.data": 4, "mesh.fsdp": 2}
TEACHER = {"vocab_size": 256, "d_model": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
           "mlp_dim": 128, "max_seq_len": 64, "init_std": 0.5}


# ---- (a) the divergences against NumPy ---------------------------------------------------------------------------
def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(logp, logq):
  return (np.exp(logp) * (logp - logq)).sum(-1)


def _reference(student, teacher, loss, beta=0.5, temperature=1.0, top_k=0):
  """Per-token divergence in float64, written from the definitions (TRL's generalized_jsd_loss for jsd)."""
  s, t = student.astype(np.float64) / temperature, teacher.astype(np.float64) / temperature
  if top_k:
    top = np.argsort(-t, axis=-1)[..., :top_k]
    s, t = np.take_along_axis(s, top, -1), np.take_along_axis(t, top, -1)
  logp_s, logp_t = _log_softmax(s), _log_softmax(t)
  if loss == "forward_kl":
    return _kl(logp_t, logp_s)
  if loss == "reverse_kl":
    return _kl(logp_s, logp_t)
  log_m = np.log(beta * np.exp(logp_t) + (1 - beta) * np.exp(logp_s))
  return beta * _kl(logp_t, log_m) + (1 - beta) * _kl(logp_s, log_m)


def _masked_mean(d_BL, mask_BL):
  return float((d_BL * mask_BL).sum() / mask_BL.sum())


@pytest.mark.parametrize("loss,beta,temperature,top_k", [
    ("forward_kl", 0.5, 1.0, 0), ("reverse_kl", 0.5, 1.0, 0), ("jsd", 0.5, 1.0, 0), ("jsd", 0.2, 2.0, 0),
    ("forward_kl", 0.5, 0.7, 5), ("reverse_kl", 0.5, 1.5, 5), ("jsd", 0.9, 2.0, 7)])
def test_divergences_equal_numpy(loss, beta, temperature, top_k):
  rng = np.random.default_rng(0)
  student, teacher = ((3.0 * rng.standard_normal((2, 5, 16))).astype(np.float32) for _ in range(2))
  mask = np.ones((2, 5), np.float32)
  mask[1, 3] = 0.0  # a masked position: outside the mean
  got = np.asarray(distill.token_divergence(student, teacher, loss, beta, temperature, top_k))
  want = _reference(student, teacher, loss, beta, temperature, top_k)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert _masked_mean(got, mask) == pytest.approx(_masked_mean(want, mask), rel=1e-5)
  assert (got >= -1e-6).all()


def test_jsd_at_beta_0_and_1_is_forward_and_reverse_kl():
  rng = np.random.default_rng(1)
  student, teacher = (2.0 * rng.standard_normal((3, 4, 11)).astype(np.float32) for _ in range(2))
  for beta, kl in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
    np.testing.assert_array_equal(np.asarray(distill.token_divergence(student, teacher, "jsd", beta, 1.5)),
                                  np.asarray(distill.token_divergence(student, teacher, kl, 0.5, 1.5)))
  np.testing.assert_allclose(np.asarray(distill.token_divergence(teacher, teacher, "jsd", 0.5)), 0.0, atol=1e-6)


# ---- (b) one Trainer step against the two models' logits on one device ---------------------------------------
def _teacher_dir(root, **changes):
  """A Hugging Face directory holding a randomly initialised teacher (TEACHER with `changes`)."""
  cfg = model_lib.config.default_model_config()
  cfg.update(**{**TEACHER, **changes})
  path = str(root / f"teacher{len(changes)}")
  hf.save(model_lib.Transformer(cfg, rngs=nnx.Rngs(7)), path, progress=False)
  return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  return _teacher_dir(tmp_path_factory.mktemp("distill"))


def _config(teacher, **overrides):
  return configs.load("tiny", **STUDENT, **{"train.objective": "distill", "train.distill_teacher": teacher,
                                            **overrides})


def test_a_step_reports_the_divergence_of_the_two_models(teacher_dir):
  config = _config(teacher_dir, **{"train.distill_loss": "jsd", "train.distill_beta": 0.3,
                                   "train.distill_temperature": 2.0, "train.z_loss": 0.0})
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh), step_lib.FAST_COMPILE)
  assert trainer.mesh.shape["data"] == 4 and trainer.mesh.shape["fsdp"] == 2
  state = setup.load_frozen_configs(trainer, trainer.init())
  teacher = hf.load(teacher_dir, progress=False)  # unsharded, on one device
  for got, want in zip(jax.tree.leaves(state["frozen"]["teacher"]), jax.tree.leaves(nnx.state(teacher, nnx.Param))):
    assert got.sharding.mesh == trainer.mesh
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  student = nnx.merge(trainer._graphdef, jax.device_get(state["params"]))  # pylint: disable=protected-access
  batch = step_lib.synthetic_batch(config, seed=3)
  assert (batch["loss_mask"] == 0).any()  # padding and document ends are outside the mean
  with jax.default_device(jax.devices()[0]):
    args = (batch["inputs"], batch["segment_ids"], batch["positions"])
    student_logits, teacher_logits = np.asarray(student(*args)), np.asarray(teacher(*args))
  _, metrics = trainer.step_fn(state, trainer.batch_to_device(batch))
  metrics = jax.device_get(metrics)
  mask = batch["loss_mask"]
  want = _masked_mean(_reference(student_logits, teacher_logits, "jsd", 0.3, 2.0), mask)
  assert float(metrics["loss"]) == pytest.approx(want, abs=1e-5)
  assert float(metrics["distill_divergence"]) == float(metrics["loss"])
  def ce(logits):
    logp = _log_softmax(logits.astype(np.float64))
    return -_masked_mean(np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0], mask)
  assert float(metrics["lm_loss"]) == pytest.approx(ce(student_logits), rel=1e-5)
  assert float(metrics["teacher_lm_loss"]) == pytest.approx(ce(teacher_logits), rel=1e-5)
  assert float(metrics["tokens"]) == mask.sum() and float(metrics["grad_norm"]) > 0


def test_a_teacher_from_a_meshlm_run_loads_its_weights(teacher_dir, tmp_path):
  """Saved as a run's checkpoint (params + its config), read back onto the student's mesh."""
  teacher = hf.load(teacher_dir, progress=False)
  params = jax.device_get(nnx.to_pure_dict(nnx.state(teacher, nnx.Param)))
  ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), None)
  ck.save(5, {"params": params, "step": np.int32(5)}, None, {"config": {"model": teacher.cfg.to_dict()}})
  ck.close()
  config = _config(str(tmp_path))
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh), step_lib.FAST_COMPILE)
  assert trainer.objective.frozen_configs["teacher"].model.num_layers == 3
  abstract = trainer.abstract_frozen_params("teacher")
  loaded = setup.load_params(trainer, str(tmp_path), abstract, trainer.objective.frozen_configs["teacher"].model,
                             "train.distill_teacher")
  for got, want, a in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), jax.tree.leaves(abstract)):
    assert got.sharding == a.sharding
    np.testing.assert_array_equal(np.asarray(got), want)


# ---- (c) a vocab mismatch, (d) conditional keys, the recipe's start -------------------------------------------
def test_a_vocab_mismatch_is_refused_naming_both_sizes(tmp_path):
  path = _teacher_dir(tmp_path, vocab_size=512)
  config = _config(path)
  with pytest.raises(ValueError, match=r"teacher's vocab_size=512 differs from the student's model.vocab_size=256"):
    step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh))
  with pytest.raises(ValueError, match="needs config.train.distill_teacher"):
    step_lib.Trainer(_config(""), mesh_lib.make_mesh(config.mesh))


def test_distill_keys_act_only_with_the_distill_objective():
  for key, value in (("train.distill_temperature", 2.0), ("train.distill_top_k", 8), ("train.distill_loss", "jsd"),
                     ("train.distill_teacher", "/tmp/t"), ("train.distill_lm_weight", 0.5)):
    config = configs.load("tiny", **{key: value})
    with pytest.raises(configs.ConfigError, match=f"{key}=.* has no effect unless train.objective=distill"):
      validate.check(config)
    # Set by a config file while the command line chose another objective: a warning naming it.
    warnings = validate.check(config, explicit=["train.objective"])
    assert any(w.startswith(f"{key}=") and "has no effect unless train.objective=distill" in w for w in warnings)
  beta = configs.load("tiny", **{"train.objective": "distill", "train.distill_beta": 0.2})
  with pytest.raises(configs.ConfigError, match="distill_beta=0.2 has no effect unless .*distill_loss=jsd"):
    validate.check(beta)
  assert validate.check(configs.load("distill_tiny")) == []


def test_the_teacher_recipe_is_made_and_gives_its_tokenizer(tmp_path):
  made = []

  def train_base(config, workdir):  # stands in for train.core.loop.run: a finished run with a tokenizer
    made.append((config.model.num_layers, workdir))
    (tmp_path / "tiny" / "checkpoints").mkdir(parents=True)
    (tmp_path / "tiny" / "tokenizer.model").write_bytes(b"the teacher's tokenizer")
    return {"stopped": None}

  config = configs.load("distill_tiny")
  (tmp_path / "student").mkdir()
  setup.resolve_start(config, str(tmp_path / "student"), train_base)
  assert made == [(4, str(tmp_path / "tiny"))]
  assert config.train.distill_teacher == str(tmp_path / "tiny") and config.train.init_from == ""
  assert (tmp_path / "student" / "tokenizer.model").read_bytes() == b"the teacher's tokenizer"
  json.dumps(setup.config_dict(config))  # the resolved teacher is part of config.json
