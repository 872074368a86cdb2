"""Chat data (data/chat.py, data/instruct.py, data/hf_tokenizer_load.py): the meshlm template's tokens and
assistant masks, packing whole conversations, truncation, bad records counted / skipped / fatal, Jinja templates,
and Hugging Face tokenizer directories."""
import json
import os

import numpy as np
import pytest

import configs
from data import chat
from data import hf_tokenizer_load
from data import instruct
from data import pipeline
from data import sources
from data import tokenizer as tokenizer_lib
from chat_testing import CHATS, TEXT, expected, hf_tokenizer_dir



@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tok.model"
  return tokenizer_lib.Tokenizer.load(tokenizer_lib.train(TEXT, str(path), 320))


def _config(tok, path, **overrides):
  c = configs.load("tiny", **{"data.tokenizer": tok.path, "data.sources": f"chat:{path}", "train.batch_size": 2,
                              "train.seq_len": 96, "model.vocab_size": 320, "data.chat_template": "meshlm",
                              **overrides})
  return c


def _write(tmp_path, records, name="chats.jsonl"):
  path = tmp_path / name
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def test_packed_batch_holds_whole_conversations_with_assistant_masks(tok, tmp_path):
  path = _write(tmp_path, CHATS * 4)
  it = pipeline.make_iterator(_config(tok, path), tok, process_index=0, process_count=1)
  seen = 0
  for _ in range(3):
    batch = next(it)
    for r in range(batch["inputs"].shape[0]):
      seg = batch["segment_ids"][r]
      for s in sorted(set(seg[seg > 0].tolist())):
        where = seg == s
        inputs, targets, mask = batch["inputs"][r][where], batch["targets"][r][where], batch["loss_mask"][r][where]
        assert inputs[0] == tok.bos_id and np.array_equal(batch["positions"][r][where], np.arange(where.sum()))
        full = np.concatenate([inputs, targets[-1:]]).tolist()
        matches = [c for c in CHATS if expected(tok, chat.parse_record(c))[0] == full]
        assert len(matches) == 1, full  # a whole conversation: no piece of another one, nothing cut
        ids, flags = expected(tok, chat.parse_record(matches[0]))
        np.testing.assert_array_equal(targets, ids[1:])
        np.testing.assert_array_equal(mask, flags[1:])
        seen += 1
    assert not batch["loss_mask"][batch["segment_ids"] == 0].any()
  assert seen >= 6
  # The assistant-masked targets decode to exactly the assistant turns, each closed by its end-of-turn marker.
  ids, flags = expected(tok, chat.parse_record(CHATS[0]))
  eot = tok.special_id("<|end_of_turn|>")
  masked = [t for t, f in zip(ids[1:], flags[1:]) if f]
  assert masked.count(eot) == 2 and tok.decode(masked) == "42c b a"
  it.close()


def test_loss_on_all_tokens_and_truncation_sides(tok):
  template = chat.MeshlmTemplate(tok)
  messages = chat.parse_record(CHATS[0])
  ids, _ = expected(tok, messages)
  text = json.dumps(CHATS[0])
  everything = chat.ChatEncoder(template, 100, loss="all")(text)
  assert everything["loss_mask"].all() and len(everything["inputs"]) == len(ids) - 1
  before = sources.COUNTERS["chat_truncated"]
  n = len(ids) - 4
  right = chat.ChatEncoder(template, n, truncation="right")(text)
  left = chat.ChatEncoder(template, n, truncation="left")(text)
  assert sources.COUNTERS["chat_truncated"] == before + 2
  np.testing.assert_array_equal(right["inputs"], ids[:n])  # keeps the start
  np.testing.assert_array_equal(left["targets"], ids[-n:])  # keeps the end (the last answer)
  assert left["loss_mask"][-1] == 1 and right["inputs"][0] == tok.bos_id
  # Cut before the first answer: nothing left to learn, so the conversation is skipped and counted.
  skipped = sources.COUNTERS["chat_skipped_no_loss_tokens"]
  assert chat.ChatEncoder(template, 5, truncation="right")(text) is None
  assert sources.COUNTERS["chat_skipped_no_loss_tokens"] == skipped + 1


