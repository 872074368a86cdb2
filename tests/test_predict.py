"""The performance model (train/planning/predict.py) against closed forms: a matmul's roofline, ring collectives, and
the cost of recomputation; programs compiled for TPU v4 by libtpu on this CPU machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import configs
from model import remat
from train.planning import compile as aot
from train.planning import hardware
from train.planning import hlo
from train.planning import predict

V4_16 = hardware.tpu_slice("v4-16")  # 8 chips, torus 2x2x2
V4 = hardware.CHIPS["tpu_v4"]
SMALL = {"model.num_layers": 3, "train.seq_len": 64, "model.max_seq_len": 64, "train.batch_size": 16,
         "model.vocab_size": 512, "model.d_model": 128, "model.mlp_dim": 256, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 64, "mesh.data": 1, "mesh.fsdp": 8, "model.dtype": "bfloat16"}


@pytest.fixture(scope="module")
def devices():
  return aot.abstract_devices(V4_16)


def test_single_large_matmul_costs_flops_over_peak(devices):
  m, k, n = 4096, 8192, 2048
  mesh = Mesh(np.array(devices), ("x",))
  rep = NamedSharding(mesh, P())
  compiled = jax.jit(lambda a, b: a @ b).lower(jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=rep),
                                              jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=rep)).compile()
  flops = 2 * m * k * n  # every chip computes the whole (replicated) product
  p = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=flops,
                      tokens_per_chip=1, efficiency=1.0)
  assert p["hardware_flops_per_chip"] == pytest.approx(flops, rel=1e-6)
  assert p["step_seconds"] == pytest.approx(flops / 275e12, rel=1e-3)
  assert p["compute_seconds"] == pytest.approx(p["step_seconds"]) and p["memory_bound_seconds"] == 0
  assert p["mfu"] == pytest.approx(1.0, rel=1e-3) and p["collective_seconds"] == 0
  # The efficiency factor scales FLOP-bound time only.
  half = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=flops,
                         tokens_per_chip=1, efficiency=0.5)
  assert half["step_seconds"] == pytest.approx(2 * flops / 275e12, rel=1e-3)


def test_memory_bound_kernel_costs_bytes_over_bandwidth(devices):
  mesh = Mesh(np.array(devices), ("x",))
  rep = NamedSharding(mesh, P())
  shape = (4096, 4096)
  compiled = jax.jit(lambda a: a * 2.0).lower(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)).compile()
  nbytes = 2 * 4 * shape[0] * shape[1]  # read and write one float32 array
  p = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=0,
                      tokens_per_chip=1)
  assert p["memory_bound_seconds"] == pytest.approx(nbytes / 1200e9, rel=1e-3)
  assert p["compute_seconds"] == 0


def test_ring_collective_time_follows_bytes_and_group_size(devices):
  # A v4 link moves 50 GB/s each way; a bidirectional ring over each torus axis the group spans.
  link = 50e9
  for group, axes in ((2, 1), (4, 2), (8, 3)):
    bw = predict.ring_bandwidth(group, V4, V4_16.torus)
    assert bw == 2 * axes * link
    for nbytes in (1e6, 1e9):
      ag = predict.collective_seconds("all-gather", nbytes, group, bw)
      assert ag == pytest.approx((group - 1) / group * nbytes / (2 * axes * link))
      assert predict.collective_seconds("all-reduce", nbytes, group, bw) == pytest.approx(2 * ag)
      # a reduce-scatter's result is the 1/group shard of the same array
      assert predict.collective_seconds("reduce-scatter", nbytes / group, group, bw) == pytest.approx(ag)
  assert predict.collective_seconds("all-gather", 1e9, 1, 1e9) == 0
  # GPUs: NVLink inside the 8-GPU node, InfiniBand beyond it.
  h100 = hardware.CHIPS["h100"]
  assert predict.ring_bandwidth(8, h100) == 450e9 and predict.ring_bandwidth(16, h100) == 50e9


def test_compiled_all_gather_is_timed_by_the_ring_formula(devices):
  # Gathering a float32 [8, 1024, 1024] array sharded over the 8 chips of a 2x2x2 torus.
  mesh = Mesh(np.array(devices), ("x",))
  x = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  compiled = jax.jit(lambda a: a * 2.0, out_shardings=NamedSharding(mesh, P())).lower(x).compile()
  (op,) = hlo.collective_ops(compiled.as_text(), 8)
  full = 8 * 1024 * 1024 * 4
  assert (op["kind"], op["group"], op["bytes"], op["per_step"]) == ("all-gather", 8, full, 1)
  p = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=0,
                      tokens_per_chip=1)
  assert p["collective_seconds"] == pytest.approx(7 / 8 * full / (3 * 2 * 50e9))
  assert p["exposed_collective_seconds"] == pytest.approx(p["collective_seconds"])  # synchronous: not hidden


@pytest.fixture(scope="module")
def remat_reports(devices):
  out = {}
  for remat in ("none", "full"):
    config = configs.load("tiny", **SMALL, **{"train.remat": remat})
    out[remat] = aot.compile_step(config, V4_16, devices)
  return out


def test_predicted_time_grows_with_recomputation(remat_reports):
  none, full = remat_reports["none"]["predicted"], remat_reports["full"]["predicted"]
  assert full["step_seconds"] > none["step_seconds"]
  # Full remat runs each layer's forward again: its matmuls add about a third of the layers' training FLOPs.
  assert full["hardware_flops_per_chip"] > 1.1 * none["hardware_flops_per_chip"]
  model_flops = remat_reports["none"]["flops"]["model_per_chip"]
  assert none["hardware_flops_per_chip"] >= 0.9 * model_flops
  for p, r in ((none, remat_reports["none"]), (full, remat_reports["full"])):
    tokens = r["batch_size"] * r["seq_len"] / r["num_devices"]
    assert p["tokens_per_sec_per_chip"] == pytest.approx(tokens / p["step_seconds"])
    assert p["mfu"] == pytest.approx(model_flops / (p["step_seconds"] * 275e12))
    assert p["uncosted_kernels"] == 0 and len(p["top_ops"]) == 10


# ---- custom calls: Mosaic kernels costed by their closed forms ----------------------------------------------
def test_visible_tiles_are_the_tiles_the_mask_touches():
  from model import splash  # pylint: disable=g-import-not-at-top
  for T, bq, bk in ((512, 128, 128), (768, 128, 256), (1024, 256, 128)):
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    for mask, visible in (("full", np.ones((T, T), bool)), ("causal", q >= k), ("local100", (q >= k) & (q - k < 100)),
                          ("local300", (q >= k) & (q - k < 300))):
      tiles = visible.reshape(T // bq, bq, T // bk, bk).any(axis=(1, 3)).sum()
      assert splash.visible_tiles(T, T, bq, bk, mask) == tiles, (T, bq, bk, mask)


@pytest.fixture(scope="module")
def v5e_programs():
  """The tiny step compiled for a v5e-4 with splash and with xla attention: (HLO text, report) each."""
  tpu = hardware.tpu_slice("v5e-4")
  devices = aot.abstract_devices(tpu)
  out = {}
  for impl in ("splash", "xla"):
    config = configs.load("tiny", **{"model.attention_impl": impl})
    trainer, compiled = aot.compile_trainer(config, devices)
    out[impl] = compiled.as_text(), aot.summarize(config, tpu, trainer, seconds=0.0)
  return out


def test_splash_kernels_are_costed_by_their_closed_forms(v5e_programs):
  """XLA sees a Mosaic kernel as zero work; the model prices each splash kernel (forward, dq, dk/dv) in closed form,
  so the splash program's FLOPs equal the xla program's but for the kernels' recomputation."""
  text, report = v5e_programs["splash"]
  kernels = [k for k in predict.kernel_costs(text) if k["opcode"] == "custom-call"]
  assert sorted(k["name"].split(".")[0] for k in kernels) == [
      "splash_mqa_dkv_segmented_no_residuals", "splash_mqa_dq_segmented_no_residuals",
      "splash_mqa_fwd_segmented_residuals"]
  assert all(k["costed"] and "splash_mask_causal" in k["op_name"] for k in kernels)
  # tiny: 16 rows over 4 chips, 4 heads, T = 128 (one 128-token tile, computed whole), head_dim 32, 4 layers;
  # 4 + 6 + 8 matmul FLOPs per visible pair and head_dim unit (model.splash.KERNEL_MATMULS).
  assert sum(k["flops"] * k["per_step"] for k in kernels) == 18 * 4 * 4 * 128 * 128 * 32 * 4
  xla_text, xla_report = v5e_programs["xla"]
  splash_p, xla_p = report["predicted"], xla_report["predicted"]
  assert splash_p["uncosted_kernels"] == 0 and xla_p["uncosted_kernels"] == 0
  # xla: 12 units (forward q.k and p.v, four backward products; XLA's own online-softmax kernel priced too) vs
  # splash's 18: attention is about a tenth of this model's FLOPs, so the programs differ by about 5%.
  assert 1.0 < splash_p["hardware_flops_per_chip"] / xla_p["hardware_flops_per_chip"] < 1.07
  assert xla_p["hardware_flops_per_chip"] >= report["flops"]["model_per_chip"]


