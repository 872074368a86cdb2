"""`train.init_from` a sharded Hugging Face directory on an 8-device mesh (data 2 x fsdp 2 x tensor 2), then
training, resuming and `python -m train.export` in several files: the initial parameters are transformers'
tensors, each device holding its block, and the export loads in transformers with the trained run's logits."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import configs
import parallel
from data import tokenizer as tokenizer_lib
from model import hf
from model import safetensors_io
from parallel import mesh as mesh_lib
from test_hf import _hf_logits, _random_hf_model  # tests/ is on sys.path under pytest
from train.rundir import export as export_lib
from train.core import loop
from train.core import setup as setup_lib
from train.rundir import restore
from train.core import step as step_lib

pytestmark = pytest.mark.slow

SMALL = {"model.max_seq_len": 64, "train.seq_len": 64, "train.batch_size": 8, "train.steps": 2,
         "train.warmup_steps": 1, "train.lr": 1e-2, "train.log_every": 1, "train.eval_every": 0,
         "checkpoint.every": 2, "log.progress": False, "log.tensorboard": False,
         "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_train")
  tokenizer = tokenizer_lib.prepare(configs.load("tiny", **{"model.vocab_size": 512,
                                                           "data.tokenizer_max_sentences": 2000}), str(root))
  ref = _random_hf_model("llama", seed=5, vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
  ref.save_pretrained(root / "hf", max_shard_size="60KB")
  assert os.path.exists(root / "hf" / safetensors_io.INDEX)
  config = configs.load("tiny", **{**SMALL, "data.tokenizer": tokenizer, "train.init_from": str(root / "hf")})
  return root, ref, config


def test_init_from_sharded_hf_dir_gives_its_tensors_on_the_mesh(setup):
  root, ref, config = setup
  config = configs.load("tiny", **SMALL)
  config.model = hf.config_from_hf(ref.config.to_dict())
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh))
  params = setup_lib.init_from(trainer, str(root / "hf"))
  hf_ = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]), hf_["model.embed_tokens.weight"])
  np.testing.assert_array_equal(np.asarray(params["unembed"]), hf_["lm_head.weight"].T)
  q = params["layers"]["attn"]["q"]  # [layers, d_model, heads, head_dim]; HF [heads * head_dim, d_model]
  np.testing.assert_array_equal(np.asarray(q[1]).reshape(64, 64).T, hf_["model.layers.1.self_attn.q_proj.weight"])
  for got, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(trainer.param_shardings)):
    assert got.sharding == sharding
  assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 2, 16)}  # fsdp 2 on d_model, tensor 2 on heads


def test_train_resume_and_export_from_a_sharded_hf_dir(setup, capsys):
  root, _, config = setup
  workdir = str(root / "run")
  loop.run(config, workdir)
  assert "initialised the parameters from" in capsys.readouterr().out
  more = configs.load("tiny", **{**SMALL, "data.tokenizer": config.data.tokenizer,
                                 "train.init_from": config.train.init_from, "train.steps": 4})
  loop.run(more, workdir)  # resumes at step 2
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
  assert steps == [1, 2, 3, 4]

  out = root / "export"
  assert export_lib.main([f"--workdir={workdir}", f"--output={out}", "--max_shard_size=50KB"]) == 0
  files = json.load(open(out / safetensors_io.INDEX))["weight_map"].values()
  assert len(set(files)) > 2
  run = restore.load_run(workdir)  # the trained run's own model on its mesh
  tokens = np.random.default_rng(2).integers(0, 512, size=(8, 20)).astype(np.int32)
  with parallel.activate(run.mesh, run.rules):
    want = np.asarray(run.model(jnp.asarray(tokens)))
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
  np.testing.assert_allclose(_hf_logits(back, tokens), want, atol=1e-4, rtol=0)
  assert transformers.AutoTokenizer.from_pretrained(out).vocab_size == 512
