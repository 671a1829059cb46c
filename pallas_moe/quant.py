"""Weight quantization for gmm: int8 / fp8 (e4m3) values with per-(group, output-channel) scales.

`quantize(w)` maps float weights [G, k, n] to `QuantizedWeights(values [G, k, n] int8 or
float8_e4m3fn, scales [G, 1, n] f32)`: symmetric absmax over the contraction axis k, one scale per
(group, output column), so `values * scales` approximates w. For the transposed layout [G, n, k]
(`axis=2`) the scales are [G, n, 1]. `pallas_moe.gmm` accepts a `QuantizedWeights` as its rhs.

`quantize_rows(x)` quantizes activations [m, k] with one f32 scale per row ([m, 1]): a per-row
scale factors out of gmm's contraction over k, so the kernel applies it to the accumulator.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Largest representable magnitude of each quantized dtype (symmetric range).
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}
# MaxText-style short names accepted as aliases.
_ALIASES = {"fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}


def canonical_dtype(dtype: Any) -> str:
  """The quantized dtype name ("int8" or "float8_e4m3fn") for a name, alias or dtype.

  Args:
    dtype: "int8", "float8_e4m3fn", "fp8", or the numpy/jax dtype.

  Returns:
    The canonical name.
  """
  if isinstance(dtype, str):
    name = _ALIASES.get(dtype, dtype)
  else:
    try:
      name = jnp.dtype(dtype).name
    except TypeError:
      name = None
  if name not in _DTYPES:
    raise ValueError(
      f"Unsupported quantized weight dtype {dtype!r}: use 'int8' or 'float8_e4m3fn' ('fp8')."
    )
  return name


def is_quantized_dtype(dtype: Any) -> bool:
  """Whether `dtype` is one of the quantized dtypes (int8, float8_e4m3fn)."""
  try:
    return jnp.dtype(dtype).name in _DTYPES
  except TypeError:
    return False


def narrow_dot_supported(dtype: Any, generation: Any) -> bool:
  """Whether `generation`'s MXU multiplies two `dtype` operands natively (see `tiling`).

  Args:
    dtype: a quantized dtype or its name.
    generation: a `tiling.TpuGeneration`.
  """
  name = canonical_dtype(dtype)
  return generation.supports_int8 if name == "int8" else generation.supports_fp8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
  """Quantized expert weights: `values * scales` approximates the float weights.

  Attributes:
    values: [G, k, n] (or [G, n, k] for the transposed layout) int8 or float8_e4m3fn.
    scales: f32 with `values`'s shape and the contraction axis reduced to 1: [G, 1, n] (or
      [G, n, 1]); one scale per (group, output channel).
  """

  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)

  @property
  def dtype(self):
    return self.values.dtype


def _contraction_axis(axis: int) -> int:
  if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (1, 2, -1, -2):
    raise ValueError(
      f"`axis`={axis!r} must be the contraction (k) axis of a [G, k, n] (axis=1) or [G, n, k] "
      "(axis=2) weight."
    )
  return axis % 3


def quantize(
  w: jax.Array, *, dtype: Any = "int8", axis: int = 1, axis_name: str | None = None
) -> QuantizedWeights:
  """Symmetric absmax quantization with one scale per (group, output channel).

  Args:
    w: [G, k, n] float weights (or [G, n, k] with axis=2).
    dtype: "int8" or "float8_e4m3fn" (alias "fp8").
    axis: the contraction axis k that each scale spans: 1 for [G, k, n], 2 for [G, n, k].
    axis_name: inside `shard_map`, a mesh axis k is split over: the scale spans the whole k
      (the absmax is a pmax over the axis). None: the k of `w`.

  Returns:
    `QuantizedWeights` with values of `dtype` and f32 scales of w's shape with `axis` reduced to 1.
  """
  name = canonical_dtype(dtype)
  if not hasattr(w, "dtype") or not hasattr(w, "ndim"):
    raise TypeError(f"`w` must be a jax or numpy array, got {type(w).__name__}.")
  if w.ndim != 3:
    raise ValueError(f"`w` must be a 3-d [G, k, n] array, got shape {tuple(w.shape)}.")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"`w` must be a floating-point array, got {w.dtype}.")
  axis = _contraction_axis(axis)
  w32 = jnp.asarray(w).astype(jnp.float32)
  qmax = _QMAX[name]
  absmax = jnp.max(jnp.abs(w32), axis=axis, keepdims=True)
  if axis_name is not None:
    # NOTE: scales carry no gradient (straight-through), and pmax has no differentiation rule.
    absmax = jax.lax.pmax(jax.lax.stop_gradient(absmax), axis_name)
  # NOTE: an all-zero channel gets scale 1 (its values are all 0 either way), never a 0 divisor.
  scales = jnp.where(absmax > 0, absmax / qmax, 1.0).astype(jnp.float32)
  return QuantizedWeights(values=_quantize_values(w32, scales, name), scales=scales)


def _quantize_values(x32: jax.Array, scales: jax.Array, name: str) -> jax.Array:
  qmax = _QMAX[name]
  scaled = x32 / scales
  if name == "int8":
    return jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
  return jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn)


def quantize_rows(x: jax.Array, *, dtype: Any = "int8") -> tuple[jax.Array, jax.Array]:
  """Symmetric absmax quantization of activations with one f32 scale per row.

  Args:
    x: [m, k] float activations (rows are tokens).
    dtype: "int8" or "float8_e4m3fn" (alias "fp8").

  Returns:
    (values [m, k] of `dtype`, scales [m, 1] f32) with values * scales approximating x. An
    all-zero row gets scale 1.
  """
  name = canonical_dtype(dtype)
  if not hasattr(x, "dtype") or not hasattr(x, "ndim"):
    raise TypeError(f"`x` must be a jax or numpy array, got {type(x).__name__}.")
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"`x` must be a 2-d float [m, k] array, got {x.dtype}{list(x.shape)}.")
  x32 = jnp.asarray(x).astype(jnp.float32)
  absmax = jnp.max(jnp.abs(x32), axis=1, keepdims=True)
  scales = jnp.where(absmax > 0, absmax / _QMAX[name], 1.0).astype(jnp.float32)
  return _quantize_values(x32, scales, name), scales


def dequantize(q: QuantizedWeights, *, dtype: Any = jnp.float32) -> jax.Array:
  """`values * scales` in `dtype` (f32 by default)."""
  check_quantized(q)
  return (q.values.astype(jnp.float32) * q.scales).astype(dtype)


def check_quantized(q: Any, *, transpose_rhs: bool | None = None) -> None:
  """Checks a `QuantizedWeights`: dtypes, rank, and the scales' shape.

  Args:
    q: the value to check.
    transpose_rhs: when given, the layout the scales must follow: [G, 1, n] for [G, k, n]
      (False) or [G, n, 1] for [G, n, k] (True). None accepts either.
  """
  if not isinstance(q, QuantizedWeights):
    raise TypeError(f"Expected a QuantizedWeights, got {type(q).__name__}.")
  values, scales = q.values, q.scales
  for name, x in (("values", values), ("scales", scales)):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
      raise TypeError(f"QuantizedWeights.{name} must be an array, got {type(x).__name__}.")
  if jnp.dtype(values.dtype).name not in _DTYPES:
    raise TypeError(
      f"QuantizedWeights.values must be int8 or float8_e4m3fn, got {values.dtype}; "
      "build it with pallas_moe.quantize."
    )
  if jnp.dtype(scales.dtype) != jnp.float32:
    raise TypeError(f"QuantizedWeights.scales must be float32, got {scales.dtype}.")
  if values.ndim != 3:
    raise ValueError(f"QuantizedWeights.values must be 3-d, got shape {tuple(values.shape)}.")
  g, a, b = values.shape
  layouts = {False: (g, 1, b), True: (g, a, 1)}
  allowed = [layouts[transpose_rhs]] if transpose_rhs is not None else list(layouts.values())
  if tuple(scales.shape) not in allowed:
    want = " or ".join(str(s) for s in allowed)
    raise ValueError(
      f"QuantizedWeights.scales has shape {tuple(scales.shape)} but values {tuple(values.shape)} "
      f"need scales of shape {want} (one per group and output channel)."
    )


# NOTE: DeepSeek-V3's checkpoints store expert weights as float8_e4m3fn with one f32 scale per
# 128 x 128 block (`weight_scale_inv`, which multiplies: w ~= values * scale).
BLOCK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQuantizedWeights:
  """Expert weights with one scale per `block` x `block` tile: `values * scales` (each scale
  repeated over its tile) approximates the float weights.

  Attributes:
    values: [G, k, n] int8 or float8_e4m3fn.
    scales: [G, k / block, n / block] f32.
    block: the tile edge (128 in DeepSeek-V3's checkpoints); k and n are multiples of it.
  """

  values: jax.Array
  scales: jax.Array
  block: int = dataclasses.field(default=BLOCK, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)

  @property
  def dtype(self):
    return self.values.dtype


def quantize_blocks(
  w: jax.Array, *, dtype: Any = "fp8", block: int = BLOCK
) -> BlockQuantizedWeights:
  """Symmetric absmax quantization with one scale per (group, block x block tile), the layout of
  DeepSeek-V3's fp8 checkpoints.

  Args:
    w: [G, k, n] float weights; k and n multiples of `block`.
    dtype: "fp8" (float8_e4m3fn, as DeepSeek-V3 stores them) or "int8".
    block: the tile edge.

  Returns:
    `BlockQuantizedWeights`.
  """
  name = canonical_dtype(dtype)
  if not hasattr(w, "ndim") or w.ndim != 3:
    raise ValueError(f"`w` must be a 3-d [G, k, n] array, got {getattr(w, 'shape', type(w))}.")
  g, k, n = w.shape
  if k % block or n % block:
    raise ValueError(
      f"`w` of shape {tuple(w.shape)}: k and n must be multiples of block={block} for block "
      "scales; use quantize(...) (per-channel scales) for other shapes."
    )
  w32 = jnp.asarray(w).astype(jnp.float32).reshape(g, k // block, block, n // block, block)
  absmax = jnp.max(jnp.abs(w32), axis=(2, 4))
  scales = jnp.where(absmax > 0, absmax / _QMAX[name], 1.0).astype(jnp.float32)
  values = _quantize_values(w32, scales[:, :, None, :, None], name).reshape(g, k, n)
  return BlockQuantizedWeights(values=values, scales=scales, block=block)


def dequantize_blocks(q: BlockQuantizedWeights, *, dtype: Any = jnp.float32) -> jax.Array:
  """`values * scales` with each scale repeated over its tile, in `dtype` (f32 by default)."""
  check_block_quantized(q)
  g, k, n = q.values.shape
  b = q.block
  # NOTE: only the major dim k is split ([G, k/b, b, n]: a bitcast of the tiled layout), and
  # the scales are repeated along n first ([G, k/b, 1, n] f32, 1/b of the weights' elements),
  # so the multiply is one elementwise pass over the weights: 3.1 HBM bytes per fp8 element,
  # compiled for v6e. Splitting n as well ([G, k/b, b, n/b, b]) made XLA write the scales
  # broadcast to the weights' full shape in f32 and copy it (19 bytes per element).
  rows = q.values.reshape(g, k // b, b, n).astype(jnp.float32)
  cols = jnp.repeat(q.scales, b, axis=2)[:, :, None, :]
  return (rows * cols).reshape(g, k, n).astype(dtype)


def check_block_quantized(q: Any) -> None:
  """Checks a `BlockQuantizedWeights`: dtypes, rank and the scales' shape."""
  if not isinstance(q, BlockQuantizedWeights):
    raise TypeError(f"Expected a BlockQuantizedWeights, got {type(q).__name__}.")
  if jnp.dtype(q.values.dtype).name not in _DTYPES:
    raise TypeError(
      f"BlockQuantizedWeights.values must be int8 or float8_e4m3fn, got {q.values.dtype}."
    )
  if jnp.dtype(q.scales.dtype) != jnp.float32:
    raise TypeError(f"BlockQuantizedWeights.scales must be float32, got {q.scales.dtype}.")
  if q.values.ndim != 3:
    raise ValueError(f"BlockQuantizedWeights.values must be 3-d, got {tuple(q.values.shape)}.")
  g, k, n = q.values.shape
  want = (g, -(-k // q.block), -(-n // q.block))
  if k % q.block or n % q.block or tuple(q.scales.shape) != want:
    raise ValueError(
      f"BlockQuantizedWeights: values {tuple(q.values.shape)} need k, n multiples of "
      f"block={q.block} and scales of shape {want}, got {tuple(q.scales.shape)}."
    )
