"""The model options that make the one transformer a Qwen 2/2.5/3, Gemma 2/3, OLMo 2 or Llama 3.x model (issue 36)
against independent references: a float64 NumPy forward pass written from the families' definitions (transformers'
modeling code), brute-force attention with soft-capping, transformers' own RoPE functions; scan == unrolled and
KV-cache greedy decoding == full-forward argmax for one model with every Gemma-3-like option on; splash's soft cap
in interpret mode; validation, conditional keys (tests/test_configs_conditional.py) and parameter counts.

Compiles are few: each family case is one forward of a 2-3 layer model, and one Gemma-3-like model serves the
scan, generation and counting checks.
"""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import configs
import model
import parallel
from configs import base
from model import attention, axes, config as config_lib, generate as gen, rope, splash
from model.layers import Norm
from parallel import mesh as mesh_lib
from parallel import pipeline as pipeline_lib
from parallel import rules as rules_lib

TINY = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
            max_seq_len=64, init_std=0.3, attention_impl="xla")
# Every Gemma-3-like option at once: 2 sliding : 1 full layers with a window shorter than the sequences, a local
# RoPE base on the sliding layers and linear scaling on the full one, per-head q/k norms, sandwich norms with the
# (1 + w) offset, the embedding scale, both soft caps and the query scalar.
GEMMA3 = dict(layer_types=("sliding", "sliding", "full"), sliding_window=4, rope_local_theta=100.0,
              rope_scaling="linear", rope_scaling_factor=2.0, qk_norm="head", norm_position="sandwich",
              norm_offset=True, embed_scale=True, attn_logit_softcap=1.5, final_logit_softcap=2.0,
              query_pre_attn_scalar=12.0, mlp_type="geglu", tie_embeddings=True)
FAMILIES = {
    # Qwen 2.5: q/k/v biases, YaRN (the reference takes its frequencies and factor from transformers).
    "qwen2_qkv_bias_yarn": dict(qkv_bias=True, rope_scaling="yarn", rope_scaling_factor=4.0,
                                rope_original_max_len=32, rope_yarn_beta_fast=8.0, rope_yarn_beta_slow=0.5),
    # Qwen 3: per-head q/k norms; a window on the last layer only (Qwen's max_window_layers as layer_types).
    "qwen3_qk_norm_head": dict(qk_norm="head", layer_types=("full", "full", "sliding"), sliding_window=4),
    # OLMo 2: q/k norms over the whole projections, post-norm sublayers.
    "olmo2_qk_norm_proj_post": dict(qk_norm="proj", norm_position="post"),
    # Gemma 2: alternating sliding / full layers, soft caps, query scalar, sandwich norms with offset, scaled
    # embedding, GeGLU, tied output.
    "gemma2": dict(num_layers=2, layer_types=("sliding", "full"), sliding_window=4, attn_logit_softcap=1.0,
                   final_logit_softcap=2.0, query_pre_attn_scalar=12.0, norm_position="sandwich", norm_offset=True,
                   embed_scale=True, mlp_type="geglu", tie_embeddings=True),
    "gemma3": GEMMA3,
}
PROMPTS = [[5, 9, 2], [7, 1, 8, 3, 3, 4, 10, 11, 12], [40]]
# Options whose effect the family test checks by switching them off in the reference ("post" has no pre-norms to
# fall back on).
ACTIVE = ("qkv_bias", "qk_norm", "norm_offset", "norm_position", "embed_scale", "attn_logit_softcap",
          "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta", "rope_scaling")


def make_cfg(**overrides):
  cfg = base.get_config().model
  cfg.update(**{**TINY, **overrides})
  return cfg


def make_model(seed=0, **overrides):
  """A model whose every parameter (norm scales and biases too, which start at 1 or 0) is randomised."""
  m = model.Transformer(make_cfg(**overrides), rngs=nnx.Rngs(seed))
  state = nnx.state(m, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  nnx.update(m, jax.tree.unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
                                             for x, k in zip(leaves, keys)]))
  return m


