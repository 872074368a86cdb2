"""Data curation: a CCNet-style pipeline (paragraph deduplication, MinHash near-duplicate removal, benchmark
decontamination, fastText language id, Gopher/C4 quality rules, n-gram perplexity buckets, PII masking) on one machine or a Ray cluster.

`python -m data.curate --input GLOB --output DIR [--config=curate] [--config.KEY=VALUE ...]`, or
`data.curate.run(configs.curate.get_config())`. See docs/curation.md.
"""
from data.curate.pipeline import run

__all__ = ["run"]
