"""One remat policy table (model/remat.py) serves both the model's jax.checkpoint policies and the planner's
activation-memory model (train/planning/memory.py)."""
import configs
from model import remat
from train.planning import memory


def test_one_remat_table_drives_the_model_and_the_memory_model():
  for name, policy in remat.POLICIES.items():
    assert set(policy.keeps) | set(policy.offloads) <= set(remat.GROUPS), name
    assert not set(policy.keeps) & set(policy.offloads), name
    assert "input" in policy.keeps + policy.offloads, name  # the scan carry is always kept, in HBM or on the host
  assert remat.POLICIES["none"].checkpoint is None
  # The memory model sizes exactly the groups the table speaks of.
  m = configs.load("tiny").model
  assert set(memory._layer_bytes(m, 128, 1)) == set(remat.GROUPS)


def _saved_names(policy: str) -> set[str]:
  """The checkpoint names a policy keeps for the backward pass of a function that tags one value with each."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.ad_checkpoint import print_saved_residuals  # pylint: disable=g-import-not-at-top

  def f(x):
    return sum(jnp.sin(remat.tag(x * (i + 1.0), name)).sum() for i, name in enumerate(remat.NAMES))

  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(jax.checkpoint(f, policy=remat.POLICIES[policy].checkpoint), jnp.ones((4,)))
  return {name for name in remat.NAMES if f"'{name}'" in buf.getvalue()}


def test_save_dot_except_mlpwi_keeps_what_maxtexts_policy_keeps():
  """MaxText's save_dot_except_mlpwi: q, k, v and the attention and MLP output projections are kept, the MLP's
  gate/up projections and everything else recomputed; the table's groups say the same."""
  assert _saved_names("save_dot_except_mlpwi") == {remat.QUERY_PROJ, remat.KEY_PROJ, remat.VALUE_PROJ,
                                                   remat.ATTN_OUT, remat.MLP_OUT}
  assert set(remat.POLICIES["save_dot_except_mlpwi"].keeps) == {"input", "qkv", "attn_out", "mlp_out"}
  assert _saved_names("full") == set()


def _residuals(policy: str):
  """(device, host) residual shapes of the tiny model's loss for `policy`, and its gradient function."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=g-import-not-at-top
  import model  # pylint: disable=g-import-not-at-top

  m = configs.load("tiny").model
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, m.vocab_size)
  graphdef, state = nnx.split(model.Transformer(m, rngs=nnx.Rngs(0), remat=policy))

  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens)
    return jnp.mean((logits[0] if isinstance(logits, tuple) else logits).astype(jnp.float32) ** 2)

  shapes = [(aval.str_short(), aval.shape) for aval, _ in saved_residuals(loss, state)]
  return ([s for t, s in shapes if "<host>" not in t], [s for t, s in shapes if "<host>" in t],
          jax.jit(jax.grad(loss)), state, m)


def test_offload_policies_keep_what_they_save_in_host_memory_with_the_same_gradients():
  """offload_qkv_out (MaxText's custom policy of its Llama 3.1 v6e recipes): every layer's input, q, k, v and the
  attention's output projection are kept in host memory, nothing layer-stacked in device memory; the gradients are
  those of the model without remat (the policy changes where values wait, not what is computed)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  device, host, grad, state, m = _residuals("offload_qkv_out")
  n, b, s, d, h, g, k = m.num_layers, 2, 16, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
  assert sorted(host) == sorted([(n, b, s, d), (n, b, s, h, k), (n, b, s, g, k), (n, b, s, g, k), (n, b, s, d)])
  assert not [shape for shape in device if shape[:2] == (n, b)]
  assert sorted(_residuals("offload_input")[1]) == [(n, b, s, d)]
  reference = _residuals("none")[2](state)
  for a, r in zip(jax.tree.leaves(grad(state)), jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-7)


def test_the_planner_moves_offloaded_groups_from_hbm_to_the_host():
  """Per layer and token, offload_qkv_out keeps D (input) + (H + 2G) K (q, k, v) + D (attention output) values on
  the host (model dtype), none of them in HBM."""
  config = configs.load("tiny", **{"train.seq_len": 64, "train.batch_size": 8})
  m, c = config.model, memory.BYTES[config.model.dtype]
  off = memory.activation_memory(config, 8, remat="offload_qkv_out")
  per_token = (2 * m.d_model + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim) * c
  assert off["host"] == per_token * off["tokens_per_device"] * m.num_layers
  assert off["per_layer_saved"] == 0
  kept = memory.activation_memory(config, 8, remat="save_qkv_proj")
  assert kept["host"] == 0 and off["total"] < kept["total"]
