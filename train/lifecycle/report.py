"""The lifecycle's report: WORKDIR/report.html, one self-contained page (inline CSS and SVG, no script, nothing
fetched, so it opens from disk) with the stages, the curation funnel, the training curves, the per-stage
evaluations and sample generations.

Files read (each may be absent: a stage not run yet, whose section then says "not run"):
  WORKDIR/curate/stats.json           data.curate's summary (data/curate/stats.py `summarise`: "stages" with
                                      docs_in/docs_out/chars_in/chars_out per curation stage, "output", ...)
  <stage dir>/metrics.jsonl           train.core.logger's records: {"step", metric: float or null, ...} per line
  state["evaluations"][stage]         `python -m train.evaluate --output` JSON (evals/harness.py):
                                      {"results": {task: {metric: value, metric_stderr: value}}, "n-samples",
                                       "config", "timing"}
  WORKDIR/eval/<stage>.samples.json   [{"prompt": str, "completion": str[, "answer": str]}, ...]

`state` is the runner's: {"name", "stages", "records": {stage: {"status", "seconds", "command", "settings",
"dir", ...}}, "evaluations": {stage: path}, "training_stages"}.
"""
from __future__ import annotations

import html
import json
import math
import os
import shlex
import time
from typing import Any

from data import files as datafiles
from train.core import logger

REPORT_FILE = "report.html"
NOT_RUN = "not run"
SAMPLES_SHOWN = 20  # sample generations shown per stage; the rest are counted
# Series colours: distinguishable on white and for the common colour-vision deficiencies (Okabe-Ito).
COLOURS = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#f0e442", "#000000")
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #777; font-style: italic; }
figure { display: inline-block; margin: 0 1em 1em 0; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: 0.5em; margin: 0.2em 0; }
code { font-size: 90%; }
"""


def _esc(value: Any) -> str:
  """`value` as HTML text, quotes included (safe inside attributes too)."""
  return html.escape(str(value), quote=True)


def is_number(value: Any) -> bool:
  """A finite int or float (not a bool, not null)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt_value(value: Any) -> str:
  """A table cell: 4 significant digits for a number, "n/a" for a missing one."""
  if value is None:
    return "n/a"
  if isinstance(value, bool):  # an int to Python, but a yes/no to the reader
    return str(value)
  return f"{value:,}" if isinstance(value, int) else f"{value:.4g}" if is_number(value) else str(value)


def load_json(path: str | None) -> tuple[Any, str | None]:
  """(the parsed file, None), or (None, why not): "not run" when it is absent, "unreadable: ..." when broken."""
  if not path or not os.path.exists(path):
    return None, NOT_RUN
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f), None
  except (OSError, ValueError) as e:
    return None, f"unreadable: {e}"


def stats_path(workdir: str) -> str:
  """Where the curate stage's summary lies."""
  return os.path.join(workdir, "curate", "stats.json")


def samples_path(workdir: str, stage: str) -> str:
  """Where a stage's sample generations lie."""
  return os.path.join(workdir, "eval", f"{stage}.samples.json")


def stage_dir(workdir: str, state: dict, stage: str) -> str:
  """A stage's run directory: its record's "dir", else WORKDIR/<stage>."""
  return state.get("records", {}).get(stage, {}).get("dir") or os.path.join(workdir, stage)


