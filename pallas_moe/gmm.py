"""Pallas TPU grouped matmul kernels: out[rows of g] = lhs[rows of g] @ rhs[g].

The raw (non-differentiable) kernels. `pallas_moe.ops.gmm` wraps them with a VJP and picks one per
call. As in megablox, the package exports the *function* `pallas_moe.gmm`, which shadows this
module's name as a package attribute: reach the module with `from pallas_moe.gmm import ...` or
`importlib.import_module("pallas_moe.gmm")`.

Two schedules compute the same thing:

- `gmm_rowtile_pallas` (the default when its blocks fit VMEM): grid (tiles_n, visited tiles), one
  step per m-tile that holds a row of a local group. Each step's [tm, k] lhs block (the whole k)
  is fetched, and its [tm, tn] output block written back, by manual DMAs double-buffered along
  the grid (the next step's lhs is fetched while this one computes; a write-back completes while
  the next step computes). They move only the tile's local rows, rounded out to the DMA granule
  (`common.tile_row_copies`): the first and last visited tiles of an expert-parallel receive
  buffer cost their real rows, not tm (the output's whole tile is written where its other rows
  must hold zeros or existing_out). rhs stays in HBM
  (`pl.ANY`): the step loops over the local groups whose rows meet its tile
  (`metadata.make_tile_groups`) and multiplies only their MXU-row sub-blocks. Each group's [k, tn]
  weight block is DMA'd into one of two VMEM slots once per n-tile: a group that spans several
  m-tiles keeps its slot, and the next group's block is fetched while the current group computes
  (double buffering across groups and grid steps). So weights are read exactly once per n-tile, lhs
  once per n-tile, the output written once. With `rows_stationary` each sub-block computes out^T =
  w^T @ x^T: the rows are the MXU's stationary operand and the tn weight columns stream through it,
  so a tn that the MXU width does not divide (1408 on v6e's 256-wide MXU) is not padded to it (1.09x
  fewer MXU passes there).
  Rows outside the visited tiles (other shards' rows; rows past sum(group_sizes), the slack of an
  expert-parallel receive buffer) cost no grid step, no lhs fetch, no MXU pass and no output
  write in this kernel (nor do a visited tile's rows outside the local rows' DMA granules, but
  for the write-back of a tile whose other rows must hold zeros or existing_out): its output
  aliases a base buffer that already holds their values. With `existing_out` that buffer is
  existing_out itself (untouched: 0 bytes; the first and last visited tiles read their few
  foreign rows from it). Without, `_zeros_outside_active` makes it: one grid step that DMAs
  zeros over exactly those rows, i.e. (m - visited rows) x n x itemsize bytes written once at
  HBM bandwidth, and nothing else. With `fill_unowned=False` (the MoE block) there is no base
  buffer and nothing is written outside the local rows' granules.
- `gmm_pallas` (any tiles, quantized operands): grid (tiles_n, visits, tiles_k). The visit axis
  walks the schedule of `metadata.make_schedule`; k is innermost so one f32 accumulator block
  collects a visit's dot products. Every m-tile of the output is visited, so the kernel alone
  writes the whole output: rows of the local groups get the product, every other row gets
  `existing_out` or exact zeros.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import common, metadata

# ------------------------------------------------------------------------------------------------
# Visit schedule: one grid step per (group, m-tile) visit and k-tile.
# ------------------------------------------------------------------------------------------------


def _dot_dims(transpose_rhs: bool):
  # NOTE: rhs blocks are [tk, tn], or [tn, tk] when transposed; contract lhs's k with rhs's k.
  return (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))


def _mask_k(x: jax.Array, *, valid_k: int, axis: int) -> jax.Array:
  """Zeros the columns (along `axis`) past `valid_k` of a ragged last k-tile.

  NOTE: the part of an edge block outside the array holds whatever was in VMEM (NaN under
  interpret mode's poisoning). Both operands are masked: 0 * NaN would still be NaN.
  """
  k_ids = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where(k_ids < valid_k, x, jnp.zeros_like(x))


def _prepare(
  lhs, rhs, *, transpose_rhs, rhs_scales, lhs_scales, scales_on_k, narrow_dot, tm, sub_m
):
  """Checks what both gmm kernels share and derives their shapes and dot dtypes.

  Returns:
    (m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype).
  """
  m, k = lhs.shape
  num_local_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  sub_m = common.check_sub_m(sub_m, tm)
  # NOTE: per-output-column scales are [G, 1, n] in either layout; scales along the contraction
  # (the lhs-gradient pass) keep rhs's shape with its n axis reduced to 1.
  if rhs_scales is not None:
    if scales_on_k:
      want = (num_local_groups, 1, k) if transpose_rhs else (num_local_groups, k, 1)
    else:
      want = (num_local_groups, 1, n)
    if tuple(rhs_scales.shape) != want:
      raise ValueError(f"rhs_scales has shape {tuple(rhs_scales.shape)}, expected {want}.")
  if lhs_scales is not None and tuple(lhs_scales.shape) != (m, 1):
    raise ValueError(f"lhs_scales has shape {tuple(lhs_scales.shape)}, expected {(m, 1)}.")
  compute_dtype, dot_acc_dtype = common.dot_dtypes(
    lhs.dtype,
    rhs.dtype,
    lhs_quantized=lhs_scales is not None,
    rhs_quantized=rhs_scales is not None,
    narrow_dot=narrow_dot,
    scales_allow_narrow=not scales_on_k,
    scales_requirement=" and per-output-column rhs scales (not scales_on_k)",
  )
  return m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype


def _f32(scales: jax.Array | None) -> jax.Array | None:
  """Scales as the kernels read them (f32), or None when the operand is not quantized."""
  return None if scales is None else scales.astype(jnp.float32)


# NOTE: bytes of the zero block `_zeros_outside_active` DMAs from, and the DMAs it keeps in flight.
_ZERO_BLOCK_BYTES = 1 << 20
_ZERO_DMA_DEPTH = 8


def _zeros_outside_active(active_tiles, *, rows, n, tm, dtype, interpret, vary_like):
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


def _result_and_cost(
  lhs,
  rhs,
  rhs_scales,
  lhs_scales,
  existing_out,
  others,
  *,
  n,
  out_dtype,
  tiles_n,
  rows=None,
  whole_output=False,
  visit_tiles=None,
):
  """`common.call_kernel`'s result and cost arguments, shared by both gmm kernels.

  The result is [m, n] (aliasing existing_out when compiled). XLA's cost estimate is the work
  on `rows` rows (the caller's `expected_rows`; None: all m): flops 2 * rows * k * n; lhs's
  rows and their scales once per n-tile, rhs and its scales once, the output rows once (all m
  rows with `whole_output`, the visit kernel, which writes every tile; with existing_out all of
  it read and written). `others` are the remaining operands the result varies with (group
  sizes, offset).

  `visit_tiles=(tm, tk)`: the visit kernel's tiles. Where tk < k its k-tiles change at every
  grid step, so each visit fetches its [tm, k] lhs rows and its group's [k, tn] weights anew:
  per n-tile, `metadata.max_visits` visits of `rows` rows each read tm * k of lhs and k * tn of
  rhs (megablox's kernel, which visits the same way, declares about this too).
  """
  m, k = lhs.shape
  rows = m if rows is None else min(rows, m)
  has_existing = existing_out is not None
  operands = (lhs, rhs, *others, existing_out, rhs_scales, lhs_scales)
  out_bytes = jnp.dtype(out_dtype).itemsize * n
  lhs_rows, rhs_reads = rows, 1
  if visit_tiles is not None and visit_tiles[1] < k:
    tm = visit_tiles[0]
    # NOTE: the visits of `rows` rows: one per m-tile they cover plus at most one per group
    # whose first tile is shared with the previous group.
    visits = metadata.max_visits(m=rows, tm=tm, num_local_groups=rhs.shape[0])
    lhs_rows = visits * tm
    # NOTE: rhs.size is every group's k * n once; a visit reads its group's k * n (k * tn in
    # each of the n-tiles).
    rhs_reads = visits / rhs.shape[0]
  return dict(
    out_shape=common.out_struct((m, n), out_dtype, *operands),
    flops=2 * rows * k * n,
    bytes_accessed=lhs_rows * k * lhs.dtype.itemsize * tiles_n
    + int(rhs.size * rhs.dtype.itemsize * rhs_reads)
    + (rhs_scales.size * 4 if rhs_scales is not None else 0)
    + (lhs_rows * 4 * tiles_n if lhs_scales is not None else 0)
    + (2 * m * out_bytes if has_existing else (m if whole_output else rows) * out_bytes),
    alias_last_operand=has_existing,
  )


def gmm_pallas(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  tiling: tuple[int, int, int],
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
  expected_rows: int | None = None,
  fill_unowned: bool = True,
  count_rows: bool = False,
  interpret: common.Interpret = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Runs the gmm kernel on validated arguments.

  Args:
    lhs: [m, k].
    rhs: [num_local_groups, k, n], or [num_local_groups, n, k] with `transpose_rhs`.
    group_sizes: [num_groups_total] int32.
    tiling: (tm, tk, tn), already clamped to the dims and aligned.
    out_dtype: dtype of the result.
    group_offset: [] int32, the first global group that rhs holds.
    existing_out: optional [m, n] of `out_dtype`; rows outside the local groups keep its values.
    transpose_rhs: whether rhs is [G, n, k].
    rhs_scales: optional f32 dequantization scales of a quantized (int8 / fp8) rhs. The rhs block
      is upcast to the compute dtype (lhs's) in VMEM, on every TPU generation. Per output column
      (default): [G, 1, n] in either layout; each partial product is scaled per column before it
      is accumulated. With `scales_on_k` (per contraction row, the lhs-gradient pass): rhs's shape
      with the n axis reduced to 1, [G, k, 1] or [G, 1, k] with `transpose_rhs`; the upcast rhs
      block is scaled before the dot.
    scales_on_k: see `rhs_scales`.
    lhs_scales: optional [m, 1] f32 per-row dequantization scales of a quantized (int8 / fp8)
      lhs. A per-row scale factors out of the k contraction, so it multiplies each partial
      product (like per-column rhs scales), never the operand.
    narrow_dot: both operands quantized with the same dtype and per-channel scales: the dot runs
      on the narrow values (int8 x int8 with int32 results, fp8 x fp8 with f32 results), the
      MXU's native mode where the generation has one. False: quantized operands are upcast in
      VMEM (to bf16 when both are quantized: exact for int8 and e4m3 values).
    sub_m: rows per MXU pass; sub-blocks of the m-tile outside the visit's group are skipped.
      Must divide tm. None: the whole tile (no skipping).
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the call (None: Mosaic's default).
    expected_rows: the rows the caller expects sum(group_sizes) to be; the cost estimate XLA
      gets counts the work on those rows, not on all m. None: m.
    fill_unowned: visit every m-tile holding no local row to write its output block (zeros,
      or existing_out's rows). False (`gmm(..., unowned_rows="undefined")` without existing_out):
      those tiles cost no grid step and are left unwritten, e.g. a receive buffer's slack.
    count_rows: instrumentation for interpret mode: also return [tiles_n, max_visits] int32 rows
      pushed through the MXU per (n-tile, visit) for one sweep over k.
    interpret: see `common.run_kernel`.

  Returns:
    [m, n] of `out_dtype` (and the row counts with `count_rows`).
  """
  tm, tk, tn = tiling
  m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype = _prepare(
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
  tiles_n, tiles_k = metadata.cdiv(n, tn), metadata.cdiv(k, tk)
  k_rem = k % tk
  quantized = rhs_scales is not None
  lhs_quantized = lhs_scales is not None

  schedule = metadata.make_schedule(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=num_local_groups,
    m=m,
    tm=tm,
    fill_uncovered_tiles=fill_unowned or existing_out is not None,
    visit_empty_groups=False,
  )
  prefetch = (
    schedule.group_offsets,
    schedule.visit_group,
    schedule.visit_m_tile,
    schedule.visit_load_tile,
    schedule.visit_active,
    group_offset.reshape((1,)),
  )
  has_existing = existing_out is not None
  present = (True, True, quantized, lhs_quantized, has_existing)

  def kernel(offsets_ref, group_ref, m_tile_ref, _load_ref, active_ref, goff_ref, *refs):
    ins, outs, (acc_ref,) = common.split_refs(
      refs, inputs=present, outputs=1 + count_rows, scratch=1
    )
    lhs_ref, rhs_ref, scales_ref, lhs_scales_ref, existing_ref = ins
    out_ref, rows_ref = outs[0], (outs[1] if count_rows else None)
    n_i, visit, k_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    active = active_ref[visit] == 1
    group = group_ref[visit] + goff_ref[0]
    # NOTE: rows of this tile inside [start, end) belong to the visit's group.
    start, end = offsets_ref[group], offsets_ref[group + 1]
    row0 = m_tile_ref[visit] * tm

    @pl.when(k_i == 0)
    def _zero_acc():
      acc_ref[...] = jnp.zeros_like(acc_ref)
      if rows_ref is not None:
        rows_ref[n_i, visit] = 0

    # NOTE: the tile is multiplied in sub-blocks of sub_m rows (the MXU's row granularity), and
    # only the sub-blocks holding rows of the visit's group: first_sub .. last_sub. A tile that
    # straddles group boundaries costs each group only the sub-blocks it touches.
    first_sub = jnp.maximum(start - row0, 0) // sub_m
    last_sub = (jnp.minimum(end, row0 + tm) - 1 - row0) // sub_m

    def accumulate(last_k: bool):
      def body(sub, carry):
        _, rows = common.sub_block(sub, sub_m, tm)
        lhs_blk, rhs_blk = lhs_ref[rows, :], rhs_ref[...]
        if lhs_quantized and not narrow_dot:
          lhs_blk = lhs_blk.astype(jnp.float32).astype(compute_dtype)
        if quantized and not narrow_dot:
          rhs_blk = rhs_blk.astype(jnp.float32)
          if scales_on_k:
            # NOTE: scales [tk, 1] (or [1, tk] transposed) broadcast along rhs's k axis. Scaled
            # before the ragged-k mask, so garbage scales past k are zeroed with the values.
            rhs_blk = rhs_blk * scales_ref[...]
          rhs_blk = rhs_blk.astype(compute_dtype)
        if last_k and k_rem:
          lhs_blk = _mask_k(lhs_blk, valid_k=k_rem, axis=1)
          rhs_blk = _mask_k(rhs_blk, valid_k=k_rem, axis=1 if transpose_rhs else 0)
        prod = lax.dot_general(
          lhs_blk.astype(compute_dtype),
          rhs_blk.astype(compute_dtype),
          dimension_numbers=_dot_dims(transpose_rhs),
          preferred_element_type=dot_acc_dtype,
        ).astype(jnp.float32)
        if quantized and not scales_on_k:
          # NOTE: one scale per output column: dot(lhs, q) * s[None, :] == dot(lhs, q * s).
          prod = prod * scales_ref[...]
        if lhs_quantized:
          # NOTE: one scale per row [sub_m, 1]: dot(diag(s) q, w) == diag(s) dot(q, w). Rows of a
          # ragged last m-tile may hold garbage scales; the store keeps only the group's rows.
          prod = prod * lhs_scales_ref[rows, :]
        acc_ref[rows, :] += prod
        return carry

      lax.fori_loop(first_sub, last_sub + 1, body, 0)

    if k_rem:
      pl.when(active & (k_i == tiles_k - 1))(functools.partial(accumulate, True))
      pl.when(active & (k_i != tiles_k - 1))(functools.partial(accumulate, False))
    else:
      pl.when(active)(functools.partial(accumulate, False))
    if rows_ref is not None:

      @pl.when(active & (k_i == 0))
      def _count():
        rows_ref[n_i, visit] += (last_sub + 1 - first_sub) * sub_m

    @pl.when(k_i == tiles_k - 1)
    def _store():
      m_tile = m_tile_ref[visit]
      # NOTE: visits of an m-tile are consecutive; the first one starts the output block from
      # existing_out (or zeros), later ones add their group's rows to what is already there.
      prev_tile = m_tile_ref[jnp.maximum(visit - 1, 0)]
      first = (visit == 0) | (prev_tile != m_tile)
      rows = row0 + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
      mine = active & (rows >= start) & (rows < end)
      if existing_ref is None:
        fresh = jnp.zeros((tm, tn), jnp.float32)
      else:
        fresh = existing_ref[...].astype(jnp.float32)
      base = jnp.where(first, fresh, out_ref[...].astype(jnp.float32))
      out_ref[...] = jnp.where(mine, acc_ref[...], base).astype(out_ref.dtype)

  # Index maps get (n_i, visit, k_i, *prefetch refs).
  def lhs_map(n_i, visit, k_i, offsets, group, m_tile, load_tile, active, goff):
    # NOTE: non-computing visits pin k to 0 and load the first compute visit's tile, so their
    # block index never changes and they trigger no DMA.
    return load_tile[visit], k_i * active[visit]

  def rhs_map(n_i, visit, k_i, offsets, group, m_tile, load_tile, active, goff):
    # NOTE: rhs holds only the local groups; visit_group is already local.
    k_blk = k_i * active[visit]
    if transpose_rhs:
      return group[visit], n_i, k_blk
    return group[visit], k_blk, n_i

  def scales_map(n_i, visit, k_i, offsets, group, m_tile, load_tile, active, goff):
    if not scales_on_k:
      return group[visit], 0, n_i
    k_blk = k_i * active[visit]
    return (group[visit], 0, k_blk) if transpose_rhs else (group[visit], k_blk, 0)

  def lhs_scales_map(n_i, visit, k_i, offsets, group, m_tile, load_tile, active, goff):
    # NOTE: follows lhs's m block (not k: one scale spans the whole row), so it is fetched once
    # per m-tile and, like lhs, never for non-computing visits.
    return load_tile[visit], 0

  def out_map(n_i, visit, k_i, offsets, group, m_tile, load_tile, active, goff):
    return m_tile[visit], n_i

  rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
  if scales_on_k:
    scales_block = (None, 1, tk) if transpose_rhs else (None, tk, 1)
  else:
    scales_block = (None, 1, tn)
  operands, in_specs = common.present_operands(
    (lhs, pl.BlockSpec((tm, tk), lhs_map)),
    (rhs, pl.BlockSpec(rhs_block, rhs_map)),
    (_f32(rhs_scales), pl.BlockSpec(scales_block, scales_map)),
    (_f32(lhs_scales), pl.BlockSpec((tm, 1), lhs_scales_map)),
    (existing_out, pl.BlockSpec((tm, tn), out_map)),
  )

  return common.call_kernel(
    kernel,
    name="pallas_moe_gmm",
    grid=(tiles_n, schedule.num_visits, tiles_k),
    prefetch=prefetch,
    operands=operands,
    in_specs=in_specs,
    out_spec=pl.BlockSpec((tm, tn), out_map),
    scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    dimension_semantics=("parallel", "arbitrary", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
    **_result_and_cost(
      lhs,
      rhs,
      rhs_scales,
      lhs_scales,
      existing_out,
      (group_sizes, group_offset),
      n=n,
      out_dtype=out_dtype,
      tiles_n=tiles_n,
      rows=expected_rows,
      whole_output=fill_unowned,
      visit_tiles=(tm, tk),
    ),
    counts_shape=(tiles_n, schedule.max_visits) if count_rows else None,
    valid_counts=jnp.arange(schedule.max_visits) < schedule.num_visits,
  )


# ------------------------------------------------------------------------------------------------
# Row-tile schedule: one grid step per m-tile; weights streamed per group by manual DMA.
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
  count_rows: bool = False,
  interpret: common.Interpret = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Runs the row-tile gmm kernel on validated arguments.

  The kernel moves lhs row blocks, group weights and output blocks by manual DMA, each
  double-buffered. The first lhs block of a chain of grid steps (which nothing overlaps) arrives
  in chunks (`metadata.ramp_chunk_rows`: at most 8 per tile, at least one pass each), and each
  pass waits only for the chunks holding its rows, so the MXU starts after one chunk and the
  first group's weights, not after the whole block.

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
      (written by `_zeros_outside_active`; the visited tiles' other rows by this kernel). False
      leaves every row outside the local rows (rounded out to the output's DMA granule, which
      get zeros) undefined, at no cost: for callers that never read them (the MoE block's
      receive buffer).
    pass_cuts: cut the m-tiles on the groups' pass grids (`metadata.make_pass_cut_tiles`) instead
      of every tm rows: a group spanning several tiles then pays no partial pass at a tile
      boundary, for a few more (shorter) tiles. None: where it can save MXU work
      (`metadata.uses_pass_cuts`).
    count_rows: interpret-mode instrumentation: also return [tiles_n, tiles, 4] int32 per grid
      step: rows pushed through the MXU, weight blocks loaded, lhs rows fetched (0 when the
      tile's block is kept from an earlier step) and output rows written back. Tiles are the
      m-tiles, or with pass cuts the cut tiles in order (`metadata.max_pass_cut_tiles`).
    interpret: see `common.run_kernel`.

  Returns:
    [m, n] of `out_dtype` (and the counts with `count_rows`).
  """
  m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype = _prepare(
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
  tiles_n, tiles_m = n // tn, metadata.cdiv(m, tm)
  # NOTE: lhs rows move in DMA granules (`common.tile_row_copies`); an m that is not a multiple
  # of the granule (8 rows of f32, 16 of bf16) is padded, at the cost of one copy of lhs, since
  # Mosaic rejects some VMEM slices of m % granule rows. Local rows end at or before m, so the
  # padding rows are never read into a product.
  lhs_granule = common.row_granule(lhs.dtype)
  lhs_rows = m
  if tm % lhs_granule == 0:
    # NOTE: (a tm of all m rows that the granule does not divide moves its tile whole instead.)
    lhs_rows = -(-m // lhs_granule) * lhs_granule
  if lhs_rows != m:
    lhs = jnp.pad(lhs, ((0, lhs_rows - m), (0, 0)))
  quantized, lhs_quantized = rhs_scales is not None, lhs_scales is not None
  upcast = quantized and not narrow_dot
  # NOTE: the weights the dot reads, prepared once per group load: upcast (quantized) and/or
  # transposed to [tn, k] (rows_stationary with [k, tn] blocks). Otherwise it reads the slot.
  prepare = upcast or (rows_stationary and not transpose_rhs)
  if scales_on_k:
    s_block = (1, k) if transpose_rhs else (k, 1)
  else:
    s_block = (1, tn)
  groups = metadata.make_tile_groups(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=num_local_groups,
    m=m,
    tm=tm,
    finalize_empty_groups=False,
  )
  has_existing = existing_out is not None
  aliased = has_existing or fill_unowned
  # NOTE: where the rows of a visited tile outside the local rows must hold zeros or
  # existing_out's values, the whole tile is written back; otherwise only the local rows.
  write_whole_tiles = aliased
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
  first_group, last_group, active = (
    groups.tile_first_group,
    groups.tile_last_group,
    groups.active_tiles,
  )
  cut_arrays = ()
  count_tiles = tiles_m
  if pass_cuts:
    cuts = metadata.make_pass_cut_tiles(
      groups,
      group_offset=group_offset,
      m=m,
      tm=tm,
      sub_m=sub_m,
      align=align,
      write_whole_tiles=write_whole_tiles,
    )
    # NOTE: grid step s is cut tile s (active = (0, tiles used)).
    first_group, last_group = cuts.tile_first_group, cuts.tile_last_group
    active = jnp.concatenate([jnp.zeros((1,), jnp.int32), cuts.num_tiles])
    cut_arrays = (cuts.tile_start, cuts.tile_reach)
    count_tiles = cuts.tile_reach.shape[0]
  ramp_rows = metadata.ramp_chunk_rows(tm=tm, sub_m=sub_m, granule=lhs_granule)
  ramp_chunks = metadata.cdiv(tm, ramp_rows) if ramp_rows else 0
  prefetch = (
    groups.group_offsets,
    first_group,
    last_group,
    groups.load_rank,
    groups.load_group,
    groups.num_loads,
    active,
    group_offset.reshape((1,)),
    *cut_arrays,
  )
  # NOTE: the output is padded (and the result sliced back to m rows) for the TPU simulator,
  # whose aliased outputs must not have a ragged last block (jax 0.10.2: "Out-of-bounds block
  # index"), and to a multiple of the output's DMA granule: Mosaic rejects a write-back from a
  # VMEM slice of m % granule rows at some widths (v5e, n = 200), so an m that is not a multiple
  # of 8 rows (f32; 16 bf16) costs one copy of the output.
  simulated = isinstance(interpret, pltpu.InterpretParams)
  out_rows = m
  if simulated and aliased:
    out_rows = tiles_m * tm
  elif tm % out_granule == 0:
    out_rows = -(-m // out_granule) * out_granule
  base = None
  if has_existing:
    base = existing_out
    if out_rows != m:
      base = jnp.pad(existing_out, ((0, out_rows - m), (0, 0)))
  elif fill_unowned:
    base = _zeros_outside_active(
      groups.active_tiles,
      rows=out_rows,
      n=n,
      tm=tm,
      dtype=out_dtype,
      interpret=interpret,
      vary_like=(lhs, rhs, group_sizes, group_offset, rhs_scales, lhs_scales),
    )
  present = (True, True, quantized, lhs_quantized, aliased)
  w_block = (tn, k) if transpose_rhs else (k, tn)
  prep_block = (tn, k) if rows_stationary else w_block
  # NOTE: rhs blocks are [k, tn], or [tn, k] when transposed; contract lhs's k with rhs's k. With
  # rows_stationary the weights are the dot's lhs as [tn, k] and lhs its transposed rhs.
  if rows_stationary:
    dims = (((1,), (1,)), ((), ()))
  else:
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

  def kernel(
    offsets_ref, first_ref, last_ref, rank_ref, load_ref, nloads_ref, active_ref, goff_ref, *refs
  ):
    if pass_cuts:
      (tstart_ref, reach_ref), refs = refs[:2], refs[2:]
    ins, outs, scratch = common.split_refs(
      refs,
      inputs=present,
      outputs=1 + count_rows,
      scratch=5 + quantized + prepare + 2 * bool(ramp_chunks),
    )
    if ramp_chunks:
      (ramp_sems, ready_ref), scratch = scratch[-2:], scratch[:-2]
    lhs_hbm, rhs_hbm, scales_hbm, lhs_scales_ref, base_hbm = ins
    out_hbm, counts_ref = outs[0], (outs[1] if count_rows else None)
    w_vmem, sems = scratch[0], scratch[1]
    s_vmem = scratch[2] if quantized else None
    w_prep = scratch[2 + quantized] if prepare else None
    lhs_vmem, out_vmem, io_sems = scratch[-3:]
    # NOTE: the grid visits only the tiles holding local rows (`active_tiles`); t is the m-tile.
    n_i, step = pl.program_id(0), pl.program_id(1)
    num_steps = active_ref[1]
    t = active_ref[0] + step
    rows_start = offsets_ref[goff_ref[0]]
    rows_end = offsets_ref[goff_ref[0] + num_local_groups]

    def tile_rows(tile):
      # NOTE: (first row, end of the rows written back) of a tile: every tm rows, or the cuts.
      if pass_cuts:
        return pl.multiple_of(tstart_ref[tile], align), tstart_ref[tile + 1]
      return tile * tm, tile * tm + tm

    row0, row_end = tile_rows(t)

    # NOTE: lhs blocks and output blocks move by manual DMA, double-buffered along a chain of
    # grid steps: the whole grid with `sequential_sweeps` (one core runs it in order), else each
    # n sweep (sweeps may run on different TensorCores, so nothing is prefetched across them).
    if sequential_sweeps:
      chain, chain_len = n_i * num_steps + step, tiles_n * num_steps
    else:
      chain, chain_len = step, num_steps
    slot = chain % 2
    # NOTE: lhs does not depend on the n-tile: with one visited tile its block is fetched once
    # per chain and kept in slot 0 (as the pipeline kept a block whose index did not change).
    lhs_slot = jnp.where(num_steps > 1, slot, 0)

    def local_rows(tile):
      # NOTE: rows [lo, hi) of `tile`, relative to its first row, that hold local rows: all of
      # them but in the first and last visited tiles (other shards' rows, a receive buffer's
      # slack past sum(group_sizes)). With pass cuts: the rows its passes read, which end at its
      # last group's last pass (past its written rows when that pass reaches into the next tile).
      r0, _ = tile_rows(tile)
      if pass_cuts:
        return r0, jnp.maximum(rows_start - r0, 0), reach_ref[tile] - r0
      return r0, jnp.maximum(rows_start - r0, 0), jnp.minimum(rows_end - r0, tm)

    def written_rows(tile):
      # NOTE: rows [lo, hi) of `tile` written back: the local ones when the rest are undefined,
      # else the whole tile (zeros or existing_out there are part of the result). A cut tile
      # writes up to the next cut (the rows its last pass computes past it are carried over to
      # the next tile), and the metadata ends the last one where the output ends.
      r0, end = tile_rows(tile)
      lo = jnp.maximum(rows_start - r0, 0)
      if pass_cuts:
        hi = end - r0
      elif write_whole_tiles:
        hi = jnp.minimum(tm, out_rows - r0)
      else:
        hi = jnp.minimum(rows_end - r0, tm)
      return r0, (0 * lo if write_whole_tiles else lo), hi

    def lhs_copies(tile, into, chunk=None):
      r0, lo, hi = local_rows(tile)
      sem = io_sems.at[into]
      if chunk is not None:
        # NOTE: ramp chunk `chunk` of the tile: its rows [chunk, chunk + 1) x ramp_rows, clipped
        # to the local ones (an empty range moves nothing), on its own semaphore.
        lo = jnp.maximum(lo, chunk * ramp_rows)
        hi = jnp.minimum(hi, (chunk + 1) * ramp_rows)
        sem = ramp_sems.at[chunk]
      return common.tile_row_copies(
        hbm_rows=lambda start, size: lhs_hbm.at[pl.ds(start, size)],
        vmem_rows=lambda off, size: lhs_vmem.at[into, pl.ds(off, size)],
        sem=sem,
        row0=r0,
        lo=lo,
        hi=hi,
        tm=tm,
        m=lhs_rows,
        granule=lhs_granule,
      )

    def out_copies(c):
      # NOTE: the write-back of chain step c (from out slot c % 2): its tile and n-tile follow
      # from c as the grid's order does. Rows: the tile's local rows when the rest are
      # undefined, else the whole tile (zeros or existing_out there are part of the result).
      if sequential_sweeps:
        c_tile, c_col = active_ref[0] + c % num_steps, c // num_steps
      else:
        c_tile, c_col = active_ref[0] + c, n_i
      r0, lo, hi = written_rows(c_tile)
      col = pl.multiple_of(c_col * tn, tn)
      return common.tile_row_copies(
        hbm_rows=lambda start, size: out_hbm.at[pl.ds(start, size), common.window(col, tn, n)],
        vmem_rows=lambda off, size: out_vmem.at[c % 2, pl.ds(off, size)],
        sem=io_sems.at[2 + c % 2],
        row0=r0,
        lo=lo,
        hi=hi,
        tm=tm,
        m=out_rows,
        granule=out_granule,
        to_hbm=True,
      )

    # NOTE: this step's lhs rows were prefetched by the previous step of the chain; the chain's
    # first step fetches its own (exposed). Then the next step's are started into the other slot
    # (the next tile, or with `sequential_sweeps` the next sweep's first tile) while this one
    # computes. A single visited tile is fetched once per chain and not again.
    if sequential_sweeps:
      fetched = (chain == 0) | (num_steps > 1)
    else:
      fetched = True

    def start_fetch(j, carry):
      # NOTE: the fetch for chain step chain + j (j = 0 only at the chain's start, j = 1 the
      # prefetch): one loop body, so the kernel holds one copy of the row-chunk DMAs.
      tile = active_ref[0] + (step + j) % num_steps
      common.run_copies(lhs_copies(tile, jnp.where(num_steps > 1, (chain + j) % 2, 0)), wait=False)
      return carry

    prefetch = (num_steps > 1) & (chain + 1 < chain_len)
    if not ramp_chunks:
      lax.fori_loop(jnp.where(chain == 0, 0, 1), jnp.where(prefetch, 2, 1), start_fetch, 0)

    out_ref = out_vmem.at[slot]

    def slot_of(rank, sweep):
      # NOTE: loads alternate between the two slots in the order they are issued, counted
      # across n-tiles (sweep * num_loads + rank): with `sequential_sweeps` the next n-tile's
      # first load lands in the slot the current n-tile's last group does not use.
      return (sweep * nloads_ref[0] + rank) % 2

    def weight_copies(rank, sweep):
      # NOTE: load `rank` (the rank-th non-empty local group) of n-tile `sweep`.
      slot = slot_of(rank, sweep)
      group = load_ref[rank]
      col = pl.multiple_of(sweep * tn, tn)
      src = (
        rhs_hbm.at[group, common.window(col, tn, n), :]
        if transpose_rhs
        else rhs_hbm.at[group, :, common.window(col, tn, n)]
      )
      copies = [pltpu.make_async_copy(src, w_vmem.at[slot], sems.at[slot])]
      if quantized:
        if scales_on_k:
          s_src = scales_hbm.at[group]
        else:
          s_src = scales_hbm.at[group, :, common.window(col, tn, n)]
        copies.append(pltpu.make_async_copy(s_src, s_vmem.at[slot], sems.at[2 + slot]))
      return copies

    def start_load(rank, sweep):
      for c in weight_copies(rank, sweep):
        c.start()

    def wait_load(rank, sweep):
      for c in weight_copies(rank, sweep):
        c.wait()

    if ramp_chunks:
      # NOTE: the chain's first tile is fetched in chunks of ramp_rows rows, each waited for by
      # the first pass that reads it (`segment`), so the MXU starts after one chunk instead of
      # the whole block. Issue order is the order of need: the first chunk, the first group's
      # weights (loaded here rather than when that group starts, `_load`), the other chunks,
      # then the next tile's prefetch.
      def start_chunk(c, carry):
        common.run_copies(lhs_copies(t, 0, chunk=c), wait=False)
        return carry

      @pl.when(chain == 0)
      def _ramp():
        start_chunk(0, 0)

        @pl.when(nloads_ref[0] > 0)
        def _first_load():
          start_load(0, n_i)

        lax.fori_loop(1, ramp_chunks, start_chunk, 0)

      ready_ref[0] = jnp.where(chain == 0, 0, ramp_chunks)
      lax.fori_loop(1, jnp.where(prefetch, 2, 1), start_fetch, 0)

    # NOTE: the output block starts as existing_out (or zeros); each group overwrites its rows.
    # Rows of other shards' groups and rows past sum(group_sizes) keep this value. Only the first
    # and last visited tiles can hold such rows (the local rows are contiguous); unvisited tiles
    # keep the aliased base buffer: existing_out, or zeros written by `_zeros_outside_active`.
    out_ref[...] = jnp.zeros((tm, tn), out_dtype)
    if has_existing and pass_cuts:
      # NOTE: a cut tile whose written rows include rows outside the local ones (the first and
      # last) starts them as existing_out's, DMA'd from the aliased buffer.
      r0, lo, hi = written_rows(t)
      col = pl.multiple_of(n_i * tn, tn)
      reads = common.tile_row_copies(
        hbm_rows=lambda start, size: base_hbm.at[pl.ds(start, size), common.window(col, tn, n)],
        vmem_rows=lambda off, size: out_ref.at[pl.ds(off, size)],
        sem=sems.at[2 + 2 * quantized],
        row0=r0,
        lo=lo,
        hi=hi,
        tm=tm,
        m=out_rows,
        granule=out_granule,
      )

      @pl.when((row0 < rows_start) | (row_end > rows_end))
      def _read_base():
        common.run_copies(reads, wait=False)
        common.run_copies(reads, wait=True)

    elif has_existing:
      rows_start = offsets_ref[goff_ref[0]]
      rows_end = offsets_ref[goff_ref[0] + num_local_groups]
      col = pl.multiple_of(n_i * tn, tn)

      def read_base(rows):
        # NOTE: existing_out's rows of this tile, DMA'd from the aliased buffer before the
        # pipeline writes the tile back; a ragged last tile reads its static row count.
        src = base_hbm.at[pl.ds(row0, rows), common.window(col, tn, n)]
        copy = pltpu.make_async_copy(src, out_ref.at[:rows], sems.at[2 + 2 * quantized])
        copy.start()
        copy.wait()

      partial = (row0 < rows_start) | (row0 + tm > rows_end)
      last_rows = out_rows - (tiles_m - 1) * tm
      if last_rows == tm:
        pl.when(partial)(lambda: read_base(tm))
      else:
        # NOTE: a single tile larger than m has only the ragged read.
        if tiles_m > 1:
          pl.when(partial & (t < tiles_m - 1))(lambda: read_base(tm))
        pl.when(partial & (t == tiles_m - 1))(lambda: read_base(last_rows))
    if pass_cuts:
      # NOTE: the previous cut tile's last pass may have computed rows of its last group past
      # this tile's first row (fewer than `align`, before this tile's first group starts); they
      # are written back with this tile, from the previous step's output slot (the other one,
      # intact until the next step).
      carried_end = offsets_ref[goff_ref[0] + jnp.minimum(first_ref[t], num_local_groups)]
      prev_row0 = tstart_ref[jnp.maximum(t - 1, 0)]
      offset = row0 - prev_row0

      @pl.when((step > 0) & (carried_end > row0) & (offset + align <= tm))
      def _carry():
        prev = out_vmem.at[1 - slot][pl.ds(pl.multiple_of(offset, align), align), :]
        row_ids = row0 + lax.broadcasted_iota(jnp.int32, (align, tn), 0)
        out_ref[:align, :] = jnp.where(row_ids < carried_end, prev, out_ref[:align, :])

    if counts_ref is not None:
      counts_ref[n_i, t, 0] = 0
      counts_ref[n_i, t, 1] = 0
      _, lo, hi = local_rows(t)
      first, end = common.tile_row_range(
        row0=row0, lo=lo, hi=hi, tm=tm, m=lhs_rows, granule=lhs_granule
      )
      counts_ref[n_i, t, 2] = jnp.where(fetched, end - first, 0)
      _, lo, hi = written_rows(t)
      first, end = common.tile_row_range(
        row0=row0, lo=lo, hi=hi, tm=tm, m=out_rows, granule=out_granule
      )
      counts_ref[n_i, t, 3] = end - first

    # NOTE: a ramped first tile is waited for chunk by chunk in `segment`.
    @pl.when(fetched & (chain > 0) if ramp_chunks else fetched)
    def _wait_lhs():
      common.run_copies(lhs_copies(t, lhs_slot), wait=True)

    def wait_chunk(c, carry):
      common.run_copies(lhs_copies(t, 0, chunk=c), wait=True)
      return carry

    lhs_ref = lhs_vmem.at[lhs_slot]

    def group_body(g, carry):
      start = offsets_ref[g + goff_ref[0]]
      end = offsets_ref[g + goff_ref[0] + 1]

      @pl.when(end > start)
      def _compute():
        rank = rank_ref[g]

        # NOTE: a group whose first row is in this tile has not been loaded for this n-tile yet
        # (one that started in an earlier tile is still in its slot). Its load was started while
        # the previous group computed; the first load of an n-tile is started here, unless
        # `sequential_sweeps` prefetched it during the previous n-tile's last group. Then the
        # next load starts, into the other slot, whose group is finished.
        @pl.when(start >= row0)
        def _load():
          exposed_first = rank == 0
          if sequential_sweeps:
            exposed_first = exposed_first & (n_i == 0)
          # NOTE: with a ramp, the chain's first step started this load with its first lhs chunk
          # (the rank-0 group starts in the chain's first tile).
          if not ramp_chunks:

            @pl.when(exposed_first)
            def _first():
              start_load(rank, n_i)

          @pl.when(rank + 1 < nloads_ref[0])
          def _prefetch():
            start_load(rank + 1, n_i)

          if sequential_sweeps:

            @pl.when((rank + 1 == nloads_ref[0]) & (n_i + 1 < tiles_n))
            def _prefetch_next_sweep():
              start_load(0, n_i + 1)

          wait_load(rank, n_i)
          if prepare:
            # NOTE: upcast / transpose once per group and n-tile (not per sub-block); the group
            # keeps it while it spans several m-tiles, since the next group is prepared only
            # when it starts.
            w = w_vmem[slot_of(rank, n_i)]
            if upcast:
              w = w.astype(jnp.float32)
              if scales_on_k:
                # NOTE: scales along the contraction cannot be factored out of the dot; they
                # scale the weights, once per group, as part of the upcast.
                w = w * s_vmem[slot_of(rank, n_i)]
              w = w.astype(compute_dtype)
            w_prep[...] = w.T if rows_stationary and not transpose_rhs else w
          if counts_ref is not None:
            counts_ref[n_i, t, 1] += 1

        slot = slot_of(rank, n_i)
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
          jnp.minimum(end, row_end) - row0,
          sub_m=sub_m,
          align=align,
          tail=tail,
          tm=tm,
          cover_end=end - row0,
        )
        regular = passes - 2 * merged.astype(jnp.int32)

        def multiply(r0, rows, size):
          # NOTE: one pass: `size` rows of the tile from row r0 times the group's weights; the
          # row mask keeps the group's rows of the product.
          lhs_blk = lhs_ref[rows, :]
          if lhs_quantized and not narrow_dot:
            lhs_blk = lhs_blk.astype(jnp.float32)
          w_blk = w_prep[...] if prepare else w_vmem[slot]
          operands = (w_blk, lhs_blk) if rows_stationary else (lhs_blk, w_blk)
          prod = lax.dot_general(
            *(x.astype(compute_dtype) for x in operands),
            dimension_numbers=dims,
            preferred_element_type=dot_acc_dtype,
          ).astype(jnp.float32)
          if rows_stationary:
            prod = prod.T  # [tn, sub_m] -> [sub_m, tn]
          if quantized and not scales_on_k:
            # NOTE: one scale per output column: dot(x, q) * s[None, :] == dot(x, q * s).
            prod = prod * s_vmem[slot]
          if lhs_quantized:
            # NOTE: one scale per row: rows of a ragged last tile may hold garbage scales; the
            # row mask below keeps only the group's rows.
            prod = prod * lhs_scales_ref[rows, :]
          row_ids = row0 + r0 + lax.broadcasted_iota(jnp.int32, (size, tn), 0)
          mine = (row_ids >= start) & (row_ids < end)
          out_ref[rows, :] = jnp.where(mine, prod.astype(out_dtype), out_ref[rows, :])

        def sub_body(p, c):
          r0, rows = common.pass_block(first_row + p * sub_m, sub_m=sub_m, tm=tm, align=align)
          multiply(r0, rows, sub_m)
          return c

        if ramp_chunks:

          def segment(p):
            # NOTE: waits for the chunks holding pass p's rows (as `sub_body` places the pass),
            # then runs every pass from p whose rows those chunks (and the ones before) hold:
            # all of the group's passes once the whole block is in (every step but the chain's
            # first), so the pass loop itself never waits.
            r0, _ = common.pass_block(first_row + p * sub_m, sub_m=sub_m, tm=tm, align=align)
            ready = ready_ref[0]
            need = jnp.minimum(metadata.cdiv(r0 + sub_m, ramp_rows), ramp_chunks)
            lax.fori_loop(ready, need, wait_chunk, 0)
            covered = jnp.maximum(ready, need)
            ready_ref[0] = covered
            fit = (covered * ramp_rows - sub_m - first_row) // sub_m + 1
            end = jnp.where(covered >= ramp_chunks, regular, jnp.clip(fit, p + 1, regular))
            lax.fori_loop(p, end, sub_body, 0)
            return end

          lax.while_loop(lambda p: p < regular, segment, 0)
        else:
          lax.fori_loop(0, regular, sub_body, 0)
        if tail:
          # NOTE: the widened pass starts at the second-to-last pass's first row, moved back to
          # end at the tile's end like a pass that would cross it (rows it recomputes get the
          # same values).
          wide_r0 = pl.multiple_of(
            jnp.minimum(first_row + (passes - 2) * sub_m, tm - sub_m - tail), align
          )

          def widened():
            multiply(wide_r0, pl.ds(wide_r0, sub_m + tail), sub_m + tail)

          if ramp_chunks:
            # NOTE: waits for the chunks holding the widened pass's rows (none once the block is
            # in), outside its region, which then holds only the dot.
            need = jnp.where(
              merged, jnp.minimum(metadata.cdiv(wide_r0 + sub_m + tail, ramp_rows), ramp_chunks), 0
            )
            lax.fori_loop(ready_ref[0], need, wait_chunk, 0)
            ready_ref[0] = jnp.maximum(ready_ref[0], need)
          pl.when(merged)(widened)
        if counts_ref is not None:
          counts_ref[n_i, t, 0] += passes * sub_m - merged * (sub_m - tail)

      return carry

    lax.fori_loop(first_ref[t], last_ref[t] + 1, group_body, 0)
    if ramp_chunks:
      # NOTE: chunks no pass read (none, as passes cover the fetched rows; kept so that no DMA
      # is left pending).
      lax.fori_loop(ready_ref[0], ramp_chunks, wait_chunk, 0)

    common.run_copies(out_copies(chain), wait=False)

    def wait_write(j, carry):
      # NOTE: the previous step's write-back (j = 0), done while this step computed, before its
      # slot is reused by the next step; at the chain's end also this step's own (j = 1), so
      # that nothing is pending when the sweep (or, with `sequential_sweeps`, the grid) ends.
      common.run_copies(out_copies(chain - 1 + j), wait=True)
      return carry

    lax.fori_loop(
      jnp.where(chain >= 1, 0, 1), jnp.where(chain + 1 == chain_len, 2, 1), wait_write, 0
    )

  # Index maps get (n_i, step, *prefetch refs).
  def lhs_scales_map(n_i, step, offsets, first, last, rank, load, nloads, active, goff, *cut):
    # NOTE: step s of an n-tile is m-tile active[0] + s: unvisited tiles are never fetched.
    return active[0] + step, 0

  # NOTE: rhs and its scales stay in HBM; the kernel DMAs each group's blocks itself. The base
  # (last operand) is the output's buffer (aliased); the kernel only reads existing_out from it.
  operands, in_specs = common.present_operands(
    (lhs, pl.BlockSpec(memory_space=pl.ANY)),
    (rhs, pl.BlockSpec(memory_space=pl.ANY)),
    (_f32(rhs_scales), pl.BlockSpec(memory_space=pl.ANY)),
    (_f32(lhs_scales), pl.BlockSpec((tm, 1), lhs_scales_map)),
    (base, pl.BlockSpec(memory_space=pl.ANY)),
  )
  # NOTE: m-tiles run in order (a group's weights stay in their slot across tiles, and the next
  # load is started a group ahead). Without `sequential_sweeps` each n-tile restarts its load
  # sequence, so n-tiles are independent and may be split across TensorCores; with it a load
  # crosses n-tiles, so they must run in order on one core.
  result_and_cost = _result_and_cost(
    lhs,
    rhs,
    rhs_scales,
    lhs_scales,
    existing_out,
    (group_sizes, group_offset),
    n=n,
    out_dtype=out_dtype,
    tiles_n=tiles_n,
    rows=expected_rows,
  )
  result_and_cost["out_shape"] = common.out_struct(
    (out_rows, n), out_dtype, lhs, rhs, group_sizes, group_offset, base, rhs_scales, lhs_scales
  )
  result_and_cost["alias_last_operand"] = aliased
  result_and_cost["alias_when_interpreted"] = True
  visited = jnp.arange(count_tiles) - active[0]
  out = common.call_kernel(
    kernel,
    name="pallas_moe_gmm_rowtile",
    grid=(tiles_n, active[1]),
    prefetch=prefetch,
    operands=operands,
    in_specs=in_specs,
    out_spec=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=[
      pltpu.VMEM((2, *w_block), rhs.dtype),
      # NOTE: two weight slots (+ two scale slots), and one for reading existing_out.
      pltpu.SemaphoreType.DMA((5 if quantized else 3,)),
    ]
    + ([pltpu.VMEM((2, *s_block), jnp.float32)] if quantized else [])
    + ([pltpu.VMEM(prep_block, compute_dtype if upcast else rhs.dtype)] if prepare else [])
    + [
      # NOTE: two lhs slots and two output slots (the pipeline's double buffers, by hand), and
      # their semaphores: lhs slots 0, 1, output slots 2, 3.
      pltpu.VMEM((2, tm, k), lhs.dtype),
      pltpu.VMEM((2, tm, tn), out_dtype),
      pltpu.SemaphoreType.DMA((4,)),
    ]
    + (
      # NOTE: the ramp's chunk semaphores and how many chunks the passes have waited for.
      [pltpu.SemaphoreType.DMA((ramp_chunks,)), pltpu.SMEM((1,), jnp.int32)] if ramp_chunks else []
    ),
    dimension_semantics=("arbitrary", "arbitrary")
    if sequential_sweeps
    else ("parallel", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
    **result_and_cost,
    counts_shape=(tiles_n, count_tiles, 4) if count_rows else None,
    # NOTE: counters of unvisited tiles are never written (and those tiles did no work).
    valid_counts=((visited >= 0) & (visited < active[1]))[:, None],
  )
  if out_rows == m:
    return out
  if count_rows:
    return out[0][:m], out[1]
  return out[:m]