def flat_params(m):
  """{path: float64 numpy} of a scanned model (layer parameters with their leading [num_layers] dim)."""
  return {"/".join(map(str, k)): np.asarray(v.get_value(), np.float64)
          for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


def _hf_rope_config(cfg, rope_parameters, max_position_embeddings=None):
  return transformers.LlamaConfig(hidden_size=cfg.num_heads * cfg.head_dim, num_attention_heads=cfg.num_heads,
                                  head_dim=cfg.head_dim,
                                  max_position_embeddings=max_position_embeddings or cfg.max_seq_len,
                                  rope_parameters={"rope_theta": cfg.rope_theta, **rope_parameters})


def _hf_yarn(cfg):
  """transformers' YaRN (inv_freq, attention factor) for a meshlm config: the reference's frequencies."""
  hf = _hf_rope_config(cfg, {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                             "original_max_position_embeddings": cfg.rope_original_max_len,
                             "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow,
                             "truncate": cfg.rope_yarn_truncate})
  inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
  return inv_freq.double().numpy(), factor


def _softmax(s):
  e = np.exp(s - s.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _rotate(x_LNK, cos_LF, sin_LF):
  """Rotate-half RoPE (transformers' apply_rotary_pos_emb)."""
  h = x_LNK.shape[-1] // 2
  x1, x2, c, s = x_LNK[..., :h], x_LNK[..., h:], cos_LF[:, None], sin_LF[:, None]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


class Reference:
  """float64 forward pass of unpacked rows, from the definitions (Gemma 2/3, Qwen 2/3, OLMo 2 in transformers):
  not from model/. Layers read p["layers/<name>"][i]."""

  def __init__(self, cfg, p):
    self.cfg, self.p = cfg, p
    K, n = cfg.head_dim, cfg.num_layers
    types = list(cfg.layer_types) * (n // len(cfg.layer_types)) if cfg.layer_types else ["full"] * n
    self.windows = [cfg.sliding_window if t == "sliding" else 0 for t in types]
    self.global_freq, self.factor = 1.0 / cfg.rope_theta ** (np.arange(0, K, 2) / K), 1.0
    if cfg.rope_scaling == "linear":
      self.global_freq = self.global_freq / cfg.rope_scaling_factor
    elif cfg.rope_scaling == "yarn":
      self.global_freq, self.factor = _hf_yarn(cfg)
    self.local_freq = 1.0 / cfg.rope_local_theta ** (np.arange(0, K, 2) / K) if cfg.rope_local_theta else None

  def norm(self, x, w, over=1):
    """RMSNorm over the last `over` axes; Gemma's (1 + w) with norm_offset."""
    ax = tuple(range(-over, 0))
    y = x / np.sqrt((x * x).mean(ax, keepdims=True) + self.cfg.norm_eps)
    return y * ((1.0 + w) if self.cfg.norm_offset else w)

  def attention(self, i, h):
    cfg, lp = self.cfg, lambda name: self.p["layers/" + name][i]
    L, K, R = h.shape[0], cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    q, k, v = (np.einsum("ld,dnk->lnk", h, lp(f"attn/{n}")) for n in "qkv")
    if cfg.qkv_bias:
      q, k, v = q + lp("attn/q_bias"), k + lp("attn/k_bias"), v + lp("attn/v_bias")
    if cfg.qk_norm != "none":  # head: over head_dim; proj: over the whole [heads, head_dim] projection
      over = 1 if cfg.qk_norm == "head" else 2
      q, k = self.norm(q, lp("attn/q_norm/scale"), over), self.norm(k, lp("attn/k_norm/scale"), over)
    window, pos = self.windows[i], np.arange(L)
    local = window > 0 and self.local_freq is not None
    freq, factor = (self.local_freq, 1.0) if local else (self.global_freq, self.factor)
    cos, sin = np.cos(pos[:, None] * freq) * factor, np.sin(pos[:, None] * freq) * factor
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = np.repeat(k, R, axis=1), np.repeat(v, R, axis=1)  # query head j reads kv head j // R
    s = np.einsum("thk,shk->hts", q, k) * (cfg.query_pre_attn_scalar or K) ** -0.5
    if cfg.attn_logit_softcap:
      s = cfg.attn_logit_softcap * np.tanh(s / cfg.attn_logit_softcap)
    diff = pos[:, None] - pos[None, :]
    s = np.where((diff >= 0) & ((window == 0) | (diff < window)), s, -np.inf)
    o = np.einsum("hts,shk->thk", _softmax(s), v)
    return np.einsum("thk,hkd->td", o, lp("attn/o"))

  def mlp(self, i, h):
    lp = lambda name: self.p["layers/" + name][i]
    act = _gelu_tanh if self.cfg.mlp_type == "geglu" else lambda g: g / (1 + np.exp(-g))
    return (act(h @ lp("mlp/gate")) * (h @ lp("mlp/up"))) @ lp("mlp/down")

  def logits(self, tokens_L):
    cfg, p = self.cfg, self.p
    pre, post = cfg.norm_position != "post", cfg.norm_position != "pre"
    x = p["embed/embedding"][tokens_L] * (np.sqrt(cfg.d_model) if cfg.embed_scale else 1.0)
    for i in range(cfg.num_layers):
      for name, f in (("attn", self.attention), ("mlp", self.mlp)):
        h = self.norm(x, p[f"layers/{name}_norm/scale"][i]) if pre else x
        y = f(i, h)
        x = x + (self.norm(y, p[f"layers/{name}_post_norm/scale"][i]) if post else y)
    x = self.norm(x, p["final_norm/scale"])
    logits = x @ (p["embed/embedding"].T if cfg.tie_embeddings else p["unembed"])
    if cfg.final_logit_softcap:
      logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
    return logits


@jax.jit
def _forward(state, graphdef, tokens_BL):
  return nnx.merge(graphdef, state)(tokens_BL)


def forward(m, tokens_BL):
  graphdef, state = nnx.split(m)
  return np.asarray(_forward(state, graphdef, jnp.asarray(tokens_BL, jnp.int32)))


@pytest.fixture(scope="module")
def gemma3():
  return make_model(**GEMMA3)


# ---- every option against the NumPy forward pass --------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_options_match_the_numpy_reference(family, gemma3):
  m = gemma3 if family == "gemma3" else make_model(**FAMILIES[family])
  tokens = np.random.default_rng(0).integers(0, 64, size=(2, 12))
  p = flat_params(m)
  want = np.stack([Reference(m.cfg, p).logits(t) for t in tokens])
  np.testing.assert_allclose(forward(m, tokens), want, atol=2e-4, rtol=1e-4)
  # Each option acts on these weights and inputs: the reference without it gives other logits.
  defaults = config_lib.default_model_config()
  for key in ACTIVE:
    if m.cfg[key] != defaults[key] and not (key == "norm_position" and m.cfg[key] == "post"):
      without = Reference(ml_collections.ConfigDict(dict(m.cfg, **{key: defaults[key]})), p)
      assert np.max(np.abs(np.stack([without.logits(t) for t in tokens]) - want)) > 1e-3, key


def test_norms_match_numpy_with_offset_head_and_projection():
  """Norm alone: Gemma's (1 + w) over d_model; RMSNorm of each head over head_dim and over a whole [H, K]
  projection (OLMo 2), without bias even where model.use_bias gives the block norms one."""
  rng = np.random.default_rng(0)
  for overrides, shape, over in ((dict(norm_offset=True), None, 1), (dict(use_bias=True), (8,), 1),
                                 (dict(norm_offset=True), (4, 8), 2)):
    cfg = make_cfg(norm_eps=1e-6, **overrides)
    with axes.creation_context():  # unsharded parameters outside a mesh
      norm = Norm(cfg, rngs=nnx.Rngs(0), **({} if shape is None else dict(shape=shape, rms=True)))
    if shape is not None:
      assert norm.bias is None
    w = rng.normal(size=norm.scale.get_value().shape)
    norm.scale.set_value(jnp.asarray(w, jnp.float32))
    x = rng.normal(size=(2, 5, 4, 8) if shape else (2, 5, 32))
    ax = tuple(range(-over, 0))
    want = x / np.sqrt((x * x).mean(ax, keepdims=True) + 1e-6) * ((1 + w) if cfg.norm_offset else w)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x, jnp.float32))), want, atol=2e-5, rtol=1e-5)
  with axes.creation_context():
    assert float(jnp.max(jnp.abs(Norm(make_cfg(norm_offset=True), rngs=nnx.Rngs(0)).scale.get_value()))) == 0.0


