"""The planner: Chinchilla sizes against Hoffmann et al. 2022, PF-days, memory accounting, and the activation
estimate against the compiled train step."""
import json

import jax
import numpy as np
import pytest

import model
from parallel import mesh as mesh_lib
import configs
from train.planning import memory

# Hoffmann et al. 2022, Table 3 (approach 1): parameters -> (FLOPs, tokens).
from train.planning import plan

# Hoffmann et al. 2022, Table 3 (approach 1): parameters -> (FLOPs, tokens).
from train.core import step

# Hoffmann et al. 2022, Table 3 (approach 1): parameters -> (FLOPs, tokens).
TABLE3 = [(400e6, 1.92e19, 8.0e9), (1e9, 1.21e20, 20.2e9), (10e9, 1.23e22, 205.1e9), (67e9, 5.76e23, 1.5e12),
          (175e9, 3.85e24, 3.7e12), (280e9, 9.90e24, 5.9e12), (520e9, 3.43e25, 11.0e12), (1e12, 1.27e26, 21.2e12),
          (10e12, 1.30e28, 216.2e12)]


@pytest.mark.parametrize("params,flops,tokens", TABLE3)
def test_approach1_reproduces_table3(params, flops, tokens):
  opt = plan.optimum(params=params)["approach1"]
  assert opt["tokens"] == pytest.approx(tokens, rel=0.10)
  assert opt["flops"] == pytest.approx(flops, rel=0.10)
  n, d = plan.approach1_from_flops(flops)  # and back from the budget
  assert n == pytest.approx(params, rel=0.10) and d == pytest.approx(tokens, rel=0.10)


def test_approach3_closed_form_matches_brute_force_minimum():
  # Minimise L(N, C / 6N) over a fine grid of N (independent of the closed form).
  for flops in (1e20, 3.85e24, 1e26):
    grid = np.logspace(6, 14, 200_001)
    losses = plan.E + plan.A / grid**plan.ALPHA + plan.B / (flops / (6 * grid))**plan.BETA
    n_best = grid[np.argmin(losses)]
    n, d = plan.approach3_from_flops(flops)
    assert n == pytest.approx(n_best, rel=1e-3)
    assert 6 * n * d == pytest.approx(flops)
    assert plan.loss(n, d) == pytest.approx(losses.min(), rel=1e-9)
  # The same optimum reached from its size or its dataset.
  n, d = plan.approach3_from_flops(1e23)
  assert plan.optimum(params=n)["approach3"]["tokens"] == pytest.approx(d)
  assert plan.optimum(tokens=d)["approach3"]["params"] == pytest.approx(n)


def test_gpt3_pf_days():
  # Brown et al. 2020: GPT-3 175B on 300B tokens took 3.14e23 FLOPs, "3,640 PF-days".
  r = plan.allocation(175e9, 300e9)
  assert r["flops"] == pytest.approx(3.15e23, rel=0.01)
  assert r["pf_days"] == pytest.approx(3640, rel=0.01)
  assert r["training"] == "under-trained" and r["tokens_per_param"] == pytest.approx(300 / 175)


def test_one_billion_parameters_memory():
  fp32 = memory.state_memory(1e9, "fp32")
  assert fp32["weights"] == 4e9  # 4 GB of fp32 weights
  assert memory.state_memory(1e9, "seeds")["total"] == 24e9  # weights + 20 bytes per parameter
  assert memory.state_memory(1e9, "bf16_mixed")["weights"] == 2e9
  assert fp32["total"] == 16e9  # AdamW: weights 4 + gradients 4 + two moments 8
  # ZeRO stages over 8 fsdp ranks shard optimizer state, then gradients, then weights.
  z = {k: memory.state_memory(1e9, "fp32", zero_stage=k, fsdp=8) for k in range(4)}
  assert [z[k]["total"] for k in range(4)] == [16e9, 4e9 + 4e9 + 1e9, 4e9 + 0.5e9 + 1e9, 2e9]


def _run(argv, capsys):
  assert plan.main(argv) == 0
  return json.loads(capsys.readouterr().out)


