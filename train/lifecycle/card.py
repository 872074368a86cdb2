"""The model card: EXPORT_DIR/README.md in Hugging Face's format (https://huggingface.co/docs/hub/model-cards), a
YAML front matter block and a Markdown body, written from the lifecycle's state and the files the report reads
(train/lifecycle/report.py), so that card and report show the same numbers.

The front matter's model-index has one entry whose results are, for every task of the last evaluated stage's
evaluation JSON, {task: {type: text-generation}, dataset: {name: TASK, type: TASK}, metrics: [{type, value}]} with
the JSON's values exactly (stderrs and null values left out). The YAML is written by hand: every string
double-quoted, every float in a form YAML 1.1 (PyYAML) reads back as the same float.
"""
from __future__ import annotations

import json
import os
from typing import Any

from data import files as datafiles
from train.lifecycle import report

CARD_FILE = "README.md"
TAGS = ("meshlm", "text-generation", "causal-lm")
# Tasks whose metrics measure bias or toxicity (evals/bias.py, evals/toxicity.py; the names of evals/tasks.py).
BIAS_TASKS = ("crows_pairs", "winogender", "bbq", "toxicity")
# (card label, model config key): the architecture rows, shown when config.json has the key.
ARCHITECTURE = (("layers", "num_layers"), ("d_model (residual width)", "d_model"), ("query heads", "num_heads"),
                ("key/value heads", "num_kv_heads"), ("head width", "head_dim"), ("MLP width", "mlp_dim"),
                ("MLP type", "mlp_type"), ("vocabulary", "vocab_size"), ("context length (tokens)", "max_seq_len"),
                ("tied embeddings", "tie_embeddings"), ("experts", "num_experts"))
LIMITATIONS = ("This is a tiny model trained for a few steps on Python documentation, to exercise meshlm's pipeline "
               "from curation to export end to end. Its generations are unreliable and often wrong, it knows "
               "little beyond the style of that documentation, and it has had no safety training beyond the "
               "stages listed above: it is not for use in any application.")
# Characters a YAML double-quoted scalar must not hold raw: the quote, the escape, and the line breaks and
# controls YAML would fold or reject.
_YAML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


# ---- YAML -----------------------------------------------------------------------------------------------------
def yaml_str(text: Any) -> str:
  """`text` as a YAML double-quoted scalar."""
  out = []
  for ch in str(text):
    if ch in _YAML_ESCAPES:
      out.append(_YAML_ESCAPES[ch])
    elif ord(ch) < 0x20 or ord(ch) == 0x7F or ch in "\x85\u2028\u2029\ufeff":
      out.append(f"\\u{ord(ch):04x}")
    else:
      out.append(ch)
  return '"' + "".join(out) + '"'


def yaml_number(value: int | float) -> str:
  """A finite int or float as YAML that PyYAML (YAML 1.1) reads back as the equal number: repr's shortest
  round-trip digits, with ".0" put before a bare exponent since YAML 1.1 reads 1e-05 as a string."""
  if isinstance(value, int):
    return str(value)
  text = repr(float(value))
  if "e" in text and "." not in text:
    mantissa, exponent = text.split("e")
    text = f"{mantissa}.0e{exponent}"  # repr writes the exponent's sign, which YAML 1.1 requires
  return text


def model_index_results(evaluation: dict) -> list[dict[str, Any]]:
  """The model-index results of one evaluation JSON: per task, its finite metric values (no stderrs)."""
  results = []
  for task, metrics in evaluation["results"].items():
    values = [(name, value) for name, value in metrics.items()
              if not name.endswith("_stderr") and report.is_number(value)]
    if values:
      results.append({"task": task, "metrics": values})
  return results


def front_matter(state: dict) -> str:
  """The YAML block between the two '---' lines."""
  last = report.last_evaluation(state)
  lines = ["---", "library_name: meshlm", "tags:", *[f"- {yaml_str(t)}" for t in TAGS],
           f"license: {yaml_str(state.get('license', 'other'))}", "model-index:",
           f"- name: {yaml_str(state.get('name', 'model'))}"]
  results = model_index_results(last[1]) if last else []
  lines.append("  results:" if results else "  results: []")
  for r in results:
    lines += ["  - task:", f"      type: {yaml_str('text-generation')}", "    dataset:",
              f"      name: {yaml_str(r['task'])}", f"      type: {yaml_str(r['task'])}", "    metrics:"]
    for name, value in r["metrics"]:
      lines += [f"    - type: {yaml_str(name)}", f"      value: {yaml_number(value)}"]
  return "\n".join(lines + ["---"]) + "\n"


