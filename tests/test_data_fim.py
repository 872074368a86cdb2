"""Fill-in-the-middle: round trip to the original text, rate and PSM/SPM proportions, the pipeline's FIM
documents, exact resume, and the infilling prompt."""

import numpy as np
import pytest

from configs import tiny
from data import fim
from data import pipeline

import word_corpus

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return word_corpus.make(tmp_path_factory.mktemp("fim"))


def test_transformed_documents_round_trip_to_the_original_text(corpus):
  _, docs, tok = corpus
  pre, mid, suf = fim.sentinels(tok)
  seen = set()
  for i, text in enumerate(docs[:300]):
    p = fim.plan(7, i, len(text), 1.0, 0.5)
    ids = fim.encode(tok, text, p)
    assert fim.restore(tok, ids) == text
    # The layout, against the text's own slices.
    prefix, middle, suffix = text[:p.cut1], text[p.cut1:p.cut2], text[p.cut2:]
    if p.spm:
      assert ids[:2] == [pre, suf] and tok.decode(ids[2:ids.index(mid)]) == suffix
      assert tok.decode(ids[ids.index(mid) + 1:]) == prefix + middle
    else:
      assert ids[0] == pre and tok.decode(ids[1:ids.index(suf)]) == prefix
      assert tok.decode(ids[ids.index(suf) + 1:ids.index(mid)]) == suffix
      assert tok.decode(ids[ids.index(mid) + 1:]) == middle
    assert ids.count(pre) == ids.count(mid) == ids.count(suf) == 1
    seen.add(p.spm)
  assert seen == {True, False}


def test_rate_and_spm_share_within_one_percent_over_10k_documents():
  for rate, spm_rate in ((0.5, 0.5), (0.9, 0.2)):
    plans = [fim.plan(3, i, 1000, rate, spm_rate) for i in range(10_000)]
    done = [p for p in plans if p is not None]
    assert abs(len(done) / 10_000 - rate) < 0.01
    assert abs(sum(p.spm for p in done) / len(done) - spm_rate) < 0.01
    cuts = np.array([(p.cut1, p.cut2) for p in done])
    assert (cuts[:, 0] <= cuts[:, 1]).all() and cuts.min() >= 0 and cuts.max() <= 1000
  assert fim.plan(3, 5, 100, 0.5, 0.5) == fim.plan(3, 5, 100, 0.5, 0.5)  # a function of (seed, index)
  assert all(fim.plan(3, i, 100, 0.0, 0.5) is None for i in range(100))


def test_token_level_split_round_trips_and_cuts_the_documents_own_tokens(corpus):
  _, docs, tok = corpus
  pre, mid, suf = fim.sentinels(tok)
  seen, cuts = set(), []
  for i, text in enumerate(docs[:300]):
    p = fim.plan(7, i, len(text), 1.0, 0.5, level="token")
    ids = fim.encode(tok, text, p)
    assert fim.restore(tok, ids) == text
    whole = tok.encode(text)
    c1, c2 = p.cuts(len(whole))
    prefix, middle, suffix = whole[:c1], whole[c1:c2], whole[c2:]  # slices of the whole document's tokens
    want = [pre, suf] + suffix + [mid] + prefix + middle if p.spm else \
        [pre] + prefix + [suf] + suffix + [mid] + middle
    assert ids == want and 0 <= c1 <= c2 <= len(whole)
    seen.add(p.spm)
    cuts.append(c1 / len(whole))
  assert seen == {True, False}
  assert 0.2 < np.mean(cuts) < 0.45  # the smaller of two uniform cuts: mean 1/3


