"""Statements in docs and comments that code can check: no citations of a design file outside the repository,
every remat policy listed where the policies are listed, the uniform-loss figure derived from the vocabulary."""
import math
import os
import re

import configs
from model import remat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE_DOC = "DESIGN" + ".md"  # spelled in two parts so that this file does not cite it either


def _read(rel):
  with open(os.path.join(REPO, rel), encoding="utf-8") as f:
    return f.read()


def test_no_file_cites_the_design_file_outside_the_repository():
  citing = []
  for top in ("model", "parallel", "data", "train", "configs", "common", "tests", "docs", "benchmarks"):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        if name.endswith((".py", ".md")):
          rel = os.path.relpath(os.path.join(root, name), REPO)
          if OUTSIDE_DOC in _read(rel):
            citing.append(rel)
  assert not [p for p in citing + (["README.md"] if OUTSIDE_DOC in _read("README.md") else [])]


def test_every_remat_policy_is_listed_where_policies_are_listed():
  base_line = next(line for line in _read("configs/base.py").splitlines() if "t.remat =" in line)
  places = {"configs/base.py": base_line, "docs/interfaces.md": _read("docs/interfaces.md"),
            "docs/parallel.md": _read("docs/parallel.md"), "docs/model.md": _read("docs/model.md")}
  for where, text in places.items():
    missing = [p for p in remat.POLICIES if not re.search(rf"\b{p}\b", text)]
    assert not missing, (where, missing)


def test_uniform_loss_figure_matches_the_vocabulary():
  vocab = configs.load("tiny").model.vocab_size
  figure = f"ln {vocab} = {math.log(vocab):.2f}"
  for rel in ("README.md", "configs/tiny.py"):
    assert figure in " ".join(_read(rel).split()), rel


def test_what_the_docs_examples_write_in_the_checkout_is_ignored_by_git():
  """The files the README's and docs' example commands write into the checkout (a curated corpus, a tokenizer,
  evaluation results, runs) are in .gitignore, so following the docs leaves `git status` clean."""
  import glob  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  docs = _read("README.md") + "".join(_read(os.path.relpath(p, REPO)) for p in glob.glob(f"{REPO}/docs/*.md"))
  written = ["curated/en/head/part-0.jsonl", "tok.model", "results.json", "runs/tiny/metrics.jsonl"]
  for path in written:  # each appears in a documented command
    assert path.split("/")[0] in docs, path
  out = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True, text=True)
  assert sorted(out.stdout.split()) == sorted(written), out


def test_the_simulated_multi_process_example_runs_a_few_steps():
  """docs/parallel.md's two-process example on one machine sets its step count (the config's default is a full
  training run, minutes of two processes for an example)."""
  text = _read("docs/parallel.md")
  block = text[text.index("### Simulated on one CPU machine"):].split("```")[1]
  assert "python -m train.step" in block and "--config.distributed.num_processes=2" in block
  steps = re.search(r"--config\.train\.steps=(\d+)", block)
  assert steps and int(steps.group(1)) <= 10