# ---- soft-capped attention: every kernel that takes it ---------------------------------------------------------
def brute_force_capped(q, k, v, window, cap):
  """float64 loops: softmax over visible keys of cap * tanh(q.k / sqrt(K) / cap)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, H, K = q.shape
  R = H // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for h in range(H):
      for t in range(T):
        keys = [s for s in range(t + 1) if window == 0 or t - s < window]
        s = np.array([q[b, t, h] @ k[b, j, h // R] for j in keys]) / np.sqrt(K)
        s = cap * np.tanh(s / cap)
        p = np.exp(s - s.max())
        out[b, t, h] = (p / p.sum()) @ v[b, keys, h // R]
  return out


def _qkv(T=12, H=4, G=2, K=8, B=2, scale=2.0, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(scale * rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, G, G)]


@pytest.mark.parametrize("window", [0, 4])
def test_softcapped_attention_matches_brute_force(window):
  q, k, v = _qkv()
  seg = jnp.ones(q.shape[:2], jnp.int32)
  want = brute_force_capped(q, k, v, window, cap=2.0)
  assert np.max(np.abs(want - brute_force_capped(q, k, v, window, cap=1e6))) > 1e-2  # the cap acts
  got = {"xla": attention.xla_attention(q, k, v, seg, window, softcap=2.0),
         "xla_query_blocks": attention.xla_attention(q, k, v, seg, window, query_block=5, softcap=2.0),
         "blockwise": attention.blockwise_attention(q, k, v, seg, window, block_size=4, softcap=2.0),
         "cached": attention.cached_attention(q, k, v, 0, jnp.zeros((2,), jnp.int32), window, softcap=2.0)}
  for name, o in got.items():
    np.testing.assert_allclose(np.asarray(o), want, atol=2e-5, err_msg=name)


def test_blockwise_softcap_gradients_equal_xla_autodiff():
  """blockwise's hand-written backward (the tanh's derivative) against autodiff of the xla reference; packed rows
  and a window."""
  q, k, v = _qkv()
  seg = jnp.asarray([[1] * 12, [1] * 5 + [2] * 5 + [0] * 2], jnp.int32)
  w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)

  def grads(fn):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)

  want = grads(lambda q, k, v: attention.xla_attention(q, k, v, seg, 4, softcap=2.0))
  got = grads(lambda q, k, v: attention.blockwise_attention(q, k, v, seg, 4, block_size=4, softcap=2.0))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_splash_softcap_in_interpret_mode_equals_xla():
  """The kernel's attn_logits_soft_cap on meshlm's scaled scores: values and gradients as xla's."""
  q, k, v = _qkv(T=128, H=2, G=1, K=16, B=1, scale=1.5)
  seg = jnp.ones((1, 128), jnp.int32)
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  opts = splash.SplashOptions(128, 128, 128, 128, 128, interpret=True, soft_cap=1.0)

  def value_and_grads(fn):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(w))

  got = value_and_grads(lambda q, k, v: attention.attend("splash", q, k, v, seg, 0, splash_options=opts,
                                                         softcap=1.0))
  want = value_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, seg, 0, softcap=1.0))
  uncapped = attention.xla_attention(q, k, v, seg, 0)
  assert float(jnp.max(jnp.abs(want[0] - uncapped))) > 1e-2
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  cfg = make_cfg(attn_logit_softcap=30.0, attention_impl="splash", pallas_interpret=True)
  assert splash.options(config_lib.validate(cfg)).soft_cap == 30.0


