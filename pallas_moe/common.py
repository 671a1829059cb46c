"""Shared argument checks and Pallas plumbing for the gmm and tgmm kernels."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jex_core

from pallas_moe import _jax_compat

_jax_compat.install_interpret_vma_workaround()

# Block shapes on TPU: the last dim a multiple of 128 (lanes), the second-last a multiple of 8
# (sublanes), unless the block spans the whole array dimension.
SUBLANE = 8
LANE = 128

Interpret = bool | pltpu.InterpretParams | None


def host_value(x: Any) -> np.ndarray:
  """`x` as a host numpy array, also when `x` is a jax.Array that spans several processes.

  `np.asarray` raises on an array with shards on other processes' devices (multi-host, e.g.
  `jax.distributed.initialize` with a mesh over every process's devices) unless it is fully
  replicated; such an array is gathered with `multihost_utils.process_allgather`. That gather is a
  collective: every process must call this with the same array, as with any computation on it.
  """
  if (
    isinstance(x, jax.Array)
    and not isinstance(x, jax.core.Tracer)
    and not x.is_fully_addressable
    and not x.is_fully_replicated
  ):
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def concrete_or_none(x: Any) -> np.ndarray | None:
  """The value of `x` as numpy when it is known at trace time, else None."""
  if x is None:
    return None
  try:
    return host_value(jex_core.concrete_or_error(None, x))
  except (jax.errors.ConcretizationTypeError, TypeError):
    return None


def check_int_array(name: str, x: Any, *, ndim: int) -> jax.Array:
  """Checks that `x` is an integer array of rank `ndim` and returns it as int32."""
  if not hasattr(x, "dtype") or not hasattr(x, "ndim"):
    x = np.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(
      f"`{name}` must be an integer array (int32), got dtype {x.dtype}; "
      f"convert it with `{name}.astype(jnp.int32)`."
    )
  if x.ndim != ndim:
    raise ValueError(f"`{name}` must be a {ndim}-d array, got shape {tuple(x.shape)}.")
  return jnp.asarray(x, jnp.int32)


def check_group_sizes(group_sizes: Any, *, m: int) -> jax.Array:
  """Checks `group_sizes`: 1-d integers; when concrete, non-negative and summing to at most m."""
  group_sizes = check_int_array("group_sizes", group_sizes, ndim=1)
  if group_sizes.shape[0] == 0:
    raise ValueError("`group_sizes` must hold at least one group, got an empty array.")
  value = concrete_or_none(group_sizes)
  if value is not None:
    if (value < 0).any():
      raise ValueError(
        f"`group_sizes` must be non-negative, got {value.tolist()[:16]}: a negative count of rows "
        "has no meaning; check how the sizes were computed."
      )
    if int(value.astype(np.int64).sum()) > m:
      raise ValueError(
        f"`group_sizes` sums to {int(value.sum())}, more rows than the {m} rows of lhs; pass sizes "
        "that sum to at most m (rows past the sum are left as zeros)."
      )
  return group_sizes


def check_group_offset(group_offset: Any, *, num_groups_total: int, num_local_groups: int):
  """Checks `group_offset`: an int scalar (or shape-(1,)); when concrete, within range."""
  if group_offset is None:
    return jnp.zeros((), jnp.int32)
  if isinstance(group_offset, (int, np.integer)):
    group_offset = np.int32(group_offset)
  group_offset = jnp.asarray(group_offset)
  if not jnp.issubdtype(group_offset.dtype, jnp.integer):
    raise TypeError(f"`group_offset` must be an integer scalar, got dtype {group_offset.dtype}.")
  if group_offset.size != 1 or group_offset.ndim > 1:
    raise ValueError(f"`group_offset` must be a scalar, got shape {tuple(group_offset.shape)}.")
  group_offset = group_offset.reshape(()).astype(jnp.int32)
  value = concrete_or_none(group_offset)
  if value is not None and not 0 <= int(value) <= num_groups_total - num_local_groups:
    raise ValueError(
      f"`group_offset`={int(value)} is out of range: with {num_local_groups} local groups and "
      f"{num_groups_total} groups in `group_sizes` it must lie in "
      f"[0, {num_groups_total - num_local_groups}]."
    )
  return group_offset


def check_float_array(name: str, x: Any, *, ndim: int) -> None:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"`{name}` must be a jax or numpy array, got {type(x).__name__}.")
  if x.ndim != ndim:
    raise ValueError(f"`{name}` must be a {ndim}-d array, got shape {tuple(x.shape)}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"`{name}` must be a floating-point array (f32, bf16, ...), got {x.dtype}.")


def check_existing_out(existing_out: Any, *, shape: tuple[int, ...], dtype: Any) -> None:
  if existing_out is None:
    return
  if not hasattr(existing_out, "shape") or tuple(existing_out.shape) != tuple(shape):
    got = getattr(existing_out, "shape", type(existing_out).__name__)
    raise ValueError(f"`existing_out` must have shape {tuple(shape)}, got {got}.")
  if jnp.dtype(existing_out.dtype) != jnp.dtype(dtype):
    raise TypeError(
      f"`existing_out` has dtype {existing_out.dtype} but the output dtype is {jnp.dtype(dtype)}; "
      "pass preferred_element_type equal to existing_out.dtype."
    )


def fit_tiles(
  tiles: Any,
  *,
  dims: tuple[int, int, int],
  names: tuple[str, str, str],
  aligns: tuple[int, int, int],
) -> tuple[int, int, int]:
  """Validates a (t0, t1, t2) tiling against dims and clamps each tile to its dim.

  A tile larger than its dimension becomes the whole dimension (always a legal TPU block). Other
  tiles must be multiples of `aligns`: 8 where the tile is the second-last dim of a block (TPU
  sublanes), 128 where it is the last dim of some block (lanes).
  """
  if not isinstance(tiles, (tuple, list)) or len(tiles) != 3:
    raise TypeError(f"`tiling` must be a 3-tuple of ints ({', '.join(names)}), got {tiles!r}.")
  out = []
  for t, d, name, align in zip(tiles, dims, names, aligns, strict=True):
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
      raise TypeError(f"`tiling` entry {name} must be an int, got {t!r}.")
    t = int(t)
    if t <= 0:
      raise ValueError(f"`tiling` entry {name}={t} must be positive.")
    t = min(t, d)
    if t != d and t % align:
      raise ValueError(
        f"`tiling` entry {name}={t} is not a multiple of {align}: TPU blocks need (8, 128)-aligned "
        f"tiles (second-last block dims a multiple of 8, last dims a multiple of 128) unless the "
        f"tile spans the whole dimension ({d}). Use {max(align, t // align * align)} or {d}."
      )
    out.append(t)
  return tuple(out)


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """An output ShapeDtypeStruct that varies over the manual mesh axes any operand varies over.

  NOTE: inside `jax.shard_map(check_vma=True)` a pallas_call's outputs must declare the manual axes
  they vary over; without it the call is rejected (upstream megablox's failure mode).
  """
  varying = frozenset()
  for x in operands:
    if x is None:
      continue
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is not None:
      varying |= mat.varying
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(
    shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying)
  )


def pvary_like(x: jax.Array, *operands) -> jax.Array:
  """Marks `x` as varying over every manual axis any of `operands` varies over."""
  varying = frozenset()
  for y in operands:
    if y is None:
      continue
    mat = getattr(jax.typeof(y), "manual_axis_type", None)
    if mat is not None:
      varying |= mat.varying
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  missing = tuple(sorted(varying - (mat.varying if mat is not None else frozenset())))
  if missing:
    x = jax.lax.pcast(x, missing, to="varying")
  return x


def window(start: Any, size: int, full: int) -> Any:
  """Index of `size` elements from `start` along a dim of `full`: a static whole-dim slice when
  the window is the whole dim.

  NOTE: Mosaic must prove a dynamic offset along a tiled (last two) dim of a VMEM ref to be a
  multiple of its tile; for a window of the whole dim the offset is always 0 but, traced, is
  not provably so (e.g. n = 130: "Offsets along tiled dimensions must be aligned to tiles").
  XLA may place a `pl.ANY` operand in VMEM, so this holds for "HBM" refs too.
  """
  return slice(None) if size == full else pl.ds(start, size)


def sub_block(sub: Any, sub_m: int, tm: int) -> tuple[Any, Any]:
  """(first row, index) of sub-block `sub` of sub_m rows in a tm-row tile.

  NOTE: with one sub-block per tile (sub_m == tm) it is the static whole tile: a traced offset
  of 0 is not provably aligned, and a tile of all of m rows need not be (m = 300 rows on the
  sublane dim, or 200 on tgmm's lane dim, do not compile with a dynamic offset).
  """
  if sub_m == tm:
    return 0, slice(None)
  r0 = pl.multiple_of(sub * sub_m, sub_m)
  return r0, pl.ds(r0, sub_m)


def pass_block(row: Any, *, sub_m: int, tm: int, align: int) -> tuple[Any, Any]:
  """(first row, index) of the sub_m-row pass starting at `row` of a tm-row tile.

  NOTE: `row` is a multiple of `align` (`metadata.group_passes`); a pass that would cross the
  tile's end is moved back to the tile's last sub_m rows (a multiple of align too, since align
  divides sub_m and sub_m divides tm): it then overlaps a pass of the same group, whose rows it
  recomputes to the same values. On the sub_m grid (align == sub_m) no pass crosses the end.
  """
  if sub_m == tm:
    return 0, slice(None)
  if align != sub_m:
    row = jnp.minimum(row, tm - sub_m)
  r0 = pl.multiple_of(row, align)
  return r0, pl.ds(r0, sub_m)


def run_kernel(build: Callable[[Interpret], Callable[..., Any]], interpret: Interpret, *args):
  """Runs a kernel compiled on TPU and in interpret mode elsewhere.

  Args:
    build: maps an `interpret` value to the pallas_call to run.
    interpret: None picks per lowering platform: compiled Mosaic when lowering for TPU (also when
      compiling ahead of time for a TPU topology from a CPU host), interpret mode otherwise. True or
      a `pltpu.InterpretParams` force interpret mode; False forces compiled Mosaic.
    *args: the pallas_call operands.
  """
  if interpret is None:
    return jax.lax.platform_dependent(*args, tpu=build(False), default=build(True))
  return build(interpret)(*args)


def check_instrumented(interpret: Interpret) -> None:
  """The row-count probe (`probe.count_rows`) reads SMEM counters that only interpret mode
  returns."""
  if interpret is None or interpret is False:
    raise ValueError("probe.count_rows is an interpret-mode instrumentation; pass interpret=True.")


def check_sub_m(sub_m: int | None, tm: int) -> int:
  """Rows per MXU pass: `sub_m`, which must divide tm, or the whole tile when None."""
  sub_m = tm if sub_m is None else sub_m
  if tm % sub_m:
    raise ValueError(f"sub_m={sub_m} must divide tm={tm}.")
  return sub_m


def call_kernel(
  kernel: Callable[..., None],
  *,
  name: str,
  grid: tuple[int, ...],
  prefetch: tuple[jax.Array, ...],
  operands: list[jax.Array],
  in_specs: list[Any],
  out_shape: jax.ShapeDtypeStruct,
  out_spec: Any,
  scratch_shapes: list[Any],
  dimension_semantics: tuple[str, ...],
  vmem_limit_bytes: int | None,
  flops: int,
  bytes_accessed: int,
  interpret: Interpret,
  alias_last_operand: bool = False,
  alias_when_interpreted: bool = False,
  counts_shape: tuple[int, ...] | None = None,
  valid_counts: jax.Array | None = None,
):
  """Builds one of our kernels' pallas_calls (scalar-prefetch grid) and runs it.

  Args:
    kernel: the kernel body; it gets the prefetch refs, the operand refs, the output ref, the
      counts ref (with `counts_shape`) and the scratch refs, in that order.
    name: the kernel's name (it names the Mosaic program, and the bench finds kernels by it).
    grid: the grid.
    prefetch: int32 arrays scalar-prefetched into SMEM (the kernel's metadata).
    operands: the array operands, in `in_specs` order.
    in_specs: their BlockSpecs.
    out_shape: the result (see `out_struct`).
    out_spec: its BlockSpec.
    scratch_shapes: VMEM / semaphore scratch.
    dimension_semantics: per grid axis, "parallel" or "arbitrary".
    vmem_limit_bytes: Mosaic's scoped VMEM limit (None: Mosaic's default).
    flops: for XLA's cost estimate.
    bytes_accessed: for XLA's cost estimate.
    interpret: see `run_kernel`.
    alias_last_operand: the output reuses the last operand's buffer (existing_out) when compiled.
    alias_when_interpreted: also in interpret mode (a kernel that leaves output blocks unwritten
      relies on it; see the NOTE below for the simulator's ragged-block restriction).
    counts_shape: interpret-mode instrumentation (`probe.count_rows`): the shape of an extra int32
      output in SMEM that the kernel fills with its counts; returned beside the result.
    valid_counts: with `counts_shape`, a [counts_shape[-1]] mask of the entries along the last
      axis that belong to a grid step (the visit kernels' padded visit axis); others are zeroed.

  Returns:
    The result, and with `counts_shape` the counts too.
  """
  counting = counts_shape is not None
  out_shapes = [out_shape]
  out_specs = [out_spec]
  if counting:
    out_shapes.append(jax.ShapeDtypeStruct(counts_shape, jnp.int32))
    out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))

  def build(interpret):
    return pl.pallas_call(
      kernel,
      out_shape=out_shapes if counting else out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        in_specs=in_specs,
        out_specs=out_specs if counting else out_spec,
        grid=grid,
        scratch_shapes=scratch_shapes,
      ),
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=dimension_semantics, vmem_limit_bytes=vmem_limit_bytes
      ),
      # NOTE: on TPU the output reuses existing_out's HBM buffer. The TPU simulator rejects an
      # aliased output with a ragged last block (jax 0.10.2), and aliasing saves nothing there,
      # so the visit kernels read existing_out as a plain input in interpret mode.
      input_output_aliases={len(prefetch) + len(operands) - 1: 0}
      if alias_last_operand and (alias_when_interpreted or not interpret)
      else {},
      cost_estimate=pl.CostEstimate(flops=flops, bytes_accessed=bytes_accessed, transcendentals=0),
      interpret=interpret,
      name=name,
    )

  if not counting:
    return run_kernel(build, interpret, *prefetch, *operands)
  check_instrumented(interpret)
  out, counts = build(interpret)(*prefetch, *operands)
  if valid_counts is not None:
    # NOTE: entries past the real visits belong to no grid step and were never written.
    counts = jnp.where(valid_counts, counts, 0)
  return out, counts


def dot_dtypes(
  lhs_dtype,
  rhs_dtype,
  *,
  lhs_quantized: bool,
  rhs_quantized: bool,
  narrow_dot: bool,
  scales_allow_narrow: bool = True,
  scales_requirement: str = "",
) -> tuple[jnp.dtype, jnp.dtype]:
  """The dtype a kernel's dot multiplies in, and the dtype it accumulates in.

  NOTE: 8-bit operands have no implicit promotion: one quantized operand is multiplied in the
  other operand's dtype, two in bf16 (int8 and e4m3 values are exact there). With `narrow_dot`
  the dot runs on the 8-bit values themselves; int8 x int8 products are exact in int32
  (|sum| <= 127^2 * k), fp8 accumulates in f32.

  Args:
    lhs_dtype: lhs element type.
    rhs_dtype: rhs element type.
    lhs_quantized: lhs holds int8 / fp8 values with scales.
    rhs_quantized: rhs holds int8 / fp8 values with scales.
    narrow_dot: multiply the 8-bit values natively.
    scales_allow_narrow: whether the scales' layout lets them factor out of the dot.
    scales_requirement: that layout, for the error message.

  Returns:
    (compute dtype, dot accumulation dtype).
  """
  if lhs_quantized and rhs_quantized:
    compute = jnp.dtype(jnp.bfloat16)
  elif rhs_quantized:
    compute = jnp.dtype(lhs_dtype)
  elif lhs_quantized:
    compute = jnp.dtype(rhs_dtype)
  else:
    compute = jnp.promote_types(lhs_dtype, rhs_dtype)
  if not narrow_dot:
    return compute, jnp.dtype(jnp.float32)
  same = jnp.dtype(lhs_dtype) == jnp.dtype(rhs_dtype)
  if not (lhs_quantized and rhs_quantized and same and scales_allow_narrow):
    raise ValueError(
      "narrow_dot needs both operands quantized with the same dtype"
      f"{scales_requirement}; got lhs {jnp.dtype(lhs_dtype)}, rhs {jnp.dtype(rhs_dtype)}."
    )
  acc = jnp.int32 if jnp.dtype(lhs_dtype) == jnp.int8 else jnp.float32
  return jnp.dtype(lhs_dtype), jnp.dtype(acc)


def result_dtype(lhs, rhs, preferred_element_type) -> jnp.dtype:
  """The output dtype: `preferred_element_type`, or the promoted dtype of lhs and rhs."""
  if preferred_element_type is None:
    return jnp.dtype(jnp.promote_types(lhs.dtype, rhs.dtype))
  return jnp.dtype(preferred_element_type)


def row_granule(dtype: Any, *, lanes: bool = False) -> int:
  """Rows a manual DMA along an operand's m axis moves at a time (its alignment).

  NOTE: a dynamic offset along a tiled dim must be a multiple of the dim's tile: 8 sublanes of
  32 bits, so 16 rows of bf16 and 32 of 8-bit types; 128 when m is the lane dim (tgmm's lhs^T).
  """
  if lanes:
    return LANE
  return SUBLANE * max(1, 4 // jnp.dtype(dtype).itemsize)


def tile_row_range(*, row0: Any, lo: Any, hi: Any, tm: int, m: int, granule: int):
  """(first, end): the rows `tile_row_copies` moves for rows [lo, hi) of the tile at `row0`,
  relative to row0: [lo, hi) rounded out to the granule and clipped at m (the whole tile, clipped
  at m, when the granule does not divide tm). Works on traced values and on numpy arrays."""
  if tm % granule:
    return 0 * lo, jnp.minimum(tm, m - row0)
  first = (lo // granule) * granule
  # NOTE: an empty range (a visited tile of a shard without rows) moves nothing.
  end = jnp.where(hi > lo, jnp.minimum(-(-hi // granule) * granule, m - row0), first)
  tail = m % granule
  if tail:
    # NOTE: a range reaching m's unaligned tail moves the tile from its row 0 (see
    # `tile_row_copies`).
    first = jnp.where((hi > lo) & (end > m - tail - row0), 0, first)
  return first, end


def tile_row_copies(
  *,
  hbm_rows: Callable[[Any, int], Any],
  vmem_rows: Callable[[Any, int], Any],
  sem: Any,
  row0: Any,
  lo: Any,
  hi: Any,
  tm: int,
  m: int,
  granule: int,
  to_hbm: bool = False,
) -> list[tuple[Any, Any]]:
  """The DMAs that move rows [lo, hi) of the m-tile at `row0` (offsets within the tile), rounded
  out to `granule`, between an operand's HBM rows and a [tm, ...] VMEM block at the same offsets.

  A row-tile kernel fetches (or writes back) only the rows of a tile that hold local rows: the
  first and last visited tiles of an expert-parallel receive buffer hold few of them. Mosaic
  DMAs have static shapes (interpret mode too), so a range of dynamic length L is moved as the
  binary decomposition of L / granule: at most log2(tm / granule) + 1 copies of static
  power-of-two sizes, each at an offset aligned to its granule; a range that reaches m's
  unaligned last m % granule rows is one static copy of the tile's rows from 0 instead. Rows of
  the block outside the range are left as they were. A tm that the granule does not divide (a
  tile of all m rows) falls back to the whole tile (static, clipped at m).

  Args:
    hbm_rows: (start, size) -> the operand's HBM ref indexed to rows [start, start + size).
    vmem_rows: (offset, size) -> the VMEM block indexed to rows [offset, offset + size).
    sem: the DMA semaphore every copy signals.
    row0: first row of the tile (a multiple of tm).
    lo: first row to move, relative to row0 (0 <= lo < hi).
    hi: end of the rows to move, relative to row0 (hi <= min(tm, m - row0)).
    tm: rows per tile.
    m: rows of the operand.
    granule: the row alignment (`row_granule`).
    to_hbm: write the VMEM rows to HBM (default: fetch HBM rows into VMEM).

  Returns:
    [(predicate, descriptor)]: start (or wait for) each descriptor under its predicate; the same
    arguments give the same list, so a later step can wait for what an earlier one started.
  """

  tiles_m = -(-m // tm)

  def copy(offset, size, start=None):
    if start is None:
      # NOTE: Mosaic must prove a dynamic offset along the tiled row dim aligned (XLA may place
      # a small `pl.ANY` operand in VMEM): a single tile's row0 is the static 0.
      start = offset if tiles_m == 1 else pl.multiple_of(row0 + offset, math.gcd(tm, granule))
    src = hbm_rows(start, size)
    dst = vmem_rows(offset, size)
    if to_hbm:
      src, dst = dst, src
    return pltpu.make_async_copy(src, dst, sem)

  last_rows = m - (tiles_m - 1) * tm
  if tm % granule:
    # NOTE: unaligned tile (only a tile of all m rows): the whole tile, ragged when it is m's end.
    if tiles_m == 1:
      return [(True, copy(0, last_rows))]
    last = row0 == (tiles_m - 1) * tm
    return [(~last, copy(0, tm)), (last, copy(0, last_rows))]
  tail = m % granule
  aligned_end = m - tail - row0  # rows of this tile before m's unaligned tail
  first, end = tile_row_range(row0=row0, lo=lo, hi=hi, tm=tm, m=m, granule=granule)
  # NOTE: Mosaic takes a VMEM slice whose row count is not a multiple of the tile only as a
  # prefix of the block (offset 0). A range that reaches m's unaligned tail (only in m's last
  # tile, whose row0 is static) is therefore moved as one static copy of the tile's rows
  # [0, m - row0), the rows a whole-tile fetch would move; the chunks move nothing then.
  to_tail = (hi > lo) & (end > aligned_end) if tail else False
  units = jnp.where(to_tail, 0, jnp.maximum(end - first, 0) // granule)
  copies = []
  top = max(0, (tm // granule).bit_length() - 1)
  for bit in range(top, -1, -1):
    size = granule << bit
    if size > m - tail:
      continue  # NOTE: never moved (the range has at most m - tail aligned rows)
    # NOTE: the copy for bit j starts after the copies of the higher bits: at first + the units
    # of bits above j, a multiple of granule * 2^(j+1), so its offset is aligned.
    offset = pl.multiple_of(first + ((units >> (bit + 1)) << (bit + 1)) * granule, granule)
    copies.append((((units >> bit) & 1) == 1, copy(offset, size)))
  if tail:
    copies.append((to_tail, copy(0, last_rows, start=(tiles_m - 1) * tm)))
  return copies


def run_copies(copies: list[tuple[Any, Any]], *, wait: bool) -> None:
  """Starts (or waits for) each copy of `tile_row_copies` under its predicate."""
  for pred, desc in copies:
    action = desc.wait if wait else desc.start
    if pred is True:
      action()
    else:
      pl.when(pred)(action)
