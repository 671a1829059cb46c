"""Tile pickers: the default (tm, tk, tn) of each kernel for the current TPU generation.

`pick_rowtile_tiling` picks for the row-tile kernels (the default schedule) by their modeled
time (`schedule_cost`); `pick_tiling` for the visit-schedule kernels. Both keep every candidate
within the VMEM budget (`vmem`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pallas_moe.generations import (
  TpuGeneration,
  get_generation,
  narrow_peak,
  pass_rows,
)
from pallas_moe.metadata import uses_pass_cuts
from pallas_moe.schedule_cost import gmm_pass_align, rows_stationary_pays, rowtile_modeled_seconds
from pallas_moe.vmem import usable_vmem_bytes, vmem_estimate_bytes

_MIB = 1024 * 1024


def _itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize


def rowtile_vmem_bytes(
  *,
  tm: int,
  tk: int,
  tn: int,
  kind: str,
  lhs_dtype,
  rhs_dtype,
  out_dtype,
  generation: str | TpuGeneration,
  existing_out: bool = True,
) -> int:
  """VMEM a row-tile kernel needs at (tm, tk, tn), with `rows_stationary` where it pays (as the
  kernels decide it).

  Args:
    tm: rows per m-tile.
    tk: contraction tile (gmm: k).
    tn: output-column tile.
    kind: "gmm" or "tgmm".
    lhs_dtype: lhs element type.
    rhs_dtype: rhs element type.
    out_dtype: output element type.
    generation: TPU generation.
    existing_out: the call has an `existing_out` (tgmm then holds its block in VMEM).

  Returns:
    Bytes (`vmem_estimate_bytes`).
  """
  gen = get_generation(generation)
  sub = pass_rows(tm, gen, kind=kind, tn=tn)
  return vmem_estimate_bytes(
    tm=tm,
    tk=tk,
    tn=tn,
    lhs_dtype=lhs_dtype,
    rhs_dtype=rhs_dtype,
    out_dtype=out_dtype,
    kind=f"{kind}_rowtile",
    generation=gen,
    rows_stationary=rows_stationary_pays(kind=kind, sub_m=sub, tk=tk, tn=tn, generation=gen),
    existing_out=existing_out,
  )


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


def _tm_candidates(m: int, mxu: int) -> list[int]:
  cands = [t for t in (mxu, 2 * mxu, 512, 1024, 2048) if t % mxu == 0 and t < m]
  return sorted(set(cands)) + [m] if m <= 2048 else sorted(set(cands))


def pick_tiling(**kwargs: Any) -> tuple[int, int, int]:
  """Chooses (tm, tk, tn) for a gmm or tgmm by a small cost model of our kernels.

  See `visit_tiling_and_seconds` (same keyword arguments) for the model; this returns its tiles.
  """
  return visit_tiling_and_seconds(**kwargs)[0]


def visit_tiling_and_seconds(
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
  step_overhead_s: float | None = None,
) -> tuple[tuple[int, int, int], float]:
  """The visit-schedule kernels' tiles (`pick_tiling`) and their modeled seconds.

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
  - On a megacore device (v4, v5p) the kernel's "parallel" axes (gmm: n tiles; tgmm: k and n
    tiles) are split between the two TensorCores, each at half the rates: a single tile runs on
    one core.

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
    step_overhead_s: per grid step overhead; default the generation's `step_overhead_s`.

  Returns:
    ((tm, tk, tn), seconds): tm a multiple of the MXU size (or m), tk and tn multiples of 128 or
    full dims; the model's time for them.
  """
  if kind not in ("gmm", "tgmm"):
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  gen = get_generation(generation)
  budget = vmem_budget_bytes if vmem_budget_bytes is not None else usable_vmem_bytes(gen)
  if step_overhead_s is None:
    step_overhead_s = gen.step_overhead_s
  li, ri, oi = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
  bw, peak = gen.hbm_bytes_per_s, gen.peak_bf16_flops
  cores = gen.tensorcores_per_device
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
        if cores > 1:
          # NOTE: a megacore device splits the leading "parallel" axes (gmm: n tiles; tgmm: k
          # and n tiles) between its TensorCores, each at half the device's rates: the busiest
          # core runs ceil(P / cores) of the P tiles.
          par = nn if kind == "gmm" else nk * nn
          share = -(-par // cores) / par
          score = share * (cores * max(mxu_s, traffic / bw) + steps * step_overhead_s)
        scored.append((score, est, (tm, tk, tn)))
  if not scored:
    raise ValueError(
      f"no {kind} tiling fits {budget / _MIB:.1f} MiB of VMEM on {gen.name} "
      f"for (m, k, n)={(m, k, n)}"
    )
  # NOTE: among tilings within 2% of the best modeled time, take the one needing the least VMEM:
  # bigger blocks buy nothing once a kernel is MXU-bound, and they cost Mosaic compile time.
  best_score = min(score for score, _, _ in scored)
  _, tiles, score = min(
    (est, tiles, score) for score, est, tiles in scored if score <= 1.02 * best_score
  )
  return tiles, score


# Row-tile kernels (`gmm_rowtile_pallas`, `tgmm_rowtile_pallas`): one grid step per m-tile.
_PICKER_SEED = 20261122


def _divisor_tiles(dim: int) -> list[int]:
  """Tiles of a dim the row-tile kernels can use: the dim itself and 128-multiples dividing it
  (their per-group DMAs move whole blocks, so tiles must divide the dim)."""
  return sorted({dim, *(t for t in range(128, dim, 128) if dim % t == 0)})


# NOTE: 4096 / 5 rounded to 8 rows: 0, 816, ..., 3264 land at different offsets within every
# power-of-two tm from 128 to 4096 (and every tm from 3584 up). Within some tms between powers of
# two they cluster: 0-192 of 768, 0-192 and 816-912 of 1536.
_FILL_SPREAD = 816


# NOTE: gmm's m-tiles: every 256 rows to 2048, every 512 to 4096, every 1024 to 8192. Between two
# powers of two lies the tile that fills VMEM with fewer steps (tpu7x, 0.84 us each) or splits
# the rows into fewer, fuller tiles; the largest pay on v6e's 128 MiB VMEM, where HBM-bound
# problems then pay fewer steps. tgmm keeps powers of two: it also picks tk, and its scoring
# is several times gmm's.
_GMM_TMS = (
  128,
  *range(256, 2048, 256),
  *range(2048, 4096, 512),
  *range(4096, 8193, 1024),
)
_TGMM_TMS = (128, 256, 512, 1024, 2048, 4096)


def _picker_draws(*, m: int, num_groups: int, expected_rows: int | None) -> list[np.ndarray]:
  """The group sizes the row-tile pickers score on (see `pick_rowtile_tiling`)."""
  # NOTE: group boundaries of a real routing fall anywhere; equal sizes would put them at regular,
  # often MXU-aligned rows and hide the per-tile imbalance. A fixed-seed uniform multinomial
  # draw stands in for the routing the kernel will see.
  rows = m if expected_rows is None else max(1, min(int(expected_rows), m))
  # NOTE: with slack, where the real rows end relative to the tile boundaries decides how much of
  # the last visited tile's MXU sub-blocks (and, where the output is written whole, its output
  # rows) do no real work. The real count varies around the expectation, so each tiling is scored
  # at a few ends spread over the largest tm (not multiples of any smaller one): an even chance
  # for every tm.
  ends = [rows] if rows == m else sorted({min(m, rows + j * _FILL_SPREAD) for j in range(5)})
  return [
    np.random.default_rng(_PICKER_SEED).multinomial(r, np.full(num_groups, 1 / num_groups))
    for r in ends
  ]


def _draws_seconds(draws: list[np.ndarray], **kwargs: Any) -> float:
  """Mean `rowtile_modeled_seconds` over the draws."""
  return sum(rowtile_modeled_seconds(group_sizes=d, **kwargs) for d in draws) / len(draws)


# NOTE: cached: the ops call the picker each time they are traced, and scoring every candidate on
# its draws takes 0.05-1 s on large problems. Its arguments are hashable (dtypes, names or frozen
# `TpuGeneration`s, ints).
@functools.lru_cache(maxsize=256)
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
  step_overhead_s: float | None = None,
  narrow_dot: bool = False,
  expected_rows: int | None = None,
  unowned_rows: str = "zero",
  allow_pass_cuts: bool = True,
  existing_out: bool = True,
  transpose_lhs: bool = False,
) -> tuple[int, int, int] | None:
  """Chooses (tm, tk, tn) for a row-tile kernel, or None (see Returns).

  Scores every candidate on one uniform-routing draw of group sizes (the kernel does not see the
  real sizes when it is traced) by the sum over grid steps of max(MXU time, HBM time), plus the
  exposed DMA time (`rowtile_step_costs`) and the per-step overhead: the cost model of
  docs/design.md ("The cost model") applied to the row-tile schedule. Candidates: tm (or all of m)
  from 128 to 8192 for gmm (every 256 rows to 2048, then every 512 and 1024: `_GMM_TMS`), powers of
  two to 4096 for tgmm; tn (and tgmm's tk) dividing the dim; gmm's tk is always k (the whole
  contraction stays in VMEM). Among tilings within 0.25% of the best, the one needing the least VMEM
  wins.

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
    step_overhead_s: per grid step overhead; default the generation's `step_overhead_s`.
    narrow_dot: gmm multiplies the 8-bit lhs and rhs natively (both `lhs_dtype`), at the chip's
      int8 / fp8 rate: less MXU time per step shifts the balance towards fewer, larger steps.
    expected_rows: rows the caller expects sum(group_sizes) to be (default m). An expert-parallel
      receive buffer holds fewer real rows than m; the kernels visit only the m-tiles that hold
      them, so the tiles are scored on that many rows (the last, partly filled tile included:
      its lhs rows are moved only up to the real rows, rounded to the DMA granule).
    unowned_rows: gmm's `unowned_rows` ("zero", "undefined"; "existing" for an `existing_out`):
      whether the visited tiles' output is written whole (and the rest zero-filled) or only
      their real rows (`rowtile_step_costs`).
    allow_pass_cuts: gmm: the kernel may cut its m-tiles on the groups' pass grids (False: a
      quantized lhs, whose per-row scales come in m-tile blocks); tiles are then scored at the
      better of fixed and cut tiles (`rowtile_pass_cuts_pay`).
    existing_out: the call has an `existing_out` (tgmm then needs VMEM for its block; False
      admits larger tgmm tiles).
    transpose_lhs: tgmm: lhs comes as [m, k] (gmm's backward), whose passes start at each
      group's first row (`rowtile_step_costs`).

  Returns:
    (tm, tk, tn), or None: when no tiling fits VMEM, or when on a megacore device (v5p) the best
    one has fewer (k, n) sweeps than TensorCores and the visit kernel's model
    (`visit_tiling_and_seconds`) is faster.
  """
  if kind not in ("gmm", "tgmm"):
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  gen = get_generation(generation)
  budget = vmem_budget_bytes if vmem_budget_bytes is not None else usable_vmem_bytes(gen)
  if step_overhead_s is None:
    step_overhead_s = gen.step_overhead_s
  li, ri, oi = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
  peak = narrow_peak(gen, lhs_dtype) if narrow_dot else None
  # NOTE: group boundaries of a real routing fall anywhere; equal sizes would put them at regular,
  # often MXU-aligned rows and hide the per-tile imbalance. A fixed-seed uniform multinomial
  # draw stands in for the routing the kernel will see.
  draws = _picker_draws(m=m, num_groups=num_groups, expected_rows=expected_rows)
  # NOTE: tgmm's tm is the lane dim of its [tk, tm] lhs block: a multiple of 128 or all of m.
  align = 128 if kind == "tgmm" else 8
  ladder = _GMM_TMS if kind == "gmm" else _TGMM_TMS
  tms = {min(t, -(-m // align) * align) for t in ladder}
  tms = sorted(t if t < m else m for t in tms)
  tks = _divisor_tiles(k) if kind == "tgmm" else [k]
  scored = []
  for tm in sorted(set(tms)):
    for tk in tks:
      for tn in _divisor_tiles(n):
        est = rowtile_vmem_bytes(
          tm=tm,
          tk=tk,
          tn=tn,
          kind=kind,
          lhs_dtype=lhs_dtype,
          rhs_dtype=rhs_dtype,
          out_dtype=out_dtype,
          generation=gen,
          existing_out=existing_out,
        )
        if est > budget:
          continue
        # NOTE: gmm at the better of fixed and pass-cut tiles (`rowtile_pass_cuts_pay`).
        score = min(
          _draws_seconds(
            draws,
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
            buffer_rows=m,
            unowned_rows=unowned_rows,
            fixed_tiles=fixed,
            **({"transpose_lhs": transpose_lhs} if kind == "tgmm" else {}),
          )
          for fixed in ((True, False) if kind == "gmm" and allow_pass_cuts else (True,))
        )
        scored.append((score, est, (tm, tk, tn)))
  if not scored:
    return None
  best = min(score for score, _, _ in scored)
  _, tiles, seconds = min(
    (est, tiles, score) for score, est, tiles in scored if score <= 1.0025 * best
  )
  cores = gen.tensorcores_per_device
  sweeps = (k // tiles[1]) * (n // tiles[2])
  if cores > 1 and sweeps < cores:
    # NOTE: on a megacore device the row-tile kernel splits only its sweeps between the
    # TensorCores; with fewer sweeps than cores (a tn of all n, where no 128-multiple divides it:
    # 2880) a core idles, while the visit kernel splits its n-tiles, ragged or not. Its model
    # (`visit_tiling_and_seconds`) decides.
    try:
      problem = dict(m=m, k=k, n=n, num_groups=num_groups, kind=kind, out_dtype=out_dtype)
      problem.update(lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype, generation=gen)
      _, visit_seconds = visit_tiling_and_seconds(
        **problem, vmem_budget_bytes=budget, step_overhead_s=step_overhead_s
      )
    except ValueError:
      visit_seconds = float("inf")
    if visit_seconds < seconds:
      return None
  return tiles


def rowtile_pass_cuts_pay(
  *,
  m: int,
  k: int,
  n: int,
  num_groups: int,
  tiles: tuple[int, int, int],
  lhs_dtype: Any,
  rhs_dtype: Any,
  out_dtype: Any,
  generation: str | TpuGeneration,
  narrow_dot: bool = False,
  expected_rows: int | None = None,
  unowned_rows: str = "zero",
) -> bool:
  """Whether the row-tile gmm should cut its tiles on the groups' pass grids at these tiles.

  Pass cuts (`metadata.make_pass_cut_tiles`) save the partial passes where a tile boundary cuts
  a group, at the cost of a few more (shorter) grid steps: where the steps are HBM-bound or the
  per-step overhead dominates, the saving is hidden and the extra steps cost. Decided by the
  picker's model on its draws (`pick_rowtile_tiling` scores gmm tiles at the better of the two).
  False where the kernel cannot cut (`metadata.uses_pass_cuts`).
  """
  gen = get_generation(generation)
  tm, tk, tn = tiles
  sub = pass_rows(tm, gen, kind="gmm", tn=tn)
  li, ri, oi = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
  align = gmm_pass_align(sub_m=sub, tm=tm, lhs_itemsize=li, out_itemsize=oi)
  if not uses_pass_cuts(m=m, tm=tm, sub_m=sub, align=align):
    return False
  draws = _picker_draws(m=m, num_groups=num_groups, expected_rows=expected_rows)
  kw = dict(k=k, n=n, tm=tm, tk=tk, tn=tn, kind="gmm", lhs_itemsize=li, rhs_itemsize=ri)
  kw.update(out_itemsize=oi, generation=gen, buffer_rows=m, unowned_rows=unowned_rows)
  kw.update(peak_flops=narrow_peak(gen, lhs_dtype) if narrow_dot else None)
  return _draws_seconds(draws, **kw) < _draws_seconds(draws, **kw, fixed_tiles=True)
