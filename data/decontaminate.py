"""Which training documents contain evaluation items: a per-task n-gram overlap report (data/curate/contamination.py).

    python -m data.decontaminate --tasks piqa:DIR,crows_pairs:FILE,mc:items.jsonl --input 'crawl/*.jsonl'
    python -m data.decontaminate --tasks ... --sources builtin        # a training mixture instead of files

Prints, per task: its items (and those too short to check), the documents hit, the n-gram occurrences matched, the
distinct items hit and a few examples; `--output FILE` writes the same as JSON. To drop contaminated documents
while curating, set the curation stage `--config.decontaminate.tasks=...` (docs/curation.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Iterator, Sequence

from data import files as datafiles
from data.curate import contamination


def _documents(args) -> Iterator[dict]:
  if args.sources:
    from data import sources as sources_lib  # pylint: disable=g-import-not-at-top
    for spec in sources_lib.parse_spec(args.sources):
      src = sources_lib.open_source(spec, args.text_field)
      for i in range(len(src)):
        text = src[i]
        if isinstance(text, str) and text:
          yield {"id": f"{spec.name}:{i}", "text": text}
    return
  for path in datafiles.expand(args.input, "--input"):
    yield from datafiles.read_documents(path, args.input_format, text_field=args.text_field,
                                        format_key="--input_format", field_key="--text_field")


def format_report(report: dict) -> str:
  """The report as a console table plus examples."""
  lines = [f"{report['documents']:,} documents read, {report['contaminated_documents']:,} contaminated "
           f"(n-grams of {report['n'][0]} to {report['n'][1]} words)",
           f"{'task':<24} {'items':>7} {'too short':>9} {'docs hit':>8} {'n-grams':>8} {'items hit':>9}"]
  for name, r in report["tasks"].items():
    lines.append(f"{name:<24} {r['items']:>7,} {r['items_too_short']:>9,} {r['documents_hit']:>8,} "
                 f"{r['ngrams_matched']:>8,} {r['items_hit']:>9,}")
  for name, r in report["tasks"].items():
    for ex in r["examples"]:
      lines.append(f"  {name}: document {ex['document']} holds item {ex['item']}: \"{ex['ngram']}\"")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m data.decontaminate", description=__doc__.split("\n\n")[0])
  p.add_argument("--tasks", required=True, help="evaluation tasks NAME:PATH[,...] (as python -m train.evaluate --tasks)")
  p.add_argument("--input", default="", help="training files (globs, comma-separated; jsonl, parquet, text, wet)")
  p.add_argument("--sources", default="", help="or a training mixture spec, as config.data.sources")
  p.add_argument("--input_format", default="auto", help="auto (from the extension) | jsonl | parquet | text | wet")
  p.add_argument("--text_field", default="text")
  p.add_argument("--min_n", type=int, default=contamination.MIN_N)
  p.add_argument("--max_n", type=int, default=contamination.MAX_N)
  p.add_argument("--output", default="", help="also write the report as JSON here")
  args = p.parse_args(argv)
  if bool(args.input) == bool(args.sources):
    print("error: give the training documents with exactly one of --input GLOB or --sources SPEC", file=sys.stderr)
    return 2
  try:
    index = contamination.load_index(args.tasks, args.min_n, args.max_n)
    report = contamination.scan(index, _documents(args)).to_dict()
  except (ValueError, FileNotFoundError) as e:  # a bad task spec or file, a missing input
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_report(report))
  if args.output:
    with open(args.output, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
