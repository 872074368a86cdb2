"""Long-context evaluation (evals/long_context.py, tasks passkey and position_ppl) and context extension from a
checkpoint (train.context_extension): prompt sizes by a tokenizer, the needle's depth, exact match per cell and
perplexity per position bucket against hand counts and a NumPy log-softmax of one forward pass, and which model
keys a run started from a checkpoint takes from where."""
import json
import math

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

import configs
import parallel
from configs import ConfigError
from data import tokenizer as tokenizer_lib
from evals import harness, long_context, tasks as tasks_lib
from evals.requests import LM
from model import Transformer
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from train.rundir import runconfig


def words(text):
  """A stand-in tokenizer: one token per whitespace-separated word."""
  return text.split()


@pytest.mark.parametrize("length,depth", [(64, 0.0), (200, 0.5), (500, 1.0), (333, 0.25)])
def test_passkey_prompt_fits_its_length_and_places_the_needle(length, depth):
  r = long_context.passkey_record(words, length, depth, "12345")
  used = 1 + len(words(r["context"])) + len(words(" 12345"))  # BOS, context, answer
  assert length - 12 < used <= length  # within one filler sentence (at most 7 words) of the length, never over
  assert r["context"].endswith(long_context.QUESTION) and r["answer"] == "12345"
  filler = r["context"].replace(long_context.QUESTION, "")
  before, after = filler.split("The pass key is 12345.")
  n_before, n_after = before.count(". "), after.count(". ") - 2  # the needle's own two sentences
  assert abs(n_before / max(n_before + n_after, 1) - depth) <= 1 / max(n_before + n_after, 1)


def test_passkey_exact_match_per_length_and_depth(tmp_path):
  records = [dict(long_context.passkey_record(words, n, d, k), answer=k)
             for n, d, k in [(64, 0.0, "11111"), (64, 1.0, "22222"), (128, 0.0, "33333"), (128, 0.0, "44444")]]
  path = tmp_path / "passkey.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  task = tasks_lib.load_task("passkey", str(path))
  out = task.aggregate(task.docs, [" 11111", "2222", "33333 ", "55555"])  # right, wrong, right, wrong
  assert out["exact_match"] == 0.5
  assert out["exact_match_len64"] == 0.5 and out["exact_match_len128"] == 0.5
  assert out["exact_match_len64_depth0"] == 1.0 and out["exact_match_len64_depth1"] == 0.0
  assert out["exact_match_len128_depth0"] == 0.5


def test_position_buckets_hand_counted():
  results = [np.log(np.full(300, 0.5)), np.log(np.full(100, 0.25))]  # two documents of 301 and 101 tokens
  out = tasks_lib.Task("position_ppl", "", tasks_lib.POSITIONS, [], tasks_lib._positions_aggregate).aggregate(
      [], results)
  # tokens 1..127 of both (127 + 100 of them), 128..255 and 256..300 of the first only
  want = (127 * math.log(2) + 100 * math.log(4)) / 227
  assert out["tokens_pos0_128"] == 227 and out["nll_pos0_128"] == pytest.approx(want)
  assert out["tokens_pos128_256"] == 128 and out["perplexity_pos128_256"] == pytest.approx(2.0)
  assert out["tokens_pos256_512"] == 45 and "nll_pos512_1024" not in out


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
  import pydoc_data.topics
  path = tmp_path_factory.mktemp("tok") / "tok.model"
  tokenizer_lib.train(list(pydoc_data.topics.topics.values()), str(path), 512, max_sentences=2000)
  tok = tokenizer_lib.Tokenizer.load(str(path))
  c = configs.load("tiny")
  c.model.update(vocab_size=tok.vocab_size, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                 mlp_dim=64, max_seq_len=64)
  c.mesh.update(data=2, fsdp=1, tensor=1, sequence=4)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  with parallel.activate(mesh, rules):
    model = Transformer(c.model, rngs=nnx.Rngs(0))
  return LM(model, tok, mesh, rules, batch_size=4)


def test_token_logprobs_equal_a_numpy_log_softmax_of_one_forward_pass(lm, tmp_path):
  """Batched, padded and sharded over data 2 x sequence 4, each document's per-token scores equal a NumPy
  log-softmax of its own unpadded forward pass; the task reads them into buckets."""
  texts = ["The list is a mutable sequence. " * 3, "def f(x):\n    return x + 1\n" * 6, "A short one."]
  got = lm.token_logprobs(texts)
  forward = nnx.jit(lambda model, tokens: model(tokens))
  for text, scores in zip(texts, got):
    ids = lm.tok_encode(text)[:lm.max_len]
    with parallel.activate(lm.mesh, lm.rules):
      logits = np.asarray(forward(lm.model, np.asarray([ids], np.int32))[0], np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    want = [logp[j - 1, ids[j]] for j in range(1, len(ids))]
    np.testing.assert_allclose(scores, want, atol=1e-4)
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  out = harness.evaluate(lm, [("position_ppl", str(path))])["results"]["position_ppl"]
  assert out["tokens_pos0_128"] == sum(len(s) for s in got)


def test_context_extension_takes_the_runs_rope_keys_only_when_asked():
  source = dict(configs.load("tiny").model)
  extended = configs.load("long_tiny")
  notes = runconfig.model_from(extended, source, "runs/tiny/checkpoints/300", [])
  assert extended.model.max_seq_len == 2048 and extended.model.rope_scaling == "yarn"
  assert any("context extension" in n for n in notes)
  llama_like = dict(source, rope_theta=500000.0)  # a key long_tiny leaves at its default keeps the checkpoint's
  kept = configs.load("long_tiny")
  runconfig.model_from(kept, llama_like, "x", [])
  assert kept.model.rope_theta == 500000.0 and kept.model.rope_scaling == "yarn"
  plain = configs.load("long_tiny", **{"train.context_extension": False})
  runconfig.model_from(plain, source, "runs/tiny/checkpoints/300", [])
  assert plain.model.max_seq_len == 128 and plain.model.rope_scaling == "none"  # the checkpoint's, as before
  with pytest.raises(ConfigError, match="model.num_layers"):
    runconfig.model_from(configs.load("long_tiny", **{"model.num_layers": 6}), source, "x",
                         ["model.num_layers"])
