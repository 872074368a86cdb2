"""Loglikelihood requests/s: meshlm's evals.LM vs lm-evaluation-harness's hf backend on the same exported model.

`python benchmarks/evals.py --workdir runs/tiny,runs/m50 [--requests 256] [--choices 1,4] [--batch_size 32]
[--repeats 3]` exports each run (train.export), scores the same (context, continuation) requests with both,
alternating the two `--repeats` times, and prints one JSON line per run and request shape: the median
requests/s of each (every repeat listed), the speed-up, meshlm's first call (compilation included), the largest
per-request |log-likelihood| difference and the machine's load average, and the floor: meshlm's matrix products
alone (`meshlm_products_only_s`, benchmarks/products.py) with lm-eval's time over it (`ceiling_speedup`, the most
any meshlm pass over the same rows could reach). `--choices K` gives each context K
continuations, as a K-way multiple-choice task does (HellaSwag: 4, PIQA: 2); K = 1 is the worst case for meshlm,
whose requests sharing a context share one row (the context once, tree attention), while lm-eval's hf backend
runs every request in full.
`--tasks NAME:PATH[,...]` scores a real task's requests instead (its first `--requests` requests, whole documents,
prompts as `python -m train.evaluate` builds them, zero-shot), e.g. the official files of ../shared/evaldata:
`E=../shared/evaldata; python benchmarks/evals.py --workdir runs/tiny --tasks piqa:$E/piqa,bbq:$E/bbq,`
`crows_pairs:$E/crows_pairs/crows_pairs_anonymized.csv,winogender:$E/winogender/all_sentences.tsv` (one line).
A ~50M-parameter run to compare with, a few steps:
`python -m train --workdir runs/m50 --config.model.vocab_size=8192 --config.model.d_model=512
 --config.model.num_layers=10 --config.model.num_heads=8 --config.model.num_kv_heads=8 --config.model.head_dim=64
 --config.model.mlp_dim=2048 --config.model.max_seq_len=256 --config.train.steps=20 --config.train.batch_size=8
 --config.train.seq_len=256 --config.train.eval_every=20 --config.train.eval_steps=1 --config.checkpoint.every=20`.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from train.core.hostmem import keep_freed_host_memory  # noqa: E402

keep_freed_host_memory()  # as `python -m train.evaluate` does on the CPU; lm-eval in this process shares it
os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def requests(n, choices=1):
  """n (context, continuation) pairs of Python's own documentation, `choices` consecutive ones per context:
  contexts of 10-49 words, continuations of 2-7 words (multiple-choice-like)."""
  import pydoc_data.topics
  words = " ".join(pydoc_data.topics.topics.values()).split()
  out = []
  for i in range(-(-n // choices)):
    start = (i * 37) % (len(words) - 120)
    ctx = " ".join(words[start:start + 10 + i % 40])
    for j in range(choices):
      at = start + 50 + 8 * j
      out.append((ctx, " " + " ".join(words[at:at + 2 + (i + j) % 6])))
  return out[:n]


def task_requests(name, path, n):
  """The (context, continuation) requests of task `name` read from `path`, whole documents, at least n of them
  (all if the task has fewer); -> (requests, documents, choices per document on average)."""
  from evals import tasks as tasks_lib
  task = tasks_lib.load_task(name, path)
  if task.kind not in (tasks_lib.MULTIPLE_CHOICE, tasks_lib.LOGLIKELIHOOD):
    raise SystemExit(f"--tasks {name}: only loglikelihood tasks (multiple choice or one continuation) are timed")
  every = tasks_lib.requests_of(task, tasks_lib.prompts(task))
  out, docs = 0, 0
  for d in task.docs:  # requests_of gives each document's requests in turn: one per choice, or one
    if out >= n:
      break
    out += len(d.choices) if task.kind == tasks_lib.MULTIPLE_CHOICE else 1
    docs += 1
  return every[:out], docs, out / docs


def products_floor(lm, reqs) -> float:
  """Seconds that the matrix products of meshlm's scoring passes over `reqs` take alone (benchmarks/products.py,
  each batch shape's compiled pass once, times the number of its calls): the floor under meshlm's time."""
  from products import products_only
  calls, score = [], lm._score_fn

  def record(state, *args, num_requests):
    calls.append((args, num_requests))
    return score(state, *args, num_requests=num_requests)

  lm._score_fn = record
  try:
    lm.loglikelihood(reqs)
  finally:
    lm._score_fn = score
  seconds, total = {}, 0.0
  for args, n in calls:
    key = (tuple(a.shape for a in args), n)
    if key not in seconds:
      seconds[key] = products_only(score.lower(lm._state, *args, num_requests=n).compile().as_text())["seconds"]
    total += seconds[key]
  return total


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def bench(workdir, reqs, choices, batch_size, repeats):
  import flax
  import jax
  import evals
  from data import tokenizer as tokenizer_lib
  from lm_eval.api.instance import Instance
  from lm_eval.models.huggingface import HFLM
  from train.rundir import export
  from train.rundir import restore
  load_before = os.getloadavg()[0]
  run = restore.load_run(workdir)
  lm = evals.LM(run.model, tokenizer_lib.Tokenizer.load(run.tokenizer_path), run.mesh, run.rules,
                batch_size=batch_size)
  n_given = len(reqs)  # lm-eval asserts on a continuation longer than the model; meshlm would score its end
  reqs = [r for r in reqs if len(lm.encode_pair(*r)[1]) <= lm.max_len]
  _, first_s = _timed(lambda: lm.loglikelihood(reqs))  # every shape compiles here
  out_dir, _ = export.export(workdir, tempfile.mkdtemp(prefix="meshlm-bench-"))
  hf = HFLM(pretrained=out_dir, dtype="float32", batch_size=batch_size, device="cpu")
  inst = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)]
  hf.loglikelihood(inst[:batch_size], disable_tqdm=True)  # warm-up
  ours_s, ref_s = [], []
  for _ in range(repeats):  # alternating, so both see the same machine load
    ours, s = _timed(lambda: lm.loglikelihood(reqs))
    ours_s.append(s)
    ref, s = _timed(lambda: hf.loglikelihood(inst, disable_tqdm=True))
    ref_s.append(s)
  floor_s = products_floor(lm, reqs)
  n = len(reqs)
  return {
      "workdir": workdir, "params": sum(x.size for x in jax.tree.leaves(flax.nnx.state(run.model))),
      "max_seq_len": lm.max_len, "requests": n, "dropped_too_long": n_given - n, "choices": choices,
      "batch_size": lm.batch_size, "repeats": repeats,
      "meshlm_requests_per_s": n / statistics.median(ours_s),
      "lm_eval_hf_requests_per_s": n / statistics.median(ref_s),
      "speedup": statistics.median(ref_s) / statistics.median(ours_s),
      # meshlm's products alone, and lm-eval's time over them: the speed-up a pass of nothing but products would give
      "meshlm_products_only_s": floor_s, "ceiling_speedup": statistics.median(ref_s) / floor_s,
      "meshlm_each_s": [round(s, 3) for s in ours_s], "lm_eval_hf_each_s": [round(s, 3) for s in ref_s],
      "meshlm_first_call_s": first_s, "max_abs_ll_diff": max(abs(a[0] - b[0]) for a, b in zip(ours, ref)),
      "greedy_equal": all(a[1] == b[1] for a, b in zip(ours, ref)),
      "load_average_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)]}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", default="runs/tiny", help="one run directory or several, comma-separated")
  p.add_argument("--requests", type=int, default=256)
  p.add_argument("--choices", default="1,4", help="continuations per context, one value or several, comma-separated")
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--tasks", default="", help="NAME:PATH[,...]: time these tasks' requests instead of --choices")
  args = p.parse_args()
  from evals import tasks as tasks_lib
  for workdir in args.workdir.split(","):
    if args.tasks:
      for name, path in tasks_lib.parse_specs(args.tasks):
        reqs, docs, choices = task_requests(name, path, args.requests)
        out = bench(workdir, reqs, round(choices, 2), args.batch_size, args.repeats)
        print(json.dumps({"task": name, "documents": docs, **out}), flush=True)
      continue
    for choices in (int(k) for k in args.choices.split(",")):
      print(json.dumps(bench(workdir, requests(args.requests, choices), choices, args.batch_size, args.repeats)),
            flush=True)


if __name__ == "__main__":
  main()
