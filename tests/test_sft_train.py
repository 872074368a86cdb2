"""SFT on the shared Trainer: the loss equals a PyTorch reference on the exported model over a packed batch of
conversations (assistant tokens only), is mesh-invariant, and a run (made from its base recipe) resumes
bit-exactly and logs held-out exact match per family."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

import checkpoint_testing

import configs
from chat_testing import CHATS, TEXT, expected
from data import chat
from data import pipeline
from data import tokenizer as tokenizer_lib
from model import hf
from parallel import mesh as mesh_lib
from train.core import loop
from train.core import setup as setup_lib
from train.core import step as step_lib

SMALL = {"model.vocab_size": 320, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": 128,
         "train.seq_len": 128, "train.batch_size": 4, "train.lr": 3e-3, "train.warmup_steps": 1,
         "train.objective": "sft", "data.chat_template": "meshlm", "train.z_loss": 1e-3}
MESHES = [(1, 1, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("sft")
  tok = tokenizer_lib.Tokenizer.load(tokenizer_lib.train(TEXT, str(root / "tok.model"), 320))
  path = root / "chats.jsonl"
  path.write_text("".join(json.dumps(c) + "\n" for c in CHATS * 6))
  config = configs.load("tiny", **SMALL, **{"data.tokenizer": tok.path, "data.sources": f"chat:{path}"})
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  batches = [next(it) for _ in range(2)]
  it.close()
  return {"root": root, "tok": tok, "config": config, "batches": batches, "path": str(path)}


def _trainer(config, shape):
  c = config.copy_and_resolve_references()
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], sequence=shape[3])
  devices = jax.devices()[:1] if shape == (1, 1, 1, 1) else None
  return step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)


def _steps(trainer, batches):
  state = trainer.init()
  out = []
  for b in batches:
    state, m = trainer.step_fn(state, trainer.batch_to_device(b))
    out.append({k: float(v) for k, v in jax.device_get(m).items()})
  return out, state


@pytest.fixture(scope="module")
def reference(setup):
  trainer = _trainer(setup["config"], MESHES[0])
  init = trainer.init()
  model = trainer.model(init)
  hf.save(model, str(setup["root"] / "exported"))
  metrics, _ = _steps(trainer, setup["batches"])
  return {"trainer": trainer, "metrics": metrics}


def test_sft_loss_equals_pytorch_on_the_exported_model(setup, reference):
  """Each packed conversation is scored alone by transformers' Llama on the exported weights; the mean negative
  log-likelihood of the hand-derived assistant tokens equals the step's loss (pre-update, first batch)."""
  import torch
  import transformers
  tok, batch = setup["tok"], setup["batches"][0]
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(setup["root"] / "exported"),
                                                                  dtype=torch.float32)
  nll, count, turns = 0.0, 0, set()
  for r in range(batch["inputs"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in sorted(set(seg[seg > 0].tolist())):
      where = seg == s
      full = np.concatenate([batch["inputs"][r][where], batch["targets"][r][where][-1:]]).tolist()
      record = next(c for c in CHATS if expected(tok, chat.parse_record(c))[0] == full)
      messages = chat.parse_record(record)
      turns |= {m["role"] for m in messages}
      ids, flags = expected(tok, messages)
      with torch.no_grad():
        logits = torch_model(torch.tensor([ids[:-1]])).logits[0].double()
      logp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
      nll -= float((logp * np.asarray(flags[1:])).sum())
      count += int(sum(flags[1:]))
  assert turns == {"system", "user", "assistant"}
  assert reference["metrics"][0]["tokens"] == count
  assert reference["metrics"][0]["loss"] == pytest.approx(nll / count, rel=1e-5)


@pytest.mark.parametrize("shape", MESHES[1:], ids=lambda s: "x".join(map(str, s)))
def test_sft_is_mesh_invariant(setup, reference, shape):
  metrics, _ = _steps(_trainer(setup["config"], shape), setup["batches"])
  for key in ("loss", "z_loss", "grad_norm", "param_norm", "tokens", "sequences"):
    np.testing.assert_allclose([m[key] for m in metrics], [m[key] for m in reference["metrics"]], rtol=1e-5,
                               err_msg=key)


BASE = """from configs import tiny
def get_config():
  c = tiny.get_config()
  c.model.update(vocab_size=320, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=128)
  c.train.update(steps=2, batch_size=8, seq_len=128, eval_every=0, log_every=1)
  c.data.update(tokenizer={tokenizer!r})
  c.log.progress = False
  return c
"""



@pytest.mark.slow
def test_sft_run_from_its_base_recipe_resumes_bit_exactly(setup, capsys, monkeypatch):
  root = setup["root"] / "runs"
  root.mkdir()
  recipe = setup["root"] / "base_small.py"
  recipe.write_text(BASE.format(tokenizer=setup["tok"].path))
  config = configs.load("tiny", **{k: v for k, v in SMALL.items() if k not in ("data.chat_template", "train.batch_size")}, **{
      "data.sources": f"chat:{setup['path']}", "data.eval_fraction": 0.3, "train.base_recipe": str(recipe),
      "train.batch_size": 8, "train.steps": 4, "train.eval_every": 4, "train.eval_steps": 1, "train.eval_generations": 2,
      "train.eval_max_new_tokens": 4, "train.log_every": 1, "checkpoint.every": 2, "checkpoint.keep": 5,
      "log.progress": False})
  workdir = str(root / "sft")
  loop.run(config, workdir)
  assert "making the" in capsys.readouterr().out and os.path.isdir(root / "base_small" / "checkpoints" / "2")
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in records if "eval_loss" in r]
  families = {c["family"] for c in CHATS}
  assert [r["step"] for r in evals] == [0, 4]
  for r in evals:
    assert 0.0 <= r["eval_exact_match"] <= 1.0
    assert {k.split("/")[1] for k in r if k.startswith("eval_exact_match/")} <= families
  want = checkpoint_testing.saved(workdir, 4)
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
  loop.run(config, workdir)  # resumes from step 2 and redoes steps 3-4; the base run is reused
  out = capsys.readouterr().out
  assert "reusing the" in out and f"resumed from {workdir}/checkpoints/2" in out
  got = checkpoint_testing.saved(workdir, 4)
  assert got.keys() == want.keys()
  for k in want:
    assert np.array_equal(got[k], want[k]), k
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert {r["step"]: r["loss"] for r in records if "loss" in r} == losses

  # The chat command line answers each stdin line, with the run's template from its checkpoint.
  import io
  from train.rundir import generate
  monkeypatch.setattr("sys.stdin", io.StringIO("What is 12 + 30?\nReverse: a b c\n"))
  assert generate.main(["--workdir", workdir, "--chat", "--max_new_tokens", "4"]) == 0
  assert capsys.readouterr().out.count("\n") >= 2  # one printed answer per turn (answers may hold newlines)


def test_init_from_a_hugging_face_dir_takes_its_model_config_and_tokenizer(tmp_path):
  from flax import nnx
  from chat_testing import hf_tokenizer_dir
  import model as model_lib
  directory = hf_tokenizer_dir(tmp_path)
  hf_model = configs.load("tiny", **SMALL).model
  hf_model.update(vocab_size=400, d_model=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, mlp_dim=96)
  hf.save(model_lib.Transformer(hf_model, rngs=nnx.Rngs(0)), directory)
  config = configs.load("tiny", **{"train.init_from": directory, "model.dtype": "bfloat16"})
  resolved = setup_lib.resolve_start(config, str(tmp_path / "run"))  # the tokenizer comes from the directory
  setup_lib.reconcile(resolved, str(tmp_path / "run" / "checkpoints"), overrides=["model.dtype"])  # so does the model
  for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
    assert resolved.model[key] == hf_model[key], key
  assert resolved.model.dtype == "bfloat16"  # the run's compute settings stay
  assert resolved.data.tokenizer == directory
  tok = tokenizer_lib.load(tokenizer_lib.prepare(resolved, str(tmp_path / "run")))
  assert 300 < tok.vocab_size <= 400 and tok.chat_template and tok.eos_id == tok.special_id("<|eot_id|>")


def test_chat_answers_each_turn_with_the_whole_conversation(setup, reference):
  """`converse` equals greedy decoding, written out by hand, of the meshlm-rendered conversation so far."""
  import jax.numpy as jnp
  from flax import nnx
  from train.rundir import chat as chat_lib
  tok = setup["tok"]
  model = reference["trainer"].model(reference["trainer"].init())
  template = chat_lib.template_for_run(setup["config"], tok, chat.MESHLM_JINJA)
  answers = []
  messages = chat_lib.converse(model, tok, template, ["What is 12 + 30?", "", "Reverse: a b c"], answers.append,
                               max_new_tokens=5)
  assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
  stops = {tok.special_id("<|end_of_turn|>"), tok.eos_id}
  # One full forward pass per token, without a cache; right padding to one length compiles the pass once and does
  # not change a causal model's logits at the last real position.
  forward = nnx.jit(lambda m, x: m(x))
  length = setup["config"].model.max_seq_len
  for turn in (1, 3):
    ids = expected(tok, messages[:turn])[0] + [tok.special_id("<|assistant|>")]
    new = []
    for _ in range(5):  # greedy
      row = ids + new
      assert len(row) <= length
      token = int(jnp.argmax(forward(model, jnp.asarray([row + [0] * (length - len(row))]))[0, len(row) - 1]))
      new.append(token)
      if token in stops:
        break
    assert messages[turn]["content"] == tok.decode([t for t in new if t not in stops])
  assert answers == [messages[1]["content"], messages[3]["content"]]
