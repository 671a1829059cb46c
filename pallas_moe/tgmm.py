"""Pallas TPU transposed grouped matmul kernels: out[g] = lhs[:, rows of g] @ rhs[rows of g].

The weight-gradient kernels: with lhs = x^T [k, m] and rhs = dy [m, n], out[g] is dW of group g.
`pallas_moe.ops` runs them for gmm's VJP and for the public `tgmm`. As in megablox, the package
exports the *function* `pallas_moe.tgmm`, which shadows this module's name as a package
attribute: reach the module with `from pallas_moe.tgmm import ...` or
`importlib.import_module("pallas_moe.tgmm")`.

Two schedules compute the same thing (the row-tile kernel lives in `pallas_moe.tgmm_rowtile`,
the cost estimate both give XLA in `pallas_moe.tgmm_common`; this module re-exports
`tgmm_rowtile_pallas`, `tgmm_cost` and `INTERIOR_SUBS`):

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

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import common, kernel_refs, metadata, probe
from pallas_moe.tgmm_common import tgmm_cost
from pallas_moe.tgmm_rowtile import INTERIOR_SUBS, tgmm_rowtile_pallas

__all__ = ["INTERIOR_SUBS", "tgmm_cost", "tgmm_pallas", "tgmm_rowtile_pallas"]

# ------------------------------------------------------------------------------------------------
# Visit schedule: one grid step per k-tile, n-tile and (group, m-tile) visit.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisitPlan:
  """The static configuration of one visit-schedule tgmm call (see `_plan_visits`).

  Attributes:
    m, k, n: lhs is [k, m] ([m, k] with `transpose_lhs`), rhs [m, n], the result [G, k, n].
    num_groups: local groups computed.
    tm, tk, tn, sub_m: the tiles and the rows per MXU pass.
    tiles_k, tiles_n: k-tiles and n-tiles.
    compute_dtype, dot_acc_dtype: the dot's operand and accumulation types.
    lhs_quantized, rhs_quantized: lhs / rhs come with f32 scales.
    lhs_token, rhs_token: those scales are per token ([1, m], [m, 1]), not per channel.
    narrow_dot, transpose_lhs: see `tgmm_pallas`.
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
  tiles_k: int
  tiles_n: int
  compute_dtype: Any
  dot_acc_dtype: Any
  lhs_quantized: bool
  rhs_quantized: bool
  lhs_token: bool
  rhs_token: bool
  narrow_dot: bool
  transpose_lhs: bool
  has_existing: bool
  count_rows: bool


def _plan_visits(
  lhs, rhs, *, tiling, num_groups, lhs_scales, rhs_scales, narrow_dot, sub_m, transpose_lhs,
  has_existing, count_rows,
) -> VisitPlan:  # fmt: skip
  """Checks a visit tgmm call's static arguments and makes its `VisitPlan`."""
  m, k = lhs.shape if transpose_lhs else lhs.shape[::-1]
  n = rhs.shape[1]
  tm, tk, tn = tiling
  sub_m = common.check_sub_m(sub_m, tm)
  if transpose_lhs and lhs_scales is not None:
    raise ValueError("lhs_scales are for a [k, m] lhs; pass transpose_lhs=False with them.")
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
  return VisitPlan(
    m=m,
    k=k,
    n=n,
    num_groups=num_groups,
    tm=tm,
    tk=tk,
    tn=tn,
    sub_m=sub_m,
    tiles_k=metadata.cdiv(k, tk),
    tiles_n=metadata.cdiv(n, tn),
    compute_dtype=compute_dtype,
    dot_acc_dtype=dot_acc_dtype,
    lhs_quantized=lhs_q,
    rhs_quantized=rhs_q,
    lhs_token=lhs_token,
    rhs_token=rhs_token,
    narrow_dot=narrow_dot,
    transpose_lhs=transpose_lhs,
    has_existing=has_existing,
    count_rows=count_rows,
  )


