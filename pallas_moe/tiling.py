"""TPU generation facts and tile heuristics for the grouped matmuls.

Facts (per chip) come from DESIGN.md, which agrees with jax's own table in
`jax/_src/pallas/mosaic/tpu_info.py` (jax 0.10.2). The *scoped* VMEM default is what Mosaic lets
one kernel use when `pltpu.CompilerParams(vmem_limit_bytes=...)` is not set; it is much smaller
than the physical VMEM. jax does not ship these defaults (libtpu owns them). The figures below
are the ones publicly reported for the XLA flag `--xla_tpu_scoped_vmem_limit_kib`
(16 MiB on v4/v5e/v5p, 32 MiB on v6e and tpu7x); tpu7x's is the least certain.
AOT check (libtpu for jax 0.10.2, upstream megablox gmm bf16, no vmem_limit_bytes): on v5e:2x2
(512,1024,1024) compiles and (512,2048,1024) fails with CompileTimeScopedVmemOom (its blocks +
accumulator alone are 16 MiB); on v6e:2x2 (512,2048,2048) compiles (blocks + acc 28 MiB) and
(1024,2048,2048) fails. `vmem_estimate_bytes` says 14.2 / 20.8 / 36.2 / 53.8 MiB for these, so
it is on the safe side (by up to ~8 MiB at large tiles).
Our gmm kernel (AOT, same libtpu): without the lhs-copy term the estimate said "fits" for
(512,4096,256) (15.8 MiB) and (1024,2048,256) (15.3 MiB) on v5e, but Mosaic needed 17.0 and
16.1 MiB (buffers + accumulator + about one lhs block). With it, every bf16 tiling we probed that
the estimate admits compiles (tests/test_aot.py re-checks a set near the v5e and v6e budgets).

When a tiling needs more than the scoped default, a kernel must pass
`pltpu.CompilerParams(vmem_limit_bytes=...)` (jax documents that it overrides the default limit;
on older libtpu builds the XLA flag also had to be raised). `pick_tiling` therefore stays within
the scoped default unless it is given a larger `vmem_budget_bytes`; a kernel that passes a larger
budget should set `vmem_limit_bytes` to the same figure.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
  "TpuGeneration",
  "GENERATIONS",
  "get_generation",
  "current_generation",
  "use_generation",
  "usable_vmem_bytes",
  "vmem_limit_for",
  "vmem_estimate_bytes",
  "check_fits_vmem",
  "pick_tiling",
  "pick_rowtile_tiling",
  "rowtile_manual_dma",
  "rowtile_modeled_seconds",
  "narrow_peak",
  "rows_per_pass",
  "rows_stationary_pays",
  "rowtile_step_costs",
  "sequential_sweeps",
]

_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuGeneration:
  """Per-chip facts of one TPU generation.

  Attributes:
    name: short name ("v5e", "v6e", ...).
    vmem_bytes: physical VMEM per TensorCore.
    scoped_vmem_default_bytes: Mosaic's default per-kernel VMEM limit (no `vmem_limit_bytes`).
    mxu_size: systolic array edge (rows per MXU pass, and weight tile edge).
    peak_bf16_flops: chip peak bf16 flop/s.
    supports_int8: native int8 x int8 MXU matmul (int32 accumulation), faster than bf16.
    supports_fp8: native float8_e4m3fn x float8_e4m3fn MXU matmul, faster than bf16.
    peak_int8_ops: chip peak int8 op/s where `supports_int8`, else 0.
    peak_fp8_ops: chip peak fp8 flop/s where `supports_fp8`, else 0.
    hbm_bytes_per_s: chip HBM bandwidth.
    cores_per_chip: TensorCores per chip.
    aot_topology: topology name for ahead-of-time compilation (`get_topology_desc`).
    device_kinds: `jax.Device.device_kind` strings of this generation.
  """

  name: str
  vmem_bytes: int
  scoped_vmem_default_bytes: int
  mxu_size: int
  peak_bf16_flops: float
  supports_int8: bool
  supports_fp8: bool
  hbm_bytes_per_s: float
  cores_per_chip: int
  aot_topology: str
  device_kinds: tuple[str, ...] = ()
  peak_int8_ops: float = 0.0
  peak_fp8_ops: float = 0.0


# NOTE on the narrow MXU modes (int8 / fp8). Sources: Cloud TPU docs per chip ("Peak compute per
# chip (Int8)": v5e 393 TOPs, v5p 918 TOPs, v6e 1836 TOPs; tpu7x "(fp8)": 4614 TFLOPs) and jax
# 0.10.2's `jax/_src/pallas/mosaic/tpu_info.py`, whose `is_matmul_supported` lists int8 x int8 for
# generations 5 and 6 but float8_e4m3fn only from generation 7 (v5/v6 list e5m2 and e4m3b11fnuz),
# gives v6e's fp8 rate as its bf16 rate (9.2e14), and lists no int8 rate for tpu7x or v4.
# So v6e gets no fp8 credit: Mosaic accepts an e4m3fn dot there (AOT, also on v5e) but gains
# nothing over bf16; our kernels upcast in VMEM instead. v4 rejects int8 and fp8 dots outright
# (AOT: CompileTimeMosaicUnsupportedRhsType).


GENERATIONS: dict[str, TpuGeneration] = {
  g.name: g
  for g in (
    TpuGeneration(
      name="v4",
      vmem_bytes=16 * _MIB,
      scoped_vmem_default_bytes=16 * _MIB,
      mxu_size=128,
      peak_bf16_flops=275e12,
      supports_int8=False,
      supports_fp8=False,
      hbm_bytes_per_s=1200e9,
      cores_per_chip=2,
      aot_topology="v4:2x2x1",
      device_kinds=("TPU v4",),
    ),
    TpuGeneration(
      name="v5e",
      vmem_bytes=128 * _MIB,
      scoped_vmem_default_bytes=16 * _MIB,
      mxu_size=128,
      peak_bf16_flops=197e12,
      supports_int8=True,
      supports_fp8=False,
      peak_int8_ops=393e12,
      hbm_bytes_per_s=819e9,
      cores_per_chip=1,
      aot_topology="v5e:2x2",
      device_kinds=("TPU v5e", "TPU v5 lite"),
    ),
    TpuGeneration(
      name="v5p",
      vmem_bytes=64 * _MIB,
      scoped_vmem_default_bytes=16 * _MIB,
      mxu_size=128,
      peak_bf16_flops=459e12,
      supports_int8=True,
      supports_fp8=False,
      peak_int8_ops=918e12,
      hbm_bytes_per_s=2765e9,
      cores_per_chip=2,
      aot_topology="v5p:2x2x1",
      device_kinds=("TPU v5", "TPU v5p"),
    ),
    TpuGeneration(
      name="v6e",
      vmem_bytes=128 * _MIB,
      scoped_vmem_default_bytes=32 * _MIB,
      mxu_size=256,
      peak_bf16_flops=918e12,
      supports_int8=True,
      supports_fp8=False,
      peak_int8_ops=1836e12,
      hbm_bytes_per_s=1638e9,
      cores_per_chip=1,
      aot_topology="v6e:2x2",
      device_kinds=("TPU v6e", "TPU v6 lite"),
    ),
    TpuGeneration(
      name="tpu7x",
      vmem_bytes=64 * _MIB,
      scoped_vmem_default_bytes=32 * _MIB,
      mxu_size=256,
      peak_bf16_flops=2307e12,
      supports_int8=False,
      supports_fp8=True,
      peak_fp8_ops=4614e12,
      hbm_bytes_per_s=7380e9,
      cores_per_chip=2,
      aot_topology="tpu7x:2x2x1",
      device_kinds=("TPU7x",),
    ),
  )
}

_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "7x": "tpu7x", "v7x": "tpu7x"}


def get_generation(name: str | TpuGeneration) -> TpuGeneration:
  """Looks up a TPU generation by short name.

  Args:
    name: "v4", "v5e", "v5p", "v6e" or "tpu7x" (a few aliases accepted), or a `TpuGeneration`
      (returned as is).

  Returns:
    The `TpuGeneration`.
  """
  if isinstance(name, TpuGeneration):
    return name
  key = _ALIASES.get(name.lower(), name.lower())
  if key not in GENERATIONS:
    raise ValueError(f"Unknown TPU generation {name!r}; known: {sorted(GENERATIONS)}")
  return GENERATIONS[key]


_GENERATION_OVERRIDE: contextvars.ContextVar[TpuGeneration | None] = contextvars.ContextVar(
  "pallas_moe_tpu_generation", default=None
)


@contextlib.contextmanager
def use_generation(generation: str | TpuGeneration) -> Iterator[TpuGeneration]:
  """Makes `current_generation()` return `generation` inside the block.

  For ahead-of-time compilation from a host that is not that TPU (e.g. compiling for a v6e
  topology from a CPU): the default tiles (`pick_tiling`) and the VMEM check of `pallas_moe.gmm`
  / `tgmm` then follow the target, not the host. The override applies when the ops are *traced*
  (e.g. inside `jax.jit(f).lower(...)`), so lower inside the block. Nests; thread- and
  asyncio-safe (a `contextvars.ContextVar`).

  Args:
    generation: a generation name ("v5e", "v6e", ...) or a `TpuGeneration`.

  Yields:
    The `TpuGeneration` in effect.
  """
  gen = get_generation(generation)
  token = _GENERATION_OVERRIDE.set(gen)
  try:
    yield gen
  finally:
    _GENERATION_OVERRIDE.reset(token)


def current_generation() -> TpuGeneration:
  """The generation set by `use_generation`, else that of `jax.devices()[0]` on TPU, else v5e.

  Returns:
    The `TpuGeneration`.
  """
  override = _GENERATION_OVERRIDE.get()
  if override is not None:
    return override
  import jax

  try:
    kind = jax.devices()[0].device_kind
  except RuntimeError:
    return GENERATIONS["v5e"]
  for gen in GENERATIONS.values():
    if kind in gen.device_kinds:
      return gen
  return GENERATIONS["v5e"]


# Headroom for Mosaic's internal scratch (relayout buffers, spills, semaphores): a fixed amount
# plus a fraction of the explicit buffers. Conservative by design.
_MOSAIC_FIXED_MARGIN = 1 * _MIB
_MOSAIC_FRACTION_MARGIN = 0.10


def _itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize


def narrow_peak(generation: str | TpuGeneration, dtype) -> float:
  """MXU rate of a dot that multiplies two `dtype` (int8 / fp8) operands natively.

  Raises:
    ValueError: the generation has no native mode for `dtype` (its dots upcast to bf16).
  """
  gen = get_generation(generation)
  name = np.dtype(dtype).name
  if name == "int8" and gen.supports_int8:
    return gen.peak_int8_ops
  if name.startswith("float8") and gen.supports_fp8:
    return gen.peak_fp8_ops
  raise ValueError(f"{gen.name} has no native {name} MXU mode: its {name} dots run upcast.")


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
    # NOTE: calibrated on real Mosaic (AOT, the smallest vmem_limit_bytes that compiles), v6e:
    # (512, 4096, 3584) needs 74 MiB, (512, 14336, 1024) transposed 94 MiB, (256, 4096, 1792)
    # with existing_out 34 MiB; (256, 14336, 512) transposed needs 46 MiB on v5e and v5p, 50 on
    # v6e, 43 on tpu7x. Pipelined lhs [tm, k], out and existing_out [tm, tn] blocks (x2), two
    # manual weight slots [k, tn], the f32 product of one sub-block and, except on tpu7x, a copy
    # of its lhs rows; quantized weights add the upcast block and the scale slots.
    gen = get_generation(generation) if generation is not None else None
    mxu = gen.mxu_size if gen is not None else _MAX_SUB_M
    sub = rows_per_pass(tm, mxu)
    # NOTE: with rows_stationary the lhs rows are the dot's transposed operand; tpu7x then copies
    # them too (AOT: (1024, 2048, 1408) with existing_out needs 31 MiB usual, 39 MiB swapped).
    lhs_copy = gen is None or gen.name != "tpu7x" or rows_stationary
    blocks = 2 * tm * tk * li + 4 * tm * tn * oi + 2 * tk * tn * ri
    temps = sub * tn * 4 + (sub * tk * li if lhs_copy else 0)
    if ri == 1:
      temps += tk * tn * 2 + 2 * tk * 4 + 2 * tn * 4
    if rows_stationary:
      # NOTE: the [tn, k] transposed weights (counted also with transposed rhs, where the slot
      # is read directly: the estimate does not know the layout) and the transposed product.
      temps += tk * tn * max(ri, 2) + sub * tn * 4
    return int(blocks + temps + _ROWTILE_MARGIN)
  elif kind == "tgmm_rowtile":
    # NOTE: calibrated likewise: (1024, 2048, 1792) needs 45 MiB (64 with existing_out),
    # (512, 1024, 1024) 13 MiB. Pipelined lhs [tk, tm] and rhs [tm, tn] blocks (x2), the f32
    # accumulator, two staging slots, the existing_out buffer with its f32 sum (counted always:
    # the estimate does not know whether the call has one), and the masked sub-block operands.
    gen = get_generation(generation) if generation is not None else None
    mxu = gen.mxu_size if gen is not None else _MAX_SUB_M
    sub = rows_per_pass(tm, mxu)
    blocks = 2 * tm * tk * li + 2 * tm * tn * ri
    acc = tk * tn * 4 + 2 * tk * tn * oi + tk * tn * (oi + 4)
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
# figures within 1-3 MiB, above them); a fixed margin covers Mosaic's internal scratch.
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


def _pow2_floor(x: float) -> int:
  return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


def _dim_candidates(dim: int, mxu: int) -> list[int]:
  """Tile sizes for a k or n dimension: the full dim, and multiples of the MXU edge up to 4096
  that divide it (a ragged last tile, or a tile that is not a multiple of the MXU edge, still
  costs full MXU tiles); failing that 128-multiples that divide it; failing that any."""
  for step, need_divisor in ((mxu, True), (128, True), (128, False)):
    cands = [
      t
      for t in range(step, min(dim, 4096 + 1), step)
      if t < dim and (dim % t == 0 or not need_divisor)
    ]
    if cands:
      return sorted({dim, *cands}, reverse=True)
  return [dim]


def usable_vmem_bytes(generation: str | TpuGeneration) -> int:
  """VMEM our kernels may ask Mosaic for (`vmem_limit_bytes`): 3/4 of the physical VMEM.

  The rest is left to Mosaic's internal scratch and to what our estimate misses.
  """
  return get_generation(generation).vmem_bytes * 3 // 4


def vmem_limit_for(estimate_bytes: int, generation: str | TpuGeneration) -> int | None:
  """The `vmem_limit_bytes` a kernel with this VMEM estimate must pass (None: the default does)."""
  gen = get_generation(generation)
  if estimate_bytes <= gen.scoped_vmem_default_bytes:
    return None
  return usable_vmem_bytes(gen)


def _tm_candidates(m: int, mxu: int) -> list[int]:
  cands = [t for t in (mxu, 2 * mxu, 512, 1024, 2048) if t % mxu == 0 and t < m]
  return sorted(set(cands)) + [m] if m <= 2048 else sorted(set(cands))


def pick_tiling(
  *,
  m: int,
  k: int,
  n: int,
  num_groups: int,
  kind: str,
  lhs_dtype,
  rhs_dtype,
  out_dtype,
  generation: str | TpuGeneration,
  vmem_budget_bytes: int | None = None,
  step_overhead_s: float = 0.35e-6,
) -> tuple[int, int, int]:
  """Chooses (tm, tk, tn) for a gmm or tgmm by a small cost model of our kernels.

  Our kernels multiply an m-tile in sub-blocks of the MXU's row count and skip sub-blocks outside
  the visit's group, so MXU work does not grow with tm; what tm, tk and tn change is HBM traffic
  and the number of grid steps. Every candidate that fits the VMEM budget is scored by
  max(MXU time, HBM time) + steps x per-step overhead (of those within 2% of the best, the one
  needing the least VMEM wins), where:

  - gmm: with tk == k an m-tile's lhs block keeps its block index over the consecutive visits of
    the groups that share it, and the expert's weight block keeps its index over the group's
    consecutive visits: lhs is read once per n tile and weights once. With tk < k both are
    re-fetched on every visit (k is the innermost grid axis): (m/tm + G) x (tm k + k n) per n tile.
  - tgmm: lhs [k, m] is read once per n tile and dout [m, n] once per k tile.
  - MXU time counts the ragged last k and n tiles as full tiles.

  Args:
    m: rows (tokens x top_k on this device).
    k: contraction dim of gmm (d_model), or tgmm's output rows.
    n: output columns.
    num_groups: local experts.
    kind: "gmm" or "tgmm" (for tgmm, m is the contraction dim; out is [G, k, n]).
    lhs_dtype: lhs element type.
    rhs_dtype: rhs element type.
    out_dtype: output element type.
    generation: TPU generation (name or `TpuGeneration`).
    vmem_budget_bytes: VMEM budget; default `usable_vmem_bytes(generation)`. The kernels set
      `vmem_limit_bytes` (see `vmem_limit_for`) when a tiling needs more than the scoped default.
    step_overhead_s: per grid step overhead.

  Returns:
    (tm, tk, tn): tm a multiple of the MXU size (or m), tk and tn multiples of 128 or full dims.
  """
  if kind not in ("gmm", "tgmm"):
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  gen = get_generation(generation)
  budget = vmem_budget_bytes if vmem_budget_bytes is not None else usable_vmem_bytes(gen)
  li, ri, oi = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
  bw, peak = gen.hbm_bytes_per_s, gen.peak_bf16_flops
  scored = []
  for tm in _tm_candidates(m, gen.mxu_size):
    visits = -(-m // tm) + num_groups
    for tk in _dim_candidates(k, gen.mxu_size):
      for tn in _dim_candidates(n, gen.mxu_size):
        est = vmem_estimate_bytes(
          tm=tm,
          tk=tk,
          tn=tn,
          lhs_dtype=lhs_dtype,
          rhs_dtype=rhs_dtype,
          out_dtype=out_dtype,
          kind=kind,
        )
        if est > budget:
          continue
        nk, nn = -(-k // tk), -(-n // tn)
        if kind == "gmm":
          if nk == 1:
            traffic = m * k * li * nn + num_groups * k * n * ri
          else:
            traffic = visits * (tm * k * li + k * tn * ri) * nn
          traffic += m * n * oi
        else:
          traffic = m * k * li * nn + m * n * ri * nk + num_groups * k * n * oi
        mxu_s = 2 * m * (nk * tk) * (nn * tn) / peak
        steps = visits * nk * nn
        score = max(mxu_s, traffic / bw) + steps * step_overhead_s
        scored.append((score, est, (tm, tk, tn)))
  if not scored:
    raise ValueError(
      f"no {kind} tiling fits {budget / _MIB:.1f} MiB of VMEM on {gen.name} "
      f"for (m, k, n)={(m, k, n)}"
    )
  # NOTE: among tilings within 2% of the best modeled time, take the one needing the least VMEM:
  # bigger blocks buy nothing once a kernel is MXU-bound, and they cost Mosaic compile time.
  best_score = min(score for score, _, _ in scored)
  return min((est, tiles) for score, est, tiles in scored if score <= 1.02 * best_score)[1]


# ------------------------------------------------------------------------------------------------
# Row-tile kernels (`gmm_rowtile_pallas`, `tgmm_rowtile_pallas`): one grid step per m-tile.


_PICKER_SEED = 20261122


def _divisor_tiles(dim: int) -> list[int]:
  """Tiles of a dim the row-tile kernels can use: the dim itself and 128-multiples dividing it
  (their per-group DMAs move whole blocks, so tiles must divide the dim)."""
  return sorted({dim, *(t for t in range(128, dim, 128) if dim % t == 0)})


def sequential_sweeps(generation: str | TpuGeneration) -> bool:
  """Whether the row-tile kernels run their sweeps in order with DMAs crossing them.

  On a chip with one TensorCore (v5e, v6e) a grid runs in order anyway, so the kernels prefetch
  across sweeps; with two (megacore: v4, v5p, tpu7x) the sweeps stay independent so that they can
  be split between the cores.
  """
  return get_generation(generation).cores_per_chip == 1


def rows_per_pass(tm: int, mxu: int) -> int:
  """Rows the kernels push through the MXU per sub-block (their `sub_m`): the MXU edge when it
  divides tm (sub-blocks without rows of a group are skipped), else the whole tile."""
  return mxu if tm % mxu == 0 else tm


def _dot_macs(*, rows: int, contract: int, cols: int, mxu: int) -> int:
  """MACs one dot costs on an mxu x mxu systolic array (DESIGN.md, as in `bench.costmodel`):
  the stationary operand is cut into mxu x mxu tiles (contraction and output columns padded to
  the MXU), and each tile costs at least mxu row passes (loading it takes as long)."""
  pad = lambda d: -(-d // mxu) * mxu  # noqa: E731
  return max(rows, mxu) * pad(contract) * pad(cols)


def rows_stationary_pays(
  *, kind: str, sub_m: int, tk: int, tn: int, generation: str | TpuGeneration
) -> bool:
  """Whether a row-tile kernel does less MXU work with its sub-block rows as the stationary
  operand (the kernels' `rows_stationary`: out^T = w^T @ x^T streams the tn columns as rows).

  The usual orientation streams the sub_m rows through [contraction, tn] weight tiles, so a tn
  that is not a multiple of the MXU width is padded to it (1408 -> 1536 on a 256-wide MXU:
  1.09x). Swapped, the rows are padded instead, and a sub_m that is a multiple of the MXU is not.
  Ties keep the usual orientation, which needs no transposes.

  Args:
    kind: "gmm" (contraction tk = the whole k; output [sub_m, tn]) or "tgmm" (contraction
      sub_m; output [tk, tn]).
    sub_m: rows per MXU pass.
    tk: gmm: k; tgmm: its k tile.
    tn: n tile.
    generation: TPU generation (its MXU edge).

  Returns:
    True when the swapped orientation costs strictly fewer MACs.
  """
  mxu = get_generation(generation).mxu_size
  if kind == "gmm":
    usual = _dot_macs(rows=sub_m, contract=tk, cols=tn, mxu=mxu)
    swapped = _dot_macs(rows=tn, contract=tk, cols=sub_m, mxu=mxu)
  elif kind == "tgmm":
    usual = _dot_macs(rows=tk, contract=sub_m, cols=tn, mxu=mxu)
    swapped = _dot_macs(rows=tn, contract=sub_m, cols=tk, mxu=mxu)
  else:
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  return swapped < usual


def _rowtile_pairs(starts: np.ndarray, ends: np.ndarray, *, tm: int, sub_m: int):
  """The (group, m-tile) pairs a row-tile kernel multiplies, and the sub-blocks of each.

  Args:
    starts: [groups] first row of each group (int64).
    ends: [groups] end row of each group.
    tm: m tile.
    sub_m: rows per MXU pass.

  Returns:
    (pair_group, pair_tile, pair_hits), in group order: every non-empty group with each tile it
    intersects, and the number of its sub_m-row sub-blocks there.
  """
  nonempty = ends > starts
  first_t = np.where(nonempty, starts // tm, 0)
  last_t = np.where(nonempty, (np.maximum(ends, 1) - 1) // tm, -1)
  counts = np.maximum(last_t - first_t + 1, 0)
  pair_g = np.repeat(np.arange(starts.size), counts)
  pair_t = np.repeat(first_t, counts) + (
    np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
  )
  lo = pair_t * tm
  s = np.maximum(starts[pair_g], lo) - lo
  e = np.minimum(ends[pair_g], lo + tm) - lo
  return pair_g, pair_t, (e - 1) // sub_m - s // sub_m + 1


def rowtile_manual_dma(
  *,
  starts,
  ends,
  m: int,
  tm: int,
  sub_m: int,
  kind: str,
  sweeps: int,
  block_bytes: float,
  sequential_sweeps: bool,
) -> tuple[np.ndarray, np.ndarray]:
  """Per grid step: bytes of the row-tile kernels' manual DMAs, split into overlapped and exposed.

  A manual DMA runs from the point the kernel starts it to the point it waits for it, concurrent
  with the MXU work in between: gmm starts a group's weight load when the previous group starts
  computing and waits for it before the group computes; tgmm starts a group's output write after
  its last rows are reduced and waits for it when the write two later needs its staging slot (or
  at the drain). The bytes are spread over that window's (group, tile) sub-block work in
  proportion to its MXU rows, and counted in the grid steps doing that work, so a step's time is
  max(MXU, pipelined + overlapped bytes / bandwidth). A DMA with no MXU work in its window (the
  first load of a sweep, the last write before a drain) stalls the kernel: its bytes are
  "exposed", added to the step that waits for it on top of that max.

  Args:
    starts: [local groups] first row of each local group (numpy, sorted, clipped to m).
    ends: [local groups] end row of each local group.
    m: rows.
    tm: m tile.
    sub_m: rows per MXU pass.
    kind: "gmm" (weight loads) or "tgmm" (output writes).
    sweeps: grid steps over the other axes (gmm: n-tiles; tgmm: k-tiles x n-tiles).
    block_bytes: bytes of one load / write.
    sequential_sweeps: the kernels' option: DMAs cross sweeps (see the kernels).

  Returns:
    (overlapped, exposed), each [sweeps * tiles_m] bytes in grid-step order.
  """
  if kind not in ("gmm", "tgmm"):
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  starts = np.asarray(starts, np.int64)
  ends = np.asarray(ends, np.int64)
  num_groups = starts.size
  tiles_m = max(1, -(-m // tm))
  nonempty = ends > starts
  # NOTE: the work of one sweep as (tile, group) pairs in kernel order (tiles in order, groups in
  # order within a tile), each with the MXU rows it pushes; tgmm also has a pair without work
  # where an empty group is finalized.
  first_t = np.where(nonempty, starts // tm, 0)
  pair_g, pair_t, pair_hits = _rowtile_pairs(starts, ends, tm=tm, sub_m=sub_m)
  pair_rows = pair_hits * sub_m
  fin = None
  if kind == "tgmm":
    fin = np.clip(np.where(nonempty, (ends - 1) // tm, starts // tm), 0, tiles_m - 1)
    empty = np.flatnonzero(~nonempty)
    pair_g = np.concatenate([pair_g, empty])
    pair_t = np.concatenate([pair_t, fin[empty]])
    pair_rows = np.concatenate([pair_rows, np.zeros(empty.size, np.int64)])
  order = np.lexsort((pair_g, pair_t))
  pair_g, pair_t, pair_rows = pair_g[order], pair_t[order], pair_rows[order]
  num_pairs = pair_g.size
  pair_key = pair_t * num_groups + pair_g
  # Two consecutive sweeps, for DMAs that cross from one into the next.
  step2 = np.concatenate([pair_t, pair_t + tiles_m])
  cum2 = np.concatenate([[0], np.cumsum(np.concatenate([pair_rows, pair_rows]))]).astype(np.float64)
  rows2 = np.concatenate([pair_rows, pair_rows]).astype(np.float64)

  def spread(windows):
    """windows: (first pair, end pair (exclusive), step that waits) over two sweeps."""
    over = np.zeros(2 * tiles_m)
    exposed = np.zeros(2 * tiles_m)
    for i, j, wait_step in windows:
      work = cum2[j] - cum2[i]
      if work > 0:
        np.add.at(over, step2[i:j], block_bytes * rows2[i:j] / work)
      else:
        exposed[wait_step] += block_bytes
    return over, exposed

  if kind == "gmm":
    # NOTE: load r is waited at group r's first pair and started at group r - 1's first pair.
    loaded = np.flatnonzero(nonempty)
    first_pair = np.searchsorted(pair_key, first_t[loaded] * num_groups + loaded)
    loads = first_pair.size
    within = [(first_pair[r - 1], first_pair[r], pair_t[first_pair[r]]) for r in range(1, loads)]
    # The first load of a sweep, started where it is waited for.
    head_alone = [(first_pair[0], first_pair[0], pair_t[first_pair[0]])] if loads else []
    # With sequential sweeps: started at the previous sweep's last group.
    cross = (
      [(first_pair[-1], num_pairs + first_pair[0], tiles_m + pair_t[first_pair[0]])]
      if loads
      else []
    )
    tail_alone = []
  else:
    # NOTE: write g is started after its finalize pair and waited at write g + 2's finalize
    # (after that pair's work), or at the drain after the sweep's (or the grid's) last pair.
    fin_pair = np.searchsorted(pair_key, fin * num_groups + np.arange(num_groups))
    within = [
      (fin_pair[g] + 1, fin_pair[g + 2] + 1, pair_t[fin_pair[g + 2]]) for g in range(num_groups - 2)
    ]
    last_two = range(max(num_groups - 2, 0), num_groups)
    tail_alone = [(fin_pair[g] + 1, num_pairs, tiles_m - 1) for g in last_two]
    head_alone = []
    if num_groups >= 2:
      cross = [
        (
          fin_pair[g] + 1,
          num_pairs + fin_pair[g + 2 - num_groups] + 1,
          tiles_m + pair_t[fin_pair[g + 2 - num_groups]],
        )
        for g in last_two
      ]
    else:
      # NOTE: a single group waits for the write two sweeps back; counted as if one sweep back.
      cross = [(fin_pair[0] + 1, 2 * num_pairs, 2 * tiles_m - 1)] if num_groups else []
  w_over, w_exp = spread(within)
  h_over, h_exp = spread(head_alone)
  t_over, t_exp = spread(tail_alone)
  c_over, c_exp = spread(cross)
  over = np.zeros((sweeps, tiles_m))
  exposed = np.zeros((sweeps, tiles_m))
  over += w_over[:tiles_m]
  exposed += w_exp[:tiles_m]
  if not sequential_sweeps:
    over += h_over[:tiles_m] + t_over[:tiles_m]
    exposed += h_exp[:tiles_m] + t_exp[:tiles_m]
  else:
    over[0] += h_over[:tiles_m]
    exposed[0] += h_exp[:tiles_m]
    over[-1] += t_over[:tiles_m]
    exposed[-1] += t_exp[:tiles_m]
    over[:-1] += c_over[:tiles_m]
    exposed[:-1] += c_exp[:tiles_m]
    over[1:] += c_over[tiles_m:]
    exposed[1:] += c_exp[tiles_m:]
  return over.reshape(-1), exposed.reshape(-1)


def rowtile_step_costs(
  *,
  group_sizes,
  k: int,
  n: int,
  tm: int,
  tk: int,
  tn: int,
  kind: str,
  lhs_itemsize: int,
  rhs_itemsize: int,
  out_itemsize: int,
  generation: str | TpuGeneration,
  peak_flops: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-step MXU seconds and HBM bytes of a row-tile kernel's whole grid.

  The same accounting as `bench.costmodel` applies to the real kernel (pipelined blocks, plus the
  manual per-group DMAs spread over the work they overlap, `rowtile_manual_dma`), in closed form
  from the group sizes: the picker's model. The kernels' `sequential_sweeps` follows the
  generation, as in `pallas_moe.ops`.

  Args:
    group_sizes: rows per local group (numpy).
    k: gmm's contraction / tgmm's output rows.
    n: output columns.
    tm: m tile.
    tk: tgmm's k tile (gmm: k).
    tn: n tile.
    kind: "gmm" or "tgmm".
    lhs_itemsize: bytes per lhs element.
    rhs_itemsize: bytes per rhs element.
    out_itemsize: bytes per output element.
    generation: TPU generation.
    peak_flops: the dot's MXU rate (default the bf16 peak; `narrow_peak` for a narrow dot).

  Returns:
    (mxu_seconds, overlapped_bytes, exposed_bytes), each [sweeps * tiles_m] in grid-step order:
    a step takes max(mxu, overlapped / bandwidth) + exposed / bandwidth.
  """
  gen = get_generation(generation)
  mxu = gen.mxu_size
  sub = rows_per_pass(tm, mxu)
  gs = np.maximum(np.asarray(group_sizes, np.int64), 0)
  ends = np.cumsum(gs)
  starts = ends - gs
  m = int(ends[-1]) if gs.size else 0
  tiles_m = max(1, -(-m // tm))
  _, t, hits = _rowtile_pairs(starts, ends, tm=tm, sub_m=sub)
  # NOTE: one sub-block dot in the orientation the kernel runs (`rows_stationary_pays`).
  swap = rows_stationary_pays(kind=kind, sub_m=sub, tk=tk, tn=tn, generation=gen)
  if kind == "gmm":
    shape = dict(rows=tn, contract=k, cols=sub) if swap else dict(rows=sub, contract=k, cols=tn)
  else:
    shape = dict(rows=tn, contract=sub, cols=tk) if swap else dict(rows=tk, contract=sub, cols=tn)
  macs = _dot_macs(**shape, mxu=mxu)
  peak = gen.peak_bf16_flops if peak_flops is None else peak_flops
  mxu_s = np.bincount(t, hits * 2.0 * macs, tiles_m) / peak
  rows = np.minimum(m, (np.arange(tiles_m) + 1) * tm) - np.arange(tiles_m) * tm
  sweeps = (k // tk) * (n // tn)
  if kind == "gmm":
    pipelined = rows * (k * lhs_itemsize + tn * out_itemsize)
    block = k * tn * rhs_itemsize
  else:
    pipelined = rows * (tk * lhs_itemsize + tn * rhs_itemsize)
    block = tk * tn * out_itemsize
  over, exposed = rowtile_manual_dma(
    starts=starts,
    ends=ends,
    m=m,
    tm=tm,
    sub_m=sub,
    kind=kind,
    sweeps=sweeps,
    block_bytes=block,
    sequential_sweeps=sequential_sweeps(gen),
  )
  return np.tile(mxu_s, sweeps), np.tile(pipelined.astype(np.float64), sweeps) + over, exposed


def rowtile_modeled_seconds(*, step_overhead_s: float = 0.35e-6, **step_costs_kwargs: Any) -> float:
  """Modeled time of a row-tile kernel's whole grid: Σ over steps of max(MXU, overlapped HBM
  time) + exposed HBM time + per-step overhead (DESIGN.md), from `rowtile_step_costs` (same
  keyword arguments)."""
  gen = get_generation(step_costs_kwargs["generation"])
  mxu_s, over, exposed = rowtile_step_costs(**step_costs_kwargs)
  bw = gen.hbm_bytes_per_s
  return float(
    np.maximum(mxu_s, over / bw).sum() + exposed.sum() / bw + step_overhead_s * mxu_s.size
  )


def pick_rowtile_tiling(
  *,
  m: int,
  k: int,
  n: int,
  num_groups: int,
  kind: str,
  lhs_dtype,
  rhs_dtype,
  out_dtype,
  generation: str | TpuGeneration,
  vmem_budget_bytes: int | None = None,
  step_overhead_s: float = 0.35e-6,
  narrow_dot: bool = False,
) -> tuple[int, int, int] | None:
  """Chooses (tm, tk, tn) for a row-tile kernel, or None when none fits VMEM.

  Scores every candidate on one uniform-routing draw of group sizes (the kernel does not see the
  real sizes when it is traced) by the sum over grid steps of max(MXU time, HBM time), plus the
  exposed DMA time (`rowtile_step_costs`) and
  the per-step overhead: the DESIGN.md model applied to the row-tile schedule. Candidates: tm in
  {128 .. 4096} (powers of two; or all of m), tn (and tgmm's tk) dividing the dim; gmm's tk is
  always k (the whole contraction stays in VMEM). Among tilings within 1% of the best, the one
  needing the least VMEM wins.

  Args:
    m: rows.
    k: gmm's contraction dim / tgmm's output rows.
    n: output columns.
    num_groups: local groups.
    kind: "gmm" or "tgmm".
    lhs_dtype: lhs element type.
    rhs_dtype: rhs element type.
    out_dtype: output element type.
    generation: TPU generation.
    vmem_budget_bytes: default `usable_vmem_bytes(generation)`.
    step_overhead_s: per grid step overhead.
    narrow_dot: gmm multiplies the 8-bit lhs and rhs natively (both `lhs_dtype`), at the chip's
      int8 / fp8 rate: less MXU time per step shifts the balance towards fewer, larger steps.

  Returns:
    (tm, tk, tn), or None.
  """
  if kind not in ("gmm", "tgmm"):
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  gen = get_generation(generation)
  budget = vmem_budget_bytes if vmem_budget_bytes is not None else usable_vmem_bytes(gen)
  li, ri, oi = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
  peak = narrow_peak(gen, lhs_dtype) if narrow_dot else None
  # NOTE: group boundaries of a real routing fall anywhere; equal sizes would put them at regular,
  # often MXU-aligned rows and hide the per-tile imbalance. A fixed-seed uniform multinomial
  # draw stands in for the routing the kernel will see.
  sizes = np.random.default_rng(_PICKER_SEED).multinomial(m, np.full(num_groups, 1 / num_groups))
  # NOTE: tgmm's tm is the lane dim of its [tk, tm] lhs block: a multiple of 128 or all of m.
  align = 128 if kind == "tgmm" else 8
  tms = {min(t, -(-m // align) * align) for t in (128, 256, 512, 1024, 2048, 4096)}
  tms = sorted(t if t < m else m for t in tms)
  tks = _divisor_tiles(k) if kind == "tgmm" else [k]
  scored = []
  for tm in sorted(set(tms)):
    for tk in tks:
      for tn in _divisor_tiles(n):
        sub = rows_per_pass(tm, gen.mxu_size)
        est = vmem_estimate_bytes(
          tm=tm,
          tk=tk,
          tn=tn,
          lhs_dtype=lhs_dtype,
          rhs_dtype=rhs_dtype,
          out_dtype=out_dtype,
          kind=f"{kind}_rowtile",
          generation=gen,
          rows_stationary=rows_stationary_pays(kind=kind, sub_m=sub, tk=tk, tn=tn, generation=gen),
        )
        if est > budget:
          continue
        score = rowtile_modeled_seconds(
          group_sizes=sizes,
          k=k,
          n=n,
          tm=tm,
          tk=tk,
          tn=tn,
          kind=kind,
          lhs_itemsize=li,
          rhs_itemsize=ri,
          out_itemsize=oi,
          generation=gen,
          peak_flops=peak,
          step_overhead_s=step_overhead_s,
        )
        scored.append((score, est, (tm, tk, tn)))
  if not scored:
    return None
  best = min(score for score, _, _ in scored)
  return min((est, tiles) for score, est, tiles in scored if score <= 1.01 * best)[1]
