"""Registry of grouped-matmul implementations the bench models (and times on TPU).

An implementation turns (op, shape, group sizes, generation) into a `Case`: the function that
launches its Pallas kernel(s), its arguments (big operands as `jax.ShapeDtypeStruct`,
`group_sizes` concrete), the tiling it uses, and optionally a `step_scale` hook for kernels
that skip MXU work inside a step (see `bench.costmodel`).

To plug in a kernel, write `build(*, op, shape, group_sizes, generation) -> Case` and call
`register(Impl(name=..., build=..., available=...))`. `available()` returns None when the
implementation can run, else the reason it is skipped. `build` raises `Unsupported(reason)` for
a case the implementation cannot do (e.g. megablox's m % tm rule).

Ops (docs/design.md, "Benchmark shapes"): fwd = gmm lhs[m,k] x rhs[G,k,n]; dlhs = gmm grad[m,n] x
rhs[G,k,n]^T (the transposed rhs); drhs = tgmm lhs^T[k,m] x grad[m,n] -> [G,k,n]. Inputs and outputs
are bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import costmodel, tokamax_tiles
from bench.costmodel import CallSchedule, StepContext
from bench.shapes import Shape
from pallas_moe import metadata
from pallas_moe import tiling as tiling_lib
from pallas_moe.generations import MIN_PASS_ROWS
from pallas_moe.tgmm import INTERIOR_SUBS
from pallas_moe.tiling import TpuGeneration, pick_tiling, use_generation

__all__ = [
  "Case",
  "Impl",
  "Unsupported",
  "IMPLS",
  "register",
  "op_arrays",
  "OPS",
  "pallas_moe_step_scale",
  "rowtile_hooks",
  "rowtile_tgmm_dots",
  "MEGABLOX_GRID_SIZES",
  "MEGABLOX_KN_EXTRA_SIZES",
  "GridResult",
  "megablox_tilings",
  "megablox_vmem_bytes",
  "megablox_lower_bound_us",
  "megablox_grid_search",
  "megablox_v2_tiles",
  "megablox_v2_row_tiles",
  "megablox_v2_schedule",
]

OPS = ("fwd", "dlhs", "drhs")
DTYPE = jnp.bfloat16


class Unsupported(Exception):
  """The implementation cannot run this case."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """One runnable case.

  Attributes:
    fn: launches the kernel; called as fn(*args).
    args: its arguments (ShapeDtypeStruct for big operands, concrete group_sizes).
    tiling: (tm, tk, tn) as the implementation uses them (for the report).
    step_scale: optional per-step MXU-work hook for the cost model.
    step_manual_bytes: optional per-step manual-DMA bytes hook for the cost model.
    kernel: which of an implementation's kernels runs (for the report): "rowtile", or
      "rowtile-rows-stationary" (run with `rows_stationary`).
    schedules: `costmodel.analyze`'s result when the build already ran it (a tiling search);
      the bench then uses it instead of analyzing again.
    extra: more fields for the bench's record (e.g. the search's statistics).
    row_macs: MACs per token row of one full sweep, padded as the kernel pads (tile grid and
      MXU); makes `mxu_rows_executed` a pure row count. Callable of the MXU size.
    tgmm_dots: the row-tile tgmm's per-step dots by kind (`rowtile_tgmm_dots`), for
      `bench.llo`'s trip counts; None for other kernels.
    gmm_passes: the row-tile gmm's per-step passes and widened passes (`rowtile_gmm_passes`),
      for `bench.llo`'s trip counts; None for other kernels.
  """

  fn: Callable[..., Any]
  args: tuple[Any, ...]
  tiling: tuple[int, int, int]
  step_scale: Callable[[StepContext], np.ndarray] | None = None
  row_macs: Callable[[int], float] | None = None
  step_manual_bytes: Callable[[StepContext], np.ndarray] | None = None
  kernel: str = ""
  schedules: tuple[CallSchedule, ...] | None = None
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  tgmm_dots: Callable[[StepContext], tuple[np.ndarray, ...]] | None = None
  gmm_passes: Callable[[StepContext], tuple[np.ndarray, np.ndarray]] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Impl:
  """A registered implementation.

  Attributes:
    name: registry key (`--impls`).
    build: (*, op, shape, group_sizes, generation) -> Case.
    available: () -> None if usable, else the reason it is skipped.
    tiling_depends_on_generation: whether `build` picks tiles per generation.
    program_depends_on_generation: whether the traced kernel differs per generation for the same
      tiles (ours: the MXU sub-block rows, the VMEM limit, and the VMEM check that may refuse
      tiles on one generation only); the bench then analyzes each generation separately.
  """

  name: str
  build: Callable[..., Case]
  available: Callable[[], str | None] = lambda: None
  tiling_depends_on_generation: bool = False
  program_depends_on_generation: bool = False


IMPLS: dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
  """Adds (or replaces) an implementation in the registry.

  Args:
    impl: the implementation.

  Returns:
    The same implementation.
  """
  IMPLS[impl.name] = impl
  return impl


def op_arrays(*, op: str, shape: Shape, group_sizes: np.ndarray) -> tuple[Any, ...]:
  """Abstract operands of an op, plus the concrete group sizes.

  Args:
    op: "fwd", "dlhs" or "drhs".
    shape: the problem.
    group_sizes: int32 [G].

  Returns:
    fwd: (lhs[m,k], rhs[G,k,n], gs); dlhs: (grad[m,n], rhs[G,k,n], gs);
    drhs: (lhs^T[k,m], grad[m,n], gs).
  """
  m, k, n, g = shape.m, shape.k, shape.n, shape.num_groups
  sds = lambda *s: jax.ShapeDtypeStruct(s, DTYPE)
  gs = np.asarray(group_sizes, np.int32)
  if op == "fwd":
    return sds(m, k), sds(g, k, n), gs
  if op == "dlhs":
    return sds(m, n), sds(g, k, n), gs
  if op == "drhs":
    return sds(k, m), sds(m, n), gs
  raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _pad(x: int, t: int) -> int:
  return -(-x // t) * t


def _gmm_row_macs(
  contract: int, out: int, tk: int, tn: int, *, rows_stationary: bool = False
) -> Callable[[int], float]:
  """gmm step dot [tm,tk]x[tk,tn]: per row, Σ over k tiles and n tiles of tk'·tn'. With
  `rows_stationary` (the kernel computes [tn,tk]x[tk,rows]) the tn columns are streamed rows:
  per row max(tn, mxu) instead of tn'."""

  def row_macs(mxu: int) -> float:
    cols = max(tn, mxu) if rows_stationary else _pad(tn, mxu)
    return (-(-contract // tk)) * _pad(tk, mxu) * (-(-out // tn)) * cols

  return row_macs


def _tgmm_row_macs(
  k: int, n: int, tk: int, tn: int, *, rows_stationary: bool = False
) -> Callable[[int], float]:
  """tgmm step dot [tk,tm]x[tm,tn]: rows are the contraction; per row max(tk,mxu)·tn'. With
  `rows_stationary` ([tn,tm]x[tm,tk]): per row max(tn,mxu)·tk'."""

  def row_macs(mxu: int) -> float:
    if rows_stationary:
      per_tile = max(tn, mxu) * _pad(tk, mxu)
    else:
      per_tile = max(tk, mxu) * _pad(tn, mxu)
    return (-(-k // tk)) * (-(-n // tn)) * per_tile

  return row_macs


# ----------------------------------------------------------------------------------------------
# Upstream megablox.


def _megablox_module():
  # The package __init__ shadows the `gmm` module with the `gmm` function: import the module.
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_tgmm_scale(ctx: StepContext) -> np.ndarray:
  """megablox tgmm runs its dot only when the step's group is non-empty (`dont_skip`)."""
  group_offsets, group_ids, _, _ = ctx.index_operands
  grid_id = ctx.program_ids[2]
  gid = group_ids[grid_id]
  return (group_offsets[gid + 1] - group_offsets[gid] > 0).astype(np.float64)


def _megablox_build(tiling: tuple[int, int, int]):
  def build(*, op: str, shape: Shape, group_sizes: np.ndarray, generation: TpuGeneration) -> Case:
    del generation
    mb = _megablox_module()
    m, k, n = shape.m, shape.k, shape.n
    tm, tk, tn = tiling
    args = op_arrays(op=op, shape=shape, group_sizes=group_sizes)
    # Like MaxText, clamp each tile to its dimension.
    if op == "fwd":
      til = (min(tm, m), min(tk, k), min(tn, n))
      fn = functools.partial(mb.gmm, preferred_element_type=DTYPE, tiling=til)
      row_macs = _gmm_row_macs(k, n, til[1], til[2])
      scale = None
    elif op == "dlhs":
      til = (min(tm, m), min(tk, n), min(tn, k))
      fn = functools.partial(mb.gmm, preferred_element_type=DTYPE, tiling=til, transpose_rhs=True)
      row_macs = _gmm_row_macs(n, k, til[1], til[2])
      scale = None
    else:
      til = (min(tm, m), min(tk, k), min(tn, n))
      fn = functools.partial(mb.tgmm, preferred_element_type=DTYPE, tiling=til)
      row_macs = _tgmm_row_macs(k, n, til[1], til[2])
      scale = _megablox_tgmm_scale
    if m % til[0]:
      raise Unsupported(f"megablox needs m % tm == 0 (m={m}, tm={til[0]})")
    return Case(fn=fn, args=args, tiling=til, step_scale=scale, row_macs=row_macs)

  return build


register(Impl(name="megablox-maxtext", build=_megablox_build((512, 1024, 1024))))
register(Impl(name="megablox-default", build=_megablox_build((128, 128, 128))))


def _tokamax_build(*, op: str, shape: Shape, group_sizes: np.ndarray, generation) -> Case:
  """tokamax 0.0.12's TPU ragged dot at its tuned tiles (bench.tokamax_tiles).

  NOTE: modeled as megablox's schedule at tokamax's tiles: tokamax's kernel runs megablox's
  grid and index maps inside `emit_pipeline`, which the cost model cannot see into. Its lhs
  buffer depth (`input_buffer_count`) is recorded, not modeled.
  """
  tiles, depth, tuned = tokamax_tiles.lookup(
    op=op, m=shape.m, k=shape.k, n=shape.n, num_groups=shape.num_groups
  )
  case = _megablox_build(tiles)(op=op, shape=shape, group_sizes=group_sizes, generation=generation)
  return dataclasses.replace(
    case,
    schedules=gridless_schedules(case),
    extra=dict(tokamax=dict(input_buffer_count=depth, tuned=tuned)),
  )


def gridless_schedules(case: Case) -> tuple[CallSchedule, ...]:
  """A megablox-schedule case's schedules as run by a grid-less `pallas_call` around
  `emit_pipeline` (tokamax's v1 kernel): the same steps with no dimension semantics, since
  Mosaic runs a grid-less kernel on one TensorCore of a megacore device (`costmodel.cost`)."""
  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  return tuple(dataclasses.replace(s, dimension_semantics=None) for s in scheds)


register(Impl(name="tokamax", build=_tokamax_build))


# ----------------------------------------------------------------------------------------------
# tokamax's v2 ragged dot (`tokamax/_src/ops/gmm_v2/gmm_v2.py`, 0.0.17; MaxText 0.2.5 runs an
# earlier version with `use_tokamax_gmm` + `use_gmm_v2`). Modeled from its source, as numpy:
# the kernel is a `pl.kernel` over a TensorCore mesh whose body runs `pltpu.emit_pipeline` over
# HBM refs, which `costmodel.analyze` cannot see into.
#
# Schedule: grid (n tiles, gm tiles, k tiles), gm fastest but k. The gm tiles are only the local
# groups' row tiles: each non-empty group's rows [s, e) are cut into chunks of at most
# tile_m - (start % sublane) rows (`fill_metadata`), so a tile never straddles two groups and an
# empty group costs nothing. The lhs and output blocks are `pl.BoundedSlice` row ranges (whole
# sublane rows of the chunk), the weights [tile_k, tile_n] of the chunk's group (triple
# buffered): with one k tile they are fetched once per group and n tile, with several every step
# (the k window changes). Each step pushes `bucket_m` = bucket_base x min(end_local // base + 1,
# tile_m // base) rows through the MXU (`lax.switch` over buckets). dlhs reads the weights
# [tile_n, tile_k] and transposes them in VMEM (XLU work, not modeled).


def megablox_v2_tiles(
  *, m: int, k: int, n: int, transpose_rhs: bool, generation: str | TpuGeneration
) -> dict[str, int]:
  """tokamax v2's `calculate_tiling` for bf16 operands, no quantization, no fused activation.

  Args:
    m: rows.
    k: the kernel's contraction (dlhs: the forward's n).
    n: the kernel's output columns (dlhs: the forward's k).
    transpose_rhs: dlhs (the kernel starts from tile_m 256 instead of 128).
    generation: TPU generation (VMEM per TensorCore, MXU columns).

  Returns:
    tile_m, tile_k, tile_n, bucket_base, lhs_buffer_count, and vmem_limit_bytes (90% of one
    TensorCore's VMEM, the kernel's default limit).
  """
  gen = tiling_lib.get_generation(generation)
  lanes = 128
  align = lambda x, a: -(-x // a) * a
  limit = int(gen.vmem_bytes * 0.9)
  tile_m = min(256 if transpose_rhs else 128, m)
  tile_n_limit = min(gen.mxu_size * 2, n)
  tile_k, tile_n = align(k, lanes), align(n, lanes)
  n_tiles = k_tiles = 1

  def est(tm, tn, tk, lhs_buffers=2):
    # NOTE: as the kernel estimates: lhs buffers, rhs x3, f32 accumulator, output x2 (bf16).
    return lhs_buffers * tm * tk * 2 + 3 * tk * tn * 2 + tm * tn * 4 + 2 * tm * tn * 2

  while est(tile_m, tile_n, tile_k) > limit and tile_n > tile_n_limit:
    n_tiles += 1
    tile_n = align(n, n_tiles * lanes) // n_tiles
  if tile_n < tile_n_limit:
    n_tiles -= 1
    tile_n = align(n, n_tiles * lanes) // n_tiles
  if est(tile_m, tile_n, tile_k) > limit:
    while est(tile_m, tile_n, tile_k) > limit and tile_k > lanes:
      k_tiles += 1
      tile_k = align(k, k_tiles * lanes) // k_tiles
  bucket_base = tile_m
  for _ in range(1, 4):
    new_tm = tile_m + bucket_base
    if new_tm > m or est(new_tm, tile_n, tile_k) > limit:
      break
    tile_m = new_tm
  buffers = 3 if est(tile_m, tile_n, tile_k, 3) <= limit else 2
  return dict(
    tile_m=tile_m,
    tile_k=tile_k,
    tile_n=tile_n,
    bucket_base=bucket_base,
    lhs_buffer_count=buffers,
    vmem_limit_bytes=limit,
  )


def megablox_v2_row_tiles(
  group_sizes: np.ndarray, *, tile_m: int, sublane: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The v2 kernel's gm tiles (`fill_metadata`), group offset 0, all groups local.

  Args:
    group_sizes: rows per group.
    tile_m: the kernel's tile_m.
    sublane: rows per sublane tile of the lhs dtype (the kernel's `size_lhs_sublane`).

  Returns:
    (group id, first row, end row) per gm tile, in execution order.
  """
  gs = np.asarray(group_sizes, np.int64)
  ends = np.cumsum(gs)
  starts = ends - gs
  gids, lo, hi = [], [], []
  for g in np.flatnonzero(gs > 0):
    cur, end = int(starts[g]), int(ends[g])
    while cur < end:
      size = min(tile_m - cur % sublane, end - cur)
      gids.append(g)
      lo.append(cur)
      hi.append(cur + size)
      cur += size
  return np.asarray(gids, np.int64), np.asarray(lo, np.int64), np.asarray(hi, np.int64)


def megablox_v2_schedule(
  *,
  op: str,
  shape: Shape,
  group_sizes: np.ndarray,
  generation: str | TpuGeneration,
) -> tuple[CallSchedule, dict[str, int]]:
  """The v2 kernel's schedule as a `costmodel.CallSchedule` (fwd or dlhs).

  Per step: an input block is fetched when its index (row range and k tile for the lhs; group,
  k and n tiles for the weights) differs from the previous step's, an output block written when
  its row range or n tile differs from the next step's; bytes clipped at the array edges. The
  step's dot is [tile_m, tile_k] x [tile_k, tile_n], scaled to the step's bucket rows.

  Args:
    op: "fwd" or "dlhs".
    shape: the problem.
    group_sizes: rows per group.
    generation: TPU generation.

  Returns:
    (schedule, tiles as `megablox_v2_tiles` returns them).
  """
  if op not in ("fwd", "dlhs"):
    raise Unsupported(f"megablox-v2 models gmm (fwd, dlhs), not {op}")
  gen = tiling_lib.get_generation(generation)
  m, dk, dn = _kernel_dims(op=op, shape=shape)
  tiles = megablox_v2_tiles(m=m, k=dk, n=dn, transpose_rhs=op == "dlhs", generation=gen)
  tm, tk, tn, base = tiles["tile_m"], tiles["tile_k"], tiles["tile_n"], tiles["bucket_base"]
  # NOTE: bf16 sublane tiling: 8 rows before tpu7x, 16 on tpu7x (jax's tpu_info).
  sublane = min(16 if gen.name == "tpu7x" else 8, m)
  gid, lo, hi = megablox_v2_row_tiles(group_sizes, tile_m=tm, sublane=sublane)
  num_gm, num_k, num_n = gid.size, _cdiv(dk, tk), _cdiv(dn, tn)
  steps = num_n * num_gm * num_k
  itemsize = np.dtype(DTYPE).itemsize
  n_i = np.repeat(np.arange(num_n), num_gm * num_k)
  g_i = np.tile(np.repeat(np.arange(num_gm), num_k), num_n)
  k_i = np.tile(np.arange(num_k), num_n * num_gm)
  cols_k = np.minimum(tk, dk - k_i * tk)
  cols_n = np.minimum(tn, dn - n_i * tn)
  row0 = lo[g_i] // sublane
  lhs_rows = (-(-hi[g_i] // sublane) - row0) * sublane
  last = g_i == num_gm - 1
  out_rows = (np.where(last, -(-hi[g_i] // sublane), hi[g_i] // sublane) - row0) * sublane

  def changed(*idx, prev: bool) -> np.ndarray:
    idx = np.stack(idx, axis=1)
    diff = np.any(idx[1:] != idx[:-1], axis=1)
    moved = np.ones(steps, bool)
    if prev:
      moved[1:] = diff
    else:
      moved[:-1] = diff
    return moved

  if steps:
    lhs_b = np.where(changed(row0, lhs_rows, k_i, prev=True), lhs_rows * cols_k * itemsize, 0)
    rhs_b = np.where(changed(gid[g_i], k_i, n_i, prev=True), cols_k * cols_n * itemsize, 0)
    out_b = np.where(changed(row0, out_rows, n_i, prev=False), out_rows * cols_n * itemsize, 0)
  else:
    lhs_b = rhs_b = out_b = np.zeros(0)
  end_local = hi[g_i] - (lo[g_i] - lo[g_i] % sublane)
  buckets = tm // base
  bucket_rows = base * np.minimum(end_local // base + 1, buckets)
  # NOTE: a bucket's pass costs at least `min_pass_rows` rows (128 on a 256-wide MXU).
  floor = tiling_lib.min_pass_rows(gen)
  scale = np.maximum(bucket_rows, floor) / max(tm, floor)
  import jax

  jaxpr = jax.make_jaxpr(lambda a, b: jax.lax.dot(a, b, preferred_element_type=np.float32))(
    jax.ShapeDtypeStruct((tm, tk), DTYPE), jax.ShapeDtypeStruct((tk, tn), DTYPE)
  ).jaxpr
  sched = CallSchedule(
    name=f"gmm_v2-{op}",
    grid=(num_n, num_gm, num_k),
    dimension_semantics=("parallel", "arbitrary", "arbitrary"),
    steps=steps,
    step_bytes=(lhs_b + rhs_b + out_b).astype(np.float64),
    operand_bytes={"lhs": int(lhs_b.sum()), "rhs": int(rhs_b.sum()), "out": int(out_b.sum())},
    operand_array_bytes={
      "lhs": m * dk * itemsize,
      "rhs": shape.num_groups * dk * dn * itemsize,
      "out": m * dn * itemsize,
    },
    kernel_jaxpr=jaxpr,
    step_scale=scale.astype(np.float64),
    notes=(
      "numpy model of tokamax's gmm_v2 schedule (emit_pipeline over HBM refs)",
      *(("in-VMEM transpose of the weight tile (XLU) not modeled",) if op == "dlhs" else ()),
    ),
  )
  return sched, tiles


def _megablox_v2_build(*, op: str, shape: Shape, group_sizes: np.ndarray, generation) -> Case:
  """tokamax's v2 ragged dot at the tiles its `calculate_tiling` picks for the generation.

  NOTE: `fn` is the megablox forward at the same tiles, for shape checks only: the schedule is
  `megablox_v2_schedule`'s (the bench uses `Case.schedules`); it is not timed on TPU here.
  """
  gen = tiling_lib.get_generation(generation)
  sched, tiles = megablox_v2_schedule(op=op, shape=shape, group_sizes=group_sizes, generation=gen)
  til = (tiles["tile_m"], tiles["tile_k"], tiles["tile_n"])
  m, dk, dn = _kernel_dims(op=op, shape=shape)

  def fn(*args):
    raise NotImplementedError("megablox-v2 is modeled from its schedule only (not run here).")

  return Case(
    fn=fn,
    args=op_arrays(op=op, shape=shape, group_sizes=group_sizes),
    tiling=til,
    row_macs=_gmm_row_macs(dk, dn, til[1], til[2]),
    schedules=(sched,),
    extra=dict(
      bucket_base=tiles["bucket_base"],
      lhs_buffer_count=tiles["lhs_buffer_count"],
      row_tiles=sched.grid[1],
    ),
  )


register(
  Impl(
    name="megablox-v2",
    build=_megablox_v2_build,
    tiling_depends_on_generation=True,
    program_depends_on_generation=True,
  )
)


# ----------------------------------------------------------------------------------------------
# Upstream megablox at its best tiling: per case and chip, the fastest
# modeled (tm, tk, tn) from a grid that fits VMEM.
#
# NOTE: "fits" uses our `vmem_estimate_bytes` for megablox's blocks (kind "gmm": lhs [tm, tk],
# rhs [tk, tn], out [tm, tn] double-buffered + f32 acc [tm, tn]; "tgmm": lhs [tm, tk], rhs
# [tm, tn], out [tk, tn] + f32 acc [tk, tn] and the f32 masked input copies megablox's tgmm makes)
# against `usable_vmem_bytes` (7/8 of physical VMEM), not the scoped default: megablox passes no
# `vmem_limit_bytes`, so it reaches that budget only if its caller raises the scoped limit. The
# estimate leaves out the f32 masked copies megablox's gmm makes on a ragged last k tile; both
# choices admit more tilings (generous to megablox). Whether the best also fits the scoped
# default is reported (`fits_scoped`), and `megablox-best-scoped` searches within it.

# None: the full dimension.
MEGABLOX_GRID_SIZES = (128, 256, 512, 1024, None)
# NOTE: tokamax's tuned tile_k / tile_n values (1536, 1792, 2944, 3584, ...; bench.tokamax_tiles)
# join the tk and tn candidates, so megablox-best covers tokamax's tiles too; tm keeps the grid
# above (tokamax's tile_m values are all in it).
MEGABLOX_KN_EXTRA_SIZES = tokamax_tiles.TILE_SIZES


def _kernel_dims(*, op: str, shape: Shape) -> tuple[int, int, int]:
  """(m, dim tiled by tk, dim tiled by tn) as megablox's kernel sees the op."""
  return (shape.m, shape.n, shape.k) if op == "dlhs" else (shape.m, shape.k, shape.n)


def megablox_tilings(
  *,
  op: str,
  shape: Shape,
  sizes: tuple[int | None, ...] = MEGABLOX_GRID_SIZES,
  kn_extra: tuple[int, ...] = MEGABLOX_KN_EXTRA_SIZES,
) -> list[tuple[int, int, int]]:
  """The (tm, tk, tn) grid for megablox, in its kernel's terms.

  Each tile takes every value of `sizes` (None: the full dim), tk and tn also those of
  `kn_extra`, clamped to its dim as `_megablox_build` clamps (dlhs: tk tiles n and tn tiles k),
  deduplicated; tilings with m % tm != 0 (megablox refuses them) are left out.

  Args:
    op: "fwd", "dlhs" or "drhs".
    shape: the problem.
    sizes: tile sizes to try per dimension.
    kn_extra: more tile sizes for tk and tn (default: tokamax's tuned ones).

  Returns:
    The tilings, sorted.
  """
  dims = _kernel_dims(op=op, shape=shape)
  per_dim = [
    sorted({min(s or d, d) for s in (sizes if i == 0 else (*sizes, *kn_extra))})
    for i, d in enumerate(dims)
  ]
  return [
    (tm, tk, tn) for tm in per_dim[0] for tk in per_dim[1] for tn in per_dim[2] if dims[0] % tm == 0
  ]


def megablox_vmem_bytes(*, op: str, tiling: tuple[int, int, int]) -> int:
  """Our VMEM estimate for megablox's gmm (fwd, dlhs) or tgmm (drhs) at a tiling, bf16.

  Args:
    op: "fwd", "dlhs" or "drhs".
    tiling: (tm, tk, tn) in the kernel's terms.

  Returns:
    Bytes.
  """
  tm, tk, tn = tiling
  kind = "tgmm" if op == "drhs" else "gmm"
  return tiling_lib.vmem_estimate_bytes(
    tm=tm, tk=tk, tn=tn, lhs_dtype=DTYPE, rhs_dtype=DTYPE, out_dtype=DTYPE, kind=kind
  )


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def megablox_lower_bound_us(
  *,
  op: str,
  shape: Shape,
  group_sizes: np.ndarray,
  tiling: tuple[int, int, int],
  generation: str | TpuGeneration,
  step_overhead_s: float = costmodel.DEFAULT_STEP_OVERHEAD_S,
) -> float:
  """A lower bound of megablox's modeled time at a tiling, from numpy alone (no tracing).

  The cost model gives Σ_steps max(mxu, dma) + steps·overhead ≥ max(Σ mxu, Σ dma) +
  steps·overhead. Steps and Σ mxu are exact (megablox's grid and its one dot per step, as
  `make_group_metadata` and `kernel_dot_macs` count them; tgmm's skipped empty-group steps
  excluded). Σ dma is bounded below by pipeline fetches that must happen: with more than one k
  tile every step changes the lhs and (gmm) the rhs block, so both are fetched every step;
  otherwise each distinct block is fetched at least once per sweep of the inner grid axes (the
  first step of a sweep differs from the previous sweep's last step when there are two or more
  m tiles), and each output block is written at least once. `megablox_grid_search` checks
  bound ≤ model on every tiling it analyzes.

  Args:
    op: "fwd", "dlhs" or "drhs".
    shape: the problem.
    group_sizes: rows per group.
    tiling: (tm, tk, tn) in the kernel's terms, clamped, m % tm == 0.
    generation: TPU generation.
    step_overhead_s: the cost model's per-step overhead.

  Returns:
    Microseconds.
  """
  gen = tiling_lib.get_generation(generation)
  mxu = gen.mxu_size
  floor = tiling_lib.min_pass_rows(gen)
  m, dk, dn = _kernel_dims(op=op, shape=shape)
  tm, tk, tn = tiling
  tiles_k, tiles_n = _cdiv(dk, tk), _cdiv(dn, tn)
  gs = np.asarray(group_sizes, np.int64)
  ends = np.cumsum(gs)
  starts = ends - gs
  nonempty = gs > 0
  first, stop = starts // tm, -(-ends // tm)
  visits = int(np.where(nonempty, stop - first, 0).sum())  # visits of non-empty groups
  # Distinct m tiles holding rows of non-empty groups.
  cover = np.zeros(m // tm + 1, np.int64)
  np.add.at(cover, first[nonempty], 1)
  np.add.at(cover, stop[nonempty], -1)
  m_tiles = int((np.cumsum(cover)[:-1] > 0).sum())
  groups = int(nonempty.sum())
  pad = lambda x: _cdiv(x, mxu) * mxu
  if op == "drhs":
    # Grid (tiles_n, tiles_k, visits incl. one per empty group); dot [tk, tm] x [tm, tn].
    steps = tiles_n * tiles_k * (visits + int((~nonempty).sum()))
    macs = tiles_n * tiles_k * visits * max(tk, floor) * pad(tm) * pad(tn)
    lhs = (tiles_n if (tiles_k >= 2 or m_tiles >= 2) else 1) * m_tiles * tm * dk
    rhs = (tiles_k if m_tiles >= 2 else 1) * m_tiles * tm * dn
    out = groups * dk * dn
  else:
    # Grid (tiles_n, visits, tiles_k); dot [tm, tk] x [tk, tn].
    steps = tiles_n * visits * tiles_k
    macs = steps * max(tm, floor) * pad(tk) * pad(tn)
    if tiles_k >= 2:
      lhs, rhs = tiles_n * visits * tm * dk, visits * dk * dn
    else:
      lhs = (tiles_n if m_tiles >= 2 else 1) * m_tiles * tm * dk
      rhs = groups * dk * dn
    out = m_tiles * tm * dn
  itemsize = np.dtype(DTYPE).itemsize
  mxu_s = 2 * macs / gen.peak_bf16_flops
  dma_s = (lhs + rhs + out) * itemsize / gen.hbm_bytes_per_s
  return (steps * step_overhead_s + max(mxu_s, dma_s)) * 1e6


@dataclasses.dataclass(frozen=True, kw_only=True)
class GridResult:
  """The best megablox tiling of one case on one chip.

  Attributes:
    tiling: (tm, tk, tn) in the kernel's terms.
    modeled_us: its modeled time.
    schedules: its `costmodel.analyze` result.
    vmem_bytes: its VMEM estimate.
    fits_scoped: whether that estimate fits the chip's scoped VMEM default.
    budget_bytes: the VMEM budget of the search.
    enumerated: tilings in the grid.
    fitting: of those, tilings within the budget.
    analyzed: tilings modeled (traced) on this chip; the others were pruned by the lower bound.
    seconds: wall time of the search.
  """

  tiling: tuple[int, int, int]
  modeled_us: float
  schedules: tuple[CallSchedule, ...]
  vmem_bytes: int
  fits_scoped: bool
  budget_bytes: int
  enumerated: int
  fitting: int
  analyzed: int
  seconds: float


# Analyses of megablox tilings, per (shape, op, group sizes): shared by the chips and by
# megablox-best / megablox-best-scoped. NOTE: only the last few cases are kept (a 128^3 schedule
# of a big shape holds per-step arrays of millions of steps).
_GRID_CACHE: dict[tuple, dict[tuple[int, int, int], tuple[CallSchedule, ...]]] = {}
_GRID_CACHE_CASES = 2


def _grid_schedules(
  *, op: str, shape: Shape, group_sizes: np.ndarray, tiling: tuple[int, int, int]
) -> tuple[CallSchedule, ...]:
  key = (shape, op, np.asarray(group_sizes, np.int32).tobytes())
  if key not in _GRID_CACHE:
    while len(_GRID_CACHE) >= _GRID_CACHE_CASES:
      del _GRID_CACHE[next(iter(_GRID_CACHE))]
    _GRID_CACHE[key] = {}
  per_case = _GRID_CACHE[key]
  if tiling not in per_case:
    case = _megablox_build(tiling)(op=op, shape=shape, group_sizes=group_sizes, generation=None)
    per_case[tiling] = tuple(costmodel.analyze(case.fn, *case.args, step_scale=case.step_scale))
  return per_case[tiling]


def megablox_grid_search(
  *,
  op: str,
  shape: Shape,
  group_sizes: np.ndarray,
  generation: str | TpuGeneration,
  sizes: tuple[int | None, ...] = MEGABLOX_GRID_SIZES,
  kn_extra: tuple[int, ...] = MEGABLOX_KN_EXTRA_SIZES,
  vmem_budget_bytes: int | None = None,
  prune: bool = True,
) -> GridResult:
  """The fastest modeled megablox tiling of the grid that fits VMEM.

  Tilings are modeled in order of their lower bound (`megablox_lower_bound_us`); with `prune`
  the search stops at the first whose bound is ≥ the best modeled time so far (it and all later
  ones cannot be faster). Raises if a modeled time is below its bound (an unsound bound).

  Args:
    op: "fwd", "dlhs" or "drhs".
    shape: the problem.
    group_sizes: rows per group.
    generation: TPU generation.
    sizes: tile sizes per dimension (see `megablox_tilings`).
    kn_extra: more tk / tn sizes (see `megablox_tilings`).
    vmem_budget_bytes: VMEM budget; default `usable_vmem_bytes(generation)`.
    prune: skip tilings whose lower bound cannot beat the best (False: model all).

  Returns:
    The `GridResult`.

  Raises:
    Unsupported: no tiling of the grid fits the budget.
  """
  t0 = time.time()
  gen = tiling_lib.get_generation(generation)
  budget = tiling_lib.usable_vmem_bytes(gen) if vmem_budget_bytes is None else vmem_budget_bytes
  tilings = megablox_tilings(op=op, shape=shape, sizes=sizes, kn_extra=kn_extra)
  fitting = [t for t in tilings if megablox_vmem_bytes(op=op, tiling=t) <= budget]
  if not fitting:
    raise Unsupported(f"no megablox tiling of the grid fits {budget / 2**20:.0f} MiB of VMEM")
  bound = {
    t: megablox_lower_bound_us(
      op=op, shape=shape, group_sizes=group_sizes, tiling=t, generation=gen
    )
    for t in fitting
  }
  best, best_us, best_scheds, analyzed = None, math.inf, None, 0
  for t in sorted(fitting, key=lambda t: (bound[t], t)):
    if prune and bound[t] >= best_us:
      break
    scheds = _grid_schedules(op=op, shape=shape, group_sizes=group_sizes, tiling=t)
    analyzed += 1
    us = costmodel.cost(scheds, generation=gen).modeled_us
    if us < bound[t] * (1 - 1e-9):
      raise AssertionError(f"megablox lower bound {bound[t]} > modeled {us} at {t} ({op})")
    if us < best_us:
      best, best_us, best_scheds = t, us, scheds
  vmem = megablox_vmem_bytes(op=op, tiling=best)
  return GridResult(
    tiling=best,
    modeled_us=best_us,
    schedules=best_scheds,
    vmem_bytes=vmem,
    fits_scoped=vmem <= gen.scoped_vmem_default_bytes,
    budget_bytes=budget,
    enumerated=len(tilings),
    fitting=len(fitting),
    analyzed=analyzed,
    seconds=time.time() - t0,
  )


def _megablox_best_build(*, scoped: bool):
  def build(*, op: str, shape: Shape, group_sizes: np.ndarray, generation: TpuGeneration) -> Case:
    gen = tiling_lib.get_generation(generation)
    res = megablox_grid_search(
      op=op,
      shape=shape,
      group_sizes=group_sizes,
      generation=gen,
      vmem_budget_bytes=gen.scoped_vmem_default_bytes if scoped else None,
    )
    case = _megablox_build(res.tiling)(op=op, shape=shape, group_sizes=group_sizes, generation=gen)
    extra = dict(
      grid_search=dict(
        budget_mib=res.budget_bytes / 2**20,
        vmem_mib=res.vmem_bytes / 2**20,
        fits_scoped=res.fits_scoped,
        enumerated=res.enumerated,
        fitting=res.fitting,
        analyzed=res.analyzed,
        seconds=res.seconds,
      )
    )
    return dataclasses.replace(case, schedules=res.schedules, extra=extra)

  return build


register(
  Impl(
    name="megablox-best",
    build=_megablox_best_build(scoped=False),
    tiling_depends_on_generation=True,
  )
)
register(
  Impl(
    name="megablox-best-scoped",
    build=_megablox_best_build(scoped=True),
    tiling_depends_on_generation=True,
  )
)


# ----------------------------------------------------------------------------------------------
# Our kernels (pallas_moe).
#
# NOTE: `pallas_moe.gmm` / `pallas_moe.tgmm` are functions (re-exported from `pallas_moe.ops`);
# there is no module of that name. The cases call them with `interpret=False` (compiled Mosaic):
# the bench only traces them, and `interpret=None` would put both the Mosaic and the interpret
# kernel behind a `lax.platform_dependent`, which the cost model cannot schedule. They are traced
# under `tiling.use_generation(generation)` so the ops' VMEM check uses the modeled chip's budget.


def _pallas_moe_available() -> str | None:
  try:
    ops = importlib.import_module("pallas_moe.ops")
  except ImportError as e:
    return f"pallas_moe.ops not importable ({e})"
  if not (callable(getattr(ops, "gmm", None)) and callable(getattr(ops, "tgmm", None))):
    return "pallas_moe.ops has no callable gmm/tgmm"
  return None


def pallas_moe_step_scale(
  *, op: str, tm: int, sub_m: int, branches_per_sub: int = 1
) -> Callable[[StepContext], np.ndarray]:
  """Per-step MXU work of our kernels, from their schedule (what they really multiply).

  Our gmm visits (group, m-tile) pairs from `metadata.make_schedule`, including fill visits that
  only write zeros / existing_out; tgmm also visits empty groups once. An active visit multiplies
  each `sub_m`-row sub-block of its m-tile that holds a row of its group and skips the others
  (`tests/kernel_testing.mxu_rows` is the same count; tests check it against the kernels'
  interpret-mode `probe.count_rows`). The kernel body holds one sub-block dot inside a loop over the
  hit sub-blocks, twice over for gmm with a ragged last k tile (masked and unmasked branches, one
  runs); the cost model counts each dot once per step, so the hook scales by hits / branches.

  Args:
    op: "fwd"/"dlhs" (gmm: prefetch (group_offsets, visit_group, visit_m_tile, visit_load_tile,
      visit_active, group_offset), visit = grid axis 1) or "drhs" (tgmm: prefetch
      (group_offsets, visit_group, visit_load_tile, visit_active, group_offset), visit = axis 2).
    tm: the m tile.
    sub_m: rows per MXU pass in the kernel.
    branches_per_sub: dot-holding branches per sub-block (2 for gmm with k % tk != 0).

  Returns:
    The hook.
  """
  active_idx, visit_axis = (3, 2) if op == "drhs" else (4, 1)

  def scale(ctx: StepContext) -> np.ndarray:
    prefetch = [np.asarray(x) for x in ctx.index_operands]
    visit = ctx.program_ids[visit_axis]
    offsets = prefetch[0]
    group = prefetch[1][visit] + int(prefetch[-1].reshape(-1)[0])
    start, end = offsets[group], offsets[group + 1]
    lo = prefetch[2][visit][:, None] * tm + np.arange(0, tm, sub_m)[None, :]
    active = prefetch[active_idx][visit] == 1
    hits = active[:, None] & (lo < end[:, None]) & (lo + sub_m > start[:, None])
    return hits.sum(axis=1) / branches_per_sub

  return scale


# NOTE: the row-tile gmm's scalar prefetch: offsets, first, last, load_rank, load_group,
# num_loads, active_tiles, group_offset, and with pass cuts tile_start, tile_reach; tgmm's:
# offsets, first, last, finalize_tile, active_tiles, group_offset.
_GMM_PASS_CUT_PREFETCH = 10


def _prefetch_tail(ctx: StepContext) -> int:
  """Entries after a row-tile kernel's group_offset in its prefetch (2 with pass cuts)."""
  return 2 if len(ctx.index_operands) == _GMM_PASS_CUT_PREFETCH else 0


def _local_groups(ctx: StepContext) -> tuple[np.ndarray, np.ndarray]:
  """(starts, ends) rows of the local groups, from a row-tile kernel's prefetched schedule."""
  prefetch = [np.asarray(x) for x in ctx.index_operands]
  offsets = prefetch[0]
  goff = int(prefetch[-1 - _prefetch_tail(ctx)].reshape(-1)[0])
  num_local = prefetch[3].shape[0]
  return offsets[goff : goff + num_local], offsets[goff + 1 : goff + num_local + 1]


def _first_active_tile(ctx: StepContext) -> int:
  """The m-tile of a row-tile kernel's first m step (`metadata.TileGroups.active_tiles`; 0 with
  pass cuts, whose steps are the cut tiles)."""
  return int(np.asarray(ctx.index_operands[-2 - _prefetch_tail(ctx)]).reshape(-1)[0])


def _pass_cuts(ctx: StepContext) -> dict[str, np.ndarray] | None:
  """The row-tile gmm's pass-cut tiles (`metadata.pass_cut_rows`' dict) from its prefetch, or
  None when it runs fixed m-tiles."""
  if not _prefetch_tail(ctx):
    return None
  prefetch = [np.asarray(x).astype(np.int64) for x in ctx.index_operands]
  return dict(
    tile_start=prefetch[8],
    tile_reach=prefetch[9],
    tile_first_group=prefetch[1],
    tile_last_group=prefetch[2],
    num_tiles=prefetch[6].reshape(-1)[1:2],
  )


def rowtile_gmm_passes(
  ctx: StepContext, *, tm: int, sub_m: int, align: int, tail: int
) -> tuple[np.ndarray, np.ndarray]:
  """Per step of the row-tile gmm: (sub_m-row passes, widened passes of sub_m + tail rows), as
  the kernel runs them (`metadata.group_pass_plan`)."""

  def pushed(s, e, cover_end=None):
    _, passes, merged = metadata.group_pass_plan(
      s, e, sub_m=sub_m, align=align, tail=tail, tm=tm, cover_end=cover_end
    )
    return np.stack([passes - 2 * merged, merged.astype(passes.dtype)])

  starts, ends = _local_groups(ctx)
  cuts = _pass_cuts(ctx)
  if cuts is not None:
    # NOTE: step s is cut tile s: its groups first..last, their passes up to the next cut.
    tile = ctx.program_ids[-1].astype(np.int64)
    row0 = cuts["tile_start"][tile][:, None]
    row_end = cuts["tile_start"][tile + 1][:, None]
    g = np.arange(starts.size)[None, :]
    mine = (g >= cuts["tile_first_group"][tile][:, None]) & (
      g <= cuts["tile_last_group"][tile][:, None]
    )
    s = np.maximum(starts[None, :], row0) - row0
    e = np.minimum(ends[None, :], row_end) - row0
    both = pushed(s, e, cover_end=ends[None, :] - row0)
    both = np.where(mine & (e > s) & (ends > starts)[None, :], both, 0).sum(axis=2)
    return both[0], both[1]
  # NOTE: the grid's m axis walks only the visited tiles, from the first active one.
  tile = ctx.program_ids[-1] + _first_active_tile(ctx)
  row0 = tile[:, None].astype(np.int64) * tm
  # NOTE: as in the kernels: group g multiplies the passes covering its rows of the tile
  # (`metadata.group_passes`), none where it has no rows there.
  s = np.clip(starts[None, :] - row0, 0, tm)
  e = np.clip(ends[None, :] - row0, 0, tm)
  both = np.where(e > s, pushed(s, e), 0).sum(axis=2)
  return both[0], both[1]


def rowtile_gmm_pass_counts(
  *, tm: int, sub_m: int, lhs_itemsize: int = 2, out_itemsize: int = 2, rows_stationary=False
) -> Callable[[StepContext], tuple[np.ndarray, np.ndarray]]:
  """`rowtile_gmm_passes` for one row-tile gmm configuration: its pass alignment and widened
  pass (`metadata.merge_tail_rows`) as the kernel derives them."""
  align = tiling_lib.gmm_pass_align(
    sub_m=sub_m, tm=tm, lhs_itemsize=lhs_itemsize, out_itemsize=out_itemsize
  )
  tail = metadata.merge_tail_rows(sub_m=sub_m, tm=tm, align=align, rows_stationary=rows_stationary)
  return functools.partial(rowtile_gmm_passes, tm=tm, sub_m=sub_m, align=align, tail=tail)


def rowtile_tgmm_dots(
  ctx: StepContext, *, tm: int, sub_m: int, interior_subs: int, align: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per step: the dots the row-tile tgmm runs (`tgmm.tgmm_rowtile_pallas`), by kind.

  For each group with rows in the step's tile, its passes of sub_m rows from its first row
  rounded down to `align` (`metadata.group_passes`): one masked pass dot written into the
  accumulator where the group starts in the tile, unmasked runs of `interior_subs` passes over
  the whole passes after it, and masked pass dots for the rest (the run's leftover and the
  group's last pass).

  Args:
    ctx: the tgmm call's `StepContext` (prefetch: offsets, first, last, finalize_tile,
      active_tiles, group_offset).
    tm: m tile.
    sub_m: rows per pass.
    interior_subs: passes per run.
    align: the passes' alignment (`tiling.tgmm_pass_align`); None: sub_m (the sub_m grid).

  Returns:
    (first, runs, singles): [steps] float arrays of dots of 1, interior_subs and 1 passes.
  """
  starts, ends = _local_groups(ctx)
  tile = ctx.program_ids[-1] + _first_active_tile(ctx)
  row0 = (tile * tm)[:, None]  # [steps, 1]
  # NOTE: as in the kernel: the group's rows in the tile, local to it, [lo, hi).
  live = (ends > starts)[None, :] & (ends[None, :] > row0) & (starts[None, :] < row0 + tm)
  lo = np.maximum(starts[None, :], row0) - row0
  hi = np.minimum(ends[None, :], row0 + tm) - row0
  starts_here = starts[None, :] >= row0
  first_row, passes = metadata.group_passes(
    lo, hi, sub_m=sub_m, align=sub_m if align is None else align
  )
  rest = starts_here.astype(np.int64)
  run_loop = sub_m < tm and tm // sub_m >= interior_subs
  whole = (hi - first_row) // sub_m
  runs = np.maximum(whole - rest, 0) // interior_subs if run_loop else np.zeros_like(lo)
  singles = passes - rest - runs * interior_subs
  sums = [np.where(live, x, 0).sum(axis=1).astype(np.float64) for x in (starts_here, runs, singles)]
  return sums[0], sums[1], sums[2]


def _padded_rows(rows: int, mxu: int) -> int:
  # NOTE: a sub-block's rows are the tgmm dot's contraction: the model pads it to the MXU edge.
  return -(-rows // mxu) * mxu


def rowtile_hooks(
  *,
  op: str,
  tm: int,
  tk: int,
  tn: int,
  sub_m: int,
  sequential_sweeps: bool,
  itemsize: int = 2,
  block_bytes: int | None = None,
  rows: int | None = None,
  out_cols: int | None = None,
  out_itemsize: int = 2,
  mxu: int = 128,
  interior_subs: int = INTERIOR_SUBS,
  lhs_itemsize: int = 2,
  rhs_itemsize: int = 2,
  unowned_rows: str = "zero",
  rows_stationary: bool = False,
  transpose_lhs: bool = False,
):
  """Cost-model hooks of the row-tile kernels, from their prefetched schedule.

  MXU: each step multiplies, for every group of its tile, the sub_m-row sub-blocks holding the
  group's rows (the same count as `tests/kernel_testing.rowtile_mxu_rows`, checked against the
  kernels' `probe.count_rows`). gmm: its sub-block dot runs once per pass, and its widened
  last-pass dot of sub_m + tail rows (`metadata.merge_tail_rows`; where the kernel has one)
  once per widened pass; the model counts each once per step, so step_scale = the rows pushed
  over their rows together (a dot costs its rows). tgmm: its three dots (the group's first
  sub-block, an interior run, a single sub-block; `rowtile_tgmm_dots`) run as often as that
  function counts; step_scale is their padded work over the body's (one of each). Manual DMA:
  gmm loads a group's [k, tn] weight block, tgmm writes a group's [tk, tn] output block; each
  is spread over the sub-block work between the points the kernel starts and waits for it, or
  exposed when there is none (`tiling.rowtile_manual_dma`). The row blocks (gmm's lhs and
  output, tgmm's lhs and rhs) move by manual DMA too: only the rows of a visited tile that hold
  local rows, rounded out to the DMA granule (`tiling.tile_rows_moved`), prefetched during the
  previous step of the kernel's chain and written back during the next one, the chain's first
  fetch and last write exposed (`tiling.rowtile_row_dma`).

  Args:
    op: "fwd"/"dlhs" (gmm prefetch: offsets, first, last, load_rank, load_group, num_loads,
      group_offset) or "drhs" (tgmm prefetch: offsets, first, last, finalize_tile, group_offset).
    tm: m tile.
    tk: gmm: the contraction k (whole); tgmm: its k tile.
    tn: n tile.
    sub_m: rows per MXU pass.
    sequential_sweeps: the kernel's option (`tiling.sequential_sweeps(generation)` in ops).
    itemsize: bytes per weight (gmm) / output (tgmm) element.
    block_bytes: bytes of one manual block (default tk * tn * itemsize); quantized weights add
      their [1, tn] f32 scales.
    rows: the operands' rows (m): where the row blocks are clipped; gmm: the zero fill's.
    out_cols: gmm: the output's columns (the zero fill's).
    out_itemsize: gmm: bytes per output element.
    mxu: tgmm: the MXU edge the cost model pads a dot's contraction to.
    interior_subs: tgmm: the kernel's sub-blocks per interior run.
    lhs_itemsize: bytes per lhs element.
    rhs_itemsize: tgmm: bytes per rhs element.
    unowned_rows: gmm: "undefined" (`fill_unowned=False`, no existing_out: only a tile's local
      rows are written back) or "zero" / "existing" (visited tiles are written whole).
    rows_stationary: gmm: the kernel's orientation option (no widened pass with it).
    transpose_lhs: tgmm: its lhs comes as [m, k] (gmm's backward): rows move in sublane
      granules and the passes start at each group's first row (`tiling.tgmm_pass_align`).

  Returns:
    (step_scale, step_manual_bytes). They also cover the gmm's `pallas_moe_zero_fill` call: no
    MXU work, and the bytes of the unvisited tiles' rows written once.
  """

  # NOTE: the passes start at each group's first row in the tile, to the VMEM tile of the rows
  # they slice: gmm's lhs and output, tgmm's lhs and rhs (lhs's lanes unless `transpose_lhs`).
  tail = 0
  if op == "drhs":
    align = tiling_lib.tgmm_pass_align(
      sub_m=sub_m,
      tm=tm,
      lhs_itemsize=lhs_itemsize,
      rhs_itemsize=rhs_itemsize,
      transpose_lhs=transpose_lhs,
    )
  else:
    align = tiling_lib.gmm_pass_align(
      sub_m=sub_m, tm=tm, lhs_itemsize=lhs_itemsize, out_itemsize=out_itemsize
    )
    tail = metadata.merge_tail_rows(
      sub_m=sub_m, tm=tm, align=align, rows_stationary=rows_stationary
    )
  min_rows = min(mxu, MIN_PASS_ROWS)

  def is_fill(ctx: StepContext) -> bool:
    return "pallas_moe_zero_fill" in ctx.name

  def scale(ctx: StepContext) -> np.ndarray:
    if is_fill(ctx):
      return np.zeros(1)
    if op == "drhs":
      first, runs, singles = rowtile_tgmm_dots(
        ctx, tm=tm, sub_m=sub_m, interior_subs=interior_subs, align=align
      )
      one, run = _padded_rows(sub_m, mxu), _padded_rows(interior_subs * sub_m, mxu)
      # NOTE: the kernel body holds the first and the single dots, and the run's when the tile
      # has room for a run (as the kernel decides statically).
      body = 2 * one + (run if sub_m < tm and tm // sub_m >= interior_subs else 0)
      return ((first + singles) * one + runs * run) / body
    # NOTE: a pass costs max(rows, the MXU's minimum) (`generations.min_pass_rows`).
    one, wide = max(sub_m, min_rows), max(sub_m + tail, min_rows)
    regular, widened = rowtile_gmm_passes(ctx, tm=tm, sub_m=sub_m, align=align, tail=tail)
    return (regular * one + widened * wide) / (one + (wide if tail else 0))

  def manual(ctx: StepContext) -> tuple[np.ndarray, np.ndarray]:
    if is_fill(ctx):
      if rows is None or out_cols is None:
        raise ValueError("rowtile_hooks(rows=, out_cols=) are needed to model the zero fill.")
      first, num = (int(x) for x in np.asarray(ctx.index_operands[0]).reshape(-1)[:2])
      zero_rows = first * tm + max(0, rows - (first + num) * tm)
      return np.full(1, float(zero_rows * out_cols * out_itemsize)), np.zeros(1)
    starts, ends = _local_groups(ctx)
    # NOTE: in the coordinates of the visited tiles (the grid starts at the first active one);
    # pass-cut tiles are in the rows' own.
    cuts = _pass_cuts(ctx)
    shift = _first_active_tile(ctx) * tm
    sweeps = math.prod(ctx.grid[:-1])
    over, exposed = tiling_lib.rowtile_manual_dma(
      cuts=cuts,
      starts=starts - shift,
      ends=ends - shift,
      m=ctx.grid[-1] * tm,
      tm=tm,
      sub_m=sub_m,
      kind="tgmm" if op == "drhs" else "gmm",
      sweeps=sweeps,
      block_bytes=tk * tn * itemsize if block_bytes is None else block_bytes,
      sequential_sweeps=sequential_sweeps,
      align=align,
      tail=tail,
    )
    row_over, row_exposed = tiling_lib.rowtile_row_dma(
      **_rowtile_row_blocks(ctx, starts=starts, ends=ends), sweeps=sweeps,
      sequential_sweeps=sequential_sweeps,
    )  # fmt: skip
    return over + row_over, exposed + row_exposed

  def _rowtile_row_blocks(ctx: StepContext, *, starts, ends) -> dict:
    """The row blocks each step moves (`tiling.rowtile_row_dma`'s fetches and writes)."""
    if rows is None:
      raise ValueError("rowtile_hooks(rows=) is needed to model the row blocks' DMAs.")
    tile = ctx.program_ids[-1].astype(np.int64) + _first_active_tile(ctx)
    row0 = tile * tm
    # NOTE: the local rows [rows_start, rows_end) in the tile, relative to its first row.
    lo = np.maximum(starts[0] - row0, 0) if starts.size else np.zeros_like(row0)
    hi = np.minimum(ends[-1] - row0, tm) if ends.size else np.zeros_like(row0)
    cuts = _pass_cuts(ctx)
    written_hi = None
    if cuts is not None:
      # NOTE: a cut tile fetches the rows its passes read and writes up to the next cut.
      row0 = cuts["tile_start"][tile]
      lo = np.maximum(starts[0] - row0, 0)
      hi = cuts["tile_reach"][tile] - row0
      written_hi = cuts["tile_start"][tile + 1] - row0

    def moved(granule):
      # NOTE: gmm pads its lhs and output rows to the granule (when the granule divides tm).
      m = rows
      if op != "drhs" and tm % granule == 0:
        m = -(-rows // granule) * granule
      return tiling_lib.tile_rows_moved(row0=row0, lo=lo, hi=hi, tm=tm, m=m, granule=granule)

    def manual_dma(operand: str) -> int:
      # NOTE: an operand the pipeline moves (a kernel version with BlockSpecs for it) is
      # counted by `costmodel.analyze` already.
      return int(operand not in ctx.pipelined)

    if op == "drhs":
      # NOTE: both fetched every step (a single visited tile too: the k, n windows change).
      lhs_rows = moved(tiling_lib.row_granule_of(lhs_itemsize, lanes=not transpose_lhs))
      rhs_rows = moved(tiling_lib.row_granule_of(rhs_itemsize))
      every = np.arange(tile.size)
      fetches = [
        (lhs_rows * tk * lhs_itemsize * manual_dma("in0"), every),
        (rhs_rows * tn * rhs_itemsize * manual_dma("in1"), every),
      ]
      return dict(fetches=fetches, writes=np.zeros(tile.size))
    lhs_rows = moved(tiling_lib.row_granule_of(lhs_itemsize))
    if written_hi is not None:
      granule = tiling_lib.row_granule_of(out_itemsize)
      padded = -(-rows // granule) * granule
      out_lo = lo if unowned_rows == "undefined" else 0 * lo
      out_rows = tiling_lib.tile_rows_moved(
        row0=row0, lo=out_lo, hi=written_hi, tm=tm, m=padded, granule=granule
      )
    elif unowned_rows == "undefined":
      out_rows = moved(tiling_lib.row_granule_of(out_itemsize))
    else:
      granule = tiling_lib.row_granule_of(out_itemsize)
      padded = -(-rows // granule) * granule if tm % granule == 0 else rows
      out_rows = np.maximum(np.minimum(padded - row0, tm), 0)
    return dict(
      fetches=[(lhs_rows * tk * lhs_itemsize * manual_dma("in0"), tile)],
      writes=out_rows * tn * out_itemsize * manual_dma("out0"),
    )

  return scale, manual


def _in_generation(fn: Callable[..., Any], generation: TpuGeneration) -> Callable[..., Any]:
  def wrapped(*args):
    with use_generation(generation):
      return fn(*args)

  return wrapped


def _visits_gmm(x, w, gs, *, zero, **kw):
  from pallas_moe.gmm import gmm_pallas

  return gmm_pallas(x, w, gs, out_dtype=DTYPE, group_offset=zero, interpret=False, **kw)


def _visits_tgmm(x, y, gs, *, zero, num_groups, **kw):
  from pallas_moe.tgmm import tgmm_pallas

  return tgmm_pallas(
    x,
    y,
    gs,
    out_dtype=DTYPE,
    group_offset=zero,
    num_actual_groups=num_groups,
    interpret=False,
    **kw,
  )


def _pallas_moe_build(
  tiling: tuple[int, int, int] | None, schedule: str = "ops", unowned_rows: str = "zero"
):
  """Our kernels with fixed tiles (clamped to the dims, like MaxText), or None: the heuristic.

  schedule "ops": what `pallas_moe.ops` runs (the row-tile kernels when the tiles allow);
  "visits": the visit-schedule kernels with `tiling.pick_tiling`'s tiles (the previous default).
  unowned_rows: `pallas_moe.gmm`'s option: "zero" writes exact zeros to the rows past
  sum(group_sizes); "undefined" (what the MoE block runs) leaves them unwritten.
  """

  def build(*, op: str, shape: Shape, group_sizes: np.ndarray, generation: TpuGeneration) -> Case:
    ops = importlib.import_module("pallas_moe.ops")
    m, k, n, g = shape.m, shape.k, shape.n, shape.num_groups
    args = op_arrays(op=op, shape=shape, group_sizes=group_sizes)
    # NOTE: the weight gradient as gmm's backward runs it: lhs as the [m, k] array the forward
    # read (`tgmm(..., transpose_lhs=True)`), not a transposed copy.
    transposed = op == "drhs" and schedule == "ops"
    if transposed:
      args = (jax.ShapeDtypeStruct((m, k), DTYPE), *args[1:])
    tgmm_kw = dict(transpose_lhs=True) if transposed else {}
    dt = dict(lhs_dtype=DTYPE, rhs_dtype=DTYPE, out_dtype=DTYPE, generation=generation)
    # (kind, m, contraction-or-k, n) as pick_tiling sees the op.
    kind, dk, dn = ("tgmm", k, n) if op == "drhs" else ("gmm", *((k, n) if op == "fwd" else (n, k)))
    kw = dict(preferred_element_type=DTYPE, interpret=False)
    mxu = generation.mxu_size
    # NOTE: the MoE block passes gmm the buffer's typical fill, tokens x top_k per device
    # (`moe._expert_parallel`), as a hint for the tiles and for whether to cut them on the pass
    # grids (`tiling.rowtile_pass_cuts_pay`); gmm alone does not.
    expected = shape.tokens * shape.top_k if unowned_rows == "undefined" else None
    hint = expected if expected is not None and expected < m else None
    if tiling is None and schedule == "visits":
      til = pick_tiling(m=m, k=dk, n=dn, num_groups=g, kind=kind, **dt)
    elif tiling is None:
      # NOTE: what pallas_moe.ops runs by default: row-tile tiles when they fit, else the visit
      # kernel's; passing the resolved tiles back to ops selects the same kernel.
      with use_generation(generation):
        kt = ops._resolve_tiles(
          None,
          dims=(m, dk, dn),
          kind=kind,
          num_groups=g,
          dtypes=(DTYPE, DTYPE, DTYPE),
          interpret=False,
          expected_rows=hint,
          unowned_rows=unowned_rows,
          # NOTE: as ops runs these calls: no existing_out (tgmm's weight gradient has none;
          # gmm's estimate does not depend on it).
          existing_out=False,
          **tgmm_kw,
        )
      til = kt.tiles
    else:
      til = (min(tiling[0], m), min(tiling[1], dk), min(tiling[2], dn))
    # NOTE: as pallas_moe.ops chooses it (`generations.pass_granule`).
    sub_m = tiling_lib.pass_rows(til[0], generation, kind=kind, tn=til[2])
    if schedule == "ops":
      with use_generation(generation):
        kt = ops._resolve_tiles(
          til,
          dims=(m, dk, dn),
          kind=kind,
          num_groups=g,
          dtypes=(DTYPE, DTYPE, DTYPE),
          interpret=False,
          existing_out=False,
          **tgmm_kw,
        )
      if kt.rowtile:
        scale, manual = rowtile_hooks(
          op=op,
          tm=til[0],
          tk=til[1],
          tn=til[2],
          sub_m=sub_m,
          sequential_sweeps=kt.sequential_sweeps,
          rows_stationary=kt.rows_stationary,
          rows=m,
          out_cols=dn,
          mxu=mxu,
          unowned_rows=unowned_rows,
          **tgmm_kw,
        )
        # Tiling(fwd=) only: the single-op bench never runs the backward passes.
        tl = ops.Tiling(fwd=til, dlhs=(128, 128, 128), drhs=(128, 128, 128))
        if op == "drhs":
          fn = functools.partial(ops.tgmm, tiling=til, **kw, **tgmm_kw)
          row_macs = _tgmm_row_macs(k, n, til[1], til[2], rows_stationary=kt.rows_stationary)
        else:
          fn = functools.partial(
            ops.gmm,
            tiling=tl,
            transpose_rhs=op == "dlhs",
            unowned_rows=unowned_rows,
            expected_rows=hint,
            **kw,
          )
          row_macs = _gmm_row_macs(dk, dn, til[1], til[2], rows_stationary=kt.rows_stationary)
        return Case(
          fn=_in_generation(fn, generation),
          args=args,
          tiling=til,
          step_scale=scale,
          step_manual_bytes=manual,
          row_macs=row_macs,
          kernel="rowtile-rows-stationary" if kt.rows_stationary else "rowtile",
          tgmm_dots=functools.partial(
            rowtile_tgmm_dots,
            tm=til[0],
            sub_m=sub_m,
            interior_subs=INTERIOR_SUBS,
            align=tiling_lib.tgmm_pass_align(
              sub_m=sub_m,
              tm=til[0],
              lhs_itemsize=jnp.dtype(DTYPE).itemsize,
              rhs_itemsize=jnp.dtype(DTYPE).itemsize,
              transpose_lhs=transposed,
            ),
          )
          if op == "drhs"
          else None,
          gmm_passes=None
          if op == "drhs"
          else rowtile_gmm_pass_counts(tm=til[0], sub_m=sub_m, rows_stationary=kt.rows_stationary),
        )
    # NOTE: the visit-schedule kernels, called directly (ops would pick the row-tile kernel for
    # tiles it can run).
    with use_generation(generation):
      vmem = tiling_lib.vmem_estimate_bytes(
        tm=til[0],
        tk=til[1],
        tn=til[2],
        lhs_dtype=DTYPE,
        rhs_dtype=DTYPE,
        out_dtype=DTYPE,
        kind=kind,
      )
    limit = tiling_lib.vmem_limit_for(vmem, generation)
    zero = jnp.int32(0)
    if op == "drhs":
      fn = functools.partial(
        _visits_tgmm,
        tiling=til,
        sub_m=sub_m,
        vmem_limit_bytes=limit,
        num_groups=g,
        zero=zero,
        **tgmm_kw,
      )
      row_macs = _tgmm_row_macs(k, n, til[1], til[2])
      dots = 1
    else:
      fn = functools.partial(
        _visits_gmm,
        tiling=til,
        sub_m=sub_m,
        vmem_limit_bytes=limit,
        transpose_rhs=op == "dlhs",
        zero=zero,
        # NOTE: as ops runs it: "undefined" rows' tiles get no fill visit.
        fill_unowned=unowned_rows != "undefined",
      )
      row_macs = _gmm_row_macs(dk, dn, til[1], til[2])
      dots = 2 if dk % til[1] else 1
    return Case(
      fn=_in_generation(fn, generation),
      args=args,
      tiling=til,
      step_scale=pallas_moe_step_scale(op=op, tm=til[0], sub_m=sub_m, branches_per_sub=dots),
      row_macs=row_macs,
    )

  return build


register(
  Impl(
    name="pallas_moe",
    build=_pallas_moe_build(None),
    available=_pallas_moe_available,
    tiling_depends_on_generation=True,
    program_depends_on_generation=True,
  )
)
register(
  Impl(
    name="pallas_moe-moe",
    build=_pallas_moe_build(None, unowned_rows="undefined"),
    available=_pallas_moe_available,
    tiling_depends_on_generation=True,
    program_depends_on_generation=True,
  )
)
register(
  Impl(
    name="pallas_moe-visits",
    build=_pallas_moe_build(None, "visits"),
    available=_pallas_moe_available,
    tiling_depends_on_generation=True,
    program_depends_on_generation=True,
  )
)
register(
  Impl(
    name="pallas_moe-maxtext",
    build=_pallas_moe_build((512, 1024, 1024)),
    available=_pallas_moe_available,
    program_depends_on_generation=True,
  )
)


# ----------------------------------------------------------------------------------------------
# Our gmm with int8 / fp8 weights (per-(expert, output-channel) f32 scales), and optionally the
# activations quantized per row too (`-w8a8`: one f32 scale per row).
#
# NOTE: fwd and dlhs run the quantized kernel as `pallas_moe.gmm` does in training with
# `weight_quantization=` (and `activation_quantization=`): fwd with per-output-column scales,
# dlhs transposed with the scales on its contraction axis (dout stays bf16, so dlhs is the same
# with or without activation quantization). drhs (tgmm) is unchanged: the weight gradient is bf16.
# Weights-only runs upcast the 8-bit block to bf16 in VMEM (bf16 MXU rate). With activations
# quantized the fwd dot is 8-bit x 8-bit: the narrow MXU mode (and its peak) where the generation
# table has it, else both blocks upcast to bf16 (the cost model credits the narrow peak only when
# the kernel's dot really has 8-bit operands). The per-row quantization of the activations is an
# XLA op before the kernel, not in these numbers.


def _pallas_moe_quant_build(dtype: str, *, activations: bool):
  def build(*, op: str, shape: Shape, group_sizes: np.ndarray, generation) -> Case:
    if op == "drhs":
      return _pallas_moe_build(None)(
        op=op, shape=shape, group_sizes=group_sizes, generation=generation
      )
    from pallas_moe import quant
    from pallas_moe import tiling as tiling_lib
    from pallas_moe.gmm import gmm_pallas

    m, k, n, g = shape.m, shape.k, shape.n, shape.num_groups
    lhs, _, gs = op_arrays(op=op, shape=shape, group_sizes=group_sizes)
    values = jax.ShapeDtypeStruct((g, k, n), jnp.dtype(dtype))
    dlhs = op == "dlhs"
    quant_lhs = activations and not dlhs
    if quant_lhs:
      lhs = jax.ShapeDtypeStruct((m, k), jnp.dtype(dtype))
    lhs_scales = jax.ShapeDtypeStruct((m, 1), jnp.float32) if quant_lhs else None
    narrow = quant_lhs and quant.narrow_dot_supported(dtype, generation)
    # NOTE: scales [G, 1, n] follow the forward's output columns; for dlhs (rhs read as
    # [G, n', k']) they lie along the contraction k' = n, the same [G, 1, n] array.
    scales = jax.ShapeDtypeStruct((g, 1, n), jnp.float32)
    dk, dn = (n, k) if dlhs else (k, n)
    # NOTE: as pallas_moe.gmm runs them: the row-tile kernel with its tiles (chosen, like the
    # VMEM estimate, as for bf16, an over-estimate covering the upcast copy, unless the dot is
    # narrow: then for the 8-bit operands at the narrow rate). dlhs reads the
    # weights transposed with the scales along its contraction, DMA'd whole per group.
    from pallas_moe import ops
    from pallas_moe.gmm import gmm_rowtile_pallas

    # NOTE: a narrow forward gets tiles for its 8-bit operands at the narrow rate, as in ops.
    tile_dtypes = (jnp.dtype(dtype),) * 2 + (DTYPE,) if narrow else (DTYPE,) * 3
    with use_generation(generation):
      kt = ops._resolve_tiles(
        None,
        dims=(m, dk, dn),
        kind="gmm",
        num_groups=g,
        dtypes=tile_dtypes,
        interpret=False,
        narrow_dot=narrow,
        allow_pass_cuts=not quant_lhs,
      )
    if kt.rowtile:
      tm, _, tn = kt.tiles

      def rowtile_fn(x, q, s, gs, *xs):
        return gmm_rowtile_pallas(
          x,
          q,
          jnp.asarray(gs),
          tm=tm,
          tn=tn,
          out_dtype=DTYPE,
          group_offset=jnp.zeros((), jnp.int32),
          transpose_rhs=dlhs,
          rhs_scales=s,
          scales_on_k=dlhs,
          lhs_scales=xs[0] if xs else None,
          narrow_dot=narrow,
          sub_m=kt.sub_m,
          vmem_limit_bytes=kt.vmem_limit_bytes,
          sequential_sweeps=kt.sequential_sweeps,
          rows_stationary=kt.rows_stationary,
          # NOTE: as ops runs it: per-row lhs scales keep the m-tiles.
          pass_cuts=kt.pass_cuts and not xs,
          interpret=False,
        )

      scale, manual = rowtile_hooks(
        op=op,
        tm=tm,
        tk=dk,
        tn=tn,
        sub_m=kt.sub_m,
        sequential_sweeps=kt.sequential_sweeps,
        block_bytes=dk * tn * jnp.dtype(dtype).itemsize + (dk if dlhs else tn) * 4,
        rows=m,
        out_cols=dn,
        lhs_itemsize=jnp.dtype(lhs.dtype).itemsize,
        rows_stationary=kt.rows_stationary,
      )
      return Case(
        fn=_in_generation(rowtile_fn, generation),
        args=(lhs, values, scales, gs) + ((lhs_scales,) if quant_lhs else ()),
        tiling=kt.tiles,
        step_scale=scale,
        step_manual_bytes=manual,
        row_macs=_gmm_row_macs(dk, dn, dk, tn, rows_stationary=kt.rows_stationary),
        kernel="rowtile-rows-stationary" if kt.rows_stationary else "rowtile",
        gmm_passes=rowtile_gmm_pass_counts(
          tm=tm,
          sub_m=kt.sub_m,
          lhs_itemsize=jnp.dtype(lhs.dtype).itemsize,
          rows_stationary=kt.rows_stationary,
        ),
      )
    # NOTE: tiles and VMEM estimate as for bf16 (as pallas_moe.gmm does: an over-estimate that
    # covers the upcast copy of the 8-bit blocks).
    dt = dict(lhs_dtype=DTYPE, rhs_dtype=DTYPE, out_dtype=DTYPE)
    til = pick_tiling(m=m, k=dk, n=dn, num_groups=g, kind="gmm", generation=generation, **dt)
    est = tiling_lib.vmem_estimate_bytes(tm=til[0], tk=til[1], tn=til[2], kind="gmm", **dt)
    sub_m = tiling_lib.pass_rows(til[0], generation, kind="gmm", tn=til[2])

    def fn(x, q, s, gs, *xs):
      return gmm_pallas(
        x,
        q,
        jnp.asarray(gs),
        tiling=til,
        out_dtype=DTYPE,
        group_offset=jnp.zeros((), jnp.int32),
        transpose_rhs=dlhs,
        rhs_scales=s,
        scales_on_k=dlhs,
        lhs_scales=xs[0] if xs else None,
        narrow_dot=narrow,
        sub_m=sub_m,
        vmem_limit_bytes=tiling_lib.vmem_limit_for(est, generation),
        interpret=False,
      )

    dots = 2 if dk % til[1] else 1
    args = (lhs, values, scales, gs) + ((lhs_scales,) if quant_lhs else ())
    return Case(
      fn=_in_generation(fn, generation),
      args=args,
      tiling=til,
      step_scale=pallas_moe_step_scale(op=op, tm=til[0], sub_m=sub_m, branches_per_sub=dots),
      row_macs=_gmm_row_macs(dk, dn, til[1], til[2]),
    )

  return build


for _name, _dtype, _act in (
  ("pallas_moe-int8", "int8", False),
  ("pallas_moe-fp8", "float8_e4m3fn", False),
  ("pallas_moe-int8-w8a8", "int8", True),
  ("pallas_moe-fp8-w8a8", "float8_e4m3fn", True),
):
  register(
    Impl(
      name=_name,
      build=_pallas_moe_quant_build(_dtype, activations=_act),
      available=_pallas_moe_available,
      tiling_depends_on_generation=True,
      program_depends_on_generation=True,
    )
  )
