"""Helpers shared by the MoE layer's tests (and the backend tests that run the layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe import moe


def _mesh(data: int, ep: int):
  return jax.make_mesh((data, ep), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _cotangent(shape, seed=7):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _block_grads(params, x, config, mesh, *, buffer_rows=None):
  """(y, aux, grads wrt params, grad wrt x) of sum(y * ct) + aux_loss through moe_layer."""
  ct = _cotangent(x.shape)

  def loss(p, x):
    y, aux = moe.moe_layer(p, x, config, mesh, buffer_rows=buffer_rows)
    return jnp.sum(y.astype(jnp.float32) * ct) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    params, x
  )
  return y, aux, gp, gx


def _setup(config, *, tokens, seed=0):
  params = moe.init_params(jax.random.key(seed), config)
  x = jax.random.normal(jax.random.key(seed + 1), (tokens, config.d_model), jnp.float32)
  return params, x.astype(config.compute_dtype)


SMALL = dict(num_experts=8, top_k=2, d_model=32, expert_ffn_dim=16, num_shared_experts=1)
