"""Preference pairs: rendering with the chat template (completion mask on the completion only), rows that keep a
pair together, the built-in task's labels, and bad pairs (identical, empty completion, missing field) counted or
refused with a message."""
import json
import re

import numpy as np
import pytest

import configs
from chat_testing import TEXT, expected
from data import chat
from data import files
from data import pipeline
from data import preference
from data import tokenizer as tokenizer_lib

PAIRS = [
    {"prompt": "What is 12 + 30?", "chosen": "42", "rejected": "43"},
    {"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Reverse: a b c"}],
     "chosen": [{"role": "assistant", "content": "c b a"}], "rejected": "a b c", "margin": 1.5},
    {"prompt": "Hello there!", "chosen": "Hello.", "rejected": "Go away."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  root = tmp_path_factory.mktemp("pref")
  return tokenizer_lib.Tokenizer.load(tokenizer_lib.train(TEXT, str(root / "tok.model"), 320))


def _messages(value, role):
  return [{"role": role, "content": value}] if isinstance(value, str) else value


def _config(tok, sources, **kw):
  return configs.load("tiny", **{"model.vocab_size": 320, "train.seq_len": 40, "train.batch_size": 4,
                                 "data.tokenizer": tok.path, "data.chat_template": "meshlm",
                                 "data.sources": sources, **kw})


def test_a_pair_renders_prompt_then_completion_with_the_completion_masked(tok):
  encoder = preference.PairEncoder(chat.MeshlmTemplate(tok), seq_len=40, pad_id=tok.pad_id)
  for record in PAIRS:
    out = encoder(json.dumps(record))
    prompt = _messages(record["prompt"], "user")
    for side in ("chosen", "rejected"):
      completion = _messages(record[side], "assistant")
      ids, flags = expected(tok, prompt + completion)  # the meshlm template written out by hand
      n_prompt = len(expected(tok, prompt)[0]) + 1  # ... and the assistant marker opening the completion
      n = len(ids)  # every token is an input; the last has no target
      np.testing.assert_array_equal(out[f"{side}_inputs"][:n], ids)
      np.testing.assert_array_equal(out[f"{side}_targets"][:n - 1], ids[1:])
      mask = np.asarray(flags[1:] + [0], np.float32)
      mask[:n_prompt - 1] = 0  # targets inside the prompt are context
      np.testing.assert_array_equal(out[f"{side}_loss_mask"][:n], mask)
      assert out[f"{side}_loss_mask"][:n].sum() == len(tok.encode(completion[-1]["content"])) + 1  # + end of turn
      np.testing.assert_array_equal(out[f"{side}_segment_ids"], (np.arange(40) < n).astype(np.int32))
      np.testing.assert_array_equal(out[f"{side}_positions"][:n], np.arange(n))
      assert not out[f"{side}_loss_mask"][n:].any() and (out[f"{side}_inputs"][n:] == tok.pad_id).all()
    assert (out["margin"] == record.get("margin", 0.0)).all()


def test_pipeline_rows_keep_each_pair_together(tok, tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS * 4))
  it = pipeline.make_iterator(_config(tok, f"preference:{path}", **{"data.eval_fraction": 0.0}),
                              tok, process_index=0, process_count=1)
  batch = next(it)
  it.close()
  assert set(batch) == set(preference.BATCH_KEYS)
  for r in range(4):
    prompt_len = int(np.argmax(batch["chosen_loss_mask"][r]))  # first completion target
    np.testing.assert_array_equal(batch["chosen_inputs"][r, :prompt_len + 1],
                                  batch["rejected_inputs"][r, :prompt_len + 1])  # the same prompt in one row
    assert not np.array_equal(batch["chosen_targets"][r], batch["rejected_targets"][r])


def test_builtin_task_prefers_the_correct_answer():
  for i in range(200):
    p = preference.pair(0, i)
    assert p["chosen"] != p["rejected"]
    if p["family"] == "addition":
      a, b = map(int, re.findall(r"\d+", p["prompt"]))
      assert int(p["chosen"]) == a + b != int(p["rejected"])
      # the hundreds carry slipped: off by exactly 100, toward two digits when a + b has three and back
      assert int(p["rejected"]) == (a + b - 100 if a + b >= 100 else a + b + 100)
    elif p["family"] == "sorting":
      digits = p["prompt"].split(": ")[1].split()
      assert p["chosen"].split() == sorted(digits) != p["rejected"].split()
  held_out = preference.PreferenceTask().split_indices("eval")
  train = set(preference.PreferenceTask().split_indices("train")[:5000].tolist())
  assert 0 < len(held_out) and not train & set(held_out.tolist())


BAD = [({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."}, "identical"),
       ({"prompt": "Hi", "chosen": "", "rejected": "Hello."}, "empty_completion"),
       ({"prompt": "Hi", "chosen": "Hello."}, "missing_field")]


@pytest.mark.parametrize("record,reason", BAD, ids=[r for _, r in BAD])
def test_bad_pairs_are_counted_and_skipped_or_refused_when_strict(tok, record, reason):
  template = chat.MeshlmTemplate(tok)
  before = files.COUNTERS[f"preference_skipped_{reason}"]
  assert preference.PairEncoder(template, 40, tok.pad_id)(json.dumps(record), "pairs.jsonl:3") is None
  assert files.COUNTERS[f"preference_skipped_{reason}"] == before + 1
  with pytest.raises(ValueError, match=r"pairs.jsonl:3: .*data.strict=False"):
    preference.PairEncoder(template, 40, tok.pad_id, strict=True)(json.dumps(record), "pairs.jsonl:3")


def test_bad_pairs_in_a_file_are_skipped_and_logged_in_the_stats(tok, tmp_path):
  path = tmp_path / "mixed.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in (PAIRS + [r for r, _ in BAD]) * 3))
  it = pipeline.make_iterator(_config(tok, f"preference:{path}", **{"data.eval_fraction": 0.0}), tok,
                              process_index=0, process_count=1)
  for _ in range(3):
    batch = next(it)
    assert all((batch[f"{s}_loss_mask"].sum(1) > 0).all() for s in ("chosen", "rejected"))
  stats = it.stats()
  it.close()
  for _, reason in BAD:
    assert stats[f"data/preference_skipped_{reason}"] >= 1


def test_preference_sources_do_not_mix_with_text(tok, tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps(PAIRS[0]) + "\n")
  with pytest.raises(ValueError, match="mixes preference sources"):
    pipeline.make_iterator(_config(tok, f"preference:{path},builtin:prose"), tok, process_index=0, process_count=1)


def test_held_out_generation_items_come_from_preference_pairs_with_the_correct_answer():
  """train.eval_generations on a preference run (DPO): the held-out pairs' prompts with the chosen answer as the
  reference, per family; for the built-in task that is the correct answer, checked here from the prompt itself
  for reversal (the letters reversed) and addition (the sum)."""
  c = configs.load("dpo_tiny")
  items = preference.eval_items(c.data, per_family=8)
  families = {item.family for item in items}
  assert {"addition", "reversal"} <= families and len(items) == 8 * len(families)
  checked = 0
  for item in items:
    question = item.messages[-1]["content"]
    if item.family == "reversal":
      letters = question.split(":")[-1].split()
      assert item.answer.split() == letters[::-1], (question, item.answer)
      checked += 1
    elif item.family == "addition":
      a, b = map(int, re.findall(r"\d+", question)[:2])
      assert item.answer == str(a + b), (question, item.answer)
      checked += 1
  assert checked == 16