def test_softcap_makes_auto_choose_kernels_that_cap():
  assert attention.auto_impl("gpu", jnp.bfloat16, 128) == "cudnn"
  assert attention.auto_impl("gpu", jnp.bfloat16, 128, softcap=50.0) == "xla"
  assert attention.auto_impl("tpu", jnp.bfloat16, 128, softcap=50.0) == "splash"
  assert attention.resolve_impl(make_cfg(attention_impl="auto", dtype="bfloat16", attn_logit_softcap=50.0),
                                "gpu") == "xla"
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="model.attn_logit_softcap"):
    attention.attend("dot_product", q, k, v, jnp.ones(q.shape[:2], jnp.int32), softcap=2.0)


# ---- RoPE against transformers ------------------------------------------------------------------------------
ROPE_CASES = {
    "linear": (dict(rope_scaling="linear", rope_scaling_factor=4.0), {"rope_type": "linear", "factor": 4.0}),
    "yarn": (dict(rope_scaling="yarn", rope_scaling_factor=8.0, rope_original_max_len=512),
             {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}),
    "yarn_untruncated_betas_factor": (
        dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=256, rope_yarn_beta_fast=16.0,
             rope_yarn_beta_slow=2.0, rope_yarn_truncate=False, rope_attention_factor=1.3),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16.0,
         "beta_slow": 2.0, "truncate": False, "attention_factor": 1.3}),
    "llama3": (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=64),
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(case):
  overrides, hf_rope = ROPE_CASES[case]
  cfg = make_cfg(head_dim=32, max_seq_len=2048, rope_theta=10000.0, **overrides)
  hf = _hf_rope_config(cfg, hf_rope)
  inv_freq, factor = ROPE_INIT_FUNCTIONS[hf_rope["rope_type"]](hf, "cpu")
  np.testing.assert_allclose(rope.inv_frequencies(cfg), inv_freq.numpy(), rtol=1e-6)
  assert rope.attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
  positions = np.array([[0, 1, 7, 100, 200], [3, 2, 1, 0, 150]])  # float32 angles: errors grow with position
  cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), torch.tensor(positions))
  got_cos, got_sin = rope.tables(cfg, jnp.asarray(positions))
  np.testing.assert_allclose(np.asarray(got_cos), cos[..., :16].numpy(), atol=2e-6)
  np.testing.assert_allclose(np.asarray(got_sin), sin[..., :16].numpy(), atol=2e-6)


