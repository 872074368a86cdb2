"""`model.moe_impl=megablox` (the Pallas TPU grouped-matmul kernels, interpret mode on the CPU): the expert layer
against a per-expert loop (values and gradients) with uneven, empty and partly masked groups across several row,
contraction and output tiles; a MoE model under expert parallelism on 8 devices against `ragged`; the tiling
rule; the refusal off TPU; and the ahead-of-time TPU compile holding the Mosaic kernels."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import configs
from test_moe import _loop_reference  # the per-expert loop both files check against
import parallel
from configs import validate as config_validate
from model import experts as experts_lib
from model import megablox
from model import moe
from model.transformer import Transformer
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib

MEASURED = {}
TOL = 1e-5
# 150 tokens x top-2 = 300 rows: three row tiles of 128 with groups starting inside tiles. D = 160 and F = 48 are
# padded to 256 and 128: two contraction tiles for gate/up, two output tiles for down.
T, D, F, E, K = 150, 160, 48, 6, 2
INTERPRET = megablox.MegabloxOptions(tile_m=128, tile_k=128, tile_n=128, interpret=True)


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  # Skewed routing with expert 5 never chosen (an empty group); a fifth of the assignments dropped.
  probs = np.array([0.4, 0.05, 0.25, 0.2, 0.1, 0.0])
  experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False, p=probs) for _ in range(T)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, size=(T, K)), jnp.float32)
  w = [jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
  cot = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  keep = jnp.asarray(rng.uniform(size=(T, K)) < 0.8)
  return x, experts, weights, w, cot, keep


@pytest.mark.parametrize("first, local", [(0, E), (3, 3)], ids=["all_experts", "experts_3_to_5"])
def test_expert_layer_equals_per_expert_loop(case, first, local):
  """Values and gradients (inputs, routing weights, expert weights). experts_3_to_5: a device holding experts 3-5
  under expert parallelism: the other experts' rows are sorted past the groups and never computed."""
  x, experts, weights, w, cot, keep = case
  w = [a[first:first + local] for a in w]

  def value_and_grads(fn):
    loss = lambda *args: jnp.sum(fn(*args) * cot)
    return jax.jit(lambda *args: (fn(*args), jax.grad(loss, argnums=range(5))(*args)))(x, weights, *w)

  got, got_grads = value_and_grads(
      lambda x, wt, g, u, d: experts_lib.expert_ffn(x, experts, wt, keep, g, u, d, first, jax.nn.silu, INTERPRET))
  want, want_grads = value_and_grads(
      lambda x, wt, g, u, d: _loop_reference(x, experts, wt, keep, g, u, d, first))
  MEASURED[f"layer {first}+{local}: values"] = float(jnp.max(jnp.abs(got - want)))
  MEASURED[f"layer {first}+{local}: gradients"] = max(float(jnp.max(jnp.abs(a - b)))
                                                       for a, b in zip(got_grads, want_grads))
  np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
  for name, a, b in zip(("x", "weights", "gate", "up", "down"), got_grads, want_grads):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=name)
  sizes = np.bincount(np.asarray(experts)[np.asarray(keep)], minlength=E)
  assert sizes[5] == 0 and len(set(sizes[:5])) == 5  # an empty group, the others uneven


def test_tiling_divides_both_padded_widths():
  opts = megablox.MegabloxOptions()  # bounds 512 rows, 1024 columns
  assert megablox.tiling(opts, 8192, 4096, 14336) == ((512, 1024, 1024), (8192, 4096, 14336))
  assert megablox.tiling(opts, 8192, 4096, 1536) == ((512, 512, 512), (8192, 4096, 1536))  # gcd 512
  assert megablox.tiling(opts, 300, 160, 48) == ((384, 128, 128), (384, 256, 128))  # small: padded to 128
  assert megablox.tiling(INTERPRET, 300, 160, 48) == ((128, 128, 128), (384, 256, 128))


# ---- a MoE model under expert parallelism: data=2 x expert=4 -----------------------------------------------
def _model_config(impl):
  c = configs.load("tiny_moe")
  c.model.update(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32,
                 expert_mlp_dim=16, num_experts=8, experts_per_token=2, max_seq_len=16, moe_impl=impl)
  if impl == "megablox":
    c.model.update(pallas_interpret=True, megablox_tile_m=128, megablox_tile_k=128, megablox_tile_n=128)
  c.mesh.update(data=2, expert=4)
  return c


