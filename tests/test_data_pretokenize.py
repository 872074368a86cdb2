"""The tokenized cache (data/pretokenize.py, `tokens:DIR`): its batches equal the text source's step for step (one
and two processes, after a resume, after a changed process count), epochs reshuffle deterministically, a killed
build resumes without redoing finished shards, worker processes write the same shards, and mismatches are refused."""
import json
import os
import pathlib

import numpy as np
import pytest

from configs import tiny
from data import mixture as mixture_lib
from data import pipeline
from data import plan as plan_lib
from data import pretokenize
from data import sources
from data import tokenizer as tokenizer_lib
from data.curate import executors

SEQ_LEN, VOCAB = 64, 512
_LETTERS = np.random.default_rng(1).integers(97, 123, (300, 7))
WORDS = ["".join(map(chr, w[:3 + i % 5])) for i, w in enumerate(_LETTERS)]  # 300 made-up words


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Two JSONL sources (one with an unparseable line and a blank-text record), a tokenizer, and their cache."""
  root = tmp_path_factory.mktemp("pretok")
  rng = np.random.default_rng(0)
  texts = []
  for name, n in (("alpha", 300), ("beta", 150)):
    os.makedirs(root / name)
    docs = [f"{name}{i:04d} " + " ".join(rng.choice(WORDS, int(rng.integers(5, 90)))) for i in range(n)]
    texts += docs
    with open(root / name / "part.jsonl", "w") as f:
      for i, d in enumerate(docs):
        f.write(json.dumps({"text": d}) + "\n")
        if name == "beta" and i == 20:
          f.write("{not json\n")
          f.write(json.dumps({"text": "   "}) + "\n")
  tok_path = tokenizer_lib.train(texts, str(root / "tok.model"), VOCAB)
  spec = f"a=jsonl:{root}/alpha/*.jsonl@0.7,b=jsonl:{root}/beta/*.jsonl@0.3"
  cache = str(root / "cache")
  pretokenize.build(spec, tok_path, cache, shard_docs=64)
  return root, spec, tok_path, cache


def _config(corpus, sources_spec, **data):
  _, _, tok_path, _ = corpus
  c = tiny.get_config()
  c.model.vocab_size = VOCAB
  c.train.batch_size, c.train.seq_len = 4, SEQ_LEN
  c.data.sources, c.data.tokenizer, c.data.eval_fraction = sources_spec, tok_path, 0.05
  c.data.update(data)
  return c


def _batches(config, n, p=0, count=1, state=None, global_states=None, split="train"):
  tok = tokenizer_lib.Tokenizer.load(config.data.tokenizer)
  it = pipeline.make_iterator(config, tok, split=split, process_index=p, process_count=count)
  try:
    if state is not None:
      it.set_state(state)
    if global_states is not None:
      it.set_global_state(global_states)
    out = [next(it) for _ in range(n)]
    return out, json.loads(json.dumps(it.get_state()))
  finally:
    it.close()


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_the_cache_holds_each_documents_ids_in_source_order(corpus):
  root, spec, tok_path, cache = corpus
  tok = tokenizer_lib.Tokenizer.load(tok_path)
  manifest = json.load(open(os.path.join(cache, "manifest.json")))
  assert [(s["name"], s["docs"], s["shards"]) for s in manifest["sources"]] == [("a", 300, 5), ("b", 152, 3)]
  assert manifest["tokenizer"]["sha256"] == pretokenize.tokenizer_fingerprint(tok_path)
  text = sources.JsonlFiles("b", f"{root}/beta/*.jsonl")
  cached = sources.TokenCache("b", os.path.join(cache, "b"))
  assert len(cached) == len(text) == 152
  for i in range(len(text)):
    want = tok.encode(text[i]) if text[i].strip() else []
    np.testing.assert_array_equal(cached[i], np.asarray(want, np.int32), err_msg=str(i))
  assert cached[21].size == 0 and cached[22].size == 0  # the unparseable line and the blank text
  specs = sources.parse_spec(f"tokens:{cache}")
  assert [(s.name, s.weight) for s in specs] == [(s.name, s.weight) for s in sources.parse_spec(spec)]


def test_batches_equal_the_text_source_step_for_step_with_resume_and_process_changes(corpus):
  _, spec, _, cache = corpus
  text_cfg, cache_cfg = _config(corpus, spec), _config(corpus, f"tokens:{cache}")
  want, _ = _batches(text_cfg, 6)
  got, _ = _batches(cache_cfg, 6)
  _assert_same(got, want)
  head, state = _batches(cache_cfg, 3)
  _assert_same(_batches(cache_cfg, 3, state=state)[0], want[3:])
  halves = [_batches(cache_cfg, 3, p, 2) for p in range(2)]
  _assert_same([{k: np.concatenate([halves[0][0][s][k], halves[1][0][s][k]]) for k in want[s]} for s in range(3)],
               want[:3])
  # 2 processes -> 1: the combined states continue the one-process order.
  _assert_same(_batches(cache_cfg, 3, global_states=[h[1] for h in halves])[0], want[3:])
  # The eval split is the text source's too.
  _assert_same(_batches(cache_cfg, 2, split="eval")[0], _batches(text_cfg, 2, split="eval")[0])


def test_each_epoch_reshuffles_the_same_way_on_every_rerun(corpus):
  _, _, _, cache = corpus
  plan = plan_lib.resolve_spec(f"b=tokens:{cache}/b")
  n = len(sources.split_indices(152, 0.0, "train"))

  def epochs():
    ds = pipeline.mixture_dataset(list(plan.specs), plan.open(), "train", 0.0, seed=3)
    return [[bytes(np.asarray(ds[e * n + i][1]).tobytes()) for i in range(n)] for e in range(2)]

  first, second = epochs()
  assert sorted(first) == sorted(second)  # every document once per epoch
  assert first != second  # in another order
  assert epochs() == [first, second]
  assert mixture_lib.MIX_BLOCK > 0


def test_a_killed_build_keeps_finished_shards_and_redoes_the_partial_one(corpus, tmp_path):
  _, spec, tok_path, cache = corpus
  out = str(tmp_path / "cache")
  pretokenize.build(spec, tok_path, out, shard_docs=64)
  a = os.path.join(out, "a")
  kept = os.stat(os.path.join(a, "shard-00000.array_record")).st_mtime_ns
  # As a kill mid-shard leaves it: no marker, a truncated temporary file, and no manifest yet.
  os.remove(os.path.join(a, "shard-00002.done"))
  os.remove(os.path.join(a, "shard-00002.array_record"))
  with open(os.path.join(a, "shard-00002.array_record.tmp-999"), "wb") as f:
    f.write(b"\x00" * 10)
  os.remove(os.path.join(out, "manifest.json"))
  with pytest.raises(sources.SpecError, match="unfinished cache"):
    sources.parse_spec(f"tokens:{out}")
  pretokenize.build(spec, tok_path, out, shard_docs=64)
  assert os.stat(os.path.join(a, "shard-00000.array_record")).st_mtime_ns == kept
  for name in ("a", "b"):
    for f in sorted(os.listdir(os.path.join(cache, name))):
      if f.endswith(".array_record"):
        with open(os.path.join(cache, name, f), "rb") as x, open(os.path.join(out, name, f), "rb") as y:
          assert x.read() == y.read(), f
  with pytest.raises(ValueError, match="shard_docs"):
    pretokenize.build(spec, tok_path, out, shard_docs=32)


@pytest.mark.slow  # spawned worker processes
def test_worker_processes_write_the_same_cache(corpus, tmp_path):
  _, spec, tok_path, cache = corpus
  out = str(tmp_path / "parallel")
  executor = executors.LocalExecutor(2)
  try:
    pretokenize.build(spec, tok_path, out, shard_docs=64, executor=executor)
  finally:
    executor.close()
  for name in ("a", "b"):
    for f in sorted(os.listdir(os.path.join(cache, name))):
      if f.endswith(".array_record"):
        with open(os.path.join(cache, name, f), "rb") as x, open(os.path.join(out, name, f), "rb") as y:
          assert x.read() == y.read(), f


def test_mismatches_are_refused_with_the_fix(corpus, tmp_path):
  root, spec, tok_path, cache = corpus
  other = tokenizer_lib.train([" ".join(WORDS[i::7]) for i in range(7)] * 20, str(tmp_path / "other.model"), VOCAB)
  c = _config(corpus, f"tokens:{cache}")
  c.data.tokenizer = other
  with pytest.raises(ValueError, match=r"another tokenizer .*other\.model"):
    _batches(c, 1)
  with pytest.raises(ValueError, match="fim_rate"):
    _batches(_config(corpus, f"tokens:{cache}", fim_rate=0.5), 1)
  with pytest.raises(ValueError, match="another sha256"):
    pretokenize.build(spec, other, cache, shard_docs=64)
  with pytest.raises(ValueError, match="chat template"):
    pretokenize.build("builtin:instruct", tok_path, str(tmp_path / "chat"))
  with pytest.raises(sources.SpecError, match="name them one by one"):
    sources.parse_spec(f"web=tokens:{cache}")
  with pytest.raises(sources.SpecError, match="no tokenized cache"):
    sources.parse_spec(f"tokens:{tmp_path}/nothing")
  assert pretokenize.main(["--tokenizer", str(tmp_path / "missing.model"), "--output", str(tmp_path / "x"),
                           "--num_workers", "1"]) == 2


def test_a_run_without_a_tokenizer_uses_the_caches(corpus, tmp_path):
  _, _, tok_path, cache = corpus
  c = _config(corpus, f"tokens:{cache}")
  c.data.tokenizer = ""
  path = tokenizer_lib.prepare(c, str(tmp_path / "run"))
  assert open(path, "rb").read() == open(tok_path, "rb").read()


@pytest.mark.slow  # a real process killed with SIGKILL mid-build, then the command run again
def test_sigkill_mid_build_then_rerun_gives_the_uninterrupted_cache(tmp_path):
  import signal
  import subprocess
  import sys
  import time
  tok = tokenizer_lib.train((sources.Builtin("p", "prose")[i] for i in range(200)), str(tmp_path / "tok.model"), 1024)
  args = ["--sources", "builtin", "--tokenizer", tok, "--shard_docs", "40", "--num_workers", "1"]
  want = str(tmp_path / "want")
  pretokenize.build("builtin", tok, want, shard_docs=40)
  out = tmp_path / "killed"
  proc = subprocess.Popen([sys.executable, "-m", "data.pretokenize", *args, "--output", str(out)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while not list(out.glob("*/shard-*.done")) and time.time() < deadline and proc.poll() is None:
    time.sleep(0.002)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  done_at_kill = len(list(out.glob("*/shard-*.done")))
  total = sum(len(list(pathlib.Path(want, name).glob("*.done"))) for name in ("prose", "code"))
  assert 0 < done_at_kill < total and not (out / "manifest.json").exists(), (done_at_kill, total)
  assert pretokenize.main([*args, "--output", str(out)]) == 0
  for name in ("prose", "code"):
    for shard in sorted(pathlib.Path(want, name).glob("*.array_record")):
      assert (out / name / shard.name).read_bytes() == shard.read_bytes(), shard.name
