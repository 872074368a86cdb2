"""One remat policy table (model/remat.py) serves both the model's jax.checkpoint policies and the planner's
activation-memory model (train/planning/memory.py)."""
import configs
from model import remat
from train.planning import memory


def test_one_remat_table_drives_the_model_and_the_memory_model():
  for name, policy in remat.POLICIES.items():
    assert set(policy.keeps) <= set(remat.GROUPS), name
    assert "input" in policy.keeps, name  # the scan carry is always kept
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
