"""`python -m train.generate`: text from a trained run or a Hugging Face directory (docs/generate.md).

    python -m train.generate --workdir RUN [--step N] --prompt "text" [--prompt ...] [--max_new_tokens 64]
        [--temperature 0] [--top_k 0] [--top_p 1.0] [--min_p 0] [--repetition_penalty 1.0] [--seed 0] [--sampler engine|static] [--json]
        [--config.mesh.data=2 ...]
    python -m train.generate --hf DIR --prompt "text"
    python -m train.generate --workdir RUN --chat      (user turns from stdin, one per line; train/rundir/chat.py)
    python -m train.generate --workdir RUN --prefix "def f(x):" --suffix "  return y"   (fill in the middle)

Each prompt is encoded as [BOS] + tokens (as training documents start) and continued until the tokenizer's EOS or
max_new_tokens. With --prefix/--suffix the prompt is the fill-in-the-middle prompt of data/fim.py (a run trained
with data.fim_rate > 0) and the continuation is the middle, printed between prefix and suffix. One prompt streams its tokens to the console as they come; several are printed when done.
`--json` prints {"completions": [...], "tokens_per_sec": ..., ...} instead (tokens/s of prefill + decode, compile
time excluded). The model runs on the mesh of `config.mesh` (the run's, changed with `--config.mesh.*`). Exit
codes: 0 done, 2 bad arguments or an unusable run/model directory (the message names it).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import Any, Sequence

import configs


class GenerateError(ValueError):
  """An argument, run directory or model directory that cannot be used; the message names it and the fix."""


def add_source_arguments(p: argparse.ArgumentParser) -> None:
  """--workdir RUN | --hf DIR and --step: where `load` reads the model (train.generate's and train.serve's)."""
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="meshlm run directory (holding checkpoints/)")
  src.add_argument("--hf", help="Hugging Face model directory (a family docs/hf.md lists) with its tokenizer")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m train.generate", description="Generate text from a meshlm run or a Hugging Face directory.",
      epilog="Mesh and model overrides: --config.SECTION.KEY=VALUE (e.g. --config.mesh.tensor=2). Exit codes: 0 "
             "done, 2 bad arguments or directory.")
  add_source_arguments(p)
  p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
  p.add_argument("--chat", action="store_true",
                 help="multi-turn chat: read one user turn per line from stdin, print each answer (the run's chat "
                      "template; greedy unless --temperature)")
  p.add_argument("--prefix", help="fill in the middle: the text before the gap (with --suffix)")
  p.add_argument("--suffix", help="fill in the middle: the text after the gap (with --prefix)")
  p.add_argument("--spm", action="store_true", help="fill in the middle with the suffix-prefix-middle prompt")
  p.add_argument("--max_new_tokens", type=int, default=64, help="most tokens generated per prompt")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
  p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1] (1 = off)")
  p.add_argument("--min_p", type=float, default=0.0,
                 help="keep tokens with probability >= min_p x the most likely one's, in [0, 1] (0 = off)")
  p.add_argument("--repetition_penalty", type=float, default=1.0,
                 help="> 0: divide the logits of tokens already in the prompt or output by it (multiply negative "
                      "ones); > 1 discourages repeats, also when greedy (1 = off)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--sampler", choices=("engine", "static"), default="engine",
                 help="engine: the continuous-batching engine over a paged cache (model/engine.py); static: "
                      "model.generate's one static batch (the same greedy tokens)")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
  return p


def _check_args(args) -> None:
  infill = args.prefix is not None or args.suffix is not None
  if bool(args.prompt) + bool(args.chat) + infill != 1:
    raise GenerateError("give one of --prompt (repeatable), --chat, or --prefix/--suffix (fill in the middle)")
  if args.max_new_tokens < 1:
    raise GenerateError(f"--max_new_tokens={args.max_new_tokens} must be >= 1")
  if not args.temperature >= 0:
    raise GenerateError(f"--temperature={args.temperature} must be >= 0 (0 = greedy)")
  if args.top_k < 0:
    raise GenerateError(f"--top_k={args.top_k} must be >= 0 (0 = off)")
  if not 0 < args.top_p <= 1:
    raise GenerateError(f"--top_p={args.top_p} must be in (0, 1] (1 = off)")
  if not 0 <= args.min_p <= 1:
    raise GenerateError(f"--min_p={args.min_p} must be in [0, 1] (0 = off)")
  if not 0 < args.repetition_penalty < float("inf"):
    raise GenerateError(f"--repetition_penalty={args.repetition_penalty} must be a finite number > 0 (1 = off)")
  if args.step is not None and args.hf:
    raise GenerateError("--step applies to --workdir runs only")
  if not (0 <= args.seed < 2**31):
    raise GenerateError(f"--seed={args.seed} must be in [0, 2^31)")


def _run_source(workdir: str, step: int | None):
  """(config, tokenizer, restore(abstract_params) -> params) of a meshlm run's checkpoint."""
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from train.core import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from train.core import loop  # pylint: disable=g-import-not-at-top
  from train.rundir import runconfig  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)):
    raise GenerateError(f"--workdir {workdir}: no meshlm run there (expected {workdir}/checkpoints/); train one with "
                        f"python -m train --workdir {workdir}")
  ck = ckpt_lib.Checkpointer(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR), read_only=True)
  steps = ck.all_steps()
  if not steps:
    raise GenerateError(f"--workdir {workdir}: no complete checkpoint yet; let python -m train save one")
  if step is not None and step not in steps:
    raise GenerateError(f"--step {step}: no such checkpoint in {workdir}; available steps: {steps}")
  step = steps[-1] if step is None else step
  meta = ck.metadata(step)
  if "config" not in meta or loop.TOKENIZER_KEY not in meta:
    raise GenerateError(f"checkpoint {workdir}/checkpoints/{step} lacks the config or tokenizer in its metadata "
                        "(not written by python -m train)")
  try:
    config = runconfig.from_saved(meta["config"])
  except configs.ConfigError as e:
    raise GenerateError(str(e)) from None
  tokenizer = tokenizer_lib.Tokenizer(base64.b64decode(meta[loop.TOKENIZER_KEY]["base64"]))

  def restore(abstract_params):
    return loop.restore_model_params(ck, step, abstract_params)  # a LoRA run's adapters come merged in

  return config, tokenizer, restore, meta.get(loop.CHAT_TEMPLATE_KEY)


