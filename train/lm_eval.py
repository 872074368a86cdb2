"""lm-evaluation-harness with meshlm as a model backend: `python -m train.lm_eval --model meshlm --model_args
workdir=RUN[,step=N][,mesh=data=1;fsdp=-1] --tasks hellaswag ...` (every other argument is lm_eval's own).

lm-eval 0.4.13 resolves `--model NAME` in its internal registry and reads no plugin entry points, so a plain
`lm_eval --model meshlm` cannot see an installed package's backend; this program registers `meshlm` (and
`meshlm-hf` for `hf=DIR`: both accept workdir= or hf=) and then runs lm-eval's own command line. In Python:
`import train.lm_eval` registers it for `lm_eval.simple_evaluate(model="meshlm", model_args=...)`.
"""
from __future__ import annotations

import sys


def _register():
  import lm_eval.models  # noqa: F401  (fills lm-eval's registry first: it only self-loads when empty)
  from lm_eval.api.registry import model_registry, register_model  # pylint: disable=g-import-not-at-top
  from evals.lm_eval_backend import MeshLMHarness  # pylint: disable=g-import-not-at-top

  class MeshLMFromRun(MeshLMHarness):
    """`workdir=RUN` (a meshlm run, `step=N` optional) or `hf=DIR`; `mesh=data=1;fsdp=-1`; lm-eval's
    `batch_size` (an integer; "auto" means 16)."""

    def __init__(self, workdir: str = "", hf: str = "", step: int | None = None, mesh: str = "",
                 batch_size: int | str | None = 16, **unused):
      del unused  # device, max_batch_size, ...: the mesh decides placement
      import evals  # pylint: disable=g-import-not-at-top
      from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
      from train.rundir import restore  # pylint: disable=g-import-not-at-top
      if bool(workdir) == bool(hf):
        raise ValueError("meshlm model_args need exactly one of workdir=RUN or hf=DIR")
      mesh_overrides = {k: int(v) for k, v in (kv.split("=") for kv in mesh.split(";") if kv)} or None
      size = int(batch_size) if str(batch_size or "").isdigit() else 16
      if workdir:
        run = restore.load_run(workdir, int(step) if step is not None else None, mesh_overrides)
        tok = tokenizer_lib.Tokenizer.load(run.tokenizer_path)
        specials = {p: tok.special_id(p) for p in tokenizer_lib.RESERVED}
        lm = evals.LM(run.model, tok, run.mesh, run.rules, batch_size=size, specials=specials)
      else:
        model, tok, mesh_, rules = restore.load_hf(hf, mesh_overrides)
        lm = evals.LM(model, tok, mesh_, rules, batch_size=size)  # tokenizer.json matches specials itself
      super().__init__(lm, name=workdir or hf)

  if "meshlm" not in model_registry:
    register_model("meshlm", "meshlm-hf")(MeshLMFromRun)
  return model_registry.get("meshlm")


from train.__main__ import _default_platform  # noqa: E402

_default_platform()  # before JAX is imported (by the backend), as every meshlm command does
MeshLMFromRun = None  # set on import below (lm-eval is an optional dependency)
try:
  MeshLMFromRun = _register()
except ImportError:  # lm-eval not installed: main() says how to install it
  pass


def main(argv=None) -> int:
  if MeshLMFromRun is None:
    print("error: lm-evaluation-harness is not installed: pip install -c constraints.txt -e '.[eval]'",
          file=sys.stderr)
    return 2
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
  sys.argv = ["lm_eval"] + list(sys.argv[1:] if argv is None else argv)
  cli_evaluate()
  return 0


if __name__ == "__main__":
  sys.exit(main())
