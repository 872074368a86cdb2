"""The application layer: each `python -m train.NAME` command is a thin module here; the work lives in
`core/` (Trainer, step, loop), `objectives/`, `rl/`, `planning/` and `rundir/` (tools that open a run directory).
Importing the package registers its config checks and the data package's (config_checks.py) with configs.validate,
so every command's `configs.parse` runs them."""
from train import config_checks as _config_checks  # noqa: F401  pylint: disable=unused-import
