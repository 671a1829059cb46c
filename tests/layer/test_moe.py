"""Tests for pallas_moe.moe: the EP block against the dense reference, on 8 CPU devices.

Every case is one jit of (y, aux, grads) through `moe_layer` and one of the same through
`reference.moe`. Shapes are small: interpret-mode compiles dominate the runtime.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer_testing import (
  BF16_TOL,
  F32_TOL,
  SMALL,
  _assert_close,
  _block_grads,
  _mesh,
  _ref_grads,
  _setup,
)

from pallas_moe import moe, reference
from pallas_moe.config import MoEConfig


@pytest.mark.parametrize(
  "data, ep, dtype",
  # NOTE: every mesh shape runs once, each dtype with and without expert parallelism (the
  # dispatch path does not depend on the dtype; all eight pairs cost ~50 s more of the suite's
  # 10-minute budget for no new code path).
  [
    (2, 4, "float32"),
    (1, 8, "float32"),
    (8, 1, "bfloat16"),
    (4, 2, "bfloat16"),
  ],
)
def test_block_matches_dense_reference(data, ep, dtype):
  """Forward, aux loss and all gradients equal the per-expert-loop reference."""
  config = MoEConfig(**SMALL, dtype=dtype, weight_dtype=dtype, norm_topk_prob=dtype == "float32")
  params, x = _setup(config, tokens=64)
  got = _block_grads(params, x, config, _mesh(data, ep))
  assert int(got[1]["dropped_rows"]) == 0
  _assert_close(got, _ref_grads(params, x, config), F32_TOL if dtype == "float32" else BF16_TOL)


DEEPSEEK_LITE = dict(
  num_experts=64,
  top_k=6,
  d_model=32,
  expert_ffn_dim=16,
  num_shared_experts=2,
  score_func="softmax",
  norm_topk_prob=False,
  routed_scaling_factor=1.0,
)


@pytest.mark.parametrize("data, ep", [(2, 4)])
def test_deepseek_v2_lite_grad_under_jit(data, ep):
  """64 experts, top-6, 2 shared: jit(grad) with EP 4 (the 1x8 mesh: the dense-reference test)."""
  config = MoEConfig(**DEEPSEEK_LITE)
  params, x = _setup(config, tokens=64, seed=3)
  got = _block_grads(params, x, config, _mesh(data, ep))
  assert int(got[1]["dropped_rows"]) == 0
  _assert_close(got, _ref_grads(params, x, config), F32_TOL)


def _adversarial(config, *, tokens, ep):
  """Params and tokens that route every token to experts of expert-shard 0 only."""
  params, x = _setup(config, tokens=tokens, seed=11)
  e_local = config.num_experts // ep
  # NOTE: feature 0 of every token is 1 and the router gives experts [0, e_local) +30 on it, so
  # every token's top-k (k <= e_local) lies on the device holding experts [0, e_local).
  x = x.at[:, 0].set(1.0)
  params["router"] = params["router"].at[0, :e_local].add(30.0)
  return params, x


def _counts_per_device(ids, *, num_experts, data, ep):
  return moe._receive_counts(np.asarray(ids), num_experts=num_experts, data=data, ep=ep)


@pytest.mark.parametrize("mode", ["static_bound", "exact"])
def test_adversarial_routing_dropless(mode):
  """All tokens to one device's experts: nothing is dropped by the default policy."""
  data, ep = 2, 4
  config = MoEConfig(**SMALL)
  params, x = _adversarial(config, tokens=64, ep=ep)
  mesh = _mesh(data, ep)
  rows = moe.dropless_buffer_rows(params, x, config, mesh) if mode == "exact" else None
  _, _, ids = reference.moe(params, x, config)
  need = _counts_per_device(ids, num_experts=8, data=data, ep=ep).max()
  assert need == 32 // 1 * 2  # NOTE: 32 tokens per data slice, 2 choices each, all to one device
  if mode == "exact":
    assert rows == need  # exact (need is a multiple of 8 here)
  got = _block_grads(params, x, config, mesh, buffer_rows=rows)
  aux = got[1]
  assert int(aux["dropped_rows"]) == 0
  assert int(aux["needed_rows"]) == need
  assert int(aux["buffer_rows"]) == (need if mode == "exact" else ep * 8 * 2)
  _assert_close(got, _ref_grads(params, x, config), F32_TOL)


