"""The row-tile kernels' row-block DMAs in the cost model: gmm's lhs and output and
tgmm's lhs and rhs move only a visited tile's local rows, rounded out to the DMA granule, so a
receive buffer with slack costs what the same rows cost in a buffer of exactly their size."""

import numpy as np
import pytest
from kernel_testing import pushed_rows_per_tile

from bench import costmodel as cm
from bench.shapes import Shape
from pallas_moe import tiling

# NOTE: 700 real rows in a buffer of 1024 (slack) or 700 (slack 1); the last visited tile of
# tm = 256 holds 188 of them, 192 once rounded to bf16's 16-row granule.
_GS = np.array([100, 0, 300, 0, 0, 170, 130], np.int32)
_ROWS, _BUFFER = 700, 1024


def test_tile_rows_moved_by_hand():
  moved = lambda **kw: tiling.tile_rows_moved(tm=256, m=1024, **kw).tolist()  # noqa: E731
  # Tile rows [lo, hi) rounded out to the granule, clipped at m.
  assert moved(row0=[0, 256, 512], lo=[0, 0, 0], hi=[256, 256, 188], granule=16) == [256, 256, 192]
  assert moved(row0=[512], lo=[40], hi=[188], granule=16) == [160]  # [32, 192)
  assert moved(row0=[512], lo=[0], hi=[188], granule=128) == [256]  # tgmm's lhs: lanes
  assert tiling.tile_rows_moved(row0=[512], lo=[0], hi=[188], tm=256, m=700, granule=16) == [188]
  # A tile the granule does not divide (all of m) moves whole, clipped at m.
  assert tiling.tile_rows_moved(row0=[0], lo=[8], hi=[20], tm=300, m=300, granule=16) == [300]
  assert [tiling.row_granule_of(i) for i in (4, 2, 1)] == [8, 16, 32]
  assert tiling.row_granule_of(2, lanes=True) == 128


def test_row_dma_chain_by_hand():
  """Two sweeps of three steps: fetches are counted in the step before (the chain's first
  exposed), writes in the step after (the chain's last exposed); an unchanged block (same key)
  is not fetched again."""
  fetch = np.array([10.0, 20, 30, 10, 20, 30])
  write = np.array([1.0, 2, 3, 1, 2, 3])
  key = np.array([0, 1, 2, 0, 1, 2])
  over, exposed = tiling.rowtile_row_dma(
    fetches=[(fetch, key)], writes=write, sweeps=2, sequential_sweeps=False
  )
  np.testing.assert_allclose(over, [20, 31, 2, 20, 31, 2])
  np.testing.assert_allclose(exposed, [10, 0, 3, 10, 0, 3])
  over, exposed = tiling.rowtile_row_dma(
    fetches=[(fetch, key)], writes=write, sweeps=2, sequential_sweeps=True
  )
  np.testing.assert_allclose(over, [20, 31, 2 + 10, 3 + 20, 31, 2])
  np.testing.assert_allclose(exposed, [10, 0, 0, 0, 0, 3])
  # One visited tile: with sequential sweeps its block is fetched once.
  over, exposed = tiling.rowtile_row_dma(
    fetches=[(np.full(2, 10.0), np.zeros(2, int))], writes=np.zeros(2), sweeps=2,
    sequential_sweeps=True,
  )  # fmt: skip
  assert over.sum() == 0 and exposed.tolist() == [10, 0]


def _closed_form(kind, *, buffer_rows, unowned_rows, generation="v6e", tm=256):
  k, n = (512, 256)
  return tiling.rowtile_step_costs(
    group_sizes=_GS, k=k, n=n, tm=tm, tk=k if kind == "gmm" else 256, tn=128, kind=kind,
    lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2, generation=generation,
    buffer_rows=buffer_rows, unowned_rows=unowned_rows,
  )  # fmt: skip


@pytest.mark.parametrize("generation", ["v6e", "v5p"])  # sequential sweeps, and not
@pytest.mark.parametrize("kind", ["gmm", "tgmm"])
def test_closed_form_slack_costs_the_slack1_bytes(kind, generation):
  """The picker's closed form: with the output's tail undefined, a buffer with slack moves the
  slack-1 bytes but for the last tile's granule rounding (188 -> 192 rows per fetch / write);
  writing the tail (unowned rows "zero") writes the last visited tile whole."""
  _, over1, exp1 = _closed_form(
    kind, buffer_rows=None, unowned_rows="undefined", generation=generation
  )
  mxu, over, exp = _closed_form(
    kind, buffer_rows=_BUFFER, unowned_rows="undefined", generation=generation
  )
  tiles_m = 3
  sweeps = mxu.size // tiles_m
  # NOTE: gmm moves an lhs row (k = 512) and an output row (tn = 128) per tile and sweep (the
  # lhs once per sweep: more than one tile); tgmm an lhs row (tk = 256) and an rhs row (tn).
  # Rounding: 4 rows each for tgmm, whose lhs (lanes: 128 granule) rounds 188 up to 256 (68
  # rows); none for gmm, which pads an m of 700 rows to its granule (704) at slack 1 too.
  per_sweep = 0 if kind == "gmm" else (68 * 256 + 4 * 128) * 2
  assert (over + exp).sum() - (over1 + exp1).sum() == sweeps * per_sweep
  assert exp.sum() - exp1.sum() <= sweeps * per_sweep
  if kind == "gmm":
    _, over_z, exp_z = _closed_form(
      kind, buffer_rows=_BUFFER, unowned_rows="zero", generation=generation
    )
    # NOTE: the last tile's output written whole: 256 rows instead of 192.
    assert (over_z + exp_z).sum() - (over + exp).sum() == sweeps * 64 * 128 * 2
    fill = tiling.rowtile_fill_bytes(
      group_sizes=_GS, n=256, tm=256, out_itemsize=2, buffer_rows=_BUFFER
    )
    assert fill == (1024 - 768) * 256 * 2


