"""The fastText quality classifier (data/curate/classifier.py): the .bin it writes loads in fasttext-predict with
the same probabilities as its own forward pass (fastText's features: vocabulary words, signed-hash bigrams), it
separates held-out good text from web junk, and the curation stage `quality_model` scores and drops by it."""
import json
import random

import numpy as np
import pytest

import curate_corpus
from data.curate import classifier
from data.curate import pipeline

NOUNS = "river town market garden bridge morning bakery window street teacher school story harbour field".split()
VERBS = "crosses follows opens watches reaches remembers describes carries finds builds".split()
JUNK = ("click here buy now best price free shipping casino bonus win prize login sign up cookies accept all "
        "home about contact menu share tweet subscribe").split()


def _good(rng):
  return " ".join(f"The {rng.choice(NOUNS)} {rng.choice(VERBS)} the old {rng.choice(NOUNS)} near the "
                  f"{rng.choice(NOUNS)}." for _ in range(rng.randint(3, 8)))


def _junk(rng):
  return " | ".join(" ".join(rng.choice(JUNK) for _ in range(rng.randint(2, 6))).title() for _ in range(8))


@pytest.fixture(scope="module")
def data():
  rng = random.Random(0)
  return [_good(rng) for _ in range(240)], [_junk(rng) for _ in range(240)]


@pytest.fixture(scope="module")
def model_path(data, tmp_path_factory):
  good, junk = data
  model = classifier.train(good[:200], junk[:200], dim=16, bucket=5000, epochs=5, lr=0.5)
  path = str(tmp_path_factory.mktemp("quality") / "quality.bin")
  model.save(path, 5, 0.5, 1000)
  return path, model


def test_fasttext_predict_reads_the_model_with_the_same_probabilities(model_path):
  path, model = model_path
  scorer = classifier.Scorer(path)
  texts = ["The river crosses the old bridge.", "CLICK here, casino bonus!", "unseen words entirely", "", "café naïve"]
  want = np.array([model.probabilities(classifier.prepare(t))[0] for t in texts])
  # fasttext-predict reports log(p + 1e-5) exponentiated: p + 1e-5.
  np.testing.assert_allclose(scorer.scores(texts), want + 1e-5, atol=2e-6)
  assert classifier.fasttext_hash("a") == 0xE40C292C  # FNV-1a 32 of b"a"
  assert classifier.fasttext_hash("\u00e9") == ((((2166136261 ^ 0xFFFFFFC3) * 16777619 & 0xFFFFFFFF)
                                                ^ 0xFFFFFFA9) * 16777619) & 0xFFFFFFFF  # bytes as signed chars


def test_held_out_documents_are_told_apart(model_path, data):
  scorer = classifier.Scorer(model_path[0])
  good, junk = data
  assert np.mean(scorer.scores(good[200:]) > 0.5) >= 0.95
  assert np.mean(scorer.scores(junk[200:]) < 0.5) >= 0.95


def test_the_curation_stage_scores_and_drops(model_path, data, tmp_path):
  good, junk = data
  docs = [{"id": f"g{i}", "text": t} for i, t in enumerate(good[200:210])] + [
      {"id": f"j{i}", "text": t} for i, t in enumerate(junk[200:210])]
  with open(tmp_path / "in.jsonl", "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in docs)
  cfg = curate_corpus.curate_input_config(
      tmp_path / "in.jsonl", tmp_path / "out", langid__enabled=False, quality__enabled=False,
      perplexity__enabled=False, minhash__enabled=False, dedup__enabled=False, quality_model__model=model_path[0],
      quality_model__threshold=0.5)
  stats = pipeline.run(cfg)
  out = curate_corpus.output_records(cfg.output)
  assert sorted(d["id"] for d in out) == sorted(f"g{i}" for i in range(10))
  assert all(d["quality_score"] > 0.5 for d in out)
  stage = next(s for s in stats["stages"] if s["stage"] == "quality_model")
  assert (stage["docs_in"], stage["docs_out"]) == (20, 10)
  cfg.output, cfg.quality_model.model = str(tmp_path / "out2"), str(tmp_path / "none.bin")
  with pytest.raises(FileNotFoundError, match="python -m data.curate.classifier"):
    pipeline.run(cfg)


def test_the_command_trains_and_reports_held_out_accuracy(data, tmp_path, capsys):
  good, junk = data
  for name, texts in (("good", good), ("junk", junk)):
    with open(tmp_path / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
  out = tmp_path / "q.bin"
  assert classifier.main(["--positive", str(tmp_path / "good.jsonl"), "--negative", str(tmp_path / "junk.jsonl"),
                          "--output", str(out), "--bucket", "5000", "--dim", "16"]) == 0
  assert "held-out accuracy" in capsys.readouterr().out and out.exists()
  assert classifier.main(["--positive", str(tmp_path / "nothing*.jsonl"), "--negative", str(tmp_path / "junk.jsonl"),
                          "--output", str(out)]) == 2
