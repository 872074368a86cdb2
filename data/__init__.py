"""Data: sources and mixtures (`data.sources`, `data.mixture`), SentencePiece tokenizers (`data.tokenizer`), the
per-process grain pipeline (`data.pipeline`), iterator checkpoint arguments (`data.checkpoint`) and curation
(`data.curate`); see docs/data.md. Importing the package imports only its config checks (data/config_checks.py,
registered with configs.validate so every command that reads data checks the `data` section before it runs)."""
from data import config_checks as _config_checks  # noqa: F401  pylint: disable=unused-import
