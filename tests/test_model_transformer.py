"""The transformer against an independent NumPy forward pass, and its structural properties."""
import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

import model
from configs import base
from model import remat

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
            max_seq_len=64, init_std=0.1)
L = 12


def make_cfg(**overrides):
  cfg = base.get_config().model
  cfg.update(**{**TINY, **overrides})
  return cfg


def params_of(m):
  """{path: numpy} with per-layer arrays stacked on a leading axis, for both layer layouts."""
  flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  if m.cfg.scan_layers:
    return flat
  out = {k: v for k, v in flat.items() if not k.startswith("layers/")}
  for k in flat:
    if k.startswith("layers/"):
      local = k.split("/", 2)[2]
      out.setdefault("layers/" + local, np.stack([flat[f"layers/{i}/{local}"] for i in range(m.cfg.num_layers)]))
  return out


def numpy_forward(cfg, p, tokens, segments):
  """Straightforward float64 decoder: pre-norm blocks, RoPE (rotate-half), masked softmax attention."""
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = {k: v.astype(np.float64) for k, v in p.items()}

  def norm(x, prefix, i=None):
    scale = p[prefix + "/scale"] if i is None else p[prefix + "/scale"][i]
    if cfg.norm_type == "layernorm":
      x = x - x.mean(-1, keepdims=True)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * scale
    if cfg.use_bias:
      y = y + (p[prefix + "/bias"] if i is None else p[prefix + "/bias"][i])
    return y

  def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

  out = []
  for b in range(tokens.shape[0]):
    seg = segments[b]
    T = len(seg)
    pos = np.array([t - min(s for s in range(t + 1) if all(seg[s:t + 1] == seg[t])) for t in range(T)])
    freq = cfg.rope_theta ** -(np.arange(0, K, 2) / K)
    ang = pos[:, None] * freq[None]

    def rope(x):  # x [T, N, K]
      x1, x2 = x[..., :K // 2], x[..., K // 2:]
      c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
      return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = p["embed/embedding"][tokens[b]]
    for i in range(cfg.num_layers):
      lp = lambda name: p["layers/" + name][i]
      window = 0 if cfg.sliding_window == 0 or (cfg.global_every and (i + 1) % cfg.global_every == 0) \
          else cfg.sliding_window
      h = norm(x, "layers/attn_norm", i)
      q = np.einsum("td,dhk->thk", h, lp("attn/q"))
      k = np.einsum("td,dgk->tgk", h, lp("attn/k"))
      v = np.einsum("td,dgk->tgk", h, lp("attn/v"))
      if cfg.use_bias:
        q, k, v = q + lp("attn/q_bias"), k + lp("attn/k_bias"), v + lp("attn/v_bias")
      q, k = rope(q), rope(k)
      ctx = np.zeros((T, H, K))
      for hh in range(H):
        g = hh // (H // G)
        for t in range(T):
          keys = [s for s in range(t + 1) if seg[s] == seg[t] and (window == 0 or t - s < window)]
          sc = np.array([q[t, hh] @ k[s, g] for s in keys]) / np.sqrt(K)
          w = np.exp(sc - sc.max())
          ctx[t, hh] = (w / w.sum()) @ v[keys, g]
      attn = np.einsum("thk,hkd->td", ctx, lp("attn/o")) + (lp("attn/o_bias") if cfg.use_bias else 0)

      def mlp(z):
        up = z @ lp("mlp/up") + (lp("mlp/up_bias") if cfg.use_bias else 0)
        if cfg.mlp_type == "gelu":
          hid = gelu(up)
        elif cfg.mlp_type == "relu":
          hid = np.maximum(up, 0.0)
        else:
          gate = z @ lp("mlp/gate") + (lp("mlp/gate_bias") if cfg.use_bias else 0)
          hid = (gate / (1 + np.exp(-gate)) if cfg.mlp_type == "swiglu" else gelu(gate)) * up
        return hid @ lp("mlp/down") + (lp("mlp/down_bias") if cfg.use_bias else 0)

      if cfg.block_type == "parallel":
        x = x + attn + mlp(h)
      else:
        x = x + attn
        x = x + mlp(norm(x, "layers/mlp_norm", i))
    x = norm(x, "final_norm")
    out.append(x @ (p["embed/embedding"].T if cfg.tie_embeddings else p["unembed"]))
  return np.stack(out)


LENGTHS = (5, 4, 3)  # three documents packed into row 0 of the test batch


@pytest.fixture(scope="module")
def batch():
  """Row 0 packs three documents; rows 1-3 hold one of them each, followed by padding (segment 0)."""
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, TINY["vocab_size"], size=(n,)).astype(np.int32) for n in LENGTHS]
  tokens, segments = np.zeros((4, L), np.int32), np.zeros((4, L), np.int32)
  tokens[0] = np.concatenate(docs)
  segments[0] = np.concatenate([np.full(n, i + 1) for i, n in enumerate(LENGTHS)])
  for i, d in enumerate(docs):
    tokens[i + 1, :len(d)], segments[i + 1, :len(d)] = d, 1
  return tokens, segments


