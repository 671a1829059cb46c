"""MaxText's megablox call, verbatim: switch MaxText's MoE layer to pallas_moe by changing imports.

MaxText does not call upstream megablox; `maxtext/layers/moe.py` calls its own fork,
`maxtext.kernels.megablox.ops.gmm` (imported as `mblx`), and `jax.lax.ragged_all_to_all`, which
has no CPU implementation. This module offers both under the names MaxText uses:

  from pallas_moe import maxtext as mblx      # was: from maxtext.kernels import megablox as mblx
  mblx.ragged_all_to_all(...)                 # was: jax.lax.ragged_all_to_all(...)

`gmm` takes MaxText's arguments (positional order and keyword names of MaxText's `ops.gmm` at
commit e591f30cbbf217ed67ef71263ec0538239f9c3b8, 2026-08-22, plus keywords of earlier versions):

- `tiling`: MaxText's 9 ints (fwd tm, tk, tn, dlhs tm, tk, tn, drhs tm, tk, tn). MaxText hands
  tiling[3:6] to a gmm with the transposed weights (tiles over m, n, k) and tiling[6:9] to tgmm
  (tiles over m, k, n), which are exactly `pallas_moe.Tiling`'s per-pass coordinates, so the
  triples map one to one: Tiling(fwd=t[0:3], dlhs=t[3:6], drhs=t[6:9]). Tiles larger than a
  dimension are clamped to it. None picks pallas_moe's heuristic; a `Tiling`, one (tm, tk, tn) or
  a callable is passed through.
- `lhs_quantize_dtype` / `rhs_quantize_dtype` (int8 or int4): MaxText's AQT-style rule, i.e. qwix
  "absmax" calibration: activations with one scale per row, weights with one scale per output
  channel shared by all experts (absmax over the groups and k), scale = absmax / (qmax + 0.5),
  values = round(x / scale) saturated to the integer range. The weights run through pallas_moe's
  quantized kernel as int8 values with f32 scales (int4 values are held in int8: same products,
  twice the bytes of packed int4). Activations are quantized and dequantized in the wrapper
  (pallas_moe's own activation path calibrates with absmax / 127, which is not MaxText's).
  Gradients follow MaxText: the lhs gradient is dout @ dequantized(rhs)^T, the weight gradient
  is tgmm(dequantized(lhs)^T, dout), both straight through to the float inputs.
- `weight_gather_axes` [(axis_name, dim), ...]: the float weights are all-gathered (tiled) over
  each mesh axis along `dim` before the kernel, inside `shard_map`; the weight gradient is
  reduce-scattered back by JAX's transpose of all_gather.
- `partial_sum` [m, n]: added to the output (MaxText's tokamax gmm v2 accumulates into it); its
  gradient is the output's.
- `lhs_vma_axes`: the output is marked varying over these mesh axes (MaxText's `pcast`; pallas_moe
  outputs already vary over their operands' axes). `rhs_vma_axes`: the weight gradient's axes,
  which JAX's varying-axes typing already gives it; accepted, nothing to do.
- Accepted and ignored (no meaning here): `use_tokamax_backend`, `use_gmm_v2` (backend choice:
  pallas_moe is the backend), `input_buffer_count`, `combine_scopes` (keywords of MaxText's
  2026-02..04 versions: megablox pipeline depth, tokamax named scopes), `use_manual_quantization`
  without quantization, `qwix_rule` with `use_qwix_quantization=False` (MaxText ignores it too).
- Refused with a ValueError saying what to use: `use_qwix_quantization=True` (qwix rules, e.g.
  MaxText's quantization="fp8_full"), quantize dtypes other than int8 / int4, and
  `use_manual_quantization=True` with quantization (MaxText's batch-split scheme).
- `interpret`: None means compiled on TPU and interpret mode elsewhere (MaxText's None means
  compiled); True, False or `pltpu.InterpretParams` are passed through.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import pallas_moe as pm
from pallas_moe import ragged_all_to_all

__all__ = ["MAXTEXT_COMMIT", "gmm", "maxtext_tiling", "quantize_absmax", "ragged_all_to_all"]

# The MaxText commit whose `kernels/megablox/ops.py` and `layers/moe.py` this module follows.
MAXTEXT_COMMIT = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"

# qwix's symmetric integer bounds (`numerics.get_symmetric_bound`: qmax + 0.5) and value ranges.
_INT_QUANT = {"int8": (127.5, -128, 127), "int4": (7.5, -8, 7)}


def _quant_name(dtype: Any, *, argument: str) -> str | None:
  """The name "int8" / "int4" of MaxText's quantize dtype (a jnp dtype or its name), or None."""
  if dtype is None:
    return None
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in _INT_QUANT:
    raise ValueError(
      f"`{argument}`={dtype!r} is not supported: MaxText's megablox quantizes to jnp.int8 or "
      "jnp.int4. For fp8 use pallas_moe.gmm(..., weight_quantization='fp8', "
      "activation_quantization='fp8')."
    )
  return name