def test_an_unknown_custom_call_counts_as_uncosted():
  text = """HloModule m

ENTRY %main (p0: f32[256,256]) -> f32[256,256] {
  %p0 = f32[256,256]{1,0} parameter(0)
  ROOT %mystery_kernel.1 = f32[256,256]{1,0} custom-call(%p0), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128}"
}}, metadata={op_name="jit(f)/mystery_kernel/pallas_call"}, backend_config={"custom_call_config":{"body":"AAAA"}}
}
"""
  (kernel,) = predict.kernel_costs(text)
  assert kernel["name"] == "mystery_kernel.1" and "mystery_kernel/pallas_call" in kernel["op_name"]
  assert not kernel["costed"] and kernel["flops"] == 0 and kernel["bytes"] == 2 * 256 * 256 * 4
  p = predict.predict(text, V4, num_devices=1, model_flops_per_chip=1, tokens_per_chip=1)
  assert p["uncosted_kernels"] == 1


def _grouped_call(name: str, rhs: str, out: str) -> str:
  return f"""HloModule m

ENTRY %main (p0: bf16[512,256], p1: {rhs}, p2: s32[4]) -> {out} {{
  %p0 = bf16[512,256]{{1,0}} parameter(0)
  %p1 = {rhs}{{2,1,0}} parameter(1)
  %p2 = s32[4]{{0}} parameter(2)
  ROOT %{name} = {out}{{1,0}} custom-call(%p2, %p0, %p1), custom_call_target="tpu_custom_call"
}}
"""


