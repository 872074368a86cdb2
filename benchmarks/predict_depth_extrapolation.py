"""How well the predicted step time extrapolates in depth (benchmarks/predict_maxtext.py --layers A,B).

  python benchmarks/predict_depth_extrapolation.py

Compiles a small MaxText-style model (d_model 1024, 8 heads x 128, mlp 4096, seq 1024, remat full, FSDP over a
v5e-16 slice; libtpu, no TPU needed) at 2, 4 and 16 layers, extrapolates every step-time term linearly from the
2- and 4-layer programs to 16 layers, and prints both with the relative difference as one JSON object.
"""
from __future__ import annotations

import json
import sys

import configs
from train.planning import compile as aot
from train.planning import hardware
from train.planning import predict

TERMS = ("step_seconds", "compute_seconds", "memory_bound_seconds", "collective_seconds",
         "exposed_collective_seconds")
SMALL = {"model.d_model": 1024, "model.num_heads": 8, "model.num_kv_heads": 8, "model.head_dim": 128,
         "model.mlp_dim": 4096, "model.vocab_size": 32000, "train.batch_size": 32, "train.seq_len": 1024,
         "model.max_seq_len": 1024, "train.remat": "full", "mesh.data": 1, "mesh.fsdp": 16}


def main() -> int:
  tpu = hardware.tpu_slice("v5e-16")
  devices = aot.abstract_devices(tpu)
  terms = {}
  for depth in (2, 4, 16):
    c = configs.load("maxtext_16b", **SMALL, **{"model.num_layers": depth})
    _, compiled = aot.compile_trainer(c, devices)
    p = predict.predict(compiled.as_text(), tpu.chip, num_devices=tpu.num_chips, torus=tpu.torus,
                        model_flops_per_chip=0.0, tokens_per_chip=1.0)
    terms[depth] = {k: p[k] for k in TERMS}
  extrapolated = {k: terms[2][k] + (terms[4][k] - terms[2][k]) * (16 - 2) / (4 - 2) for k in TERMS}
  print(json.dumps({"direct_16": terms[16], "extrapolated_16": extrapolated,
                    "relative": {k: extrapolated[k] / terms[16][k] - 1 if terms[16][k] else None for k in TERMS}},
                   indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
