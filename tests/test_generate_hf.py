"""Greedy generation equals transformers' generate(do_sample=False) token for token (random-weight Llama and
Mistral loaded through model.hf.load; several prompt lengths in one meshlm batch)."""
import numpy as np
import pytest
import torch
import transformers

from model import generate as gen
from model import hf

PROMPTS = [[5, 17, 30], [7, 1, 8, 3, 3, 4, 10, 11, 12, 60, 61], [40, 2, 9, 90, 33, 12]]
NEW = 12


def _random_hf_model(model_type, **overrides):
  base = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
  base.update(overrides)
  config_cls = transformers.MistralConfig if model_type == "mistral" else transformers.LlamaConfig
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config_cls(**base), attn_implementation="eager")
  model = model.float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
  return model


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", dict(rope_theta=500000.0)),
    # A window shorter than prompt + continuation: decoding must keep masking past it.
    ("mistral", dict(sliding_window=6, num_key_value_heads=1)),
])
def test_greedy_equals_transformers_generate(model_type, overrides, tmp_path):
  ref = _random_hf_model(model_type, **overrides)
  ref.save_pretrained(tmp_path)
  ours = gen.generate(hf.load(str(tmp_path)), PROMPTS, NEW, stop_ids=(2,))
  for prompt, got in zip(PROMPTS, ours):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    if 2 in want:  # transformers pads a finished single row no further; cut after its EOS like meshlm does
      want = want[:want.index(2) + 1]
    assert got == want
  assert sum(len(t) for t in ours) > 2 * NEW  # the comparison covers long continuations, not just early stops