def metric_series(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
  """{group: {key: [(step, value), ...]}} of every key holding "loss" or "reward" in metrics.jsonl records.

  A group is a key without its "eval_" prefix, so training and held-out values of one metric share a plot; null
  (non-finite) values and records without a step are left out."""
  groups: dict[str, dict[str, list[tuple[float, float]]]] = {}
  for record in records:
    step = record.get("step")
    if not is_number(step):
      continue
    for key, value in record.items():
      if key != "step" and ("loss" in key or "reward" in key) and is_number(value):
        group = key[len("eval_"):] if key.startswith("eval_") else key
        groups.setdefault(group, {}).setdefault(key, []).append((float(step), float(value)))
  return {g: groups[g] for g in sorted(groups)}


# ---- evaluations ----------------------------------------------------------------------------------------------
def evaluated_stages(state: dict) -> list[tuple[str, dict | None, str | None]]:
  """[(stage, evaluation JSON or None, why not)] for every stage with an evaluation path, in pipeline order."""
  paths = state.get("evaluations", {})
  order = [s for s in state.get("stages", []) if s in paths]  # a stage dropped from the sequence no longer counts
  out = []
  for stage in order:
    data, why = load_json(paths[stage])
    if data is not None and not (isinstance(data, dict) and isinstance(data.get("results"), dict)):
      data, why = None, "unreadable: no 'results' object (not a python -m train.evaluate --output file)"
    out.append((stage, data, why))
  return out


def last_evaluation(state: dict) -> tuple[str, dict] | None:
  """(stage, evaluation JSON) of the last model stage of the sequence (the exported model), when its evaluation
  exists; None otherwise (an older model's figures are not the exported one's)."""
  policy = [s for s in state.get("stages", []) if s in ("pretrain", "sft", "dpo", "rl")]
  found = [(stage, data) for stage, data, _ in evaluated_stages(state) if data is not None]
  return found[-1] if found and policy and found[-1][0] == policy[-1] else None


def evaluation_metrics(evaluation: dict) -> dict[str, tuple[Any, Any]]:
  """{"task/metric": (value, stderr)} of one evaluation JSON in its order; stderr None when it has none, value
  None when the harness wrote null (NaN)."""
  out = {}
  for task, metrics in evaluation["results"].items():
    for name, value in metrics.items():
      if not name.endswith("_stderr"):
        out[f"{task}/{name}"] = (value, metrics.get(f"{name}_stderr"))
  return out


def _evaluation_cells(state: dict) -> tuple[list[str], list[list]]:
  """Columns ["stage", "task/metric", ...] (first seen first) and rows [stage, (value, stderr), ...]."""
  per_stage = [(stage, evaluation_metrics(data)) for stage, data, _ in evaluated_stages(state) if data is not None]
  columns: dict[str, None] = {}
  for _, metrics in per_stage:
    columns.update(dict.fromkeys(metrics))
  rows = [[stage] + [metrics.get(c, (None, None)) for c in columns] for stage, metrics in per_stage]
  return ["stage", *columns], rows


def evaluation_table(state: dict) -> tuple[list[str], list[list]]:
  """The per-stage evaluation table the report shows: columns ["stage", "task/metric", ...] and one row per stage
  with an evaluation file, [stage, value, ...] (the JSON's values as they are; None where a stage lacks a metric
  or the harness wrote null)."""
  columns, rows = _evaluation_cells(state)
  return columns, [[row[0]] + [value for value, _ in row[1:]] for row in rows]


# ---- SVG ------------------------------------------------------------------------------------------------------
def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
  return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _span(values: list[float]) -> tuple[float, float]:
  """(lo, hi) of `values`, widened when they are all equal so that a flat line sits mid-plot."""
  lo, hi = min(values), max(values)
  if hi == lo:
    pad = abs(lo) * 0.05 or 1.0
    return lo - pad, hi + pad
  return lo, hi


def plot_svg(series: dict[str, list[tuple[float, float]]], title: str) -> str:
  """An inline SVG line plot: one polyline (attribute data-series=name, one point per finite (x, y)) per series,
  with axes, 5 ticks per axis and a legend. Series without a finite point are listed in the legend as "no data"."""
  width, height, left, right, top, bottom = 640, 300, 64, 170, 28, 40
  pw, ph = width - left - right, height - top - bottom
  clean = {name: [(float(x), float(y)) for x, y in pts if is_number(x) and is_number(y)]
           for name, pts in series.items()}
  xs = [x for pts in clean.values() for x, _ in pts]
  ys = [y for pts in clean.values() for _, y in pts]
  parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_esc(title)}">',
           f'<text x="{left}" y="18" font-size="14" font-weight="bold">{_esc(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
  if not xs:
    parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#777">no data</text>')
  else:
    (x0, x1), (y0, y1) = _span(xs), _span(ys)
    px = lambda x: left + (x - x0) / (x1 - x0) * pw
    py = lambda y: top + ph - (y - y0) / (y1 - y0) * ph  # SVG's y grows downwards
    for t in _ticks(x0, x1):
      parts.append(f'<text x="{px(t):.2f}" y="{top + ph + 16}" font-size="11" text-anchor="middle">{t:.4g}</text>')
    for t in _ticks(y0, y1):
      parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.2f}" y2="{py(t):.2f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{py(t) + 4:.2f}" font-size="11" text-anchor="end">{t:.4g}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 4}" font-size="11" text-anchor="middle">step</text>')
    for i, (name, pts) in enumerate(clean.items()):
      colour = COLOURS[i % len(COLOURS)]
      if pts:
        points = " ".join(f"{px(x):.2f},{py(y):.2f}" for x, y in pts)
        parts.append(f'<polyline data-series="{_esc(name)}" fill="none" stroke="{colour}" stroke-width="1.5" '
                     f'points="{points}"><title>{_esc(name)}</title></polyline>')
        if len(pts) == 1:  # a one-point polyline draws nothing: mark the point
          parts.append(f'<circle cx="{px(pts[0][0]):.2f}" cy="{py(pts[0][1]):.2f}" r="3" fill="{colour}"/>')
  for i, (name, pts) in enumerate(clean.items()):
    y = top + 12 + 18 * i
    parts.append(f'<rect x="{width - right + 12}" y="{y - 9}" width="12" height="4" '
                 f'fill="{COLOURS[i % len(COLOURS)]}"/><text x="{width - right + 30}" y="{y - 4}" '
                 f'font-size="11">{_esc(name)}{"" if pts else " (no data)"}</text>')
  parts.append("</svg>")
  return "\n".join(parts)


def _funnel_svg(stages: list[dict]) -> str:
  """Horizontal bars: documents out of each curation stage, as a share of the documents read."""
  width, label, bar_h = 640, 130, 18
  total = max(stages[0].get("docs_in", 0), 1) if stages else 1
  parts = [f'<svg width="{width}" height="{bar_h * len(stages) + 8}" role="img" aria-label="curation funnel">']
  for i, s in enumerate(stages):
    y, w = 4 + i * bar_h, (width - label - 90) * s.get("docs_out", 0) / total
    parts.append(f'<text x="{label - 6}" y="{y + 13}" font-size="12" text-anchor="end">{_esc(s.get("stage"))}'
                 f'</text><rect x="{label}" y="{y + 2}" width="{w:.2f}" height="{bar_h - 4}" fill="{COLOURS[0]}"/>'
                 f'<text x="{label + w + 6:.2f}" y="{y + 13}" font-size="12">{_esc(fmt_value(s.get("docs_out")))}'
                 "</text>")
  parts.append("</svg>")
  return "\n".join(parts)


# ---- sections -------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[str]]) -> str:
  """An HTML table of already-escaped cells (a cell starting with "<td" is taken as it is)."""
  head = "".join(f"<th>{h}</th>" for h in header)
  body = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>"
                 for row in rows)
  return f"<table><tr>{head}</tr>{body}</table>"


