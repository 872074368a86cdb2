"""Ahead-of-time compilation of the real train step for TPU v4 slices (libtpu's compiler, no TPU attached)."""
import json

import jax
import pytest
from flax import nnx

import model
import configs
from parallel import mesh as mesh_lib
from parallel import sharding
from train.planning import hardware
from train.planning import compile as aot

# A small Llama-style model whose dimensions divide every mesh below; compile time does not depend on depth. The
# reference attention (auto would run splash on TPUs: tests/test_attention_splash.py, test_predict.py), whose
# collectives and memory the figures below follow.
SMALL = {"model.num_layers": 3, "train.seq_len": 64, "model.max_seq_len": 64, "train.batch_size": 16,
         "model.vocab_size": 512, "model.d_model": 128, "model.mlp_dim": 256, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 64, "model.attention_impl": "xla"}
V4_16 = hardware.tpu_slice("v4-16")  # 16 TensorCores = 8 chips, "v4:2x2x2"
# docs/parallel.md's logical -> mesh table (written out here, independently of parallel/rules.py).
DESIGN_RULES = {"embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
                "layers": None, "head_dim": None}


@pytest.fixture(scope="module")
def devices():
  return aot.abstract_devices(V4_16)


def test_topology_names_follow_cloud_tpu_naming():
  # v4-N counts TensorCores (2 per chip), v5e-N counts chips (Cloud TPU documentation's slice tables).
  assert (hardware.tpu_slice("v4-8").topology, hardware.tpu_slice("v4-8").num_chips) == ("v4:2x2x1", 4)
  assert hardware.tpu_slice("v4-32").topology == "v4:2x2x4"
  assert hardware.tpu_slice("v4-128").topology == "v4:4x4x4"
  assert hardware.tpu_slice("v4-4096").topology == "v4:8x16x16"
  assert hardware.tpu_slice("v5p-16").topology == "v5p:2x2x2"
  assert hardware.tpu_slice("v5e-16").topology == "v5e:4x4"
  assert hardware.tpu_slice("v5litepod-256").topology == "v5e:16x16"
  assert hardware.tpu_slice("v4:4x4x12").num_chips == 192
  with pytest.raises(ValueError, match="TensorCores"):
    hardware.tpu_slice("v4-12")


def test_abstract_devices_are_one_per_chip(devices):
  assert len(devices) == 8 and {d.device_kind for d in devices} == {"TPU v4"}
  two = aot.abstract_devices(hardware.tpu_slice("v4-8", num_slices=2))
  assert len(two) == 8 and {d.slice_index for d in two} == {0, 1}


def _compile(devices, **mesh):
  config = configs.load("tiny", **SMALL, **{"mesh.data": 1, **{f"mesh.{k}": v for k, v in mesh.items()}})
  trainer, compiled = aot.compile_trainer(config, devices)
  return config, trainer, compiled


