"""Held-out quality of the preference recipes per pair family (the learning targets of reward_tiny and dpo_tiny).

  JAX_PLATFORMS=cpu python benchmarks/preference_eval.py [--reward runs/reward_tiny] [--dpo runs/dpo_tiny]
      [--reference runs/sft_tiny] [--pairs 400]

Scores the first `--pairs` held-out pairs of `builtin:preference` (data/preference.py, the instruct task's
prompt-hash split, about 100 per family) and prints one JSON object:
  reward: pairwise accuracy of the reward run (fraction of pairs with r_chosen > r_rejected, scored with
          train.rundir.reward.load_scorer on the pair rendered as a chat record, as in training), overall and per family;
  dpo:    TRL's implicit-reward accuracy of the DPO run against the reference run (the fraction of pairs with
          [log pi(c) - log pi_ref(c)] - [log pi(r) - log pi_ref(r)] > 0, completion tokens only), overall and per
          family, and `kl`: KL(pi || pi_ref) summed over each sequence's completion tokens, averaged over the
          sequences (the recipe's eval_kl), overall and per family.
A run left out (empty flag) is skipped.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import parallel  # noqa: E402
from data import preference  # noqa: E402
from data import tokenizer as tokenizer_lib  # noqa: E402
from model import logprobs  # noqa: E402
from train.rundir import chat as chat_run  # noqa: E402
from train.rundir import reward as reward_api  # noqa: E402
from train.rundir import restore  # noqa: E402
from train.objectives import dpo as dpo_objective  # noqa: E402


def held_out_pairs(count: int) -> list[dict]:
  """The first `count` held-out pairs of the built-in task (the recipes' `pairs=builtin:preference`)."""
  task = preference.PreferenceTask("pairs")
  return [json.loads(task[int(i)]) for i in task.split_indices("eval")[:count]]


def _by_family(values, families) -> dict[str, float]:
  groups = collections.defaultdict(list)
  for v, f in zip(values, families):
    groups[f].append(v)
  return {f: round(float(np.mean(v)), 4) for f, v in sorted(groups.items())}


def reward_accuracy(workdir: str, pairs: list[dict]) -> dict:
  score = reward_api.load_scorer(workdir)
  chosen, rejected = ([json.dumps({"prompt": p["prompt"], "completion": p[side]}) for p in pairs]
                      for side in ("chosen", "rejected"))
  correct = np.array(score(chosen)) > np.array(score(rejected))
  families = [p["family"] for p in pairs]
  return {"accuracy": round(float(correct.mean()), 4), "per_family": _by_family(correct, families),
          "pairs": len(pairs)}


def _completion_stats(policy: restore.Run, reference: restore.Run, pairs: list[dict], rows: int = 32):
  """(policy - reference completion log-prob [P, 2] (chosen, rejected), KL summed over completion tokens [P, 2])."""
  tokenizer = tokenizer_lib.load(policy.tokenizer_path)
  template = chat_run.template_for_run(policy.config, tokenizer, policy.chat_template)
  encoder = preference.PairEncoder(template, int(policy.config.train.seq_len), tokenizer.pad_id, strict=True)
  graphdef, policy_params = nnx.split(policy.model)
  _, reference_params = nnx.split(reference.model)

  @jax.jit
  def stats(policy_params, reference_params, inputs_BL, targets_BL, segments_BL, positions_BL, mask_BL):
    with parallel.activate(policy.mesh, policy.rules, inside_jit=True):
      logits = [nnx.merge(graphdef, p)(inputs_BL, segments_BL, positions_BL)
                for p in (policy_params, reference_params)]
    logp = [logprobs.sequence_logprobs(x, targets_BL, mask_BL)["sum"][:, 0] for x in logits]
    return logp[0] - logp[1], jnp.sum(dpo_objective.token_kl(*logits) * mask_BL, axis=1)

  ratio, kl = [], []
  for start in range(0, len(pairs), rows):
    encoded = [encoder(json.dumps(p)) for p in pairs[start:start + rows]]
    encoded += [encoded[0]] * (rows - len(encoded))  # filler rows, dropped below
    arrays = {k: np.stack([e[f"{side}_{k}"] for e in encoded for side in preference.SIDES])
              for k in preference.TOKEN_KEYS}
    with parallel.activate(policy.mesh, policy.rules):
      r, k = stats(policy_params, reference_params, *(jnp.asarray(arrays[key]) for key in
                                                        ("inputs", "targets", "segment_ids", "positions", "loss_mask")))
    n = min(rows, len(pairs) - start)
    ratio.append(np.asarray(r).reshape(rows, 2)[:n])
    kl.append(np.asarray(k).reshape(rows, 2)[:n])
  return np.concatenate(ratio), np.concatenate(kl)


def dpo_accuracy(workdir: str, reference_dir: str, pairs: list[dict]) -> dict:
  ratio_P2, kl_P2 = _completion_stats(restore.load_run(workdir), restore.load_run(reference_dir), pairs)
  correct = ratio_P2[:, 0] - ratio_P2[:, 1] > 0
  families = [p["family"] for p in pairs]
  return {"reward_accuracy": round(float(correct.mean()), 4), "per_family": _by_family(correct, families),
          "kl": round(float(kl_P2.mean()), 3), "kl_per_family": _by_family(kl_P2.mean(axis=1), families),
          "pairs": len(pairs)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--reward", default="runs/reward_tiny", help="reward run ('' = skip)")
  p.add_argument("--dpo", default="runs/dpo_tiny", help="DPO run ('' = skip)")
  p.add_argument("--reference", default="runs/sft_tiny", help="the DPO run's reference (its starting run)")
  p.add_argument("--pairs", type=int, default=400, help="held-out pairs scored")
  args = p.parse_args()
  pairs = held_out_pairs(args.pairs)
  out = {}
  if args.reward:
    out["reward"] = reward_accuracy(args.reward, pairs)
  if args.dpo:
    out["dpo"] = dpo_accuracy(args.dpo, args.reference, pairs)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
