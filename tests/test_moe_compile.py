"""Ahead-of-time compilation of an MoE train step with expert parallelism for a TPU v4 slice (libtpu's compiler,
no TPU attached): expert weights split over `expert`, assignments exchanged over it by ragged all-to-alls, per-chip
state and model FLOPs."""
import configs
import model
from train.planning import compile as aot
from train.planning import hardware

V4_16 = hardware.tpu_slice("v4-16")  # 8 chips
D, F, E, K, LAYERS, V = 128, 64, 8, 2, 2, 512


def test_expert_parallel_step_compiles_with_experts_split():
  config = configs.load("tiny_moe", **{
      "model.num_layers": LAYERS, "model.d_model": D, "model.num_heads": 4, "model.num_kv_heads": 2,
      "model.head_dim": 32, "model.mlp_dim": 256, "model.expert_mlp_dim": F, "model.num_experts": E,
      "model.experts_per_token": K, "model.vocab_size": V, "model.max_seq_len": 64, "model.moe_impl": "ragged",
      "train.seq_len": 64, "train.batch_size": 16, "mesh.data": 2, "mesh.expert": 4})
  trainer, compiled = aot.compile_trainer(config, aot.abstract_devices(V4_16))
  gate = compiled.input_shardings[0][0]["params"]["layers"]["moe"]["gate"]
  assert tuple(gate.spec)[:2] == (None, "expert")  # [layers, experts, embed, mlp]
  # Per-chip state: fp32 weights + Adam m, v; expert weights split 4 ways, everything else replicated.
  expert = LAYERS * E * 3 * D * F
  dense = model.count_params(config.model)["total"] - expert
  state = 3 * 4 * (dense + expert / 4)
  r = aot.summarize(config, V4_16, trainer, seconds=0.0)
  assert state <= r["memory"]["argument_bytes"] <= state * 1.05
  # Each chip holds 16 / (data 2 x expert 4) = 2 rows x 64 tokens x top-2 = 256 assignments. An MoE layer sends
  # them to their experts' chips into a worst-case buffer of 4 x 256 rows (with their local expert ids), and the
  # results come back into 256 rows; the backward pass sends both ways once more. No token is gathered.
  ops = aot.collective_ops(compiled.as_text())
  assert not [op for op in ops if op["kind"] in ("all-gather", "reduce-scatter") and f",{D}]" in op["shapes"]]
  ragged = [op for op in ops if op["kind"] == "ragged-all-to-all"]
  sent = [op for op in ragged if op["shapes"].startswith(f"f32[{4 * 256},")]
  back = [op for op in ragged if op["shapes"].startswith(f"f32[{256},")]
  ids = [op for op in ragged if op["shapes"].startswith(f"s32[{4 * 256},")]
  assert (len(sent), len(back), len(ids)) == (2, 2, 1) and len(ragged) == 5
  assert all(op["per_step"] == LAYERS and op["group"] == 4 for op in ragged)
  # Model FLOPs count the k active experts, not all E.
  active = model.count_params(config.model)["active"]
  assert active == model.count_params(config.model)["total"] - LAYERS * (E - K) * 3 * D * F
  assert r["fits"] and r["flops"]["model_per_chip"] == model.flops_per_token(config.model, 64) * 16 * 64 / 8