def test_cli_modes(capsys):
  r = _run(["--params", "1B", "--json"], capsys)
  for key in ("params", "tokens", "flops", "pf_days", "loss"):
    assert key in r
  assert r["tokens"] == pytest.approx(20.2e9) and r["approach3"]["params"] == pytest.approx(1e9)
  r = _run(["--tokens", "1.4T", "--json"], capsys)  # the dataset decides the model (Chinchilla: 70B, 1.4T)
  assert r["params"] == pytest.approx(70e9, rel=0.02)
  r = _run(["--params", "175B", "--tokens", "300B", "--json"], capsys)
  assert r["pf_days"] == pytest.approx(3640, rel=0.01) and r["training"] == "under-trained"
  # 1,024 v4 chips for 10 days at 40% MFU: 275 TFLOP/s each.
  r = _run(["--chip", "tpu_v4", "--chips", "1024", "--days", "10", "--mfu", "0.4", "--json"], capsys)
  assert r["flops"] == pytest.approx(275e12 * 1024 * 10 * 86400 * 0.4)
  with pytest.raises(SystemExit):
    plan.main(["--params", "7B", "--flops", "1e21"])


def test_config_plan(capsys):
  r = _run(["--config=tiny", "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
            "--chips=8", "--chip=v5e", "--json"], capsys)
  config = configs.load("tiny")
  counts = model.count_params(config.model)
  t = config.train
  tokens = t.steps * t.batch_size * t.seq_len
  assert r["params"] == counts["total"] and r["params_non_embedding"] == counts["non_embedding"]
  assert r["flops"] == pytest.approx(model.flops_per_token(config.model, t.seq_len) * tokens)
  assert r["wall_days"] == pytest.approx(r["flops"] / (8 * 197e12 * 0.4) / 86400)
  # meshlm keeps fp32 weights, gradients and both Adam moments, sharded over fsdp x tensor = 8, and Adam's int32
  # step counter on every device.
  assert r["state"]["meshlm"]["total"] == pytest.approx(16 * counts["total"] / 8 + 4, rel=1e-9)
  # The largest micro-batch (a closed form: the HBM left after the state, divided by one sequence per rank's
  # activations) against brute force: plans of the run at that batch and one step of 4 (the data ranks) more.
  hbm = 16 * 2**30
  best = r["per_chip"]["tpu_v5e"]["max_micro_batch"]["none"]

  def planned(batch):
    cfg = configs.load("tiny", **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2, "train.remat": "none",
                                  "train.batch_size": batch})
    return plan.plan_config(cfg, chip="v5e", num_devices=8)["memory_per_device"]

  assert best % 4 == 0 and planned(best) <= hbm < planned(best + 4)


FIFTY_M = {"model.d_model": 512, "model.num_layers": 8, "model.num_heads": 8, "model.num_kv_heads": 4,
           "model.head_dim": 64, "model.mlp_dim": 2048, "model.vocab_size": 16000, "model.max_seq_len": 512,
           "train.seq_len": 512}


# Multi-head latent attention (DeepSeek-V3's, with q LoRA): its latents and per-head expansions are counted.
MLA = {"model.attention_type": "mla", "model.q_lora_rank": 48, "model.kv_lora_rank": 64,
       "model.qk_nope_head_dim": 32, "model.qk_rope_head_dim": 16, "model.v_head_dim": 32}


@pytest.mark.parametrize("overrides", [{}, FIFTY_M, MLA], ids=["tiny", "50M", "mla"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_activation_estimate_matches_compiled_step(overrides, remat):
  """The estimate vs the compiled step's temporaries (Trainer.memory_analysis()["temp_bytes"], per device).

  Temporaries are the activations kept for the backward pass and the backward's working set, plus
  batch-independent buffers (gradients, the optimizer update: ~1.5x the parameter bytes). With 16 sequences per
  device the activations dominate, so the temporaries are the figure the activation estimate must match.
  """
  config = configs.load("tiny", **overrides, **{"train.remat": remat, "train.batch_size": 128})
  mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices())
  assert mesh.shape["data"] == 8
  compiled = step.Trainer(config, mesh).memory_analysis()["temp_bytes"]
  estimate = memory.activation_memory(config, 128, sizes=dict(mesh.shape))["total"]
  # A planning bound: never more than 25% under the compiled figure; up to 30% over it (XLA:CPU's backward with
  # the flattened projections frees the recomputed layer's tensors sooner than the model assumes, remat=full tiny).
  assert 0.75 * compiled <= estimate <= 1.30 * compiled
  assert model.count_params(config.model)["total"] * 4 * 2 < 0.25 * compiled  # activations dominate


def test_latent_attention_activations_are_counted():
  """What MLA adds to a layer's saved tensors over tiny's attention (its latents, one kernel width for q, k, v):
  the estimated difference within 25% of the compiled temporaries' difference (remat none, 16 sequences a device)."""
  def both(overrides):
    config = configs.load("tiny", **overrides, **{"train.remat": "none", "train.batch_size": 128})
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices())
    return (step.Trainer(config, mesh).memory_analysis()["temp_bytes"],
            memory.activation_memory(config, 128, sizes=dict(mesh.shape))["total"])
  (compiled_mha, est_mha), (compiled_mla, est_mla) = both({}), both(MLA)
  assert compiled_mla - compiled_mha > 0.05 * compiled_mha  # a difference worth modelling
  assert est_mla - est_mha == pytest.approx(compiled_mla - compiled_mha, rel=0.25)


