"""Shared by the chat / SFT tests: a small text corpus, conversations, and the meshlm template written by hand."""
TEXT = ["The quick brown fox jumps over the lazy dog.", "What is 12 + 30? It is 42.", "Reverse the letters: a b c",
        "Sorting digits and converting units are small tasks.", "You are a helpful assistant. Hello there!"] * 40
CHATS = [
    {"family": "mixed",
     "messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"},
                  {"role": "user", "content": "Reverse: a b c"}, {"role": "assistant", "content": "c b a"}]},
    {"family": "greeting", "prompt": "Hello there!", "completion": "Hello."},
    {"family": "sorting",
     "messages": [{"role": "user", "content": "Sort the digits: 3 1 2"}, {"role": "assistant", "content": "1 2 3"}]},
]


def expected(tok, messages):
  """The meshlm template written out by hand: BOS, then <|role|> content <|end_of_turn|> per message; the loss
  flags are on each assistant turn's content and end-of-turn marker."""
  ids, flags = [tok.bos_id], [0]
  for m in messages:
    body = tok.encode(m["content"]) + [tok.special_id("<|end_of_turn|>")]
    ids += [tok.special_id(f"<|{m['role']}|>")] + body
    flags += [0] + [int(m["role"] == "assistant")] * len(body)
  return ids, flags
