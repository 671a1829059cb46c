"""Row-tile gmm / tgmm kernels: vs the references in both interpret modes, race detector, counts.

The row-tile kernels (one grid step per m-tile, per-group weights / outputs by manual DMA) are
what `pallas_moe.ops` runs by default; tests of the public ops exercise them too. Here they are
called directly, so each static case is known to run them, and their instrumentation (MXU rows,
weight loads, output writes per grid step) is checked against the schedule-derived counts the
cost model uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import kernel_testing
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import (
  INTERPRET_MODES,
  RACE_PARAMS,
  examples,
  group_sizes_strategy,
  no_races_or_oob,
  np_gmm,
  np_tgmm,
  pushed_rows,
  pushed_rows_per_tile,
  random_array,
  rounded,
  tolerance,
)

import pallas_moe
from pallas_moe import common, metadata, ops, probe, reference, tiling
from pallas_moe.gmm import gmm_rowtile_pallas
from pallas_moe.tgmm import tgmm_rowtile_pallas

# (m, k, n, tm, tn, sub_m, groups_total, local, in dtype, out dtype, transpose_rhs, existing)
GMM_CASES = [
  (67, 40, 48, 16, 16, 8, 5, 5, jnp.float32, jnp.float32, False, False),
  (67, 40, 48, 16, 48, 16, 5, 3, jnp.float32, jnp.float32, True, True),
  (200, 96, 256, 96, 128, 32, 16, 16, jnp.bfloat16, jnp.float32, False, False),
  (130, 64, 128, 256, 128, 256, 6, 4, jnp.bfloat16, jnp.bfloat16, True, False),
  (300, 128, 256, 128, 256, 32, 9, 9, jnp.float32, jnp.bfloat16, False, True),
  (67, 40, 48, 16, 16, 8, 4, 1, jnp.float32, jnp.float32, True, False),
]
# NOTE: tm 96 (three 32-row passes, a ragged third tile): the picker's m-tiles need not be powers
# of two.
# NOTE: cases run the kernel with `sequential_sweeps` (DMAs crossing n-tiles) or without, fixed
# per case so each static configuration is compiled once; both modes have several n-tiles and a
# single local group.
GMM_SEQUENTIAL = {1, 2, 5}
# NOTE: likewise `rows_stationary` (out^T = w^T @ x^T): with [k, tn] weights (transposed once per
# load) in both sweep modes, and with transposed weights (read as they are).
GMM_ROWS_STATIONARY = {0, 2, 3}
GMM_IDS = [
  f"m{c[0]}k{c[1]}n{c[2]}tm{c[3]}g{c[6]}l{c[7]}"
  f"{'-seq' if i in GMM_SEQUENTIAL else ''}{'-rs' if i in GMM_ROWS_STATIONARY else ''}"
  for i, c in enumerate(GMM_CASES)
]

# (m, k, n, tm, tk, tn, sub_m, groups_total, local, in dtype, out dtype, existing)
TGMM_CASES = [
  (67, 40, 48, 16, 40, 16, 8, 5, 5, jnp.float32, jnp.float32, False),
  (67, 32, 48, 16, 16, 48, 16, 5, 3, jnp.float32, jnp.float32, True),
  (200, 96, 256, 128, 32, 128, 128, 16, 16, jnp.bfloat16, jnp.float32, False),
  (300, 64, 128, 256, 64, 128, 128, 9, 6, jnp.bfloat16, jnp.bfloat16, True),
  (67, 32, 48, 16, 16, 16, 8, 3, 1, jnp.float32, jnp.float32, False),
  (101, 32, 48, 64, 16, 48, 16, 6, 4, jnp.float32, jnp.float32, False),
]
TGMM_SEQUENTIAL = {1, 2, 4}
TGMM_ROWS_STATIONARY = {1, 3}
# NOTE: lhs given as [m, k] (`transpose_lhs`, as gmm's backward passes it): its rows are sublanes,
# so a group's passes start at its first row rounded to 8 rows (f32) or 16 (bf16) rather than on
# the sub_m grid. Case 5: four 16-row passes per 64-row tile, 8-row aligned; case 3: two
# 128-row passes per 256-row bf16 tile, 16-row aligned, rows stationary.
TGMM_TRANSPOSED = {3, 5}
TGMM_IDS = [
  f"m{c[0]}k{c[1]}n{c[2]}tm{c[3]}g{c[7]}l{c[8]}"
  f"{'-seq' if i in TGMM_SEQUENTIAL else ''}{'-rs' if i in TGMM_ROWS_STATIONARY else ''}"
  f"{'-tl' if i in TGMM_TRANSPOSED else ''}"
  for i, c in enumerate(TGMM_CASES)
]


@functools.cache
def _jitted(kernel, **static):
  """The kernel jitted once per static configuration (eager pallas_calls re-lower every call)."""

  def call(lhs, rhs, group_sizes, group_offset, existing_out):
    return kernel(
      lhs, rhs, group_sizes, group_offset=group_offset, existing_out=existing_out, **static
    )

  return jax.jit(call)


def _draw_shard(data, total, local):
  offset = data.draw(st.integers(0, total - local))
  return offset


def _check_drawn(check, case, data, interpret, *, kind):
  """Draws group sizes, a shard and a seed for a GMM_CASES / TGMM_CASES case and checks it, in
  the case's fixed sweep mode and MXU orientation."""
  cases, sequential, stationary, total, local = {
    "gmm": (GMM_CASES, GMM_SEQUENTIAL, GMM_ROWS_STATIONARY, 6, 7),
    "tgmm": (TGMM_CASES, TGMM_SEQUENTIAL, TGMM_ROWS_STATIONARY, 7, 8),
  }[kind]
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[total]))
  offset = _draw_shard(data, case[total], case[local])
  seed = data.draw(st.integers(0, 2**16))
  index = cases.index(case)
  extra = dict(transpose_lhs=index in TGMM_TRANSPOSED) if kind == "tgmm" else {}
  check(
    case,
    sizes,
    offset,
    seed,
    interpret,
    sequential=index in sequential,
    rows_stationary=index in stationary,
    **extra,
  )


