"""tgmm: kernel vs the jnp reference and a float64 numpy loop, in both interpret modes."""

from __future__ import annotations

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
  np_tgmm,
  random_array,
  reorder_tolerance,
  rounded,
  tolerance,
)

import pallas_moe
from pallas_moe import reference

# Static configurations (each compiles once; hypothesis varies group sizes and data):
# (m, k, n, tiling, num_groups, in dtype, out dtype). Ragged m, k (tgmm's output rows) and n,
# k below 128, k = 1408 with tk = 256, 1 to 32 groups.
CASES = [
  (200, 1408, 100, (128, 256, 128), 8, jnp.float32, jnp.float32),
  (300, 96, 256, (128, 96, 128), 32, jnp.bfloat16, jnp.float32),
  (37, 40, 130, (128, 16, 128), 1, jnp.bfloat16, jnp.bfloat16),
  (256, 128, 128, (128, 128, 128), 5, jnp.float32, jnp.bfloat16),
  # tm a multiple of the MXU rows: sub-blocks outside a group skipped.
  (700, 136, 128, (512, 136, 128), 12, jnp.float32, jnp.float32),
]
CASE_IDS = [f"m{c[0]}k{c[1]}n{c[2]}g{c[4]}" for c in CASES]


def check_tgmm_case(case, sizes, seed, interpret):
  m, k, n, tiling, num_groups, in_dtype, out_dtype = case
  lhs = random_array(seed, (k, m), in_dtype)
  rhs = random_array(seed + 1, (m, n), in_dtype)
  out = pallas_moe.tgmm(lhs, rhs, jnp.asarray(sizes), out_dtype, tiling, interpret=interpret)
  assert out.shape == (num_groups, k, n) and out.dtype == out_dtype
  out = np.asarray(out.astype(jnp.float32))
  # Each output sums over at most m rows.
  tol = tolerance(in_dtype=in_dtype, out_dtype=out_dtype, k=m)
  expected = np_tgmm(rounded(lhs, in_dtype), rounded(rhs, in_dtype), sizes)
  np.testing.assert_allclose(out, expected, **tol)
  ref = reference.tgmm(lhs, rhs, jnp.asarray(sizes), out_dtype)
  np.testing.assert_allclose(out, np.asarray(ref.astype(jnp.float32)), **tol)
  # Empty groups are exact zeros.
  assert not np.any(out[sizes == 0])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@examples()
@given(data=st.data())
def test_tgmm_matches_references(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[4]))
  check_tgmm_case(case, sizes, data.draw(st.integers(0, 2**16)), INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@examples(0.25)
@given(data=st.data())
def test_tgmm_matches_references_tpu_simulator(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[4]))
  check_tgmm_case(case, sizes, data.draw(st.integers(0, 2**16)), INTERPRET_MODES["tpu"])


