"""Pseudo-log-likelihood of a masked-LM encoder against a brute-force loop (one unpadded forward pass per masked
token), the CrowS-Pairs shared-token variant, and refusal of a causal model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from data import tokenizer as tokenizer_lib
import parallel
from evals import bias
from evals import harness
from evals import pll
from evals.requests import LM
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib

V = 128


def _model_config(causal=False):
  c = configs.load("tiny").model
  c.update(vocab_size=V, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
           max_seq_len=32, init_std=0.2, causal=causal)
  return c


@pytest.fixture(scope="module")
def encoder():
  return model_lib.Transformer(_model_config(), rngs=nnx.Rngs(0))


_forward = nnx.jit(lambda m, x: m(x))


def brute_force_pll(m, seq, positions):
  """sum over t in positions of log_softmax(model(seq with t masked))[t, seq[t]], one row at a time."""
  total = 0.0
  for t in positions:
    x = np.asarray(seq, np.int32)[None].copy()
    x[0, t] = tokenizer_lib.MASK_ID
    logits = np.asarray(_forward(m, jnp.asarray(x))[0, t], np.float64)
    total += logits[seq[t]] - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
  return total


def test_pll_equals_a_brute_force_loop(encoder):
  rng = np.random.default_rng(0)
  seqs = [[2] + rng.integers(30, V, size=n).tolist() for n in (8, 11, 4)]  # 9, 12 and 5 tokens
  got = pll.pseudo_log_likelihood(encoder, seqs, batch_size=8)  # 26 masked rows: 4 padded batches
  want = [brute_force_pll(encoder, s, range(len(s))) for s in seqs]
  np.testing.assert_allclose(got, want, rtol=2e-5)
  scored = [[t % 2 == 1 for t in range(len(s))] for s in seqs]
  got = pll.pseudo_log_likelihood(encoder, seqs, scored=scored, batch_size=8)
  np.testing.assert_allclose(got, [brute_force_pll(encoder, s, range(1, len(s), 2)) for s in seqs], rtol=2e-5)


class _Tokens:
  """A tokenizer over space-separated integers (ids as written), BOS 2."""
  bos_id = 2

  def encode(self, text):
    return [int(w) for w in text.split()]


def test_crows_pairs_scores_mask_only_the_shared_tokens(encoder):
  # Lengths 5, 9 and 12 with BOS, the shapes the first test compiled.
  a, b = [2, 50, 51, 52, 53, 54, 55, 56, 57], [2, 50, 51, 60, 61, 62, 63, 53, 54, 55, 56, 57]
  pairs = [("40 41 42 43", "40 41 90 43"), (" ".join(map(str, a[1:])), " ".join(map(str, b[1:])))]
  more, less = pll.crows_pairs_scores(encoder, _Tokens(), pairs)
  assert pll.shared_positions([2, 40, 41, 42, 43], [2, 40, 41, 90, 43]) == \
      ([True, True, True, False, True], [True, True, True, False, True])
  want_more = [brute_force_pll(encoder, [2, 40, 41, 42, 43], [1, 2, 4]),
               brute_force_pll(encoder, a, [1, 2, 4, 5, 6, 7, 8])]
  want_less = [brute_force_pll(encoder, [2, 40, 41, 90, 43], [1, 2, 4]),
               brute_force_pll(encoder, b, [1, 2, 7, 8, 9, 10, 11])]
  np.testing.assert_allclose(more, want_more, rtol=2e-5)
  np.testing.assert_allclose(less, want_less, rtol=2e-5)
  metrics = bias.crows_pairs(more, less, ["a", "b"])
  assert metrics["pct_stereotype"] == np.mean(np.array(want_more) > np.array(want_less))


def test_evaluate_scores_crows_pairs_of_an_encoder_by_shared_token_pll(encoder, tmp_path):
  (tmp_path / "cp.csv").write_text(",sent_more,sent_less,stereo_antistereo,bias_type\n"
                                   "0,40 41 42 43,40 41 90 43,stereo,age\n1,50 51 52 53,50 51 52 60,stereo,race\n")
  c = configs.load("tiny")
  c.model = _model_config()
  mesh = mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:1])
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  with parallel.activate(mesh, rules):
    out = harness.evaluate(LM(encoder, _Tokens(), mesh, rules), [("crows_pairs", str(tmp_path / "cp.csv"))])
  more = [brute_force_pll(encoder, [2, 40, 41, 42, 43], [1, 2, 4]),
          brute_force_pll(encoder, [2, 50, 51, 52, 53], [1, 2, 3])]
  less = [brute_force_pll(encoder, [2, 40, 41, 90, 43], [1, 2, 4]),
          brute_force_pll(encoder, [2, 50, 51, 52, 60], [1, 2, 3])]
  got = out["results"]["crows_pairs"]
  assert got["pct_stereotype"] == np.mean(np.array(more) > np.array(less))
  np.testing.assert_allclose(got["likelihood_diff"], np.mean(np.abs(np.array(more) - np.array(less))), rtol=1e-4)


def test_a_causal_model_is_refused():
  with pytest.raises(ValueError, match="model.causal=false"):
    decoder = nnx.eval_shape(lambda: model_lib.Transformer(_model_config(causal=True), rngs=nnx.Rngs(0)))
    pll.pseudo_log_likelihood(decoder, [[2, 40, 41]])
