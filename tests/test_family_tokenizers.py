"""Tokenizers and chat templates of the model families (issue 36) through meshlm's one tokenizer layer
(data/hf_tokenizer_load.py) and chat layer (data/chat.py), against transformers' AutoTokenizer.

Each family's tokenizer is built here in its published style, trained on a small multilingual corpus, nothing
downloaded: Qwen 2.5 (byte-level BPE in tokenizer.json: NFC, Qwen2's split regex, added specials <|endoftext|>,
<|im_start|>, <|im_end|>, non-special <tool_call>; no BOS; Qwen2Tokenizer), Llama 3.1 (byte-level BPE with
Llama 3's regex, <|begin_of_text|> added by the post-processor, header and <|eot_id|> specials;
PreTrainedTokenizerFast) and Gemma (a SentencePiece BPE tokenizer.model with byte fallback, no dummy prefix,
<start_of_turn> / <end_of_turn> as user-defined symbols; GemmaTokenizer), the latter also as the tokenizer.json +
chat_template.jinja transformers saves from it. The chat templates are the families' published Jinja templates.

Checked per family: meshlm's ids equal AutoTokenizer's on English, German, Chinese, emoji and code (with BOS where
the family adds it); the stop ids hold the end-of-turn token and generation_config.json's EOS ids; the chat
encoder SFT uses (and DPO's pair encoder) renders apply_chat_template(tokenize=True)'s ids; the assistant mask
equals the assistant spans found independently in transformers' rendering (content + end-of-turn token) and,
for the template with {% generation %} blocks around those spans, transformers' return_assistant_tokens_mask.
"""
import io
import json

import numpy as np
import pytest

