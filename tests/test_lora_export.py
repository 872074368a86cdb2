"""`python -m train.adapters` on a LoRA run: base/ and merged/ are whole Hugging Face models, tokenizer and chat
template included (written as `python -m train.export` writes them), so transformers loads both with meshlm's
logits and token ids, PEFT's adapter on base/ gives merged/'s logits, and meshlm's own `--hf` commands load
merged/ (the issue: train.generate --hf DIR/merged failed with "no tokenizer.model there")."""
import filecmp
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm

import configs
import parallel
from data import chat
from data import tokenizer as tokenizer_lib
from parallel import mesh as mesh_lib
from train.core import checkpoint as ckpt_lib
from train.core import loop
from train.core import step as step_lib
from train.rundir import adapters
from train.rundir import export as export_lib
from train.rundir import generate as generate_cli
from train.rundir import restore
from train.rundir import runconfig

# A model smaller than tiny's, two steps at a high learning rate so the adapters' B moves off zero; GQA kept.
RUN = {"model.vocab_size": 512, "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
       "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.max_seq_len": 32,
       "model.init_std": 0.1, "train.seq_len": 32, "train.batch_size": 8, "train.steps": 2, "train.lr": 3e-2,
       "train.warmup_steps": 1, "train.schedule": "constant", "train.eval_every": 0, "train.log_every": 1,
       "train.lora_rank": 4, "train.lora_alpha": 8.0, "train.lora_targets": ("q", "k", "v", "o", "gate", "up", "down"),
       "checkpoint.every": 2, "log.progress": False, "log.tensorboard": False,
       "data.tokenizer_max_sentences": 1500}
TEXTS = ["The quick brown fox", "  leading and trailing  ", "def f(x):\n    return x ** 2", "0123 café", ""]
TOL = 1e-5  # relative and absolute; init_std 0.1 keeps logits ~1, where float32 sums in another order differ ~1e-6

pytestmark = pytest.mark.slow  # end to end: a training run, the export, three loaders


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora_export")
  run, out = root / "run", root / "adapters"
  loop.run(configs.load("tiny", **RUN), str(run))
  assert adapters.main(["--workdir", str(run), "--output", str(out)]) == 0
  return root, run, out


def _tokens(vocab):
  return np.random.default_rng(4).integers(0, vocab, size=(8, 24)).astype(np.int32)  # 8 rows: any 8-device mesh


def _run_state(run):
  """The run's last state (adapters and frozen base) on one device, and its Trainer."""
  ck = ckpt_lib.Checkpointer(str(run / ckpt_lib.CHECKPOINT_DIR), read_only=True)
  config = runconfig.from_saved(ck.metadata()["config"])
  config.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
  state, _ = ck.restore(trainer.abstract_state())
  return trainer, state


def _torch_logits(directory, tokens):
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
  with torch.no_grad():
    return model, model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_base_and_merged_carry_the_tokenizer_as_train_export_writes_it(exported, capsys):
  import transformers
  root, run, out = exported
  assert export_lib.main([f"--workdir={run}", f"--output={root / 'export'}"]) == 0
  step = max(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())
  assert capsys.readouterr().out.strip() == f"wrote {root / 'export'}: step {step} of {run}"  # the step written
  names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
           "generation_config.json"]
  sp = tokenizer_lib.Tokenizer.load(str(run / "tokenizer.model"))
  for directory in (out / "base", out / "merged"):
    match, mismatch, errors = filecmp.cmpfiles(root / "export", directory, names, shallow=False)
    assert (mismatch, errors) == ([], []), directory
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
      assert hf(text, add_special_tokens=False).input_ids == sp.encode(text), repr(text)
      assert hf(text).input_ids == [sp.bos_id] + sp.encode(text), repr(text)
    assert hf.chat_template == chat.MESHLM_JINJA
    assert (hf.bos_token_id, hf.eos_token_id) == (sp.bos_id, sp.eos_id)
    # transformers' generate stops at the chat template's end of turn as well as at EOS
    generation = transformers.GenerationConfig.from_pretrained(str(directory))
    end_of_turn = spm.SentencePieceProcessor(model_file=str(run / "tokenizer.model")).piece_to_id("<|end_of_turn|>")
    assert sorted(generation.eos_token_id) == sorted([sp.eos_id, end_of_turn])


def test_transformers_and_peft_give_meshlm_logits(exported):
  import peft
  import torch
  _, run, out = exported
  trainer, state = _run_state(run)
  tokens = _tokens(trainer.config.model.vocab_size)
  merged_ours = np.asarray(trainer.model(state)(jnp.asarray(tokens)))  # the adapted model as trained
  zero = {**state, "params": {**state["params"], "lora": jax.tree.map(jnp.zeros_like, state["params"]["lora"])}}
  base_ours = np.asarray(trainer.model(zero)(jnp.asarray(tokens)))  # W + 0: the frozen base alone
  assert np.abs(merged_ours - base_ours).max() > 1e-3  # the adapters trained
  base, base_logits = _torch_logits(out / "base", tokens)
  _, merged_logits = _torch_logits(out / "merged", tokens)
  np.testing.assert_allclose(base_logits, base_ours, atol=TOL, rtol=TOL)
  np.testing.assert_allclose(merged_logits, merged_ours, atol=TOL, rtol=TOL)
  adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
  with torch.no_grad():
    peft_logits = adapted(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  # PEFT adds the branch, W x + s B (A x), where merged/ holds W + s A B: equal up to float32 rounding.
  np.testing.assert_allclose(peft_logits, merged_logits, atol=TOL, rtol=TOL)
  assert np.abs(peft_logits - base_logits).max() > 1e-3  # the adapter is applied, not ignored


def test_meshlm_hf_commands_load_merged(exported, capsys):
  _, run, out = exported
  want = restore.load_run(str(run))  # the run's checkpoint, adapters merged, on the run's mesh
  tokens = _tokens(want.config.model.vocab_size)
  with parallel.activate(want.mesh, want.rules):
    want_logits = np.asarray(want.model(jnp.asarray(tokens)))
  for directory in (out / "merged", out / "base"):
    model, tokenizer, mesh, rules = restore.load_hf(str(directory))  # train.evaluate --hf
    assert tokenizer.encode(TEXTS[0]) == tokenizer_lib.Tokenizer.load(str(run / "tokenizer.model")).encode(TEXTS[0])
    if directory.name == "merged":
      with parallel.activate(mesh, rules):
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), want_logits, atol=TOL, rtol=TOL)
  capsys.readouterr()
  argv = ["--hf", str(out / "merged"), "--prompt", "The quick", "--max_new_tokens", "4", "--json"]
  assert generate_cli.main(argv) == 0  # python -m train.generate --hf DIR/merged
  assert json.loads(capsys.readouterr().out)["new_tokens"] >= 1
