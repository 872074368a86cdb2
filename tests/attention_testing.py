"""Shared test reference: attention under an explicit boolean mask, written as loops (float64)."""
import numpy as np


def brute_force_attention(q, k, v, mask):
  """o[b, t, h] = softmax over the keys s with mask[b, t, s] of q.k / sqrt(K), applied to v (kv head h // rep)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros_like(q)
  rep = q.shape[2] // k.shape[2]
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      for t in range(q.shape[1]):
        keys = np.flatnonzero(mask[b, t])
        scores = np.array([q[b, t, h] @ k[b, s, h // rep] for s in keys]) / np.sqrt(q.shape[-1])
        p = np.exp(scores - scores.max())
        out[b, t, h] = (p / p.sum()) @ v[b, keys, h // rep]
  return out