def _kept_numpy(ids, *, num_experts, data, ep, rows):
  """[T, k] bool: which (token, choice) rows fit the receive buffers (the documented layout).

  A receiver lays rows out by (local expert, sender, sender's sorted order = token order) and keeps
  the first `rows`.
  """
  ids = np.asarray(ids)
  t_dev = ids.shape[0] // (data * ep)
  e_local = num_experts // ep
  keep = np.zeros(ids.shape, bool)
  for a in range(data):
    for dst in range(ep):
      layout = []
      for e in range(dst * e_local, (dst + 1) * e_local):
        for src in range(ep):
          block = (a * ep + src) * t_dev
          sub = ids[block : block + t_dev]
          # NOTE: the sender's rows for e in its stable sort order (t * k + j ascending).
          for flat in np.flatnonzero(sub.reshape(-1) == e):
            layout.append((block + flat // ids.shape[1], flat % ids.shape[1]))
      for t, j in layout[:rows]:
        keep[t, j] = True
  return keep


def test_factor_policy_drops_exactly_and_dropped_rows_are_zero():
  """A capacity factor drops rows; the count is exact and they add exactly 0 (NaN poison on).
  The plain exchange: a drop is a (token, choice) row (test_dedup: the deduplicated one's)."""
  data, ep = 2, 4
  config = MoEConfig(**SMALL, buffer_factor=1.25, debug_nan_poison=True, dedup_dispatch=False)
  params, x = _adversarial(config, tokens=64, ep=ep)
  mesh = _mesh(data, ep)
  _, _, ids = reference.moe(params, x, config)
  rows = moe.buffer_rows_for(config, tokens_per_device=8, expert_parallelism=ep)
  assert rows == 20  # ceil(1.25 * 8 tokens * 2)
  counts = _counts_per_device(ids, num_experts=8, data=data, ep=ep)
  want_dropped = int(np.maximum(counts - rows, 0).sum())
  assert want_dropped == 2 * (64 - 20)
  got = _block_grads(params, x, config, mesh)
  aux = got[1]
  assert int(aux["dropped_rows"]) == want_dropped
  for leaf in jax.tree.leaves(got):
    assert np.isfinite(np.asarray(leaf, np.float32)).all()  # no poison leaked anywhere
  keep = _kept_numpy(ids, num_experts=8, data=data, ep=ep, rows=rows)
  assert (~keep).sum() == want_dropped
  _assert_close(got, _ref_grads(params, x, config, keep=jnp.asarray(keep)), F32_TOL)


def test_plain_block_without_mesh_and_ragged_dot_impl():
  """Outside shard_map the block is EP=1; gmm_impl='ragged_dot' gives the same result."""
  config = MoEConfig(**SMALL)
  params, x = _setup(config, tokens=16)
  y, aux = jax.jit(functools.partial(moe.moe_block, config=config))(params, x)
  ry, raux, _ = reference.moe(params, x, config)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ry), **F32_TOL)
  np.testing.assert_allclose(float(aux["aux_loss"]), float(raux), rtol=1e-5)
  rd = MoEConfig(**SMALL, gmm_impl="ragged_dot")
  y2, _ = jax.jit(functools.partial(moe.moe_block, config=rd))(params, x)
  np.testing.assert_allclose(np.asarray(y2), np.asarray(ry), rtol=1e-3, atol=1e-4)


def test_load_balance_loss_is_one_when_uniform():
  probs = jnp.full((8, 4), 0.25)
  sizes = jnp.array([4, 4, 4, 4], jnp.int32)  # 8 tokens * top-2 spread evenly
  np.testing.assert_allclose(
    float(moe.load_balance_loss(probs=probs, group_sizes=sizes, top_k=2)), 1.0
  )


def test_errors():
  config = MoEConfig(**SMALL, expert_parallelism=2)
  params, x = _setup(config, tokens=16)
  with pytest.raises(ValueError, match="expert_parallelism=2"):
    moe.moe_layer(params, x, config, _mesh(2, 4))
  with pytest.raises(ValueError, match="lack 'data'"):
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    moe.moe_layer(params, x, MoEConfig(**SMALL), mesh)


def test_demo_loss_falls():
  """The demo's training loop on data=2 x expert=4 (fewer steps and tokens: 80 tokens keep
  every step in one buffer bucket, one compile): the loss falls."""
  from pallas_moe import demo

  result = demo.main(steps=5, tokens=80, log=False)
  assert result["losses"][-1] < 0.8 * result["losses"][0], result["losses"]
  assert result["dropped_rows"] == 0
  assert result["tokens_per_s"] > 0


