"""meshlm's evaluation against lm-evaluation-harness itself: a model trained a few steps by `python -m train`,
exported by `python -m train.export` (its `main`, in this process), scored by lm-eval's `hf` backend (PyTorch)
on local task YAMLs and by `python -m train.evaluate` (JAX, 8 simulated devices) and by lm-eval's own command
line with the meshlm backend (`python -m train.lm_eval --model meshlm`): per-document log-likelihoods within
1e-4, identical acc / acc_norm, equal perplexities, the same few-shot prompts, and the exported tokenizer's ids
equal to SentencePiece's."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 48  # the model's length: short, so long documents roll over several windows and contexts truncate
FEWSHOT = 2

MC = [
    {"context": "Question: What do cats drink?\nAnswer:", "choices": ["milk", "gasoline"], "label": 0},
    {"context": "Question: Where does the sun rise?\nAnswer:", "choices": ["in the east", "under the sea",
                                                                           "nowhere at all"], "label": 0},
    {"context": "The function returns ", "choices": ["None", "a list of integers"], "label": 1},  # trailing space
    {"context": "", "choices": ["x = 1", "def f(): pass"], "label": 1},  # empty context: scored from BOS
    {"context": "Read the file line by line. " * 12 + "Then", "choices": [" close it.", " open it again."],
     "label": 0},  # longer than the model: left-truncated
    {"context": "Digits 12345 and\ttabs\n\n  indented:", "choices": ["  yes", "no\n", "émoji 😀"], "label": 2},
]
PPL = [
    {"text": "The quick brown fox jumps over the lazy dog. " * 9},  # several rolling windows
    {"text": "import os\nprint(os.getcwd())\n"},
    {"text": "Short."},
    {"text": "  spaces,\ttabs and 1234567 digits; ∑ unicode and bytes \x07."},
]


def _yaml(path, name, data, kind):
  if kind == "mc":
    body = ('output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
            'fewshot_split: test\n')  # few-shot examples from the same file, the document itself excluded
  else:
    body = ('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
            '  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n')
  with open(path, "w") as f:
    f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lm_eval")
  run, export = tmp / "run", tmp / "export"
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  for name, rows in (("mc", MC), ("ppl", PPL)):
    with open(tmp / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    _yaml(tmp / f"meshlm_{name}.yaml", f"meshlm_{name}", tmp / f"{name}.jsonl", name)
  # A model smaller than tiny's (cheap compiles, steps and scoring); GQA kept so the exported config maps heads.
  train = [sys.executable, "-m", "train", "--config=tiny", f"--workdir={run}", "--config.train.steps=3",
           "--config.train.batch_size=4", "--config.train.seq_len=48", f"--config.model.max_seq_len={MAX_LEN}",
           "--config.model.vocab_size=512", "--config.model.d_model=64", "--config.model.num_layers=2",
           "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.model.head_dim=32",
           "--config.model.mlp_dim=128",
           "--config.train.eval_every=3", "--config.train.eval_steps=1", "--config.train.warmup_steps=1",
           "--config.log.progress=false", "--config.data.tokenizer_max_sentences=1500",
           f"--config.train.eval_tasks=mc:{tmp}/mc.jsonl"]  # benchmark tasks during training too
  subprocess.run(train, check=True, env=env, cwd=REPO, capture_output=True)
  from train.rundir import export as export_lib  # the CLI in this process: no second interpreter and JAX start-up
  assert export_lib.main([f"--workdir={run}", f"--output={export}"]) == 0
  return tmp, run, export


@pytest.fixture(scope="module")
def reference(setup):
  """lm-eval 0.4's hf backend on the exported directory: per-document responses and aggregate metrics."""
  tmp, _, export = setup
  os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "hf_cache"),
                    TOKENIZERS_PARALLELISM="false")
  import lm_eval
  from lm_eval.tasks import TaskManager
  out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32",
                                tasks=["meshlm_mc", "meshlm_ppl"], task_manager=TaskManager(include_path=str(tmp)),
                                batch_size=4, device="cpu", log_samples=True, bootstrap_iters=0)
  samples = {k: sorted(v, key=lambda s: s["doc_id"]) for k, v in out["samples"].items()}
  fewshot = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", tasks=["meshlm_mc"],
                                    task_manager=TaskManager(include_path=str(tmp)), batch_size=4, device="cpu",
                                    log_samples=True, bootstrap_iters=0, num_fewshot=FEWSHOT)
  samples["meshlm_mc_fewshot"] = sorted(fewshot["samples"]["meshlm_mc"], key=lambda s: s["doc_id"])
  return out["results"], samples