# One jitted forward for every test: models with the same config share one compilation.
FORWARD = nnx.jit(lambda m, t, s: m(t, s))
WINDOWED = dict(sliding_window=3, global_every=2)  # layer 0 windowed, layer 1 global

OPTION_SETS = {
    "llama": dict(),
    "window_every_2nd_global_unrolled": dict(WINDOWED, scan_layers=False),
    "layernorm_gelu_bias_tied": dict(norm_type="layernorm", mlp_type="gelu", use_bias=True, tie_embeddings=True),
    "relu_tied": dict(mlp_type="relu", tie_embeddings=True),  # MaxText's 2023 default decoder (ungated relu)
    "parallel_geglu_mqa_unroll2": dict(block_type="parallel", mlp_type="geglu", num_kv_heads=1, scan_unroll=2),
    "window_stack_fully_unrolled": dict(WINDOWED, scan_unroll=TINY["num_layers"]),  # a loop over the stack's slices
    "blockwise_window": dict(attention_impl="blockwise", attention_block_size=4, sliding_window=4,
                             rope_theta=500.0),
}


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_logits_match_numpy_reference(name, batch):
  cfg = make_cfg(**OPTION_SETS[name])
  m = model.Transformer(cfg, rngs=nnx.Rngs(1))
  if cfg.use_bias:  # zero-initialised biases would hide a missing bias; make them random
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
      if "bias" in str(path[-1]):
        var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.shape))
  got = np.asarray(FORWARD(m, *batch))
  assert got.dtype == np.float32
  want = numpy_forward(cfg, params_of(m), *batch)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def scanned():
  return model.Transformer(make_cfg(**WINDOWED), rngs=nnx.Rngs(0))


def _unrolled_copy(scanned):
  """An unrolled model holding the scanned model's parameters (layer i = slice i of the stack)."""
  unrolled = model.Transformer(dict(scanned.cfg, scan_layers=False), rngs=nnx.Rngs(5))
  stacked = nnx.state(scanned.layers, nnx.Param)
  for i, block in enumerate(unrolled.layers):
    nnx.update(block, jax.tree.map(lambda a: a[i], stacked))
  for attr in ("embed", "final_norm"):
    nnx.update(getattr(unrolled, attr), nnx.state(getattr(scanned, attr)))
  unrolled.unembed.set_value(scanned.unembed.get_value())
  return unrolled


def test_scan_and_unrolled_agree(scanned, batch):
  np.testing.assert_allclose(np.asarray(FORWARD(_unrolled_copy(scanned), *batch)),
                             np.asarray(FORWARD(scanned, *batch)), atol=1e-5)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_fully_unrolled_stack_has_the_scans_gradients(scanned, batch, policy):
  """scan_unroll = num_layers runs the stacked layers as a loop over slices: same loss and weight gradients."""
  tokens, segments = batch

  def loss_and_grads(unroll):
    m = model.Transformer(dict(scanned.cfg, scan_unroll=unroll), rngs=nnx.Rngs(0))
    m.remat = policy
    nnx.update(m, nnx.state(scanned, nnx.Param))
    loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens, segments))[..., 0] * (segments > 0))
    return nnx.jit(nnx.value_and_grad(loss))(m)  # one compile: op-by-op dispatch took ~10 s

  (loss_scan, g_scan), (loss_loop, g_loop) = loss_and_grads(1), loss_and_grads(TINY["num_layers"])
  np.testing.assert_allclose(float(loss_loop), float(loss_scan), rtol=1e-6)
  for (path, a), (_, b) in zip(nnx.to_flat_state(g_loop), nnx.to_flat_state(g_scan)):
    np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), atol=1e-6, err_msg=str(path))


