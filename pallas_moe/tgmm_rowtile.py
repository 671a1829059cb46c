"""The row-tile tgmm kernel: one grid step per m-tile; output blocks streamed out by manual DMA.

`tgmm.py`'s module docstring describes the schedule. The kernel is built from named parts:

- `TgmmRowTilePlan`: every static choice of a call (tiles, pass alignment, lhs tail columns,
  interior runs, the kernel's flags), made in plain Python before any tracing.
- `TgmmRowTileMetadata`: the scalar-prefetch arrays, one pytree.
- `TgmmRowTileInputs`, `TgmmRowTileScratch`: the operands and the VMEM / semaphore scratch.
- `_Step`: one grid step's positions (tile, sweep, chain, slots) and the DMA descriptors of its
  lhs / rhs rows and output blocks (`dma` does the double buffering).
- `_Step.product`, `_Step.group_body`, `_Step.finalize`: the compute body.
- `_kernel`: the main loop; `tgmm_rowtile_pallas`: validation, metadata and the pallas_call.
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

from pallas_moe import common, dma, kernel_refs, metadata, probe
from pallas_moe.tgmm_common import tgmm_cost

# NOTE: sub-blocks per interior dot of the row-tile tgmm. On v5e a 128-row sub-block is 2,816 MXU
# cycles (tk 1024, tn 1408) against ~2,950 bundles of accumulator read / add / write: issue-bound;
# 256 rows per accumulator update bring the loop under its MXU time (bench/results/rowtile-vliw.md,
# "The weight gradient's loops").
INTERIOR_SUBS = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class TgmmRowTilePlan:
  """The static configuration of one row-tile tgmm call (see `plan_rowtile`).

  Attributes:
    m, k, n: lhs is [k, m] ([m, k] with `transpose_lhs`), rhs [m, n], the result [G, k, n].
    num_groups: local groups computed.
    tm, tk, tn, sub_m: the tiles and the rows per MXU pass.
    tiles_m, tiles_k, tiles_n: tiles along each dim.
    lhs_dtype, rhs_dtype, out_dtype, compute_dtype: element types.
    lhs_granule, rhs_granule: rows (columns of a [k, m] lhs) per DMA granule.
    align: the pass alignment (`metadata.pass_align`).
    lhs_tail: m's last columns that cannot be DMA'd into the lane-tiled slot (0: none).
    lhs_m: m - lhs_tail.
    interior_subs: passes per interior dot; run_loop: whether interior runs are used at all.
    transpose_lhs, rows_stationary, sequential_sweeps: see `tgmm_rowtile_pallas`.
    has_existing: an existing_out is given.
    count_rows: a `probe.count_rows` probe is open.
  """

  m: int
  k: int
  n: int
  num_groups: int
  tm: int
  tk: int
  tn: int
  sub_m: int
  tiles_m: int
  tiles_k: int
  tiles_n: int
  lhs_dtype: Any
  rhs_dtype: Any
  out_dtype: Any
  compute_dtype: Any
  lhs_granule: int
  rhs_granule: int
  align: int
  lhs_tail: int
  lhs_m: int
  interior_subs: int
  run_loop: bool
  transpose_lhs: bool
  rows_stationary: bool
  sequential_sweeps: bool
  has_existing: bool
  count_rows: bool


def plan_rowtile(
  lhs,
  rhs,
  *,
  tiling,
  out_dtype,
  num_groups,
  sub_m,
  interior_subs,
  transpose_lhs,
  rows_stationary,
  sequential_sweeps,
  has_existing,
  count_rows,
) -> TgmmRowTilePlan:
  """Checks a row-tile tgmm call's static arguments and makes its `TgmmRowTilePlan`.

  Args: those of `tgmm_rowtile_pallas` (`num_groups`: num_actual_groups; `has_existing`: whether
  existing_out is given; `count_rows`: whether a probe is open).

  Returns:
    The plan.
  """
  m, k = lhs.shape if transpose_lhs else lhs.shape[::-1]
  n = rhs.shape[1]
  tm, tk, tn = tiling
  sub_m = common.check_sub_m(sub_m, tm)
  if k % tk or n % tn:
    raise ValueError(f"tk={tk} must divide k={k} and tn={tn} divide n={n} for the row-tile tgmm.")
  if interior_subs < 1:
    raise ValueError(f"interior_subs={interior_subs} must be >= 1.")
  lhs_granule = common.row_granule(lhs.dtype, lanes=not transpose_lhs)
  rhs_granule = common.row_granule(rhs.dtype)
  # NOTE: m's last m % 128 columns of lhs cannot be DMAed into the lane-tiled [tk, tm] slot: a
  # slice of a VMEM ref along its lane dim must span whole 128-lane tiles (Mosaic rejects a
  # 104-lane window). They go to a [tk, lhs_tail] buffer of their own (a whole-dim window) and
  # are copied into the slot as values. `common.tile_row_copies` moves the aligned columns
  # before them (it is told lhs has lhs_m columns). A tm of all m columns that is not a multiple
  # of 128 is fetched whole and has no separate tail.
  # (A transposed [m, k] lhs has m on its sublanes, like rhs: no tail.)
  lhs_tail = m % lhs_granule if tm % lhs_granule == 0 and not transpose_lhs else 0
  return TgmmRowTilePlan(
    m=m,
    k=k,
    n=n,
    num_groups=num_groups,
    tm=tm,
    tk=tk,
    tn=tn,
    sub_m=sub_m,
    tiles_m=metadata.cdiv(m, tm),
    tiles_k=k // tk,
    tiles_n=n // tn,
    lhs_dtype=lhs.dtype,
    rhs_dtype=rhs.dtype,
    out_dtype=out_dtype,
    compute_dtype=jnp.promote_types(lhs.dtype, rhs.dtype),
    lhs_granule=lhs_granule,
    rhs_granule=rhs_granule,
    # NOTE: a group's passes start at its first row in the tile rounded down to the row tile of
    # both operands' m axis (`metadata.pass_align`): 16 rows of bf16 where lhs comes as [m, k]
    # (`transpose_lhs`, rows on sublanes like rhs), 128 where m is lhs's lane axis (a pass then
    # stays on the grid unless sub_m is 256).
    align=metadata.pass_align(sub_m=sub_m, tm=tm, row_granule=max(lhs_granule, rhs_granule)),
    lhs_tail=lhs_tail,
    lhs_m=m - lhs_tail,
    interior_subs=interior_subs,
    # NOTE: a run needs interior_subs sub-blocks in one tile; with a single sub-block per tile
    # (sub_m == tm) its dynamic offset 0 would not be provably aligned (see `common.sub_block`).
    run_loop=sub_m < tm and tm // sub_m >= interior_subs,
    transpose_lhs=transpose_lhs,
    rows_stationary=rows_stationary,
    sequential_sweeps=sequential_sweeps,
    has_existing=has_existing,
    count_rows=count_rows,
  )


class TgmmRowTileMetadata(NamedTuple):
  """The kernel's scalar-prefetch arrays (int32, in SMEM), in prefetch order.

  Attributes:
    group_offsets: [num_groups_total + 1] first row of each global group.
    first_group, last_group: per m-tile, the local groups it holds (empty ones included, in the
      tile of their position).
    finalize_tile: per local group, the m-tile whose step writes its output block.
    active: [2] (first visited m-tile, visited m-tiles).
    group_offset: [1] the first global group computed.
  """

  group_offsets: Any
  first_group: Any
  last_group: Any
  finalize_tile: Any
  active: Any
  group_offset: Any


class TgmmRowTileInputs(NamedTuple):
  """The operands, all in HBM: lhs and rhs rows are fetched by the kernel's own DMAs (only the
  local rows of each visited tile), existing_out's block only when its group is written."""

  lhs: Any
  rhs: Any
  existing: Any


