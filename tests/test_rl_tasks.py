"""The built-in verifiable tasks (data/tasks.py) and their rewards through train.rl's Reward: references score 1,
constant answers ~0, malformed ones the format penalty; countdown checked against brute-force enumeration with
Python's own eval; the RL held-out prompts never in the cold-start chat source's training split."""
import itertools
import json
import re

import numpy as np
import pytest

from data import rl_prompts
from data import tasks
from train.rl import rewards


def _items(family, n=300):
  picked = [tasks.item(0, i) for i in range(tasks.SIZE) if tasks.FAMILIES[i % len(tasks.FAMILIES)] == family]
  return [(it["messages"][0]["content"], it["messages"][-1]["content"]) for it in picked[:n]]


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_references_score_one_constants_zero_malformed_the_penalty(family):
  items = _items(family)
  for prompt, reference in items:
    assert tasks.reward(prompt, reference) == {"correct": 1.0, "format": 0.0}
    inside = re.fullmatch(r"<answer>(.*)</answer>", reference).group(1)
    assert tasks.reward(prompt, inside) == {"correct": 0.0, "format": -tasks.FORMAT_PENALTY}  # no tags
    assert tasks.reward(prompt, f"The answer is {reference}") == {"correct": 1.0, "format": -tasks.FORMAT_PENALTY}
  # the best prompt-independent answer among every reference answer seen scores about nothing
  candidates = sorted({reference for _, reference in items})
  best = max(np.mean([tasks.reward(p, c)["correct"] for p, _ in items]) for c in candidates)
  assert best <= 0.05, best


def test_countdown_equals_brute_force_enumeration():
  """Every expression of the three numbers (orders, operators, both groupings) and some that break the rules:
  `correct` agrees with Python's eval of the expression and a multiset check of the numbers it uses."""
  for prompt, _ in _items("countdown", 40):
    target, numbers = re.match(r"Reach (-?\d+) with ([\d ]+) using", prompt).groups()
    numbers = [int(x) for x in numbers.split()]
    found = 0
    for a, b, c in set(itertools.permutations(numbers)):
      for o1, o2 in itertools.product("+-*", repeat=2):
        for expression in (f"{a}{o1}{b}{o2}{c}", f"({a}{o1}{b}){o2}{c}", f"{a}{o1}({b}{o2}{c})"):
          expect = eval(expression) == int(target)  # pylint: disable=eval-used  (digits and + - * only)
          assert tasks.correct(prompt, expression) == expect, (prompt, expression)
          found += expect
    assert found >= 1  # the task always has an answer
    a, b, c = numbers
    # a number twice, one left out, an extra one, code, division, nothing, no expression: never right
    for wrong in (f"{a}+{a}+{b}", f"{a}*{b}", f"{a}+{b}+{c}+0", "__import__('os')", f"{a}/{b}+{c}", "", "((("):
      assert not tasks.correct(prompt, wrong), wrong


def test_the_reward_sums_its_parts_and_keeps_each():
  prompts = ["Compute 47 + 35.", "Compute 47 + 35.", "Sort the numbers: 5 3 9", "Compute 20 - 3."]
  completions = ["<answer>82</answer>", "82", "<answer>3 5 9</answer> done", "<answer>18</answer>"]
  reward = rewards.Reward("py:data.tasks:reward")
  got, parts = reward.scored(prompts, completions, completions)
  np.testing.assert_allclose(got, [1.0, -0.5, 0.5, 0.0])
  np.testing.assert_allclose(reward(prompts, completions, completions), got)
  np.testing.assert_allclose(parts["correct"], [1, 0, 1, 0])
  np.testing.assert_allclose(parts["format"], [0, -0.5, -0.5, 0])


def test_held_out_rl_prompts_are_held_out_of_the_cold_start_source():
  split = rl_prompts.load("builtin:arithmetic", tasks.EVAL_FRACTION)
  source = tasks.TaskSource()
  trained = {json.loads(source[int(i)])["messages"][0]["content"] for i in source.split_indices("train")}
  held = [c[-1]["content"] for c in split["eval"]]
  assert held and not trained & set(held)
  assert all(p.startswith("Compute ") for p in held + [c[-1]["content"] for c in split["train"]])
  assert len(set(held)) == len(held)
  with pytest.raises(ValueError, match="rl.eval_fraction=0.1 with rl.prompts=builtin:arithmetic"):
    rl_prompts.load("builtin:arithmetic", 0.1)
  with pytest.raises(ValueError, match="builtin:countdown"):
    rl_prompts.load("builtin:nope", 0.05)


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_one_family_chat_source_holds_that_familys_items_and_split(family):
  """`builtin:<family>` (data.sources) = builtin:tasks' records of that family, in order, with the same held-out
  prompts as rl.prompts=builtin:<family>."""
  from data import sources  # pylint: disable=g-import-not-at-top
  spec, = sources.parse_spec(f"builtin:{family}")
  source, whole = sources.open_source(spec), tasks.TaskSource()
  assert sources.is_chat_source(spec) and len(source) == tasks.SIZE // len(tasks.FAMILIES)
  mine = [i for i in range(tasks.SIZE) if tasks.FAMILIES[i % len(tasks.FAMILIES)] == family]
  assert [source[i] for i in range(0, len(source), 97)] == [whole[mine[i]] for i in range(0, len(source), 97)]
  held = {json.loads(source[int(i)])["messages"][0]["content"] for i in source.split_indices("eval")}
  trained = {json.loads(source[int(i)])["messages"][0]["content"] for i in source.split_indices("train")}
  assert held == {c[-1]["content"] for c in rl_prompts.load(f"builtin:{family}", tasks.EVAL_FRACTION)["eval"]}
  assert held and trained and not held & trained
  with pytest.raises(sources.SpecError, match="builtin:countdown"):
    sources.parse_spec("builtin:arithmetics")


def test_calculator_environment_answers_tool_calls_and_scores_answers():
  """The tool's reply is the expression's value (or error), an answer ends the episode with data.tasks.reward,
  and without the tool a call is just a malformed answer."""
  from train.rl import env as env_lib
  calc = env_lib.factory("builtin:calculator")()
  assert calc.reset("Calculate 347 + 585.") == "Calculate 347 + 585."
  assert calc.step("<tool>347+585</tool>") == ("<result>932</result>", 0.0, False)
  assert calc.step(" <tool>(2+3)*4-1</tool>\n") == ("<result>19</result>", 0.0, False)
  assert calc.step("<tool>347/585</tool>") == ("<result>error</result>", 0.0, False)
  assert calc.step("<answer>932</answer>") == (None, {"correct": 1.0, "format": 0.0}, True)
  bare = env_lib.factory("builtin:calculator_no_tool")()
  bare.reset("Calculate 347 + 585.")
  assert bare.step("<tool>347+585</tool>") == (None, {"correct": 0.0, "format": -tasks.FORMAT_PENALTY}, True)
  for spec, message in (("calc", "must be builtin:calculator"), ("py:rl_testing:nope", "cannot load nope"),
                        ("py:rl_testing:length", "no reset")):
    with pytest.raises(ValueError, match=message):
      env_lib.factory(spec)