def _hf_source(directory: str):
  """(config, tokenizer, restore, chat template) of a Hugging Face model directory of a family model.hf reads,
  with its tokenizer (tokenizer.json or tokenizer.model: the one tokenizer layer, data.tokenizer.load)."""
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from model import hf  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(os.path.join(directory, "config.json")):
    raise GenerateError(f"--hf {directory}: no config.json there (expected a Hugging Face model directory)")
  from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
  if not hf_tokenizer_load.is_hf_dir(directory):
    raise GenerateError(f"--hf {directory}: no tokenizer.json or tokenizer.model there; add the model's tokenizer "
                        "files")
  with open(os.path.join(directory, "config.json")) as f:
    model_cfg = hf.config_from_hf(json.load(f))
  config = configs.load_config_file("base")
  config.model.update(model_cfg)

  def restore(abstract_params):
    import jax  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from parallel import rules as rules_lib  # pylint: disable=g-import-not-at-top
    m = config.model
    mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh  # each device reads its own blocks of the weights
    rules = rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), m, mesh)
    loaded = hf.load(directory, dtype=m.param_dtype, compute_dtype=m.dtype, scan_layers=m.scan_layers, mesh=mesh,
                     rules=rules)
    params = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    return jax.device_put(params, jax.tree.map(lambda a: a.sharding, abstract_params))

  try:
    tokenizer = tokenizer_lib.load(directory)  # tokenizer.json or tokenizer.model, with its chat template
  except Exception as e:  # pylint: disable=broad-except  (tokenizers' and sentencepiece's own errors)
    raise GenerateError(f"--hf {directory}: its tokenizer does not load ({type(e).__name__}: {e})") from None
  return config, tokenizer, restore, tokenizer.chat_template  # the model's own Jinja chat template, for --chat


def _load_model(config, restore):
  """The Transformer with restored parameters sharded on config.mesh; returns (model, mesh, rules)."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  import model as model_lib  # pylint: disable=g-import-not-at-top
  import parallel  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib, rules as rules_lib  # pylint: disable=g-import-not-at-top

  mesh = mesh_lib.make_mesh(config.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), config.model, mesh)
  with parallel.activate(mesh, rules):
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(config.model, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
  shapes = nnx.to_pure_dict(abstract_params)
  rules_lib.check_divisible(specs, shapes, mesh)
  targets = jax.tree.map(lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p)),
                         shapes, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return nnx.merge(graphdef, restore(targets)), mesh, rules


def load(workdir: str | None, hf_dir: str | None, step: int | None = None,
         overrides: Sequence[tuple[str, str]] = ()):
  """(config, tokenizer, saved chat template or None, model, mesh, rules) of a run directory's checkpoint (the
  latest, or `step`) or a Hugging Face directory, the model's parameters sharded on config.mesh after the
  overrides [(dotted key, value)]. Raises GenerateError naming the directory and the fix."""
  if workdir:
    config, tokenizer, restore, chat_template = _run_source(os.path.abspath(workdir), step)
  else:
    config, tokenizer, restore, chat_template = _hf_source(os.path.abspath(hf_dir))
  for key, value in overrides:
    configs.apply_override(config, key, value)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise GenerateError(f"tokenizer has {tokenizer.vocab_size} pieces but the model only {config.model.vocab_size}")
  model, mesh, rules = _load_model(config, restore)
  return config, tokenizer, chat_template, model, mesh, rules


def _sample(args, model, prompts, stop_ids, on_ids):
  """model.generate.Generation of the prompts by --sampler's program; on_ids(new ids of prompt 0) as they come."""
  kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, stop_ids=stop_ids, seed=args.seed)
  if args.sampler == "engine":
    from model import engine as engine_lib  # pylint: disable=g-import-not-at-top
    return engine_lib.sample(model, prompts, args.max_new_tokens, **kwargs,
                             on_tokens=(lambda i, ids: on_ids(ids)) if on_ids else None)
  from model import generate as generate_lib  # pylint: disable=g-import-not-at-top

  def on_tokens(step, token_B, done_B):
    del step
    if not done_B[0]:
      on_ids([int(token_B[0])])

  return generate_lib.sample(model, prompts, args.max_new_tokens, **kwargs, on_tokens=on_tokens if on_ids else None)


