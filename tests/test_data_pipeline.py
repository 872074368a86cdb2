"""The grain pipeline: determinism, exact resume (thread and worker prefetch, orbax), per-process slicing,
packing invariants against a brute-force tokenization, mixture frequencies, the eval split, layout refusal."""
import collections
import json
import os

import numpy as np
import pytest
import sentencepiece as spm

from configs import tiny
from data import pipeline
from data import sources
from data import tokenizer as tokenizer_lib

SEQ_LEN = 64
VOCAB = 512
WORDS = ("the quick brown fox jumps over lazy dog data model train token batch shard mesh grain pack "
         "segment loss mask python code prose river stone cloud light night day").split()


def _doc(rng, prefix, i, long=False):
  n = 400 if long else int(rng.integers(5, 60))
  return f"{prefix}{i:05d} " + " ".join(rng.choice(WORDS, n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Two JSONL sources whose documents carry unique ids ('alpha00012', 'beta00007'), some longer than a row."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  docs = {}
  for name, n_docs, n_files in (("alpha", 600, 2), ("beta", 300, 1)):
    os.makedirs(root / name)
    texts = [_doc(rng, name, i, long=(i % 50 == 7)) for i in range(n_docs)]
    docs[name] = texts
    for f in range(n_files):
      with open(root / name / f"part{f}.jsonl", "w") as out:
        for t in texts[f::n_files]:
          out.write(json.dumps({"text": t}) + "\n")
  tok_path = tokenizer_lib.train(docs["alpha"] + docs["beta"], str(root / "tok.model"), VOCAB)
  return root, docs, tok_path


def _config(corpus, **data):
  root, _, tok_path = corpus
  c = tiny.get_config()
  c.model.vocab_size = VOCAB
  c.train.batch_size = 4
  c.train.seq_len = SEQ_LEN
  c.data.sources = f"a=jsonl:{root}/alpha/*.jsonl@0.7,b=jsonl:{root}/beta/*.jsonl@0.3"
  c.data.tokenizer = tok_path
  c.data.eval_fraction = 0.05
  c.data.update(data)
  return c


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert sorted(a) == sorted(pipeline.BATCH_KEYS)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _iterator(config, tok, p=0, n=1, split="train"):
  return pipeline.make_iterator(config, tok, split=split, process_index=p, process_count=n)


@pytest.fixture(scope="module")
def tok(corpus):
  return tokenizer_lib.Tokenizer.load(corpus[2])


@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_same_seed_same_batches_and_resume_is_exact(corpus, tok, packing):
  c = _config(corpus, packing=packing)
  first = _iterator(c, tok)
  head = _take(first, 3)
  state = json.loads(json.dumps(first.get_state()))  # as it travels through a checkpoint
  tail = _take(first, 3)
  again = _iterator(c, tok)
  _assert_same(_take(again, 6), head + tail)
  resumed = _iterator(c, tok)
  resumed.set_state(state)
  _assert_same(_take(resumed, 3), tail)
  c2 = _config(corpus, packing=packing, shuffle_seed=1)
  other = _take(_iterator(c2, tok), 1)[0]
  assert not np.array_equal(other["inputs"], head[0]["inputs"]), "the shuffle seed must change the order"
  for it in (first, again, resumed):
    it.close()


def test_resume_through_orbax_checkpoint(corpus, tok, tmp_path):
  import orbax.checkpoint as ocp
  from data import checkpoint as data_checkpoint
  c = _config(corpus)
  it = _iterator(c, tok)
  _take(it, 2)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
                             ) as mngr:
    mngr.save(2, args=ocp.args.Composite(data=data_checkpoint.IteratorSave(it)))
    expected = _take(it, 2)
    fresh = _iterator(c, tok)
    mngr.restore(2, args=ocp.args.Composite(data=data_checkpoint.IteratorRestore(fresh)))
  _assert_same(_take(fresh, 2), expected)
  it.close()
  fresh.close()


@pytest.mark.slow  # grain worker processes
def test_resume_is_exact_with_worker_processes(corpus, tok):
  c = _config(corpus, worker_count=2)
  c.train.batch_size = 2
  it = _iterator(c, tok)
  try:
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 2)
  finally:
    it.close()
  resumed = _iterator(c, tok)
  try:
    resumed.set_state(state)
    _assert_same(_take(resumed, 2), expected)
  finally:
    resumed.close()