@pytest.mark.parametrize("length", [20, 32, 33, 90])
def test_dynamic_ntk_follows_the_input_length_as_transformers(length):
  """Dynamic NTK: transformers grows the base once max(position ids) + 1 exceeds max_position_embeddings (meshlm:
  rope_original_max_len); a fresh rotary embedding per input, as a model's first call."""
  cfg = make_cfg(head_dim=32, rope_scaling="dynamic", rope_scaling_factor=3.0, rope_original_max_len=32)
  hf = _hf_rope_config(cfg, {"rope_type": "dynamic", "factor": 3.0}, max_position_embeddings=32)
  positions = np.stack([np.arange(length), np.maximum(np.arange(length) - 5, 0)])
  cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), torch.tensor(positions))
  got_cos, got_sin = jax.jit(lambda p: rope.tables(cfg, p))(jnp.asarray(positions))
  # The grown base is a float32 power on both sides (XLA's and torch's pow may differ by an ulp), which angles up
  # to 90 radians turn into a few 1e-6.
  np.testing.assert_allclose(np.asarray(got_cos), cos[..., :16].numpy(), atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_sin), sin[..., :16].numpy(), atol=1e-5)
  grown = not np.allclose(np.asarray(got_cos), np.asarray(rope.cos_sin(jnp.asarray(positions),
                                                                         rope.default_frequencies(1e4, 32))[0]))
  assert grown == (length > 32)


def test_rope_local_theta_tables_are_chosen_per_layer_by_window():
  """Two sets with model.rope_local_theta ([2, B, L, K/2]: global scaled, local unscaled); a layer with a window
  takes the local one, by a static or a traced window."""
  cfg = make_cfg(rope_local_theta=10.0, rope_scaling="linear", rope_scaling_factor=2.0, sliding_window=4)
  positions = jnp.asarray([[0, 1, 2, 5]])
  cos, sin = rope.tables(cfg, positions)
  assert cos.shape == (2, 1, 4, 4)
  K, pos = cfg.head_dim, np.array([0, 1, 2, 5])[:, None]
  angles = {0: pos / 10000.0 ** (np.arange(0, K, 2) / K) / 2.0, 4: pos / 10.0 ** (np.arange(0, K, 2) / K)}
  picked = jax.jit(lambda w: rope.for_window(cos, sin, w))
  for window, angle in angles.items():
    for c, s in (rope.for_window(cos, sin, window), picked(jnp.int32(window))):
      np.testing.assert_allclose(np.asarray(c)[0], np.cos(angle), atol=1e-6)
      np.testing.assert_allclose(np.asarray(s)[0], np.sin(angle), atol=1e-6)


