"""Pallas TPU grouped matmul kernels: out[rows of g] = lhs[rows of g] @ rhs[g].

The raw (non-differentiable) kernels. `pallas_moe.ops.gmm` wraps them with a VJP and picks one per
call. As in megablox, the package exports the *function* `pallas_moe.gmm`, which shadows this
module's name as a package attribute: reach the module with `from pallas_moe.gmm import ...` or
`importlib.import_module("pallas_moe.gmm")`.

Two schedules compute the same thing (the row-tile kernel lives in `pallas_moe.gmm_rowtile`, the
parts both share in `pallas_moe.gmm_common`; this module re-exports `gmm_rowtile_pallas`):

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
  foreign rows from it). Without, `gmm_rowtile.zeros_outside_active` makes it: one grid step
  that DMAs zeros over exactly those rows, i.e. (m - visited rows) x n x itemsize bytes written
  once at HBM bandwidth, and nothing else. With `fill_unowned=False` (the MoE block) there is no
  base buffer and nothing is written outside the local rows' granules.
- `gmm_pallas` (any tiles, quantized operands): grid (tiles_n, visits, tiles_k). The visit axis
  walks the schedule of `metadata.make_schedule`; k is innermost so one f32 accumulator block
  collects a visit's dot products. Every m-tile of the output is visited, so the kernel alone
  writes the whole output: rows of the local groups get the product, every other row gets
  `existing_out` or exact zeros.
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

from pallas_moe import common, gmm_common, kernel_refs, metadata, probe
from pallas_moe.gmm_rowtile import gmm_rowtile_pallas, zeros_outside_active

__all__ = ["gmm_pallas", "gmm_rowtile_pallas"]

# NOTE: the row-tile gmm's zero fill, under the name its tests import.
_zeros_outside_active = zeros_outside_active

# ------------------------------------------------------------------------------------------------
# Visit schedule: one grid step per (group, m-tile) visit and k-tile.
# ------------------------------------------------------------------------------------------------


def _mask_k(x: jax.Array, *, valid_k: int, axis: int) -> jax.Array:
  """Zeros the columns (along `axis`) past `valid_k` of a ragged last k-tile.

  NOTE: the part of an edge block outside the array holds whatever was in VMEM (NaN under
  interpret mode's poisoning). Both operands are masked: 0 * NaN would still be NaN.
  """
  k_ids = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where(k_ids < valid_k, x, jnp.zeros_like(x))


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisitPlan:
  """The static configuration of one visit-schedule gmm call.

  Attributes:
    m, k, n: lhs is [m, k], the result [m, n].
    tm, tk, tn, sub_m: the tiles and the rows per MXU pass.
    tiles_n, tiles_k: n-tiles and k-tiles.
    k_rem: columns of the ragged last k-tile (0: none).
    compute_dtype, dot_acc_dtype: the dot's operand and accumulation types.
    transpose_rhs, quantized, lhs_quantized, scales_on_k, narrow_dot, has_existing: see
      `gmm_pallas` (quantized: rhs_scales given; lhs_quantized: lhs_scales given).
    count_rows: a `probe.count_rows` probe is open.
  """

  m: int
  k: int
  n: int
  tm: int
  tk: int
  tn: int
  sub_m: int
  tiles_n: int
  tiles_k: int
  k_rem: int
  compute_dtype: Any
  dot_acc_dtype: Any
  transpose_rhs: bool
  quantized: bool
  lhs_quantized: bool
  scales_on_k: bool
  narrow_dot: bool
  has_existing: bool
  count_rows: bool

  @property
  def dims(self) -> Any:
    # NOTE: rhs blocks are [tk, tn], or [tn, tk] when transposed; contract lhs's k with rhs's k.
    return (((1,), (1,)), ((), ())) if self.transpose_rhs else (((1,), (0,)), ((), ()))

  @property
  def rhs_block(self) -> tuple[Any, ...]:
    return (None, self.tn, self.tk) if self.transpose_rhs else (None, self.tk, self.tn)

  @property
  def scales_block(self) -> tuple[Any, ...]:
    if self.scales_on_k:
      return (None, 1, self.tk) if self.transpose_rhs else (None, self.tk, 1)
    return (None, 1, self.tn)


def _plan_visits(
  lhs, rhs, *, tiling, transpose_rhs, rhs_scales, scales_on_k, lhs_scales, narrow_dot, sub_m,
  has_existing, count_rows,
) -> VisitPlan:  # fmt: skip
  """Checks a visit gmm call's static arguments and makes its `VisitPlan`."""
  tm, tk, tn = tiling
  m, k, n, _, sub_m, compute_dtype, dot_acc_dtype = gmm_common.check_operands(
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
  return VisitPlan(
    m=m,
    k=k,
    n=n,
    tm=tm,
    tk=tk,
    tn=tn,
    sub_m=sub_m,
    tiles_n=metadata.cdiv(n, tn),
    tiles_k=metadata.cdiv(k, tk),
    k_rem=k % tk,
    compute_dtype=compute_dtype,
    dot_acc_dtype=dot_acc_dtype,
    transpose_rhs=transpose_rhs,
    quantized=rhs_scales is not None,
    lhs_quantized=lhs_scales is not None,
    scales_on_k=scales_on_k,
    narrow_dot=narrow_dot,
    has_existing=has_existing,
    count_rows=count_rows,
  )


class VisitMetadata(NamedTuple):
  """The scalar-prefetch arrays (`metadata.Schedule`'s, and the group offset), in order."""

  group_offsets: Any
  visit_group: Any
  visit_m_tile: Any
  visit_load_tile: Any
  visit_active: Any
  group_offset: Any


class VisitIndexMaps:
  """Block index maps: each takes the grid indices (n_i, visit, k_i) and the metadata refs."""

  def __init__(self, plan: VisitPlan):
    self.plan = plan

  def lhs(self, n_i, visit, k_i, meta: VisitMetadata):
    # NOTE: non-computing visits pin k to 0 and load the first compute visit's tile, so their
    # block index never changes and they trigger no DMA.
    return meta.visit_load_tile[visit], k_i * meta.visit_active[visit]

  def rhs(self, n_i, visit, k_i, meta: VisitMetadata):
    # NOTE: rhs holds only the local groups; visit_group is already local.
    k_blk = k_i * meta.visit_active[visit]
    if self.plan.transpose_rhs:
      return meta.visit_group[visit], n_i, k_blk
    return meta.visit_group[visit], k_blk, n_i

  def scales(self, n_i, visit, k_i, meta: VisitMetadata):
    group = meta.visit_group
    if not self.plan.scales_on_k:
      return group[visit], 0, n_i
    k_blk = k_i * meta.visit_active[visit]
    return (group[visit], 0, k_blk) if self.plan.transpose_rhs else (group[visit], k_blk, 0)

  def lhs_scales(self, n_i, visit, k_i, meta: VisitMetadata):
    # NOTE: follows lhs's m block (not k: one scale spans the whole row), so it is fetched once
    # per m-tile and, like lhs, never for non-computing visits.
    return meta.visit_load_tile[visit], 0

  def out(self, n_i, visit, k_i, meta: VisitMetadata):
    return meta.visit_m_tile[visit], n_i


class VisitInputs(NamedTuple):
  """The operands (None where absent), in `in_specs` order."""

  lhs: Any
  rhs: Any
  rhs_scales: Any
  lhs_scales: Any
  existing: Any


class VisitOutputs(NamedTuple):
  """The result and, with an open probe, the [tiles_n, max_visits] row counts (SMEM)."""

  out: Any
  counts: Any = None


def _accumulate(plan: VisitPlan, ins: VisitInputs, acc_ref, *, first_sub, last_sub, last_k):
  """Adds the visit's product over this k-tile into the accumulator, sub-block by sub-block.

  Args:
    plan: the call's plan.
    ins: the operand blocks.
    acc_ref: the [tm, tn] f32 accumulator.
    first_sub, last_sub: the sub-blocks holding rows of the visit's group (inclusive).
    last_k: this is the ragged last k-tile (its columns past k are masked).
  """

  def body(sub, carry):
    _, rows = common.sub_block(sub, plan.sub_m, plan.tm)
    lhs_blk, rhs_blk = ins.lhs[rows, :], ins.rhs[...]
    if plan.lhs_quantized and not plan.narrow_dot:
      lhs_blk = lhs_blk.astype(jnp.float32).astype(plan.compute_dtype)
    if plan.quantized and not plan.narrow_dot:
      rhs_blk = rhs_blk.astype(jnp.float32)
      if plan.scales_on_k:
        # NOTE: scales [tk, 1] (or [1, tk] transposed) broadcast along rhs's k axis. Scaled
        # before the ragged-k mask, so garbage scales past k are zeroed with the values.
        rhs_blk = rhs_blk * ins.rhs_scales[...]
      rhs_blk = rhs_blk.astype(plan.compute_dtype)
    if last_k and plan.k_rem:
      lhs_blk = _mask_k(lhs_blk, valid_k=plan.k_rem, axis=1)
      rhs_blk = _mask_k(rhs_blk, valid_k=plan.k_rem, axis=1 if plan.transpose_rhs else 0)
    prod = lax.dot_general(
      lhs_blk.astype(plan.compute_dtype),
      rhs_blk.astype(plan.compute_dtype),
      dimension_numbers=plan.dims,
      preferred_element_type=plan.dot_acc_dtype,
    ).astype(jnp.float32)
    if plan.quantized and not plan.scales_on_k:
      # NOTE: one scale per output column: dot(lhs, q) * s[None, :] == dot(lhs, q * s).
      prod = prod * ins.rhs_scales[...]
    if plan.lhs_quantized:
      # NOTE: one scale per row [sub_m, 1]: dot(diag(s) q, w) == diag(s) dot(q, w). Rows of a
      # ragged last m-tile may hold garbage scales; the store keeps only the group's rows.
      prod = prod * ins.lhs_scales[rows, :]
    acc_ref[rows, :] += prod
    return carry

  lax.fori_loop(first_sub, last_sub + 1, body, 0)


def _visit_kernel(plan: VisitPlan, meta: VisitMetadata, ins: VisitInputs, outs, acc_ref) -> None:
  """One grid step (n-tile, visit, k-tile): accumulate the visit's rows; store at the last k."""
  tm, tn, sub_m, tiles_k = plan.tm, plan.tn, plan.sub_m, plan.tiles_k
  rows_ref = outs.counts
  n_i, visit, k_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  active = meta.visit_active[visit] == 1
  group = meta.visit_group[visit] + meta.group_offset[0]
  # NOTE: rows of this tile inside [start, end) belong to the visit's group.
  start, end = meta.group_offsets[group], meta.group_offsets[group + 1]
  row0 = meta.visit_m_tile[visit] * tm

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
  accumulate = functools.partial(
    _accumulate, plan, ins, acc_ref, first_sub=first_sub, last_sub=last_sub
  )
  if plan.k_rem:
    pl.when(active & (k_i == tiles_k - 1))(functools.partial(accumulate, last_k=True))
    pl.when(active & (k_i != tiles_k - 1))(functools.partial(accumulate, last_k=False))
  else:
    pl.when(active)(functools.partial(accumulate, last_k=False))
  if rows_ref is not None:

    @pl.when(active & (k_i == 0))
    def _count():
      rows_ref[n_i, visit] += (last_sub + 1 - first_sub) * sub_m

  @pl.when(k_i == tiles_k - 1)
  def _store():
    out_ref, m_tile_ref = outs.out, meta.visit_m_tile
    m_tile = m_tile_ref[visit]
    # NOTE: visits of an m-tile are consecutive; the first one starts the output block from
    # existing_out (or zeros), later ones add their group's rows to what is already there.
    prev_tile = m_tile_ref[jnp.maximum(visit - 1, 0)]
    first = (visit == 0) | (prev_tile != m_tile)
    rows = row0 + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    mine = active & (rows >= start) & (rows < end)
    if ins.existing is None:
      fresh = jnp.zeros((tm, tn), jnp.float32)
    else:
      fresh = ins.existing[...].astype(jnp.float32)
    base = jnp.where(first, fresh, out_ref[...].astype(jnp.float32))
    out_ref[...] = jnp.where(mine, acc_ref[...], base).astype(out_ref.dtype)


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
  interpret: common.Interpret = None,
) -> jax.Array:
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
    interpret: see `common.run_kernel`.

  Returns:
    [m, n] of `out_dtype`.

  With a `probe.count_rows` probe open (interpret mode), the probe gets [tiles_n, max_visits]
  int32 rows pushed through the MXU per (n-tile, visit) for one sweep over k.
  """
  counter = probe.active()
  tm, tk, tn = tiling
  plan = _plan_visits(
    lhs,
    rhs,
    tiling=tiling,
    transpose_rhs=transpose_rhs,
    rhs_scales=rhs_scales,
    scales_on_k=scales_on_k,
    lhs_scales=lhs_scales,
    narrow_dot=narrow_dot,
    sub_m=sub_m,
    has_existing=existing_out is not None,
    count_rows=counter is not None,
  )
  schedule = metadata.make_schedule(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=rhs.shape[0],
    m=plan.m,
    tm=tm,
    fill_uncovered_tiles=fill_unowned or existing_out is not None,
    visit_empty_groups=False,
  )
  meta = VisitMetadata(
    group_offsets=schedule.group_offsets,
    visit_group=schedule.visit_group,
    visit_m_tile=schedule.visit_m_tile,
    visit_load_tile=schedule.visit_load_tile,
    visit_active=schedule.visit_active,
    group_offset=group_offset.reshape((1,)),
  )
  inputs = VisitInputs(
    lhs=lhs,
    rhs=rhs,
    rhs_scales=gmm_common.f32(rhs_scales),
    lhs_scales=gmm_common.f32(lhs_scales),
    existing=existing_out,
  )
  result_and_cost = gmm_common.result_and_cost(
    lhs,
    rhs,
    rhs_scales,
    lhs_scales,
    existing_out,
    (group_sizes, group_offset),
    n=plan.n,
    out_dtype=out_dtype,
    tiles_n=plan.tiles_n,
    rows=expected_rows,
    whole_output=fill_unowned,
    visit_tiles=(tm, tk),
  )
  out = _visit_call(
    plan,
    meta,
    inputs,
    result_and_cost,
    schedule=schedule,
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
  )
  if plan.count_rows:
    out, counts = out
    counter.record(counts)
  return out


def _visit_call(
  plan: VisitPlan, meta, inputs, result_and_cost, *, schedule, vmem_limit_bytes, interpret
):
  """The visit gmm's pallas_call: block specs, grid, scratch, and the probe's counts output."""
  tm, tn = plan.tm, plan.tn
  maps = VisitIndexMaps(plan)

  def spec(block, index_map):
    return pl.BlockSpec(block, kernel_refs.index_map(index_map, metadata=meta, grid_rank=3))

  specs = VisitInputs(
    lhs=spec((tm, plan.tk), maps.lhs),
    rhs=spec(plan.rhs_block, maps.rhs),
    rhs_scales=spec(plan.scales_block, maps.scales),
    lhs_scales=spec((tm, 1), maps.lhs_scales),
    existing=spec((tm, tn), maps.out),
  )
  specs = VisitInputs(*(s if x is not None else None for x, s in zip(inputs, specs, strict=True)))
  counts_shape = (plan.tiles_n, schedule.max_visits) if plan.count_rows else None
  outputs = VisitOutputs(
    out=result_and_cost["out_shape"],
    counts=jax.ShapeDtypeStruct(counts_shape, jnp.int32) if counts_shape else None,
  )
  scratch = pltpu.VMEM((tm, tn), jnp.float32)
  kernel = kernel_refs.kernel(
    functools.partial(_visit_kernel, plan), layout=(meta, inputs, outputs, scratch)
  )
  return common.call_kernel(
    kernel,
    name="pallas_moe_gmm",
    grid=(plan.tiles_n, schedule.num_visits, plan.tiles_k),
    prefetch=tuple(kernel_refs.leaves(meta)),
    operands=kernel_refs.leaves(inputs),
    in_specs=kernel_refs.leaves(specs),
    out_spec=spec((tm, tn), maps.out),
    scratch_shapes=[scratch],
    dimension_semantics=("parallel", "arbitrary", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
    **result_and_cost,
    counts_shape=counts_shape,
    valid_counts=jnp.arange(schedule.max_visits) < schedule.num_visits,
  )
