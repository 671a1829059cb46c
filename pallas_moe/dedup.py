"""Deduplicated expert-parallel dispatch: a token crosses the exchange once per destination device.

The plain block (`pallas_moe.moe`) sends one row per (token, choice): `T * k` rows each way. Here
a token with several of its k experts on one device sends that device ONE row; the receiver
expands it locally into one row per local expert for the gmm, and on the way back sums that
token's local expert outputs, weighted by their routing weights, into ONE row. The sender then
sums the rows coming home over destination devices. Same products and sums as the plain block,
in another order (so equal up to float rounding, not bitwise).

Data flow on one device (`ep` devices, `E_l` local experts, `n = T * min(k, ep)` send rows):

  send_layout  the (token, destination) pairs with at least one choice on the destination,
               laid out by destination then token (a compaction by cumsum, no sort); with each
               row go the routing weights and local expert ids of its choices on that device
               (f32 weights, -1 ids for choices elsewhere)
  plan         one all_gather of the per-destination row and expert-row counts (and, where the
               buffer can overflow, a second one of the accepted counts); the ragged offsets
  pack         rows | weight bits | id bits as one array of the compute dtype (`pack_rows`), so
               one `ragged_all_to_all` carries all of it; its VJP carries the rows' and weights'
               cotangents back bit-exactly through the same exchange's transpose
  expand       on the receiver: a stable argsort of the received rows' local ids gives the
               expert rows in local-expert order, and one HBM gather builds the gmm's lhs
  reduce       after the experts: each expert row times its weight (f32), scatter-added into its
               received row; cast to the compute dtype; the combine exchange returns it
  sum_home     on the sender: the delivered rows scatter-added into their tokens (f32)

Buffers (static): the gmm's expert-row buffer is the plain block's `buffer_rows` P (`moe.
buffer_rows_for`); the exchange's receive buffer holds `min(P, ep * T)` rows (every received row
brings at least one expert row, and a peer sends at most one row per token).

Drops (a capacity factor, or an exact buffer on a batch that needs more): a receiver accepts
rows in its receive layout (by sender, then the sender's token order) while their expert rows
fit in P; the first row that does not fit and every row after it are dropped, with all of that
token's choices on that device. A drop on the wire is one row actually sent (a token, device
pair: `RaggedPlan.num_dropped`, the block's `aux["dropped_exchange_rows"]`); the block's
`aux["dropped_rows"]` counts the (token, choice) assignments it did not compute, as the plain
exchange does: each dropped row's choices on its device (`dropped_pairs`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_moe import collectives

__all__ = [
  "SendLayout",
  "dropped_pairs",
  "expand",
  "expected_destinations",
  "extra_words",
  "wire_row_bytes",
  "pack_rows",
  "plan",
  "quantize_rows",
  "quantized_dispatch",
  "reduce_rows",
  "send_layout",
  "sum_home",
  "unpack_rows",
]


def expected_destinations(*, num_experts: int, top_k: int, expert_parallelism: int) -> float:
  """Expected distinct devices a token's k experts live on, under uniform routing.

  A token picks k distinct experts uniformly; device q holds E_l = E / ep of them, so it is hit
  with probability `1 - C(E - E_l, k) / C(E, k)`.

  Args:
    num_experts: E.
    top_k: k.
    expert_parallelism: ep (must divide E).

  Returns:
    `ep * (1 - C(E - E_l, k) / C(E, k))`, between `k / E_l` (at least) and `min(k, ep)`.
  """
  e, k, ep = num_experts, top_k, expert_parallelism
  e_l = e // ep
  miss = math.comb(e - e_l, k) / math.comb(e, k)
  return ep * (1.0 - miss)


# The modeled step's verdict (`python -m bench.ep --options dedup`, uniform routing, exact
# buffers, best chunk count): whether the deduplicated exchange beats the plain one. Fewer
# bytes is not enough: its expand/reduce passes run on the TensorCore, and where they cost about
# as much as the exchange time they save (v5p; v5e for DeepSeek-V2-Lite) the step is slower.
# (num_experts, top_k, d_model, ep, tokens per device) -> (v5e, v5p, v6e); None: not modeled.
MODELED_DEDUP: dict[tuple[int, int, int, int, int], tuple[bool | None, ...]] = {
  # deepseek-v2-lite: 1.05, 1.11, 0.97 x plain at 4096; 1.04, 1.13, 0.88 at 16384.
  (64, 6, 2048, 8, 4096): (False, False, True),
  (64, 6, 2048, 8, 16384): (False, False, True),
  # deepseek-v2-lite at EP 4: 1.10, 1.05, 1.09 at 4096; 1.14, 1.07, 1.10 at 16384.
  (64, 6, 2048, 4, 4096): (False, False, False),
  (64, 6, 2048, 4, 16384): (False, False, False),
  # qwen3-30b-a3b: 0.90, 1.04, 0.82 at 4096; 0.84, 1.02, 0.75 at 16384.
  (128, 8, 2048, 8, 4096): (True, False, True),
  (128, 8, 2048, 8, 16384): (True, False, True),
  # deepseek-v3: 0.94 on v6e at EP 32, 16384 tokens (2026-11-27).
  (256, 8, 7168, 32, 16384): (None, None, True),
}
_MODELED_CHIPS = ("v5e", "v5p", "v6e")


def modeled_choice(
  *, num_experts: int, top_k: int, d_model: int, ep: int, tokens: int, generation: str
) -> bool | None:
  """`MODELED_DEDUP`'s verdict for a layer, or None where the model has no verdict.

  Dims the table knows but a case (ep, tokens, generation) it has not modeled give False (the
  plain exchange: never slower than before); dims it does not know give None.

  Args:
    num_experts: E.
    top_k: k.
    d_model: d.
    ep: expert parallelism.
    tokens: tokens per device (of the whole batch, before any batch split).
    generation: TPU generation name.

  Returns:
    True / False, or None for unknown dims.
  """
  dims = (num_experts, top_k, d_model)
  if not any(key[:3] == dims for key in MODELED_DEDUP):
    return None
  row = MODELED_DEDUP.get((*dims, ep, tokens))
  if row is None or generation not in _MODELED_CHIPS:
    return False
  return bool(row[_MODELED_CHIPS.index(generation)])


# ---------------------------------------------------------------------------------------------
# Packing: rows, weights and ids in one array of the rows' dtype.
# ---------------------------------------------------------------------------------------------


def wire_row_bytes(width: int, itemsize: int) -> int:
  """Bytes a row of `width` values of `itemsize` bytes occupies in a TPU ragged-all-to-all.

  XLA:TPU packs a row into 32-bit words laid out in 128-lane tiles (AOT-compiled for v5e and
  v6e, libtpu 0.0.42.1: an s8 [n, 2082] operand became s8[n, 4, 640], bf16 [n, 2063]
  bf16[n, 2, 1152]), so rows round up to 128 words: 512 int8, 256 bf16 or 128 f32 values. The
  extra words `pack_rows` appends cost a whole tile when d is a multiple of it.

  Args:
    width: values per row.
    itemsize: bytes per value (1, 2 or 4).

  Returns:
    The padded row's bytes.
  """
  granule = 128 * max(1, 4 // itemsize)
  return -(-width // granule) * granule * itemsize


def _id_dtype(num_local: int):
  # NOTE: ids are -1 .. E_l - 1; int8 holds them for E_l <= 128 (every EP case we know).
  return jnp.int8 if num_local <= 128 else jnp.int32


def _to_words(a, dt):
  """[n, c] of a 4-byte or 1-byte dtype -> [n, w] of `dt` with the same bits."""
  n, c = a.shape
  src, dst = jnp.dtype(a.dtype).itemsize, jnp.dtype(dt).itemsize
  if src == dst:
    return jax.lax.bitcast_convert_type(a, dt)
  if src > dst:
    return jax.lax.bitcast_convert_type(a, dt).reshape(n, c * (src // dst))
  r = dst // src
  pad = -c % r
  a = jnp.pad(a, ((0, 0), (0, pad)))
  return jax.lax.bitcast_convert_type(a.reshape(n, (c + pad) // r, r), dt)


def _from_words(words, dtype, c: int):
  """Inverse of `_to_words`: `[n, w]` words -> `[n, c]` of `dtype`."""
  n = words.shape[0]
  src, dst = jnp.dtype(words.dtype).itemsize, jnp.dtype(dtype).itemsize
  if src == dst:
    return jax.lax.bitcast_convert_type(words, dtype)
  if dst > src:
    return jax.lax.bitcast_convert_type(words.reshape(n, c, dst // src), dtype)
  return jax.lax.bitcast_convert_type(words, dtype).reshape(n, -1)[:, :c]


def _word_counts(*, k: int, dt, id_dtype) -> tuple[int, int]:
  isz = jnp.dtype(dt).itemsize
  w = k * 4 // isz if isz <= 4 else None
  ib = jnp.dtype(id_dtype).itemsize
  ids = -(-k * ib // isz)
  return w, ids


def extra_words(*, k: int, dt, num_local: int) -> int:
  """Words of `dt` `pack_rows` appends to a row: k f32 weights and k ids.

  Args:
    k: top_k.
    dt: the rows' dtype.
    num_local: E_l (picks the ids' dtype).

  Returns:
    The count.
  """
  w, ids = _word_counts(k=k, dt=dt, id_dtype=_id_dtype(num_local))
  return w + ids


def _pack(x, w, ids):
  dt = x.dtype
  return jnp.concatenate([x, _to_words(w, dt), _to_words(ids, dt)], axis=1)


def _unpack(packed, *, d: int, k: int, id_dtype):
  nw, _ = _word_counts(k=k, dt=packed.dtype, id_dtype=id_dtype)
  x = packed[:, :d]
  w = _from_words(packed[:, d : d + nw], jnp.float32, k)
  ids = _from_words(packed[:, d + nw :], id_dtype, k)
  return x, w, ids


@jax.custom_vjp
def pack_rows(x, w, ids):
  """`[x | bits of w | bits of ids]`: one array of x's dtype, for one exchange.

  Differentiable in x and w: the cotangent comes back in the same layout (`unpack_rows`'s VJP
  packs the rows' and weights' cotangents), so the weights' gradients cross the exchange's
  transpose bit-exactly. The exchange only moves these words, never adds them.

  Args:
    x: [n, d] rows (2- or 4-byte float dtype).
    w: [n, k] f32 routing weights.
    ids: [n, k] int8/int32 local expert ids.

  Returns:
    [n, d + words] of x's dtype.
  """
  return _pack(x, w, ids)


def _pack_fwd(x, w, ids):
  # NOTE: the ids as residual: their shape and dtype give the layout (residuals must be arrays).
  return _pack(x, w, ids), ids


def _pack_bwd(ids, ct):
  k = ids.shape[1]
  nw, ni = _word_counts(k=k, dt=ct.dtype, id_dtype=ids.dtype)
  dx, dw, _ = _unpack(ct, d=ct.shape[1] - nw - ni, k=k, id_dtype=ids.dtype)
  return dx, dw, None


pack_rows.defvjp(_pack_fwd, _pack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def unpack_rows(packed, d: int, k: int, id_dtype):
  """Inverse of `pack_rows`: `(x [n, d], w [n, k] f32, ids [n, k])`.

  Args:
    packed: `pack_rows`'s layout (e.g. after the exchange).
    d: row width.
    k: weights/ids per row.
    id_dtype: the ids' dtype.

  Returns:
    The three arrays; the VJP packs `(dx, dw)` back into one cotangent array.
  """
  return _unpack(packed, d=d, k=k, id_dtype=id_dtype)


def _unpack_fwd(packed, d, k, id_dtype):
  return _unpack(packed, d=d, k=k, id_dtype=id_dtype), None


def _unpack_bwd(d, k, id_dtype, _, ct):
  dx, dw, _ = ct
  return (_pack(dx, dw, jnp.zeros(dw.shape, id_dtype)),)


unpack_rows.defvjp(_unpack_fwd, _unpack_bwd)


# ---------------------------------------------------------------------------------------------
# 8-bit dispatch.
# ---------------------------------------------------------------------------------------------

DISPATCH_QUANTIZATIONS = (None, "int8", "fp8")
# NOTE: DeepSeek-V3 dispatches fp8 (e4m3) with one f32 scale per 1 x 128 tile of a row.
FP8_BLOCK = 128
_FP8_MAX = 448.0


def scale_columns(*, d: int, kind: str) -> int:
  """f32 scales per row: 1 for int8 (absmax per row), ceil(d / 128) for fp8 (per block)."""
  return 1 if kind == "int8" else -(-d // FP8_BLOCK)


def quantize_rows(x, *, kind: str):
  """8-bit rows and their f32 scales (`x ~ dequantize_rows(...)`).

  Args:
    x: [n, d] float rows.
    kind: "int8" (symmetric, absmax per row, values in [-127, 127]) or "fp8" (e4m3, absmax
      per 128-column block scaled to 448).

  Returns:
    `(q [n, d] int8 or float8_e4m3fn, scales [n, scale_columns] f32)`; an all-zero row or
    block gets scale 1 (its values are 0).
  """
  n, d = x.shape
  x = x.astype(jnp.float32)
  if kind == "int8":
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    return q, scale
  if kind != "fp8":
    raise ValueError(f"kind must be 'int8' or 'fp8', got {kind!r}.")
  nb = scale_columns(d=d, kind=kind)
  xb = jnp.pad(x, ((0, 0), (0, nb * FP8_BLOCK - d))).reshape(n, nb, FP8_BLOCK)
  amax = jnp.max(jnp.abs(xb), axis=2)
  scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
  q = (xb / scale[:, :, None]).astype(jnp.float8_e4m3fn).reshape(n, nb * FP8_BLOCK)[:, :d]
  return q, scale


def dequantize_rows(q, scale, *, kind: str, dtype):
  """Inverse of `quantize_rows` (up to its rounding), in `dtype`."""
  n, d = q.shape
  v = q.astype(jnp.float32)
  if kind == "int8":
    return (v * scale).astype(dtype)
  nb = scale.shape[1]
  vb = jnp.pad(v, ((0, 0), (0, nb * FP8_BLOCK - d))).reshape(n, nb, FP8_BLOCK)
  return (vb * scale[:, :, None]).reshape(n, nb * FP8_BLOCK)[:, :d].astype(dtype)


def _pack8(rows, w, ids, *, kind: str):
  q, scale = quantize_rows(rows, kind=kind)
  q8 = jax.lax.bitcast_convert_type(q, jnp.int8) if kind == "fp8" else q
  return jnp.concatenate(
    [q8, _to_words(scale, jnp.int8), _to_words(w, jnp.int8), _to_words(ids, jnp.int8)], axis=1
  )


def _unpack8(packed, *, d: int, k: int, kind: str, id_dtype, dtype):
  ns = scale_columns(d=d, kind=kind)
  q8 = packed[:, :d]
  q = jax.lax.bitcast_convert_type(q8, jnp.float8_e4m3fn) if kind == "fp8" else q8
  scale = _from_words(packed[:, d : d + 4 * ns], jnp.float32, ns)
  w = _from_words(packed[:, d + 4 * ns : d + 4 * ns + 4 * k], jnp.float32, k)
  ids = _from_words(packed[:, d + 4 * ns + 4 * k :], id_dtype, k)
  return dequantize_rows(q, scale, kind=kind, dtype=dtype), w, ids


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def quantized_dispatch(rows, w, ids, plan, axis_name, kind: str, poison: bool):
  """The deduplicated dispatch with 8-bit rows; its transpose (the backward) stays bf16.

  Forward: each row is quantized (`quantize_rows`), and its scales, routing weights and ids
  travel as raw bytes in the same int8 row (one `ragged_all_to_all`, no second exchange for
  the scales: they are 4 B of 2 KiB+ per row); the receiver dequantizes to the rows' dtype.
  Backward: straight-through (quantization counts as identity): the received rows' and
  weights' cotangents are packed in the rows' dtype (`pack_rows`'s layout) and go back by the
  combine's offsets, the dispatch's transpose.

  Args:
    rows: [n, d] send rows (the plain path's `pack_rows` x).
    w: [n, k] f32 weights.
    ids: [n, k] local ids.
    plan: the `plan` of this dispatch.
    axis_name: the expert axis.
    kind: "int8" or "fp8".
    poison: received slack rows become NaN (debugging).

  Returns:
    `(x [U, d] in rows' dtype, w [U, k] f32, ids [U, k])` on the receiver, like
    `unpack_rows(dispatch(pack_rows(...)))`.
  """
  return _quantized_dispatch(rows, w, ids, plan, axis_name, kind, poison)


def _quantized_dispatch(rows, w, ids, plan, axis_name, kind, poison):
  packed = _pack8(rows, w, ids, kind=kind)
  # NOTE: int8 words cannot hold NaN: the slack is poisoned after dequantizing instead.
  buf = collectives.dispatch(packed, plan, axis_name=axis_name)
  x, wb, ib = _unpack8(
    buf, d=rows.shape[1], k=w.shape[1], kind=kind, id_dtype=ids.dtype, dtype=rows.dtype
  )
  if poison:
    live = jnp.arange(x.shape[0], dtype=jnp.int32) < plan.recv_group_sizes[0]
    x = jnp.where(live[:, None], x, jnp.nan)
  return x, wb, ib


def _qd_fwd(rows, w, ids, plan, axis_name, kind, poison):
  out = _quantized_dispatch(rows, w, ids, plan, axis_name, kind, poison)
  return out, (plan, ids, jnp.zeros((rows.shape[0], 0), rows.dtype))


def _qd_bwd(axis_name, kind, poison, res, ct):
  plan, ids, like = res
  dx, dw, _ = ct
  ct_packed = _pack(dx.astype(like.dtype), dw, jnp.zeros(dw.shape, ids.dtype))
  back = collectives.combine(ct_packed, plan, num_rows=like.shape[0], axis_name=axis_name)
  d_rows, d_w, _ = _unpack(back, d=dx.shape[1], k=dw.shape[1], id_dtype=ids.dtype)
  return d_rows, d_w, None, None


quantized_dispatch.defvjp(_qd_fwd, _qd_bwd)


# ---------------------------------------------------------------------------------------------
# Sender layout and plan.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SendLayout:
  """One device's deduplicated send rows (see the module docstring).

  Attributes:
    token: [n] int32 the token of each send row.
    dest: [n] int32 its destination device (rows are sorted by it).
    live: [n] bool: a real row (rows past `counts.sum()` are padding, never sent).
    counts: [ep] int32 rows per destination.
    pair_counts: [ep] int32 expert rows (token, choice) per destination.
    row_pairs: [n] int32 expert rows each send row brings (0 for padding).
    weights: [n, k] f32 routing weights of the row's choices on `dest` (0 elsewhere).
    local_ids: [n, k] local expert ids of those choices (-1 elsewhere).
  """

  token: jax.Array
  dest: jax.Array
  live: jax.Array
  counts: jax.Array
  pair_counts: jax.Array
  row_pairs: jax.Array
  weights: jax.Array
  local_ids: jax.Array


def send_layout(slot_ids, weights, *, num_local: int, ep: int) -> SendLayout:
  """The deduplicated send rows of one device's tokens.

  Args:
    slot_ids: [T, k] int weight slots of each token's choices (device = slot // E_l).
    weights: [T, k] f32 routing weights.
    num_local: E_l, slots per device.
    ep: devices.

  Returns:
    A `SendLayout` with `n = T * min(k, ep)` rows (a static bound: a token reaches at most that
    many devices).
  """
  t, k = slot_ids.shape
  dev = slot_ids.astype(jnp.int32) // num_local
  hit = dev[:, :, None] == jnp.arange(ep, dtype=jnp.int32)  # [T, k, ep]
  on = hit.any(axis=1)  # [T, ep]
  counts = on.sum(axis=0).astype(jnp.int32)
  pair_counts = hit.sum(axis=(0, 1)).astype(jnp.int32)
  n = t * min(k, ep)
  # NOTE: flat index q * T + t: compaction by cumsum keeps (destination, token) order.
  flat = on.T.reshape(-1)
  pos = jnp.cumsum(flat.astype(jnp.int32)) - 1
  src = (
    jnp.zeros((n,), jnp.int32)
    .at[jnp.where(flat, pos, n)]
    .set(jnp.arange(ep * t, dtype=jnp.int32), mode="drop")
  )
  dest, token = src // t, src % t
  live = jnp.arange(n, dtype=jnp.int32) < counts.sum()
  onj = (dev[token] == dest[:, None]) & live[:, None]  # [n, k]
  id_dtype = _id_dtype(num_local)
  local = slot_ids[token].astype(jnp.int32) - dest[:, None] * num_local
  return SendLayout(
    token=token,
    dest=dest,
    live=live,
    counts=counts,
    pair_counts=pair_counts,
    row_pairs=onj.sum(axis=1).astype(jnp.int32),
    weights=jnp.where(onj, weights[token].astype(jnp.float32), 0.0),
    local_ids=jnp.where(onj, local, -1).astype(id_dtype),
  )


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def plan(
  layout: SendLayout, *, axis_name, buffer_rows: int, pair_rows: int, may_drop: bool
) -> tuple[collectives.RaggedPlan, jax.Array]:
  """Offsets and sizes of the deduplicated dispatch and its combine (call inside shard_map).

  Args:
    layout: this device's `send_layout`.
    axis_name: the expert axis.
    buffer_rows: static receive-buffer rows (U).
    pair_rows: static expert-row capacity of a receiver (P): rows are accepted while their
      expert rows fit (see the module docstring).
    may_drop: False when P is the static worst case (skips the clipping and its all_gather).

  Returns:
    `(plan, delivered)`: a `RaggedPlan` (one slot per device; `num_dropped` counts send rows
    this device dropped as a receiver; `needed_rows` the largest expert-row count any device
    wanted: the exact P) and `delivered` [n] bool, the send rows their receiver accepted.
  """
  ep = int(jax.lax.axis_size(axis_name))
  names = frozenset((axis_name,))
  me = jax.lax.axis_index(axis_name)
  both = collectives._vary(jnp.stack([layout.counts, layout.pair_counts]), names)
  everyone = jax.lax.all_gather(both, axis_name)  # [src, 2, dst]
  cu, cp = everyone[:, 0], everyone[:, 1]
  if may_drop:
    # NOTE: receiver dst takes senders in order; sender src's expert rows start at the sum of
    # the earlier senders' wanted expert rows, so once one sender overflows, later ones get 0.
    cap = pair_rows - _exclusive_cumsum(cp, axis=0)[me]  # [dst]
    cum = jnp.cumsum(layout.row_pairs) - _exclusive_cumsum(layout.pair_counts)[layout.dest]
    delivered = layout.live & (cum <= cap[layout.dest])
    accepted = jax.ops.segment_sum(delivered.astype(jnp.int32), layout.dest, num_segments=ep)
    acc = jax.lax.all_gather(collectives._vary(accepted, names), axis_name)  # [src, dst]
  else:
    delivered, accepted, acc = layout.live, layout.counts, cu
  send_off = _exclusive_cumsum(cu, axis=1)  # [src, dst]: each sender's chunk starts
  recv_off = _exclusive_cumsum(acc, axis=0)  # [src, dst]: where src's rows sit at dst
  recv = acc[:, me]
  p = collectives.RaggedPlan(
    dispatch_args=(send_off[me], accepted, recv_off[me], recv),
    combine_args=(recv_off[:, me], recv, send_off[:, me], accepted),
    recv_group_sizes=recv.sum()[None],
    num_dropped=cu[:, me].sum() - recv.sum(),
    num_unsent=layout.counts.sum() - accepted.sum(),
    needed_rows=cp.sum(axis=0).max(),
    buffer_rows=buffer_rows,
  )
  return p, delivered


def dropped_pairs(layout: SendLayout, delivered) -> jax.Array:
  """(token, choice) assignments of this device's tokens that were not computed (int32 scalar).

  A send row its receiver refused takes all of that token's choices on that device with it:
  the count is the refused rows' `row_pairs`. Counted on the sender (the plain exchange's
  `num_dropped` on the receiver); summed over the expert axis both give the global count.

  Args:
    layout: this device's `send_layout`.
    delivered: [n] bool from `plan`.

  Returns:
    The number of this device's expert rows (token, choice) dropped by their receiver.
  """
  refused = layout.live & ~delivered
  return jnp.where(refused, layout.row_pairs, 0).sum().astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Receiver: expand, reduce; sender: sum home.
# ---------------------------------------------------------------------------------------------


def expand(x, w, ids, *, received, num_local: int, pair_rows: int):
  """The gmm's expert rows from the received rows (one HBM gather).

  Args:
    x: [U, d] received rows (rows past `received` are slack: 0, or NaN when poisoned).
    w: [U, k] f32 their weights.
    ids: [U, k] their local expert ids (-1: not for this device).
    received: scalar int, rows received.
    num_local: E_l.
    pair_rows: static expert rows P (capped at U * k).

  Returns:
    `(rows [P', d], group_sizes [E_l], src [P'], weight [P'], valid [P'])`, P' = min(P, U * k):
    expert rows sorted by local expert (then received row); rows past `group_sizes.sum()` are
    exactly 0 and not `valid`; `src` the received row each came from, `weight` its routing
    weight (0 where not valid).
  """
  u, k = ids.shape
  live = jnp.arange(u, dtype=jnp.int32) < received
  ids = jnp.where(live[:, None], ids.astype(jnp.int32), -1)
  key = jnp.where(ids >= 0, ids, num_local).reshape(-1)
  group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
  p = min(pair_rows, u * k)
  order = jnp.argsort(key, stable=True)[:p].astype(jnp.int32)
  valid = jnp.arange(p, dtype=jnp.int32) < group_sizes.sum()
  src = order // k
  # NOTE: an out-of-range index with mode="fill" gives 0 and takes no gradient: slack rows (NaN
  # under poison) never reach the gmm, and garbage cotangents of unowned gmm rows never reach x.
  rows = x.at[jnp.where(valid, src, u)].get(mode="fill", fill_value=0)
  weight = jnp.where(valid, w.reshape(-1)[order], 0.0)
  return rows, group_sizes, src, weight, valid


def reduce_rows(y, *, src, weight, valid, num_rows: int):
  """Each received row's weighted sum of its expert outputs (f32).

  Args:
    y: [P', d] expert outputs (rows past the groups are undefined).
    src, weight, valid: from `expand`; weight None: y is already weighted (`expert_mlp`'s
      `row_weights`), rows are summed as they are.
    num_rows: U.

  Returns:
    [U, d] f32: row i = sum of weight * y over the expert rows of received row i.
  """
  y = y.astype(jnp.float32)
  if weight is not None:
    y = y * weight[:, None]
  contrib = jnp.where(valid[:, None], y, 0.0)
  return jnp.zeros((num_rows, y.shape[1]), jnp.float32).at[src].add(contrib)


def sum_home(back, layout: SendLayout, delivered, *, tokens: int):
  """Adds the rows that came home into their tokens (f32).

  Args:
    back: [n, d] the combine's output in send layout (undelivered rows: 0 or NaN when poisoned).
    layout: the `send_layout`.
    delivered: [n] bool from `plan`.
    tokens: T.

  Returns:
    [T, d] f32: each token's routed output, summed over destination devices.
  """
  rows = jnp.where(delivered[:, None], back.astype(jnp.float32), 0.0)
  return jnp.zeros((tokens, back.shape[1]), jnp.float32).at[layout.token].add(rows)


def kept_pairs(slot_ids, *, num_local: int, ep: int, pair_rows: int, data: int = 1) -> np.ndarray:
  """Host numpy: [T_global, k] bool, the (token, choice) pairs the deduplicated block keeps.

  For tests and for reading drops: tokens are split over (data, ep) as `moe.moe_layer` splits
  them (data major), one chunk. A receiver accepts rows by sender, then token, while their
  expert rows fit in `pair_rows`.

  Args:
    slot_ids: [T_global, k] slot ids (host).
    num_local: E_l.
    ep: devices on the expert axis.
    pair_rows: P.
    data: data-axis size.

  Returns:
    The keep mask.
  """
  from pallas_moe.common import host_value

  ids = host_value(slot_ids)  # NOTE: also gathers ids sharded over several processes.
  t_dev = ids.shape[0] // (data * ep)
  keep = np.zeros(ids.shape, bool)
  for a in range(data):
    for dst in range(ep):
      used = 0
      full = False
      for src in range(ep):
        block = (a * ep + src) * t_dev
        for t in range(block, block + t_dev):
          on = ids[t] // num_local == dst
          if not on.any() or full:
            continue
          if used + on.sum() > pair_rows:
            full = True
            continue
          used += on.sum()
          keep[t] |= on
  return keep