def _num_cell(value: Any) -> str:
  """A right-aligned cell: a number to 4 significant digits (integers whole), a string as it is."""
  return f'<td class="num">{_esc(fmt_value(value))}</td>'


def _eval_cell(stage: str, column: str, value: Any, stderr: Any) -> str:
  """An evaluation cell: "value ± stderr" to 4 digits; data-value and data-stderr hold the exact numbers."""
  attrs = "".join(f' data-{k}="{_esc(repr(v) if is_number(v) else v)}"'
                  for k, v in (("stage", stage), ("column", column), ("value", value), ("stderr", stderr))
                  if v is not None)
  text = _esc(fmt_value(value)) + (f" &plusmn; {_esc(fmt_value(stderr))}" if stderr is not None else "")
  return f'<td class="num"{attrs}>{text}</td>'


def _stages_section(state: dict) -> str:
  records = state.get("records", {})
  rows = []
  for stage in state.get("stages", []) + [s for s in records if s not in state.get("stages", [])]:
    r = records.get(stage)
    if r is None:
      rows.append([_esc(stage), NOT_RUN, "-", "-"])
      continue
    command = r.get("command")
    command = shlex.join(map(str, command)) if isinstance(command, (list, tuple)) else command or "-"
    rows.append([_esc(stage), _esc(r.get("status", "?")), _num_cell(r.get("seconds")),
                 f"<code>{_esc(command)}</code>"])
  return "<h2>Stages</h2>" + _table(["stage", "status", "seconds", "command"], rows)


def _curation_section(workdir: str) -> str:
  stats, why = load_json(stats_path(workdir))
  out = "<h2>Curation funnel</h2>"
  if stats is None:
    return out + f'<p class="note">{_esc(why)} ({_esc(stats_path(workdir))})</p>'
  stages = stats.get("stages", [])
  rows = [[_esc(s["stage"]), _num_cell(s["docs_in"]), _num_cell(s["docs_out"]), _num_cell(s["docs_in"] - s["docs_out"]),
           _num_cell(f"{100 * s['docs_out'] / s['docs_in']:.1f}%" if s["docs_in"] else "-"),
           _num_cell(s["chars_in"]), _num_cell(s["chars_out"])] for s in stages]
  out += _funnel_svg(stages) + _table(["stage", "docs in", "docs out", "dropped", "kept", "chars in", "chars out"],
                                      rows)
  kept = sum(b["docs"] for by_bucket in stats.get("output", {}).values() for b in by_bucket.values())
  out += f"<p>Documents written: {fmt_value(kept)}.</p>"
  reasons = stats.get("quality_reasons") or {}
  if reasons:
    out += "<p>Quality drops by rule: " + ", ".join(f"{_esc(k)} {fmt_value(v)}" for k, v in reasons.items()) + ".</p>"
  return out + "".join(f'<p class="note">{_esc(n)}</p>' for n in stats.get("notices", ()))


