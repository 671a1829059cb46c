"""VMEM accounting: what a tiling of each kernel needs, the budget, and the limit to pass Mosaic.

AOT check (libtpu for jax 0.10.2, upstream megablox gmm bf16, no vmem_limit_bytes): on v5e:2x2
(512,1024,1024) compiles and (512,2048,1024) fails with CompileTimeScopedVmemOom (its blocks +
accumulator alone are 16 MiB); on v6e:2x2 (512,2048,2048) compiles (blocks + acc 28 MiB) and
(1024,2048,2048) fails. `vmem_estimate_bytes` says 14.2 / 20.8 / 36.2 / 53.8 MiB for these, so
it is on the safe side (by up to ~8 MiB at large tiles).
Our gmm kernel (AOT, same libtpu): without the lhs-copy term the estimate said "fits" for
(512,4096,256) (15.8 MiB) and (1024,2048,256) (15.3 MiB) on v5e, but Mosaic needed 17.0 and
16.1 MiB (buffers + accumulator + about one lhs block). With it, every bf16 tiling we probed that
the estimate admits compiles (tests/kernels/test_aot.py re-checks a set near the v5e and v6e
budgets).

When a tiling needs more than the scoped default, a kernel must pass
`pltpu.CompilerParams(vmem_limit_bytes=...)` (jax documents that it overrides the default limit;
on older libtpu builds the XLA flag also had to be raised). `tile_pickers.pick_tiling` therefore
stays within the scoped default unless it is given a larger `vmem_budget_bytes`; a kernel that
passes a larger budget should set `vmem_limit_bytes` to the same figure.
"""

from __future__ import annotations

import numpy as np

from pallas_moe.generations import TpuGeneration, get_generation, pass_granule, rows_per_pass
from pallas_moe.metadata import merge_tail_rows
from pallas_moe.schedule_cost import gmm_pass_align

_MIB = 1024 * 1024

# Headroom for Mosaic's internal scratch (relayout buffers, spills, semaphores): a fixed amount
# plus a fraction of the explicit buffers. Conservative by design.
_MOSAIC_FIXED_MARGIN = 1 * _MIB


_MOSAIC_FRACTION_MARGIN = 0.10


def _itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize


def vmem_estimate_bytes(
  *,
  tm: int,
  tk: int,
  tn: int,
  lhs_dtype,
  rhs_dtype,
  out_dtype,
  kind: str,
  generation: str | TpuGeneration | None = None,
  rows_stationary: bool = False,
  existing_out: bool = True,
) -> int:
  """Estimates the VMEM a gmm/tgmm tiling needs.

  Counts: every pipelined input/output block twice (double buffering), the f32 accumulator
  scratch, the f32 dot result temporary, for gmm a copy of the lhs block, and for tgmm the f32
  masked copies of the two input blocks (a kernel that zeroes rows outside the group
  materializes them); then a safety margin
  for Mosaic's internal scratch (1 MiB + 10%).

  Args:
    tm: rows (tokens) per tile.
    tk: contraction (gmm) / output-row (tgmm) tile of the k dimension.
    tn: output-column tile.
    lhs_dtype: lhs element type.
    rhs_dtype: rhs element type.
    out_dtype: output element type.
    kind: "gmm" (blocks lhs[tm,tk], rhs[tk,tn], out[tm,tn], acc f32[tm,tn]), "tgmm"
      (blocks lhs[tm,tk], rhs[tm,tn], out[tk,tn], acc f32[tk,tn]), or the row-tile kernels
      "gmm_rowtile" (tk = k; weight slots instead of rhs blocks) / "tgmm_rowtile" (staging slots
      instead of out blocks).
    generation: row-tile kinds only: the chip the kernel compiles for (its MXU rows per pass
      and Mosaic's temporaries differ); None: the largest over the generations.
    rows_stationary: row-tile kinds only: the kernel runs with `rows_stationary` (transposed
      weights / products / sums).
    existing_out: "tgmm_rowtile" only: the call has an `existing_out` (its [tk, tn] block and
      f32 sum are then in VMEM too). The default counts them, the safe side.

  Returns:
    Estimated bytes.
  """
  li, ri, oi = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
  if kind == "gmm":
    blocks = tm * tk * li + tk * tn * ri + tm * tn * oi
    acc = tm * tn * 4
    # NOTE: Mosaic can materialize the loaded lhs block as a value in internal scratch (AOT,
    # v5e: (512, 4096, 256) needs 17.0 MiB = buffers + acc + ~4 MiB, the size of the lhs block).
    temps = tm * tn * 4 + tm * tk * li
  elif kind == "tgmm":
    blocks = tm * tk * li + tm * tn * ri + tk * tn * oi
    acc = tk * tn * 4
    temps = tk * tn * 4 + tm * (tk + tn) * 4
  elif kind == "gmm_rowtile":
    # NOTE: calibrated on real Mosaic (AOT, jax 0.12.0.1's libtpu: the smallest vmem_limit_bytes
    # that compiles, to 0.5 MiB): tpu7x (2048, 1536, 2048) needs 40.4 MiB, (1024, 7168, 1024)
    # 60.1, (256, 14336, 512) 42.7, (3584, 1024, 1792) 45.8; v6e (1024, 7168, 1024) 62.0,
    # (2048, 2048, 1408) 39.2, (7168, 2048, 768) 83.7; v5e (1536, 4096, 1792) 63.8; the same with
    # and without existing_out. That is the kernel's scratch: two lhs slots [tm, k],
    # two output slots [tm, tn] (existing_out's rows are DMA'd into them) and two weight slots
    # [k, tn]; except on tpu7x, a copy of one sub-block's lhs rows (v6e's 1.75 MiB at k = 7168);
    # with rows_stationary the transposed weights (tpu7x (2048, 1536, 2048): 46 MiB against 40).
    # The f32 product of one sub-block is counted too, as headroom; quantized weights add the
    # upcast block and the scale slots.
    gen = get_generation(generation) if generation is not None else None
    mxu = pass_granule(gen, kind="gmm", tn=tn) if gen is not None else _MAX_SUB_M
    sub = rows_per_pass(tm, mxu)
    # NOTE: with rows_stationary the lhs rows are the dot's transposed operand; tpu7x then copies
    # them too (AOT: (1024, 2048, 1408) with existing_out needs 31 MiB usual, 39 MiB swapped).
    lhs_copy = gen is None or gen.name != "tpu7x" or rows_stationary
    blocks = 2 * tm * tk * li + 2 * tm * tn * oi + 2 * tk * tn * ri
    # NOTE: the lhs copy is of the widest pass's rows: a widened last pass
    # (`metadata.merge_tail_rows`) has sub + tail (AOT with it: v6e (1024, 7168, 1024) needs
    # 62.9 MiB, 0.9 more, tail x k of bf16; tpu7x, with no copy, (1536, 4096, 1024) 46.0 and
    # (1536, 256, 7168) 50.8, as without).
    align = gmm_pass_align(sub_m=sub, tm=tm, lhs_itemsize=li, out_itemsize=oi)
    wide = sub + merge_tail_rows(sub_m=sub, tm=tm, align=align, rows_stationary=rows_stationary)
    temps = sub * tn * 4 + (wide * tk * li if lhs_copy else 0)
    if ri == 1:
      temps += tk * tn * 2 + 2 * tk * 4 + 2 * tn * 4
    if rows_stationary:
      # NOTE: the [tn, k] transposed weights (counted also with transposed rhs, where the slot
      # is read directly: the estimate does not know the layout) and the transposed product.
      temps += tk * tn * max(ri, 2) + sub * tn * 4
    return int(blocks + temps + _ROWTILE_MARGIN)
  elif kind == "tgmm_rowtile":
    # NOTE: calibrated likewise (v6e): (1024, 2048, 1792) needs 45.2 MiB, 64.1 with existing_out;
    # (2048, 1024, 1024) 25.0 MiB. Two slots each of lhs [tk, tm] and rhs [tm, tn] (filled by the
    # kernel's row DMAs; the size of the pipeline's double buffers they replaced), the f32
    # accumulator, two staging slots, with `existing_out` its [tk, tn] block and f32 sum, and the
    # masked sub-block operands.
    # Not counted: the [2, tk, m % 128] lhs tail buffer of a ragged m (2 * tk * 128 elements
    # with lane padding: 0.5 MiB at tk = 1024 in bf16; the estimate does not know m).
    gen = get_generation(generation) if generation is not None else None
    mxu = gen.mxu_size if gen is not None else _MAX_SUB_M
    sub = rows_per_pass(tm, mxu)
    blocks = 2 * tm * tk * li + 2 * tm * tn * ri
    acc = tk * tn * 4 + 2 * tk * tn * oi + (tk * tn * (oi + 4) if existing_out else 0)
    temps = sub * (tk + tn) * 4
    if rows_stationary:
      # NOTE: the transposed rhs sub-block. The transposed f32 sum at a group's finalize reuses
      # Mosaic's scratch (AOT, v6e: (2048, 2048, 1408) with existing_out needs 66 MiB either way).
      temps += sub * tn * 4
    return int(blocks + acc + temps + _ROWTILE_MARGIN)
  else:
    raise ValueError(f"kind must be 'gmm', 'tgmm', 'gmm_rowtile' or 'tgmm_rowtile', got {kind!r}")
  explicit = 2 * blocks + acc + temps
  return int(explicit * (1 + _MOSAIC_FRACTION_MARGIN) + _MOSAIC_FIXED_MARGIN)