def test_table_columns_stay_apart(capsys):
  # Llama-2-7B on 16 chips without remat, 4x the batch, needs > 1000 GiB of activations: wide numbers must not
  # run together.
  argv = ["--config=llama2_7b", "--chip=tpu_v4", "--chips=16", "--config.mesh.data=2", "--config.mesh.fsdp=8",
          "--config.model.dtype=bfloat16", "--config.train.batch_size=1024",
          "--config.model.attention_impl=xla"]  # its [T, T] scores (auto runs splash on TPUs, which keeps none)
  r = _run(argv + ["--json"], capsys)
  assert plan.main(argv) == 0
  table = capsys.readouterr().out.splitlines()
  for name, a in r["activations"].items():
    (row,) = [line for line in table if line.split()[:2] == ["remat", name]]
    cells = [float(x) for x in row.split()[2:]]
    expected = [a[k] / 2**30 for k in ("per_layer_saved", "layers", "recompute_peak", "logits", "total", "host")]
    assert cells == pytest.approx(expected, abs=1e-3)
  assert r["activations"]["none"]["total"] > 1000 * 2**30


def test_help_names_config_and_overrides(capsys):
  with pytest.raises(SystemExit) as e:
    plan.main(["--help"])
  assert e.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  assert "--config=FILE" in out and "--config.SECTION.KEY=VALUE" in out


def test_each_approach_optimum_is_labelled_compute_optimal():
  opt = plan.optimum(flops=1e23)
  a3 = opt["approach3"]
  assert a3["tokens_per_param"] > 20.2 * 1.25  # more tokens per parameter than approach 1's ratio ...
  assert a3["training"] == "compute-optimal"  # ... yet approach 3's own optimum
  assert opt["approach1"]["training"] == "compute-optimal"


def test_json_numbers_are_exact(capsys):
  assert plan.main(["--params", "7B", "--tokens", "1.4T", "--json"]) == 0
  text = capsys.readouterr().out
  r = json.loads(text)
  assert r["params"] == 7e9 and r["tokens"] == 1.4e12 and r["flops"] == 6 * 7e9 * 1.4e12
  assert "000001" not in text and "999999" not in text


def test_scale_reports_the_fastest_compiled_layout_per_size(capsys):
  # One compile per size: choosing the quickest of several compiled layouts is train.planning.compile.fastest's, tested in
  # tests/test_compile.py; here each size's row must come from its own search, topology and token count.
  r = _run(["--config=tiny", "--config.model.dtype=bfloat16", "--chip=tpu_v5e", "--scale", "4,8",
            "--max_compiles=1", "--json"], capsys)
  rows = r["scaling"]
  assert [row["chips"] for row in rows] == [4, 8] and [row["topology"] for row in rows] == ["v5e:2x2", "v5e:2x4"]
  for row in rows:
    fitting = [t for t in row["tried"] if t["fits"]]
    assert row["found"] and row["step_seconds"] == pytest.approx(min(t["step_seconds"] for t in fitting))
    tokens = row["batch_size"] * 128 / row["chips"]  # tiny: seq_len 128
    assert row["tokens_per_sec_per_chip"] == pytest.approx(tokens / row["step_seconds"])
