"""Decontamination (data/curate/contamination.py, python -m data.decontaminate, the curation stage): planted copies
of benchmark items (verbatim, re-cased, re-punctuated) are found, unrelated text and copies shorter than the n-gram
are not, and the stage drops or marks exactly the planted documents."""
import json
import random

import pytest

import curate_corpus
from data import decontaminate
from data.curate import contamination
from data.curate import eval_items
from data.curate import pipeline

# Two small tasks in evals' own formats: a multiple-choice JSONL and a generation JSONL.
MC = [{"context": "Question: How do you keep a cast iron pan from rusting after you've washed it in the sink?\nAnswer:",
       "choices": ["Dry it on the stove and wipe a thin layer of oil over it.", "Leave it wet overnight."],
       "label": 0},
      {"context": "Question: What is the quickest way to cool a hot bowl of soup for a small child?\nAnswer:",
       "choices": ["Stir in an ice cube and wait a minute before serving it.", "Heat it longer."], "label": 0},
      {"context": "Short one?", "choices": ["Yes.", "No."], "label": 1}]
GEN = [{"context": "Translate the sentence about the lighthouse keeper who rowed out every winter night:",
        "answer": "He lit the lamp."}]
FILLER = ("the river town market winter garden old bridge quiet morning rain bakery bread window street teacher "
          "children school lesson story night lamp harbour boat fisher wind hill farm field summer evening").split()


def _filler(rng, n=60):
  return " ".join(rng.choice(FILLER) for _ in range(n)).capitalize() + "."


