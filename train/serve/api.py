"""The OpenAI-compatible HTTP API over the engine's worker: /v1/completions, /v1/chat/completions, /v1/models.

Request bodies are checked against the schemas below (unknown fields refused); every refusal is an OpenAI-style
error body {"error": {"message", "type", "param", "code"}} with status 400 (bad input), 404 (unknown model), 429
(server full) or 503 (shutting down). Completions read `prompt` as text ([BOS] + its tokens, as
`train.generate --prompt` does) or as token ids; chat renders `messages` with the run's chat template and stops
at its end-of-turn ids. Text is detokenized incrementally (data/detokenize.py): a completion's text is
`tokenizer.decode` of its tokens, and streamed deltas (server-sent events, `data: {...}` chunks, then
`data: [DONE]`) concatenate to it. `stop` strings end a choice at their first occurrence (not included); while
streaming, the last characters that could begin a stop string are held back until they cannot.
"""
from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from typing import Any, Literal

import fastapi
import pydantic
from fastapi import responses

from data import detokenize
from train.serve import worker as worker_lib

# OpenAI parameters this server knows but does not implement: refused by name rather than ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "presence_penalty", "frequency_penalty",
               "logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format",
               "parallel_tool_calls", "modalities", "audio", "prediction", "reasoning_effort")


class _Sampling(pydantic.BaseModel):
  """Fields common to both endpoints (OpenAI's defaults; top_k, min_p, repetition_penalty as vLLM extends them)."""
  model_config = pydantic.ConfigDict(extra="forbid")
  model: str
  max_tokens: int | None = pydantic.Field(None, ge=1)
  temperature: float = pydantic.Field(1.0, ge=0.0, le=100.0)
  top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
  top_k: int = pydantic.Field(0, ge=0)
  min_p: float = pydantic.Field(0.0, ge=0.0, le=1.0)
  repetition_penalty: float = pydantic.Field(1.0, gt=0.0)
  n: int = pydantic.Field(1, ge=1, le=16)
  stop: str | list[str] | None = None
  seed: int | None = pydantic.Field(None, ge=0, lt=2**31)
  stream: bool = False
  stream_options: dict[Literal["include_usage"], bool] | None = None
  user: str | None = None  # the caller's end-user id: metadata, as OpenAI uses it


class CompletionRequest(_Sampling):
  prompt: str | list[int]


class Message(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid")
  role: Literal["system", "user", "assistant"]
  content: str
  name: str | None = None


class ChatRequest(_Sampling):
  messages: list[Message] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)


class ApiError(Exception):
  """An error answered as OpenAI's error body with `status`."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
  return responses.JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                                status_code=status)


def _describe(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
  """(message, parameter) of pydantic's first validation error, with the fix where the error is an unknown key."""
  e = errors[0]
  where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
  if e.get("type") == "json_invalid":
    return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})", None
  if e.get("type") == "extra_forbidden":
    name = where.split(".")[-1]
    if name in UNSUPPORTED:
      return f"parameter {name!r} is not supported by this server; leave it out", name
    return f"unknown parameter {where!r}; see the API's fields in docs/serve.md", where
  if e.get("type") == "missing":
    return f"missing required parameter {where!r}", where
  return f"invalid {where or 'body'}: {e.get('msg')}", where or None


class Service:
  """What the routes need: the worker, the tokenizer, the chat template, the model's name and its limits."""

  def __init__(self, worker, tokenizer, template, model_name: str):
    self.worker, self.tokenizer, self.template, self.model_name = worker, tokenizer, template, model_name
    self.created = int(time.time())

  def check_model(self, name: str) -> None:
    if name != self.model_name:
      raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r} (GET /v1/models)",
                     "not_found_error", "model")

  def prompt_ids(self, prompt: str | list[int]) -> list[int]:
    from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    if isinstance(prompt, str):
      return tokenizer_lib.prompt_ids(self.tokenizer, self.tokenizer.encode(prompt))
    return list(prompt)

  def chat_ids(self, messages: list[Message]) -> tuple[list[int], tuple[int, ...]]:
    if self.template is None:
      raise ApiError(400, "this model has no chat template; use /v1/completions")
    return self.template.prompt([m.model_dump(exclude_none=True) for m in messages]), tuple(self.template.stop_ids())