def _doc_ids(batch, tok):
  """Ids ('alpha00012') of the documents that start (BOS) in a batch."""
  ids = []
  for row_in, row_seg in zip(batch["inputs"], batch["segment_ids"]):
    for s in np.unique(row_seg[row_seg > 0]):
      seg = row_in[row_seg == s]
      if seg[0] == tok.bos_id:
        ids.append(tok.decode(seg[1:]).split(" ")[0])
  return ids


def test_two_processes_are_disjoint_slices_of_the_one_process_order(corpus, tok):
  c = _config(corpus)
  whole = _take(_iterator(c, tok), 5)
  halves = [_take(_iterator(c, tok, p, 2), 5) for p in range(2)]
  for step, batch in enumerate(whole):
    for k in batch:
      assert halves[0][step][k].shape == (2, SEQ_LEN)
      np.testing.assert_array_equal(np.concatenate([halves[0][step][k], halves[1][step][k]]), batch[k])
  ids = [[i for b in h for i in _doc_ids(b, tok)] for h in halves]
  assert ids[0] and ids[1]
  assert not set(ids[0]) & set(ids[1]), "the processes read the same document"
  with pytest.raises(ValueError, match="not divisible by the 3 processes"):
    _iterator(c, tok, 0, 3)


def _reference_pieces(docs, tok_path):
  """Brute force: every document tokenized on its own by sentencepiece, as (BOS+ids, ids+EOS), indexed by
  their first 1-4 tokens at every offset."""
  sp = spm.SentencePieceProcessor(model_file=tok_path)
  index = collections.defaultdict(list)
  for text in docs:
    ids = sp.encode(text)
    full_in = np.array([sp.bos_id()] + ids)
    full_tgt = np.array(ids + [sp.eos_id()])
    for o in range(len(full_in)):
      for k in range(1, 5):  # pieces shorter than 4 tokens (a row's last) look up their own length
        index[tuple(full_in[o:o + k])].append((full_in, full_tgt, o))
  return index


@pytest.mark.parametrize("packing", ["first_fit", "concat"])
def test_packing_invariants_against_brute_force_tokenization(corpus, tok, packing):
  _, docs, tok_path = corpus
  index = _reference_pieces(docs["alpha"] + docs["beta"], tok_path)
  it = _iterator(_config(corpus, packing=packing), tok)
  batches = _take(it, 8)
  it.close()
  n_segments = n_split = 0
  for b in batches:
    assert b["inputs"].dtype == b["targets"].dtype == b["segment_ids"].dtype == b["positions"].dtype == np.int32
    assert b["loss_mask"].dtype == np.float32
    for inp, tgt, seg, pos, mask in zip(b["inputs"], b["targets"], b["segment_ids"], b["positions"],
                                        b["loss_mask"]):
      np.testing.assert_array_equal(mask, (seg > 0).astype(np.float32))  # the loss mask excludes padding
      assert np.all(inp[seg == 0] == tok.pad_id) and np.all(tgt[seg == 0] == tok.pad_id)
      real = seg[seg > 0]
      # Segments never overlap: ids 1, 2, ... in contiguous runs, padding only after the last one.
      assert np.all(seg[:len(real)] > 0), "padding before a segment"
      runs = [int(s) for i, s in enumerate(real) if i == 0 or s != real[i - 1]]
      assert runs == list(range(1, len(runs) + 1)), f"segment ids {runs} are not contiguous runs 1..k"
      for s in runs:
        where = seg == s
        n_segments += 1
        np.testing.assert_array_equal(pos[where], np.arange(where.sum()))  # positions restart per document
        piece_in, piece_tgt = inp[where], tgt[where]
        matches = [(o, full_tgt) for full_in, full_tgt, o in index[tuple(piece_in[:4])]
                   if np.array_equal(full_in[o:o + len(piece_in)], piece_in)]
        assert matches, "a packed segment is not a contiguous piece of any tokenized document"
        # Targets are the next token of the same document (EOS after its last token).
        assert any(np.array_equal(full_tgt[o:o + len(piece_tgt)], piece_tgt) for o, full_tgt in matches)
        if piece_in[0] != tok.bos_id:
          n_split += 1
          if packing == "first_fit":  # long documents are cut into whole rows
            assert any(o % SEQ_LEN == 0 for o, _ in matches)
  assert n_segments > 20 and n_split > 0