def _training_section(workdir: str, state: dict) -> str:
  out = "<h2>Training curves</h2>"
  for stage in state.get("training_stages", []):
    out += f"<h3>{_esc(stage)}</h3>"
    directory = stage_dir(workdir, state, stage)
    if not os.path.exists(os.path.join(directory, logger.METRICS_FILE)):
      out += f'<p class="note">{NOT_RUN}</p>'
      continue
    try:
      groups = metric_series(logger.read_metrics(directory))
    except ValueError as e:
      out += f'<p class="note">unreadable: {_esc(e)}</p>'
      continue
    if not groups:
      out += '<p class="note">no loss or reward metrics logged</p>'
    for group, series in groups.items():
      out += f'<figure data-stage="{_esc(stage)}">{plot_svg(series, f"{stage}: {group}")}</figure>'
  return out


def _evaluation_section(state: dict) -> str:
  out = "<h2>Evaluation</h2>"
  columns, rows = _evaluation_cells(state)
  if rows:
    cells = [[_esc(row[0])] + [_eval_cell(row[0], c, v, e) for c, (v, e) in zip(columns[1:], row[1:])]
             for row in rows]
    out += _table([_esc(c) for c in columns], cells)
    out += '<p class="note">4 significant digits, &plusmn; the standard error where the harness computed one.</p>'
  stages = evaluated_stages(state)
  out += "".join(f'<p class="note">{_esc(stage)}: {_esc(why)}</p>' for stage, data, why in stages if data is None)
  missing = [s for s in state.get("training_stages", []) if s not in {stage for stage, _, _ in stages}]
  if missing:
    out += f'<p class="note">Not evaluated ({NOT_RUN}): {_esc(", ".join(missing))}.</p>'
  return out


def _samples_section(workdir: str, state: dict) -> str:
  out = "<h2>Sample generations</h2>"
  shown = False
  for stage in state.get("stages", []):
    samples, why = load_json(samples_path(workdir, stage))
    if why == NOT_RUN:
      continue
    shown = True
    out += f"<h3>{_esc(stage)}</h3>"
    if not isinstance(samples, list):
      out += f'<p class="note">{_esc(why or "unreadable: not a JSON list")}</p>'
      continue
    for s in samples[:SAMPLES_SHOWN]:
      s = s if isinstance(s, dict) else {}
      answer = f'<b>expected</b><pre>{_esc(s["answer"])}</pre>' if "answer" in s else ""
      out += (f'<div class="sample"><b>prompt</b><pre>{_esc(s.get("prompt", ""))}</pre>'
              f'<b>completion</b><pre>{_esc(s.get("completion", ""))}</pre>{answer}</div>')
    if len(samples) > SAMPLES_SHOWN:
      out += f'<p class="note">{SAMPLES_SHOWN} of {len(samples)} shown.</p>'
  return out if shown else out + f'<p class="note">{NOT_RUN}</p>'


def render(workdir: str, state: dict) -> str:
  """The report's HTML text."""
  name = state.get("name", os.path.basename(os.path.abspath(workdir)))
  body = (_stages_section(state) + _curation_section(workdir) + _training_section(workdir, state)
          + _evaluation_section(state) + _samples_section(workdir, state))
  return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(name)}: lifecycle report'
          f"</title><style>{_CSS}</style></head><body><h1>{_esc(name)}</h1>"
          f'<p class="note">{_esc(os.path.abspath(workdir))}, written {time.strftime("%Y-%m-%d %H:%M:%S")}</p>'
          f"{body}</body></html>\n")


def write_report(workdir: str, state: dict) -> str:
  """Writes WORKDIR/report.html atomically (a reader sees the old report or the whole new one); returns its
  path."""
  path = os.path.join(workdir, REPORT_FILE)
  datafiles.atomic_write(path, render(workdir, state))
  return path
