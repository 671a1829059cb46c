"""Bad input to gmm/tgmm raises ValueError/TypeError naming the argument and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe

M, K, N, G = 64, 128, 128, 4
LHS = jnp.zeros((M, K), jnp.float32)
RHS = jnp.zeros((G, K, N), jnp.float32)
SIZES = jnp.array([16, 16, 16, 16], jnp.int32)


def gmm(*args, **kwargs):
  kwargs.setdefault("interpret", True)
  return pallas_moe.gmm(*args, **kwargs)


@pytest.mark.parametrize(
  "args, kwargs, error, match",
  [
    ((LHS[None], RHS, SIZES), {}, ValueError, r"`lhs` must be a 2-d array"),
    ((LHS, RHS[0], SIZES), {}, ValueError, r"`rhs` must be a 3-d array"),
    ((LHS, jnp.zeros((G, K + 1, N)), SIZES), {}, ValueError, r"k mismatch.*transpose_rhs"),
    ((LHS, jnp.zeros((G, K, 256)), SIZES), {"transpose_rhs": True}, ValueError, r"k mismatch"),
    ((LHS, RHS, SIZES.astype(jnp.float32)), {}, TypeError, r"`group_sizes` must be an integer"),
    ((LHS, RHS, SIZES[None]), {}, ValueError, r"`group_sizes` must be a 1-d array"),
    ((LHS, RHS, SIZES[:3]), {}, ValueError, r"rhs holds 4 groups but `group_sizes` has only 3"),
    ((LHS, RHS, jnp.array([16, -1, 16, 16])), {}, ValueError, r"must be non-negative"),
    ((LHS, RHS, jnp.array([16, 16, 16, 17])), {}, ValueError, r"sums to 65.*64 rows"),
    ((LHS, RHS[:2], SIZES), {"group_offset": 3}, ValueError, r"`group_offset`=3 is out of range"),
    ((LHS, RHS[:2], SIZES), {"group_offset": -1}, ValueError, r"`group_offset`=-1 is out of range"),
    ((LHS, RHS[:2], SIZES), {"group_offset": 1.0}, TypeError, r"`group_offset` must be an integer"),
    ((LHS, RHS, SIZES), {"tiling": (0, 128, 128)}, ValueError, r"tm=0 must be positive"),
    ((LHS, RHS, SIZES), {"tiling": (16, -128, 128)}, ValueError, r"tk=-128 must be positive"),
    ((LHS, RHS, SIZES), {"tiling": (12, 128, 128)}, ValueError, r"tm=12 is not a multiple of 8"),
    ((LHS, RHS, SIZES), {"tiling": (16, 100, 128)}, ValueError, r"tk=100 is not a multiple of 128"),
    ((LHS, RHS, SIZES), {"tiling": (16, 128)}, TypeError, r"`tiling` must be a 3-tuple"),
    ((LHS, RHS, SIZES), {"tiling": "big"}, TypeError, r"`tiling` must be a \(tm, tk, tn\)"),
    ((LHS, RHS, SIZES), {"tiling": lambda m, k, n: None}, ValueError, r"found no tiles"),
    (
      (LHS, RHS, SIZES),
      {"existing_out": jnp.zeros((M, N + 1))},
      ValueError,
      r"`existing_out` must have shape \(64, 128\)",
    ),
    (
      (LHS, RHS, SIZES),
      {"existing_out": jnp.zeros((M, N), jnp.bfloat16)},
      TypeError,
      r"`existing_out` has dtype bfloat16 .* preferred_element_type",
    ),
    ((LHS.astype(jnp.int32), RHS, SIZES), {}, TypeError, r"`lhs` must be a floating-point"),
    ((np.zeros((M, K)).tolist(), RHS, SIZES), {}, TypeError, r"`lhs` must be a jax or numpy"),
  ],
)
def test_gmm_bad_input(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    gmm(*args, **kwargs)


def test_tile_alignment_checked_when_compiling():
  """Unaligned tiles are refused up front, also for compiled (TPU) lowering."""
  with pytest.raises(ValueError, match=r"tn=200 is not a multiple of 128"):
    jax.eval_shape(
      lambda a, b: pallas_moe.gmm(a, b, SIZES, tiling=(16, 128, 200), interpret=False),
      LHS,
      jnp.zeros((G, K, 256)),
    )


def test_over_budget_tiling_refused_before_mosaic():
  lhs = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"needs ~.* MiB of VMEM .* budget"):
    jax.eval_shape(lambda a, b: pallas_moe.gmm(a, b, SIZES, tiling=(2048, 4096, 4096)), lhs, rhs)


@pytest.mark.parametrize(
  "args, kwargs, error, match",
  [
    ((LHS, jnp.zeros((M, N)), SIZES), {}, ValueError, r"m mismatch.*transposed"),
    ((LHS.T, jnp.zeros((M, N)), SIZES), {"num_actual_groups": 5}, ValueError, r"num_actual_groups"),
    ((LHS.T, jnp.zeros((M, N)), SIZES), {"num_actual_groups": 0}, ValueError, r"num_actual_groups"),
    (
      (LHS.T, jnp.zeros((M, N)), SIZES),
      {"num_actual_groups": 2, "group_offset": 3},
      ValueError,
      r"`group_offset`=3 is out of range",
    ),
    (
      (LHS.T, jnp.zeros((M, N)), SIZES),
      {"tiling": (32, 128, 128)},
      ValueError,
      r"tm=32 is not a multiple of 128",
    ),
    (
      (LHS.T, jnp.zeros((M, N)), SIZES),
      {"existing_out": jnp.zeros((G, K, N + 1))},
      ValueError,
      r"`existing_out` must have shape \(4, 128, 128\)",
    ),
    ((LHS.T, jnp.zeros((M, N)), jnp.array([70, 0, 0, 0])), {}, ValueError, r"sums to 70"),
  ],
)
def test_tgmm_bad_input(args, kwargs, error, match):
  kwargs.setdefault("interpret", True)
  with pytest.raises(error, match=match):
    pallas_moe.tgmm(*args, **kwargs)


def test_traced_sizes_past_m_are_clipped_not_out_of_bounds():
  """Under jit sizes can't be checked; rows past m are dropped, nothing reads out of bounds."""
  lhs = jnp.ones((M, K))
  rhs = jnp.ones((G, K, N))

  @jax.jit
  def f(sizes):
    return pallas_moe.gmm(lhs, rhs, sizes, tiling=(16, 128, 128), interpret=True)

  out = np.asarray(f(jnp.array([30, 30, 30, 30], jnp.int32)))
  np.testing.assert_allclose(out, np.full((M, N), float(K)))