# NOTE: the row-tile estimates are per-buffer sums calibrated on real Mosaic (they match the AOT
# figures within 1-4 MiB, above them); a fixed margin covers Mosaic's internal scratch.
_ROWTILE_MARGIN = 1 << 20


# Rows per MXU pass the row-tile kernels use at most (the largest MXU edge).
_MAX_SUB_M = 256


def check_fits_vmem(
  *,
  tm: int,
  tk: int,
  tn: int,
  lhs_dtype,
  rhs_dtype,
  out_dtype,
  kind: str,
  generation: str | TpuGeneration,
  vmem_limit_bytes: int | None = None,
) -> int:
  """Raises if a tiling's VMEM estimate exceeds the budget.

  Args:
    tm: m tile.
    tk: k tile.
    tn: n tile.
    lhs_dtype: lhs element type.
    rhs_dtype: rhs element type.
    out_dtype: output element type.
    kind: "gmm" or "tgmm".
    generation: TPU generation (name or `TpuGeneration`).
    vmem_limit_bytes: the kernel's `vmem_limit_bytes`, if it sets one; else the generation's
      scoped default is the budget.

  Returns:
    The estimate in bytes (when it fits).

  Raises:
    ValueError: naming the tiling, the estimate, the budget, and a smaller tiling to try.
  """
  gen = get_generation(generation)
  budget = vmem_limit_bytes if vmem_limit_bytes is not None else gen.scoped_vmem_default_bytes
  est = vmem_estimate_bytes(
    tm=tm, tk=tk, tn=tn, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype, out_dtype=out_dtype, kind=kind
  )
  if est > budget:
    smaller = _shrink(
      tm=tm,
      tk=tk,
      tn=tn,
      lhs_dtype=lhs_dtype,
      rhs_dtype=rhs_dtype,
      out_dtype=out_dtype,
      kind=kind,
      budget=budget,
    )
    hint = f"try {smaller}" if smaller else "no (8,128)-aligned tiling fits; raise the limit"
    src = "vmem_limit_bytes" if vmem_limit_bytes is not None else "scoped VMEM default"
    raise ValueError(
      f"{kind} tiling (tm, tk, tn)={(tm, tk, tn)} needs ~{est / _MIB:.1f} MiB of VMEM "
      f"(double-buffered blocks + f32 accumulator + margin) but the {gen.name} budget "
      f"({src}) is {budget / _MIB:.1f} MiB (physical {gen.vmem_bytes / _MIB:.0f} MiB); "
      f"use smaller tiles ({hint}) or pass pltpu.CompilerParams(vmem_limit_bytes=...)."
    )
  return est


def _shrink(*, tm, tk, tn, lhs_dtype, rhs_dtype, out_dtype, kind, budget):
  """Halves the largest of tn, tk, tm (keeping alignment) until the estimate fits."""
  t = [tm, tk, tn]
  mins = [8, 128, 128]
  while True:
    est = vmem_estimate_bytes(
      tm=t[0],
      tk=t[1],
      tn=t[2],
      lhs_dtype=lhs_dtype,
      rhs_dtype=rhs_dtype,
      out_dtype=out_dtype,
      kind=kind,
    )
    if est <= budget:
      return tuple(t)
    order = sorted(range(3), key=lambda i: (t[i], i == 0), reverse=True)
    for i in order:
      half = t[i] // 2 // mins[i] * mins[i]
      if half >= mins[i]:
        t[i] = half
        break
    else:
      return None


def usable_vmem_bytes(generation: str | TpuGeneration) -> int:
  """VMEM our kernels may ask Mosaic for (`vmem_limit_bytes`): 7/8 of the physical VMEM.

  Mosaic counts its internal scratch inside the limit, and our row-tile estimates are calibrated
  1-4 MiB above what Mosaic needs (`vmem_estimate_bytes`); the last 1/8 (8 MiB on tpu7x, 16 on
  v6e) is left to what an estimate misses. tokamax's TPU kernels ask for more: the whole VMEM
  (its routing-MoE gmm plan, MLA v2) or 0.95 of it (fused MoE reduce-scatter).
  """
  return get_generation(generation).vmem_bytes * 7 // 8


def vmem_limit_for(estimate_bytes: int, generation: str | TpuGeneration) -> int | None:
  """The `vmem_limit_bytes` a kernel with this VMEM estimate must pass (None: the default does)."""
  gen = get_generation(generation)
  if estimate_bytes <= gen.scoped_vmem_default_bytes:
    return None
  return usable_vmem_bytes(gen)
