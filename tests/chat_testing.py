"""Shared by the chat / SFT tests: a small text corpus, conversations, the meshlm template written by hand, and a
Hugging Face tokenizer directory."""
import json

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


def hf_tokenizer_dir(tmp_path):
  """A small tokenizers-library BPE with Llama-3-style specials and a Llama-3-style Jinja chat template."""
  import tokenizers
  from tokenizers import models, pre_tokenizers, decoders, trainers
  t = tokenizers.Tokenizer(models.BPE())
  t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.decoder = decoders.ByteLevel()
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
  t.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  directory = tmp_path / "hf"
  directory.mkdir()
  t.save(str(directory / "tokenizer.json"))
  template = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
      "chat_template": template}))
  return str(directory)
