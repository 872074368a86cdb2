"""`ConfigError`, the one exception of config loading and checking (its own module: configs/loader.py and
configs/validate.py both raise it and neither imports the other for it)."""


class ConfigError(ValueError):
  """A config file or override that cannot be applied; the message names the key and the fix."""