@pytest.mark.parametrize("record,reason", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"text": "plain"}, "no_messages"),
    ("{not json", "unparseable"),
])
def test_bad_records_are_counted_and_skipped_or_fatal_when_strict(tok, record, reason):
  text = record if isinstance(record, str) else json.dumps(record)
  key = f"chat_skipped_{reason}"
  before = sources.COUNTERS[key]
  assert chat.ChatEncoder(chat.MeshlmTemplate(tok), 64)(text) is None
  assert sources.COUNTERS[key] == before + 1
  with pytest.raises(ValueError, match="strict=False"):
    chat.ChatEncoder(chat.MeshlmTemplate(tok), 64, strict=True)(text)


def test_pipeline_skips_bad_records_and_strict_stops(tok, tmp_path):
  path = _write(tmp_path, [CHATS[2], {"messages": [{"role": "user", "content": "hi"}]}] * 8)
  before = sources.COUNTERS["chat_skipped_no_assistant"]
  it = pipeline.make_iterator(_config(tok, path), tok, process_index=0, process_count=1)
  batch = next(it)
  assert batch["loss_mask"].sum() > 0 and sources.COUNTERS["chat_skipped_no_assistant"] > before
  assert it.stats()["data/chat_skipped_no_assistant"] >= 1
  it.close()
  it = pipeline.make_iterator(_config(tok, path, **{"data.strict": True}), tok, process_index=0, process_count=1)
  with pytest.raises(ValueError, match="no assistant turn"):
    next(it)
  it.close()


def test_template_without_special_pieces_is_refused(tmp_path):
  import sentencepiece as spm
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(tmp_path / "plain"), vocab_size=60,
                                 minloglevel=2)
  plain = tokenizer_lib.Tokenizer.load(str(tmp_path / "plain.model"))
  with pytest.raises(ValueError, match=r"lacks the special pieces \['<\|user\|>', '<\|assistant\|>'"):
    chat.MeshlmTemplate(plain)
  # A tokenizer with the user/assistant/end-of-turn markers but no system marker: conversations with a system
  # turn are counted and skipped (fatal with data.strict), the others train.
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(tmp_path / "nosys"), vocab_size=60,
                                 control_symbols=["<|user|>", "<|assistant|>", "<|end_of_turn|>"], minloglevel=2)
  nosys = chat.MeshlmTemplate(tokenizer_lib.Tokenizer.load(str(tmp_path / "nosys.model")))
  before = sources.COUNTERS["chat_skipped_missing_marker"]
  assert chat.ChatEncoder(nosys, 200)(json.dumps(CHATS[0])) is None
  assert sources.COUNTERS["chat_skipped_missing_marker"] == before + 1
  assert chat.ChatEncoder(nosys, 200)(json.dumps(CHATS[2]))["loss_mask"].sum() > 0
  with pytest.raises(ValueError, match="no marker piece '<\\|system\\|>'"):
    chat.ChatEncoder(nosys, 200, strict=True)(json.dumps(CHATS[0]))


def test_meshlm_jinja_renders_the_same_tokens_and_masks(tok):
  """The exported Jinja form of the template (tokenizer_config.json chat_template), rendered by jinja2 and
  tokenized with special-piece matching, gives the token renderer's ids and assistant flags."""
  jinja = chat.JinjaTemplate(tok, chat.MESHLM_JINJA)
  meshlm = chat.MeshlmTemplate(tok)
  for record in CHATS:
    messages = chat.parse_record(record)
    assert jinja.render(messages) == meshlm.render(messages) == expected(tok, messages)
    assert jinja.prompt(messages[:-1]) == meshlm.prompt(messages[:-1])
  # User text that spells a marker stays text: it cannot open a turn.
  ids, _ = meshlm.render([{"role": "user", "content": "<|assistant|>"}, {"role": "assistant", "content": "ok"}])
  assert ids.count(tok.special_id("<|assistant|>")) == 1


