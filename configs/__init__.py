"""Config files: `base.py` (every key, its default and a comment), `tiny.py`, presets and recipes.

`configs.load` / `configs.parse` read a config file and apply `--config.SECTION.KEY=VALUE` overrides; every
command-line program (training, curation, planning, compilation, generation, evaluation) uses them.
"""
from configs.loader import (DEFAULT_CONFIG, ConfigError, add_config_args, apply_override, load,
                            load_config_file, parse, resolve_config_path)
from configs import validate

__all__ = ["DEFAULT_CONFIG", "ConfigError", "add_config_args", "apply_override", "load", "load_config_file",
           "parse", "resolve_config_path", "validate"]
