"""The inference engine (model/engine.py, model/paged.py): greedy tokens equal model.generate's for requests
arriving at different steps, with the pool running short (preemption by recomputation); chunked prefill into the
paged cache equals one forward pass; a sampled request's tokens do not depend on the traffic around it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from model import Transformer
from model import engine as engine_lib
from model import generate as generate_lib
from model import paged

SMALL = {"model.vocab_size": 256, "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.max_seq_len": 96,
         # a sliding-window layer beside a global one: the pages' mask must apply the window
         "model.layer_types": ("sliding", "full"), "model.sliding_window": 8}
LENGTHS = (3, 17, 30, 5, 44, 9, 21)


@pytest.fixture(scope="module")
def model():
  return Transformer(configs.load("tiny", **SMALL).model, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts_and_greedy(model):
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(1, 256, size=n)] for n in LENGTHS]
  return prompts, generate_lib.generate(model, prompts, 12)  # the static sampler: one batch, left-padded


def _arrivals(engine, prompts, max_new_tokens, every=2):
  """Adds prompt i at step i * every (requests join while others decode); returns each prompt's tokens."""
  out, ids, step = {}, {}, 0
  while len(out) < len(prompts):
    for i, p in enumerate(prompts):
      if i * every == step:
        ids[engine.add(p, max_new_tokens)] = i
    out.update({ids[r.rid]: r.tokens for r in engine.step()})
    step += 1
  return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("pool", ["ample", "short"])
def test_greedy_stream_equals_the_static_sampler(model, prompts_and_greedy, pool):
  prompts, want = prompts_and_greedy
  kwargs = {"num_pages": 10, "max_len": 64} if pool == "short" else {}
  engine = engine_lib.Engine(model, max_seqs=4, page_size=8, chunk=7, **kwargs)
  assert _arrivals(engine, prompts, 12) == want
  assert (engine.stats["preemptions"] > 0) == (pool == "short")
  assert not engine.refs and len(engine.free) + len(engine.evictable) == engine.num_pages - 1  # all pages back


def test_prefix_caching_shares_pages_and_keeps_the_tokens(model):
  """Prompts behind one 24-token system prefix: with prefix caching the later requests reuse its pages (fewer tokens
  fed), and every request's greedy tokens equal model.generate's, as without it."""
  rng = np.random.default_rng(2)
  system = [int(t) for t in rng.integers(1, 256, size=24)]
  prompts = [system + [int(t) for t in rng.integers(1, 256, size=n)] for n in (3, 9, 1, 14)]
  want = generate_lib.generate(model, prompts, 8)
  fed = {}
  for caching in (True, False):
    engine = engine_lib.Engine(model, max_seqs=2, page_size=8, chunk=16, prefix_caching=caching)
    assert engine.generate(prompts, 8) == want
    fed[caching] = engine.stats["tokens_fed"]
    # the first request computes the prefix while the others wait for it (their first page is the one it is
    # prefilling); then each of them finds its 3 full pages (all 3 lie before each prompt's last token)
    assert engine.stats["prefix_hit_tokens"] == (3 * 24 if caching else 0)
  assert fed[True] == fed[False] - 3 * 24


def test_chunked_prefill_equals_one_forward_pass(model):
  """A 29-token prompt fed in uneven chunks (5, 11, 13) through the paged cache, pages scattered over the pool:
  every position's logits equal the one-shot forward's (float32, 1e-5)."""
  tokens = np.random.default_rng(1).integers(1, 256, size=(1, 29)).astype(np.int32)
  want = np.asarray(model(jnp.asarray(tokens)))[0]
  page, table = 4, np.array([[7, 2, 9, 4, 1, 8, 3, 6]], np.int32)  # 8 pages of 4 slots: 32 >= 29
  k, v = paged.pools(model.cfg, 10, page)
  got, start = [], 0
  for n in (5, 11, 13):
    cache = paged.PagedKVCache(k, v, jnp.asarray(table), jnp.asarray([start], jnp.int32))
    x, cache = model.features(jnp.asarray(tokens[:, start:start + n]), jnp.ones((1, n), jnp.int32),
                              jnp.arange(start, start + n, dtype=jnp.int32)[None], cache=cache)
    got.append(np.asarray(model.logits(x))[0])
    k, v, start = cache.k, cache.v, start + n
  np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=1e-5)


