"""data/plan.py: config.data parsed once into a DataPlan, and a run handing that one plan to every data stage."""
import json

import pytest

import configs
from chat_testing import CHATS, TEXT
from data import chat as chat_lib
from data import pipeline
from data import plan as plan_lib
from data import sources
from data import tokenizer as tokenizer_lib
from train.core import chat_eval
from train.core import loop

SMALL = {"model.vocab_size": 320, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.max_seq_len": 128,
         "train.seq_len": 128, "train.batch_size": 8, "train.lr": 3e-3, "train.warmup_steps": 1,
         "data.chat_template": "meshlm", "log.progress": False, "log.tensorboard": False}


def _count_parses(monkeypatch) -> list:
  """Every later data.sources.parse_spec call, recorded (and passed through)."""
  calls, original = [], sources.parse_spec
  monkeypatch.setattr(sources, "parse_spec", lambda *a, **k: (calls.append(a), original(*a, **k))[1])
  return calls


def test_resolve_parses_sources_weights_and_objective_mixture():
  config = configs.load("tiny", **{"data.sources": "web=jsonl:/d/*.jsonl@3,chat:/c/*.jsonl,builtin:preference",
                                   "data.eval_fraction": 0.2, "data.objective_mixture": "R:1,X:1,LM:2"})
  plan = plan_lib.resolve(config.data)
  assert plan.names == ("web", "chat", "preference") and plan.weights == pytest.approx((0.6, 0.2, 0.2))
  assert plan.kinds == (plan_lib.TEXT, plan_lib.CHAT, plan_lib.PREFERENCE)
  assert plan.chat_indices == (1,) and plan.preference_names == ("preference",)
  assert plan.has_chat and plan.has_preference and plan.eval_fraction == 0.2
  assert plan.denoisers == {"R": 0.25, "X": 0.25, "LM": 0.5}
  assert plan == plan_lib.resolve(config.data)  # a value: frozen and comparable
  with pytest.raises(AttributeError):
    plan.specs = ()  # pylint: disable=attribute-defined-outside-init
  assert plan_lib.resolve(configs.load("tiny").data).kinds == (plan_lib.TEXT, plan_lib.TEXT)  # builtin


@pytest.mark.parametrize("key, value, message", [
    ("data.sources", "nope:/x", "cannot parse source"),
    ("data.weights", (1.0, 2.0, 3.0), "config.data.weights has 3 entries"),
    ("data.objective_mixture", "Q:1", "config.data.objective_mixture"),
])
def test_resolve_names_the_bad_key(key, value, message):
  with pytest.raises(ValueError, match=message):
    plan_lib.resolve(configs.load("tiny", **{key: value}).data)


def test_stages_given_a_plan_do_not_parse_again(tmp_path, monkeypatch):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i, text in enumerate(TEXT[:40]):
    (corpus / f"{i}.txt").write_text(text)
  config = configs.load("tiny", **SMALL, **{"data.sources": f"text:{corpus}/*.txt", "data.eval_fraction": 0.1,
                                            "data.tokenizer_max_sentences": 200})
  plan = plan_lib.resolve(config.data)
  calls = _count_parses(monkeypatch)
  path = tokenizer_lib.prepare(config, str(tmp_path), plan)  # trains the tokenizer on the plan's sources
  tok = tokenizer_lib.load(path)
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1, plan=plan)
  assert next(it)["inputs"].shape == (8, 128)
  it.close()
  assert chat_eval.template_for(config, tok, plan) is None  # text only: no chat template
  assert calls == []


def test_tokenizer_command_resolves_its_sources_once(tmp_path, monkeypatch):
  corpus = tmp_path / "a.txt"
  corpus.write_text("\n".join(TEXT))
  calls = _count_parses(monkeypatch)
  assert tokenizer_lib.main(["--output", str(tmp_path / "t.model"), "--sources", f"text:{corpus}",
                             "--vocab_size", "320"]) == 0
  assert len(calls) == 1 and tokenizer_lib.Tokenizer.load(str(tmp_path / "t.model")).vocab_size == 320


def _spy(monkeypatch, module, name: str, seen: list) -> None:
  """Wraps module.name to record the DataPlans among the arguments of each call."""
  original = getattr(module, name)

  def wrapper(*args, **kwargs):
    seen.append((f"{module.__name__}.{name}", [a for a in (*args, *kwargs.values())
                                               if isinstance(a, plan_lib.DataPlan)]))
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, wrapper)


@pytest.mark.slow
def test_a_run_parses_its_data_spec_once_and_every_stage_receives_that_plan(tmp_path, monkeypatch):
  tok = tokenizer_lib.train(TEXT, str(tmp_path / "tok.model"), 320)
  chats = tmp_path / "chats.jsonl"
  chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS * 6))
  config = configs.load("tiny", **SMALL, **{
      "train.objective": "sft", "data.tokenizer": tok, "data.sources": f"chat:{chats}", "data.eval_fraction": 0.3,
      "train.steps": 2, "train.log_every": 1, "train.eval_every": 2, "train.eval_steps": 1,
      "train.eval_generations": 1, "train.eval_max_new_tokens": 2, "checkpoint.every": 0})
  seen = []
  for module, name in ((tokenizer_lib, "prepare"), (pipeline, "make_dataset"), (chat_eval, "template_for"),
                       (chat_eval, "eval_items"), (chat_lib, "eval_items")):
    _spy(monkeypatch, module, name, seen)
  calls = _count_parses(monkeypatch)
  summary = loop.run(config, str(tmp_path / "run"))
  assert summary["step"] == 2 and "eval_exact_match" in json.dumps(
      [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")])
  assert len(calls) == 1, calls  # config.data.sources parsed once (the config checks share the parse)
  stages = [stage for stage, _ in seen]
  assert sorted(set(stages)) == ["data.chat.eval_items", "data.pipeline.make_dataset", "data.tokenizer.prepare",
                                 "train.core.chat_eval.eval_items", "train.core.chat_eval.template_for"]
  assert stages.count("data.pipeline.make_dataset") == 2  # the training and the eval split
  plans = [plan for _, found in seen for plan in found]
  assert len(plans) == len(seen) and all(plan is plans[0] for plan in plans), seen  # one plan, the same object
  assert plans[0] == plan_lib.resolve(config.data)
