"""Exporting a LoRA run: the adapters merged into the weights, or a PEFT adapter directory next to the base model.

`save_peft(trainer, state, directory, base_model_path)` writes `adapter_config.json` + `adapter_model.safetensors`
in PEFT's LoRA layout (lora_A = A^T [r, in], lora_B = B^T [out, r], scaling lora_alpha / r, or / sqrt(r) with use_rslora), which
`peft.PeftModel.from_pretrained(base, directory)` loads onto the base model written by `save_base`.
`save_merged` writes one Hugging Face directory whose weights are W + (alpha / r) A @ B.

Command line: `python -m train.adapters --workdir RUN [--step N] --output DIR` writes DIR/base (the frozen base
model, Hugging Face format), DIR/adapter (PEFT) and DIR/merged (adapters merged). base/ and merged/ carry the
run's tokenizer and chat template as `python -m train.export` writes them (`export.write_tokenizer`), so
transformers' AutoModelForCausalLM / AutoTokenizer and meshlm's `--hf` commands (train.generate, train.evaluate)
load them as they are.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

# meshlm projection -> the module name PEFT targets in a Hugging Face Llama/Mistral block
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def _check_lora(trainer) -> None:
  if not trainer.lora_rank:
    raise ValueError("this run has no LoRA adapters (train.lora_rank=0); export it with model.hf.save / "
                     "python -m train.export")


def _check_peft(trainer) -> None:
  """ValueError unless every adapter sits on a dense block's projection (what HF_MODULES names for PEFT)."""
  from model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  adapted = lora_lib.kernels(trainer.abstract_model_params(), trainer.lora_targets)
  # a target's first parent is its dense block's (attn, mlp): the modules HF_MODULES names
  other = sorted("/".join(map(str, p)) for p in adapted if p[-2] != lora_lib.TARGETS[p[-1]][0][0])
  if other:
    raise ValueError(f"PEFT export names dense projections only; this run also adapts {', '.join(other[:3])} (MoE "
                     "experts); use the merged export (DIR/merged) or train.lora_targets without gate/up/down")


def save_base(trainer, state: dict[str, Any], directory: str) -> None:
  """The frozen base model (the weights the adapters apply to) as a Hugging Face directory."""
  from model import hf  # pylint: disable=g-import-not-at-top
  _check_lora(trainer)
  hf.save(trainer._merge(trainer.base_params(state["frozen"]["model"])), directory)  # pylint: disable=protected-access


def save_merged(trainer, state: dict[str, Any], directory: str) -> None:
  """The adapted model, adapters merged into the weights, as a Hugging Face directory."""
  from model import hf  # pylint: disable=g-import-not-at-top
  hf.save(trainer.model(state), directory)


def peft_tensors(adapters: dict, num_layers: int) -> dict[str, np.ndarray]:
  """PEFT state-dict names -> float32 arrays for meshlm adapters (scanned or per-layer trees)."""
  import jax  # pylint: disable=g-import-not-at-top
  from model import lora as lora_lib  # pylint: disable=g-import-not-at-top
  layers = adapters["layers"]
  per_layer = ([jax.tree.map(lambda x, i=i: x[i], layers) for i in range(num_layers)]
               if not all(isinstance(k, int) for k in layers) else [layers[i] for i in range(num_layers)])
  out = {}
  for i, block in enumerate(per_layer):
    for path, ab in lora_lib._walk_adapters(block):  # pylint: disable=protected-access
      target = path[-1]
      a, b = np.asarray(jax.device_get(ab["a"]), np.float32), np.asarray(jax.device_get(ab["b"]), np.float32)
      rank = a.shape[-1]
      prefix = f"base_model.model.model.layers.{i}.{HF_MODULES[target]}"
      out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)
      out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)
  return out


def save_peft(trainer, state: dict[str, Any], directory: str, base_model_path: str = "") -> None:
  """adapter_config.json + adapter_model.safetensors (PEFT LoRA) for `state`'s adapters."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  _check_lora(trainer)
  _check_peft(trainer)
  os.makedirs(directory, exist_ok=True)
  t = trainer.config.train
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": trainer.lora_rank, "lora_alpha": float(t.lora_alpha),
            "target_modules": sorted(HF_MODULES[x].split(".")[1] for x in trainer.lora_targets),
            "lora_dropout": float(t.lora_dropout), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": bool(t.lora_rslora),
            "inference_mode": True, "base_model_name_or_path": base_model_path, "modules_to_save": None}
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  save_file(peft_tensors(state["params"]["lora"], trainer.config.model.num_layers),
            os.path.join(directory, "adapter_model.safetensors"))


def main(argv=None) -> int:
  """`python -m train.adapters --workdir RUN --output DIR [--step N]` (module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m train.adapters", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a run trained with train.lora_rank > 0")
  parser.add_argument("--output", required=True, help="directory for base/, adapter/ and merged/")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  args = parser.parse_args(argv)
  from train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  train_main._default_platform()  # pylint: disable=protected-access
  import jax  # pylint: disable=g-import-not-at-top
  import configs  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.core import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import export as export_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top
  try:
    directory, _ = ckpt_lib.find_checkpoint_dir(args.workdir)
    checkpointer = ckpt_lib.Checkpointer(directory, read_only=True)
    meta = checkpointer.metadata(args.step)
  except ckpt_lib.CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    config = runconfig.from_saved(meta["config"])
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  config.mesh.update(data=1, fsdp=1, tensor=1, sequence=1, dcn_data=1, dcn_fsdp=1)
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
  try:
    _check_lora(trainer)
    tokenizer = restore.tokenizer_file(args.workdir, config, meta)  # before writing anything
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  state, _ = checkpointer.restore(trainer.abstract_state(), step=args.step)
  base, merged = os.path.join(args.output, "base"), os.path.join(args.output, "merged")
  save_base(trainer, state, base)
  try:
    save_peft(trainer, state, os.path.join(args.output, "adapter"), os.path.abspath(base))
    adapter = f", {os.path.join(args.output, 'adapter')} (PEFT)"
  except ValueError as e:  # adapters on MoE experts: PEFT has no names for them; base and merged still hold
    print(f"warning: no PEFT adapter written: {e}", file=sys.stderr)
    adapter = ""
  save_merged(trainer, state, merged)
  for directory in (base, merged):  # both are models: each carries the tokenizer, as train.export writes it
    export_lib.write_tokenizer(directory, tokenizer, config, meta)
  print(f"wrote {base}{adapter} and {merged}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
