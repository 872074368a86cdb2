"""The data package's config checks, registered with configs.validate when data/ is imported (data/__init__.py).

`data`: the UL2 objective_mixture against the rest of the config (data/denoise.py check_config). Conditional keys
of the `data` section: keys that act only under a condition, refused where they cannot (configs.validate.Conditional).
"""
from __future__ import annotations

from configs import validate

_TOKENIZER_TRAINING = ("tokenizer_type", "tokenizer_character_coverage", "tokenizer_byte_fallback",
                       "tokenizer_max_sentences")  # not tokenizer_vocab_size: it also checks a given tokenizer
_UL2_KEYS = ("ul2_r_mean_span", "ul2_r_rate", "ul2_x_mean_span", "ul2_x_rate")


def _objective_mixture(config) -> None:
  if config.get("train") is None or config.get("data") is None or not config.data.get("objective_mixture"):
    return
  from data import denoise  # pylint: disable=g-import-not-at-top  (numpy-heavy; only when a mixture is set)
  denoise.check_config(config)


def source_kinds(data_config) -> set[str] | None:
  """The kinds of data.sources' items ("chat" also for builtin:instruct, "preference" also for
  builtin:preference), or None if the spec does not parse (the data pipeline reports that, naming the key)."""
  from data import chat  # pylint: disable=g-import-not-at-top
  from data import plan  # pylint: disable=g-import-not-at-top
  try:
    specs = plan.parse(data_config.sources, tuple(data_config.weights))  # shared with the run's data plan
  except ValueError:
    return None
  from data import sources  # pylint: disable=g-import-not-at-top
  return {"chat" if chat.is_chat_source(s) else "preference" if sources.is_preference_source(s) else s.kind
          for s in specs}


def _has_source(*kinds: str):
  def acts(config, facts):
    del facts
    found = source_kinds(config.data)
    return None if found is None else bool(found & set(kinds))
  return acts


validate.register("data", _objective_mixture)
validate.conditional(
    *(validate.Conditional(f"data.{k}", "data.tokenizer is empty (a tokenizer is trained for the run)",
                           lambda c, f: not c.data.tokenizer, why="it configures tokenizer training")
      for k in _TOKENIZER_TRAINING),
    validate.Conditional("data.packing_bins", "data.packing='first_fit'",
                         lambda c, f: c.data.packing == "first_fit", why="concat packing has no bins"),
    *(validate.Conditional(f"data.{k}", "data.fim_rate > 0", lambda c, f: c.data.fim_rate > 0,
                           why="it shapes the fill-in-the-middle documents") for k in ("fim_spm_rate", "fim_level")),
    *(validate.Conditional(f"data.{k}", "data.objective_mixture is set", lambda c, f: bool(c.data.objective_mixture),
                           why="it configures a UL2 denoiser") for k in _UL2_KEYS),
    *(validate.Conditional(f"data.{k}", "data.sources has a chat source (chat:PATH or builtin:instruct)",
                           _has_source("chat"), why="only conversations are masked and truncated by turn")
      for k in ("chat_loss", "chat_truncation")),
    validate.Conditional("data.text_field", "data.sources has a jsonl: or parquet: source",
                         _has_source("jsonl", "parquet"), why="other sources have no fields"),
)
