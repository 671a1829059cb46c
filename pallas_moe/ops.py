"""Public grouped matmuls: differentiable `gmm` and `tgmm`, with argument checks and tilings.

`gmm` keeps the positional signature of megablox's `ops.gmm`, so MaxText-like code switches by
changing an import:

  gmm(lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, existing_out,
      transpose_rhs, interpret)

Its VJP runs three kernels, each with its own tiles (`Tiling(fwd=, dlhs=, drhs=)`):
  fwd:  out  = gmm(lhs, rhs)                      tiles (tm, tk, tn) over (m, k, n)
  dlhs: dlhs = gmm(dout, rhs, transposed rhs)     tiles (tm, tk, tn) over (m, n, k)
  drhs: drhs = tgmm(lhs^T, dout)                  tiles (tm, tk, tn) over (m, k, n) of rhs's k, n
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_moe import common, quant, xla_gmm
from pallas_moe import tiling as tiling_lib
from pallas_moe.gmm import gmm_pallas, gmm_rowtile_pallas
from pallas_moe.tgmm import tgmm_pallas, tgmm_rowtile_pallas
from pallas_moe.tiles import TileFn, Tiles, Tiling

# Required multiples of (tm, tk, tn) by kernel, from the block layouts:
# gmm: lhs [tm, tk], rhs [tk, tn] (or [tn, tk]), out [tm, tn].
# tgmm: lhs [tk, tm], rhs [tm, tn], out [tk, tn]: tm is a lane dim there.
GMM_ALIGN = (common.SUBLANE, common.LANE, common.LANE)
TGMM_ALIGN = (common.LANE, common.SUBLANE, common.LANE)
_NAMES = ("tm", "tk", "tn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTiling:
  """What one kernel call is launched with.

  Attributes:
    tiles: (tm, tk, tn), clamped to the dims and aligned.
    sub_m: rows per MXU pass: the MXU size when it divides tm, else tm (no sub-block skipping).
    vmem_limit_bytes: Mosaic's scoped VMEM limit when the tiles need more than the default.
    rowtile: run the row-tile kernel (`gmm_rowtile_pallas` / `tgmm_rowtile_pallas`: one grid
      step per m-tile, per-group blocks by manual DMA) instead of the visit-schedule kernel.
    sequential_sweeps: row-tile kernels only: let DMAs cross sweeps (`tiling.sequential_sweeps`:
      the generation has one TensorCore per JAX device, so nothing is gained by splitting sweeps).
    rows_stationary: row-tile kernels only: the sub-block rows are the MXU's stationary operand
      (`tiling.rows_stationary_pays`: tn is not a multiple of the MXU width, e.g. 1408 on v6e).
    fill_unowned: gmm only: write exact zeros to the rows outside the local groups' tiles
      (False: `gmm(..., unowned_rows="undefined")`: no grid step for those tiles).
    pass_cuts: row-tile gmm only: cut the m-tiles on the groups' pass grids
      (`tiling.rowtile_pass_cuts_pay`).
    kind: "gmm" or "tgmm": the kernel family (tiles are in that kernel's coordinates).
    reason: why these tiles and this kernel, in words (`GmmPlan.describe`); not part of the
      kernel's identity.
  """

  tiles: Tiles
  sub_m: int
  vmem_limit_bytes: int | None
  rowtile: bool = False
  sequential_sweeps: bool = False
  rows_stationary: bool = False
  fill_unowned: bool = True
  pass_cuts: bool = False
  kind: str = "gmm"
  reason: str = dataclasses.field(default="", compare=False)

  @property
  def kernel(self) -> str:
    """The Pallas kernel's name, as compiled programs show it (e.g. "pallas_moe_gmm_rowtile")."""
    return f"pallas_moe_{self.kind}" + ("_rowtile" if self.rowtile else "")

  @property
  def scope(self) -> str:
    """The name scope the kernel is launched under: its tiles, readable in a compiled program's
    op_name metadata (e.g. "pallas_moe_tiles_512x2048x1024")."""
    return "pallas_moe_tiles_" + "x".join(str(t) for t in self.tiles)

  def kwargs(self) -> dict[str, Any]:
    kw = dict(tiling=self.tiles, sub_m=self.sub_m, vmem_limit_bytes=self.vmem_limit_bytes)
    if self.rowtile:
      kw["sequential_sweeps"] = self.sequential_sweeps
      kw["rows_stationary"] = self.rows_stationary
    return kw


def _resolve_tiles(
  spec: Tiles | TileFn | None,
  *,
  dims: tuple[int, int, int],
  kind: str,
  num_groups: int,
  dtypes: tuple[Any, Any, Any],
  interpret: common.Interpret,
  allow_rowtile: bool = True,
  narrow_dot: bool = False,
  expected_rows: int | None = None,
  unowned_rows: str = "zero",
  allow_pass_cuts: bool = True,
  existing_out: bool = True,
  transpose_lhs: bool = False,
) -> KernelTiling:
  """Tiles (and the kernel) for one call: the heuristic, a LUT lookup, or the user's, checked.

  The row-tile kernel is used whenever it can run the tiles: gmm with the whole contraction in
  one tile (tk == k) and tn dividing n; tgmm with tk dividing k and tn dividing n; and its
  blocks within the VMEM budget. The heuristic picks row-tile tiles first
  (`tiling.pick_rowtile_tiling`) and falls back to the visit kernel's (`tiling.pick_tiling`).

  Args:
    spec: (tm, tk, tn), a callable (m, k, n) -> tiles, or None for `tiling.pick_tiling`.
    dims: the call's (m, k, n).
    kind: "gmm" or "tgmm" (block layouts differ, see GMM_ALIGN / TGMM_ALIGN).
    num_groups: groups in the call (the heuristic sizes tm from the mean group).
    dtypes: (lhs, rhs, out) dtypes.
    interpret: when the call may compile for TPU (None or False), tiles over the current
      generation's VMEM budget are refused here rather than by Mosaic.
    allow_rowtile: False keeps the visit kernel (quantized tgmm operands).
    narrow_dot: the gmm multiplies 8-bit lhs and rhs natively (w8a8 where the chip can): the
      heuristic scores MXU time at that rate (`dtypes` are then the 8-bit ones).
    expected_rows: the caller's expectation of sum(group_sizes) (see `gmm`), for the heuristic.
    unowned_rows: gmm's option (see `gmm`), for the heuristic: whether the visited tiles'
      output is written whole or only their local rows.
    allow_pass_cuts: gmm: the row-tile kernel may cut its m-tiles on the groups' pass grids
      (False for a quantized lhs: its per-row scales come in m-tile blocks).
    existing_out: the call has an `existing_out` (the row-tile tgmm then holds its block in
      VMEM; without one larger tiles fit).
    transpose_lhs: tgmm's lhs comes as [m, k] (gmm's backward), for the heuristic.
  """
  m, k, n = dims
  lhs_dtype, rhs_dtype, out_dtype = dtypes
  generation = tiling_lib.current_generation()
  budget = tiling_lib.usable_vmem_bytes(generation)
  # NOTE: the row-tile model's view of the call, shared by the picker and the pass-cut choice.
  model = dict(m=m, k=k, n=n, num_groups=num_groups, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype)
  model.update(out_dtype=out_dtype, generation=generation, narrow_dot=narrow_dot)
  model.update(expected_rows=expected_rows, unowned_rows=unowned_rows)
  # NOTE: gmm's passes stream rows (128-row passes on a 256-wide MXU), tgmm's contract them.
  picked = None
  if spec is None:
    source = f"picked for {generation.name} by pallas_moe's row-tile model"
  elif callable(spec):
    source = "looked up by the caller's tiling function"
  else:
    source = "given by the caller"
  if spec is None and allow_rowtile:
    extra = dict(transpose_lhs=transpose_lhs) if kind == "tgmm" else {}
    picked = tiling_lib.pick_rowtile_tiling(
      **model, kind=kind, allow_pass_cuts=allow_pass_cuts, existing_out=existing_out, **extra
    )
  if picked is not None:
    spec = picked
  elif spec is None:
    source = (
      f"picked for {generation.name} by the visit kernel's heuristic (no row-tile tiling fits)"
      if allow_rowtile
      else f"picked for {generation.name} by the visit kernel's heuristic"
    )
    spec = tiling_lib.pick_tiling(
      m=m,
      k=k,
      n=n,
      num_groups=num_groups,
      kind=kind,
      lhs_dtype=lhs_dtype,
      rhs_dtype=rhs_dtype,
      out_dtype=out_dtype,
      generation=generation,
    )
  elif callable(spec):
    looked_up = spec(m, k, n)
    if looked_up is None:
      raise ValueError(f"The `tiling` callable found no tiles for (m, k, n) = {dims}.")
    spec = looked_up
  aligns = GMM_ALIGN if kind == "gmm" else TGMM_ALIGN
  tm, tk, tn = common.fit_tiles(spec, dims=dims, names=_NAMES, aligns=aligns)
  vmem = dict(tm=tm, tk=tk, tn=tn, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype, out_dtype=out_dtype)
  # NOTE: the row-tile kernels move per-group blocks by manual DMA, which cannot be ragged: tn
  # must divide n (and tgmm's tk divide k); gmm keeps the whole contraction in VMEM (tk == k).
  fits_rowtile = (tk == k if kind == "gmm" else k % tk == 0) and n % tn == 0
  sub_m = tiling_lib.pass_rows(tm, generation, kind=kind, tn=tn)
  why_visits = _why_not_rowtile(
    kind=kind, dims=dims, tiles=(tm, tk, tn), allow_rowtile=allow_rowtile
  )
  if allow_rowtile and fits_rowtile:
    swap = tiling_lib.rows_stationary_pays(
      kind=kind, sub_m=sub_m, tk=tk, tn=tn, generation=generation
    )
    estimate = tiling_lib.vmem_estimate_bytes(
      **vmem,
      kind=f"{kind}_rowtile",
      generation=generation,
      rows_stationary=swap,
      existing_out=existing_out,
    )
    if estimate <= budget or not (interpret is None or interpret is False):
      pass_cuts = (
        kind == "gmm"
        and allow_pass_cuts
        and tiling_lib.rowtile_pass_cuts_pay(**model, tiles=(tm, tk, tn))
      )
      return KernelTiling(
        tiles=(tm, tk, tn),
        sub_m=sub_m,
        vmem_limit_bytes=tiling_lib.vmem_limit_for(estimate, generation),
        rowtile=True,
        sequential_sweeps=tiling_lib.sequential_sweeps(generation),
        rows_stationary=swap,
        pass_cuts=pass_cuts,
        kind=kind,
        reason=f"tiles {source}; row-tile kernel (one grid step per m-tile)",
      )
    why_visits = (
      f"the row-tile blocks need {estimate / 2**20:.1f} MiB of VMEM, over {generation.name}'s "
      f"{budget / 2**20:.1f} MiB"
    )
  estimate = tiling_lib.vmem_estimate_bytes(**vmem, kind=kind)
  if interpret is None or interpret is False:
    tiling_lib.check_fits_vmem(
      **vmem,
      kind=kind,
      generation=generation,
      vmem_limit_bytes=budget,
    )
  return KernelTiling(
    tiles=(tm, tk, tn),
    sub_m=sub_m,
    vmem_limit_bytes=tiling_lib.vmem_limit_for(estimate, generation),
    kind=kind,
    reason=f"tiles {source}; visit-schedule kernel: {why_visits}",
  )


def _why_not_rowtile(*, kind: str, dims, tiles, allow_rowtile: bool) -> str:
  """Why the row-tile kernel cannot run these tiles ("" when it can), in words."""
  (_, k, n), (_, tk, tn) = dims, tiles
  if not allow_rowtile:
    return "quantized tgmm operands (the row-tile tgmm takes no scales)"
  if kind == "gmm" and tk != k:
    return f"tk = {tk} < k = {k} (the row-tile gmm holds the whole contraction in one tile)"
  if kind == "tgmm" and k % tk:
    return f"tk = {tk} does not divide k = {k} (its per-group blocks move by manual DMA)"
  if n % tn:
    return f"tn = {tn} does not divide n = {n} (its per-group blocks move by manual DMA)"
  return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GmmPlan:
  """What one `gmm` or `tgmm` call runs, decided at trace time before any data moves.

  Attributes:
    op: "gmm" or "tgmm".
    dims: the call's (m, k, n): lhs [m, k], output [m, n] (gmm) or [G, k, n] (tgmm).
    num_groups: groups the call computes (rhs's G for gmm, num_actual_groups for tgmm).
    generation: the TPU generation the tiles and VMEM limits are for.
    kernels: (pass, KernelTiling) pairs: ("fwd", "dlhs", "drhs") for gmm, whose backward
      kernels run only when it is differentiated; ("tgmm",) for tgmm.
    implementation: "mosaic", "interpret", "xla" (no kernel: `kernels` are not used), or None
      (per lowering platform: Mosaic for TPU, XLA for GPU, interpret mode elsewhere).
  """

  op: str
  dims: tuple[int, int, int]
  num_groups: int
  generation: str
  kernels: tuple[tuple[str, KernelTiling], ...]
  implementation: str | None = None

  def describe(self) -> str:
    """One line per kernel: pass, kernel, tiles and why."""
    m, k, n = self.dims
    head = f"{self.op} m={m} k={k} n={n} groups={self.num_groups} on {self.generation}"
    if self.implementation == "xla":
      return f"{head}: XLA's ragged_dot (implementation='xla'), no Pallas kernel"
    where = {
      None: "Mosaic when lowered for TPU (XLA's ragged_dot for GPU, interpret mode elsewhere)",
      "mosaic": "Mosaic",
      "interpret": "Pallas interpret mode",
    }[self.implementation]
    lines = [f"{head}, {where}:"]
    for name, kt in self.kernels:
      lines.append(f"  {name:<4} {kt.kernel} tiles {kt.tiles}: {kt.reason}")
    return "\n".join(lines)


_LOG = logging.getLogger("pallas_moe")
_RECORDERS: contextvars.ContextVar[tuple[list[GmmPlan], ...]] = contextvars.ContextVar(
  "pallas_moe_plan_recorders", default=()
)


@contextlib.contextmanager
def record_plans() -> Iterator[list[GmmPlan]]:
  """Collects the `GmmPlan` of every gmm / tgmm call traced inside the block.

  Plans are made when a call is traced (jit, grad, lower, eval_shape), so recording around
  `jax.jit(step).lower(...)` lists what the compiled program runs, with no data moved:

    with pallas_moe.record_plans() as plans:
      jax.jit(step).lower(*args)
    for plan in plans:
      print(plan.describe())

  Yields:
    The list the plans are appended to, in trace order.
  """
  plans: list[GmmPlan] = []
  token = _RECORDERS.set((*_RECORDERS.get(), plans))
  try:
    yield plans
  finally:
    _RECORDERS.reset(token)


def _announce(plan: GmmPlan) -> None:
  """Hands a call's plan to the active recorders and to the "pallas_moe" logger (DEBUG)."""
  for plans in _RECORDERS.get():
    plans.append(plan)
  if _LOG.isEnabledFor(logging.DEBUG):
    _LOG.debug("%s", plan.describe())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GmmStatic:
  """Static (hashable) configuration of one differentiable gmm call."""

  out_dtype: Any
  fwd: KernelTiling
  dlhs: KernelTiling
  drhs: KernelTiling  # In tgmm's coordinates: (tm, tn, tk) of the rhs when transpose_rhs.
  transpose_rhs: bool
  interpret: Any
  weight_dtype: str | None = None  # Quantized paths: "int8" or "float8_e4m3fn".
  activation_dtype: str | None = None  # lhs quantized per row in the forward (same as weights).
  narrow_dot: bool = False  # The forward multiplies the narrow values on the MXU (see gmm).
  expected_rows: int | None = None  # The kernels' cost estimates count these rows (see gmm).
  weight_scale_axis: str | None = None  # Mesh axis the contraction is also split over (gmm).


def _swap_kn(fn: TileFn) -> TileFn:
  def swapped(m: int, k: int, n: int) -> Tiles | None:
    tiles = fn(m, n, k)
    return None if tiles is None else (tiles[0], tiles[2], tiles[1])

  return swapped


def _local_rows_mask(group_sizes, group_offset, num_local_groups: int, m: int) -> jax.Array:
  """[m] True for rows owned by the local groups (those the kernel overwrites)."""
  ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
  offsets = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])
  start = offsets[group_offset]
  end = offsets[group_offset + num_local_groups]
  rows = jnp.arange(m)
  return (rows >= start) & (rows < end)