def test_a_sampled_request_ignores_the_traffic_around_it(model, prompts_and_greedy):
  prompts, _ = prompts_and_greedy
  alone = engine_lib.Engine(model, max_seqs=2, page_size=8)
  rid = alone.add(prompts[1], 10, temperature=1.0, seed=3)
  solo = {}
  while alone.busy():
    solo.update({r.rid: (r.tokens, r.logprobs) for r in alone.step()})
  crowded = engine_lib.Engine(model, max_seqs=4, page_size=8, chunk=5)
  for p in prompts[:3]:
    crowded.add(p, 10, temperature=1.0, seed=11)
  mine = crowded.add(prompts[1], 10, temperature=1.0, seed=3)
  got = {}
  while crowded.busy():
    got.update({r.rid: (r.tokens, r.logprobs) for r in crowded.step()})
  assert got[mine][0] == solo[rid][0]
  np.testing.assert_allclose(got[mine][1], solo[rid][1], rtol=0, atol=1e-5)
  assert got[mine][0] != got[1][0]  # same prompt, another seed: another draw


def test_bad_requests_are_refused(model):
  engine = engine_lib.Engine(model, max_seqs=2, page_size=8, max_len=32)
  with pytest.raises(ValueError, match="max_len=32"):
    engine.add(list(range(1, 30)), 8)
  with pytest.raises(ValueError, match="non-empty prompt"):
    engine.add([], 4)
  with pytest.raises(ValueError, match="num_pages=3"):
    engine_lib.Engine(model, page_size=8, num_pages=3, max_len=32)


def test_speculative_greedy_equals_plain_greedy(model):
  """n-gram prompt-lookup drafts (3 per step) on prompts that repeat themselves: drafts are accepted, and the tokens
  are plain greedy decoding's (model.generate) exactly."""
  rng = np.random.default_rng(4)
  prompts = [[int(t) for t in np.tile(rng.integers(1, 256, size=n), 4)] for n in (3, 5, 7)]
  want = generate_lib.generate(model, prompts, 16)
  engine = engine_lib.Engine(model, max_seqs=3, page_size=8, chunk=8, speculative=3)
  assert engine.generate(prompts, 16) == want
  assert engine.stats["drafted"] > 0 and engine.stats["accepted"] > 0


def test_a_draft_model_proposes_and_greedy_stays_plain_greedy(model):
  """A smaller meshlm model drafting 3 tokens per step (verified by the target in one call): the tokens are plain
  greedy decoding's although the draft proposes tokens the target refuses."""
  rng = np.random.default_rng(6)
  prompts = [[int(t) for t in rng.integers(1, 256, size=n)] for n in (4, 19, 11)]
  want = generate_lib.generate(model, prompts, 14)
  small = Transformer(configs.load("tiny", **{**SMALL, "model.num_layers": 1, "model.d_model": 16,
                                              "model.mlp_dim": 32, "model.layer_types": ()}).model,
                      rngs=nnx.Rngs(7))
  engine = engine_lib.Engine(model, max_seqs=3, page_size=8, chunk=8, speculative=3, draft=small)
  assert engine.generate(prompts, 14) == want
  drafted, accepted = engine.stats["drafted"], engine.stats["accepted"]
  assert 0 < drafted and accepted < drafted, (drafted, accepted)  # its drafts are checked, some refused
  with pytest.raises(ValueError, match="speculative >= 1"):
    engine_lib.Engine(model, draft=small)


def test_speculative_sampling_keeps_the_target_distribution():
  """The acceptance rule with a deterministic draft (engine.verify): over 4000 seeds, the first token it emits is
  distributed as the target softmax(logits / T) (chi-square, 5 categories), for a likely and an unlikely draft."""
  from scipy import stats
  logits = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])) * 2.0  # T = 2 undoes the x2
  p = np.exp(logits[0] / 2.0) / np.exp(logits[0] / 2.0).sum()
  for draft in (0, 4):
    counts = np.zeros(5)
    for seed in range(4000):
      r = engine_lib.Request(0, [1, 2], 8, temperature=2.0, seed=seed, tokens=[3], drafts=[draft])
      new, _ = engine_lib.verify(logits, r)
      counts[new[0]] += 1
    assert stats.chisquare(counts, 4000 * p).pvalue > 1e-3, (draft, counts)


