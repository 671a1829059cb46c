"""What both tgmm kernels (`tgmm.tgmm_pallas`, `tgmm_rowtile.tgmm_rowtile_pallas`) share: the
cost estimate XLA gets."""

from __future__ import annotations

import jax.numpy as jnp


def tgmm_cost(
  lhs, rhs, lhs_scales, rhs_scales, *, m, k, n, rows, num_groups, out_dtype, tiles, has_existing
) -> dict[str, int]:
  """The CostEstimate a tgmm call gives XLA: the work it will do on `rows` of its m rows.

  `rows` is the caller's `expected_rows` (the real rows of an expert-parallel receive buffer)
  or all m: the kernels visit only the m-tiles holding local rows, so a buffer's slack costs
  nothing and is not counted. flops = 2 * rows * k * n; bytes: lhs's rows (and per-token
  scales) once per n-tile, rhs's once per k-tile, per-channel scales once per tile of theirs,
  the output (and existing_out) once.

  Returns:
    dict(flops=, bytes_accessed=) for `common.call_kernel`.
  """
  tiles_k, tiles_n = tiles
  frac = rows / m if m else 0.0

  def scale_bytes(scales, channel_shape, reads):
    if scales is None:
      return 0
    per_token = tuple(scales.shape) != channel_shape
    return int(scales.size * 4 * (frac if per_token else 1)) * reads

  return dict(
    flops=2 * rows * k * n,
    bytes_accessed=rows * k * lhs.dtype.itemsize * tiles_n
    + rows * n * rhs.dtype.itemsize * tiles_k
    + scale_bytes(lhs_scales, (k, 1), tiles_n)
    + scale_bytes(rhs_scales, (1, n), tiles_k)
    + num_groups * k * n * jnp.dtype(out_dtype).itemsize * (2 if has_existing else 1),
  )
