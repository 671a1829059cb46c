"""Plain-jnp references for gmm and tgmm. Every kernel test compares against these.

They are written for clarity, not speed: a per-row group id and a gather of each row's weights
(gmm), a masked sum over rows per group (tgmm). They follow the same contract as the kernels: rows
outside the local groups keep `existing_out` (or are 0), rows past `sum(group_sizes)` are 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def row_group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
  """[m] global group of each row; rows past sum(group_sizes) get num_groups."""
  ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
  return jnp.searchsorted(ends, jnp.arange(m), side="right").astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "transpose_rhs"))
def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type=None,
  group_offset: int | jax.Array = 0,
  existing_out: jax.Array | None = None,
  transpose_rhs: bool = False,
) -> jax.Array:
  """out[r] = lhs[r] @ rhs[group(r) - group_offset] for rows of local groups.

  Every row is multiplied by every local group's weights and the row's own group is selected: G
  times the work of gmm, but no [m, k, n] gather of per-row weights.
  """
  out_dtype = preferred_element_type or jnp.promote_types(lhs.dtype, rhs.dtype)
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  num_local = rhs.shape[0]
  m = lhs.shape[0]
  local = row_group_ids(group_sizes, m) - group_offset
  onehot = (local[:, None] == jnp.arange(num_local)[None, :]).astype(jnp.float32)
  prod = jnp.einsum(
    "mk,gkn,mg->mn",
    lhs.astype(jnp.float32),
    rhs.astype(jnp.float32),
    onehot,
    precision=jax.lax.Precision.HIGHEST,
  )
  in_shard = (local >= 0) & (local < num_local)
  base = jnp.zeros_like(prod) if existing_out is None else existing_out.astype(jnp.float32)
  return jnp.where(in_shard[:, None], prod, base).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "num_actual_groups"))
def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type=None,
  group_offset: int | jax.Array = 0,
  num_actual_groups: int | None = None,
  existing_out: jax.Array | None = None,
) -> jax.Array:
  """out[g] = lhs[:, rows of g] @ rhs[rows of g] for the local groups; lhs is [k, m]."""
  out_dtype = preferred_element_type or jnp.promote_types(lhs.dtype, rhs.dtype)
  num_local = group_sizes.shape[0] if num_actual_groups is None else num_actual_groups
  m = lhs.shape[1]
  local = row_group_ids(group_sizes, m) - group_offset
  onehot = (local[None, :] == jnp.arange(num_local)[:, None]).astype(jnp.float32)
  out = jnp.einsum(
    "km,gm,mn->gkn",
    lhs.astype(jnp.float32),
    onehot,
    rhs.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  if existing_out is not None:
    out = out + existing_out.astype(jnp.float32)
  return out.astype(out_dtype)
