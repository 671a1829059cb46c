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
  down rows [chunk, d]. Each is double-buffered: the step waits for its gate/up block, starts
  the next step's gate/up copy, waits for its down block, starts the next step's down copy, and
  only then computes, so both of the next step's copies (the next expert's gate/up once a
  chunk is the expert's last) stream while this step multiplies. Only the first step's copy is
  exposed.
- Per step and expert: the expert's rows in windows of `window` rows (a window moved back to
  end at the buffer's end keeps only the rows it owns), `silu(x @ gate) * (x @ up)` in f32,
  times the rows' routing weights, masked to the expert's rows, then `@ down` accumulated into
  the rows' f32 sums. The result is written once, in the output dtype.

Weights: float (bf16 / f32), `quant.QuantizedWeights` (int8 / fp8 values, one scale per output
column: the scales multiply the products) or `quant.BlockQuantizedWeights` (one scale per 128 x
128 tile, DeepSeek-V3's fp8 layout: the gate/up products are summed over 128-row blocks of the
contraction, each times its scale, and the down product's 128-column blocks are scaled; the
scales of a step are copied to SMEM). Values are upcast to the rows' dtype in VMEM; HBM holds and
the DMA moves the narrow values.
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

__all__ = ["FusedPlan", "plan_fused", "fused_experts", "weight_kind"]

