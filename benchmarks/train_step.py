"""Training-step throughput and MFU of meshlm vs PyTorch + transformers, a hand-written JAX step and MaxText, 1 CPU.

  JAX_PLATFORMS=cpu python benchmarks/train_step.py [--configs tiny,d256,50m] [--remat none,full] [--steps 4]
      [--peers torch,hand_written] [--maxtext_venv VENV] [--variant KEY=VALUE,...] [--threads=1]
  (on a shared machine: taskset -c 0 ... --threads=1)

Prints one JSON object. For each config and remat (none / full): tokens/s and MFU (`mfu`: causal attention FLOPs
halved; `mfu_full_attention`: not halved; both against a float32 matmul peak measured in the same run) of
`train.core.step.Trainer.step_fn` and of each peer on the same model (same dimensions, batch, AdamW with clipping):
- torch: transformers' LlamaForCausalLM (sdpa attention) with torch.optim.AdamW and clip_grad_norm_, as many
  threads as jax uses; full remat = `gradient_checkpointing_enable()`;
- hand_written: the minimal jitted JAX step below (no framework);
- meshlm_variant (--variant): meshlm with some config keys changed, e.g. `model.scan_layers=false`;
- maxtext: MaxText 0.2.5 in its own venv (--maxtext_venv; `bash ../shared/peers/maxtext/install.sh VENV` style
  installs, never a project dependency), run as a subprocess on synthetic data between two meshlm blocks; its
  fastest logged step is compared.
Steps of meshlm and the in-process peers alternate one by one so machine load affects them alike; tokens/s use
the fastest step (on a shared machine load only adds time), medians are reported too, with the load average.
`mfu_needed_for_1_2x_torch` is the MFU meshlm would need for 1.2x PyTorch's tokens/s in that run (1.2 times
PyTorch's MFU against the same measured peak). `products_only` times the step's matrix products alone (every
`dot` of the compiled step, a scanned layer's once per layer, in one jitted function: benchmarks/products.py),
the floor under any meshlm step on this machine;
`ceiling_ratio_over_torch` = PyTorch's step time / that floor, the ratio a step of nothing but products would reach.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# --threads=1 must reach XLA before jax starts (as torch.set_num_threads(1) on the other side); pin the process
# to one core as well (`taskset -c 0`). On a machine shared with other jobs, single-threaded sides degrade alike,
# while a 2-thread OpenMP side (torch) that spins at barriers degrades far more than XLA's pool.
if "--threads=1" in sys.argv:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train.core.hostmem import keep_freed_host_memory  # noqa: E402

# As every meshlm command does on the CPU (MESHLM_SYSTEM_MALLOC=1 turns it off); the in-process peers share it.
keep_freed_host_memory()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import rope  # noqa: E402
from parallel import mesh as mesh_lib  # noqa: E402
import configs  # noqa: E402
from train.planning import mfu as mfu_lib  # noqa: E402
from train.core import step as step_lib  # noqa: E402
from products import products_only  # noqa: E402  (benchmarks/products.py)

CONFIGS = {
    "tiny": {},  # configs/tiny.py as it is: d 128, 4 layers, seq 128, batch 16 (1.3M parameters)
    "d256": {"model.vocab_size": 2048, "model.d_model": 256, "model.num_layers": 4, "model.num_heads": 4,
             "model.num_kv_heads": 4, "model.head_dim": 64, "model.mlp_dim": 1024, "model.max_seq_len": 256,
             "train.batch_size": 8, "train.seq_len": 256},
    "50m": {"model.vocab_size": 16000, "model.d_model": 512, "model.num_layers": 10, "model.num_heads": 8,
            "model.num_kv_heads": 8, "model.head_dim": 64, "model.mlp_dim": 1536, "model.max_seq_len": 256,
            "train.batch_size": 4, "train.seq_len": 256},
}


def matmul_peak_flops(n: int = 1024, reps: int = 10) -> float:
  """Measured float32 matmul FLOP/s of one device (best of 3 runs of `reps` chained n x n products)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32) / math.sqrt(n)

  @jax.jit
  def chain(x):
    for _ in range(reps):
      x = x @ a
    return x

  chain(a).block_until_ready()
  best = math.inf
  for _ in range(3):
    start = time.perf_counter()
    chain(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n ** 3 * reps / best


# ---- the hand-written step: plain functions over the same parameter dict --------------------------------
def _rms(x, scale, eps):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale


def hand_written_step(config, remat: bool):
  """A minimal Llama-style training step (RMSNorm, RoPE, causal GQA, SwiGLU, AdamW with clipping), jitted."""
  m, t = config.model, config.train
  G, H = m.num_kv_heads, m.num_heads
  inv_freq = rope.inv_frequencies(m)

  def layer(x, p, cos, sin):
    B, L, _ = x.shape
    h = _rms(x, p["attn_norm"]["scale"], m.norm_eps)
    q = rope.apply(jnp.einsum("bld,dhk->blhk", h, p["attn"]["q"]), cos, sin)
    k = rope.apply(jnp.einsum("bld,dgk->blgk", h, p["attn"]["k"]), cos, sin)
    v = jnp.einsum("bld,dgk->blgk", h, p["attn"]["v"])
    q = q.reshape(B, L, G, H // G, m.head_dim)
    s = jnp.einsum("btgrk,bsgk->bgrts", q, k) / math.sqrt(m.head_dim)
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -1e30)
    o = jnp.einsum("bgrts,bsgk->btgrk", jax.nn.softmax(s, -1), v).reshape(B, L, H, m.head_dim)
    x = x + jnp.einsum("blhk,hkd->bld", o, p["attn"]["o"])
    h = _rms(x, p["mlp_norm"]["scale"], m.norm_eps)
    f = jax.nn.silu(h @ p["mlp"]["gate"]) * (h @ p["mlp"]["up"])
    return x + f @ p["mlp"]["down"]

  if remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

  def loss_fn(params, batch):
    pos = jnp.broadcast_to(jnp.arange(batch["inputs"].shape[1]), batch["inputs"].shape)
    cos, sin = rope.cos_sin(pos, inv_freq)
    x = params["embed"]["embedding"][batch["inputs"]]
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p, cos, sin), None), x, params["layers"])
    logits = _rms(x, params["final_norm"]["scale"], m.norm_eps) @ params["unembed"]
    logz = jax.nn.logsumexp(logits, -1)
    nll = logz - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    return jnp.sum((nll + t.z_loss * logz ** 2) * mask) / jnp.sum(mask), jnp.sum(nll * mask) / jnp.sum(mask)

  def step(state, batch):
    params, mu, nu, count = state
    (_, loss), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
    g = jax.tree.map(lambda x: x * jnp.minimum(1.0, t.clip_norm / norm), g)
    count = count + 1
    mu = jax.tree.map(lambda a, x: t.b1 * a + (1 - t.b1) * x, mu, g)
    nu = jax.tree.map(lambda a, x: t.b2 * a + (1 - t.b2) * x * x, nu, g)
    lr = t.lr

    def update(path, p, a, b):
      u = (a / (1 - t.b1 ** count)) / (jnp.sqrt(b / (1 - t.b2 ** count)) + t.eps)
      name = "/".join(str(k.key) for k in path)
      if not any(s in name for s in t.decay_exclude):
        u = u + t.weight_decay * p
      return p - lr * u

    params = jax.tree_util.tree_map_with_path(update, params, mu, nu)
    return (params, mu, nu, count), loss

  return jax.jit(step, donate_argnums=0)


