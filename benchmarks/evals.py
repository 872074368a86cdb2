"""Loglikelihood requests/s: meshlm's evals.LM vs lm-evaluation-harness's hf backend on the same exported model.

`python benchmarks/evals.py --workdir runs/tiny [--requests 256] [--batch_size 32]` exports the run (train.export),
scores the same (context, continuation) requests with both and prints one JSON object: requests/s of each, the
speed-up, and the largest per-request |log-likelihood| difference. For the ~50M model, train one first, e.g.
`python -m train --workdir runs/m50 --config.model.d_model=512 --config.model.num_layers=8 ...` (a few steps).
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def requests(n):
  import pydoc_data.topics
  words = " ".join(pydoc_data.topics.topics.values()).split()
  out = []
  for i in range(n):
    start = (i * 37) % (len(words) - 80)
    ctx = " ".join(words[start:start + 10 + i % 40])
    out.append((ctx, " " + " ".join(words[start + 50:start + 52 + i % 6])))
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", default="runs/tiny")
  p.add_argument("--requests", type=int, default=256)
  p.add_argument("--batch_size", type=int, default=32)
  args = p.parse_args()
  import evals
  from data import tokenizer as tokenizer_lib
  from train import export, restore
  reqs = requests(args.requests)
  run = restore.load_run(args.workdir)
  lm = evals.LM(run.model, tokenizer_lib.Tokenizer.load(run.tokenizer_path), run.mesh, run.rules,
                batch_size=args.batch_size)
  lm.loglikelihood(reqs[:args.batch_size * 2])  # compile the shapes
  lm.loglikelihood(reqs)
  t0 = time.perf_counter()
  ours = lm.loglikelihood(reqs)
  ours_s = time.perf_counter() - t0
  out_dir = export.export(args.workdir, tempfile.mkdtemp(prefix="meshlm-bench-"))
  from lm_eval.api.instance import Instance
  from lm_eval.models.huggingface import HFLM
  hf = HFLM(pretrained=out_dir, dtype="float32", batch_size=args.batch_size, device="cpu")
  inst = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)]
  hf.loglikelihood(inst[:args.batch_size], disable_tqdm=True)
  t0 = time.perf_counter()
  ref = hf.loglikelihood(inst, disable_tqdm=True)
  ref_s = time.perf_counter() - t0
  print(json.dumps({
      "workdir": args.workdir, "params": sum(x.size for x in __import__("jax").tree.leaves(
          __import__("flax").nnx.state(run.model))), "requests": len(reqs), "batch_size": args.batch_size,
      "meshlm_requests_per_s": len(reqs) / ours_s, "lm_eval_hf_requests_per_s": len(reqs) / ref_s,
      "speedup": ref_s / ours_s, "max_abs_ll_diff": max(abs(a[0] - b[0]) for a, b in zip(ours, ref))}))


if __name__ == "__main__":
  main()
