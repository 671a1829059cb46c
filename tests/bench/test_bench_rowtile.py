"""The cost model's row-tile hooks against the row-tile kernels they model.

`bench.costmodel` and `bench.impls` derive each grid step's MXU rows, DMAs and exposed waits
from the kernels' schedules (used at full size, where nothing can run); here the kernels run in
interpret mode at small sizes and their row-count probe (`probe.count_rows`) and compiled grids
must agree with those hooks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import kernel_testing
import numpy as np
import pytest
from kernel_testing import INTERPRET_MODES, random_array
from kernels.test_rowtile import (
  INTERIOR_SIZES,
  INTERIOR_TGMM,
  INTERIOR_TGMM_TL,
  _gmm_rows_per_tile,
  _tgmm_align,
  check_tgmm,
)

import pallas_moe
from pallas_moe import metadata, ops, probe, reference, tiling
from pallas_moe.gmm import gmm_rowtile_pallas
from pallas_moe.tgmm import tgmm_rowtile_pallas


@pytest.mark.parametrize(
  "rows_stationary, transpose_lhs",
  [(False, False), (True, False), (False, True), (True, True)],
  ids=["", "rs", "tl", "rs-tl"],
)
@pytest.mark.parametrize("interior_subs", [1, 2, 3])
@pytest.mark.parametrize("sizes, offset", INTERIOR_SIZES, ids=["odd", "whole-tiles"])
def test_tgmm_rowtile_interior_runs(sizes, offset, interior_subs, rows_stationary, transpose_lhs):
  """Groups long enough for interior runs (an unmasked dot over `interior_subs` passes), with odd
  counts of whole passes and leftovers: same results, exact zeros for the empty groups, MXU rows
  one pass per pass pushed, and the bench's per-dot counts."""
  from bench.costmodel import StepContext
  from bench.impls import rowtile_tgmm_dots

  sizes = np.asarray(sizes, np.int32)
  base = INTERIOR_TGMM_TL if transpose_lhs else INTERIOR_TGMM
  case = base[:-1] + (interior_subs == 2,)
  check_tgmm(
    case,
    sizes,
    offset,
    7,
    INTERPRET_MODES["hlo"],
    rows_stationary=rows_stationary,
    interior_subs=interior_subs,
    transpose_lhs=transpose_lhs,
  )
  m, tm, sub_m, local = case[0], case[3], case[6], case[8]
  align = _tgmm_align(case, transpose_lhs)
  assert align == (8 if transpose_lhs else sub_m)
  groups = metadata.make_tile_groups(
    group_sizes=jnp.asarray(sizes),
    group_offset=offset,
    num_local_groups=local,
    m=m,
    tm=tm,
    finalize_empty_groups=True,
  )
  steps = int(groups.active_tiles[1])
  ctx = StepContext(
    name="pallas_moe_tgmm_rowtile",
    grid=(1, 1, steps),
    program_ids=(np.zeros(steps, int), np.zeros(steps, int), np.arange(steps)),
    index_operands=(
      groups.group_offsets,
      groups.tile_first_group,
      groups.tile_last_group,
      groups.finalize_tile,
      groups.active_tiles,
      np.int32(offset),
    ),
  )
  first, runs, singles = rowtile_tgmm_dots(
    ctx, tm=tm, sub_m=sub_m, interior_subs=interior_subs, align=align
  )
  rows = kernel_testing.rowtile_mxu_rows(
    groups, group_offset=offset, m=m, tm=tm, sub_m=sub_m, align=align
  )
  first_tile = int(groups.active_tiles[0])
  np.testing.assert_array_equal(
    (first + singles + runs * interior_subs) * sub_m,
    np.asarray(rows)[first_tile : first_tile + steps],
  )
  assert first.sum() == np.sum(sizes[offset : offset + local] > 0)
  assert runs.sum() > 0  # the run path ran


