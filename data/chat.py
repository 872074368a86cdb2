"""Conversations: parsing chat records, rendering them with a chat template, and the assistant-token loss mask.

Records (JSONL, one per line; source kind `chat:PATH` or the built-in `builtin:instruct`):
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
  {"prompt": "..." | [messages], "completion": "..." | [messages]}     (prompt turns, then assistant turns)
An optional "family" string names the task family for per-family evaluation.

Templates (`config.data.chat_template`):
  meshlm  the default, Llama-3-like: BOS, then per message `<|role|> content <|end_of_turn|>`; a generation
          prompt ends with `<|assistant|>`. The markers are the tokenizer's reserved control pieces, inserted by
          id, so no text a user types can produce them (data/tokenizer.py RESERVED).
  auto    an HF tokenizer's own Jinja `chat_template` (chat_template.jinja or tokenizer_config.json) when it has
          one, else meshlm.
  PATH    a Jinja file in Hugging Face's chat-template language.
Jinja templates render text as transformers' apply_chat_template does (same sandbox, globals and filters); the
whole text is tokenized once with the special tokens matched (the ids apply_chat_template(tokenize=True) gives).
The assistant spans come from the template's `{% generation %}` blocks when it has them (transformers'
return_assistant_tokens_mask), else from rendering each prefix of the conversation (the span of assistant turn
i is the text between the rendering of messages[:i] with the generation prompt and that of messages[:i+1], up
to and including its end-of-turn token); a token is in the mask when its text overlaps a span.

Loss mask (`config.data.chat_loss`): `assistant` = the tokens of every assistant turn including its end-of-turn
marker (not the role marker that opens it); `all` = every token. Conversations longer than seq_len + 1 tokens
are truncated (`config.data.chat_truncation`): `right` drops the end, `left` drops the beginning (keeps the
last turns); each is counted in `data/chat_truncated`. Bad records (no assistant turn, an unknown role, a role
the tokenizer has no marker for, no messages, a conversation the Jinja template refuses such as a system turn
for Gemma 2: `template_error`) are counted per reason (`data/chat_skipped_<reason>`) and skipped, or raise with
config.data.strict.
"""
from __future__ import annotations

import contextvars
import dataclasses
import datetime
import json
import os
import re
from typing import Any, Sequence

import numpy as np

from data import files
from data import sources as sources_lib

ROLES = ("system", "user", "assistant")
MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end_of_turn|>"
# The meshlm template in Hugging Face's Jinja chat-template language (exported as tokenizer_config.json's
# `chat_template`, so `apply_chat_template` renders the same tokens).
MESHLM_JINJA = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] "
                "+ '<|end_of_turn|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


