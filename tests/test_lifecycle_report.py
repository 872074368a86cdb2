"""The lifecycle's report and model card (train/lifecycle/report.py, card.py) against the files the stages really
write: stats.json from a curation run, evaluation JSONs from `python -m train.evaluate`'s own main (a stand-in
model answers the requests), metrics.jsonl from train.core.logger. References are independent of the code under
test: the input's line count, the curated output's records, the JSON files themselves, a hand parameter count."""
import html.parser
import json
import os
import zlib

import ml_collections
import pytest
import yaml

import curate_corpus
from data.curate import pipeline
from train.core import logger
from train.lifecycle import card
from train.lifecycle import report

STAGES = ["curate", "tokenizer", "pretrain", "sft", "dpo", "export"]
TRAINING = ["pretrain", "sft", "dpo"]
DOCUMENTS = 200
# The tiny model of dpo/config.json and its parameter count by hand (Llama-style, untied, no biases):
# embeddings 2 V D; per layer q, k, v, o 4 D^2 (H K = G K = D), SwiGLU 3 D F, two RMSNorms 2 D; final norm D.
TINY = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, mlp_dim=128)
TINY_PARAMS = 2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
HOSTILE = "</pre><script>alert(1)</script>"


class _StandInLM:
  """Answers evals.harness's requests as evals.LM would, with log-likelihoods from a CRC of the text (so two
  seeds are two different "models")."""

  def __init__(self, seed: int):
    self.seed, self.max_len, self.batch_size = seed, 128, 4

  def _ll(self, text: str) -> float:
    return -(zlib.crc32(f"{self.seed}|{text}".encode()) % 997) / 37.0 - 0.5

  def loglikelihood(self, requests):
    return [(self._ll(context + continuation), False) for context, continuation in requests]

  def loglikelihood_rolling(self, texts):
    return [20 * self._ll(t) for t in texts]

  def generate_until(self, requests, *, temperature=0.0, top_p=1.0, seed=0):
    del temperature, top_p, seed
    return [f"continuation {i} of {self.seed}" for i in range(len(requests))]


class _StandInScorer:
  name, note = "stand-in", "a test scorer"

  @staticmethod
  def score(texts):
    return [(zlib.crc32(t.encode()) % 100) / 100 for t in texts]


def _write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def _evaluate(tmp, seed: int, tasks: str, output: str) -> dict:
  """`python -m train.evaluate --output OUTPUT` run by its main, the model replaced by _StandInLM."""
  from evals import toxicity
  from train.rundir import evaluate as evaluate_cli
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(evaluate_cli, "open_lm", lambda args: (_StandInLM(seed), f"stand-in {seed}"))
    mp.setattr(toxicity, "make_scorer", lambda spec: _StandInScorer())
    argv = ["--workdir", str(tmp), "--tasks", tasks, "--output", output, "--no_progress", "--toxicity_samples", "3"]
    assert evaluate_cli.main(argv) == 0
  with open(output) as f:
    return json.load(f)


def _task_files(tmp) -> dict[str, str]:
  paragraphs = curate_corpus.english_paragraphs()
  return {
      "mc": _write_jsonl(tmp / "mc.jsonl", [{"context": p[:80], "choices": [" yes", " no", " maybe"], "label": i % 3}
                                            for i, p in enumerate(paragraphs[:8])]),
      "ppl": _write_jsonl(tmp / "ppl.jsonl", [{"text": p} for p in paragraphs[8:12]]),
      "toxicity": _write_jsonl(tmp / "tox.jsonl", [{"prompt": {"text": p[:60]}} for p in paragraphs[12:15]]),
  }


def _metrics(directory, lines: list[dict]) -> None:
  """metrics.jsonl as a training run writes it (train.core.logger.MetricLogger)."""
  os.makedirs(directory, exist_ok=True)
  log = logger.MetricLogger(directory, ml_collections.ConfigDict(
      {"tensorboard": False, "wandb": False, "wandb_project": "", "progress": False}), total_steps=len(lines))
  for line in lines:
    log.log(line.pop("step"), line)
  log.close()