@pytest.fixture(scope="module")
def ours(setup):
  tmp, run, _ = setup
  from train.rundir import evaluate
  output = tmp / "ours.json"
  code = evaluate.main(["--workdir", str(run), "--tasks", f"mc:{tmp}/mc.jsonl,ppl:{tmp}/ppl.jsonl",
                        "--output", str(output), "--log_samples", "--batch_size", "4", "--no_progress"])
  assert code == 0
  with open(output) as f:
    results = json.load(f)
  export = tmp / "export"  # the exported directory: --hf loads it with its tokenizer.json
  code = evaluate.main(["--hf", str(export), "--tasks", f"mc:{tmp}/mc.jsonl", "--num_fewshot", str(FEWSHOT),
                        "--output", str(tmp / "ours_fewshot.json"), "--log_samples", "--batch_size", "16",
                        "--no_progress"])
  assert code == 0
  with open(tmp / "ours_fewshot.json") as f:
    results["samples"]["mc_fewshot"] = json.load(f)["samples"]["mc"]
  return results


def test_multiple_choice_loglikelihoods_and_accuracy_match_lm_eval(reference, ours):
  ref_results, ref_samples = reference
  ref_lls = [[float(r[0]) for r in s["filtered_resps"]] for s in ref_samples["meshlm_mc"]]
  our_lls = [s["lls"] for s in ours["samples"]["mc"]]
  assert len(our_lls) == len(ref_lls) == len(MC)
  for ref, got in zip(ref_lls, our_lls):
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  ref_greedy = [[str(r[1]) == "True" for r in s["filtered_resps"]] for s in ref_samples["meshlm_mc"]]
  assert [s["is_greedy"] for s in ours["samples"]["mc"]] == ref_greedy
  for metric in ("acc", "acc_norm"):
    assert ours["results"]["mc"][metric] == ref_results["meshlm_mc"][f"{metric},none"]
    assert [s[metric] for s in ref_samples["meshlm_mc"]] == [
        float(v) for v in _per_doc(ours["samples"]["mc"], metric)]