def _recase_repunctuate(text):
  return text.upper().replace("?", " ...").replace(",", ";").replace("\n", " -- ").replace("'", "")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  root = tmp_path_factory.mktemp("tasks")
  for name, rows in (("mc", MC), ("gen", GEN)):
    with open(root / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return f"mc:{root}/mc.jsonl,gen:{root}/gen.jsonl"


def _item(i):
  return MC[i]["context"] + " " + MC[i]["choices"][MC[i]["label"]]


def test_planted_copies_are_found_and_unrelated_text_is_not(tasks):
  index = contamination.load_index(tasks)
  assert index.items == {"mc": 3, "gen": 1} and index.too_short == {"mc": 1, "gen": 0}
  rng = random.Random(0)
  verbatim = _filler(rng) + " " + _item(0) + " " + _filler(rng)
  recased = _filler(rng) + " " + _recase_repunctuate(_item(1))
  # Only the answer's 13 words in a row, from the generation item (prompt + answer).
  gen_words = contamination.words(GEN[0]["context"] + " " + GEN[0]["answer"])
  tail = " ".join(gen_words[-13:]).title()
  assert set(index.match(verbatim)) == {"mc"} and index.match(verbatim)["mc"].items == {0}
  assert index.match(recased)["mc"].items == {1}
  assert set(index.match(_filler(rng) + " " + tail + ".")) == {"gen"}
  # Twelve words of an item (under its 13-gram) and a short item's full text are not enough.
  twelve = " ".join(contamination.words(_item(0))[:12])
  assert index.match(_filler(rng) + " " + twelve + " " + _filler(rng)) == {}
  assert index.match("Short one? No. " + _filler(rng)) == {}
  assert all(index.match(_filler(rng, 400)) == {} for _ in range(20))


def test_ngram_size_follows_the_item_length_with_a_floor():
  # A 10-word item is matched with 10-grams: all ten words needed, nine are not.
  index = contamination.Index([("t", ["one two three four five six seven eight nine ten"])])
  assert index.match("zero One, two; three four five six seven eight nine ten!") != {}
  assert index.match("zero one two three four five six seven eight nine") == {}
  # An apostrophe dropped or kept is the same word.
  index = contamination.Index([("t", ["I can't believe it is not butter at all."])])
  assert index.match("I CANT BELIEVE IT IS NOT BUTTER -- AT ALL") != {}
  with pytest.raises(ValueError, match="min_n"):
    contamination.Index([("t", ["x"])], min_n=9, max_n=8)


def test_cli_reports_per_task(tasks, tmp_path, capsys):
  rng = random.Random(1)
  docs = [{"id": "a", "text": _filler(rng) + " " + _item(0)}, {"id": "b", "text": _filler(rng)},
          {"id": "c", "text": _recase_repunctuate(_item(0)) + " " + _recase_repunctuate(_item(1))}]
  with open(tmp_path / "train.jsonl", "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in docs)
  out = tmp_path / "report.json"
  assert decontaminate.main(["--tasks", tasks, "--input", str(tmp_path / "train.jsonl"), "--output", str(out)]) == 0
  report = json.load(open(out))
  assert report["documents"] == 3 and report["contaminated_documents"] == 2
  mc = report["tasks"]["mc"]
  assert (mc["documents_hit"], mc["items_hit"], mc["items_too_short"]) == (2, 2, 1)
  assert mc["ngrams_matched"] > 0 and [e["document"] for e in mc["examples"]] == ["a", "c"]
  assert report["tasks"]["gen"]["documents_hit"] == 0
  printed = capsys.readouterr().out
  assert "2 contaminated" in printed and "document a holds item 0" in printed
  assert decontaminate.main(["--tasks", "nosuch:x", "--input", str(tmp_path / "train.jsonl")]) == 2
  assert decontaminate.main(["--tasks", tasks]) == 2


@pytest.mark.parametrize("action", ["drop", "report"])
def test_the_curation_stage_drops_or_marks_the_planted_documents(tasks, tmp_path, action):
  rng = random.Random(2)
  docs = [{"id": f"d{i}", "text": "\n".join(_filler(rng) for _ in range(3))} for i in range(12)]
  docs[3]["text"] += "\n" + _item(0)
  docs[7]["text"] += "\n" + _recase_repunctuate(_item(1))
  with open(tmp_path / "in.jsonl", "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in docs)
  cfg = curate_corpus.curate_input_config(tmp_path / "in.jsonl", tmp_path / "out", minhash__enabled=False,
                                          langid__enabled=False, quality__enabled=False, perplexity__enabled=False,
                                          dedup__min_length=0, decontaminate__tasks=tasks,
                                          decontaminate__action=action)
  stats = pipeline.run(cfg)
  written = curate_corpus.output_records(tmp_path / "out")
  stage = next(s for s in stats["stages"] if s["stage"] == "decontaminate")
  assert stats["contamination"] == {"mc": {"documents": 2, "ngrams": stats["contamination"]["mc"]["ngrams"]}}
  if action == "drop":
    assert sorted(d["id"] for d in written) == sorted(f"d{i}" for i in range(12) if i not in (3, 7))
    assert (stage["docs_in"], stage["docs_out"]) == (12, 10)
  else:
    assert len(written) == 12 and stage["docs_out"] == 12
    assert {d["id"]: d.get("contamination") for d in written if "contamination" in d} == {"d3": ["mc"],
                                                                                           "d7": ["mc"]}
  cfg.decontaminate.action = "delete"
  with pytest.raises(ValueError, match="decontaminate.action"):
    pipeline.run(cfg)


def test_published_formats_give_raw_prompt_plus_answer_items(tmp_path):
  """PIQA (goal + the labelled solution), CrowS-Pairs (each sentence), WinoGender (the sentence), BBQ (context +
  question + the labelled answer): raw text, no template, so a raw copy in training text is found."""
  piqa = tmp_path / "piqa"
  piqa.mkdir()
  (piqa / "valid.jsonl").write_text(json.dumps({"goal": "How do I remove a stripped screw from soft wood?",
                                                "sol1": "Press a wide rubber band into the head and turn slowly.",
                                                "sol2": "Hit it with a hammer."}) + "\n")
  (piqa / "valid-labels.lst").write_text("0\n")
  (tmp_path / "crows.csv").write_text("sent_more,sent_less,bias_type\n"
                                      "The old man could not work the new phone at all,"
                                      "The young man could not work the new phone at all,age\n")
  (tmp_path / "wino.tsv").write_text("sentid\tsentence\nnurse.patient.1.female.txt\tThe nurse notified the patient "
                                     "that her shift would be ending in an hour.\n")
  (tmp_path / "bbq.jsonl").write_text(json.dumps({"context": "A pastor and a chemist met at the station.",
                                                  "question": "Who was late?", "ans0": "The pastor",
                                                  "ans1": "The chemist", "ans2": "Unknown", "label": 2}) + "\n")
  spec = (f"piqa:{piqa},crows_pairs:{tmp_path / 'crows.csv'},winogender:{tmp_path / 'wino.tsv'},"
          f"bbq:{tmp_path / 'bbq.jsonl'}")
  items = dict(eval_items.load(spec))
  assert items["piqa"] == ["How do I remove a stripped screw from soft wood? Press a wide rubber band into the head "
                           "and turn slowly."]
  assert items["crows_pairs"] == ["The old man could not work the new phone at all",
                                  "The young man could not work the new phone at all"]
  assert items["winogender"] == ["The nurse notified the patient that her shift would be ending in an hour."]
  assert items["bbq"] == ["A pastor and a chemist met at the station. Who was late? Unknown"]
  index = contamination.load_index(spec)
  raw = "Tips. How do I remove a stripped screw from soft wood? Press a wide rubber band into the head. Done."
  assert set(index.match(raw)) == {"piqa"}
  assert set(index.match("he said the young man could not work the new phone at all, sadly")) == {"crows_pairs"}
  with pytest.raises(ValueError, match="unknown task 'quiz'"):
    eval_items.load(f"quiz:{tmp_path}")