class Choice:
  """One choice's progress on the event loop: its detokenizer, stop strings and finish reason."""

  def __init__(self, tokenizer, stop_strings: list[str], hidden: tuple[int, ...]):
    self.detok = detokenize.Detokenizer(tokenizer)
    self.stops, self.hidden = [s for s in stop_strings if s], hidden
    self.text, self.sent, self.tokens, self.finish = "", 0, 0, None

  def add(self, ids: list[int], reason: str | None) -> None:
    """Takes new ids (and the worker's finish reason); a stop string sets finish = "stop" and cuts the text."""
    self.tokens += len(ids)
    self.text += self.detok.push([i for i in ids if i not in self.hidden])
    if reason is not None:
      self.text += self.detok.flush()
    for s in self.stops:
      at = self.text.find(s)
      if at >= 0:
        self.text, reason = self.text[:at], "stop"
    self.finish = reason

  def _end(self) -> int:
    """Where the streamable text ends: all of it once finished, else short of a tail that could begin a stop."""
    hold = max(len(s) for s in self.stops) - 1 if self.finish is None and self.stops else 0
    return max(len(self.text) - hold, self.sent)

  def pending(self) -> bool:
    """Whether `delta` has text to stream now."""
    return self._end() > self.sent

  def delta(self) -> str:
    """The text not yet streamed (`_end`)."""
    end = self._end()
    out, self.sent = self.text[self.sent:end], end
    return out


class Run:
  """One request's n choices in the engine: submitted at construction (ApiError when refused), then `updates()`
  yields (index, Choice) each time a choice changed until all finished; `close()` cancels the unfinished ones."""

  def __init__(self, service: Service, prompt: list[int], stop_ids: tuple[int, ...], body: _Sampling,
               max_tokens: int):
    self.service, self.prompt = service, prompt
    loop = asyncio.get_running_loop()
    self.events: asyncio.Queue = asyncio.Queue()
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    settings = dict(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty, seed=seed, stop_ids=stop_ids)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    self.choices = [Choice(service.tokenizer, stops, stop_ids) for _ in range(body.n)]
    self.tickets: list[int] = []
    try:
      for i in range(body.n):
        sink = functools.partial(self._sink, loop, i)
        self.tickets.append(service.worker.submit(prompt, max_tokens, sink, row=i, **settings))
    except ValueError as e:  # the engine's words for the API's: its max_new_tokens is max_tokens here
      self.close()
      raise ApiError(400, str(e).replace("max_new_tokens", "max_tokens")) from None
    except worker_lib.Overloaded as e:
      self.close()
      raise ApiError(429, str(e), "rate_limit_error") from None
    except RuntimeError as e:
      self.close()
      raise ApiError(503, str(e), "server_error") from None

  def _sink(self, loop, i: int, ids: list[int], reason: str | None) -> None:
    loop.call_soon_threadsafe(self.events.put_nowait, (i, ids, reason))

  async def updates(self):
    try:
      while any(c.finish is None for c in self.choices):
        i, ids, reason = await self.events.get()
        if reason is not None and reason.startswith("error"):
          raise ApiError(500, reason, "server_error")
        if reason == "cancelled":
          raise ApiError(503, "the server shut down before the request finished", "server_error")
        self.choices[i].add(ids, reason)
        if self.choices[i].finish is not None and reason is None:
          self.service.worker.cancel(self.tickets[i])  # a stop string: the engine need not go on
        yield i, self.choices[i]
    finally:
      self.close()

  def close(self) -> None:
    for t, c in zip(self.tickets, self.choices):
      if c.finish is None:
        c.finish = "cancelled"
        self.service.worker.cancel(t)  # the client went away or an error ended the request

  def usage(self) -> dict[str, int]:
    done = sum(c.tokens for c in self.choices)
    return {"prompt_tokens": len(self.prompt), "completion_tokens": done, "total_tokens": len(self.prompt) + done}


