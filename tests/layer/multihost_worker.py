"""One process of tests/layer/test_multihost.py: 2 processes x 4 CPU devices, one 8-device mesh.

  python tests/layer/multihost_worker.py PROCESS_ID PORT OUT.npz

Joins `jax.distributed.initialize("127.0.0.1:PORT", num_processes=2)`, builds the data=2 x
expert=4 mesh of `mesh_of` (each expert group holds 2 devices of each process) and runs
`compute` on it; process 0 writes the results to OUT.npz. The test runs the same `compute` in
its own single process on 8 CPU devices and compares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_moe import collectives, demo, from_hf, gmm, moe, place_experts, to_hf
from pallas_moe.common import host_value
from pallas_moe.config import MoEConfig
from pallas_moe.routing import BIAS_KEY, update_routed_bias

DATA, EXPERT = 2, 4
SMALL = dict(num_experts=8, top_k=2, d_model=32, expert_ffn_dim=16, num_shared_experts=1)
# NOTE: ragged_dot keeps the layer's compiles short; the demo runs the Pallas (interpret) gmm.
LAYER = MoEConfig(**SMALL, gmm_impl="ragged_dot")
# DeepSeek-V3 routing (the correction bias), experts placed in a permuted order.
PLACEMENT = (5, 2, 7, 0, 3, 6, 1, 4)
NOAUX = MoEConfig(
  **SMALL,
  score_func="sigmoid",
  topk_method="noaux_tc",
  n_group=4,
  topk_group=2,
  norm_topk_prob=True,
  gmm_impl="ragged_dot",
  expert_placement=PLACEMENT,
)
TOKENS = 64
LR = 0.1


def mesh_of(devices) -> jax.sharding.Mesh:
  """data=2 x expert=4 over 8 devices such that every expert group spans both processes.

  `jax.devices()` lists process 0's 4 devices, then process 1's: row a of the mesh is devices
  a, a + 2, a + 4, a + 6, so the expert axis (and the exchange) crosses processes, and so does
  the demo's data axis (`jax.make_mesh` puts each process on one data row).
  """
  grid = np.asarray(devices).reshape(EXPERT, DATA).T
  return jax.sharding.Mesh(grid, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _put(mesh, a, spec):
  """A global array from a host value every process holds (the same on each)."""
  a = np.asarray(a)
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def _put_params(mesh, params, config):
  """Params sharded as `moe_layer` reads them: expert weights split over the expert axis."""
  return {k: _put(mesh, params[k], s) for k, s in moe.param_specs(config, params).items()}


def _tree_host(tree, prefix: str) -> dict[str, np.ndarray]:
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[prefix + jax.tree_util.keystr(path)] = host_value(leaf)
  return out


def _exchange(mesh) -> dict[str, np.ndarray]:
  """plan_from_send_counts + ragged_all_to_all over the expert axis: forward and VJP."""
  n, rows, buf, f = DATA * EXPERT, 6, 12, 3
  rng = np.random.default_rng(0)
  # NOTE: 0-2 rows per destination (zero-size chunks included); untouched buffer rows are random.
  counts = rng.integers(0, 3, (n, EXPERT)).astype(np.int32)
  operand = rng.standard_normal((n * rows, f)).astype(np.float32)
  output = rng.standard_normal((n * buf, f)).astype(np.float32)
  ct = rng.standard_normal((n * buf, f)).astype(np.float32)

  def body(operand, output, counts, ct):
    plan = collectives.plan_from_send_counts(counts[0], axis_name="expert", buffer_rows=buf)

    def op(o, b):
      return collectives.ragged_all_to_all(o, b, *plan.dispatch_args, axis_name="expert")

    y, vjp = jax.vjp(op, operand, output)
    return (y, *vjp(ct))

  tok = P(("data", "expert"))
  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tok, out_specs=tok))
  args = [_put(mesh, a, tok) for a in (operand, output, counts, ct)]
  y, d_operand, d_output = run(*args)
  return {
    "exchange/y": host_value(y),
    "exchange/d_operand": host_value(d_operand),
    "exchange/d_output": host_value(d_output),
    # NOTE: exact_buffer_rows reads the per-device counts as a host value (here: sharded).
    "exchange/exact_buffer_rows": np.asarray(
      collectives.exact_buffer_rows(
        _put(mesh, counts, tok), axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]
      )
    ),
  }


def _gmm(mesh) -> dict[str, np.ndarray]:
  """Eager `gmm` (Pallas interpret and XLA) on arrays spanning both processes: its argument
  checks read `group_sizes` (sharded over the expert axis) as a host value."""
  rng = np.random.default_rng(1)
  lhs = _put(mesh, rng.standard_normal((32, 16)).astype(np.float32), P(("data", "expert")))
  rhs = _put(mesh, rng.standard_normal((4, 16, 8)).astype(np.float32), P("expert"))
  group_sizes = _put(mesh, np.array([5, 0, 11, 8], np.int32), P("expert"))
  return {
    f"gmm/{impl}": host_value(gmm(lhs, rhs, group_sizes, implementation=impl))
    for impl in ("xla", None)
  }


def _layer(mesh) -> dict[str, np.ndarray]:
  """moe_layer forward, gradients and two SGD steps at the dropless buffer size."""
  config = LAYER
  params = moe.init_params(jax.random.key(0), config)
  x = jax.random.normal(jax.random.key(1), (TOKENS, config.d_model), jnp.float32)
  target = jax.random.normal(jax.random.key(7), (TOKENS, config.d_model), jnp.float32)
  tok = P(("data", "expert"))
  params = _put_params(mesh, params, config)
  x, target = _put(mesh, x, tok), _put(mesh, target, tok)
  rows = moe.dropless_buffer_rows(params, x, config, mesh)

  @jax.jit
  def step(params, x, target):
    def loss(p, x):
      y, aux = moe.moe_layer(p, x, config, mesh, buffer_rows=rows)
      return jnp.mean((y - target) ** 2) + aux["aux_loss"], (y, aux)

    (value, (y, aux)), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    new = jax.tree.map(lambda p, g: p - LR * g, params, gp)
    return value, y, aux, gp, gx, new

  value, y, aux, gp, gx, params1 = step(params, x, target)
  value1, *_, params2 = step(params1, x, target)
  out = {"layer/dropless_buffer_rows": np.asarray(rows)}
  out |= _tree_host({"loss": [value, value1], "y": y, "aux": aux, "dx": gx}, "layer/")
  out |= _tree_host({"grads": gp, "params2": params2}, "layer/")
  return out


def _noaux_placed(mesh) -> dict[str, np.ndarray]:
  """place_experts, dropless_buffer_rows and update_routed_bias with the correction bias; the
  to_hf / from_hf round trip of the sharded params."""
  config = NOAUX
  params = moe.init_params(jax.random.key(3), config)
  params[BIAS_KEY] = 0.3 * jax.random.normal(jax.random.key(9), (config.num_experts,))
  x = jax.random.normal(jax.random.key(4), (TOKENS, config.d_model), jnp.float32)
  tok = P(("data", "expert"))
  unplaced = dataclasses.replace(config, expert_placement=None)
  # NOTE: expert-order params sharded over the expert axis (spanning processes), then placed.
  params = place_experts(_put_params(mesh, params, unplaced), placement=PLACEMENT)
  x = _put(mesh, x, tok)
  rows = moe.dropless_buffer_rows(params, x, config, mesh)
  y, aux = jax.jit(functools.partial(moe.moe_layer, config=config, mesh=mesh, buffer_rows=rows))(
    params, x
  )
  # NOTE: the bias update on the replicated load and on a copy sharded over the expert axis.
  bias = update_routed_bias(params[BIAS_KEY], aux["expert_load"], rate=1e-3)
  load = jax.device_put(aux["expert_load"], NamedSharding(mesh, P("expert")))
  bias_sharded = update_routed_bias(
    jax.device_put(params[BIAS_KEY], NamedSharding(mesh, P("expert"))), load, rate=1e-3
  )
  undone = place_experts(params, placement=PLACEMENT, undo=True)
  hf = to_hf(params, config, family="deepseek_v3", prefix="model.layers.1.mlp.")
  # NOTE: from_hf of a state dict of arrays sharded over both processes (the experts' weights
  # split over the expert axis, the rest replicated).
  sharded_hf = {
    k: _put(mesh, v, P("expert") if v.shape[0] % EXPERT == 0 else P()) for k, v in hf.items()
  }
  back = from_hf(sharded_hf, config, prefix="model.layers.1.mlp.")
  out = {"noaux/dropless_buffer_rows": np.asarray(rows)}
  out |= _tree_host({"y": y, "aux": aux, "bias": bias, "bias_sharded": bias_sharded}, "noaux/")
  out |= _tree_host({"placed": params, "undone": undone}, "noaux/")
  out |= {f"noaux/to_hf/{k}": v for k, v in hf.items()}
  out |= {f"noaux/from_hf/{k}": v for k, v in back.items()}
  return out


def _demo() -> dict[str, np.ndarray]:
  """The demo's training loop (its own `jax.make_mesh`: the data axis spans the processes)."""
  # NOTE: at 80 tokens both steps' batches need the same buffer bucket: one compile of the step.
  # ragged_dot as in `_layer`: the Pallas gmm's interpret-mode compile was most of this test's
  # time in three processes; the kernel runs across processes in `_gmm`.
  result = demo.main(steps=2, tokens=80, log=False, gmm_impl="ragged_dot")
  return {
    "demo/losses": np.asarray(result["losses"]),
    "demo/dropped_rows": np.asarray(result["dropped_rows"]),
    "demo/buffer_rows": np.asarray(result["buffer_rows"]),
    "demo/max_over_mean_load": np.asarray(result["max_over_mean_load"]),
  }


def compute(mesh) -> dict[str, np.ndarray]:
  """Every case, as host numpy (gathered from every process)."""
  return _exchange(mesh) | _gmm(mesh) | _layer(mesh) | _noaux_placed(mesh) | _demo()


def main(process_id: int, port: int, out: str) -> None:
  jax.config.update("jax_num_cpu_devices", 4)
  # NOTE: as tests/conftest.py sets it for the single-process side.
  jax.config.update("jax_disable_most_optimizations", True)
  # NOTE: gloo is the default of both supported jax versions; set it where the option exists.
  with contextlib.suppress(AttributeError, ValueError):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  devices = jax.devices()
  assert len(devices) == 8 and jax.process_count() == 2, devices
  mesh = mesh_of(devices)
  for row in mesh.devices:
    assert {d.process_index for d in row} == {0, 1}, mesh.devices
  results = compute(mesh)
  if process_id == 0:
    np.savez(out, **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS", "cpu"))
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
