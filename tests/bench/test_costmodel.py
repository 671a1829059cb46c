"""Tests of bench.costmodel and pallas_moe.tiling against hand-computed schedules."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from bench import costmodel as cm
from bench.impls import IMPLS
from bench.shapes import SHAPES, SMALL_BATCH_TOKENS, get_shape, group_sizes
from pallas_moe import tiling

mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
BF16 = jnp.bfloat16
V5E = tiling.get_generation("v5e")
V6E = tiling.get_generation("v6e")


def _sds(*shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _visited_tiles(gs, tm, *, visit_empty=False):
  """megablox's m-tile visits, computed independently: each non-empty group [s, e) visits the
  tiles it touches, ceil(e/tm) - floor(s/tm); with visit_empty, an empty group visits one."""
  gs = np.asarray(gs, np.int64)
  ends = np.cumsum(gs)
  starts = ends - gs
  touched = -(-ends // tm) - starts // tm
  return int(np.where(gs > 0, touched, 1 if visit_empty else 0).sum())


# (a) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tk", [128, 256])
def test_single_dense_group_bytes(tk):
  m, k, n, tm, tn = 512, 256, 384, 128, 128
  gs = np.array([m], np.int32)
  fn = functools.partial(mb.gmm, preferred_element_type=BF16, tiling=(tm, tk, tn))
  (s,) = cm.analyze(fn, _sds(m, k), _sds(1, k, n), gs)
  tiles_m, tiles_k, tiles_n = m // tm, k // tk, n // tn
  assert s.grid == (tiles_n, tiles_m, tiles_k)
  steps = tiles_n * tiles_m * tiles_k
  # lhs block (m_tile, k_tile) changes every step (k innermost; or m_tile when tiles_k == 1).
  lhs = steps * tm * tk * 2
  # rhs block (0, k_tile, n_tile): every step when tiles_k > 1, else once per n tile.
  rhs = (steps if tiles_k > 1 else tiles_n) * tk * tn * 2
  out = tiles_n * tiles_m * tm * tn * 2
  assert sorted(s.operand_bytes.values()) == sorted([lhs, rhs, out])
  assert s.hbm_bytes == lhs + rhs + out
  assert s.min_hbm_bytes == 2 * (m * k + k * n + m * n)


# (b) ------------------------------------------------------------------------------------------


def test_megablox_gmm_rows_equal_visited_tiles():
  m, k, n, tm = 1024, 256, 256, 128
  gs = np.array([100, 0, 300, 0, 0, 500, 124], np.int32)
  fn = functools.partial(mb.gmm, preferred_element_type=BF16, tiling=(tm, 128, 128))
  scheds = cm.analyze(fn, _sds(m, k), _sds(len(gs), k, n), gs)
  visited = _visited_tiles(gs, tm)
  assert scheds[0].grid == (n // 128, visited, k // 128)
  rep = cm.cost(scheds, generation=V5E, row_macs=k * n, mxu_rows_useful=m)
  assert rep.mxu_rows_executed == visited * tm
  # On v6e (256-wide MXU) a 128-row tile costs 128 row passes (`generations.min_pass_rows`);
  # with the row sweep padded as the kernel pads it (each 128-wide k and n tile fills a 256-wide
  # weight tile), that is all.
  padded_row_macs = (k // 128) * 256 * (n // 128) * 256
  rep6 = cm.cost(scheds, generation=V6E, row_macs=padded_row_macs, mxu_rows_useful=m)
  assert rep6.mxu_rows_executed == visited * 128
  # Against the true k·n the column padding shows up too (4x more MACs per row).
  rep6_true = cm.cost(scheds, generation=V6E, row_macs=k * n, mxu_rows_useful=m)
  assert rep6_true.mxu_rows_executed == visited * 128 * 4


def test_megablox_tgmm_rows_with_skip_hook():
  m, k, n, tm = 1024, 256, 256, 128
  gs = np.array([100, 0, 300, 0, 0, 500, 124], np.int32)
  fn = functools.partial(mb.tgmm, preferred_element_type=BF16, tiling=(tm, 128, 128))
  hook = (
    IMPLS["megablox-default"]
    .build(
      op="drhs",
      shape=SHAPES["qwen3-30b-a3b"],
      group_sizes=np.ones(128, np.int32) * 1024,
      generation=V5E,
    )
    .step_scale
  )
  args = (_sds(k, m), _sds(m, n), gs)
  with_hook = cm.analyze(fn, *args, step_scale=hook)
  visits = _visited_tiles(gs, tm, visit_empty=True)
  assert with_hook[0].grid == (n // 128, k // 128, visits)
  rep = cm.cost(with_hook, generation=V5E, row_macs=k * n, mxu_rows_useful=m)
  assert rep.mxu_rows_executed == _visited_tiles(gs, tm) * tm
  no_hook = cm.cost(cm.analyze(fn, *args), generation=V5E, row_macs=k * n)
  assert no_hook.mxu_rows_executed == visits * tm


# (c) ------------------------------------------------------------------------------------------


def _matmul(x, y, *, bm, bn, bk):
  def kernel(x_ref, y_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  m, kk = x.shape
  n = y.shape[1]
  return pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
    grid=(m // bm, n // bn, kk // bk),
    in_specs=[
      pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
      pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
  )(x, y)


@pytest.mark.parametrize("gen", [V5E, V6E], ids=lambda g: g.name)
def test_tiled_matmul_by_hand(gen):
  m, k, n, bm, bn, bk = 256, 512, 256, 128, 128, 256
  fn = functools.partial(_matmul, bm=bm, bn=bn, bk=bk)
  (s,) = cm.analyze(fn, _sds(m, k), _sds(k, n))
  assert s.grid == (2, 2, 2)
  x_blk, y_blk, o_blk = bm * bk * 2, bk * bn * 2, bm * bn * 4
  # Steps (i, j, kk): x and y blocks change every step; out is written when kk == 1.
  per_step = np.array(
    [x_blk + y_blk + (o_blk if kk == 1 else 0) for _ in range(4) for kk in range(2)]
  )
  np.testing.assert_array_equal(s.step_bytes, per_step)
  rep = cm.cost([s], generation=gen)
  mxu = gen.mxu_size
  pad = lambda v: -(-v // mxu) * mxu
  # NOTE: a pass costs at least min(mxu, 128) rows (`generations.min_pass_rows`).
  mxu_t = 2 * max(bm, min(mxu, 128)) * pad(bk) * pad(bn) / gen.peak_bf16_flops
  expect = sum(max(mxu_t, b / gen.hbm_bytes_per_s) + gen.step_overhead_s for b in per_step)
  assert rep.modeled_us == pytest.approx(expect * 1e6, rel=1e-9)
  assert rep.hbm_bytes == per_step.sum()
  assert rep.min_hbm_bytes == 2 * m * k + 2 * k * n + 4 * m * n


def test_floor_rows_by_hand():
  # Groups [0,100) [100,100) [100,400) [400,1024) in 128-row passes: from each group's first
  # row 128 + 0 + 384 + 640; on the 128-row grid 128 + 0 + 512 + 640.
  assert cm.floor_rows([100, 0, 300, 624], 128) == 1152
  assert cm.aligned_rows([100, 0, 300, 624], 128) == 1280
  assert cm.floor_rows([256, 256], 128) == cm.aligned_rows([256, 256], 128) == 512
  assert cm.floor_rows([1, 1], 256) == cm.aligned_rows([1, 1], 256) == 512


# (d) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gmm", "tgmm"])
def test_vmem_estimate_monotonic(kind):
  dt = dict(lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16, kind=kind)
  base = tiling.vmem_estimate_bytes(tm=256, tk=512, tn=512, **dt)
  for bigger in [
    dict(tm=512, tk=512, tn=512),
    dict(tm=256, tk=1024, tn=512),
    dict(tm=256, tk=512, tn=1024),
  ]:
    assert tiling.vmem_estimate_bytes(**bigger, **dt) > base
  f32 = dict(dt, lhs_dtype=jnp.float32)
  assert tiling.vmem_estimate_bytes(tm=256, tk=512, tn=512, **f32) > base


def test_check_fits_vmem_raises_for_oversized():
  dt = dict(lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16, kind="gmm")
  assert tiling.check_fits_vmem(tm=128, tk=128, tn=128, generation="v5e", **dt) > 0
  with pytest.raises(ValueError, match=r"\(2048, 4096, 4096\).*MiB.*v5e.*try \("):
    tiling.check_fits_vmem(tm=2048, tk=4096, tn=4096, generation="v5e", **dt)
  # A raised limit admits a tiling the scoped default rejects.
  with pytest.raises(ValueError):
    tiling.check_fits_vmem(tm=512, tk=2048, tn=2048, generation="v5e", **dt)
  tiling.check_fits_vmem(
    tm=512, tk=2048, tn=2048, generation="v5e", vmem_limit_bytes=100 * 2**20, **dt
  )


def _aligned(t, dim, align):
  return t == dim or (t % align == 0 and t <= dim)


@pytest.mark.parametrize("gen", sorted(tiling.GENERATIONS))
def test_pick_tiling_aligned_and_fits(gen):
  g = tiling.get_generation(gen)
  dt = dict(lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16)
  for name in SHAPES:
    for tokens in (None, SMALL_BATCH_TOKENS):
      s = get_shape(name, tokens=tokens)
      # fwd (k contracted), dlhs (n contracted), drhs (tgmm).
      for kind, kk, nn in (("gmm", s.k, s.n), ("gmm", s.n, s.k), ("tgmm", s.k, s.n)):
        tm, tk, tn = tiling.pick_tiling(
          m=s.m, k=kk, n=nn, num_groups=s.num_groups, kind=kind, generation=g, **dt
        )
        assert _aligned(tm, s.m, 8) and _aligned(tk, kk, 128) and _aligned(tn, nn, 128)
        budget = tiling.usable_vmem_bytes(g)
        est = tiling.check_fits_vmem(
          tm=tm, tk=tk, tn=tn, kind=kind, generation=g, vmem_limit_bytes=budget, **dt
        )
        assert est <= budget
        # Over Mosaic's scoped default, the kernels raise the limit to the budget.
        limit = tiling.vmem_limit_for(est, g)
        assert (limit is None) == (est <= g.scoped_vmem_default_bytes)


def test_generations_table():
  assert tiling.get_generation("v6e").mxu_size == 256
  assert tiling.get_generation("v5e").peak_bf16_flops == 197e12
  assert tiling.current_generation().name == "v5e"  # CPU default
  with pytest.raises(ValueError, match="Unknown TPU generation"):
    tiling.get_generation("v9z")


# docs/design.md figures ("MXU row waste and weight traffic") ------------------------------------


@pytest.mark.parametrize(
  "name,tokens,expected",
  [
    ("deepseek-v2-lite", 16384, 1.33),
    ("qwen3-30b-a3b", 16384, 1.50),
    ("deepseek-v2-lite", 4096, 2.31),
    ("qwen3-30b-a3b", 4096, 2.98),
  ],
)
def test_design_megablox_row_waste(name, tokens, expected):
  """Row waste = rows pushed through the MXU per full (k, n) sweep / sum(group_sizes), with
  column padding excluded (row_macs = the padded per-row sweep); megablox tiling 512x1024x1024
  clamped to the dims as MaxText does; uniform routing, seed 0, v5e."""
  shape = get_shape(name, tokens=tokens)
  gs = group_sizes(shape, routing="uniform")
  case = IMPLS["megablox-maxtext"].build(op="fwd", shape=shape, group_sizes=gs, generation=V5E)
  rep = cm.model(
    case.fn, *case.args, generation=V5E, row_macs=case.row_macs(128), mxu_rows_useful=int(gs.sum())
  )
  assert rep.row_waste == pytest.approx(expected, rel=0.03)
  assert rep.mxu_rows_executed == _visited_tiles(gs, 512) * 512


# The bench's pallas_moe entries ---------------------------------------------------------------


def _tiny_shape(*, m, k, n, g):
  from bench.shapes import Shape

  return Shape(name="tiny", tokens=m, top_k=1, num_groups=g, k=k, n=n)


# Groups with empty ones, sizes summing to less than m (so the kernel has fill visits).
_GS = np.array([100, 0, 300, 0, 0, 170, 130], np.int32)  # sum 700 of m = 1024


@pytest.mark.parametrize("op", ["fwd", "dlhs", "drhs"])
def test_pallas_moe_visit_rows_equal_aligned_rows(op):
  """The grid is the schedule (visits counted with numpy); rows executed = aligned_rows."""
  m, k, n = 1024, 256, 384
  shape = _tiny_shape(m=m, k=k, n=n, g=len(_GS))
  case = IMPLS["pallas_moe-visits"].build(op=op, shape=shape, group_sizes=_GS, generation=V5E)
  tm, tk, tn = case.tiling
  (s,) = cm.analyze(case.fn, *case.args, step_scale=case.step_scale)
  active = _visited_tiles(_GS, tm)
  contract, out_cols = (n, k) if op == "dlhs" else (k, n)
  if op == "drhs":
    # Every group visited, empty ones once (inactive); visits innermost.
    assert s.grid == (-(-k // tk), -(-n // tn), _visited_tiles(_GS, tm, visit_empty=True))
  else:
    # Plus one fill visit per m-tile with no row of any group: rows [700, 1024).
    fill = -(-m // tm) - (-(-int(_GS.sum()) // tm))
    assert s.grid == (-(-out_cols // tn), active + fill, -(-contract // tk))
  rep = cm.cost([s], generation=V5E, row_macs=case.row_macs(128), mxu_rows_useful=int(_GS.sum()))
  # The visit kernels skip the MXU-row sub-blocks outside the visit's group: the model's count is
  # aligned_rows, and equals what the kernel really multiplies when run in interpret mode.
  assert rep.mxu_rows_executed == pytest.approx(cm.aligned_rows(_GS, 128))
  assert rep.mxu_rows_executed == _interpret_rows_executed(op, shape, case.tiling)


@pytest.mark.parametrize("op", ["fwd", "dlhs", "drhs"])
def test_pallas_moe_default_rowtile_rows_and_bytes(op):
  """The default impl runs the row-tile kernels: one step per (k, n) tile and m-tile, rows
  executed = floor_rows, and with the manual-DMA hook the bytes moved are the minimum: the row
  operands' real rows read once (rounded to the DMA granule: 700 -> 704 rows; tgmm's lhs comes as
  [m, k], as gmm's backward passes it), weights once per n-tile, the output written once (gmm:
  whole visited tiles, the unowned rows are zeros)."""
  m, k, n = 1024, 256, 384
  shape = _tiny_shape(m=m, k=k, n=n, g=len(_GS))
  case = IMPLS["pallas_moe"].build(op=op, shape=shape, group_sizes=_GS, generation=V5E)
  assert case.kernel == "rowtile"
  tm, tk, tn = case.tiling
  *_, s = cm.analyze(  # a gmm's zero fill (nothing to fill here) comes first
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  contract, out_cols = (n, k) if op == "dlhs" else (k, n)
  rep = cm.cost([s], generation=V5E, row_macs=case.row_macs(128), mxu_rows_useful=int(_GS.sum()))
  # NOTE: gmm's passes start at each group's first row (16-row aligned), the last two as one of
  # 192 rows where the last would hold at most 64 (300, 170 and 130 rows: 832 rows, not the 1024
  # of whole passes): here that is the floor. tgmm's start there too (its rows are the
  # contraction: no widened pass), 1024 rows where the 128-row grid would push 1152.
  want_rows = cm.floor_rows(_GS, 128) if op == "drhs" else cm.floor_rows(_GS, 128, tail=64)
  assert cm.floor_rows(_GS, 128, tail=64) == 832 < cm.floor_rows(_GS, 128) == 1024
  assert cm.floor_rows(_GS, 128) < cm.aligned_rows(_GS, 128)
  assert rep.mxu_rows_executed == pytest.approx(want_rows)
  rows = -(-int(_GS.sum()) // 16) * 16  # bf16's 16-row granule
  if op == "drhs":
    assert s.grid == (k // tk, n // tn, -(-m // tm))
    want = rows * k * 2 * (n // tn) + rows * n * 2 * (k // tk) + len(_GS) * k * n * 2
  else:
    assert s.grid == (out_cols // tn, -(-m // tm))
    nonempty = int(np.sum(_GS > 0))
    want = (
      rows * contract * 2 * (out_cols // tn) + nonempty * contract * out_cols * 2 + m * out_cols * 2
    )
  assert s.hbm_bytes == want


def test_pallas_moe_default_weight_gradient_tiles_are_ops_without_existing_out():
  """The bench's tgmm has no existing_out, like the weight gradient ops runs: its tiles are the
  ones ops picks for such a call. At this shape (mixtral's up projection, one expert on v6e, a
  16,384-row buffer) the estimate without existing_out's block admits a wider tk than with it."""
  from pallas_moe import ops

  m, k, n = 16384, 4096, 14336
  shape = _tiny_shape(m=m, k=k, n=n, g=1)
  case = IMPLS["pallas_moe"].build(
    op="drhs", shape=shape, group_sizes=np.array([8276], np.int32), generation=V6E
  )
  picked = {}
  for existing_out in (False, True):
    with tiling.use_generation(V6E):
      picked[existing_out] = ops._resolve_tiles(
        None,
        dims=(m, k, n),
        kind="tgmm",
        num_groups=1,
        dtypes=(jnp.bfloat16,) * 3,
        interpret=False,
        existing_out=existing_out,
      ).tiles
  assert picked[False] != picked[True]
  assert case.kernel == "rowtile"
  assert case.tiling == picked[False]