# NOTE: the share of VMEM the kernel plans for; the rest is Mosaic's (internal scratch, spills).
_VMEM_SHARE = 0.75
_MAX_WINDOW = 128


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
    window: rows per MXU pass (a multiple of `align`, at most `rows`).
    align: row granule of the rows' dtype (8 f32, 16 bf16 rows per VMEM tile).
    kind: "float", "channel" or "block" (`weight_kind`).
    block: the block scales' tile edge (kind "block").
    x_dtype: rows' (and the MXU operands') dtype name.
    w_dtype: weights' dtype name as stored.
    out_dtype: result dtype name.
    vmem_bytes: the kernel's VMEM estimate.
    vmem_limit_bytes: Mosaic's scoped limit passed with the call.
    tokens: None: the call's rows come sorted by expert and its result is per row. An int: the
      call gets a table of `tokens` token rows and each sorted row's token index; the kernel
      gathers the rows itself and returns per-token f32 sums (`fused_experts(row_tokens=)`).
  """

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
  tokens: int | None = None

  @property
  def chunks(self) -> int:
    return self.f // self.chunk

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


def _vmem_bytes(*, rows, d, chunk, x_item, w_item, out_item, kind, window, tokens) -> int:
  if tokens is None:
    resident = rows * d * (2 * x_item + 2 * out_item + 4)  # rows and result (2 buffers), sums
  else:
    # NOTE: the token table and the per-token f32 result (2 buffers each), the gathered rows
    # and their f32 sums.
    resident = tokens * d * (2 * x_item + 2 * 4) + rows * d * (x_item + 4)
  weights = 2 * 3 * d * chunk * w_item  # two slots of gate, up, down
  upcast = 3 * d * chunk * x_item if w_item != x_item else 0
  work = window * (4 * chunk * 4 + d * 4)  # gate, up, activation, the down product
  scales = 2 * 4 * (2 * chunk + d) * 8 if kind == "channel" else 0
  return resident + weights + upcast + work + scales + (1 << 20)


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
  tokens: int | None = None,
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
    tokens: the token table's rows where the kernel gathers its rows (see `FusedPlan.tokens`).

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
  if tokens is not None:
    out_dtype = jnp.float32
  out_item = jnp.dtype(out_dtype).itemsize
  align = 8 * max(1, 4 // x_item)
  padded = max(align, -(-rows // align) * align)
  window = min(padded, _MAX_WINDOW)
  if kind == "block" and (d % block or f % block):
    raise ValueError(f"block-scaled weights need d={d} and f={f} to be multiples of block={block}.")
  granule = block if kind == "block" else 128
  if chunk is not None:
    if f % chunk or (chunk != f and chunk % granule):
      raise ValueError(f"chunk={chunk} must divide f={f} and be a multiple of {granule} (or f).")
    candidates = [chunk]
  elif f % granule:
    candidates = [f]
  else:
    candidates = [c for c in range(f, 0, -granule) if f % c == 0]
  budget = int(gen.vmem_bytes * _VMEM_SHARE)
  kw = dict(
    rows=padded,
    d=d,
    x_item=x_item,
    w_item=w_item,
    out_item=out_item,
    kind=kind,
    window=window,
    tokens=tokens,
  )
  fits = [c for c in candidates if _vmem_bytes(chunk=c, **kw) <= budget]
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
    tokens=tokens,
  )


class _Weights(NamedTuple):
  """HBM refs: values and (quantized kinds) scales of wi and wo."""

  wi: Any
  wo: Any
  wi_scales: Any
  wo_scales: Any


class _Scratch(NamedTuple):
  acc: Any  # [rows, d] f32 sums
  gate_up: Any  # [2 slots, 2, d, chunk] weights
  down: Any  # [2 slots, chunk, d]
  gate_up_scales: Any  # channel: [2, 2, 1, chunk] f32; block: SMEM [2, 2 * cb * kb]
  down_scales: Any  # channel: [2, 1, d] f32; block: SMEM [2, cb * nb]
  sems: Any  # DMA semaphores [2 slots, 4]
  first_row: Any  # SMEM [E + 1]
  visits: Any  # SMEM [E]: the non-empty experts in order


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


def _copies(plan: FusedPlan, w: _Weights, scratch: _Scratch, *, expert, chunk, slot, part):
  """The step's DMAs of `part` ("gate_up" or "down"): a list of descriptors."""
  f, c = plan.f, plan.chunk
  col = pl.multiple_of(chunk * c, c)
  sems = scratch.sems.at[slot]

  def cp(src, dst, i):
    return pltpu.make_async_copy(src, dst, sems.at[i])

  if part == "down":
    return _down_copies(plan, w, scratch, expert=expert, chunk=chunk, slot=slot, cp=cp)
  gate_up = [
    cp(w.wi.at[expert, :, pl.ds(col, c)], scratch.gate_up.at[slot, 0], 0),
    cp(w.wi.at[expert, :, pl.ds(col + f, c)], scratch.gate_up.at[slot, 1], 0),
  ]
  if plan.kind == "channel":
    gate_up += [
      cp(w.wi_scales.at[expert, :, pl.ds(col, c)], scratch.gate_up_scales.at[slot, 0], 2),
      cp(w.wi_scales.at[expert, :, pl.ds(col + f, c)], scratch.gate_up_scales.at[slot, 1], 2),
    ]
  elif plan.kind == "block":
    # NOTE: block scales come transposed, [E, 2f / block, d / block] for wi (so a chunk's
    # column blocks are leading rows) and [E, f / block, d / block] for wo: one contiguous run
    # of rows per step, copied to SMEM where the kernel reads them as scalars.
    cb = plan.chunk_blocks
    blk = chunk * cb
    gate_up += [
      cp(w.wi_scales.at[expert, pl.ds(blk, cb)], scratch.gate_up_scales.at[slot, 0], 2),
      cp(
        w.wi_scales.at[expert, pl.ds(blk + plan.f // plan.block, cb)],
        scratch.gate_up_scales.at[slot, 1],
        2,
      ),
    ]
  return gate_up


def _down_copies(plan: FusedPlan, w: _Weights, scratch: _Scratch, *, expert, chunk, slot, cp):
  row = pl.multiple_of(chunk * plan.chunk, plan.chunk)
  down = [cp(w.wo.at[expert, pl.ds(row, plan.chunk), :], scratch.down.at[slot], 1)]
  if plan.kind == "channel":
    down.append(cp(w.wo_scales.at[expert], scratch.down_scales.at[slot], 3))
  elif plan.kind == "block":
    cb = plan.chunk_blocks
    rows = w.wo_scales.at[expert, pl.ds(chunk * cb, cb)]
    down.append(cp(rows, scratch.down_scales.at[slot], 3))
  return down


def _start(copies) -> None:
  for c in copies:
    c.start()


def _wait(copies) -> None:
  for c in copies:
    c.wait()


def _project_in(plan: FusedPlan, x_rows, scratch: _Scratch, *, slot, r0):
  """(gate, up) products [window, chunk] in f32 of the window's rows, scales applied."""
  cdt = jnp.dtype(plan.x_dtype)

  def dot(a, b):
    return jnp.dot(a, b.astype(cdt), preferred_element_type=jnp.float32)

  gate_w, up_w = scratch.gate_up.at[slot, 0], scratch.gate_up.at[slot, 1]
  if plan.kind != "block":
    x = x_rows[pl.ds(r0, plan.window), :]
    gate, up = dot(x, gate_w[...]), dot(x, up_w[...])
    if plan.kind == "channel":
      # NOTE: one scale per output column: dot(x, q) * s[None, :] == dot(x, q * s).
      gate = gate * scratch.gate_up_scales[slot, 0]
      up = up * scratch.gate_up_scales[slot, 1]
    return gate, up

  # NOTE: a block scale varies along the contraction: sum the 128-row blocks' products, each
  # times its (column block, row block) scale, read from SMEM as a scalar.
  b, cb = plan.block, plan.chunk_blocks
  scales = scratch.gate_up_scales

  def body(kb, carry):
    k0 = pl.multiple_of(kb * b, b)
    x = x_rows[pl.ds(r0, plan.window), pl.ds(k0, b)]
    out = []
    for which, (w, acc) in enumerate(zip((gate_w, up_w), carry, strict=True)):
      prod = dot(x, w[pl.ds(k0, b), :])
      parts = [prod[:, j * b : (j + 1) * b] * scales[slot, which, j, kb] for j in range(cb)]
      out.append(acc + (parts[0] if cb == 1 else jnp.concatenate(parts, axis=1)))
    return tuple(out)

  zero = jnp.zeros((plan.window, plan.chunk), jnp.float32)
  return lax.fori_loop(0, plan.d // b, body, (zero, zero))


def _project_out(plan: FusedPlan, act, scratch: _Scratch, *, slot):
  """The activation [window, chunk] times the step's down rows: [window, d] f32."""
  cdt = jnp.dtype(plan.x_dtype)
  down = scratch.down.at[slot]
  if plan.kind != "block":
    y = jnp.dot(act.astype(cdt), down[...].astype(cdt), preferred_element_type=jnp.float32)
    if plan.kind == "channel":
      y = y * scratch.down_scales[slot]
    return y
  # NOTE: the chunk's 128-row blocks of down are its contraction blocks, and each 128-column
  # block of the output has its own scale: scale each block product's columns.
  b, nb = plan.block, plan.d // plan.block
  y = jnp.zeros((plan.window, plan.d), jnp.float32)
  for j in range(plan.chunk_blocks):
    prod = jnp.dot(
      act[:, j * b : (j + 1) * b].astype(cdt),
      down[j * b : (j + 1) * b, :].astype(cdt),
      preferred_element_type=jnp.float32,
    )
    cols = [prod[:, n * b : (n + 1) * b] * scratch.down_scales[slot, j, n] for n in range(nb)]
    y = y + jnp.concatenate(cols, axis=1)
  return y


def _expert_step(plan: FusedPlan, refs, scratch: _Scratch, *, expert, slot) -> None:
  """One step's compute: every window of the expert's rows through gate/up, the activation and
  down into the f32 sums."""
  x_rows, row_weights = refs
  lo, hi = scratch.first_row[expert], scratch.first_row[expert + 1]
  start = (lo // plan.align) * plan.align
  windows = (hi - start + plan.window - 1) // plan.window

  def body(p, carry):
    nominal = start + p * plan.window
    # NOTE: a window that would cross the buffer's end moves back to end there; it keeps only
    # the rows from its nominal start, so no row is added twice.
    r0 = pl.multiple_of(jnp.minimum(nominal, plan.rows - plan.window), plan.align)
    gate, up = _project_in(plan, x_rows, scratch, slot=slot, r0=r0)
    act = jax.nn.silu(gate) * up
    row = r0 + lax.broadcasted_iota(jnp.int32, (plan.window, 1), 0)
    mine = (row >= jnp.maximum(lo, nominal)) & (row < hi)
    if row_weights is not None and plan.tokens is None:
      act = act * row_weights[pl.ds(r0, plan.window), :]
    act = jnp.where(mine, act, 0.0)
    y = _project_out(plan, act, scratch, slot=slot)
    scratch.acc[pl.ds(r0, plan.window), :] += y
    return carry

  lax.fori_loop(0, windows, body, 0)


def _kernel(plan: FusedPlan, has_weights: bool, *refs) -> None:
  refs = list(refs)
  group_sizes = refs.pop(0)
  x = refs.pop(0)
  row_tokens = refs.pop(0) if plan.tokens is not None else None
  row_weights = refs.pop(0) if has_weights else None
  if plan.kind != "float":
    wi, wi_s, wo, wo_s, out, *scr = refs
  else:
    (wi, wo, out, *scr), wi_s, wo_s = refs, None, None
    scr = scr[:3] + [None, None] + scr[3:]
  w = _Weights(wi=wi, wo=wo, wi_scales=wi_s, wo_scales=wo_s)
  x_rows = scr.pop() if plan.tokens is not None else x
  scratch = _Scratch(*scr)

  visited = _metadata(plan, group_sizes, scratch)
  steps = visited * plan.chunks
  scratch.acc[...] = jnp.zeros_like(scratch.acc)
  total = scratch.first_row[plan.num_experts]
  if plan.tokens is not None:
    _gather_rows(x, x_rows, row_tokens)

  def copies(s, part):
    expert = scratch.visits[s // plan.chunks]
    return _copies(plan, w, scratch, expert=expert, chunk=s % plan.chunks, slot=s % 2, part=part)

  @pl.when(steps > 0)
  def _():
    _start(copies(0, "gate_up"))
    _start(copies(0, "down"))

  def step(s, carry):
    _wait(copies(s, "gate_up"))

    # NOTE: start the next step's copies before computing this one, gate/up first: they
    # stream under this step's products, and the DMA queue never runs dry.
    @pl.when(s + 1 < steps)
    def _():
      _start(copies(s + 1, "gate_up"))

    _wait(copies(s, "down"))

    @pl.when(s + 1 < steps)
    def _():
      _start(copies(s + 1, "down"))

    expert = scratch.visits[s // plan.chunks]
    _expert_step(plan, (x_rows, row_weights), scratch, expert=expert, slot=s % 2)
    return carry

  lax.fori_loop(0, steps, step, 0)
  if plan.tokens is None:
    out[...] = scratch.acc[...].astype(out.dtype)
  else:
    _scatter_rows(scratch.acc, out, row_tokens, row_weights, total)


# NOTE: the token table is small where this mode runs (ep * T tokens). A row gather by dynamic
# row index would need row-aligned VMEM accesses Mosaic cannot prove; a one-hot product moves
# the rows on the MXU instead: one [R, n] x [n, d] product each way, exact (each output sums one
# nonzero term; f32 operands at HIGHEST precision).
def _exact(dtype) -> dict:
  if jnp.dtype(dtype) == jnp.float32:
    return dict(preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
  return dict(preferred_element_type=jnp.float32)


def _token_onehot(row_tokens, tokens: int):
  """[tokens, R] f32: 1 where row r's token is t (row_tokens is a [1, R] ref)."""
  rows = row_tokens.shape[1]
  ids = lax.broadcasted_iota(jnp.int32, (tokens, rows), 0)
  return (row_tokens[...] == ids).astype(jnp.float32)


def _gather_rows(table, rows, row_tokens) -> None:
  """rows[r] = table[row_tokens[r]] (zeros for a token outside the table)."""
  onehot = _token_onehot(row_tokens, table.shape[0]).astype(table.dtype)
  dims = (((0,), (0,)), ((), ()))
  gathered = lax.dot_general(onehot, table[...], dims, **_exact(table.dtype))
  rows[...] = gathered.astype(rows.dtype)


def _scatter_rows(acc, out, row_tokens, row_weights, total) -> None:
  """out[t] = sum over routed rows r < total of token t of row_weights[r] * acc[r], in f32."""
  onehot = _token_onehot(row_tokens, out.shape[0])
  lane = lax.broadcasted_iota(jnp.int32, onehot.shape, 1)
  onehot = jnp.where(lane < total, onehot, 0.0)
  if row_weights is not None:
    onehot = onehot * row_weights[...]
  out[...] = jnp.dot(onehot, acc[...], **_exact(jnp.float32)).astype(out.dtype)


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


def _check(x, wi, wo, group_sizes, row_weights, row_tokens) -> tuple[int, int, int]:
  common.check_float_array("x", x, ndim=2)
  m, d = x.shape
  if row_tokens is not None:
    row_tokens = common.check_int_array("row_tokens", row_tokens, ndim=1)
    m = row_tokens.shape[0]
  e, wd, f2 = wi.shape
  if wd != d or f2 % 2:
    raise ValueError(f"wi must be [E, d={d}, 2f] ([gate | up] columns), got {tuple(wi.shape)}.")
  f = f2 // 2
  if tuple(wo.shape) != (e, f, d):
    raise ValueError(f"wo must be [E={e}, f={f}, d={d}] to match wi, got {tuple(wo.shape)}.")
  common.check_group_sizes(group_sizes, m=m)
  if group_sizes.shape != (e,):
    raise ValueError(
      f"group_sizes must be [E={e}] (one per local expert), got {tuple(group_sizes.shape)}."
    )
  if row_weights is not None and tuple(row_weights.shape) != (m,):
    raise ValueError(f"row_weights must be [m={m}], got {tuple(row_weights.shape)}.")
  return m, d, f


def fused_experts(
  x: jax.Array,
  wi: Any,
  wo: Any,
  group_sizes: jax.Array,
  *,
  row_weights: jax.Array | None = None,
  row_tokens: jax.Array | None = None,
  out_dtype: Any = None,
  chunk: int | None = None,
  plan: FusedPlan | None = None,
  interpret: Any = None,
) -> jax.Array:
  """SwiGLU experts over rows sorted by expert, in one kernel: `silu(x @ gate) * (x @ up)`,
  times the rows' routing weights, `@ down`, per row's expert.

  With `row_tokens`, the kernel gathers the rows from a token table and sums each token's
  rows: x is [n, d] tokens, row r of the sorted rows is `x[row_tokens[r]]`, and the result is
  [n, d] f32 with `out[t] = sum_r row_weights[r] * expert_r(x[t])` over the routed rows r <
  sum(group_sizes) of token t (the serving path: no gather or scatter op around the call).

  Args:
    x: [m, d] rows sorted by local expert (`group_sizes[e]` rows of expert e, in order); rows
      past `sum(group_sizes)` come out as zeros. With `row_tokens`: [n, d] tokens.
    wi: [E, d, 2f] [gate | up] weights: a float array, `quant.QuantizedWeights` ([E, 1, 2f]
      scales) or `quant.BlockQuantizedWeights` ([E, d / 128, 2f / 128] scales).
    wo: [E, f, d] down weights, of wi's kind.
    group_sizes: [E] int32 rows per local expert.
    row_weights: optional [m] f32 routing weights, applied in VMEM (to the activation; with
      `row_tokens`, to each row's sum as it is added to its token).
    row_tokens: optional [m] int32 token of each sorted row (indices into x's rows).
    out_dtype: result dtype (default x's).
    chunk: f columns per streamed step (default: `plan_fused`'s).
    plan: a `FusedPlan` from `plan_fused` (default: planned here for the current generation).
    interpret: see `common.run_kernel`: None compiles for TPU and interprets elsewhere; True or
      `pltpu.InterpretParams(...)` force interpret mode.

  Returns:
    [m, d] of `out_dtype`; with `row_tokens`, [n, d] f32.
  """
  if weight_kind(wi) != weight_kind(wo):
    raise TypeError(
      f"wi and wo must be of the same kind, got {weight_kind(wi)} and {weight_kind(wo)}; "
      "quantize both the same way."
    )
  wi_v, wi_s = _split(wi, "wi")
  wo_v, wo_s = _split(wo, "wo")
  group_sizes = jnp.asarray(group_sizes)
  m, d, f = _check(x, wi_v, wo_v, group_sizes, row_weights, row_tokens)
  kind = weight_kind(wi)
  tokens = x.shape[0] if row_tokens is not None else None
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
      tokens=tokens,
    )
  if plan.tokens != tokens:
    raise ValueError(
      f"plan.tokens={plan.tokens} but the call has {tokens} token rows; plan with "
      f"plan_fused(tokens={tokens})."
    )
  if plan.kind == "block":
    # NOTE: the kernel copies a step's scales as leading rows (see `_copies`).
    wi_s = jnp.swapaxes(wi_s, 1, 2)
  full = lambda shape: pl.BlockSpec(shape, lambda i, *_: (0,) * len(shape))  # noqa: E731
  prefetch = [group_sizes.astype(jnp.int32)]
  pad = plan.rows - m
  if tokens is not None:
    # NOTE: row tokens and weights come as [1, R] lanes (a free reshape of [R]); padding rows
    # get token -1, which matches no token. The gathered rows live in VMEM scratch.
    operands, in_specs, out_rows = [x], [full(x.shape)], tokens
    tok = row_tokens.astype(jnp.int32)
    operands.append((jnp.pad(tok, (0, pad), constant_values=-1) if pad else tok)[None, :])
    in_specs.append(full((1, plan.rows)))
    if row_weights is not None:
      rw = row_weights.astype(jnp.float32)
      operands.append((jnp.pad(rw, (0, pad)) if pad else rw)[None, :])
      in_specs.append(full((1, plan.rows)))
  else:
    if pad:
      x = jnp.pad(x, ((0, pad), (0, 0)))
    operands, in_specs, out_rows = [x], [full((plan.rows, d))], plan.rows
    if row_weights is not None:
      rw = row_weights.astype(jnp.float32)
      operands.append(jnp.pad(rw, (0, pad))[:, None] if pad else rw[:, None])
      in_specs.append(full((plan.rows, 1)))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  if kind == "float":
    operands += [wi_v, wo_v]
    in_specs += [hbm, hbm]
  else:
    operands += [wi_v, wi_s, wo_v, wo_s]
    in_specs += [hbm] * 4
  scratch = _scratch_shapes(plan)
  out = common.call_kernel(
    lambda *refs: _kernel(plan, row_weights is not None, *refs),
    name="pallas_moe_fused_experts",
    grid=(1,),
    prefetch=tuple(prefetch),
    operands=operands,
    in_specs=in_specs,
    out_shape=common.out_struct((out_rows, d), plan.out_dtype, x, wi_v, group_sizes),
    out_spec=full((out_rows, d)),
    scratch_shapes=scratch,
    dimension_semantics=("arbitrary",),
    vmem_limit_bytes=plan.vmem_limit_bytes,
    flops=2 * plan.rows * 3 * d * f,
    bytes_accessed=int(plan.num_experts * plan.expert_weight_bytes + 2 * plan.rows * d * 2),
    interpret=interpret,
  )
  return out[:m] if pad and tokens is None else out


def _scratch_shapes(plan: FusedPlan) -> list[Any]:
  vmem = pltpu.VMEM
  wdt = jnp.dtype(plan.w_dtype)
  d, c = plan.d, plan.chunk
  shapes = [
    vmem((plan.rows, d), jnp.float32),
    vmem((2, 2, d, c), wdt),
    vmem((2, c, d), wdt),
  ]
  if plan.kind == "channel":
    shapes += [vmem((2, 2, 1, c), jnp.float32), vmem((2, 1, d), jnp.float32)]
  elif plan.kind == "block":
    cb, nb = plan.chunk_blocks, d // plan.block
    shapes += [pltpu.SMEM((2, 2, cb, nb), jnp.float32), pltpu.SMEM((2, cb, nb), jnp.float32)]
  shapes += [
    pltpu.SemaphoreType.DMA((2, 4)),
    pltpu.SMEM((plan.num_experts + 1,), jnp.int32),
    pltpu.SMEM((plan.num_experts,), jnp.int32),
  ]
  if plan.tokens is not None:
    shapes.append(vmem((plan.rows, d), jnp.dtype(plan.x_dtype)))
  return shapes