def test_token_level_rate_spm_share_and_cut_uniformity_over_10k_documents():
  rate, spm_rate, n = 0.5, 0.3, 20
  plans = [fim.plan(3, i, 0, rate, spm_rate, level="token") for i in range(10_000)]
  done = [p for p in plans if p is not None]
  assert abs(len(done) / 10_000 - rate) < 0.01
  assert abs(sum(p.spm for p in done) / len(done) - spm_rate) < 0.01
  # Each cut is uniform over the n + 1 token boundaries: the (unsorted) pair of cuts hits every boundary
  # with frequency 1 / (n + 1) within 1%.
  both = np.array([p.cuts(n) for p in done]).reshape(-1)
  np.testing.assert_allclose(np.bincount(both, minlength=n + 1) / len(both), 1 / (n + 1), atol=0.01)
  with pytest.raises(ValueError, match="fim_level"):
    fim.plan(3, 0, 10, 0.5, 0.5, level="word")


def _config(corpus, **data):
  root, _, tok = corpus
  c = tiny.get_config()
  c.model.vocab_size = 384
  c.train.update(batch_size=4, seq_len=128)
  c.data.update(sources=f"jsonl:{root}/docs.jsonl", tokenizer=tok.path, eval_fraction=0.05, fim_rate=0.5,
                fim_spm_rate=0.5, prefetch=0)
  c.data.update(data)
  return c


def _documents(batches, tok):
  """Complete documents (BOS ... EOS inside one segment) of the batches as token ids without BOS/EOS."""
  out = []
  for b in batches:
    for r in range(b["inputs"].shape[0]):
      for s in set(b["segment_ids"][r].tolist()) - {0}:
        inputs, targets = b["inputs"][r][b["segment_ids"][r] == s], b["targets"][r][b["segment_ids"][r] == s]
        if inputs[0] == tok.bos_id and targets[-1] == tok.eos_id:
          out.append(inputs[1:].tolist())
  return out


def test_pipeline_transforms_documents_before_packing_and_resumes_exactly(corpus):
  _, docs, tok = corpus
  config = _config(corpus)
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  batches = [next(it) for _ in range(12)]
  state = it.get_state()
  after = [next(it) for _ in range(3)]
  pre = fim.sentinels(tok)[0]
  documents = _documents(batches, tok)
  transformed = [d for d in documents if d[0] == pre]
  assert 0.3 < len(transformed) / len(documents) < 0.7 and len(documents) > 100
  texts = set(docs)
  assert all(fim.restore(tok, d) in texts for d in transformed)
  assert all(tok.decode(d) in texts for d in documents if d[0] != pre)
  resumed = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  resumed.set_state(state)
  for a, b in zip(after, [next(resumed) for _ in range(3)]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  evaluation = pipeline.make_iterator(config, tok, split="eval", process_index=0, process_count=1)
  assert not np.isin(np.asarray(fim.sentinels(tok)), next(evaluation)["inputs"]).any()


def test_pipeline_token_level_documents_restore_to_corpus_texts(corpus):
  _, docs, tok = corpus
  it = pipeline.make_iterator(_config(corpus, fim_level="token"), tok, process_index=0, process_count=1)
  documents = _documents([next(it) for _ in range(4)], tok)
  pre = fim.sentinels(tok)[0]
  transformed = [d for d in documents if d[0] == pre]
  assert len(transformed) > 10 and all(fim.restore(tok, d) in set(docs) for d in transformed)


def test_state_of_a_run_without_fim_is_refused_by_one_with_fim(corpus):
  _, _, tok = corpus
  it = pipeline.make_iterator(_config(corpus, fim_rate=0.0), tok, process_index=0, process_count=1)
  next(it)
  other = pipeline.make_iterator(_config(corpus, fim_rate=0.3), tok, process_index=0, process_count=1)
  with pytest.raises(ValueError, match="fim"):
    other.set_state(it.get_state())


def test_infill_prompt_is_the_transformed_document_up_to_the_middle(corpus):
  _, docs, tok = corpus
  text = docs[0]
  for spm in (False, True):
    p = fim.Plan(5, 17, spm)
    ids = fim.encode(tok, text, p)
    prompt = fim.infill_prompt(tok, text[:5], text[17:], spm=spm)
    if spm:  # SPM: the prompt ends with the prefix, the middle continues it
      assert ids[:len(prompt)] == prompt
    else:
      assert ids[:len(prompt)] == prompt and tok.decode(ids[len(prompt):]) == text[5:17]
