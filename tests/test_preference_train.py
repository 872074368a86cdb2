"""Reward and DPO objectives on the shared Trainer: rewards and completion log-probabilities equal PyTorch on the
exported model, DPO starts at exactly ln 2 with accuracy 0, the frozen reference never changes, both objectives are
mesh-invariant, runs resume bit-exactly, and the scoring API / CLI equal PyTorch on the trained run."""
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

import checkpoint_testing

import configs
from chat_testing import TEXT
from data import pipeline
from data import tokenizer as tokenizer_lib
from model import hf
from parallel import mesh as mesh_lib
import parallel
from train.core import loop
from train.rundir import reward as reward_api
from train.core import step as step_lib
from train.objectives import reward as reward_objective

PAIRS = [{"prompt": "What is 12 + 30?", "chosen": "42", "rejected": "43"},
         {"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Reverse: a b c"}],
          "chosen": "c b a", "rejected": "a b c", "margin": 0.5},
         {"prompt": "Hello there!", "chosen": "Hello.", "rejected": "Go away, I am busy."},
         {"prompt": "Sort the digits: 3 1 2", "chosen": "1 2 3", "rejected": "3 2 1"}]
SMALL = {"model.vocab_size": 320, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": 32,
         "train.seq_len": 32, "train.batch_size": 8, "train.lr": 3e-3, "train.warmup_steps": 1,
         "data.chat_template": "meshlm", "data.eval_fraction": 0.0, "train.z_loss": 0.0}
MESHES = [(1, 1, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("preference")
  tok = tokenizer_lib.Tokenizer.load(tokenizer_lib.train(TEXT, str(root / "tok.model"), 320))
  path = root / "pairs.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS * 6))
  config = configs.load("tiny", **SMALL, **{"data.tokenizer": tok.path, "data.sources": f"preference:{path}"})
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  batches = [next(it) for _ in range(2)]
  it.close()
  return {"root": root, "tok": tok, "config": config, "batches": batches, "path": str(path)}


def _trainer(config, objective, shape):
  c = config.copy_and_resolve_references()
  c.train.objective = objective
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], sequence=shape[3])
  devices = jax.devices()[:1] if shape == (1, 1, 1, 1) else None
  return step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)


def _steps(trainer, batches, state=None):
  state = trainer.init() if state is None else state
  out = []
  for b in batches:
    state, m = trainer.step_fn(state, trainer.batch_to_device(b))
    out.append({k: float(v) for k, v in jax.device_get(m).items()})
  return out, state


@pytest.fixture(scope="module")
def reference(setup):
  """Both objectives on one device from the same init, and the init exported for transformers."""
  out = {}
  for objective in ("reward", "dpo"):
    trainer = _trainer(setup["config"], objective, MESHES[0])
    init = trainer.init()
    if objective == "reward":
      hf.save(trainer.model(init), str(setup["root"] / "exported"))
      out["head"] = np.asarray(jax.device_get(init["params"][reward_objective.HEAD]))
    before = jax.device_get(init)
    metrics, state = _steps(trainer, setup["batches"] * 2)
    out[objective] = {"trainer": trainer, "metrics": metrics, "before": before, "after": jax.device_get(state)}
  return out


def _torch_model(path):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _rows(batch, side):
  """(the sequence's token ids [n], completion mask over its targets ids[1:] [n-1]) of each row of one side."""
  for r in range(batch[f"{side}_inputs"].shape[0]):
    n = int((batch[f"{side}_segment_ids"][r] > 0).sum())
    assert batch[f"{side}_loss_mask"][r, n - 1:].sum() == 0  # the last token has no target
    yield batch[f"{side}_inputs"][r, :n], batch[f"{side}_loss_mask"][r, :n - 1]


def test_rewards_and_loss_equal_pytorch_on_the_exported_trunk(setup, reference):
  """r = head . (transformers' final-normed hidden state at the last token); loss = mean -log sigmoid(rc - rr - m)."""
  import torch
  model = _torch_model(str(setup["root"] / "exported"))
  batch = setup["batches"][0]
  rewards = {}
  for side in ("chosen", "rejected"):
    rewards[side] = []
    for ids, _ in _rows(batch, side):
      with torch.no_grad():
        out = model(torch.tensor(ids[None]), output_hidden_states=True)
      hidden = out.hidden_states[-1][0, -1].double().numpy()
      rewards[side].append(hidden @ reference["head"])
  rc, rr, m = np.array(rewards["chosen"]), np.array(rewards["rejected"]), batch["margin"][:, 0]
  first = reference["reward"]["metrics"][0]
  assert first["loss"] == pytest.approx(np.mean(np.logaddexp(0, -(rc - rr - m))), rel=1e-5)
  assert first["reward_accuracy"] == np.mean(rc > rr)
  assert first["reward_margin"] == pytest.approx(np.mean(rc - rr), rel=1e-4, abs=1e-6)


