"""Counting documents and characters in and out of each stage, per language, and the readable table."""
from __future__ import annotations

from collections import defaultdict

STAGES = ("read", "url_filter", "minhash", "paragraph_dedup", "min_length", "decontaminate", "langid", "quality",
          "quality_model", "perplexity", "pii")
_FIELDS = ("docs_in", "chars_in", "docs_out", "chars_out")


class StageCounter:
  """counts[stage][language] = [docs_in, chars_in, docs_out, chars_out]; JSON-serialisable via `to_dict`."""

  def __init__(self, data: dict | None = None):
    self.counts: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0]))
    for stage, by_lang in (data or {}).items():
      for lang, values in by_lang.items():
        self.counts[stage][lang] = list(values)

  def add(self, stage: str, language: str, chars_in: int, chars_out: int | None) -> None:
    """One document entering `stage`; `chars_out` None when the stage drops it."""
    row = self.counts[stage][language]
    row[0] += 1
    row[1] += chars_in
    if chars_out is not None:
      row[2] += 1
      row[3] += chars_out

  def merge(self, other: "StageCounter") -> None:
    for stage, by_lang in other.counts.items():
      for lang, values in by_lang.items():
        row = self.counts[stage][lang]
        for i, v in enumerate(values):
          row[i] += v

  def to_dict(self) -> dict:
    return {stage: {lang: list(v) for lang, v in sorted(by_lang.items())} for stage, by_lang in self.counts.items()}


def summarise(counter: StageCounter, output: dict, extra: dict) -> dict:
  """The stats.json object: stages in pipeline order (totals and per language), output per language and bucket,
  plus `extra` (dedup/minhash/cutoff details)."""
  stages = []
  for stage in STAGES:
    if stage not in counter.counts:
      continue
    by_lang = {lang: dict(zip(_FIELDS, v)) for lang, v in sorted(counter.counts[stage].items())}
    total = [sum(v[i] for v in counter.counts[stage].values()) for i in range(4)]
    stages.append({"stage": stage, **dict(zip(_FIELDS, total)), "by_language": by_lang})
  return {"stages": stages, "output": output, **extra}


def _fmt(n: int) -> str:
  return f"{n:,}"


def table(summary: dict) -> str:
  """Markdown tables: every stage (documents and characters in/out), documents out per language and stage, and
  the output per language and bucket."""
  lines = [f"Notice: {notice}" for notice in summary.get("notices", ())]
  lines += [""] if lines else []
  lines += ["## Stages", "", "| stage | docs in | docs out | chars in | chars out | docs kept |",
            "|---|---:|---:|---:|---:|---:|"]
  for s in summary["stages"]:
    kept = f"{100 * s['docs_out'] / s['docs_in']:.1f}%" if s["docs_in"] else "-"
    lines.append(f"| {s['stage']} | {_fmt(s['docs_in'])} | {_fmt(s['docs_out'])} | {_fmt(s['chars_in'])} | "
                 f"{_fmt(s['chars_out'])} | {kept} |")
  languages = sorted({lang for s in summary["stages"] for lang in s["by_language"]})
  names = [s["stage"] for s in summary["stages"]]
  lines += ["", "## Documents (characters) out of each stage, per language", "",
            "| language | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
  for lang in languages:
    cells = []
    for s in summary["stages"]:
      row = s["by_language"].get(lang)
      cells.append(f"{_fmt(row['docs_out'])} ({_fmt(row['chars_out'])})" if row else "-")
    lines.append(f"| {lang} | " + " | ".join(cells) + " |")
  lines += ["", "## Output per language and bucket: documents (characters)", "",
            "| language | head | middle | tail | all |", "|---|---:|---:|---:|---:|"]
  for lang, by_bucket in sorted(summary["output"].items()):
    cells = [f"{_fmt(by_bucket[b]['docs'])} ({_fmt(by_bucket[b]['chars'])})" if b in by_bucket else "-"
             for b in ("head", "middle", "tail", "all")]
    lines.append(f"| {lang} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