class VisitMetadata(NamedTuple):
  """The scalar-prefetch arrays (`metadata.Schedule`'s, and the group offset), in order."""

  group_offsets: Any
  visit_group: Any
  visit_load_tile: Any
  visit_active: Any
  group_offset: Any


class VisitIndexMaps:
  """Block index maps: each takes the grid indices (k_i, n_i, visit) and the metadata refs.

  NOTE: scale blocks follow the operand axis they describe: per-channel ones the output block's
  k or n index (fetched once per output block), per-token ones the visit's m-tile, like the
  operand itself (no refetch while a non-computing visit repeats the tile).
  """

  def __init__(self, plan: VisitPlan):
    self.plan = plan

  def lhs(self, k_i, n_i, visit, meta: VisitMetadata):
    tile = meta.visit_load_tile
    return (tile[visit], k_i) if self.plan.transpose_lhs else (k_i, tile[visit])

  def rhs(self, k_i, n_i, visit, meta: VisitMetadata):
    return meta.visit_load_tile[visit], n_i

  def out(self, k_i, n_i, visit, meta: VisitMetadata):
    # NOTE: the output holds only the local groups; visit_group is already local.
    return meta.visit_group[visit], k_i, n_i

  def lhs_channel_scales(self, k_i, n_i, visit, meta: VisitMetadata):
    return k_i, 0

  def lhs_token_scales(self, k_i, n_i, visit, meta: VisitMetadata):
    return 0, meta.visit_load_tile[visit]

  def rhs_channel_scales(self, k_i, n_i, visit, meta: VisitMetadata):
    return 0, n_i

  def rhs_token_scales(self, k_i, n_i, visit, meta: VisitMetadata):
    return meta.visit_load_tile[visit], 0


class VisitInputs(NamedTuple):
  """The operands (None where absent), in `in_specs` order."""

  lhs: Any
  rhs: Any
  lhs_scales: Any
  rhs_scales: Any
  existing: Any


class VisitOutputs(NamedTuple):
  """The result and, with an open probe, the [tiles_k, tiles_n, max_visits] row counts."""

  out: Any
  counts: Any = None


def _accumulate(
  plan: VisitPlan, ins: VisitInputs, acc_ref, *, row0, start, end, first_sub, last_sub
):
  """Adds the product of the visit's sub-blocks first_sub .. last_sub (rows of the group
  [start, end) only) to the accumulator.

  NOTE: rows are tgmm's contraction dim. The tile is reduced in sub-blocks of sub_m rows (the MXU
  granularity), only those holding rows of the group. A tile straddling group boundaries costs
  each group only the sub-blocks it touches.
  """
  sub_m, tk, tn = plan.sub_m, plan.tk, plan.tn

  def body(sub, carry):
    r0, rows = common.sub_block(sub, sub_m, plan.tm)
    # NOTE: only the rows of this sub-block that belong to the group contribute. Mask both
    # operands: rows of a ragged last m-tile are uninitialized (NaN under interpret mode) and
    # 0 * NaN = NaN.
    lo = row0 + r0
    if plan.transpose_lhs:
      lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (sub_m, tk), 0)
      lhs_blk = ins.lhs[rows, :]
    else:
      lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (tk, sub_m), 1)
      lhs_blk = ins.lhs[:, rows]
    rhs_rows = lo + lax.broadcasted_iota(jnp.int32, (sub_m, tn), 0)
    rhs_blk = ins.rhs[rows, :]
    if plan.lhs_quantized and not plan.narrow_dot:
      lhs_blk = lhs_blk.astype(jnp.float32)
      if plan.lhs_token:
        # NOTE: [1, sub_m] token scales broadcast over the block's k rows; scaled before the
        # row mask so garbage scales of a ragged last m-tile are masked with the values.
        lhs_blk = lhs_blk * ins.lhs_scales[:, rows]
    if plan.rhs_quantized and not plan.narrow_dot:
      rhs_blk = rhs_blk.astype(jnp.float32)
      if plan.rhs_token:
        rhs_blk = rhs_blk * ins.rhs_scales[rows, :]
    lhs_blk = jnp.where((lhs_cols >= start) & (lhs_cols < end), lhs_blk, 0)
    rhs_blk = jnp.where((rhs_rows >= start) & (rhs_rows < end), rhs_blk, 0)
    acc_ref[...] += lax.dot_general(
      lhs_blk.astype(plan.compute_dtype),
      rhs_blk.astype(plan.compute_dtype),
      dimension_numbers=(((0 if plan.transpose_lhs else 1,), (0,)), ((), ())),
      preferred_element_type=plan.dot_acc_dtype,
    ).astype(jnp.float32)
    return carry

  lax.fori_loop(first_sub, last_sub + 1, body, 0)


