"""Serving: the engine (model/engine.py) against the static-batch sampler and transformers' continuous batching.

  JAX_PLATFORMS=cpu python benchmarks/serve.py [--models tiny,50m] [--requests 64] [--rate 0] [--max_seqs 16]
      [--skip_torch] [--grpo_prompts 8 --grpo_samples 8]

Workload (seed 0, the same for every system): `--requests` requests arriving as a Poisson process of `--rate`
requests/s (0: all at once, which measures throughput with the server saturated); prompt lengths log-normal
(median 24 tokens, 4 .. 256), output lengths long-tailed (a Pareto draw: median ~12, a tail to 384), random token
ids; greedy, every request generating exactly its output length (no stop
id). Systems, on the same random weights (model.hf.save for transformers, float32, same process), each run once to
warm up (compilations) and once timed:
  engine       Engine(max_seqs, chunk 64, page 16): requests join as they arrive, leave when done
  static       model.generate.sample on the arrived requests, up to max_seqs at a time, each batch run to its
               longest output (what a static batch costs: rows that finish early wait)
  transformers generate's continuous batching (ContinuousBatchingManager.add_request per arrival, its defaults)
Figures per system: output tokens/s (sum of requested output lengths / time from the first arrival to the last
completion), p50/p99 time to first token (first token - arrival) and time per output token ((completion - first
token) / (length - 1)), seconds. A static batch's tokens arrive together when it finishes, its first tokens after
its prefill. `--grpo_*`: one GRPO rollout iteration (P prompts x G samples at temperature 1, up to 96 new tokens,
stopping at 4 stop ids) through model.generate.sample and through the engine (prefix caching shares each
prompt's pages among its G samples), seconds per iteration after a warm-up (the best of 3). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
from flax import nnx

import model
from configs import base
from model import engine as engine_lib
from model import generate as gen

MODELS = {
    "tiny": dict(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
                 max_seq_len=640),
    "50m": dict(vocab_size=32000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536,
                max_seq_len=640),
}


def workload(n: int, rate: float, vocab: int, seed: int = 0) -> list[dict]:
  """n requests: arrival (s), prompt ids, output length (module docstring)."""
  rng = np.random.default_rng(seed)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) - 1.0 / rate if rate > 0 else np.zeros(n)
  prompt_lens = np.clip(np.round(np.exp(rng.normal(np.log(24), 0.9, n))), 4, 256).astype(int)
  out_lens = np.clip(np.round(6 * (1 + rng.pareto(1.1, n))), 4, 384).astype(int)
  return [{"arrival": float(a), "prompt": rng.integers(4, vocab, p).tolist(), "length": int(o)}
          for a, p, o in zip(arrivals, prompt_lens, out_lens)]


def _summary(work, first, done, elapsed) -> dict:
  ttft = np.array([first[i] - w["arrival"] for i, w in enumerate(work)])
  tpot = np.array([(done[i] - first[i]) / max(w["length"] - 1, 1) for i, w in enumerate(work)])
  tokens = sum(w["length"] for w in work)
  return {"tokens_per_sec": tokens / elapsed, "seconds": elapsed, "ttft_p50": float(np.percentile(ttft, 50)),
          "ttft_p99": float(np.percentile(ttft, 99)), "tpot_p50": float(np.percentile(tpot, 50)),
          "tpot_p99": float(np.percentile(tpot, 99))}


def run_engine(m, work, max_seqs: int) -> dict:
  engine = engine_lib.Engine(m, max_seqs=max_seqs, chunk=64, page_size=16)
  engine.warmup()  # every (call width, page-table width) program, before the clock starts
  first, done, requests, order = {}, {}, {}, sorted(range(len(work)), key=lambda i: work[i]["arrival"])
  t0 = time.perf_counter()
  while order or engine.busy():
    now = time.perf_counter() - t0
    while order and work[order[0]]["arrival"] <= now:
      i = order.pop(0)
      requests[i] = engine.live[engine.add(work[i]["prompt"], work[i]["length"])]
    if not engine.busy():
      time.sleep(max(0.0, work[order[0]]["arrival"] - now))
      continue
    engine.step()
    now = time.perf_counter() - t0
    for i, r in requests.items():
      if r.tokens and i not in first:
        first[i] = now
      if r.done and i not in done:
        done[i] = now
  return {**_summary(work, first, done, time.perf_counter() - t0), "engine_steps": engine.stats["steps"],
          "preemptions": engine.stats["preemptions"]}


def run_static(m, work, max_seqs: int) -> dict:
  first, done, order = {}, {}, sorted(range(len(work)), key=lambda i: work[i]["arrival"])
  t0 = time.perf_counter()
  while order:
    now = time.perf_counter() - t0
    batch = [i for i in order if work[i]["arrival"] <= now][:max_seqs]
    if not batch:
      time.sleep(work[order[0]]["arrival"] - now)
      continue
    start = time.perf_counter() - t0
    out = gen.sample(m, [work[i]["prompt"] for i in batch], max(work[i]["length"] for i in batch))
    end = time.perf_counter() - t0
    for i in batch:
      first[i], done[i] = start + out.stats["prefill_seconds"], end
      order.remove(i)
  return _summary(work, first, done, time.perf_counter() - t0)


def run_transformers(ref, work, max_seqs: int) -> dict:
  import transformers  # pylint: disable=g-import-not-at-top
  config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                         max_new_tokens=max(w["length"] for w in work))
  manager = ref.init_continuous_batching(generation_config=config)
  manager.start()
  order = sorted(range(len(work)), key=lambda i: work[i]["arrival"])
  t0 = time.perf_counter()
  for i in order:
    time.sleep(max(0.0, work[i]["arrival"] - (time.perf_counter() - t0)))
    manager.add_request(work[i]["prompt"], request_id=str(i), max_new_tokens=work[i]["length"],
                        record_timestamps=True)
  first, done, lengths = {}, {}, {}
  while len(done) < len(order):
    out = manager.get_result(timeout=3600)  # results in the order they finish
    if out is None:
      raise RuntimeError("transformers' continuous batching returned no result (its thread stopped)")
    i = int(out.request_id)
    first[i], done[i] = out.timestamps[0] - t0, out.lifespan[1] - t0
    lengths[i] = len(out.generated_tokens)
  manager.stop(block=True)
  elapsed = max(done.values())
  del max_seqs
  return {**_summary(work, first, done, elapsed),
          "generated_as_requested": all(lengths[i] == work[i]["length"] for i in order)}


def grpo_rollouts(m, prompts: int, samples: int) -> dict:
  rng = np.random.default_rng(1)
  batch = [p for p in rng.integers(4, m.cfg.vocab_size, (prompts, 48)).tolist() for _ in range(samples)]
  kwargs = dict(temperature=1.0, stop_ids=(4, 5, 6, 7), seed=0)
  out = {}
  for name, fn in (("static", gen.sample), ("engine", engine_lib.sample)):
    fn(m, batch, 96, **kwargs)  # compiles
    times = []
    for _ in range(3):
      t = time.perf_counter()
      g = fn(m, batch, 96, **kwargs)
      times.append(time.perf_counter() - t)
    out[name] = {"seconds_per_iteration": min(times),
                 "mean_completion_tokens": float(np.mean([len(x) for x in g.tokens]))}
  out["engine_speedup"] = out["static"]["seconds_per_iteration"] / out["engine"]["seconds_per_iteration"]
  return out


def bench(name: str, args) -> dict:
  cfg = base.get_config().model
  cfg.update(MODELS[name], dtype="float32", param_dtype="float32", init_std=0.5)
  m = model.Transformer(cfg, rngs=nnx.Rngs(0))
  work = workload(args.requests, args.rate, cfg.vocab_size)
  result = {"requests": args.requests, "rate": args.rate, "max_seqs": args.max_seqs,
            "output_tokens": sum(w["length"] for w in work),
            "output_length_p50_p99_max": [float(np.percentile([w["length"] for w in work], q)) for q in (50, 99, 100)]}
  for system, fn in (("engine", run_engine), ("static", run_static)):
    fn(m, work, args.max_seqs)  # warm-up: every compilation
    result[system] = fn(m, work, args.max_seqs)
  if not args.skip_torch:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    from model import hf  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
      hf.save(m, d)
      ref = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    run_transformers(ref, work[:8], args.max_seqs)  # warm-up
    result["transformers"] = run_transformers(ref, work, args.max_seqs)
    result["engine_vs_transformers"] = result["engine"]["tokens_per_sec"] / result["transformers"]["tokens_per_sec"]
  result["engine_vs_static"] = result["engine"]["tokens_per_sec"] / result["static"]["tokens_per_sec"]
  if args.grpo_prompts:
    result["grpo"] = grpo_rollouts(m, args.grpo_prompts, args.grpo_samples)
  return result


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--models", default="tiny,50m")
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--rate", type=float, default=0.0,
                 help="arrivals per second (0: all at once, vLLM's benchmark_serving default)")
  p.add_argument("--max_seqs", type=int, default=16)
  p.add_argument("--skip_torch", action="store_true")
  p.add_argument("--grpo_prompts", type=int, default=8)
  p.add_argument("--grpo_samples", type=int, default=8)
  args = p.parse_args()
  print(json.dumps({name: bench(name, args) for name in args.models.split(",")}, indent=1))


if __name__ == "__main__":
  main()