# ---- Markdown -------------------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
  """A Markdown table cell: numbers to 4 significant digits, pipes escaped, one line."""
  return report.fmt_value(value).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
  return (["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows] + [""])


def _last_config(workdir: str, state: dict) -> tuple[str, dict] | None:
  """(stage, config.json) of the last model stage (the exported model; not a reward model) that wrote one."""
  for stage in reversed([s for s in state.get("training_stages", []) if s != "reward"]):
    config, _ = report.load_json(os.path.join(report.stage_dir(workdir, state, stage), "config.json"))
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
      return stage, config
  return None


def _param_counts(model_config: dict) -> dict[str, int] | None:
  """model.counting's parameter counts of a config.json model section, or None where it cannot tell (a config
  from another meshlm version, or JAX unavailable)."""
  try:
    from model import counting  # pylint: disable=g-import-not-at-top  # lazy: imports JAX
    return counting.count_params(model_config)
  except (ImportError, ValueError, TypeError, KeyError):
    return None


def _description(workdir: str, state: dict) -> list[str]:
  stages = " → ".join(state.get("stages", []))
  out = ["## Model description", "",
         f"A decoder-only transformer trained with meshlm by `python -m train.lifecycle`, through the stages "
         f"{stages}.", ""]
  found = _last_config(workdir, state)
  if found is None:
    return out + [f"Architecture unknown: no training stage has written config.json yet ({report.NOT_RUN}).", ""]
  stage, config = found
  model = config["model"]
  rows = [[label, model[key]] for label, key in ARCHITECTURE if key in model]
  counts = _param_counts(model)
  if counts:
    rows += [["parameters", counts["total"]], ["non-embedding parameters", counts["non_embedding"]]]
  objective = config.get("train", {}).get("objective") if isinstance(config.get("train"), dict) else None
  note = f" (final objective: {objective})" if objective else ""
  return out + [f"From `{stage}/config.json`{note}:", ""] + _md_table(["setting", "value"], rows)


def _training_data(workdir: str) -> list[str]:
  out = ["## Training data", ""]
  stats, why = report.load_json(report.stats_path(workdir))
  if not isinstance(stats, dict) or not stats.get("stages"):
    return out + [f"Curation: {why or 'no stages in stats.json'} (`curate/stats.json`).", ""]
  stages = stats["stages"]
  written = [b for by_bucket in stats.get("output", {}).values() for b in by_bucket.values()]
  out += [f"Curation (`python -m data.curate`) read {stages[0]['docs_in']:,} documents "
          f"({stages[0]['chars_in']:,} characters) from {stats.get('input_files', '?')} input file(s) and kept "
          f"{sum(b['docs'] for b in written):,} ({sum(b['chars'] for b in written):,} characters). "
          "Documents in and out of each stage:", ""]
  out += _md_table(["stage", "docs in", "docs out", "dropped"],
                   [[s["stage"], s["docs_in"], s["docs_out"], s["docs_in"] - s["docs_out"]] for s in stages])
  reasons = stats.get("quality_reasons") or {}
  if reasons:
    out += ["Quality drops by rule: " + ", ".join(f"{k} {v:,}" for k, v in reasons.items()) + ".", ""]
  return out


def _settings(settings: Any) -> str:
  if not isinstance(settings, dict):
    return "" if settings is None else str(settings)
  return ", ".join(f"{k}={v if isinstance(v, (str, int, float)) else json.dumps(v)}" for k, v in settings.items())


def _procedure(state: dict) -> list[str]:
  records = state.get("records", {})
  rows = []
  for stage in state.get("stages", []):
    r = records.get(stage)
    rows.append([stage, report.NOT_RUN, "-", "-"] if r is None else
                [stage, r.get("status", "?"), r.get("seconds"), _settings(r.get("settings"))])
  return ["## Training procedure", ""] + _md_table(["stage", "status", "seconds", "settings"], rows)


def _evaluation(state: dict) -> list[str]:
  columns, rows = report.evaluation_table(state)
  out = ["## Evaluation", ""]
  if not rows:
    return out + [f"No stage has been evaluated ({report.NOT_RUN}).", ""]
  return out + ["`python -m train.evaluate` after each stage (4 significant digits; exact values in the front "
                "matter for the last stage and in the evaluation JSONs):", ""] + _md_table(columns, rows)


def _bias(state: dict) -> list[str]:
  rows = []
  for stage, data, _ in report.evaluated_stages(state):
    for task, metrics in (data or {}).get("results", {}).items():
      if task.split(":")[0] in BIAS_TASKS:
        rows += [[stage, task, name, value, metrics.get(f"{name}_stderr")]
                 for name, value in metrics.items() if not name.endswith("_stderr")]
  out = ["## Bias and toxicity", ""]
  if not rows:
    return out + ["No bias or toxicity evaluation was configured (tasks crows_pairs, winogender, bbq, toxicity of "
                  "`python -m train.evaluate`), so none is reported.", ""]
  return out + _md_table(["stage", "task", "metric", "value", "stderr"], rows)


def card_text(state: dict, workdir: str) -> str:
  """The card's text: front matter, then the body sections."""
  body = ([f"# {state.get('name', 'model')}", ""] + _description(workdir, state) + _training_data(workdir)
          + _procedure(state) + _evaluation(state) + _bias(state) + ["## Limitations", "", LIMITATIONS, ""])
  return front_matter(state) + "\n" + "\n".join(body)


def write_model_card(export_dir: str, state: dict, workdir: str) -> str:
  """Writes EXPORT_DIR/README.md atomically; returns its path."""
  path = os.path.join(export_dir, CARD_FILE)
  datafiles.atomic_write(path, card_text(state, workdir))
  return path