def _curate(tmp, workdir) -> int:
  """A real curation run into WORKDIR/curate/output; returns the input's line count."""
  paragraphs = curate_corpus.english_paragraphs()
  texts = (paragraphs * (1 + DOCUMENTS // len(paragraphs)))[:DOCUMENTS - 10] + paragraphs[:10]  # some duplicates
  source = _write_jsonl(tmp / "docs.jsonl", [{"text": t} for t in texts])
  pipeline.run(curate_corpus.curate_input_config(source, os.path.dirname(report.stats_path(str(workdir)))))
  return len(texts)


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
  """(workdir, state, evaluations {stage: JSON}): every stage but export has run; pretrain and sft evaluated."""
  tmp = tmp_path_factory.mktemp("lifecycle")
  workdir = tmp / "work"
  documents = _curate(tmp, workdir)
  nan = float("nan")
  _metrics(workdir / "pretrain", [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 13)]
           + [{"step": 12, "eval_loss": 4.1}, {"step": 13, "loss": nan}, {"step": 14, "loss": 3.2}])
  _metrics(workdir / "sft", [{"step": s, "loss": 3.0 / s} for s in range(1, 6)] + [{"step": 5, "eval_loss": 2.5}])
  _metrics(workdir / "dpo", [{"step": s, "loss": 0.69 - 0.01 * s, "reward_accuracy": 0.5 + 0.05 * s,
                              "chosen_reward": 0.1 * s, "rejected_reward": -0.1 * s} for s in range(1, 5)]
           + [{"step": 4, "eval_loss": 0.6, "eval_reward_accuracy": 0.75}])
  from model import config as model_config
  model = model_config.default_model_config()
  model.update(TINY)
  with open(workdir / "dpo" / "config.json", "w") as f:
    json.dump({"model": model.to_dict(), "train": {"objective": "dpo"}}, f)
  files = _task_files(tmp)
  evaluations = {
      "pretrain": _evaluate(tmp, 0, f"mc:{files['mc']},ppl:{files['ppl']}", str(workdir / "eval" / "pretrain.json")),
      "sft": _evaluate(tmp, 1, ",".join(f"{k}:{v}" for k, v in files.items()), str(workdir / "eval" / "sft.json")),
  }
  with open(workdir / "eval" / "sft.samples.json", "w") as f:
    json.dump([{"prompt": "a < b & c", "completion": HOSTILE, "answer": "x > y"},
               {"prompt": "def f():", "completion": "  pass"}], f)
  records = {stage: {"status": "done", "digest": "ab12", "settings": {"train.steps": 40, "train.lr": 1e-3},
                     "seconds": 1.5 + i, "command": ["python", "-m", "train", f"--workdir={workdir / stage}"],
                     "dir": str(workdir / stage)} for i, stage in enumerate(STAGES[:-1])}
  state = {"name": "lifecycle_tiny", "stages": STAGES, "records": records, "training_stages": TRAINING,
           "evaluations": {s: str(workdir / "eval" / f"{s}.json") for s in evaluations}}
  return str(workdir), state, evaluations, documents


class _Page(html.parser.HTMLParser):
  """Tables (rows of (cell text, attributes)) and polylines (figure's data-stage, attributes) of a page."""

  def __init__(self, text: str):
    super().__init__()
    self.tables, self.polylines, self._stage, self._cell = [], [], None, None
    self.feed(text)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if tag == "table":
      self.tables.append([])
    elif tag == "tr":
      self.tables[-1].append([])
    elif tag in ("td", "th"):
      self._cell = ["", attrs]
      self.tables[-1][-1].append(self._cell)
    elif tag == "figure":
      self._stage = attrs.get("data-stage")
    elif tag == "polyline":
      self.polylines.append((self._stage, attrs))

  def handle_endtag(self, tag):
    if tag in ("td", "th"):
      self._cell = None
    elif tag == "figure":
      self._stage = None

  def handle_data(self, data):
    if self._cell is not None:
      self._cell[0] += data

  def table(self, *header: str) -> list[list]:
    """The first table whose header row starts with `header`; its body rows."""
    for t in self.tables:
      if tuple(text for text, _ in t[0][:len(header)]) == header:
        return t[1:]
    raise AssertionError(f"no table with header {header}")


def _metric_values(evaluation: dict) -> dict[str, dict[str, float]]:
  """{task: {metric: value}} of the non-null, non-stderr values of an evaluation JSON."""
  return {task: {m: v for m, v in metrics.items() if not m.endswith("_stderr") and v is not None}
          for task, metrics in evaluation["results"].items()}


def test_report_is_self_contained_and_escaped(lifecycle):
  workdir, state, _, _ = lifecycle
  path = report.write_report(workdir, state)
  assert path == os.path.join(workdir, "report.html")
  assert not [n for n in os.listdir(workdir) if ".tmp" in n]
  with open(path, encoding="utf-8") as f:
    text = f.read()
  for external in ('src="http', "src='http", 'href="http', "href='http", "<link", "<script", "@import", "url("):
    assert external not in text.lower(), external
  assert "&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in text and "a &lt; b &amp; c" in text
  assert "x &gt; y" in text
  rows = _Page(text).table("stage", "status", "seconds", "command")
  assert [(r[0][0], r[1][0]) for r in rows] == [(s, "done") for s in STAGES[:-1]] + [("export", "not run")]


def test_report_curation_funnel_matches_the_curated_output(lifecycle):
  workdir, state, _, documents = lifecycle
  with open(report.write_report(workdir, state), encoding="utf-8") as f:
    rows = _Page(f.read()).table("stage", "docs in", "docs out")
  with open(report.stats_path(workdir)) as f:
    stats = json.load(f)
  written = len(curate_corpus.output_records(os.path.dirname(report.stats_path(workdir))))
  assert [[c[0] for c in r[:3]] for r in rows] == [[s["stage"], f"{s['docs_in']:,}", f"{s['docs_out']:,}"]
                                                   for s in stats["stages"]]
  assert rows[0][1][0] == f"{documents:,}" and rows[-1][2][0] == f"{written:,}"
  assert int(rows[0][1][0].replace(",", "")) > int(rows[-1][2][0].replace(",", ""))  # the funnel dropped some


def test_report_plots_one_point_per_logged_value(lifecycle):
  workdir, state, _, _ = lifecycle
  with open(report.write_report(workdir, state), encoding="utf-8") as f:
    polylines = _Page(f.read()).polylines
  drawn = {(stage, a["data-series"]): len(a["points"].split()) for stage, a in polylines}
  expected = {}
  for stage in TRAINING:
    with open(os.path.join(workdir, stage, "metrics.jsonl")) as f:
      for line in f:
        for key, value in json.loads(line).items():
          if ("loss" in key or "reward" in key) and value is not None:
            expected[(stage, key)] = expected.get((stage, key), 0) + 1
  assert drawn == expected
  assert expected[("pretrain", "loss")] == 13  # 14 logged losses, one NaN (null)
  assert len(polylines) == len(expected)


def test_report_evaluation_table_shows_the_json_values(lifecycle):
  workdir, state, evaluations, _ = lifecycle
  with open(report.write_report(workdir, state), encoding="utf-8") as f:
    page = _Page(f.read())
  cells = {(a["data-stage"], a["data-column"]): a for t in page.tables for r in t for _, a in r if "data-column" in a}
  expected = 0
  for stage, evaluation in evaluations.items():
    for task, metrics in evaluation["results"].items():
      for metric, value in metrics.items():
        if metric.endswith("_stderr") or value is None:
          continue
        expected += 1
        cell = cells[(stage, f"{task}/{metric}")]
        assert float(cell["data-value"]) == value, (stage, task, metric)
        if f"{metric}_stderr" in metrics and metrics[f"{metric}_stderr"] is not None:
          assert float(cell["data-stderr"]) == metrics[f"{metric}_stderr"]
  assert sum("data-value" in a for a in cells.values()) == expected
  assert ("pretrain", "toxicity/expected_max_toxicity") in cells  # a metric pretrain lacks: an empty cell
  assert "data-value" not in cells[("pretrain", "toxicity/expected_max_toxicity")]


def test_evaluation_table_is_the_json(lifecycle):
  _, state, evaluations, _ = lifecycle
  columns, rows = report.evaluation_table(state)
  assert columns[0] == "stage" and [r[0] for r in rows] == ["pretrain", "sft"]
  for row in rows:
    results = evaluations[row[0]]["results"]
    for column, value in zip(columns[1:], row[1:]):
      task, metric = column.split("/", 1)
      assert value == results.get(task, {}).get(metric), (row[0], column)
  assert {c.split("/", 1)[0] for c in columns[1:]} == {"mc", "ppl", "toxicity"}
  assert not any(c.endswith("_stderr") for c in columns)


def _front_matter(text: str) -> dict:
  assert text.startswith("---\n")
  return yaml.safe_load(text.split("---\n")[1])


def test_model_card_front_matter_has_the_last_evaluation(lifecycle, tmp_path):
  workdir, state, evaluations, _ = lifecycle
  # the exported model is the sequence's last model stage, sft here; with dpo after it, dpo's evaluation is needed
  with open(card.write_model_card(str(tmp_path / "dpo_not_evaluated"), state, workdir), encoding="utf-8") as f:
    assert not _front_matter(f.read())["model-index"][0].get("results")
  state = {**state, "stages": ["curate", "tokenizer", "pretrain", "sft", "export"]}
  path = card.write_model_card(str(tmp_path / "export"), state, workdir)
  assert path == str(tmp_path / "export" / "README.md")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  meta = _front_matter(text)
  assert meta["library_name"] == "meshlm" and meta["license"] == "other" and "meshlm" in meta["tags"]
  (entry,) = meta["model-index"]
  assert entry["name"] == "lifecycle_tiny"
  assert all(r["task"] == {"type": "text-generation"} and r["dataset"]["name"] == r["dataset"]["type"]
             for r in entry["results"])
  got = {r["dataset"]["name"]: {m["type"]: m["value"] for m in r["metrics"]} for r in entry["results"]}
  assert got == _metric_values(evaluations["sft"])  # sft, the exported model; == on floats: exact
  assert all(type(m["value"]) is float for r in entry["results"] for m in r["metrics"])
  assert "expected_max_toxicity" in text.split("## Bias and toxicity")[1].split("##")[0]


def test_model_card_body(lifecycle, tmp_path):
  workdir, state, _, documents = lifecycle
  with open(card.write_model_card(str(tmp_path), {**state, "license": "apache-2.0"}, workdir)) as f:
    text = f.read()
  assert _front_matter(text)["license"] == "apache-2.0"
  sections = ["## Model description", "## Training data", "## Training procedure", "## Evaluation",
              "## Bias and toxicity", "## Limitations"]
  assert [text.index(s) for s in sections] == sorted(text.index(s) for s in sections)
  assert "| layers | 2 |" in text and "| d_model (residual width) | 64 |" in text
  assert f"| parameters | {TINY_PARAMS:,} |" in text
  assert f"read {documents:,} documents" in text
  assert "| export | not run | - | - |" in text and "train.steps=40" in text
  assert "not for use" in text and "Python documentation" in text


def test_model_card_without_bias_tasks(lifecycle, tmp_path):
  workdir, state, evaluations, _ = lifecycle
  only_pretrain = {**state, "stages": ["curate", "tokenizer", "pretrain", "export"],
                   "evaluations": {"pretrain": state["evaluations"]["pretrain"]}}
  with open(card.write_model_card(str(tmp_path), only_pretrain, workdir)) as f:
    text = f.read()
  got = {r["dataset"]["name"]: {m["type"]: m["value"] for m in r["metrics"]}
         for r in _front_matter(text)["model-index"][0]["results"]}
  assert got == _metric_values(evaluations["pretrain"])
  assert "No bias or toxicity evaluation was configured" in text


def test_nothing_run_yet(tmp_path):
  state = {"name": "fresh", "stages": STAGES, "records": {}, "evaluations": {"pretrain": str(tmp_path / "no.json")},
           "training_stages": TRAINING}
  with open(report.write_report(str(tmp_path), state), encoding="utf-8") as f:
    text = f.read()
  page = _Page(text)
  assert [r[1][0] for r in page.table("stage", "status")] == ["not run"] * len(STAGES)
  assert not page.polylines and text.count("not run") >= len(STAGES) + 1 + len(TRAINING)
  assert report.evaluation_table(state) == (["stage"], [])
  with open(card.write_model_card(str(tmp_path / "export"), state, str(tmp_path))) as f:
    meta = _front_matter(f.read())
  assert meta["model-index"][0]["results"] == []


@pytest.mark.parametrize("value", [1e-05, 5e-324, 1.5e300, 0.1 + 0.2, 1 / 3, -2.5e-10, 1e16, 0.0, 7, -3])
def test_yaml_number_reads_back_exactly(value):
  parsed = yaml.safe_load(f"v: {card.yaml_number(value)}")["v"]
  assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["plain", 'say "hi" \\ there', "two\nlines\tand tab", "é 🙂 中文", "a\u2028b",
                                  "#not: a [comment]", "null", "yes", "123", "", "- item"])
def test_yaml_str_reads_back_exactly(text):
  assert yaml.safe_load(f"v: {card.yaml_str(text)}")["v"] == text


def test_plot_svg_scales_points_into_the_frame():
  svg = report.plot_svg({"a": [(0, 1.0), (10, 3.0)], "b <x>": [(5, float("nan"))], "c": [(5, 2.0)]}, "t & u")
  page = _Page(f"<figure>{svg}</figure>")
  points = {a["data-series"]: [tuple(map(float, p.split(","))) for p in a["points"].split()]
            for _, a in page.polylines}
  assert set(points) == {"a", "c"} and "b &lt;x&gt; (no data)" in svg and "t &amp; u" in svg
  (ax0, ay0), (ax1, ay1) = points["a"]
  (cx, cy), = points["c"]
  assert ax0 < cx < ax1 and cx == pytest.approx((ax0 + ax1) / 2)  # x: 5 is halfway between 0 and 10
  assert ay0 > cy > ay1 and cy == pytest.approx((ay0 + ay1) / 2)  # y grows downwards; 2 halfway between 1 and 3