def _max_tokens(service: Service, prompt: list[int], requested: int | None) -> int:
  """max_tokens, or (unset) what the server's max_len leaves after the prompt, as vLLM defaults it."""
  if requested is not None:
    return requested
  room = service.worker.engine.max_len - len(prompt)
  if room < 1:
    raise ApiError(400, f"the prompt's {len(prompt)} tokens leave no room under the server's max_len="
                        f"{service.worker.engine.max_len}; shorten it")
  return room


def _chunk(run: Run, rid: str, kind: str, model: str, created: int, i: int, choice: Choice | None) -> str:
  """One server-sent event: choice i's delta (its finish reason once finished), or the usage (choice None)."""
  body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model, "choices": []}
  if choice is None:
    body["usage"] = run.usage()
  elif kind == "text_completion":
    body["choices"] = [{"index": i, "text": choice.delta(), "finish_reason": choice.finish, "logprobs": None}]
  else:
    body["choices"] = [{"index": i, "delta": {"content": choice.delta()}, "finish_reason": choice.finish,
                        "logprobs": None}]
  return f"data: {json.dumps(body)}\n\n"


async def _stream(run: Run, body: _Sampling, rid: str, kind: str, model: str):
  """The server-sent events of a streamed request, ending with `data: [DONE]`."""
  created = int(time.time())
  if kind == "chat.completion.chunk":
    for i in range(len(run.choices)):
      first = {"id": rid, "object": kind, "created": created, "model": model,
               "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                            "logprobs": None}]}
      yield f"data: {json.dumps(first)}\n\n"
  try:
    async for i, choice in run.updates():
      if choice.finish is not None or choice.pending():
        yield _chunk(run, rid, kind, model, created, i, choice)
  except ApiError as e:
    yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'param': None, 'code': None}})}\n\n"
    return
  if body.stream_options and body.stream_options.get("include_usage"):
    yield _chunk(run, rid, kind, model, created, 0, None)
  yield "data: [DONE]\n\n"


async def _answer(service: Service, body: _Sampling, prompt: list[int], stop_ids: tuple[int, ...], chat: bool):
  """The response to a completion (chat=False) or chat completion request."""
  requested = body.max_completion_tokens or body.max_tokens if chat else (body.max_tokens or 16)
  run = Run(service, prompt, stop_ids, body, _max_tokens(service, prompt, requested))
  rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
  if body.stream:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return responses.StreamingResponse(_stream(run, body, rid, kind, service.model_name),
                                       media_type="text/event-stream")
  async for _ in run.updates():
    pass
  if chat:
    choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish,
                "logprobs": None} for i, c in enumerate(run.choices)]
  else:
    choices = [{"index": i, "text": c.text, "finish_reason": c.finish, "logprobs": None}
               for i, c in enumerate(run.choices)]
  return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
          "model": service.model_name, "choices": choices, "usage": run.usage()}


def build_app(service: Service, lifespan=None) -> fastapi.FastAPI:
  """The FastAPI application: the three routes and the OpenAI-style error handlers."""
  app = fastapi.FastAPI(title="meshlm", lifespan=lifespan)

  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    del request
    return error_response(e.status, e.message, e.kind, e.param)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def _invalid(request, e):
    del request
    message, param = _describe(list(e.errors()))
    return error_response(400, message, param=param)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                        "owned_by": "meshlm"}]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest):
    service.check_model(body.model)
    return await _answer(service, body, service.prompt_ids(body.prompt), (service.tokenizer.eos_id,), chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatRequest):
    service.check_model(body.model)
    prompt, stop_ids = service.chat_ids(body.messages)
    return await _answer(service, body, prompt, stop_ids, chat=True)

  return app
