"""Hugging Face checkpoint I/O: load and save throughput and peak host memory, unsharded vs sharded vs transformers.

  python benchmarks/hf_io.py [--size 1gb|100mb]
      [--modes load_unsharded,load_sharded,transformers,save_sharded,load_qlora_nf4]
      [--code DIR]

Writes a random Llama-shaped checkpoint in float32 (1gb: d 1024, 12 layers, MLP 4096, vocab 32000: 267M
parameters, 1.07 GB; 100mb: d 512, 6 layers) as Hugging Face files (model.hf.save, 5 GB shards), then runs each
mode in a fresh subprocess on 8 CPU devices and reports, per mode:
  seconds, gb_per_s      wall time of the load or save (blocked until the arrays are ready) and bytes / time
  rss_growth_gb          growth of the peak RSS over the measured step: for loads the peak (VmHWM, what
                         `ru_maxrss` reports minus the parent's RSS that Linux carries into a child's ru_maxrss)
                         after importing jax and building the mesh vs after loading; for the save the peak
                         (VmHWM reset through /proc/self/clear_refs after the load) during the save over the RSS
                         before it
  rss_growth_x_model     rss_growth_gb / the checkpoint's size
Modes: load_unsharded (`model.hf.load` without a mesh), load_sharded (`model.hf.load` on an fsdp=8 mesh),
load_qlora_nf4 (a QLoRA run's train.init_from: `train.core.setup.init_from` on an fsdp=8 mesh with
train.lora_base_quant=nf4, the projection kernels quantized layer by layer while streaming; loaded_gb = what it
holds: NF4 kernels, float32 embeddings and norms),
transformers (`AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`), save_sharded (`model.hf.save` of the
fsdp=8 model, 250 MB files). On CPU devices the loaded parameters live in host memory, so a load's growth is
at least the model's size. --code DIR runs the modes with another checkout's code (e.g. an earlier commit's).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    "1gb": dict(vocab_size=32000, d_model=1024, num_layers=12, num_heads=16, num_kv_heads=16, head_dim=64,
                mlp_dim=4096, max_seq_len=2048),
    "100mb": dict(vocab_size=32000, d_model=512, num_layers=6, num_heads=8, num_kv_heads=8, head_dim=64,
                  mlp_dim=1536, max_seq_len=2048),
}

# Runs in the subprocess: argv = mode, checkpoint dir, scratch dir. Prints one JSON line.
CHILD = r"""
import json, os, sys, time
mode, src, scratch = sys.argv[1:4]
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from flax import nnx

def rss_gb():
  # The peak RSS of this process image: VmHWM, as ru_maxrss would be if Linux did not carry the forking
  # parent's RSS over into the child's ru_maxrss across exec.
  return status_gb("VmHWM")

def status_gb(key):
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith(key)) * 1024 / 1e9  # kB = KiB

mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
rules = (("batch", "fsdp"), ("length", None), ("kv_length", None), ("embed", "fsdp"), ("heads", None),
         ("kv_heads", None), ("head_dim", None), ("mlp", None), ("vocab", None), ("experts", None), ("layers", None))
out = {"mode": mode}
if mode == "transformers":
  import torch, transformers
  before = rss_gb(); t0 = time.perf_counter()
  m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
  out["seconds"] = time.perf_counter() - t0; out["rss_growth_gb"] = rss_gb() - before
elif mode == "load_qlora_nf4":
  import configs
  from model import hf
  from parallel import mesh as mesh_lib
  from train.core import setup, step as step_lib
  with open(os.path.join(src, "config.json")) as f:
    model_cfg = hf.config_from_hf(json.load(f))
  c = configs.load("tiny", **{"train.lora_rank": 16, "train.lora_base_quant": "nf4",
                              "train.lora_targets": ("q", "k", "v", "o", "gate", "up", "down")})
  c.model.update({k: model_cfg[k] for k in model_cfg})
  c.mesh.update(data=1, fsdp=8)
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))
  before = rss_gb(); t0 = time.perf_counter()
  params = setup.init_from(trainer, src)
  jax.block_until_ready(params)
  out["seconds"], out["rss_growth_gb"] = time.perf_counter() - t0, rss_gb() - before
  out["loaded_gb"] = sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9
else:
  from model import hf
  sharded = mode != "load_unsharded"
  kwargs = {"mesh": mesh, "rules": rules} if sharded else {}
  import inspect
  if "progress" in inspect.signature(hf.load).parameters:  # not in an earlier checkout's load()
    kwargs["progress"] = False
  before = rss_gb(); t0 = time.perf_counter()
  m = hf.load(src, **kwargs)
  jax.block_until_ready(nnx.state(m, nnx.Param))
  seconds, growth = time.perf_counter() - t0, rss_gb() - before
  if mode == "save_sharded":
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM: the save's own peak
    before = status_gb("VmRSS"); t0 = time.perf_counter()
    hf.save(m, os.path.join(scratch, "saved"), max_shard_size="250MB", progress=False)
    seconds, growth = time.perf_counter() - t0, status_gb("VmHWM") - before
  out["seconds"], out["rss_growth_gb"] = seconds, growth
print(json.dumps(out))
"""


def _write_checkpoint(size: str, path: str) -> int:
  """Writes a random float32 checkpoint of `SIZES[size]` to `path`; returns its weight bytes."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import Transformer, config as config_lib, hf  # pylint: disable=g-import-not-at-top
  cfg = config_lib.default_model_config()
  cfg.update(SIZES[size])
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def values(p):
    shape = shapes
    for k in p:
      shape = shape[k]
    return (0.02 * rng.standard_normal(shape.shape, np.float32)).astype(np.float32)

  hf.save(model, path, progress=False, values=values)
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default="1gb", choices=sorted(SIZES))
  parser.add_argument("--modes", default="load_unsharded,load_sharded,transformers,save_sharded")
  parser.add_argument("--code", default=REPO, help="checkout whose model/ the subprocesses import")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="hf_io_") as tmp:
    src = os.path.join(tmp, "ckpt")
    nbytes = _write_checkpoint(args.size, src)
    results = []
    env = dict(os.environ, PYTHONPATH=args.code, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    for mode in args.modes.split(","):
      done = subprocess.run([sys.executable, "-c", CHILD, mode, src, tmp], env=env, capture_output=True,
                            text=True, check=False, cwd=args.code)  # `python -c` imports from its cwd first
      if done.returncode:
        results.append({"mode": mode, "error": done.stderr[-2000:]})
        continue
      r = json.loads(done.stdout.strip().splitlines()[-1])
      r["gb_per_s"] = nbytes / 1e9 / r["seconds"]
      r["rss_growth_x_model"] = r["rss_growth_gb"] / (nbytes / 1e9)
      results.append(r)
  print(json.dumps({"checkpoint_gb": nbytes / 1e9, "code": args.code, "results": results}, indent=2))


if __name__ == "__main__":
  main()
