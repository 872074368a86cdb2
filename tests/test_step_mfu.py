"""MFU arithmetic (train/planning/mfu.py): model FLOPs per second over the hardware peak, omitted where the peak is unknown."""
import jax
import numpy as np
import pytest
from flax import nnx

import model
from model import count_params
import configs
from train.planning import hardware
from train.planning import mfu


def test_mfu_formula_and_unknown_peak():
  # 2 H100s at 989 TFLOP/s each; 10k tokens/s of a model costing 6e9 FLOPs per token -> 6e13 / 1.978e15.
  peak = hardware.peak_flops_per_device("NVIDIA H100 80GB HBM3")
  assert peak == 989e12
  assert mfu.mfu(1e4, 6e9, 2, peak) == pytest.approx(6e13 / (2 * 989e12))
  assert mfu.mfu(1e4, 6e9, 2, None) is None


def test_cpu_peak_is_unknown_unless_given():
  assert mfu.peak_flops_per_device(jax.devices()) is None
  assert mfu.peak_flops_per_device(jax.devices(), override_tflops=2.5) == 2.5e12


def _brute_force_flops_per_step(cfg, seq_len, batch, causal=True):
  """Training FLOPs of one step counted from the model's own parameter shapes (not from count_params):
  every weight matmul costs 2 FLOPs per multiply-add per token forward and twice that backward; the output
  projection is a matmul (tied or not), the embedding lookup is not; attention does QK^T and PV over the keys
  each query sees (query t sees t + 1 keys under a causal mask, at most `window`), again x3 for training.
  causal=False counts every key of the window for every query (T, or `window`: no causal halving)."""
  abstract = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
  matmul_weights = 0
  for path, p in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    name = "/".join(map(str, path))
    if p.get_value().ndim >= 2 and "embedding" not in name:  # kernels (stacked over layers when scanned)
      matmul_weights += int(np.prod(p.get_value().shape))
  if cfg.tie_embeddings:
    matmul_weights += cfg.d_model * cfg.vocab_size
  flops = 0.0
  for layer in range(cfg.num_layers):
    window = 0 if cfg.sliding_window == 0 or (cfg.global_every and (layer + 1) % cfg.global_every == 0) else (
        cfg.sliding_window)
    for t in range(seq_len):
      seen = t + 1 if causal else seq_len
      keys = seen if window == 0 else min(seen, window)
      flops += 3 * 2 * 2 * cfg.num_heads * cfg.head_dim * keys  # QK^T and PV, forward + backward
  return batch * (seq_len * 6.0 * matmul_weights + flops)


@pytest.mark.parametrize("overrides", [{}, {"model.sliding_window": 16, "model.global_every": 2,
                                            "model.tie_embeddings": True}], ids=["tiny", "windowed_tied"])
def test_flops_per_step_matches_a_count_from_the_parameters(overrides):
  c = configs.load("tiny", **overrides)
  want = _brute_force_flops_per_step(c.model, c.train.seq_len, 3)
  # meshlm's convention differs from this exact count only in small terms: the norm scales counted as
  # parameters in 6N (0.15% here) and the continuous mean of attended keys (T/2 instead of (T+1)/2).
  assert mfu.flops_per_step(c.model, c.train.seq_len, 3) == pytest.approx(want, rel=5e-3)
  # At least the 6 * N matmul term of the non-embedding parameters (model.flops_per_token's definition).
  assert mfu.flops_per_token(c.model, c.train.seq_len) >= 6 * count_params(c.model)["non_embedding"]


@pytest.mark.parametrize("overrides", [{}, {"model.sliding_window": 16, "model.global_every": 2}],
                         ids=["tiny", "windowed"])
def test_full_attention_flops_match_a_count_without_causal_halving(overrides):
  # mfu_full_attention's numerator (PaLM / torchtitan): every query is charged for all keys of its window.
  c = configs.load("tiny", **overrides)
  want = _brute_force_flops_per_step(c.model, c.train.seq_len, 3, causal=False)
  got = mfu.flops_per_step(c.model, c.train.seq_len, 3, causal_halving=False)
  assert got == pytest.approx(want, rel=5e-3)
  # The difference is exactly the halved attention term: 6 * H * K * T per global layer at T = seq_len.
  if not overrides:
    m, T = c.model, c.train.seq_len
    extra = mfu.flops_per_token(m, T, causal_halving=False) - mfu.flops_per_token(m, T)
    assert extra == pytest.approx(6 * m.num_layers * m.num_heads * m.head_dim * T)