class TgmmRowTileOutputs(NamedTuple):
  """The result (in HBM) and, with an open probe, the [tiles_k, tiles_n, tiles_m, 4] counts."""

  out: Any
  counts: Any = None


class TgmmRowTileScratch(NamedTuple):
  """VMEM buffers and DMA semaphores.

  Attributes:
    lhs: [2, tk, tm] (transposed lhs: [2, tm, tk]) the two lhs slots.
    rhs: [2, tm, tn] the two rhs slots.
    in_sems: one semaphore per operand and slot: [lhs, rhs] x [slot 0, slot 1].
    acc: the f32 group sum, [tk, tn] ([tn, tk] with rows_stationary).
    staging: [2, tk, tn] the output blocks being written.
    existing: [tk, tn] existing_out's block of the group being written.
    sems: the staging slots' semaphores (0, 1) and the existing_out read's (2).
    lhs_tail: [2, tk, lhs_tail] lhs's tail columns (None without a tail).
  """

  lhs: Any
  rhs: Any
  in_sems: Any
  acc: Any
  staging: Any
  existing: Any
  sems: Any
  lhs_tail: Any = None


def _scratch_shapes(plan: TgmmRowTilePlan) -> TgmmRowTileScratch:
  tm, tk, tn = plan.tm, plan.tk, plan.tn
  return TgmmRowTileScratch(
    lhs=pltpu.VMEM((2, tm, tk) if plan.transpose_lhs else (2, tk, tm), plan.lhs_dtype),
    rhs=pltpu.VMEM((2, tm, tn), plan.rhs_dtype),
    in_sems=pltpu.SemaphoreType.DMA((2, 2)),
    acc=pltpu.VMEM((tn, tk) if plan.rows_stationary else (tk, tn), jnp.float32),
    staging=pltpu.VMEM((2, tk, tn), plan.out_dtype),
    existing=pltpu.VMEM((tk, tn), plan.out_dtype),
    sems=pltpu.SemaphoreType.DMA((3,)),
    lhs_tail=pltpu.VMEM((2, tk, plan.lhs_tail), plan.lhs_dtype) if plan.lhs_tail else None,
  )