def test_engine_sample_equals_the_static_sampler_on_a_mesh():
  """engine.sample (what train.rl uses with rl.engine=True) under parallel.activate on data 2 x fsdp 2 x tensor 2:
  greedy tokens and their log-probabilities equal model.generate.sample's."""
  import parallel
  from parallel import mesh as mesh_lib
  from parallel import rules as rules_lib
  c = configs.load("tiny", **SMALL)
  c.mesh.update(data=2, fsdp=2, tensor=2)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  rng = np.random.default_rng(5)
  prompts = [[int(t) for t in rng.integers(1, 256, size=n)] for n in (4, 13, 8)]
  with parallel.activate(mesh, rules):
    sharded = Transformer(c.model, rngs=nnx.Rngs(0))
    want = generate_lib.sample(sharded, prompts, 10, stop_ids=(7,))
    got = engine_lib.sample(sharded, prompts, 10, stop_ids=(7,), max_len=40)
  assert got.tokens == want.tokens
  for a, b in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_a_windowed_model_frees_the_pages_its_window_left_behind():
  """Every layer windowed (8 tokens): a sequence gives back the pages before its next query's window, so two
  68-token sequences run in a pool of 9 pages of 4 slots (each needs 17 without freeing) with model.generate's
  greedy tokens and no preemption."""
  windowed = Transformer(configs.load("tiny", **{**SMALL, "model.layer_types": ("sliding",)}).model,
                         rngs=nnx.Rngs(1))
  rng = np.random.default_rng(4)
  prompts = [[int(t) for t in rng.integers(1, 256, size=n)] for n in (20, 13)]
  want = generate_lib.generate(windowed, prompts, 48)
  engine = engine_lib.Engine(windowed, max_seqs=2, page_size=4, chunk=4, num_pages=1 + 2 * 4)
  assert engine.generate(prompts, 48) == want
  assert engine.stats["preemptions"] == 0
  assert engine.stats["window_freed_pages"] >= 2 * (60 // 4 - 4)


PLAIN = {**SMALL, "model.layer_types": (), "model.sliding_window": 0, "model.head_dim": 128,
         "model.dtype": "bfloat16"}


def test_the_pallas_decode_kernel_equals_the_gather():
  """The TPU paged-attention kernel (interpret mode on CPU) for the decode calls of a bfloat16 model without
  windows: the tokens and log-probabilities of the XLA gather path (the kernel reads bfloat16 pages as stored)."""
  m = Transformer(configs.load("tiny", **PLAIN).model, rngs=nnx.Rngs(8))
  rng = np.random.default_rng(9)
  prompts = [[int(t) for t in rng.integers(1, 256, size=n)] for n in (5, 21)]
  out = {}
  for attention in ("xla", "pallas"):
    engine = engine_lib.Engine(m, max_seqs=2, page_size=16, chunk=16, attention=attention)
    assert engine.kernel == ("xla" if attention == "xla" else "interpret")
    ids = [engine.add(p, 4) for p in prompts]
    requests = [engine.live[i] for i in ids]
    while engine.busy():
      engine.step()
    out[attention] = requests
  for a, b in zip(out["xla"], out["pallas"]):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-2)
  with pytest.raises(ValueError, match="no sliding window"):
    engine_lib.Engine(Transformer(configs.load("tiny", **SMALL).model, rngs=nnx.Rngs(0)), attention="pallas")


