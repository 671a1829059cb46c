"""Row-tile Pallas TPU transposed grouped matmul: one grid step per m-tile, outputs streamed out.

Computes the same thing as `tgmm_kernel.tgmm_pallas` (out[g] = lhs[:, rows of g] @ rhs[rows of g],
the weight gradient) with another schedule, chosen by `pallas_moe.ops` when its blocks fit VMEM:

- Grid (tiles_k, tiles_n, tiles_m). The Pallas pipeline fetches one [tk, tm] lhs block and one
  [tm, tn] rhs block per step, so every step moves the same bytes per row.
- The output stays in HBM (`pl.ANY`). The step loops over the local groups of its tile
  (`metadata.make_tile_groups`), reduces each group's MXU-row sub-blocks into one f32
  accumulator, and when a group is complete (its last row is in this tile; empty groups in the
  tile of their position) casts it into one of two VMEM staging slots and DMAs it to out[g]
  while the next groups compute.

Each output block is written once, lhs once per n-tile and rhs once per k-tile, and there are
tiles_k x tiles_n x tiles_m grid steps instead of tiles_k x tiles_n x (tiles_m + groups).

With `rows_stationary` the accumulator holds out^T = rhs^T @ lhs^T: the [sub_m, tk] lhs^T rows
are the MXU's stationary operand and the tn rhs columns stream through it, so a tn that the MXU
width does not divide is not padded to it; the sum is transposed once, when the group is written.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import common, metadata


def tgmm_rowtile_pallas(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  tiling: tuple[int, int, int],
  out_dtype: Any,
  group_offset: jax.Array,
  num_actual_groups: int,
  existing_out: jax.Array | None = None,
  sub_m: int | None = None,
  vmem_limit_bytes: int | None = None,
  sequential_sweeps: bool = False,
  rows_stationary: bool = False,
  count_rows: bool = False,
  interpret: common.Interpret = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Runs the row-tile tgmm kernel on validated arguments.

  Args:
    lhs: [k, m].
    rhs: [m, n].
    group_sizes: [num_groups_total] int32.
    tiling: (tm, tk, tn); tk must divide k and tn divide n (manual output DMAs are not ragged).
    out_dtype: dtype of the result.
    group_offset: [] int32, the first global group to compute.
    num_actual_groups: number of local groups to compute (static).
    existing_out: optional [num_actual_groups, k, n] of `out_dtype`, added to the result.
    sub_m: rows per MXU pass (divides tm); sub-blocks without rows of a group are skipped for
      that group. None: the whole tile.
    vmem_limit_bytes: Mosaic's scoped VMEM limit for the call (None: Mosaic's default).
    sequential_sweeps: the grid runs in order on one TensorCore (v5e, v6e): the output writes
      still in flight at the end of a (k, n) sweep complete while the next sweep computes, and
      are drained only after the last grid step, instead of at the end of every sweep. All grid
      axes are then "arbitrary".
    rows_stationary: accumulate out^T = rhs^T @ lhs^T: the sub-block's [sub_m, tk] lhs^T is the
      MXU's stationary operand and the tn rhs columns stream through it as rows, so a tn that is
      a multiple of 128 but not of the MXU width (1408 on a 256-wide MXU) is not padded to it.
      Costs a transpose of each [sub_m, tn] rhs sub-block and of the [tn, tk] f32 sum once per
      group. `tiling.rows_stationary_pays` says when it saves MXU work.
    count_rows: interpret-mode instrumentation: also return [tiles_k, tiles_n, tiles_m, 2] int32:
      rows pushed through the MXU and output blocks written, per grid step.
    interpret: see `common.run_kernel`.

  Returns:
    [num_actual_groups, k, n] of `out_dtype` (and the counts with `count_rows`).
  """
  k, m = lhs.shape
  n = rhs.shape[1]
  tm, tk, tn = tiling
  sub_m = tm if sub_m is None else sub_m
  if tm % sub_m:
    raise ValueError(f"sub_m={sub_m} must divide tm={tm}.")
  if k % tk or n % tn:
    raise ValueError(f"tk={tk} must divide k={k} and tn={tn} divide n={n} for the row-tile tgmm.")
  tiles_k, tiles_n, tiles_m = k // tk, n // tn, metadata.cdiv(m, tm)
  num_groups = num_actual_groups
  compute_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  groups = metadata.make_tile_groups(
    group_sizes=group_sizes,
    group_offset=group_offset,
    num_local_groups=num_groups,
    m=m,
    tm=tm,
    finalize_empty_groups=True,
  )
  prefetch = (
    groups.group_offsets,
    groups.tile_first_group,
    groups.tile_last_group,
    groups.finalize_tile,
    group_offset.reshape((1,)),
  )
  has_existing = existing_out is not None

  def kernel(offsets_ref, first_ref, last_ref, fin_ref, goff_ref, *refs):
    refs = list(refs)
    counts_ref = refs.pop(-5) if count_rows else None
    lhs_ref, rhs_ref = refs[:2]
    existing_hbm = refs[2] if has_existing else None
    out_hbm, acc_ref, staging, ex_vmem, sems = refs[-5:]
    k_i, n_i, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row0 = t * tm
    k0 = pl.multiple_of(k_i * tk, tk)
    n0 = pl.multiple_of(n_i * tn, tn)

    sweep = k_i * tiles_n + n_i

    def out_copy(w):
      # NOTE: writes are numbered in issue order across sweeps, w = sweep * G + g (groups are
      # finalized in order within a sweep); write w uses staging slot w % 2.
      w_sweep, g = w // num_groups, w % num_groups
      w_k0 = pl.multiple_of((w_sweep // tiles_n) * tk, tk)
      w_n0 = pl.multiple_of((w_sweep % tiles_n) * tn, tn)
      dst = out_hbm.at[g, common.window(w_k0, tk, k), common.window(w_n0, tn, n)]
      return pltpu.make_async_copy(staging.at[w % 2], dst, sems.at[w % 2])

    if counts_ref is not None:
      counts_ref[k_i, n_i, t, 0] = 0
      counts_ref[k_i, n_i, t, 1] = 0

    def group_body(g, carry):
      start = offsets_ref[g + goff_ref[0]]
      end = offsets_ref[g + goff_ref[0] + 1]

      # NOTE: a group that started in an earlier tile (start < row0) carries its partial sum in
      # acc; one starting here (or empty) starts from zero.
      @pl.when(start >= row0)
      def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

      first_sub = (jnp.maximum(start, row0) - row0) // sub_m
      last_sub = (jnp.minimum(end, row0 + tm) - 1 - row0) // sub_m

      def sub_body(sub, c):
        r0, rows = common.sub_block(sub, sub_m, tm)
        # NOTE: rows are the contraction dim: only rows of g in this sub-block contribute. Both
        # operands are masked: rows past m in a ragged last tile are uninitialized (NaN under
        # interpret mode) and 0 * NaN = NaN.
        lo = row0 + r0
        lhs_cols = lo + lax.broadcasted_iota(jnp.int32, (tk, sub_m), 1)
        rhs_rows = lo + lax.broadcasted_iota(jnp.int32, (sub_m, tn), 0)
        lhs_blk = jnp.where((lhs_cols >= start) & (lhs_cols < end), lhs_ref[:, rows], 0)
        rhs_blk = jnp.where((rhs_rows >= start) & (rhs_rows < end), rhs_ref[rows, :], 0)
        if rows_stationary:
          # NOTE: [sub_m, tn] contracted on its rows with [tk, sub_m] on its columns: [tn, tk].
          acc_ref[...] += lax.dot_general(
            rhs_blk.astype(compute_dtype),
            lhs_blk.astype(compute_dtype),
            dimension_numbers=(((0,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
          )
        else:
          acc_ref[...] += jnp.dot(
            lhs_blk.astype(compute_dtype),
            rhs_blk.astype(compute_dtype),
            preferred_element_type=jnp.float32,
          )
        return c

      @pl.when(end > start)
      def _accumulate():
        lax.fori_loop(first_sub, last_sub + 1, sub_body, 0)
        if counts_ref is not None:
          counts_ref[k_i, n_i, t, 0] += (last_sub + 1 - first_sub) * sub_m

      @pl.when(fin_ref[g] == t)
      def _finalize():
        w = sweep * num_groups + g
        # NOTE: the slot was last used by write w - 2; its DMA must be done before reuse. Without
        # `sequential_sweeps` every sweep drains its writes, so only g >= 2 has one in flight.
        in_flight = (w >= 2) if sequential_sweeps else (g >= 2)

        @pl.when(in_flight)
        def _wait_slot():
          out_copy(w - 2).wait()

        acc = acc_ref[...].T if rows_stationary else acc_ref[...]
        if existing_hbm is not None:
          src = existing_hbm.at[g, common.window(k0, tk, k), common.window(n0, tn, n)]
          read = pltpu.make_async_copy(src, ex_vmem, sems.at[2])
          read.start()
          read.wait()
          acc = acc + ex_vmem[...].astype(jnp.float32)
        staging[w % 2] = acc.astype(staging.dtype)
        out_copy(w).start()
        if counts_ref is not None:
          counts_ref[k_i, n_i, t, 1] += 1

      return carry

    lax.fori_loop(first_ref[t], last_ref[t] + 1, group_body, 0)

    # NOTE: every group is finalized by the last tile; drain the (at most two) writes in flight
    # so that no DMA is pending when the sweep (or, with `sequential_sweeps`, the grid) ends.
    last = t == tiles_m - 1
    if sequential_sweeps:
      last = last & (sweep == tiles_k * tiles_n - 1)

    # NOTE: the writes in flight are the last two issued: of this sweep, or with
    # `sequential_sweeps` and a single group, of this sweep and the previous one.
    in_flight = tiles_k * tiles_n * num_groups if sequential_sweeps else num_groups

    @pl.when(last)
    def _drain():
      for back in (2, 1):
        if in_flight - back >= 0:
          out_copy((sweep + 1) * num_groups - back).wait()

  # Index maps get (k_i, n_i, t, *prefetch refs).
  def lhs_map(k_i, n_i, t, *_):
    return k_i, t

  def rhs_map(k_i, n_i, t, *_):
    return t, n_i

  in_specs = [pl.BlockSpec((tk, tm), lhs_map), pl.BlockSpec((tm, tn), rhs_map)]
  operands = [lhs, rhs]
  if has_existing:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    operands.append(existing_out)
  out_bytes = num_groups * k * n * jnp.dtype(out_dtype).itemsize
  cost = pl.CostEstimate(
    flops=2 * m * k * n,
    bytes_accessed=lhs.size * lhs.dtype.itemsize * tiles_n
    + rhs.size * rhs.dtype.itemsize * tiles_k
    + out_bytes * (2 if has_existing else 1),
    transcendentals=0,
  )
  out_shape = common.out_struct(
    (num_groups, k, n), out_dtype, lhs, rhs, group_sizes, group_offset, existing_out
  )
  out_shapes = [out_shape]
  out_specs = [pl.BlockSpec(memory_space=pl.ANY)]
  if count_rows:
    out_shapes.append(jax.ShapeDtypeStruct((tiles_k, tiles_n, tiles_m, 2), jnp.int32))
    out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))

  def build(interpret):
    return pl.pallas_call(
      kernel,
      out_shape=out_shapes if count_rows else out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        in_specs=in_specs,
        out_specs=out_specs if count_rows else out_specs[0],
        grid=(tiles_k, tiles_n, tiles_m),
        scratch_shapes=[
          pltpu.VMEM((tn, tk) if rows_stationary else (tk, tn), jnp.float32),
          pltpu.VMEM((2, tk, tn), out_dtype),
          pltpu.VMEM((tk, tn), out_dtype),
          pltpu.SemaphoreType.DMA((3,)),
        ],
      ),
      # NOTE: m-tiles run in order (a group's partial sum crosses tiles). Without
      # `sequential_sweeps` writes are drained at each sweep's end, so (k, n) sweeps are
      # independent and may be split across TensorCores; with it writes cross sweeps.
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=("arbitrary",) * 3
        if sequential_sweeps
        else ("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit_bytes,
      ),
      cost_estimate=cost,
      interpret=interpret,
      name="pallas_moe_tgmm_rowtile",
    )

  if count_rows:
    common.check_instrumented(interpret)
    return build(interpret)(*prefetch, *operands)
  return common.run_kernel(build, interpret, *prefetch, *operands)