# ---- one Gemma-3-like model: scan == unrolled, KV-cache greedy == full-forward argmax -------------------------
def _unrolled_copy(scanned):
  unrolled = model.Transformer(dict(scanned.cfg, scan_layers=False), rngs=nnx.Rngs(5))
  stacked = nnx.state(scanned.layers, nnx.Param)
  for i, block in enumerate(unrolled.layers):
    nnx.update(block, jax.tree.map(lambda a: a[i], stacked))
  for attr in ("embed", "final_norm"):
    nnx.update(getattr(unrolled, attr), nnx.state(getattr(scanned, attr), nnx.Param))
  return unrolled


def test_gemma3_like_scan_equals_unrolled(gemma3):
  tokens = np.random.default_rng(2).integers(0, 64, size=(2, 12))
  np.testing.assert_allclose(forward(_unrolled_copy(gemma3), tokens), forward(gemma3, tokens), atol=1e-5)


def test_gemma3_like_greedy_generation_equals_argmax_of_full_forward(gemma3):
  """Prompts and continuations past the window of 4: the cached decode applies window, local RoPE, q/k norms and
  both soft caps as one full pass does."""
  got = gen.generate(gemma3, PROMPTS, 6)
  rows = [p + t for p, t in zip(PROMPTS, got)]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for b, r in enumerate(rows):
    tokens[b, :len(r)] = r
  full = forward(gemma3, tokens)
  for b, (p, t) in enumerate(zip(PROMPTS, got)):
    assert len(t) == 6
    assert t == np.argmax(full[b, len(p) - 1:len(p) + 5], axis=-1).tolist()


def test_pipelined_stack_equals_the_plain_scan_with_local_rope_and_dynamic_ntk():
  """Two pipeline stages (parallel/pipeline.py) over a Gemma-3-like stack with dynamic NTK on the global layers:
  the microbatches (rows 0, 2 and 1, 3) have different longest positions, yet every stage takes the whole batch's
  length, as the plain scan does."""
  c = configs.load("tiny")
  c.model.update(**{**TINY, **GEMMA3, "num_layers": 4, "layer_types": ("sliding", "full"), "rope_scaling": "dynamic",
                    "rope_original_max_len": 10, "rope_scaling_factor": 3.0})
  c.mesh.update(stage=2)
  mesh = mesh_lib.make_mesh(c.mesh, jax.devices()[:2])
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  tokens = np.random.default_rng(4).integers(0, 64, size=(4, 16))
  segments = np.array([[1] * 16, [1] * 8 + [2] * 8, [1] * 16, [1] * 8 + [2] * 8])  # rows 1, 3: positions < 10
  plain = model.Transformer(c.model, rngs=nnx.Rngs(0))
  with parallel.activate(mesh, rules):
    piped = model.Transformer(c.model, rngs=nnx.Rngs(0), pipeline=pipeline_lib.Schedule(2, 2, 1, False))
    nnx.update(piped, jax.device_put(jax.tree.map(np.asarray, nnx.state(make_model(**c.model), nnx.Param))))
    got = jax.jit(lambda m, t, s: m(t, s))(piped, jnp.asarray(tokens), jnp.asarray(segments))
  nnx.update(plain, nnx.state(make_model(**c.model), nnx.Param))
  want = jax.jit(lambda m, t, s: m(t, s))(plain, jnp.asarray(tokens), jnp.asarray(segments))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ---- layer types, validation, counting ------------------------------------------------------------------------
