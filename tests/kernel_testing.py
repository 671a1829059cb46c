"""Shared test helpers: float64 numpy loops, hypothesis strategies, interpret modes, shapes."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import _jax_compat, metadata

# The two interpret modes every kernel test runs under: plain HLO interpretation, and the TPU
# simulator (memory spaces, DMAs, out-of-bounds reads raise, uninitialized memory is NaN).
INTERPRET_MODES = {
  "hlo": True,
  "tpu": pltpu.InterpretParams(),
}
# The simulator with the race detector and 2 cores, so "parallel" grid axes are split.
RACE_PARAMS = _jax_compat.interpret_params(detect_races=True, num_cores_or_threads=2)


class ModelShape(NamedTuple):
  """One device's grouped matmul of a benchmark model: rows m = tokens x top_k, k = d_model, n =
  the expert ffn width, num_groups local experts."""

  m: int
  k: int
  n: int
  num_groups: int


# The four benchmark models of docs/design.md ("Benchmark shapes") at their native token counts,
# as bench/shapes.py has them (tests/bench/test_bench_shapes.py checks the two agree).
MODEL_SHAPES = {
  "mixtral-8x7b": ModelShape(m=16384 * 2, k=4096, n=14336, num_groups=8),
  "deepseek-v2-lite": ModelShape(m=16384 * 6, k=2048, n=1408, num_groups=64),
  "qwen3-30b-a3b": ModelShape(m=16384 * 8, k=2048, n=768, num_groups=128),
  "deepseek-v3": ModelShape(m=32768 * 8, k=7168, n=2048, num_groups=256),
}


def np_gmm(lhs, rhs, group_sizes, *, group_offset=0, existing_out=None, transpose_rhs=False):
  """float64 loop over groups: out[rows of g] = lhs[rows of g] @ rhs[g - group_offset]."""
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  if transpose_rhs:
    rhs = rhs.transpose(0, 2, 1)
  m, n = lhs.shape[0], rhs.shape[2]
  out = np.zeros((m, n)) if existing_out is None else np.array(existing_out, np.float64)
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    local = g - group_offset
    if 0 <= local < rhs.shape[0]:
      out[start : start + size] = lhs[start : start + size] @ rhs[local]
    start += size
  return out


def np_tgmm(lhs, rhs, group_sizes, *, group_offset=0, num_actual_groups=None, existing_out=None):
  """float64 loop: out[g] = lhs[:, rows of g] @ rhs[rows of g]; lhs is [k, m]."""
  lhs = np.asarray(lhs, np.float64)
  rhs = np.asarray(rhs, np.float64)
  sizes = np.asarray(group_sizes)
  num = len(sizes) if num_actual_groups is None else num_actual_groups
  out = np.zeros((num, lhs.shape[0], rhs.shape[1]))
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for local in range(num):
    g = local + group_offset
    s, e = starts[g], starts[g + 1]
    out[local] = lhs[:, s:e] @ rhs[s:e]
  if existing_out is not None:
    out = out + np.asarray(existing_out, np.float64)
  return out


def tolerance(*, in_dtype, out_dtype, k) -> dict:
  """assert_allclose tolerances for a k-long dot of N(0, 1) values.

  f32 everywhere: rounding of the f32 accumulation, ~1e-6 relative per term, grows like sqrt(k).
  bf16 output: one rounding to 8 mantissa bits (relative 2^-8) dominates. Inputs are rounded to
  their dtype before the float64 reference is computed, so input dtype adds no error of its own.
  """
  scale = float(np.sqrt(k))
  if jnp.dtype(out_dtype) == jnp.bfloat16:
    return dict(rtol=1.6e-2, atol=1.6e-2 * scale)
  del in_dtype
  return dict(rtol=2e-5, atol=2e-5 * scale)


def reorder_tolerance(*, dtype, terms: int, scale: float = 1.0, stages: int = 1) -> dict:
  """assert_allclose tolerances for two computations of the same sums in different orders.

  Chunked vs unchunked, placed vs unplaced, sharded vs whole, other tiles: the same products are
  added in another order (and XLA:CPU picks other vector widths and tilings per shape and CPU),
  so bit-equality is a property of one CPU, not of the code. Two orders of an n-term f32 sum of
  random-sign terms differ like a random walk of n roundings: about `sqrt(n) * eps` relative to
  the result. The bound here is 8x that per chained reduction stage (router, gmm, gmm, combine,
  ...), with `atol` the same relative bound of `scale` (the results' typical magnitude) for
  entries near zero. A misrouted, dropped or doubled row is off by O(1), far above it.

  Args:
    dtype: dtype the sums are accumulated in.
    terms: the longest reduction (contraction length, tokens summed into a weight gradient, ...).
    scale: typical magnitude of the compared values.
    stages: chained reductions each value passes through.

  Returns:
    dict(rtol=..., atol=...) for `np.testing.assert_allclose`.
  """
  eps = float(jnp.finfo(dtype).eps)
  rtol = 8.0 * stages * eps * float(np.sqrt(max(terms, 1)))
  return dict(rtol=rtol, atol=rtol * scale)


def rounded(x, dtype):
  """x rounded to dtype, as float64 numpy (what the kernel really multiplies)."""
  return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


@st.composite
def group_sizes_strategy(draw, *, m: int, num_groups: int):
  """Group sizes over m rows: random splits, empty groups, one full group, sums below m."""
  kind = draw(st.sampled_from(["random", "one_group", "short", "sparse"]))
  if kind == "one_group":
    sizes = np.zeros(num_groups, np.int32)
    sizes[draw(st.integers(0, num_groups - 1))] = m
    return sizes
  total = m if kind != "short" else draw(st.integers(0, max(m - 1, 0)))
  if kind == "sparse":
    # Cuts from a few points only: most groups come out empty.
    points = st.sampled_from(sorted({0, total // 3, total // 2, total}))
  else:
    points = st.integers(0, total)
  cuts = sorted(draw(st.lists(points, min_size=num_groups - 1, max_size=num_groups - 1)))
  return np.diff(np.array([0, *cuts, total])).astype(np.int32)


def random_array(seed: int, shape, dtype):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@contextlib.contextmanager
def no_races_or_oob(capfd):
  """Asserts that the TPU simulator reports no race inside the block (OOB reads raise)."""
  pltpu.reset_tpu_interpret_mode_state()
  try:
    yield
    jax.effects_barrier()
    out, err = capfd.readouterr()
    # NOTE: jax 0.10.2 prints the race report; 0.12 sends it to `logging` (pytest keeps those
    # records out of capfd), so `races_found` is the check that holds on both.
    assert "RACE DETECTED" not in out + err, out + err
    assert not _jax_compat.races_found()
  finally:
    pltpu.reset_tpu_interpret_mode_state()


def examples(fraction: float = 1.0):
  """A hypothesis `settings` with a fraction of the active profile's max_examples (at least 2).

  Kernel tests compile once per static configuration and then run each example in milliseconds
  under plain interpretation, but the TPU simulator pays per grid step: its tests use a fraction.
  """
  return settings(max_examples=max(2, int(settings.default.max_examples * fraction)))


def pushed_rows(s, e, cover_end, *, sub_m, align, tail, tm):
  """Rows one group's passes push in one row-tile gmm tile, restated from the kernel's rule
  (independent of `metadata.group_pass_plan`): sub_m-row passes from its first row rounded down
  to align, the last two as one of sub_m + tail rows where the last would hold at most tail of
  the group's rows (up to its end, which may lie past e in a pass-cut tile)."""
  first = s // align * align
  passes = max(-(-(e - first) // sub_m), 0)
  rows = passes * sub_m
  if tail and passes >= 2:
    last = first + (passes - 1) * sub_m
    if min(cover_end, last + sub_m, tm) - last <= tail:
      rows -= sub_m - tail
  return rows


def pushed_rows_per_tile(starts, ends, *, tiles, tm, sub_m, align):
  """[tiles] rows fixed m-tiles push for groups [starts[g], ends[g]) (`pushed_rows` per group and
  tile it intersects; no widened pass, as the row-tile tgmm)."""
  rows = np.zeros(tiles, np.int64)
  for t in range(tiles):
    for s, e in zip(starts, ends, strict=True):
      s_t, e_t = max(s - t * tm, 0), min(e - t * tm, tm)
      if e > s and e_t > s_t:
        rows[t] += pushed_rows(s_t, e_t, e_t, sub_m=sub_m, align=align, tail=0, tm=tm)
  return rows


# The rows the kernels push through the MXU, derived from their schedules (the kernels'
# row-count probe, `probe.count_rows`, measures the same by running them).


def mxu_rows(schedule: metadata.Schedule, *, group_offset: jax.Array | int, tm: int, sub_m: int):
  """Rows the kernels push through the MXU for one sweep over k and n, from the schedule.

  A compute visit multiplies each sub_m-row sub-block of its m-tile that holds a row of its group
  (`gmm.gmm_pallas` / `tgmm.tgmm_pallas` skip the others). This is the count a cost model uses at
  full size; the kernels' row-count probe (`probe.count_rows`) measures the same thing by running
  them.

  Args:
    schedule: from `metadata.make_schedule`.
    group_offset: the shard's first global group.
    tm: m-tile size.
    sub_m: rows per MXU pass (divides tm).

  Returns:
    [] int32 total rows.
  """
  real = jnp.arange(schedule.max_visits) < schedule.num_visits
  active = (schedule.visit_active == 1) & real
  group = schedule.visit_group + jnp.asarray(group_offset, jnp.int32)
  start = schedule.group_offsets[group]
  end = schedule.group_offsets[group + 1]
  lo = schedule.visit_m_tile[:, None] * tm + jnp.arange(0, tm, sub_m)[None, :]
  # NOTE: sub-block [lo, lo + sub_m) is multiplied iff it intersects the group's [start, end).
  hit = active[:, None] & (lo < end[:, None]) & (lo + sub_m > start[:, None])
  return jnp.sum(hit).astype(jnp.int32) * sub_m


def rowtile_mxu_rows(
  tile_groups: metadata.TileGroups,
  *,
  group_offset: jax.Array | int,
  m: int,
  tm: int,
  sub_m: int,
  align: int | None = None,
  tail: int = 0,
) -> jax.Array:
  """Rows the row-tile kernels push through the MXU for one sweep over n (and k), per m-tile.

  Each non-empty local group multiplies, in every tile it intersects, the sub_m-row passes that
  cover its rows there (`metadata.group_passes`), its last two as one widened pass where gmm runs
  them so (`metadata.group_pass_plan`). This is the count the cost model uses at full size; the
  kernels' row-count probe (`probe.count_rows`) measures it by running them.

  Args:
    tile_groups: from `metadata.make_tile_groups`.
    group_offset: the shard's first global group.
    m: rows.
    tm: m-tile size.
    sub_m: rows per MXU pass (divides tm).
    align: the passes' alignment (`metadata.pass_align`); None: sub_m (the sub_m grid).
    tail: gmm's `metadata.merge_tail_rows` (0: sub_m-row passes only, as tgmm, whose rows are
      the contraction).

  Returns:
    [tiles_m] int32 rows.
  """
  num_local = tile_groups.load_rank.shape[0]
  goff = jnp.asarray(group_offset, jnp.int32).reshape(())
  starts = jax.lax.dynamic_slice_in_dim(tile_groups.group_offsets, goff, num_local)
  ends = jax.lax.dynamic_slice_in_dim(tile_groups.group_offsets, goff + 1, num_local)
  row0 = jnp.arange(metadata.cdiv(m, tm))[:, None] * tm
  # NOTE: each group's rows in each tile, in tile coordinates; an empty intersection (or an
  # empty group, even when its position is inside the tile) multiplies nothing.
  s = jnp.clip(starts[None, :] - row0, 0, tm)
  e = jnp.clip(ends[None, :] - row0, 0, tm)
  rows = metadata.group_pass_rows(
    s, e, sub_m=sub_m, align=sub_m if align is None else align, tail=tail, tm=tm
  )
  return jnp.sum(jnp.where(e > s, rows, 0), axis=1).astype(jnp.int32)
