"""Group metadata: which (group, m-tile) pairs a grouped-matmul kernel visits, in what order.

This module decides *what to visit*; `gmm.py` and `tgmm.py` decide *how to compute* a visit. Both
kernels share one schedule so that their tiles, masks and edge cases agree.

Rows of `lhs` are sorted by group: group `g` owns rows `[starts[g], ends[g])` with
`ends = cumsum(group_sizes)`. A kernel that holds only a shard of the groups (expert parallelism)
works on the *local* groups `group_offset .. group_offset + num_local_groups - 1`.

A *visit* is one pass of the kernel over one m-tile on behalf of one local group. A visit carries:

- `visit_m_tile`: the m-tile whose output block (gmm) the visit writes. Visits of one m-tile are
  consecutive, so a Pallas output block is written back exactly once.
- `visit_group`: the local group whose weights (gmm) or output block (tgmm) the visit uses.
- `visit_load_tile`: the m-tile whose lhs/rhs rows are loaded. It equals `visit_m_tile` for compute
  visits; for visits that compute nothing it repeats a neighbouring compute visit's tile so the
  Pallas pipeline sees an unchanged block index and issues no DMA.
- `visit_active`: 1 when the visit multiplies, 0 when it only initialises or zeroes an output.

Two kinds of non-computing visits exist:

- gmm *fill* visits (`fill_uncovered_tiles=True`): every m-tile with no row of a local group (rows
  of other shards' groups and rows past `sum(group_sizes)`) is visited once so that its output
  block is written (zeros or `existing_out`) inside the kernel, with no extra pass over the
  output. Fill visits come first, before all compute visits.
- tgmm *empty-group* visits (`visit_empty_groups=True`): every empty local group is visited once so
  that its weight-gradient block is written (zeros or `existing_out`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """A tile schedule, as int32 arrays that a kernel scalar-prefetches into SMEM.

  Attributes:
    group_offsets: [num_groups_total + 1] row at which each (global) group starts; the last entry is
      the end of the last group. Clipped to [0, m].
    visit_group: [max_visits] local group index of each visit.
    visit_m_tile: [max_visits] m-tile each visit writes (gmm) or reduces over (tgmm).
    visit_load_tile: [max_visits] m-tile each visit loads rows from.
    visit_active: [max_visits] 1 if the visit multiplies, else 0.
    num_visits: [] number of leading entries of the visit arrays that are real; the rest repeat the
      last real visit.
  """

  group_offsets: jax.Array
  visit_group: jax.Array
  visit_m_tile: jax.Array
  visit_load_tile: jax.Array
  visit_active: jax.Array
  num_visits: jax.Array

  @property
  def max_visits(self) -> int:
    return self.visit_group.shape[0]


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _searchsorted(sorted_: jax.Array, values: jax.Array, *, side: str) -> jax.Array:
  """int32 `jnp.searchsorted` as one [len(values), len(sorted_)] comparison.

  NOTE: the schedules search tiles against groups (a few thousand pairs at most): a comparison of
  all pairs is one small fused XLA op, where the default binary search is a while loop per call
  (XLA ops and bytes accessed around every kernel launch).
  """
  return jnp.searchsorted(sorted_, values, side=side, method="compare_all").astype(jnp.int32)


def max_visits(*, m: int, tm: int, num_local_groups: int) -> int:
  """Static upper bound on the number of visits of any schedule for these shapes.

  NOTE: each local group adds at most one visit beyond the m-tiles it covers (its first tile may be
  shared with the previous group), and an empty group or an uncovered tile adds one visit. So
  visits <= tiles_m + num_local_groups.
  """
  return cdiv(m, tm) + num_local_groups


def make_schedule(
  *,
  group_sizes: jax.Array,
  group_offset: jax.Array | int,
  num_local_groups: int,
  m: int,
  tm: int,
  fill_uncovered_tiles: bool,
  visit_empty_groups: bool,
) -> Schedule:
  """Computes the visit schedule for a shard of groups.

  Args:
    group_sizes: [num_groups_total] int32 rows per group. Negative sizes are treated as 0 and rows
      past `m` are clipped (inputs are validated by the callers when concrete).
    group_offset: first global group held by this shard (scalar, may be traced).
    num_local_groups: number of groups held by this shard (static).
    m: number of rows.
    tm: m-tile size.
    fill_uncovered_tiles: add one non-computing visit for each m-tile that holds no row of a local
      group (gmm: so that every output block is written inside the kernel).
    visit_empty_groups: add one non-computing visit for each empty local group (tgmm: so that its
      output block is written).

  Returns:
    The `Schedule`.
  """
  tiles_m = cdiv(m, tm)
  group_sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  group_offset = jnp.asarray(group_offset, jnp.int32).reshape(())
  # NOTE: clipping to m keeps every offset inside lhs even when traced sizes overflow it.
  ends = jnp.minimum(jnp.cumsum(group_sizes), m).astype(jnp.int32)
  group_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])

  local_starts = jax.lax.dynamic_slice_in_dim(group_offsets, group_offset, num_local_groups)
  local_ends = jax.lax.dynamic_slice_in_dim(group_offsets, group_offset + 1, num_local_groups)
  nonempty = local_ends > local_starts
  # NOTE: a group covering rows [s, e) touches m-tiles s // tm .. (e - 1) // tm.
  first_tile = local_starts // tm
  last_tile = (jnp.maximum(local_ends, 1) - 1) // tm
  group_visits = jnp.where(nonempty, last_tile - first_tile + 1, 0)
  if visit_empty_groups:
    group_visits = jnp.where(nonempty, group_visits, 1)

  # Rows of the local groups form one contiguous range [rows_start, rows_end).
  rows_start = local_starts[0]
  rows_end = local_ends[-1]
  any_rows = rows_end > rows_start
  covered_first = rows_start // tm
  covered_last = (jnp.maximum(rows_end, 1) - 1) // tm
  num_covered = jnp.where(any_rows, covered_last - covered_first + 1, 0)
  num_fill = (tiles_m - num_covered) if fill_uncovered_tiles else jnp.int32(0)

  total = max_visits(m=m, tm=tm, num_local_groups=num_local_groups)
  visit = jnp.arange(total, dtype=jnp.int32)
  visit_ends = jnp.cumsum(group_visits)
  num_visits = num_fill + visit_ends[-1]

  # Compute (and empty-group) visits: visit `num_fill + j` belongs to the group whose cumulative
  # visit count first exceeds j, and walks that group's tiles in order.
  j = jnp.clip(visit - num_fill, 0, jnp.maximum(visit_ends[-1] - 1, 0))
  group = _searchsorted(visit_ends, j, side="right")
  group = jnp.minimum(group, num_local_groups - 1)
  within = j - (visit_ends[group] - group_visits[group])
  # NOTE: an empty group's single visit loads the tile holding the row before its start (the tile
  # the previous visit loaded), so the pipeline sees no new block index and fetches nothing.
  empty_tile = (jnp.maximum(local_starts[group], 1) - 1) // tm
  tile = jnp.where(nonempty[group], first_tile[group] + within, empty_tile)
  tile = jnp.clip(tile, 0, tiles_m - 1)
  active = nonempty[group]

  if fill_uncovered_tiles:
    # NOTE: the uncovered tiles are 0 .. covered_first - 1 and covered_last + 1 .. tiles_m - 1, or
    # every tile when the shard has no rows. Fill visit f maps to the f-th uncovered tile.
    skip = jnp.where(any_rows & (visit >= covered_first), num_covered, 0)
    fill_tile = jnp.clip(visit + skip, 0, tiles_m - 1)
    is_fill = visit < num_fill
    # NOTE: fill visits load the first compute visit's blocks, so that visit reuses them.
    first_compute = jnp.minimum(num_fill, total - 1)
    group = jnp.where(is_fill, group[first_compute], group)
    load_tile = jnp.where(is_fill, tile[first_compute], tile)
    tile = jnp.where(is_fill, fill_tile, tile)
    active = jnp.where(is_fill, False, active)
  else:
    load_tile = tile

  # NOTE: entries past num_visits repeat the last real visit: no new block index, no DMA, no write.
  last = jnp.maximum(num_visits - 1, 0)
  pad = visit >= num_visits

  def repeat_last(x):
    return jnp.where(pad, x[last], x).astype(jnp.int32)

  return Schedule(
    group_offsets=group_offsets,
    visit_group=repeat_last(group),
    visit_m_tile=repeat_last(tile),
    visit_load_tile=repeat_last(load_tile),
    visit_active=jnp.where(pad, 0, active).astype(jnp.int32),
    num_visits=num_visits.astype(jnp.int32),
  )


# ------------------------------------------------------------------------------------------------
# Row-tile schedules: the grid walks m-tiles only; each step loops over the groups in its tile.
#
# The visit schedule above gives each (group, m-tile) pair its own grid step, so a Pallas pipeline
# fetches a whole m-tile in the first visit and a whole weight block in a group's first visit,
# whatever work that step has. The row-tile kernels (`gmm.gmm_rowtile_pallas`,
# `tgmm.tgmm_rowtile_pallas`) instead keep one m-tile per grid step and move the per-group blocks
# (gmm: weights in; tgmm: weight gradients out) with manual, double-buffered DMAs inside the step.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TileGroups:
  """Which local groups each m-tile holds, as int32 arrays for scalar prefetch.

  Attributes:
    group_offsets: [num_groups_total + 1] row at which each (global) group starts, clipped to m.
    tile_first_group: [tiles_m] first local group the tile's step handles.
    tile_last_group: [tiles_m] last local group the tile's step handles (inclusive; smaller than
      `tile_first_group` when the step handles none).
    load_rank: [num_local_groups] gmm: rank of each local group among the non-empty ones, i.e. its
      position in the sequence of weight loads (loads alternate between two VMEM slots).
    load_group: [num_local_groups] gmm: the local group of each load rank (entries past
      `num_loads` repeat the last load).
    num_loads: [1] gmm: number of non-empty local groups.
    finalize_tile: [num_local_groups] tgmm: the m-tile in whose step the group's weight gradient
      is complete and written out.
    active_tiles: [2] (first m-tile, number of m-tiles) the kernel's grid visits: the tiles that
      hold a row of a local group, or, when the shard has none, the one tile of its position.
  """

  group_offsets: jax.Array
  tile_first_group: jax.Array
  tile_last_group: jax.Array
  load_rank: jax.Array
  load_group: jax.Array
  num_loads: jax.Array
  finalize_tile: jax.Array
  active_tiles: jax.Array


def make_tile_groups(
  *,
  group_sizes: jax.Array,
  group_offset: jax.Array | int,
  num_local_groups: int,
  m: int,
  tm: int,
  finalize_empty_groups: bool,
) -> TileGroups:
  """Computes the row-tile schedule for a shard of groups.

  Args:
    group_sizes: [num_groups_total] int32 rows per group (negative sizes count as 0, rows past m
      are clipped).
    group_offset: first global group held by this shard (may be traced).
    num_local_groups: groups held by this shard (static).
    m: number of rows.
    tm: m-tile size.
    finalize_empty_groups: tgmm: every local group, empty ones included, is finalized (its
      output written) in exactly one tile's step, in group order; tile ranges cover them.
      gmm (False): a tile's range is the local groups whose rows intersect it.

  Returns:
    The `TileGroups`.
  """
  tiles_m = cdiv(m, tm)
  group_sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  group_offset = jnp.asarray(group_offset, jnp.int32).reshape(())
  ends = jnp.minimum(jnp.cumsum(group_sizes), m).astype(jnp.int32)
  group_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  starts = jax.lax.dynamic_slice_in_dim(group_offsets, group_offset, num_local_groups)
  ends = jax.lax.dynamic_slice_in_dim(group_offsets, group_offset + 1, num_local_groups)
  nonempty = ends > starts
  tile_lo = jnp.arange(tiles_m, dtype=jnp.int32) * tm
  tile_hi = jnp.minimum(tile_lo + tm, m)
  # NOTE: the local groups' rows are one contiguous range [starts[0], ends[-1]); only the tiles
  # meeting it hold work. Tiles before it (other shards' rows) and after it (other shards' rows,
  # rows past sum(group_sizes): a receive buffer's slack) are not visited at all: no grid step,
  # no lhs fetch, no MXU pass, no output write.
  rows_start, rows_end = starts[0], ends[-1]
  any_rows = rows_end > rows_start
  first_active = jnp.where(any_rows, rows_start // tm, 0)
  num_active = jnp.where(any_rows, (rows_end - 1) // tm - first_active + 1, 0)
  # NOTE: with no rows the kernels still visit one tile, the one holding the shard's (empty)
  # position, clamped into the grid: tgmm must write its empty groups there, and a grid with no
  # step at all leaves an aliased output undefined in interpret mode.
  first_active = jnp.where(any_rows, first_active, jnp.minimum(rows_start // tm, tiles_m - 1))
  num_active = jnp.maximum(num_active, 1)
  last_active = first_active + num_active - 1
  # NOTE: local starts and ends are sorted, so "groups with start < hi" and "groups with end <= lo"
  # are prefixes; searchsorted gives their lengths.
  starts_before_hi = _searchsorted(starts, tile_hi, side="left")
  if finalize_empty_groups:
    # NOTE: a non-empty group is complete in the tile of its last row; an empty one is written in
    # the tile of its (empty) position, clamped into the visited tiles (a position of m is past
    # the last tile). Both are non-decreasing in g, so finalization happens in group order.
    finalize_tile = jnp.where(nonempty, (ends - 1) // tm, starts // tm)
    # NOTE: empty groups at the range's end (position rows_end, possibly the first row of the
    # next tile) are written in the last visited tile.
    finalize_tile = jnp.clip(finalize_tile, first_active, last_active).astype(jnp.int32)
    # NOTE: groups finalized before tile t are a prefix, so the tile's first group is the first
    # one not yet finalized (it may have started in an earlier tile). The last is the last group
    # starting before the tile's end; the last visited tile also takes every group left.
    first = _searchsorted(finalize_tile, jnp.arange(tiles_m), side="left")
    last = jnp.where(jnp.arange(tiles_m) == last_active, num_local_groups - 1, starts_before_hi - 1)
  else:
    finalize_tile = jnp.zeros((num_local_groups,), jnp.int32)
    # NOTE: group g intersects [lo, hi) iff end > lo and start < hi; empty groups inside the range
    # are skipped by the kernel.
    first = _searchsorted(ends, tile_lo, side="right")
    last = starts_before_hi - 1
  load_rank = (jnp.cumsum(nonempty) - 1).astype(jnp.int32)
  num_loads = jnp.sum(nonempty).astype(jnp.int32)
  # NOTE: the non-empty groups first, in group order: each goes to its load rank (a scatter;
  # empty groups fall outside and are dropped), no sort.
  slot = jnp.where(nonempty, load_rank, num_local_groups)
  load_group = (
    jnp.zeros((num_local_groups,), jnp.int32)
    .at[slot]
    .set(jnp.arange(num_local_groups, dtype=jnp.int32), mode="drop")
  )
  last_load = jnp.maximum(num_loads - 1, 0)
  load_group = jnp.where(
    jnp.arange(num_local_groups) < num_loads, load_group, load_group[last_load]
  ).astype(jnp.int32)
  return TileGroups(
    group_offsets=group_offsets,
    tile_first_group=first,
    tile_last_group=last.astype(jnp.int32),
    load_rank=load_rank,
    load_group=load_group,
    num_loads=num_loads.reshape((1,)),
    finalize_tile=finalize_tile,
    active_tiles=jnp.stack([first_active, num_active]).astype(jnp.int32),
  )


def pass_align(*, sub_m: int, tm: int, row_granule: int) -> int:
  """Rows a row-tile gmm pass's first row is a multiple of, in its tile's coordinates.

  A group's passes start at its first row in the tile rounded down to `row_granule` (the rows'
  VMEM tile: 16 bf16 rows), not on the sub_m grid: at a group boundary inside a tile the
  group's first pass then wastes fewer than `row_granule` rows at its start instead of up to
  sub_m - 1, about sub_m / 2 + row_granule / 2 rows per boundary instead of sub_m. Passes stay
  on the sub_m grid (the result is sub_m) where one pass covers the tile or sub_m is not a
  multiple of the granule.

  Args:
    sub_m: rows per MXU pass (divides tm).
    tm: m-tile size.
    row_granule: the largest row tile of the operands the pass slices in VMEM (lhs, output).

  Returns:
    The alignment in rows (a divisor of sub_m).
  """
  if sub_m >= tm or sub_m % row_granule:
    return sub_m
  return row_granule


def group_passes(start: Any, end: Any, *, sub_m: int, align: int) -> tuple[Any, Any]:
  """(first pass's row, passes) that cover a group's rows [start, end) of one tile.

  Works on Python ints, numpy and traced arrays alike (the kernels, their instrumentation and
  the cost model count the same passes). The kernels clamp a pass that would cross the tile's
  end back to the tile's last sub_m rows (it then overlaps the group's previous pass), which
  leaves the count unchanged.

  Args:
    start: the group's first row in the tile (tile coordinates, >= 0).
    end: its end in the tile (<= tm), > start for a group with rows there.
    sub_m: rows per pass.
    align: `pass_align` (sub_m: passes on the sub_m grid).

  Returns:
    (first, passes): passes of sub_m rows from row `first` (a multiple of align).
  """
  first = (start // align) * align
  return first, (end - first + sub_m - 1) // sub_m


def merge_tail_rows(*, sub_m: int, tm: int, align: int, rows_stationary: bool = False) -> int:
  """Rows the row-tile gmm's widened last pass holds beyond sub_m (0: sub_m-row passes only).

  A group's last pass in a tile usually holds only part of a pass of the group's rows; the rest
  of its sub_m rows belong to the next group (or to none) and are pushed through the MXU for
  nothing, as is the weight tile it loads. Where that part is at most `sub_m // 2` rows, the
  kernel pushes the group's last two passes as one of sub_m + sub_m // 2 rows under the same
  weight tiles (`group_pass_plan`): a dot's cost is its rows once a pass has at least the MXU's
  minimum (`generations.min_pass_rows`), so this saves sub_m // 2 rows where it applies and
  halves the rows a group's end wastes on average (sub_m / 4 instead of sub_m / 2).

  Not with `rows_stationary` (the rows are then the dot's column operand, padded to the MXU, so
  a wider pass costs two), nor where a tile holds fewer than two passes, nor where sub_m // 2 is
  not a multiple of the pass alignment (passes on the sub_m grid).

  Args:
    sub_m: rows per MXU pass (divides tm).
    tm: m-tile size.
    align: the passes' alignment (`pass_align`).
    rows_stationary: the kernel's orientation option.

  Returns:
    The extra rows (a multiple of align), or 0.
  """
  tail = sub_m // 2
  if rows_stationary or tm < 2 * sub_m or tail == 0 or tail % align:
    return 0
  return tail


def _min(a: Any, b: Any) -> Any:
  # NOTE: elementwise min for Python ints, numpy and traced arrays alike.
  return b + (a - b) * (a < b)


def group_pass_plan(
  start: Any,
  end: Any,
  *,
  sub_m: int,
  align: int,
  tail: int,
  tm: int,
  cover_end: Any = None,
) -> tuple[Any, Any, Any]:
  """`group_passes` with the row-tile gmm's widened last pass (`merge_tail_rows`).

  The passes are those of `group_passes`. Their last two run as one pass of sub_m + tail rows
  from the second-to-last pass's first row (moved back to end at the tile's end, like a pass
  that would cross it) where there are at least two and the group's rows the last pass would
  cover, from its first row to min(cover_end, its end, tm), number at most `tail`: the widened
  pass then covers every row the two did. Rows pushed: passes * sub_m - merged * (sub_m - tail).

  Args:
    start: the group's first row in the tile (tile coordinates, >= 0).
    end: its end in the tile (<= tm), > start for a group with rows there.
    sub_m: rows per pass.
    align: `pass_align`.
    tail: `merge_tail_rows` (0: no widened pass; merged is then always false).
    tm: m-tile size.
    cover_end: the group's end in tile coordinates where its last pass also computes rows past
      `end` (a pass-cut tile's carried rows); None: end.

  Returns:
    (first, passes, merged): passes of sub_m rows from row `first`, and whether the last two
    run as one widened pass (bool, or a bool array).
  """
  first, passes = group_passes(start, end, sub_m=sub_m, align=align)
  if not tail:
    return first, passes, passes < 0
  last = first + (passes - 1) * sub_m
  cover = end if cover_end is None else cover_end
  covered = _min(_min(cover, last + sub_m), tm) - last
  return first, passes, (passes >= 2) & (covered <= tail)


def group_pass_rows(
  start: Any,
  end: Any,
  *,
  sub_m: int,
  align: int,
  tail: int,
  tm: int,
  cover_end: Any = None,
) -> Any:
  """Rows the passes of `group_pass_plan` push (same arguments): sub_m per pass, the widened
  last two sub_m + tail together. Works on Python ints, numpy and traced arrays alike."""
  _, passes, merged = group_pass_plan(
    start, end, sub_m=sub_m, align=align, tail=tail, tm=tm, cover_end=cover_end
  )
  return passes * sub_m - merged * (sub_m - tail)


def uses_pass_cuts(*, m: int, tm: int, sub_m: int, align: int) -> bool:
  """Whether the row-tile gmm cuts its m-tiles at pass boundaries (`make_pass_cut_tiles`).

  Only where it can save MXU work: with fixed tiles a group cut by a tile boundary pays a partial
  pass on each side; with cuts on its pass grid it pays none. That needs passes off the sub_m
  grid (align < sub_m), at least two passes per tile (so every tile advances), and more than
  one tile.
  """
  return align < sub_m and tm >= 2 * sub_m and m > tm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PassCutTiles:
  """Row tiles whose boundaries fall on the groups' pass grids, as int32 arrays for prefetch.

  Tile t covers rows [tile_start[t], tile_start[t + 1]) of the output: at most tm rows, starting
  at a multiple of the pass alignment. A boundary inside a group is one of its pass starts (its
  first row rounded down to the alignment, plus a multiple of sub_m), so its passes are split
  between tiles whole. At a boundary that is a group's first pass start, the previous group's
  last pass may reach past it (by less than the alignment): the previous tile computes those
  rows and the next tile takes them over from it before writing (`carry`).

  Attributes:
    tile_start: [max_tiles + 1] first row of each tile; entry `num_tiles` is where the last tile's
      output ends (the local rows' end, or the fixed m-tile's end when the whole visited range
      is written), entries past it repeat it.
    tile_reach: [max_tiles] end of the rows the tile computes (its last group's last pass,
      clipped to the group): the rows its lhs block must hold.
    tile_first_group: [max_tiles] first local group with a pass in the tile (num_local_groups:
      none; also the group whose first row ends the carried rows).
    tile_last_group: [max_tiles] last local group with a pass in the tile (inclusive).
    num_tiles: [1] tiles in use.
  """

  tile_start: jax.Array
  tile_reach: jax.Array
  tile_first_group: jax.Array
  tile_last_group: jax.Array
  num_tiles: jax.Array


def max_pass_cut_tiles(*, m: int, tm: int, sub_m: int) -> int:
  """Tiles `make_pass_cut_tiles` may use: every tile but the last two holds more than
  tm - sub_m rows (the next cut is the last pass start at or before its start + tm)."""
  return cdiv(m, tm - sub_m) + 2


def _holding_group(starts, row, xp):
  """Index of the last local group starting at or before `row` (-1: none). With sorted starts
  and empty groups sitting at the next group's start, that is the group holding `row` when
  row is inside the local rows."""
  return xp.searchsorted(starts, row, side="right") - 1


def _pass_start_at_or_before(starts, g, row, *, sub_m: int, align: int, xp):
  """The last pass start of group g at or before `row` (g's passes: from its first row rounded
  down to `align`, every sub_m rows)."""
  a = (starts[xp.maximum(g, 0)] // align) * align
  return a + ((row - a) // sub_m) * sub_m


def _next_cut(c, *, starts, rows_end, write_end, tm: int, sub_m: int, align: int, xp):
  """The first row of the tile after one starting at row c (see `PassCutTiles`)."""
  x = c + tm
  g = _holding_group(starts, x, xp)
  inside = _pass_start_at_or_before(starts, g, x, sub_m=sub_m, align=align, xp=xp)
  # NOTE: past the local rows: a tail tile from the last rows' alignment (its rows before
  # rows_end are carried over) to where the output is written.
  tail = (rows_end // align) * align
  return xp.where(x >= write_end, write_end, xp.where(x >= rows_end, tail, inside))


def _tile_groups(c, c_next, *, starts, ends, rows_end, num_local: int, sub_m: int, align: int, xp):
  """(first group, last group, reach) of the tile [c, c_next) (see `PassCutTiles`)."""
  h = _holding_group(starts, c, xp)
  own = _pass_start_at_or_before(starts, h, c, sub_m=sub_m, align=align, xp=xp) == c
  # NOTE: row c belongs to group h; if h's pass holding it starts before c, that pass (and the
  # rows of h it covers) belongs to the previous tile, so the tile's first group is h + 1.
  first = xp.where(h < 0, 0, xp.where(own, h, h + 1))
  first = xp.where(c >= rows_end, num_local, first)
  # NOTE: -1 (no group) when the tile's last row is before the local rows.
  last = _holding_group(starts, c_next - 1, xp)
  last = xp.where(c_next > c, last, -1)
  # NOTE: the rows the tile computes end where the pass holding its last row ends (clipped to
  # that row's group): past c_next when that pass is the group's last and reaches into the next
  # group's first pass; at the local rows' end when the tile reaches past it.
  r = c_next - 1
  g = _holding_group(starts, r, xp)
  gi = xp.maximum(g, 0)
  pass_end = _pass_start_at_or_before(starts, gi, r, sub_m=sub_m, align=align, xp=xp) + sub_m
  reach = xp.minimum(pass_end, ends[gi])
  reach = xp.where(r >= rows_end, rows_end, reach)
  reach = xp.where((g < 0) | (c_next <= c), c, xp.maximum(reach, c))
  return first, last, reach


def make_pass_cut_tiles(
  tile_groups: TileGroups,
  *,
  group_offset: jax.Array | int,
  m: int,
  tm: int,
  sub_m: int,
  align: int,
  write_whole_tiles: bool,
) -> PassCutTiles:
  """Row tiles for the row-tile gmm cut at the groups' pass grids (see `PassCutTiles`).

  The first tile starts at the first visited m-tile's first row (as fixed tiles do; without
  `write_whole_tiles`, at the first local row rounded down to the alignment); each next
  one at the last pass start at or before the previous start + tm of the group holding that row
  (greedy: tiles of more than tm - sub_m rows). A group then pays ceil((rows + its first row's
  misalignment) / sub_m) passes however many tiles it spans.

  Args:
    tile_groups: the fixed m-tiles' schedule (`make_tile_groups` with the same m and tm): the
      group offsets and the visited fixed tiles.
    group_offset: first global group held by this shard.
    m: rows.
    tm: the most rows a tile holds (>= 2 sub_m).
    sub_m: rows per pass.
    align: the passes' alignment (`pass_align`).
    write_whole_tiles: the kernel writes every row of the visited fixed m-tiles (zeros or
      existing_out outside the local rows): the last tile ends at the last visited fixed tile's
      end (clipped at m), not at the local rows' end.

  Returns:
    The `PassCutTiles`.
  """
  tiles = tile_groups
  num_local_groups = tiles.load_rank.shape[0]
  goff = jnp.asarray(group_offset, jnp.int32).reshape(())
  starts = jax.lax.dynamic_slice_in_dim(tiles.group_offsets, goff, num_local_groups)
  ends = jax.lax.dynamic_slice_in_dim(tiles.group_offsets, goff + 1, num_local_groups)
  first_tile, num_fixed = tiles.active_tiles[0], tiles.active_tiles[1]
  first_row = first_tile * tm
  if not write_whole_tiles:
    # NOTE: rows before the local ones are not written: the first tile starts at their
    # alignment (the first group's first pass).
    first_row = jnp.where(ends[-1] > starts[0], (starts[0] // align) * align, first_row)
  cuts = pass_cut_rows(
    starts=starts,
    ends=ends,
    first_row=first_row,
    fixed_end=jnp.minimum((first_tile + num_fixed) * tm, m),
    m=m,
    tm=tm,
    sub_m=sub_m,
    align=align,
    write_whole_tiles=write_whole_tiles,
    xp=jnp,
  )
  return PassCutTiles(**{k: v.astype(jnp.int32) for k, v in cuts.items()})


def pass_cut_rows(
  *,
  starts,
  ends,
  first_row,
  fixed_end,
  m: int,
  tm: int,
  sub_m: int,
  align: int,
  write_whole_tiles: bool,
  xp: Any = jnp,
) -> dict[str, Any]:
  """`make_pass_cut_tiles`' arrays from the local groups' rows, with jax.numpy (traced, a fixed
  number of tiles) or numpy (`xp=np`: the cost model; as many tiles as used).

  Args:
    starts: [num_local_groups] first row of each local group.
    ends: [num_local_groups] end row of each local group.
    first_row: the first tile's first row (a multiple of align, at or before the local rows).
    fixed_end: end of the last visited fixed m-tile (clipped at m).
    m, tm, sub_m, align, write_whole_tiles: see `make_pass_cut_tiles`.
    xp: jax.numpy or numpy.

  Returns:
    dict of `PassCutTiles`' fields.
  """
  num_local = starts.shape[0]
  rows_start, rows_end = starts[0], ends[-1]
  any_rows = rows_end > rows_start
  if write_whole_tiles:
    write_end = fixed_end
  else:
    write_end = xp.where(any_rows, rows_end, first_row)
  step = dict(starts=starts, rows_end=rows_end, write_end=write_end, tm=tm, sub_m=sub_m)
  step.update(align=align, xp=xp)
  if xp is jnp:
    max_tiles = max_pass_cut_tiles(m=m, tm=tm, sub_m=sub_m)

    def body(t, cuts):
      c = cuts[t]
      nxt = jnp.where(c < write_end, _next_cut(c, **step), c)
      return cuts.at[t + 1].set(nxt)

    cuts = jnp.full((max_tiles + 1,), first_row, jnp.int32)
    cuts = jax.lax.fori_loop(0, max_tiles, body, cuts)
    num_tiles = jnp.maximum(jnp.sum(cuts[:-1] < write_end), 1)
  else:
    cut_list = [int(first_row)]
    while cut_list[-1] < int(write_end):
      cut_list.append(int(_next_cut(cut_list[-1], **step)))
    if len(cut_list) == 1:
      cut_list.append(cut_list[0])
    cuts = xp.asarray(cut_list, xp.int64)
    num_tiles = len(cut_list) - 1
  first, last, reach = _tile_groups(
    cuts[:-1],
    cuts[1:],
    starts=starts,
    ends=ends,
    rows_end=rows_end,
    num_local=num_local,
    sub_m=sub_m,
    align=align,
    xp=xp,
  )
  return dict(
    tile_start=cuts,
    tile_reach=reach,
    tile_first_group=first,
    tile_last_group=last,
    num_tiles=xp.reshape(xp.asarray(num_tiles), (1,)),
  )