@pytest.mark.parametrize("name", ["gmm.3", "ragged-dot-none.1"])
@pytest.mark.parametrize("rhs, out", [("bf16[4,256,128]", "bf16[512,128]"),  # rhs [E, X, Y]
                                      ("bf16[4,128,256]", "bf16[512,128]")])  # transposed: the rows' gradient
def test_grouped_matmul_kernels_cost_each_row_against_its_own_group(name, rhs, out):
  """megablox's gmm and XLA:TPU's ragged-dot kernel, rhs plain or transposed: 2·M·X·Y FLOPs (512 rows of 256
  against one 256 x 128 matrix each), bytes of the two operands and the result once."""
  (kernel,) = predict.kernel_costs(_grouped_call(name, rhs, out))
  assert kernel["costed"] and kernel["flops"] == 2 * 512 * 256 * 128
  assert kernel["bytes"] == 2 * (512 * 256 + 4 * 256 * 128 + 512 * 128)


def test_tuple_element_references_read_as_get_tuple_element():
  """XLA 0.12 prints a tuple's element as an operand `%f#1`; rewritten, the dot's operand is a get-tuple-element of
  the right shape, so the dot is costed as when the older form is printed (2·8·16·4 FLOPs)."""
  newer = """HloModule m

ENTRY %main (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  %t = (f32[2]{0}, f32[8,16]{1,0}) tuple(%p0, %p0)
  ROOT %d = f32[8,4]{1,0} dot(%t#1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
  text = hlo.untuple_refs(newer)
  assert "%t.gte1 = f32[8,16]{1,0} get-tuple-element(%t), index=1" in text and "dot(%t.gte1, %p1)" in text
  assert hlo.untuple_refs(text) == text  # nothing left to rewrite
  (dot,) = [k for k in predict.kernel_costs(text) if k["name"] == "d"]
  assert dot["flops"] == 2 * 8 * 16 * 4


def test_flop_conventions_reproduce_maxtexts_own_log(monkeypatch):
  """The calibration's FLOP conventions (benchmarks/predict_maxtext.py) against MaxText's printed figures: the
  tpu-recipes Llama 3.1 8B v6e-256 log says 417.397 TFLOP/s/device at 4.546 s per step (per-device batch 4 x
  8192) under the non-causal count of its release; PR #1988's causal count halves the attention term."""
  import importlib  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  pm = importlib.import_module("predict_maxtext")
  row = pm.ROWS["llama3_1_8b_v6e"]
  c = pm.row_config(row)
  flops = pm.published_flops_per_chip(row, c)
  assert flops == pytest.approx(417.397e12 * 4.546, rel=2e-4)
  m, seq = c.model, c.train.seq_len
  attention = 3 * m.num_layers * 4 * seq**2 * m.num_heads * m.head_dim / 2 * 4  # the half PR #1988 removes
  causal = pm.CONVENTIONS["matmul_causal"](m, seq) * 4
  assert causal == pytest.approx(flops - attention, rel=1e-12)
  # tokens/s per chip gives the published step time without any convention
  assert pm.published_step_seconds(row, c) == pytest.approx(4.546, rel=2e-4)
  assert flops / pm.published_step_seconds(row, c) / 918e12 == pytest.approx(0.4546, abs=2e-4)


