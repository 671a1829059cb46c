"""The row-tile gmm kernel: one grid step per m-tile; weights streamed per group by manual DMA.

`gmm.py`'s module docstring describes the schedule. The kernel is built from named parts:

- `RowTilePlan`: every static choice of a call (tiles, pass alignment, pass cuts, which
  operands are present, the kernel's flags), made in plain Python before any tracing.
- `RowTileMetadata`: the scalar-prefetch arrays, one pytree; `RowTileIndexMaps` its index maps.
- `RowTileInputs`, `RowTileScratch`: the operands and the VMEM / semaphore scratch by name.
- `_Step`: one grid step's positions (tile, chain, slots) and the DMA descriptors of its lhs rows,
  output rows and group weights (`dma` does the double buffering).
- `_Step.group_body` (`compute_group`, `load_group`, `run_passes`, `multiply`): the compute
  body, one local group's weight load and passes.
- `_kernel`: the main loop; `gmm_rowtile_pallas`: validation, metadata and the pallas_call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import common, dma, gmm_common, kernel_refs, metadata, probe

# ------------------------------------------------------------------------------------------------
# Zero fill: the rows outside the visited tiles of the output buffer the kernel aliases.
# ------------------------------------------------------------------------------------------------

# NOTE: bytes of the zero block `zeros_outside_active` DMAs from, and the DMAs it keeps in flight.
_ZERO_BLOCK_BYTES = 1 << 20
_ZERO_DMA_DEPTH = 8


def zeros_outside_active(active_tiles, *, rows, n, tm, dtype, interpret, vary_like):
  """A [rows, n] buffer whose rows outside the visited m-tiles are exact zeros.

  The row-tile gmm visits only the m-tiles holding local rows and writes its result into this
  buffer (aliased), so this is how the rows of other shards' groups and the rows past
  sum(group_sizes) (a receive buffer's slack) get their zeros: one grid step that DMAs a zeroed
  VMEM block over those rows only. It writes exactly their bytes, once, at HBM bandwidth, and
  leaves the visited tiles' rows unwritten (the gmm writes them).

  Args:
    active_tiles: [2] int32 (first visited m-tile, number of visited m-tiles).
    rows: rows of the buffer.
    n: columns.
    tm: the gmm's m-tile.
    dtype: element type.
    interpret: see `common.run_kernel`.
    vary_like: operands whose manual mesh axes the buffer varies over (shard_map).

  Returns:
    [rows, n] of `dtype`.
  """
  itemsize = jnp.dtype(dtype).itemsize
  # NOTE: the zero block is a divisor of the m-tile (so it never straddles a visited tile) of at
  # most ~1 MiB, a multiple of 8 rows unless it is the whole tile.
  chunk = tm
  while chunk % 16 == 0 and chunk * n * itemsize > _ZERO_BLOCK_BYTES:
    chunk //= 2
  tiles_m = metadata.cdiv(rows, tm)
  per_tile = tm // chunk
  last_rows = rows - (tiles_m - 1) * tm
  depth = _ZERO_DMA_DEPTH

  def kernel(active_ref, out_hbm, zeros, sems):
    zeros[...] = jnp.zeros_like(zeros)
    first, num = active_ref[0], active_ref[1]
    after = first + num  # first unvisited tile after the visited ones

    def copy(row, i, size=chunk):
      return pltpu.make_async_copy(
        zeros.at[:size], out_hbm.at[pl.ds(row, size)], sems.at[i % depth]
      )

    # NOTE: whole-tile chunks: those of tiles 0 .. first - 1, then of tiles after .. tiles_m - 2
    # (the last tile may be ragged: written below with its static row count).
    num_head = first * per_tile
    num_chunks = num_head + jnp.maximum(tiles_m - 1 - after, 0) * per_tile

    def row_of(i):
      return jnp.where(i < num_head, i, after * per_tile + i - num_head) * chunk

    def issue(i, carry):
      # NOTE: at most `depth` DMAs in flight: before reusing a semaphore, wait for the DMA that
      # last used it (all chunks have one size, so any chunk's descriptor waits for it).
      @pl.when(i >= depth)
      def _wait():
        copy(0, i - depth).wait()

      copy(row_of(i), i).start()
      return carry

    def drain(i, carry):
      copy(0, i).wait()
      return carry

    # NOTE: with a single (possibly ragged) tile there are no whole-tile chunks.
    if tiles_m > 1:
      lax.fori_loop(0, num_chunks, issue, 0)
      lax.fori_loop(jnp.maximum(num_chunks - depth, 0), num_chunks, drain, 0)

    @pl.when(after <= tiles_m - 1)
    def _last_tile():
      row0 = (tiles_m - 1) * tm
      sizes = [chunk] * (last_rows // chunk) + ([last_rows % chunk] if last_rows % chunk else [])
      copies = [copy(row0 + j * chunk, j, size) for j, size in enumerate(sizes)]
      for j in range(0, len(copies), depth):
        for c in copies[j : j + depth]:
          c.start()
        for c in copies[j : j + depth]:
          c.wait()

  return common.call_kernel(
    kernel,
    name="pallas_moe_zero_fill",
    grid=(1,),
    prefetch=(active_tiles,),
    operands=[],
    in_specs=[],
    out_shape=common.out_struct((rows, n), dtype, active_tiles, *vary_like),
    out_spec=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=[pltpu.VMEM((chunk, n), dtype), pltpu.SemaphoreType.DMA((depth,))],
    dimension_semantics=("arbitrary",),
    vmem_limit_bytes=None,
    flops=0,
    bytes_accessed=rows * n * itemsize,
    interpret=interpret,
  )


# ------------------------------------------------------------------------------------------------
# The plan: every static choice, before tracing.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowTilePlan:
  """The static configuration of one row-tile gmm call (see `plan_rowtile`).

  Attributes:
    m, k, n: lhs is [m, k], the result [m, n].
    num_local_groups: groups rhs holds.
    tm, tn, sub_m: rows per m-tile, columns per n-tile, rows per MXU pass.
    tiles_m, tiles_n: m-tiles of m, n-tiles of n.
    lhs_dtype, rhs_dtype, out_dtype: element types of the operands and the result.
    compute_dtype, dot_acc_dtype: the dot's operand and accumulation types (`common.dot_dtypes`).
    lhs_granule, out_granule: rows per DMA granule of lhs and of the output.
    lhs_rows, out_rows: rows of lhs and of the output buffer, padded to their granules.
    align: the pass alignment (`metadata.pass_align`): a group's passes start at a multiple.
    tail: rows a group's widened last pass adds (`metadata.merge_tail_rows`; 0: none).
    pass_cuts: m-tiles cut on the groups' pass grids (`metadata.make_pass_cut_tiles`).
    transpose_rhs: rhs is [G, n, k].
    quantized, lhs_quantized: rhs / lhs come with f32 scales.
    scales_on_k: rhs scales run along the contraction.
    narrow_dot: the dot runs on the 8-bit values.
    rows_stationary: each pass computes out^T = w^T @ x^T.
    sequential_sweeps: the grid runs in order on one TensorCore (DMA chains cross n-tiles).
    has_existing: an existing_out is given.
    fill_unowned: rows outside the local rows hold zeros (without existing_out).
    count_rows: a `probe.count_rows` probe is open: the kernel writes its per-step counts.
  """

  m: int
  k: int
  n: int
  num_local_groups: int
  tm: int
  tn: int
  sub_m: int
  tiles_m: int
  tiles_n: int
  lhs_dtype: Any
  rhs_dtype: Any
  out_dtype: Any
  compute_dtype: Any
  dot_acc_dtype: Any
  lhs_granule: int
  out_granule: int
  lhs_rows: int
  out_rows: int
  align: int
  tail: int
  pass_cuts: bool
  transpose_rhs: bool
  quantized: bool
  lhs_quantized: bool
  scales_on_k: bool
  narrow_dot: bool
  rows_stationary: bool
  sequential_sweeps: bool
  has_existing: bool
  fill_unowned: bool
  count_rows: bool

  @property
  def upcast(self) -> bool:
    """Quantized weights are upcast in VMEM (not multiplied as 8-bit values)."""
    return self.quantized and not self.narrow_dot

  @property
  def prepare(self) -> bool:
    """The dot reads weights prepared once per group load: upcast (quantized) and/or transposed
    to [tn, k] (rows_stationary with [k, tn] blocks). Otherwise it reads the slot."""
    return self.upcast or (self.rows_stationary and not self.transpose_rhs)

  @property
  def aliased(self) -> bool:
    """The output aliases a base buffer (existing_out, or `zeros_outside_active`'s zeros)."""
    return self.has_existing or self.fill_unowned

  @property
  def write_whole_tiles(self) -> bool:
    """Where the rows of a visited tile outside the local rows must hold zeros or existing_out's
    values, the whole tile is written back; otherwise only the local rows."""
    return self.aliased

  @property
  def weight_block(self) -> tuple[int, int]:
    return (self.tn, self.k) if self.transpose_rhs else (self.k, self.tn)

  @property
  def scales_block(self) -> tuple[int, int]:
    if self.scales_on_k:
      return (1, self.k) if self.transpose_rhs else (self.k, 1)
    return (1, self.tn)

  @property
  def dims(self) -> Any:
    """The pass's dot dimensions.

    NOTE: rhs blocks are [k, tn], or [tn, k] when transposed; contract lhs's k with rhs's k. With
    rows_stationary the weights are the dot's lhs as [tn, k] and lhs its transposed rhs.
    """
    if self.rows_stationary or self.transpose_rhs:
      return (((1,), (1,)), ((), ()))
    return (((1,), (0,)), ((), ()))


def plan_rowtile(
  lhs,
  rhs,
  *,
  tm,
  tn,
  out_dtype,
  transpose_rhs,
  rhs_scales,
  scales_on_k,
  lhs_scales,
  narrow_dot,
  sub_m,
  sequential_sweeps,
  rows_stationary,
  fill_unowned,
  has_existing,
  pass_cuts,
  count_rows,
  interpret,
) -> RowTilePlan:
  """Checks a row-tile gmm call's static arguments and makes its `RowTilePlan`.

  Args: those of `gmm_rowtile_pallas` (`has_existing`: whether existing_out is given;
  `count_rows`: whether a probe is open).

  Returns:
    The plan.
  """
  m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype = gmm_common.check_operands(
    lhs,
    rhs,
    transpose_rhs=transpose_rhs,
    rhs_scales=rhs_scales,
    lhs_scales=lhs_scales,
    scales_on_k=scales_on_k,
    narrow_dot=narrow_dot,
    tm=tm,
    sub_m=sub_m,
  )
  if n % tn:
    raise ValueError(f"tn={tn} must divide n={n} for the row-tile gmm.")
  tiles_m = metadata.cdiv(m, tm)
  # NOTE: lhs rows move in DMA granules (`common.tile_row_copies`); an m that is not a multiple
  # of the granule (8 rows of f32, 16 of bf16) is padded, at the cost of one copy of lhs, since
  # Mosaic rejects some VMEM slices of m % granule rows. Local rows end at or before m, so the
  # padding rows are never read into a product.
  lhs_granule = common.row_granule(lhs.dtype)
  lhs_rows = m
  if tm % lhs_granule == 0:
    # NOTE: (a tm of all m rows that the granule does not divide moves its tile whole instead.)
    lhs_rows = -(-m // lhs_granule) * lhs_granule
  out_granule = common.row_granule(out_dtype)
  align = metadata.pass_align(sub_m=sub_m, tm=tm, row_granule=max(lhs_granule, out_granule))
  tail = metadata.merge_tail_rows(sub_m=sub_m, tm=tm, align=align, rows_stationary=rows_stationary)
  # NOTE: per-row lhs scales arrive in m-tile blocks, so a quantized lhs keeps the m-tiles.
  can_cut = lhs_scales is None and metadata.uses_pass_cuts(m=m, tm=tm, sub_m=sub_m, align=align)
  if pass_cuts is None:
    pass_cuts = can_cut
  elif pass_cuts and not can_cut:
    raise ValueError(
      f"pass_cuts=True needs passes off the sub_m grid, two passes per tile and more than one "
      f"tile, and no lhs_scales (m={m}, tm={tm}, sub_m={sub_m}, pass alignment {align}); "
      "pass pass_cuts=None."
    )
  # NOTE: the output is padded (and the result sliced back to m rows) for the TPU simulator,
  # whose aliased outputs must not have a ragged last block (jax 0.10.2: "Out-of-bounds block
  # index"), and to a multiple of the output's DMA granule: Mosaic rejects a write-back from a
  # VMEM slice of m % granule rows at some widths (v5e, n = 200), so an m that is not a multiple
  # of 8 rows (f32; 16 bf16) costs one copy of the output.
  out_rows = m
  if isinstance(interpret, pltpu.InterpretParams) and (has_existing or fill_unowned):
    out_rows = tiles_m * tm
  elif tm % out_granule == 0:
    out_rows = -(-m // out_granule) * out_granule
  return RowTilePlan(
    m=m,
    k=k,
    n=n,
    num_local_groups=num_local_groups,
    tm=tm,
    tn=tn,
    sub_m=sub_m,
    tiles_m=tiles_m,
    tiles_n=n // tn,
    lhs_dtype=lhs.dtype,
    rhs_dtype=rhs.dtype,
    out_dtype=out_dtype,
    compute_dtype=compute_dtype,
    dot_acc_dtype=dot_acc_dtype,
    lhs_granule=lhs_granule,
    out_granule=out_granule,
    lhs_rows=lhs_rows,
    out_rows=out_rows,
    align=align,
    tail=tail,
    pass_cuts=pass_cuts,
    transpose_rhs=transpose_rhs,
    quantized=rhs_scales is not None,
    lhs_quantized=lhs_scales is not None,
    scales_on_k=scales_on_k,
    narrow_dot=narrow_dot,
    rows_stationary=rows_stationary,
    sequential_sweeps=sequential_sweeps,
    has_existing=has_existing,
    fill_unowned=fill_unowned,
    count_rows=count_rows,
  )


# ------------------------------------------------------------------------------------------------
# Metadata, operands and scratch by name.
# ------------------------------------------------------------------------------------------------


class RowTileMetadata(NamedTuple):
  """The kernel's scalar-prefetch arrays (int32, in SMEM), in prefetch order.

  Grid step s of an n-tile is tile active[0] + s: an m-tile (only the visited ones), or with pass
  cuts a cut tile (active = (0, tiles used)).

  Attributes:
    group_offsets: [num_groups_total + 1] first row of each global group.
    first_group, last_group: per tile, the local groups whose rows (passes, with cuts) meet it.
    load_rank: per local group, its rank among the non-empty local groups (its load's).
    load_group: per load rank, the local group it loads.
    num_loads: [1] loads per n-tile (the non-empty local groups).
    active: [2] (first tile, grid steps per n-tile).
    group_offset: [1] the first global group rhs holds.
    tile_start, tile_reach: with pass cuts, each cut tile's first row and the end of the rows its
      passes read (`metadata.PassCutTiles`); else None.
  """

  group_offsets: Any
  first_group: Any
  last_group: Any
  load_rank: Any
  load_group: Any
  num_loads: Any
  active: Any
  group_offset: Any
  tile_start: Any = None
  tile_reach: Any = None


class RowTileIndexMaps:
  """Index maps of the blocks the pipeline moves (everything else stays in HBM, `pl.ANY`).

  Each takes the grid indices (n_i, step) and the `RowTileMetadata` refs.
  """

  def lhs_scales(self, n_i, step, meta: RowTileMetadata):
    # NOTE: step s of an n-tile is m-tile active[0] + s: unvisited tiles are never fetched.
    return meta.active[0] + step, 0


class RowTileInputs(NamedTuple):
  """The operands (None where absent). rhs and its scales stay in HBM; the kernel DMAs each
  group's blocks itself. The base is the output's buffer (aliased): existing_out, or the zeros
  of `zeros_outside_active`; the kernel only reads existing_out from it."""

  lhs: Any
  rhs: Any
  rhs_scales: Any
  lhs_scales: Any
  base: Any


class RowTileOutputs(NamedTuple):
  """The result buffer and, with an open probe, the [tiles_n, tiles, 4] counts (SMEM)."""

  out: Any
  counts: Any = None


class RowTileScratch(NamedTuple):
  """VMEM buffers and DMA semaphores (None where the plan has no use for them).

  Attributes:
    weights: [2, *weight_block] the two weight slots.
    sems: the weight slots' semaphores (0, 1), the scale slots' (2, 3) when quantized, and the
      existing_out read's (last).
    scales: [2, *scales_block] f32 scale slots (quantized rhs).
    prepared: the weights the dot reads, upcast / transposed once per group load (`prepare`).
    lhs: [2, tm, k] the two lhs slots.
    out: [2, tm, tn] the two output slots.
    io_sems: the lhs slots' semaphores (0, 1) and the output slots' (2, 3).
  """

  weights: Any
  sems: Any
  scales: Any
  prepared: Any
  lhs: Any
  out: Any
  io_sems: Any


def _scratch_shapes(plan: RowTilePlan) -> RowTileScratch:
  q, p = plan.quantized, plan.prepare
  prep_block = (plan.tn, plan.k) if plan.rows_stationary else plan.weight_block
  return RowTileScratch(
    weights=pltpu.VMEM((2, *plan.weight_block), plan.rhs_dtype),
    # NOTE: two weight slots (+ two scale slots), and one for reading existing_out.
    sems=pltpu.SemaphoreType.DMA((5 if q else 3,)),
    scales=pltpu.VMEM((2, *plan.scales_block), jnp.float32) if q else None,
    prepared=pltpu.VMEM(prep_block, plan.compute_dtype if plan.upcast else plan.rhs_dtype)
    if p
    else None,
    # NOTE: two lhs slots and two output slots (the pipeline's double buffers, by hand), and
    # their semaphores: lhs slots 0, 1, output slots 2, 3.
    lhs=pltpu.VMEM((2, plan.tm, plan.k), plan.lhs_dtype),
    out=pltpu.VMEM((2, plan.tm, plan.tn), plan.out_dtype),
    io_sems=pltpu.SemaphoreType.DMA((4,)),
  )


# ------------------------------------------------------------------------------------------------
# One grid step: positions and DMA descriptors.
# ------------------------------------------------------------------------------------------------


class _Step:
  """One grid step (n_i, step) of the kernel: the tile it computes, its place in the DMA chain,
  and the descriptors of the DMAs it starts or waits for.

  NOTE: the constructor reads the step's positions (and starts nothing); the methods are the
  kernel's parts, called by `_kernel` in order.
  """

  def __init__(self, plan: RowTilePlan, meta, ins: RowTileInputs, outs, scratch: RowTileScratch):
    self.plan, self.meta, self.ins, self.scratch = plan, meta, ins, scratch
    self.out_hbm, self.counts = outs.out, outs.counts
    # NOTE: the grid visits only the tiles holding local rows (`active_tiles`); t is the m-tile.
    self.n_i, step = pl.program_id(0), pl.program_id(1)
    self.step = step
    self.num_steps = num_steps = meta.active[1]
    self.t = meta.active[0] + step
    self.rows_start = meta.group_offsets[meta.group_offset[0]]
    self.rows_end = meta.group_offsets[meta.group_offset[0] + plan.num_local_groups]
    self.row0, self.row_end = self.tile_rows(self.t)
    # NOTE: lhs blocks and output blocks move by manual DMA, double-buffered along a chain of
    # grid steps: the whole grid with `sequential_sweeps` (one core runs it in order), else each
    # n sweep (sweeps may run on different TensorCores, so nothing is prefetched across them).
    self.chain = dma.chain(
      sequential=plan.sequential_sweeps,
      sweep=self.n_i,
      num_sweeps=plan.tiles_n,
      step=step,
      num_steps=num_steps,
    )
    # NOTE: lhs does not depend on the n-tile: with one visited tile its block is fetched once
    # per chain and kept in slot 0 (as the pipeline kept a block whose index did not change).
    self.lhs_slot = jnp.where(num_steps > 1, self.chain.slot, 0)
    # NOTE: this step's lhs rows were prefetched by the previous step of the chain; the chain's
    # first step fetches its own (exposed). Then the next step's are started into the other slot
    # (the next tile, or with `sequential_sweeps` the next sweep's first tile) while this one
    # computes. A single visited tile is fetched once per chain and not again.
    if plan.sequential_sweeps:
      self.fetched = (self.chain.index == 0) | (num_steps > 1)
    else:
      self.fetched = True
    self.out_ref = scratch.out.at[self.chain.slot]
    self.lhs_ref = scratch.lhs.at[self.lhs_slot]

  # --- rows of a tile --------------------------------------------------------------------------

  def tile_rows(self, tile):
    # NOTE: (first row, end of the rows written back) of a tile: every tm rows, or the cuts.
    if self.plan.pass_cuts:
      start = pl.multiple_of(self.meta.tile_start[tile], self.plan.align)
      return start, self.meta.tile_start[tile + 1]
    return tile * self.plan.tm, tile * self.plan.tm + self.plan.tm

  def local_rows(self, tile):
    # NOTE: rows [lo, hi) of `tile`, relative to its first row, that hold local rows: all of
    # them but in the first and last visited tiles (other shards' rows, a receive buffer's
    # slack past sum(group_sizes)). With pass cuts: the rows its passes read, which end at its
    # last group's last pass (past its written rows when that pass reaches into the next tile).
    r0, _ = self.tile_rows(tile)
    if self.plan.pass_cuts:
      return r0, jnp.maximum(self.rows_start - r0, 0), self.meta.tile_reach[tile] - r0
    return r0, jnp.maximum(self.rows_start - r0, 0), jnp.minimum(self.rows_end - r0, self.plan.tm)

  def written_rows(self, tile):
    # NOTE: rows [lo, hi) of `tile` written back: the local ones when the rest are undefined,
    # else the whole tile (zeros or existing_out there are part of the result). A cut tile
    # writes up to the next cut (the rows its last pass computes past it are carried over to
    # the next tile), and the metadata ends the last one where the output ends.
    plan = self.plan
    r0, end = self.tile_rows(tile)
    lo = jnp.maximum(self.rows_start - r0, 0)
    if plan.pass_cuts:
      hi = end - r0
    elif plan.write_whole_tiles:
      hi = jnp.minimum(plan.tm, plan.out_rows - r0)
    else:
      hi = jnp.minimum(self.rows_end - r0, plan.tm)
    return r0, (0 * lo if plan.write_whole_tiles else lo), hi

  # --- DMA descriptors -------------------------------------------------------------------------

  def lhs_copies(self, tile, into):
    plan, scratch = self.plan, self.scratch
    r0, lo, hi = self.local_rows(tile)
    return common.tile_row_copies(
      hbm_rows=lambda start, size: self.ins.lhs.at[pl.ds(start, size)],
      vmem_rows=lambda off, size: scratch.lhs.at[into, pl.ds(off, size)],
      sem=scratch.io_sems.at[into],
      row0=r0,
      lo=lo,
      hi=hi,
      tm=plan.tm,
      m=plan.lhs_rows,
      granule=plan.lhs_granule,
    )

  def out_copies(self, c):
    # NOTE: the write-back of chain step c (from out slot c % 2): its tile and n-tile follow
    # from c as the grid's order does. Rows: the tile's local rows when the rest are
    # undefined, else the whole tile (zeros or existing_out there are part of the result).
    plan, out_hbm = self.plan, self.out_hbm
    if plan.sequential_sweeps:
      c_tile, c_col = self.meta.active[0] + c % self.num_steps, c // self.num_steps
    else:
      c_tile, c_col = self.meta.active[0] + c, self.n_i
    r0, lo, hi = self.written_rows(c_tile)
    col = pl.multiple_of(c_col * plan.tn, plan.tn)
    return common.tile_row_copies(
      hbm_rows=lambda start, size: out_hbm.at[
        pl.ds(start, size), common.window(col, plan.tn, plan.n)
      ],
      vmem_rows=lambda off, size: self.scratch.out.at[c % 2, pl.ds(off, size)],
      sem=self.scratch.io_sems.at[2 + c % 2],
      row0=r0,
      lo=lo,
      hi=hi,
      tm=plan.tm,
      m=plan.out_rows,
      granule=plan.out_granule,
      to_hbm=True,
    )

  def slot_of(self, rank, sweep):
    # NOTE: loads alternate between the two slots in the order they are issued, counted
    # across n-tiles (sweep * num_loads + rank): with `sequential_sweeps` the next n-tile's
    # first load lands in the slot the current n-tile's last group does not use.
    return (sweep * self.meta.num_loads[0] + rank) % 2

  def weight_copies(self, rank, sweep):
    # NOTE: load `rank` (the rank-th non-empty local group) of n-tile `sweep`.
    plan, scratch = self.plan, self.scratch
    slot = self.slot_of(rank, sweep)
    group = self.meta.load_group[rank]
    col = pl.multiple_of(sweep * plan.tn, plan.tn)
    cols = common.window(col, plan.tn, plan.n)
    src = self.ins.rhs.at[group, cols, :] if plan.transpose_rhs else self.ins.rhs.at[group, :, cols]
    copies = [dma.slot_copy(src, scratch.weights, slot, scratch.sems.at[slot])]
    if plan.quantized:
      if plan.scales_on_k:
        s_src = self.ins.rhs_scales.at[group]
      else:
        s_src = self.ins.rhs_scales.at[group, :, common.window(col, plan.tn, plan.n)]
      copies.append(dma.slot_copy(s_src, scratch.scales, slot, scratch.sems.at[2 + slot]))
    return copies

  def start_load(self, rank, sweep):
    dma.start(self.weight_copies(rank, sweep))

  def wait_load(self, rank, sweep):
    dma.wait(self.weight_copies(rank, sweep))

  # --- the step's parts, in kernel order -------------------------------------------------------

  def start_fetches(self) -> None:
    """Starts this step's lhs fetch (the chain's first step only) and the next step's."""
    meta, chain = self.meta, self.chain

    def fetch(j, carry):
      # NOTE: the fetch for chain step chain + j (j = 0 only at the chain's start, j = 1 the
      # prefetch): one loop body, so the kernel holds one copy of the row-chunk DMAs.
      tile = meta.active[0] + (self.step + j) % self.num_steps
      into = jnp.where(self.num_steps > 1, (chain.index + j) % 2, 0)
      dma.start(self.lhs_copies(tile, into))
      return carry

    prefetch = (self.num_steps > 1) & (chain.index + 1 < chain.length)
    dma.fetch_ahead(fetch, chain=chain, prefetch=prefetch)

  def init_out_block(self) -> None:
    """Starts the output block as existing_out's rows (or zeros); each group overwrites its rows.

    NOTE: rows of other shards' groups and rows past sum(group_sizes) keep this value. Only the
    first and last visited tiles can hold such rows (the local rows are contiguous); unvisited
    tiles keep the aliased base buffer: existing_out, or zeros written by `zeros_outside_active`.
    """
    plan, out_ref = self.plan, self.out_ref
    out_ref[...] = jnp.zeros((plan.tm, plan.tn), plan.out_dtype)
    if not plan.has_existing:
      return
    # NOTE: the semaphore after the weight (and scale) slots' is the existing_out read's.
    base_sem = 2 + 2 * plan.quantized
    if plan.pass_cuts:
      # NOTE: a cut tile whose written rows include rows outside the local ones (the first and
      # last) starts them as existing_out's, DMA'd from the aliased buffer.
      r0, lo, hi = self.written_rows(self.t)
      col = pl.multiple_of(self.n_i * plan.tn, plan.tn)
      reads = common.tile_row_copies(
        hbm_rows=lambda start, size: self.ins.base.at[
          pl.ds(start, size), common.window(col, plan.tn, plan.n)
        ],
        vmem_rows=lambda off, size: out_ref.at[pl.ds(off, size)],
        sem=self.scratch.sems.at[base_sem],
        row0=r0,
        lo=lo,
        hi=hi,
        tm=plan.tm,
        m=plan.out_rows,
        granule=plan.out_granule,
      )

      @pl.when((self.row0 < self.rows_start) | (self.row_end > self.rows_end))
      def _read_base():
        dma.start(reads)
        dma.wait(reads)

      return
    # NOTE: the local rows' range, read again from the metadata; the later parts use these reads.
    meta = self.meta
    self.rows_start = meta.group_offsets[meta.group_offset[0]]
    self.rows_end = meta.group_offsets[meta.group_offset[0] + plan.num_local_groups]
    col = pl.multiple_of(self.n_i * plan.tn, plan.tn)

    def read_base(rows):
      # NOTE: existing_out's rows of this tile, DMA'd from the aliased buffer before the
      # tile is written back; a ragged last tile reads its static row count.
      src = self.ins.base.at[pl.ds(self.row0, rows), common.window(col, plan.tn, plan.n)]
      copy = pltpu.make_async_copy(src, out_ref.at[:rows], self.scratch.sems.at[base_sem])
      copy.start()
      copy.wait()

    partial = (self.row0 < self.rows_start) | (self.row0 + plan.tm > self.rows_end)
    last_rows = plan.out_rows - (plan.tiles_m - 1) * plan.tm
    if last_rows == plan.tm:
      pl.when(partial)(lambda: read_base(plan.tm))
    else:
      # NOTE: a single tile larger than m has only the ragged read.
      if plan.tiles_m > 1:
        pl.when(partial & (self.t < plan.tiles_m - 1))(lambda: read_base(plan.tm))
      pl.when(partial & (self.t == plan.tiles_m - 1))(lambda: read_base(last_rows))

  def take_carried_rows(self) -> None:
    """With pass cuts: the previous cut tile's last pass may have computed rows of its last
    group past this tile's first row (fewer than `align`, before this tile's first group
    starts); they are written back with this tile, from the previous step's output slot (the
    other one, intact until the next step)."""
    plan, meta, t, row0 = self.plan, self.meta, self.t, self.row0
    carried_end = meta.group_offsets[
      meta.group_offset[0] + jnp.minimum(meta.first_group[t], plan.num_local_groups)
    ]
    prev_row0 = meta.tile_start[jnp.maximum(t - 1, 0)]
    offset = row0 - prev_row0

    @pl.when((self.step > 0) & (carried_end > row0) & (offset + plan.align <= plan.tm))
    def _carry():
      prev_slot = self.scratch.out.at[1 - self.chain.slot]
      prev = prev_slot[pl.ds(pl.multiple_of(offset, plan.align), plan.align), :]
      row_ids = row0 + lax.broadcasted_iota(jnp.int32, (plan.align, plan.tn), 0)
      out = self.out_ref
      out[: plan.align, :] = jnp.where(row_ids < carried_end, prev, out[: plan.align, :])

  def count_moved_rows(self) -> None:
    """Probe counts: zeroes the step's MXU rows and weight loads; records its lhs rows fetched
    (0 when the tile's block is kept from an earlier step) and output rows written back."""
    plan, counts, n_i, t = self.plan, self.counts, self.n_i, self.t
    counts[n_i, t, 0] = 0
    counts[n_i, t, 1] = 0
    _, lo, hi = self.local_rows(t)
    first, end = common.tile_row_range(
      row0=self.row0, lo=lo, hi=hi, tm=plan.tm, m=plan.lhs_rows, granule=plan.lhs_granule
    )
    counts[n_i, t, 2] = jnp.where(self.fetched, end - first, 0)
    _, lo, hi = self.written_rows(t)
    first, end = common.tile_row_range(
      row0=self.row0, lo=lo, hi=hi, tm=plan.tm, m=plan.out_rows, granule=plan.out_granule
    )
    counts[n_i, t, 3] = end - first

  def wait_lhs(self) -> None:
    @pl.when(self.fetched)
    def _wait_lhs():
      dma.wait(self.lhs_copies(self.t, self.lhs_slot))

  def write_back(self) -> None:
    """Starts this step's output write-back; waits for the previous step's (and at the chain's
    end this step's own, so that nothing is pending when the sweep, or with
    `sequential_sweeps` the grid, ends)."""
    dma.start(self.out_copies(self.chain.index))

    def wait_write(j, carry):
      dma.wait(self.out_copies(self.chain.index - 1 + j))
      return carry

    dma.wait_behind(wait_write, chain=self.chain)

  # --- the compute body: one local group's passes ----------------------------------------------

  def group_body(self, g, carry):
    """The loop body over the tile's local groups: group g's passes (none when it is empty)."""
    meta = self.meta
    start = meta.group_offsets[g + meta.group_offset[0]]
    end = meta.group_offsets[g + meta.group_offset[0] + 1]
    pl.when(end > start)(lambda: self.compute_group(g, start, end))
    return carry

  def compute_group(self, g, start, end) -> None:
    """Loads group g's weights if it starts in this tile, then runs its passes over the tile.

    Args:
      g: the local group.
      start, end: its rows [start, end) (absolute).
    """
    plan, row0 = self.plan, self.row0
    rank = self.meta.load_rank[g]
    pl.when(start >= row0)(lambda: self.load_group(rank))
    slot = self.slot_of(rank, self.n_i)
    # NOTE: only passes over rows of g are multiplied: sub_m-row passes from g's first row in
    # this tile rounded down to `align` (`metadata.group_passes`). Rows a pass shares with a
    # neighbouring group are multiplied for each, and the row mask keeps each group's rows.
    # NOTE: a cut tile counts its last group's passes up to the next cut: a last pass that
    # starts before it is this tile's, and computes the group's rows past it too.
    # NOTE: where the group's last pass would hold at most `tail` of its rows, its last two
    # passes run as one widened pass of sub_m + tail rows (`metadata.group_pass_plan`),
    # after the regular ones; its rows are within theirs, and end at the group's real end
    # (past the cut, in a cut tile) at the latest.
    first_row, passes, merged = metadata.group_pass_plan(
      jnp.maximum(start, row0) - row0,
      jnp.minimum(end, self.row_end) - row0,
      sub_m=plan.sub_m,
      align=plan.align,
      tail=plan.tail,
      tm=plan.tm,
      cover_end=end - row0,
    )
    regular = passes - 2 * merged.astype(jnp.int32)
    group = dict(start=start, end=end, slot=slot)
    self.run_passes(first_row, regular, **group)
    if plan.tail:
      self.run_widened_pass(first_row, passes, merged, **group)
    if self.counts is not None:
      self.counts[self.n_i, self.t, 0] += passes * plan.sub_m - merged * (plan.sub_m - plan.tail)

  def load_group(self, rank) -> None:
    """Waits for the weights of the group of load `rank` (which starts in this tile) and starts
    the next load.

    NOTE: a group whose first row is in this tile has not been loaded for this n-tile yet (one
    that started in an earlier tile is still in its slot). Its load was started while the
    previous group computed; the first load of an n-tile is started here, unless
    `sequential_sweeps` prefetched it during the previous n-tile's last group. Then the next
    load starts, into the other slot, whose group is finished.
    """
    plan, meta, n_i = self.plan, self.meta, self.n_i
    exposed_first = rank == 0
    if plan.sequential_sweeps:
      exposed_first = exposed_first & (n_i == 0)
    pl.when(exposed_first)(lambda: self.start_load(rank, n_i))
    pl.when(rank + 1 < meta.num_loads[0])(lambda: self.start_load(rank + 1, n_i))
    if plan.sequential_sweeps:
      next_sweep = (rank + 1 == meta.num_loads[0]) & (n_i + 1 < plan.tiles_n)
      pl.when(next_sweep)(lambda: self.start_load(0, n_i + 1))
    self.wait_load(rank, n_i)
    if plan.prepare:
      # NOTE: upcast / transpose once per group and n-tile (not per sub-block); the group
      # keeps it while it spans several m-tiles, since the next group is prepared only
      # when it starts.
      w = self.scratch.weights[self.slot_of(rank, n_i)]
      if plan.upcast:
        w = w.astype(jnp.float32)
        if plan.scales_on_k:
          # NOTE: scales along the contraction cannot be factored out of the dot; they
          # scale the weights, once per group, as part of the upcast.
          w = w * self.scratch.scales[self.slot_of(rank, n_i)]
        w = w.astype(plan.compute_dtype)
      self.scratch.prepared[...] = w.T if plan.rows_stationary and not plan.transpose_rhs else w
    if self.counts is not None:
      self.counts[n_i, self.t, 1] += 1

  def multiply(self, r0, rows, size, *, start, end, slot) -> None:
    """One pass: `size` rows of the tile from row r0 times the group's weights; the row mask
    keeps the group's rows [start, end) of the product."""
    plan, scratch = self.plan, self.scratch
    lhs_blk = self.lhs_ref[rows, :]
    if plan.lhs_quantized and not plan.narrow_dot:
      lhs_blk = lhs_blk.astype(jnp.float32)
    w_blk = scratch.prepared[...] if plan.prepare else scratch.weights[slot]
    operands = (w_blk, lhs_blk) if plan.rows_stationary else (lhs_blk, w_blk)
    prod = lax.dot_general(
      *(x.astype(plan.compute_dtype) for x in operands),
      dimension_numbers=plan.dims,
      preferred_element_type=plan.dot_acc_dtype,
    ).astype(jnp.float32)
    if plan.rows_stationary:
      prod = prod.T  # [tn, sub_m] -> [sub_m, tn]
    if plan.quantized and not plan.scales_on_k:
      # NOTE: one scale per output column: dot(x, q) * s[None, :] == dot(x, q * s).
      prod = prod * scratch.scales[slot]
    if plan.lhs_quantized:
      # NOTE: one scale per row: rows of a ragged last tile may hold garbage scales; the
      # row mask below keeps only the group's rows.
      prod = prod * self.ins.lhs_scales[rows, :]
    row_ids = self.row0 + r0 + lax.broadcasted_iota(jnp.int32, (size, plan.tn), 0)
    mine = (row_ids >= start) & (row_ids < end)
    out = self.out_ref
    out[rows, :] = jnp.where(mine, prod.astype(plan.out_dtype), out[rows, :])

  def run_passes(self, first_row, regular, **group) -> None:
    """The group's `regular` passes of sub_m rows from tile row `first_row`."""
    plan = self.plan

    def pass_body(p, c):
      r0, rows = common.pass_block(
        first_row + p * plan.sub_m, sub_m=plan.sub_m, tm=plan.tm, align=plan.align
      )
      self.multiply(r0, rows, plan.sub_m, **group)
      return c

    lax.fori_loop(0, regular, pass_body, 0)

  def run_widened_pass(self, first_row, passes, merged, **group) -> None:
    """Where `merged`, the group's last two passes as one of sub_m + tail rows.

    NOTE: the widened pass starts at the second-to-last pass's first row, moved back to end at
    the tile's end like a pass that would cross it (rows it recomputes get the same values).
    """
    plan = self.plan
    size = plan.sub_m + plan.tail
    wide_r0 = pl.multiple_of(
      jnp.minimum(first_row + (passes - 2) * plan.sub_m, plan.tm - size), plan.align
    )
    pl.when(merged)(lambda: self.multiply(wide_r0, pl.ds(wide_r0, size), size, **group))


def _kernel(
  plan: RowTilePlan,
  meta: RowTileMetadata,
  ins: RowTileInputs,
  outs: RowTileOutputs,
  scratch: RowTileScratch,
) -> None:
  """One grid step (n-tile n_i, visited tile active[0] + step): the main loop."""
  step = _Step(plan, meta, ins, outs, scratch)
  step.start_fetches()
  step.init_out_block()
  if plan.pass_cuts:
    step.take_carried_rows()
  if step.counts is not None:
    step.count_moved_rows()
  step.wait_lhs()
  lax.fori_loop(meta.first_group[step.t], meta.last_group[step.t] + 1, step.group_body, 0)
  step.write_back()


# ------------------------------------------------------------------------------------------------
# The builder.
# ------------------------------------------------------------------------------------------------


def gmm_rowtile_pallas(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  tm: int,
  tn: int,
  out_dtype: Any,
  group_offset: jax.Array,
  existing_out: jax.Array | None = None,
  transpose_rhs: bool = False,
  rhs_scales: jax.Array | None = None,
  scales_on_k: bool = False,
  lhs_scales: jax.Array | None = None,
  narrow_dot: bool = False,
  sub_m: int | None = None,
  vmem_limit_bytes: int | None = None,
  sequential_sweeps: bool = False,
  rows_stationary: bool = False,
  fill_unowned: bool = True,
  expected_rows: int | None = None,
  pass_cuts: bool | None = None,
  interpret: common.Interpret = None,
) -> jax.Array:
  """Runs the row-tile gmm kernel on validated arguments.

  The kernel moves lhs row blocks, group weights and output blocks by manual DMA, each
  double-buffered.

  Args:
    lhs: [m, k].
    rhs: [num_local_groups, k, n], or [num_local_groups, n, k] with `transpose_rhs`.
    group_sizes: [num_groups_total] int32.
    tm: m-tile (rows per grid step); a multiple of 8 or m.
    tn: n-tile; must divide n (manual weight DMAs are not ragged).
    out_dtype: dtype of the result.
    group_offset: [] int32, the first global group that rhs holds.
    existing_out: optional [m, n] of `out_dtype`; rows outside the local groups keep its values.
    transpose_rhs: whether rhs is [G, n, k].
    rhs_scales: optional [G, 1, n] f32 per-output-column scales of a quantized (int8 / fp8) rhs.
      They travel with the group's weights (a [1, tn] DMA into the same slot) and scale each
      partial product. Unless `narrow_dot`, the weights are upcast once per group, when loaded.
      With `scales_on_k` (the lhs-gradient pass: scales along the contraction) they are
      [G, 1, k] ([G, k, 1] without `transpose_rhs`), DMA'd whole per group and folded into the
      upcast weights.
    scales_on_k: see `rhs_scales`.
    lhs_scales: optional [m, 1] f32 per-row scales of a quantized lhs; scale each partial product.
    narrow_dot: both operands quantized with the same dtype: the dot runs on the 8-bit values
      (int8 x int8 -> int32, fp8 x fp8 -> f32), the MXU's native mode where the chip has one.
    sub_m: rows per MXU pass (divides tm). A group's passes start at its first row in the tile,
      rounded down to the lhs / output VMEM tile (`metadata.pass_align`: 16 rows of bf16), and
      where its last pass would hold at most sub_m / 2 of its rows, its last two run as one
      pass of 1.5 x sub_m rows (`metadata.merge_tail_rows`; not with `rows_stationary`), so a
      group boundary inside a tile costs about sub_m / 4 extra rows, not sub_m. None: the whole
      tile.
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the call (None: Mosaic's default).
    expected_rows: the rows the caller expects sum(group_sizes) to be; the cost estimate XLA
      gets counts the work on those rows, not on all m. None: m.
    sequential_sweeps: the grid runs in order on one TensorCore (v5e, v6e, tpu7x): the first
      weights of n-tile j + 1 are prefetched while the last group of n-tile j computes, instead
      of being loaded (exposed) at the start of n-tile j + 1. Both grid axes are then
      "arbitrary".
    rows_stationary: multiply out^T = w^T @ lhs^T: the sub-block's rows are the MXU's
      stationary operand and the tn weight columns stream through it as rows, so a tn that is a
      multiple of 128 but not of the MXU width (1408 on a 256-wide MXU) is not padded to it.
      Costs a transpose of each group's weight block once per load (none with
      `transpose_rhs`: its [tn, k] blocks are already w^T) and of each [tn, sub_m] f32 result.
      `tiling.rows_stationary_pays` says when it saves MXU work.
    fill_unowned: without `existing_out`, rows outside the local groups' tiles are exact zeros
      (written by `zeros_outside_active`; the visited tiles' other rows by this kernel). False
      leaves every row outside the local rows (rounded out to the output's DMA granule, which
      get zeros) undefined, at no cost: for callers that never read them (the MoE block's
      receive buffer).
    pass_cuts: cut the m-tiles on the groups' pass grids (`metadata.make_pass_cut_tiles`) instead
      of every tm rows: a group spanning several tiles then pays no partial pass at a tile
      boundary, for a few more (shorter) tiles. None: where it can save MXU work
      (`metadata.uses_pass_cuts`).
    interpret: see `common.run_kernel`.

  Returns:
    [m, n] of `out_dtype`.

  With a `probe.count_rows` probe open (interpret mode), the probe gets [tiles_n, tiles, 4] int32
  per grid step: rows pushed through the MXU, weight blocks loaded, lhs rows fetched (0 when the
  tile's block is kept from an earlier step) and output rows written back. Tiles are the
  m-tiles, or with pass cuts the cut tiles in order (`metadata.max_pass_cut_tiles`).
  """
  counter = probe.active()
  plan = plan_rowtile(
    lhs,
    rhs,
    tm=tm,
    tn=tn,
    out_dtype=out_dtype,
    transpose_rhs=transpose_rhs,
    rhs_scales=rhs_scales,
    scales_on_k=scales_on_k,
    lhs_scales=lhs_scales,
    narrow_dot=narrow_dot,
    sub_m=sub_m,
    sequential_sweeps=sequential_sweeps,
    rows_stationary=rows_stationary,
    fill_unowned=fill_unowned,
    has_existing=existing_out is not None,
    pass_cuts=pass_cuts,
    count_rows=counter is not None,
    interpret=interpret,
  )
  if plan.lhs_rows != plan.m:
    lhs = jnp.pad(lhs, ((0, plan.lhs_rows - plan.m), (0, 0)))
  meta, active_tiles = _metadata(plan, group_sizes=group_sizes, group_offset=group_offset)
  base = _base_buffer(
    plan,
    existing_out=existing_out,
    active_tiles=active_tiles,
    interpret=interpret,
    vary_like=(lhs, rhs, group_sizes, group_offset, rhs_scales, lhs_scales),
  )
  inputs = RowTileInputs(
    lhs=lhs,
    rhs=rhs,
    rhs_scales=gmm_common.f32(rhs_scales),
    lhs_scales=gmm_common.f32(lhs_scales),
    base=base,
  )
  result_and_cost = _result_and_cost(
    plan,
    inputs,
    operands=(lhs, rhs, rhs_scales, lhs_scales, existing_out),
    others=(group_sizes, group_offset),
    expected_rows=expected_rows,
  )
  out = _call(
    plan, meta, inputs, result_and_cost, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret
  )
  if plan.count_rows:
    out, counts = out
    counter.record(counts)
  return out if plan.out_rows == plan.m else out[: plan.m]


def _metadata(plan: RowTilePlan, *, group_sizes, group_offset) -> tuple[RowTileMetadata, Any]:
  """The kernel's scalar-prefetch metadata, and the visited m-tiles (for the zero fill).

  Returns:
    (metadata, [2] int32 (first visited m-tile, number of visited m-tiles)).
  """
  groups = metadata.make_tile_groups(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=plan.num_local_groups,
    m=plan.m,
    tm=plan.tm,
    finalize_empty_groups=False,
  )
  first_group, last_group, active = (
    groups.tile_first_group,
    groups.tile_last_group,
    groups.active_tiles,
  )
  tile_start = tile_reach = None
  if plan.pass_cuts:
    cuts = metadata.make_pass_cut_tiles(
      groups,
      group_offset=group_offset,
      m=plan.m,
      tm=plan.tm,
      sub_m=plan.sub_m,
      align=plan.align,
      write_whole_tiles=plan.write_whole_tiles,
    )
    # NOTE: grid step s is cut tile s (active = (0, tiles used)).
    first_group, last_group = cuts.tile_first_group, cuts.tile_last_group
    active = jnp.concatenate([jnp.zeros((1,), jnp.int32), cuts.num_tiles])
    tile_start, tile_reach = cuts.tile_start, cuts.tile_reach
  meta = RowTileMetadata(
    group_offsets=groups.group_offsets,
    first_group=first_group,
    last_group=last_group,
    load_rank=groups.load_rank,
    load_group=groups.load_group,
    num_loads=groups.num_loads,
    active=active,
    group_offset=group_offset.reshape((1,)),
    tile_start=tile_start,
    tile_reach=tile_reach,
  )
  return meta, groups.active_tiles


def _base_buffer(plan: RowTilePlan, *, existing_out, active_tiles, interpret, vary_like):
  """The buffer the output aliases: existing_out (padded to the output's rows), the zeros of
  `zeros_outside_active`, or None (`fill_unowned=False`: no base, rows left undefined)."""
  if plan.has_existing:
    if plan.out_rows != plan.m:
      return jnp.pad(existing_out, ((0, plan.out_rows - plan.m), (0, 0)))
    return existing_out
  if plan.fill_unowned:
    return zeros_outside_active(
      active_tiles,
      rows=plan.out_rows,
      n=plan.n,
      tm=plan.tm,
      dtype=plan.out_dtype,
      interpret=interpret,
      vary_like=vary_like,
    )
  return None


def _result_and_cost(plan: RowTilePlan, inputs, *, operands, others, expected_rows) -> dict:
  """`common.call_kernel`'s result and cost arguments (`gmm_common.result_and_cost`): the output
  is the padded [out_rows, n] buffer, aliasing the base buffer where there is one.

  Args:
    plan: the call's plan.
    inputs: the kernel's `RowTileInputs` (for the base buffer).
    operands: (lhs (padded), rhs, rhs_scales, lhs_scales, existing_out) as given.
    others: (group_sizes, group_offset).
    expected_rows: see `gmm_rowtile_pallas`.

  Returns:
    The keyword arguments.
  """
  lhs, rhs, rhs_scales, lhs_scales, existing_out = operands
  result_and_cost = gmm_common.result_and_cost(
    lhs,
    rhs,
    rhs_scales,
    lhs_scales,
    existing_out,
    others,
    n=plan.n,
    out_dtype=plan.out_dtype,
    tiles_n=plan.tiles_n,
    rows=expected_rows,
  )
  result_and_cost["out_shape"] = common.out_struct(
    (plan.out_rows, plan.n), plan.out_dtype, lhs, rhs, *others, inputs.base, rhs_scales,
    lhs_scales,
  )  # fmt: skip
  result_and_cost["alias_last_operand"] = plan.aliased
  result_and_cost["alias_when_interpreted"] = True
  return result_and_cost


def _call(plan: RowTilePlan, meta, inputs, result_and_cost, *, vmem_limit_bytes, interpret):
  """The pallas_call: block specs, scratch, grid and dimension semantics, and the probe's
  counts output."""
  maps = RowTileIndexMaps()
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  lhs_scales_spec = pl.BlockSpec(
    (plan.tm, 1), kernel_refs.index_map(maps.lhs_scales, metadata=meta, grid_rank=2)
  )
  specs = RowTileInputs(
    lhs=any_spec, rhs=any_spec, rhs_scales=any_spec, lhs_scales=lhs_scales_spec, base=any_spec
  )
  specs = RowTileInputs(*(s if x is not None else None for x, s in zip(inputs, specs, strict=True)))
  count_tiles = plan.tiles_m if meta.tile_reach is None else meta.tile_reach.shape[0]
  counts_shape = (plan.tiles_n, count_tiles, 4) if plan.count_rows else None
  outputs = RowTileOutputs(
    out=result_and_cost["out_shape"],
    counts=jax.ShapeDtypeStruct(counts_shape, jnp.int32) if counts_shape else None,
  )
  scratch = _scratch_shapes(plan)
  kernel = kernel_refs.kernel(
    functools.partial(_kernel, plan), layout=(meta, inputs, outputs, scratch)
  )
  visited = jnp.arange(count_tiles) - meta.active[0]
  # NOTE: m-tiles run in order (a group's weights stay in their slot across tiles, and the next
  # load is started a group ahead). Without `sequential_sweeps` each n-tile restarts its load
  # sequence, so n-tiles are independent and may be split across TensorCores; with it a load
  # crosses n-tiles, so they must run in order on one core.
  return common.call_kernel(
    kernel,
    name="pallas_moe_gmm_rowtile",
    grid=(plan.tiles_n, meta.active[1]),
    prefetch=tuple(kernel_refs.leaves(meta)),
    operands=kernel_refs.leaves(inputs),
    in_specs=kernel_refs.leaves(specs),
    out_spec=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=kernel_refs.leaves(scratch),
    dimension_semantics=("arbitrary", "arbitrary")
    if plan.sequential_sweeps
    else ("parallel", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
    **result_and_cost,
    counts_shape=counts_shape,
    # NOTE: counters of unvisited tiles are never written (and those tiles did no work).
    valid_counts=((visited >= 0) & (visited < meta.active[1]))[:, None],
  )
