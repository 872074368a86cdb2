"""Evaluation items as raw text, for decontamination: per task file, each item's prompt plus its answer as the
benchmark publishes them (no prompt template: training text holds the question and the answer, not "Question:"
and "Answer:"). The task names and file layouts are those `python -m train.evaluate --tasks NAME:PATH` reads.

  mc, gen        JSONL {context, choices, label} / {context, answer}: context + the gold choice / the answer
  ppl, lambada, position_ppl, toxicity   JSONL: the text (toxicity: the prompt)
  passkey        JSONL gen records: context + answer
  piqa           a directory with valid.jsonl (+ valid-labels.lst), or one split's .jsonl: goal + gold solution
                 (both solutions without the labels file)
  hellaswag      ctx_a + ctx_b + the gold ending;  arc: question stem + the gold choice
  crows_pairs    the CSV: each of sent_more and sent_less is an item (the pair differs in a word or two)
  winogender     all_sentences.tsv: the sentence
  bbq            a category .jsonl or a directory of them: context + question + the gold answer
"""
from __future__ import annotations

import csv
import glob
import json
import os
from typing import Iterator


def _jsonl(path: str) -> Iterator[tuple[str, dict]]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file (a decontamination task file)")
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
          raise ValueError(f"{path}:{lineno}: expected a JSON object")
        yield f"{path}:{lineno}", record


def _get(record: dict, key: str, where: str):
  if key not in record:
    raise ValueError(f"{where}: record has no {key!r} field (fields: {', '.join(sorted(record))})")
  return record[key]


def _pick(choices: list, label, where: str) -> str:
  try:
    return str(choices[int(label)])
  except (ValueError, TypeError, IndexError):
    raise ValueError(f"{where}: label {label!r} does not index the {len(choices)} choices") from None


def _mc(path):
  return [f"{_get(r, 'context', w)} {_pick(_get(r, 'choices', w), _get(r, 'label', w), w)}" for w, r in _jsonl(path)]


def _gen(path):
  return [f"{_get(r, 'context', w)} {_get(r, 'answer', w)}" for w, r in _jsonl(path)]


def _text(path):
  return [str(_get(r, "text", w)) for w, r in _jsonl(path)]


def _toxicity(path):
  out = []
  for w, r in _jsonl(path):
    prompt = r.get("prompt", r.get("text"))
    prompt = prompt.get("text") if isinstance(prompt, dict) else prompt
    if not isinstance(prompt, str):
      raise ValueError(f"{w}: record has no prompt text ('prompt': {{'text': ...}}, 'prompt' or 'text')")
    out.append(prompt)
  return out


def _piqa(path):
  data = os.path.join(path, "valid.jsonl") if os.path.isdir(path) else path
  labels_path = data[:-len(".jsonl")] + "-labels.lst"
  labels = None
  if os.path.isfile(labels_path):
    with open(labels_path) as f:
      labels = [line.strip() for line in f if line.strip()]
  out = []
  for i, (w, r) in enumerate(_jsonl(data)):
    sols = [_get(r, "sol1", w), _get(r, "sol2", w)]
    answer = _pick(sols, labels[i], w) if labels is not None and i < len(labels) else " ".join(sols)
    out.append(f"{_get(r, 'goal', w)} {answer}")
  return out


def _hellaswag(path):
  return [f"{_get(r, 'ctx_a', w)} {_get(r, 'ctx_b', w)} {_pick(_get(r, 'endings', w), _get(r, 'label', w), w)}"
          for w, r in _jsonl(path)]


def _arc(path):
  out = []
  for w, r in _jsonl(path):
    q = _get(r, "question", w)
    if isinstance(q, dict):
      stem, options = _get(q, "stem", w), _get(q, "choices", w)
      texts, keys = [c.get("text", "") for c in options], [c.get("label") for c in options]
    else:
      choices = _get(r, "choices", w)
      stem, texts, keys = q, list(choices.get("text", [])), list(choices.get("label", []))
    key = _get(r, "answerKey", w)
    out.append(f"{stem} {texts[keys.index(key)] if key in keys else ' '.join(texts)}")
  return out


def _crows_pairs(path):
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file (CrowS-Pairs CSV)")
  with open(path, newline="", encoding="utf-8") as f:
    return [r[k] for r in csv.DictReader(f) for k in ("sent_more", "sent_less") if r.get(k)]


def _winogender(path):
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file (WinoGender all_sentences.tsv)")
  with open(path, encoding="utf-8") as f:
    return [line.rstrip("\n").split("\t", 1)[1] for n, line in enumerate(f) if n and "\t" in line]


def _bbq(path):
  files = sorted(glob.glob(os.path.join(path, "*.jsonl"))) if os.path.isdir(path) else [path]
  if not files:
    raise FileNotFoundError(f"{path}: no *.jsonl BBQ category files in this directory")
  return [f"{_get(r, 'context', w)} {_get(r, 'question', w)} "
          f"{_pick([r.get('ans0'), r.get('ans1'), r.get('ans2')], _get(r, 'label', w), w)}"
          for file in files for w, r in _jsonl(file)]


READERS = {"mc": _mc, "gen": _gen, "passkey": _gen, "ppl": _text, "lambada": _text, "position_ppl": _text,
           "toxicity": _toxicity, "piqa": _piqa, "hellaswag": _hellaswag, "arc": _arc, "arc_easy": _arc,
           "arc_challenge": _arc, "crows_pairs": _crows_pairs, "winogender": _winogender, "bbq": _bbq}


def parse_specs(specs: str, known=None, error: type[Exception] = ValueError) -> list[tuple[str, str]]:
  """'NAME:PATH[,NAME:PATH...]' -> [(name, path)], names among `known` (default: this module's readers; the
  evaluator passes its own, with its own `error` class); `error` for a malformed item, an unknown name or none."""
  known = READERS if known is None else known
  pairs = []
  for item in (s.strip() for s in specs.split(",") if s.strip()):
    name, sep, path = item.partition(":")
    if not sep or not path:
      raise error(f"task spec {item!r} must be NAME:PATH (e.g. piqa:/data/piqa, mc:/my/task.jsonl)")
    if name not in known:
      raise error(f"unknown task {name!r} in {item!r}; known tasks: {', '.join(sorted(known))}")
    pairs.append((name, path))
  if not pairs:
    raise error("no task given; pass NAME:PATH[,NAME:PATH...]")
  return pairs


def load(specs: str) -> list[tuple[str, list[str]]]:
  """[(task label, item texts)] of 'NAME:PATH[,NAME:PATH...]'; a name given twice is labelled NAME:PATH."""
  pairs = parse_specs(specs)
  names = [n for n, _ in pairs]
  return [(n if names.count(n) == 1 else f"{n}:{p}", READERS[n](p)) for n, p in pairs]