def _aot_training_step(config, *, topology: str, data: int, ep: int, tokens_per_device: int):
  """`jit(grad(sum(y**2) + aux_loss))` of `moe_layer`, compiled ahead of time for a TPU topology
  from this CPU host (abstract operands, the topology's chip's tiles)."""
  from jax.experimental import topologies

  from pallas_moe import tiling

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  mesh = jax.sharding.Mesh(
    np.array(topo.devices).reshape(data, ep),
    (config.data_axis, config.expert_axis),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  params = jax.eval_shape(lambda: moe.init_params(jax.random.key(0), config))
  p_shard, x_shard = moe.shardings(config, mesh, params)
  params = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=p_shard[k]) for k, v in params.items()
  }
  x = jax.ShapeDtypeStruct(
    (tokens_per_device * data * ep, config.d_model), config.compute_dtype, sharding=x_shard
  )

  def loss(p, x):
    y, aux = moe.moe_layer(p, x, config, mesh)
    return jnp.sum(jnp.square(y.astype(jnp.float32))) + aux["aux_loss"]

  with jax.default_device(topo.devices[0]), tiling.use_generation(topology.split(":")[0]):
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()


@pytest.mark.aot
def test_training_step_compiles_for_v5e_2x4_ep8():
  """One training step, compiled ahead of time for a v5e:2x4 TPU topology, EP=8."""
  # NOTE: DeepSeek-V2-Lite's routing (64 experts, top-6, 2 shared) at reduced widths: Mosaic
  # compiles every kernel for real; `python -m bench.moe_memory` does the full-width layer.
  config = MoEConfig(
    **{**DEEPSEEK_LITE, "d_model": 256, "expert_ffn_dim": 256},
    dtype="bfloat16",
    weight_dtype="bfloat16",
    buffer_factor=2.0,
  )
  compiled = _aot_training_step(config, topology="v5e:2x4", data=1, ep=8, tokens_per_device=128)
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(f"v5e:2x4 EP=8 MoE training step temp bytes: {temp}")
  assert temp > 0


def test_undefined_slack_rows_never_reach_the_layer():
  """The block's gmm calls leave the receive buffer's slack rows undefined
  (`unowned_rows="undefined"`). With the dropless static bound (ep * T * min(k, E_l) = 64 rows
  per device, about 16 received: ~4x slack) and those rows NaN-poisoned, nothing reaches the
  output, the aux loss or any gradient."""
  data, ep = 2, 4
  config = MoEConfig(**SMALL, debug_nan_poison=True)
  params, x = _setup(config, tokens=64)
  assert moe.buffer_rows_for(config, tokens_per_device=8, expert_parallelism=ep) == 64
  got = _block_grads(params, x, config, _mesh(data, ep))
  for leaf in jax.tree.leaves(got):
    assert np.isfinite(np.asarray(leaf, np.float32)).all()
  _assert_close(got, _ref_grads(params, x, config), F32_TOL)


def test_weighted_expert_mlp_keeps_no_activation_or_output_for_the_backward():
  """With routing weights (the deduplicated exchange's expert rows), the weights scale the
  activation and the down projection is rematerialized: the backward keeps the rows and
  h = rows @ wi, not the activation [B, f] nor the [B, d] output; the output and every
  gradient (the weights' too) are those of the weighted output."""
  b, d, f, g = 48, 16, 24, 3
  config = MoEConfig(num_experts=g, top_k=1, d_model=d, expert_ffn_dim=f, gmm_impl="ragged_dot")
  k = jax.random.split(jax.random.key(3), 4)
  rows = jax.random.normal(k[0], (b, d), jnp.float32)
  wi = jax.random.normal(k[1], (g, d, 2 * f), jnp.float32) / d**0.5
  wo = jax.random.normal(k[2], (g, f, d), jnp.float32) / f**0.5
  w = jax.random.uniform(k[3], (b,), jnp.float32)
  gs = jnp.array([20, 0, 28], jnp.int32)

  def mlp(rows, wi, wo, w):
    return moe.expert_mlp(rows, wi, wo, gs, config=config, row_weights=w)

  y, vjp = jax.vjp(mlp, rows, wi, wo, w)
  kept = [x.shape for x in jax.tree.leaves(vjp) if hasattr(x, "shape")]
  assert (b, f) not in kept and kept.count((b, d)) <= 1  # NOTE: the rows, not the output
  assert (b, 2 * f) in kept
  plain = moe.expert_mlp(rows, wi, wo, gs, config=config)
  np.testing.assert_allclose(y, w[:, None] * plain, rtol=1e-5, atol=1e-6)
  ct = jax.random.normal(jax.random.key(4), y.shape, jnp.float32)
  got = vjp(ct)
  want = jax.vjp(lambda r, a, o, s: s[:, None] * moe.expert_mlp(r, a, o, gs, config=config),
                 rows, wi, wo, w)[1](ct)  # fmt: skip
  for x, z in zip(got, want, strict=True):
    np.testing.assert_allclose(x, z, rtol=1e-4, atol=1e-5)
