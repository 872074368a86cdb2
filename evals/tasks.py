"""Evaluation tasks read from files (nothing downloads): meshlm's JSONL formats and readers for official files.

A task spec is `NAME:PATH`. Names and what PATH holds:
  mc          JSONL, one {"context": str, "choices": [str, ...], "label": int} per line (multiple choice)
  ppl         JSONL, one {"text": str} per line (rolling log-likelihood: word/byte perplexity, bits per byte)
  gen         JSONL, one {"context": str, "answer": str[, "until": [str], "max_tokens": int]} per line
  piqa        directory with valid.jsonl + valid-labels.lst (train.jsonl + train-labels.lst for few-shot)
  hellaswag   JSONL as published (ctx_a, ctx_b, activity_label, endings, label)
  arc         JSONL as published (question.stem, question.choices[{text, label}], answerKey) or flattened
  lambada     JSONL, one {"text"} per line (last word predicted from the rest)
  crows_pairs crows_pairs_anonymized.csv
  winogender  all_sentences.tsv
  bbq         one BBQ category .jsonl, or a directory of them
  toxicity    JSONL of prompts: {"prompt": {"text": ...}} (RealToxicityPrompts) or {"prompt": str} / {"text": str}
  passkey     JSONL of gen records with "length" and "depth" (python -m evals.long_context passkey): exact match
              overall, per length and per (length, depth)
  position_ppl JSONL, one {"text"} per line: mean NLL and perplexity of the tokens at positions [0, 128),
              [128, 256), [256, 512), ... of each document's first max_len tokens (evals/long_context.py)
Prompts are lm-eval's templates for the tasks of the same name. Every malformed record raises TaskError naming
the file and line.
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import json
import os
import re
from typing import Any, Callable, Iterator, Sequence

from evals import bias

MULTIPLE_CHOICE, LOGLIKELIHOOD, ROLLING, GENERATE = "multiple_choice", "loglikelihood", "rolling", "generate"
POSITIONS = "positions"  # per-token log-likelihoods of each document's first max_len tokens


class TaskError(ValueError):
  """A bad task spec or task file; the message names the file (and line) and the fix."""


@dataclasses.dataclass
class Doc:
  """One evaluation document.

  prompt: the context (lm-eval's doc_to_text); choices/gold for multiple choice; target: the text scored
  (loglikelihood), expected (generation) or shown after the prompt in few-shot examples; text: the document of
  a perplexity task; meta: task-specific fields (category, gender, BBQ answer groups, ...).
  """
  prompt: str = ""
  choices: list[str] = dataclasses.field(default_factory=list)
  gold: Any = 0
  target: str = ""
  text: str = ""
  until: list[str] = dataclasses.field(default_factory=list)
  max_tokens: int = 0
  meta: dict = dataclasses.field(default_factory=dict)
  where: str = ""  # "file:line", for messages


@dataclasses.dataclass
class Task:
  """A loaded task: its docs, request type, delimiters and the aggregation of per-document results."""
  name: str
  path: str
  kind: str
  docs: list[Doc]
  aggregate: Callable[[list[Doc], list[Any]], dict[str, float]]
  target_delimiter: str = " "
  fewshot_delimiter: str = "\n\n"
  fewshot_docs: list[Doc] | None = None  # a separate split for few-shot examples (else: the same docs)


# ---- file helpers ---------------------------------------------------------------------------------------------
def _check_file(path: str, what: str) -> None:
  if not os.path.exists(path):
    raise TaskError(f"{path}: no such file ({what})")
  if not os.path.isfile(path):
    raise TaskError(f"{path}: is not a file ({what})")


def _jsonl(path: str, what: str) -> Iterator[tuple[int, dict]]:
  _check_file(path, what)
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
      if not isinstance(record, dict):
        raise TaskError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
      yield lineno, record


def _field(record: dict, key: str, where: str, kind: type | tuple = str):
  if key not in record:
    raise TaskError(f"{where}: record has no {key!r} field (fields: {', '.join(sorted(record)) or 'none'})")
  value = record[key]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
    raise TaskError(f"{where}: field {key!r} must be {want}, got {value!r}")
  return value


def _label(value, n: int, where: str, key: str = "label") -> int:
  try:
    label = int(value)
  except (TypeError, ValueError):
    raise TaskError(f"{where}: {key} {value!r} is not an integer") from None
  if not 0 <= label < n:
    raise TaskError(f"{where}: {key} {label} is out of range for {n} choices (0..{n - 1})")
  return label


def _nonempty(docs: list[Doc], path: str) -> list[Doc]:
  if not docs:
    raise TaskError(f"{path}: no records; the task is empty")
  return docs


# ---- aggregations ---------------------------------------------------------------------------------------------
def _mc_aggregate(docs, results):
  from evals import metrics  # pylint: disable=g-import-not-at-top
  per = [metrics.multiple_choice([ll for ll, _ in r], d.choices, d.gold) for d, r in zip(docs, results)]
  out = {}
  for key in ("acc", "acc_norm", "acc_bytes"):
    out.update(metrics.mean_with_stderr(key, [p[key] for p in per]))
  return out


def _rolling_aggregate(docs, results):
  from evals import metrics  # pylint: disable=g-import-not-at-top
  return metrics.rolling_metrics(results, [d.text for d in docs])


def _gen_aggregate(docs, results):
  from evals import metrics  # pylint: disable=g-import-not-at-top
  return metrics.mean_with_stderr("exact_match", [metrics.exact_match(r, d.target) for d, r in zip(docs, results)])


def _lambada_aggregate(docs, results):
  from evals import metrics  # pylint: disable=g-import-not-at-top
  lls = [ll for ll, _ in results]
  out = {"perplexity": metrics.perplexity(lls), "perplexity_stderr": metrics.bootstrap_stderr(metrics.perplexity,
                                                                                                [lls])}
  out.update(metrics.mean_with_stderr("acc", [float(g) for _, g in results]))
  return out


def _crows_aggregate(docs, results):
  return bias.crows_pairs([r[0][0] for r in results], [r[1][0] for r in results],
                          [d.meta["category"] for d in docs])


def _winogender_aggregate(docs, results):
  from evals import metrics  # pylint: disable=g-import-not-at-top
  correct = [metrics.multiple_choice([ll for ll, _ in r], d.choices, d.gold)["acc"] for d, r in zip(docs, results)]
  return bias.winogender(correct, [d.meta["gender"] for d in docs])


def _bbq_aggregate(docs, results):
  import numpy as np  # pylint: disable=g-import-not-at-top
  preds = [int(np.argmax([ll for ll, _ in r])) for r in results]
  return bias.bbq(preds, [d.meta for d in docs])


# ---- readers --------------------------------------------------------------------------------------------------
def _read_mc(path):
  docs = []
  for lineno, r in _jsonl(path, "mc task: JSONL of {context, choices, label}"):
    where = f"{path}:{lineno}"
    context = _field(r, "context", where)
    choices = _field(r, "choices", where, list)
    if len(choices) < 2 or not all(isinstance(c, str) for c in choices):
      raise TaskError(f"{where}: 'choices' must be a list of at least two strings")
    docs.append(Doc(prompt=context, choices=choices, gold=_label(_field(r, "label", where, (int, str)),
                                                                  len(choices), where), where=where))
  return Task("mc", path, MULTIPLE_CHOICE, _nonempty(docs, path), _mc_aggregate)


def _read_ppl(path):
  docs = [Doc(text=_field(r, "text", f"{path}:{n}"), where=f"{path}:{n}")
          for n, r in _jsonl(path, "ppl task: JSONL of {text}")]
  return Task("ppl", path, ROLLING, _nonempty(docs, path), _rolling_aggregate)


def _read_gen(path):
  docs = []
  for lineno, r in _jsonl(path, "gen task: JSONL of {context, answer}"):
    where = f"{path}:{lineno}"
    until = r.get("until", [])
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
      raise TaskError(f"{where}: 'until' must be a list of strings")
    max_tokens = r.get("max_tokens", 64)
    if not isinstance(max_tokens, int) or max_tokens < 1:
      raise TaskError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    docs.append(Doc(prompt=_field(r, "context", where), target=_field(r, "answer", where), until=until,
                    max_tokens=max_tokens, where=where))
  return Task("gen", path, GENERATE, _nonempty(docs, path), _gen_aggregate)


def _piqa_split(directory, split):
  data, labels = os.path.join(directory, f"{split}.jsonl"), os.path.join(directory, f"{split}-labels.lst")
  _check_file(labels, f"PIQA labels for {split}.jsonl, one 0/1 per line")
  with open(labels) as f:
    golds = [line.strip() for line in f if line.strip()]
  docs = []
  for i, (lineno, r) in enumerate(_jsonl(data, "PIQA questions")):
    where = f"{data}:{lineno}"
    if i >= len(golds):
      raise TaskError(f"{where}: no label: {labels} has only {len(golds)} lines")
    sols = [_field(r, "sol1", where), _field(r, "sol2", where)]
    docs.append(Doc(prompt=f"Question: {_field(r, 'goal', where)}\nAnswer:", choices=sols,
                    gold=_label(golds[i], 2, f"{labels}:{i + 1}"), where=where))
  if len(golds) != len(docs):
    raise TaskError(f"{labels}: {len(golds)} labels for {len(docs)} questions in {data}")
  return _nonempty(docs, data)


def _read_piqa(path):
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  split = "valid" if os.path.isdir(path) else os.path.basename(path).rsplit(".", 1)[0]
  docs = _piqa_split(directory, split)
  train = os.path.join(directory, "train.jsonl")
  fewshot = _piqa_split(directory, "train") if split != "train" and os.path.isfile(train) else None
  return Task("piqa", path, MULTIPLE_CHOICE, docs, _mc_aggregate, fewshot_docs=fewshot)


def _hellaswag_clean(text: str) -> str:
  """lm-eval's hellaswag preprocess: strip, ' [title]' -> '. ', drop [bracketed] artefacts, fold double spaces."""
  text = text.strip().replace(" [title]", ". ")
  text = re.sub("\\[.*?\\]", "", text)
  return text.replace("  ", " ")


def _read_hellaswag(path):
  docs = []
  for lineno, r in _jsonl(path, "HellaSwag JSONL"):
    where = f"{path}:{lineno}"
    ctx = _field(r, "ctx_a", where) + " " + _field(r, "ctx_b", where).capitalize()
    endings = _field(r, "endings", where, list)
    docs.append(Doc(prompt=_hellaswag_clean(_field(r, "activity_label", where) + ": " + ctx),
                    choices=[_hellaswag_clean(e) for e in endings],
                    gold=_label(_field(r, "label", where, (int, str)), len(endings), where), where=where))
  return Task("hellaswag", path, MULTIPLE_CHOICE, _nonempty(docs, path), _mc_aggregate)


def _read_arc(path):
  docs = []
  for lineno, r in _jsonl(path, "ARC JSONL"):
    where = f"{path}:{lineno}"
    q = _field(r, "question", where, (str, dict))
    if isinstance(q, dict):  # published layout
      stem = _field(q, "stem", where)
      options = _field(q, "choices", where, list)
      texts, labels = [c.get("text", "") for c in options], [c.get("label") for c in options]
    else:  # flattened (Hugging Face) layout
      choices = _field(r, "choices", where, dict)
      stem, texts, labels = q, list(choices.get("text", [])), list(choices.get("label", []))
    key = _field(r, "answerKey", where)
    if key not in labels:
      raise TaskError(f"{where}: answerKey {key!r} is not one of the choice labels {labels}")
    docs.append(Doc(prompt=f"Question: {stem}\nAnswer:", choices=texts, gold=labels.index(key), where=where))
  return Task("arc", path, MULTIPLE_CHOICE, _nonempty(docs, path), _mc_aggregate)


def _read_lambada(path):
  docs = []
  for lineno, r in _jsonl(path, "LAMBADA JSONL of {text}"):
    where = f"{path}:{lineno}"
    words = _field(r, "text", where).split(" ")
    if len(words) < 2:
      raise TaskError(f"{where}: text needs at least two words (the last one is predicted)")
    docs.append(Doc(prompt=" ".join(words[:-1]), target=" " + words[-1], where=where))
  return Task("lambada", path, LOGLIKELIHOOD, _nonempty(docs, path), _lambada_aggregate, target_delimiter="")


def _read_crows_pairs(path):
  _check_file(path, "CrowS-Pairs CSV (crows_pairs_anonymized.csv)")
  docs = []
  with open(path, newline="", encoding="utf-8") as f:
    reader = csv.DictReader(f)
    missing = {"sent_more", "sent_less", "bias_type"} - set(reader.fieldnames or ())
    if missing:
      raise TaskError(f"{path}:1: CSV header lacks {', '.join(sorted(missing))}")
    for r in reader:
      where = f"{path}:{reader.line_num}"
      if not r["sent_more"] or not r["sent_less"] or not r["bias_type"]:
        raise TaskError(f"{where}: empty sent_more, sent_less or bias_type")
      docs.append(Doc(choices=[r["sent_more"], r["sent_less"]], gold=0, meta={"category": r["bias_type"]},
                      where=where))
  return Task("crows_pairs", path, MULTIPLE_CHOICE, _nonempty(docs, path), _crows_aggregate, target_delimiter="")


_PRONOUNS = {"male": ("he", "his", "him"), "female": ("she", "her"), "neutral": ("they", "their", "them")}


def _read_winogender(path):
  _check_file(path, "WinoGender all_sentences.tsv")
  docs = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if lineno == 1 or not line.strip():
        continue
      where = f"{path}:{lineno}"
      parts = line.rstrip("\n").split("\t")
      if len(parts) != 2:
        raise TaskError(f"{where}: expected 'sentid<TAB>sentence'")
      sentid, sentence = parts
      fields = sentid.split(".")
      if len(fields) != 5 or fields[3] not in _PRONOUNS:
        raise TaskError(f"{where}: sentid {sentid!r} is not occupation.participant.answer.gender.txt")
      occupation, participant, answer, gender = fields[:4]
      words = re.findall(r"[A-Za-z]+", sentence)
      pronoun = next((w for w in words if w.lower() in _PRONOUNS[gender]), None)
      if pronoun is None:
        raise TaskError(f"{where}: no {gender} pronoun in the sentence")
      docs.append(Doc(prompt=f"{sentence} \u2018{pronoun.capitalize()}\u2019 refers to the",
                      choices=[occupation, participant], gold=_label(answer, 2, where, "answer"),
                      meta={"gender": gender}, where=where))
  return Task("winogender", path, MULTIPLE_CHOICE, _nonempty(docs, path), _winogender_aggregate)


def _read_bbq(path):
  files = sorted(glob.glob(os.path.join(path, "*.jsonl"))) if os.path.isdir(path) else [path]
  if not files:
    raise TaskError(f"{path}: no *.jsonl BBQ category files in this directory")
  docs = []
  for file in files:
    for lineno, r in _jsonl(file, "BBQ category JSONL"):
      where = f"{file}:{lineno}"
      for key in ("context", "question", "ans0", "ans1", "ans2", "label", "context_condition", "category",
                  "question_polarity", "answer_info", "additional_metadata"):
        _field(r, key, where, object)
      _label(r["label"], 3, where)
      try:
        meta = bias.bbq_doc(r)
      except (ValueError, KeyError, TypeError) as e:
        raise TaskError(f"{where}: {e}") from None
      docs.append(Doc(prompt=f"{r['context']}\n\nQ: {r['question']}\nA:", choices=meta["choices"],
                      gold=meta["gold"], meta=meta, where=where))
  return Task("bbq", path, MULTIPLE_CHOICE, _nonempty(docs, path), _bbq_aggregate)


def _read_toxicity(path):
  docs = []
  for lineno, r in _jsonl(path, "toxicity prompts JSONL"):
    where = f"{path}:{lineno}"
    prompt = r.get("prompt", r.get("text"))
    if isinstance(prompt, dict):
      prompt = prompt.get("text")
    if not isinstance(prompt, str):
      raise TaskError(f"{where}: record has no prompt text ('prompt': {{'text': ...}}, 'prompt' or 'text')")
    docs.append(Doc(prompt=prompt, where=where))
  from evals import toxicity  # pylint: disable=g-import-not-at-top
  return Task("toxicity", path, GENERATE, _nonempty(docs, path), toxicity.aggregate)


def _passkey_aggregate(docs, results):
  from evals import metrics  # pylint: disable=g-import-not-at-top
  hits = [metrics.exact_match(r, d.target) for d, r in zip(docs, results)]
  out = metrics.mean_with_stderr("exact_match", hits)
  cells: dict[tuple, list[float]] = {}
  for d, hit in zip(docs, hits):
    cells.setdefault((d.meta["length"],), []).append(hit)
    cells.setdefault((d.meta["length"], d.meta["depth"]), []).append(hit)
  for cell, values in sorted(cells.items()):
    name = f"exact_match_len{cell[0]}" + (f"_depth{cell[1]:g}" if len(cell) > 1 else "")
    out[name] = sum(values) / len(values)
  return out


def _read_passkey(path):
  task = _read_gen(path)
  for (lineno, r), d in zip(_jsonl(path, "passkey task: JSONL of python -m evals.long_context passkey"), task.docs):
    where = f"{path}:{lineno}"
    d.meta = {"length": _field(r, "length", where, int), "depth": float(_field(r, "depth", where, (int, float)))}
  task.aggregate = _passkey_aggregate
  return task


def position_edges(longest: int) -> list[int]:
  """Bucket edges 0, 128, 256, 512, ... doubling until they cover `longest` positions."""
  edges = [0, 128]
  while edges[-1] < longest:
    edges.append(edges[-1] * 2)
  return edges


def _positions_aggregate(docs, results):
  """Mean NLL (nats per token) and perplexity of the predicted tokens whose index in the window falls in each
  bucket [lo, hi) of `position_edges` (index 1 = the first text token after BOS)."""
  import math  # pylint: disable=g-import-not-at-top
  out: dict[str, float] = {}
  edges = position_edges(max((len(r) + 1 for r in results), default=1))
  for lo, hi in zip(edges[:-1], edges[1:]):
    values = [float(-lp) for r in results for j, lp in enumerate(r, start=1) if lo <= j < hi]
    if values:
      nll = sum(values) / len(values)
      out.update({f"nll_pos{lo}_{hi}": nll, f"perplexity_pos{lo}_{hi}": math.exp(nll),
                  f"tokens_pos{lo}_{hi}": float(len(values))})
  return out


def _read_positions(path):
  task = _read_ppl(path)
  return Task("position_ppl", path, POSITIONS, task.docs, _positions_aggregate)


READERS: dict[str, Callable[[str], Task]] = {
    "mc": _read_mc, "ppl": _read_ppl, "gen": _read_gen, "piqa": _read_piqa, "hellaswag": _read_hellaswag,
    "arc": _read_arc, "arc_easy": _read_arc, "arc_challenge": _read_arc, "lambada": _read_lambada,
    "crows_pairs": _read_crows_pairs, "winogender": _read_winogender, "bbq": _read_bbq,
    "toxicity": _read_toxicity, "passkey": _read_passkey, "position_ppl": _read_positions,
}


def parse_specs(spec: str) -> list[tuple[str, str]]:
  """'NAME:PATH[,NAME:PATH...]' -> [(name, path)]; TaskError for an unknown name or a missing path."""
  from data.curate import eval_items  # pylint: disable=g-import-not-at-top  # the one spec parser
  return eval_items.parse_specs(spec, READERS, TaskError)


def load_task(name: str, path: str) -> Task:
  """Reads task `name` from `path` (see the module docstring); TaskError names the file and line of a problem."""
  if name not in READERS:
    raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(READERS))}")
  if not os.path.exists(path):
    raise TaskError(f"{path}: no such file or directory (task {name})")
  task = READERS[name](path)
  task.name = name
  return task