def test_ahead_of_time_tpu_compile_of_a_decode_step_holds_the_paged_kernel():
  """The engine's decode program for a v5e-4 slice (data 2 x tensor 2), compiled by libtpu with no TPU attached:
  attention over the pages is the Mosaic paged-attention kernel (a tpu_custom_call), per device under shard_map."""
  import parallel
  from jax.sharding import NamedSharding, PartitionSpec
  from parallel import mesh as mesh_lib
  from parallel import rules as rules_lib
  from train.planning import compile as aot
  from train.planning import hardware
  if not aot._libtpu_installed():  # pylint: disable=protected-access
    pytest.skip("libtpu (the TPU compiler) is not installed")
  c = configs.load("tiny", **{**PLAIN, "model.num_kv_heads": 2, "mesh.data": 2, "mesh.tensor": 2})
  mesh = mesh_lib.make_mesh(c.mesh, devices=aot.abstract_devices(hardware.tpu_slice("v5e-4")))
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  S, P, N = 4, 4, 32
  with parallel.activate(mesh, rules):
    abstract = nnx.eval_shape(lambda: Transformer(c.model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    specs = nnx.get_partition_spec(state)
    state = jax.tree.map(lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p)),
                         state, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    pool = jax.eval_shape(lambda: paged.pools(c.model, N, 16)[0])
    pool = jax.ShapeDtypeStruct(pool.shape, pool.dtype,
                                sharding=NamedSharding(mesh, jax.sharding.PartitionSpec("tensor")))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = (i32(S, 1), i32(S, 1), i32(S, 1), i32(S, P), i32(S), i32(S), i32(S), i32(S), i32(S),
            jax.ShapeDtypeStruct((S,), jnp.float32))
    compiled = engine_lib._jitted_forward(1, kernel="pallas").lower(graphdef, state, pool, pool, *args).compile()
  hlo = compiled.as_text()
  kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  assert len(kernels) == 1 and "%paged_attention" in kernels[0]  # one layer's program, scanned


def _deepseek_style(mtp_depth: int):
  """Multi-head latent attention (q LoRA, interleaved RoPE), a dense first layer then sigmoid-routed dropless MoE
  layers with a shared expert, and `mtp_depth` multi-token heads: DeepSeek-V3's layout at toy size."""
  c = configs.load("tiny_moe")
  c.model.update(vocab_size=256, d_model=32, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=8, mlp_dim=32,
                 expert_mlp_dim=16, num_experts=4, experts_per_token=2, max_seq_len=96, num_shared_experts=1,
                 router="sigmoid", first_dense_layers=1, capacity_factor=0.0, attention_type="mla",
                 q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 rope_interleave=True, mtp_depth=mtp_depth)
  return Transformer(c.model, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def deepseek():
  return _deepseek_style(mtp_depth=1)


def test_latent_attention_pages_hold_the_latents_and_give_one_pass_logits(deepseek):
  """MLA's pages hold the latent (kv_lora_rank) and the RoPE key (qk_rope_head_dim) per slot, not per-head keys;
  a 29-token prompt fed in chunks of 5, 11 and 13 over scattered pages gives the one-shot forward's logits (1e-5)."""
  k, v = paged.pools(deepseek.cfg, 10, 4)
  assert k.shape == (1, 3, 10, 4, 16) and v.shape == (1, 3, 10, 4, 4)
  tokens = np.random.default_rng(1).integers(1, 256, size=(1, 29)).astype(np.int32)
  want = np.asarray(deepseek(jnp.asarray(tokens)))[0]
  table, got, start = jnp.asarray([[7, 2, 9, 4, 1, 8, 3, 6]], jnp.int32), [], 0
  for n in (5, 11, 13):
    cache = paged.PagedKVCache(k, v, table, jnp.asarray([start], jnp.int32))
    x, cache = deepseek.features(jnp.asarray(tokens[:, start:start + n]), jnp.ones((1, n), jnp.int32),
                                 jnp.arange(start, start + n, dtype=jnp.int32)[None], cache=cache)
    got.append(np.asarray(deepseek.logits(x))[0])
    k, v, start = cache.k, cache.v, start + n
  np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=1e-5)


def _stepped(engine, prompts, max_new_tokens):
  """Every prompt's tokens, and per prompt {sequence length: the multi-token head's guess at the token after the
  newest} read after every step."""
  requests = [engine.live[engine.add(p, max_new_tokens)] for p in prompts]
  guesses = [{} for _ in prompts]
  while engine.busy():
    engine.step()
    for i, r in enumerate(requests):
      if r.mtp_next is not None and not r.done:
        guesses[i][len(r.sequence)] = r.mtp_next
  return [r.tokens for r in requests], guesses


def test_the_multi_token_head_drafts_what_it_predicts(deepseek):
  """draft='mtp' on the DeepSeek-style model, prompts behind a shared 16-token prefix (prefix caching on) in a pool
  short enough to preempt: greedy tokens equal model.generate's, and every draft the head made equals the argmax
  of the multi-token head's logits in one training-style forward over the finished sequences (position L - 2
  predicts token L: Transformer(mtp=True), causal, so the right padding changes nothing before it)."""
  from model import transformer as transformer_lib
  rng = np.random.default_rng(12)
  system = [int(t) for t in rng.integers(1, 256, size=16)]
  prompts = [system + [int(t) for t in rng.integers(1, 256, size=n)] for n in (3, 12, 1, 9)]
  want = generate_lib.generate(deepseek, prompts, 8)
  engine = engine_lib.Engine(deepseek, max_seqs=2, page_size=8, chunk=8, speculative=1, draft="mtp", num_pages=8,
                             max_len=40)
  tokens, guesses = _stepped(engine, prompts, 8)
  assert tokens == want
  assert engine.stats["drafted"] > 0 and engine.stats["prefix_hit_tokens"] > 0 and engine.stats["preemptions"] > 0
  finished = [p + t for p, t in zip(prompts, tokens)]
  padded = np.asarray([s + [0] * (40 - len(s)) for s in finished], np.int32)
  _, aux = deepseek(jnp.asarray(padded), return_aux=True, mtp=True)
  predicted = np.argmax(np.asarray(deepseek.logits(aux[transformer_lib.MTP_FEATURES][0])), axis=-1)
  for row, seen in enumerate(guesses):
    assert seen and all(predicted[row, L - 2] == g for L, g in seen.items()), (row, seen, predicted[row])


def test_mtp_drafts_are_refused_where_they_cannot_act(deepseek, model):
  with pytest.raises(ValueError, match="mtp_depth >= 1"):
    engine_lib.Engine(model, speculative=1, draft="mtp")
  with pytest.raises(ValueError, match="speculative=1"):
    engine_lib.Engine(deepseek, speculative=2, draft="mtp")
  with pytest.raises(ValueError, match="latent attention"):
    engine_lib.Engine(deepseek, attention="pallas")