def check_gmm(
  case, sizes, offset, seed, interpret, *, count=True, sequential=False, rows_stationary=False
):
  m, k, n, tm, tn, sub_m, _, local, in_dtype, out_dtype, transpose_rhs, has_existing = case
  lhs = random_array(seed, (m, k), in_dtype)
  rhs = random_array(seed + 1, (local, n, k) if transpose_rhs else (local, k, n), in_dtype)
  existing = random_array(seed + 2, (m, n), out_dtype) if has_existing else None
  fn = _jitted(
    probe.with_row_counts(gmm_rowtile_pallas) if count else gmm_rowtile_pallas,
    tm=tm,
    tn=tn,
    out_dtype=out_dtype,
    transpose_rhs=transpose_rhs,
    sub_m=sub_m,
    sequential_sweeps=sequential,
    rows_stationary=rows_stationary,
    interpret=interpret,
  )
  out = fn(lhs, rhs, jnp.asarray(sizes), jnp.int32(offset), existing)
  out, counts = out if count else (out, None)
  assert out.shape == (m, n) and out.dtype == out_dtype
  got = np.asarray(out.astype(jnp.float32))
  tol = tolerance(in_dtype=in_dtype, out_dtype=out_dtype, k=k)
  expected = np_gmm(
    rounded(lhs, in_dtype),
    rounded(rhs, in_dtype),
    sizes,
    group_offset=offset,
    existing_out=None if existing is None else rounded(existing, out_dtype),
    transpose_rhs=transpose_rhs,
  )
  np.testing.assert_allclose(got, expected, **tol)
  ref = reference.gmm(
    lhs,
    rhs,
    jnp.asarray(sizes),
    out_dtype,
    group_offset=offset,
    existing_out=existing,
    transpose_rhs=transpose_rhs,
  )
  np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), **tol)
  if existing is None:
    # Rows outside the local groups (other shards, past sum(group_sizes)) are exactly zero.
    mask = np.asarray(ops._local_rows_mask(jnp.asarray(sizes), offset, local, m))
    assert not np.any(got[~mask])
  if counts is None:
    return
  # Instrumentation: MXU rows per tile = the schedule-derived count; each non-empty local group's
  # weights are loaded exactly once per n-tile, in the tile of its first row.
  counts = np.asarray(counts)
  groups = metadata.make_tile_groups(
    group_sizes=jnp.asarray(sizes),
    group_offset=offset,
    num_local_groups=local,
    m=m,
    tm=tm,
    finalize_empty_groups=False,
  )
  granule = max(common.row_granule(in_dtype), common.row_granule(out_dtype))
  align = metadata.pass_align(sub_m=sub_m, tm=tm, row_granule=granule)
  tail = metadata.merge_tail_rows(sub_m=sub_m, tm=tm, align=align, rows_stationary=rows_stationary)
  if metadata.uses_pass_cuts(m=m, tm=tm, sub_m=sub_m, align=align):
    want = _pass_cut_counts(
      sizes, offset, local, m=m, tm=tm, sub_m=sub_m, align=align, tail=tail, in_dtype=in_dtype,
      out_dtype=out_dtype, sequential=sequential, interpret=interpret, sweeps=counts.shape[0],
    )  # fmt: skip
    np.testing.assert_array_equal(counts[..., [0, 2, 3]], want)
    nonempty = int(np.sum(np.asarray(sizes)[offset : offset + local] > 0))
    np.testing.assert_array_equal(counts[..., 1].sum(axis=1), nonempty)
    return
  rows = np.asarray(
    kernel_testing.rowtile_mxu_rows(
      groups, group_offset=offset, m=m, tm=tm, sub_m=sub_m, align=align, tail=tail
    )
  )
  np.testing.assert_array_equal(counts[..., 0], np.broadcast_to(rows, counts.shape[:2]))
  nonempty = int(np.sum(np.asarray(sizes)[offset : offset + local] > 0))
  np.testing.assert_array_equal(counts[..., 1].sum(axis=1), nonempty)
  # lhs rows fetched and output rows written per tile: the local rows rounded to the granule.
  fetched = _edge_rows(
    sizes, offset, local, m=m, tm=tm, granule=8 * max(1, 4 // np.dtype(in_dtype).itemsize)
  )
  if sequential and np.count_nonzero(fetched) == 1:
    fetched = np.stack([fetched] + [0 * fetched] * (counts.shape[0] - 1))  # kept after sweep 0
  np.testing.assert_array_equal(counts[..., 2], np.broadcast_to(fetched, counts.shape[:2]))
  # NOTE: the whole visited tiles are written back (their other rows hold zeros), also the one
  # tile a shard without rows visits.
  # NOTE: the TPU simulator's output is padded to whole tiles (see gmm_rowtile_pallas).
  first_tile, visited = np.asarray(groups.active_tiles)
  granule = 8 * max(1, 4 // np.dtype(out_dtype).itemsize)
  out_rows = -(-m // granule) * granule if tm % granule == 0 else m  # NOTE: see gmm_rowtile
  if isinstance(interpret, pltpu.InterpretParams):
    out_rows = counts.shape[1] * tm
  written = np.zeros(counts.shape[1], np.int64)
  for t in range(first_tile, first_tile + visited):
    written[t] = min(tm, out_rows - t * tm)
  np.testing.assert_array_equal(counts[..., 3], np.broadcast_to(written, counts.shape[:2]))


def _pass_cut_counts(
  sizes,
  offset,
  local,
  *,
  m,
  tm,
  sub_m,
  align,
  tail,
  in_dtype,
  out_dtype,
  sequential,
  interpret,
  sweeps,
  whole=True,
):
  """[sweeps, tiles, 3] (MXU rows, lhs rows fetched, output rows written) per cut tile, from the
  numpy cuts (`metadata.pass_cut_rows`) and the kernel's passes restated (`pushed_rows`),
  independent of the kernel's traced metadata."""
  sizes = np.asarray(sizes, np.int64)
  offsets = np.concatenate([[0], np.minimum(np.cumsum(sizes), m)])
  starts, ends = offsets[offset : offset + local], offsets[offset + 1 : offset + local + 1]
  rows_start, rows_end = starts[0], ends[-1]
  first_fixed = rows_start // tm
  if rows_end <= rows_start:
    first_fixed = min(first_fixed, -(-m // tm) - 1)
  num_fixed = (rows_end - 1) // tm - first_fixed + 1 if rows_end > rows_start else 1
  lhs_granule, out_granule = common.row_granule(in_dtype), common.row_granule(out_dtype)
  out_rows = -(-m // out_granule) * out_granule
  if isinstance(interpret, pltpu.InterpretParams):
    out_rows = -(-m // tm) * tm  # NOTE: see gmm_rowtile_pallas (aliased output, simulator)
  first_row = first_fixed * tm
  if not whole and rows_end > rows_start:
    first_row = rows_start // align * align
  cuts = metadata.pass_cut_rows(
    starts=starts, ends=ends, first_row=first_row,
    fixed_end=min((first_fixed + num_fixed) * tm, m), m=m, tm=tm, sub_m=sub_m, align=align,
    write_whole_tiles=whole, xp=np,
  )  # fmt: skip
  c, reach = cuts["tile_start"], cuts["tile_reach"]
  tiles = int(cuts["num_tiles"][0])
  want = np.zeros((tiles, 3), np.int64)
  for t in range(tiles):
    for g in range(cuts["tile_first_group"][t], cuts["tile_last_group"][t] + 1):
      if ends[g] > starts[g]:
        s, e = max(starts[g], c[t]) - c[t], min(ends[g], c[t + 1]) - c[t]
        want[t, 0] += pushed_rows(s, e, ends[g] - c[t], sub_m=sub_m, align=align, tail=tail, tm=tm)
    lo = max(rows_start - c[t], 0)
    for col, (lo_t, hi_t, granule, rows) in enumerate(
      [(lo, reach[t] - c[t], lhs_granule, -(-m // lhs_granule) * lhs_granule),
       (0 if whole else lo, c[t + 1] - c[t], out_granule, out_rows)], start=1,
    ):  # fmt: skip
      first, end = common.tile_row_range(
        row0=c[t], lo=lo_t, hi=hi_t, tm=tm, m=rows, granule=granule
      )
      want[t, col] = end - first
  out = np.zeros((sweeps, max(metadata.max_pass_cut_tiles(m=m, tm=tm, sub_m=sub_m), tiles), 3))
  out[:, :tiles] = want
  if sequential and tiles == 1:
    out[1:, :, 1] = 0  # NOTE: a single tile's lhs block is kept across sweeps
  return out[:, : metadata.max_pass_cut_tiles(m=m, tm=tm, sub_m=sub_m)]


def _edge_rows(sizes, offset, local, *, m, tm, granule):
  """Rows a row-tile kernel moves per m-tile: its local rows rounded out to the DMA granule
  (the whole tile when the granule does not divide tm), clipped at m; 0 for tiles without
  local rows."""
  ends = np.cumsum(sizes)
  start, end = (ends - sizes)[offset], ends[offset + local - 1]
  rows = np.zeros(-(-m // tm), np.int64)
  if tm % granule == 0:
    m = -(-m // granule) * granule  # NOTE: gmm pads its lhs and output to the granule
  for t in range(rows.size):
    row0 = t * tm
    lo, hi = max(start - row0, 0), min(end - row0, tm)
    if hi <= lo:
      continue
    if tm % granule:
      lo, hi = 0, tm
    first, last = lo // granule * granule, min(-(-hi // granule) * granule, m - row0)
    if m % granule and last > m - m % granule - row0:
      first = 0  # NOTE: a range reaching m's unaligned tail moves the tile from row 0
    rows[t] = last - first
  return rows


@pytest.mark.parametrize("case", GMM_CASES, ids=GMM_IDS)
@examples(0.5)
@given(data=st.data())
def test_gmm_rowtile_matches_references(case, data):
  _check_drawn(check_gmm, case, data, INTERPRET_MODES["hlo"], kind="gmm")


@pytest.mark.parametrize("case", GMM_CASES[1:3], ids=GMM_IDS[1:3])
@examples(0.25)
@given(data=st.data())
def test_gmm_rowtile_tpu_simulator(case, data):
  _check_drawn(check_gmm, case, data, INTERPRET_MODES["tpu"], kind="gmm")


def check_tgmm(
  case,
  sizes,
  offset,
  seed,
  interpret,
  *,
  count=True,
  sequential=False,
  rows_stationary=False,
  interior_subs=None,
  transpose_lhs=False,
):
  m, k, n, tm, tk, tn, sub_m, _, local, in_dtype, out_dtype, has_existing = case
  # NOTE: with transpose_lhs the kernel gets lhs^T as the [m, k] array; references take [k, m].
  lhs = random_array(seed, (k, m), in_dtype)
  rhs = random_array(seed + 1, (m, n), in_dtype)
  existing = random_array(seed + 2, (local, k, n), out_dtype) if has_existing else None
  extra = {} if interior_subs is None else dict(interior_subs=interior_subs)
  if transpose_lhs:
    extra["transpose_lhs"] = True
  fn = _jitted(
    probe.with_row_counts(tgmm_rowtile_pallas) if count else tgmm_rowtile_pallas,
    tiling=(tm, tk, tn),
    out_dtype=out_dtype,
    num_actual_groups=local,
    sub_m=sub_m,
    sequential_sweeps=sequential,
    rows_stationary=rows_stationary,
    interpret=interpret,
    **extra,
  )
  out = fn(lhs.T if transpose_lhs else lhs, rhs, jnp.asarray(sizes), jnp.int32(offset), existing)
  out, counts = out if count else (out, None)
  assert out.shape == (local, k, n) and out.dtype == out_dtype
  got = np.asarray(out.astype(jnp.float32))
  tol = tolerance(in_dtype=in_dtype, out_dtype=out_dtype, k=m)
  expected = np_tgmm(
    rounded(lhs, in_dtype),
    rounded(rhs, in_dtype),
    sizes,
    group_offset=offset,
    num_actual_groups=local,
    existing_out=None if existing is None else rounded(existing, out_dtype),
  )
  np.testing.assert_allclose(got, expected, **tol)
  ref = reference.tgmm(
    lhs,
    rhs,
    jnp.asarray(sizes),
    out_dtype,
    group_offset=offset,
    num_actual_groups=local,
    existing_out=existing,
  )
  np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), **tol)
  if existing is None:
    empty = np.asarray(sizes)[offset : offset + local] == 0
    assert not np.any(got[empty])  # exact zeros for empty groups
  if counts is None:
    return
  counts = np.asarray(counts)
  groups = metadata.make_tile_groups(
    group_sizes=jnp.asarray(sizes),
    group_offset=offset,
    num_local_groups=local,
    m=m,
    tm=tm,
    finalize_empty_groups=True,
  )
  align = _tgmm_align(case, transpose_lhs)
  rows = kernel_testing.rowtile_mxu_rows(
    groups, group_offset=offset, m=m, tm=tm, sub_m=sub_m, align=align
  )
  rows = np.asarray(rows)
  np.testing.assert_array_equal(counts[..., 0], np.broadcast_to(rows, counts.shape[:3]))
  # NOTE: the same count restated from the rule (`pushed_rows`: passes from each group's first row
  # in the tile rounded down to align; no widened pass).
  cum = np.cumsum(sizes)
  starts = np.minimum(cum - sizes, m)[offset : offset + local]
  ends = np.minimum(cum, m)[offset : offset + local]
  want = pushed_rows_per_tile(starts, ends, tiles=rows.size, tm=tm, sub_m=sub_m, align=align)
  np.testing.assert_array_equal(rows, want)
  # Every local group's output block is written exactly once per (k, n) sweep.
  np.testing.assert_array_equal(counts[..., 1].sum(axis=2), local)


def _tgmm_align(case, transpose_lhs: bool) -> int:
  """The row-tile tgmm's pass alignment for a TGMM_CASES case (the model's `tgmm_pass_align`)."""
  _, _, _, tm, _, _, sub_m, _, _, in_dtype, _, _ = case
  size = jnp.dtype(in_dtype).itemsize
  return tiling.tgmm_pass_align(
    sub_m=sub_m, tm=tm, lhs_itemsize=size, rhs_itemsize=size, transpose_lhs=transpose_lhs
  )


@pytest.mark.parametrize("case", TGMM_CASES, ids=TGMM_IDS)
@examples(0.5)
@given(data=st.data())
def test_tgmm_rowtile_matches_references(case, data):
  _check_drawn(check_tgmm, case, data, INTERPRET_MODES["hlo"], kind="tgmm")


@pytest.mark.parametrize("case", TGMM_CASES[1:2], ids=TGMM_IDS[1:2])
@examples(0.25)
@given(data=st.data())
def test_tgmm_rowtile_tpu_simulator(case, data):
  _check_drawn(check_tgmm, case, data, INTERPRET_MODES["tpu"], kind="tgmm")


# NOTE: 8 sub-blocks per tile (tm = 64, sub_m = 8), ragged last tile, a shard of 6 of 7 groups.
INTERIOR_TGMM = (203, 32, 48, 64, 16, 48, 8, 7, 6, jnp.float32, jnp.float32, False)
INTERIOR_SIZES = [
  # Groups starting mid-sub-block with 7 whole sub-blocks after their first (odd), 4 whole and a
  # ragged last one, an empty group between them.
  ([3, 70, 0, 45, 17, 60, 5], 0),
  # Groups covering whole tiles they did not start in (8 whole sub-blocks, no masked one), starts
  # and ends on sub-block and tile boundaries, an empty group at the shard's end.
  ([5, 150, 40, 0, 8, 0, 0], 1),
]


# NOTE: the same with lhs given as [m, k] (`transpose_lhs`) and 16-row passes (four per tile)
# that start at each group's first row rounded to 8 rows: runs and moved-back last passes.
INTERIOR_TGMM_TL = INTERIOR_TGMM[:6] + (16,) + INTERIOR_TGMM[7:]


@pytest.mark.parametrize(
  "rows_stationary, transpose_lhs", [(False, False), (True, True)], ids=["", "rs-tl"]
)
def test_tgmm_rowtile_interior_runs_simulator_no_races(capfd, rows_stationary, transpose_lhs):
  """The interior-run path under the TPU simulator (out-of-bounds reads raise) with its race
  detector on 2 simulated cores: on the pass grid, and with `rows_stationary` and passes from each
  group's first row (`transpose_lhs`)."""
  sizes = np.asarray(INTERIOR_SIZES[0][0], np.int32)
  with no_races_or_oob(capfd):
    check_tgmm(
      INTERIOR_TGMM_TL if transpose_lhs else INTERIOR_TGMM,
      sizes,
      INTERIOR_SIZES[0][1],
      3,
      RACE_PARAMS,
      count=False,
      rows_stationary=rows_stationary,
      interior_subs=2,
      transpose_lhs=transpose_lhs,
    )


@pytest.mark.parametrize(
  "sequential, stationary", [(False, False), (True, True)], ids=["parallel", "sequential-rs"]
)
def test_rowtile_kernels_have_no_races(capfd, sequential, stationary):
  """The DMA slots and semaphores are used race-free: with 2 simulated cores on the parallel
  axes, and with `sequential_sweeps` (DMAs crossing sweeps, all axes arbitrary; here with
  `rows_stationary`, whose prepared weights are written once per load).

  NOTE: without the row-count probe (`probe.count_rows`): its SMEM output is per core in the
  simulator.
  """
  # NOTE: a shard (groups 1..4, rows 13..32) in the middle of a receive buffer with slack: the
  # kernels visit tiles 0..2 only and the zero fill writes tiles 3..4.
  sizes = np.array([13, 0, 7, 12, 0, 3], np.int32)
  kw = dict(count=False, sequential=sequential, rows_stationary=stationary)
  with no_races_or_oob(capfd):
    gmm_case = GMM_CASES[0][:6] + (6, 4) + GMM_CASES[0][8:]
    check_gmm(gmm_case, sizes, 1, 3, RACE_PARAMS, **kw)
    tgmm_case = TGMM_CASES[0][:7] + (6, 4) + TGMM_CASES[0][9:]
    check_tgmm(tgmm_case, sizes, 1, 4, RACE_PARAMS, **kw)


@pytest.mark.parametrize(
  "sequential, stationary, in_dtype, sizes",
  [
    (True, True, jnp.bfloat16, (20, 9, 21, 30, 0, 0)),  # shard mid-buffer, 3x slack
    (True, False, jnp.float32, (0, 0, 5, 2, 0, 0)),  # one visited tile, kept across sweeps
    (False, True, jnp.bfloat16, (40, 50, 60, 20, 13, 20)),  # rows reach m = 203: tail copies
  ],
  ids=["sequential-rs-bf16", "one-tile", "to-the-end"],
)
def test_gmm_rowtile_moves_only_local_rows(capfd, sequential, stationary, in_dtype, sizes):
  """The MoE block's call (`fill_unowned=False`): lhs rows fetched and output rows written are
  the local rows rounded to the DMA granule, never a whole edge tile; rows outside them are
  NaN (in lhs) and nothing reaches the local rows; no races, no out-of-bounds DMA."""
  m, k, n, tm, tn, sub_m, offset, local = 203, 40, 48, 64, 16, 16, 1, 3
  sizes = np.asarray(sizes, np.int32)
  ends = np.cumsum(sizes)
  start, end = (ends - sizes)[offset], ends[offset + local - 1]
  lhs = np.array(random_array(5, (m, k), in_dtype).astype(jnp.float32))
  lhs[:start] = np.nan
  lhs[end:] = np.nan
  rhs = random_array(6, (local, k, n), in_dtype)
  call = functools.partial(
    gmm_rowtile_pallas,
    jnp.asarray(lhs, in_dtype),
    rhs,
    jnp.asarray(sizes),
    tm=tm,
    tn=tn,
    out_dtype=jnp.float32,
    group_offset=jnp.int32(offset),
    sub_m=sub_m,
    sequential_sweeps=sequential,
    rows_stationary=stationary,
    fill_unowned=False,
  )
  with no_races_or_oob(capfd):
    got = np.asarray(call(interpret=RACE_PARAMS))[start:end]
  want = np_gmm(np.nan_to_num(lhs), rounded(rhs, in_dtype), sizes, group_offset=offset)[start:end]
  np.testing.assert_allclose(got, want, **tolerance(in_dtype=in_dtype, out_dtype=jnp.float32, k=k))
  _, counts = probe.with_row_counts(call)(interpret=True)
  counts = np.asarray(counts)
  granule = 8 * max(1, 4 // np.dtype(in_dtype).itemsize)
  align = metadata.pass_align(sub_m=sub_m, tm=tm, row_granule=granule)
  tail = metadata.merge_tail_rows(sub_m=sub_m, tm=tm, align=align, rows_stationary=stationary)
  if metadata.uses_pass_cuts(m=m, tm=tm, sub_m=sub_m, align=align):
    want = _pass_cut_counts(
      sizes, offset, local, m=m, tm=tm, sub_m=sub_m, align=align, tail=tail, in_dtype=in_dtype,
      out_dtype=jnp.float32, sequential=sequential, interpret=True, sweeps=counts.shape[0],
      whole=False,
    )  # fmt: skip
    np.testing.assert_array_equal(counts[..., [0, 2, 3]], want)
    # NOTE: the edge tiles move fewer rows than a whole tile (the point of the manual DMAs).
    assert want[0, :, 2].sum() < tm * np.count_nonzero(want[0, :, 2])
    return
  fetched = _edge_rows(sizes, offset, local, m=m, tm=tm, granule=granule)
  if sequential and np.count_nonzero(fetched) == 1:
    fetched = np.stack([fetched] + [0 * fetched] * (counts.shape[0] - 1))
  np.testing.assert_array_equal(counts[..., 2], np.broadcast_to(fetched, counts.shape[:2]))
  written = _edge_rows(sizes, offset, local, m=m, tm=tm, granule=8)
  np.testing.assert_array_equal(counts[..., 3], np.broadcast_to(written, counts.shape[:2]))
  # NOTE: the edge tiles move fewer rows than a whole tile (the point of the manual DMAs).
  visited = written[written > 0]
  assert visited.sum() < tm * visited.size


def _gmm_rows_per_tile(sizes, *, m, tm, sub_m, align, tail=0):
  """The schedule-derived MXU rows per m-tile of the row-tile gmm, every group local."""
  groups = metadata.make_tile_groups(
    group_sizes=jnp.asarray(sizes),
    group_offset=0,
    num_local_groups=len(sizes),
    m=m,
    tm=tm,
    finalize_empty_groups=False,
  )
  return np.asarray(
    kernel_testing.rowtile_mxu_rows(
      groups, group_offset=0, m=m, tm=tm, sub_m=sub_m, align=align, tail=tail
    )
  )


@pytest.mark.parametrize("stationary", [False, True], ids=["plain", "rs"])
def test_gmm_rowtile_passes_start_at_each_group(capfd, stationary):
  """Passes start at a group's first row (8-row aligned for f32), and one that would cross the
  tile's end is moved back over the group's previous rows: the result is still exact, the
  simulator sees no race or out-of-bounds access, and the kernel pushes 6 passes where the
  32-row grid takes 7; with the widened last pass (16 more rows), 176 rows.

  NOTE: tm = 64, sub_m = 32; groups [0,24) [24,56) [56,64) | [64,104) [104,104) [104,128), 8 rows
  of slack. Tile 0: 1 + 1 (grid: 2) + 1 (from row 56, moved back to 32); tile 1: 2 + 1 (from row
  40, moved back to 32), where the first group's second pass would hold 8 of its rows, so its
  two run as one of 48 rows (not with rows_stationary).
  """
  case = (136, 40, 48, 64, 48, 32, 6, 6, jnp.float32, jnp.float32, False, False)
  sizes = np.array([24, 32, 8, 40, 0, 24], np.int32)
  granule = common.row_granule(jnp.float32)
  assert metadata.pass_align(sub_m=32, tm=64, row_granule=granule) == 8
  rows = functools.partial(_gmm_rows_per_tile, sizes, m=136, tm=64, sub_m=32)
  np.testing.assert_array_equal(rows(align=8), [96, 96, 0])
  np.testing.assert_array_equal(rows(align=32), [128, 96, 0])
  assert metadata.merge_tail_rows(sub_m=32, tm=64, align=8) == 16
  assert metadata.merge_tail_rows(sub_m=32, tm=64, align=8, rows_stationary=True) == 0
  np.testing.assert_array_equal(rows(align=8, tail=16), [96, 80, 0])
  # NOTE: check_gmm compares the counts with rows(align=8).
  check_gmm(case, sizes, 0, 5, INTERPRET_MODES["hlo"], rows_stationary=stationary)
  with no_races_or_oob(capfd):
    check_gmm(case, sizes, 0, 6, RACE_PARAMS, count=False, rows_stationary=stationary)


def test_gmm_pass_cuts_split_a_group_between_tiles_whole(capfd):
  """With pass cuts a group spanning two tiles pays only its own passes; with fixed m-tiles it
  pays a partial pass on each side of the boundary. Both exact, and the cut kernel race-free
  (its last pass's rows past the cut are carried into the next tile).

  NOTE: tm = 64, sub_m = 32, f32 rows (passes 8-row aligned); groups [0,40) [40,100) [100,128).
  Fixed tiles: [0,64) 2 + 1 (g1's rows 40..63), [64,128) 2 (g1's 64..99) + 1 (g2 from 96): 6
  passes. Cuts at 40 (g1's first pass) and 96 (g2's, whose rows 96..99 g1's last pass computes
  in the middle tile): g0 2, g1 2 ([40,72), [72,104)), g2 1: 5 passes, in 3 tiles. The widened
  last pass (48 rows) runs a group's last two where the last would hold at most 16 of its rows:
  fixed tiles g0's [0,40) and g1's [64,100), 160 rows; cut tiles g0's only (g1's second pass
  holds 28 rows, to 100 past the cut), 144 rows.
  """
  m, k, n, tm, tn, sub_m = 128, 40, 48, 64, 48, 32
  sizes = np.array([40, 60, 28], np.int32)
  lhs = random_array(11, (m, k), jnp.float32)
  rhs = random_array(12, (3, k, n), jnp.float32)
  call = functools.partial(
    gmm_rowtile_pallas,
    lhs,
    rhs,
    jnp.asarray(sizes),
    tm=tm,
    tn=tn,
    out_dtype=jnp.float32,
    group_offset=jnp.int32(0),
    sub_m=sub_m,
  )
  want = np_gmm(np.asarray(lhs), np.asarray(rhs), sizes)
  tol = tolerance(in_dtype=jnp.float32, out_dtype=jnp.float32, k=k)
  for cuts, rows, tiles in ((False, 160, 2), (True, 144, 3)):
    out, counts = probe.with_row_counts(call)(pass_cuts=cuts, interpret=True)
    np.testing.assert_allclose(np.asarray(out), want, **tol)
    counts = np.asarray(counts)[0]
    assert counts[:, 0].sum() == rows
    assert np.count_nonzero(counts[:, 3]) == tiles
  with no_races_or_oob(capfd):
    out = call(pass_cuts=True, interpret=RACE_PARAMS)
  np.testing.assert_allclose(np.asarray(out), want, **tol)


def test_manual_dma_windows():
  """Hand-computed windows: groups of 8 and 4 rows, tm = sub_m = 4, two sweeps, 100-byte blocks."""

  def dma(kind, sequential):
    over, exposed = tiling.rowtile_manual_dma(
      starts=np.array([0, 8]),
      ends=np.array([8, 12]),
      m=12,
      tm=4,
      sub_m=4,
      kind=kind,
      sweeps=2,
      block_bytes=100.0,
      sequential_sweeps=sequential,
    )
    return over.reshape(2, 3), exposed.reshape(2, 3)

  # gmm: load 1 overlaps group 0's two tiles; load 0 is exposed unless the previous sweep's last
  # group (tile 2) prefetched it.
  over, exposed = dma("gmm", False)
  np.testing.assert_allclose(over, [[50, 50, 0], [50, 50, 0]])
  np.testing.assert_allclose(exposed, [[100, 0, 0], [100, 0, 0]])
  over, exposed = dma("gmm", True)
  np.testing.assert_allclose(over, [[50, 50, 100], [50, 50, 0]])
  np.testing.assert_allclose(exposed, [[100, 0, 0], [0, 0, 0]])
  # tgmm: write 0 (finalized in tile 1) overlaps tile 2; write 1 (tile 2) is drained exposed,
  # unless it is waited for in the next sweep, at group 1's finalize.
  over, exposed = dma("tgmm", False)
  np.testing.assert_allclose(over, [[0, 0, 100], [0, 0, 100]])
  np.testing.assert_allclose(exposed, [[0, 0, 100], [0, 0, 100]])
  over, exposed = dma("tgmm", True)
  third = 100 / 3
  np.testing.assert_allclose(over, [[0, 0, third], [2 * third, 2 * third, third + 100]])
  np.testing.assert_allclose(exposed, [[0, 0, 0], [0, 0, 100]])


def test_ops_default_picks_rowtile_and_falls_back():
  """Default tiles run the row-tile kernels; tiles they cannot run (tk < k) the visit kernels."""
  kw = dict(
    num_groups=8,
    dtypes=(jnp.bfloat16,) * 3,
    interpret=None,
  )
  with tiling.use_generation("v5e"):
    assert ops._resolve_tiles(None, dims=(4096, 2048, 768), kind="gmm", **kw).rowtile
    assert ops._resolve_tiles(None, dims=(4096, 2048, 768), kind="tgmm", **kw).rowtile
    visits = ops._resolve_tiles((512, 1024, 768), dims=(4096, 2048, 768), kind="gmm", **kw)
    assert not visits.rowtile and visits.tiles == (512, 1024, 768)
    # Ragged n tile: manual DMAs cannot be ragged, so the visit kernel runs.
    assert not ops._resolve_tiles(
      (512, 2048, 512), dims=(4096, 2048, 768), kind="gmm", **kw
    ).rowtile


def test_public_gmm_grad_through_rowtile_kernels():
  """jax.grad of pallas_moe.gmm (default tiles: all three passes row-tile) vs the reference."""
  sizes = jnp.array([50, 0, 70, 8], jnp.int32)
  x = random_array(0, (140, 64), jnp.float32)
  w = random_array(1, (4, 64, 128), jnp.float32)

  def loss(f):
    return lambda x, w: jnp.sum(jnp.sin(f(x, w, sizes)))

  got = jax.jit(jax.grad(loss(lambda x, w, s: pallas_moe.gmm(x, w, s, interpret=True)), (0, 1)))(
    x, w
  )
  ref = jax.jit(jax.grad(loss(lambda x, w, s: reference.gmm(x, w, s)), (0, 1)))(x, w)
  for a, b in zip(got, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-4)


# (m, k, n, tm, tn, sub_m, groups, weights dtype, quantize lhs, narrow_dot, in/out dtype)
QUANT_CASES = [
  (67, 40, 48, 16, 16, 8, 5, jnp.int8, False, False, jnp.bfloat16),
  (67, 40, 48, 16, 48, 16, 5, jnp.float8_e4m3fn, False, False, jnp.float32),
  (130, 64, 128, 64, 128, 32, 6, jnp.int8, True, True, jnp.bfloat16),
  (130, 64, 128, 64, 64, 32, 6, jnp.float8_e4m3fn, True, True, jnp.bfloat16),
  (130, 64, 128, 64, 64, 32, 6, jnp.int8, True, False, jnp.float32),
]
# NOTE: `rows_stationary` on the upcast weights and on the narrow 8-bit dot (transposed 8-bit
# weights); case 2 is also the race-detector case.
QUANT_ROWS_STATIONARY = {1, 2}
QUANT_IDS = [
  f"{jnp.dtype(c[7]).name}"
  + ("-w8a8" if c[8] else "")
  + ("-narrow" if c[9] else "")
  + ("-rs" if i in QUANT_ROWS_STATIONARY else "")
  for i, c in enumerate(QUANT_CASES)
]


def check_quantized(case, sizes, seed, interpret):
  from pallas_moe import quant

  m, k, n, tm, tn, sub_m, groups, w_dtype, quant_lhs, narrow, dtype = case
  x = random_array(seed, (m, k), dtype)
  q = quant.quantize(random_array(seed + 1, (groups, k, n), jnp.float32), dtype=w_dtype)
  lhs, lhs_scales = quant.quantize_rows(x, dtype=w_dtype) if quant_lhs else (x, None)
  out = jax.jit(
    lambda x, v, s, gs, ls: gmm_rowtile_pallas(
      x,
      v,
      gs,
      tm=tm,
      tn=tn,
      out_dtype=jnp.float32,
      group_offset=jnp.int32(0),
      rhs_scales=s,
      lhs_scales=ls,
      narrow_dot=narrow,
      sub_m=sub_m,
      rows_stationary=QUANT_CASES.index(case) in QUANT_ROWS_STATIONARY,
      interpret=interpret,
    )
  )(lhs, q.values, q.scales, jnp.asarray(sizes), lhs_scales)
  ref = reference.quantized_gmm(lhs, lhs_scales, q.values, q.scales, jnp.asarray(sizes))
  # NOTE: one quantized operand is multiplied in the other's dtype (bf16 lhs rounds nothing
  # further: the reference dequantizes the same bf16 x); two in bf16 or natively, both exact.
  np.testing.assert_allclose(
    np.asarray(out), np.asarray(ref), **tolerance(in_dtype=dtype, out_dtype=jnp.float32, k=k)
  )
  assert not np.any(np.asarray(out)[int(sizes.sum()) :])


@pytest.mark.parametrize("case", QUANT_CASES, ids=QUANT_IDS)
@examples(0.25)
@given(data=st.data())
def test_quantized_gmm_rowtile_matches_dequantized_reference(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[6]))
  check_quantized(case, sizes, data.draw(st.integers(0, 2**16)), INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("case", QUANT_CASES[2:3], ids=QUANT_IDS[2:3])
def test_quantized_gmm_rowtile_simulator_no_races(case, capfd):
  sizes = np.array([30, 0, 45, 1, 0, 54], np.int32)
  with no_races_or_oob(capfd):
    check_quantized(case, sizes, 5, RACE_PARAMS)


@pytest.mark.parametrize(
  "transpose_fwd, rows_stationary", [(False, False), (True, True)], ids=["kn", "nk_T-rs"]
)
def test_quantized_dlhs_rowtile_scales_on_contraction(transpose_fwd, rows_stationary):
  """The lhs-gradient pass: dout @ dequantize(q)^T, scales along the kernel's contraction (with
  `rows_stationary`: [k, tn] weights scaled, upcast and transposed once per load)."""
  from pallas_moe import quant

  m, k, n, groups = 130, 64, 128, 6
  sizes = np.array([30, 0, 45, 1, 0, 54], np.int32)
  axis = 2 if transpose_fwd else 1
  w = random_array(1, (groups, n, k) if transpose_fwd else (groups, k, n), jnp.float32)
  q = quant.quantize(w, dtype="int8", axis=axis)
  dout = random_array(0, (m, n), jnp.bfloat16)
  scales = q.scales  # [G, n, 1] or [G, 1, n]: along n, the contraction of this pass
  out = gmm_rowtile_pallas(
    dout,
    q.values,
    jnp.asarray(sizes),
    tm=64,
    tn=64,
    out_dtype=jnp.float32,
    group_offset=jnp.int32(0),
    transpose_rhs=not transpose_fwd,
    rhs_scales=scales,
    scales_on_k=True,
    sub_m=32,
    rows_stationary=rows_stationary,
    interpret=INTERPRET_MODES["tpu"],
  )
  deq = quant.dequantize(q)
  ref = reference.gmm(dout.astype(jnp.float32), deq, jnp.asarray(sizes), jnp.float32,
                      transpose_rhs=not transpose_fwd)  # fmt: skip
  # NOTE: the scaled weights are rounded to bf16 (the compute dtype) before the dot.
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-2, atol=2e-2 * np.sqrt(n))


@pytest.mark.parametrize(
  "kind, sub_m, tk, tn, gen, want",
  [
    ("gmm", 256, 2048, 1408, "v6e", True),  # 1408 columns padded to 1536 on a 256-wide MXU
    ("gmm", 128, 2048, 1408, "v5e", False),  # 1408 = 11 x 128: no padding on a 128-wide MXU
    ("gmm", 256, 1408, 2048, "v6e", False),  # the contraction is padded either way
    ("gmm", 256, 2048, 1536, "v6e", False),  # tie: keep the orientation without transposes
    ("tgmm", 256, 2048, 1408, "v6e", True),
    ("tgmm", 256, 1408, 2048, "v6e", False),  # tk would be padded instead
  ],
)
def test_rows_stationary_pays(kind, sub_m, tk, tn, gen, want):
  assert tiling.rows_stationary_pays(kind=kind, sub_m=sub_m, tk=tk, tn=tn, generation=gen) is want


# ------------------------------------------------------------------------------------------------
# Receive buffers with slack (expert parallelism): the kernels cost the rows they compute.

# NOTE: m = 203 rows (ragged last tile), at most 6 x 8 = 48 of them real: a buffer with >= 4x
# slack, and a shard of 3 of the 6 groups that may sit in its middle.
SLACK_GMM = (203, 40, 48, 16, 16, 8, 6, 3, jnp.float32, jnp.float32, False, False)
SLACK_TGMM = (203, 32, 48, 16, 16, 48, 16, 6, 3, jnp.float32, jnp.float32, False)


# NOTE: a fraction as the other TPU-simulator tests take (its default case runs there).
@pytest.mark.parametrize("mode, existing", [("hlo", True), ("tpu", False)])
@examples(0.25)
@given(data=st.data())
def test_slack_buffers_match_references(mode, existing, data):
  """sum(group_sizes) far below m, shards anywhere in m: gmm's rows outside the shard are exact
  zeros or existing_out's, tgmm's empty groups exact zeros; MXU rows only where rows are."""
  sizes = np.asarray(data.draw(st.lists(st.integers(0, 8), min_size=6, max_size=6)), np.int32)
  offset = data.draw(st.integers(0, 3))
  seed = data.draw(st.integers(0, 2**16))
  gmm_case = SLACK_GMM[:-1] + (existing,)
  check_gmm(gmm_case, sizes, offset, seed, INTERPRET_MODES[mode], rows_stationary=existing)
  tgmm_case = SLACK_TGMM[:-1] + (existing,)
  check_tgmm(tgmm_case, sizes, offset, seed, INTERPRET_MODES[mode], sequential=existing)


def test_zero_fill_writes_only_the_unvisited_rows():
  """The fill's bytes are the rows outside the visited tiles, and its buffer holds
  zeros there; the visited rows are left for the gmm (NaN-poisoned by the TPU simulator)."""
  from pallas_moe.gmm import _zeros_outside_active

  for active, rows in (((0, 1), 67), ((1, 2), 67), ((2, 3), 80), ((0, 5), 67)):
    buf = np.asarray(
      _zeros_outside_active(
        jnp.asarray(active, jnp.int32),
        rows=rows,
        n=48,
        tm=16,
        dtype=jnp.float32,
        interpret=INTERPRET_MODES["tpu"],
        vary_like=(),
      )
    )
    lo, hi = active[0] * 16, min(rows, (active[0] + active[1]) * 16)
    outside = np.ones(rows, bool)
    outside[lo:hi] = False
    assert np.all(buf[outside] == 0), active
    assert np.all(np.isnan(buf[~outside])), active


# ------------------------------------------------------------------------------------------------
# The row-tile tgmm fetches only the local rows of each visited tile (manual lhs / rhs DMAs).

# NOTE: bf16 operands (rhs rows move in granules of 16, lhs columns of 128 lanes), tm = 256 so the
# lane granule is visible, m = 1000 (m % 128 = 104, m % 16 = 8: the static tail copies), two
# n-tiles. (name, m, tm, sub_m, sizes, offset, local)
FETCH_CASES = [
  # A shard (groups 1..3, rows 300..560) of a receive buffer with slack (600 of 1000 rows real):
  # its first tile starts mid-tile, its last holds 48 rows.
  ("shard", 1000, 256, 64, [300, 50, 200, 10, 40], 1, 3),
  # A shard from mid-tile (row 300) up to m: the last tile's 232 rows end in m's unaligned tail.
  ("to-m", 1000, 256, 64, [300, 200, 0, 500], 1, 3),
  # One tile of all m rows (tm = m = 208): lhs's 208 lanes are not a multiple of 128, fetched
  # whole; rhs's rows are, fetched by range with a static row0.
  ("one-tile", 208, 208, 208, [50, 0, 20], 0, 3),
]
# NOTE: (case, interpret mode, sequential_sweeps, rows_stationary): each static configuration
# compiles once (~8 s); both sweep modes and MXU orientations, the slack case in both modes.
# NOTE: 3 static configurations (suite time): the parallel sweep mode and plain interpretation
# run in the ragged case; the hypothesis cases above cover both modes further.
FETCH_PARAMS = [
  (FETCH_CASES[0], "tpu", True, True),
  (FETCH_CASES[1], "hlo", True, True),
  (FETCH_CASES[2], "tpu", False, True),
]


def _expected_fetch(sizes, offset, local, *, m, tm, granule):
  """Rows fetched per m-tile: [floor(lo), min(ceil(hi), m - row0)) of the tile's local rows
  [lo, hi) in `granule`s; a tile that the granule does not divide whole (clipped at m)."""
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  rows_start, rows_end = bounds[offset], bounds[offset + local]
  out = np.zeros(-(-m // tm), int)
  for t in range(len(out)):
    row0 = t * tm
    lo, hi = max(rows_start - row0, 0), min(rows_end - row0, tm)
    if lo >= hi:
      continue
    if tm % granule:
      out[t] = min(tm, m - row0)
    else:
      out[t] = min(-(-hi // granule) * granule, m - row0) - lo // granule * granule
  return out


@pytest.mark.parametrize(
  "case, mode, sequential, rows_stationary",
  FETCH_PARAMS,
  ids=[f"{c[0]}-{mode}{'-seq' if s else ''}{'-rs' if r else ''}" for c, mode, s, r in FETCH_PARAMS],
)
def test_tgmm_rowtile_fetches_only_local_rows(case, mode, sequential, rows_stationary):
  """lhs / rhs rows outside the shard's rows (other shards', the buffer's slack) are never read
  into a result: NaN there changes nothing. Each visited tile fetches its local rows rounded out
  to the DMA granule (128 lhs lanes, 16 bf16 rhs rows), unvisited tiles nothing."""
  _, m, tm, sub_m, sizes, offset, local = case
  k, n, tk, tn = 16, 32, 16, 16
  sizes = np.asarray(sizes, np.int32)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  rows_start, rows_end = bounds[offset], bounds[offset + local]
  lhs = random_array(11, (k, m), jnp.bfloat16)
  rhs = random_array(12, (m, n), jnp.bfloat16)
  outside = np.ones(m, bool)
  outside[rows_start:rows_end] = False
  poisoned_lhs = jnp.where(jnp.asarray(outside)[None, :], jnp.nan, lhs)
  poisoned_rhs = jnp.where(jnp.asarray(outside)[:, None], jnp.nan, rhs)
  fn = _jitted(
    probe.with_row_counts(tgmm_rowtile_pallas),
    tiling=(tm, tk, tn),
    out_dtype=jnp.float32,
    num_actual_groups=local,
    sub_m=sub_m,
    sequential_sweeps=sequential,
    rows_stationary=rows_stationary,
    interpret=INTERPRET_MODES[mode],
  )
  out, counts = fn(poisoned_lhs, poisoned_rhs, jnp.asarray(sizes), jnp.int32(offset), None)
  got = np.asarray(out)
  assert np.isfinite(got).all()
  tol = tolerance(in_dtype=jnp.bfloat16, out_dtype=jnp.float32, k=m)
  clean = dict(group_offset=offset, num_actual_groups=local)
  expected = np_tgmm(rounded(lhs, jnp.bfloat16), rounded(rhs, jnp.bfloat16), sizes, **clean)
  np.testing.assert_allclose(got, expected, **tol)
  ref = reference.tgmm(lhs, rhs, jnp.asarray(sizes), jnp.float32, **clean)
  np.testing.assert_allclose(got, np.asarray(ref), **tol)
  assert not np.any(got[sizes[offset : offset + local] == 0])
  counts = np.asarray(counts)
  for index, granule in ((2, 16), (3, 128)):
    want = _expected_fetch(sizes, offset, local, m=m, tm=tm, granule=granule)
    np.testing.assert_array_equal(counts[..., index], np.broadcast_to(want, counts.shape[:3]))
