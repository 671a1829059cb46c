"""The tile schedule shared by gmm and tgmm, checked against a numpy re-derivation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import kernel_testing
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import examples, group_sizes_strategy

from pallas_moe import metadata, probe
from pallas_moe.gmm import gmm_pallas
from pallas_moe.tgmm import tgmm_pallas

make_schedule = jax.jit(
  metadata.make_schedule,
  static_argnames=(
    "num_local_groups",
    "m",
    "tm",
    "fill_uncovered_tiles",
    "visit_empty_groups",
  ),
)


def expected_pairs(sizes, *, offset, num_local, m, tm):
  """(local group, m-tile) pairs whose intersection is non-empty, in row order."""
  ends = np.cumsum(sizes)
  starts = ends - sizes
  pairs = []
  for local in range(num_local):
    s, e = starts[offset + local], ends[offset + local]
    if e > s:
      pairs += [(local, t) for t in range(s // tm, (e - 1) // tm + 1)]
  return pairs


# NOTE: each new (m, tm, groups) compiles the schedule: draw from a few values.
@given(
  data=st.data(),
  m=st.sampled_from([1, 37, 128, 300]),
  tm=st.sampled_from([8, 64, 128]),
  num_groups=st.sampled_from([1, 3, 16]),
)
def test_gmm_schedule(data, m, tm, num_groups):
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=num_groups))
  num_local = data.draw(st.integers(1, num_groups))
  offset = data.draw(st.integers(0, num_groups - num_local))
  sched = make_schedule(
    group_sizes=jnp.asarray(sizes),
    group_offset=offset,
    num_local_groups=num_local,
    m=m,
    tm=tm,
    fill_uncovered_tiles=True,
    visit_empty_groups=False,
  )
  n = int(sched.num_visits)
  tiles_m = -(-m // tm)
  assert n <= sched.max_visits == metadata.max_visits(m=m, tm=tm, num_local_groups=num_local)
  tile = np.asarray(sched.visit_m_tile)[:n]
  group = np.asarray(sched.visit_group)[:n]
  active = np.asarray(sched.visit_active)[:n].astype(bool)
  load = np.asarray(sched.visit_load_tile)[:n]
  # Every output tile is visited, and the visits of one tile are consecutive.
  assert set(tile.tolist()) == set(range(tiles_m))
  changes = np.count_nonzero(np.diff(tile)) + 1
  assert changes == tiles_m
  # Compute visits are exactly the non-empty (group, tile) intersections, in row order.
  assert list(zip(group[active].tolist(), tile[active].tolist(), strict=True)) == expected_pairs(
    sizes, offset=offset, num_local=num_local, m=m, tm=tm
  )
  np.testing.assert_array_equal(load[active], tile[active])
  # Fill visits come first and load the first compute visit's tile (no extra DMA).
  num_fill = int((~active).sum())
  assert not active[:num_fill].any() and active[num_fill:].all()
  if active.any():
    assert (load[:num_fill] == tile[num_fill]).all()
  # Padding past num_visits repeats the last visit and is inactive.
  assert (np.asarray(sched.visit_m_tile)[n:] == tile[-1]).all()
  assert not np.asarray(sched.visit_active)[n:].any()


@given(data=st.data(), m=st.sampled_from([1, 37, 300]), num_groups=st.sampled_from([1, 3, 16]))
def test_tgmm_schedule_visits_every_group(data, m, num_groups):
  tm = 128
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=num_groups))
  sched = make_schedule(
    group_sizes=jnp.asarray(sizes),
    group_offset=0,
    num_local_groups=num_groups,
    m=m,
    tm=tm,
    fill_uncovered_tiles=False,
    visit_empty_groups=True,
  )
  n = int(sched.num_visits)
  group = np.asarray(sched.visit_group)[:n]
  active = np.asarray(sched.visit_active)[:n].astype(bool)
  # Every group is visited, in order, in one run; empty ones once and without computing.
  assert group.tolist() == sorted(group.tolist())
  assert set(group.tolist()) == set(range(num_groups))
  for g in range(num_groups):
    assert active[group == g].all() == (sizes[g] > 0)
    assert (not active[group == g].any()) == (sizes[g] == 0)
  assert n == len(expected_pairs(sizes, offset=0, num_local=num_groups, m=m, tm=tm)) + int(
    (sizes == 0).sum()
  )


@pytest.mark.parametrize("offset", [0, 2, 5])
def test_overflowing_traced_sizes_are_clipped(offset):
  """Sizes summing past m (possible when traced) never yield tiles outside the array."""
  sizes = jnp.array([50, -3, 60, 70, 0, 90, 10, 5], jnp.int32)
  sched = make_schedule(
    group_sizes=sizes,
    group_offset=offset,
    num_local_groups=3,
    m=100,
    tm=16,
    fill_uncovered_tiles=True,
    visit_empty_groups=False,
  )
  tiles = np.asarray(sched.visit_m_tile)
  assert tiles.min() >= 0 and tiles.max() < 7
  assert int(np.asarray(sched.group_offsets)[-1]) == 100


def floor_rows(sizes, *, mxu):
  """Each group's rows rounded out to the MXU size at its boundaries (docs/design.md, "Bounds")."""
  ends = np.cumsum(sizes)
  starts = ends - sizes
  return int(
    sum((-(-e // mxu) - s // mxu) * mxu for s, e in zip(starts, ends, strict=True) if e > s)
  )


@pytest.mark.parametrize("kernel", ["gmm", "tgmm"])
@examples(0.5)
@given(data=st.data())
def test_mxu_rows_executed_equal_floor_rows(kernel, data):
  """Rows the kernel really multiplies (interpret-mode instrumentation) = the schedule-derived
  count the cost model uses = floor_rows: no MXU work beyond the MXU's own granularity."""
  m, k, n, num_groups, tm, sub_m = 600, 128, 128, 12, 256, 128
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=num_groups))
  gs = jnp.asarray(sizes)
  x = jnp.ones((m, k), jnp.float32)
  if kernel == "gmm":
    _, rows = probe.with_row_counts(gmm_pallas)(
      x,
      jnp.ones((num_groups, k, n)),
      gs,
      tiling=(tm, k, n),
      sub_m=sub_m,
      out_dtype=jnp.float32,
      group_offset=jnp.int32(0),
      interpret=True,
    )
  else:
    _, rows = probe.with_row_counts(tgmm_pallas)(
      x.T,
      jnp.ones((m, n)),
      gs,
      tiling=(tm, k, n),
      sub_m=sub_m,
      out_dtype=jnp.float32,
      group_offset=jnp.int32(0),
      num_actual_groups=num_groups,
      interpret=True,
    )
  executed = int(np.asarray(rows).sum())
  sched = make_schedule(
    group_sizes=gs,
    group_offset=0,
    num_local_groups=num_groups,
    m=m,
    tm=tm,
    fill_uncovered_tiles=kernel == "gmm",
    visit_empty_groups=kernel == "tgmm",
  )
  derived = int(kernel_testing.mxu_rows(sched, group_offset=0, tm=tm, sub_m=sub_m))
  assert executed == derived == floor_rows(sizes, mxu=sub_m)


def test_group_pass_plan_widens_a_short_last_pass():
  """sub_m = 128, 16-row alignment, tail 64 (`merge_tail_rows`), tm = 512, by hand:

  - [100, 400): passes from 96, three; the last (from 352) would hold 48 rows: widened, 320 rows.
  - [100, 420): the last would hold 68: not widened, 384 rows.
  - [0, 100): one pass: nothing to merge.
  - [300, 512) of a group that goes on (cover_end 600): passes from 288, two; the last (from
    416) reaches the tile's end with 96 rows: not widened.
  - [0, 150) in a cut tile whose group ends at 150 + 8 = 158 (carried rows): the last pass (from
    128) holds 30 rows up to 158: widened; with the group ending at 200 it would hold 72: not.
  Works on Python ints, numpy and traced arrays alike."""
  kw = dict(sub_m=128, align=16, tail=64, tm=512)
  assert metadata.merge_tail_rows(sub_m=128, tm=512, align=16) == 64
  assert metadata.merge_tail_rows(sub_m=128, tm=128, align=16) == 0  # one pass per tile
  assert metadata.merge_tail_rows(sub_m=128, tm=512, align=128) == 0  # the sub_m grid
  cases = [
    (100, 400, None, (96, 3, True)),
    (100, 420, None, (96, 3, False)),
    (0, 100, None, (0, 1, False)),
    (300, 512, 600, (288, 2, False)),
    (0, 150, 158, (0, 2, True)),
    (0, 150, 200, (0, 2, False)),
  ]
  for start, end, cover, want in cases:
    got = metadata.group_pass_plan(start, end, cover_end=cover, **kw)
    assert tuple(int(x) for x in got) == (want[0], want[1], int(want[2])), (start, end, cover)
  starts = np.array([c[0] for c in cases])
  ends = np.array([c[1] for c in cases])
  covers = np.array([c[1] if c[2] is None else c[2] for c in cases])
  want = np.array([c[3][2] for c in cases])
  _, _, merged = metadata.group_pass_plan(starts, ends, cover_end=covers, **kw)
  np.testing.assert_array_equal(merged, want)
  _, _, merged = jax.jit(lambda s, e, c: metadata.group_pass_plan(s, e, cover_end=c, **kw))(
    jnp.asarray(starts), jnp.asarray(ends), jnp.asarray(covers)
  )
  np.testing.assert_array_equal(np.asarray(merged), want)
  # Without a tail nothing is widened.
  _, _, merged = metadata.group_pass_plan(starts, ends, sub_m=128, align=16, tail=0, tm=512)
  assert not np.any(merged)