def run(args, overrides: Sequence[tuple[str, str]]) -> dict[str, Any]:
  """Loads the model, generates, prints; returns the JSON summary. Raises GenerateError / ValueError."""
  import parallel  # pylint: disable=g-import-not-at-top
  from data import detokenize  # pylint: disable=g-import-not-at-top

  config, tokenizer, chat_template, model, mesh, rules = load(args.workdir, args.hf, args.step, overrides)
  if args.chat:
    from train.rundir import chat  # pylint: disable=g-import-not-at-top
    template = chat.template_for_run(config, tokenizer, chat_template)
    with parallel.activate(mesh, rules):
      messages = chat.converse(model, tokenizer, template, sys.stdin, lambda text: print(text, flush=True),
                               args.max_new_tokens, args.temperature, args.seed, args.sampler)
    return {"messages": messages}
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  infill = args.prefix is not None or args.suffix is not None
  if infill:
    from data import fim  # pylint: disable=g-import-not-at-top
    args.prompt = [args.prefix or ""]  # shown before the middle, as a prompt is before its continuation
    prompts = [tokenizer_lib.prompt_ids(tokenizer, fim.infill_prompt(tokenizer, args.prefix or "", args.suffix or "",
                                                                      args.spm))]
  else:
    prompts = [tokenizer_lib.prompt_ids(tokenizer, tokenizer.encode(text)) for text in args.prompt]

  for p in prompts:  # before the prompt is echoed: a refused run prints nothing but its error
    if len(p) + args.max_new_tokens > model.cfg.max_seq_len:
      raise GenerateError(f"prompt of {len(p)} tokens + max_new_tokens={args.max_new_tokens} exceeds "
                          f"model.max_seq_len={model.cfg.max_seq_len}; shorten the prompt or lower --max_new_tokens")
  stream = len(prompts) == 1 and not args.json
  detok = detokenize.Detokenizer(tokenizer)
  if stream:
    print(args.prompt[0], end="", flush=True)
  with parallel.activate(mesh, rules):
    out = _sample(args, model, prompts, (tokenizer.eos_id,),
                  (lambda ids: print(detok.push(ids), end="", flush=True)) if stream else None)
  if stream:
    print(detok.flush(), end="", flush=True)
  stats = out.stats
  seconds = stats["prefill_seconds"] + stats["decode_seconds"]
  summary = {
      "completions": [tokenizer.decode(t) for t in out.tokens],
      "tokens": out.tokens,
      "tokens_per_sec": stats["new_tokens"] / seconds if seconds > 0 else 0.0,
      "decode_tokens_per_sec": (stats["new_tokens"] - len(prompts)) / stats["decode_seconds"]
                               if stats["decode_seconds"] > 0 else 0.0,
      "new_tokens": stats["new_tokens"], "compile_seconds": stats["compile_seconds"],
  }
  if infill:
    summary["infilled"] = (args.prefix or "") + summary["completions"][0] + (args.suffix or "")
  if args.json:
    print(json.dumps(summary))
  else:
    if stream:
      print((args.suffix or "") if infill else "")
    else:
      for text, completion in zip(args.prompt, summary["completions"]):
        print(f"{text}{completion}\n")
    print(f"{stats['new_tokens']} tokens, {summary['tokens_per_sec']:.1f} tokens/s (compile "
          f"{stats['compile_seconds']:.1f} s excluded)", file=sys.stderr)
  return summary


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """(the command's own arguments, [(dotted key, value)] from --config.KEY=VALUE / --config.KEY VALUE)."""
  own, overrides, i = [], [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--config."):
      key, eq, value = arg[len("--config."):].partition("=")
      if not eq:
        if i + 1 >= len(argv):
          raise GenerateError(f"override {arg!r} has no value")
        value, i = argv[i + 1], i + 1
      overrides.append((key, value))
    elif arg == "--config" or arg.startswith("--config="):
      raise GenerateError("--config is not used here: the model config comes from the run or the Hugging Face "
                          "directory; change single keys with --config.SECTION.KEY=VALUE")
    else:
      own.append(arg)
    i += 1
  return own, overrides


def main(argv: Sequence[str] | None = None) -> int:
  from train.__main__ import _default_platform  # pylint: disable=g-import-not-at-top
  _default_platform()  # before the first JAX import
  try:
    own, overrides = split_overrides(sys.argv[1:] if argv is None else list(argv))
    args = _parser().parse_args(own)
    _check_args(args)
    run(args, overrides)
  except (GenerateError, configs.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