_PEELED_LOOP = """HloModule m

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[4] exponential(%x)
  ROOT %t = (s32[], f32[4]) tuple(%j, %y)
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4] parameter(0)
  %start = s32[] constant(START)
  %c = s32[] copy(%start)
  %t = (s32[], f32[4]) tuple(%c, %x)
  ROOT %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body
}
"""


@pytest.mark.parametrize("start", [0, 1, 3])
def test_a_loop_counter_that_starts_late_runs_fewer_iterations(start):
  """libtpu peels the first backward layer iteration out of the loop (the counter then starts at 1) to overlap
  the data-parallel gradient all-reduce: `counter < 4` from 1 runs 3 bodies, not 4 (as a Python loop counts)."""
  program = hlo.parse(_PEELED_LOOP.replace("START", str(start)))
  runs = [mult for _, instr, mult in hlo.executed(program) if instr.opcode == "exponential"]
  assert runs == [len(range(start, 4))]


def test_offloaded_residuals_cost_their_bytes_over_the_host_link(devices):
  """A layer scan whose remat policy offloads each layer's input (model.remat offload_input): the program moves L
  inputs to the host and L back, each B x D float32; they cost 2 L B D 4 bytes / the chip's host bandwidth, and
  what the kernels of their loop body cannot hide is added to the step."""
  n_layers, b, d = 6, 512, 1024

  def layer(x, w):
    x = remat.tag(x, remat.LAYER_INPUT)
    return x + jnp.tanh(x @ w), None

  def loss(ws, x):
    body = jax.checkpoint(layer, policy=remat.POLICIES["offload_input"].checkpoint, prevent_cse=False)
    return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

  rep = NamedSharding(Mesh(np.array(devices), ("x",)), P())
  text = jax.jit(jax.grad(loss)).lower(jax.ShapeDtypeStruct((n_layers, d, d), jnp.float32, sharding=rep),
                                       jax.ShapeDtypeStruct((b, d), jnp.float32, sharding=rep)).compile().as_text()
  moves = hlo.host_transfers(hlo.parse(text))
  for direction in ("to_host", "from_host"):
    assert sum(t["per_step"] for t in moves if t["direction"] == direction) == n_layers
  assert {t["bytes"] for t in moves} == {b * d * 4}
  p = predict.predict(text, V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=1, tokens_per_chip=1)
  assert p["host_transfer_seconds"] == pytest.approx(2 * n_layers * b * d * 4 / (V4.host_gbps * 1e9), rel=1e-9)
  assert 0 < p["exposed_host_seconds"] <= p["host_transfer_seconds"]
  assert p["step_seconds"] == pytest.approx(p["compute_seconds"] + p["memory_bound_seconds"]
                                            + p["exposed_collective_seconds"] + p["exposed_host_seconds"])
  # Nothing of the transfers is priced again as an HBM kernel.
  assert not [r for r in p["top_ops"] if r["bound"] in ("compute", "memory") and "slice" in r["op"]]


