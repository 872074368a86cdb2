"""Sharded, streaming Hugging Face load and save on the 8-device CPU mesh: each device holds only its block, the
logits equal transformers' (PyTorch) on the same files, sharded saves load in transformers and back bit for bit,
and missing or truncated shard files are named."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import configs
import parallel
from model import hf
from model import safetensors_io
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from test_hf import _hf_logits, _random_hf_model  # tests/ is on sys.path under pytest

TOL = 1e-4
V = 128
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rope_theta=50000.0)
# (mesh axes, rules overrides): fsdp 8; fsdp 2 x tensor 4 (kv heads replicated: 2 kv heads on 4 shards); and
# head_dim over tensor, so a device's rows of an HF [heads*head_dim, hidden] weight are not contiguous.
LAYOUTS = {
    "fsdp8": ({"fsdp": 8}, ()),
    "fsdp2_tensor4": ({"fsdp": 2, "tensor": 4}, ()),
    "head_dim_split": ({"fsdp": 2, "tensor": 4}, (("heads", None), ("kv_heads", None), ("head_dim", "tensor"))),
}


def _mesh(axes, rules=(), model_cfg=None):
  config = configs.load("tiny", **{f"mesh.{k}": v for k, v in {"data": 1, **axes}.items()})
  config.mesh.rules = rules
  mesh = mesh_lib.make_mesh(config.mesh)
  return mesh, tuple(rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), model_cfg or config.model, mesh))


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  ref = _random_hf_model("llama", seed=7, **LLAMA)
  path = tmp_path_factory.mktemp("llama")
  ref.save_pretrained(path, max_shard_size="60KB")  # several files + model.safetensors.index.json
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
  tokens = np.random.default_rng(0).integers(0, V, size=(8, 16))  # batch over 8 devices.astype(np.int32)
  return ref, str(path), tokens, _hf_logits(ref, tokens)


@pytest.fixture(scope="module")
def unsharded(llama):
  return hf.load(llama[1], progress=False)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_load_gives_transformers_logits_and_each_device_its_block(llama, unsharded, layout):
  _, path, tokens, want = llama
  mesh, rules = _mesh(*LAYOUTS[layout], model_cfg=unsharded.cfg)
  with parallel.activate(mesh, rules):  # the active mesh and rules choose the sharded path
    model = hf.load(path, progress=False)
    got = np.asarray(model(jnp.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  sharded = 0
  for (key, x), ref in zip(jax.tree_util.tree_leaves_with_path(_params(model)),
                           jax.tree.leaves(_params(unsharded))):
    assert x.sharding.mesh == mesh and x.shape == ref.shape, key
    for shard in x.addressable_shards:  # each device holds exactly its block of the parameter
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(ref)[shard.index], err_msg=str(key))
    sharded += int(np.prod(x.addressable_shards[0].data.shape) < np.prod(ref.shape))
  assert sharded >= 8  # every weight matrix is split somewhere, not only replicated
  q = model.layers.attn.q.get_value()  # [layers, hidden, heads, head_dim]
  blocks = {"fsdp8": (2, 8, 4, 16), "fsdp2_tensor4": (2, 32, 1, 16), "head_dim_split": (2, 32, 4, 4)}[layout]
  assert {s.data.shape for s in q.addressable_shards} == {blocks}


@pytest.fixture(scope="module")
def saved_sharded(llama, unsharded, tmp_path_factory):
  """The fsdp 2 x tensor 4 model saved in 40 KB files, and the model it came from."""
  _, path, _, _ = llama
  mesh, rules = _mesh({"fsdp": 2, "tensor": 4}, model_cfg=unsharded.cfg)
  model = hf.load(path, mesh=mesh, rules=rules, progress=False)
  out = tmp_path_factory.mktemp("saved")
  files = hf.save(model, str(out), max_shard_size="40KB", progress=False)
  return model, str(out), files, (mesh, rules)


def test_sharded_save_is_huggingface_layout_and_loads_in_transformers(llama, saved_sharded):
  _, _, tokens, want = llama
  _, out, files, _ = saved_sharded
  index = json.load(open(os.path.join(out, safetensors_io.INDEX)))
  assert len(files) > 3 and files == sorted(set(index["weight_map"].values()))
  assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert not os.path.exists(os.path.join(out, safetensors_io.SINGLE))
  for f in files:  # HF's rule: a file passes 40 KB only when it holds one tensor
    held = [k for k, v in index["weight_map"].items() if v == f]
    assert os.path.getsize(os.path.join(out, f)) <= 40_000 + 1024 or len(held) == 1, f
  assert index["metadata"]["total_size"] == sum(int(np.prod(p.shape)) * 4 for p in
                                                jax.tree.leaves(_params(saved_sharded[0])))
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
  np.testing.assert_allclose(_hf_logits(back, tokens), want, atol=TOL, rtol=0)


def test_sharded_save_then_sharded_load_gives_identical_parameters(saved_sharded):
  model, out, _, _ = saved_sharded
  mesh, rules = _mesh({"fsdp": 8}, model_cfg=model.cfg)  # another layout than the one saved from
  again = hf.load(out, mesh=mesh, rules=rules, progress=False)
  for a, b in zip(jax.tree.leaves(_params(again)), jax.tree.leaves(_params(model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_save_rounds_like_torch(llama, saved_sharded, tmp_path):
  ref = llama[0]
  model, _, _, _ = saved_sharded
  hf.save(model, str(tmp_path), dtype="bfloat16", max_shard_size="20KB", progress=False)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
  for name, p in ref.state_dict().items():
    assert torch.equal(back.state_dict()[name], p.bfloat16()), name
  # And read back (bf16 files, bf16 parameters) on a mesh: the same bf16 values.
  mesh, rules = _mesh({"fsdp": 8}, model_cfg=model.cfg)
  again = hf.load(str(tmp_path), dtype="bfloat16", mesh=mesh, rules=rules, progress=False)
  np.testing.assert_array_equal(np.asarray(again.embed.embedding.get_value()).astype(np.float32),
                                ref.model.embed_tokens.weight.detach().bfloat16().float().numpy())


def test_resave_replaces_the_earlier_layout(saved_sharded, tmp_path):
  model, _, _, _ = saved_sharded
  hf.save(model, str(tmp_path), max_shard_size="40KB", progress=False)
  hf.save(model, str(tmp_path), progress=False)  # fits one file now: the shards and index must go
  weights = sorted(f for f in os.listdir(tmp_path) if "safetensors" in f)
  assert weights == [safetensors_io.SINGLE]


def test_missing_and_truncated_shard_files_are_named(saved_sharded, tmp_path):
  _, out, files, (mesh, rules) = saved_sharded
  for f in os.listdir(out):
    (tmp_path / f).write_bytes(open(os.path.join(out, f), "rb").read())
  victim = tmp_path / files[2]
  data = victim.read_bytes()
  victim.write_bytes(data[:-100])
  with pytest.raises(safetensors_io.FileError, match=rf"{files[2]} is truncated"):
    hf.load(str(tmp_path), mesh=mesh, rules=rules, progress=False)
  victim.write_bytes(data[:6])
  with pytest.raises(safetensors_io.FileError, match=rf"{files[2]} is truncated"):
    hf.load(str(tmp_path), progress=False)
  victim.unlink()
  with pytest.raises(safetensors_io.FileError, match=rf"lists {files[2]}, missing"):
    hf.load(str(tmp_path), mesh=mesh, rules=rules, progress=False)


def test_mixtral_sharded_round_trip(tmp_path):
  ref = _random_hf_model("mixtral", seed=11, vocab_size=V, hidden_size=32, intermediate_size=48,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
  ref.save_pretrained(tmp_path / "src", max_shard_size="50KB")
  tokens = np.random.default_rng(1).integers(0, V, size=(8, 12)).astype(np.int32)
  want = _hf_logits(ref, tokens)
  cfg = hf.config_from_hf(ref.config.to_dict())
  mesh, rules = _mesh({"expert": 2, "fsdp": 2, "tensor": 2}, model_cfg=cfg)
  with parallel.activate(mesh, rules):
    model = hf.load(str(tmp_path / "src"), moe_impl="tiled", progress=False)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), want, atol=TOL, rtol=0)
  gate = model.layers.moe.gate.get_value()  # [layers, experts, hidden, mlp]: experts over expert, mlp over tensor
  assert {s.data.shape for s in gate.addressable_shards} == {(2, 2, 16, 24)}
  files = hf.save(model, str(tmp_path / "out"), max_shard_size="30KB", progress=False)
  assert len(files) > 2
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
  np.testing.assert_allclose(_hf_logits(back, tokens), want, atol=TOL, rtol=0)
  again = hf.load(str(tmp_path / "out"), mesh=mesh, rules=rules, moe_impl="tiled", progress=False)
  for a, b in zip(jax.tree.leaves(_params(again)), jax.tree.leaves(_params(model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shard_plan_follows_huggingface():
  f32 = np.dtype(np.float32)
  tensors = [("a", (10,), f32), ("b", (10,), f32), ("c", (30,), f32), ("d", (5,), f32)]
  # 40 + 40 fits 100; c (120 bytes) exceeds the limit alone and gets a file; d starts the next.
  assert safetensors_io.plan(tensors, 100) == [[0, 1], [2], [3]]
  assert safetensors_io.parse_size("5GB") == 5 * 10**9 and safetensors_io.parse_size("2MiB") == 2 * 2**20
  with pytest.raises(ValueError, match="5GB"):
    safetensors_io.parse_size("five")