def quantize_absmax(x: jax.Array, *, dtype: Any, channel_axes: tuple[int, ...]):
  """qwix-style symmetric absmax quantization (MaxText's AQT-equivalent rule).

  Args:
    x: float array.
    dtype: jnp.int8 or jnp.int4 (or their names).
    channel_axes: axes with their own scale; the absmax is taken over the others.

  Returns:
    (values, scales): int8 `values` (int4 values lie in [-8, 7]) and `scales` in x's dtype with
    size 1 on the reduced axes, so that `values * scales` approximates x.
  """
  name = _quant_name(dtype, argument="dtype")
  bound, lo, hi = _INT_QUANT[name]
  reduce_axes = tuple(a for a in range(x.ndim) if a not in channel_axes)
  absmax = jnp.max(jnp.abs(x), axis=reduce_axes, keepdims=True)
  # NOTE: as qwix: the scale is computed and kept in x's dtype; an all-zero channel gets scale 1.
  scales = absmax / jnp.asarray(bound, x.dtype)
  scales = jnp.where(scales == 0, jnp.ones_like(scales), scales)
  values = jnp.clip(jnp.round(x / scales), lo, hi).astype(jnp.int8)
  return values, scales


def _fake_quantize_rows(lhs: jax.Array, name: str) -> jax.Array:
  """lhs quantized per row and dequantized, straight-through (d/dlhs taken as the identity)."""
  values, scales = quantize_absmax(lhs, dtype=name, channel_axes=(0,))
  deq = values.astype(scales.dtype) * scales
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


def _frozen_gmm(static: _QuantStatic, lhs, q, group_sizes, group_offset, existing_out):
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
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _quantized_gmm(static, lhs, rhs, group_sizes, group_offset, existing_out):
  q = _quantize_weights(static, rhs)
  return _frozen_gmm(static, lhs, q, group_sizes, group_offset, existing_out)


def _quantized_gmm_fwd(static, lhs, rhs, group_sizes, group_offset, existing_out):
  q = _quantize_weights(static, rhs)

  def run(lhs, existing_out):
    return _frozen_gmm(static, lhs, q, group_sizes, group_offset, existing_out)

  # NOTE: the frozen-weights gmm's own VJP gives the lhs gradient against the quantized weights
  # (pallas_moe's quantized kernel, transposed) and existing_out's; the weight gradient is below.
  out, pull = jax.vjp(run, lhs, existing_out)
  rhs_dtype = jnp.zeros((0,), rhs.dtype)  # NOTE: a residual must be an array; this carries a dtype
  return out, (pull, lhs, group_sizes, group_offset, rhs_dtype, rhs.shape[0])