def test_eval_tasks_during_training_log_the_same_metrics(setup, ours):
  _, run, _ = setup
  with open(run / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  final = [l for l in lines if "eval_mc/acc" in l and l["step"] == 3]
  assert len(final) == 1 and "eval_loss" in final[0]
  for metric in ("acc", "acc_norm", "acc_bytes"):  # the step-3 model, as python -m train.evaluate scores it
    assert final[0][f"eval_mc/{metric}"] == ours["results"]["mc"][metric]
  events = b"".join(p.read_bytes() for p in (run / "tensorboard").rglob("*tfevents*"))
  assert b"eval_mc/acc_norm" in events


def test_few_shot_prompts_and_loglikelihoods_match_lm_eval(reference, ours):
  """`python -m train.evaluate --hf EXPORT --num_fewshot 2` against lm-eval's hf backend with num_fewshot=2."""
  _, ref_samples = reference
  ref, got = ref_samples["meshlm_mc_fewshot"], ours["samples"]["mc_fewshot"]
  assert [s["prompt"] for s in got] == [s["arguments"][0][0] for s in ref]  # same seeded examples, same layout
  assert all(s["prompt"].count("\n\n") >= FEWSHOT for s in got)
  for r, g in zip(ref, got):
    np.testing.assert_allclose(g["lls"], [float(x[0]) for x in r["filtered_resps"]], atol=1e-4, rtol=0)


def test_lm_eval_command_line_with_the_meshlm_backend(setup, reference, tmp_path):
  """`python -m train.lm_eval --model meshlm --model_args workdir=RUN` (lm-eval's CLI, meshlm registered) gives
  lm-eval's own records with the hf backend's per-document log-likelihoods and metrics."""
  tmp, run, _ = setup
  ref_results, ref_samples = reference
  from train import lm_eval as meshlm_lm_eval
  assert meshlm_lm_eval.main(["--model", "meshlm", "--model_args", f"workdir={run}", "--tasks",
                              "meshlm_mc,meshlm_ppl", "--include_path", str(tmp), "--batch_size", "4",
                              "--output_path", str(tmp_path), "--log_samples"]) == 0
  [results_file] = tmp_path.rglob("results_*.json")
  with open(results_file) as f:
    results = json.load(f)["results"]
  for task, metrics in (("meshlm_mc", ("acc", "acc_norm")),
                        ("meshlm_ppl", ("word_perplexity", "byte_perplexity", "bits_per_byte"))):
    [samples_file] = tmp_path.rglob(f"samples_{task}_*.jsonl")
    with open(samples_file) as f:
      got = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    assert len(got) == len(ref_samples[task])
    for g, r in zip(got, ref_samples[task]):
      lls = lambda s: [float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in s["filtered_resps"]]
      np.testing.assert_allclose(lls(g), lls(r), atol=1e-4, rtol=0)
    for metric in metrics:
      np.testing.assert_allclose(results[task][f"{metric},none"], ref_results[task][f"{metric},none"], rtol=1e-5)


def _per_doc(samples, metric):
  from evals import metrics
  return [metrics.multiple_choice(s["lls"], s["choices"], s["gold"])[metric] for s in samples]


def test_rolling_loglikelihoods_and_perplexities_match_lm_eval(reference, ours):
  ref_results, ref_samples = reference
  ref_lls = [float(s["filtered_resps"][0]) for s in ref_samples["meshlm_ppl"]]
  np.testing.assert_allclose([s["ll"] for s in ours["samples"]["ppl"]], ref_lls, atol=1e-4, rtol=0)
  for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
    np.testing.assert_allclose(ours["results"]["ppl"][metric], ref_results["meshlm_ppl"][f"{metric},none"],
                               rtol=1e-5)


def test_exported_tokenizer_gives_sentencepiece_ids(setup):
  _, run, export = setup
  import transformers
  from data import tokenizer as tokenizer_lib
  sp = tokenizer_lib.Tokenizer.load(str(run / "tokenizer.model"))
  hf = transformers.AutoTokenizer.from_pretrained(str(export))
  texts = [r["context"] + c for r in MC for c in r["choices"]] + [r["text"] for r in PPL] + [
      "   leading and trailing   ", "a\n\n\n  b\r\n", "0123456789 3.14159", "中文 café Ωmega 🤖", "\x00\x1b[0m",
      "def f(x):\n    return x ** 2  # square\n", ""]
  for text in texts:
    assert hf(text, add_special_tokens=False).input_ids == sp.encode(text), repr(text)
    assert hf(text).input_ids == [sp.bos_id] + sp.encode(text), repr(text)  # BOS added by default
    assert hf.decode(sp.encode(text)) == sp.decode(sp.encode(text)), repr(text)


def test_apply_chat_template_matches_lm_eval(setup, reference):
  """lm-eval with `apply_chat_template`: the meshlm backend's chat rendering (markers as their ids) scores what
  the hf backend scores through the exported tokenizer's chat template."""
  tmp, run, export = setup
  import lm_eval
  from lm_eval.tasks import TaskManager
  import train.lm_eval  # noqa: F401  (registers meshlm)
  out = {}
  for model, args in (("hf", f"pretrained={export},dtype=float32"), ("meshlm", f"workdir={run}")):
    res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["meshlm_mc"], batch_size=4, device="cpu",
                                  task_manager=TaskManager(include_path=str(tmp)), log_samples=True,
                                  bootstrap_iters=0, apply_chat_template=True)
    out[model] = sorted(res["samples"]["meshlm_mc"], key=lambda s: s["doc_id"])
  for ours, ref in zip(out["meshlm"], out["hf"]):
    assert "<|user|>" in ours["arguments"][0][0] and ours["arguments"][0][0].endswith("<|assistant|>")
    np.testing.assert_allclose([float(x[0]) for x in ours["filtered_resps"]],
                               [float(x[0]) for x in ref["filtered_resps"]], atol=1e-4, rtol=0)
