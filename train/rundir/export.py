"""`python -m train.export --workdir RUN [--step N] --output DIR [--dtype D] [--max_shard_size S]`: a run's
checkpoint as a Hugging Face directory.

Writes config.json + model.safetensors, or Hugging Face's sharded layout (model-0000k-of-0000n.safetensors +
model.safetensors.index.json) when the weights exceed --max_shard_size (`model.hf.save`), the run's tokenizer as
tokenizer.json + tokenizer_config.json + special_tokens_map.json (`data.hf_tokenizer`, BOS added by default as
Llama's tokenizer does) and the SentencePiece tokenizer.model, so `transformers.AutoModelForCausalLM` /
`AutoTokenizer` and lm-evaluation-harness's `hf` backend load the model with meshlm's logits and token ids. A run
started from a Hugging Face model's directory writes that family back (`model.hf.family_of`) with the tokenizer
files it trained with (tokenizer.json ...) copied as they are.
The checkpoint is read one parameter at a time through orbax onto this host's first device, whatever mesh it was
trained on, so a model that fits on disk exports on one CPU host.
Exit codes: 0 written, 2 bad arguments or run directory (nothing written).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Sequence


def _nested(path: tuple, leaf: Any) -> dict:
  for key in reversed(path):
    leaf = {key: leaf}
  return leaf


def export(workdir: str, output: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: int | str = "5GB") -> tuple[str, int]:
  """Writes the Hugging Face directory `output` for `workdir`'s checkpoint `step` (default latest); returns
  (output, the step written).

  dtype: stored dtype (default: the run's param_dtype); max_shard_size: bytes per weight file (int or "5GB").
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import Transformer  # pylint: disable=g-import-not-at-top
  from model import hf  # pylint: disable=g-import-not-at-top
  from train.core import loop  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  checkpointer, step, meta = restore.open_checkpoint(workdir, step)
  config = runconfig.from_saved(meta["config"])
  model = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))  # shapes only
  shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  device = jax.local_devices()[0]
  here = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("host",)), jax.sharding.PartitionSpec())

  def restore_one(path):
    """One parameter (a LoRA run's with its adapter merged), restored alone from the checkpoint."""
    leaf = shapes
    for key in path:
      leaf = leaf[key]
    wanted = _nested(path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here))
    value = loop.restore_model_params(checkpointer, step, wanted)
    for key in path:
      value = value[key]
    return value

  tokenizer = restore.tokenizer_file(workdir, config, meta)
  os.makedirs(output, exist_ok=True)
  try:
    hf.save(model, output, dtype=dtype, max_shard_size=max_shard_size, values=restore_one)
  finally:
    checkpointer.close()
  write_tokenizer(output, tokenizer, config, meta)
  return output, step


def write_tokenizer(directory: str, tokenizer: str, config, meta: dict[str, Any]) -> None:
  """Gives the Hugging Face model directory `directory` the run's tokenizer, as every directory meshlm writes as a
  model carries it (this export, and train.adapters' base/ and merged/): tokenizer.json + tokenizer_config.json +
  special_tokens_map.json (`data.hf_tokenizer`, for transformers' AutoTokenizer), the SentencePiece
  tokenizer.model (for meshlm's own --hf commands), and the run's chat template (the checkpoint metadata's, else
  meshlm's) in tokenizer_config.json, so transformers renders chats as the run was trained.

  A run that trained with a Hugging Face tokenizer directory (started from a Hugging Face model's tokenizer.json)
  gets that directory's tokenizer files copied as they are, with the run's chat template when it had chat data.

  tokenizer: the run's SentencePiece file or Hugging Face tokenizer directory (`restore.tokenizer_file`); config:
  the run's config; meta: the checkpoint's metadata.
  """
  from data import chat  # pylint: disable=g-import-not-at-top
  from data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
  from train.core import loop  # pylint: disable=g-import-not-at-top
  write_generation_config(directory, tokenizer, config, meta)
  if os.path.isdir(tokenizer):
    for name in hf_tokenizer_load.FILES:
      if os.path.isfile(os.path.join(tokenizer, name)):
        shutil.copyfile(os.path.join(tokenizer, name), os.path.join(directory, name))
    if meta.get(loop.CHAT_TEMPLATE_KEY):  # else the tokenizer's own template (meshlm's needs meshlm's tokens)
      chat.write_chat_template(directory, meta[loop.CHAT_TEMPLATE_KEY])
    return
  hf_tokenizer.write(tokenizer, directory, model_max_length=config.model.max_seq_len)
  shutil.copyfile(tokenizer, os.path.join(directory, "tokenizer.model"))
  chat.write_chat_template(directory, meta.get(loop.CHAT_TEMPLATE_KEY) or chat.MESHLM_JINJA)


def write_generation_config(directory: str, tokenizer: str, config, meta: dict[str, Any]) -> None:
  """generation_config.json: transformers' `generate` stops where meshlm's chat does, at the run's chat template's
  end-of-turn id as well as EOS (`eos_token_id` lists both), and starts prompts with BOS."""
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from train.core import loop  # pylint: disable=g-import-not-at-top
  from train.rundir import chat as run_chat  # pylint: disable=g-import-not-at-top
  tok = tokenizer_lib.load(tokenizer)
  stops = list(dict.fromkeys(int(i) for i in run_chat.template_for_run(config, tok, meta.get(loop.CHAT_TEMPLATE_KEY))
                             .stop_ids()))
  body = {"bos_token_id": int(tok.bos_id), "eos_token_id": stops if len(stops) > 1 else stops[0],
          "pad_token_id": int(getattr(tok, "pad_id", 0))}
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump(body, f, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
  from train.__main__ import _default_platform  # pylint: disable=g-import-not-at-top
  _default_platform()
  parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a meshlm run directory (or checkpoints/<step>)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--output", required=True, help="directory to write the Hugging Face files into")
  parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                      help="stored weight dtype (default: the run's model.param_dtype)")
  parser.add_argument("--max_shard_size", default="5GB",
                      help="largest weight file, e.g. 5GB, 500MB (larger models are split over several files)")
  args = parser.parse_args(argv)
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  if os.path.exists(args.output) and not os.path.isdir(args.output):
    print(f"error: --output {args.output} exists and is not a directory", file=sys.stderr)
    return 2
  from model import safetensors_io  # pylint: disable=g-import-not-at-top
  try:
    safetensors_io.parse_size(args.max_shard_size)
  except ValueError as e:
    print(f"error: --max_shard_size: {e}", file=sys.stderr)
    return 2
  try:
    out, step = export(args.workdir, args.output, args.step, args.dtype, args.max_shard_size)
  except (restore.RunError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}: step {step} of {args.workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
