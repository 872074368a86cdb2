"""`python -m data.curate --input GLOB --output DIR [--config=curate] [--config.SECTION.KEY=VALUE ...]`."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
  import configs  # config files and overrides, shared by every command
  from data.curate import pipeline

  parser = argparse.ArgumentParser(prog="python -m data.curate", description=__doc__)
  parser.add_argument("--input", default=None, help="input glob(s), comma-separated (config key `input`)")
  parser.add_argument("--output", default=None, help="output directory (config key `output`)")
  try:
    cfg, args = configs.parse(sys.argv[1:] if argv is None else list(argv), parser, default="curate")
    if args.input is not None:
      cfg.input = args.input
    if args.output is not None:
      cfg.output = args.output
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    summary = pipeline.run(cfg)
  except (configs.ConfigError, ValueError, FileNotFoundError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from data.curate import stats
  print(stats.table(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
