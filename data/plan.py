"""The run's data plan: config.data's mixture parsed once, at set-up, into one frozen value.

`resolve` is the one place a run parses `config.data.sources` / `config.data.weights` (data.sources.parse_spec,
through `parse`, which the config checks share) and `config.data.objective_mixture` (data.denoise.parse_mixture).
Every later stage receives the DataPlan instead of re-reading those strings: tokenizer training
(data.tokenizer.prepare), the grain pipeline (data.pipeline.make_dataset), the chat template and held-out chat
prompts (train/core/chat_eval.py, data.chat.eval_items) and the objective/data check (train/core/setup.py).
Called without a plan, those functions resolve one themselves (a plan per call), as scripts and tests that use
them alone expect. data/ imports neither model/ nor train/: the plan is plain data.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from data import denoise as denoise_lib
from data import sources as sources_lib

TEXT, CHAT, PREFERENCE = "text", "chat", "preference"  # what a source's documents hold


@dataclasses.dataclass(frozen=True)
class DataPlan:
  """The parsed mixture: one SourceSpec per source (weights normalised to sum to 1) with what its records hold,
  how each source is split, read and (optionally) denoised."""
  specs: tuple[sources_lib.SourceSpec, ...]
  kinds: tuple[str, ...]  # per source: TEXT documents, CHAT conversations or PREFERENCE pairs
  eval_fraction: float  # the held-out fraction of each source (data.sources.source_split)
  text_field: str  # the record field holding a jsonl / parquet document
  strict: bool  # a bad record raises (True) or is skipped and counted (False)
  objective_mixture: tuple[tuple[str, float], ...] = ()  # (denoiser, weight summing to 1); () = left-to-right

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(s.name for s in self.specs)

  @property
  def weights(self) -> tuple[float, ...]:
    return tuple(s.weight for s in self.specs)

  @property
  def chat_indices(self) -> tuple[int, ...]:
    """Positions (in `specs`) of the sources holding conversations."""
    return tuple(i for i, kind in enumerate(self.kinds) if kind == CHAT)

  @property
  def preference_names(self) -> tuple[str, ...]:
    """Names of the sources holding preference pairs."""
    return tuple(s.name for s, kind in zip(self.specs, self.kinds) if kind == PREFERENCE)

  @property
  def has_chat(self) -> bool:
    return CHAT in self.kinds

  @property
  def has_preference(self) -> bool:
    return PREFERENCE in self.kinds

  @property
  def denoisers(self) -> dict[str, float]:
    """data.objective_mixture as {denoiser: weight} (empty without one)."""
    return dict(self.objective_mixture)

  def open(self) -> list[sources_lib.Source]:
    """Fresh Source objects, one per spec. Each stage opens its own: a source's file handles and caches are not
    shared between the training iterator's threads and an evaluation reading at the same time."""
    return [sources_lib.open_source(s, self.text_field, self.strict) for s in self.specs]


def parse(sources: str | Sequence[str], weights: Sequence[float] = ()) -> tuple[sources_lib.SourceSpec, ...]:
  """data.sources.parse_spec's specs, parsed once per distinct (sources, weights) in a process: the config checks
  (data/config_checks.py, run by configs.validate) and a run's set-up read the same spec. ValueError as parse_spec."""
  try:
    return _parse_once(sources, tuple(weights))
  except TypeError:  # an unhashable spec (a list of items): parsed on every call
    return tuple(sources_lib.parse_spec(sources, tuple(weights)))


@functools.lru_cache(maxsize=64)
def _parse_once(sources, weights: tuple[float, ...]) -> tuple[sources_lib.SourceSpec, ...]:
  return tuple(sources_lib.parse_spec(sources, weights))  # SourceSpecs are frozen: sharing them is safe


def resolve_spec(sources: str | Sequence[str], weights: Sequence[float] = (), *, eval_fraction: float = 0.0,
                 text_field: str = "text", strict: bool = False, objective_mixture: str = "") -> DataPlan:
  """The DataPlan of a mixture spec (data/sources.py's syntax). ValueError naming the key for a bad spec."""
  specs = parse(sources, weights)
  kinds = tuple(PREFERENCE if sources_lib.is_preference_source(s) else CHAT if sources_lib.is_chat_source(s)
                else TEXT for s in specs)
  mixture = tuple(denoise_lib.parse_mixture(objective_mixture).items()) if objective_mixture else ()
  return DataPlan(specs, kinds, float(eval_fraction), text_field, bool(strict), mixture)


def resolve(data_config) -> DataPlan:
  """The DataPlan of `config.data`: its sources, weights, eval_fraction, text_field, strict and
  objective_mixture. ValueError (data.sources.SpecError for the mixture) naming the key when one is bad."""
  return resolve_spec(data_config.sources, tuple(data_config.weights), eval_fraction=data_config.eval_fraction,
                      text_field=data_config.text_field, strict=data_config.strict,
                      objective_mixture=data_config.objective_mixture)
