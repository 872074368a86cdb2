"""The whole lifecycle on this CPU (`python -m train.lifecycle --config=lifecycle_tiny`): raw text through curation,
a tokenizer, pretraining, supervised fine-tuning, DPO, an evaluation of every model and an exported Hugging Face
directory with its model card (docs/lifecycle.md).

Sections: `lifecycle` (the stage sequence and the card's license) and one per stage. A stage section holds the
lifecycle's own keys for it and `config`: keys of the stage's own command (`python -m data.curate`, `python -m
train --config=<recipe>`, ...), given on the command line as `--config.<stage>.<key>=VALUE` (e.g.
`--config.pretrain.train.steps=100`, `--config.curate.minhash.threshold=0.7`), checked against that command's
config before anything runs.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.lifecycle = ml_collections.ConfigDict(dict(
      stages="curate,tokenizer,pretrain,sft,reward,dpo,evaluate,export",  # in order; also: rl
      license="apache-2.0",  # the model card's license
      # on several hosts (the same command on each; docs/lifecycle.md): where process 0 listens for the others
      # ("" = JAX_COORDINATOR_ADDRESS's host at its port + 1) and how long each waits for the others to start
      pod_address="", pod_timeout_s=900))
  # raw text: "builtin" writes the built-in corpus (Python's own documentation and sources) as JSONL with planted
  # exact and near duplicates and junk (curation has work), holding `heldout` documents out for perplexity;
  # or input glob(s) of the user's own JSONL / text / WET files
  c.curate = ml_collections.ConfigDict(dict(
      input="builtin", documents=0, heldout=40, duplicates=0.05, junk=0.05,
      config=ml_collections.ConfigDict(dict(num_workers=1))))
  c.tokenizer = ml_collections.ConfigDict(dict(vocab_size=2048, model_type="bpe", max_sentences=20000))
  c.pretrain = ml_collections.ConfigDict(dict(
      recipe="tiny", config=ml_collections.ConfigDict(dict(
          train=ml_collections.ConfigDict(dict(steps=400, eval_every=100)),
          checkpoint=ml_collections.ConfigDict(dict(every=100))))))
  c.sft = ml_collections.ConfigDict(dict(
      recipe="sft_tiny", config=ml_collections.ConfigDict(dict(
          train=ml_collections.ConfigDict(dict(steps=600, eval_every=200))))))
  c.reward = ml_collections.ConfigDict(dict(
      recipe="reward_tiny", config=ml_collections.ConfigDict(dict(
          train=ml_collections.ConfigDict(dict(steps=200, eval_every=100))))))
  c.dpo = ml_collections.ConfigDict(dict(
      recipe="dpo_tiny", config=ml_collections.ConfigDict(dict(
          train=ml_collections.ConfigDict(dict(steps=150, eval_every=50))))))
  c.rl = ml_collections.ConfigDict(dict(recipe="grpo_tiny", config=ml_collections.ConfigDict()))
  # every model-changing stage (pretrain, sft, dpo, rl) is evaluated on the same tasks: held-out perplexity of the
  # held-out raw documents, exact match of greedy chat answers to the built-in tasks' held-out prompts
  # (`per_family` per task family), and `tasks` (NAME:PATH[,...] as python -m train.evaluate --tasks takes them,
  # e.g. crows_pairs:FILE, toxicity:FILE) with `toxicity_scorer`
  c.evaluate = ml_collections.ConfigDict(dict(
      per_family=16, max_new_tokens=24, tasks="", toxicity_scorer="", samples=4, batch_size=16))
  c.export = ml_collections.ConfigDict(dict(dtype="float32"))
  return c
