"""The application layer: each `python -m train.NAME` command is a thin module here; the work lives in
`core/` (Trainer, step, loop), `objectives/`, `rl/`, `planning/` and `rundir/` (tools that open a run directory)."""
