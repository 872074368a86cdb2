"""`python -m train.serve` with the official openai client on localhost: completions and chat completions equal
`train.generate`'s text, streamed deltas concatenate to it, 16 concurrent clients are all answered, bad requests
get 400s naming the problem, SIGTERM lets an in-flight stream finish and exits 0. Also the worker's admission
limits and the incremental detokenizer against one-shot decoding."""
import concurrent.futures
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from data import detokenize
from data import tokenizer as tokenizer_lib
import ports
from test_generate_cli import run  # noqa: F401  (the module's run directory fixture)
from train.rundir import generate as cli
from train.serve import worker as worker_lib

PROMPTS = ["def main(", "The quick brown fox", "import os\nimport sys", "x"]


def _expected(capsys, workdir, prompt, n):
  assert cli.main(["--workdir", workdir, "--prompt", prompt, "--max_new_tokens", str(n), "--json"]) == 0
  return json.loads(capsys.readouterr().out)["completions"][0]


def _expected_chat(capsys, monkeypatch, workdir, text, n):
  monkeypatch.setattr(sys, "stdin", io.StringIO(text + "\n"))
  assert cli.main(["--workdir", workdir, "--chat", "--max_new_tokens", str(n)]) == 0
  return capsys.readouterr().out[:-1]


def _post(port, path, data: bytes):
  request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


@pytest.fixture
def server(run):  # noqa: F811
  workdir = run[0]
  port = ports.free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.Popen([sys.executable, "-m", "train.serve", "--workdir", workdir, "--port", str(port),
                           "--max_seqs", "8", "--served_model_name", "tiny", "--no_warmup"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  lines = []
  threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
  deadline = time.time() + 240
  while True:
    try:
      client.models.list()
      break
    except openai.APIConnectionError:
      assert proc.poll() is None and time.time() < deadline, "".join(lines)
      time.sleep(0.5)
  yield proc, client, port, workdir, lines
  if proc.poll() is None:
    proc.kill()


def test_openai_client_completions_chat_streaming_concurrency_errors_and_sigterm(server, capsys, monkeypatch):
  proc, client, _, workdir, _ = server
  assert [m.id for m in client.models.list().data] == ["tiny"]
  want = {p: _expected(capsys, workdir, p, 12) for p in PROMPTS}
  for p in PROMPTS[:2]:
    got = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
    assert got.choices[0].text == want[p] and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    stream = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True)
    deltas = [c.choices[0].text for c in stream]
    assert len(deltas) > 2 and "".join(deltas) == want[p]

  answer = _expected_chat(capsys, monkeypatch, workdir, "hello there", 10)
  messages = [{"role": "user", "content": "hello there"}]
  chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
  assert chat.choices[0].message.content == answer
  stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                          stream=True, stream_options={"include_usage": True})
  chunks = list(stream)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
  assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

  # A stop string ends the text at its first occurrence (not included).
  stop = want[PROMPTS[0]][3:5]
  cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
  assert cut.choices[0].text == want[PROMPTS[0]][:want[PROMPTS[0]].find(stop)]
  assert cut.choices[0].finish_reason == "stop"

  # 16 clients at once (the server decodes 8 at a time, the rest queue): every answer is the lone answer.
  def ask(i):
    p = PROMPTS[i % len(PROMPTS)]
    return p, client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    answers = list(pool.map(ask, range(16)))
  assert all(text == want[p] for p, text in answers)
  assert proc.poll() is None

  _bad_requests_get_errors_naming_the_problem(server[2], client)
  _sigterm_lets_the_stream_in_flight_finish_and_exits_0(proc, client, _expected(capsys, workdir, PROMPTS[1], 40),
                                                        server[4])


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 4, "colour": 1}', 400, "unknown parameter 'colour'"),
    (b'{"model": "tiny", "prompt": "x", "logprobs": 2}', 400, "'logprobs' is not supported"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 500}', 400, "exceeds model.max_seq_len=64.*max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny"}', 400, "missing required parameter 'prompt'"),
    (b'{"model": "gpt-9", "prompt": "x"}', 404, "model 'gpt-9' does not exist"),
]


def _bad_requests_get_errors_naming_the_problem(port, client):
  for body, status, message in BAD:
    code, out = _post(port, "/v1/completions", body)
    assert code == status and re.search(message, out["error"]["message"]), out
  code, out = _post(port, "/v1/chat/completions", b'{"model": "tiny", "messages": []}')
  assert code == 400 and "messages" in out["error"]["message"]
  with pytest.raises(openai.BadRequestError, match="not supported"):
    client.completions.create(model="tiny", prompt="x", presence_penalty=1.0)


def _sigterm_lets_the_stream_in_flight_finish_and_exits_0(proc, client, want, lines):
  stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True)
  chunks = [next(iter(stream))]
  proc.send_signal(signal.SIGTERM)
  chunks += list(stream)
  assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "length"
  assert proc.wait(timeout=60) == 0, "".join(lines)


class _Engine:
  """What the worker reads of an engine before it starts: its limits and `check`."""
  max_seqs, max_len = 1, 8

  def check(self, prompt, max_new_tokens, **_):
    if len(prompt) + max_new_tokens > self.max_len:
      raise ValueError("too long")


def test_worker_refuses_past_max_seqs_plus_max_queue():
  w = worker_lib.Worker(_Engine(), max_queue=1)
  sink = lambda ids, reason: None  # noqa: E731
  w.submit([1, 2], 3, sink)
  w.submit([1, 2], 3, sink)
  with pytest.raises(worker_lib.Overloaded, match="max_seqs \\+ max_queue = 2"):
    w.submit([1, 2], 3, sink)
  with pytest.raises(ValueError, match="too long"):
    w.submit([1, 2], 30, sink)


def test_detokenizer_deltas_concatenate_to_the_decoding(run):  # noqa: F811
  tok = run[2]
  text = "naïve café — 東京 🚀 done\n\tx"
  ids = tokenizer_lib.prompt_ids(tok, tok.encode(text))[1:]
  assert any(tok.id_to_piece(i).startswith("<0x") for i in ids)  # byte-fallback pieces inside characters
  detok = detokenize.Detokenizer(tok)
  deltas = [detok.push([i]) for i in ids] + [detok.flush()]
  assert "".join(deltas) == tok.decode(ids) == text
  assert not any("\ufffd" in d for d in deltas)


def test_mtp_drafts_are_refused_with_the_reason(run, capsys):  # noqa: F811
  """--draft_mtp drafts one token per step, from a model that has multi-token heads: exit 2 naming which is wrong."""
  from train.serve import main as serve_main
  assert serve_main.main(["--workdir", run[0], "--draft_mtp", "--speculative", "2"]) == 2
  assert "--speculative 1" in capsys.readouterr().err
  assert serve_main.main(["--workdir", run[0], "--draft_mtp", "--speculative", "1", "--no_warmup"]) == 2
  assert "model.mtp_depth >= 1 (this model: 0)" in capsys.readouterr().err
