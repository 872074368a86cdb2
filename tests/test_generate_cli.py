"""`python -m train.generate`: a run directory and a Hugging Face directory give the library's tokens, on any
mesh; streaming; bad arguments exit 2 with one clear message each."""
import json
import os
import re

import numpy as np
import pytest
from flax import nnx

import configs
import model
from data import tokenizer as tokenizer_lib
from model import generate as gen
from model import hf
from train.core import checkpoint as ckpt_lib
from train.rundir import generate as cli

SMALL = {"model.vocab_size": 512, "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64, "model.max_seq_len": 64,
         "model.init_std": 0.3}
PROMPTS = ["def main(", "The quick brown fox"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory with one checkpoint (random weights, the run's config and tokenizer), and its model."""
  workdir = tmp_path_factory.mktemp("run")
  config = configs.load("tiny", **SMALL)
  texts = [open(os.path.join(os.path.dirname(os.__file__), name)).read() for name in ("os.py", "argparse.py")]
  sp = tokenizer_lib.train(texts, str(workdir / "tokenizer.model"), 512, max_sentences=3000)
  m = model.Transformer(config.model, rngs=nnx.Rngs(3))
  ck = ckpt_lib.Checkpointer(str(workdir / "checkpoints"), None)
  ck.save(5, {"params": nnx.to_pure_dict(nnx.state(m, nnx.Param)), "step": np.int32(5)}, None,
          {"config": json.loads(config.to_json_best_effort()), "tokenizer": ckpt_lib.encode_file(sp)})
  ck.close()
  tok = tokenizer_lib.Tokenizer.load(sp)
  os.remove(sp)  # the CLI reads the tokenizer from the checkpoint
  return str(workdir), m, tok


def _json(capsys, argv):
  assert cli.main(argv) == 0
  return json.loads(capsys.readouterr().out)


def test_workdir_and_hf_directory_give_the_library_tokens_on_any_mesh(run, capsys, tmp_path):
  workdir, m, tok = run
  args = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max_new_tokens", "10", "--json"]
  out = _json(capsys, ["--workdir", workdir] + args)
  want = gen.generate(m, [[tok.bos_id] + tok.encode(p) for p in PROMPTS], 10, stop_ids=(tok.eos_id,))
  assert out["tokens"] == want
  assert out["completions"] == [tok.decode(t) for t in want]
  assert out["tokens_per_sec"] > 0
  sharded = _json(capsys, ["--workdir", workdir, "--step", "5", "--config.mesh.data=2", "--config.mesh.tensor=4"]
                  + args)
  assert sharded["tokens"] == want
  hf_dir = tmp_path / "hf"
  hf.save(m, str(hf_dir))
  with open(hf_dir / "tokenizer.model", "wb") as f:
    f.write(tok._proto)
  assert _json(capsys, ["--hf", str(hf_dir)] + args)["tokens"] == want


def test_sampling_options_reach_the_sampler(run, capsys):
  workdir, m, tok = run
  options = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.3, seed=2)
  argv = ["--workdir", workdir, "--prompt", PROMPTS[0], "--max_new_tokens", "8", "--json"]
  out = _json(capsys, argv + [a for k, v in options.items() for a in (f"--{k}", str(v))])
  prompt = [[tok.bos_id] + tok.encode(PROMPTS[0])]
  assert out["tokens"] == gen.generate(m, prompt, 8, stop_ids=(tok.eos_id,), **options)
  greedy = _json(capsys, argv + ["--repetition_penalty", "0.5"])  # < 1 rewards repeats: this model's output changes
  assert greedy["tokens"] == gen.generate(m, prompt, 8, stop_ids=(tok.eos_id,), repetition_penalty=0.5)
  assert greedy["tokens"] != gen.generate(m, prompt, 8, stop_ids=(tok.eos_id,))  # the flag made a difference


def test_one_prompt_streams_its_text(run, capsys):
  workdir, _, _ = run
  assert cli.main(["--workdir", workdir, "--prompt", PROMPTS[1], "--max_new_tokens", "6"]) == 0
  streamed = capsys.readouterr().out
  out = _json(capsys, ["--workdir", workdir, "--prompt", PROMPTS[1], "--max_new_tokens", "6", "--json"])
  assert streamed == PROMPTS[1] + out["completions"][0] + "\n"


@pytest.mark.parametrize("argv,message", [
    (["--workdir", "/nonexistent/run"], "no meshlm run there"),
    (["--workdir", "RUN", "--step", "9"], "no such checkpoint"),
    (["--workdir", "RUN", "--max_new_tokens", "0"], "--max_new_tokens=0 must be >= 1"),
    (["--workdir", "RUN", "--top_p", "1.5"], r"--top_p=1.5 must be in \(0, 1\]"),
    (["--workdir", "RUN", "--min_p", "1.5"], r"--min_p=1.5 must be in \[0, 1\]"),
    (["--workdir", "RUN", "--min_p", "-0.1"], r"--min_p=-0.1 must be in \[0, 1\]"),
    (["--workdir", "RUN", "--repetition_penalty", "0"], "--repetition_penalty=0.0 must be a finite number > 0"),
    (["--workdir", "RUN", "--repetition_penalty", "-2"], "--repetition_penalty=-2.0 must be a finite number > 0"),
    (["--workdir", "RUN", "--max_new_tokens", "80"], "exceeds model.max_seq_len=64"),
    (["--workdir", "RUN", "--config.mesh.tensor=3"], "config.mesh"),
    (["--hf", "HFJSON"], "its tokenizer does not load"),
    (["--hf", "HFBARE"], "no tokenizer.json or tokenizer.model there"),
])
def test_bad_arguments_exit_2_with_a_message(run, capsys, tmp_path, argv, message):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                                    "intermediate_size": 64, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2}))
  (tmp_path / "tokenizer.json").write_text("{}")
  (tmp_path / "bare").mkdir()
  (tmp_path / "bare" / "config.json").write_text("{}")
  paths = {"RUN": run[0], "HFJSON": str(tmp_path), "HFBARE": str(tmp_path / "bare")}
  argv = [paths.get(a, a) for a in argv]
  assert cli.main(argv + ["--prompt", "hello"]) == 2
  out, err = capsys.readouterr()
  assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
  assert re.search(message, err), err
  assert out == ""  # checked before anything is printed (the prompt is echoed only for a run that goes ahead)