def _check_parameters_are_sharded_as_the_rules_say(config, compiled, mesh):
  abstract = nnx.eval_shape(lambda: model.Transformer(config.model, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  compiled_params = compiled.input_shardings[0][0]["params"]
  hlo = compiled.as_text().split("ENTRY", 1)[1]
  for path, var in leaves:
    names = var.get_metadata()["out_sharding"]
    expected = tuple(DESIGN_RULES[n] for n in names)
    sharding = compiled_params
    for key in path:
      sharding = sharding[key.key]
    got = tuple(sharding.spec) + (None,) * (len(names) - len(sharding.spec))
    assert got == expected, (path, names, got)
    # The compiled program's entry parameters have the per-chip shard shape.
    shard = [d // (mesh[a] if a else 1) for d, a in zip(var.shape, expected)]
    assert f"f32[{','.join(map(str, shard))}]" in hlo, (path, shard)
  assert len(leaves) >= 10


def _activation_all_reduces(config, compiled, rows_per_device):
  """All-reduces of a [rows, seq_len, d_model] float32 activation, with executions per step."""
  shape = f"f32[{rows_per_device},{config.train.seq_len},{config.model.d_model}]"
  ops = aot.collective_ops(compiled.as_text())
  return [op for op in ops if op["kind"] == "all-reduce" and shape in op["shapes"]]


def test_data_parallel_step_report(devices):
  config, trainer, compiled = _compile(devices, data=8)
  # One all-reduce of the full gradient (4 bytes per parameter) and no activation collectives.
  stats = aot.collectives(compiled.as_text())
  assert set(stats) == {"all-reduce"}
  grad_bytes = 4 * model.count_params(config.model)["total"]
  assert grad_bytes <= stats["all-reduce"]["bytes_per_step"] <= grad_bytes * 1.001
  assert _activation_all_reduces(config, compiled, 2) == []
  r = aot.summarize(config, V4_16, trainer, seconds=0.0)
  assert r["fits"] and r["num_devices"] == 8 and r["chip"] == "tpu_v4" and r["collectives"] == stats
  per_chip = model.flops_per_token(config.model, 64) * 16 * 64 / 8  # global batch 16 x 64 tokens on 8 chips
  assert r["flops"]["model_per_chip"] == pytest.approx(per_chip)
  assert r["flops"]["compiled_per_chip"] > 0
  m = r["memory"]
  # Arguments hold the state (params + 2 Adam moments, fp32, replicated) and the batch.
  params = model.count_params(config.model)["total"]
  state = 3 * 4 * params
  assert state <= m["argument_bytes"] <= state * 1.05
  # The total holds at least the state and the float32 gradient, and no more than the compiler's own peak
  # (buffer assignment's figure, computed apart from the sizes the report adds up) plus the code.
  assert state + 4 * params <= m["total_bytes"]
  assert m["total_bytes"] <= compiled.memory_analysis().peak_memory_in_bytes + m["generated_code_bytes"]
  json.dumps(r)


def test_tensor_parallel_steps_follow_the_rules_and_bring_megatron_all_reduces(devices):
  # Tensor parallelism (Megatron): in every layer the attention and MLP outputs are all-reduced in the forward
  # pass and their input gradients in the backward pass: 4 all-reduces per layer (ops inside the scan over
  # layers, executed num_layers times), each of one [rows per device, seq_len, d_model] float32 activation, so
  # their size follows the data-parallel split of the batch (16 rows over fsdp=4, then over fsdp=2).
  for fsdp, tensor in ((4, 2), (2, 4)):
    config, _, compiled = _compile(devices, fsdp=fsdp, tensor=tensor)
    if tensor == 2:  # every dimension divides its mesh axis here
      _check_parameters_are_sharded_as_the_rules_say(config, compiled, {"fsdp": fsdp, "tensor": tensor})
    rows, L = 16 // fsdp, config.model.num_layers
    per_layer = [op for op in _activation_all_reduces(config, compiled, rows) if op["per_step"] == L]
    assert len(per_layer) == 4, (fsdp, tensor, per_layer)
    assert {op["bytes"] for op in per_layer} == {rows * config.train.seq_len * config.model.d_model * 4}
    assert "all-gather" in aot.collectives(compiled.as_text())  # FSDP gathers the sharded weights before use


def test_multi_slice_data_parallelism_crosses_dcn(capsys):
  # Two v4-8 slices; with no DCN axes in the config, data parallelism spans the slices (mesh.dcn_data=2):
  # the gradient all-reduce then crosses the data-centre network, which libtpu lowers to megascale transfers.
  argv = ["--config=tiny", "--topology=v4-8", "--num_slices=2", "--json",
          *[f"--config.{k}={v}" for k, v in SMALL.items()]]
  assert aot.main(argv) == 0
  r = json.loads(capsys.readouterr().out)
  assert r["num_devices"] == 8 and r["num_slices"] == 2 and r["mesh"]["data"] == 8
  assert r["collectives"]["dcn-all-reduce"]["per_step"] >= 1


def test_too_large_is_reported_with_a_suggestion_that_fits(capsys):
  # 4096 layers keep every op small (cheap to compile) while the saved activations of all layers exceed a v4
  # chip's HBM without remat, by more than the TPU compiler's own rematerialisation can recover; with full remat
  # only each layer's input is kept. One search compile (the budget) proves the suggestion fits; with a larger
  # budget the search goes on to lighter policies.
  big = {**SMALL, "model.num_layers": 4096, "train.batch_size": 128, "mesh.data": 1, "mesh.fsdp": 8}
  argv = ["--config=tiny", "--topology=v4-16", "--json", "--max_compiles=1",
          *[f"--config.{k}={v}" for k, v in big.items()]]
  assert aot.main(argv) == 1
  r = json.loads(capsys.readouterr().out)
  assert not r["fits"]
  m = r["memory"]
  assert "RESOURCE_EXHAUSTED" in m["error"] and m["total_bytes"] > m["available_bytes"]
  assert r["estimate"]["total_bytes"] > 32 * 2**30  # the planner agrees before compiling
  s = r["suggestion"]
  assert s["found"] and (s["remat"], s["grad_accum"]) != ("none", 1)
  assert s["tried"] == [{"remat": s["remat"], "grad_accum": s["grad_accum"], "fits": True,
                         "total_bytes": s["report"]["memory"]["total_bytes"],
                         "step_seconds": s["report"]["predicted"]["step_seconds"]}]
  assert s["report"]["fits"] and s["report"]["memory"]["total_bytes"] <= 32 * 2**30
  assert s["micro_batch"] * s["grad_accum"] == 128


def test_missing_tpu_compiler_is_a_clear_error_not_a_traceback(monkeypatch, capsys):
  monkeypatch.setattr(aot, "_libtpu_installed", lambda: False)
  assert aot.main(["--config=tiny", "--topology=v4-8"]) == 2
  err = capsys.readouterr().err
  assert "TPU compiler" in err and "Traceback" not in err
  # both ways to install it keep to the pinned versions
  assert err.count("pip install -c constraints.txt") == 2 and "-e '.[tpu]'" in err


def test_fit_search_keeps_every_remat_policy(monkeypatch):
  # A policy without an activation estimate in train/planning/memory.py is still searched (before `full`), with a warning.
  from model import remat
  monkeypatch.setitem(remat.POLICIES, "save_everything_but_scores", remat.POLICIES["save_dots"])
  config = configs.load("tiny", **SMALL)
  sizes = {"data": 8, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1, "stage": 1}
  with pytest.warns(UserWarning, match="save_everything_but_scores"):
    order = aot._policies_light_to_heavy(config, sizes)
  assert set(order) == set(remat.POLICIES) and order[-2:] == ["save_everything_but_scores", "full"]


def test_fit_search_suggests_the_predicted_fastest_policy_that_fits(monkeypatch):
  # A stand-in compiler (the search's own logic is under test): every policy but `none` fits, and `full` is
  # predicted fastest, so the lightest fitting policy is not the one to suggest.
  def compile_step(config, tpu, devices):
    remat = config.train.remat
    return {"fits": remat != "none", "memory": {"total_bytes": 1},
            "predicted": {"step_seconds": 1.0 if remat == "full" else 2.0 + len(remat) / 100}}

  monkeypatch.setattr(aot, "compile_step", compile_step)
  s = aot.suggest(configs.load("tiny", **SMALL), V4_16, devices=list(range(8)))
  fitting = [t for t in s["tried"] if t["fits"]]
  assert s["found"] and any(t["remat"] != "full" for t in fitting)  # a lighter policy fitted too
  assert s["remat"] == "full" and s["report"]["predicted"]["step_seconds"] == min(t["step_seconds"] for t in fitting)


def test_fastest_search_picks_the_quickest_layout_that_fits(devices):
  config = configs.load("tiny", **SMALL)
  search = aot.fastest(config, V4_16, max_compiles=3, devices=devices, remats=("none", "full"))
  fitting = [t for t in search["tried"] if t["fits"]]
  assert search["found"] and len(search["tried"]) == 3
  assert search["report"]["predicted"]["step_seconds"] == min(t["step_seconds"] for t in fitting)
  winner = search["overrides"]
  assert search["report"]["mesh"]["tensor"] == winner["mesh.tensor"] and search["report"]["remat"] == winner[
      "train.remat"]
  # Candidates come least-recompute first: remat none is compiled before full.
  assert search["tried"][0]["overrides"]["train.remat"] == "none"


def test_fastest_search_on_a_multi_host_slice_compiles_only_layouts_that_can_run(capsys):
  # v4-32 is 4 hosts x 4 chips. With 8 heads the candidates include tensor=8, which spans two hosts: they would
  # share batch rows, which training rejects. The search used to compile such a layout and die on it (exit 2);
  # now it rules it out before compiling, reports it with the reason, and ends with the fastest that can run.
  # A micro-batch of 8 leaves three meshes (tensor 2, 4, 8 with fsdp over the rest); two compiles suffice.
  over = {**SMALL, "model.num_heads": 8, "model.num_kv_heads": 8, "model.head_dim": 16, "train.batch_size": 8}
  argv = ["--config=tiny", "--topology=v4-32", "--fastest", "--json", "--max_compiles=2",
          *[f"--config.{k}={v}" for k, v in over.items()]]
  assert aot.main(argv) == 0
  r = json.loads(capsys.readouterr().out)
  search = r["fastest"]
  assert search["found"] and r["fits"] and len(search["tried"]) == 2
  assert {(o["mesh.tensor"], o["mesh.fsdp"]) for o in (t["overrides"] for t in search["tried"])} == {(2, 8), (4, 4)}
  assert r["mesh"]["tensor"] == search["overrides"]["mesh.tensor"]
  devices = aot.abstract_devices(hardware.tpu_slice("v4-32"))
  assert len({d.process_index for d in devices}) == 4

  def rows_per_process(overrides):
    """The training-time check (parallel.sharding) on the mesh the layout builds; its message, or None."""
    config = configs.load("tiny", **over, **overrides)
    try:
      sharding.check_rows_per_process(mesh_lib.make_mesh(config.mesh, devices=devices), ("data", "fsdp", "expert"))
    except ValueError as e:
      return str(e)
    return None

  assert all(rows_per_process(t["overrides"]) is None for t in search["tried"])
  skipped = search["skipped"]
  assert skipped and {s["overrides"]["mesh.tensor"] for s in skipped} == {8}
  for s in skipped:
    assert "tensor=8 spans processes" in s["reason"] and s["reason"] == rows_per_process(s["overrides"])
  table = aot.format_report(r)
  assert "skipped before compiling" in table and "tensor=8   remat=none       mesh axis tensor=8 spans" in table
  assert "fastest that fits: --config.mesh.data=1" in table


def test_local_topology_needs_a_known_accelerator(capsys):
  # On this CPU machine the attached devices are CPUs: no data-sheet peak, so no prediction (GPUs are listed).
  assert aot.main(["--config=tiny", "--topology=local"]) == 2
  assert "device kind" in capsys.readouterr().err


def test_continuation_fusion_is_asked_of_tpu_v5e_only():
  """train.xla_overlap: every TPU gets the async-collective and data-parallel overlap options, only a v5e (the
  generation libtpu 0.0.50 allows it on) also continuation fusion; read off the compile-only devices' kinds."""
  from train.core import step  # pylint: disable=g-import-not-at-top
  by_slice = {name: step.overlap_options(aot.abstract_devices(hardware.tpu_slice(name))[0])
              for name in ("v5e-4", "v6e-4", "v5p-8", "v4-8")}
  for name, options in by_slice.items():
    assert step.OVERLAP_OPTIONS["tpu"].items() <= options.items(), name
    fused = step.CONTINUATION_FUSION.items() <= options.items()
    assert fused == (name == "v5e-4"), name


def test_tpu_start_up_warnings_stay_off_the_console():
  """On a CPU-only host with libtpu installed, `python -m train.step` pins JAX to the CPU before it starts (as
  `python -m train` does) and the TPU compiler's topology for ahead-of-time compilation starts without libtpu's
  'no TPU host' warnings."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if not aot._libtpu_installed():  # pylint: disable=protected-access
    pytest.skip("libtpu (the TPU compiler) is not installed")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS") and not k.startswith("TPU_")}
  noise = ("INVALID_ARGUMENT", "could not determine TPU")
  step = subprocess.run([sys.executable, "-m", "train.step", "--config=tiny", "--config.train.steps=1"], cwd=repo,
                        env=env, capture_output=True, text=True, timeout=300)
  assert step.returncode == 0, step.stderr[-2000:]
  assert not any(n in step.stderr for n in noise), step.stderr[-2000:]
  topology = subprocess.run([sys.executable, "-c", "from train.planning import compile as aot, hardware; "
                             "print(len(aot.abstract_devices(hardware.tpu_slice('v5e-4'))))"], cwd=repo,
                            env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  assert topology.stdout.strip() == "4" and not any(n in topology.stderr for n in noise), topology.stderr[-2000:]