def test_closed_form_does_not_penalize_a_big_tile_for_slack():
  """tgmm on a buffer twice the real rows: each tm's modeled time is its slack-1 time (within
  the granule rounding), so a big tm is no longer charged for its partly filled last tile."""
  gs = np.random.default_rng(0).multinomial(8276, np.full(4, 0.25))
  for tm in (512, 1024, 2048, 4096):
    kw = dict(
      group_sizes=gs, k=4096, n=1024, tm=tm, tk=1024, tn=1024, kind="tgmm", lhs_itemsize=2,
      rhs_itemsize=2, out_itemsize=2, generation="v6e",
    )  # fmt: skip
    one = tiling.rowtile_modeled_seconds(**kw)
    slack = tiling.rowtile_modeled_seconds(**kw, buffer_rows=16384)
    assert slack == pytest.approx(one, rel=0.01), tm


def _bench_schedule(op, *, buffer_rows, unowned_rows, generation):
  from bench import impls

  # NOTE: fixed tiles (the heuristic could pick other tiles for the two buffers).
  tiles = (256, 512, 128) if op != "dlhs" else (256, 256, 128)
  shape = Shape(name="tiny", tokens=buffer_rows, top_k=1, num_groups=len(_GS), k=512, n=256)
  gen = tiling.get_generation(generation)
  case = impls._pallas_moe_build(tiles, unowned_rows=unowned_rows)(
    op=op, shape=shape, group_sizes=_GS, generation=gen
  )
  *_, s = cm.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  return s


@pytest.mark.parametrize("op", ["fwd", "dlhs", "drhs"])
def test_bench_model_slack_costs_the_slack1_bytes(op):
  """The bench's model of the real kernels (`rowtile_hooks`): ours as the MoE block runs it
  (the tail undefined) moves the slack-1 bytes on a buffer with slack, but for the last tile's
  granule rounding; and its per-step bytes are the closed form's."""
  gen = "v6e"
  unowned = "undefined"
  s = _bench_schedule(op, buffer_rows=_BUFFER, unowned_rows=unowned, generation=gen)
  s1 = _bench_schedule(op, buffer_rows=_ROWS, unowned_rows=unowned, generation=gen)
  assert s.grid == s1.grid
  sweeps = s.steps // 3
  width = 512 if op != "dlhs" else 256  # gmm's contraction, tgmm's tk (an lhs row)
  # NOTE: as above, but the bench's tgmm takes its lhs as [m, k] (gmm's backward): its rows round
  # 188 up to 192 like rhs's (sublanes), not to 256 lanes.
  per_sweep = 0 if op != "drhs" else (4 * width + 4 * 128) * 2
  assert s.hbm_bytes - s1.hbm_bytes == sweeps * per_sweep
  # The closed form (the picker's) step by step.
  kind = "tgmm" if op == "drhs" else "gmm"
  k, n = (256, 512) if op == "dlhs" else (512, 256)
  mxu, over, exposed = tiling.rowtile_step_costs(
    group_sizes=_GS, k=k, n=n, tm=256, tk=k if kind == "gmm" else 512, tn=128, kind=kind,
    lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2, generation=gen, buffer_rows=_BUFFER,
    unowned_rows=unowned, **({"transpose_lhs": True} if kind == "tgmm" else {}),
  )  # fmt: skip
  np.testing.assert_allclose(s.step_bytes, over)
  np.testing.assert_allclose(s.step_exposed_bytes, exposed)


def test_closed_form_tgmm_passes_from_each_groups_first_row():
  """The picker's closed form for the weight gradient as gmm's backward runs it (lhs as [m, k]):
  a group's 128-row passes start at its first row rounded to 16 bf16 rows, not on the 128-row
  grid, so it scores fewer MXU rows: here 1,024 (8 passes: 100, 300, 112 + 58 and 130 rows in
  512-row tiles) against the grid's 1,152 (300 rows from row 100 touch four 128-row chunks)."""
  kw = dict(
    group_sizes=_GS, k=512, n=256, tm=512, tk=256, tn=128, kind="tgmm", lhs_itemsize=2,
    rhs_itemsize=2, out_itemsize=2, generation="v5e",
  )  # fmt: skip
  grid_mxu = tiling.rowtile_step_costs(**kw)[0].sum()
  first_row_mxu = tiling.rowtile_step_costs(**kw, transpose_lhs=True)[0].sum()
  assert (
    tiling.tgmm_pass_align(sub_m=128, tm=512, lhs_itemsize=2, rhs_itemsize=2, transpose_lhs=True)
    == 16
  )
  ends = np.cumsum(_GS)
  starts = ends - _GS
  rows = {
    align: pushed_rows_per_tile(starts, ends, tiles=2, tm=512, sub_m=128, align=align).sum()
    for align in (16, 128)
  }
  assert (rows[16], rows[128]) == (1024, 1152)
  assert first_row_mxu / grid_mxu == pytest.approx(rows[16] / rows[128])
