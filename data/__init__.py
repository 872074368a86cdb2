"""Data: sources and mixtures (`data.sources`, `data.mixture`), SentencePiece tokenizers (`data.tokenizer`), the
per-process grain pipeline (`data.pipeline`), iterator checkpoint arguments (`data.checkpoint`) and curation
(`data.curate`). Importing the package imports nothing else; see docs/data.md."""
