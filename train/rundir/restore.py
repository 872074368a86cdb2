"""Opens a run directory for inference: its config, a checkpoint's parameters on a mesh, and its tokenizer.

`load_run(workdir, step=None)` -> Run(config, model, tokenizer_path, mesh, rules, step). The model is a
`model.Transformer` holding the checkpoint's parameters sharded by the run's logical-axis rules on `mesh` (the
run's `config.mesh`, or `mesh_overrides` such as {"data": 1, "fsdp": -1}; -1 = the remaining devices).
`load_hf(directory)` does the same for a Hugging Face directory (model.hf.load) with its tokenizer.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any, Mapping

import jax
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import parallel
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from train.core import checkpoint as ckpt_lib

TOKENIZER_KEY = "tokenizer"  # the checkpoint metadata entry holding the tokenizer file (train/core/loop.py)


class RunError(ValueError):
  """The run directory or checkpoint cannot be opened; the message names the path and the fix."""


@dataclasses.dataclass
class Run:
  config: ml_collections.ConfigDict
  model: Any
  tokenizer_path: str
  mesh: jax.sharding.Mesh
  rules: tuple
  step: int | None
  chat_template: str | None = None  # the Jinja template a chat run trained with (exports write it)


def _inference_config(config_dict: Mapping[str, Any], mesh_overrides: Mapping[str, int] | None):
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  try:
    config = runconfig.from_saved(dict(config_dict))
  except ValueError as e:
    raise RunError(str(e)) from None
  if mesh_overrides:
    for key, value in mesh_overrides.items():
      if key not in config.mesh:
        raise RunError(f"unknown mesh axis {key!r}; axes: {', '.join(k for k in config.mesh if k != 'rules')}")
      config.mesh[key] = int(value)
  return config


def _mesh_and_rules(config: ml_collections.ConfigDict) -> tuple[jax.sharding.Mesh, tuple]:
  """The mesh of config.mesh and the logical-axis rules fitted to config.model (RunError naming the problem)."""
  try:
    mesh = mesh_lib.make_mesh(config.mesh)
  except ValueError as e:
    raise RunError(f"{e} (pass --mesh to choose another layout, e.g. --mesh data=-1)") from None
  rules = tuple(rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), config.model, mesh))
  return mesh, rules


def place(model, config: ml_collections.ConfigDict, mesh_overrides: Mapping[str, int] | None = None):
  """(model with its parameters sharded on a mesh built from config.mesh, mesh, rules)."""
  mesh, rules = _mesh_and_rules(config)
  from model import Transformer  # pylint: disable=g-import-not-at-top
  with parallel.activate(mesh, rules):
    abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(abstract))
  graphdef, state = nnx.split(model)
  # Plain dicts on both sides: a model made outside a mesh (model.hf.load) carries other Variable metadata than
  # the abstract one, and device_put wants the two trees to match exactly.
  shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), nnx.to_pure_dict(specs),
                           is_leaf=lambda x: isinstance(x, PartitionSpec))
  nnx.replace_by_pure_dict(state, jax.device_put(nnx.to_pure_dict(state), shardings))
  return nnx.merge(graphdef, state), mesh, rules


def open_checkpoint(workdir: str, step: int | None = None) -> tuple[ckpt_lib.Checkpointer, int, dict[str, Any]]:
  """(read-only checkpointer, step, metadata) of `workdir`'s checkpoint `step` (default: the latest); RunError
  naming the path and the fix when there is none."""
  if not os.path.isdir(workdir):
    raise RunError(f"--workdir {workdir!r} is not a directory; give a meshlm run directory (python -m train)")
  try:
    directory, found = ckpt_lib.find_checkpoint_dir(workdir)
    checkpointer = ckpt_lib.Checkpointer(directory, read_only=True)
    step = step if step is not None else (found if found is not None else checkpointer.latest_step())
    if step is None:
      raise RunError(f"{directory}: no complete checkpoint; train first (python -m train --workdir {workdir})")
    return checkpointer, step, checkpointer.metadata(step)
  except ckpt_lib.CheckpointError as e:
    raise RunError(str(e)) from None


def load_run(workdir: str, step: int | None = None, mesh_overrides: Mapping[str, int] | None = None,
             max_seq_len: int | None = None) -> Run:
  """The run's model at checkpoint `step` (default: the latest), placed on the mesh; see the module docstring.
  `max_seq_len` above the run's raises model.max_seq_len (a bound on generation, not part of the function the
  weights compute): evaluation beyond the length a model was trained on."""
  checkpointer, step, meta = open_checkpoint(workdir, step)
  config = _inference_config(meta["config"], mesh_overrides)
  if max_seq_len and max_seq_len > config.model.max_seq_len:
    config.model.max_seq_len = int(max_seq_len)
  from model import Transformer  # pylint: disable=g-import-not-at-top
  abstract_model = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract_model)
  mesh, rules = _mesh_and_rules(config)
  with parallel.activate(mesh, rules):
    specs = nnx.get_partition_spec(nnx.state(nnx.eval_shape(lambda: Transformer(config.model,
                                                                                 rngs=nnx.Rngs(0)))))
  abstract_params = jax.tree.map(
      lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p)),
      nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(specs),
      is_leaf=lambda x: isinstance(x, PartitionSpec))
  from train.core import loop  # pylint: disable=g-import-not-at-top
  params = loop.restore_model_params(checkpointer, step, abstract_params)  # LoRA runs: adapters merged
  nnx.replace_by_pure_dict(abstract_state, params)
  model = nnx.merge(graphdef, abstract_state)
  return Run(config, model, tokenizer_file(workdir, config, meta), mesh, rules, step,
             meta.get(loop.CHAT_TEMPLATE_KEY))


def tokenizer_file(workdir: str, config, meta: Mapping[str, Any]) -> str:
  """The run's SentencePiece model (config.data.tokenizer, WORKDIR/tokenizer.model, or the checkpoint's copy), or
  the Hugging Face tokenizer directory it trained with (a run started from a Hugging Face model's tokenizer.json;
  the checkpoint records its path)."""
  from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
  candidates = [config.data.tokenizer] if config.data.get("tokenizer") else []
  run_dir = workdir if os.path.isdir(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)) else None
  if run_dir:
    candidates.append(os.path.join(run_dir, "tokenizer.model"))
  for path in candidates:
    if path and (os.path.isfile(path) or hf_tokenizer_load.is_hf_dir(path)):
      return path
  entry = meta.get(TOKENIZER_KEY)
  if entry and "directory" in entry and hf_tokenizer_load.is_hf_dir(entry["directory"]):
    return entry["directory"]
  if not entry or "base64" not in entry:
    raise RunError(f"no tokenizer for {workdir}: neither {' nor '.join(candidates) or 'a file'} exists nor does "
                   "the checkpoint hold one")
  return ckpt_lib.decode_file(entry, tempfile.mkdtemp(prefix="meshlm-tokenizer-"))


def load_hf(directory: str, mesh_config: Mapping[str, int] | None = None):
  """(model, tokenizer, mesh, rules) for a Hugging Face directory with config.json, safetensors, tokenizer.json."""
  from configs import base  # pylint: disable=g-import-not-at-top
  from data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  from model import hf  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(os.path.join(directory, "config.json")):
    raise RunError(f"--hf {directory!r} holds no config.json; give a Hugging Face model directory")
  config = base.get_config()
  try:
    with open(os.path.join(directory, "config.json")) as f:
      config.model = hf.config_from_hf(json.load(f))
    config = _inference_config(config.to_dict(), mesh_config)
    mesh, rules = _mesh_and_rules(config)
    model = hf.load(directory, mesh=mesh, rules=rules)  # each device reads its own blocks of the weights
  except ValueError as e:
    raise RunError(str(e)) from None
  return model, hf_tokenizer.HFTokenizer(directory), mesh, rules