def _run_gmm(kt: KernelTiling, lhs, rhs, group_sizes, **kwargs):
  """The gmm kernel `kt` selects (row-tile or visit schedule), under its tiles' name scope."""
  with jax.named_scope(kt.scope):
    return _launch_gmm(kt, lhs, rhs, group_sizes, **kwargs)


def _launch_gmm(kt: KernelTiling, lhs, rhs, group_sizes, **kwargs):
  if kt.rowtile:
    tm, _, tn = kt.tiles
    return gmm_rowtile_pallas(
      lhs,
      rhs,
      group_sizes,
      tm=tm,
      tn=tn,
      sub_m=kt.sub_m,
      vmem_limit_bytes=kt.vmem_limit_bytes,
      sequential_sweeps=kt.sequential_sweeps,
      rows_stationary=kt.rows_stationary,
      fill_unowned=kt.fill_unowned,
      # NOTE: a quantized lhs's per-row scales come in m-tile blocks: no cuts there.
      pass_cuts=kt.pass_cuts and kwargs.get("lhs_scales") is None,
      **kwargs,
    )
  return gmm_pallas(lhs, rhs, group_sizes, fill_unowned=kt.fill_unowned, **kt.kwargs(), **kwargs)


def _run_tgmm(kt: KernelTiling, lhs, rhs, group_sizes, **kwargs):
  """The tgmm kernel `kt` selects (row-tile or visit schedule), under its tiles' name scope."""
  kernel = tgmm_rowtile_pallas if kt.rowtile else tgmm_pallas
  with jax.named_scope(kt.scope):
    return kernel(lhs, rhs, group_sizes, **kt.kwargs(), **kwargs)


