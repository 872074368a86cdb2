"""UL2 denoisers on the built-in corpus: `python benchmarks/ul2.py [--batches 50] [--config.KEY=VALUE ...]`.

Reads packed training batches of `--config=tiny --config.data.objective_mixture=R:0.4,X:0.4,S:0.2` (override
with --config.data.objective_mixture=...) from the real pipeline, reads every example's layout from its tokens
(mode token, sentinels, prefix) and prints one JSON object: the realised share of examples per denoiser (a long
document gives several examples, so on a corpus of few long documents this share is noisy), and per
span denoiser the corruption rate and mean span length against the configured ones (documents shorter than
about 2 mu / r tokens cannot reach the configured span), the share of loss tokens, and the packing efficiency.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import configs  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from data import denoise  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from data import pipeline  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from data import tokenizer as tokenizer_lib  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batches", type=int, default=50)
  config, args = configs.parse(["--config=tiny", "--config.data.objective_mixture=R:0.4,X:0.4,S:0.2", *argv], p)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    tok = tokenizer_lib.load(tokenizer_lib.prepare(config, tmp))
    it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
    d = denoise.Denoiser(tok, config.data, config.train.seq_len)
    kinds = {v: k for k, v in d.mode_ids.items()}
    examples = {k: 0 for k in denoise.DENOISERS}
    tokens = {k: [0, 0, 0] for k in ("R", "X")}  # document tokens, noise tokens, spans
    loss_tokens = real_tokens = 0
    for _ in range(args.batches):
      b = next(it)
      loss_tokens += float(b["loss_mask"].sum())
      real_tokens += int((b["segment_ids"] > 0).sum())
      for r in range(b["inputs"].shape[0]):
        for s in set(b["segment_ids"][r].tolist()) - {0}:
          seg = b["inputs"][r][b["segment_ids"][r] == s]
          kind = kinds.get(int(seg[1]), "LM") if len(seg) > 1 and seg[0] == tok.bos_id else None
          if kind is None:
            continue  # the tail piece of a long plain document
          examples[kind] += 1
          if kind in tokens:
            sentinels = np.flatnonzero(np.isin(seg, d.sentinel_ids))
            m = len(sentinels) // 2
            targets = len(seg) - int(sentinels[m])  # sentinels and spans (EOS is the last target, not an input)
            noise = targets - m
            tokens[kind][0] += int(sentinels[m]) - 2 - m + noise  # document tokens: the input's kept + noise
            tokens[kind][1] += noise
            tokens[kind][2] += m
  n = sum(examples.values())
  out = {"command": "python benchmarks/ul2.py " + " ".join(argv), "load_average_at_start": os.getloadavg()[0],
         "wall_s": round(time.perf_counter() - start, 1), "mixture": config.data.objective_mixture,
         "examples": examples, "example_share": {k: round(v / n, 4) for k, v in examples.items()},
         "loss_token_share": round(loss_tokens / real_tokens, 4)}
  for k, (doc, noise, spans) in tokens.items():
    want = denoise.span_setting(config.data, k)
    out[k] = {"rate": round(noise / max(doc, 1), 4), "configured_rate": want.rate,
              "mean_span": round(noise / max(spans, 1), 3), "configured_mean_span": want.mean_span}
  out["packing_efficiency"] = round(pipeline.stats(it)["data/packing_efficiency"], 4)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