class _Step:
  """One grid step (k_i, n_i, visited tile active[0] + step) of the kernel: its positions, its
  place in the DMA chain, the descriptors of its DMAs, and the compute body.

  NOTE: the constructor reads the step's positions (and starts nothing); the methods are the
  kernel's parts, called by `_kernel` in order.
  """

  def __init__(self, plan: TgmmRowTilePlan, meta, ins: TgmmRowTileInputs, outs, scratch):
    self.plan, self.meta, self.ins, self.scratch = plan, meta, ins, scratch
    self.out_hbm, self.counts = outs.out, outs.counts
    # NOTE: the grid visits only the tiles holding local rows (`active_tiles`); t is the m-tile.
    self.k_i, self.n_i, self.step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    self.num_steps = pl.num_programs(2)
    self.t = meta.active[0] + self.step
    self.row0 = self.t * plan.tm
    self.k0 = pl.multiple_of(self.k_i * plan.tk, plan.tk)
    self.n0 = pl.multiple_of(self.n_i * plan.tn, plan.tn)
    self.sweep = self.k_i * plan.tiles_n + self.n_i
    # NOTE: the local groups' rows are one contiguous range [rows_start, rows_end).
    self.rows_start = meta.group_offsets[meta.group_offset[0]]
    self.rows_end = meta.group_offsets[meta.group_offset[0] + plan.num_groups]
    # NOTE: lhs and rhs are double-buffered along a chain of grid steps: with `sequential_sweeps`
    # the whole grid in order (one TensorCore runs it), without it each (k, n) sweep alone
    # (sweeps may run on different TensorCores: nothing is prefetched across them). Step c of
    # the chain reads slot c % 2; it prefetches step c + 1's rows into the other slot, which
    # step c - 1 read and is done with, and the chain's first step fetches its own (exposed).
    self.chain = dma.chain(
      sequential=plan.sequential_sweeps,
      sweep=self.sweep,
      num_sweeps=plan.tiles_k * plan.tiles_n,
      step=self.step,
      num_steps=self.num_steps,
    )
    # NOTE: rows of the slots outside the fetched range hold other tiles' rows or uninitialized
    # memory (NaN under interpret mode): `product` reads them only masked (see its NOTEs).
    self.lhs_ref = scratch.lhs.at[self.chain.slot]
    self.rhs_ref = scratch.rhs.at[self.chain.slot]

  # --- DMA descriptors -------------------------------------------------------------------------

  def tile_fetches(self, *, tile: Any, k_idx: Any, n_idx: Any, slot: Any) -> tuple[list, list]:
    """The (lhs, rhs) DMAs (`common.tile_row_copies`) of m-tile `tile`'s local rows, for the
    (k_idx, n_idx) output block, into VMEM slot `slot`.

    NOTE: a function of its arguments only, so the step that waits for a fetch rebuilds the
    descriptors the step that started it built (same rows, same predicates, same sizes).
    """
    plan, scratch = self.plan, self.scratch
    tm, tk, tn, m, k, n = plan.tm, plan.tk, plan.tn, plan.m, plan.k, plan.n
    lhs_hbm, rhs_hbm, lhs_vmem = self.ins.lhs, self.ins.rhs, scratch.lhs
    # NOTE: with one m-tile the tile is 0: a static row0 keeps the whole-tile fallback (a tm of
    # all m rows that the granule does not divide) a static slice.
    tile_row0 = 0 if plan.tiles_m == 1 else tile * tm
    # NOTE: the tile's local rows [lo, hi), relative to its first row. A visited tile holds
    # some (the grid skips the others); the one tile visited when the shard has no rows at all
    # (to write its empty groups) fetches nothing.
    lo = jnp.clip(self.rows_start - tile_row0, 0, tm)
    hi = jnp.clip(self.rows_end - tile_row0, 0, tm)
    some = hi > lo
    lo, hi = jnp.where(some, lo, 0), jnp.where(some, hi, 0)
    w_k0 = pl.multiple_of(k_idx * tk, tk)
    w_n0 = pl.multiple_of(n_idx * tn, tn)
    # NOTE: m is lhs's lane (last) dim: its rows move in lane granules of 128; rhs's m is its
    # sublane dim (8 rows of 32 bits). `common.window` keeps a window of a whole dim static.
    lhs_hi = jnp.minimum(hi, plan.lhs_m - tile_row0) if plan.lhs_tail else hi
    if plan.transpose_lhs:
      lhs_hbm_rows = lambda start, size: lhs_hbm.at[
        common.window(start, size, m), common.window(w_k0, tk, k)
      ]
      lhs_vmem_rows = lambda off, size: lhs_vmem.at[slot, common.window(off, size, tm), :]
    else:
      lhs_hbm_rows = lambda start, size: lhs_hbm.at[
        common.window(w_k0, tk, k), common.window(start, size, m)
      ]
      lhs_vmem_rows = lambda off, size: lhs_vmem.at[slot, :, common.window(off, size, tm)]
    lhs_copies = common.tile_row_copies(
      hbm_rows=lhs_hbm_rows,
      vmem_rows=lhs_vmem_rows,
      sem=scratch.in_sems.at[0, slot],
      granule=plan.lhs_granule,
      row0=tile_row0,
      lo=lo,
      hi=lhs_hi,
      tm=tm,
      m=plan.lhs_m,
    )
    if plan.lhs_tail:
      # NOTE: the tail columns [lhs_m, m), in m's last tile only, when the rows reach them.
      tail_src = lhs_hbm.at[common.window(w_k0, tk, k), pl.ds(plan.lhs_m, plan.lhs_tail)]
      tail_copy = dma.slot_copy(tail_src, scratch.lhs_tail, slot, scratch.in_sems.at[0, slot])
      lhs_copies.append((hi > plan.lhs_m - tile_row0, tail_copy))
    rhs_copies = common.tile_row_copies(
      hbm_rows=lambda start, size: rhs_hbm.at[
        common.window(start, size, m), common.window(w_n0, tn, n)
      ],
      vmem_rows=lambda off, size: scratch.rhs.at[slot, common.window(off, size, tm), :],
      sem=scratch.in_sems.at[1, slot],
      granule=plan.rhs_granule,
      row0=tile_row0,
      lo=lo,
      hi=hi,
      tm=tm,
      m=m,
    )
    return lhs_copies, rhs_copies

  def out_copy(self, w):
    # NOTE: writes are numbered in issue order across sweeps, w = sweep * G + g (groups are
    # finalized in order within a sweep); write w uses staging slot w % 2.
    plan = self.plan
    w_sweep, g = w // plan.num_groups, w % plan.num_groups
    w_k0 = pl.multiple_of((w_sweep // plan.tiles_n) * plan.tk, plan.tk)
    w_n0 = pl.multiple_of((w_sweep % plan.tiles_n) * plan.tn, plan.tn)
    dst = self.out_hbm.at[
      g, common.window(w_k0, plan.tk, plan.k), common.window(w_n0, plan.tn, plan.n)
    ]
    return dma.slot_copy(dst, self.scratch.staging, w % 2, self.scratch.sems.at[w % 2], to_hbm=True)

  # --- the step's parts, in kernel order -------------------------------------------------------

  def fetch_rows(self) -> None:
    """Starts this step's fetches (the chain's first step only) and the next step's, then waits
    for this step's and places lhs's tail columns."""
    plan, meta, chain = self.plan, self.meta, self.chain

    def fetch(j, carry):
      # NOTE: the fetches of chain step chain + j: j = 0 only at the chain's start, j = 1 the
      # prefetch (the next tile, or with `sequential_sweeps` after a sweep's last step the next
      # sweep's first visited tile, with that sweep's k and n windows; sweeps run k-major, like
      # the grid).
      c = chain.index + j
      if plan.sequential_sweeps:
        c_sweep, c_step = c // self.num_steps, c % self.num_steps
        k_idx, n_idx = c_sweep // plan.tiles_n, c_sweep % plan.tiles_n
      else:
        c_step, k_idx, n_idx = c, self.k_i, self.n_i
      where = dict(tile=meta.active[0] + c_step, k_idx=k_idx, n_idx=n_idx, slot=c % 2)
      for copies in self.tile_fetches(**where):
        dma.start(copies)
      return carry

    dma.fetch_ahead(fetch, chain=chain)
    lhs_copies, rhs_copies = self.tile_fetches(
      tile=self.t, k_idx=self.k_i, n_idx=self.n_i, slot=chain.slot
    )
    dma.wait(lhs_copies)
    dma.wait(rhs_copies)
    if plan.lhs_tail:
      # NOTE: a static, 128-aligned offset into the slot: the tail's place in m's last tile.
      tail_at = plan.lhs_m - (plan.tiles_m - 1) * plan.tm

      @pl.when(lhs_copies[-1][0])
      def _place_lhs_tail():
        lhs_vmem = self.scratch.lhs
        lhs_vmem[chain.slot, :, pl.ds(tail_at, plan.lhs_tail)] = self.scratch.lhs_tail[chain.slot]

    self.fetches = lhs_copies, rhs_copies

  def count_moved_rows(self) -> None:
    """Probe counts: zeroes the step's MXU rows and output blocks; records the rows the step's
    DMAs moved (whoever started them): rhs rows, lhs rows (columns of a [k, m] lhs)."""
    counts, k_i, n_i, t = self.counts, self.k_i, self.n_i, self.t
    lhs_copies, rhs_copies = self.fetches
    counts[k_i, n_i, t, 0] = 0
    counts[k_i, n_i, t, 1] = 0
    lhs_axis = 0 if self.plan.transpose_lhs else 1
    for index, copies, axis in ((2, rhs_copies, 0), (3, lhs_copies, lhs_axis)):
      counts[k_i, n_i, t, index] = sum(
        jnp.where(pred, desc.dst_ref.shape[axis], 0) for pred, desc in copies
      )

  def drain_writes(self) -> None:
    """Waits for the writes in flight after the last step (of the sweep, or with
    `sequential_sweeps` of the grid): every group is finalized by then; the (at most two)
    writes in flight are the last two issued: of this sweep, or with `sequential_sweeps` and a
    single group, of this sweep and the previous one."""
    plan = self.plan
    last = pl.program_id(2) == pl.num_programs(2) - 1
    if plan.sequential_sweeps:
      last = last & (self.sweep == plan.tiles_k * plan.tiles_n - 1)
    in_flight = plan.tiles_k * plan.tiles_n * plan.num_groups
    if not plan.sequential_sweeps:
      in_flight = plan.num_groups

    @pl.when(last)
    def _drain():
      for back in (2, 1):
        if in_flight - back >= 0:
          self.out_copy((self.sweep + 1) * plan.num_groups - back).wait()

  # --- the compute body ------------------------------------------------------------------------

  def product(self, *, row: Any, subs: int, masked: bool, start: Any, end: Any) -> jax.Array:
    """The f32 product of `subs` consecutive passes of sub_m rows from tile row `row`.

    Args:
      row: the first pass's first row in the tile (traced, a multiple of `align`).
      subs: passes in the dot (static): 1 at a group's ends, `interior_subs` inside it.
      masked: zero the rows outside [start, end) in both operands.
      start: the first row (absolute) the dot may count: the group's first row, or past the
        rows the group's previous pass counted (a pass moved back from the tile's end).
      end: one past the group's last row.

    Returns:
      [tk, tn] (with `rows_stationary` [tn, tk]) f32.
    """
    plan = self.plan
    sub_m, tm, tk, tn = plan.sub_m, plan.tm, plan.tk, plan.tn
    if subs == 1:
      # NOTE: a pass that would cross the tile's end is moved back to its last sub_m rows
      # (`common.pass_block`); the rows it shares with the group's previous pass are masked
      # (the caller's `start`), so no row is counted twice.
      r0, rows = common.pass_block(row, sub_m=sub_m, tm=tm, align=plan.align)
    else:
      # NOTE: a run lies wholly inside the group and the tile; its rows are aligned to `align`,
      # which is what the lane (lhs) and sublane (rhs) slices need.
      r0 = pl.multiple_of(row, plan.align)
      rows = pl.ds(r0, subs * sub_m)
    lhs_blk = self.lhs_ref[rows, :] if plan.transpose_lhs else self.lhs_ref[:, rows]
    rhs_blk = self.rhs_ref[rows, :]
    if masked:
      # NOTE: rows are the contraction dim: only rows of the group contribute. Both operands
      # are masked: rows of the slot outside the fetched range (past m in a ragged last tile,
      # other shards' rows, a receive buffer's slack) hold stale or uninitialized data (NaN
      # under interpret mode) and 0 * NaN = NaN. An unmasked run reads only sub-blocks wholly
      # inside the group, which are fetched.
      lo = self.row0 + r0
      width = rhs_blk.shape[0]
      if plan.transpose_lhs:
        lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (width, tk), 0)
      else:
        lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (tk, width), 1)
      rhs_rows = lo + lax.broadcasted_iota(jnp.int32, (width, tn), 0)
      lhs_blk = jnp.where((lhs_cols >= start) & (lhs_cols < end), lhs_blk, 0)
      rhs_blk = jnp.where((rhs_rows >= start) & (rhs_rows < end), rhs_blk, 0)
    # NOTE: lhs's rows are its dim 0 when transposed ([rows, tk]), else dim 1 ([tk, rows]).
    lhs_rows_dim = 0 if plan.transpose_lhs else 1
    if plan.rows_stationary:
      # NOTE: [rows, tn] contracted on its rows with lhs on its rows: [tn, tk].
      operands, dims = (rhs_blk, lhs_blk), (((0,), (lhs_rows_dim,)), ((), ()))
    else:
      operands, dims = (lhs_blk, rhs_blk), (((lhs_rows_dim,), (0,)), ((), ()))
    return lax.dot_general(
      *(x.astype(plan.compute_dtype) for x in operands),
      dimension_numbers=dims,
      preferred_element_type=jnp.float32,
    )

  def group_body(self, g, carry):
    """The loop body over the tile's local groups: adds group g's passes over this tile to its
    sum (a group starting here starts it), and writes the group if it ends here."""
    plan, meta, acc_ref, row0 = self.plan, self.meta, self.scratch.acc, self.row0
    start = meta.group_offsets[g + meta.group_offset[0]]
    end = meta.group_offsets[g + meta.group_offset[0] + 1]
    nonempty = end > start
    # NOTE: the group's rows in this tile, local to it: [lo, hi).
    lo = jnp.maximum(start, row0) - row0
    hi = jnp.minimum(end, row0 + plan.tm) - row0
    # NOTE: its passes: sub_m rows each from first_row, lo rounded down to `align`
    # (`metadata.group_passes`; pass p starts at first_row + p * sub_m).
    first_row, passes = metadata.group_passes(lo, hi, sub_m=plan.sub_m, align=plan.align)
    # NOTE: a group that started in an earlier tile (start < row0) carries its partial sum in
    # acc; one starting here writes its first pass's product (no zeroing pass).
    starts_here = start >= row0

    # NOTE: an empty group computes nothing: its output is exact zeros (plus existing_out).
    @pl.when(jnp.logical_not(nonempty))
    def _zero():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(nonempty & starts_here)
    def _first():
      acc_ref[...] = self.product(row=first_row, subs=1, masked=True, start=start, end=end)
      if self.counts is not None:
        self.counts[self.k_i, self.n_i, self.t, 0] += plan.sub_m

    self.add_passes(
      first_row, passes, start=start, end=end, hi=hi, nonempty=nonempty, starts_here=starts_here
    )
    pl.when(meta.finalize_tile[g] == self.t)(lambda: self.finalize(g))
    return carry

  def add_passes(self, first_row, passes, *, start, end, hi, nonempty, starts_here) -> None:
    """Adds the group's passes after its first one to its sum.

    NOTE: the passes left are [rest, passes). All but the group's last one lie wholly inside
    it: pass 0 holds its first row and is taken by `group_body` when the group starts here, or
    the group started in an earlier tile (then lo = first_row = 0 and rest = 0). They go in runs
    of `interior_subs` passes, one unmasked dot and one accumulator update per run; the rest
    (fewer than a run, and the last pass when the group ends inside it) one masked pass at a
    time. MXU rows are the same as one dot per pass.
    """
    plan, acc_ref, row0, sub_m = self.plan, self.scratch.acc, self.row0, self.plan.sub_m
    subs = plan.interior_subs

    def pass_row(p):
      return first_row + p * sub_m

    def masked_from(p):
      # NOTE: rows before pass p's own first row were counted by pass p - 1 (or precede the
      # group); they matter only where pass p is moved back from the tile's end.
      return jnp.maximum(start, row0 + pass_row(p))

    rest = starts_here.astype(jnp.int32)
    # NOTE: passes whose rows all precede hi; the last one is whole iff it ends at hi.
    whole_end = (hi - first_row) // sub_m
    if plan.run_loop:
      runs = jnp.where(nonempty, jnp.maximum(whole_end - rest, 0) // subs, 0)
    else:
      runs = 0
    edge0 = rest + runs * subs

    if plan.run_loop:

      def run_body(i, c):
        acc_ref[...] += self.product(
          row=pass_row(rest + i * subs), subs=subs, masked=False, start=start, end=end
        )
        return c

      lax.fori_loop(0, runs, run_body, 0)

    def edge_body(p, c):
      acc_ref[...] += self.product(
        row=pass_row(p), subs=1, masked=True, start=masked_from(p), end=end
      )
      return c

    # NOTE: an empty group has no rows here (hi <= lo, its pass count is meaningless): its
    # range is made empty explicitly, like its run count above.
    edges_end = jnp.where(nonempty, passes, edge0)
    lax.fori_loop(edge0, edges_end, edge_body, 0)
    if self.counts is not None:
      self.counts[self.k_i, self.n_i, self.t, 0] += (runs * subs + edges_end - edge0) * sub_m

  def finalize(self, g) -> None:
    """Writes group g's finished sum (plus existing_out's block) to out[g] through a staging
    slot, by a DMA that completes while the next groups compute."""
    plan, scratch = self.plan, self.scratch
    w = self.sweep * plan.num_groups + g
    # NOTE: the slot was last used by write w - 2; its DMA must be done before reuse. Without
    # `sequential_sweeps` every sweep drains its writes, so only g >= 2 has one in flight.
    in_flight = (w >= 2) if plan.sequential_sweeps else (g >= 2)

    @pl.when(in_flight)
    def _wait_slot():
      self.out_copy(w - 2).wait()

    acc = scratch.acc[...].T if plan.rows_stationary else scratch.acc[...]
    if plan.has_existing:
      src = self.ins.existing.at[
        g, common.window(self.k0, plan.tk, plan.k), common.window(self.n0, plan.tn, plan.n)
      ]
      read = pltpu.make_async_copy(src, scratch.existing, scratch.sems.at[2])
      read.start()
      read.wait()
      acc = acc + scratch.existing[...].astype(jnp.float32)
    scratch.staging[w % 2] = acc.astype(scratch.staging.dtype)
    self.out_copy(w).start()
    if self.counts is not None:
      self.counts[self.k_i, self.n_i, self.t, 1] += 1


def _kernel(
  plan: TgmmRowTilePlan,
  meta: TgmmRowTileMetadata,
  ins: TgmmRowTileInputs,
  outs: TgmmRowTileOutputs,
  scratch: TgmmRowTileScratch,
) -> None:
  """One grid step (k-tile k_i, n-tile n_i, visited m-tile active[0] + step): the main loop."""
  step = _Step(plan, meta, ins, outs, scratch)
  step.fetch_rows()
  if step.counts is not None:
    step.count_moved_rows()
  lax.fori_loop(meta.first_group[step.t], meta.last_group[step.t] + 1, step.group_body, 0)
  step.drain_writes()


def tgmm_rowtile_pallas(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  tiling: tuple[int, int, int],
  out_dtype: Any,
  group_offset: jax.Array,
  num_actual_groups: int,
  existing_out: jax.Array | None = None,
  sub_m: int | None = None,
  vmem_limit_bytes: int | None = None,
  sequential_sweeps: bool = False,
  rows_stationary: bool = False,
  interior_subs: int = INTERIOR_SUBS,
  transpose_lhs: bool = False,
  expected_rows: int | None = None,
  interpret: common.Interpret = None,
) -> jax.Array:
  """Runs the row-tile tgmm kernel on validated arguments.

  Args:
    lhs: [k, m], or [m, k] with `transpose_lhs`.
    rhs: [m, n].
    group_sizes: [num_groups_total] int32.
    tiling: (tm, tk, tn); tk must divide k and tn divide n (manual output DMAs are not ragged).
    out_dtype: dtype of the result.
    group_offset: [] int32, the first global group to compute.
    num_actual_groups: number of local groups to compute (static).
    existing_out: optional [num_actual_groups, k, n] of `out_dtype`, added to the result.
    sub_m: rows per MXU pass (divides tm); a group's passes cover only its rows in the tile,
      from its first row rounded down to `metadata.pass_align`. None: the whole tile.
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the call (None: Mosaic's default).
    sequential_sweeps: the grid runs in order on one TensorCore (v5e, v6e, tpu7x): the output
      writes still in flight at the end of a (k, n) sweep complete while the next sweep
      computes, and are drained only after the last grid step, instead of at the end of every
      sweep. All grid axes are then "arbitrary".
    rows_stationary: accumulate out^T = rhs^T @ lhs^T: the sub-block's [sub_m, tk] lhs^T is the
      MXU's stationary operand and the tn rhs columns stream through it as rows, so a tn that is
      a multiple of 128 but not of the MXU width (1408 on a 256-wide MXU) is not padded to it.
      Costs a transpose of each [sub_m, tn] rhs sub-block and of the [tn, tk] f32 sum once per
      group. `tiling.rows_stationary_pays` says when it saves MXU work.
    interior_subs: sub-blocks per dot where they all lie inside the group (interior runs): the
      f32 accumulator is read, added to and written once per run instead of once per sub-block.
      The group's last sub-block (masked) and the sub-blocks left over from the runs are still
      multiplied one at a time, so MXU rows do not change. 1: every interior sub-block is its
      own unmasked dot.
    transpose_lhs: lhs is [m, k] (the gmm's own lhs, as the forward read it): its rows move
      like rhs's (sublane granules) into [tm, tk] slots and the dots contract dim 0 of both
      blocks (`lax.dot_general`), so the caller needs no [k, m] transposed copy in HBM; and the
      passes start at each group's first row rounded to 16 bf16 rows (8 f32), not on the
      128-lane grid a [k, m] lhs needs.
    expected_rows: the rows of m the caller expects to be real; the cost estimate XLA gets
      (`tgmm_cost`) counts those, not all m. None: m.
    interpret: see `common.run_kernel`.

  Returns:
    [num_actual_groups, k, n] of `out_dtype`.

  With a `probe.count_rows` probe open (interpret mode), the probe gets [tiles_k, tiles_n,
  tiles_m, 4] int32, per grid step: rows pushed through the MXU, output blocks written, rhs rows
  fetched and lhs rows (columns) fetched for the step's tile (whichever step started the DMAs).
  """
  counter = probe.active()
  plan = plan_rowtile(
    lhs,
    rhs,
    tiling=tiling,
    out_dtype=out_dtype,
    num_groups=num_actual_groups,
    sub_m=sub_m,
    interior_subs=interior_subs,
    transpose_lhs=transpose_lhs,
    rows_stationary=rows_stationary,
    sequential_sweeps=sequential_sweeps,
    has_existing=existing_out is not None,
    count_rows=counter is not None,
  )
  groups = metadata.make_tile_groups(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=plan.num_groups,
    m=plan.m,
    tm=plan.tm,
    finalize_empty_groups=True,
  )
  meta = TgmmRowTileMetadata(
    group_offsets=groups.group_offsets,
    first_group=groups.tile_first_group,
    last_group=groups.tile_last_group,
    finalize_tile=groups.finalize_tile,
    active=groups.active_tiles,
    group_offset=group_offset.reshape((1,)),
  )
  inputs = TgmmRowTileInputs(lhs=lhs, rhs=rhs, existing=existing_out)
  out = _call(
    plan,
    meta,
    inputs,
    others=(group_sizes, group_offset),
    expected_rows=expected_rows,
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
  )
  if plan.count_rows:
    out, counts = out
    counter.record(counts)
  return out


def _call(
  plan: TgmmRowTilePlan, meta, inputs, *, others, expected_rows, vmem_limit_bytes, interpret
):
  """The pallas_call: every operand in HBM, scratch, grid and dimension semantics, cost, and the
  probe's counts output."""
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  specs = TgmmRowTileInputs(*(None if x is None else any_spec for x in inputs))
  counts_shape = (plan.tiles_k, plan.tiles_n, plan.tiles_m, 4) if plan.count_rows else None
  outputs = TgmmRowTileOutputs(
    out=common.out_struct(
      (plan.num_groups, plan.k, plan.n), plan.out_dtype, *inputs[:2], *others, inputs.existing
    ),
    counts=jax.ShapeDtypeStruct(counts_shape, jnp.int32) if counts_shape else None,
  )
  scratch = _scratch_shapes(plan)
  kernel = kernel_refs.kernel(
    functools.partial(_kernel, plan), layout=(meta, inputs, outputs, scratch)
  )
  visited = jnp.arange(plan.tiles_m) - meta.active[0]
  # NOTE: m-tiles run in order (a group's partial sum crosses tiles). Without `sequential_sweeps`
  # writes are drained at each sweep's end, so (k, n) sweeps are independent and may be split
  # across TensorCores; with it writes cross sweeps.
  return common.call_kernel(
    kernel,
    name="pallas_moe_tgmm_rowtile",
    grid=(plan.tiles_k, plan.tiles_n, meta.active[1]),
    prefetch=tuple(kernel_refs.leaves(meta)),
    operands=kernel_refs.leaves(inputs),
    in_specs=kernel_refs.leaves(specs),
    out_shape=outputs.out,
    out_spec=any_spec,
    scratch_shapes=kernel_refs.leaves(scratch),
    dimension_semantics=("arbitrary",) * 3
    if plan.sequential_sweeps
    else ("parallel", "parallel", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    # NOTE: the kernel moves only the local rows; their count is not static: the caller's
    # expectation, else all m rows (an upper bound).
    **tgmm_cost(
      inputs.lhs,
      inputs.rhs,
      None,
      None,
      m=plan.m,
      k=plan.k,
      n=plan.n,
      rows=plan.m if expected_rows is None else min(expected_rows, plan.m),
      num_groups=plan.num_groups,
      out_dtype=plan.out_dtype,
      tiles=(plan.tiles_k, plan.tiles_n),
      has_existing=plan.has_existing,
    ),
    interpret=interpret,
    counts_shape=counts_shape,
    # NOTE: counters of unvisited tiles are never written (and those tiles did no work).
    valid_counts=((visited >= 0) & (visited < meta.active[1]))[:, None],
  )