def test_packed_row_equals_documents_run_separately(scanned, batch):
  tokens, segments = batch
  logits = np.asarray(FORWARD(scanned, tokens, segments))
  start = 0
  for i, n in enumerate(LENGTHS):
    np.testing.assert_allclose(logits[0, start:start + n], logits[i + 1, :n], atol=1e-5)
    start += n
  # Explicit per-document positions give the same logits as the default (derived from the segments).
  positions = np.concatenate([np.arange(n) for n in LENGTHS])[None].astype(np.int32)
  explicit = scanned(tokens[:1], segments[:1], positions)
  np.testing.assert_allclose(np.asarray(explicit), logits[:1], atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads(batch):
  gqa = model.Transformer(make_cfg(num_kv_heads=2), rngs=nnx.Rngs(2))
  mha = model.Transformer(make_cfg(num_kv_heads=4), rngs=nnx.Rngs(3))
  source = dict(nnx.to_flat_state(nnx.state(gqa, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(mha, nnx.Param)):
    src = source[path].get_value()
    if path[-1] in ("k", "v"):  # [layers, D, G, K]: query head h reads kv head h // 2
      src = jnp.repeat(src, 2, axis=2)
    var.set_value(src)
  np.testing.assert_allclose(np.asarray(FORWARD(mha, *batch)), np.asarray(FORWARD(gqa, *batch)), atol=1e-5)


def test_remat_policies_leave_gradients_unchanged(scanned, batch):
  tokens, segments = batch
  loss = lambda m: jnp.mean(jax.nn.logsumexp(m(tokens, segments), -1) ** 2)
  grad_fn = nnx.jit(nnx.grad(loss))
  reference = nnx.state(grad_fn(scanned))  # remat="none": no checkpointing at all
  full = model.Transformer(scanned.cfg, rngs=nnx.Rngs(0), remat="full")
  nnx.update(full, nnx.state(scanned))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), nnx.state(grad_fn(full)), reference)
  # Unrolled layers with a dot-based policy: gradients equal the scanned model's, slice by slice.
  unrolled = _unrolled_copy(scanned)
  unrolled.remat = "save_dots"
  grads = nnx.state(grad_fn(unrolled), nnx.Param)
  for i in range(scanned.cfg.num_layers):
    for a, b in zip(jax.tree.leaves(grads["layers"][i]), jax.tree.leaves(reference["layers"]), strict=True):
      np.testing.assert_allclose(a, b[i], atol=1e-6)
  np.testing.assert_allclose(grads["embed"]["embedding"].get_value(),
                             reference["embed"]["embedding"].get_value(), atol=1e-6)


def _saved_residuals(m, tokens):
  """The lines jax prints for each residual the backward pass keeps (tracing only, nothing compiled)."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(lambda s: nnx.merge(nnx.graphdef(m), s)(tokens).sum(), nnx.state(m))
  return buf.getvalue().splitlines()


def test_remat_policies_choose_what_is_saved(scanned, batch):
  unrolled = _unrolled_copy(scanned)  # per-layer residuals are visible outside a scan
  saved = {}
  for policy in ("none", "full", "save_qkv_proj"):
    unrolled.remat = policy
    saved[policy] = _saved_residuals(unrolled, batch[0])
  named = lambda lines: sorted(re.search(r"named '(\w+)'", l).group(1) for l in lines if " named '" in l)
  # attn_context and mlp_hidden feed 2-D projections (model.quant.project): without remat they are kept as the
  # flattened (bitcast) operand of that matmul, which carries no name; q, k and v as their heads-major transposes
  # (the operands of the attention products), unnamed too. The normalised MLP input keeps its name.
  assert "mlp_in" in named(saved["none"])
  assert named(saved["full"]) == [] and len(saved["full"]) < len(saved["none"])
  layers = scanned.cfg.num_layers
  assert named(saved["save_qkv_proj"]) == sorted(["key_proj", "query_proj", "value_proj"] * layers)
  assert set(remat.NAMES) >= set(named(saved["none"]))


def test_parallel_block_trains():
  cfg = make_cfg(block_type="parallel", num_layers=2)
  m = model.Transformer(cfg, rngs=nnx.Rngs(0))
  # Toy task: each sequence counts upward from a random start (mod vocab); the next token is predictable.
  starts = np.arange(8)[:, None] * 7
  tokens = ((starts + np.arange(17)[None]) % cfg.vocab_size).astype(np.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  def loss_fn(m):
    logits = m(inputs)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

  @nnx.jit
  def step(m, opt):
    loss, g = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, g)
    return loss

  losses = [float(step(m, opt)) for _ in range(30)]
  assert losses[-1] < 0.3 * losses[0], losses


def test_bfloat16_compute_keeps_float32_logits(batch):
  m32 = model.Transformer(make_cfg(), rngs=nnx.Rngs(4))
  m16 = model.Transformer(make_cfg(dtype="bfloat16"), rngs=nnx.Rngs(4))
  out = FORWARD(m16, *batch)
  assert out.dtype == jnp.float32
  assert m16.embed.embedding.get_value().dtype == jnp.float32  # param_dtype stays float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(FORWARD(m32, *batch)), atol=0.1)
