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


def moe(params: dict, x: jax.Array, config, *, keep: jax.Array | None = None):
  """Dense MoE reference: every token through its top-k experts by a loop over experts.

  Plain jnp in f32 (HIGHEST precision) on the global batch, independent of the block's sorting,
  exchange and kernels. Inputs are first rounded to `config.dtype` like the block does.

  Args:
    params: `moe.init_params` layout: router [d, E], wi [E, d, 2f], wo [E, f, d], optional
      shared_wi [d, 2s], shared_wo [s, d], shared_gate [d, 1] (the shared output times
      `sigmoid(x @ shared_gate)` per token).
    x: [T, d] tokens.
    config: a `MoEConfig`.
    keep: optional [T, k] bool; False (token, choice) pairs contribute nothing (dropped rows).

  Returns:
    `(y [T, d] f32, aux_loss f32, expert_ids [T, k])`.
  """
  hi = jax.lax.Precision.HIGHEST
  dt = jnp.dtype(config.dtype)
  f32 = lambda a: a.astype(dt).astype(jnp.float32)
  x = f32(x)
  logits = jnp.dot(x, params["router"].astype(jnp.float32), precision=hi)
  if config.score_func == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdims=True)
  weights, ids = jax.lax.top_k(scores, config.top_k)
  if config.norm_topk_prob:
    weights = weights / weights.sum(-1, keepdims=True)
  weights = weights * config.routed_scaling_factor
  if keep is not None:
    weights = jnp.where(keep, weights, 0.0)
  num_experts, f = config.num_experts, config.expert_ffn_dim

  def expert(e, y):
    """Adds expert e's output for every token, weighted by the token's weight for e (or 0)."""
    h = jnp.dot(x, f32(params["wi"][e]), precision=hi)
    # NOTE: outputs are rounded to config.dtype where the block's gmm outputs are.
    h = h.astype(dt).astype(jnp.float32)
    act = (jax.nn.silu(h[:, :f]) * h[:, f:]).astype(dt).astype(jnp.float32)
    out = jnp.dot(act, f32(params["wo"][e]), precision=hi).astype(dt).astype(jnp.float32)
    coef = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=1)  # [T]
    return y + coef[:, None] * out

  # NOTE: a rolled loop over experts: one compiled body however many experts there are.
  y = jax.lax.fori_loop(0, num_experts, expert, jnp.zeros_like(x))
  if "shared_wi" in params:
    h = jnp.dot(x, f32(params["shared_wi"]), precision=hi)
    s = h.shape[1] // 2
    shared = jnp.dot(jax.nn.silu(h[:, :s]) * h[:, s:], f32(params["shared_wo"]), precision=hi)
    if "shared_gate" in params:
      shared = shared * jax.nn.sigmoid(jnp.dot(x, f32(params["shared_gate"]), precision=hi))
    y = y + shared
  counts = jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)
  frac = jax.lax.stop_gradient(counts / (x.shape[0] * config.top_k))
  aux = num_experts * jnp.sum(frac * probs.mean(axis=0))
  return y, aux, ids


# --- Quantized operands: references on the dequantized values ----------------------------------


def dequantize(values: jax.Array, scales: jax.Array | None) -> jax.Array:
  """`values * scales` in f32; scales broadcast (per row, column, channel or token).

  Args:
    values: an int8 / float8_e4m3fn (or float) array.
    scales: f32 scales broadcastable to `values`, or None (a float operand, returned as f32).
  """
  out = values.astype(jnp.float32)
  return out if scales is None else out * scales


def quantized_gmm(
  lhs, lhs_scales, rhs, rhs_scales, group_sizes, *, group_offset=0, existing_out=None,
  transpose_rhs=False,
) -> jax.Array:  # fmt: skip
  """gmm of the dequantized operands, f32 out: lhs [m, k] with [m, 1] row scales (or None),
  rhs [G, k, n] with [G, 1, n] scales (or [G, n, k] with [G, n, 1] when transposed)."""
  return gmm(
    dequantize(lhs, lhs_scales),
    dequantize(rhs, rhs_scales),
    group_sizes,
    jnp.float32,
    group_offset=group_offset,
    existing_out=existing_out,
    transpose_rhs=transpose_rhs,
  )


def quantized_tgmm(
  lhs, lhs_scales, rhs, rhs_scales, group_sizes, *, group_offset=0, num_actual_groups=None,
  existing_out=None, round_token_scaled_to=None,
) -> jax.Array:  # fmt: skip
  """tgmm of the dequantized operands, f32 out.

  Args:
    lhs: [k, m] with scales [k, 1] / [1, m] (or None for a float lhs).
    lhs_scales: see lhs.
    rhs: [m, n] with scales [1, n] / [m, 1] (or None).
    rhs_scales: see rhs.
    group_sizes: as `tgmm`.
    group_offset: as `tgmm`.
    num_actual_groups: as `tgmm`.
    existing_out: as `tgmm`.
    round_token_scaled_to: a dtype: round each operand that has per-token scales, after scaling,
      to it (the kernel multiplies token-scaled values in its compute dtype).
  """
  k, m = lhs.shape

  def deq(values, scales, channel_shape):
    out = dequantize(values, scales)
    token = scales is not None and tuple(scales.shape) != channel_shape
    if token and round_token_scaled_to is not None:
      out = out.astype(round_token_scaled_to).astype(jnp.float32)
    return out

  return tgmm(
    deq(lhs, lhs_scales, (k, 1)),
    deq(rhs, rhs_scales, (1, rhs.shape[1])),
    group_sizes,
    jnp.float32,
    group_offset=group_offset,
    num_actual_groups=num_actual_groups,
    existing_out=existing_out,
  )