# ---- peers ----------------------------------------------------------------------------------------------
def torch_step(config, remat: bool, threads: int):
  """transformers' Llama of the same dimensions and a step (forward, backward, clip, AdamW): () -> loss."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  m, t = config.model, config.train
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  hf = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_dim, num_hidden_layers=m.num_layers,
      num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
      max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
      tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa", use_cache=False)
  model = transformers.LlamaForCausalLM(hf)
  model.train()
  if remat:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
  opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps, weight_decay=t.weight_decay)
  tokens = torch.randint(0, m.vocab_size, (t.batch_size, t.seq_len), generator=torch.Generator().manual_seed(0))

  def step():
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
    opt.step()
    return float(loss)

  return step


def maxtext_run(venv: str, config, remat: str, steps: int, workdir: str) -> dict:
  """MaxText 0.2.5 on synthetic data, same model; -> its fastest and median logged step (the first two excluded)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  m, t = config.model, config.train
  out = os.path.join(workdir, f"maxtext_{remat}")
  os.makedirs(out, exist_ok=True)
  args = [os.path.join(venv, "bin", "python"), "-m", "maxtext.trainers.pre_train.train", "run_name=bench",
          f"base_output_directory={out}", "dataset_type=synthetic", f"base_emb_dim={m.d_model}",
          f"base_num_query_heads={m.num_heads}", f"base_num_kv_heads={m.num_kv_heads}", f"base_mlp_dim={m.mlp_dim}",
          f"base_num_decoder_layers={m.num_layers}", f"head_dim={m.head_dim}", f"vocab_size={m.vocab_size}",
          f"per_device_batch_size={t.batch_size}", f"max_target_length={t.seq_len}", f"steps={steps + 2}",
          "enable_checkpointing=false", "attention=dot_product", f"remat_policy={remat}", "dtype=float32",
          "weight_dtype=float32", "enable_goodput_recording=false", "monitor_goodput=false", 'jax_cache_dir=""',
          "log_config=false", f"metrics_file={out}/metrics.jsonl"]
  env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")
  env.pop("PYTHONPATH", None)
  proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    return {"error": proc.stderr[-2000:]}
  with open(f"{out}/metrics.jsonl") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  # Step 0 compiles; MaxText times step 1 before its asynchronously dispatched work has finished (0.04-0.11 s
  # logged, an MFU above 1 at d256), and step 2 absorbs the rest: steps >= 2 are the steady ones.
  times = [r["perf/step_time_seconds"] for r in rows if r.get("step", 0) >= 2]
  return {"step_time_s": min(times), "step_time_median_s": statistics.median(times),
          "tokens_per_sec": t.batch_size * t.seq_len / min(times)}