def test_dpo_sequence_logprobs_equal_pytorch_with_the_prompt_excluded(setup, reference):
  import torch
  trainer = reference["dpo"]["trainer"]
  model = _torch_model(str(setup["root"] / "exported"))  # the same init: dpo and reward draw the trunk alike
  batch = setup["batches"][0]
  with parallel.activate(trainer.mesh, trainer.rules):
    logp_2B = np.asarray(trainer.objective.sequence_logprobs(
        trainer.model(trainer.init()), {k: jax.numpy.asarray(v) for k, v in batch.items()})[0])
  want = {}
  for side in ("chosen", "rejected"):
    want[side] = []
    for ids, mask in _rows(batch, side):
      with torch.no_grad():
        logits = model(torch.tensor(ids[None, :-1])).logits[0].double()
      logp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
      assert 0 < mask.sum() < len(mask)  # the prompt is there and not scored
      want[side].append(float((logp * mask).sum()))
  np.testing.assert_allclose(logp_2B[0::2], want["chosen"], rtol=1e-5)
  np.testing.assert_allclose(logp_2B[1::2], want["rejected"], rtol=1e-5)


def test_dpo_starts_at_ln2_and_keeps_its_reference_bit_for_bit(reference):
  metrics, before, after = (reference["dpo"][k] for k in ("metrics", "before", "after"))
  assert metrics[0]["loss"] == np.float32(math.log(2))
  assert metrics[0]["reward_accuracy"] == 0.0 and metrics[0]["reward_margin"] == 0.0 and metrics[0]["kl"] == 0.0
  assert metrics[-1]["loss"] < metrics[0]["loss"] and metrics[-1]["kl"] > 0
  for a, b in zip(jax.tree.leaves(after["frozen"]["reference"]), jax.tree.leaves(before["frozen"]["reference"])):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(before["frozen"]["reference"]), jax.tree.leaves(before["params"])):
    np.testing.assert_array_equal(a, b)  # the reference is the starting policy
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["params"]),
                                                       jax.tree.leaves(before["params"])))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["reward", "dpo"])
@pytest.mark.parametrize("shape", MESHES[1:], ids=lambda s: "x".join(map(str, s)))
def test_preference_objectives_are_mesh_invariant(setup, reference, objective, shape):
  metrics, _ = _steps(_trainer(setup["config"], objective, shape), setup["batches"] * 2)
  for key in ("loss", "reward_accuracy", "grad_norm", "param_norm") + (("kl",) if objective == "dpo" else ()):
    # Later steps carry the earlier updates' reduction-order rounding, which Adam's g / sqrt(v) amplifies in
    # small-gradient coordinates (2.1e-5 relative in the reward model's step-3 gradient norm on a 2x2x2 mesh).
    # DPO's first rewards are exactly 0 in exact arithmetic (policy = reference); on a sharded mesh the policy's
    # differentiated forward and the reference's plain one may round apart by ~1e-7, and the fraction of pairs
    # with chosen > rejected is then the sign of that rounding: compared from the first update on.
    first = 1 if objective == "dpo" and key == "reward_accuracy" else 0
    np.testing.assert_allclose([m[key] for m in metrics][first:],
                               [m[key] for m in reference[objective]["metrics"]][first:],
                               rtol=1e-4 if key == "grad_norm" else 1e-5, atol=1e-6, err_msg=key)
  # Rewards are O(1) and their batch means mix signs (cancellation): compared absolutely, 3e-5 on the first step,
  # 1e-4 after updates (3.3e-5 seen at step 3, as above).
  for key in ("chosen_reward", "rejected_reward", "reward_margin"):
    got, want = [m[key] for m in metrics], [m[key] for m in reference[objective]["metrics"]]
    np.testing.assert_allclose(got[:1], want[:1], rtol=0, atol=3e-5, err_msg=key)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=key)


BASE = """from configs import tiny
def get_config():
  c = tiny.get_config()
  c.model.update(vocab_size=320, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=32)
  c.train.update(steps=1, batch_size=8, seq_len=32, eval_every=0, log_every=1)
  c.data.update(tokenizer={tokenizer!r})
  c.log.progress = False
  return c
"""



