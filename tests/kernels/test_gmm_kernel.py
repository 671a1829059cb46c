"""gmm forward: kernel vs the jnp reference and a float64 numpy loop, in both interpret modes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import (
  INTERPRET_MODES,
  RACE_PARAMS,
  examples,
  group_sizes_strategy,
  no_races_or_oob,
  np_gmm,
  random_array,
  reorder_tolerance,
  rounded,
  tolerance,
)

import pallas_moe
from pallas_moe import reference

# Static configurations (each compiles once; hypothesis then varies group sizes and data):
# (m, k, n, tiling, num_groups, in dtype, out dtype, transpose_rhs). Ragged m, k and n; k = 1408
# with tk = 256; k below 128; m below one tile; 1 to 32 groups; f32/bf16 in and out.
CASES = [
  (200, 1408, 100, (64, 256, 128), 8, jnp.float32, jnp.float32, False),
  (200, 96, 256, (32, 128, 128), 32, jnp.bfloat16, jnp.float32, True),
  (37, 300, 130, (16, 128, 128), 1, jnp.bfloat16, jnp.bfloat16, False),
  (128, 128, 128, (128, 128, 128), 5, jnp.float32, jnp.bfloat16, True),
  (8, 64, 40, (8, 128, 128), 3, jnp.float32, jnp.float32, False),
  (250, 200, 256, (64, 128, 128), 16, jnp.bfloat16, jnp.float32, False),
  # tm a multiple of the MXU rows (128 on the default v5e): sub-blocks outside a group skipped.
  (700, 256, 130, (512, 256, 128), 12, jnp.float32, jnp.float32, False),
  (300, 200, 256, (256, 128, 256), 5, jnp.bfloat16, jnp.float32, True),
]
CASE_IDS = [f"m{c[0]}k{c[1]}n{c[2]}g{c[4]}" + ("T" if c[7] else "") for c in CASES]


def check_gmm_case(case, sizes, seed, interpret):
  m, k, n, tiling, num_groups, in_dtype, out_dtype, transpose_rhs = case
  lhs = random_array(seed, (m, k), in_dtype)
  rhs_shape = (num_groups, n, k) if transpose_rhs else (num_groups, k, n)
  rhs = random_array(seed + 1, rhs_shape, in_dtype)
  out = pallas_moe.gmm(
    lhs,
    rhs,
    jnp.asarray(sizes),
    preferred_element_type=out_dtype,
    tiling=tiling,
    transpose_rhs=transpose_rhs,
    interpret=interpret,
  )
  assert out.shape == (m, n) and out.dtype == out_dtype
  out = np.asarray(out.astype(jnp.float32))
  tol = tolerance(in_dtype=in_dtype, out_dtype=out_dtype, k=k)
  expected = np_gmm(
    rounded(lhs, in_dtype), rounded(rhs, in_dtype), sizes, transpose_rhs=transpose_rhs
  )
  np.testing.assert_allclose(out, expected, **tol)
  ref = reference.gmm(lhs, rhs, jnp.asarray(sizes), out_dtype, transpose_rhs=transpose_rhs)
  np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), **tol)
  # Rows past sum(group_sizes) are exactly zero.
  assert not np.any(out[int(sizes.sum()) :])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@examples()
@given(data=st.data())
def test_gmm_matches_references(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[4]))
  check_gmm_case(case, sizes, data.draw(st.integers(0, 2**16)), INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("case", CASES[:4] + CASES[-1:], ids=CASE_IDS[:4] + CASE_IDS[-1:])
@examples(0.25)
@given(data=st.data())
def test_gmm_matches_references_tpu_simulator(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[4]))
  check_gmm_case(case, sizes, data.draw(st.integers(0, 2**16)), INTERPRET_MODES["tpu"])


@examples(0.25)
@given(data=st.data(), num_groups=st.integers(1, 32), transpose_rhs=st.booleans())
def test_gmm_any_group_count(data, num_groups, transpose_rhs):
  """Any number of groups from 1 to 32 (each a new compile, so fewer examples)."""
  case = (72, 200, 130, (16, 128, 128), num_groups, jnp.float32, jnp.float32, transpose_rhs)
  sizes = data.draw(group_sizes_strategy(m=72, num_groups=num_groups))
  check_gmm_case(case, sizes, 0, INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("mode", INTERPRET_MODES)
@pytest.mark.parametrize("existing", [False, True])
def test_rows_past_sum_exact(mode, existing):
  """Rows past sum(group_sizes) are 0 (or existing_out), never NaN, under both interpreters.

  The TPU simulator fills uninitialized VMEM and output buffers with NaN: an unwritten row shows.
  """
  m, k, n = 72, 128, 128
  sizes = jnp.array([10, 0, 21, 5], jnp.int32)  # 36 of 72 rows
  lhs = random_array(0, (m, k), jnp.float32)
  rhs = random_array(1, (4, k, n), jnp.float32)
  existing_out = random_array(2, (m, n), jnp.float32) if existing else None
  out = np.asarray(
    pallas_moe.gmm(
      lhs,
      rhs,
      sizes,
      tiling=(16, 128, 128),
      existing_out=existing_out,
      interpret=INTERPRET_MODES[mode],
    )
  )
  assert not np.isnan(out).any()
  tail = out[36:]
  if existing:
    np.testing.assert_array_equal(tail, np.asarray(existing_out)[36:])
  else:
    np.testing.assert_array_equal(tail, np.zeros_like(tail))
  np.testing.assert_allclose(out[:36], np_gmm(lhs, rhs, sizes)[:36], rtol=2e-5, atol=3e-4)


@pytest.mark.parametrize(
  "mode, num_shards, transpose_rhs",
  [("hlo", 2, False), ("hlo", 4, True), ("hlo", 4, False), ("tpu", 4, True)],
)
@examples(0.25)
@given(data=st.data())
def test_sharded_groups_chain_to_unsharded(mode, num_shards, transpose_rhs, data):
  """Splitting groups into shards via group_offset and chaining existing_out = unsharded gmm."""
  m, k, n, num_groups = 100, 200, 130, 8
  sizes = jnp.asarray(data.draw(group_sizes_strategy(m=m, num_groups=num_groups)))
  lhs = random_array(3, (m, k), jnp.float32)
  rhs = random_array(4, (num_groups, n, k) if transpose_rhs else (num_groups, k, n), jnp.float32)
  kw = dict(tiling=(32, 128, 128), transpose_rhs=transpose_rhs, interpret=INTERPRET_MODES[mode])
  full = pallas_moe.gmm(lhs, rhs, sizes, **kw)
  per = num_groups // num_shards
  out = None
  for shard in range(num_shards):
    local_rhs = rhs[shard * per : (shard + 1) * per]
    out = pallas_moe.gmm(lhs, local_rhs, sizes, group_offset=shard * per, existing_out=out, **kw)
  # NOTE: the same k-long dots per row; the chained program may still block them differently.
  tol = reorder_tolerance(dtype=np.float32, terms=k, scale=np.sqrt(k))
  np.testing.assert_allclose(np.asarray(out), np.asarray(full), **tol)
  expected = np_gmm(lhs, rhs, np.asarray(sizes), transpose_rhs=transpose_rhs)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=4e-4)


def test_traced_group_offset_under_jit():
  m, k, n = 64, 128, 128
  sizes = jnp.array([10, 20, 0, 30], jnp.int32)
  lhs = random_array(5, (m, k), jnp.float32)
  rhs = random_array(6, (4, k, n), jnp.float32)

  @jax.jit
  def shard_out(offset):
    return pallas_moe.gmm(lhs, rhs[2:], sizes, group_offset=offset, tiling=(16, 128, 128))

  out = np.asarray(shard_out(jnp.int32(2)))
  np.testing.assert_allclose(out, np_gmm(lhs, rhs[2:], sizes, group_offset=2), rtol=2e-5, atol=3e-4)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_no_race_no_oob_two_cores(capfd, transpose_rhs):
  """TPU simulator with the race detector on 2 cores: no race, no out-of-bounds access."""
  m, k, n = 50, 300, 260  # ragged m, k and n: edge blocks everywhere
  sizes = jnp.array([7, 0, 20, 13, 0], jnp.int32)
  lhs = random_array(7, (m, k), jnp.bfloat16)
  rhs = random_array(8, (5, n, k) if transpose_rhs else (5, k, n), jnp.bfloat16)
  existing_out = random_array(9, (m, n), jnp.float32)
  with no_races_or_oob(capfd):
    out = pallas_moe.gmm(
      lhs,
      rhs[1:4],
      sizes,
      jnp.float32,
      (16, 128, 128),
      1,
      existing_out,
      transpose_rhs,
      RACE_PARAMS,
    )
    out = np.asarray(out)
  expected = np_gmm(
    rounded(lhs, jnp.bfloat16),
    rounded(rhs[1:4], jnp.bfloat16),
    sizes,
    group_offset=1,
    existing_out=existing_out,
    transpose_rhs=transpose_rhs,
  )
  np.testing.assert_allclose(out, expected, rtol=2e-5, atol=1e-3)
