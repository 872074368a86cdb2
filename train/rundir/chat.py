"""Multi-turn chat with a model: the conversation so far, rendered with the run's template, answered greedily.

`python -m train.generate --workdir RUN --chat` reads one user turn per line from stdin and prints each answer;
an empty line is ignored, end of input ends the chat. `template_for_run` picks the template the run trained with
(the Jinja source in its checkpoint metadata; the meshlm template when that is meshlm's own), else the one
config.data.chat_template names.
"""
from __future__ import annotations

from typing import Callable, Iterable

from data import chat as chat_lib


def template_for_run(config, tokenizer, saved_jinja: str | None):
  """The chat template of a run: its checkpoint's Jinja source if any, else config.data.chat_template."""
  if saved_jinja == chat_lib.MESHLM_JINJA:
    return chat_lib.MeshlmTemplate(tokenizer)
  if saved_jinja:
    return chat_lib.JinjaTemplate(tokenizer, saved_jinja)
  return chat_lib.make_template(config.data, tokenizer)


def converse(model, tokenizer, template, turns: Iterable[str], write: Callable[[str], None],
             max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             sampler: str = "engine") -> list[dict[str, str]]:
  """Answers each user turn in `turns` with the whole conversation as context; returns the messages.

  Each answer is generated (by the engine, model/engine.py, or with sampler="static" by `model.generate`) from `template.prompt(messages)` until an end-of-turn /
  EOS id (`template.stop_ids()`) or max_new_tokens, decoded without the stop id and passed to `write`.
  """
  from model import engine as engine_lib, generate as generate_lib  # pylint: disable=g-import-not-at-top
  generate = engine_lib.sample if sampler == "engine" else generate_lib.sample
  stops = tuple(template.stop_ids())
  messages: list[dict[str, str]] = []
  for i, line in enumerate(turns):
    text = line.rstrip("\n")
    if not text.strip():
      continue
    messages.append({"role": "user", "content": text})
    out = generate(model, [template.prompt(messages)], max_new_tokens, temperature=temperature, stop_ids=stops,
                   seed=seed + i).tokens[0]
    answer = tokenizer.decode([t for t in out if t not in stops])
    messages.append({"role": "assistant", "content": answer})
    write(answer)
  return messages