class ChatError(ValueError):
  """A conversation that cannot be used; `reason` is a short counter name (no_assistant, unknown_role, ...)."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def parse_record(record: Any) -> list[dict[str, str]]:
  """A chat record (module docstring) -> its list of {"role", "content"} messages; ChatError if malformed."""
  if not isinstance(record, dict):
    raise ChatError("not_an_object", f"a chat record must be a JSON object, got {type(record).__name__}")
  if "messages" in record:
    messages = record["messages"]
  elif "prompt" in record and "completion" in record:
    prompt, completion = record["prompt"], record["completion"]
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + (
        [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion))
  else:
    raise ChatError("no_messages", f"a chat record needs 'messages' or 'prompt' + 'completion'; it has "
                    f"{sorted(record)}")
  if not isinstance(messages, list) or not messages:
    raise ChatError("no_messages", "the record's 'messages' is empty or not a list")
  out = []
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
      raise ChatError("bad_message", f"each message needs a 'role' and a string 'content'; got {m!r:.80}")
    if m.get("role") not in ROLES:
      raise ChatError("unknown_role", f"unknown role {m.get('role')!r}; roles are {', '.join(ROLES)}")
    out.append({"role": m["role"], "content": m["content"]})
  if not any(m["role"] == "assistant" for m in out):
    raise ChatError("no_assistant", "the conversation has no assistant turn: nothing to learn from it")
  return out


class MeshlmTemplate:
  """The built-in template (module docstring), rendered token by token with the markers inserted by id."""
  name = "meshlm"
  jinja = MESHLM_JINJA

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    missing = [p for p in (MARKERS["user"], MARKERS["assistant"], END_OF_TURN) if not _has_piece(tokenizer, p)]
    if missing:
      raise ValueError(f"the tokenizer {getattr(tokenizer, 'path', '')!r} lacks the special pieces {missing} the "
                       "meshlm chat template needs; use a meshlm tokenizer (data/tokenizer.py reserves them) or set "
                       "config.data.chat_template to a Jinja template written for this tokenizer")
    self.ids = {role: tokenizer.special_id(p) for role, p in MARKERS.items() if _has_piece(tokenizer, p)}
    self.end_id = tokenizer.special_id(END_OF_TURN)

  def stop_ids(self) -> tuple[int, ...]:
    return (self.end_id, self.tokenizer.eos_id)

  def render(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(token ids, assistant flags) of a whole conversation, BOS first."""
    ids, flags = [self.tokenizer.bos_id], [0]
    for m in messages:
      if m["role"] not in self.ids:
        raise ChatError("missing_marker", f"the tokenizer has no marker piece {MARKERS[m['role']]!r} for role "
                        f"{m['role']!r}")
      body = self.tokenizer.encode(m["content"]) + [self.end_id]
      flag = int(m["role"] == "assistant")
      ids += [self.ids[m["role"]]] + body
      flags += [0] + [flag] * len(body)
    return ids, flags

  def prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` followed by the generation prompt (the assistant marker)."""
    ids = self.render(messages)[0] if messages else [self.tokenizer.bos_id]
    return ids + [self.ids["assistant"]]


class JinjaTemplate:
  """A Hugging Face Jinja chat template rendered as transformers' apply_chat_template renders it (a sandboxed
  jinja2 environment with its globals, filters and `{% generation %}` tag), tokenized with special-token matching.

  Assistant spans: a template with `{% generation %}` blocks marks them itself (transformers'
  return_assistant_tokens_mask); otherwise turn i's span is the text between messages[:i] rendered with the
  generation prompt and messages[:i+1], ending after its end-of-turn token (a stop id; the newline Qwen's and
  Gemma's templates write after it is template glue the model never generates). A token is flagged when its text
  overlaps a span, as transformers flags it.
  """
  name = "jinja"

  def __init__(self, tokenizer, source: str):
    self.tokenizer, self.jinja = tokenizer, source
    self._env = _jinja_environment()
    self._template = self._env.from_string(source)
    self._tagged = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
    self._tokens = dict(getattr(tokenizer, "template_tokens", None) or {
        "bos_token": tokenizer.id_to_piece(tokenizer.bos_id), "eos_token": tokenizer.id_to_piece(tokenizer.eos_id)})
    self._stop_pieces = [tokenizer.id_to_piece(i) for i in self.stop_ids()]

  def __getstate__(self):  # grain worker processes rebuild the jinja2 environment from the source
    return {"tokenizer": self.tokenizer, "source": self.jinja}

  def __setstate__(self, state):
    self.__init__(state["tokenizer"], state["source"])

  def stop_ids(self) -> tuple[int, ...]:
    return tuple(getattr(self.tokenizer, "stop_ids", (self.tokenizer.eos_id,)))

  def text(self, messages, add_generation_prompt: bool = False, spans: list | None = None) -> str:
    """The rendered conversation; `spans` collects the (start, end) of each {% generation %} block in it."""
    import jinja2  # pylint: disable=g-import-not-at-top
    blocks = []
    token = _TRACKER.set((blocks, spans)) if spans is not None else None
    try:
      for block in self._template.generate(messages=list(messages), tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **self._tokens):
        blocks.append(block)
    except jinja2.TemplateError as e:  # e.g. Gemma 2's raise_exception('System role not supported')
      raise ChatError("template_error", f"the chat template refused the conversation: {e}") from e
    finally:
      if token is not None:
        _TRACKER.reset(token)
    return "".join(blocks)

  def spans(self, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its assistant spans (class docstring)."""
    if self._tagged:
      spans = []
      return self.text(messages, spans=spans), spans
    full, spans = self.text(messages), []
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      before, through = self.text(messages[:i], True), self.text(messages[:i + 1])
      if not (full.startswith(before) and full.startswith(through)):
        raise ChatError("template_not_prefix", "the chat template does not render conversations prefix by prefix "
                        "(the rendering of a prefix is not a prefix of the whole); the assistant spans are unknown "
                        "unless the template marks them with {% generation %}")
      turn = full[len(before):len(through)]
      ends = [turn.rfind(p) + len(p) for p in self._stop_pieces if p and p in turn]
      spans.append((len(before), len(before) + (max(ends) if ends else len(turn))))
    return full, spans

  def render(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
    full, spans = self.spans(messages)
    ids, offsets = self.tokenizer.encode_with_offsets(full)
    # Flagged when the token's text overlaps a span; a zero-width token counts as the character it sits on.
    flags = [int(any(s < end and max(e, s + 1) > start for start, end in spans)) for s, e in offsets]
    return ids, flags

  def prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
    return self.tokenizer.encode_with_specials(self.text(messages, True))


# The {% generation %} tracker of the render in progress: (blocks rendered so far, spans), or None.
_TRACKER: contextvars.ContextVar = contextvars.ContextVar("meshlm_chat_generation", default=None)


def _jinja_environment():
  """The sandboxed jinja2 environment transformers renders chat templates in (its chat_template_utils): trim
  and lstrip blocks, loop controls, raise_exception, strftime_now, a tojson that keeps non-ASCII text, and the
  {% generation %} tag recording where its body lands in the output."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

  class Generation(ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
      text, tracking = caller(), _TRACKER.get()
      if tracking is not None and tracking[1] is not None:
        start = len("".join(tracking[0]))
        tracking[1].append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[Generation, "jinja2.ext.loopcontrols"])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env


def write_chat_template(directory: str, jinja: str) -> None:
  """Sets `chat_template` in DIRECTORY/tokenizer_config.json (created if absent, other keys kept), so that
  `transformers`' `apply_chat_template` renders conversations as the run was trained (exports call this)."""
  path = os.path.join(directory, "tokenizer_config.json")
  config = {}
  if os.path.exists(path):
    with open(path) as f:
      config = json.load(f)
  config["chat_template"] = jinja
  with open(path + ".tmp", "w") as f:
    json.dump(config, f, indent=2)
  os.replace(path + ".tmp", path)


def _has_piece(tokenizer, piece: str) -> bool:
  try:
    tokenizer.special_id(piece)
    return True
  except KeyError:
    return False


def make_template(data_config, tokenizer):
  """The template named by config.data.chat_template for `tokenizer` (ValueError naming the key and the fix)."""
  name = data_config.chat_template
  if name == "auto":
    source = getattr(tokenizer, "chat_template", None)
    return JinjaTemplate(tokenizer, source) if source else MeshlmTemplate(tokenizer)
  if name == "meshlm":
    return MeshlmTemplate(tokenizer)
  if os.path.isfile(name):
    with open(name) as f:
      return JinjaTemplate(tokenizer, f.read())
  raise ValueError(f"config.data.chat_template={name!r} is not auto, meshlm or an existing Jinja file")


@dataclasses.dataclass
class ChatEncoder:
  """Record text -> {inputs, targets, loss_mask} of at most seq_len tokens (module docstring), or None."""
  template: Any
  seq_len: int
  loss: str = "assistant"
  truncation: str = "right"
  strict: bool = False

  def __post_init__(self):
    if self.loss not in ("assistant", "all"):
      raise ValueError(f"config.data.chat_loss={self.loss!r} must be 'assistant' or 'all'")
    if self.truncation not in ("right", "left"):
      raise ValueError(f"config.data.chat_truncation={self.truncation!r} must be 'right' or 'left'")

  def __call__(self, text: str, where: str = "chat record") -> dict[str, np.ndarray] | None:
    try:
      messages = parse_record(json.loads(text))
      ids, flags = self.template.render(messages)
    except json.JSONDecodeError as e:
      return self._skip("unparseable", f"{where}: unparseable JSON ({e})")
    except ChatError as e:
      return self._skip(e.reason, f"{where}: {e}")
    ids, flags = np.asarray(ids, np.int32), np.asarray(flags, np.float32)
    inputs, targets, mask = ids[:-1], ids[1:], flags[1:] if self.loss == "assistant" else np.ones(len(ids) - 1,
                                                                                                   np.float32)
    if len(inputs) > self.seq_len:
      files.COUNTERS["chat_truncated"] += 1
      keep = slice(0, self.seq_len) if self.truncation == "right" else slice(len(inputs) - self.seq_len, None)
      inputs, targets, mask = inputs[keep], targets[keep], mask[keep]
    if not mask.any():
      return self._skip("no_loss_tokens", f"{where}: no assistant token is left after truncation to "
                        f"{self.seq_len} tokens (config.data.chat_truncation={self.truncation!r})")
    return {"inputs": inputs, "targets": targets, "loss_mask": mask}

  def _skip(self, reason: str, message: str):
    if self.strict:
      raise ValueError(message + "; fix the record or set config.data.strict=False to skip such records")
    files.COUNTERS[f"chat_skipped_{reason}"] += 1
    files.warn_once(f"chat:{reason}", message + " -- skipped (counted in data/chat_skipped_" + reason + ")")
    return None


is_chat_source = sources_lib.is_chat_source  # whether a parsed mixture item holds conversations


@dataclasses.dataclass
class EvalItem:
  family: str
  messages: list[dict[str, str]]  # the conversation before its last assistant turn
  answer: str  # the last assistant turn's content


def eval_items(data_config, per_family: int, eval_fraction: float | None = None, plan=None,
               split: str = "eval", parsers=None) -> list[EvalItem]:
  """Held-out prompts with reference answers from the chat sources' eval split: up to `per_family` per family
  (a record's "family", else its source name), in a fixed order; the reference is a conversation's last assistant
  turn, the context everything before it. `plan`: the run's parsed config.data (data/plan.py DataPlan; resolved
  from `data_config` when None). `split="train"` reads the training split instead (train.rl's rl.ptx_coef rows).
  `parsers`: ((is_source(spec), record -> messages), ...) for other kinds of sources (data.preference.eval_items);
  default the chat sources' `parse_record`."""
  if plan is None:
    from data import plan as plan_lib  # pylint: disable=g-import-not-at-top  (data.plan reads the sources)
    plan = plan_lib.resolve(data_config)
  specs, srcs = plan.specs, plan.open()
  fraction = data_config.eval_fraction if eval_fraction is None else eval_fraction
  items: dict[str, list[EvalItem]] = {}
  parsers = parsers or ((is_chat_source, parse_record),)
  for spec, src in zip(specs, srcs):
    parse = next((p for is_source, p in parsers if is_source(spec)), None)
    if parse is None:
      continue
    for i in sources_lib.source_split(src, fraction, split):
      try:
        record = json.loads(src[int(i)])
        messages = parse(record)
      except (json.JSONDecodeError, ChatError):
        continue
      last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
      family = str(record.get("family") or spec.name)
      bucket = items.setdefault(family, [])
      if len(bucket) < per_family:
        bucket.append(EvalItem(family, messages[:last], messages[last]["content"]))
  return [item for family in sorted(items) for item in items[family]]


def exact_match(prediction: str, answer: str) -> bool:
  """Exact match after stripping surrounding whitespace (lm-eval's `exact_match` with ignore_whitespace at ends)."""
  return prediction.strip() == answer.strip()