def test_layer_types_repeat_over_the_layers():
  windows = config_lib.layer_windows
  assert windows(make_cfg(num_layers=6, layer_types=("sliding",) * 5 + ("full",), sliding_window=8)) == (
      8, 8, 8, 8, 8, 0)
  assert windows(make_cfg(num_layers=4, layer_types=("sliding", "full"), sliding_window=8)) == (8, 0, 8, 0)
  assert windows(make_cfg(num_layers=3, layer_types=["full", "full", "sliding"], sliding_window=8)) == (0, 0, 8)
  assert windows(make_cfg(num_layers=4, sliding_window=8, global_every=2)) == (8, 0, 8, 0)  # unchanged


@pytest.mark.parametrize("overrides,needle", [
    (dict(layer_types=("local", "full"), sliding_window=4, num_layers=2), "model.layer_types"),
    (dict(layer_types="sliding", sliding_window=4), "model.layer_types"),
    (dict(layer_types=("sliding", "full"), sliding_window=4), "model.layer_types has 2 entries"),
    (dict(layer_types=("sliding", "full", "full"), sliding_window=4, global_every=2), "model.global_every=2"),
    (dict(layer_types=("sliding", "full", "full")), "model.sliding_window=0"),
    (dict(qk_norm="x"), "model.qk_norm='x'"),
    (dict(norm_position="middle"), "model.norm_position"),
    (dict(attn_logit_softcap=-1.0), "model.attn_logit_softcap=-1.0"),
    (dict(final_logit_softcap=-0.5), "model.final_logit_softcap=-0.5"),
    (dict(query_pre_attn_scalar=-2.0), "model.query_pre_attn_scalar=-2.0"),
    (dict(rope_local_theta=-1.0), "model.rope_local_theta=-1.0"),
    (dict(rope_attention_factor=-1.0), "model.rope_attention_factor=-1.0"),
    (dict(rope_yarn_beta_fast=0.0), "model.rope_yarn_beta_fast=0.0"),
    (dict(rope_scaling="yarn", rope_yarn_beta_fast=1.0, rope_yarn_beta_slow=2.0), "model.rope_yarn_beta_fast=1.0"),
    (dict(qkv_bias=1), "model.qkv_bias=1"),
    (dict(norm_offset="yes"), "model.norm_offset='yes'"),
    (dict(embed_scale=None), "model.embed_scale=None"),
    (dict(attn_logit_softcap=50.0, attention_impl="cudnn"), "model.attn_logit_softcap=50.0"),
    (dict(attn_logit_softcap=50.0, attention_impl="dot_product"), "model.attn_logit_softcap=50.0"),
    (dict(query_pre_attn_scalar=64.0, parametrization="mup"), "model.query_pre_attn_scalar=64.0"),
    (dict(norm_position="sandwich", block_type="parallel"), "model.norm_position='sandwich'"),
])
def test_bad_values_are_refused_naming_the_key(overrides, needle):
  cfg = dict(make_cfg(), **overrides)  # a plain dict: a ConfigDict would refuse the wrong types itself
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert needle in str(e.value)


def test_counts_include_biases_and_norms(gemma3):
  """count_params (and so flops_per_token's 6 N) against the formula: q/k/v biases (H + 2G) K, per-head q/k
  norms 2K, projection q/k norms (H + G) K, post norms 2D per layer; "post" drops the two pre-norms."""
  D, H, G, K, n = 32, 4, 2, 8, 3
  base_cfg = make_cfg()
  plain = model.count_params(base_cfg)["total"]
  cases = ((dict(qkv_bias=True), n * (H + 2 * G) * K), (dict(qk_norm="head"), n * 2 * K),
           (dict(qk_norm="proj"), n * (H + G) * K), (dict(norm_position="sandwich"), n * 2 * D),
           (dict(norm_position="post"), 0))
  for overrides, extra in cases:
    cfg = make_cfg(**overrides)
    assert model.count_params(cfg)["total"] == plain + extra, overrides
    assert model.flops_per_token(cfg, 16) - model.flops_per_token(base_cfg, 16) == pytest.approx(6.0 * extra)
  assert model.count_params(make_cfg(qkv_bias=True, use_bias=True))["total"] == model.count_params(
      make_cfg(use_bias=True))["total"]  # use_bias already has the q/k/v biases
  allocated = sum(x.size for x in jax.tree.leaves(nnx.state(gemma3, nnx.Param)))
  assert model.count_params(gemma3.cfg)["total"] == allocated