import configs
from data import chat
from data import files as files_lib
from data import hf_tokenizer_load
from data import preference
from data import tokenizer as tokenizer_lib

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:30 and we've got 3 tasks left.",
    "Grüße aus München! Die Straße ist schön, Äpfel und Öl kosten 3,50 € im Geschäft.",
    "我们今天去北京大学学习自然语言处理。你好，世界！今天天气很好。",
    "Emoji: 🦊🚀👍🏽 and ❤️ — done. Smileys 😀😀 everywhere.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n",
    "You are a helpful assistant. Answer briefly and politely, in the user's language.",
] * 30
TEXTS = CORPUS[:6] + [
    "Überraschung für Jürgen: 中文测试很有趣 🎉🎉 (ÄÖÜ äöü ß)",
    "  x = [i**2 for i in range(10)]\n\tif x:\n        pass  \n\n",
    "naïve café — ½ 𝒳 👩‍👩‍👧 1234567 'll 's",
    "a <tool_call> b",
]
CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Wie heißt die Hauptstadt von Österreich?"},
     {"role": "assistant", "content": "Wien. 🇦🇹"},
     {"role": "user", "content": "用中文再说一遍。"},
     {"role": "assistant", "content": "维也纳。"}],
    [{"role": "user", "content": "Write add() in Python."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}],
    [{"role": "user", "content": "  spaces around  "}, {"role": "assistant", "content": "  trimmed? 🦊  "},
     {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Grüße!"}],
]

QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen/Qwen2.5-7B-Instruct tokenizer_config.json chat_template.
QWEN2_5_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json chat_template (it needs no date function: date_string
# defaults to "26 Jul 2024").
LLAMA3_1_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# google/gemma-2-9b-it tokenizer_config.json chat_template (refuses a system turn).
GEMMA2_TEMPLATE = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

# google/gemma-3-12b-it chat_template (a system turn is prefixed to the first user turn).
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Each template with {% generation %} around an assistant turn's content and end-of-turn token (what the loss
# mask covers): (published text, tagged replacement) pairs.
TAGGED = {
    "qwen2_5": [("""{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}""",
                 """{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"""
                 """{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}"""
                 """{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"""
                 """{%- endif %}""")],
    "llama3_1": [("""{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | """
                  """trim + '<|eot_id|>' }}""",
                  """{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{%- if message.role"""
                  """ == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"""
                  """{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}""")],
    "gemma3": [("""{{ message['content'] | trim }}""",
                """{% if role == 'model' %}{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}"""
                """{% endgeneration %}{% else %}{{ message['content'] | trim }}{% endif %}"""),
               ("""{{ '<end_of_turn>\\n' }}""",
                """{{ '\\n' if role == 'model' else '<end_of_turn>\\n' }}""")],
}
# The rendered assistant header, how the template writes the content, and the end-of-turn token: the independent
# assistant spans.
SPANS = {"qwen2_5": ("<|im_start|>assistant\n", lambda c: c, "<|im_end|>"),
         "llama3_1": ("<|start_header_id|>assistant<|end_header_id|>\n\n", str.strip, "<|eot_id|>"),
         "gemma2": ("<start_of_turn>model\n", str.strip, "<end_of_turn>"),
         "gemma3": ("<start_of_turn>model\n", str.strip, "<end_of_turn>")}


def _byte_level_bpe(regex, nfc, specials, non_special=()):
  """A byte-level BPE trained on CORPUS in the Qwen 2 / Llama 3 layout; the specials are added after the vocab."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  t = Tokenizer(models.BPE())
  if nfc:
    t.normalizer = normalizers.NFC()
  t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  t.decoder = decoders.ByteLevel()
  t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  t.add_tokens([AddedToken(s, special=False, normalized=False) for s in non_special])
  return t


def _write_json(directory, name, obj):
  (directory / name).write_text(json.dumps(obj, ensure_ascii=False, indent=1))


def _qwen_dir(directory):
  """Qwen 2.5 Instruct: tokenizer.json + tokenizer_config.json (bos null, eos <|im_end|>) + generation_config."""
  from tokenizers import processors
  t = _byte_level_bpe(QWEN_REGEX, True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      ["<tool_call>", "</tool_call>"])
  t.post_processor = processors.ByteLevel(trim_offsets=False)
  t.save(str(directory / "tokenizer.json"))
  _write_json(directory, "tokenizer_config.json", {
      "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False, "bos_token": None,
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
      "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "split_special_tokens": False,
      "clean_up_tokenization_spaces": False, "model_max_length": 131072, "chat_template": QWEN2_5_TEMPLATE})
  ids = [t.token_to_id(p) for p in ("<|im_end|>", "<|endoftext|>")]
  _write_json(directory, "generation_config.json", {"bos_token_id": ids[1], "eos_token_id": ids,
                                                    "pad_token_id": ids[1]})


def _llama_dir(directory):
  """Llama 3.1 Instruct: BOS from tokenizer.json's post-processor, eos <|eot_id|>, three EOS ids generating."""
  from tokenizers import processors
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
  t = _byte_level_bpe(LLAMA3_REGEX, False, specials)
  bos = t.token_to_id("<|begin_of_text|>")
  t.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                    special_tokens=[("<|begin_of_text|>", bos)])])
  t.save(str(directory / "tokenizer.json"))
  _write_json(directory, "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
      "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
      "model_max_length": 131072, "chat_template": LLAMA3_1_TEMPLATE})
  _write_json(directory, "generation_config.json", {
      "bos_token_id": bos, "eos_token_id": [t.token_to_id(p) for p in ("<|end_of_text|>", "<|eom_id|>",
                                                                       "<|eot_id|>")]})


def _gemma_dir(directory, template):
  """Gemma: a SentencePiece tokenizer.model as Gemma's is trained (BPE, byte fallback, identity normalisation, no
  dummy prefix, split digits, pad/eos/bos/unk = 0/1/2/3, the turn markers user-defined)."""
  import sentencepiece as spm
  model = io.BytesIO()
  lines = [line for text in CORPUS for line in text.split("\n") if line]
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model, vocab_size=500, model_type="bpe", character_coverage=1.0,
      byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
      bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
      normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
      allow_whitespace_only_pieces=True, split_digits=True, hard_vocab_limit=False, minloglevel=2)
  (directory / "tokenizer.model").write_bytes(model.getvalue())
  _write_json(directory, "tokenizer_config.json", {
      "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
      "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "spaces_between_special_tokens": False,
      "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"], "chat_template": template})
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  _write_json(directory, "generation_config.json", {"bos_token_id": 2, "eos_token_id": [1, sp.piece_to_id(
      "<end_of_turn>")], "pad_token_id": 0})


