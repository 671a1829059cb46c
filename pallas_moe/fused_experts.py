"""The fused expert kernel: gate/up, the activation and down of every non-empty local expert in
one `pallas_call`, for decode- and prefill-size row counts.

At serving sizes the work of an MoE layer is reading expert weights: the floor is the bytes of
the non-empty local experts' weights over HBM bandwidth. This kernel streams exactly those
bytes, once:

- The rows (sorted by local expert, `group_sizes` of them per expert) and the f32 accumulator
  stay in VMEM for the whole call; the weights stay in HBM and are copied in by manual DMA.
- Group metadata is derived inside the kernel from the scalar-prefetched `group_sizes`: a scalar
  loop writes each expert's first row and the list of non-empty experts to SMEM. Nothing else
  (no XLA ops) prepares the call, and an empty expert is never visited: its weights are never
  read.
- The weights of the visited experts form one stream of steps, (expert, chunk of `chunk`
  columns of f): step s holds the gate and up columns [d, chunk] of its chunk and the matching
  down rows [chunk, d], both double-buffered. Each block is copied in `pieces` parts along d
  (gate/up: rows of the contraction; down: output columns), one semaphore each, and the step's
  products run piece by piece, each waiting only for its own piece: the step waits for its
  first gate/up piece, starts all of the next step's copies, and computes as the rest arrives.
  So the next step's weights (the next expert's once a chunk is the expert's last) stream while
  this step multiplies, and only a piece is exposed at either end of the stream: the first
  piece's copy before any product can start, the last piece's product after the last byte.
- Per step and expert: the expert's rows in windows of `window` rows (a window moved back to
  end at the buffer's end keeps only the rows it owns), `silu(x @ gate) * (x @ up)` in f32,
  times the rows' routing weights, masked to the expert's rows, then `@ down` accumulated into
  the rows' f32 sums. The result is written once, in the output dtype.

Weights: float (bf16 / f32), `quant.QuantizedWeights` (int8 / fp8 values, one scale per output
column: the scales multiply the products) or `quant.BlockQuantizedWeights` (one scale per 128 x
128 tile, DeepSeek-V3's fp8 layout: their scales copied to SMEM, each block either dequantized
on its way to the MXU for full-depth products or multiplied as stored with the partial products
scaled, `upcast_route`). HBM holds and the DMA moves the narrow values; no dequantized copy of
them is kept in VMEM.

On a device with two TensorCores (v5p, v4) the grid has one "parallel" step per core; each
streams half of every visited expert's chunks, and the two partial sums, each in the result's
dtype, are added after the call (as a tensor-parallel split of f adds its devices' sums).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import common, quant
from pallas_moe.generations import current_generation, get_generation

__all__ = [
  "MAX_PIECES",
  "PARTIALS_MAX_WINDOW",
  "FusedPlan",
  "plan_fused",
  "fused_experts",
  "upcast_route",
  "weight_kind",
]

# NOTE: the share of VMEM the kernel plans for; the rest is Mosaic's (internal scratch, spills).
# `_vmem_bytes` counts the VMEM operands (rows, result) as well as the scratch, and rounds its
# per-window values up: for DeepSeek-V3's fp8 experts over 256 gathered tokens on tpu7x at
# chunk 256 it says 52 MiB, where Mosaic allocates 39.1 MiB of scratch beside 10.5 MiB of
# operands (compiled ahead of time).
_VMEM_SHARE = 0.85
_MAX_WINDOW = 128
# NOTE: on the "partials" route each window's partial products are scaled 128 columns at a time,
# so a step's vector work grows with the window's rows. Compiled for v5e, a step issues about
# 0.33 + 0.0163 x rows bundles per 1,024 values (v5p: 0.33 + 0.0184), against the 2 cycles per
# 1,024 values four 128-wide MXUs take to load them: past about 100 rows the vector unit, not
# the MXU, sets the pace there. (v6e: 0.41 + 0.0085 x rows against 4 cycles, never.)
PARTIALS_MAX_WINDOW = 96
# NOTE: a step's weights arrive in up to this many parts: the exposed copy before the first
# product, and the exposed product after the last copy, are one part's.
MAX_PIECES = 8
# NOTE: a step over a window of at most `SMALL_WINDOW` rows issues well under its copy, so its
# weights come in up to `SMALL_WINDOW_PIECES` parts: where the MXU, not HBM, sets the pace, the
# first part's copy is exposed whole. Compiled at 32 tokens, DeepSeek-V3's expert issues 2-20%
# more a step in 14 parts than in 7 or 8, at most 0.63 of its copy (tpu7x fp8; v5e fp8: 25.1 µs
# against a 53.8 µs copy; bench/results/fused-vliw-pieces.md).
SMALL_WINDOW = 32
SMALL_WINDOW_PIECES = 16


def weight_kind(w: Any) -> str:
  """ "float", "channel" (`QuantizedWeights`) or "block" (`BlockQuantizedWeights`)."""
  if isinstance(w, quant.BlockQuantizedWeights):
    return "block"
  if isinstance(w, quant.QuantizedWeights):
    return "channel"
  return "float"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedPlan:
  """Every static choice of one fused call, made before tracing.

  Attributes:
    rows: rows the kernel holds (the caller's m rounded up to `align`).
    d: model dim.
    f: MLP width (wi holds [gate | up], 2f columns).
    num_experts: local experts (len(group_sizes)).
    chunk: f columns per streamed step (divides f).
    pieces: parts each step's weight blocks are copied and multiplied in, along d (d / pieces
      is a multiple of the MXU edge and of the block scales' edge).
    window: rows per MXU pass (a multiple of `align`, at most `rows`).
    align: row granule of the rows' dtype (8 f32, 16 bf16 rows per VMEM tile).
    kind: "float", "channel" or "block" (`weight_kind`).
    block: the block scales' tile edge (kind "block").
    x_dtype: rows' (and the MXU operands') dtype name.
    w_dtype: weights' dtype name as stored.
    out_dtype: result dtype name.
    vmem_bytes: the kernel's VMEM estimate.
    vmem_limit_bytes: Mosaic's scoped limit passed with the call.
    by_token: False: the rows come sorted by expert (`group_sizes` of each) and the result is
      per row. True: the rows are tokens, every expert runs over all of them, each token's
      product scaled by its routing weight for the expert (0 where it did not choose it), and
      the result is the per-token sum (`fused_experts(expert_weights=)`).
    gather: with `by_token`: each visited expert runs over its own tokens only, gathered into
      windows in VMEM by a one-hot product with the token table (`expert_tokens`) and added
      back by its transpose once the expert's last chunk is done; otherwise over all tokens.
    cores: TensorCores the call's weight stream is split over (2 on a megacore device). Rows
      resident in VMEM: each core streams half of every visited expert's chunks and the call
      returns both cores' partial sums in `out_dtype`, which `fused_experts` adds in f32.
      Streamed rows: each core takes half of the visits (whole experts' weights, rows
      disjoint) and writes its own rows; the one granule both cores' rows can share comes
      back apart and is added in.
    stream: sorted rows that stay in HBM (any number of them): each visit copies its expert's
      rows in, `align` rows at a time, and its finished rows out (`_stream_step`). Only the
      rows of `group_sizes` are read or written; the rest of the buffer is never touched.
    visit_rows: with `stream`, the rows one visit holds in VMEM: an expert whose rows (from
      its first row rounded down to `align`) span more is visited again for the rest, its
      weights streamed again.
    upcast: how kind "block" values reach the MXU (`upcast_route`): "partials" (as stored: one
      128-deep product per block row of d, each partial times its blocks' scales, summed in
      f32), or each 128 x 128 block dequantized to the compute dtype inside the products' loop
      on its way to the MXU, "astype" (the generation converts the stored dtype itself) or
      "e4m3b11" (float8_e4m3fn bytes read as float8_e4m3b11fnuz, which v5e / v5p / v6e unpack
      in one instruction).
    row_unit: with `stream`, a visit's rows come in from its first row rounded down to this
      (`generations.TpuGeneration.copy_row_unit`, at most `align`), not to its granule.
  """

  @property
  def max_visits(self) -> int:
    """A bound on the visits of a streamed call: each expert once, plus one per further
    `visit_rows - align` rows (a visit holds at least that many of its expert's rows)."""
    return self.num_experts + self.rows // (self.visit_rows - self.align) + 1

  rows: int
  d: int
  f: int
  num_experts: int
  chunk: int
  window: int
  align: int
  kind: str
  block: int
  x_dtype: str
  w_dtype: str
  out_dtype: str
  vmem_bytes: int
  vmem_limit_bytes: int
  by_token: bool = False
  cores: int = 1
  gather: bool = False
  stream: bool = False
  visit_rows: int = 0
  pieces: int = 1
  upcast: str = "astype"
  row_unit: int = 16

  @property
  def step_rows(self) -> int:
    """The most rows one step's windows cover (`_products`' sums hold them)."""
    rows = self.visit_rows + self.align if self.stream else self.rows
    return -(-rows // self.window) * self.window

  @property
  def piece(self) -> int:
    """Rows of d in one piece."""
    return self.d // self.pieces

  @property
  def chunks(self) -> int:
    return self.f // self.chunk

  @property
  def core_chunks(self) -> int:
    """Chunks of each visited expert one TensorCore streams (streamed rows: every chunk of
    the core's visits)."""
    return self.chunks if self.stream else self.chunks // self.cores

  @property
  def chunk_blocks(self) -> int:
    return self.chunk // self.block

  @property
  def step_weight_bytes(self) -> int:
    """HBM bytes one step copies: its gate, up and down blocks (and their scales)."""
    item = jnp.dtype(self.w_dtype).itemsize
    values = 3 * self.d * self.chunk * item
    if self.kind == "channel":
      return values + 4 * (2 * self.chunk + self.d)
    if self.kind == "block":
      return values + 4 * 3 * self.chunk_blocks * (self.d // self.block)
    return values

  @property
  def expert_weight_bytes(self) -> int:
    """HBM bytes of one visited expert: every chunk's step."""
    return self.chunks * self.step_weight_bytes


def _vmem_bytes(
  *,
  rows,
  d,
  chunk,
  x_item,
  w_item,
  out_item,
  kind,
  window,
  experts,
  gather,
  stream=0,
  pieces=1,
  dequantized=True,
) -> int:
  if stream:
    # NOTE: one visit's rows, their row weights (128 lanes), f32 sums and output staging, and
    # the carried tile; the rows themselves stay in HBM.
    held = stream + 16
    resident = held * (d * (2 * x_item + 4 + out_item) + 2 * 128 * 4) + 16 * d * 4
  else:
    # NOTE: the rows (one copy), the result (2 buffers), the f32 sums.
    resident = rows * d * (x_item + 2 * out_item + 4)
  if experts:
    # NOTE: the [E, 1, rows] routing weights (and token lists), each padded to 8 sublanes.
    resident += experts * 8 * rows * 4 * (2 if gather else 1)
  if gather:
    # NOTE: an expert's gathered rows and their f32 sums; the table's non-finite rows (128 lanes).
    resident += rows * d * (x_item + 4) + rows * 128 * 4
  elif not stream:
    resident += rows * 128 * 4  # the [rows, 1] row weights, padded to 128 lanes
  weights = 2 * 3 * d * chunk * w_item  # two slots of gate, up, down
  # NOTE: weights upcast to the rows' dtype for the products (a float upcast, or block values
  # dequantized inline) are values Mosaic may hold in VMEM: counted as a whole step's.
  upcast = 3 * d * chunk * x_item if w_item != x_item and dequantized else 0
  # NOTE: one window's gate and up products (f32), its activation, one down piece's product.
  work = window * (chunk * (2 * 4 + 4 + x_item) + d // pieces * 4)
  # NOTE: a step's gate and up sums (f32) and activation over all its windows' rows.
  step_rows = -(-((stream + 16) if stream else rows) // window) * window
  work += step_rows * chunk * (2 * 4 + x_item)
  scales = 2 * 4 * (2 * chunk + d) * 8 if kind == "channel" else 0
  return resident + weights + upcast + work + scales + (1 << 20)


# NOTE: an e4m3fn value is 16 times the e4m3b11fnuz value of the same byte (same fields, exponent
# bias 7 against 11), subnormals included; the factor goes into the block scale (exact: a power
# of two).
_E4M3B11_FACTOR = 16.0


def upcast_route(w_dtype: Any, *, x_dtype: Any = jnp.bfloat16, generation: Any = None) -> str:
  """How the fused kernel brings block-scaled values to the MXU (`FusedPlan.upcast`).

  A block scale varies along the contraction as well as the columns, so either the values are
  dequantized (upcast, scaled, cast to the compute dtype) for full-depth products, or each
  128-deep block row of d is its own product and the scales multiply its partial sums. The
  dequantized blocks are built inside the products' loop body and go from the vector registers
  into the MXU, so the vector unit's work issues beside the MXU's and no copy of them takes VMEM
  bandwidth or a loop of its own.

  - "astype": dequantized, the stored dtype converted as such. Where the vector unit unpacks
    it in one instruction (tpu7x's float8_e4m3fn), this costs less than partials on a 256-wide
    MXU, where a 128-deep product uses half of the array: compiled for tpu7x, a step of
    DeepSeek-V3's expert at 64 tokens issues 0.76 bundles per 1,024 values, products included
    (1.17 with a dequantization loop of its own before the products).
  - "partials": where Mosaic pushes the stored dtype into the MXU beside bf16 rows
    (`generations.TpuGeneration.mxu_pushes_fp8`: float8_e4m3fn on v5e, v5p and v6e) and the
    MXU is 128 wide (v5e, v5p), no value passes through the vector unit; the partials'
    scaling does, [window, 128] per block of the step, and the products are exact in f32.
    Compiled at 64 rows (a [64, 1,024] x [1,024, 2,048] product): 2,915 bundles against 4,874
    dequantized first in a loop of their own (v5e).
  - "e4m3b11": dequantized, float8_e4m3fn bytes read as float8_e4m3b11fnuz, which v5e, v5p and
    v6e unpack in one instruction (their e4m3fn takes fix-ups: 2.35 bundles per 1,024 values
    with the scale, against 1.33). Exact up to the factor 16 folded into the scale
    (subnormals included), except the byte 0x80 (e4m3fn's -0, e4m3b11fnuz's NaN), set back to
    0, and e4m3fn's NaN bytes (0x7F, 0xFF), which read as +-480; the scaled value is rounded
    to the compute dtype, as every dequantizing route does. For rows that are not bf16, and on
    v6e's 256-wide MXU, where a 128-deep partial product fills half of the array: a step of
    DeepSeek-V3's expert (chunk 1,024) takes 12.3 µs of MXU time on partials at a 128-row
    pass against 6.1 full depth, and issues 6.0-7.0 µs at 16-128 rows
    (`python -m bench.fused_vliw --chips v6e --weights fp8-block --upcast e4m3b11`), under
    its 13.4 µs copy either way.

  Returns:
    The route's name.
  """
  gen = current_generation() if generation is None else get_generation(generation)
  w = jnp.dtype(w_dtype)
  if w != jnp.dtype(jnp.float8_e4m3fn) or w.name in gen.unpacks_fp8:
    return "astype"
  pushes = w.name in gen.mxu_pushes_fp8 and jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16)
  # NOTE: a partial product is one block (128) deep: on a wider MXU it fills part of the array.
  if pushes and gen.mxu_size <= quant.BLOCK:
    return "partials"
  if "float8_e4m3b11fnuz" in gen.unpacks_fp8:
    return "e4m3b11"
  return "partials" if pushes else "astype"


def plan_fused(
  *,
  rows: int,
  d: int,
  f: int,
  num_experts: int,
  x_dtype: Any,
  w_dtype: Any,
  out_dtype: Any = None,
  kind: str = "float",
  block: int = quant.BLOCK,
  chunk: int | None = None,
  generation: Any = None,
  by_token: bool = False,
  cores: int | None = None,
  gather: bool = False,
  stream: bool = False,
  visit_rows: int = 256,
  pieces: int | None = None,
  window: int | None = None,
  upcast: str | None = None,
) -> FusedPlan:
  """The fused kernel's plan: the largest chunk of f whose double-buffered weight blocks fit.

  Args:
    rows: rows of the call (m).
    d: model dim.
    f: MLP width.
    num_experts: local experts.
    x_dtype: rows' dtype.
    w_dtype: weights' dtype as stored.
    out_dtype: result dtype (default x_dtype).
    kind: see `weight_kind`.
    block: tile edge of block scales.
    chunk: force the f columns per step (must divide f; a multiple of 128, or f).
    generation: the TPU generation whose VMEM bounds the plan (default: the current one).
    by_token: see `FusedPlan.by_token`.
    gather: see `FusedPlan.gather` (with by_token).
    cores: TensorCores to split the weight stream over (default: the generation's TensorCores
      per JAX device, where f has an even number of chunks).
    stream: see `FusedPlan.stream` (rows sorted by expert; on a megacore device the visits are
      split between its TensorCores).
    visit_rows: with `stream`, the most rows one visit holds (rounded up to the rows' granule,
      at most the rows).
    pieces: force the parts each step's weights are copied and multiplied in (each a multiple
      of 128 rows of d, or one; default: the most, up to `MAX_PIECES` or for a window of at most
      `SMALL_WINDOW` rows `SMALL_WINDOW_PIECES`, whose parts are multiples of the generation's
      MXU edge).
    window: rows per MXU pass over rows sorted by expert (a multiple of the rows' granule,
      capped at the rows a visit or the call holds; default 128). An MXU pass costs at least
      128 row cycles, and a window costs its whole size: where experts hold a little over 128
      rows, one window of about their size costs less than two of 128.
    upcast: force how block-scaled values reach the MXU (`FusedPlan.upcast`; default:
      `upcast_route`'s choice for the generation).

  Returns:
    A `FusedPlan`.

  Raises:
    ValueError: the rows and one smallest chunk do not fit the chip's VMEM (use the gmm path),
      or a forced chunk that does not divide f.
  """
  gen = current_generation() if generation is None else get_generation(generation)
  x_item = jnp.dtype(x_dtype).itemsize
  w_item = jnp.dtype(w_dtype).itemsize
  out_dtype = x_dtype if out_dtype is None else out_dtype
  out_item = jnp.dtype(out_dtype).itemsize
  align = 8 * max(1, 4 // x_item)
  padded = max(align, -(-rows // align) * align)
  if stream:
    if by_token:
      raise ValueError("stream takes rows sorted by expert, not tokens (by_token).")
    # NOTE: rows are copied in and out `align` at a time: a whole VMEM tile of both dtypes.
    align = max(align, 8 * max(1, 4 // out_item))
    padded = max(align, -(-rows // align) * align)
    # NOTE: a visit holds at least one granule of its expert's rows past its rounded-down start.
    visit_rows = max(2 * align, min(-(-visit_rows // align) * align, padded + align))
  window = _window(
    window, align=align, rows=min(padded, visit_rows) if stream else padded, by_token=by_token
  )
  if by_token:
    # NOTE: windows over the tokens start on the 128-lane grid of the [E, 1, rows] weights.
    padded = -(-padded // window) * window
  if kind == "block" and (d % block or f % block):
    raise ValueError(f"block-scaled weights need d={d} and f={f} to be multiples of block={block}.")
  granule = block if kind == "block" else 128
  candidates = _chunks(f, chunk, granule)
  budget = int(gen.vmem_bytes * _VMEM_SHARE)
  upcast = _upcast(upcast, kind=kind, w_dtype=w_dtype, x_dtype=x_dtype, gen=gen)
  kw = dict(
    rows=padded,
    d=d,
    x_item=x_item,
    w_item=w_item,
    out_item=out_item,
    kind=kind,
    window=window,
    experts=num_experts if by_token else 0,
    gather=gather,
    stream=visit_rows if stream else 0,
    pieces=_pieces(d, gen.mxu_size, granule, pieces, small=window <= SMALL_WINDOW),
    dequantized=upcast != "partials",
  )
  cores = gen.tensorcores_per_device if cores is None else cores
  fits = [c for c in candidates if _vmem_bytes(chunk=c, **kw) <= budget]
  if stream:
    # NOTE: the TensorCores split the visits, not the chunks.
    cores = min(cores, 2)
  elif cores > 1 and any((f // c) % cores == 0 for c in fits):
    # NOTE: a megacore device's two TensorCores each stream half of every expert's chunks.
    fits = [c for c in fits if (f // c) % cores == 0]
  else:
    cores = 1
  if not fits:
    smallest = _vmem_bytes(chunk=candidates[-1], **kw)
    raise ValueError(
      f"fused experts: {rows} rows of d={d} and a [{d}, {candidates[-1]}] weight chunk need "
      f"{smallest / 2**20:.1f} MiB of VMEM, more than {budget / 2**20:.0f} MiB on "
      f"{gen.name}; run fewer rows per call (the gmm path takes any number)."
    )
  chunk = fits[0]
  vmem = _vmem_bytes(chunk=chunk, **kw)
  return FusedPlan(
    rows=padded,
    d=d,
    f=f,
    num_experts=num_experts,
    chunk=chunk,
    window=window,
    align=align,
    kind=kind,
    block=block,
    x_dtype=jnp.dtype(x_dtype).name,
    w_dtype=jnp.dtype(w_dtype).name,
    out_dtype=jnp.dtype(out_dtype).name,
    vmem_bytes=vmem,
    vmem_limit_bytes=min(int(gen.vmem_bytes * 0.9), max(vmem + (4 << 20), 32 << 20)),
    by_token=by_token,
    cores=cores,
    gather=gather and by_token,
    stream=stream,
    visit_rows=visit_rows if stream else 0,
    pieces=kw["pieces"],
    upcast=upcast,
    row_unit=min(align, gen.copy_row_unit),
  )


def _chunks(f: int, chunk: int | None, granule: int) -> list[int]:
  """The chunks of f a plan may take, widest first: `chunk` (checked), else every divisor of f
  that is a multiple of `granule` (f itself where none is)."""
  if chunk is not None:
    if f % chunk or (chunk != f and chunk % granule):
      raise ValueError(f"chunk={chunk} must divide f={f} and be a multiple of {granule} (or f).")
    return [chunk]
  if f % granule:
    return [f]
  return [c for c in range(f, 0, -granule) if f % c == 0]


def _upcast(forced: str | None, *, kind: str, w_dtype, x_dtype, gen) -> str:
  """The plan's `upcast`: `forced` where the generation can run it, else `upcast_route`'s."""
  if forced is None:
    return upcast_route(w_dtype, x_dtype=x_dtype, generation=gen) if kind == "block" else "astype"
  w, x = jnp.dtype(w_dtype), jnp.dtype(x_dtype)
  runs = {
    "astype": kind == "block",
    "partials": kind == "block" and w.name in gen.mxu_pushes_fp8 and x == jnp.bfloat16,
    "e4m3b11": kind == "block"
    and w == jnp.float8_e4m3fn
    and "float8_e4m3b11fnuz" in gen.unpacks_fp8,
  }
  if not runs.get(forced, False):
    can = [name for name, ok in runs.items() if ok] or ["none: only block-scaled weights"]
    raise ValueError(
      f"upcast={forced!r} does not run for {kind} {w.name} weights and {x.name} rows on "
      f"{gen.name}; it runs: {', '.join(can)}."
    )
  return forced


def _window(window: int | None, *, align: int, rows: int, by_token: bool) -> int:
  """Rows per MXU pass: `window` (checked) or 128, at most the `rows` a step holds."""
  if window is not None and (by_token or window <= 0 or window % align):
    raise ValueError(
      f"window={window} must be a positive multiple of {align} (the rows' granule), for "
      "rows sorted by expert (not by_token)."
    )
  return min(_MAX_WINDOW if window is None else window, rows)


def _pieces(d: int, mxu: int, granule: int, forced: int | None, *, small: bool = False) -> int:
  """The parts of d each step's weights come in: the most (up to `MAX_PIECES`, for a `small`
  window `SMALL_WINDOW_PIECES`) that keep a part a multiple of the MXU edge and of `granule`
  (the block scales' edge)."""
  if forced is not None:
    if forced < 1 or d % forced or (forced > 1 and (d // forced) % granule):
      raise ValueError(
        f"pieces={forced} must split d={d} into parts that are multiples of {granule}."
      )
    return forced
  edge = max(mxu, granule)
  most = SMALL_WINDOW_PIECES if small else MAX_PIECES
  return next(p for p in range(most, 0, -1) if p == 1 or d % (p * edge) == 0)


class _Weights(NamedTuple):
  """HBM refs: values and (quantized kinds) scales of wi and wo."""

  wi: Any
  wo: Any
  wi_scales: Any
  wo_scales: Any


class _Scratch(NamedTuple):
  acc: Any  # [rows, d] f32 sums
  gate_up: Any  # [2 slots, 2, pieces, d / pieces, chunk] weights
  down: Any  # [2 slots, pieces, chunk, d / pieces]
  sems: Any  # DMA semaphores [2 slots, 2 x pieces]: gate/up's pieces, then down's
  first_row: Any  # SMEM [E + 1]
  visits: Any  # SMEM [E]: the non-empty experts in order
  # channel: [2 slots, 2, 1, chunk] f32; block: SMEM [2, 2, cb, d / block]
  gate_up_scales: Any = None
  down_scales: Any = None  # channel: [2 slots, 1, d] f32; block: SMEM [2, cb, d / block]
  gathered: Any = None  # gather: [rows, d] the visited expert's tokens
  expert_acc: Any = None  # gather: [rows, d] f32 their sums
  bad_rows: Any = None  # gather: [rows, 1] f32, 1 where the token's row is not finite
  visit_lo: Any = None  # stream: SMEM [max visits] each visit's first row
  visit_hi: Any = None  # stream: SMEM [max visits] one past its last row
  x_rows: Any = None  # stream: [2 slots, held, d] a visit's rows, from its first rounded down
  row_weights: Any = None  # stream: [2 slots, held, 1] f32 their routing weights
  staging: Any = None  # stream: [held, d] the visit's sums in the output dtype, to copy out
  carry: Any = None  # stream: [align, d] f32 the last, unfinished granule of rows
  row_sems: Any = None  # stream: DMA semaphores [2, 2]: rows in (per slot), rows out
  seam_row: Any = None  # stream on two cores: SMEM [1] uint32, the shared granule's first row
  gate_up_sums: Any = None  # [2, step rows, chunk] f32 a step's gate and up products
  act: Any = None  # [step rows, chunk] its activation in the compute dtype


def _metadata(plan: FusedPlan, group_sizes, scratch: _Scratch):
  """Writes each expert's first row and the list of non-empty experts to SMEM.

  Returns:
    The number of non-empty experts (a scalar).
  """

  def body(e, carry):
    row, count = carry
    size = group_sizes[e]
    scratch.first_row[e] = row
    scratch.visits[count] = e
    return row + size, count + (size > 0).astype(jnp.int32)

  row, count = lax.fori_loop(0, plan.num_experts, body, (jnp.int32(0), jnp.int32(0)))
  scratch.first_row[plan.num_experts] = row
  return count


def _stream_metadata(plan: FusedPlan, group_sizes, scratch: _Scratch):
  """Writes the visits of a streamed call to SMEM: (expert, first row, end row) per visit, in
  row order; an expert whose rows span more than `visit_rows` from its first row rounded down
  to `align` gets one visit per such span.

  Returns:
    The number of visits (a scalar).
  """
  align, held = plan.align, plan.visit_rows

  def expert_visits(e, carry):
    row, count = carry
    end = row + group_sizes[e]

    def more(c):
      return c[0] < end

    def visit(c):
      lo, n = c
      # NOTE: a visit's rows start at a granule boundary in VMEM (its first row rounded down),
      # so it holds rows up to that boundary plus `visit_rows`.
      hi = jnp.minimum(end, (lo // align) * align + held)
      scratch.visits[n] = e
      scratch.visit_lo[n] = lo
      scratch.visit_hi[n] = hi
      return hi, n + 1

    _, count = lax.while_loop(more, visit, (row, count))
    return end, count

  _, count = lax.fori_loop(0, plan.num_experts, expert_visits, (jnp.int32(0), jnp.int32(0)))
  return count


def _copies(plan: FusedPlan, w: _Weights, scratch: _Scratch, *, expert, chunk, slot, part, piece):
  """The step's DMAs of one piece of `part` ("gate_up": rows [piece x plan.piece, ...) of d of
  the gate and up columns; "down": those columns of d of the down rows): a list of descriptors
  on the piece's semaphore. A step's scales travel with its first piece of each part."""
  f, c, k = plan.f, plan.chunk, plan.piece
  col = pl.multiple_of(chunk * c, c)
  sem = scratch.sems.at[slot, piece + (plan.pieces if part == "down" else 0)]
  rows = slice(piece * k, (piece + 1) * k)

  def cp(src, dst):
    return pltpu.make_async_copy(src, dst, sem)

  if part == "down":
    # NOTE: the chunk's columns of gate/up are its rows of down.
    down = [cp(w.wo.at[expert, pl.ds(col, c), rows], scratch.down.at[slot, piece])]
    if piece == 0:
      down += _down_scale_copies(plan, w, scratch, expert=expert, chunk=chunk, slot=slot, cp=cp)
    return down
  gate_up = [
    cp(w.wi.at[expert, rows, pl.ds(col, c)], scratch.gate_up.at[slot, 0, piece]),
    cp(w.wi.at[expert, rows, pl.ds(col + f, c)], scratch.gate_up.at[slot, 1, piece]),
  ]
  if piece or plan.kind == "float":
    return gate_up
  if plan.kind == "channel":
    return gate_up + [
      cp(w.wi_scales.at[expert, :, pl.ds(col, c)], scratch.gate_up_scales.at[slot, 0]),
      cp(w.wi_scales.at[expert, :, pl.ds(col + f, c)], scratch.gate_up_scales.at[slot, 1]),
    ]
  # NOTE: block scales come transposed, [E, 2f / block, d / block] for wi (so a chunk's column
  # blocks are leading rows) and [E, f / block, d / block] for wo: one contiguous run of rows
  # per step, copied to SMEM where the kernel reads them as scalars.
  cb = plan.chunk_blocks
  blk = chunk * cb
  scales = scratch.gate_up_scales.at[slot]
  return gate_up + [
    cp(w.wi_scales.at[expert, pl.ds(blk, cb)], scales.at[0]),
    cp(w.wi_scales.at[expert, pl.ds(blk + f // plan.block, cb)], scales.at[1]),
  ]


def _down_scale_copies(plan: FusedPlan, w: _Weights, scratch: _Scratch, *, expert, chunk, slot, cp):
  if plan.kind == "channel":
    return [cp(w.wo_scales.at[expert], scratch.down_scales.at[slot])]
  if plan.kind == "block":
    cb = plan.chunk_blocks
    return [cp(w.wo_scales.at[expert, pl.ds(chunk * cb, cb)], scratch.down_scales.at[slot])]
  return []


def _step_copies(plan: FusedPlan, copies):
  """Every piece's descriptors of a step, gate/up's first: `copies(part, piece)` gives one."""
  return [c for part in ("gate_up", "down") for p in range(plan.pieces) for c in copies(part, p)]


def _start(copies) -> None:
  for c in copies:
    c.start()


def _wait(copies) -> None:
  for c in copies:
    c.wait()


def _arrivals(copies):
  """`arrive(part, piece)`: waits for the piece's copies (gate/up's first piece excepted: the
  step waited for it before starting the next step's)."""

  def arrive(part, piece):
    if part == "down" or piece:
      _wait(copies(part, piece))

  return arrive


def _products(
  plan: FusedPlan,
  scratch: _Scratch,
  *,
  slot,
  arrive,
  windows,
  place,
  x_rows,
  scale,
  into,
  after_down=None,
):
  """One step's products over `windows` windows of rows, piece by piece of d as the pieces
  arrive: gate/up summed over the pieces into `gate_up_sums`, then the activation, then down's
  column pieces added into the f32 sums `into`.

  NOTE: a piece's wait sits between loops, never between the products of one loop body: Mosaic
  keeps a body's weight operands in scoped VMEM when a DMA wait splits it.

  Args:
    arrive: `_arrivals`' function.
    windows: the step's window count (traced).
    place: window index -> its first row in `x_rows` and `into` (a multiple of `plan.align`).
    x_rows: the rows' ref.
    scale: (window index, first row, activation [window, chunk] f32) -> the activation times
      the rows' routing weights, zero on rows the window does not own.
    into: the f32 sums' ref.
    after_down: (piece, its columns of d) -> None, run once the piece's down products are in
      `into` (before the next piece's wait), or None.
  """
  k, window, cdt = plan.piece, plan.window, jnp.dtype(plan.x_dtype)
  sums, act_rows = scratch.gate_up_sums, scratch.act
  partials = plan.kind == "block" and plan.upcast == "partials"
  inline = plan.kind == "block" and not partials
  weights_in, weights_out = scratch.gate_up.at[slot], scratch.down.at[slot]

  def own(i):
    return pl.ds(pl.multiple_of(i * window, window), window)

  def dot(a, b):
    return jnp.dot(a, b.astype(cdt), preferred_element_type=jnp.float32)

  for p in range(plan.pieces):
    arrive("gate_up", p)

    def gate_up(i, carry, p=p):
      if partials:
        _gate_up_partials(plan, scratch, slot=slot, piece=p, x=x_rows, row=place(i), at=own(i))
        return carry
      x = x_rows[pl.ds(place(i), window), p * k : (p + 1) * k]
      for which in range(2):
        if inline:
          y = dot(x, _dequantized_gate_up(plan, scratch, slot=slot, which=which, piece=p))
        else:
          y = dot(x, weights_in[which, p])
        sums[which, own(i)] = y if p == 0 else sums[which, own(i)] + y
      return carry

    lax.fori_loop(0, windows, gate_up, 0)

  def activation(i, carry):
    gate, up = sums[0, own(i)], sums[1, own(i)]
    if plan.kind == "channel":
      # NOTE: one scale per output column: dot(x, q) * s[None, :] == dot(x, q * s).
      gate = gate * scratch.gate_up_scales[slot, 0]
      up = up * scratch.gate_up_scales[slot, 1]
    act_rows[own(i)] = scale(i, place(i), jax.nn.silu(gate) * up).astype(cdt)
    return carry

  lax.fori_loop(0, windows, activation, 0)
  for p in range(plan.pieces):
    arrive("down", p)
    cols = slice(p * k, (p + 1) * k)

    def down(i, carry, p=p, cols=cols):
      if partials:
        _down_partials(plan, scratch, slot=slot, piece=p, at=own(i), into=into, row=place(i))
        return carry
      if inline:
        y = dot(act_rows[own(i)], _dequantized_down(plan, scratch, slot=slot, piece=p))
      else:
        y = dot(act_rows[own(i)], weights_out[p])
      if plan.kind == "channel":
        y = y * scratch.down_scales[slot, :, cols]
      into[pl.ds(place(i), window), cols] += y
      return carry

    lax.fori_loop(0, windows, down, 0)
    if after_down is not None:
      after_down(p, cols)


def _gate_up_partials(plan: FusedPlan, scratch: _Scratch, *, slot, piece, x, row, at) -> None:
  """One window's gate and up products over one piece of d, from the stored block-scaled
  values (`FusedPlan.upcast` "partials"): per 128-deep block row of the piece, a [window,
  chunk] partial product, each 128 of its columns times that block's scale, added into
  `gate_up_sums` (zeroed at the first piece).

  Args:
    x: the rows' ref; row: the window's first row in it; at: the window's rows of the sums.
  """
  b, cb, window = plan.block, plan.chunk_blocks, plan.window
  sums, scales, values = scratch.gate_up_sums, scratch.gate_up_scales, scratch.gate_up.at[slot]
  first = piece * (plan.piece // b)  # NOTE: the piece's first block of d, to index the scales
  if piece == 0:
    sums[:, at] = jnp.zeros((2, window, plan.chunk), jnp.float32)

  def block_row(kb, carry):
    k0 = pl.multiple_of(kb * b, b)
    rows = x[pl.ds(row, window), pl.ds(pl.multiple_of(piece * plan.piece + k0, b), b)]
    for which in range(2):
      part = jnp.dot(rows, values[which, piece, pl.ds(k0, b)], preferred_element_type=jnp.float32)
      for j in range(cb):
        cols = slice(j * b, (j + 1) * b)
        sums[which, at, cols] += part[:, cols] * scales[slot, which, j, first + kb]
    return carry

  lax.fori_loop(0, plan.piece // b, block_row, 0)


def _down_partials(plan: FusedPlan, scratch: _Scratch, *, slot, piece, at, into, row) -> None:
  """One window's down product into one piece of d's columns, from the stored block-scaled
  values: per 128-deep block row of the chunk, a [window, d / pieces] partial product, each
  128 of its columns times that block's scale, added into `into`'s window rows.

  Args:
    at: the window's rows of the activation; into: the f32 sums' ref; row: the window's first
      row in it.
  """
  b, window, k = plan.block, plan.window, plan.piece
  scales, values = scratch.down_scales, scratch.down.at[slot]
  first = piece * (k // b)  # NOTE: the piece's first block of d's columns, to index the scales

  def block_row(kb, carry):
    k0 = pl.multiple_of(kb * b, b)
    act = scratch.act[at, pl.ds(k0, b)]
    part = jnp.dot(act, values[piece, pl.ds(k0, b)], preferred_element_type=jnp.float32)
    for j in range(k // b):
      cols = pl.ds(piece * k + j * b, b)
      into[pl.ds(row, window), cols] += part[:, j * b : (j + 1) * b] * scales[slot, kb, first + j]
    return carry

  lax.fori_loop(0, plan.chunk_blocks, block_row, 0)


def _dequantized_gate_up(plan: FusedPlan, scratch: _Scratch, *, slot, which, piece):
  """One piece of the step's gate (which 0) or up (1) block-scaled values, dequantized on their
  way to the MXU: each 128 x 128 block upcast, times its scale, cast to the compute dtype, the
  blocks put together as one [d / pieces, chunk] operand (`FusedPlan.upcast`).

  NOTE: a block scale varies along both the contraction and the output columns, so no full-depth
  product can take it outside the MXU. Built inside the product's loop body, the blocks go from
  the vector registers into the MXU with no dequantized copy in VMEM: the vector unit's unpack
  and multiply issue beside the MXU's pushes (tpu7x, gate and up [64, 1,024] x [1,024, 512]
  products: 790 bundles against 1,307 with a dequantization loop of their own before them,
  `python -m bench.llo_variants --variant dq_inline,dq_products_loop`). A step of several
  windows dequantizes its blocks once per window; a 128-row window's products take the MXU
  longer than that (tpu7x: 0.82 bundles per 1,024 values against 1 MXU cycle).
  """
  b, cb, cdt = plan.block, plan.chunk_blocks, jnp.dtype(plan.x_dtype)
  values, scales = scratch.gate_up.at[slot], scratch.gate_up_scales
  first = piece * (plan.piece // b)  # NOTE: the piece's first block of d, to index the scales

  def block(kb, j):
    v = values[which, piece, kb * b : (kb + 1) * b, j * b : (j + 1) * b]
    return _scaled(plan, v, scales[slot, which, j, first + kb]).astype(cdt)

  rows = [
    jnp.concatenate([block(kb, j) for j in range(cb)], axis=1) for kb in range(plan.piece // b)
  ]
  return jnp.concatenate(rows, axis=0)


def _dequantized_down(plan: FusedPlan, scratch: _Scratch, *, slot, piece):
  """One piece of d's columns of the step's block-scaled down values, dequantized on their way
  to the MXU as `_dequantized_gate_up`'s: one [chunk, d / pieces] operand."""
  b, cb, cdt = plan.block, plan.chunk_blocks, jnp.dtype(plan.x_dtype)
  values, scales = scratch.down.at[slot], scratch.down_scales
  first = piece * (plan.piece // b)  # NOTE: the piece's first block of d's columns

  def block(j, n):
    v = values[piece, j * b : (j + 1) * b, n * b : (n + 1) * b]
    return _scaled(plan, v, scales[slot, j, first + n]).astype(cdt)

  rows = [jnp.concatenate([block(j, n) for n in range(plan.piece // b)], axis=1) for j in range(cb)]
  return jnp.concatenate(rows, axis=0)


def _scaled(plan: FusedPlan, values, scale):
  """One block's narrow values times its scale, in f32 (`FusedPlan.upcast`)."""
  if plan.upcast == "e4m3b11":
    wide = lax.bitcast_convert_type(values, jnp.float8_e4m3b11fnuz).astype(jnp.float32)
    scaled = wide * (scale * _E4M3B11_FACTOR)
    # NOTE: only the byte 0x80 (e4m3fn's -0) reads as NaN in e4m3b11fnuz.
    return jnp.where(scaled == scaled, scaled, 0.0)
  return values.astype(jnp.float32) * scale


def _expert_step(
  plan: FusedPlan, refs, scratch: _Scratch, *, expert, slot, arrive, span=None
) -> None:
  """One step's compute: every window of the expert's rows through gate/up, the activation and
  down into the f32 sums.

  Args:
    arrive: `_arrivals`' function.
    span: (lo, hi, rows): the rows [lo, hi) of `refs`' first `rows` rows to run (a streamed
      visit's, in its VMEM copy); None: the expert's rows of the resident buffer (or every
      token, `by_token`).
  """
  x_rows, row_weights = refs
  bound = plan.rows
  if span is not None:
    lo, hi, bound = span
    start = 0
  elif plan.by_token:
    # NOTE: every token, scaled by its weight for this expert (0: not routed to it).
    lo, hi, start = 0, plan.rows, 0
  else:
    lo, hi = scratch.first_row[expert], scratch.first_row[expert + 1]
    start = (lo // plan.align) * plan.align
  windows = (hi - start + plan.window - 1) // plan.window

  def place(i):
    # NOTE: a window that would cross the buffer's end moves back to end there; it keeps only
    # the rows from its nominal start, so no row is added twice.
    return pl.multiple_of(jnp.minimum(start + i * plan.window, bound - plan.window), plan.align)

  def scale(i, r0, act):
    row = r0 + lax.broadcasted_iota(jnp.int32, (plan.window, 1), 0)
    mine = (row >= jnp.maximum(lo, start + i * plan.window)) & (row < hi)
    if plan.by_token:
      act = act * _token_column(row_weights, expert, r0, plan.window)
    elif row_weights is not None:
      act = act * row_weights[pl.ds(r0, plan.window), :]
    return jnp.where(mine, act, 0.0)

  _products(
    plan, scratch, slot=slot, arrive=arrive, windows=windows, place=place, x_rows=x_rows,
    scale=scale, into=scratch.acc,
  )  # fmt: skip


def _row_copies(plan: FusedPlan, src, dst, sem, *, src_row, dst_row, rows, unit=None):
  """Copies of `rows` rows from src row `src_row` to dst row `dst_row`: whole `align`-row
  tiles, then the rest rounded up to `unit` rows (the descriptors, as a function of the
  method).

  NOTE: Mosaic starts a copy into a VMEM slice only on the buffer's tile: where a copy starts
  mid-granule, `unit` is `plan.row_unit` and both rows are multiples of it. None: `rows` and
  both rows are whole granules (multiples of `align`), and there is no rest to copy.
  """
  a = plan.align
  step = unit or a
  tiles = rows // a

  def copy(at, size):
    return pltpu.make_async_copy(
      src.at[pl.ds(pl.multiple_of(src_row + at, step), size)],
      dst.at[pl.ds(pl.multiple_of(dst_row + at, step), size)],
      sem,
    )

  def run(method):
    def tile(p, carry):
      getattr(copy(p * a, a), method)()
      return carry

    def rest(q, carry):
      getattr(copy(tiles * a + q * unit, unit), method)()
      return carry

    lax.fori_loop(0, tiles, tile, 0)
    if unit is not None:
      lax.fori_loop(0, (rows - tiles * a + unit - 1) // unit, rest, 0)

  return run


def _visit_rows_in(plan: FusedPlan, refs, scratch: _Scratch, visit, method: str) -> None:
  """Starts or waits for ("start" / "wait") the copies of a visit's rows and row weights into
  its slot (visit % 2), placed from its first row rounded down to `align`.

  NOTE: only rows from the visit's first rounded down to `plan.row_unit` are copied: the
  granule's rows before it belong to the previous visit, and the products mask them (a stale
  row's values, NaN included, are selected away, never multiplied into a result).
  """
  x_hbm, w_hbm, _ = refs
  a, u, slot = plan.align, plan.row_unit, visit % 2
  lo, hi = scratch.visit_lo[visit], scratch.visit_hi[visit]
  base = (lo // a) * a
  first = (lo // u) * u
  sem = scratch.row_sems.at[0, slot]
  kw = dict(src_row=first, dst_row=first - base, rows=hi - first, unit=u)
  _row_copies(plan, x_hbm, scratch.x_rows.at[slot], sem, **kw)(method)
  if w_hbm is not None:
    _row_copies(plan, w_hbm, scratch.row_weights.at[slot], sem, **kw)(method)


def _visit_rows_out(plan: FusedPlan, refs, scratch: _Scratch, visit, method: str) -> None:
  """Starts or waits for the copies of a visit's finished granules out of the staging rows."""
  a = plan.align
  lo, hi = scratch.visit_lo[visit], scratch.visit_hi[visit]
  base = (lo // a) * a
  out = _row_copies(
    plan, scratch.staging, refs[2], scratch.row_sems.at[1, 0], src_row=0, dst_row=base,
    rows=(hi - base) // a * a,
  )  # fmt: skip
  out(method)


def _visit_rows_turn(plan: FusedPlan, refs, scratch: _Scratch, *, visit, visits) -> None:
  """At a visit's first step, before the next step's weights are started: waits for the
  visit's rows (copied while the previous visit computed) and starts the next visit's into the
  other slot, so they queue ahead of the weights that follow (with one chunk per expert, the
  next step is the next visit's)."""
  _visit_rows_in(plan, refs, scratch, visit, "wait")

  @pl.when(visit + 1 < visits)
  def _():
    _visit_rows_in(plan, refs, scratch, visit + 1, "start")


def _stream_step(
  plan: FusedPlan, refs, scratch: _Scratch, *, visit, first_visit, expert, slot, arrive, first, last
):
  """One step of a streamed visit: its rows (and row weights) are in slot visit % 2
  (`_visit_rows_turn`); at its first chunk it starts its sums from the granule the previous
  visit left unfinished; every chunk runs its rows as `_expert_step`; at its last chunk its finished
  granules are copied out (the previous visit's copy out is waited for first: it had this
  whole visit to finish) and the unfinished last one is carried on.

  NOTE: visits come in row order and are contiguous, so the granule a visit starts in is the
  one the previous visit ended in: its rows of earlier visits arrive in the carry, and no
  granule is copied out before every row in it is done. Rows of later visits in a granule are
  masked (zero) until their own visit.
  """
  a = plan.align
  lo, hi = scratch.visit_lo[visit], scratch.visit_hi[visit]
  base = (lo // a) * a
  held = plan.visit_rows + a
  rows = visit % 2
  # NOTE: the granules the visit finishes (copied out at its last chunk); the one after them is
  # carried on to the next visit.
  full = (hi - base) // a

  def granule(g):
    return pl.ds(pl.multiple_of(g * a, a), a)

  @pl.when(first)
  def _():
    # NOTE: only the granules the visit's rows reach and the carried one are read back; the
    # sums' other rows take masked (zero) products only, and a visit of a few rows need not
    # clear all `visit_rows` of them.
    def clear(g, carry):
      scratch.acc[granule(g), :] = jnp.zeros((a, plan.d), jnp.float32)
      return carry

    lax.fori_loop(0, full + 1, clear, 0)
    scratch.acc[0:a, :] = scratch.carry[...]

  weights = scratch.row_weights.at[rows] if refs[1] is not None else None
  _expert_step(
    plan,
    (scratch.x_rows.at[rows], weights),
    scratch,
    expert=expert,
    slot=slot,
    arrive=arrive,
    span=(lo - base, hi - base, held),
  )

  @pl.when(last)
  def _():
    @pl.when(visit > first_visit)
    def _():
      _visit_rows_out(plan, refs, scratch, visit - 1, "wait")

    def cast(g, carry):
      scratch.staging[granule(g), :] = scratch.acc[granule(g), :].astype(scratch.staging.dtype)
      return carry

    lax.fori_loop(0, full, cast, 0)
    _visit_rows_out(plan, refs, scratch, visit, "start")
    scratch.carry[...] = scratch.acc[granule(full), :]


def _token_onehot(expert_tokens, expert, r0, window: int, tokens: int):
  """[window, tokens] one-hot rows of the expert's r0-th to (r0 + window)-th tokens."""
  ids = _token_column(expert_tokens, expert, r0, window)
  return ids == lax.broadcasted_iota(jnp.int32, (window, tokens), 1)


def _gathered_step(plan: FusedPlan, refs, scratch: _Scratch, *, expert, slot, arrive, first, last):
  """One step over the expert's own tokens: gathered into windows at its first chunk, each
  window through gate/up, the activation (times the weights) and down into the expert's f32
  sums, added into the tokens' sums at its last chunk piece by piece of d.

  NOTE: at the last chunk each down piece's columns are final once its products are in, so
  they are added back then, while the next piece's copy streams: only the last piece's add
  back is left after the call's last copy (the call's last step is always some expert's last).
  """
  table, weights, expert_tokens, group_sizes = refs
  window, cdt = plan.window, jnp.dtype(plan.x_dtype)
  windows = (group_sizes[expert] + window - 1) // window
  exact = dict(preferred_element_type=jnp.float32)
  if cdt == jnp.float32:
    exact["precision"] = lax.Precision.HIGHEST

  def gather(p, carry):
    r0 = pl.multiple_of(p * window, window)
    onehot = _token_onehot(expert_tokens, expert, r0, window, plan.rows).astype(cdt)
    rows = jnp.dot(onehot, table[...], **exact)
    scratch.gathered[pl.ds(r0, window), :] = rows.astype(cdt)
    scratch.expert_acc[pl.ds(r0, window), :] = jnp.zeros((window, plan.d), jnp.float32)
    return carry

  def place(i):
    return pl.multiple_of(i * window, window)

  def scale(i, r0, act):
    act = act * _token_column(weights, expert, r0, window)
    # NOTE: list entries past the expert's count may name any token: they add nothing.
    listed = r0 + lax.broadcasted_iota(jnp.int32, (window, 1), 0) < group_sizes[expert]
    return jnp.where(listed, act, 0.0)

  def add_back(piece, cols):
    def scatter(p, carry):
      r0 = pl.multiple_of(p * window, window)
      onehot = _token_onehot(expert_tokens, expert, r0, window, plan.rows).astype(cdt)
      rows = scratch.expert_acc[pl.ds(r0, window), cols].astype(cdt)
      dims = (((0,), (0,)), ((), ()))
      scratch.acc[:, cols] += lax.dot_general(onehot, rows, dims, **exact)
      return carry

    @pl.when(last)
    def _():
      lax.fori_loop(0, windows, scatter, 0)

  @pl.when(first)
  def _():
    lax.fori_loop(0, windows, gather, 0)

  _products(
    plan, scratch, slot=slot, arrive=arrive, windows=windows, place=place,
    x_rows=scratch.gathered, scale=scale, into=scratch.expert_acc, after_down=add_back,
  )  # fmt: skip


def _clean_table(plan: FusedPlan, table, scratch: _Scratch) -> None:
  """Zeroes the table's values that are not finite and marks their rows in `bad_rows`.

  NOTE: the one-hot products that gather and add back a visited expert's tokens multiply every
  row of the table (or of the expert's sums) by 0 or 1, and 0 x inf is NaN: one non-finite
  token would make every token's result NaN. Zeroed, it reaches no other row; its own row
  comes out NaN at the end.
  """
  # NOTE: a granule of rows at a time: its f32 values and mask are the only temporaries.
  a = plan.align

  def block(b, carry):
    r0 = pl.multiple_of(b * a, a)
    rows = table[pl.ds(r0, a), :].astype(jnp.float32)
    finite = jnp.abs(rows) <= jnp.finfo(jnp.float32).max
    table[pl.ds(r0, a), :] = jnp.where(finite, rows, 0.0).astype(table.dtype)
    bad = jnp.min(finite.astype(jnp.float32), axis=1, keepdims=True) < 1.0
    scratch.bad_rows[pl.ds(r0, a), :] = bad.astype(jnp.float32)
    return carry

  lax.fori_loop(0, plan.rows // a, block, 0)


def _token_column(weights, expert, r0, window):
  """[window, 1] routing weights of tokens [r0, r0 + window) for `expert`, from the [E, 1,
  rows] lanes (a column would take 128 lanes of VMEM per token)."""
  lanes = weights[expert, :, pl.ds(pl.multiple_of(r0, window), window)]  # [1, window]
  return jnp.transpose(jnp.broadcast_to(lanes, (8, window)))[:, :1]


def _kernel(plan: FusedPlan, has_weights: bool, *refs) -> None:
  refs = list(refs)
  group_sizes = refs.pop(0)
  x = refs.pop(0)
  row_weights = refs.pop(0) if has_weights else None
  expert_tokens = refs.pop(0) if plan.gather else None
  if plan.kind != "float":
    wi, wi_s, wo, wo_s, out, *scr = refs
  else:
    (wi, wo, out, *scr), wi_s, wo_s = refs, None, None
  seam = None
  if plan.stream and plan.cores > 1:
    # NOTE: the shared granule's values and first row (`_stream_finish`).
    seam, scr = (scr[0], scr[1]), scr[2:]
  w = _Weights(wi=wi, wo=wo, wi_scales=wi_s, wo_scales=wo_s)
  scratch = _Scratch(**dict(zip(_scratch_names(plan), scr, strict=True)))
  per_expert = plan.core_chunks
  core = pl.program_id(0)

  if plan.stream:
    visited = _stream_metadata(plan, group_sizes, scratch)
    scratch.carry[...] = jnp.zeros_like(scratch.carry)
    # NOTE: TensorCore c runs visits [v0, v1): the first half (rounded up) or the rest.
    half = (visited + plan.cores - 1) // plan.cores
    v0 = jnp.minimum(core * half, visited)
    v1 = jnp.minimum(v0 + half, visited)
    first_chunk = 0
  else:
    visited = _metadata(plan, group_sizes, scratch)
    scratch.acc[...] = jnp.zeros_like(scratch.acc)
    v0, v1 = 0, visited
    # NOTE: TensorCore c streams chunks [c * per_expert, (c + 1) * per_expert) of each expert.
    first_chunk = core * per_expert
  steps = (v1 - v0) * per_expert

  def copies(s):
    expert = scratch.visits[v0 + s // per_expert]
    chunk = first_chunk + s % per_expert
    kw = dict(expert=expert, chunk=chunk, slot=s % 2)
    return lambda part, piece: _copies(plan, w, scratch, part=part, piece=piece, **kw)

  @pl.when(steps > 0)
  def _():
    if plan.stream:
      _visit_rows_in(plan, (x, row_weights, out), scratch, v0, "start")
    _start(_step_copies(plan, copies(0)))

  if plan.gather:
    # NOTE: under the first step's copies.
    _clean_table(plan, x, scratch)

  def step(s, carry):
    _wait(copies(s)("gate_up", 0))
    if plan.stream:

      @pl.when(s % per_expert == 0)
      def _():
        _visit_rows_turn(
          plan, (x, row_weights, out), scratch, visit=v0 + s // per_expert, visits=v1
        )

    # NOTE: start the next step's copies (its slot's last reader, step s - 1, is done) once
    # this step's first piece is in: they queue behind this step's other pieces and stream
    # under its products, so the DMA queue never runs dry.
    @pl.when(s + 1 < steps)
    def _():
      _start(_step_copies(plan, copies(s + 1)))

    expert = scratch.visits[v0 + s // per_expert]
    arrive = _arrivals(copies(s))
    if plan.stream:
      _stream_step(
        plan,
        (x, row_weights, out),
        scratch,
        visit=v0 + s // per_expert,
        first_visit=v0,
        expert=expert,
        slot=s % 2,
        arrive=arrive,
        first=s % per_expert == 0,
        last=s % per_expert == per_expert - 1,
      )
    elif plan.gather:
      _gathered_step(
        plan,
        (x, row_weights, expert_tokens, group_sizes),
        scratch,
        expert=expert,
        slot=s % 2,
        arrive=arrive,
        first=s % per_expert == 0,
        last=s % per_expert == per_expert - 1,
      )
    else:
      _expert_step(plan, (x, row_weights), scratch, expert=expert, slot=s % 2, arrive=arrive)
    return carry

  lax.fori_loop(0, steps, step, 0)
  if not plan.stream:
    acc = scratch.acc[...]
    if plan.gather:
      # NOTE: a token whose row is not finite comes out NaN, as it would from its own products.
      acc = jnp.where(scratch.bad_rows[...] > 0, jnp.nan, acc)
    out[...] = acc.reshape(out.shape).astype(out.dtype)
    return
  _stream_finish(plan, (x, row_weights, out), scratch, seam, v0=v0, v1=v1, visited=visited)


def _stream_finish(plan: FusedPlan, refs, scratch: _Scratch, seam, *, v0, v1, visited) -> None:
  """A streamed core's end: waits for its last visit's rows out and writes the granule its
  last visit left unfinished (its rows past the core's last come out zero).

  NOTE: on two TensorCores the first core's unfinished granule is the one the second core's
  first visit starts in, and the second core writes it (the first core's rows zero). So the
  first core writes its part to `seam` instead, with the granule's first row, for
  `fused_experts` to add in; where there is no shared granule it writes zeros there.
  """
  a = plan.align
  end = jnp.where(v1 > v0, scratch.visit_hi[jnp.maximum(v1 - 1, 0)], 0)
  shared = (v1 < visited) & (end % a != 0)

  @pl.when(v1 > v0)
  def _():
    _visit_rows_out(plan, refs, scratch, v1 - 1, "wait")

  def write(dst, row):
    scratch.staging[0:a, :] = scratch.carry[...].astype(scratch.staging.dtype)
    copy = _row_copies(
      plan, scratch.staging, dst, scratch.row_sems.at[1, 0], src_row=0, dst_row=row, rows=a
    )
    copy("start")
    copy("wait")

  @pl.when((end % a != 0) & jnp.logical_not(shared))
  def _():
    write(refs[2], (end // a) * a)

  if seam is None:
    return
  values, first_row = seam

  @pl.when(pl.program_id(0) == 0)
  def _():
    @pl.when(jnp.logical_not(shared))
    def _():
      scratch.carry[...] = jnp.zeros_like(scratch.carry)

    write(values, 0)
    scratch.seam_row[0] = jnp.where(shared, (end // a) * a, 0).astype(jnp.uint32)
    copy = pltpu.make_async_copy(scratch.seam_row, first_row, scratch.row_sems.at[1, 1])
    copy.start()
    copy.wait()


def _split(w: Any, name: str):
  """(values, scales or None) of a weight in any of the three kinds."""
  kind = weight_kind(w)
  if kind == "float":
    common.check_float_array(name, w, ndim=3)
    return w, None
  if kind == "channel":
    quant.check_quantized(w, transpose_rhs=False)
  else:
    quant.check_block_quantized(w)
  return w.values, w.scales


def _check(
  x, wi, wo, group_sizes, row_weights, expert_weights, expert_tokens
) -> tuple[int, int, int]:
  common.check_float_array("x", x, ndim=2)
  m, d = x.shape
  e, wd, f2 = wi.shape
  if wd != d or f2 % 2:
    raise ValueError(f"wi must be [E, d={d}, 2f] ([gate | up] columns), got {tuple(wi.shape)}.")
  f = f2 // 2
  if tuple(wo.shape) != (e, f, d):
    raise ValueError(f"wo must be [E={e}, f={f}, d={d}] to match wi, got {tuple(wo.shape)}.")
  if expert_weights is None:
    common.check_group_sizes(group_sizes, m=m)
  else:
    # NOTE: with tokens, a token counts once for each local expert it chose.
    common.check_int_array("group_sizes", group_sizes, ndim=1)
  if group_sizes.shape != (e,):
    raise ValueError(
      f"group_sizes must be [E={e}] (one per local expert), got {tuple(group_sizes.shape)}."
    )
  if row_weights is not None and expert_weights is not None:
    raise ValueError(
      "pass row_weights (rows sorted by expert) or expert_weights (tokens), not both."
    )
  if row_weights is not None and tuple(row_weights.shape) != (m,):
    raise ValueError(f"row_weights must be [m={m}], got {tuple(row_weights.shape)}.")
  if expert_tokens is not None and (expert_weights is None or tuple(expert_tokens.shape) != (e, m)):
    raise ValueError(
      f"expert_tokens must be [E={e}, m={m}] (each expert's tokens first) and come with "
      "expert_weights in the same order."
    )
  if expert_weights is not None and tuple(expert_weights.shape) != (e, m):
    raise ValueError(
      f"expert_weights must be [E={e}, m={m}] (each token's weight for each local expert), "
      f"got {tuple(expert_weights.shape)}."
    )
  return m, d, f


def fused_experts(
  x: jax.Array,
  wi: Any,
  wo: Any,
  group_sizes: jax.Array,
  *,
  row_weights: jax.Array | None = None,
  expert_weights: jax.Array | None = None,
  expert_tokens: jax.Array | None = None,
  out_dtype: Any = None,
  chunk: int | None = None,
  stream: bool = False,
  unowned_rows: str = "zero",
  plan: FusedPlan | None = None,
  interpret: Any = None,
) -> jax.Array:
  """SwiGLU experts in one kernel: `silu(x @ gate) * (x @ up)`, times the routing weights,
  `@ down`.

  Two layouts of the rows:
  - sorted by expert (`row_weights` or none): row r belongs to the expert whose group holds it;
    the result is per row.
  - tokens (`expert_weights`): every visited expert runs over all m tokens and the result is
    `out[t] = sum_e expert_weights[e, t] * expert_e(x[t])`. No gather or scatter of rows, no
    sort: the serving path's layout where the tokens are few (a decode step's), since each
    expert's pass over all of them costs no more MXU time than one 128-row pass.
  In both, only the experts with `group_sizes[e] > 0` are visited and have their weights read.

  Args:
    x: [m, d] rows sorted by local expert (`group_sizes[e]` rows of expert e, in order; rows
      past `sum(group_sizes)` come out as zeros), or [m, d] tokens with `expert_weights`.
    wi: [E, d, 2f] [gate | up] weights: a float array, `quant.QuantizedWeights` ([E, 1, 2f]
      scales) or `quant.BlockQuantizedWeights` ([E, d / 128, 2f / 128] scales).
    wo: [E, f, d] down weights, of wi's kind.
    group_sizes: [E] int32 rows of each local expert (with `expert_weights`: its tokens; only
      whether it is 0 matters).
    row_weights: optional [m] f32 routing weight of each sorted row, applied to the activation.
    expert_weights: [E, m] f32 each token's routing weight for each local expert (0: not
      routed there), applied to the activation. With `expert_tokens`, in its order.
    expert_tokens: optional [E, m] int32: expert e's `group_sizes[e]` tokens first (their
      weights at the same places of `expert_weights`), any value after. The kernel then
      gathers each visited expert's own tokens instead of running it over all m (worth it
      above 128 tokens, where all m would take more than one 128-row MXU pass).
    out_dtype: result dtype (default x's).
    chunk: f columns per streamed step (default: `plan_fused`'s).
    stream: rows sorted by expert stay in HBM, any number of them: each visited expert's rows
      are copied in and its results out (`FusedPlan.stream`; one TensorCore). For receive
      buffers much larger than the rows they hold: nothing is read or written past
      `sum(group_sizes)`.
    unowned_rows: with `stream`, the result's rows past `sum(group_sizes)`: "zero" (one XLA
      select over the result) or "undefined" (never written: for callers that never read
      them, as `moe.expert_mlp`'s). The other layouts always write zeros there.
    plan: a `FusedPlan` from `plan_fused` (default: planned here for the current generation).
    interpret: see `common.run_kernel`: None compiles for TPU and interprets elsewhere; True or
      `pltpu.InterpretParams(...)` force interpret mode.

  Returns:
    [m, d] of `out_dtype`.
  """
  if weight_kind(wi) != weight_kind(wo):
    raise TypeError(
      f"wi and wo must be of the same kind, got {weight_kind(wi)} and {weight_kind(wo)}; "
      "quantize both the same way."
    )
  wi_v, wi_s = _split(wi, "wi")
  wo_v, wo_s = _split(wo, "wo")
  group_sizes = jnp.asarray(group_sizes)
  m, d, f = _check(x, wi_v, wo_v, group_sizes, row_weights, expert_weights, expert_tokens)
  kind = weight_kind(wi)
  by_token = expert_weights is not None
  gather = expert_tokens is not None
  if plan is None:
    plan = plan_fused(
      rows=m,
      d=d,
      f=f,
      num_experts=wi_v.shape[0],
      x_dtype=x.dtype,
      w_dtype=wi_v.dtype,
      out_dtype=out_dtype,
      kind=kind,
      block=getattr(wi, "block", quant.BLOCK),
      chunk=chunk,
      by_token=by_token,
      gather=gather,
      stream=stream,
    )
  if (plan.by_token, plan.gather, plan.stream) != (by_token, gather, stream):
    raise ValueError(
      f"plan has by_token={plan.by_token}, gather={plan.gather}, stream={plan.stream}, but the "
      f"call passes expert_weights: {by_token}, expert_tokens: {gather}, stream={stream}; plan "
      f"with plan_fused(by_token={by_token}, gather={gather}, stream={stream})."
    )
  if unowned_rows not in ("zero", "undefined"):
    raise ValueError(f"unowned_rows must be 'zero' or 'undefined', got {unowned_rows!r}.")
  if plan.kind == "block":
    # NOTE: the kernel copies a step's scales as leading rows (see `_copies`).
    wi_s = jnp.swapaxes(wi_s, 1, 2)
  operands, in_specs = _row_operands(plan, x, row_weights, expert_weights, expert_tokens)
  pad = plan.rows - m
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  if kind == "float":
    operands += [wi_v, wo_v]
    in_specs += [hbm, hbm]
  else:
    operands += [wi_v, wi_s, wo_v, wo_s]
    in_specs += [hbm] * 4
  out_struct, out_spec = _outputs(plan, x, wi_v, group_sizes)
  out = common.call_kernel(
    lambda *refs: _kernel(plan, by_token or row_weights is not None, *refs),
    name="pallas_moe_fused_experts",
    grid=(plan.cores,),
    prefetch=(group_sizes.astype(jnp.int32),),
    operands=operands,
    in_specs=in_specs,
    out_shape=out_struct,
    out_spec=out_spec,
    scratch_shapes=_scratch_shapes(plan),
    dimension_semantics=("parallel",),
    vmem_limit_bytes=plan.vmem_limit_bytes,
    flops=2 * plan.rows * 3 * d * f,
    bytes_accessed=int(plan.num_experts * plan.expert_weight_bytes + 2 * plan.rows * d * 2),
    interpret=interpret,
  )
  out = _result(plan, out, group_sizes, unowned_rows=unowned_rows)
  return out[:m] if pad else out


def _outputs(plan: FusedPlan, x, wi_v, group_sizes):
  """The call's output structs and specs: the result (each TensorCore's partial sum where a
  resident call is split), and for streamed rows on two cores the granule they can share."""
  d = plan.d
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  split = plan.cores > 1 and not plan.stream
  shape = (plan.cores, plan.rows, d) if split else (plan.rows, d)
  # NOTE: a split call's partial sums come out in the result's dtype, as a tensor-parallel
  # split of f hands its devices' sums to their reduction: half the bytes of f32 to write and
  # read again (the XLA op adds them in f32).
  dtype = plan.out_dtype
  struct = common.out_struct(shape, dtype, x, wi_v, group_sizes)
  if split:
    return struct, pl.BlockSpec((1, plan.rows, d), lambda c, *_: (c, 0, 0))
  if not plan.stream:
    return struct, pl.BlockSpec(shape, lambda c, *_: (0, 0))
  if plan.cores == 1:
    return struct, hbm
  # NOTE: the granule both cores' rows can share, and its first row (see `_stream_finish`).
  seam = common.out_struct((plan.align, d), dtype, x, wi_v, group_sizes)
  # NOTE: one uint32, as XLA's dynamic slices take it: no slice or convert of it after the call.
  first_row = common.out_struct((1,), jnp.uint32, x, wi_v, group_sizes)
  return [struct, seam, first_row], [hbm, hbm, hbm]


def _result(plan: FusedPlan, out, group_sizes, *, unowned_rows: str):
  """The call's outputs as one [rows, d] result: split calls' partial sums added in f32, the
  shared granule added in place, rows past the groups zeroed (streamed, `unowned_rows` "zero")."""
  if plan.cores > 1 and not plan.stream:
    # NOTE: the two TensorCores' partial sums (each over half of f), one XLA fusion.
    out = jnp.sum(out.astype(jnp.float32), axis=0).astype(plan.out_dtype)
  elif plan.cores > 1:
    out, values, first_row = out
    # NOTE: the cores' rows in the shared granule are disjoint (each wrote zeros for the
    # other's), so the sum is exact in any dtype.
    row = (first_row.reshape(()), jnp.uint32(0))
    shared = lax.dynamic_slice(out, row, values.shape)
    out = lax.dynamic_update_slice(out, shared + values, row)
  if plan.stream and unowned_rows == "zero":
    total = jnp.sum(group_sizes.astype(jnp.int32))
    out = jnp.where(jnp.arange(plan.rows)[:, None] < total, out, jnp.zeros((), out.dtype))
  return out


def _row_operands(plan: FusedPlan, x, row_weights, expert_weights, expert_tokens):
  """The rows and their routing weights (and token lists) as the kernel reads them, padded to
  `plan.rows`, with their specs: read whole into VMEM, or left in HBM (`plan.stream`).

  NOTE: whole inputs are one VMEM copy each (a blocked input would be double-buffered).
  """
  pad = plan.rows - x.shape[0]
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
  space = pl.ANY if plan.stream else pltpu.VMEM
  operands = [x]
  if expert_weights is not None:
    # NOTE: [E, 1, rows]: the kernel reads expert e's window of tokens as lanes.
    ew = expert_weights.astype(jnp.float32)
    operands.append((jnp.pad(ew, ((0, 0), (0, pad))) if pad else ew)[:, None, :])
    if expert_tokens is not None:
      # NOTE: padding entries name no token (-1 matches no row of the one-hot).
      et = expert_tokens.astype(jnp.int32)
      et = jnp.pad(et, ((0, 0), (0, pad)), constant_values=-1) if pad else et
      operands.append(et[:, None, :])
  elif row_weights is not None:
    rw = row_weights.astype(jnp.float32)
    operands.append(jnp.pad(rw, (0, pad))[:, None] if pad else rw[:, None])
  return operands, [pl.BlockSpec(memory_space=space)] * len(operands)


def _scratch_names(plan: FusedPlan) -> list[str]:
  """The `_Scratch` fields `_scratch_shapes` allocates, in its order."""
  names = ["acc", "gate_up", "down"]
  if plan.kind != "float":
    names += ["gate_up_scales", "down_scales"]
  names += ["sems", "first_row", "visits"]
  if plan.gather:
    names += ["gathered", "expert_acc", "bad_rows"]
  if plan.stream:
    names += ["visit_lo", "visit_hi", "x_rows", "row_weights", "staging", "carry", "row_sems"]
    if plan.cores > 1:
      names.append("seam_row")
  return names + ["gate_up_sums", "act"]


def _scratch_shapes(plan: FusedPlan) -> list[Any]:
  vmem = pltpu.VMEM
  wdt = jnp.dtype(plan.w_dtype)
  d, c = plan.d, plan.chunk
  held = plan.visit_rows + plan.align
  shapes = [
    vmem((held if plan.stream else plan.rows, d), jnp.float32),
    vmem((2, 2, plan.pieces, plan.piece, c), wdt),
    vmem((2, plan.pieces, c, plan.piece), wdt),
  ]
  if plan.kind == "channel":
    shapes += [vmem((2, 2, 1, c), jnp.float32), vmem((2, 1, d), jnp.float32)]
  elif plan.kind == "block":
    cb, nb = plan.chunk_blocks, d // plan.block
    shapes += [pltpu.SMEM((2, 2, cb, nb), jnp.float32), pltpu.SMEM((2, cb, nb), jnp.float32)]
  shapes += [
    pltpu.SemaphoreType.DMA((2, 2 * plan.pieces)),
    pltpu.SMEM((plan.num_experts + 1,), jnp.int32),
    pltpu.SMEM((plan.max_visits if plan.stream else plan.num_experts,), jnp.int32),
  ]
  if plan.gather:
    shapes += [
      vmem((plan.rows, d), jnp.dtype(plan.x_dtype)),
      vmem((plan.rows, d), jnp.float32),
      vmem((plan.rows, 1), jnp.float32),
    ]
  if plan.stream:
    visits = pltpu.SMEM((plan.max_visits,), jnp.int32)
    shapes += [
      visits,
      visits,
      vmem((2, held, d), jnp.dtype(plan.x_dtype)),
      vmem((2, held, 1), jnp.float32),
      vmem((held, d), jnp.dtype(plan.out_dtype)),
      vmem((plan.align, d), jnp.float32),
      pltpu.SemaphoreType.DMA((2, 2)),
    ]
    if plan.cores > 1:
      shapes.append(pltpu.SMEM((1,), jnp.uint32))
  rows = plan.step_rows
  return shapes + [vmem((2, rows, c), jnp.float32), vmem((rows, c), jnp.dtype(plan.x_dtype))]
