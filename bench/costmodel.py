"""Modeled TPU time of Pallas TPU kernels, derived from the real `pallas_call`.

How it works (see docs/design.md, "How performance is judged without a TPU"):

1. `analyze(fn, *args)` traces `fn` with `jax.make_jaxpr` (arrays become abstract; pass big
   operands as `jax.ShapeDtypeStruct` so nothing is allocated) and finds every `pallas_call`,
   also inside jit / custom_vjp / custom_jvp / checkpoint calls.
2. The values a pallas_call needs to schedule its grid (dynamic grid sizes and scalar-prefetch
   operands, e.g. megablox's group metadata and `num_tiles`) are computed from the concrete
   arguments (e.g. `group_sizes`): the jaxpr is re-interpreted under one `jax.jit`, evaluating
   every equation whose inputs are known and leaving the rest (anything that needs the abstract
   operands) unknown.
3. The grid is walked in execution order (row-major, last axis fastest) with the index maps
   evaluated vectorized over all steps (`jax.vmap` of each state-discharged index-map jaxpr).
   As in the Pallas TPU pipeline, an input block is fetched when its block index differs from
   the previous step's (and at step 0); an output block is written back when its index differs
   from the next step's (and at the last step). Bytes per block are clipped at array edges.
   Blocks in `pl.ANY`/HBM (manual DMA) and semaphores are not pipelined and are not counted
   (listed in `notes`).
4. `cost(schedule, generation=...)` turns a schedule into time for one TPU generation:
   per step, DMA time = bytes moved / HBM bandwidth; MXU time = padded MACs x 2 / peak, where a
   dot_general with lhs rows r, contraction K and output columns N costs
   max(r, p) x ceil(K/mxu)·mxu x ceil(N/mxu)·mxu MACs, p = the generation's
   `min_pass_rows` (switching a weight tile in costs as much as streaming p rows; p = mxu, on
   tpu7x fit on measured times). Dots inside `lax.cond` count their most expensive branch
   (kernels that skip work must say so through `step_scale`, below); `scan` bodies count
   `length` times; `while` bodies count once (noted). Step time = max(MXU, DMA) + overhead (the
   generation's `step_overhead_s`: 0.35 µs; v6e 0.68 µs and tpu7x 0.84 µs, fit on measured TPU
   times); the modeled time is
   the sum over steps. VPU work (masks, casts) is not modeled.
5. TensorCores (`cost(..., tensorcores=...)`): "kernel" (the default) counts what the compiled
   program does (AOT
   LLO dumps, jax 0.10.2 / libtpu 0.0.42): a TensorCore runs at the chip's rates over its
   `cores_per_chip`; on a megacore device (v4, v5p: two TensorCores) Mosaic splits the grid's
   leading "parallel" axes, flattened, between the two cores (core c runs parallel indices
   [c·h, (c+1)·h), h = ceil(P / 2), behind a `BarrierMegacore`), and when there are none, or
   their product P is 1, it wraps the kernel in a `PrimaryCoreRegion` that one core runs (so
   does a grid-less `pallas_call` around `emit_pipeline`). A kernel's time is its busiest
   core's. A tpu7x JAX device is one TensorCore: every kernel runs on it at half the chip's
   rates. "chip" charges every kernel the whole chip's rates (the model's first figures, about
   2x optimistic on v5p and tpu7x against measured TPU times: `bench.measured`).

Instrumentation hook: a kernel that skips its dot in some steps (megablox's tgmm on empty groups,
or a kernel that only pushes the MXU-granular rows of a group) passes
`step_scale(ctx) -> float array [steps]`: the fraction of the kernel's (max-branch) MXU work
each step really executes. `StepContext` gives the program ids and the concrete scalar-prefetch
values, so the hook evaluates the kernel's own predicate. For megablox gmm no hook is needed:
every visited step runs one full [tm, tk] x [tk, tn] dot, so rows executed = visited tiles x tm.

Row accounting: `mxu_rows_executed` = Σ_steps scale · padded MACs / `row_macs`, where `row_macs` is
what one token row costs in a full sweep of the other two dims. Passing the padded figure (k and n
rounded up to the tile grid and the MXU: Σ over k tiles of ceil(tk/mxu)·mxu, same for n) counts pure
row waste (the definition in docs/design.md, "MXU row waste and weight traffic"); passing k·n folds
column padding into the row figure. `mxu_rows_useful` is the caller's count of real rows
(sum(group_sizes)).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from pallas_moe import _jax_compat
from pallas_moe.generations import min_pass_rows, pass_granule, tensorcore_rates
from pallas_moe.tiling import TpuGeneration, get_generation

__all__ = [
  "StepContext",
  "CallSchedule",
  "CallCost",
  "CostReport",
  "analyze",
  "cost",
  "model",
  "aligned_rows",
  "floor_rows",
  "op_floor_rows",
  "kernel_dot_macs",
  "compiled_excess_us",
  "cost_with_compiled_schedule",
  "TENSORCORE_MODELS",
  "use_tensorcores",
  "current_tensorcores",
  "step_tensorcores",
  "DEFAULT_STEP_OVERHEAD_S",
  "CALL_FIXED_US",
  "CALL_FIXED_STAND_IN",
  "XLA_OP_FIXED_US",
  "call_fixed_us",
  "fixed_cost_us",
]

DEFAULT_STEP_OVERHEAD_S = 0.35e-6
# How `cost` counts TensorCores (module docstring, 5.).
TENSORCORE_MODELS = ("chip", "kernel")
_TENSORCORES: contextvars.ContextVar[str] = contextvars.ContextVar(
  "costmodel_tensorcores", default="kernel"
)


@contextlib.contextmanager
def use_tensorcores(model: str):
  """Makes `cost` count TensorCores by `model` ("kernel", the default, or "chip") inside the
  block, where its caller does not pass `tensorcores` (e.g. the bench's searches and EP tables).

  Args:
    model: one of `TENSORCORE_MODELS`.

  Yields:
    The model.
  """
  if model not in TENSORCORE_MODELS:
    raise ValueError(f"tensorcores model {model!r}; use one of {TENSORCORE_MODELS}")
  token = _TENSORCORES.set(model)
  try:
    yield model
  finally:
    _TENSORCORES.reset(token)


def current_tensorcores() -> str:
  """The TensorCore model `cost` uses where its caller passes none (`use_tensorcores`)."""
  return _TENSORCORES.get()


_CALL_PARAM_NAMES = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives whose sub-jaxpr runs exactly once, with the equation's operands as its inputs.
_CALL_LIKE = frozenset(
  {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "checkpoint",
    "remat",
    "remat2",
    "custom_lin",
    "run_scoped",
  }
)


class _Unknown:
  def __repr__(self):
    return "<unknown>"


_UNKNOWN = _Unknown()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepContext:
  """What a `step_scale` hook sees.

  Attributes:
    name: the pallas_call's name.
    grid: the resolved grid.
    program_ids: one int array [steps] per grid axis, in execution order.
    index_operands: the concrete scalar-prefetch operands (numpy).
    pipelined: the operands the Pallas pipeline moves (BlockSpecs, counted by `analyze`), as
      "in<i>" / "out<j>" (array operands in order): a manual-DMA hook leaves them out.
  """

  name: str
  grid: tuple[int, ...]
  program_ids: tuple[np.ndarray, ...]
  index_operands: tuple[np.ndarray, ...]
  pipelined: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallSchedule:
  """The generation-independent schedule of one pallas_call.

  Attributes:
    name: the pallas_call's name.
    grid: the resolved grid.
    dimension_semantics: from the compiler params (None if unset).
    steps: number of grid steps.
    step_bytes: HBM bytes moved by the pipeline at each step (fetches + write-backs).
    operand_bytes: total bytes per operand (by origin, e.g. "args[2]", "outputs").
    operand_array_bytes: the full size of each pipelined operand.
    kernel_jaxpr: the kernel body (for counting dots).
    step_scale: per-step MXU work fraction from the hook, or None (all steps run their dots).
    notes: anything not modeled.
    step_exposed_bytes: per-step manual-DMA bytes the kernel waits for with no MXU work to
      overlap (from the `step_manual_bytes` hook), or None; charged on top of the step's
      max(MXU, DMA) time.
  """

  name: str
  grid: tuple[int, ...]
  dimension_semantics: tuple[str, ...] | None
  steps: int
  step_bytes: np.ndarray
  operand_bytes: dict[str, int]
  operand_array_bytes: dict[str, int]
  kernel_jaxpr: Any
  step_scale: np.ndarray | None
  notes: tuple[str, ...]
  step_exposed_bytes: np.ndarray | None = None

  @property
  def hbm_bytes(self) -> int:
    return int(sum(self.operand_bytes.values()))

  @property
  def min_hbm_bytes(self) -> int:
    """Each pipelined operand read once and each output written once."""
    return int(sum(self.operand_array_bytes.values()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallCost:
  """Modeled cost of one pallas_call on one generation."""

  name: str
  grid: tuple[int, ...]
  steps: int
  modeled_us: float
  mxu_us: float
  dma_us: float
  overhead_us: float
  hbm_bytes: int
  min_hbm_bytes: int
  mxu_macs_padded: float
  dot_flops: float
  operand_bytes: dict[str, int]
  notes: tuple[str, ...]
  compute_excess_us: float = 0.0
  tensorcores: int = 1
  # NOTE: the part of dma_us no MXU work overlaps (a sweep's first load, the last write).
  exposed_us: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostReport:
  """Modeled cost of everything `fn` launches, with the problem's bounds.

  Attributes:
    generation: generation name.
    calls: per pallas_call costs.
    modeled_us: Σ of the calls.
    hbm_bytes: Σ of the calls.
    min_hbm_bytes: caller's figure, else Σ of the calls' operand sizes.
    mxu_rows_executed: padded MACs / row_macs (None without row_macs).
    mxu_rows_useful: caller's count of real rows (None if not given).
    roofline_us: max(2·rows_useful·useful_row_macs/peak, min_bytes/bw) (None without rows).
    achievable_us: same with floor_rows in place of rows_useful (None without floor_rows).
  """

  generation: str
  calls: tuple[CallCost, ...]
  modeled_us: float
  hbm_bytes: int
  min_hbm_bytes: int
  mxu_rows_executed: float | None
  mxu_rows_useful: int | None
  roofline_us: float | None
  achievable_us: float | None

  @property
  def row_waste(self) -> float | None:
    if self.mxu_rows_executed is None or not self.mxu_rows_useful:
      return None
    return self.mxu_rows_executed / self.mxu_rows_useful


# ----------------------------------------------------------------------------------------------
# Finding pallas_calls and their concrete scalar-prefetch values.


def _sub_jaxpr(eqn) -> tuple[jex_core.Jaxpr, Sequence[Any]] | None:
  for key in _CALL_PARAM_NAMES:
    j = eqn.params.get(key)
    if isinstance(j, jex_core.ClosedJaxpr):
      return j.jaxpr, j.consts
    if isinstance(j, jex_core.Jaxpr):
      return j, ()
  return None


def _all_sub_jaxprs(eqn):
  for p in eqn.params.values():
    for q in p if isinstance(p, (tuple, list)) else (p,):
      if isinstance(q, jex_core.ClosedJaxpr):
        yield q.jaxpr
      elif isinstance(q, jex_core.Jaxpr):
        yield q


def _contains_pallas(jaxpr: jex_core.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      return True
    if any(_contains_pallas(j) for j in _all_sub_jaxprs(eqn)):
      return True
  return False


def _interpret(jaxpr, consts, inputs, found: list, path: str):
  """Evaluates what can be evaluated; records pallas_call equations with their operands."""
  env: dict[Any, Any] = {}

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val
    return env.get(v, _UNKNOWN)

  for v, c in zip(jaxpr.constvars, consts, strict=True):
    env[v] = c
  for v, x in zip(jaxpr.invars, inputs, strict=True):
    env[v] = x
  for i, eqn in enumerate(jaxpr.eqns):
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    outs = None
    if name == "pallas_call":
      found.append((eqn, ins, f"{path}/{i}"))
    elif name in _CALL_LIKE and _sub_jaxpr(eqn) is not None:
      sub, sub_consts = _sub_jaxpr(eqn)
      if len(sub.invars) == len(ins) and len(sub.outvars) == len(eqn.outvars):
        outs = _interpret(sub, sub_consts, ins, found, f"{path}/{i}:{name}")
    elif any(_contains_pallas(j) for j in _all_sub_jaxprs(eqn)):
      # A pallas_call inside cond/scan/while: found, but its operands stay unknown.
      for j in _all_sub_jaxprs(eqn):
        _interpret(
          j, [_UNKNOWN] * len(j.constvars), [_UNKNOWN] * len(j.invars), found, f"{path}/{i}:{name}"
        )
    elif all(x is not _UNKNOWN for x in ins) and not eqn.effects:
      bind_params = eqn.primitive.get_bind_params(eqn.params)
      res = eqn.primitive.bind(*ins, **bind_params)
      outs = list(res) if eqn.primitive.multiple_results else [res]
    if outs is None:
      outs = [_UNKNOWN] * len(eqn.outvars)
    for v, x in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, jex_core.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _find_pallas_calls(fn: Callable, args, kwargs):
  """Returns [(eqn, concrete schedule operands or None per operand, path)]."""
  flat, tree = jax.tree.flatten((args, kwargs))
  abstract, known = [], []
  for a in flat:
    if isinstance(a, jax.ShapeDtypeStruct):
      abstract.append(a)
      known.append(None)
    else:
      arr = np.asarray(a) if not isinstance(a, jax.Array) else a
      abstract.append(jax.ShapeDtypeStruct(arr.shape, arr.dtype))
      known.append(arr)

  def flat_fn(*xs):
    a, kw = jax.tree.unflatten(tree, xs)
    return fn(*a, **kw)

  closed = jax.make_jaxpr(flat_fn)(*abstract)
  found_static: list = []
  # First pass (abstract) only to learn which operands each pallas_call needs.
  _interpret(
    closed.jaxpr, [_UNKNOWN] * len(closed.consts), [_UNKNOWN] * len(flat), found_static, ""
  )
  needed = []
  for eqn, _, _ in found_static:
    gm = eqn.params["grid_mapping"]
    needed.append(gm.num_dynamic_grid_bounds + gm.num_index_operands)

  known_vals = [k for k in known if k is not None]

  def evaluate(kv):
    it = iter(kv)
    ins = [next(it) if k is not None else _UNKNOWN for k in known]
    found: list = []
    _interpret(closed.jaxpr, closed.consts, ins, found, "")
    outs = []
    for (_, ops, _), n in zip(found, needed, strict=True):
      outs.append([None if x is _UNKNOWN else jnp.asarray(x) for x in ops[:n]])
    return outs

  if any(needed):
    values = jax.jit(evaluate)(known_vals)
  else:
    values = [[] for _ in found_static]
  return [
    (eqn, [None if v is None else np.asarray(v) for v in vals], path)
    for (eqn, _, path), vals in zip(found_static, values, strict=True)
  ]


# ----------------------------------------------------------------------------------------------
# Walking the grid.


def _index_map_fn(bm):
  pure = jex_core.jaxpr_as_fun(_jax_compat.discharge_state(bm.index_map_jaxpr))
  n_out = len(bm.index_map_jaxpr.out_avals)

  def f(*a):
    return pure(*a)[:n_out]

  return f


def _block_indices(block_mappings, grid, index_operands):
  """Block indices of every mapping at every step: list of int64 arrays [steps, ndim]."""
  steps = math.prod(grid)
  pids = np.unravel_index(np.arange(steps, dtype=np.int64), grid)
  pids = tuple(p.astype(np.int32) for p in pids)
  fns = [_index_map_fn(bm) for bm in block_mappings]
  n_grid = len(grid)

  def all_maps(pid_arrays, idx_ops):
    outs = []
    for f in fns:
      vf = jax.vmap(f, in_axes=(0,) * n_grid + (None,) * len(idx_ops))
      res = vf(*pid_arrays, *idx_ops)
      outs.append(jnp.stack([jnp.broadcast_to(r, (pid_arrays[0].shape[0],)) for r in res], -1))
    return outs

  if steps == 0:
    return pids, [np.zeros((0, len(bm.block_shape)), np.int64) for bm in block_mappings]
  outs = jax.jit(all_maps)(pids, tuple(jnp.asarray(x) for x in index_operands))
  return pids, [np.asarray(o, dtype=np.int64) for o in outs]


def _block_bytes(bm, idx: np.ndarray) -> np.ndarray:
  """Bytes of the block at each step, clipped at the array's edges."""
  shape = bm.array_aval.shape
  itemsize = np.dtype(bm.array_aval.dtype).itemsize
  elems = np.ones(idx.shape[0], np.int64)
  for d, bd in enumerate(bm.block_shape):
    dim = shape[d]
    if isinstance(bd, pl.Squeezed) or bd is None:
      continue
    if isinstance(bd, pl.Blocked) or isinstance(bd, int):
      bs = bd.block_size if isinstance(bd, pl.Blocked) else bd
      start = idx[:, d] * bs
    elif isinstance(bd, pl.Element):
      bs = bd.block_size
      start = idx[:, d] - bd.padding[0]
    else:
      raise NotImplementedError(f"block dim {bd!r} of {bm.origin} is not modeled")
    elems *= np.clip(dim - start, 0, bs)
  return elems * itemsize


def _pipelined(bm) -> bool:
  ms = str(getattr(bm.transformed_block_aval, "memory_space", "")).lower()
  return not any(s in ms for s in ("any", "hbm", "semaphore"))


def analyze(
  fn: Callable,
  *args,
  step_scale: Callable[[StepContext], np.ndarray] | None = None,
  step_manual_bytes: Callable[[StepContext], np.ndarray] | None = None,
  **kwargs,
) -> list[CallSchedule]:
  """Traces `fn(*args, **kwargs)` and schedules every pallas_call it launches.

  Args:
    fn: any function that launches Pallas TPU kernels (static arguments bound with partial).
    *args: arrays (concrete: used to compute scalar-prefetch values) or `jax.ShapeDtypeStruct`
      (abstract: for big operands).
    step_scale: optional hook, see the module docstring; applied to every pallas_call.
    step_manual_bytes: optional hook (same context) giving the bytes a kernel moves by manual DMA
      (operands in `pl.ANY`) in each step: an array (overlapped with the step's MXU work: added
      to the step's DMA) or a pair (overlapped, exposed: waited for with nothing to overlap,
      charged after the step's max(MXU, DMA)). Reported as operand "manual". Without it, manual
      DMAs are not counted (and a note says so).
    **kwargs: keyword arguments of `fn`, same rules as args.

  Returns:
    One `CallSchedule` per pallas_call, in program order.
  """
  schedules = []
  for eqn, vals, path in _find_pallas_calls(fn, args, kwargs):
    gm = eqn.params["grid_mapping"]
    dbg = getattr(eqn.params["jaxpr"], "debug_info", None)
    name = str(eqn.params.get("name") or getattr(dbg, "func_name", None) or "pallas_call")
    name = f"{name}@{path}"
    n_dyn = gm.num_dynamic_grid_bounds
    if any(v is None for v in vals):
      raise ValueError(
        f"pallas_call {name} at {path}: its dynamic grid sizes / scalar-prefetch operands depend "
        "on an abstract argument; pass the arguments they derive from (e.g. group_sizes) as "
        "concrete arrays."
      )
    dyn = iter(int(v) for v in vals[:n_dyn])
    grid = tuple(next(dyn) if g is _jax_compat.DYNAMIC_GRID_DIM else int(g) for g in gm.grid)
    index_operands = tuple(vals[n_dyn:])
    bms = gm.block_mappings
    pids, indices = _block_indices(bms, grid, index_operands)
    steps = math.prod(grid)
    step_bytes = np.zeros(steps, np.float64)
    operand_bytes, array_bytes, notes = {}, {}, []
    for i, (bm, idx) in enumerate(zip(bms, indices, strict=True)):
      is_out = i >= gm.num_inputs
      label = f"{'out' if is_out else 'in'}{i - gm.num_inputs if is_out else i}:{bm.origin}"
      if not _pipelined(bm):
        notes.append(
          f"{label} is not pipelined (memory space "
          f"{bm.transformed_block_aval.memory_space}); its manual DMAs are not counted"
        )
        continue
      if steps == 0:
        continue
      nbytes = _block_bytes(bm, idx)
      diff = np.any(idx[1:] != idx[:-1], axis=1)
      moved = np.ones(steps, bool)
      if is_out:
        moved[:-1] = diff  # written back when the next step's block differs, and at the end
      else:
        moved[1:] = diff  # fetched when this step's block differs from the previous one
      b = np.where(moved, nbytes, 0)
      step_bytes += b
      operand_bytes[label] = int(b.sum())
      array_bytes[label] = int(
        math.prod(bm.array_aval.shape) * np.dtype(bm.array_aval.dtype).itemsize
      )
    scale = None
    pipelined = frozenset(
      f"out{i - gm.num_inputs}" if i >= gm.num_inputs else f"in{i}"
      for i, bm in enumerate(bms)
      if _pipelined(bm)
    )
    ctx = StepContext(
      name=name,
      grid=grid,
      program_ids=pids,
      index_operands=index_operands,
      pipelined=pipelined,
    )
    if step_scale is not None and steps:
      scale = np.broadcast_to(np.asarray(step_scale(ctx), np.float64), (steps,))
    exposed = None
    if step_manual_bytes is not None and steps:
      res = step_manual_bytes(ctx)
      over, exp = res if isinstance(res, tuple) else (res, 0.0)
      manual = np.broadcast_to(np.asarray(over, np.float64), (steps,))
      exposed = np.broadcast_to(np.asarray(exp, np.float64), (steps,))
      step_bytes = step_bytes + manual
      operand_bytes["manual"] = round(float(manual.sum() + exposed.sum()))
      notes = [n for n in notes if "not pipelined" not in n]
      notes.append("manual DMAs counted from the kernel's schedule (step_manual_bytes hook)")
    cp = eqn.params.get("compiler_params")
    sem = None
    if cp is not None:
      tpu = cp.get("mosaic_tpu") if isinstance(cp, dict) else cp
      sem = getattr(tpu, "dimension_semantics", None)
      sem = tuple(str(s) for s in sem) if sem is not None else None
    schedules.append(
      CallSchedule(
        name=name,
        grid=grid,
        dimension_semantics=sem,
        steps=steps,
        step_bytes=step_bytes,
        operand_bytes=operand_bytes,
        operand_array_bytes=array_bytes,
        kernel_jaxpr=eqn.params["jaxpr"],
        step_scale=scale,
        notes=tuple(notes),
        step_exposed_bytes=exposed,
      )
    )
  return schedules


# ----------------------------------------------------------------------------------------------
# MXU work of the kernel body.


def _dot_padded_macs(eqn, mxu: int, min_rows: int | None = None) -> tuple[float, float]:
  """(padded MACs, true MACs) of one dot_general; a weight tile costs at least `min_rows` row
  passes (default mxu)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  ls = eqn.invars[0].aval.shape
  rs = eqn.invars[1].aval.shape
  batch = math.prod(ls[d] for d in lb)
  contract = math.prod(ls[d] for d in lc)
  rows = math.prod(s for d, s in enumerate(ls) if d not in lc and d not in lb)
  cols = math.prod(s for d, s in enumerate(rs) if d not in rc and d not in rb)
  pad = lambda x: -(-x // mxu) * mxu
  padded = batch * max(rows, mxu if min_rows is None else min_rows) * pad(contract) * pad(cols)
  return float(padded), float(batch * rows * contract * cols)


def kernel_dot_macs(
  jaxpr: jex_core.Jaxpr, *, mxu: int, min_rows: int | None = None
) -> tuple[float, float, tuple[str, ...]]:
  """MXU work of one execution of a kernel body.

  Args:
    jaxpr: the kernel jaxpr (`pallas_call`'s `jaxpr` param).
    mxu: MXU edge.
    min_rows: rows a pass through one weight tile costs at least (default mxu;
      `pallas_moe.generations.min_pass_rows`).

  Returns:
    (padded MACs, true MACs, notes). `cond` counts its most expensive branch, `scan` its body
    `length` times, `while` its body once.
  """
  padded = true = 0.0
  notes: list[str] = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      p, t = _dot_padded_macs(eqn, mxu, min_rows)
      padded += p
      true += t
    elif name == "cond":
      best = (0.0, 0.0)
      for br in eqn.params["branches"]:
        p, t, n = kernel_dot_macs(br.jaxpr, mxu=mxu, min_rows=min_rows)
        notes.extend(n)
        best = max(best, (p, t))
      padded += best[0]
      true += best[1]
    elif name == "scan":
      p, t, n = kernel_dot_macs(eqn.params["jaxpr"].jaxpr, mxu=mxu, min_rows=min_rows)
      notes.extend(n)
      padded += eqn.params["length"] * p
      true += eqn.params["length"] * t
    else:
      for sub in _all_sub_jaxprs(eqn):
        p, t, n = kernel_dot_macs(sub, mxu=mxu, min_rows=min_rows)
        if name == "while" and p:
          notes.append("dot inside a while loop counted once per step")
        notes.extend(n)
        padded += p
        true += t
  return padded, true, tuple(dict.fromkeys(notes))


# ----------------------------------------------------------------------------------------------
# Cost on a generation.


def _peak_flops(gen: TpuGeneration, jaxpr) -> float:
  """bf16 peak; dots whose operands are all int8 / fp8 run at the chip's int8 / fp8 peak where
  the generation table lists a native mode for it (`peak_int8_ops` / `peak_fp8_ops`); an 8-bit
  block upcast in VMEM before its dot runs at the bf16 peak."""
  dtypes = set()

  def visit(j):
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        dtypes.update(np.dtype(v.aval.dtype).name for v in e.invars[:2])
      for s in _all_sub_jaxprs(e):
        visit(s)

  visit(jaxpr)
  if dtypes and all(d in ("int8", "uint8") for d in dtypes) and gen.supports_int8:
    return gen.peak_int8_ops
  if dtypes and all(d.startswith("float8") for d in dtypes) and gen.supports_fp8:
    return gen.peak_fp8_ops
  return gen.peak_bf16_flops


def _is_split(semantic: str) -> bool:
  # NOTE: jax spells them "parallel" / "core_parallel" or as enum members
  # (`GridDimensionSemantics.PARALLEL`); both kinds are split between a megacore's cores.
  return str(semantic).lower().rsplit(".", 1)[-1] in ("parallel", "core_parallel")


def step_tensorcores(
  *,
  grid: Sequence[int],
  dimension_semantics: Sequence[str] | None,
  tensorcores_per_device: int,
) -> tuple[int, np.ndarray]:
  """Which TensorCore of a device runs each grid step, as Mosaic splits a grid (module
  docstring, 5.).

  Args:
    grid: the resolved grid.
    dimension_semantics: per axis, or None (unset: all "arbitrary").
    tensorcores_per_device: the generation's `tensorcores_per_device`.

  Returns:
    (cores the kernel runs on, core index of each step in row-major grid order).
  """
  steps = math.prod(grid)
  lead = 0
  for sem in dimension_semantics or ():
    if not _is_split(sem):
      break
    lead += 1
  par = math.prod(grid[:lead])
  if tensorcores_per_device < 2 or par <= 1:
    return 1, np.zeros(steps, np.int64)
  per_core = -(-par // tensorcores_per_device)
  inner = math.prod(grid[lead:])
  core = (np.arange(steps) // inner) // per_core
  return int(core.max()) + 1, core


def cost(
  schedules: Sequence[CallSchedule],
  *,
  generation: str | TpuGeneration,
  row_macs: float | None = None,
  mxu_rows_useful: int | None = None,
  useful_row_macs: float | None = None,
  floor_rows_count: int | None = None,
  min_hbm_bytes: int | None = None,
  step_overhead_s: float | None = None,
  compute_excess_us: Sequence[float] | None = None,
  tensorcores: str | None = None,
) -> CostReport:
  """Modeled time of schedules on one TPU generation.

  Args:
    schedules: from `analyze`.
    generation: TPU generation (name or `TpuGeneration`).
    row_macs: MACs one token row costs in a full sweep (see module docstring); None skips rows.
    mxu_rows_useful: real rows (sum(group_sizes)).
    useful_row_macs: true MACs per row for the bounds (k·n); default row_macs.
    floor_rows_count: `floor_rows(group_sizes, mxu)` for the achievable bound.
    min_hbm_bytes: minimum traffic; default Σ of the pipelined operands' sizes.
    step_overhead_s: per-step overhead; default the generation's `step_overhead_s`.
    compute_excess_us: per call, compute time beyond its MXU time (see
      `cost_with_compiled_schedule`); None: none.
    tensorcores: "kernel": at one TensorCore's rates, with the steps split between a megacore
      device's TensorCores as Mosaic splits the kernel's grid, the call's time being its busiest
      core's (module docstring, 5.); a call's mxu_us / dma_us / overhead_us are then its
      busiest core's, and the bounds use one device's rates (its TensorCores'). "chip": every
      kernel at the whole chip's rates. None: what `use_tensorcores` set, else "kernel".

  Returns:
    The `CostReport`.
  """
  tensorcores = _TENSORCORES.get() if tensorcores is None else tensorcores
  if tensorcores not in TENSORCORE_MODELS:
    raise ValueError(f"tensorcores={tensorcores!r}; use one of {TENSORCORE_MODELS}")
  gen = get_generation(generation)
  if step_overhead_s is None:
    step_overhead_s = gen.step_overhead_s
  per_core = tensorcores == "kernel"
  core_flops, core_bw = tensorcore_rates(gen)
  # NOTE: rates scale by the same factor for every dtype (the int8 / fp8 peaks too).
  rate = (core_flops / gen.peak_bf16_flops) if per_core else 1.0
  bw = core_bw if per_core else gen.hbm_bytes_per_s
  calls = []
  padded_total = 0.0
  for i, s in enumerate(schedules):
    padded, true, dot_notes = kernel_dot_macs(
      s.kernel_jaxpr, mxu=gen.mxu_size, min_rows=min_pass_rows(gen)
    )
    peak = _peak_flops(gen, s.kernel_jaxpr) * rate
    scale = s.step_scale if s.step_scale is not None else np.ones(s.steps)
    mxu_t = scale * (2 * padded / peak)
    dma_t = s.step_bytes / bw
    stall = s.step_exposed_bytes / bw if s.step_exposed_bytes is not None else np.zeros(s.steps)
    excess = float(compute_excess_us[i]) if compute_excess_us is not None else 0.0
    compute_t = mxu_t
    if excess > 0 and mxu_t.sum() > 0:
      # NOTE: spread over the steps in proportion to their MXU work (the excess is vector /
      # XLU / issue work around the dots: per sub-block, per group of the step).
      compute_t = mxu_t * (1 + excess * 1e-6 / mxu_t.sum())
    cores, core = 1, np.zeros(s.steps, np.int64)
    if per_core:
      cores, core = step_tensorcores(
        grid=s.grid,
        dimension_semantics=s.dimension_semantics,
        tensorcores_per_device=gen.tensorcores_per_device,
      )
    step_t = np.maximum(compute_t, dma_t) + stall + step_overhead_s
    per = np.bincount(core, weights=step_t, minlength=cores) if s.steps else np.zeros(1)
    busy = int(np.argmax(per))
    mine = core == busy
    padded_exec = float(scale.sum() * padded)
    padded_total += padded_exec
    calls.append(
      CallCost(
        name=s.name,
        grid=s.grid,
        steps=s.steps,
        modeled_us=float(per[busy]) * 1e6,
        mxu_us=float(mxu_t[mine].sum()) * 1e6,
        dma_us=float(dma_t[mine].sum() + stall[mine].sum()) * 1e6,
        overhead_us=int(mine.sum()) * step_overhead_s * 1e6,
        hbm_bytes=s.hbm_bytes,
        min_hbm_bytes=s.min_hbm_bytes,
        mxu_macs_padded=padded_exec,
        dot_flops=float(scale.sum() * true * 2),
        operand_bytes=dict(s.operand_bytes),
        notes=s.notes + dot_notes,
        compute_excess_us=excess,
        tensorcores=cores,
        exposed_us=float(stall[mine].sum()) * 1e6,
      )
    )
  min_bytes = min_hbm_bytes if min_hbm_bytes is not None else sum(c.min_hbm_bytes for c in calls)
  rows_exec = padded_total / row_macs if row_macs else None
  urm = useful_row_macs if useful_row_macs is not None else row_macs
  dev = gen.tensorcores_per_device if per_core else 1
  dev_flops = core_flops * dev if per_core else gen.peak_bf16_flops
  bw_t = min_bytes / (bw * dev)
  roof = ach = None
  if mxu_rows_useful is not None and urm:
    roof = max(2 * mxu_rows_useful * urm / dev_flops, bw_t) * 1e6
  if floor_rows_count is not None and urm:
    ach = max(2 * floor_rows_count * urm / dev_flops, bw_t) * 1e6
  return CostReport(
    generation=gen.name,
    calls=tuple(calls),
    modeled_us=sum(c.modeled_us for c in calls),
    hbm_bytes=sum(c.hbm_bytes for c in calls),
    min_hbm_bytes=int(min_bytes),
    mxu_rows_executed=rows_exec,
    mxu_rows_useful=mxu_rows_useful,
    roofline_us=roof,
    achievable_us=ach,
  )


def compiled_excess_us(*, bound_us: float, mxu_us: float) -> float:
  """The compute time a compiled VLIW schedule adds to the analytic MXU time.

  `bench.llo` measures, from Mosaic's final bundles of the compiled kernel and the case's trip
  counts, `bound_us`: Σ over loop bodies and predicated regions of max(bundles, MXU-busy
  cycles) x executions, at the clock the peak implies. The regions run one after another, so
  what exceeds the MXU-busy time is compute the analytic model does not charge: regions with no
  MXU work (a group's weight transpose with `rows_stationary`, a tgmm accumulator's zeroing and
  write-out, the output block's initialization) and loop bodies whose issue exceeds their MXU
  work (vector accumulation of the contraction, masks, casts).

  Args:
    bound_us: `bench.llo.LloReport.bound_us`.
    mxu_us: `bench.llo.LloReport.mxu_us` (equal to the model's MXU µs for our kernels).

  Returns:
    max(0, bound_us - mxu_us).
  """
  return max(0.0, bound_us - mxu_us)


def cost_with_compiled_schedule(
  schedules: Sequence[CallSchedule],
  *,
  generation: str | TpuGeneration,
  excess_us: Sequence[float],
  **kwargs,
) -> CostReport:
  """`cost` with each call's compute time raised by its compiled schedule's excess.

  Each step costs max(MXU + excess share, DMA) + overhead; the call's excess
  (`compiled_excess_us`, from `bench.llo`) is shared by its steps in proportion to their MXU
  work. The MXU, DMA and row figures are unchanged; `CallCost.compute_excess_us` records it.

  Args:
    schedules: from `analyze`.
    generation: TPU generation.
    excess_us: one figure per call, in program order.
    **kwargs: the other arguments of `cost`.

  Returns:
    The `CostReport`.
  """
  if len(excess_us) != len(schedules):
    raise ValueError(f"{len(excess_us)} excess figures for {len(schedules)} calls")
  return cost(schedules, generation=generation, compute_excess_us=excess_us, **kwargs)


def model(
  fn: Callable,
  *args,
  generation: str | TpuGeneration,
  step_scale: Callable[[StepContext], np.ndarray] | None = None,
  row_macs: float | None = None,
  mxu_rows_useful: int | None = None,
  useful_row_macs: float | None = None,
  floor_rows_count: int | None = None,
  min_hbm_bytes: int | None = None,
  step_overhead_s: float | None = None,
  tensorcores: str | None = None,
  **kwargs,
) -> CostReport:
  """`analyze` then `cost` in one call.

  Args:
    fn: function launching Pallas kernels.
    *args: its arguments (see `analyze`).
    generation: TPU generation.
    step_scale: per-step MXU work hook (see module docstring).
    row_macs: see `cost`.
    mxu_rows_useful: see `cost`.
    useful_row_macs: see `cost`.
    floor_rows_count: see `cost`.
    min_hbm_bytes: see `cost`.
    step_overhead_s: see `cost`.
    tensorcores: see `cost`.
    **kwargs: keyword arguments of fn.

  Returns:
    The `CostReport`.
  """
  scheds = analyze(fn, *args, step_scale=step_scale, **kwargs)
  return cost(
    scheds,
    generation=generation,
    row_macs=row_macs,
    mxu_rows_useful=mxu_rows_useful,
    useful_row_macs=useful_row_macs,
    floor_rows_count=floor_rows_count,
    min_hbm_bytes=min_hbm_bytes,
    step_overhead_s=step_overhead_s,
    tensorcores=tensorcores,
  )


def op_floor_rows(group_sizes, *, generation, op: str) -> int:
  """`floor_rows` at the op's pass granule (`pallas_moe.generations.pass_granule`): gmm's rows
  (fwd, dlhs) in `min_pass_rows` passes, a group's last two as one widened pass where the row-tile
  gmm runs them so (`metadata.merge_tail_rows`: half a pass more); tgmm's (drhs) contracted in
  MXU-edge chunks."""
  if op == "drhs":
    return floor_rows(group_sizes, pass_granule(generation, kind="tgmm"))
  granule = pass_granule(generation, kind="gmm")
  return floor_rows(group_sizes, granule, tail=granule // 2)


def floor_rows(group_sizes, mxu: int, *, tail: int = 0) -> int:
  """Rows a pass-granular kernel cannot avoid pushing: each group's rows in whole passes.

  A systolic MXU multiplies a weight tile by at least `mxu` rows at a time (the op's pass
  granule), and a pass holds one group's weights. A kernel pushing passes of `mxu` rows does
  best with ceil(s / mxu) of them for a group of s rows, started at its first row (tokamax's
  v2 row blocks start there; pallas_moe's row-tile gmm starts within 16 rows of it, and so
  does its tgmm where lhs comes as [m, k], as gmm's backward passes it); empty groups cost
  nothing. With `tail`, the group's last two passes count as
  one of mxu + tail rows where the last would hold at most `tail` rows (the row-tile gmm's
  widened last pass, `metadata.merge_tail_rows`).

  Args:
    group_sizes: rows per group (sorted-by-group layout).
    mxu: rows per pass.
    tail: rows a widened last pass adds to a pass (0: none).

  Returns:
    Total rows.
  """
  gs = np.maximum(np.asarray(group_sizes, np.int64), 0)
  passes = -(-gs // mxu)
  rows = passes * mxu
  if tail:
    widened = (passes >= 2) & (gs - (passes - 1) * mxu <= tail)
    rows = rows - np.where(widened, mxu - tail, 0)
  return int(rows.sum())


def aligned_rows(group_sizes, chunk: int) -> int:
  """Rows a kernel that pushes passes on a fixed `chunk`-row grid pushes: each group's rows
  rounded out to the grid at both ends, ceil(e / chunk)·chunk - floor(s / chunk)·chunk for rows
  [s, e); a chunk shared by two groups counts for each (each needs its own weights in the MXU),
  empty groups cost nothing. pallas_moe's visit kernels and its row-tile tgmm with a [k, m]
  lhs (rows of a tile that is a multiple of chunk) push this; `floor_rows` is the bound below
  it."""
  gs = np.asarray(group_sizes, np.int64)
  ends = np.cumsum(gs)
  starts = ends - gs
  touched = -(-ends // chunk) * chunk - (starts // chunk) * chunk
  return int(np.where(gs > 0, touched, 0).sum())


# ----------------------------------------------------------------------------------------------
# Fixed costs of small calls (decode sizes).

# NOTE: the per-call fixed cost of a Pallas kernel: measured - modeled of the one small problem
# tokamax 0.0.17 measured, its v2 ragged dot forward at m=8, k=n=4096, G=8 (one row per group,
# 268 MB of bf16 weights), on the chips it measured it on (`python -m bench.decode --fit`). The
# model there (`bench.measured.model_config`) already charges the per-step overhead, so what is
# left is the launch, the pipeline's fill and drain, and whatever else one call pays once. One
# problem size cannot tell a fixed cost from HBM running below its peak (measured / (bytes over
# the device's bandwidth) is 1.13 on v5p and v6e): charged as a fixed cost it is an upper bound
# on the fixed cost (and a lower bound on the bandwidth's efficiency). Under `jax.vjp` the same
# kernel measures 12.0 (v5p), 21.5 (v6e) and 3.7 µs (tpu7x) above the model.
CALL_FIXED_US = {"v5p": 10.05, "v6e": 16.60, "tpu7x": 2.78}
# NOTE: chips tokamax has no small problem for: v5e (and v4) take v5p's figure, an assumption.
CALL_FIXED_STAND_IN = {"v5e": "v5p", "v4": "v5p"}
# NOTE: the launch cost of one top-level XLA instruction beside the kernels (a fusion, a copy, a
# cumsum): no measured TPU time pins it; 1 µs is an assumption (`bench.decode` prints how its
# ratios move at 0.25-2 µs).
XLA_OP_FIXED_US = 1.0


def call_fixed_us(generation: str | TpuGeneration) -> float:
  """Per-call fixed cost of one Pallas kernel launch on `generation`, µs (`CALL_FIXED_US`; a
  chip without a measured small problem takes `CALL_FIXED_STAND_IN`'s)."""
  name = get_generation(generation).name
  return CALL_FIXED_US[CALL_FIXED_STAND_IN.get(name, name)]


def fixed_cost_us(
  generation: str | TpuGeneration,
  *,
  calls: int,
  xla_ops: int = 0,
  call_us: float | None = None,
  op_us: float = XLA_OP_FIXED_US,
) -> float:
  """The fixed time of a decode-size step: what it pays per launch, whatever its bytes.

  A kernel's modeled time (`cost`) charges its bytes, MXU work and per-step overhead; at a few
  rows per expert what remains is paid per launch: `calls` Pallas kernels at `call_us` each
  (default `call_fixed_us(generation)`) and `xla_ops` top-level XLA instructions around them
  (group metadata, pads, activations) at `op_us` each.

  Args:
    generation: TPU generation.
    calls: Pallas kernel launches.
    xla_ops: top-level XLA instructions beside the kernels.
    call_us: per-call cost, µs (default: the generation's fitted figure).
    op_us: per-instruction cost, µs.

  Returns:
    µs.
  """
  per_call = call_fixed_us(generation) if call_us is None else call_us
  return calls * per_call + xla_ops * op_us
