"""gmm and tgmm on XLA's grouped matmul (`jax.lax.ragged_dot`), with pallas_moe's contract.

The backend for platforms without Mosaic (GPUs): no Pallas kernel, no interpret-mode loops, one
`ragged_dot` per call, differentiated by JAX. Same contract as the kernels (`pallas_moe.gmm`):
rhs holds the groups group_offset .. group_offset + G - 1; rows of other groups keep
`existing_out` (or are exact zeros), and so do the rows past sum(group_sizes); their lhs
gradient is zero. tgmm gives exact zeros for empty groups and adds `existing_out`.

NOTE: `ragged_dot` hands rows to groups in order from row 0. The rows before the local groups'
are handed to the first local group, computed and masked out, so that no shifted copy of lhs is
made; under expert parallelism's ragged all-to-all (group_offset 0) there are none.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["gmm_xla", "tgmm_xla"]


def _local_groups(group_sizes, group_offset, num_local: int):
  """(sizes for ragged_dot, first row, end row) of the local groups.

  The first local group's size is widened by the rows before it (see the module NOTE).
  """
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(sizes)
  offsets = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])
  start = offsets[group_offset]
  end = offsets[group_offset + num_local]
  local = jax.lax.dynamic_slice_in_dim(sizes, group_offset, num_local)
  return local.at[0].add(start), start, end


def _owned_rows(m: int, start, end) -> jax.Array:
  rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
  return (rows >= start) & (rows < end)


def gmm_xla(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  *,
  transpose_rhs: bool,
  out_dtype: Any,
) -> jax.Array:
  """out[rows of g] = lhs[rows of g] @ rhs[g - group_offset], by `jax.lax.ragged_dot`.

  Args:
    lhs: [m, k] float.
    rhs: [G, k, n] float ([G, n, k] with `transpose_rhs`), already dequantized.
    group_sizes: [G_total] int.
    group_offset: int32 scalar.
    existing_out: None or [m, n] of `out_dtype`.
    transpose_rhs: rhs is [G, n, k].
    out_dtype: the output dtype.

  Returns:
    [m, n] of `out_dtype`.
  """
  w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  compute = jnp.promote_types(lhs.dtype, w.dtype)
  local, start, end = _local_groups(group_sizes, group_offset, w.shape[0])
  out = jax.lax.ragged_dot(
    lhs.astype(compute), w.astype(compute), local, preferred_element_type=out_dtype
  )
  fill = jnp.zeros((), out_dtype) if existing_out is None else existing_out
  return jnp.where(_owned_rows(lhs.shape[0], start, end), out, fill)


def tgmm_xla(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  existing_out: jax.Array | None,
  *,
  num_actual_groups: int,
  transpose_lhs: bool,
  out_dtype: Any,
  lhs_scales: jax.Array | None = None,
  rhs_scales: jax.Array | None = None,
) -> jax.Array:
  """out[g] = lhs[:, rows of g] @ rhs[rows of g] (+ existing_out[g]), by `ragged_dot_general`.

  Args:
    lhs: [k, m] ([m, k] with `transpose_lhs`); int8 / fp8 values with `lhs_scales`.
    rhs: [m, n]; int8 / fp8 values with `rhs_scales`.
    group_sizes: [G_total] int.
    group_offset: int32 scalar.
    existing_out: None or [num_actual_groups, k, n] of `out_dtype`.
    num_actual_groups: groups computed.
    transpose_lhs: lhs is [m, k].
    out_dtype: the output dtype.
    lhs_scales: f32 [k, 1] or [1, m] scales of a quantized lhs.
    rhs_scales: f32 [1, n] or [m, 1] scales of a quantized rhs.

  Returns:
    [num_actual_groups, k, n] of `out_dtype`.
  """
  # NOTE: quantized operands are dequantized in f32 (their scales broadcast along the layout
  # they are given for), then contracted: the products the kernels compute, without the
  # narrow MXU modes.
  x = lhs if lhs_scales is None else lhs.astype(jnp.float32) * lhs_scales
  y = rhs if rhs_scales is None else rhs.astype(jnp.float32) * rhs_scales
  x = x if transpose_lhs else x.T
  compute = jnp.promote_types(x.dtype, y.dtype)
  m = y.shape[0]
  local, start, end = _local_groups(group_sizes, group_offset, num_actual_groups)
  # NOTE: rows outside the local groups (given to the first group or to none) contribute zero.
  x = jnp.where(_owned_rows(m, start, end), x.astype(compute), jnp.zeros((), compute))
  numbers = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )
  out = jax.lax.ragged_dot_general(
    x, y.astype(compute), local, numbers, preferred_element_type=out_dtype
  )
  return out if existing_out is None else out + existing_out