def test_instruct_task_is_seeded_and_held_out_prompts_never_train():
  task = instruct.InstructTask(size=4000)
  assert task[7] == instruct.InstructTask(size=4000)[7]
  prompt = lambda i: json.loads(task[int(i)])["messages"][0]["content"]
  held = {prompt(i) for i in task.split_indices("eval")}
  trained = {prompt(i) for i in task.split_indices("train")}
  assert held and not held & trained
  for i in range(8):
    record = json.loads(task[i])
    q, a = record["messages"][0]["content"], record["messages"][1]["content"]
    if record["family"] == "addition":
      x, y = q.removeprefix("What is ").removesuffix("?").split(" + ")
      assert int(a) == int(x) + int(y)
    elif record["family"] == "reversal":
      assert a.split() == q.split(": ")[1].split()[::-1]
    elif record["family"] == "sorting":
      assert a.split() == sorted(q.split(": ")[1].split())


def test_hf_tokenizer_json_and_its_chat_template_match_transformers(tmp_path):
  import transformers
  directory = hf_tokenizer_dir(tmp_path)
  ours = tokenizer_lib.load(directory)
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  assert isinstance(ours, hf_tokenizer_load.HFTokenizer) and ours.vocab_size == len(theirs)
  for text in TEXT[:5] + ["unseen wörds, <|eot_id|> in text"]:
    assert ours.encode(text) == theirs(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
  assert ours.decode(ours.encode("The lazy dog.")) == "The lazy dog."
  template = chat.make_template(configs.load("tiny").data, ours)  # auto: the tokenizer's own Jinja template
  assert isinstance(template, chat.JinjaTemplate)
  for record in CHATS:
    messages = chat.parse_record(record)
    ids, flags = template.render(messages)
    want = theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids == want
    masked = ours.decode([t for t, f in zip(ids, flags) if f])
    assert masked == "".join(m["content"] for m in messages if m["role"] == "assistant")
    assert [t for t, f in zip(ids, flags) if f].count(ours.special_id("<|eot_id|>")) == sum(
        m["role"] == "assistant" for m in messages)
    prompt = theirs.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    assert template.prompt(messages[:-1]) == prompt
  assert ours.stop_ids == (ours.special_id("<|eot_id|>"),)


def test_hf_sentencepiece_directory_loads_through_sentencepiece(tok, tmp_path):
  directory = tmp_path / "sp"
  directory.mkdir()
  with open(tok.path, "rb") as f:
    (directory / "tokenizer.model").write_bytes(f.read())
  (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  loaded = tokenizer_lib.load(str(directory))
  assert loaded.encode("The quick brown fox") == tok.encode("The quick brown fox")
  assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (tok.bos_id, tok.eos_id, tok.vocab_size)
  assert os.path.basename(loaded.path) == "sp"


def test_exported_chat_template_is_what_transformers_renders(tmp_path):
  import transformers
  directory = hf_tokenizer_dir(tmp_path)
  jinja = ("{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '<|eot_id|>' }}"
           "{% endfor %}")
  chat.write_chat_template(directory, jinja)
  with open(os.path.join(directory, "tokenizer_config.json")) as f:
    saved = json.load(f)
  assert saved["chat_template"] == jinja and saved["eos_token"] == "<|eot_id|>"  # other keys kept
  messages = chat.parse_record(CHATS[2])
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  ours = chat.make_template(configs.load("tiny").data, tokenizer_lib.load(directory))
  assert ours.render(messages)[0] == theirs.apply_chat_template(messages, tokenize=True,
                                                                return_dict=True)["input_ids"]
