"""`python -m train.lifecycle` end to end on a cut-down lifecycle (a few steps per stage, one shared run): every
stage's output, the exported model's logits in transformers, the model card's and the report's numbers against
the evaluation files, a changed key rerunning only its stage and the later ones, SIGKILL in a training stage
resumed exactly, and bad input refused with exit 2 before anything runs."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import checkpoint_testing

from train.lifecycle import report
from train.lifecycle import runner

pytestmark = pytest.mark.slow  # end to end: real stage commands as processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
# What the cut-down run and the SIGKILL test share: the curation input, the tokenizer and pretraining.
FRONT = ["--config.curate.documents=200", "--config.tokenizer.vocab_size=1024",
         f"--config.pretrain.train.steps={STEPS}", "--config.pretrain.checkpoint.every=4",
         "--config.pretrain.train.log_every=1", "--config.pretrain.train.eval_every=0",
         "--config.pretrain.train.warmup_steps=2", "--config.pretrain.train.batch_size=8",
         "--config.pretrain.model.d_model=32", "--config.pretrain.model.num_layers=1",
         "--config.pretrain.model.mlp_dim=64", "--config.pretrain.model.vocab_size=1024"]
REST = ["--config.sft.train.steps=4", "--config.sft.train.eval_every=0", "--config.dpo.train.steps=4",
        "--config.dpo.train.eval_every=0", "--config.evaluate.per_family=2", "--config.evaluate.max_new_tokens=8"]
STAGES = "curate,tokenizer,pretrain,sft,dpo,evaluate,export"


def _env():
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS="")


def _lifecycle(workdir, *args, stages=STAGES, timeout=600):
  return subprocess.run([sys.executable, "-m", "train.lifecycle", f"--workdir={workdir}",
                         f"--config.lifecycle.stages={stages}", *args], cwd=REPO, env=_env(), capture_output=True,
                        text=True, timeout=timeout)


def _state(workdir):
  with open(os.path.join(workdir, "lifecycle.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lifecycle") / "run"
  proc = _lifecycle(workdir, *FRONT, *REST)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return workdir, proc



def test_every_stage_leaves_its_output_and_the_export_has_the_runs_logits(run):
  workdir, proc = run
  state = _state(workdir)
  assert [state["records"][s]["status"] for s in STAGES.split(",")] == ["done"] * 7
  assert os.path.exists(workdir / "curate" / "stats.json") and os.path.exists(workdir / "tokenizer" / "tokenizer.model")
  for stage in ("pretrain", "sft", "dpo"):
    assert os.path.isdir(workdir / stage / "checkpoints")
    assert os.path.exists(workdir / "eval" / f"{stage}.json")
  raw = state["records"]["curate"]["raw"]
  assert raw["junk"] > 0 and raw["exact_duplicates"] > 0  # curation had work: it dropped documents
  stats = json.loads((workdir / "curate" / "stats.json").read_text())
  assert stats["stages"][-1]["docs_out"] < raw["documents"]
  assert "stage" in proc.stdout and "report:" in proc.stdout  # the closing summary
  # The exported directory in transformers gives the logits of the run it was exported from (the last policy).
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import parallel  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  tokens = np.random.default_rng(0).integers(0, 1024, size=(8, 16)).astype(np.int32)
  loaded = restore.load_run(str(workdir / "dpo"))
  with parallel.activate(loaded.mesh, loaded.rules):
    want = np.asarray(loaded.model(jnp.asarray(tokens)))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(workdir / "export"), attn_implementation="eager")
  with torch.no_grad():
    got = hf.float().eval()(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_card_and_the_report_carry_the_evaluation_files_numbers(run):
  workdir, _ = run
  state = _state(workdir)
  text = (workdir / "export" / "README.md").read_text()
  meta = yaml.safe_load(text.split("---")[1])
  with open(workdir / "eval" / "dpo.json") as f:
    last = json.load(f)["results"]
  got = {(r["dataset"]["name"], m["type"]): m["value"] for r in meta["model-index"][0]["results"] for m in r["metrics"]}
  want = {(task, k): v for task, metrics in last.items() for k, v in metrics.items()
          if not k.endswith("_stderr") and v is not None}
  assert got == want
  columns, rows = report.evaluation_table(state)
  for row in rows:
    with open(workdir / "eval" / f"{row[0]}.json") as f:
      results = json.load(f)["results"]
    for column, value in zip(columns[1:], row[1:]):
      task, metric = column.split("/", 1)
      assert value == results[task][metric], (row[0], column)
  assert [r[0] for r in rows] == ["pretrain", "sft", "dpo"]
  html = (workdir / "report.html").read_text()
  assert "<svg" in html and "pretrain" in html and "http" not in html.split("<body")[0].lower()


def test_a_changed_key_reruns_its_stage_and_the_later_ones_only(run):
  workdir, _ = run
  before = _state(workdir)
  proc = _lifecycle(workdir, *FRONT, *REST, "--config.dpo.train.lr=2e-4")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  after = _state(workdir)
  for stage in ("curate", "tokenizer", "pretrain", "sft"):
    assert f"{stage}: done earlier, skipped" in proc.stdout
    assert after["records"][stage] == before["records"][stage]
  for stage in ("dpo", "evaluate", "export"):
    assert after["records"][stage]["digest"] != before["records"][stage]["digest"], stage
  assert "dpo: its config or an input stage changed; rerunning it and the stages after it" in proc.stdout
  # only the changed model is evaluated again
  assert "evaluate: pretrain evaluated earlier, kept" in proc.stdout and "evaluate: sft evaluated earlier, kept" in proc.stdout
  assert os.path.isdir(workdir / ".previous" / "dpo")
  # --only reruns one stage, whatever its digest
  proc = _lifecycle(workdir, *FRONT, *REST, "--config.dpo.train.lr=2e-4", "--only", "export")
  assert proc.returncode == 0 and "export: asked for; rerunning it" in proc.stdout
  assert "skipped" not in proc.stdout


def test_sigkill_in_a_training_stage_resumes_it_exactly(run, tmp_path):
  reference, _ = run
  workdir = tmp_path / "killed"
  args = [sys.executable, "-m", "train.lifecycle", f"--workdir={workdir}", "--config.lifecycle.stages="
          "curate,tokenizer,pretrain", *FRONT]
  proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while not os.path.isdir(workdir / "pretrain" / "checkpoints" / "4"):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  time.sleep(1.0)  # the stage's command dies with the lifecycle (no orphan keeps training)
  steps = sorted(int(s) for s in os.listdir(workdir / "pretrain" / "checkpoints") if s.isdigit())
  assert steps and steps[-1] < STEPS
  again = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert "curate: done earlier, skipped" in again.stdout and "tokenizer: done earlier, skipped" in again.stdout
  assert "pretrain: interrupted earlier, resuming" in again.stdout
  got = checkpoint_testing.saved(workdir / "pretrain", STEPS, part="params")
  want = checkpoint_testing.saved(reference / "pretrain", STEPS, part="params")
  assert got.keys() == want.keys()
  for key in got:
    assert np.array_equal(got[key], want[key]), key


@pytest.mark.parametrize("args,needle", [
    (["--config.lifecycle.stages=curate,pretrain"], "stage 'pretrain' reads the output of ['tokenizer']"),
    (["--config.lifecycle.stages=curate,tokenizer,pretrain,grpo"], "unknown stages ['grpo']"),
    (["--config.lifecycle.stages=curate,tokenizer,pretrain", "--config.dpo.train.steps=3"],
     "keys given for ['dpo'], which lifecycle.stages"),
    (["--config.pretrain.train.stepz=3"], "unknown config key 'train.stepz'"),
    (["--config.pretrain.train.steps=abc"], "cannot set 'train.steps' to 'abc'"),
    (["--config.sft.train.lr=-1.0"], "train.lr=-1.0 is out of range"),
    (["--config.tokenizer.vocab_size=1024"], "set --config.pretrain.model.vocab_size=1024"),
    (["--config.lifecycle.stages=curate,tokenizer,pretrain,evaluate,sft"], "puts ['sft'] after 'evaluate'"),
    (["--config.export.dtype=float13"], "export.dtype='float13'"),
    (["--config.evaluate.tasks=mc:/no/such.jsonl"], "/no/such.jsonl: no such file or directory"),
])
def test_bad_input_exits_2_naming_it_with_nothing_run(tmp_path, capsys, args, needle):
  assert runner.main([f"--workdir={tmp_path / 'run'}", *args]) == 2
  assert needle in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


def test_a_stage_rerun_alone_leaves_the_stages_reading_it_stale():
  """--only sft reruns sft; dpo (starts from sft), evaluate (evaluates it) and export (exports dpo, reads evaluate)
  are then stale, reward (starts from sft too) as well; pretrain is not."""
  sequence = ["curate", "tokenizer", "pretrain", "sft", "reward", "dpo", "evaluate", "export"]
  records = {s: {"status": "done"} for s in sequence}
  runner._mark_stale("sft", sequence, records)
  assert [s for s in sequence if records[s]["status"] == "stale"] == ["reward", "dpo", "evaluate", "export"]
