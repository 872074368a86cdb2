"""Config files and `--config.SECTION.KEY=VALUE` overrides, shared by every meshlm command (`configs.load`, `configs.parse`).

`python -m train`, `python -m train.plan` and `python -m train.compile` all take
`--config=FILE` (a path, or a name under configs/ such as `tiny` or `llama2_7b`) and any number of overrides.
Unknown keys and ill-typed values fail before anything runs, with a message naming the key.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
from typing import Sequence

import ml_collections

from configs import validate
from configs.errors import ConfigError

DEFAULT_CONFIG = "tiny"
_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def resolve_config_path(name_or_path: str) -> str:
  """`tiny`, `configs/tiny.py` or an absolute path -> an existing file path."""
  candidates = [name_or_path]
  if not name_or_path.endswith(".py"):
    candidates.append(os.path.join(_CONFIG_DIR, name_or_path + ".py"))
  candidates.append(os.path.join(_CONFIG_DIR, os.path.basename(name_or_path)))
  for path in candidates:
    if os.path.isfile(path):
      return os.path.abspath(path)
  raise ConfigError(f"config file {name_or_path!r} not found; give a path or one of: {', '.join(config_names())}")


def config_names() -> list[str]:
  """The config files under configs/ by name: the public modules that define `get_config()` (not this loader,
  the validators or private `_` helpers such as `_maxtext`)."""
  names = []
  for f in sorted(os.listdir(_CONFIG_DIR)):
    if f.endswith(".py") and not f.startswith("_") and _defines_get_config(os.path.join(_CONFIG_DIR, f)):
      names.append(f[:-3])
  return names


def _defines_get_config(path: str) -> bool:
  # Read, not imported: listing the configs must not run them (nor import the model they build on).
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  return any(isinstance(node, ast.FunctionDef) and node.name == "get_config" for node in tree.body)


def load_config_file(name_or_path: str) -> ml_collections.ConfigDict:
  """Imports the file and returns its locked `get_config()`."""
  path = resolve_config_path(name_or_path)
  spec = importlib.util.spec_from_file_location(f"_meshlm_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path} has no get_config() function")
  config = module.get_config()
  config.lock()
  return config


def _parse_value(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # bare strings need no quotes: --config.model.dtype=bfloat16


def apply_override(config: ml_collections.ConfigDict, dotted_key: str, text: str) -> None:
  """Sets config[dotted_key] from its command-line text, refusing unknown keys and wrong types."""
  parts = dotted_key.split(".")
  node = config
  for i, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(part, known, n=1)
      hint = f" (did you mean {'.'.join(parts[:i] + close)!r}?)" if close else ""
      where = ".".join(parts[:i]) or "the config"
      raise ConfigError(f"unknown config key {dotted_key!r}: {where} has no key {part!r}{hint}")
    if i < len(parts) - 1:
      node = node[part]
  old = node[parts[-1]]
  value = _parse_value(text)
  if isinstance(old, bool):
    if isinstance(value, str) and value.lower() in ("true", "false"):
      value = value.lower() == "true"
    if not isinstance(value, bool):
      raise ConfigError(f"config key {dotted_key!r} is a bool; got {text!r} (use true/false)")
  elif isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  elif isinstance(old, str) and not isinstance(value, str):
    value = text
  elif isinstance(old, tuple) and isinstance(value, list):
    value = tuple(value)
  elif isinstance(old, tuple) and not isinstance(value, tuple):
    value = (value,)
  if old is not None and not isinstance(value, type(old)) and not (isinstance(old, tuple)):
    raise ConfigError(
        f"config key {dotted_key!r} expects {type(old).__name__} (default {old!r}); got {text!r}")
  try:
    node[parts[-1]] = value
  except (TypeError, AttributeError, KeyError) as e:
    raise ConfigError(f"cannot set {dotted_key!r} to {text!r}: {e}") from None


def add_config_args(parser: argparse.ArgumentParser, default: str = DEFAULT_CONFIG) -> None:
  parser.add_argument("--config", default=default,
                      help="config file path or name under configs/ (default: %(default)s)")


def split_overrides(rest: Sequence[str], example: str = "--config.train.steps=100") -> list[tuple[str, str]]:
  """`--config.A.B=V` / `--config.A.B V` arguments -> [("A.B", "V")] in order; ConfigError for anything else."""
  overrides: list[tuple[str, str]] = []
  i = 0
  while i < len(rest):
    arg = rest[i]
    if not arg.startswith("--config."):
      raise ConfigError(f"unrecognised argument {arg!r}; overrides look like {example}")
    key, eq, value = arg[len("--config."):].partition("=")
    if not eq:
      if i + 1 >= len(rest):
        raise ConfigError(f"override {arg!r} has no value")
      value = rest[i + 1]
      i += 1
    overrides.append((key, value))
    i += 1
  return overrides


def parse(argv: Sequence[str] | None, parser: argparse.ArgumentParser,
          default: str = DEFAULT_CONFIG) -> tuple[ml_collections.ConfigDict, argparse.Namespace]:
  """Parses `argv` (without the program name): returns (config with overrides applied, other args).

  `parser` holds the command's own flags; `--config` is added here. Overrides are `--config.A.B=V` or
  `--config.A.B V`; their dotted keys, in command-line order, are in `args.overrides` (a value given explicitly
  can then be told from one that came from the config file). Values are checked by configs/validate.py: ranges,
  the model's own validation, every package's registered validator and the conditional keys (`validate.check`).
  Raises ConfigError (the CLIs print it and exit 2).
  """
  add_config_args(parser, default)
  known, rest = parser.parse_known_args(argv)
  overrides = split_overrides(rest)
  config = load_config_file(known.config)
  for key, value in overrides:
    apply_override(config, key, value)
  known.overrides = [key for key, _ in overrides]
  validate.check(config, known.overrides)  # its warnings are printed by the command that runs (train/core/setup.py)
  return config, known


def load(name_or_path: str = DEFAULT_CONFIG, **overrides) -> ml_collections.ConfigDict:
  """Programmatic form for tests and scripts: load('tiny', **{'train.steps': '5'}) or with typed values."""
  config = load_config_file(name_or_path)
  for key, value in overrides.items():
    apply_override(config, key, value if isinstance(value, str) else repr(value))
  return config