@examples(0.25)
@given(data=st.data(), num_groups=st.integers(1, 32))
def test_tgmm_any_group_count(data, num_groups):
  case = (150, 64, 128, (128, 64, 128), num_groups, jnp.float32, jnp.float32)
  sizes = data.draw(group_sizes_strategy(m=150, num_groups=num_groups))
  check_tgmm_case(case, sizes, 0, INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("mode", INTERPRET_MODES)
def test_empty_groups_exact_zero_and_existing_added(mode):
  m, k, n = 130, 64, 128
  sizes = jnp.array([0, 40, 0, 0, 50, 0], jnp.int32)  # 90 of 130 rows; empty at both ends
  lhs = random_array(0, (k, m), jnp.float32)
  rhs = random_array(1, (m, n), jnp.float32)
  out = np.asarray(
    pallas_moe.tgmm(lhs, rhs, sizes, tiling=(128, 64, 128), interpret=INTERPRET_MODES[mode])
  )
  assert not np.isnan(out).any()
  for g in (0, 2, 3, 5):
    np.testing.assert_array_equal(out[g], np.zeros((k, n)))
  np.testing.assert_allclose(out, np_tgmm(lhs, rhs, sizes), rtol=2e-5, atol=3e-4)
  existing = random_array(2, (6, k, n), jnp.float32)
  out2 = np.asarray(
    pallas_moe.tgmm(
      lhs, rhs, sizes, tiling=(128, 64, 128), existing_out=existing, interpret=INTERPRET_MODES[mode]
    )
  )
  # NOTE: the kernel adds existing_out to its m-long sums; here it is added after them.
  tol = reorder_tolerance(dtype=np.float32, terms=m, scale=np.sqrt(m))
  np.testing.assert_allclose(out2, out + np.asarray(existing), **tol)
  for g in (0, 2, 3, 5):  # empty group + existing_out = existing_out exactly
    np.testing.assert_array_equal(out2[g], np.asarray(existing)[g])


@pytest.mark.parametrize("mode, num_shards", [("hlo", 2), ("hlo", 4), ("tpu", 4)])
@examples(0.25)
@given(data=st.data())
def test_sharded_groups_reproduce_slices(mode, num_shards, data):
  """tgmm per shard (group_offset, num_actual_groups) reproduces the unsharded slices."""
  m, k, n, num_groups = 200, 64, 130, 8
  sizes = jnp.asarray(data.draw(group_sizes_strategy(m=m, num_groups=num_groups)))
  lhs = random_array(3, (k, m), jnp.float32)
  rhs = random_array(4, (m, n), jnp.float32)
  kw = dict(tiling=(128, 64, 128), interpret=INTERPRET_MODES[mode])
  full = np.asarray(pallas_moe.tgmm(lhs, rhs, sizes, **kw))
  per = num_groups // num_shards
  for shard in range(num_shards):
    part = pallas_moe.tgmm(lhs, rhs, sizes, group_offset=shard * per, num_actual_groups=per, **kw)
    np.testing.assert_allclose(
      np.asarray(part),
      full[shard * per : (shard + 1) * per],
      **reorder_tolerance(dtype=np.float32, terms=m, scale=np.sqrt(m)),
    )
  np.testing.assert_allclose(full, np_tgmm(lhs, rhs, np.asarray(sizes)), rtol=2e-5, atol=4e-4)


def test_no_race_no_oob_two_cores(capfd):
  """TPU simulator with the race detector on 2 cores (both parallel axes split): clean."""
  m, k, n = 150, 200, 260  # ragged everything
  sizes = jnp.array([0, 30, 0, 70, 20, 0], jnp.int32)
  lhs = random_array(5, (k, m), jnp.bfloat16)
  rhs = random_array(6, (m, n), jnp.bfloat16)
  existing = random_array(7, (4, k, n), jnp.float32)
  with no_races_or_oob(capfd):
    out = np.asarray(
      pallas_moe.tgmm(lhs, rhs, sizes, jnp.float32, (128, 128, 128), 1, 4, existing, RACE_PARAMS)
    )
  expected = np_tgmm(
    rounded(lhs, jnp.bfloat16),
    rounded(rhs, jnp.bfloat16),
    sizes,
    group_offset=1,
    num_actual_groups=4,
    existing_out=existing,
  )
  np.testing.assert_allclose(out, expected, rtol=2e-5, atol=1e-3)


@pytest.mark.parametrize("tiling", [None, (256, 128, 128)], ids=["heuristic", "tiles"])
def test_public_tgmm_transpose_lhs(tiling):
  """`tgmm(x, dy, ..., transpose_lhs=True)` with x as the [m, k] array gmm's lhs is: the same
  weight gradient as tgmm(x.T, dy) and the references (an empty group's block exact zeros), on a
  shard of the groups; bad calls are refused with errors that say what to pass."""
  m, k, n = 300, 128, 256
  x = random_array(1, (m, k), jnp.bfloat16)
  dy = random_array(2, (m, n), jnp.bfloat16)
  sizes = jnp.asarray([40, 0, 77, 90, 60], jnp.int32)
  kw = dict(group_offset=1, num_actual_groups=4, interpret=INTERPRET_MODES["hlo"])
  out = pallas_moe.tgmm(x, dy, sizes, jnp.float32, tiling, transpose_lhs=True, **kw)
  plain = pallas_moe.tgmm(x.T, dy, sizes, jnp.float32, tiling, **kw)
  want = np_tgmm(
    rounded(x.T, jnp.bfloat16),
    rounded(dy, jnp.bfloat16),
    np.asarray(sizes),
    group_offset=1,
    num_actual_groups=4,
  )
  tol = tolerance(in_dtype=jnp.bfloat16, out_dtype=jnp.float32, k=m)
  np.testing.assert_allclose(np.asarray(out), want, **tol)
  np.testing.assert_allclose(np.asarray(out), np.asarray(plain), **tol)
  assert not np.any(np.asarray(out)[0])  # group 1 is empty
  with pytest.raises(ValueError, match="first dims must both be m"):
    pallas_moe.tgmm(x.T, dy, sizes, transpose_lhs=True, **kw)
  with pytest.raises(ValueError, match="transpose_lhs=True` takes float operands"):
    pallas_moe.tgmm(
      x.astype(jnp.int8),
      dy,
      sizes,
      transpose_lhs=True,
      lhs_scales=jnp.ones((1, m), jnp.float32),
      **kw,
    )
  with pytest.raises(TypeError, match="transpose_lhs"):
    pallas_moe.tgmm(x, dy, sizes, transpose_lhs=1, **kw)
