"""MaxText's megablox call, verbatim: switch MaxText's MoE layer to pallas_moe by changing imports.

MaxText does not call upstream megablox; `maxtext/layers/moe.py` calls its own fork,
`maxtext.kernels.megablox.ops.gmm` (imported as `mblx`), and `jax.lax.ragged_all_to_all`, which
has no CPU implementation. This module offers both under the names MaxText uses:

  from pallas_moe import maxtext as mblx      # was: from maxtext.kernels import megablox as mblx
  mblx.ragged_all_to_all(...)                 # was: jax.lax.ragged_all_to_all(...)

or, without editing MaxText's source, `swap_into(maxtext.layers.moe)` does both at run time.

`gmm` takes MaxText's arguments: the positional order and keyword names of `ops.gmm` in MaxText
0.2.5 (PyPI, `MAXTEXT_VERSION`), the keywords of commit e591f30 (`MAXTEXT_COMMIT`, 2026-08-22:
the same without `use_gmm_v2_heuristic_tiling`, `partial_sum` at position 20, refused there with
a TypeError saying to pass it by keyword) and of earlier versions. Any other keyword raises a
TypeError naming it and these versions: a newer MaxText's new argument must fail loudly.

- `tiling`: MaxText's 9 ints (fwd tm, tk, tn, dlhs tm, tk, tn, drhs tm, tk, tn, from its 18
  `wi_tile_*` / `wo_tile_*` keys, or their `eval_*` twins) are checked and then NOT used by
  default: pallas_moe picks the kernel and tiles for the chip and the call, per pass (fwd, dlhs,
  drhs), as `pallas_moe.gmm(..., tiling=None)` does. MaxText's tiles were chosen for megablox's
  kernel (base.yml's 512, 1024, 1024, or a recipe's tuned values): at tk < k they force
  pallas_moe's visit-schedule kernels, which model at 1.3-3.0x the time of its own choice on
  MaxText's deepseek2-16b layer (`bench.maxtext_layer`).
  Tiles that differ from base.yml's defaults do not count as asking for them either: MaxText's
  own recipes set such values for megablox, so a value tells nothing of what the user wants from
  this backend, and the same config should give the same kernels whatever its numbers.
  To honour them, ask: `swap_into(moe, honour_tiling=True)`, or import `with_maxtext_tiles`
  (`from pallas_moe.maxtext import with_maxtext_tiles as mblx`), or pass `honour_tiling=True`.
  Honoured, the triples map one to one onto `pallas_moe.Tiling`'s per-pass coordinates (MaxText
  hands tiling[3:6] to a gmm with the transposed weights, tiles over m, n, k, and tiling[6:9] to
  tgmm, tiles over m, k, n): Tiling(fwd=t[0:3], dlhs=t[3:6], drhs=t[6:9]); tiles larger than a
  dimension are clamped to it. pallas_moe's own tilings (a `Tiling`, one (tm, tk, tn), a
  callable) are always honoured: only a caller who chose them passes them. Each call logs what
  it runs at INFO on the "pallas_moe.maxtext" logger (`pallas_moe.record_plans` collects the
  same plans).
- `lhs_quantize_dtype` / `rhs_quantize_dtype` (jnp.int8, jnp.int4 or jnp.float8_e4m3fn, dtypes
  or names; MaxText's quantization='int8' / int4 AQT configs / 'fp8' with
  use_qwix_quantization=false): MaxText's rule, a qwix.QtRule with "absmax" calibration, as
  `qwix.pallas.quantize` computes it (`quantize_absmax`): activations with one scale per row,
  weights with one scale per output channel shared by all experts (absmax over the groups and
  k); scale = absmax / bound in the operand's dtype, bound = qmax + 0.5 for integers and
  finfo.max (448) for fp8; integer values round(x / scale) saturated, fp8 values x / scale
  clipped and cast. The weights run through pallas_moe's quantized kernel (`QuantizedWeights`:
  int8 or float8_e4m3fn values, f32 scales; int4 values held in int8: same products, twice the
  bytes of packed int4). fp8 activations with fp8 weights run pallas_moe's fp8 x fp8 path
  (`activation_quantization='fp8'`, whose per-row rule is qwix's: the activations are handed
  over so that it reproduces qwix's values and scales exactly, also for bf16); integer
  activations (pallas_moe's own int8 path calibrates with absmax / 127, not qwix's 127.5) and
  fp8 activations with integer or float weights are quantized and dequantized in the wrapper.
  Gradients follow MaxText's `_gmm_bwd`: the lhs gradient is (dout * weight scales) @ weight
  values^T = dout @ dequantized(rhs)^T (pallas_moe's quantized kernel, transposed), the weight
  gradient is lhs values^T @ (dout * lhs scales) = dequantized(lhs)^T @ dout (pallas_moe's tgmm,
  on the fp8 values with per-token scales for fp8 x fp8), both straight through to the float
  inputs.
  float8_e4m3fnuz (quantization='nanoo_fp8', AMD GPUs) is refused: TPUs have no e4m3fnuz and
  its values are not e4m3fn values (exponent bias 8), so pallas_moe's fp8 kernels cannot hold
  them losslessly.
- `use_qwix_quantization=True`: as MaxText, the rule is `qwix_rule`, else qwix's current rule for
  "gmm" (`qwix.pallas.get_current_rule`, set by qwix's interception; only MaxText's
  quantization="fp8_full" sets one), and the quantize dtypes are not used. Without a rule (e.g.
  quantization 'fp8' or 'int8' under qwix, or qwix not installed) the gmm runs unquantized, as in
  MaxText; a rule is refused with a ValueError saying what to use.
- `weight_gather_axes` [(axis_name, dim), ...]: the float weights are all-gathered (tiled) over
  each mesh axis along `dim` before the kernel (and before quantization), inside `shard_map`;
  the weight gradient is reduce-scattered back by JAX's transpose of all_gather. (MaxText 0.2.5
  passes them only with a qwix "fixed" calibration rule, which is refused.)
- `partial_sum` [m, n]: added to the output (MaxText's tokamax gmm v2 accumulates into it); its
  gradient is the output's.
- `lhs_vma_axes`: the output is marked varying over these mesh axes (MaxText's `pcast`; pallas_moe
  outputs already vary over their operands' axes). `rhs_vma_axes`: the weight gradient's axes,
  which JAX's varying-axes typing already gives it; accepted, nothing to do.
- Accepted and ignored (no meaning here): `use_tokamax_backend`, `use_gmm_v2` (backend choice:
  pallas_moe is the backend), `use_gmm_v2_heuristic_tiling` (tokamax gmm v2 picks its own tiles
  instead of `tiling`; pallas_moe picks tiles with `tiling=None`), `input_buffer_count`,
  `combine_scopes` (keywords of MaxText's 2026-02..04 versions: megablox pipeline depth, tokamax
  named scopes), `use_manual_quantization` without quantization, `qwix_rule` with
  `use_qwix_quantization=False` (MaxText ignores it too).
- Refused with a ValueError saying what to use: a qwix rule (above), quantize dtypes other than
  int8 / int4 / float8_e4m3fn, `use_manual_quantization=True` with quantization (MaxText's
  batch-split scheme), and pre-quantized qwix QArray operands (moe_quantize_token_all_gather).
- Rows outside the local groups, without `existing_out`, follow megablox's rule
  (`_unowned_rows`): when `rhs` holds fewer groups than `group_sizes` lists (ring of experts:
  every expert's rows, this shard's experts' weights) they are exact zeros in the output and in
  the lhs gradient, since MaxText reads them (weighted by the tokens' routing weights and summed
  over the shards; their gradient flows into the input's); pallas_moe writes exactly their
  bytes, where megablox selects over the whole output. When `rhs` holds every group (ragged
  all-to-all EP, no EP, a truncated ring buffer) the only unowned rows are past
  sum(group_sizes) (receive-buffer slack, MaxText's padding to a tile multiple): left undefined
  in the output and the lhs gradient (`pallas_moe.gmm(..., unowned_rows="undefined")`), as
  megablox leaves them: MaxText never reads them, and zeros there would cost a fill per call.
  With `existing_out` they keep its values.
- `interpret`: MaxText passes True wherever its mesh is not a TPU's (CPU tests, GPU boxes) and
  False on TPU. True is read as that: the backend of the lowering platform (Pallas interpret
  mode on CPU, XLA's ragged_dot on a GPU: `pallas_moe.gmm(..., implementation=None)`), so a
  GPU user runs no interpret-mode kernel. None means the same; False compiled Mosaic; a
  `pltpu.InterpretParams` interpret mode with its checks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp

import pallas_moe as pm
from pallas_moe import ragged_all_to_all

__all__ = [
  "MAXTEXT_COMMIT",
  "MAXTEXT_VERSION",
  "gmm",
  "maxtext_tiling",
  "quantize_absmax",
  "ragged_all_to_all",
  "swap_into",
  "with_maxtext_tiles",
]

_LOG = logging.getLogger("pallas_moe.maxtext")

# The MaxText release (PyPI `maxtext`) whose `kernels/megablox/ops.py` and `layers/moe.py` this
# module follows, and the development commit it also follows (whose gmm lacks
# `use_gmm_v2_heuristic_tiling` and puts `partial_sum` at position 20).
MAXTEXT_VERSION = "0.2.5"
MAXTEXT_COMMIT = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"
_SUPPORTED = f"MaxText {MAXTEXT_VERSION} (PyPI) and MaxText commit {MAXTEXT_COMMIT[:7]}"

# qwix's symmetric integer bounds (`numerics.get_symmetric_bound`: qmax + 0.5) and value ranges.
_INT_QUANT = {"int8": (127.5, -128, 127), "int4": (7.5, -8, 7)}
# fp8: qwix's bound is finfo(dtype).max (448 for e4m3fn), values are x / scale clipped to the
# finite range and cast (round to nearest even).
_FP8 = "float8_e4m3fn"
_FP8_FNUZ = "float8_e4m3fnuz"


def _quant_name(dtype: Any, *, argument: str) -> str | None:
  """The name ("int8", "int4", "float8_e4m3fn") of MaxText's quantize dtype, or None.

  Args:
    dtype: None, a jnp dtype or its name.
    argument: the argument's name, for the error.
  """
  if dtype is None:
    return None
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name == _FP8_FNUZ:
    raise ValueError(
      f"`{argument}`=float8_e4m3fnuz (MaxText's quantization='nanoo_fp8', for AMD GPUs) is not "
      "supported: TPUs have no e4m3fnuz arithmetic and pallas_moe's kernels hold fp8 values as "
      "float8_e4m3fn, whose grid does not contain e4m3fnuz's (exponent bias 8: its smallest "
      "numbers, e.g. 2**-10, are not e4m3fn numbers), so the values cannot be re-encoded "
      "losslessly. Use quantization='fp8' (float8_e4m3fn)."
    )
  if name not in _INT_QUANT and name != _FP8:
    raise ValueError(
      f"`{argument}`={dtype!r} is not supported: MaxText's megablox quantizes to jnp.int8, "
      "jnp.int4 or jnp.float8_e4m3fn (quantization='int8', 'int4' or 'fp8')."
    )
  return name


def quantize_absmax(x: jax.Array, *, dtype: Any, channel_axes: tuple[int, ...]):
  """qwix's symmetric absmax quantization (MaxText's rule for its quantize dtypes).

  As `qwix.pallas.quantize(x, dtype, channelwise_axes=..., calibration_method="absmax")`: the
  scale is absmax / bound in x's dtype, bound = qmax + 0.5 for integers (127.5, 7.5) and
  finfo(dtype).max for fp8 (448); a scale below sqrt(finfo(x.dtype).tiny) is 1; values are
  round(x / scale) saturated (integers) or x / scale clipped to the finite range and cast (fp8).

  Args:
    x: float array.
    dtype: jnp.int8, jnp.int4 or jnp.float8_e4m3fn (or their names).
    channel_axes: axes with their own scale; the absmax is taken over the others.

  Returns:
    (values, scales): `values` int8 (int4 values lie in [-8, 7]) or float8_e4m3fn, and `scales`
    in x's dtype with size 1 on the reduced axes, so that `values * scales` approximates x.
  """
  name = _quant_name(dtype, argument="dtype")
  reduce_axes = tuple(a for a in range(x.ndim) if a not in channel_axes)
  absmax = jnp.max(jnp.abs(x), axis=reduce_axes, keepdims=True)
  bound = float(jnp.finfo(name).max) if name == _FP8 else _INT_QUANT[name][0]
  # NOTE: as qwix: the scale is computed and kept in x's dtype; a (near-)zero channel gets 1.
  scales = absmax / jnp.asarray(bound, x.dtype)
  tiny_sqrt = jnp.sqrt(jnp.finfo(scales.dtype).tiny)
  scales = jnp.where(scales < tiny_sqrt, jnp.ones_like(scales), scales)
  scaled = x / scales
  if name == _FP8:
    finfo = jnp.finfo(name)
    lo, hi = jnp.asarray(finfo.min, x.dtype), jnp.asarray(finfo.max, x.dtype)
    return jnp.clip(scaled, lo, hi).astype(name), scales
  _, lo, hi = _INT_QUANT[name]
  return jnp.clip(jnp.round(scaled), lo, hi).astype(jnp.int8), scales


def _dequantize(values: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
  return (values.astype(scales.dtype) * scales).astype(dtype)


def _fake_quantize_rows(lhs: jax.Array, name: str) -> jax.Array:
  """lhs quantized per row and dequantized, straight-through (d/dlhs taken as the identity)."""
  values, scales = quantize_absmax(lhs, dtype=name, channel_axes=(0,))
  deq = _dequantize(values, scales, lhs.dtype)
  return lhs + jax.lax.stop_gradient(deq - lhs)


def maxtext_tiling(tiling: Any) -> pm.Tiling | Any:
  """MaxText's 9-int tiling as a `pallas_moe.Tiling`; other tilings are returned unchanged.

  Args:
    tiling: 9 ints (fwd tm, tk, tn, dlhs tm, tk, tn, drhs tm, tk, tn), or anything
      `pallas_moe.gmm` takes (None, a `Tiling`, one (tm, tk, tn), a callable).

  Returns:
    `Tiling(fwd=t[0:3], dlhs=t[3:6], drhs=t[6:9])` for 9 ints, else `tiling`.
  """
  if isinstance(tiling, list):
    tiling = tuple(tiling)
  if not isinstance(tiling, tuple) or len(tiling) == 3:
    return tiling
  if len(tiling) != 9:
    raise ValueError(
      f"`tiling` has {len(tiling)} entries: MaxText's gmm takes 9 ints (fwd tm, tk, tn, dlhs tm, "
      "tk, tn, drhs tm, tk, tn, e.g. from the wi_tile_* / wo_tile_* config keys); pallas_moe also "
      "takes one (tm, tk, tn), a pallas_moe.Tiling or None."
    )
  for t in tiling:
    if isinstance(t, bool) or not isinstance(t, int):
      raise TypeError(f"`tiling` entries must be ints, got {t!r} in {tiling!r}.")
  return pm.Tiling(fwd=tiling[0:3], dlhs=tiling[3:6], drhs=tiling[6:9])


def _check_gather_axes(weight_gather_axes: Any) -> tuple[tuple[str, int], ...]:
  if weight_gather_axes is None:
    return ()
  pairs = []
  for pair in weight_gather_axes:
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2
    if ok:
      name, dim = pair
      ok = isinstance(name, str) and isinstance(dim, int) and not isinstance(dim, bool)
      ok = ok and dim in (0, 1, 2)
    if not ok:
      raise ValueError(
        f"`weight_gather_axes` entry {pair!r} must be (mesh axis name, weight dim 0, 1 or 2), "
        "e.g. [('fsdp', 2)]: the weights are all-gathered over that axis along that dim."
      )
    pairs.append((name, dim))
  return tuple(pairs)


def _check_axis_names(value: Any, *, argument: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str) or not all(isinstance(a, str) for a in value):
    raise ValueError(f"`{argument}`={value!r} must be a tuple of mesh axis names.")
  return tuple(value)


def _varying(x: Any) -> frozenset:
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset() if mat is None else mat.varying


def _vary_over(x: Any, axes) -> Any:
  """x marked varying over `axes` too (a no-op outside shard_map or when it already is)."""
  if x is None:
    return None
  missing = tuple(sorted(frozenset(axes) - _varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _vary_together(*operands):
  """Every operand varying over the union of their axes, outside the custom VJP.

  NOTE: as `pallas_moe.gmm` does: a replicated weight's gradient is then psum'd by JAX's
  transpose of the implicit broadcast, not left to the custom VJP (whose cotangent types must
  match the primals').
  """
  axes = frozenset().union(*(_varying(x) for x in operands if x is not None))
  return tuple(_vary_over(x, axes) for x in operands)


@dataclasses.dataclass(frozen=True)
class _QuantStatic:
  """The static part of a weight-quantized call (hashable: a custom_vjp nondiff argument)."""

  weight_dtype: str
  activation_dtype: str | None
  preferred_element_type: Any
  tiling: pm.Tiling
  transpose_rhs: bool
  interpret: Any


def _quantize_weights(static: _QuantStatic, rhs: jax.Array) -> pm.QuantizedWeights:
  """MaxText's weight rule: one scale per output channel, shared by all groups."""
  channel = 1 if static.transpose_rhs else 2
  values, scales = quantize_absmax(rhs, dtype=static.weight_dtype, channel_axes=(channel,))
  scales = jnp.broadcast_to(scales.astype(jnp.float32), _scale_shape(rhs.shape, channel))
  return pm.QuantizedWeights(values=values, scales=scales)


def _scale_shape(shape, channel: int) -> tuple[int, ...]:
  return tuple(d if a in (0, channel) else 1 for a, d in enumerate(shape))


def _frozen_gmm(static: _QuantStatic, lhs, q, group_sizes, group_offset, existing_out, **kw):
  return pm.gmm(
    lhs,
    q,
    group_sizes,
    static.preferred_element_type,
    static.tiling,
    group_offset,
    existing_out,
    static.transpose_rhs,
    static.interpret,
    unowned_rows=_unowned_rows(q.values.shape[0], group_sizes, existing_out),
    **kw,
  )


def _unowned_rows(num_local_groups: int, group_sizes: Any, existing_out: Any) -> str:
  """gmm's `unowned_rows` for MaxText's calls: exact zeros where MaxText reads them, as megablox.

  MaxText's megablox (`kernels/megablox/backend.py`, `gmm`) zeroes every row outside the local
  groups (`_zero_uninitialized_memory`: a select over the whole [m, n] output) exactly when `rhs`
  holds fewer groups than `group_sizes` lists and there is no `existing_out`; its lhs gradient is
  the same gmm, so the same rule holds there. Otherwise it never writes the rows past
  sum(group_sizes) (garbage on a TPU). MaxText 0.2.5's layer reads unowned rows only in the
  first case, so pallas_moe follows the same rule:

  - Ring of experts (`use_ring_of_experts`, with or without tensor parallelism or embedding
    chunks): `group_sizes` lists all E experts of the tokens all-gathered over the expert axis
    (rolled so that the shard's experts come first, `group_offset` 0; with `use_ragged_sort`
    in global order, `group_offset` the shard's first expert), `rhs` the E / ep local ones. The
    other shards' experts' rows are read. Forward: `unpermute` multiplies them by the tokens'
    (nonzero) routing weights and adds them into each token's output, which `psum_scatter` sums
    over the shards (`ring_ragged_unsort` masks them with `where`). Backward: their lhs gradient
    flows through the sort and the all-gather's transpose into the input gradient;
    `ring_ragged_unsort`'s backward multiplies them by masked zeros for the router gradient, and
    with `mlp_bias` the bias gradients sum over them (0 x NaN = NaN). So "zero": exact zeros in
    the output and the lhs gradient. Cost: a DMA-only fill of exactly those rows' bytes per
    output and per lhs gradient (megablox pays a select over all [m, n] there).
  - Ragged all-to-all EP (`ra2a_and_route`), no EP, and ring of experts with a truncated
    ragged buffer (`local_group_sizes`, `group_offset` 0): `rhs` holds every group of
    `group_sizes`, so the unowned rows are those past sum(group_sizes): a receive buffer's slack
    (sorted back to its end by `local_permute` / `unsort_output_and_ra2a`), with a batch
    replicated over the expert axis (batch-1 inference) the tokens of other shards' experts, and
    the padding to a multiple of `wi_tile_fwd_batch_seq`. MaxText never reads them: the padding
    is sliced off, the return `ragged_all_to_all` sends only the received chunks,
    `ring_ragged_unsort` and the `mlp_bias` mask drop them (`where`, a dropped scatter); so
    their cotangent is 0, and their lhs gradient lands where the transposes drop it (the
    padding's slice, the dispatch's transpose, which reads only the received chunks,
    `ring_ragged_sort`'s masked backward). So "undefined": no zero writes, as megablox.

  With `existing_out` the rows keep its values ("zero" then only zero-fills their lhs gradient).

  Args:
    num_local_groups: groups held by `rhs` (after any weight all-gather).
    group_sizes: MaxText's [G_total] group sizes.
    existing_out: gmm's `existing_out`, or None.
  """
  if existing_out is not None or num_local_groups < jnp.size(group_sizes):
    return "zero"
  return "undefined"


def _native_fp8(static: _QuantStatic) -> bool:
  """fp8 activations with fp8 weights: pallas_moe's fp8 x fp8 kernel path."""
  return static.activation_dtype == _FP8 and static.weight_dtype == _FP8


def _quantized_forward(static, lhs, q, group_sizes, group_offset, existing_out):
  """The forward on MaxText's quantized operands; also the lhs the weight gradient reads.

  Returns:
    (out, lhs_for_drhs) where lhs_for_drhs is lhs, its dequantized copy (integer activations)
    or (fp8 values, f32 scales) of the activations (fp8).
  """
  if static.activation_dtype is None:
    out = _frozen_gmm(static, lhs, q, group_sizes, group_offset, existing_out)
    return out, lhs
  values, scales = quantize_absmax(lhs, dtype=static.activation_dtype, channel_axes=(0,))
  if not _native_fp8(static):
    # NOTE: integer activations (and fp8 ones with integer weights) are dequantized in the
    # wrapper: pallas_moe's int8 activation path calibrates with absmax / 127, not qwix's 127.5.
    deq = _dequantize(values, scales, lhs.dtype)
    return _frozen_gmm(static, deq, q, group_sizes, group_offset, existing_out), deq
  # NOTE: pallas_moe's fp8 activation path quantizes each row as qwix does (absmax / 448, x /
  # scale clipped and cast), in f32. An f32 lhs is handed over as is (the same computation). A
  # bf16 / f16 lhs is handed over as its qwix quantization dequantized in f32, which is exact
  # (an fp8 value times a scale of <= 11 significant bits) and re-quantizes to exactly qwix's
  # values and scales (the row's absmax is 448 * scale).
  lhs_in = lhs if lhs.dtype == jnp.float32 else _dequantize(values, scales, jnp.float32)
  out = _frozen_gmm(
    static, lhs_in, q, group_sizes, group_offset, existing_out, activation_quantization="fp8"
  )
  return out, (values, scales.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _quantized_gmm(static, lhs, rhs, group_sizes, group_offset, existing_out):
  q = _quantize_weights(static, rhs)
  return _quantized_forward(static, lhs, q, group_sizes, group_offset, existing_out)[0]


def _quantized_gmm_fwd(static, lhs, rhs, group_sizes, group_offset, existing_out):
  q = _quantize_weights(static, rhs)
  out, lhs_for_drhs = _quantized_forward(static, lhs, q, group_sizes, group_offset, existing_out)
  rhs_dtype = jnp.zeros((0,), rhs.dtype)  # NOTE: a residual must be an array; this carries a dtype
  lhs_zero = jnp.zeros((0,), lhs.dtype)
  res = (q, lhs_for_drhs, lhs_zero, group_sizes, group_offset, existing_out, rhs_dtype)
  return out, res


def _quantized_gmm_bwd(static, residuals, dout):
  q, lhs_for_drhs, lhs_zero, group_sizes, group_offset, existing_out, rhs_dtype = residuals
  m = dout.shape[0]
  k = q.values.shape[2] if static.transpose_rhs else q.values.shape[1]

  def run(lhs, existing_out):
    return _frozen_gmm(static, lhs, q, group_sizes, group_offset, existing_out)

  # NOTE: MaxText's dlhs is (dout * rhs scale) @ rhs values^T = dout @ dequantized(rhs)^T,
  # straight through to the float lhs: the frozen-weights gmm's own VJP (pallas_moe's quantized
  # kernel, transposed), which also gives existing_out's gradient. Its forward is not used.
  lhs_like = jnp.zeros((m, k), lhs_zero.dtype)
  _, pull = jax.vjp(run, lhs_like, existing_out)
  dlhs, dexisting = pull(dout)
  drhs = _weight_grad(
    static, lhs_for_drhs, dout, group_sizes, group_offset, q.values.shape[0], rhs_dtype.dtype
  )
  return dlhs, drhs, None, None, dexisting


_quantized_gmm.defvjp(_quantized_gmm_fwd, _quantized_gmm_bwd)


def _swap_kn(spec: Any) -> Any:
  """drhs tiles given over (m, k, n) for a [G, n, k] weight gradient computed over (m, n, k)."""
  if isinstance(spec, tuple):
    return (spec[0], spec[2], spec[1])
  if callable(spec):
    return lambda m, k, n: _swap_kn(spec(m, n, k))
  return spec


def _weight_grad(static, lhs, dout, group_sizes, group_offset, num_groups, dtype):
  """MaxText's drhs: tgmm of the (quantized) lhs and dout, in the weights' layout.

  Args:
    lhs: the float lhs (or its dequantized copy), or (fp8 values, [m, 1] f32 scales): then as
      MaxText, lhs values^T @ (dout * scales), run by pallas_moe's tgmm on the fp8 values with
      per-token scales.
  """
  spec = static.tiling.drhs
  scales = {}
  if isinstance(lhs, tuple):
    values, row_scales = lhs
    if static.transpose_rhs:
      t_lhs, t_rhs, spec = dout.T, values, _swap_kn(spec)
      scales = dict(rhs_scales=row_scales)
    else:
      t_lhs, t_rhs = values.T, dout
      scales = dict(lhs_scales=row_scales.reshape(1, -1))
  else:
    # NOTE: the float operands go as the [m, *] arrays they are (`transpose_lhs`): no transposed
    # copy in HBM.
    dout = dout.astype(lhs.dtype)
    if static.transpose_rhs:
      t_lhs, t_rhs, spec = dout, lhs, _swap_kn(spec)
    else:
      t_lhs, t_rhs = lhs, dout
    scales = dict(transpose_lhs=True)
  return pm.tgmm(
    t_lhs,
    t_rhs,
    group_sizes,
    dtype,
    spec,
    group_offset,
    num_groups,
    interpret=static.interpret,
    **scales,
  )


def _current_qwix_rule() -> Any:
  """qwix's rule for "gmm" when qwix intercepts (MaxText's `qpl.get_current_rule`), else None."""
  try:
    import qwix.pallas as qpl  # noqa: PLC0415  (optional: qwix is MaxText's dependency)
  except ImportError:
    return None
  return qpl.get_current_rule("gmm")


def _refuse_qarray(x: Any, *, argument: str) -> None:
  if hasattr(x, "qvalue") and hasattr(x, "scale"):
    raise ValueError(
      f"`{argument}` is a pre-quantized qwix QArray (MaxText's moe_quantize_token_all_gather or "
      "quantized weight gathers), which pallas_moe.maxtext.gmm does not take: pass float arrays "
      "(moe_quantize_token_all_gather: false) and quantize with lhs_quantize_dtype / "
      "rhs_quantize_dtype."
    )


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = jnp.float32,
  tiling: Any = None,
  group_offset: jax.Array | int | None = None,
  existing_out: jax.Array | None = None,
  transpose_rhs: bool = False,
  interpret: Any = None,
  lhs_quantize_dtype: Any = None,
  rhs_quantize_dtype: Any = None,
  use_qwix_quantization: bool = False,
  use_tokamax_backend: bool = False,
  weight_gather_axes: list[tuple[str, int]] | None = None,
  lhs_vma_axes: tuple = (),
  rhs_vma_axes: tuple = (),
  qwix_rule: Any = None,
  use_manual_quantization: bool = False,
  use_gmm_v2: bool = False,
  use_gmm_v2_heuristic_tiling: bool = False,
  partial_sum: jax.Array | None = None,
  *,
  input_buffer_count: Any = (2, 2, 2),
  combine_scopes: bool = False,
  honour_tiling: bool = False,
  **unknown: Any,
) -> jax.Array:
  """MaxText's `kernels.megablox.ops.gmm`, run by pallas_moe's kernels. Differentiable.

  Semantics of each argument: see the module docstring. Positional order is MaxText 0.2.5's
  (`MAXTEXT_VERSION`); commit `MAXTEXT_COMMIT` has the same keywords without
  `use_gmm_v2_heuristic_tiling` (MaxText calls gmm by keyword). `input_buffer_count` and
  `combine_scopes` (earlier MaxText versions, positions 15 and 16) are keyword-only here.

  Args:
    lhs: [m, k] float activations, rows sorted by group.
    rhs: [G, k, n] float weights ([G, n, k] with `transpose_rhs`).
    group_sizes: [G_total] int32 rows per group.
    preferred_element_type: output dtype (MaxText's default: float32).
    tiling: MaxText's 9 ints (checked; used only with `honour_tiling`), or None (pallas_moe's
      choice), a `Tiling`, (tm, tk, tn) or a callable (pallas_moe's own tilings: used).
    group_offset: first group of `group_sizes` held by `rhs`.
    existing_out: [m, n] output kept in rows outside the local groups.
    transpose_rhs: rhs is [G, n, k].
    interpret: None or True (the lowering platform's backend: Mosaic for TPU, XLA for GPU,
      interpret mode elsewhere), False (Mosaic) or a `pltpu.InterpretParams`.
    lhs_quantize_dtype: None, jnp.int8, jnp.int4 or jnp.float8_e4m3fn: quantize activations per
      row (qwix absmax).
    rhs_quantize_dtype: None, jnp.int8, jnp.int4 or jnp.float8_e4m3fn: quantize weights per
      output channel (qwix absmax).
    use_qwix_quantization: take the rule from qwix (`qwix_rule`, else qwix's current rule for
      "gmm"): without one, an unquantized gmm (as MaxText); a rule is refused.
    use_tokamax_backend: ignored.
    weight_gather_axes: [(mesh axis, weight dim)]: all-gather the weights first (in shard_map).
    lhs_vma_axes: mesh axes the output is marked varying over.
    rhs_vma_axes: accepted; the weight gradient's varying axes follow from JAX's typing.
    qwix_rule: with use_qwix_quantization, refused; ignored otherwise (as MaxText).
    use_manual_quantization: must be False when quantizing; ignored otherwise.
    use_gmm_v2: ignored.
    use_gmm_v2_heuristic_tiling: ignored (tokamax gmm v2's own tile choice).
    partial_sum: optional [m, n] added to the output.
    input_buffer_count: ignored.
    combine_scopes: ignored.
    honour_tiling: run MaxText's 9-int `tiling` as given instead of pallas_moe's choice (see
      the module docstring; `with_maxtext_tiles` and `swap_into(..., honour_tiling=True)` set it).
    **unknown: any other keyword raises a TypeError naming it (a MaxText version this adapter
      does not follow).

  Returns:
    [m, n] array of `preferred_element_type`.
  """
  if unknown:
    names = ", ".join(f"`{name}`" for name in sorted(unknown))
    raise TypeError(
      f"pallas_moe.maxtext.gmm() got unexpected keyword argument(s) {names}: it takes the "
      f"arguments of `kernels.megablox.ops.gmm` in {_SUPPORTED}. A newer MaxText added an "
      "argument whose meaning this adapter does not know; use a supported MaxText version or "
      "update pallas_moe."
    )
  if hasattr(use_gmm_v2_heuristic_tiling, "shape"):
    raise TypeError(
      "Positional argument 20 is `use_gmm_v2_heuristic_tiling` (a bool, MaxText 0.2.5's order), "
      "got an array: pass `partial_sum` by keyword (MaxText commit "
      f"{MAXTEXT_COMMIT[:7]} has it at position 20)."
    )
  # NOTE: see the module docstring: backend choices and pipeline knobs of MaxText's kernels.
  del use_tokamax_backend, use_gmm_v2, use_gmm_v2_heuristic_tiling
  del input_buffer_count, combine_scopes
  _refuse_qarray(lhs, argument="lhs")
  _refuse_qarray(rhs, argument="rhs")
  if use_qwix_quantization:
    # NOTE: as MaxText: the rule is qwix_rule, else qwix's intercepted rule for "gmm" (only
    # quantization="fp8_full" sets one), and the quantize dtypes are not used.
    rule = qwix_rule if qwix_rule else _current_qwix_rule()
    if rule:
      raise ValueError(
        "`use_qwix_quantization=True` with a qwix rule for the gmm (qwix_rule="
        f"{type(rule).__name__}, e.g. MaxText's quantization='fp8_full') is not supported by "
        "pallas_moe.maxtext.gmm. Use use_qwix_quantization=false with quantization='int8', "
        "'int4' or 'fp8' (MaxText then passes lhs_quantize_dtype / rhs_quantize_dtype, which "
        "run here), or pallas_moe.gmm(..., weight_quantization='fp8', "
        "activation_quantization='fp8')."
      )
    lhs_quantize_dtype = rhs_quantize_dtype = None
  lhs_q = _quant_name(lhs_quantize_dtype, argument="lhs_quantize_dtype")
  rhs_q = _quant_name(rhs_quantize_dtype, argument="rhs_quantize_dtype")
  if use_manual_quantization and (lhs_q or rhs_q):
    raise ValueError(
      "`use_manual_quantization=True` (MaxText's batch-split manual quantization) is not "
      "supported; pass use_manual_quantization=False to get the absmax rule of "
      "lhs_quantize_dtype / rhs_quantize_dtype."
    )
  lhs_vma_axes = _check_axis_names(lhs_vma_axes, argument="lhs_vma_axes")
  _check_axis_names(rhs_vma_axes, argument="rhs_vma_axes")
  gather_axes = _check_gather_axes(weight_gather_axes)
  tiling, tile_note = _tiling_to_run(tiling, honour_tiling=honour_tiling)
  # NOTE: MaxText's True says "not a TPU mesh" (see the module docstring), not "interpret mode".
  interpret = None if interpret is True else interpret
  with pm.record_plans() as plans:
    out = _run(
      lhs,
      rhs,
      group_sizes,
      preferred_element_type,
      tiling,
      group_offset,
      existing_out,
      transpose_rhs,
      interpret,
      lhs_q=lhs_q,
      rhs_q=rhs_q,
      gather_axes=gather_axes,
    )
  if _LOG.isEnabledFor(logging.INFO):
    for plan in plans:
      _LOG.info("pallas_moe.maxtext.gmm (%s):\n%s", tile_note, plan.describe())
  if partial_sum is not None:
    if tuple(partial_sum.shape) != tuple(out.shape):
      raise ValueError(
        f"`partial_sum` has shape {tuple(partial_sum.shape)}; it must be the output's "
        f"[m, n] = {tuple(out.shape)}."
      )
    out = out + partial_sum.astype(out.dtype)
  return _vary_over(out, lhs_vma_axes)


def _tiling_to_run(tiling: Any, *, honour_tiling: bool) -> tuple[Any, str]:
  """The tiling the kernels get, and a note saying where it comes from.

  MaxText's 9 ints are checked in any case, and run only with `honour_tiling` (see the module
  docstring); pallas_moe's own tilings and None pass through.
  """
  if not isinstance(honour_tiling, bool):
    raise TypeError(f"`honour_tiling` must be a bool, got {honour_tiling!r}.")
  is_maxtext = isinstance(tiling, (tuple, list)) and len(tiling) == 9
  resolved = maxtext_tiling(tiling)
  if not is_maxtext:
    return resolved, "tiling as given" if tiling is not None else "pallas_moe's tiles"
  if honour_tiling:
    return resolved, f"MaxText's tiling {tuple(tiling)} honoured"
  return None, (
    f"MaxText's tiling {tuple(tiling)} not used: pallas_moe's tiles for the chip and call; "
    "honour it with swap_into(..., honour_tiling=True) or pallas_moe.maxtext.with_maxtext_tiles"
  )


def _run(
  lhs,
  rhs,
  group_sizes,
  preferred_element_type,
  tiling,
  group_offset,
  existing_out,
  transpose_rhs,
  interpret,
  *,
  lhs_q,
  rhs_q,
  gather_axes,
):
  """The gmm on checked arguments: weight gathers, then the float or quantized path."""
  for name, dim in gather_axes:
    # NOTE: gathered in float before any quantization, so the calibration sees every shard.
    rhs = jax.lax.all_gather(rhs, name, axis=dim, tiled=True)
  if rhs_q is None:
    if lhs_q is not None:
      lhs = _fake_quantize_rows(lhs, lhs_q)
    out = pm.gmm(
      lhs,
      rhs,
      group_sizes,
      preferred_element_type,
      tiling,
      group_offset,
      existing_out,
      transpose_rhs,
      interpret,
      unowned_rows=_unowned_rows(rhs.shape[0], group_sizes, existing_out),
    )
  else:
    for argument, x, ndim in (("lhs", lhs, 2), ("rhs", rhs, 3)):
      if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{argument}` must be a float array to quantize, got {type(x)}.")
      if x.ndim != ndim:
        raise ValueError(f"`{argument}` must be {ndim}-d, got shape {tuple(x.shape)}.")
    static = _QuantStatic(
      weight_dtype=rhs_q,
      activation_dtype=lhs_q,
      preferred_element_type=preferred_element_type,
      tiling=pm.Tiling.of(tiling),
      transpose_rhs=bool(transpose_rhs),
      interpret=interpret,
    )
    group_sizes = jnp.asarray(group_sizes)
    operands = _vary_together(lhs, rhs, group_sizes, group_offset, existing_out)
    out = _quantized_gmm(static, *operands)
  return out


class _Delegate(types.ModuleType):
  """A module object answering with its own attributes first, then `target`'s."""

  def __init__(self, name: str, target: types.ModuleType, **overrides: Any):
    super().__init__(name)
    self._target = target
    self.__dict__.update(overrides)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._target, name)


def swap_into(moe_module: types.ModuleType, *, honour_tiling: bool = False) -> dict[str, Any]:
  """Switches MaxText's MoE layer module to pallas_moe, as docs/maxtext.md's two-line edit does.

  Replaces the module's `mblx` (MaxText's megablox) by this module and makes its
  `jax.lax.ragged_all_to_all` calls call `pallas_moe.ragged_all_to_all`: the module's global
  `jax` becomes a stand-in whose `lax.ragged_all_to_all` is pallas_moe's and whose every other
  attribute is JAX's own. Nothing outside that module changes.

  Args:
    moe_module: `maxtext.layers.moe` (imported).
    honour_tiling: run MaxText's `wi_tile_*` / `wo_tile_*` tiles as given (`with_maxtext_tiles`)
      instead of pallas_moe's choice per chip and call (the default; see the module docstring).

  Returns:
    The replaced globals {name: original}, to restore them (`setattr(moe_module, name, value)`).
  """
  if not isinstance(honour_tiling, bool):
    raise TypeError(f"`honour_tiling` must be a bool, got {honour_tiling!r}.")
  for name in ("mblx", "jax"):
    if not hasattr(moe_module, name):
      raise ValueError(
        f"`moe_module` {getattr(moe_module, '__name__', moe_module)!r} has no global `{name}`: "
        "pass maxtext.layers.moe (MaxText " + _SUPPORTED + ")."
      )
  originals = {"mblx": moe_module.mblx, "jax": moe_module.jax}
  real_jax = originals["jax"]
  lax = _Delegate("jax.lax", real_jax.lax, ragged_all_to_all=ragged_all_to_all)
  moe_module.mblx = with_maxtext_tiles if honour_tiling else sys.modules[__name__]
  moe_module.jax = _Delegate("jax", real_jax, lax=lax)
  return originals


# This module with MaxText's tiles honoured, for the edited-source route:
#   from pallas_moe.maxtext import with_maxtext_tiles as mblx
with_maxtext_tiles = _Delegate(
  f"{__name__}.with_maxtext_tiles",
  sys.modules[__name__],
  gmm=functools.wraps(gmm)(functools.partial(gmm, honour_tiling=True)),
)