def test_fill_in_the_middle_generates_from_the_fim_prompt(run, capsys):
  from data import fim  # pylint: disable=g-import-not-at-top
  workdir, m, tok = run
  prefix, suffix = "def main(", "    return 0\n"
  argv = ["--workdir", workdir, "--prefix", prefix, "--suffix", suffix, "--max_new_tokens", "6"]
  out = _json(capsys, argv + ["--json"])
  pre, mid, suf = fim.sentinels(tok)
  prompt = [tok.bos_id, pre] + tok.encode(prefix) + [suf] + tok.encode(suffix) + [mid]
  want = gen.generate(m, [prompt], 6, stop_ids=(tok.eos_id,))
  assert out["tokens"] == want and out["infilled"] == prefix + tok.decode(want[0]) + suffix
  assert cli.main(argv) == 0
  assert capsys.readouterr().out == out["infilled"] + "\n"
  spm = _json(capsys, argv + ["--json", "--spm"])
  spm_prompt = [tok.bos_id, pre, suf] + tok.encode(suffix) + [mid] + tok.encode(prefix)
  assert spm["tokens"] == gen.generate(m, [spm_prompt], 6, stop_ids=(tok.eos_id,))
  assert cli.main(argv + ["--prompt", "x"]) == 2 and "--prefix/--suffix" in capsys.readouterr().err