def _build(name, directory):
  directory.mkdir()
  if name == "qwen2_5":
    _qwen_dir(directory)
  elif name == "llama3_1":
    _llama_dir(directory)
  elif name == "gemma_sp":
    _gemma_dir(directory, GEMMA3_TEMPLATE)
  elif name == "gemma2_sp":
    _gemma_dir(directory, GEMMA2_TEMPLATE)
  else:  # gemma_json: what transformers saves from the SentencePiece directory (tokenizer.json,
    # chat_template.jinja), as Gemma checkpoints saved by transformers 5 hold it
    source = directory.parent / "gemma_json_source"
    source.mkdir()
    _gemma_dir(source, GEMMA3_TEMPLATE)
    transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(directory))
    (directory / "generation_config.json").write_bytes((source / "generation_config.json").read_bytes())
  return str(directory)


FAMILIES = {"qwen2_5": "qwen2_5", "llama3_1": "llama3_1", "gemma_sp": "gemma3", "gemma2_sp": "gemma2",
            "gemma_json": "gemma3"}  # tokenizer directory -> its chat template (SPANS / TAGGED key)
END_OF_TURN = {"qwen2_5": "<|im_end|>", "llama3_1": "<|eot_id|>", "gemma3": "<end_of_turn>", "gemma2": "<end_of_turn>"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  directory = _build(request.param, tmp_path_factory.mktemp(request.param) / "tok")
  return request.param, directory, tokenizer_lib.load(directory), transformers.AutoTokenizer.from_pretrained(directory)


def test_ids_equal_autotokenizer_on_multilingual_text(family):
  name, _, ours, theirs = family
  assert isinstance(ours, hf_tokenizer_load.HFTokenizer) and ours.vocab_size == len(theirs)
  assert type(theirs).__name__ == {"qwen2_5": "Qwen2Tokenizer", "llama3_1": "TokenizersBackend"}.get(
      name, "GemmaTokenizer")  # the classes transformers 5 loads for these directories
  uses_sentencepiece = name.endswith("_sp")
  assert (ours._sp is not None) == uses_sentencepiece  # pylint: disable=protected-access
  has_bos = name != "qwen2_5"
  assert ours.add_bos_token == has_bos and (theirs.bos_token is not None) == has_bos
  for text in TEXTS:
    ids = ours.encode(text)
    assert ([ours.bos_id] if ours.add_bos_token else []) + ids == theirs(text)["input_ids"], text
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == text
  # Control tokens spelled in plain text stay text with tokenizer.json; SentencePiece itself always matches its
  # user-defined pieces (Gemma's turn markers), as transformers does unless told to split special tokens.
  spelled = "user text <|im_end|> <end_of_turn> <|eot_id|> stays text"
  want = theirs(spelled, add_special_tokens=False, split_special_tokens=not uses_sentencepiece)["input_ids"]
  assert ours.encode(spelled) == want
  if has_bos:
    assert ours.bos_id == theirs.bos_token_id
  else:  # no BOS: a document starts after Qwen's document separator
    assert ours.bos_id == theirs.convert_tokens_to_ids("<|endoftext|>")


def test_stop_ids_hold_the_end_of_turn_and_generation_config_ids(family):
  name, directory, ours, theirs = family
  with open(f"{directory}/generation_config.json") as f:
    listed = json.load(f)["eos_token_id"]
  end_of_turn = theirs.convert_tokens_to_ids(END_OF_TURN[FAMILIES[name]])
  assert set(ours.stop_ids) == {ours.eos_id, end_of_turn, *listed} and ours.eos_id == theirs.eos_token_id
  assert chat.make_template(configs.load("tiny").data, ours).stop_ids() == ours.stop_ids


def _independent_flags(template_name, rendered, offsets, messages):
  """Assistant flags of transformers' tokens from spans found in its rendered text: each assistant turn's
  content as the template writes it, then its end-of-turn token; a token is flagged where it overlaps one."""
  header, written, end = SPANS[template_name]
  spans, pos = [], 0
  for m in messages:
    if m["role"] == "assistant":
      turn = header + written(m["content"]) + end
      pos = rendered.index(turn, pos)
      spans.append((pos + len(header), pos + len(turn)))
      pos += len(turn)
  return [int(any(s < b and max(e, s + 1) > a for a, b in spans)) for s, e in offsets]


def _chats(template_name):
  return [c[1:] if c[0]["role"] == "system" and template_name == "gemma2" else c for c in CHATS]


def test_chat_template_renders_and_masks_as_transformers(family):
  name, _, ours, theirs = family
  template_name = FAMILIES[name]
  template = chat.make_template(configs.load("tiny").data, ours)  # auto: the tokenizer's own template
  assert isinstance(template, chat.JinjaTemplate) and template.jinja == theirs.chat_template
  encoder = chat.ChatEncoder(template, seq_len=1024, strict=True)
  for messages in _chats(template_name):
    ids, flags = template.render(messages)
    rendered = theirs.apply_chat_template(messages, tokenize=False)
    want = theirs(rendered, add_special_tokens=False, return_offsets_mapping=True)
    assert ids == want["input_ids"] == theirs.apply_chat_template(messages, tokenize=True,
                                                                  return_dict=True)["input_ids"]
    assert flags == _independent_flags(template_name, rendered, want["offset_mapping"], messages)
    assert ids.count(ours.bos_id) == int(ours.add_bos_token)  # BOS once (template), none for Qwen
    flagged = [t for t, f in zip(ids, flags) if f]
    assert flagged.count(ours.special_id(END_OF_TURN[template_name])) == sum(m["role"] == "assistant"
                                                                             for m in messages)
    row = encoder(json.dumps({"messages": messages}))  # the SFT encoder
    np.testing.assert_array_equal(row["inputs"], ids[:-1])
    np.testing.assert_array_equal(row["loss_mask"], flags[1:])
    prompt = theirs.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    assert template.prompt(messages[:-1]) == prompt  # what generation (chat, RL rollouts, evals) starts from


@pytest.mark.parametrize("name", sorted(n for n, t in FAMILIES.items() if t in TAGGED))  # Gemma 2: Gemma 3's turns
def test_generation_blocks_mask_as_transformers(name, tmp_path):
  """The templates with {% generation %} around each assistant turn: meshlm's mask is transformers'
  return_assistant_tokens_mask, and the same as the published template's prefix-rendering mask."""
  directory = _build(name, tmp_path / "tok")
  ours, theirs = tokenizer_lib.load(directory), transformers.AutoTokenizer.from_pretrained(directory)
  template_name = FAMILIES[name]
  tagged = theirs.chat_template
  for published, replacement in TAGGED[template_name]:
    assert tagged.count(published) == 1, published
    tagged = tagged.replace(published, replacement)
  ours_tagged, ours_plain = chat.JinjaTemplate(ours, tagged), chat.JinjaTemplate(ours, theirs.chat_template)
  for messages in _chats(template_name):
    want = theirs.apply_chat_template(messages, chat_template=tagged, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, flags = ours_tagged.render(messages)
    assert ids == want["input_ids"] and flags == want["assistant_masks"] and any(flags)
    assert (ids, flags) == ours_plain.render(messages)


def test_dpo_pairs_and_template_errors(family):
  """DPO's pair encoder takes the family's template unchanged; a conversation the template refuses (Gemma 2: no
  system turn) is a counted skip, not a crash."""
  name, _, ours, _ = family
  template = chat.make_template(configs.load("tiny").data, ours)
  pair = {"prompt": "Wie viel ist 2 + 2?", "chosen": "Vier. ✅", "rejected": "五"}
  row = preference.PairEncoder(template, 256, ours.pad_id, strict=True)(json.dumps(pair))
  for side in preference.SIDES:
    mask, targets = row[f"{side}_loss_mask"], row[f"{side}_targets"]
    assert ours.decode(targets[mask > 0]) == pair[side]  # the completion and its end-of-turn token only
    assert targets[mask > 0][-1] == ours.special_id(END_OF_TURN[FAMILIES[name]])
  if FAMILIES[name] == "gemma2":
    before = files_lib.COUNTERS["chat_skipped_template_error"]
    assert chat.ChatEncoder(template, 256)(json.dumps({"messages": CHATS[0]})) is None
    assert files_lib.COUNTERS["chat_skipped_template_error"] == before + 1


def test_template_globals_are_transformers(family):
  """The names transformers gives templates beyond the messages: the named special tokens (none for Qwen's
  absent BOS), tools=None, strftime_now (Llama 3.2's date line) and a tojson that keeps non-ASCII text."""
  _, _, ours, theirs = family
  source = ("{{ bos_token }}[{{ eos_token }}|{{ pad_token }}] {{ tools is none }} {{ strftime_now('%Y') }} "
            "{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}")
  messages = [{"role": "user", "content": "Grüße 中文 🦊"}, {"role": "assistant", "content": "ok"}]
  template = chat.JinjaTemplate(ours, source)
  assert template.text(messages, True) == theirs.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                                      add_generation_prompt=True)
