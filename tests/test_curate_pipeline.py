"""The whole curation pipeline: resuming after a crash, and the Ray executor, give the uninterrupted local output."""
import json
import os
import random

import pytest

import curate_corpus
from configs import curate as curate_config
from data.curate import executors
from data.curate import pipeline

pytestmark = pytest.mark.slow  # end to end: the whole curation pipeline, worker processes and Ray

EN = ("the a of and to in that with for on at from by river town market winter garden old bridge quiet morning "
      "rain bakery bread window street teacher children school lesson story night lamp harbour boat fisher wind "
      "hill farm field summer evening song village church bell clock square tower museum painting artist light "
      "road travel train station ticket journey mountain snow forest path letter friend neighbour door kitchen "
      "walked opened found carried watched wrote built painted sang waited remembered").split()
DE = ("der die das und mit von zu im auf aus bei nach Fluss Stadt Markt Winter Garten alte Brücke ruhige Morgen "
      "Regen Bäckerei Brot Fenster Straße Lehrer Kinder Schule Geschichte Nacht Lampe Hafen Boot Wind Hügel "
      "Bauernhof Feld Sommer Abend Lied Dorf Kirche Glocke Uhr Platz Turm Museum Maler Licht Weg Reise Zug "
      "Bahnhof Berg Schnee Wald Brief Freund Nachbar Tür Küche ging öffnete fand trug schrieb baute wartete").split()
NUM_SHARDS = 5


def _doc(rng, words, lines=3, n=30):
  return "\n".join(" ".join(rng.choice(words) for _ in range(n)).capitalize() + "." for _ in range(lines))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(0)
  shards = []
  for s in range(NUM_SHARDS):
    docs = [{"id": f"{s}-{i}", "text": _doc(rng, EN if i % 3 else DE), "meta": {"shard": s}} for i in range(14)]
    docs[4]["text"] += "\nContact: info@example.com, +44 20 7946 0958."
    shards.append(docs)
  shards[3].append({"id": "copy", "text": shards[1][2]["text"]})
  shards[4].append({"id": "near", "text": shards[0][5]["text"].replace(".", " too.")})
  for s, docs in enumerate(shards):
    with open(root / f"part-{s}.jsonl", "w") as f:
      f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
  with open(root / "reference.txt", "w") as f:
    f.write("\n".join(_doc(rng, EN, lines=1, n=20) for _ in range(150)) + "\n")
  return root


def _config(corpus, out):
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(corpus / "part-*.jsonl"), str(out), 1
  cfg.dedup.min_length = 100
  cfg.quality.min_words = 40
  cfg.perplexity.reference = (str(corpus / "reference.txt"),)
  cfg.perplexity.vocab_size = 400
  cfg.pii.enabled = True
  return cfg


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
  out = tmp_path_factory.mktemp("reference") / "out"
  stats = pipeline.run(_config(corpus, out))
  return curate_corpus.output_tree(out), stats


def test_reference_run_is_sane(reference):
  tree, stats = reference
  ids = [json.loads(line)["id"] for path, data in tree.items() if path.endswith(".jsonl")
         for line in data.decode().splitlines()]
  assert len(ids) == len(set(ids)) and "copy" not in ids and "near" not in ids
  assert {p.split(os.sep)[0] for p in tree if p.endswith(".jsonl")} == {"en", "de"}
  records = [json.loads(line) for p, data in tree.items() if p.endswith(".jsonl")
             for line in data.decode().splitlines()]
  assert all({"id", "text", "language", "language_score", "perplexity", "bucket", "meta"} <= r.keys() for r in records)
  assert any("<EMAIL>" in r["text"] and "<PHONE>" in r["text"] for r in records)
  assert sum(len(b) for b in stats["output"].values()) >= 4  # head/middle/tail present
  assert {"stats.json", "stats.md"} <= set(tree)


def test_crash_in_pass_two_then_rerun_is_identical(corpus, reference, tmp_path, monkeypatch):
  out = tmp_path / "out"
  original = pipeline.score_shard
  calls = []

  def crashing(*args):
    calls.append(args[2])
    if len(calls) > 2:
      raise RuntimeError("simulated crash")
    return original(*args)

  monkeypatch.setattr(pipeline, "score_shard", crashing)
  with pytest.raises(RuntimeError, match="simulated crash"):
    pipeline.run(_config(corpus, out))
  assert not os.path.exists(out / "stats.json")
  rerun_calls = []
  monkeypatch.setattr(pipeline, "score_shard", lambda *a: (rerun_calls.append(a[2]), original(*a))[1])
  pipeline.run(_config(corpus, out))
  assert rerun_calls == [2, 3, 4]  # finished shards are skipped
  assert curate_corpus.output_tree(out) == reference[0]


def test_crash_while_writing_output_then_rerun_is_identical(corpus, reference, tmp_path, monkeypatch):
  out = tmp_path / "out"
  original = pipeline.ppl.bucket
  calls = []

  def crashing(*args):
    calls.append(1)
    if len(calls) == 25:  # in the middle of the second shard, after some records went to temporary files
      raise RuntimeError("simulated crash")
    return original(*args)

  monkeypatch.setattr(pipeline.ppl, "bucket", crashing)
  with pytest.raises(RuntimeError, match="simulated crash"):
    pipeline.run(_config(corpus, out))
  monkeypatch.setattr(pipeline.ppl, "bucket", original)
  partial = curate_corpus.output_tree(out)
  assert partial and all(".tmp" in p or "00000" in p for p in partial)  # no finished file of unfinished shards
  pipeline.run(_config(corpus, out))
  assert curate_corpus.output_tree(out) == reference[0]


def test_rerun_with_other_settings_is_refused(corpus, reference, tmp_path):
  out = tmp_path / "out"
  pipeline.run(_config(corpus, out))
  cfg = _config(corpus, out)
  cfg.minhash.threshold = 0.5
  with pytest.raises(ValueError, match="minhash"):
    pipeline.run(cfg)


def test_local_worker_processes_match(corpus, reference, tmp_path):
  cfg = _config(corpus, tmp_path / "out")
  cfg.num_workers = 2
  pipeline.run(cfg)
  assert curate_corpus.output_tree(tmp_path / "out") == reference[0]


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # Ray starts its processes; JAX is idle here
def test_ray_executor_matches_local(corpus, reference, tmp_path):
  import ray  # the test extra installs it
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  try:
    cfg = _config(corpus, tmp_path / "out")
    cfg.executor = "ray"
    pipeline.run(cfg, executor=executors.make_executor(cfg))
    assert curate_corpus.output_tree(tmp_path / "out") == reference[0]
  finally:
    ray.shutdown()