@pytest.mark.parametrize("op", ["fwd", "dlhs", "drhs"])
def test_rows_stationary_saves_the_column_padding_on_v6e(op):
  """n = 384 on v6e's 256-wide MXU: the forward and the weight gradient run with the rows
  stationary, so their modeled MXU work is aligned_rows x k x n with n unpadded (384, not 512);
  the lhs gradient contracts over n, which no orientation unpads. Rows executed: aligned_rows,
  at the op's pass granule: the lhs gradient's output tile (k = 256) is a multiple of the MXU,
  so its passes are 128 rows (`generations.pass_granule`); the others keep 256."""
  from bench.impls import _pallas_moe_build

  m, k, n = 1024, 256, 384
  shape = _tiny_shape(m=m, k=k, n=n, g=len(_GS))
  tiles = (256, k, n) if op == "fwd" else (256, n, k) if op == "dlhs" else (256, k, n)
  case = _pallas_moe_build(tiles)(op=op, shape=shape, group_sizes=_GS, generation=V6E)
  swapped = op != "dlhs"
  assert case.kernel == ("rowtile-rows-stationary" if swapped else "rowtile")
  *_, s = cm.analyze(  # a gmm's zero fill (nothing to fill here) comes first
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  rep = cm.cost([s], generation=V6E, row_macs=case.row_macs(256), mxu_rows_useful=int(_GS.sum()))
  # NOTE: 256-row tiles of 256-row passes stay on their grid. The lhs gradient's 128-row passes
  # from each group's first row push as many rows here as on the 128-row grid (1152), less 64
  # for each of the three groups whose last two passes in a tile run as one widened pass (the
  # 300-row group's in tiles 0 and 1, the 130-row group's in tile 2): 960.
  assert cm.aligned_rows(_GS, 128) == 1152
  floor = 960 if op == "dlhs" else cm.aligned_rows(_GS, 256)
  assert rep.mxu_rows_executed == pytest.approx(floor)
  padded_n = 512  # 384 rounded up to the MXU
  assert rep.calls[0].mxu_macs_padded == pytest.approx(floor * k * (n if swapped else padded_n))


def _interpret_rows_executed(op, shape, tiling):
  """Rows the kernel multiplies per k, n sweep, counted by running it (interpret, with a
  `probe.count_rows` probe)."""
  from pallas_moe import probe
  from pallas_moe.gmm import gmm_pallas
  from pallas_moe.tgmm import tgmm_pallas

  m, k, n, g = shape.m, shape.k, shape.n, shape.num_groups
  gs = jnp.asarray(_GS)
  tm = tiling[0]
  sub_m = 128 if tm % 128 == 0 else tm
  if op == "drhs":
    _, rows = probe.with_row_counts(tgmm_pallas)(
      jnp.ones((k, m)),
      jnp.ones((m, n)),
      gs,
      tiling=tiling,
      sub_m=sub_m,
      out_dtype=jnp.float32,
      group_offset=jnp.int32(0),
      num_actual_groups=g,
      interpret=True,
    )
    return int(np.asarray(rows)[0, 0].sum())
  kk, nn = (n, k) if op == "dlhs" else (k, n)
  _, rows = probe.with_row_counts(gmm_pallas)(
    jnp.ones((m, kk)),
    jnp.ones((g, kk, nn)),
    gs,
    tiling=tiling,
    sub_m=sub_m,
    out_dtype=jnp.float32,
    group_offset=jnp.int32(0),
    interpret=True,
  )
  return int(np.asarray(rows)[0].sum())


def test_pallas_moe_rows_with_ragged_k():
  """k % tk != 0: the kernel has a masked and an unmasked dot branch; exactly one runs."""
  from bench import impls

  m, k, n = 1024, 1408, 256
  shape = _tiny_shape(m=m, k=k, n=n, g=len(_GS))
  build = impls._pallas_moe_build((128, 1024, 256))
  case = build(op="fwd", shape=shape, group_sizes=_GS, generation=V5E)
  assert case.tiling == (128, 1024, 256)
  rep = cm.model(
    case.fn,
    *case.args,
    generation=V5E,
    step_scale=case.step_scale,
    row_macs=case.row_macs(128),
    mxu_rows_useful=int(_GS.sum()),
  )
  assert rep.mxu_rows_executed == pytest.approx(cm.aligned_rows(_GS, 128))


@pytest.mark.parametrize("tk", [128, 256])
def test_pallas_moe_single_dense_group_bytes(tk):
  """One group owning all rows: every block is fetched as in a dense tiled matmul."""
  from bench import impls

  m, k, n, tm, tn = 512, 256, 384, 128, 128
  shape = _tiny_shape(m=m, k=k, n=n, g=1)
  case = impls._pallas_moe_build((tm, tk, tn), "visits")(
    op="fwd", shape=shape, group_sizes=np.array([m], np.int32), generation=V5E
  )
  (s,) = cm.analyze(case.fn, *case.args, step_scale=case.step_scale)
  tiles_m, tiles_k, tiles_n = m // tm, k // tk, n // tn
  assert s.grid == (tiles_n, tiles_m, tiles_k)
  steps = tiles_n * tiles_m * tiles_k
  lhs = steps * tm * tk * 2  # the (m_tile, k_tile) block changes every step
  rhs = (steps if tiles_k > 1 else tiles_n) * tk * tn * 2  # fixed per n tile when tiles_k == 1
  out = tiles_n * tiles_m * tm * tn * 2
  assert sorted(s.operand_bytes.values()) == sorted([lhs, rhs, out])
  assert s.hbm_bytes == lhs + rhs + out
  assert s.min_hbm_bytes == 2 * (m * k + k * n + m * n)
  rep = cm.cost([s], generation=V5E, row_macs=case.row_macs(128), mxu_rows_useful=m)
  assert rep.mxu_rows_executed == m


# megablox at its best tiling (bench/impls.py, megablox-best) ---------------------------------


def _mb_model(op, shape, t):
  """megablox's modeled time at tiling t on v5e, analyzed directly (not through the search)."""
  from bench import impls

  case = impls._megablox_build(t)(op=op, shape=shape, group_sizes=_GS, generation=V5E)
  return cm.model(case.fn, *case.args, generation=V5E, step_scale=case.step_scale).modeled_us


@pytest.mark.parametrize("op", ["fwd", "drhs"])
def test_megablox_grid_search_is_the_minimum(op):
  """The search returns the fastest tiling of its grid: its pick is modeled as it says, beats
  the others modeled directly, and every tiling it did not model has a lower bound ≥ its pick
  (the bound is checked against the model on the tilings modeled here)."""
  from bench import impls

  shape = _tiny_shape(m=1024, k=256, n=384, g=len(_GS))
  sizes = (128, None)
  # NOTE: by default tk and tn also take tokamax's tuned sizes (clamped to the dims: 256 joins
  # tn here); the search's logic is checked on the plain grid.
  assert (1024, 128, 256) in impls.megablox_tilings(op=op, shape=shape, sizes=sizes)
  tilings = impls.megablox_tilings(op=op, shape=shape, sizes=sizes, kn_extra=())
  assert tilings == [(tm, tk, tn) for tm in (128, 1024) for tk in (128, 256) for tn in (128, 384)]
  res = impls.megablox_grid_search(
    op=op, shape=shape, group_sizes=_GS, generation=V5E, sizes=sizes, kn_extra=()
  )
  assert (res.enumerated, res.fitting) == (8, 8) and res.analyzed < 8
  assert res.modeled_us == pytest.approx(_mb_model(op, shape, res.tiling), rel=1e-12)
  bound = lambda t: impls.megablox_lower_bound_us(
    op=op, shape=shape, group_sizes=_GS, tiling=t, generation=V5E
  )
  by_bound = sorted(tilings, key=lambda t: (bound(t), t))
  for t in [(128, 128, 128), (1024, 256, 384), *(by_bound[:2])]:
    us = _mb_model(op, shape, t)
    assert bound(t) <= us * (1 + 1e-12)
    assert res.modeled_us <= us
  assert sum(bound(t) < res.modeled_us for t in tilings) <= res.analyzed


def test_megablox_grid_search_refuses_tilings_over_vmem():
  from bench import impls

  shape = _tiny_shape(m=1024, k=256, n=384, g=len(_GS))
  sizes = (128, None)
  free = impls.megablox_grid_search(
    op="fwd", shape=shape, group_sizes=_GS, generation=V5E, sizes=sizes
  )
  # A budget just under the free pick's estimate: it and everything bigger are refused.
  budget = free.vmem_bytes - 1
  res = impls.megablox_grid_search(
    op="fwd", shape=shape, group_sizes=_GS, generation=V5E, sizes=sizes, vmem_budget_bytes=budget
  )
  fit = [
    t
    for t in impls.megablox_tilings(op="fwd", shape=shape, sizes=sizes)
    if impls.megablox_vmem_bytes(op="fwd", tiling=t) <= budget
  ]
  assert res.fitting == len(fit) < 8 and res.tiling in fit and res.tiling != free.tiling
  assert res.vmem_bytes <= budget and res.modeled_us >= free.modeled_us
  assert res.fits_scoped  # tiny tiles: within v5e's 16 MiB scoped default
  assert res.modeled_us <= min(_mb_model("fwd", shape, t) for t in fit if t != res.tiling)
  with pytest.raises(impls.Unsupported, match="fits"):
    impls.megablox_grid_search(
      op="fwd", shape=shape, group_sizes=_GS, generation=V5E, sizes=sizes, vmem_budget_bytes=2**20
    )


def test_step_tensorcores_follows_mosaic_split():
  # NOTE: as the AOT LLO dumps for v5p show (libtpu 0.0.42): grid (3, 2, 2) with a parallel
  # first axis loops 2 x 2 x 2 steps per core; (3, 3, 2) with two parallel axes 5 x 2 (the
  # parallel axes flattened); a parallel axis of one tile, or none, runs in a PrimaryCoreRegion.
  par = ("parallel", "arbitrary", "arbitrary")
  cores, core = cm.step_tensorcores(
    grid=(3, 2, 2), dimension_semantics=par, tensorcores_per_device=2
  )
  assert cores == 2 and core.tolist() == [0] * 8 + [1] * 4
  cores, core = cm.step_tensorcores(
    grid=(3, 3, 2),
    dimension_semantics=("GridDimensionSemantics.PARALLEL", "parallel", "arbitrary"),
    tensorcores_per_device=2,
  )
  assert cores == 2 and np.bincount(core).tolist() == [10, 8]
  for grid, sem, per_device in (
    ((1, 4, 2), par, 2),
    ((4, 2), None, 2),
    ((4, 2), ("arbitrary", "parallel"), 2),
    ((4, 2, 2), par, 1),
  ):
    cores, core = cm.step_tensorcores(
      grid=grid, dimension_semantics=sem, tensorcores_per_device=per_device
    )
    assert cores == 1 and not core.any() and core.size == np.prod(grid)
  with pytest.raises(ValueError, match="tensorcores"):
    cm.cost([], generation="v5p", tensorcores="device")
  # NOTE: "kernel" is the default; "chip" only where a caller asks for it.
  with cm.use_tensorcores("chip"):
    assert cm._TENSORCORES.get() == "chip"
  assert cm._TENSORCORES.get() == "kernel"


def test_weight_gradient_falls_back_to_the_visit_kernel_with_the_same_layout():
  """Where ops would run the visit tgmm (tiles the row-tile kernel cannot run: tk not dividing
  k), the bench's drhs case runs it as gmm's backward does, on the [m, k] lhs with
  `transpose_lhs`: the grid walks cdiv(k, tk) k-tiles of the real k (not m)."""
  from bench.impls import _pallas_moe_build

  m, k, n = 1024, 384, 256
  shape = _tiny_shape(m=m, k=k, n=n, g=len(_GS))
  case = _pallas_moe_build((256, 256, 128))(op="drhs", shape=shape, group_sizes=_GS, generation=V5E)
  assert case.kernel != "rowtile" and case.args[0].shape == (m, k)
  *_, s = cm.analyze(case.fn, *case.args, step_scale=case.step_scale)
  assert s.grid[:2] == (-(-k // 256), n // 128)
  rep = cm.cost([s], generation=V5E, row_macs=case.row_macs(128), mxu_rows_useful=int(_GS.sum()))
  assert rep.mxu_rows_executed == pytest.approx(cm.aligned_rows(_GS, 128))
