"""Curation on a real multi-node Ray cluster started by the test (ray.cluster_utils.Cluster: a head with no CPUs and
worker nodes, each its own raylet): the output equals the local executor's file for file, and a worker node killed
while it writes a shard loses and duplicates nothing (Ray retries the task on another node; the shard's atomic
writes and markers make the retry a clean redo); the tokenized cache built by Ray tasks equals the local build."""
import glob
import json
import os
import random
import threading
import time

import pytest

import curate_corpus
from data import pretokenize
from data import tokenizer as tokenizer_lib
from data.curate import executors
from data.curate import pipeline

pytestmark = pytest.mark.slow  # Ray nodes are processes: ~10 s to start a cluster

WORDS = ("the a of and to in that with for on at from by river town market winter garden old bridge quiet morning "
         "rain bakery bread window street teacher children school lesson story night lamp harbour boat fisher wind "
         "hill farm field summer evening song village church bell clock square tower museum painting artist light "
         "road travel train station ticket journey mountain snow forest path letter friend neighbour door kitchen "
         "walked opened found carried watched wrote built painted sang waited remembered").split()


def _doc(rng):
  return "\n".join(" ".join(rng.choice(WORDS) for _ in range(25)).capitalize() + "." for _ in range(4))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Six shards; the first is large (so a kill lands while it is written) and later shards repeat some documents."""
  root = tmp_path_factory.mktemp("raycorpus")
  rng = random.Random(0)
  shards = [[{"id": f"{s}-{i}", "text": _doc(rng)} for i in range(3000 if s == 0 else 40)] for s in range(6)]
  for s in range(1, 6):
    shards[s] += [dict(shards[0][s], id=f"copy-{s}")]
  for s, docs in enumerate(shards):
    with open(root / f"part-{s}.jsonl", "w") as f:
      f.writelines(json.dumps(d) + "\n" for d in docs)
  return root


def _config(corpus, out):
  return curate_corpus.curate_input_config(corpus / "part-*.jsonl", out, dedup__min_length=100,
                                           quality__min_words=40, perplexity__enabled=False)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_multi_node_cluster_equals_local_and_survives_a_killed_node(corpus, tmp_path):
  import ray
  from ray.cluster_utils import Cluster
  pipeline.run(_config(corpus, tmp_path / "local"))
  local = curate_corpus.output_tree(tmp_path / "local")
  cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # tasks run on worker nodes only
  try:
    nodes = [cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cfg = _config(corpus, tmp_path / "cluster")
    cfg.executor = "ray"
    pipeline.run(cfg, executor=executors.make_executor(cfg))
    assert curate_corpus.output_tree(tmp_path / "cluster") == local
    # The tokenized cache's shards as Ray tasks on the same nodes: the same bytes as built in this process.
    tok = tokenizer_lib.train([_doc(random.Random(i)) for i in range(200)], str(tmp_path / "tok.model"), 512)
    spec = f"crawl=jsonl:{corpus}/part-*.jsonl"
    pretokenize.build(spec, tok, str(tmp_path / "cache_local"), shard_docs=500)
    pretokenize.build(spec, tok, str(tmp_path / "cache_ray"), shard_docs=500, executor=executors.make_executor(cfg))
    assert curate_corpus.output_tree(tmp_path / "cache_ray" / "crawl") == curate_corpus.output_tree(
        tmp_path / "cache_local" / "crawl")
    # Kill the node that is writing the big shard (the only worker node left); a fresh one joins after.
    cluster.remove_node(nodes[1])
    cfg.output = str(tmp_path / "killed")
    done: dict = {}
    runner = threading.Thread(target=lambda: done.setdefault("stats", pipeline.run(
        cfg, executor=executors.make_executor(cfg))))
    runner.start()
    scored = os.path.join(cfg.output, pipeline.WORK, "scored")
    deadline = time.time() + 120
    while not glob.glob(os.path.join(scored, "00000.jsonl.tmp-*")) and time.time() < deadline:
      time.sleep(0.005)
    writing = glob.glob(os.path.join(scored, "00000.jsonl.tmp-*"))
    assert writing and not os.path.exists(os.path.join(scored, "00000.jsonl")), "no kill mid-shard"
    cluster.remove_node(nodes[0])  # its tasks wait for a node with a CPU: the one added next
    cluster.add_node(num_cpus=1)
    runner.join(300)
    assert "stats" in done
    assert curate_corpus.output_tree(tmp_path / "killed") == local  # nothing lost, nothing twice
    assert os.path.exists(writing[0]), "the killed attempt's partial file is left in _work, never in the output"
  finally:
    ray.shutdown()
    cluster.shutdown()
