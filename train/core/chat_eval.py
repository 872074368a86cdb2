"""Exact match of greedy chat answers on held-out prompts: `eval_exact_match` and `eval_exact_match/<family>`.

The prompts are the conversations of the chat sources' eval split up to their last assistant turn (rendered with
the run's template and its generation prompt); the reference is that turn's content. Generation is greedy
(temperature 0) with the shared sampler `model.generate.generate`, stopping at the template's end-of-turn / EOS
ids, at most config.train.eval_max_new_tokens tokens. A prediction matches when it equals the reference after
stripping surrounding whitespace (data.chat.exact_match).
"""
from __future__ import annotations

from typing import Sequence

from data import chat as chat_lib
from data import plan as plan_lib


def template_for(config, tokenizer, plan: plan_lib.DataPlan):
  """The run's chat template when its data (`plan`, the run's parsed config.data) has chat or preference
  sources (data/chat.py make_template), else None."""
  if not (plan.has_chat or plan.has_preference):
    return None
  return chat_lib.make_template(config.data, tokenizer)


def eval_items(config, template, plan: plan_lib.DataPlan | None) -> list[chat_lib.EvalItem]:
  """Up to config.train.eval_generations held-out prompts per task family of `plan`'s chat and preference sources
  (`plan`: the run's parsed config.data, or None to parse it)."""
  from data import preference  # pylint: disable=g-import-not-at-top
  del template  # the items are messages; they are rendered when generated
  return preference.eval_items(config.data, per_family=config.train.eval_generations, plan=plan)


def greedy_answers(model, tokenizer, template, conversations: Sequence[Sequence[dict]], max_new_tokens: int,
                   batch_size: int = 64) -> list[str]:
  """The greedy answer text to each conversation (messages up to the answer's turn), stop tokens removed."""
  from model import generate as generate_lib  # pylint: disable=g-import-not-at-top
  stops = tuple(template.stop_ids())
  answers = []
  for start in range(0, len(conversations), batch_size):
    prompts = [template.prompt(c) for c in conversations[start:start + batch_size]]
    outs = generate_lib.generate(model, prompts, max_new_tokens, temperature=0.0, stop_ids=stops)
    answers += [tokenizer.decode([t for t in out if t not in stops]) for out in outs]
  return answers


def exact_match(model, tokenizer, template, items: Sequence[chat_lib.EvalItem], max_new_tokens: int,
                batch_size: int = 64) -> dict[str, float]:
  """{"eval_exact_match": fraction over all items, "eval_exact_match/<family>": fraction per family}."""
  answers = greedy_answers(model, tokenizer, template, [item.messages for item in items], max_new_tokens, batch_size)
  hits: dict[str, list[bool]] = {}
  for item, answer in zip(items, answers):
    hits.setdefault(item.family, []).append(chat_lib.exact_match(answer, item.answer))
  if not hits:
    return {}
  every = [h for family in hits.values() for h in family]
  out = {"eval_exact_match": sum(every) / len(every)}
  out.update({f"eval_exact_match/{family}": sum(h) / len(h) for family, h in sorted(hits.items())})
  return out
