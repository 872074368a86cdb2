"""The lifecycle's stages: what each reads, the command it runs and what it leaves (WORKDIR/<stage>/).

Every stage runs the project's own command for it (`python -m data.curate`, `python -m data.tokenizer`,
`python -m train`, `python -m train.rl`, `python -m train.evaluate`, `python -m train.export`) as a child process,
so a stage resumes as that command does, and on a pod the same multi-host program runs. Inputs are found by stage
name: a training stage starts from the run of the stage before it (`init_from`), pretraining reads the curated
shards and the trained tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys

TRAINING = ("pretrain", "sft", "reward", "dpo", "rl")
POLICY = ("pretrain", "sft", "dpo", "rl")  # the stages that change the model the lifecycle evaluates and exports
# where a training stage starts from: the first of these in the sequence before it
STARTS_FROM = {"sft": ("pretrain",), "reward": ("sft", "pretrain"), "dpo": ("sft", "pretrain"),
               "rl": ("dpo", "sft", "pretrain")}
CURATED_GLOB = "*/*/part-*.jsonl"  # data.curate's DIR/<language>/<bucket>/part-NNNNN.jsonl


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  needs: tuple[str, ...]  # stages that must come before it in the sequence
  own_keys: tuple[str, ...]  # the lifecycle's keys of its section (the rest is `config`: the command's keys)


STAGES = {s.name: s for s in [
    Stage("curate", (), ("input", "documents", "heldout", "duplicates", "junk", "config")),
    Stage("tokenizer", ("curate",), ("vocab_size", "model_type", "max_sentences")),
    Stage("pretrain", ("curate", "tokenizer"), ("recipe", "config")),
    Stage("sft", ("pretrain",), ("recipe", "config")),
    Stage("reward", ("sft",), ("recipe", "config")),
    Stage("dpo", ("sft",), ("recipe", "config")),
    Stage("rl", ("sft",), ("recipe", "config")),
    Stage("evaluate", ("pretrain",), ("per_family", "max_new_tokens", "tasks", "toxicity_scorer", "samples",
                                      "batch_size")),
    Stage("export", ("pretrain",), ("dtype",)),
]}


def start_of(stage: str, sequence: list[str]) -> str:
  """The stage whose run `stage` (a training stage after pretraining) starts from."""
  before = sequence[:sequence.index(stage)]
  return next(s for s in STARTS_FROM[stage] if s in before)


def reads(stage: str, sequence: list[str]) -> list[str]:
  """The stages whose output `stage` reads in `sequence` (what its digest covers and --only requires done)."""
  out = list(STAGES[stage].needs)
  if stage in STARTS_FROM:
    out.append(start_of(stage, sequence))
  if stage == "evaluate":
    out += [s for s in sequence[:sequence.index(stage)] if s in POLICY]
  if stage == "export":
    out += [last_policy(sequence, stage)] + (["evaluate"] if "evaluate" in sequence else [])
  return sorted(set(out))


def last_policy(sequence: list[str], upto: str | None = None) -> str:
  """The last model-changing stage of `sequence` (before `upto` when given)."""
  before = sequence[:sequence.index(upto)] if upto else sequence
  return [s for s in before if s in POLICY][-1]


def flat_overrides(section, prefix: str = "") -> list[tuple[str, object]]:
  """[(dotted key, value)] of a nested mapping (a stage's `config`)."""
  out = []
  for key in sorted(section):
    value = section[key]
    if hasattr(value, "items"):
      out += flat_overrides(value, f"{prefix}{key}.")
    else:
      out.append((f"{prefix}{key}", value))
  return out


def _arg(value) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  return repr(value) if isinstance(value, (tuple, list)) else str(value)


def config_args_dict(section) -> list[tuple[str, str]]:
  """A stage's command keys as (dotted key, command-line text)."""
  return [(k, _arg(v)) for k, v in flat_overrides(section.get("config", {}))]


def config_args(section) -> list[str]:
  return [f"--config.{k}={v}" for k, v in config_args_dict(section)]


# ---- raw text and evaluation files --------------------------------------------------------------------------
_JUNK = [
    "Home | About | Contact | Login | Register | Cart (0)",
    "Click here to subscribe! Accept all cookies. Privacy policy. Terms of use. Copyright 2024. All rights reserved.",
    "buy cheap buy cheap buy cheap buy cheap buy cheap buy cheap " * 12,
    "$$$ ### !!! @@@ %%% ^^^ &&& *** ((( ))) ~~~ ||| <<< >>> ;;; " * 10,
]


def write_raw(workdir: str, section) -> dict:
  """The built-in corpus as curation input: WORKDIR/raw/part-0000N.jsonl ({"id", "text"}) with planted exact
  duplicates, near duplicates (a word appended to every line) and junk, and WORKDIR/eval/heldout.jsonl (documents
  never in the input, for held-out perplexity). Deterministic; returns the counts."""
  from data import sources  # pylint: disable=g-import-not-at-top
  src = sources.open_source(sources.parse_spec("builtin")[0])
  rng = random.Random(0)
  order = list(range(len(src)))
  rng.shuffle(order)
  held, rest = order[:section.heldout], order[section.heldout:]
  rest = rest[:section.documents] if section.documents else rest
  docs = [(f"doc-{i}", src[i]) for i in rest]
  planted = {"exact_duplicates": round(section.duplicates * len(docs) / 2),
             "near_duplicates": round(section.duplicates * len(docs) / 2), "junk": round(section.junk * len(docs))}
  originals = list(docs)
  for n in range(planted["exact_duplicates"]):
    docs.append((f"dup-{n}", rng.choice(originals)[1]))
  for n in range(planted["near_duplicates"]):
    docs.append((f"near-{n}", "\n".join(line + " indeed" for line in rng.choice(originals)[1].split("\n"))))
  for n in range(planted["junk"]):
    docs.append((f"junk-{n}", _JUNK[n % len(_JUNK)]))
  rng.shuffle(docs)
  raw = os.path.join(workdir, "raw")
  os.makedirs(raw, exist_ok=True)
  shards = 4
  for s in range(shards):
    _write_jsonl(os.path.join(raw, f"part-{s:05d}.jsonl"), [{"id": i, "text": t} for i, t in docs[s::shards]])
  _write_jsonl(heldout_path(workdir), [{"text": src[i]} for i in held])
  return {"documents": len(docs), "heldout": len(held), **planted}


def _write_jsonl(path: str, records: list[dict]) -> None:
  from data import files  # pylint: disable=g-import-not-at-top
  files.atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def heldout_path(workdir: str) -> str:
  return os.path.join(workdir, "eval", "heldout.jsonl")


def tasks_path(workdir: str) -> str:
  return os.path.join(workdir, "eval", "tasks.jsonl")


def write_task_prompts(workdir: str, section, chat_section) -> int:
  """WORKDIR/eval/tasks.jsonl: the held-out prompts of the built-in chat tasks `recipe` trains on (`per_family`
  per task family), each rendered as the meshlm chat template writes it (`<|role|>content<|end_of_turn|>`, then
  `<|assistant|>`), with its reference answer and the end of the turn as the stop: train.evaluate's `gen` task."""
  import configs  # pylint: disable=g-import-not-at-top
  from data import preference  # pylint: disable=g-import-not-at-top
  if chat_section is None:
    data = configs.load("sft_tiny").data
  else:
    data = configs.load(chat_section.recipe, **dict(config_args_dict(chat_section))).data
  items = preference.eval_items(data, per_family=section.per_family)
  records = [{"context": "".join(f"<|{m['role']}|>{m['content']}<|end_of_turn|>" for m in item.messages)
                         + "<|assistant|>",
              "answer": item.answer, "until": ["<|end_of_turn|>"], "max_tokens": section.max_new_tokens,
              "family": item.family} for item in items]
  _write_jsonl(tasks_path(workdir), records)
  return len(records)


def evaluation_path(workdir: str, stage: str) -> str:
  return os.path.join(workdir, "eval", f"{stage}.json")


# ---- commands ------------------------------------------------------------------------------------------------
def _py(*args: str) -> list[str]:
  return [sys.executable, "-m", *args]


def command(stage: str, workdir: str, cfg, sequence: list[str]) -> list[str]:
  """The argv of `stage`'s command (the evaluate stage's are per model: `evaluate_command`)."""
  section, out = cfg[stage], os.path.join(workdir, stage)
  if stage == "curate":
    glob = os.path.join(workdir, "raw", "*.jsonl") if section.input == "builtin" else section.input
    return _py("data.curate", "--input", glob, "--output", out, *config_args(section))
  if stage == "tokenizer":
    return _py("data.tokenizer", "--output", os.path.join(out, "tokenizer.model"), "--sources",
               f"curated=jsonl:{os.path.join(workdir, 'curate', CURATED_GLOB)}", "--vocab_size",
               str(section.vocab_size), "--model_type", section.model_type, "--max_sentences",
               str(section.max_sentences))
  if stage in TRAINING:
    module = "train.rl" if stage == "rl" else "train"
    args = [f"--config={section.recipe}", f"--workdir={out}", *config_args(section)]
    if stage == "pretrain":
      args += [f"--config.data.sources=curated=jsonl:{os.path.join(workdir, 'curate', CURATED_GLOB)}",
               f"--config.data.tokenizer={os.path.join(workdir, 'tokenizer', 'tokenizer.model')}"]
    else:
      args += [f"--config.train.init_from={os.path.join(workdir, start_of(stage, sequence))}",
               "--config.train.base_recipe="]
    return _py(module, *args)
  if stage == "export":
    return _py("train.export", "--workdir", os.path.join(workdir, last_policy(sequence)), "--output", out,
               "--dtype", section.dtype)
  raise ValueError(f"no command for stage {stage!r}")


def evaluate_command(model_stage: str, workdir: str, section, heldout: bool) -> list[str]:
  """train.evaluate of `model_stage`'s run on the lifecycle's task set (held-out perplexity when the lifecycle
  wrote the held-out documents: curate.input=builtin)."""
  tasks = ([f"ppl:{heldout_path(workdir)}"] if heldout else []) + [f"gen:{tasks_path(workdir)}"]
  tasks += [t for t in section.tasks.split(",") if t]
  args = ["--workdir", os.path.join(workdir, model_stage), "--tasks", ",".join(tasks), "--output",
          evaluation_path(workdir, model_stage), "--batch_size", str(section.batch_size), "--log_samples",
          "--no_progress"]
  if section.toxicity_scorer:
    args += ["--toxicity_scorer", section.toxicity_scorer]
  return _py("train.evaluate", *args)


def write_samples(workdir: str, stage: str, count: int) -> None:
  """WORKDIR/eval/<stage>.samples.json: the first `count` generations of the `gen` task from its evaluation's
  logged samples ([{"prompt", "completion", "answer"}]), for the report."""
  with open(evaluation_path(workdir, stage)) as f:
    result = json.load(f)
  samples = result.get("samples", {}).get("gen", [])  # evals.harness: {"samples": {TASK: [{"prompt", ...}]}}
  out = [{"prompt": s["prompt"], "completion": s["output"], "answer": s["answer"]} for s in samples[:count]]
  from data import files  # pylint: disable=g-import-not-at-top
  files.atomic_write(os.path.join(workdir, "eval", f"{stage}.samples.json"),
                     json.dumps(out, indent=1, ensure_ascii=False))