def test_rowtile_rows_against_the_floor():
  """Rows pushed with passes on the sub_m grid = each group's aligned chunks (docs/design.md,
  "Bounds"); with passes from each group's first row (16-row aligned) fewer, and never below the
  floor of whole passes from each group's exact first row (`floor_rows`)."""
  from bench.costmodel import floor_rows

  sizes = np.array([100, 0, 300, 5, 1, 250, 0, 370], np.int32)
  rows = lambda align: int(  # noqa: E731
    _gmm_rows_per_tile(sizes, m=1100, tm=512, sub_m=128, align=align).sum()
  )
  ends = np.cumsum(sizes)
  starts = ends - sizes
  touched = -(-ends // 128) * 128 - (starts // 128) * 128
  assert rows(None) == rows(128) == int(np.where(sizes > 0, touched, 0).sum()) == 14 * 128
  # NOTE: by group (tile 0 = rows 0..511, tile 1 = 512..1023): [0,100) 1 pass; [100,400) from
  # row 96: 3; [400,405) from 400: 1; [405,406) from 400: 1; [406,512) from 400: 1 and
  # [512,656) 2; [656,1026) from 656 in tile 1: 3, and [1024,1026) in tile 2: 1.
  assert rows(16) == 13 * 128
  assert floor_rows(sizes, 128) == 11 * 128 <= rows(16)
  # NOTE: with the widened last pass (128 + 64 rows) where a group's last pass would hold at most
  # 64 of its rows: [100,400)'s three from row 96 (its last 48 rows) and [512,656)'s two in tile
  # 1 (16 rows) each push 64 rows fewer; [656,1026)'s last in tile 1 holds 112.
  assert int(_gmm_rows_per_tile(sizes, m=1100, tm=512, sub_m=128, align=16, tail=64).sum()) == (
    12 * 128
  )


@pytest.mark.parametrize("sequential", [False, True], ids=["parallel", "sequential"])
@pytest.mark.parametrize("op", ["fwd", "dlhs", "drhs"])
def test_cost_model_hooks_match_kernel_counts(op, sequential):
  """The bench's row-tile hooks (schedule-derived, used at full size) = what the kernel does:
  MXU rows per step, and every manual DMA the kernel waits for, exposed only in a step that
  waits for one (n and k are split in two, so DMAs cross sweeps when `sequential`)."""
  from bench import costmodel as cm
  from bench.impls import rowtile_gmm_passes, rowtile_hooks, rowtile_tgmm_dots

  sizes = np.array([40, 0, 75, 3, 0, 90, 50], np.int32)
  m, k, n, tm, sub_m = 300, 64, 256, 64, 32
  tk = k // 2 if op == "drhs" else k
  tn = n // 2
  hook, manual = rowtile_hooks(
    op=op,
    tm=tm,
    tk=tk,
    tn=tn,
    sub_m=sub_m,
    sequential_sweeps=sequential,
    itemsize=4,
    rows=m,
    out_cols=n if op == "fwd" else k,
    out_itemsize=4,
    lhs_itemsize=4,
    rhs_itemsize=4,
  )
  contexts = []

  def scale(ctx):
    contexts.append(ctx)
    return hook(ctx)

  if op == "drhs":
    lhs, rhs = jnp.zeros((k, m)), jnp.zeros((m, n))
    call = lambda x, y, gs: tgmm_rowtile_pallas(  # noqa: E731
      x,
      y,
      gs,
      tiling=(tm, tk, tn),
      out_dtype=jnp.float32,
      group_offset=jnp.int32(0),
      num_actual_groups=7,
      sub_m=sub_m,
      sequential_sweeps=sequential,
      interpret=True,
    )
  else:
    lhs, rhs = jnp.zeros((m, k)), jnp.zeros((7, n, k) if op == "dlhs" else (7, k, n))
    call = lambda x, w, gs: gmm_rowtile_pallas(  # noqa: E731
      x,
      w,
      gs,
      tm=tm,
      tn=tn,
      out_dtype=jnp.float32,
      group_offset=jnp.int32(0),
      transpose_rhs=op == "dlhs",
      sub_m=sub_m,
      sequential_sweeps=sequential,
      interpret=True,
    )
  (*fill, sched) = cm.analyze(
    call,
    lhs,
    rhs,
    jnp.asarray(sizes),
    step_scale=scale,
    step_manual_bytes=manual,
  )
  # NOTE: gmm zeroes the rows outside its visited tiles first: here the 42 rows past the sum
  # fall in the last tile, which is visited, so the fill writes nothing.
  assert [s.operand_bytes["manual"] for s in fill] == ([] if op == "drhs" else [0])
  _, counts = probe.with_row_counts(call)(lhs, rhs, jnp.asarray(sizes))
  # NOTE: the grid's steps per sweep: the visited m-tiles, or (gmm here) the pass-cut tiles.
  counts = np.asarray(counts)[:, : sched.step_scale.size // counts.shape[0]]
  counts = counts.reshape(-1, counts.shape[-1])
  if op != "drhs":
    assert metadata.uses_pass_cuts(m=m, tm=tm, sub_m=sub_m, align=8)  # NOTE: f32 rows: 8
  if op == "drhs":
    # NOTE: the tgmm's dots by kind (sub-blocks: 1, 2 (a run), 1); the model pads each dot's
    # 32 or 64 rows to the 128-row MXU, so its scale is dots over the body's three.
    first, runs, singles = rowtile_tgmm_dots(contexts[-1], tm=tm, sub_m=sub_m, interior_subs=2)
    np.testing.assert_array_equal((first + singles + 2 * runs) * sub_m, counts[:, 0])
    np.testing.assert_allclose(sched.step_scale, (first + singles + runs) / 3)
    assert runs.sum() > 0
  else:
    # NOTE: f32 passes are 8-row aligned, so the gmm widens a last pass by 16 rows; the model
    # pads both dots' rows (32 and 48) to the 128-row minimum pass, so its scale is the passes
    # over the body's two dots.
    regular, widened = rowtile_gmm_passes(contexts[-1], tm=tm, sub_m=sub_m, align=8, tail=16)
    np.testing.assert_array_equal(regular * sub_m + widened * (sub_m + 16), counts[:, 0])
    np.testing.assert_allclose(sched.step_scale, (regular + widened) / 2)
    assert widened.sum() > 0
  block = tk * tn * 4
  # NOTE: the row blocks the kernel moved per step (`probe.count_rows`): gmm's lhs rows fetched
  # and output rows written (the whole tile: the unowned rows are zeros here); tgmm's rhs and lhs
  # rows fetched. Each chain's first fetch and last write are exposed.
  sweeps = 2 if op != "drhs" else 4
  row_bytes = counts[:, 2:] * (np.array([k, tn]) if op != "drhs" else np.array([tn, tk])) * 4
  steps = counts.shape[0]
  chain = np.arange(steps) % (steps if sequential else steps // sweeps)
  first, last = chain == 0, chain == chain.max()
  row_exposed = row_bytes[first, 0].sum() + (row_bytes[last, 1].sum() if op != "drhs" else 0)
  if op == "drhs":
    row_exposed += row_bytes[first, 1].sum()
  np.testing.assert_allclose(
    sched.operand_bytes["manual"], counts[:, 1].sum() * block + row_bytes.sum()
  )
  waits = (counts[:, 1] > 0) | first | (last if op != "drhs" else False)
  assert not np.any(sched.step_exposed_bytes[~waits])
  # Without crossing sweeps, each sweep's first load (gmm) / last write (tgmm) is exposed.
  exposed_blocks = (sched.step_exposed_bytes.sum() - row_exposed) / block
  assert exposed_blocks == (1 if sequential else sweeps)


def test_public_gmm_grad_rows_stationary_on_v6e():
  """Under v6e's tiles, n = 384 (not a multiple of its 256-wide MXU): ops runs the forward and
  the weight gradient with `rows_stationary` (the lhs gradient contracts over n: no swap), and
  jax.grad of pallas_moe.gmm still matches the reference."""
  from bench import costmodel as cm

  sizes = jnp.array([100, 0, 250, 30, 0, 120], jnp.int32)  # 500 of 512 rows
  m, k, n = 512, 256, 384
  x = random_array(0, (m, k), jnp.float32)
  w = random_array(1, (6, k, n), jnp.float32)
  kw = dict(num_groups=6, dtypes=(jnp.dtype(jnp.float32),) * 3, interpret=True)
  with tiling.use_generation("v6e"):
    fwd = ops._resolve_tiles(None, dims=(m, k, n), kind="gmm", **kw)
    dlhs = ops._resolve_tiles(None, dims=(m, n, k), kind="gmm", **kw)
    drhs = ops._resolve_tiles(None, dims=(m, k, n), kind="tgmm", **kw)
    assert fwd.rowtile and fwd.rows_stationary
    assert dlhs.rowtile and not dlhs.rows_stationary
    assert drhs.rowtile and drhs.rows_stationary

    def loss(f):
      return lambda x, w: jnp.sum(jnp.sin(f(x, w, sizes)))

    grad_fn = jax.grad(loss(lambda x, w, s: pallas_moe.gmm(x, w, s, interpret=True)), (0, 1))
    got = jax.jit(grad_fn)(x, w)
    # The kernels ops launched: with the rows stationary, a sub-block dot is [384, 256] x
    # [256, 256] (n streams as rows: no MXU padding); the lhs gradient's [256, 384] x [384, 256]
    # pads its contraction to 512.
    calls = cm.analyze(grad_fn, x, w)
  # NOTE: the two gmm calls also launch their zero fills (no dot): not counted here.
  calls = [c for c in calls if "zero_fill" not in c.name]
  unpadded = sorted(
    padded == true
    for padded, true, _ in (cm.kernel_dot_macs(c.kernel_jaxpr, mxu=256) for c in calls)
  )
  assert unpadded == [False, True, True]
  ref = jax.grad(loss(lambda x, w, s: reference.gmm(x, w, s)), (0, 1))(x, w)
  for a, b in zip(got, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-4)


def test_slack_rows_are_never_fetched_multiplied_or_written():
  """With 8x slack the gmm and tgmm kernels step only over the tiles holding local rows (their
  real grids, bench.costmodel); gmm fetches only the local rows of its last tile, rounded to the
  DMA granule (`probe.count_rows`), and the zero fill writes exactly the other tiles' rows,
  once."""
  from bench import costmodel as cm

  m, k, n, tm, sub_m = 512, 64, 128, 32, 16
  sizes = np.array([0, 20, 9, 21, 0], np.int32)  # rows 0..49: 2 of 16 tiles, the 2nd partial
  offset = 1  # local groups 1..3: rows 0..49
  lhs, w = jnp.zeros((m, k)), jnp.zeros((3, k, n))
  # NOTE: fixed m-tiles (pass cuts would split these 50 rows into three shorter tiles).
  gmm_fn = functools.partial(
    gmm_rowtile_pallas,
    tm=tm,
    tn=n,
    out_dtype=jnp.float32,
    sub_m=sub_m,
    pass_cuts=False,
    interpret=True,
  )
  fill, main = cm.analyze(
    lambda x, y, gs, off: gmm_fn(x, y, gs, group_offset=off),
    lhs,
    w,
    jnp.asarray(sizes),
    jnp.int32(offset),
    step_manual_bytes=lambda ctx: np.zeros(ctx.program_ids[0].shape),
  )
  assert "zero_fill" in fill.name and main.steps == 2
  out, counts = probe.with_row_counts(gmm_fn)(
    lhs + 1, w + 1, jnp.asarray(sizes), group_offset=jnp.int32(offset)
  )
  # NOTE: lhs rows fetched per tile: all 32 of tile 0, and of tile 1 its 18 local rows rounded
  # up to f32's 8-row granule; nothing for the 14 other tiles.
  np.testing.assert_array_equal(np.asarray(counts)[0, :, 2], [32, 24] + [0] * 14)
  assert not np.any(np.asarray(out)[50:]) and np.all(np.asarray(out)[:50] == k)
  tgmm_fn = functools.partial(
    tgmm_rowtile_pallas,
    tiling=(tm, k, n),
    out_dtype=jnp.float32,
    num_actual_groups=3,
    sub_m=sub_m,
    interpret=True,
  )
  (tgmm_sched,) = cm.analyze(
    lambda x, y, gs, off: tgmm_fn(x, y, gs, group_offset=off),
    lhs.T,
    jnp.zeros((m, n)),
    jnp.asarray(sizes),
    jnp.int32(offset),
  )
  assert tgmm_sched.steps == 2
  # NOTE: the tgmm fetches lhs and rhs by manual DMA (not pipelined, not in the schedule's
  # operand bytes): its instrumentation counts the rows each step fetched, rhs then lhs.
  _, counts = probe.with_row_counts(tgmm_fn)(
    lhs.T, jnp.zeros((m, n)), jnp.asarray(sizes), group_offset=jnp.int32(offset)
  )
  # NOTE: rhs rows of tile 1 are its 18 local rows rounded to f32's 8; lhs (m on lanes, granule
  # 128 > tm) is fetched as whole tiles.
  fetched = np.zeros((m // tm, 2), int)
  fetched[:2] = [[32, 32], [24, 32]]
  np.testing.assert_array_equal(np.asarray(counts)[0, 0, :, 2:], fetched)