def _logits_and_grads(impl, tokens):
  c = _model_config(impl)
  config_validate.check(c)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  with parallel.activate(mesh, rules):
    m = Transformer(c.model, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)

    def loss(state):
      logits = nnx.merge(graphdef, state)(tokens)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return np.asarray(logits), {jax.tree_util.keystr(p): np.asarray(g)
                              for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


def test_model_under_expert_parallelism_equals_ragged():
  tokens = jnp.asarray(np.random.default_rng(3).integers(1, 128, size=(8, 16)), jnp.int32)
  logits, grads = _logits_and_grads("megablox", tokens)
  logits_ref, grads_ref = _logits_and_grads("ragged", tokens)
  MEASURED["model logits"] = float(np.max(np.abs(logits - logits_ref)))
  MEASURED["model gradients"] = max(float(np.max(np.abs(grads[k] - grads_ref[k]))) for k in grads_ref)
  np.testing.assert_allclose(logits, logits_ref, atol=TOL, rtol=0)
  assert sorted(grads) == sorted(grads_ref) and any("moe" in k and "gate" in k for k in grads)
  for k in grads_ref:
    np.testing.assert_allclose(grads[k], grads_ref[k], atol=TOL, rtol=0, err_msg=k)


def test_refused_off_tpu_without_interpret_mode():
  c = _model_config("megablox").model
  c.pallas_interpret = False
  m = Transformer(c, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"model.moe_impl='megablox'.*model.pallas_interpret=true.*"
                                       r"model.moe_impl=ragged"):
    jax.eval_shape(lambda t: m(t), jax.ShapeDtypeStruct((2, 16), jnp.int32))  # refused while tracing
  with pytest.raises(ValueError, match=r"model.moe_impl='megablox'.*model.pallas_interpret=true"):
    moe.resolve_impl(c, "cpu")
  megablox.check_platform(False, "tpu")  # an ahead-of-time compile for TPUs (a TPU mesh on a CPU host) passes


def test_config_checks_tile_keys():
  with pytest.raises(configs.ConfigError, match=r"model.megablox_tile_k=100 must be a positive multiple of 128"):
    config_validate.check(configs.load("tiny_moe", **{"model.moe_impl": "megablox", "model.megablox_tile_k": 100}))
  with pytest.raises(configs.ConfigError, match=r"model.megablox_tile_m.*model.moe_impl='megablox'"):
    config_validate.check(configs.load("tiny_moe", **{"model.megablox_tile_m": 256}))  # tiled: no tiles to set


def test_ahead_of_time_tpu_compile_holds_the_mosaic_kernels():
  """The real train step of tiny_moe for a v5e-8 slice with expert parallelism (data=2 x expert=4): each of the
  expert layer's three projections is a `gmm` Mosaic kernel forward, and a `gmm` (rows) and a `tgmm` (weights)
  backward (libtpu's compiler, no TPU attached)."""
  from train.planning import compile as aot  # pylint: disable=g-import-not-at-top
  from train.planning import hardware  # pylint: disable=g-import-not-at-top
  if not aot._libtpu_installed():  # pylint: disable=protected-access
    pytest.skip("libtpu (the TPU compiler) is not installed")
  config = configs.load("tiny_moe", **{"model.moe_impl": "megablox", "mesh.data": 2, "mesh.expert": 4})
  _, compiled = aot.compile_trainer(config, aot.abstract_devices(hardware.tpu_slice("v5e-8")))
  kernels = [line for line in compiled.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  scope = f"shard_map/{experts_lib.RECEIVED_SCOPE}4/"  # the rows received from the 4 devices of the expert axis
  assert sum(f"{scope}jit(gmm)/pallas_call" in line for line in kernels) == 6
  assert sum(f"{scope}jit(tgmm)/pallas_call" in line for line in kernels) == 3
  # The performance model prices each kernel (XLA sees a Mosaic call as zero work): 2·M·X·Y for the float operands
  # read here from the call's layout constraints, [M, X] x [E, X, Y] (gmm) or [M, X] x [M, Y] (tgmm), over the
  # receive buffer's M rows (4 devices' worth), of which balanced routing fills a quarter: 2·M·X·Y / 4.
  from train.planning import predict  # pylint: disable=g-import-not-at-top
  costs = {k["name"]: k for k in predict.kernel_costs(compiled.as_text()) if k["opcode"] == "custom-call"}
  assert not [name for name, k in costs.items() if not k["costed"]]
  priced = 0
  for line in kernels:
    name = line.split("=")[0].strip().lstrip("%")
    if not name.startswith(("gmm", "tgmm")):
      continue
    floats = re.findall(r"f32\[([\d,]+)\]", line.split("operand_layout_constraints={")[1])[:2]  # the operands
    (m, x), last = (int(d) for d in floats[0].split(",")), [int(d) for d in floats[1].split(",")]
    assert costs[name]["flops"] == 2 * m * x * last[-1] / 4, name
    priced += 1
  assert priced == 9


def teardown_module():
  for case, diff in MEASURED.items():
    print(f"megablox vs reference, {case}: max |diff| {diff:.2e}")
