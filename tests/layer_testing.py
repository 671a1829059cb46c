"""Helpers shared by the MoE layer's tests (and the backend tests that run the layer)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_moe import moe, reference


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


# NOTE: atol is relative to the largest |reference| entry of each compared array (gradients of
# different params differ in scale by 10x; bf16 sums of 64 tokens err by a few bf16 ulps of it).
F32_TOL = dict(rtol=2e-4, atol=2e-5)


BF16_TOL = dict(rtol=5e-2, atol=2e-2)


def _ref_grads(params, x, config, *, keep=None):
  return _ref_grads_fn(config)(params, x, _cotangent(x.shape), keep)


@functools.cache
def _ref_grads_fn(config):
  """jit of (y, aux, grads) through the reference; cached per config (one compile per config)."""

  def loss(p, x, ct, keep):
    y, aux, _ = reference.moe(p, x, config, keep=keep)
    return jnp.sum(y * ct) + aux, (y, aux)

  def run(p, x, ct, keep):
    grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (y, aux)), (gp, gx) = grad_fn(p, x, ct, keep)
    return y, aux, gp, gx

  return jax.jit(run)


def _assert_close(got, want, tol):
  y, aux, gp, gx = got
  ry, raux, rgp, rgx = want
  f = lambda a: np.asarray(a, np.float32)

  def close(a, b, name):
    a, b = f(a), f(b)
    atol = tol["atol"] * max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=atol, err_msg=name)

  close(y, ry, "y")
  np.testing.assert_allclose(f(aux["aux_loss"]), f(raux), rtol=1e-5, err_msg="aux_loss")
  close(gx, rgx, "dx")
  assert set(gp) == set(rgp)
  for k in rgp:
    close(gp[k], rgp[k], f"d{k}")