def _store(plan: VisitPlan, ins: VisitInputs, out_ref, acc_ref) -> None:
  """Writes the group's finished sum: scaled per channel, plus existing_out's block."""
  acc = acc_ref[...]
  # NOTE: per-channel scales multiply the group's finished sum once: [tk, 1] rows, [1, tn]
  # columns. Rows / columns past k / n may see garbage scales; they are never written back.
  if plan.lhs_quantized and not plan.lhs_token:
    acc = acc * ins.lhs_scales[...]
  if plan.rhs_quantized and not plan.rhs_token:
    acc = acc * ins.rhs_scales[...]
  if ins.existing is not None:
    acc = acc + ins.existing[...].astype(jnp.float32)
  out_ref[...] = acc.astype(out_ref.dtype)


def _visit_kernel(plan: VisitPlan, meta: VisitMetadata, ins: VisitInputs, outs, acc_ref) -> None:
  """One grid step (k-tile, n-tile, visit): the visit's rows into the group's accumulator; the
  group's last visit writes its block."""
  rows_ref = outs.counts
  k_i, n_i, visit = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_visits = pl.num_programs(2)
  group_ref = meta.visit_group
  group = group_ref[visit]
  prev_group = group_ref[jnp.maximum(visit - 1, 0)]
  next_group = group_ref[jnp.minimum(visit + 1, num_visits - 1)]
  # NOTE: a group's visits are consecutive; its first visit starts the accumulator and its last
  # one writes the output block.
  first = (visit == 0) | (prev_group != group)
  last = (visit == num_visits - 1) | (next_group != group)
  active = meta.visit_active[visit] == 1
  g = group + meta.group_offset[0]
  start, end = meta.group_offsets[g], meta.group_offsets[g + 1]
  row0 = meta.visit_load_tile[visit] * plan.tm
  if rows_ref is not None:
    rows_ref[k_i, n_i, visit] = 0

  @pl.when(first)
  def _zero_acc():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  # NOTE: the sub-blocks holding rows of the group: first_sub .. last_sub.
  first_sub = jnp.maximum(start - row0, 0) // plan.sub_m
  last_sub = (jnp.minimum(end, row0 + plan.tm) - 1 - row0) // plan.sub_m

  @pl.when(active)
  def _accumulate_visit():
    _accumulate(
      plan, ins, acc_ref, row0=row0, start=start, end=end, first_sub=first_sub, last_sub=last_sub
    )
    if rows_ref is not None:
      rows_ref[k_i, n_i, visit] += (last_sub + 1 - first_sub) * plan.sub_m

  pl.when(last)(lambda: _store(plan, ins, outs.out, acc_ref))


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
  interpret: common.Interpret = None,
) -> jax.Array:
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
    interpret: see `common.run_kernel`.

  Returns:
    [num_actual_groups, k, n] of `out_dtype`.

  With a `probe.count_rows` probe open (interpret mode), the probe gets [tiles_k, tiles_n,
  max_visits] int32 rows pushed through the MXU per grid step.
  """
  counter = probe.active()
  plan = _plan_visits(
    lhs,
    rhs,
    tiling=tiling,
    num_groups=num_actual_groups,
    lhs_scales=lhs_scales,
    rhs_scales=rhs_scales,
    narrow_dot=narrow_dot,
    sub_m=sub_m,
    transpose_lhs=transpose_lhs,
    has_existing=existing_out is not None,
    count_rows=counter is not None,
  )
  schedule = metadata.make_schedule(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=num_actual_groups,
    m=plan.m,
    tm=plan.tm,
    fill_uncovered_tiles=False,
    visit_empty_groups=True,
  )
  meta = VisitMetadata(
    group_offsets=schedule.group_offsets,
    visit_group=schedule.visit_group,
    visit_load_tile=schedule.visit_load_tile,
    visit_active=schedule.visit_active,
    group_offset=group_offset.reshape((1,)),
  )
  f32 = lambda s: None if s is None else s.astype(jnp.float32)
  inputs = VisitInputs(lhs, rhs, f32(lhs_scales), f32(rhs_scales), existing_out)
  out_shape = common.out_struct(
    (num_actual_groups, plan.k, plan.n), out_dtype, lhs, rhs, group_sizes, group_offset,
    existing_out, lhs_scales, rhs_scales,
  )  # fmt: skip
  cost = tgmm_cost(
    lhs,
    rhs,
    lhs_scales,
    rhs_scales,
    m=plan.m,
    k=plan.k,
    n=plan.n,
    rows=plan.m if expected_rows is None else min(expected_rows, plan.m),
    num_groups=num_actual_groups,
    out_dtype=out_dtype,
    tiles=(plan.tiles_k, plan.tiles_n),
    has_existing=plan.has_existing,
  )
  out = _visit_call(
    plan,
    meta,
    inputs,
    out_shape,
    cost,
    schedule=schedule,
    vmem_limit_bytes=vmem_limit_bytes,
    interpret=interpret,
  )
  if plan.count_rows:
    out, counts = out
    counter.record(counts)
  return out


def _visit_call(
  plan: VisitPlan, meta, inputs, out_shape, cost, *, schedule, vmem_limit_bytes, interpret
):
  """The visit tgmm's pallas_call: block specs, grid, scratch, and the probe's counts output."""
  tm, tk, tn = plan.tm, plan.tk, plan.tn
  maps = VisitIndexMaps(plan)

  def spec(block, index_map):
    return pl.BlockSpec(block, kernel_refs.index_map(index_map, metadata=meta, grid_rank=3))

  specs = VisitInputs(
    lhs=spec((tm, tk) if plan.transpose_lhs else (tk, tm), maps.lhs),
    rhs=spec((tm, tn), maps.rhs),
    lhs_scales=spec((1, tm), maps.lhs_token_scales)
    if plan.lhs_token
    else spec((tk, 1), maps.lhs_channel_scales),
    rhs_scales=spec((tm, 1), maps.rhs_token_scales)
    if plan.rhs_token
    else spec((1, tn), maps.rhs_channel_scales),
    existing=spec((None, tk, tn), maps.out),
  )
  specs = VisitInputs(*(s if x is not None else None for x, s in zip(inputs, specs, strict=True)))
  counts_shape = (plan.tiles_k, plan.tiles_n, schedule.max_visits) if plan.count_rows else None
  outputs = VisitOutputs(
    out=out_shape,
    counts=jax.ShapeDtypeStruct(counts_shape, jnp.int32) if counts_shape else None,
  )
  scratch = pltpu.VMEM((tk, tn), jnp.float32)
  kernel = kernel_refs.kernel(
    functools.partial(_visit_kernel, plan), layout=(meta, inputs, outputs, scratch)
  )
  return common.call_kernel(
    kernel,
    name="pallas_moe_tgmm",
    grid=(plan.tiles_k, plan.tiles_n, schedule.num_visits),
    prefetch=tuple(kernel_refs.leaves(meta)),
    operands=kernel_refs.leaves(inputs),
    in_specs=kernel_refs.leaves(specs),
    out_shape=out_shape,
    out_spec=spec((None, tk, tn), maps.out),
    scratch_shapes=[scratch],
    dimension_semantics=("parallel", "parallel", "arbitrary"),
    vmem_limit_bytes=vmem_limit_bytes,
    **cost,
    interpret=interpret,
    counts_shape=counts_shape,
    valid_counts=jnp.arange(schedule.max_visits) < schedule.num_visits,
  )