@pytest.mark.slow
@pytest.mark.parametrize("objective", ["reward", "dpo"])
def test_run_resumes_bit_exactly_and_the_scorer_equals_pytorch(setup, objective, capsys):
  root = setup["root"] / "runs"
  root.mkdir(exist_ok=True)
  recipe = setup["root"] / "base_small.py"
  recipe.write_text(BASE.format(tokenizer=setup["tok"].path))
  config = configs.load("tiny", **{**SMALL, "data.eval_fraction": 0.25}, **{
      "data.sources": f"preference:{setup['path']}", "train.objective": objective,
      "train.base_recipe": str(recipe), "train.steps": 4, "train.eval_every": 4, "train.eval_steps": 1,
      "train.log_every": 1, "checkpoint.every": 2, "checkpoint.keep": 5, "log.progress": False})
  workdir = str(root / objective)
  loop.run(config, workdir)
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [0, 4] and all(0 <= r["eval_reward_accuracy"] <= 1 for r in evals)
  assert all("reward_accuracy" in r for r in records if "loss" in r)
  if objective == "dpo":
    assert evals[0]["eval_reward_accuracy"] == 0.0 and evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
  want = checkpoint_testing.saved(workdir, 4)
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
  loop.run(config, workdir)  # resumes from step 2 and redoes steps 3-4
  assert f"resumed from {workdir}/checkpoints/2" in capsys.readouterr().out
  got = checkpoint_testing.saved(workdir, 4)
  assert got.keys() == want.keys()
  for k in want:
    assert np.array_equal(got[k], want[k]), k
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert {r["step"]: r["loss"] for r in records if "loss" in r} == losses
  if objective == "dpo":
    reference = {k: v for k, v in got.items() if k[0] == "frozen"}
    start = checkpoint_testing.saved(str(root / "base_small"), 1)
    for k, v in reference.items():
      assert np.array_equal(v, start[("params",) + k[2:]]), k  # the reference is still the base run, bit for bit
    texts = root / "one_text.jsonl"
    texts.write_text(json.dumps({"text": "Hello."}) + "\n")
    assert reward_api.main(["--workdir", workdir, "--input", str(texts)]) == 2
    assert "not 'reward'" in capsys.readouterr().err
    return

  # Scoring: a chat record rendered with the run's template and a plain text, vs transformers on the export.
  import torch
  from train.rundir import restore
  hf.save(restore.load_run(workdir).model, str(root / "hf"))  # the trunk as train.export writes it
  model = _torch_model(str(root / "hf"))
  head = got[("params", reward_objective.HEAD)]
  tok = setup["tok"]
  record = {"prompt": PAIRS[1]["prompt"], "completion": PAIRS[1]["chosen"]}
  from data import chat
  short = {"prompt": PAIRS[0]["prompt"], "completion": PAIRS[0]["chosen"]}
  texts = [json.dumps(record), "Hello there, a plain text.", json.dumps(short)]
  ids = [chat.MeshlmTemplate(tok).render(chat.parse_record(r))[0] for r in (record, short)]
  assert len(ids[0]) > 32 >= len(ids[1])  # the long one is scored on its last model.max_seq_len tokens
  ids = [ids[0][-32:], [tok.bos_id] + tok.encode(texts[1]), ids[1]]
  want_rewards = []
  for x in ids:
    with torch.no_grad():
      hidden = model(torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0, -1].double().numpy()
    want_rewards.append(hidden @ head)
  np.testing.assert_allclose(reward_api.score(workdir, texts), want_rewards, rtol=1e-4, atol=1e-5)
  # An RL run with rl.reward=rm:RUN scores its rollouts (conversation + sampled completion) the same way.
  from train.rl import rewards
  conversation = [{"role": "user", "content": PAIRS[0]["prompt"]}]
  rm_reward = rewards.Reward(f"rm:{workdir}")
  got_rl = rm_reward([PAIRS[0]["prompt"]], [PAIRS[0]["chosen"]],
                     [rewards.reward_text(conversation, PAIRS[0]["chosen"])])
  np.testing.assert_allclose(got_rl, want_rewards[2:], rtol=1e-4, atol=1e-5)
  lines = root / "texts.jsonl"
  lines.write_text(json.dumps(record) + "\n\n" + json.dumps({"text": texts[1]}) + "\n" + texts[2] + "\n")
  capsys.readouterr()
  assert reward_api.main(["--workdir", workdir, "--input", str(lines)]) == 0
  printed = [json.loads(line)["reward"] for line in capsys.readouterr().out.splitlines()]
  np.testing.assert_allclose(printed, want_rewards, rtol=1e-4, atol=1e-5)
  lines.write_text(json.dumps(record) + "\n{\"prompt\": 3}\n")
  assert reward_api.main(["--workdir", workdir, "--input", str(lines)]) == 2
  assert f"{lines}:2" in capsys.readouterr().err


def test_objective_and_data_must_agree_on_pairs(setup, tmp_path):
  config = setup["config"].copy_and_resolve_references()
  config.train.objective = "dpo"
  config.data.sources = "builtin:prose"
  with pytest.raises(loop.SetupError, match="no preference source"):
    loop.run(config, str(tmp_path / "dpo_on_text"))
  assert not os.path.exists(tmp_path / "dpo_on_text" / "config.json")
  config.train.update(objective="dpo", dpo_loss="ipo", dpo_label_smoothing=0.1)
  config.data.sources = f"preference:{setup['path']}"
  with pytest.raises(loop.SetupError, match="dpo_label_smoothing=0.1 applies to the sigmoid loss only"):
    loop.run(config, str(tmp_path / "ipo_smoothed"))
