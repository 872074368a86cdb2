"""Pseudo-log-likelihood scoring of a masked-LM encoder (model.causal=false; train.objective=mlm).

Salazar et al. 2020, "Masked Language Model Scoring" (ACL), eq. 1: a sequence W = w_1..w_n scores

  PLL(W) = sum_{t in scored} log P(w_t | W with w_t replaced by the mask token)

one masked copy of W per scored token (all tokens by default). CrowS-Pairs (Nangia et al. 2020, sec. 3, "metric")
scores a masked LM the same way over the tokens a pair's two sentences share (difflib's equal blocks of the two
token sequences, as the paper's code finds them), masking one shared token at a time; `crows_pairs_scores` gives
those two scores per pair, ready for evals.bias.crows_pairs (pct_stereotype = share of pairs where the more
stereotypical sentence scores higher).

Batching: the masked copies of all sequences are rows of batches of `batch_size`, right-padded to the longest
sequence rounded up to 16 (padding is its own segment, which an encoder's real tokens never see); only the masked
position is projected to the vocabulary.
"""
from __future__ import annotations

import difflib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import tokenizer as tokenizer_lib

_LENGTH_MULTIPLE = 16  # padded lengths are multiples of this, so a handful of shapes compile


@nnx.jit
def _masked_logprob(model, tokens_BL, segment_ids_BL, at_B, target_B):
  """float32 [B]: log P(target_B | tokens_BL) at position at_B of each row."""
  x_BLD = model.features(tokens_BL, segment_ids_BL)
  x_B1D = jnp.take_along_axis(x_BLD, at_B[:, None, None], axis=1)
  logp_BV = jax.nn.log_softmax(model.logits(x_B1D)[:, 0].astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp_BV, target_B[:, None], axis=1)[:, 0]


def pseudo_log_likelihood(model, sequences: Sequence[Sequence[int]], *,
                          scored: Sequence[Sequence[bool]] | None = None, mask_id: int = tokenizer_lib.MASK_ID,
                          batch_size: int = 64) -> list[float]:
  """PLL (nats) of each token sequence under the encoder `model` (module docstring); `scored[i][t]` selects the
  positions of sequence i that are masked and summed (default: all). ValueError for a causal model or a sequence
  longer than model.cfg.max_seq_len."""
  if model.cfg.causal:
    raise ValueError("pseudo-log-likelihood scores a bidirectional encoder (model.causal=false, train.objective="
                     "mlm); a causal model's logits at t do not predict token t")
  if sequences and max(len(s) for s in sequences) > model.cfg.max_seq_len:
    raise ValueError(f"a sequence of {max(len(s) for s in sequences)} tokens exceeds model.max_seq_len="
                     f"{model.cfg.max_seq_len}")
  rows = [(i, t) for i, seq in enumerate(sequences) for t in range(len(seq)) if scored is None or scored[i][t]]
  total = np.zeros(len(sequences), np.float64)
  if not rows:
    return total.tolist()
  L = -(-max(len(s) for s in sequences) // _LENGTH_MULTIPLE) * _LENGTH_MULTIPLE
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    tokens_BL = np.zeros((batch_size, L), np.int32)
    segment_ids_BL = np.zeros((batch_size, L), np.int32)
    at_B, target_B = np.zeros(batch_size, np.int32), np.zeros(batch_size, np.int32)
    for r, (i, t) in enumerate(chunk):
      n = len(sequences[i])
      tokens_BL[r, :n], segment_ids_BL[r, :n] = sequences[i], 1
      at_B[r], target_B[r] = t, sequences[i][t]
      tokens_BL[r, t] = mask_id
    logp_B = np.asarray(_masked_logprob(model, jnp.asarray(tokens_BL), jnp.asarray(segment_ids_BL),
                                        jnp.asarray(at_B), jnp.asarray(target_B)), np.float64)
    np.add.at(total, [i for i, _ in chunk], logp_B[:len(chunk)])
  return total.tolist()


def shared_positions(a: Sequence[int], b: Sequence[int]) -> tuple[list[bool], list[bool]]:
  """Flags of the tokens of `a` and of `b` in the blocks the two sequences share (difflib equal opcodes)."""
  in_a, in_b = [False] * len(a), [False] * len(b)
  for tag, a0, a1, b0, b1 in difflib.SequenceMatcher(None, list(a), list(b)).get_opcodes():
    if tag == "equal":
      in_a[a0:a1], in_b[b0:b1] = [True] * (a1 - a0), [True] * (b1 - b0)
  return in_a, in_b


def crows_pairs_scores(model, tokenizer, pairs: Sequence[tuple[str, str]], *, mask_id: int = tokenizer_lib.MASK_ID,
                       batch_size: int = 64) -> tuple[list[float], list[float]]:
  """(scores of the more stereotypical sentences, of the less): each sentence encoded as BOS + tokens and scored
  by PLL over its tokens shared with the other sentence, BOS excluded (the paper skips [CLS] and [SEP])."""
  seqs, scored = [], []
  for more, less in pairs:
    a, b = ([tokenizer.bos_id] + tokenizer.encode(s) for s in (more, less))
    in_a, in_b = shared_positions(a, b)
    seqs += [a, b]
    scored += [[False] + in_a[1:], [False] + in_b[1:]]
  pll = pseudo_log_likelihood(model, seqs, scored=scored, mask_id=mask_id, batch_size=batch_size)
  return pll[0::2], pll[1::2]
