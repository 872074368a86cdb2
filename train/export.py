"""`python -m train.export --workdir RUN [--step N] --output DIR`: a run's checkpoint as a Hugging Face directory.

Writes config.json + model.safetensors (`model.hf.save`), the run's tokenizer as tokenizer.json +
tokenizer_config.json + special_tokens_map.json (`data.hf_tokenizer`, BOS added by default as Llama's tokenizer
does) and the SentencePiece tokenizer.model, so `transformers.AutoModelForCausalLM` / `AutoTokenizer` and
lm-evaluation-harness's `hf` backend load the model with meshlm's logits and token ids.
Exit codes: 0 written, 2 bad arguments or run directory (nothing written).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Sequence


def export(workdir: str, output: str, step: int | None = None) -> str:
  """Writes the Hugging Face directory `output` for `workdir`'s checkpoint `step` (default latest); returns it."""
  from data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  from model import hf  # pylint: disable=g-import-not-at-top
  from train import restore  # pylint: disable=g-import-not-at-top
  run = restore.load_run(workdir, step, mesh_overrides={"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1,
                                                         "dcn_data": 1, "dcn_fsdp": 1, "expert": 1, "stage": 1})
  os.makedirs(output, exist_ok=True)
  hf.save(run.model, output)
  hf_tokenizer.write(run.tokenizer_path, output, model_max_length=run.config.model.max_seq_len)
  shutil.copyfile(run.tokenizer_path, os.path.join(output, "tokenizer.model"))
  from data import chat  # pylint: disable=g-import-not-at-top
  chat.write_chat_template(output, run.chat_template or chat.MESHLM_JINJA)  # generation renders chats alike
  return output


def main(argv: Sequence[str] | None = None) -> int:
  from train.__main__ import _default_platform  # pylint: disable=g-import-not-at-top
  _default_platform()
  parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a meshlm run directory (or checkpoints/<step>)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--output", required=True, help="directory to write the Hugging Face files into")
  args = parser.parse_args(argv)
  from train import restore  # pylint: disable=g-import-not-at-top
  if os.path.exists(args.output) and not os.path.isdir(args.output):
    print(f"error: --output {args.output} exists and is not a directory", file=sys.stderr)
    return 2
  try:
    out = export(args.workdir, args.output, args.step)
  except (restore.RunError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out} (step {args.step if args.step is not None else 'latest'} of {args.workdir})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