def fewshot_context(task: Task, index: int, k: int, rng) -> str:
  """The few-shot prefix for doc `index`: k examples (prompt + delimiter + target, joined by the few-shot
  delimiter) drawn with `rng` from the task's few-shot split, or from its docs without doc `index`, as lm-eval's
  ContextSampler does (sample k + 1, drop the document itself, keep k)."""
  if k <= 0:
    return ""
  if task.kind in (ROLLING, POSITIONS):
    raise TaskError(f"task {task.name}: perplexity tasks take no few-shot examples (use --num_fewshot 0)")
  pool = task.fewshot_docs if task.fewshot_docs else task.docs
  if task.fewshot_docs:
    examples = rng.sample(pool, min(k, len(pool)))
  else:
    examples = [d for d in rng.sample(pool, min(k + 1, len(pool))) if d is not task.docs[index]][:k]
  return "".join(ex.prompt + task.target_delimiter + _example_target(ex) + task.fewshot_delimiter
                 for ex in examples)


def _example_target(doc: Doc) -> str:
  if doc.choices:
    gold = doc.gold[0] if isinstance(doc.gold, (list, tuple)) else doc.gold
    return doc.choices[gold]
  return doc.target if doc.target else doc.text


def prompts(task: Task, num_fewshot: int = 0, seed: int = 1234) -> list[str]:
  """Each doc's full context: few-shot prefix + prompt."""
  import random  # pylint: disable=g-import-not-at-top
  rng = random.Random(seed)
  return [fewshot_context(task, i, num_fewshot, rng) + d.prompt for i, d in enumerate(task.docs)]


def requests_of(task: Task, contexts: Sequence[str]) -> list[tuple]:
  """The flat list of lm-eval requests of a task (per doc: one per choice, one, or one text)."""
  out = []
  for d, ctx in zip(task.docs, contexts):
    if task.kind == MULTIPLE_CHOICE:
      out.extend((ctx, task.target_delimiter + c) for c in d.choices)
    elif task.kind == LOGLIKELIHOOD:
      out.append((ctx, task.target_delimiter + d.target))
    elif task.kind in (ROLLING, POSITIONS):
      out.append(d.text)
    else:
      out.append((ctx, d.until, d.max_tokens))
  return out
