"""What both gmm kernels (`gmm.gmm_pallas`, `gmm_rowtile.gmm_rowtile_pallas`) share: their
operand checks and dot dtypes, and their result and cost-estimate arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe import common, metadata


def check_operands(
  lhs, rhs, *, transpose_rhs, rhs_scales, lhs_scales, scales_on_k, narrow_dot, tm, sub_m
):
  """Checks what both gmm kernels share and derives their shapes and dot dtypes.

  Returns:
    (m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype).
  """
  m, k = lhs.shape
  num_local_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  sub_m = common.check_sub_m(sub_m, tm)
  # NOTE: per-output-column scales are [G, 1, n] in either layout; scales along the contraction
  # (the lhs-gradient pass) keep rhs's shape with its n axis reduced to 1.
  if rhs_scales is not None:
    if scales_on_k:
      want = (num_local_groups, 1, k) if transpose_rhs else (num_local_groups, k, 1)
    else:
      want = (num_local_groups, 1, n)
    if tuple(rhs_scales.shape) != want:
      raise ValueError(f"rhs_scales has shape {tuple(rhs_scales.shape)}, expected {want}.")
  if lhs_scales is not None and tuple(lhs_scales.shape) != (m, 1):
    raise ValueError(f"lhs_scales has shape {tuple(lhs_scales.shape)}, expected {(m, 1)}.")
  compute_dtype, dot_acc_dtype = common.dot_dtypes(
    lhs.dtype,
    rhs.dtype,
    lhs_quantized=lhs_scales is not None,
    rhs_quantized=rhs_scales is not None,
    narrow_dot=narrow_dot,
    scales_allow_narrow=not scales_on_k,
    scales_requirement=" and per-output-column rhs scales (not scales_on_k)",
  )
  return m, k, n, num_local_groups, sub_m, compute_dtype, dot_acc_dtype


def f32(scales: jax.Array | None) -> jax.Array | None:
  """Scales as the kernels read them (f32), or None when the operand is not quantized."""
  return None if scales is None else scales.astype(jnp.float32)


def result_and_cost(
  lhs,
  rhs,
  rhs_scales,
  lhs_scales,
  existing_out,
  others,
  *,
  n,
  out_dtype,
  tiles_n,
  rows=None,
  whole_output=False,
  visit_tiles=None,
):
  """`common.call_kernel`'s result and cost arguments, shared by both gmm kernels.

  The result is [m, n] (aliasing existing_out when compiled). XLA's cost estimate is the work
  on `rows` rows (the caller's `expected_rows`; None: all m): flops 2 * rows * k * n; lhs's
  rows and their scales once per n-tile, rhs and its scales once, the output rows once (all m
  rows with `whole_output`, the visit kernel, which writes every tile; with existing_out all of
  it read and written). `others` are the remaining operands the result varies with (group
  sizes, offset).

  `visit_tiles=(tm, tk)`: the visit kernel's tiles. Where tk < k its k-tiles change at every
  grid step, so each visit fetches its [tm, k] lhs rows and its group's [k, tn] weights anew:
  per n-tile, `metadata.max_visits` visits of `rows` rows each read tm * k of lhs and k * tn of
  rhs (megablox's kernel, which visits the same way, declares about this too).
  """
  m, k = lhs.shape
  rows = m if rows is None else min(rows, m)
  has_existing = existing_out is not None
  operands = (lhs, rhs, *others, existing_out, rhs_scales, lhs_scales)
  out_bytes = jnp.dtype(out_dtype).itemsize * n
  lhs_rows, rhs_reads = rows, 1
  if visit_tiles is not None and visit_tiles[1] < k:
    tm = visit_tiles[0]
    # NOTE: the visits of `rows` rows: one per m-tile they cover plus at most one per group
    # whose first tile is shared with the previous group.
    visits = metadata.max_visits(m=rows, tm=tm, num_local_groups=rhs.shape[0])
    lhs_rows = visits * tm
    # NOTE: rhs.size is every group's k * n once; a visit reads its group's k * n (k * tn in
    # each of the n-tiles).
    rhs_reads = visits / rhs.shape[0]
  return dict(
    out_shape=common.out_struct((m, n), out_dtype, *operands),
    flops=2 * rows * k * n,
    bytes_accessed=lhs_rows * k * lhs.dtype.itemsize * tiles_n
    + int(rhs.size * rhs.dtype.itemsize * rhs_reads)
    + (rhs_scales.size * 4 if rhs_scales is not None else 0)
    + (lhs_rows * 4 * tiles_n if lhs_scales is not None else 0)
    + (2 * m * out_bytes if has_existing else (m if whole_output else rows) * out_bytes),
    alias_last_operand=has_existing,
  )