def _gmm_fwd_impl(static: _GmmStatic, lhs, rhs, group_sizes, group_offset, existing_out):
  return _run_gmm(
    static.fwd,
    lhs,
    rhs,
    group_sizes,
    out_dtype=static.out_dtype,
    group_offset=group_offset,
    existing_out=existing_out,
    transpose_rhs=static.transpose_rhs,
    expected_rows=static.expected_rows,
    interpret=static.interpret,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm_diff(static, lhs, rhs, group_sizes, group_offset, existing_out):
  return _gmm_fwd_impl(static, lhs, rhs, group_sizes, group_offset, existing_out)


def _gmm_diff_fwd(static, lhs, rhs, group_sizes, group_offset, existing_out):
  out = _gmm_fwd_impl(static, lhs, rhs, group_sizes, group_offset, existing_out)
  return out, (lhs, rhs, group_sizes, group_offset, existing_out is not None)


def _weight_grad(static, lhs, dout, group_sizes, group_offset, *, num_groups, out_dtype):
  """The weight gradient by tgmm, laid out as the weights ([G, k, n], or [G, n, k] transposed).

  NOTE: tgmm contracts over rows; its operands are picked so the output is already in the weights'
  layout and no weight gradient needs a transpose: lhs^T @ dout, or dout^T @ lhs. Its first
  operand is passed as the [m, *] array it is (`transpose_lhs`: the kernel contracts its rows in
  VMEM), so XLA makes no transposed copy of lhs or dout in HBM.
  """
  t_lhs, t_rhs = (dout, lhs) if static.transpose_rhs else (lhs, dout)
  return _run_tgmm(
    static.drhs,
    t_lhs,
    t_rhs,
    group_sizes,
    out_dtype=out_dtype,
    group_offset=group_offset,
    num_actual_groups=num_groups,
    transpose_lhs=True,
    expected_rows=static.expected_rows,
    interpret=static.interpret,
  )


def _gmm_diff_bwd(static, residuals, dout):
  lhs, rhs, group_sizes, group_offset, has_existing = residuals
  m = lhs.shape[0]
  num_local_groups = rhs.shape[0]
  # NOTE: the backward kernels multiply in the forward's compute dtype (bf16 for bf16 inputs), as
  # the forward does; the accumulators stay f32.
  compute_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  dout_c = dout.astype(compute_dtype)
  dlhs = _run_gmm(
    static.dlhs,
    dout_c,
    rhs,
    group_sizes,
    out_dtype=lhs.dtype,
    group_offset=group_offset,
    transpose_rhs=not static.transpose_rhs,
    expected_rows=static.expected_rows,
    interpret=static.interpret,
  )
  drhs = _weight_grad(
    static,
    lhs,
    dout_c,
    group_sizes,
    group_offset,
    num_groups=num_local_groups,
    out_dtype=rhs.dtype,
  )
  dexisting = None
  if has_existing:
    written = _local_rows_mask(group_sizes, group_offset, num_local_groups, m)
    dexisting = jnp.where(written[:, None], jnp.zeros_like(dout), dout)
  return dlhs, drhs, None, None, dexisting


_gmm_diff.defvjp(_gmm_diff_fwd, _gmm_diff_bwd)


# --- Quantized weights ------------------------------------------------------------------------
#
# Both quantized paths run the forward and the lhs gradient through the gmm kernel with int8 /
# fp8 weights upcast in VMEM. Kernel scales are [G, 1, n] per output column; quantize's scales
# for the transposed [G, n, k] layout are [G, n, 1], the same bytes, so a reshape is free.


def _row_scales(scales):
  """[G, 1, n] output-column scales for the forward kernel (from [G, 1, n] or [G, n, 1])."""
  g = scales.shape[0]
  return scales.reshape(g, 1, scales.size // g)


def _k_scales(scales, *, transpose_rhs: bool):
  """Scales for the lhs-gradient kernel, whose contraction axis is the forward's n.

  NOTE: the dlhs call reads rhs with the opposite `transpose_rhs`; its scales must broadcast along
  that call's k (the forward's n): [G, 1, n] for a forward [G, k, n] (read as [G, n', k'=n]), and
  [G, n, 1] for a forward [G, n, k] (read as [G, k'=n, n']). These are quantize's own layouts.
  """
  g = scales.shape[0]
  n = scales.size // g
  return scales.reshape(g, n, 1) if transpose_rhs else scales.reshape(g, 1, n)


def _quant_fwd_impl(static, lhs, values, scales, group_sizes, group_offset, existing_out):
  lhs_scales = None
  if static.activation_dtype is not None:
    # NOTE: quantized in the wrapper: a row's absmax spans all of k, which one kernel step (one
    # k-tile) does not see. The int8 / fp8 lhs also halves the kernel's lhs reads.
    lhs, lhs_scales = quant.quantize_rows(lhs, dtype=static.activation_dtype)
  return _run_gmm(
    static.fwd,
    lhs,
    values,
    group_sizes,
    out_dtype=static.out_dtype,
    group_offset=group_offset,
    existing_out=existing_out,
    transpose_rhs=static.transpose_rhs,
    rhs_scales=_row_scales(scales),
    lhs_scales=lhs_scales,
    narrow_dot=static.narrow_dot,
    interpret=static.interpret,
  )


def _quant_dlhs(static, lhs, values, scales, group_sizes, group_offset, dout):
  """dlhs = dout @ dequantize(q)^T: the quantized kernel, transposed, scales on its k."""
  return _run_gmm(
    static.dlhs,
    dout.astype(lhs.dtype),
    values,
    group_sizes,
    out_dtype=lhs.dtype,
    group_offset=group_offset,
    transpose_rhs=not static.transpose_rhs,
    rhs_scales=_k_scales(scales, transpose_rhs=static.transpose_rhs),
    scales_on_k=True,
    interpret=static.interpret,
  )


def _dexisting(group_sizes, group_offset, num_local_groups, m, dout, has_existing):
  if not has_existing:
    return None
  written = _local_rows_mask(group_sizes, group_offset, num_local_groups, m)
  return jnp.where(written[:, None], jnp.zeros_like(dout), dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qgmm_frozen(static, lhs, values, scales, group_sizes, group_offset, existing_out):
  return _quant_fwd_impl(static, lhs, values, scales, group_sizes, group_offset, existing_out)


def _qgmm_frozen_fwd(static, lhs, values, scales, group_sizes, group_offset, existing_out):
  out = _quant_fwd_impl(static, lhs, values, scales, group_sizes, group_offset, existing_out)
  return out, (lhs, values, scales, group_sizes, group_offset, existing_out is not None)


def _qgmm_frozen_bwd(static, residuals, dout):
  lhs, values, scales, group_sizes, group_offset, has_existing = residuals
  dlhs = _quant_dlhs(static, lhs, values, scales, group_sizes, group_offset, dout)
  # NOTE: frozen quantized weights get a zero cotangent (float0 for the int8 values); to train
  # through quantization, pass float weights with `weight_quantization` (straight-through).
  if jnp.issubdtype(values.dtype, jnp.integer):
    dvalues = np.zeros(values.shape, jax.dtypes.float0)
  else:
    dvalues = jnp.zeros_like(values)
  dex = _dexisting(group_sizes, group_offset, values.shape[0], lhs.shape[0], dout, has_existing)
  return dlhs, dvalues, jnp.zeros_like(scales), None, None, dex


_qgmm_frozen.defvjp(_qgmm_frozen_fwd, _qgmm_frozen_bwd)
_qgmm_frozen_jit = jax.jit(_qgmm_frozen, static_argnums=(0,))


def _quantize_master(static, w):
  return quant.quantize(
    w,
    dtype=static.weight_dtype,
    axis=2 if static.transpose_rhs else 1,
    axis_name=static.weight_scale_axis,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qgmm_master(static, lhs, w, group_sizes, group_offset, existing_out):
  q = _quantize_master(static, w)
  return _quant_fwd_impl(static, lhs, q.values, q.scales, group_sizes, group_offset, existing_out)


def _qgmm_master_fwd(static, lhs, w, group_sizes, group_offset, existing_out):
  q = _quantize_master(static, w)
  out = _quant_fwd_impl(static, lhs, q.values, q.scales, group_sizes, group_offset, existing_out)
  # NOTE: a zero-size array carries w's dtype (residuals must be arrays).
  w_dtype = jnp.zeros((0,), w.dtype)
  res = (lhs, q.values, q.scales, w_dtype, group_sizes, group_offset, existing_out is not None)
  return out, res


def _qgmm_master_bwd(static, residuals, dout):
  lhs, values, scales, w_dtype, group_sizes, group_offset, has_existing = residuals
  dlhs = _quant_dlhs(static, lhs, values, scales, group_sizes, group_offset, dout)
  # NOTE: straight-through estimator: d(quantize(w))/dw is taken as the identity, so the weight
  # gradient is the plain tgmm gradient (in lhs's dtype) wrt the float master weight.
  dw = _weight_grad(
    static,
    lhs,
    dout.astype(lhs.dtype),
    group_sizes,
    group_offset,
    num_groups=values.shape[0],
    out_dtype=w_dtype.dtype,
  )
  dex = _dexisting(group_sizes, group_offset, values.shape[0], lhs.shape[0], dout, has_existing)
  return dlhs, dw, None, None, dex


_qgmm_master.defvjp(_qgmm_master_fwd, _qgmm_master_bwd)
_qgmm_master_jit = jax.jit(_qgmm_master, static_argnums=(0,))

# NOTE: jit with the validated static configuration as the cache key: eager calls would otherwise
# re-trace and re-lower the kernel on every call (a new kernel closure each time).
_gmm_jit = jax.jit(_gmm_diff, static_argnums=(0,))


@functools.partial(
  jax.jit,
  static_argnames=(
    "tiling",
    "out_dtype",
    "num_actual_groups",
    "interpret",
    "narrow_dot",
    "transpose_lhs",
  ),
)
def _tgmm_jit(
  lhs,
  rhs,
  group_sizes,
  group_offset,
  existing_out,
  lhs_scales=None,
  rhs_scales=None,
  *,
  tiling,
  out_dtype,
  num_actual_groups,
  interpret,
  narrow_dot=False,
  transpose_lhs=False,
):
  # NOTE: quantization arguments only for quantized operands: float calls keep the plain signature.
  quantized = {}
  if lhs_scales is not None or rhs_scales is not None:
    quantized = dict(lhs_scales=lhs_scales, rhs_scales=rhs_scales, narrow_dot=narrow_dot)
  if transpose_lhs:
    quantized["transpose_lhs"] = True
  return _run_tgmm(
    tiling,
    lhs,
    rhs,
    group_sizes,
    out_dtype=out_dtype,
    group_offset=group_offset,
    num_actual_groups=num_actual_groups,
    existing_out=existing_out,
    interpret=interpret,
    **quantized,
  )


def _check_tgmm_array(name: str, x: Any) -> bool:
  """Checks that a tgmm operand is a 2-d float or int8 / fp8 array; returns whether quantized."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"`{name}` must be a jax or numpy array, got {type(x).__name__}.")
  if not quant.is_quantized_dtype(x.dtype):
    common.check_float_array(name, x, ndim=2)
    return False
  if x.ndim != 2:
    raise ValueError(f"`{name}` must be a 2-d array, got shape {tuple(x.shape)}.")
  return True


def _check_tgmm_scales(name: str, x: Any, scales: Any, *, quantized: bool, channel, token):
  """Checks the scales of a tgmm operand.

  Args:
    name: "lhs" or "rhs".
    x: the operand.
    scales: None, or f32 scales: `channel` (per output row / column) or `token` (per row of m).
    quantized: whether `x` is int8 / float8_e4m3fn.
    channel: the per-channel scales' shape.
    token: the per-token scales' shape.
  """
  if not quantized:
    if scales is not None:
      raise ValueError(
        f"`{name}_scales` was given but `{name}` is {x.dtype}: scales describe a quantized "
        f"(int8 / float8_e4m3fn) {name}; quantize it or drop `{name}_scales`."
      )
    return
  per = "row of lhs" if name == "lhs" else "column of rhs"
  what = f"{tuple(channel)} (one per {per}) or {tuple(token)} (one per token)"
  if scales is None:
    raise TypeError(
      f"`{name}` is {x.dtype} (quantized): pass `{name}_scales`, f32 of shape {what}."
    )
  if not hasattr(scales, "dtype") or not hasattr(scales, "shape"):
    raise TypeError(f"`{name}_scales` must be an array, got {type(scales).__name__}.")
  if jnp.dtype(scales.dtype) != jnp.float32:
    raise TypeError(f"`{name}_scales` must be float32, got {scales.dtype}.")
  if tuple(scales.shape) not in (tuple(channel), tuple(token)):
    raise ValueError(
      f"`{name}_scales` has shape {tuple(scales.shape)}, but `{name}` {tuple(x.shape)} needs "
      f"{what}."
    )


def _vary_together(lhs, rhs, group_sizes, group_offset, existing_out):
  """Gives every operand the union of their varying manual axes (a no-op outside shard_map).

  NOTE: done outside the custom_vjp so that JAX transposes the implicit broadcast of a replicated
  operand into a psum of its gradient.
  """
  operands = (lhs, rhs, group_sizes, group_offset, existing_out)
  return tuple(None if x is None else common.pvary_like(x, *operands) for x in operands)


def _refuse_quantized_lhs(lhs: Any) -> None:
  """gmm's lhs is float: weights go in rhs, activations are quantized by the op itself."""
  if isinstance(lhs, quant.QuantizedWeights):
    raise TypeError(
      "`lhs` is a QuantizedWeights: QuantizedWeights is gmm's rhs (the [G, k, n] expert "
      "weights); pass the float activations as lhs."
    )
  if hasattr(lhs, "dtype") and quant.is_quantized_dtype(lhs.dtype):
    raise TypeError(
      f"`lhs` is {lhs.dtype}: gmm takes float activations and quantizes them per row itself; "
      "pass the float lhs with activation_quantization='int8' or 'fp8'."
    )


def _check_activation_quantization(activation_quantization, weight_dtype) -> str | None:
  """The canonical lhs quantization dtype, checked against the weights' (None: float lhs)."""
  if activation_quantization is None:
    return None
  name = quant.canonical_dtype(activation_quantization)
  if weight_dtype is None:
    raise ValueError(
      f"`activation_quantization`={activation_quantization!r} needs quantized weights: pass rhs "
      f"as QuantizedWeights or set weight_quantization={activation_quantization!r}."
    )
  if name != weight_dtype:
    raise ValueError(
      f"`activation_quantization`={activation_quantization!r} ({name}) differs from the weights' "
      f"{weight_dtype}: lhs and rhs must share one quantized dtype (the MXU multiplies int8 x "
      "int8 or fp8 x fp8); use the same name for both."
    )
  return name


def _check_expected_rows(expected_rows) -> int | None:
  if expected_rows is None:
    return None
  if isinstance(expected_rows, bool) or not isinstance(expected_rows, (int, np.integer)):
    raise TypeError(
      f"`expected_rows` must be a Python int (a static hint for the tiles) or None, got "
      f"{type(expected_rows).__name__}; pass e.g. tokens_per_device * top_k."
    )
  if expected_rows < 1:
    raise ValueError(f"`expected_rows`={expected_rows} must be >= 1 (or None: m).")
  return int(expected_rows)


IMPLEMENTATIONS = ("mosaic", "interpret", "xla")


def _check_implementation(implementation: str | None, interpret: common.Interpret):
  """(implementation, interpret) for a call: None picks per lowering platform.

  None: Mosaic when lowering for TPU, XLA's `ragged_dot` when lowering for a GPU (cuda, rocm),
  Pallas interpret mode elsewhere (CPU: the test path). `interpret` True / InterpretParams or
  False name interpret mode or Mosaic as before; "mosaic" / "interpret" set `interpret`.
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"`implementation`={implementation!r} must be one of {IMPLEMENTATIONS} or None (Mosaic "
      "on TPU, XLA's ragged_dot on GPU, interpret mode on CPU)."
    )
  if implementation is None:
    if interpret is None:
      return None, None
    return ("mosaic" if interpret is False else "interpret"), interpret
  forced = {"mosaic": False, "interpret": True}
  if implementation == "xla" or interpret is None:
    if implementation == "xla" and interpret is not None:
      raise ValueError(
        f"`interpret`={interpret!r} runs a Pallas kernel; implementation='xla' runs none: pass "
        "one of them."
      )
    return implementation, forced.get(implementation)
  if (interpret is False) != (implementation == "mosaic"):
    raise ValueError(
      f"`implementation`={implementation!r} and `interpret`={interpret!r} disagree; pass one."
    )
  return implementation, interpret


def _per_platform(kernels: Callable[[], Any], xla: Callable[[], Any], implementation):
  """The kernels' result, XLA's, or (None) whichever the lowering platform takes."""
  if implementation == "xla":
    return xla()
  if implementation is not None:
    return kernels()
  # NOTE: only the branch of the platform being lowered for is lowered: a GPU program holds no
  # Pallas kernel and a TPU program no ragged_dot.
  return jax.lax.platform_dependent(cuda=xla, rocm=xla, default=kernels)


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = None,
  tiling: Tiling | Tiles | TileFn | None = None,
  group_offset: jax.Array | int | None = None,
  existing_out: jax.Array | None = None,
  transpose_rhs: bool = False,
  interpret: common.Interpret = None,
  *,
  weight_quantization: str | None = None,
  activation_quantization: str | None = None,
  unowned_rows: str = "zero",
  expected_rows: int | None = None,
  implementation: str | None = None,
  weight_scale_axis: str | None = None,
) -> jax.Array:
  """Grouped matmul: out[rows of g] = lhs[rows of g] @ rhs[g - group_offset]. Differentiable.

  Rows are sorted by group: group g owns rows [cumsum[g-1], cumsum[g]). `rhs` holds the groups
  group_offset .. group_offset + G - 1 (an expert-parallel shard). Rows of other groups keep
  `existing_out` (or are 0); rows past sum(group_sizes) are 0 (or keep `existing_out`), and so is
  their lhs gradient. m, k and n need not be multiples of the tiles.

  Quantized weights (int8 or float8_e4m3fn values with per-(group, output-channel) f32 scales):
  the kernel upcasts each weight block to lhs's dtype in VMEM and scales each partial product per
  output column before accumulating, so int8 and fp8 run on every TPU generation (v5e has no fp8
  MXU: the upcast path never uses the native int8/fp8 MXU modes). HBM traffic for the weights is
  halved relative to bf16. Two ways in:
  - `rhs` a `QuantizedWeights` (from `quantize`): frozen weights. The lhs gradient runs the same
    quantized kernel transposed; the weights' cotangent is zero (float0 for int8 values).
  - float `rhs` with `weight_quantization="int8" | "fp8"`: quantize-on-the-fly training with a
    straight-through estimator. The forward and the lhs gradient use the quantized weights; the
    gradient wrt the float master weight is the plain tgmm gradient (d quantize(w)/dw taken as 1).

  Quantized activations (`activation_quantization`, with either way in above, same dtype as the
  weights): the forward quantizes lhs per row (one f32 absmax scale per row, in the wrapper) and
  the kernel multiplies int8 x int8 (int32 results) or fp8 x fp8 (f32 results) on the MXU where
  the current generation has that mode (`tiling.TpuGeneration.supports_int8` / `supports_fp8`:
  int8 on v5e, v5p, v6e; fp8 on tpu7x), else it upcasts both to bf16 in VMEM (exact). Row and
  column scales factor out of the k contraction and scale each f32 partial product. Gradients
  are straight-through in lhs too: dlhs = dout @ dequantize(q(w))^T (as without activation
  quantization) and the weight gradient is lhs^T @ dout with the float lhs.

  Args:
    lhs: [m, k] float array.
    rhs: [G, k, n] float array, or [G, n, k] with `transpose_rhs`; or a `QuantizedWeights` whose
      scales are [G, 1, n] (or [G, n, 1] with `transpose_rhs`).
    group_sizes: [G_total] integer rows per group, G_total >= G.
    preferred_element_type: output dtype; None means the promoted dtype of lhs and rhs.
    tiling: (tm, tk, tn) for all passes, a `Tiling(fwd=, dlhs=, drhs=)`, a callable
      (m, k, n) -> (tm, tk, tn), or None for the heuristic.
    group_offset: first group of `group_sizes` that rhs holds (scalar, may be traced). Default 0.
    existing_out: optional [m, n] array of the output dtype whose rows outside the local groups are
      kept (chaining expert shards). Differentiable.
    transpose_rhs: rhs is [G, n, k] and is used transposed.
    interpret: None: compiled on TPU, interpret mode elsewhere (decided per lowering platform).
      True or a `pltpu.InterpretParams`: interpret mode. False: compiled.
    weight_quantization: None, "int8" or "fp8" ("float8_e4m3fn"): quantize a float `rhs` on the
      fly (see above). Not allowed with a `QuantizedWeights` rhs.
    activation_quantization: None, "int8" or "fp8": quantize lhs per row in the forward (see
      above). Needs quantized weights of the same dtype.
    unowned_rows: "zero" (the contract above: rows outside the local groups are 0, or keep
      `existing_out`). "undefined": without `existing_out`, rows outside the local groups' rows
      are left unwritten (garbage), in the output and in the lhs gradient, saving their zero
      writes ((m - rows) x n x itemsize bytes): for a caller that never reads them, like an
      expert-parallel receive buffer's slack. The few rows just past the local rows that share
      their DMA granule (8 rows of f32, 16 of bf16) are 0.
    expected_rows: a hint for the default tiles only (results never depend on it): the rows you
      expect sum(group_sizes) to be when m is a receive buffer with slack (e.g. tokens x top_k
      per device under expert parallelism). The kernels visit only the m-tiles holding rows and
      move only those rows; tiles are picked for that many rows. Default: m.
    implementation: "mosaic" (the Pallas kernels compiled for TPU), "interpret" (the same in
      Pallas interpret mode) or "xla" (`jax.lax.ragged_dot`, with the same contract and
      gradients; quantized operands dequantized, straight-through); None: Mosaic when lowering
      for TPU, XLA for a GPU, interpret mode elsewhere (CPU).
    weight_scale_axis: with `weight_quantization`, inside `shard_map` where k is split over
      this mesh axis (tensor parallelism: each device holds some of k and the caller sums the
      partial outputs): each weight scale is the absmax over the whole k (a pmax over the
      axis), so the split contraction quantizes exactly as the whole one. None: over the k
      this call holds.

  Returns:
    [m, n] array of `preferred_element_type`.
  """
  _refuse_quantized_lhs(lhs)
  if weight_scale_axis is not None and (
    weight_quantization is None or not isinstance(weight_scale_axis, str)
  ):
    raise ValueError(
      f"`weight_scale_axis`={weight_scale_axis!r} names the mesh axis a quantized contraction "
      "is split over: it needs weight_quantization (a float rhs quantized on the fly) and an "
      "axis name."
    )
  implementation, interpret = _check_implementation(implementation, interpret)
  ops = _check_gmm_operands(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    transpose_rhs=bool(transpose_rhs),
    preferred_element_type=preferred_element_type,
    weight_quantization=weight_quantization,
    activation_quantization=activation_quantization,
    unowned_rows=unowned_rows,
  )
  static = _plan_gmm(
    ops,
    tiling=Tiling.of(tiling),
    interpret=interpret,
    unowned_rows=unowned_rows,
    expected_rows=_check_expected_rows(expected_rows),
  )
  if weight_scale_axis is not None:
    static = dataclasses.replace(static, weight_scale_axis=weight_scale_axis)
  m, k = lhs.shape
  _announce(
    GmmPlan(
      op="gmm",
      dims=(m, k, ops.n),
      num_groups=ops.rhs.shape[0],
      generation=tiling_lib.current_generation().name,
      kernels=(("fwd", static.fwd), ("dlhs", static.dlhs), ("drhs", static.drhs)),
      implementation=implementation,
    )
  )
  return _per_platform(
    functools.partial(_gmm_on_kernels, static, ops),
    functools.partial(_gmm_on_xla, static, ops),
    implementation,
  )


class _GmmOperands(NamedTuple):
  """gmm's operands once checked: what the plan and both backends read."""

  lhs: jax.Array
  rhs: jax.Array  # the float weights, or a QuantizedWeights' values
  qweights: quant.QuantizedWeights | None
  group_sizes: jax.Array
  group_offset: jax.Array
  existing_out: jax.Array | None
  n: int
  transpose_rhs: bool
  out_dtype: Any
  weight_dtype: Any  # the quantized weights' dtype (None: float weights)
  activation_dtype: Any  # the forward's quantized lhs dtype (None: float lhs)
  rhs_for_tiles: jax.Array  # what the tile pickers take as rhs (lhs for quantized weights)


def _check_gmm_operands(
  lhs,
  rhs,
  group_sizes,
  group_offset,
  existing_out,
  *,
  transpose_rhs: bool,
  preferred_element_type,
  weight_quantization,
  activation_quantization,
  unowned_rows: str,
) -> _GmmOperands:
  """gmm's argument checks (each error names the argument and the fix)."""
  common.check_float_array("lhs", lhs, ndim=2)
  qweights = None
  if isinstance(rhs, quant.QuantizedWeights):
    if weight_quantization is not None:
      raise ValueError(
        "`weight_quantization` quantizes a float rhs; rhs is already QuantizedWeights."
      )
    quant.check_quantized(rhs, transpose_rhs=transpose_rhs)
    qweights, rhs = rhs, rhs.values
    weight_dtype = quant.canonical_dtype(rhs.dtype)
  else:
    common.check_float_array("rhs", rhs, ndim=3)
    weight_dtype = None
    if weight_quantization is not None:
      weight_dtype = quant.canonical_dtype(weight_quantization)
  activation_dtype = _check_activation_quantization(activation_quantization, weight_dtype)
  if unowned_rows not in ("zero", "undefined"):
    raise ValueError(
      f"`unowned_rows`={unowned_rows!r} must be 'zero' (rows outside the local groups are 0) or "
      "'undefined' (left unwritten, for callers that never read them)."
    )
  m, k = lhs.shape
  num_local_groups = rhs.shape[0]
  rhs_k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
  if rhs_k != k:
    layout = "[G, n, k] (transpose_rhs=True)" if transpose_rhs else "[G, k, n]"
    raise ValueError(
      f"k mismatch: lhs is [m, k] = {tuple(lhs.shape)} but rhs {tuple(rhs.shape)} read as "
      f"{layout} has k = {rhs_k}; check `transpose_rhs`."
    )
  if num_local_groups == 0:
    raise ValueError("`rhs` must hold at least one group (rhs.shape[0] == 0).")
  group_sizes = common.check_group_sizes(group_sizes, m=m)
  num_groups_total = group_sizes.shape[0]
  if num_local_groups > num_groups_total:
    raise ValueError(
      f"rhs holds {num_local_groups} groups but `group_sizes` has only {num_groups_total}; "
      "group_sizes must list every group (all shards)."
    )
  group_offset = common.check_group_offset(
    group_offset, num_groups_total=num_groups_total, num_local_groups=num_local_groups
  )
  if weight_dtype is not None:
    # NOTE: a quantized rhs is upcast to lhs's dtype in VMEM: it computes (and, for the VMEM
    # estimate, is counted) as lhs's dtype, an over-estimate covering the upcast copy.
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    rhs_for_tiles = lhs
  else:
    out_dtype = common.result_dtype(lhs, rhs, preferred_element_type)
    rhs_for_tiles = rhs
  common.check_existing_out(existing_out, shape=(m, n), dtype=out_dtype)
  return _GmmOperands(
    lhs=lhs,
    rhs=rhs,
    qweights=qweights,
    group_sizes=group_sizes,
    group_offset=group_offset,
    existing_out=existing_out,
    n=n,
    transpose_rhs=transpose_rhs,
    out_dtype=out_dtype,
    weight_dtype=weight_dtype,
    activation_dtype=activation_dtype,
    rhs_for_tiles=rhs_for_tiles,
  )


def _plan_gmm(
  ops: _GmmOperands,
  *,
  tiling: Tiling,
  interpret: common.Interpret,
  unowned_rows: str,
  expected_rows: int | None,
) -> _GmmStatic:
  """The three kernels (fwd, dlhs, drhs) a gmm call and its VJP run, with their tiles."""
  lhs, rhs_for_tiles, out_dtype = ops.lhs, ops.rhs_for_tiles, ops.out_dtype
  (m, k), n = lhs.shape, ops.n
  activation_dtype, weight_dtype = ops.activation_dtype, ops.weight_dtype
  resolve = functools.partial(
    _resolve_tiles,
    num_groups=ops.rhs.shape[0],
    interpret=interpret,
    expected_rows=expected_rows,
  )
  # NOTE: existing_out is written whole in the visited tiles, like the zero fill's buffer.
  gmm_unowned = "existing" if ops.existing_out is not None else unowned_rows
  compute_dtype = jnp.promote_types(lhs.dtype, rhs_for_tiles.dtype)
  # NOTE: with transpose_rhs the weight gradient is [G, n, k]: tgmm's (tk, tn) tile (n, k).
  if ops.transpose_rhs:
    drhs_spec = tiling.drhs
    if isinstance(drhs_spec, tuple) and len(drhs_spec) == 3:
      drhs_spec = (drhs_spec[0], drhs_spec[2], drhs_spec[1])
    elif callable(drhs_spec):
      drhs_spec = _swap_kn(drhs_spec)
    drhs_dims = (m, n, k)
  else:
    drhs_spec, drhs_dims = tiling.drhs, (m, k, n)
  narrow_dot = activation_dtype is not None and quant.narrow_dot_supported(
    activation_dtype, tiling_lib.current_generation()
  )
  # NOTE: a narrow forward moves and multiplies the 8-bit operands: tiles for those (the other
  # quantized passes upcast, and take tiles as for lhs's dtype, see `_check_gmm_operands`).
  fwd_dtypes = (
    (jnp.dtype(activation_dtype), jnp.dtype(weight_dtype), out_dtype)
    if narrow_dot
    else (lhs.dtype, rhs_for_tiles.dtype, out_dtype)
  )
  fill = unowned_rows == "zero"
  return _GmmStatic(
    out_dtype=out_dtype,
    fwd=dataclasses.replace(
      resolve(
        tiling.fwd,
        dims=(m, k, n),
        kind="gmm",
        dtypes=fwd_dtypes,
        narrow_dot=narrow_dot,
        unowned_rows=gmm_unowned,
        allow_pass_cuts=activation_dtype is None,
      ),
      fill_unowned=fill,
    ),
    dlhs=dataclasses.replace(
      resolve(
        tiling.dlhs,
        dims=(m, n, k),
        kind="gmm",
        dtypes=(compute_dtype, rhs_for_tiles.dtype, lhs.dtype),
        unowned_rows=unowned_rows,
      ),
      fill_unowned=fill,
    ),
    # NOTE: the weight gradient has no existing_out (`_weight_grad`).
    drhs=resolve(
      drhs_spec,
      dims=drhs_dims,
      kind="tgmm",
      dtypes=(lhs.dtype, compute_dtype, rhs_for_tiles.dtype),
      existing_out=False,
      transpose_lhs=True,
    ),
    transpose_rhs=ops.transpose_rhs,
    interpret=interpret,
    weight_dtype=weight_dtype,
    activation_dtype=activation_dtype,
    narrow_dot=narrow_dot,
    expected_rows=expected_rows,
  )


def _gmm_on_kernels(static: _GmmStatic, ops: _GmmOperands) -> jax.Array:
  """gmm on the Pallas kernels (Mosaic or interpret mode), through its custom VJP."""
  lhs, qweights, existing_out = ops.lhs, ops.qweights, ops.existing_out
  if qweights is not None:
    operands = (
      None if x is None else common.pvary_like(x, lhs, qweights.values, existing_out)
      for x in (
        lhs,
        qweights.values,
        qweights.scales,
        ops.group_sizes,
        ops.group_offset,
        existing_out,
      )
    )
    return _qgmm_frozen_jit(static, *operands)
  operands = _vary_together(lhs, ops.rhs, ops.group_sizes, ops.group_offset, existing_out)
  if static.weight_dtype is not None:
    return _qgmm_master_jit(static, *operands)
  return _gmm_jit(static, *operands)


def _gmm_on_xla(static: _GmmStatic, ops: _GmmOperands) -> jax.Array:
  """gmm on XLA's ragged_dot, quantized operands dequantized, gradients straight-through."""
  lhs, rhs, qweights = ops.lhs, ops.rhs, ops.qweights
  x, w = lhs, rhs if qweights is None else jax.lax.stop_gradient(quant.dequantize(qweights))
  if static.weight_dtype is not None and qweights is None:
    w = _straight_through(w, quant.dequantize(_quantize_master(static, w), dtype=w.dtype))
  if static.activation_dtype is not None:
    values, scales = quant.quantize_rows(x, dtype=static.activation_dtype)
    x = _straight_through(x, (values.astype(jnp.float32) * scales).astype(x.dtype))
  if qweights is not None:
    w = w.astype(lhs.dtype)
  out = xla_gmm.gmm_xla(
    x,
    w,
    ops.group_sizes,
    ops.group_offset,
    ops.existing_out,
    transpose_rhs=ops.transpose_rhs,
    out_dtype=ops.out_dtype,
  )
  return common.pvary_like(out, lhs, rhs if qweights is None else qweights.values, ops.existing_out)


def _straight_through(x: jax.Array, quantized: jax.Array) -> jax.Array:
  """`quantized` in the forward, the identity in the backward (d quantized / dx taken as 1)."""
  return x + jax.lax.stop_gradient(quantized - x)


def _tgmm_dims(lhs, rhs, *, transpose_lhs: bool, quantized: bool) -> tuple[int, int, int]:
  """tgmm's (m, k, n) from lhs ([k, m], or [m, k] with `transpose_lhs`) and rhs [m, n]."""
  if transpose_lhs and quantized:
    raise ValueError(
      "`transpose_lhs=True` takes float operands; pass a quantized lhs as [k, m] with its "
      "scales (transpose_lhs=False)."
    )
  if transpose_lhs:
    m, k = lhs.shape
    if rhs.shape[0] != m:
      raise ValueError(
        f"m mismatch: with transpose_lhs tgmm's lhs is [m, k] = {tuple(lhs.shape)} and rhs is "
        f"[m, n] = {tuple(rhs.shape)}; their first dims must both be m."
      )
  else:
    k, m = lhs.shape
    if rhs.shape[0] != m:
      raise ValueError(
        f"m mismatch: tgmm's lhs is [k, m] = {tuple(lhs.shape)} and rhs is [m, n] = "
        f"{tuple(rhs.shape)}; pass lhs transposed (x.T), or x itself with transpose_lhs=True."
      )
  return m, k, rhs.shape[1]


def _tgmm_dtypes(lhs, rhs, *, lhs_q: bool, rhs_q: bool, preferred_element_type):
  """(lhs, rhs) dtypes tgmm computes in, and its output dtype."""
  # NOTE: a quantized operand computes (and, for tiles and the VMEM estimate, counts) as the
  # other operand's float dtype, or bf16 when both are quantized: the upcast copy in VMEM.
  lhs_like = (rhs.dtype if not rhs_q else jnp.bfloat16) if lhs_q else lhs.dtype
  rhs_like = (lhs.dtype if not lhs_q else jnp.bfloat16) if rhs_q else rhs.dtype
  if preferred_element_type is None and lhs_q and rhs_q:
    return lhs_like, rhs_like, jnp.dtype(jnp.float32)
  out_dtype = common.result_dtype(
    jax.ShapeDtypeStruct((), lhs_like), jax.ShapeDtypeStruct((), rhs_like), preferred_element_type
  )
  return lhs_like, rhs_like, out_dtype


def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  preferred_element_type: Any = None,
  tiling: Tiles | TileFn | None = None,
  group_offset: jax.Array | int | None = None,
  num_actual_groups: int | None = None,
  existing_out: jax.Array | None = None,
  interpret: common.Interpret = None,
  *,
  lhs_scales: jax.Array | None = None,
  rhs_scales: jax.Array | None = None,
  expected_rows: int | None = None,
  transpose_lhs: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """Transposed grouped matmul: out[g] = lhs[:, rows of g] @ rhs[rows of g] (+ existing_out[g]).

  The weight gradient of gmm. Empty groups give exact zeros (or `existing_out`).

  Quantized operands: lhs and / or rhs may be int8 or float8_e4m3fn with f32 scales, so that
  the operand means `values * scales`. The contraction is over m (tokens), so:
  - per-channel scales (lhs [k, 1], one per output row; rhs [1, n], one per output column) factor
    out of the sum and scale each group's f32 result once. With both operands quantized this
    way in one dtype, the dot runs on the narrow values where the MXU has that mode (int8 on
    v5e / v5p / v6e, fp8 on tpu7x; int32 / f32 results), else on values upcast to bf16 (exact).
  - per-token scales (lhs [1, m], rhs [m, 1]) vary along the contraction: they multiply the
    operand upcast in VMEM before the dot, which then runs in the other operand's float dtype
    (bf16 when both are quantized, rounding the scaled values like a bf16 dequantize).
  Not differentiable in the quantized operands.

  Args:
    lhs: [k, m] float array ([m, k] with `transpose_lhs`).
    rhs: [m, n] float array.
    group_sizes: [G_total] integer rows per group.
    preferred_element_type: output dtype; None means the promoted dtype of lhs and rhs.
    tiling: (tm, tk, tn) over (m, k, n), a callable (m, k, n) -> tiles, or None.
    group_offset: first group to compute (scalar, may be traced). Default 0.
    num_actual_groups: number of groups to compute (the output's leading dim); default G_total.
    existing_out: optional [num_actual_groups, k, n] array of the output dtype, added.
    interpret: as in `gmm`.
    lhs_scales: f32 scales of an int8 / fp8 lhs: [k, 1] or [1, m] (see above).
    rhs_scales: f32 scales of an int8 / fp8 rhs: [1, n] or [m, 1] (see above).
    expected_rows: a hint for the default tiles only, as in `gmm`.
    transpose_lhs: lhs is given as [m, k] (e.g. gmm's own lhs, for its weight gradient): the
      kernel contracts its rows in VMEM, so no transposed copy is made in HBM, and the row-tile
      kernel starts each group's MXU passes at its first row (to the rows' VMEM tile) instead of
      on the 128-row lane grid. Float operands only.
    implementation: as in `gmm` ("xla": `jax.lax.ragged_dot_general`, quantized operands
      dequantized in f32).

  Returns:
    [num_actual_groups, k, n] array (f32 by default when both operands are quantized, else the
    float operands' promoted dtype).
  """
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if isinstance(x, quant.QuantizedWeights):
      raise TypeError(
        f"`{name}` is a QuantizedWeights: QuantizedWeights is gmm's rhs; for tgmm pass the "
        f"int8 / fp8 values as `{name}` and their f32 scales as `{name}_scales`."
      )
  implementation, interpret = _check_implementation(implementation, interpret)
  lhs_q = _check_tgmm_array("lhs", lhs)
  rhs_q = _check_tgmm_array("rhs", rhs)
  if not isinstance(transpose_lhs, bool):
    raise TypeError(f"`transpose_lhs` must be a bool, got {type(transpose_lhs).__name__}.")
  m, k, n = _tgmm_dims(lhs, rhs, transpose_lhs=transpose_lhs, quantized=lhs_q or rhs_q)
  _check_tgmm_scales("lhs", lhs, lhs_scales, quantized=lhs_q, channel=(k, 1), token=(1, m))
  _check_tgmm_scales("rhs", rhs, rhs_scales, quantized=rhs_q, channel=(1, n), token=(m, 1))
  group_sizes = common.check_group_sizes(group_sizes, m=m)
  num_groups_total = group_sizes.shape[0]
  if num_actual_groups is None:
    num_actual_groups = num_groups_total
  if not isinstance(num_actual_groups, (int,)) or not 1 <= num_actual_groups <= num_groups_total:
    raise ValueError(
      f"`num_actual_groups`={num_actual_groups!r} must be an int in [1, {num_groups_total}] "
      "(the number of groups in group_sizes)."
    )
  group_offset = common.check_group_offset(
    group_offset, num_groups_total=num_groups_total, num_local_groups=num_actual_groups
  )
  lhs_like, rhs_like, out_dtype = _tgmm_dtypes(
    lhs, rhs, lhs_q=lhs_q, rhs_q=rhs_q, preferred_element_type=preferred_element_type
  )
  common.check_existing_out(existing_out, shape=(num_actual_groups, k, n), dtype=out_dtype)
  tiles = _resolve_tiles(
    tiling,
    dims=(m, k, n),
    kind="tgmm",
    num_groups=num_actual_groups,
    dtypes=(lhs_like, rhs_like, out_dtype),
    interpret=interpret,
    # NOTE: the row-tile tgmm takes no scales: quantized operands run the visit kernel.
    allow_rowtile=not (lhs_q or rhs_q),
    expected_rows=_check_expected_rows(expected_rows),
    existing_out=existing_out is not None,
    transpose_lhs=transpose_lhs,
  )
  _announce(
    GmmPlan(
      op="tgmm",
      dims=(m, k, n),
      num_groups=num_actual_groups,
      generation=tiling_lib.current_generation().name,
      kernels=(("tgmm", tiles),),
      implementation=implementation,
    )
  )
  # NOTE: the narrow MXU dot needs one narrow dtype on both sides and scales that factor out of
  # the contraction (per channel); per-token scales are applied to upcast values instead.
  narrow_dot = (
    lhs_q
    and rhs_q
    and lhs.dtype == rhs.dtype
    and (tuple(lhs_scales.shape), tuple(rhs_scales.shape)) == ((k, 1), (1, n))
    and quant.narrow_dot_supported(lhs.dtype, tiling_lib.current_generation())
  )
  operands = _vary_together(lhs, rhs, group_sizes, group_offset, existing_out)
  scales = [
    None if x is None else common.pvary_like(x, *operands) for x in (lhs_scales, rhs_scales)
  ]

  def kernels():
    return _tgmm_jit(
      *operands,
      *scales,
      tiling=tiles,
      out_dtype=out_dtype,
      num_actual_groups=num_actual_groups,
      interpret=interpret,
      narrow_dot=bool(narrow_dot),
      transpose_lhs=transpose_lhs,
    )

  def xla():
    out = xla_gmm.tgmm_xla(
      *operands,
      num_actual_groups=num_actual_groups,
      transpose_lhs=transpose_lhs,
      out_dtype=out_dtype,
      lhs_scales=scales[0],
      rhs_scales=scales[1],
    )
    return common.pvary_like(out, *operands)

  return _per_platform(kernels, xla, implementation)


def gmm_plan(lhs: Any, rhs: Any, group_sizes: Any, *args: Any, **kwargs: Any) -> GmmPlan:
  """The `GmmPlan` of `gmm(lhs, rhs, group_sizes, *args, **kwargs)`, without running it.

  Takes gmm's arguments; lhs, rhs and group_sizes may be `jax.ShapeDtypeStruct`s. The plan is
  for the current generation (`tiling.use_generation` picks another):

    with pallas_moe.tiling.use_generation("v6e"):
      print(pallas_moe.gmm_plan(x, w, group_sizes).describe())

  Returns:
    The plan `gmm` would trace with these arguments.
  """
  # NOTE: only this call's recorder: nothing runs, so enclosing `record_plans` see nothing.
  plans: list[GmmPlan] = []
  token = _RECORDERS.set((plans,))
  try:
    jax.eval_shape(lambda *a: gmm(*a, *args, **kwargs), lhs, rhs, group_sizes)
  finally:
    _RECORDERS.reset(token)
  return plans[-1]
