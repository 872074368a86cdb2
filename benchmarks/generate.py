"""Generation speed: meshlm's KV-cache sampler against transformers' generate on the same weights.

  JAX_PLATFORMS=cpu python benchmarks/generate.py [--models tiny,50m] [--batches 1,8] [--prompt_len 32]
      [--new_tokens 64]

For each model (configs/tiny.py's model, and a ~58M-parameter one: d 512, 8 layers, GQA 8/4 heads, vocab 32000)
with random weights, written with model.hf.save and read by transformers (PyTorch, float32, same process), and
each batch size, greedy decoding without a stop id:
  prefill_tokens_per_sec  batch x prompt_len / prefill wall time
  decode_tokens_per_sec   batch x (new_tokens - 1) / decode wall time (tokens after the first)
meshlm's times exclude compilation (one warm-up call); transformers' prefill is one forward with a cache, its
decode the rest of `generate(do_sample=False)`. `compiles_other_lengths` counts XLA compilations of meshlm calls
with other prompt lengths inside the same bucket (0 = no recompile). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch
import transformers
from flax import nnx

import model
from configs import base
from model import generate as gen
from model import hf

MODELS = {
    "tiny": dict(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
                 max_seq_len=128),
    "50m": dict(vocab_size=32000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536,
                max_seq_len=512),
}


def _prompts(batch, length, vocab, seed=0):
  return np.random.default_rng(seed).integers(3, vocab, size=(batch, length)).tolist()


def bench_meshlm(m, batch, args):
  prompts = _prompts(batch, args.prompt_len, m.cfg.vocab_size)
  first = gen.sample(m, prompts, args.new_tokens).stats  # compiles
  s = gen.sample(m, prompts, args.new_tokens).stats
  other = [gen.sample(m, _prompts(batch, n, m.cfg.vocab_size, n), args.new_tokens).stats["compiles"]
           for n in (args.prompt_len - 7, args.prompt_len - 13)]
  return {"prefill_tokens_per_sec": batch * args.prompt_len / s["prefill_seconds"],
          "decode_tokens_per_sec": batch * (args.new_tokens - 1) / s["decode_seconds"],
          "compile_seconds_first_call": first["compile_seconds"], "compiles_first_call": first["compiles"],
          "compiles_other_lengths": sum(other),
          "prompt_bucket": s["prompt_bucket"]}


def bench_torch(ref, batch, args, vocab):
  ids = torch.tensor(_prompts(batch, args.prompt_len, vocab))
  mask = torch.ones_like(ids)
  kw = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=None,
            pad_token_id=0)
  with torch.no_grad():
    ref.generate(ids, attention_mask=mask, **kw)  # warm-up
    t0 = time.perf_counter()
    ref(ids, attention_mask=mask, use_cache=True)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref.generate(ids, attention_mask=mask, **kw)
    total = time.perf_counter() - t0
  return {"prefill_tokens_per_sec": batch * args.prompt_len / prefill,
          "decode_tokens_per_sec": batch * (args.new_tokens - 1) / max(total - prefill, 1e-9)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", default="tiny,50m")
  p.add_argument("--batches", default="1,8")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--new_tokens", type=int, default=64)
  args = p.parse_args()
  results = {"torch_threads": torch.get_num_threads()}
  for name in args.models.split(","):
    cfg = base.get_config().model
    cfg.update(**MODELS[name])
    m = model.Transformer(cfg, rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as d:
      hf.save(m, d)
      ref = transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()
    entry = {"params": model.count_params(cfg)["total"]}
    for batch in (int(b) for b in args.batches.split(",")):
      ours, theirs = bench_meshlm(m, batch, args), bench_torch(ref, batch, args, cfg.vocab_size)
      entry[f"batch_{batch}"] = {"meshlm": ours, "transformers": theirs,
                                 "decode_speedup": ours["decode_tokens_per_sec"] / theirs["decode_tokens_per_sec"]}
      print(json.dumps({name: {f"batch_{batch}": entry[f"batch_{batch}"]}}), flush=True)
    results[name] = entry
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
