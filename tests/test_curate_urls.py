"""The URL filter (data/curate/urls.py, curation stage 0): blocklisted domains and their subdomains, listed URLs,
banned and soft-banned URL words and non-web schemes are dropped and counted; documents without a URL pass."""
import json

import pytest

import curate_corpus
from data.curate import pipeline
from data.curate import urls


@pytest.fixture
def blocklist(tmp_path):
  path = tmp_path / "blocked.txt"
  path.write_text("# UT1-style list\nbad.example\nads.tracker.net  # a comment\nhttp://ok.example/private/page\n")
  return str(path)


def test_rules(blocklist):
  f = urls.UrlFilter(blocklist, banned_words=("casino",), soft_words=("free", "win", "prize"), max_soft_words=2)
  assert f.reason("https://bad.example/a") == "blocklist"
  assert f.reason("http://www.BAD.example./x?y=1") == "blocklist"  # subdomain, case, trailing dot
  assert f.reason("https://notbad.example/a") == ""  # a suffix of the name is not a subdomain
  assert f.reason("https://ads.tracker.net/") == "blocklist" and f.reason("https://tracker.net/") == ""
  assert f.reason("http://ok.example/private/page/") == "blocklist" and f.reason("http://ok.example/public") == ""
  assert f.reason("https://site.org/best-casino-2024") == "banned_word"
  assert f.reason("https://site.org/casinos") == ""  # words, not substrings
  assert f.reason("https://site.org/free/win") == "" and f.reason("https://site.org/free-win-prize") == "soft_words"
  assert f.reason("ftp://files.org/a") == "scheme"


def test_the_stage_drops_and_counts_by_reason(tmp_path, blocklist):
  words = "the river town market winter garden old bridge quiet morning rain bakery bread window street".split()
  docs = []
  for i, url in enumerate(["https://a.org/1", "https://www.bad.example/2", "https://b.org/casino", "", None,
                           "https://c.org/3"]):
    doc = {"id": f"d{i}", "text": " ".join(words[(i + j) % len(words)] for j in range(60)) + f" number {i}."}
    if url is not None:
      doc["url"] = url
    docs.append(doc)
  with open(tmp_path / "in.jsonl", "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in docs)
  cfg = curate_corpus.curate_input_config(tmp_path / "in.jsonl", tmp_path / "out", langid__enabled=False,
                                          quality__enabled=False, perplexity__enabled=False, minhash__enabled=False,
                                          dedup__min_length=0, url_filter__enabled=True, url_filter__blocklist=blocklist,
                                          url_filter__banned_words=("casino",))
  stats = pipeline.run(cfg)
  out = [r["id"] for r in curate_corpus.output_records(cfg.output)]
  assert sorted(out) == ["d0", "d3", "d4", "d5"]
  stage = next(s for s in stats["stages"] if s["stage"] == "url_filter")
  assert (stage["docs_in"], stage["docs_out"]) == (6, 4)
  assert stats["url_filter_reasons"] == {"banned_word": 1, "blocklist": 1}
  cfg.output, cfg.url_filter.blocklist = str(tmp_path / "out2"), str(tmp_path / "missing.txt")
  with pytest.raises(FileNotFoundError, match="url_filter.blocklist"):
    pipeline.run(cfg)
