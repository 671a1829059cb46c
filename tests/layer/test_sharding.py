"""The layer with its weights split over fsdp and tensor axes (pallas_moe.sharding, .mesh).

Every sharded mesh is held against the plain (data, expert) block with the same expert
parallelism and the same tokens per device: forward, every gradient, the aux loss and every
counter. The params are the same global arrays on every mesh; only their placement changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer.test_routing import _dense_reference_grads
from layer_testing import F32_TOL, SMALL, _assert_close, _block_grads, _cotangent, _setup

from pallas_moe import MoEConfig, make_mesh, moe
from pallas_moe.mesh import check_mesh

ROLES = ("data", "fsdp", "tensor", "expert")
MESHES = {
  "fsdp2-ep4": dict(fsdp=2, expert=4),
  "fsdp4-ep2": dict(fsdp=4, expert=2),
  "fsdp2-tp2-ep2": dict(fsdp=2, tensor=2, expert=2),
  "data2-tp2-ep2": dict(data=2, tensor=2, expert=2),
  # NOTE: tensor 4 pairs gate/up columns with two exchanges (tensor 2 keeps one on the device).
  "tp4-ep2": dict(tensor=4, expert=2),
}


def _sharded(sizes: dict, **fields) -> tuple[MoEConfig, jax.sharding.Mesh]:
  """A config naming the axes of `sizes` (and no others) and the mesh `make_mesh` builds."""
  axes = {f"{r}_axis": (r if r in sizes else None) for r in ROLES if r != "expert"}
  counts = {f"{r}_parallelism": n for r, n in sizes.items()}
  config = MoEConfig(**SMALL, **fields, **axes, **counts)
  return config, make_mesh(config, jax.devices()[: int(np.prod(list(sizes.values())))])


def _plain(sizes: dict, **fields) -> tuple[MoEConfig, jax.sharding.Mesh]:
  """The (data, expert) block with the same expert parallelism and tokens per device."""
  data, ep = sizes.get("data", 1) * sizes.get("fsdp", 1), sizes["expert"]
  mesh = jax.make_mesh(
    (data, ep),
    ("data", "expert"),
    devices=jax.devices()[: data * ep],
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  return MoEConfig(**SMALL, **fields), mesh


def _run(params, x, config, mesh):
  p_shard, _ = moe.shardings(config, mesh, params)
  return _block_grads(jax.device_put(params, p_shard), x, config, mesh)


def _assert_same_block(got, want):
  y, aux, gp, gx = want
  _assert_close(got, (y, aux["aux_loss"], gp, gx), F32_TOL)
  for key in ("dropped_rows", "dropped_exchange_rows", "needed_rows", "buffer_rows", "expert_load"):
    np.testing.assert_array_equal(got[1][key], aux[key], err_msg=key)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_layer_equals_plain_block(name):
  """Forward, gradients and aux of the fsdp / tensor meshes equal the (data, expert) block's;
  each gradient comes back split as its weight is (reduce-scattered over fsdp)."""
  sizes = MESHES[name]
  # NOTE: XLA's gmm backend: the sharding does not reach into the kernels (the Pallas kernels
  # run the same layer in tests/kernels/test_xla_backend.py), and interpret mode costs ~40 s.
  impl = dict(gmm_impl="xla")
  config, mesh = _sharded(sizes, **impl)
  params, x = _setup(config, tokens=64)
  got = _run(params, x, config, mesh)
  _assert_same_block(got, _block_grads(params, x, *_plain(sizes, **impl)))
  specs = moe.param_specs(config, params)
  for key, grad in got[2].items():
    assert grad.sharding.spec == specs[key], key
  if name == "fsdp2-tp2-ep2":
    # NOTE: and float64 numpy (a dense einsum through every expert), on the mesh with every role.
    ry, raux, rgp, rgx, _ = _dense_reference_grads(params, x, _cotangent(x.shape), config)
    _assert_close(got, (ry, raux, rgp, rgx), F32_TOL)


def test_sharded_layer_keeps_every_feature():
  """Deduplicated exchange, batch split, expert placement, int8 weights (quantized with the
  scales of the whole MLP width: the tensor split does not change them) and int8 dispatch, on
  fsdp x tensor x expert against the plain block."""
  placement = tuple(int(i) for i in np.random.RandomState(0).permutation(SMALL["num_experts"]))
  fields = dict(
    dedup_dispatch=True,
    batch_split=2,
    expert_placement=placement,
    weight_quantization="int8",
    dispatch_quantization="int8",
    gmm_impl="xla",
  )
  sizes = MESHES["fsdp2-tp2-ep2"]
  config, mesh = _sharded(sizes, **fields)
  params, x = _setup(config, tokens=64)
  params = moe.place_experts(params, placement=placement)
  got = _run(params, x, config, mesh)
  _assert_same_block(got, _block_grads(params, x, *_plain(sizes, **fields)))


def test_param_specs_split_every_weight_over_fsdp():
  config = MoEConfig(
    **SMALL,
    shared_expert_gate=True,
    fsdp_axis="fsdp",
    tensor_axis="tensor",
    score_func="sigmoid",
    topk_method="noaux_tc",
  )
  specs = moe.param_specs(config)
  assert specs == {
    "router": jax.sharding.PartitionSpec("fsdp"),
    "wi": jax.sharding.PartitionSpec("expert", "fsdp", "tensor"),
    "wo": jax.sharding.PartitionSpec("expert", "tensor", "fsdp"),
    "shared_wi": jax.sharding.PartitionSpec("fsdp", "tensor"),
    "shared_wo": jax.sharding.PartitionSpec("tensor", "fsdp"),
    "shared_gate": jax.sharding.PartitionSpec("fsdp"),
    "e_score_correction_bias": jax.sharding.PartitionSpec(),
  }
  # NOTE: without fsdp / tensor axes, the specs are those of the (data, expert) block.
  plain = moe.param_specs(MoEConfig(**SMALL))
  assert plain["wi"] == jax.sharding.PartitionSpec("expert") and plain["router"] == (
    jax.sharding.PartitionSpec()
  )
  # NOTE: the params do not depend on the mesh.
  a = moe.init_params(jax.random.key(0), config)
  b = moe.init_params(jax.random.key(0), dataclasses.replace(config, fsdp_axis=None))
  assert jax.tree.map(jnp.shape, a) == jax.tree.map(jnp.shape, b)


def test_dropless_buffer_rows_on_an_fsdp_mesh():
  """The host-side exact buffer counts the tokens as the block splits them over (data, fsdp,
  expert): the block then drops nothing and needs exactly that many rows (rounded)."""
  config, mesh = _sharded(dict(data=2, fsdp=2, expert=2), gmm_impl="xla", buffer_factor=None)
  params, x = _setup(config, tokens=64)
  rows = moe.dropless_buffer_rows(params, x, config, mesh, multiple_of=1)
  p_shard, x_shard = moe.shardings(config, mesh, params)
  layer = jax.jit(lambda p, x: moe.moe_layer(p, x, config, mesh, buffer_rows=rows))
  _, aux = layer(jax.device_put(params, p_shard), jax.device_put(x, x_shard))
  assert int(aux["dropped_rows"]) == 0 and int(aux["needed_rows"]) == rows


@pytest.mark.parametrize(
  "fields, sizes, match",
  [
    (dict(tensor_axis="tensor"), dict(data=1, tensor=3, expert=2), r"must be even and divide"),
    (dict(fsdp_axis="fsdp"), dict(data=2, expert=4), r"lack 'fsdp'.*make_mesh"),
    (dict(expert_parallelism=2), dict(data=2, expert=4), r"expert_parallelism=2 but"),
    (dict(), dict(data=2, expert=2, seq=2), r"\{'seq': 2\} are not axes of the MoE layer"),
  ],
)
def test_mesh_errors_name_the_fix(fields, sizes, match):
  config = MoEConfig(**SMALL, **fields)
  names = tuple(sizes)
  mesh = jax.make_mesh(
    tuple(sizes.values()),
    names,
    devices=jax.devices()[: int(np.prod(list(sizes.values())))],
    axis_types=(jax.sharding.AxisType.Auto,) * len(names),
  )
  with pytest.raises(ValueError, match=match):
    moe.plan_layer(config, mesh, tokens=64)


def test_weights_placed_for_another_mesh_are_refused():
  """A weight whose model dimension or width is not this mesh's share raises, naming it."""
  config, mesh = _sharded(MESHES["fsdp2-tp2-ep2"], gmm_impl="xla")
  params, x = _setup(config, tokens=64)
  spec = jax.sharding.PartitionSpec
  specs = moe.param_specs(config, params)
  specs["wo"] = spec("expert", None, "fsdp")  # NOTE: the width left whole

  with pytest.raises(ValueError, match=r"params\['wo'\].*MLP width.*param_specs"):
    jax.shard_map(
      lambda p, x: moe.moe_block(p, x, config),
      mesh=mesh,
      in_specs=(specs, spec(config.batch_axes)),
      out_specs=spec(),
    )(params, x)


