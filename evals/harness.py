"""Runs tasks on an `evals.LM` and returns lm-eval-shaped results with plain metric names.

`evaluate(lm, [(name, path), ...])` ->
  {"results": {TASK: {"acc": .., "acc_stderr": .., ...}}, "n-samples": {TASK: n}, "config": {...},
   "samples": {TASK: [{"doc", "prompt", "lls"/"ll"/"output", "pred", ...}]} (with log_samples)}
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from evals import pll
from evals import tasks as tasks_lib
from evals.requests import LM

TOXICITY_DEFAULTS = {"samples": 25, "max_tokens": 20, "temperature": 1.0, "top_p": 0.9}


def _task_key(name: str, path: str, taken: set) -> str:
  key = name if name not in taken else f"{name}:{path}"
  taken.add(key)
  return key


def evaluate(lm: LM, specs: Sequence[tuple[str, str]], *, num_fewshot: int = 0, limit: int | None = None,
             seed: int = 1234, log_samples: bool = False, toxicity_scorer=None,
             toxicity: dict | None = None) -> dict[str, Any]:
  """Loads and runs each (name, path) task; see the module docstring for the returned dict.

  num_fewshot: examples before each prompt (lm-eval's sampling, seeded by `seed`); limit: first N docs per task;
  toxicity_scorer: an `evals.toxicity.Scorer` for toxicity tasks (default: the offline profanity scorer);
  toxicity: overrides of TOXICITY_DEFAULTS (samples per prompt, max_tokens, temperature, top_p).
  """
  loaded = [tasks_lib.load_task(name, path) for name, path in specs]  # every file checked before any compute
  out: dict[str, Any] = {"results": {}, "n-samples": {}, "config": {
      "model_max_length": lm.max_len, "batch_size": lm.batch_size, "num_fewshot": num_fewshot, "limit": limit,
      "fewshot_seed": seed, "tasks": [f"{n}:{p}" for n, p in specs]}, "timing": {}}
  if log_samples:
    out["samples"] = {}
  taken: set = set()
  for task in loaded:
    key = _task_key(task.name, task.path, taken)
    if limit:
      task.docs = task.docs[:limit]
    t0 = time.perf_counter()
    contexts = tasks_lib.prompts(task, num_fewshot, seed)
    if task.name == "toxicity":
      results, extra = _run_toxicity(lm, task, contexts, toxicity_scorer, {**TOXICITY_DEFAULTS, **(toxicity or {})})
      out["config"].update(extra)
    else:
      results = _run(lm, task, contexts)
    metrics = task.aggregate(task.docs, results)
    out["results"][key] = {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in metrics.items()}
    out["n-samples"][key] = len(task.docs)
    out["timing"][key] = time.perf_counter() - t0
    if log_samples:
      out["samples"][key] = [_sample(task, d, c, r) for d, c, r in zip(task.docs, contexts, results)]
  return out


def _run(lm: LM, task: tasks_lib.Task, contexts: list[str]) -> list[Any]:
  """Per-document results: MC -> [(ll, greedy)] per choice; loglikelihood -> (ll, greedy); rolling -> ll;
  generation -> text."""
  if task.name == "crows_pairs" and not lm.model.cfg.causal:
    # A masked-LM encoder has no left-to-right likelihood: the original metric, pseudo-log-likelihood over the
    # tokens the two sentences share (evals/pll.py).
    more, less = pll.crows_pairs_scores(lm.model, lm.tokenizer, [tuple(d.choices) for d in task.docs],
                                        batch_size=lm.batch_size)
    return [[(m, False), (l, False)] for m, l in zip(more, less)]
  reqs = tasks_lib.requests_of(task, contexts)
  if task.kind == tasks_lib.ROLLING:
    return lm.loglikelihood_rolling(reqs)
  if task.kind == tasks_lib.POSITIONS:
    return lm.token_logprobs(reqs)
  if task.kind == tasks_lib.GENERATE:
    return lm.generate_until(reqs)
  flat = lm.loglikelihood(reqs)
  if task.kind == tasks_lib.LOGLIKELIHOOD:
    return flat
  results, pos = [], 0
  for d in task.docs:
    results.append(flat[pos:pos + len(d.choices)])
    pos += len(d.choices)
  return results


def _run_toxicity(lm: LM, task, contexts, scorer, opts):
  from evals import toxicity  # pylint: disable=g-import-not-at-top
  scorer = scorer or toxicity.ProfanityScorer()
  k = int(opts["samples"])
  reqs = [(c, [], int(opts["max_tokens"])) for c in contexts for _ in range(k)]
  texts = lm.generate_until(reqs, temperature=float(opts["temperature"]), top_p=float(opts["top_p"]))
  scores = np.asarray(scorer.score(texts), np.float64).reshape(len(contexts), k)
  extra = {"toxicity_scorer": scorer.name, "toxicity_note": scorer.note, "toxicity_samples": k,
           "toxicity_max_tokens": int(opts["max_tokens"]), "toxicity_temperature": float(opts["temperature"]),
           "toxicity_top_p": float(opts["top_p"])}
  for i, d in enumerate(task.docs):
    d.meta["continuations"] = texts[i * k:(i + 1) * k]
  return [list(row) for row in scores], extra


def _sample(task, doc, context, result) -> dict[str, Any]:
  s: dict[str, Any] = {"where": doc.where, "prompt": context}
  if task.kind == tasks_lib.MULTIPLE_CHOICE:
    lls = [ll for ll, _ in result]
    s.update(choices=doc.choices, gold=doc.gold, lls=lls, is_greedy=[g for _, g in result],
             pred=int(np.argmax(lls)))
  elif task.kind == tasks_lib.LOGLIKELIHOOD:
    s.update(target=doc.target, ll=result[0], is_greedy=result[1])
  elif task.kind == tasks_lib.ROLLING:
    s.update(text=doc.text, ll=result)
  elif task.kind == tasks_lib.POSITIONS:
    s.update(text=doc.text, tokens=len(result) + 1, ll=float(np.sum(result)))
  elif task.name == "toxicity":
    s.update(continuations=doc.meta["continuations"], scores=result, max_score=max(result))
  else:
    s.update(answer=doc.target, output=result)
  return s
