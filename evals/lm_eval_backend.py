"""An lm-evaluation-harness model (`lm_eval.api.model.LM`) answering requests with an `evals.LM`.

lm-eval's `loglikelihood`, `loglikelihood_rolling` and `generate_until` map one to one onto `evals.LM`'s, so any
lm-eval task (MMLU, GSM8K, HellaSwag, ... with their data available) runs on a meshlm model sharded on the mesh
with the hf backend's tokenization. `apply_chat_template` renders lm-eval's chat history with meshlm's chat
format (`<|role|>content<|end_of_turn|>` per message, then `<|assistant|>`; BOS comes from the tokenization),
whose markers the `evals.LM` must know as `specials`. Registration under the name `meshlm`, with run-directory
loading, is `train/lm_eval.py` (evals never opens run directories).
"""
from __future__ import annotations

from typing import Any

from lm_eval.api.model import LM as HarnessLM

from evals.requests import LM

END_OF_TURN = "<|end_of_turn|>"
CHAT_JINJA = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + "
              "'<|end_of_turn|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


class MeshLMHarness(HarnessLM):
  """lm-eval's LM interface over `lm` (an evals.LM); `name` identifies the model in lm-eval's records."""

  def __init__(self, lm: LM, name: str = "meshlm"):
    super().__init__()
    self.lm, self.name = lm, name

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    return self.lm.loglikelihood([tuple(r.args) for r in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    return self.lm.loglikelihood_rolling([r.args[0] for r in requests])

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """lm-eval's gen_kwargs: until (str or list), max_gen_toks (default 256, lm-eval's), temperature,
    do_sample, top_p; greedy unless do_sample or temperature > 0."""
    out: list[Any] = [None] * len(requests)
    groups: dict[tuple[float, float], list[tuple[int, tuple]]] = {}
    for i, r in enumerate(requests):
      context, kwargs = r.args
      kwargs = dict(kwargs or {})
      until = kwargs.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      temperature = float(kwargs.get("temperature", 0.0) or 0.0)
      if kwargs.get("do_sample") is False:
        temperature = 0.0
      top_p = float(kwargs.get("top_p", 1.0) or 1.0)
      max_tokens = min(int(kwargs.get("max_gen_toks", 256)), self.lm.max_len - 1)
      groups.setdefault((temperature, top_p), []).append((i, (context, until, max_tokens)))
    for (temperature, top_p), items in groups.items():
      texts = self.lm.generate_until([req for _, req in items], temperature=temperature, top_p=top_p)
      for (i, _), text in zip(items, texts):
        out[i] = text
    return out

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{m['role']}|>{m['content']}{END_OF_TURN}" for m in chat_history)
    return text + ("<|assistant|>" if add_generation_prompt else "")

  @property
  def tokenizer_name(self) -> str:
    return f"meshlm-{self.name}"

  def chat_template(self, chat_template: bool | str = False) -> str:
    return CHAT_JINJA if chat_template else ""