_ASYNC_OFFLOAD = """HloModule m

%async_computation (p0: f32[4,8]{1,0:S(5)}, p1: f32[1,8]) -> f32[4,8]{1,0:S(5)} {
  %p0 = f32[4,8]{1,0:S(5)} parameter(0)
  %p1 = f32[1,8]{1,0} parameter(1)
  %i = s32[] constant(0)
  ROOT %dus = f32[4,8]{1,0:S(5)} dynamic-update-slice(%p0, %p1, %i, %i)
}

ENTRY %main (buf: f32[4,8]{1,0:S(5)}, x: f32[1,8]) -> f32[4,8]{1,0:S(5)} {
  %buf = f32[4,8]{1,0:S(5)} parameter(0)
  %x = f32[1,8]{1,0} parameter(1)
  %start = ((f32[4,8]{1,0:S(5)}, f32[1,8]{1,0}), f32[4,8]{1,0:S(5)}, u32[]) async-start(%buf, %x), calls=%async_computation
  ROOT %done = f32[4,8]{1,0:S(5)} async-done(%start)
}
"""


def test_a_host_transfer_inside_an_async_computation_is_asynchronous_in_its_issuers_scope():
  """Newer XLA (MaxText's programs) wraps a host transfer in async-start(calls=...): it is asynchronous, it overlaps
  with the kernels of the computation issuing the async-start, and it moves the slice (1 x 8 float32), not the
  host buffer."""
  (t,) = hlo.host_transfers(hlo.parse(_ASYNC_OFFLOAD))
  assert (t["direction"], t["bytes"], t["async"]) == ("to_host", 32.0, True)
  assert (t["where"], t["computation"]) == ("async_computation", "main")


def _ring_by_steps(kind: str, nbytes: float, n: int, bandwidth: float, step_latency: float) -> float:
  """A ring collective simulated step by step: every step each participant passes one 1/n chunk of the array to
  its neighbour and waits one network latency; an all-reduce is a reduce-scatter's n - 1 steps then an
  all-gather's n - 1."""
  passes = 2 if kind == "all-reduce" else 1
  return sum(step_latency + nbytes / n / bandwidth for _ in range(passes) for _ in range(n - 1))


def test_a_cross_slice_all_reduce_costs_its_ring_over_the_slices_and_the_networks_latency():
  # Four v4-8 slices (16 chips); summing an array split over the slices all-reduces it across the data-centre
  # network (megascale transfers), each chip with its counterparts in the other 3 slices.
  tpu = hardware.tpu_slice("v4-8", 4)
  mesh = Mesh(np.array(aot.abstract_devices(tpu)).reshape(4, 4), ("dcn", "x"))
  rows = 4 * 256
  x = jax.ShapeDtypeStruct((4, rows, 1024), jnp.float32, sharding=NamedSharding(mesh, P("dcn", "x")))
  compiled = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P("x"))).lower(x).compile()
  dcn = [op for op in hlo.collective_ops(compiled.as_text(), 16) if op["kind"].startswith("dcn-")]
  assert {(op["kind"], op["group"]) for op in dcn} == {("dcn-all-reduce", 4)}
  nbytes = rows // 4 * 1024 * 4
  assert sum(op["bytes"] for op in dcn) == nbytes  # each chip's shard of the sum
  p = predict.predict(compiled.as_text(), V4, num_devices=16, torus=tpu.torus, model_flops_per_chip=0,
                      tokens_per_chip=1)
  bandwidth = V4.dcn_gbps * 1e9
  expected = sum(predict.DCN_BASE_SECONDS * predict.DCN_ALL_REDUCE_PLATEAU  # a large all-reduce: NCCL's plateau
                 + _ring_by_steps("all-reduce", op["bytes"], 4, bandwidth, 0.0)
                 + _ring_by_steps("all-reduce", 0.0, 4, bandwidth, predict.DCN_STEP_SECONDS)
                 * predict.DCN_ALL_REDUCE_PLATEAU for op in dcn)
  assert p["collective_seconds"] == pytest.approx(expected, rel=1e-6)
  # Latency is per step: 32 slices take 62 steps, and a small all-gather pays no plateau.
  small = predict.dcn_seconds("all-gather", 1024.0, 32, V4)
  assert small == pytest.approx(predict.DCN_BASE_SECONDS + _ring_by_steps("all-gather", 1024.0, 32, bandwidth,
                                                                          predict.DCN_STEP_SECONDS))
  assert predict.dcn_seconds("all-reduce", 1e9, 1, V4) == 0
