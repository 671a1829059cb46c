"""Pallas TPU transposed grouped matmul kernels: out[g] = lhs[:, rows of g] @ rhs[rows of g].

The weight-gradient kernels: with lhs = x^T [k, m] and rhs = dy [m, n], out[g] is dW of group g.
`pallas_moe.ops` runs them for gmm's VJP and for the public `tgmm`. As in megablox, the package
exports the *function* `pallas_moe.tgmm`, which shadows this module's name as a package
attribute: reach the module with `from pallas_moe.tgmm import ...` or
`importlib.import_module("pallas_moe.tgmm")`.

Two schedules compute the same thing:

- `tgmm_rowtile_pallas` (the default when its blocks fit VMEM): grid (tiles_k, tiles_n, visited
  m-tiles), one step per m-tile holding local rows. Each step reads one [tk, tm] lhs block and
  one [tm, tn] rhs block from two VMEM slots that the kernel's own DMAs fill with only the
  tile's local rows (rounded out to the DMA granule: 128 lhs lanes, 8 rhs sublanes of 32 bits),
  so the partial first and last tiles of an expert-parallel receive buffer fetch no slack rows;
  the next step's rows are fetched during the current step. The output stays in HBM (`pl.ANY`):
  the step loops over the local groups of its tile (`metadata.make_tile_groups`), reduces each
  group's MXU passes of sub_m rows into one f32 accumulator (the group's first pass's product
  written into it, the passes wholly inside the group in runs of `INTERIOR_SUBS` per dot, the
  others one masked dot each), and when a group is complete (its last row is in this tile;
  empty groups in the tile of their position) casts it into one of two VMEM staging slots and
  DMAs it to out[g] while the next groups compute. Each output block is written once, lhs's
  local rows are read once per n-tile and rhs's once per k-tile. With `rows_stationary` the
  accumulator holds out^T = rhs^T @ lhs^T: the [sub_m, tk] lhs^T rows are the MXU's stationary
  operand and the tn rhs columns stream through it, so a tn that the MXU width does not divide
  is not padded to it; the sum is transposed once, when the group is written. Where lhs comes
  as [m, k] (`transpose_lhs`, as gmm's backward passes it) its rows are sublanes like rhs's, and
  a group's passes start at its first row in the tile rounded down to the rows' VMEM tile (16
  bf16 rows) instead of on the sub_m grid: a group boundary inside a tile then costs about half
  a pass of MXU work instead of a whole one.
- `tgmm_pallas` (any tiles, quantized operands): grid (tiles_k, tiles_n, visits). The visit axis
  is innermost: it reduces over the m-tiles of each local group into one f32 accumulator and
  writes the group's [tk, tn] block when the group's last visit ends. Every local group is
  visited, empty ones once, so every output block is written (zeros or `existing_out` for empty
  groups).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import common, metadata


def tgmm_cost(
  lhs, rhs, lhs_scales, rhs_scales, *, m, k, n, rows, num_groups, out_dtype, tiles, has_existing
) -> dict[str, int]:
  """The CostEstimate a tgmm call gives XLA: the work it will do on `rows` of its m rows.

  `rows` is the caller's `expected_rows` (the real rows of an expert-parallel receive buffer)
  or all m: the kernels visit only the m-tiles holding local rows, so a buffer's slack costs
  nothing and is not counted. flops = 2 * rows * k * n; bytes: lhs's rows (and per-token
  scales) once per n-tile, rhs's once per k-tile, per-channel scales once per tile of theirs,
  the output (and existing_out) once.

  Returns:
    dict(flops=, bytes_accessed=) for `common.call_kernel`.
  """
  tiles_k, tiles_n = tiles
  frac = rows / m if m else 0.0

  def scale_bytes(scales, channel_shape, reads):
    if scales is None:
      return 0
    per_token = tuple(scales.shape) != channel_shape
    return int(scales.size * 4 * (frac if per_token else 1)) * reads

  return dict(
    flops=2 * rows * k * n,
    bytes_accessed=rows * k * lhs.dtype.itemsize * tiles_n
    + rows * n * rhs.dtype.itemsize * tiles_k
    + scale_bytes(lhs_scales, (k, 1), tiles_n)
    + scale_bytes(rhs_scales, (1, n), tiles_k)
    + num_groups * k * n * jnp.dtype(out_dtype).itemsize * (2 if has_existing else 1),
  )


# ------------------------------------------------------------------------------------------------
# Visit schedule: one grid step per k-tile, n-tile and (group, m-tile) visit.
# ------------------------------------------------------------------------------------------------


def tgmm_pallas(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  tiling: tuple[int, int, int],
  out_dtype: Any,
  group_offset: jax.Array,
  num_actual_groups: int,
  existing_out: jax.Array | None = None,
  lhs_scales: jax.Array | None = None,
  rhs_scales: jax.Array | None = None,
  narrow_dot: bool = False,
  sub_m: int | None = None,
  vmem_limit_bytes: int | None = None,
  transpose_lhs: bool = False,
  expected_rows: int | None = None,
  count_rows: bool = False,
  interpret: common.Interpret = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Runs the tgmm kernel on validated arguments.

  Args:
    lhs: [k, m], or [m, k] with `transpose_lhs`.
    rhs: [m, n].
    group_sizes: [num_groups_total] int32.
    tiling: (tm, tk, tn), already clamped to the dims and aligned.
    out_dtype: dtype of the result.
    group_offset: [] int32, the first global group to compute.
    num_actual_groups: number of local groups to compute (static).
    existing_out: optional [num_actual_groups, k, n] of `out_dtype`, added to the result.
    lhs_scales: optional f32 dequantization scales of a quantized (int8 / fp8) lhs: [k, 1] per
      output row (factors out of the contraction over m: applied to the accumulator when the
      group's block is stored), or [1, m] per token (does not factor out: multiplies the upcast
      lhs block in VMEM before the dot). A [1, 1] array is read as [k, 1] (k = 1).
    rhs_scales: optional f32 scales of a quantized rhs: [1, n] per output column (applied at the
      store) or [m, 1] per token (before the dot). A [1, 1] array is read as [1, n].
    narrow_dot: both operands quantized with the same dtype and per-channel scales: the dot runs
      on the narrow values (int8 x int8 to int32, fp8 x fp8 to f32). False: quantized operands
      are upcast in VMEM to the float operand's dtype (bf16 when both are quantized).
    sub_m: rows per MXU pass (a multiple of 128 dividing tm); sub-blocks of the m-tile outside
      the visit's group are skipped. None: the whole tile.
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the call (None: Mosaic's default).
    transpose_lhs: lhs is [m, k] (the gmm's own lhs, as the forward read it) and the kernel
      contracts its rows in VMEM (`lax.dot_general` over dim 0 of both blocks), so the caller
      needs no [k, m] transposed copy of it in HBM. No lhs scales then.
    expected_rows: the rows of m the caller expects to be real (sum(group_sizes)); the cost
      estimate XLA gets (`tgmm_cost`) counts those, not all m. None: m.
    count_rows: instrumentation for interpret mode: also return [tiles_k, tiles_n, max_visits]
      int32 rows pushed through the MXU per grid step.
    interpret: see `common.run_kernel`.

  Returns:
    [num_actual_groups, k, n] of `out_dtype` (and the row counts with `count_rows`).
  """
  m, k = lhs.shape if transpose_lhs else lhs.shape[::-1]
  n = rhs.shape[1]
  tm, tk, tn = tiling
  sub_m = common.check_sub_m(sub_m, tm)
  if transpose_lhs and lhs_scales is not None:
    raise ValueError("lhs_scales are for a [k, m] lhs; pass transpose_lhs=False with them.")
  tiles_k, tiles_n = metadata.cdiv(k, tk), metadata.cdiv(n, tn)
  lhs_q, rhs_q = lhs_scales is not None, rhs_scales is not None
  # NOTE: a per-channel scale ([k, 1] of lhs, [1, n] of rhs) is constant along the contraction m
  # and factors out of the sum; a per-token one ([1, m], [m, 1]) varies along m and must scale
  # the operand before the dot.
  lhs_token = lhs_q and tuple(lhs_scales.shape) != (k, 1)
  rhs_token = rhs_q and tuple(rhs_scales.shape) != (1, n)
  for name, scales, want in (
    ("lhs_scales", lhs_scales, ((k, 1), (1, m))),
    ("rhs_scales", rhs_scales, ((1, n), (m, 1))),
  ):
    if scales is not None and tuple(scales.shape) not in want:
      raise ValueError(f"{name} has shape {tuple(scales.shape)}, expected {want[0]} or {want[1]}.")
  # NOTE: per-token scaled values (two quantized operands) round to bf16 like a bf16 dequantize.
  compute_dtype, dot_acc_dtype = common.dot_dtypes(
    lhs.dtype,
    rhs.dtype,
    lhs_quantized=lhs_q,
    rhs_quantized=rhs_q,
    narrow_dot=narrow_dot,
    scales_allow_narrow=not (lhs_token or rhs_token),
    scales_requirement=" and per-channel scales ([k, 1] and [1, n])",
  )

  schedule = metadata.make_schedule(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=num_actual_groups,
    m=m,
    tm=tm,
    fill_uncovered_tiles=False,
    visit_empty_groups=True,
  )
  prefetch = (
    schedule.group_offsets,
    schedule.visit_group,
    schedule.visit_load_tile,
    schedule.visit_active,
    group_offset.reshape((1,)),
  )
  has_existing = existing_out is not None

  def kernel(offsets_ref, group_ref, tile_ref, active_ref, goff_ref, *refs):
    ins, outs, (acc_ref,) = common.split_refs(
      refs, inputs=(True, True, lhs_q, rhs_q, has_existing), outputs=1 + count_rows, scratch=1
    )
    lhs_ref, rhs_ref, lhs_s_ref, rhs_s_ref, existing_ref = ins
    out_ref, rows_ref = outs[0], (outs[1] if count_rows else None)
    k_i, n_i, visit = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_visits = pl.num_programs(2)
    group = group_ref[visit]
    prev_group = group_ref[jnp.maximum(visit - 1, 0)]
    next_group = group_ref[jnp.minimum(visit + 1, num_visits - 1)]
    # NOTE: a group's visits are consecutive; its first visit starts the accumulator and its last
    # one writes the output block.
    first = (visit == 0) | (prev_group != group)
    last = (visit == num_visits - 1) | (next_group != group)
    active = active_ref[visit] == 1
    g = group + goff_ref[0]
    start, end = offsets_ref[g], offsets_ref[g + 1]
    row0 = tile_ref[visit] * tm
    if rows_ref is not None:
      rows_ref[k_i, n_i, visit] = 0

    @pl.when(first)
    def _zero_acc():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    # NOTE: rows are tgmm's contraction dim. The tile is reduced in sub-blocks of sub_m rows (the
    # MXU granularity), only those holding rows of the group: first_sub .. last_sub. A tile
    # straddling group boundaries costs each group only the sub-blocks it touches.
    first_sub = jnp.maximum(start - row0, 0) // sub_m
    last_sub = (jnp.minimum(end, row0 + tm) - 1 - row0) // sub_m

    def body(sub, carry):
      r0, rows = common.sub_block(sub, sub_m, tm)
      # NOTE: only the rows of this sub-block that belong to the group contribute. Mask both
      # operands: rows of a ragged last m-tile are uninitialized (NaN under interpret mode) and
      # 0 * NaN = NaN.
      lo = row0 + r0
      if transpose_lhs:
        lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (sub_m, tk), 0)
        lhs_blk = lhs_ref[rows, :]
      else:
        lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (tk, sub_m), 1)
        lhs_blk = lhs_ref[:, rows]
      rhs_rows = lo + lax.broadcasted_iota(jnp.int32, (sub_m, tn), 0)
      rhs_blk = rhs_ref[rows, :]
      if lhs_q and not narrow_dot:
        lhs_blk = lhs_blk.astype(jnp.float32)
        if lhs_token:
          # NOTE: [1, sub_m] token scales broadcast over the block's k rows; scaled before the
          # row mask so garbage scales of a ragged last m-tile are masked with the values.
          lhs_blk = lhs_blk * lhs_s_ref[:, rows]
      if rhs_q and not narrow_dot:
        rhs_blk = rhs_blk.astype(jnp.float32)
        if rhs_token:
          rhs_blk = rhs_blk * rhs_s_ref[rows, :]
      lhs_blk = jnp.where((lhs_cols >= start) & (lhs_cols < end), lhs_blk, 0)
      rhs_blk = jnp.where((rhs_rows >= start) & (rhs_rows < end), rhs_blk, 0)
      acc_ref[...] += lax.dot_general(
        lhs_blk.astype(compute_dtype),
        rhs_blk.astype(compute_dtype),
        dimension_numbers=(((0 if transpose_lhs else 1,), (0,)), ((), ())),
        preferred_element_type=dot_acc_dtype,
      ).astype(jnp.float32)
      return carry

    @pl.when(active)
    def _accumulate():
      lax.fori_loop(first_sub, last_sub + 1, body, 0)
      if rows_ref is not None:
        rows_ref[k_i, n_i, visit] += (last_sub + 1 - first_sub) * sub_m

    @pl.when(last)
    def _store():
      acc = acc_ref[...]
      # NOTE: per-channel scales multiply the group's finished sum once: [tk, 1] rows, [1, tn]
      # columns. Rows / columns past k / n may see garbage scales; they are never written back.
      if lhs_q and not lhs_token:
        acc = acc * lhs_s_ref[...]
      if rhs_q and not rhs_token:
        acc = acc * rhs_s_ref[...]
      if existing_ref is not None:
        acc = acc + existing_ref[...].astype(jnp.float32)
      out_ref[...] = acc.astype(out_ref.dtype)

  # Index maps get (k_i, n_i, visit, *prefetch refs).
  def lhs_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    return (tile[visit], k_i) if transpose_lhs else (k_i, tile[visit])

  def rhs_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    return tile[visit], n_i

  def out_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    # NOTE: the output holds only the local groups; visit_group is already local.
    return group[visit], k_i, n_i

  # NOTE: scale blocks follow the operand axis they describe: per-channel ones the output block's
  # k or n index (fetched once per output block), per-token ones the visit's m-tile, like the
  # operand itself (no refetch while a non-computing visit repeats the tile).
  def lhs_chan_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    return k_i, 0

  def lhs_token_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    return 0, tile[visit]

  def rhs_chan_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    return 0, n_i

  def rhs_token_map(k_i, n_i, visit, offsets, group, tile, active, goff):
    return tile[visit], 0

  f32 = lambda s: None if s is None else s.astype(jnp.float32)  # noqa: E731
  operands, in_specs = common.present_operands(
    (lhs, pl.BlockSpec((tm, tk) if transpose_lhs else (tk, tm), lhs_map)),
    (rhs, pl.BlockSpec((tm, tn), rhs_map)),
    (
      f32(lhs_scales),
      pl.BlockSpec((1, tm), lhs_token_map) if lhs_token else pl.BlockSpec((tk, 1), lhs_chan_map),
    ),
    (
      f32(rhs_scales),
      pl.BlockSpec((tm, 1), rhs_token_map) if rhs_token else pl.BlockSpec((1, tn), rhs_chan_map),
    ),
    (existing_out, pl.BlockSpec((None, tk, tn), out_map)),
  )

  return common.call_kernel(
    kernel,
    name="pallas_moe_tgmm",
    grid=(tiles_k, tiles_n, schedule.num_visits),
    prefetch=prefetch,
    operands=operands,
    in_specs=in_specs,
    out_shape=common.out_struct(
      (num_actual_groups, k, n),
      out_dtype,
      lhs,
      rhs,
      group_sizes,
      group_offset,
      existing_out,
      lhs_scales,
      rhs_scales,
    ),
    out_spec=pl.BlockSpec((None, tk, tn), out_map),
    scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    dimension_semantics=("parallel", "parallel", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    **tgmm_cost(
      lhs,
      rhs,
      lhs_scales,
      rhs_scales,
      m=m,
      k=k,
      n=n,
      rows=m if expected_rows is None else min(expected_rows, m),
      num_groups=num_actual_groups,
      out_dtype=out_dtype,
      tiles=(tiles_k, tiles_n),
      has_existing=has_existing,
    ),
    interpret=interpret,
    counts_shape=(tiles_k, tiles_n, schedule.max_visits) if count_rows else None,
    valid_counts=jnp.arange(schedule.max_visits) < schedule.num_visits,
  )


# ------------------------------------------------------------------------------------------------
# Row-tile schedule: one grid step per m-tile; output blocks streamed out by manual DMA.
# ------------------------------------------------------------------------------------------------

# NOTE: sub-blocks per interior dot of the row-tile tgmm. On v5e a 128-row sub-block is 2,816 MXU
# cycles (tk 1024, tn 1408) against ~2,950 bundles of accumulator read / add / write: issue-bound;
# 256 rows per accumulator update bring the loop under its MXU time (bench/results/rowtile-vliw.md,
# "The weight gradient's loops").
INTERIOR_SUBS = 2


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
  count_rows: bool = False,
  interpret: common.Interpret = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
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
    count_rows: interpret-mode instrumentation: also return [tiles_k, tiles_n, tiles_m, 4] int32,
      per grid step: rows pushed through the MXU, output blocks written, rhs rows fetched and
      lhs rows (columns) fetched for the step's tile (whichever step started the DMAs).
    interpret: see `common.run_kernel`.

  Returns:
    [num_actual_groups, k, n] of `out_dtype` (and the counts with `count_rows`).
  """
  m, k = lhs.shape if transpose_lhs else lhs.shape[::-1]
  n = rhs.shape[1]
  tm, tk, tn = tiling
  sub_m = common.check_sub_m(sub_m, tm)
  if k % tk or n % tn:
    raise ValueError(f"tk={tk} must divide k={k} and tn={tn} divide n={n} for the row-tile tgmm.")
  tiles_k, tiles_n, tiles_m = k // tk, n // tn, metadata.cdiv(m, tm)
  num_groups = num_actual_groups
  if interior_subs < 1:
    raise ValueError(f"interior_subs={interior_subs} must be >= 1.")
  # NOTE: a run needs interior_subs sub-blocks in one tile; with a single sub-block per tile
  # (sub_m == tm) its dynamic offset 0 would not be provably aligned (see `common.sub_block`).
  run_loop = sub_m < tm and tm // sub_m >= interior_subs
  compute_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  lhs_granule = common.row_granule(lhs.dtype, lanes=not transpose_lhs)
  rhs_granule = common.row_granule(rhs.dtype)
  # NOTE: a group's passes start at its first row in the tile rounded down to the row tile of
  # both operands' m axis (`metadata.pass_align`): 16 rows of bf16 where lhs comes as [m, k]
  # (`transpose_lhs`, rows on sublanes like rhs), 128 where m is lhs's lane axis (a pass then
  # stays on the grid unless sub_m is 256).
  align = metadata.pass_align(sub_m=sub_m, tm=tm, row_granule=max(lhs_granule, rhs_granule))
  # NOTE: m's last m % 128 columns of lhs cannot be DMAed into the lane-tiled [tk, tm] slot: a
  # slice of a VMEM ref along its lane dim must span whole 128-lane tiles (Mosaic rejects a
  # 104-lane window). They go to a [tk, lhs_tail] buffer of their own (a whole-dim window) and
  # are copied into the slot as values. `common.tile_row_copies` moves the aligned columns
  # before them (it is told lhs has lhs_m columns). A tm of all m columns that is not a multiple
  # of 128 is fetched whole and has no separate tail.
  # (A transposed [m, k] lhs has m on its sublanes, like rhs: no tail.)
  lhs_tail = m % lhs_granule if tm % lhs_granule == 0 and not transpose_lhs else 0
  lhs_m = m - lhs_tail
  groups = metadata.make_tile_groups(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=num_groups,
    m=m,
    tm=tm,
    finalize_empty_groups=True,
  )
  prefetch = (
    groups.group_offsets,
    groups.tile_first_group,
    groups.tile_last_group,
    groups.finalize_tile,
    groups.active_tiles,
    group_offset.reshape((1,)),
  )
  has_existing = existing_out is not None

  def kernel(offsets_ref, first_ref, last_ref, fin_ref, active_ref, goff_ref, *refs):
    ins, outs, scratch = common.split_refs(
      refs, inputs=(True, True, has_existing), outputs=1 + count_rows, scratch=7 + bool(lhs_tail)
    )
    lhs_hbm, rhs_hbm, existing_hbm = ins
    lhs_vmem, rhs_vmem, in_sems, acc_ref, staging, ex_vmem, sems = scratch[:7]
    lhs_tail_vmem = scratch[7] if lhs_tail else None
    out_hbm, counts_ref = outs[0], (outs[1] if count_rows else None)
    # NOTE: the grid visits only the tiles holding local rows (`active_tiles`); t is the m-tile.
    k_i, n_i, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_steps = pl.num_programs(2)
    t = active_ref[0] + step
    row0 = t * tm
    k0 = pl.multiple_of(k_i * tk, tk)
    n0 = pl.multiple_of(n_i * tn, tn)

    sweep = k_i * tiles_n + n_i
    # NOTE: the local groups' rows are one contiguous range [rows_start, rows_end).
    rows_start = offsets_ref[goff_ref[0]]
    rows_end = offsets_ref[goff_ref[0] + num_groups]

    def tile_fetches(*, tile: Any, k_idx: Any, n_idx: Any, slot: Any) -> tuple[list, list]:
      """The (lhs, rhs) DMAs (`common.tile_row_copies`) of m-tile `tile`'s local rows, for the
      (k_idx, n_idx) output block, into VMEM slot `slot`.

      NOTE: a function of its arguments only, so the step that waits for a fetch rebuilds the
      descriptors the step that started it built (same rows, same predicates, same sizes).
      """
      # NOTE: with one m-tile the tile is 0: a static row0 keeps the whole-tile fallback (a tm of
      # all m rows that the granule does not divide) a static slice.
      tile_row0 = 0 if tiles_m == 1 else tile * tm
      # NOTE: the tile's local rows [lo, hi), relative to its first row. A visited tile holds
      # some (the grid skips the others); the one tile visited when the shard has no rows at all
      # (to write its empty groups) fetches nothing.
      lo = jnp.clip(rows_start - tile_row0, 0, tm)
      hi = jnp.clip(rows_end - tile_row0, 0, tm)
      some = hi > lo
      lo, hi = jnp.where(some, lo, 0), jnp.where(some, hi, 0)
      w_k0 = pl.multiple_of(k_idx * tk, tk)
      w_n0 = pl.multiple_of(n_idx * tn, tn)
      # NOTE: m is lhs's lane (last) dim: its rows move in lane granules of 128; rhs's m is its
      # sublane dim (8 rows of 32 bits). `common.window` keeps a window of a whole dim static.
      lhs_hi = jnp.minimum(hi, lhs_m - tile_row0) if lhs_tail else hi
      if transpose_lhs:
        lhs_hbm_rows = lambda start, size: lhs_hbm.at[  # noqa: E731
          common.window(start, size, m), common.window(w_k0, tk, k)
        ]
        lhs_vmem_rows = lambda off, size: lhs_vmem.at[slot, common.window(off, size, tm), :]  # noqa: E731
      else:
        lhs_hbm_rows = lambda start, size: lhs_hbm.at[  # noqa: E731
          common.window(w_k0, tk, k), common.window(start, size, m)
        ]
        lhs_vmem_rows = lambda off, size: lhs_vmem.at[slot, :, common.window(off, size, tm)]  # noqa: E731
      lhs_copies = common.tile_row_copies(
        hbm_rows=lhs_hbm_rows,
        vmem_rows=lhs_vmem_rows,
        sem=in_sems.at[0, slot],
        granule=lhs_granule,
        row0=tile_row0,
        lo=lo,
        hi=lhs_hi,
        tm=tm,
        m=lhs_m,
      )
      if lhs_tail:
        # NOTE: the tail columns [lhs_m, m), in m's last tile only, when the rows reach them.
        tail_src = lhs_hbm.at[common.window(w_k0, tk, k), pl.ds(lhs_m, lhs_tail)]
        tail_copy = pltpu.make_async_copy(tail_src, lhs_tail_vmem.at[slot], in_sems.at[0, slot])
        lhs_copies.append((hi > lhs_m - tile_row0, tail_copy))
      rhs_copies = common.tile_row_copies(
        hbm_rows=lambda start, size: rhs_hbm.at[
          common.window(start, size, m), common.window(w_n0, tn, n)
        ],
        vmem_rows=lambda off, size: rhs_vmem.at[slot, common.window(off, size, tm), :],
        sem=in_sems.at[1, slot],
        granule=rhs_granule,
        row0=tile_row0,
        lo=lo,
        hi=hi,
        tm=tm,
        m=m,
      )
      return lhs_copies, rhs_copies

    # NOTE: lhs and rhs are double-buffered along a chain of grid steps: with `sequential_sweeps`
    # the whole grid in order (one TensorCore runs it), without it each (k, n) sweep alone
    # (sweeps may run on different TensorCores: nothing is prefetched across them). Step c of
    # the chain reads slot c % 2; it prefetches step c + 1's rows into the other slot, which
    # step c - 1 read and is done with, and the chain's first step fetches its own (exposed).
    if sequential_sweeps:
      chain, chain_len = sweep * num_steps + step, tiles_k * tiles_n * num_steps
    else:
      chain, chain_len = step, num_steps
    slot = chain % 2

    def start_fetch(j, carry):
      # NOTE: the fetches of chain step chain + j: j = 0 only at the chain's start, j = 1 the
      # prefetch (the next tile, or with `sequential_sweeps` after a sweep's last step the next
      # sweep's first visited tile, with that sweep's k and n windows; sweeps run k-major, like
      # the grid). One loop body, so the kernel holds one copy of the row-chunk DMAs.
      c = chain + j
      if sequential_sweeps:
        c_sweep, c_step = c // num_steps, c % num_steps
        k_idx, n_idx = c_sweep // tiles_n, c_sweep % tiles_n
      else:
        c_step, k_idx, n_idx = c, k_i, n_i
      where = dict(tile=active_ref[0] + c_step, k_idx=k_idx, n_idx=n_idx, slot=c % 2)
      for copies in tile_fetches(**where):
        common.run_copies(copies, wait=False)
      return carry

    lax.fori_loop(
      jnp.where(chain == 0, 0, 1), jnp.where(chain + 1 < chain_len, 2, 1), start_fetch, 0
    )

    lhs_copies, rhs_copies = tile_fetches(tile=t, k_idx=k_i, n_idx=n_i, slot=slot)
    common.run_copies(lhs_copies, wait=True)
    common.run_copies(rhs_copies, wait=True)
    if lhs_tail:
      # NOTE: a static, 128-aligned offset into the slot: the tail's place in m's last tile.
      tail_at = lhs_m - (tiles_m - 1) * tm

      @pl.when(lhs_copies[-1][0])
      def _place_lhs_tail():
        lhs_vmem[slot, :, pl.ds(tail_at, lhs_tail)] = lhs_tail_vmem[slot]

    # NOTE: rows of the slots outside the fetched range hold other tiles' rows or uninitialized
    # memory (NaN under interpret mode): `product` reads them only masked (see its NOTEs).
    lhs_ref, rhs_ref = lhs_vmem.at[slot], rhs_vmem.at[slot]

    def out_copy(w):
      # NOTE: writes are numbered in issue order across sweeps, w = sweep * G + g (groups are
      # finalized in order within a sweep); write w uses staging slot w % 2.
      w_sweep, g = w // num_groups, w % num_groups
      w_k0 = pl.multiple_of((w_sweep // tiles_n) * tk, tk)
      w_n0 = pl.multiple_of((w_sweep % tiles_n) * tn, tn)
      dst = out_hbm.at[g, common.window(w_k0, tk, k), common.window(w_n0, tn, n)]
      return pltpu.make_async_copy(staging.at[w % 2], dst, sems.at[w % 2])

    if counts_ref is not None:
      counts_ref[k_i, n_i, t, 0] = 0
      counts_ref[k_i, n_i, t, 1] = 0
      # NOTE: the rows the step's DMAs moved (whoever started them): rhs rows, lhs columns.
      lhs_axis = 0 if transpose_lhs else 1
      for index, copies, axis in ((2, rhs_copies, 0), (3, lhs_copies, lhs_axis)):
        counts_ref[k_i, n_i, t, index] = sum(
          jnp.where(pred, desc.dst_ref.shape[axis], 0) for pred, desc in copies
        )

    def product(*, row: Any, subs: int, masked: bool, start: Any, end: Any) -> jax.Array:
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
      if subs == 1:
        # NOTE: a pass that would cross the tile's end is moved back to its last sub_m rows
        # (`common.pass_block`); the rows it shares with the group's previous pass are masked
        # (the caller's `start`), so no row is counted twice.
        r0, rows = common.pass_block(row, sub_m=sub_m, tm=tm, align=align)
      else:
        # NOTE: a run lies wholly inside the group and the tile; its rows are aligned to `align`,
        # which is what the lane (lhs) and sublane (rhs) slices need.
        r0 = pl.multiple_of(row, align)
        rows = pl.ds(r0, subs * sub_m)
      lhs_blk = lhs_ref[rows, :] if transpose_lhs else lhs_ref[:, rows]
      rhs_blk = rhs_ref[rows, :]
      if masked:
        # NOTE: rows are the contraction dim: only rows of the group contribute. Both operands
        # are masked: rows of the slot outside the fetched range (past m in a ragged last tile,
        # other shards' rows, a receive buffer's slack) hold stale or uninitialized data (NaN
        # under interpret mode) and 0 * NaN = NaN. An unmasked run reads only sub-blocks wholly
        # inside the group, which are fetched.
        lo = row0 + r0
        width = rhs_blk.shape[0]
        if transpose_lhs:
          lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (width, tk), 0)
        else:
          lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (tk, width), 1)
        rhs_rows = lo + lax.broadcasted_iota(jnp.int32, (width, tn), 0)
        lhs_blk = jnp.where((lhs_cols >= start) & (lhs_cols < end), lhs_blk, 0)
        rhs_blk = jnp.where((rhs_rows >= start) & (rhs_rows < end), rhs_blk, 0)
      # NOTE: lhs's rows are its dim 0 when transposed ([rows, tk]), else dim 1 ([tk, rows]).
      lhs_rows_dim = 0 if transpose_lhs else 1
      if rows_stationary:
        # NOTE: [rows, tn] contracted on its rows with lhs on its rows: [tn, tk].
        return lax.dot_general(
          rhs_blk.astype(compute_dtype),
          lhs_blk.astype(compute_dtype),
          dimension_numbers=(((0,), (lhs_rows_dim,)), ((), ())),
          preferred_element_type=jnp.float32,
        )
      return lax.dot_general(
        lhs_blk.astype(compute_dtype),
        rhs_blk.astype(compute_dtype),
        dimension_numbers=(((lhs_rows_dim,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
      )

    def group_body(g, carry):
      start = offsets_ref[g + goff_ref[0]]
      end = offsets_ref[g + goff_ref[0] + 1]
      nonempty = end > start
      # NOTE: the group's rows in this tile, local to it: [lo, hi).
      lo = jnp.maximum(start, row0) - row0
      hi = jnp.minimum(end, row0 + tm) - row0
      # NOTE: its passes: sub_m rows each from first_row, lo rounded down to `align`
      # (`metadata.group_passes`; pass p starts at first_row + p * sub_m).
      first_row, passes = metadata.group_passes(lo, hi, sub_m=sub_m, align=align)
      # NOTE: a group that started in an earlier tile (start < row0) carries its partial sum in
      # acc; one starting here writes its first pass's product (no zeroing pass).
      starts_here = start >= row0

      def pass_row(p):
        return first_row + p * sub_m

      def masked_from(p):
        # NOTE: rows before pass p's own first row were counted by pass p - 1 (or precede the
        # group); they matter only where pass p is moved back from the tile's end.
        return jnp.maximum(start, row0 + pass_row(p))

      # NOTE: an empty group computes nothing: its output is exact zeros (plus existing_out).
      @pl.when(jnp.logical_not(nonempty))
      def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

      @pl.when(nonempty & starts_here)
      def _first():
        acc_ref[...] = product(row=first_row, subs=1, masked=True, start=start, end=end)
        if counts_ref is not None:
          counts_ref[k_i, n_i, t, 0] += sub_m

      # NOTE: the passes left are [rest, passes). All but the group's last one lie wholly inside
      # it: pass 0 holds its first row and is taken above when the group starts here, or the
      # group started in an earlier tile (then lo = first_row = 0 and rest = 0). They go in runs
      # of `interior_subs` passes, one unmasked dot and one accumulator update per run; the rest
      # (fewer than a run, and the last pass when the group ends inside it) one masked pass at a
      # time. MXU rows are the same as one dot per pass.
      rest = starts_here.astype(jnp.int32)
      # NOTE: passes whose rows all precede hi; the last one is whole iff it ends at hi.
      whole_end = (hi - first_row) // sub_m
      if run_loop:
        runs = jnp.where(nonempty, jnp.maximum(whole_end - rest, 0) // interior_subs, 0)
      else:
        runs = 0
      edge0 = rest + runs * interior_subs

      if run_loop:

        def run_body(i, c):
          acc_ref[...] += product(
            row=pass_row(rest + i * interior_subs),
            subs=interior_subs,
            masked=False,
            start=start,
            end=end,
          )
          return c

        lax.fori_loop(0, runs, run_body, 0)

      def edge_body(p, c):
        acc_ref[...] += product(row=pass_row(p), subs=1, masked=True, start=masked_from(p), end=end)
        return c

      # NOTE: an empty group has no rows here (hi <= lo, its pass count is meaningless): its
      # range is made empty explicitly, like its run count above.
      edges_end = jnp.where(nonempty, passes, edge0)
      lax.fori_loop(edge0, edges_end, edge_body, 0)
      if counts_ref is not None:
        counts_ref[k_i, n_i, t, 0] += (runs * interior_subs + edges_end - edge0) * sub_m

      @pl.when(fin_ref[g] == t)
      def _finalize():
        w = sweep * num_groups + g
        # NOTE: the slot was last used by write w - 2; its DMA must be done before reuse. Without
        # `sequential_sweeps` every sweep drains its writes, so only g >= 2 has one in flight.
        in_flight = (w >= 2) if sequential_sweeps else (g >= 2)

        @pl.when(in_flight)
        def _wait_slot():
          out_copy(w - 2).wait()

        acc = acc_ref[...].T if rows_stationary else acc_ref[...]
        if existing_hbm is not None:
          src = existing_hbm.at[g, common.window(k0, tk, k), common.window(n0, tn, n)]
          read = pltpu.make_async_copy(src, ex_vmem, sems.at[2])
          read.start()
          read.wait()
          acc = acc + ex_vmem[...].astype(jnp.float32)
        staging[w % 2] = acc.astype(staging.dtype)
        out_copy(w).start()
        if counts_ref is not None:
          counts_ref[k_i, n_i, t, 1] += 1

      return carry

    lax.fori_loop(first_ref[t], last_ref[t] + 1, group_body, 0)

    # NOTE: every group is finalized by the last tile; drain the (at most two) writes in flight
    # so that no DMA is pending when the sweep (or, with `sequential_sweeps`, the grid) ends.
    last = pl.program_id(2) == pl.num_programs(2) - 1
    if sequential_sweeps:
      last = last & (sweep == tiles_k * tiles_n - 1)

    # NOTE: the writes in flight are the last two issued: of this sweep, or with
    # `sequential_sweeps` and a single group, of this sweep and the previous one.
    in_flight = tiles_k * tiles_n * num_groups if sequential_sweeps else num_groups

    @pl.when(last)
    def _drain():
      for back in (2, 1):
        if in_flight - back >= 0:
          out_copy((sweep + 1) * num_groups - back).wait()

  # NOTE: every operand stays in HBM: lhs and rhs rows are fetched by the kernel's own DMAs
  # (only the local rows of each visited tile), existing_out's block only when its group is
  # written.
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  operands, in_specs = common.present_operands(
    (lhs, any_spec), (rhs, any_spec), (existing_out, any_spec)
  )
  visited = jnp.arange(tiles_m) - groups.active_tiles[0]
  # NOTE: m-tiles run in order (a group's partial sum crosses tiles). Without `sequential_sweeps`
  # writes are drained at each sweep's end, so (k, n) sweeps are independent and may be split
  # across TensorCores; with it writes cross sweeps.
  return common.call_kernel(
    kernel,
    name="pallas_moe_tgmm_rowtile",
    grid=(tiles_k, tiles_n, groups.active_tiles[1]),
    prefetch=prefetch,
    operands=operands,
    in_specs=in_specs,
    out_shape=common.out_struct(
      (num_groups, k, n), out_dtype, lhs, rhs, group_sizes, group_offset, existing_out
    ),
    out_spec=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=[
      pltpu.VMEM((2, tm, tk) if transpose_lhs else (2, tk, tm), lhs.dtype),
      pltpu.VMEM((2, tm, tn), rhs.dtype),
      # NOTE: one semaphore per operand and slot: [lhs, rhs] x [slot 0, slot 1].
      pltpu.SemaphoreType.DMA((2, 2)),
      pltpu.VMEM((tn, tk) if rows_stationary else (tk, tn), jnp.float32),
      pltpu.VMEM((2, tk, tn), out_dtype),
      pltpu.VMEM((tk, tn), out_dtype),
      pltpu.SemaphoreType.DMA((3,)),
    ]
    + ([pltpu.VMEM((2, tk, lhs_tail), lhs.dtype)] if lhs_tail else []),
    dimension_semantics=("arbitrary",) * 3
    if sequential_sweeps
    else ("parallel", "parallel", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    # NOTE: the kernel moves only the local rows; their count is not static: the caller's
    # expectation, else all m rows (an upper bound).
    **tgmm_cost(
      lhs,
      rhs,
      None,
      None,
      m=m,
      k=k,
      n=n,
      rows=m if expected_rows is None else min(expected_rows, m),
      num_groups=num_groups,
      out_dtype=out_dtype,
      tiles=(tiles_k, tiles_n),
      has_existing=has_existing,
    ),
    interpret=interpret,
    counts_shape=(tiles_k, tiles_n, tiles_m, 4) if count_rows else None,
    # NOTE: counters of unvisited tiles are never written (and those tiles did no work).
    valid_counts=((visited >= 0) & (visited < groups.active_tiles[1]))[:, None],
  )
