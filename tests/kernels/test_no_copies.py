"""No HBM copies around the kernels: the weight-gradient kernels read gmm's lhs as it is.

Interpret mode: both tgmm kernels with `transpose_lhs` (lhs given as [m, k], rows contracted in
VMEM) equal the float64 reference on a ragged m with a shard of the groups, the row-tile one
also with `rows_stationary`, under the TPU simulator (out-of-bounds reads raise) and its race
detector; and the cost estimates count `expected_rows`.

The compiled (AOT, real Mosaic) MaxText-shaped experts step, read with bench's HLO readers, is in
tests/bench/test_bench_aot_step.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import INTERPRET_MODES, RACE_PARAMS, no_races_or_oob, np_tgmm, tolerance

from pallas_moe.tgmm import tgmm_pallas, tgmm_rowtile_pallas

F32 = jnp.float32
# m = 203 (ragged against every tile), a shard of 3 of 5 groups (offset 1), an empty group.
M, K, N = 203, 64, 256
SIZES = np.array([30, 61, 0, 70, 20], np.int32)


def _check_transposed(kernel, interpret, **kw):
  kx, ky = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (M, K), F32)  # gmm's lhs, [m, k]
  dy = jax.random.normal(ky, (M, N), F32)
  out = kernel(
    x,
    dy,
    jnp.asarray(SIZES),
    out_dtype=F32,
    group_offset=jnp.int32(1),
    num_actual_groups=3,
    transpose_lhs=True,
    interpret=interpret,
    **kw,
  )
  want = np_tgmm(np.asarray(x).T, np.asarray(dy), SIZES, group_offset=1, num_actual_groups=3)
  np.testing.assert_allclose(np.asarray(out), want, **tolerance(in_dtype=F32, out_dtype=F32, k=M))
  assert not np.any(np.asarray(out)[1])  # the empty group: exact zeros


@pytest.mark.parametrize("mode", ["hlo", "tpu"])
def test_tgmm_visit_kernel_reads_lhs_untransposed(mode):
  _check_transposed(tgmm_pallas, INTERPRET_MODES[mode], tiling=(128, 64, 128), sub_m=128)


@pytest.mark.parametrize("rows_stationary", [False, True], ids=["", "rs"])
def test_tgmm_rowtile_kernel_reads_lhs_untransposed(capfd, rows_stationary):
  """Under the simulator with 2 cores and the race detector: the [tm, tk] lhs slots' row DMAs
  stay in bounds (the ragged last tile) and race-free, with and without rows_stationary."""
  with no_races_or_oob(capfd):
    _check_transposed(
      tgmm_rowtile_pallas,
      RACE_PARAMS,
      tiling=(64, 32, 128),
      sub_m=16,
      interior_subs=2,
      rows_stationary=rows_stationary,
    )


def test_cost_estimates_count_expected_rows():
  """flops and bytes in the kernels' CostEstimates: the expected rows' work, else all m."""
  x, dy = jnp.zeros((M, K), F32), jnp.zeros((M, N), F32)

  def costs(expected_rows):
    fn = lambda x, dy, gs: tgmm_rowtile_pallas(  # noqa: E731
      x,
      dy,
      gs,
      tiling=(64, 32, 128),
      out_dtype=F32,
      group_offset=jnp.int32(0),
      num_actual_groups=5,
      transpose_lhs=True,
      expected_rows=expected_rows,
      interpret=True,
    )
    jaxpr = jax.make_jaxpr(fn)(x, dy, jnp.asarray(SIZES))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    return eqn.params["cost_estimate"]

  full, expected = costs(None), costs(100)
  assert full.flops == 2 * M * K * N and expected.flops == 2 * 100 * K * N
  out_bytes = 5 * K * N * 4
  # lhs rows once per n-tile (2), rhs rows once per k-tile (2), the output once.
  assert expected.bytes_accessed == 100 * K * 4 * 2 + 100 * N * 4 * 2 + out_bytes
  assert full.bytes_accessed == M * K * 4 * 2 + M * N * 4 * 2 + out_bytes


@pytest.mark.parametrize("tk", [32, K], ids=["k_tiled", "whole_k"])
def test_gmm_visit_kernel_cost_counts_refetched_blocks(tk):
  """The visit kernel's bytes: with tk < k every grid step moves to another k-tile, so each
  visit fetches its lhs tile and its group's weights again (per n-tile: tm * k and k * tn);
  with tk = k a group's weights stay put across its visits and lhs rows are read once."""
  from pallas_moe.gmm import gmm_pallas

  tm, tn, groups = 64, 128, len(SIZES)
  x, w = jnp.zeros((M, K), F32), jnp.zeros((groups, K, N), F32)

  def cost(expected_rows):
    fn = lambda x, w, gs: gmm_pallas(  # noqa: E731
      x,
      w,
      gs,
      tiling=(tm, tk, tn),
      out_dtype=F32,
      group_offset=jnp.int32(0),
      expected_rows=expected_rows,
      interpret=True,
    )
    jaxpr = jax.make_jaxpr(fn)(x, w, jnp.asarray(SIZES))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    return eqn.params["cost_estimate"]

  tiles_n, out_bytes = N // tn, M * N * 4
  for rows in (100, M):
    c = cost(rows if rows < M else None)
    assert c.flops == 2 * rows * K * N
    if tk < K:
      visits = -(-rows // tm) + groups  # m-tiles of the rows, plus one per group
      want = visits * tm * K * 4 * tiles_n + visits * K * N * 4 + out_bytes
    else:
      want = rows * K * 4 * tiles_n + groups * K * N * 4 + out_bytes
    assert c.bytes_accessed == want, (rows, c.bytes_accessed, want)