def test_mixture_frequencies_within_one_percent_over_10k_documents():
  weights = {"a": 0.6, "b": 0.3, "c": 0.1}
  specs = [sources.SourceSpec(n, "text", n, w) for n, w in weights.items()]
  srcs = [[f"{n}{i}" for i in range(97 + 31 * k)] for k, n in enumerate(weights)]
  mixture = pipeline.mixture_dataset(specs, srcs, "train", 0.0, seed=3)
  counts = collections.Counter(mixture[j][1][0] for j in range(10_000))
  for name, w in weights.items():
    assert abs(counts[name] / 10_000 - w) < 0.01, (name, counts)
  # Each source is shuffled and fully covered in every epoch: the first 97 'a' documents are a permutation.
  a_docs = [mixture[j][1] for j in range(2000) if mixture[j][0] == 0][:97]
  assert sorted(a_docs) == sorted(srcs[0]) and a_docs != srcs[0]


def test_stats_report_the_realised_mixture_and_packing_efficiency(corpus, tok):
  it = _iterator(_config(corpus), tok)
  batches = _take(it, 6)
  st = it.stats()
  it.close()
  mask = np.concatenate([b["loss_mask"] for b in batches])
  assert st["data/packing_efficiency"] == pytest.approx(mask.mean())
  ids = [i for b in batches for i in _doc_ids(b, tok)]
  assert st["data/mixture_docs/a"] == pytest.approx(sum(i.startswith("alpha") for i in ids) / len(ids))
  assert st["data/mixture_docs/b"] == pytest.approx(sum(i.startswith("beta") for i in ids) / len(ids))
  assert st["data/mixture_tokens/a"] + st["data/mixture_tokens/b"] == pytest.approx(1.0)


def test_eval_split_is_held_out_and_repeatable(corpus, tok):
  c = _config(corpus)
  eval_a = _take(_iterator(c, tok, split="eval"), 3)
  eval_b = _take(_iterator(c, tok, split="eval"), 3)
  _assert_same(eval_a, eval_b)
  # The eval order does not follow the training shuffle seed: runs with different seeds evaluate alike.
  _assert_same(_take(_iterator(_config(corpus, shuffle_seed=5), tok, split="eval"), 3), eval_a)
  eval_ids = {i for b in eval_a for i in _doc_ids(b, tok)}
  train_ids = {i for b in _take(_iterator(c, tok), 20) for i in _doc_ids(b, tok)}
  assert eval_ids and not eval_ids & train_ids
  # Source index i is line i of part0 then part1; part f holds the documents f, f+2, f+4, ...
  held_out = {f"alpha{2 * i if i < 300 else 2 * (i - 300) + 1:05d}" for i in sources.split_indices(600, 0.05, "eval")}
  assert {i for i in eval_ids if i.startswith("alpha")} <= held_out


def test_changed_process_count_on_resume_continues_exactly(corpus, tok, tmp_path):
  c = _config(corpus)
  single = _iterator(c, tok)
  _take(single, 3)
  single_state = single.get_state()
  expected = _take(single, 2)  # the 1-process continuation after 3 batches
  pair = [_iterator(c, tok, p, 2) for p in range(2)]
  for it in pair:
    _take(it, 3)
  pair_states = [it.get_state() for it in pair]
  # A lone process's state cannot be applied to another layout...
  one = _iterator(c, tok)
  with pytest.raises(ValueError, match=r"saved by a run with 2 processes, but this run has 1.*IteratorRestore"):
    one.set_state(pair_states[0])
  # ...but the checkpoint of all processes can: 2 -> 1 through orbax's handler (files process_<i>-of-2.json).
  from etils import epath
  from data import checkpoint as data_checkpoint
  for p, st in enumerate(pair_states):
    (tmp_path / f"process_{p}-of-2.json").write_text(json.dumps(st))
  data_checkpoint.IteratorHandler().restore(epath.Path(tmp_path), item=one)
  _assert_same(_take(one, 2), expected)
  # 1 -> 2: each new process takes its rows from the single state.
  halves = [_iterator(c, tok, p, 2) for p in range(2)]
  for h in halves:
    h.set_global_state([json.loads(json.dumps(single_state))])
  got = [_take(h, 2) for h in halves]
  for step in range(2):
    _assert_same([{k: np.concatenate([got[0][step][k], got[1][step][k]]) for k in expected[step]}],
                 [expected[step]])
  # A changed batch size cannot be re-divided: refused, naming both values.
  c8 = _config(corpus)
  c8.train.batch_size = 8
  with pytest.raises(ValueError, match=r"batch_size=4 but this run has batch_size=8"):
    _iterator(c8, tok).set_global_state([single_state])
  for it in [single, one, *pair, *halves]:
    it.close()


def test_vocab_mismatch_is_refused(corpus, tok):
  c = _config(corpus)
  c.model.vocab_size = 1024
  with pytest.raises(ValueError, match="config.model.vocab_size=512"):
    _iterator(c, tok)