def _quantized_gmm_bwd(static, residuals, dout):
  pull, lhs, group_sizes, group_offset, rhs_dtype, num_groups = residuals
  dlhs, dexisting = pull(dout)
  drhs = _weight_grad(
    static, lhs, dout.astype(lhs.dtype), group_sizes, group_offset, num_groups, rhs_dtype.dtype
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
  """MaxText's drhs: tgmm of the (dequantized) lhs and dout, in the weights' layout."""
  spec = static.tiling.drhs
  if static.transpose_rhs:
    t_lhs, t_rhs, spec = dout.T, lhs, _swap_kn(spec)
  else:
    t_lhs, t_rhs = lhs.T, dout
  return pm.tgmm(
    t_lhs,
    t_rhs,
    group_sizes,
    dtype,
    spec,
    group_offset,
    num_groups,
    interpret=static.interpret,
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
  partial_sum: jax.Array | None = None,
  *,
  input_buffer_count: Any = (2, 2, 2),
  combine_scopes: bool = False,
) -> jax.Array:
  """MaxText's `kernels.megablox.ops.gmm`, run by pallas_moe's kernels. Differentiable.

  Semantics of each argument: see the module docstring. Positional order is MaxText's at
  `MAXTEXT_COMMIT`; `input_buffer_count` and `combine_scopes` (earlier MaxText versions, where
  they sat in positions 15 and 16) are keyword-only here.

  Args:
    lhs: [m, k] float activations, rows sorted by group.
    rhs: [G, k, n] float weights ([G, n, k] with `transpose_rhs`).
    group_sizes: [G_total] int32 rows per group.
    preferred_element_type: output dtype (MaxText's default: float32).
    tiling: MaxText's 9 ints, or None (heuristic), a `Tiling`, (tm, tk, tn) or a callable.
    group_offset: first group of `group_sizes` held by `rhs`.
    existing_out: [m, n] output kept in rows outside the local groups.
    transpose_rhs: rhs is [G, n, k].
    interpret: None (compiled on TPU, interpret mode elsewhere), True, False or InterpretParams.
    lhs_quantize_dtype: None, jnp.int8 or jnp.int4: quantize activations per row (absmax).
    rhs_quantize_dtype: None, jnp.int8 or jnp.int4: quantize weights per output channel (absmax).
    use_qwix_quantization: must be False (qwix rules are not supported).
    use_tokamax_backend: ignored.
    weight_gather_axes: [(mesh axis, weight dim)]: all-gather the weights first (in shard_map).
    lhs_vma_axes: mesh axes the output is marked varying over.
    rhs_vma_axes: accepted; the weight gradient's varying axes follow from JAX's typing.
    qwix_rule: ignored unless use_qwix_quantization (which is refused).
    use_manual_quantization: must be False when quantizing; ignored otherwise.
    use_gmm_v2: ignored.
    partial_sum: optional [m, n] added to the output.
    input_buffer_count: ignored.
    combine_scopes: ignored.

  Returns:
    [m, n] array of `preferred_element_type`.
  """
  del use_tokamax_backend, use_gmm_v2, input_buffer_count, combine_scopes  # NOTE: see docstring.
  if use_qwix_quantization:
    raise ValueError(
      "`use_qwix_quantization=True` (a qwix QtRule, qwix_rule="
      f"{type(qwix_rule).__name__}) is not supported by pallas_moe.maxtext.gmm. Use "
      "lhs_quantize_dtype / rhs_quantize_dtype=jnp.int8 or jnp.int4 (MaxText's AQT-style "
      "quantization, e.g. quantization='int8' with use_qwix_quantization=false), or for fp8 "
      "pallas_moe.gmm(..., weight_quantization='fp8', activation_quantization='fp8')."
    )
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
  tiling = maxtext_tiling(tiling)

  for name, dim in gather_axes:
    # NOTE: gathered in float before any quantization, so the calibration sees every shard.
    rhs = jax.lax.all_gather(rhs, name, axis=dim, tiled=True)
  if lhs_q is not None:
    lhs = _fake_quantize_rows(lhs, lhs_q)
  if rhs_q is None:
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
    )
  else:
    if not hasattr(rhs, "dtype") or not jnp.issubdtype(rhs.dtype, jnp.floating):
      raise TypeError(
        f"`rhs` must be a float array to quantize with rhs_quantize_dtype, got {type(rhs)}."
      )
    if rhs.ndim != 3:
      raise ValueError(f"`rhs` must be [G, k, n] (or [G, n, k]), got shape {tuple(rhs.shape)}.")
    static = _QuantStatic(
      weight_dtype=rhs_q,
      preferred_element_type=preferred_element_type,
      tiling=pm.Tiling.of(tiling),
      transpose_rhs=bool(transpose_rhs),
      interpret=interpret,
    )
    group_sizes = jnp.asarray(group_sizes)
    operands = _vary_together(lhs, rhs, group_sizes, group_offset, existing_out)
    out = _quantized_gmm(static, *operands)
  if partial_sum is not None:
    if tuple(partial_sum.shape) != tuple(out.shape):
      raise ValueError(
        f"`partial_sum` has shape {tuple(partial_sum.shape)}; it must be the output's "
        f"[m, n] = {tuple(out.shape)}."
      )
    out = out + partial_sum.astype(out.dtype)
  return _vary_over(out, lhs_vma_axes)