# ---- measurement -------------------------------------------------------------------------------------------
def _memory(compiled) -> dict[str, int]:
  ma = compiled.memory_analysis()
  return {"argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
          "temp_bytes": int(ma.temp_size_in_bytes)}


def _figures(times, config, peak) -> dict:
  t = config.train
  seconds = min(times)  # the least-disturbed step: other processes only ever add time
  tokens_per_sec = t.batch_size * t.seq_len / seconds
  out = {"step_time_s": seconds, "step_time_median_s": statistics.median(times), "tokens_per_sec": tokens_per_sec}
  out.update({f"{k}_vs_measured_peak": v for k, v in
              mfu_lib.utilisation(tokens_per_sec, config.model, t.seq_len, 1, peak).items()})
  return out


def bench(name: str, overrides: dict, remat: str, steps: int, peak: float, peers: list[str],
          maxtext_venv: str, workdir: str, threads: int, variant: dict | None = None) -> dict:
  config = configs.load("tiny", **overrides, **{"mesh.data": 1, "train.remat": remat})
  t = config.train
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  trainer = step_lib.Trainer(config, mesh)
  out = {"params": step_lib.model_lib.count_params(config.model), "batch": t.batch_size, "seq_len": t.seq_len,
         "remat": remat, "flops_per_token": mfu_lib.flops_per_token(config.model, t.seq_len),
         "meshlm_memory": trainer.memory_analysis()}
  state = trainer.init()
  batches = [trainer.batch_to_device(step_lib.synthetic_batch(config, i, packed=False)) for i in range(steps + 1)]
  steppers = {}

  def meshlm():
    nonlocal state
    state, m = trainer.step_fn(state, batches[len(times["meshlm"]) % len(batches)])
    return float(m["loss"])

  steppers["meshlm"] = meshlm
  if variant:  # meshlm again with some keys changed (--variant), measured in the same alternation
    v_config = configs.load("tiny", **overrides, **{"mesh.data": 1, "train.remat": remat}, **variant)
    v_trainer = step_lib.Trainer(v_config, mesh)
    v_state = [v_trainer.init()]

    def meshlm_variant():
      v_state[0], m = v_trainer.step_fn(v_state[0], batches[len(times["meshlm_variant"]) % len(batches)])
      return float(m["loss"])

    steppers["meshlm_variant"] = meshlm_variant
    out["variant"] = variant
  if "hand_written" in peers:
    hand = hand_written_step(config, remat == "full")
    hand_state = [(jax.tree.map(jnp.copy, state["params"]), jax.tree.map(jnp.zeros_like, state["params"]),
                   jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros((), jnp.int32))]

    def hand_step():
      hand_state[0], loss = hand(hand_state[0], batches[len(times["hand_written"]) % len(batches)])
      return float(loss)

    steppers["hand_written"] = hand_step
  if "torch" in peers:
    steppers["torch"] = torch_step(config, remat == "full", threads)
  times = {who: [] for who in steppers}
  out["first_step_loss"] = {}
  for who, fn in steppers.items():  # compile / warm up
    out["first_step_loss"][who] = fn()
  cpu = {who: [] for who in steppers}
  for _ in range(steps):
    for who, fn in steppers.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      fn()
      times[who].append(time.perf_counter() - start)
      cpu[who].append(time.process_time() - start_cpu)
  if maxtext_venv and remat == "full":  # MaxText between two meshlm blocks
    out["maxtext"] = maxtext_run(maxtext_venv, config, remat, steps, workdir)
    for _ in range(steps):
      start = time.perf_counter()
      meshlm()
      times["meshlm"].append(time.perf_counter() - start)
  for who in times:
    out[who] = _figures(times[who], config, peak)
    # CPU seconds of this process per step (all threads): less sensitive to other jobs than wall time, though a
    # runtime that spins while waiting is charged for it.
    out[who]["cpu_s_per_step"] = min(cpu[who])
    out[who]["tokens_per_cpu_sec"] = t.batch_size * t.seq_len / min(cpu[who])
  if "maxtext" in out and "tokens_per_sec" in out["maxtext"]:
    out["maxtext"].update({f"{k}_vs_measured_peak": v for k, v in mfu_lib.utilisation(
        out["maxtext"]["tokens_per_sec"], config.model, t.seq_len, 1, peak).items()})
  for who in [w for w in out if w in ("torch", "hand_written", "maxtext") and "tokens_per_sec" in out[w]]:
    for me in [m for m in ("meshlm", "meshlm_variant") if m in out]:
      out[f"ratio_{me}_over_{who}"] = out[me]["tokens_per_sec"] / out[who]["tokens_per_sec"]
      if "tokens_per_cpu_sec" in out[who]:
        out[f"cpu_ratio_{me}_over_{who}"] = out[me]["tokens_per_cpu_sec"] / out[who]["tokens_per_cpu_sec"]
  out["products_only"] = products_only(trainer.compiled().as_text())
  out["products_only"]["tokens_per_sec"] = t.batch_size * t.seq_len / out["products_only"]["seconds"]
  if "torch" in out and "tokens_per_sec" in out["torch"]:
    # What 1.2x PyTorch's tokens/s asks of meshlm in this run: an MFU 1.2 times PyTorch's, against the same peak.
    out["mfu_needed_for_1_2x_torch"] = 1.2 * out["torch"]["mfu_vs_measured_peak"]
    # The most any meshlm step could reach in this run: PyTorch's step time over the products' alone.
    out["ceiling_ratio_over_torch"] = out["torch"]["step_time_s"] / out["products_only"]["seconds"]
  out["load_average_after"] = os.getloadavg()
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default="tiny,d256,50m", help="comma-separated subset of " + ",".join(CONFIGS))
  parser.add_argument("--remat", default="none,full", help="remat policies to measure (none, full)")
  parser.add_argument("--steps", type=int, default=4, help="timed steps per implementation (after a warm-up)")
  parser.add_argument("--peers", default="torch,hand_written", help="in-process peers: torch, hand_written")
  parser.add_argument("--maxtext_venv", default="", help="a MaxText 0.2.5 venv: also run MaxText (full remat)")
  parser.add_argument("--workdir", default="/tmp/meshlm_train_step", help="MaxText's output directory")
  parser.add_argument("--threads", type=int, default=os.cpu_count(),
                      help="torch threads; 1 also makes XLA single-threaded (the fair setting on a loaded machine)")
  parser.add_argument("--variant", default="", help="also measure meshlm with these config keys changed, e.g. "
                      "model.scan_layers=false (comma-separated KEY=VALUE; reported as meshlm_variant)")
  args = parser.parse_args()
  variant = dict(kv.split("=", 1) for kv in args.variant.split(",") if kv)  # text, read as --config.KEY=VALUE
  peak = matmul_peak_flops()
  peers = [p for p in args.peers.split(",") if p]
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "matmul_peak_gflops": peak / 1e9,
            "cpu_count": os.cpu_count(), "threads": args.threads, "load_average_before": os.getloadavg(), "configs": {}}
  for name in args.configs.split(","):
    for remat in args.remat.split(","):
      result["configs"][f"{name}/{remat}"] = bench(name, CONFIGS[name], remat, args.steps, peak, peers,
                                                   args.maxtext_venv, args.workdir, args.threads, variant)
      print(json.dumps({f"{name}/{remat}": result["configs"][f"{name}/{remat}"]}), file=sys.stderr, flush=True)
  result["matmul_peak_gflops_after"] = matmul_peak_flops() / 1e9
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