def test_make_mesh_reads_maxtext_sizes():
  """ici_* x dcn_* sizes, -1 filling the devices (or slices) that are left, MaxText's order."""
  base = dict(num_experts=8, num_experts_per_tok=2, emb_dim=32, moe_mlp_dim=16)
  c = MoEConfig.from_dict(
    {
      **base,
      "ici_data_parallelism": 1,
      "ici_fsdp_parallelism": -1,
      "ici_tensor_parallelism": 2,
      "ici_expert_parallelism": 2,
      "dcn_data_parallelism": -1,
    }
  )
  assert c.mesh_axes == {"data": "data", "fsdp": "fsdp", "tensor": "tensor", "expert": "expert"}
  mesh = make_mesh(c)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2}
  assert check_mesh(mesh, c).batch_devices == 4
  # NOTE: a size of 1 makes no axis; an unknown size is caught with the key named.
  one = MoEConfig.from_dict({**base, "ici_fsdp_parallelism": 1, "ici_expert_parallelism": 8})
  assert one.fsdp_axis is None and dict(make_mesh(one).shape) == {"data": 1, "expert": 8}
  with pytest.raises(ValueError, match=r"'ici_fsdp_parallelism'=0 must be a positive int or -1"):
    MoEConfig.from_dict({**base, "ici_fsdp_parallelism": 0})
  with pytest.raises(ValueError, match=r"at most one axis can take"):
    make_mesh(
      MoEConfig.from_dict({**base, "ici_fsdp_parallelism": -1, "ici_expert_parallelism": -1})
    )
  with pytest.raises(ValueError, match=r"uses 4 of 8 devices"):
    make_mesh(MoEConfig.from_dict({**base, "ici_expert_parallelism": 4}))
