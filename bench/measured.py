"""The cost model against real TPU measurements: tokamax's autotuning caches.

tokamax ships the measurements of its autotuner: `tokamax/data/autotuning/<chip>/
pallas_mosaic_tpu_ragged_dot.json` (its v1 kernel) and `pallas_mosaic_tpu_v2_ragged_dot.json`
(v2), for v5e (`tpu_v5_lite`), v5p (`tpu_v5`), v6e (`tpu_v6_lite`) and tpu7x. Each key is a
ragged-dot problem (operand shapes and dtypes, group sizes, dimension numbers, ...); each value
maps a kernel config to measured `evaluation_times_ms`. This module reads them, models every
usable bf16 problem with the kernel's schedule at the measured tiles, and prints measured /
modeled per problem and per chip and op.

Mapping (checked against tokamax 0.0.17's source):
- Ops by dimension numbers: fwd `(([1],[1]),([],[]))` lhs [m,k] x rhs [G,k,n]; dlhs
  `(([1],[2]),([],[]))` dout [m,n] x rhs [G,k,n]; drhs `(([0],[0]),([],[]))` lhs [m,k] x dout
  [m,n] -> [G,k,n]. Keys that differ only in `return_residuals` are the forward run under
  `jax.vjp` (same kernel); both are kept.
- Group sizes: a list is used as is; `{num_groups, total_size}` means what tokamax's
  `GroupSizes` draws from it, `generate_group_sizes(m=total_size, num_groups=...)`: seed 0,
  `total_size` i.i.d. uniform choices of a group, then a bincount (not an even split).
- v1 tiles (`pallas_mosaic_tpu.py`): fwd and drhs pass (tile_m, tile_k, tile_n) to the kernel
  as megablox's (tm, tk, tn). dlhs passes (tile_m, tile_n, tile_k) (tile_n tiles the
  contraction) since tokamax commit e919cdc (2026-07-14); before it, (tile_m, tile_k, tile_n).
  Caches written before that commit hold the old order (`dlhs_old_order`).
- v1 schedule: megablox's grid and index maps run by `pltpu.emit_pipeline` inside a grid-less
  `pallas_call`; modeled as megablox's schedule (`bench.impls`, as impl "tokamax" does). Its
  `input_buffer_count` is recorded, not modeled. A grid-less kernel runs on one TensorCore.
- v2 configs are all `tile_*: null`: the kernel's own `calculate_tiling` picked the tiles;
  `bench.impls.megablox_v2_tiles` reproduces it, and impl "megablox-v2" models the schedule.

The model (`modeled_us`) is the cost model's default: TensorCores counted per kernel
(`costmodel.cost(..., tensorcores="kernel")`: the busiest TensorCore's steps at one TensorCore's
rates, as the compiled programs show: a grid-less kernel runs in a `PrimaryCoreRegion`, a grid
with a parallel axis of more than one tile is split). A tpu7x JAX device is one of the chip's
two TensorCores; on v5p (two TensorCores per device, megacore) a grid-less kernel (v1) runs on
one of them, and v2's TensorCore mesh splits only its n tiles between the two. Per-step overhead
is the generation's (`TpuGeneration.step_overhead_s`). The XLA copies around the kernel in the
measured program (`harness_copy_bytes`: the residual output's copy, and transposing layout
copies of [m, d] arrays whose d is not a multiple of 128) are added at HBM bandwidth. The
`chip rates` column is the kernel at the whole chip's rates, 0.35 µs per step, no copies.

Usage: `python -m bench.measured [--chip v5e] [--op fwd] [--kernel v1] [--limit N]
[--cache-dir DIR] [--per-problem] [--json FILE] [--fit]`, or `--from-json FILE [--fit]` to
re-print a saved run. `--compiled DUMP_DIR [--mxu-rows-per-cycle 2]` also charges each v1
problem's compiled-schedule excess (`compiled_restated`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
  "CHIP_DIRS",
  "KERNEL_FILES",
  "MeasuredConfig",
  "MeasuredProblem",
  "ModeledConfig",
  "generate_group_sizes",
  "default_cache_dir",
  "parse_entry",
  "load_problems",
  "dlhs_old_order",
  "kernel_tiling",
  "real_schedules",
  "model_config",
  "compiled_restated",
  "harness_copy_bytes",
  "device_hbm_bytes_per_s",
  "summarize",
  "markdown_table",
  "fit_report",
  "main",
]

# Our generation name -> tokamax's cache directory.
CHIP_DIRS = {"v5e": "tpu_v5_lite", "v5p": "tpu_v5", "v6e": "tpu_v6_lite", "tpu7x": "tpu7x"}
KERNEL_FILES = {
  "v1": "pallas_mosaic_tpu_ragged_dot.json",
  "v2": "pallas_mosaic_tpu_v2_ragged_dot.json",
}
_DIMS = {
  (((1,), (1,)), ((), ())): "fwd",
  (((1,), (2,)), ((), ())): "dlhs",
  (((0,), (0,)), ((), ())): "drhs",
}
_SHAPE_RE = re.compile(r"^(\w+)\[([\d,]*)\]$")

# NOTE: the v1 dlhs caches written before tokamax commit e919cdc (2026-07-14) ran the kernel with
# tiling (tile_m, tile_k, tile_n); the later ones with (tile_m, tile_n, tile_k). In tokamax's
# history the v5e cache was last written on 2026-03-12 (51396a3) and the tpu7x one on
# 2026-04-20 (0a69d97); 0.0.17 kept those entries unchanged and added a few (listed below, keyed
# (chip, m, k, n, G)), while v5p's (2026-07-21) and v6e's (added later) are all newer.
_OLD_ORDER_CHIPS = frozenset({"v5e", "tpu7x"})
_NEW_ORDER_ENTRIES = frozenset({("tpu7x", 4096, 4096, 4096, 8), ("tpu7x", 8, 4096, 4096, 8)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredConfig:
  """One measured config of a problem.

  Attributes:
    fields: the cache's config fields (tile_m, tile_k, tile_n, input_buffer_count, ...).
    times_ms: `evaluation_times_ms`.
  """

  fields: dict
  times_ms: tuple[float, ...]

  @property
  def ms(self) -> float:
    """Median of the evaluation times."""
    return float(np.median(self.times_ms))

  @property
  def tiles(self) -> tuple[int, int, int] | None:
    """(tile_m, tile_k, tile_n) as the cache names them, None when the kernel picked them."""
    t = tuple(self.fields.get(f) for f in ("tile_m", "tile_k", "tile_n"))
    return None if any(v is None for v in t) else t


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredProblem:
  """One measured ragged-dot problem.

  Attributes:
    chip: our generation name ("v5e", "v5p", "v6e", "tpu7x").
    kernel: "v1" or "v2".
    op: "fwd", "dlhs" or "drhs".
    m: rows (the ragged dimension).
    k: the forward's contraction (d_model side).
    n: the forward's output columns.
    num_groups: G.
    group_sizes: int32 [G], as the measurement used them.
    generated: whether the group sizes were drawn by `generate_group_sizes`.
    residuals: `return_residuals` (the forward under `jax.vjp`).
    configs: the measured configs.
    key: the cache key (JSON text).
  """

  chip: str
  kernel: str
  op: str
  m: int
  k: int
  n: int
  num_groups: int
  group_sizes: np.ndarray
  generated: bool
  residuals: bool
  configs: tuple[MeasuredConfig, ...]
  key: str

  @property
  def best(self) -> MeasuredConfig:
    return min(self.configs, key=lambda c: c.ms)

  @property
  def label(self) -> str:
    r = "+res" if self.residuals else ""
    dims = f"m={self.m} k={self.k} n={self.n} G={self.num_groups}"
    return f"{self.chip} {self.kernel} {self.op}{r} {dims}"


def generate_group_sizes(*, m: int, num_groups: int, seed: int = 0) -> np.ndarray:
  """tokamax's `generate_group_sizes` (`_src/ops/ragged_dot/base.py`) with uniform p.

  Args:
    m: rows to assign (the key's `total_size`).
    num_groups: groups.
    seed: numpy seed (tokamax's default, 0).

  Returns:
    int32 [num_groups]: how many of m i.i.d. uniform draws picked each group.
  """
  rng = np.random.default_rng(seed)
  group_ids = rng.choice(num_groups, (m,), p=None, replace=True)
  return np.bincount(group_ids, minlength=num_groups).astype(np.int32)


def default_cache_dir() -> Path | None:
  """The installed tokamax package's `data/autotuning` directory (None if not installed).

  Found with `importlib.util.find_spec`, which does not import tokamax.
  """
  spec = importlib.util.find_spec("tokamax")
  if spec is None or not spec.submodule_search_locations:
    return None
  path = Path(next(iter(spec.submodule_search_locations))) / "data" / "autotuning"
  return path if path.is_dir() else None


def _shape(spec) -> tuple[str, tuple[int, ...]] | None:
  if not isinstance(spec, str):
    return None  # a quantized operand (a dict describing a QArray)
  mt = _SHAPE_RE.match(spec)
  if not mt:
    return None
  return mt.group(1), tuple(int(d) for d in mt.group(2).split(",") if d)


def _canon_dims(dn) -> tuple:
  (lc, rc), (lb, rb) = dn
  return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def parse_entry(key: str, value: dict, *, chip: str, kernel: str) -> MeasuredProblem | str:
  """One cache entry as a problem, or the reason it is not usable.

  Args:
    key: the cache key (JSON text).
    value: config (JSON text) -> record with `evaluation_times_ms`.
    chip: our generation name.
    kernel: "v1" or "v2".

  Returns:
    The `MeasuredProblem`, or a short reason string.
  """
  kd = json.loads(key)
  lhs, rhs = _shape(kd["lhs"]), _shape(kd["rhs"])
  if lhs is None or rhs is None:
    return "quantized operands"
  if lhs[0] != "bf16" or rhs[0] != "bf16":
    return f"dtypes {lhs[0]} x {rhs[0]}"
  if kd.get("preferred_element_type") not in (None, "bfloat16"):
    return f"preferred_element_type {kd['preferred_element_type']}"
  for f in ("activation", "group_offset", "fuse_gateup_activation"):
    if kd.get(f) is not None:
      return f"{f} set"
  if kd.get("zero_initialize"):
    return "zero_initialize"
  rdn = kd["ragged_dot_dimension_numbers"]
  op = _DIMS.get(_canon_dims(rdn["dot_dimension_numbers"]))
  if op is None:
    return f"dimension numbers {rdn['dot_dimension_numbers']}"
  ls, rs = lhs[1], rhs[1]
  if op == "fwd":
    (m, k), (g, k2, n) = ls, rs
    ok = k == k2
  elif op == "dlhs":
    (m, n), (g, k, n2) = ls, rs
    ok = n == n2
  else:
    (m, k), (m2, n) = ls, rs
    g = None
    ok = m == m2
  if not ok:
    return f"inconsistent shapes {ls} x {rs}"
  gs_spec = kd["group_sizes"]
  if isinstance(gs_spec, dict):
    g_key, total = int(gs_spec["num_groups"]), int(gs_spec["total_size"])
    gs = generate_group_sizes(m=total, num_groups=g_key)
    generated = True
  else:
    gs = np.asarray(gs_spec, np.int32)
    g_key, generated = gs.size, False
  if g is not None and g != g_key:
    return f"rhs has {g} groups, group_sizes {g_key}"
  if int(gs.sum()) > m:
    return f"group sizes sum {int(gs.sum())} > m={m}"
  configs = tuple(
    MeasuredConfig(fields=json.loads(c), times_ms=tuple(float(t) for t in r["evaluation_times_ms"]))
    for c, r in value.items()
    if r.get("evaluation_times_ms")
  )
  if not configs:
    return "no measurements"
  return MeasuredProblem(
    chip=chip,
    kernel=kernel,
    op=op,
    m=m,
    k=k,
    n=n,
    num_groups=g_key,
    group_sizes=gs,
    generated=generated,
    residuals=bool(kd.get("return_residuals")),
    configs=configs,
    key=key,
  )


def load_problems(
  *,
  cache_dir: str | Path | None = None,
  chips: Iterable[str] | None = None,
  kernels: Iterable[str] = ("v1", "v2"),
  ops: Iterable[str] | None = None,
) -> tuple[list[MeasuredProblem], list[tuple[str, str, str]]]:
  """Reads the caches.

  Args:
    cache_dir: a directory laid out as tokamax's `data/autotuning` (`<chip dir>/<file>.json`);
      default: the installed tokamax package's.
    chips: our generation names; default all four.
    kernels: "v1" and/or "v2".
    ops: ops to keep; default all.

  Returns:
    (problems, skipped), skipped as (chip, kernel, reason) per unusable entry.
  """
  root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
  if root is None:
    raise ValueError(
      "tokamax is not installed: pass cache_dir= (a copy of tokamax's data/autotuning)."
    )
  chips = list(chips) if chips is not None else list(CHIP_DIRS)
  for c in chips:
    if c not in CHIP_DIRS:
      raise ValueError(f"chips: unknown chip {c!r}; known: {sorted(CHIP_DIRS)}")
  problems, skipped = [], []
  for chip in chips:
    for kernel in kernels:
      path = root / CHIP_DIRS[chip] / KERNEL_FILES[kernel]
      if not path.is_file():
        continue
      for key, value in json.loads(path.read_text()).items():
        p = parse_entry(key, value, chip=chip, kernel=kernel)
        if isinstance(p, str):
          skipped.append((chip, kernel, p))
        elif ops is None or p.op in ops:
          problems.append(p)
  return problems, skipped


def dlhs_old_order(problem: MeasuredProblem) -> bool:
  """Whether a v1 dlhs measurement ran its kernel with (tile_m, tile_k, tile_n) (before tokamax
  commit e919cdc) rather than (tile_m, tile_n, tile_k)."""
  p = problem
  return (
    p.kernel == "v1"
    and p.op == "dlhs"
    and p.chip in _OLD_ORDER_CHIPS
    and (p.chip, p.m, p.k, p.n, p.num_groups) not in _NEW_ORDER_ENTRIES
  )


def kernel_tiling(problem: MeasuredProblem, config: MeasuredConfig) -> tuple[int, int, int]:
  """The v1 kernel's (tm, tk, tn) in megablox's terms (tk tiles the contraction).

  Args:
    problem: a v1 problem.
    config: one of its configs.

  Returns:
    The tiling the kernel ran with (not clamped to the dims).
  """
  tiles = config.tiles
  if tiles is None:
    raise ValueError("config: v1 configs name their tiles; v2's are picked by the kernel.")
  tm, tk, tn = tiles
  if problem.op == "dlhs" and not dlhs_old_order(problem):
    return (tm, tn, tk)
  return (tm, tk, tn)


def real_schedules(problem: MeasuredProblem, schedules):
  """The schedules with the dimension semantics of the kernel tokamax really runs: v1 is a
  grid-less `pallas_call` around `emit_pipeline` (none: one TensorCore); v2's TensorCore mesh
  splits its n tiles, as the parallel first axis of its modeled grid (n, gm, k) says."""
  if problem.kernel == "v1":
    return tuple(dataclasses.replace(s, dimension_semantics=None) for s in schedules)
  return tuple(schedules)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeledConfig:
  """The model of one measured config.

  Attributes:
    tiling: (tm, tk, tn) in the kernel's terms, as modeled (clamped to the dims).
    measured_us: the config's measured time (median of its runs).
    modeled_us: the model of the measured program: the kernel's schedule costed as
      `costmodel.cost` does by default (TensorCores per kernel: one TensorCore's rates, steps
      split between a megacore device's cores only as the kernel's grid lets Mosaic split them;
      the generation's per-step overhead), plus `copy_us`.
    kernel_us: the kernel alone (`modeled_us` less `copy_us`).
    modeled_chip_us: the kernel at the whole chip's rates (`tensorcores="chip"`), no copies: the
      model's first figures.
    copy_us: XLA copies around the kernel in the measured program (`harness_copy_bytes`) at
      the device's HBM bandwidth.
    mxu_us: MXU time (busiest TensorCore).
    dma_us: DMA time (busiest TensorCore).
    overhead_us: per-step overhead (busiest TensorCore).
    steps: grid steps (all of them).
    extra: kernel facts (v2: bucket_base, lhs_buffer_count).
  """

  tiling: tuple[int, int, int]
  measured_us: float
  modeled_us: float
  kernel_us: float
  modeled_chip_us: float
  copy_us: float
  mxu_us: float
  dma_us: float
  overhead_us: float
  steps: int
  extra: dict

  @property
  def ratio(self) -> float:
    return self.measured_us / self.modeled_us

  @property
  def modeled_1tc_us(self) -> float:
    """The kernel with TensorCores counted per kernel (an earlier name of `kernel_us`)."""
    return self.kernel_us

  @property
  def bound(self) -> str:
    """What dominates the model: "mxu", "dma", "overhead" or "copy"."""
    parts = {
      "mxu": self.mxu_us,
      "dma": self.dma_us,
      "overhead": self.overhead_us,
      "copy": self.copy_us,
    }
    return max(parts, key=parts.get)


def harness_copy_bytes(problem: MeasuredProblem) -> dict[str, int]:
  """HBM bytes of the XLA copies around the kernel in tokamax's measured program.

  - `return_residuals`: the op returns its output twice (`residuals = out`), and a jitted
    program cannot return one buffer as two outputs: XLA copies it (read + write).
  - A 2D [m, d] operand or result with d not a multiple of 128 (gpt-oss's 2880): XLA's TPU
    layout assignment gives the program's parameter and result the transposed layout
    (`{0,1:T(8,128)(2,1)}`: m is the tiled minor dim), and the Mosaic kernel needs row-major,
    so the compiled program transposes each such array on its way in or out (an AOT compile of
    megablox's gmm at k = n = 2880 for v6e: a `copy` of the lhs before the kernel and of the
    output after it; at 3072 neither). The [G, k, n] weights keep their row-major layout.

  Args:
    problem: the problem.

  Returns:
    {"residuals": bytes, "layout": bytes} (read + write, bf16).
  """
  p = problem
  out_cols = p.n if p.op == "fwd" else p.k
  res = 2 * p.m * out_cols * 2 if p.residuals else 0
  # NOTE: the 2D arrays of each op: fwd lhs [m, k] and out [m, n]; dlhs dout [m, n] and out
  # [m, k]; drhs lhs [m, k] and dout [m, n].
  layout = sum(2 * p.m * d * 2 for d in (p.k, p.n) if d % 128 and p.m % 128 == 0)
  return {"residuals": res, "layout": layout}


def device_hbm_bytes_per_s(generation) -> float:
  """HBM bandwidth of one JAX device: the chip's over its TensorCores, times the device's (an
  XLA fusion on a megacore device runs on both of its cores; a tpu7x device is one core)."""
  from pallas_moe.generations import get_generation, tensorcore_rates

  gen = get_generation(generation)
  return tensorcore_rates(gen)[1] * gen.tensorcores_per_device


def _bench_shape(problem: MeasuredProblem):
  from bench.shapes import Shape

  return Shape(
    name="tokamax",
    tokens=problem.m,
    top_k=1,
    num_groups=problem.num_groups,
    k=problem.k,
    n=problem.n,
  )


@functools.lru_cache(maxsize=8)
def _v1_schedules(op, shape, gs_bytes, tiling):
  from bench import costmodel, impls

  gs = np.frombuffer(gs_bytes, np.int32)
  case = impls._megablox_build(tiling)(op=op, shape=shape, group_sizes=gs, generation=None)
  return case.tiling, tuple(costmodel.analyze(case.fn, *case.args, step_scale=case.step_scale))


def model_config(problem: MeasuredProblem, config: MeasuredConfig) -> ModeledConfig:
  """Models one measured config with its kernel's schedule at its tiles.

  Args:
    problem: the problem.
    config: one of its configs.

  Returns:
    The `ModeledConfig`.

  Raises:
    bench.impls.Unsupported: the schedule cannot be modeled (e.g. m % tm != 0).
  """
  from bench import costmodel, impls
  from pallas_moe.generations import get_generation

  gen = get_generation(problem.chip)
  shape = _bench_shape(problem)
  gs = np.asarray(problem.group_sizes, np.int32)
  extra = {}
  if problem.kernel == "v1":
    til, scheds = _v1_schedules(problem.op, shape, gs.tobytes(), kernel_tiling(problem, config))
  else:
    case = impls.IMPLS["megablox-v2"].build(
      op=problem.op, shape=shape, group_sizes=gs, generation=gen
    )
    til, scheds, extra = case.tiling, case.schedules, dict(case.extra)
  rep_chip = costmodel.cost(
    scheds, generation=gen, tensorcores="chip", step_overhead_s=costmodel.DEFAULT_STEP_OVERHEAD_S
  )
  rep = costmodel.cost(real_schedules(problem, scheds), generation=gen, tensorcores="kernel")
  copy_us = sum(harness_copy_bytes(problem).values()) / device_hbm_bytes_per_s(gen) * 1e6
  return ModeledConfig(
    tiling=tuple(til),
    measured_us=config.ms * 1e3,
    modeled_us=rep.modeled_us + copy_us,
    kernel_us=rep.modeled_us,
    modeled_chip_us=rep_chip.modeled_us,
    copy_us=copy_us,
    mxu_us=sum(c.mxu_us for c in rep.calls),
    dma_us=sum(c.dma_us for c in rep.calls),
    overhead_us=sum(c.overhead_us for c in rep.calls),
    steps=sum(c.steps for c in rep.calls),
    extra=extra,
  )


def compiled_restated(
  problem: MeasuredProblem,
  config: MeasuredConfig,
  *,
  cache_dir: str,
  mxu_rows_per_cycle: int = 1,
) -> dict:
  """A v1 config's model with its compiled schedule's excess charged (`bench.llo`).

  Compiles megablox's kernel (v1's grid and index maps) at the config's tiles for the chip
  with the LLO dumps on, and charges max(0, bound - MXU) (`costmodel.compiled_excess_us`) on
  the schedules `model_config` costs (`costmodel.cost_with_compiled_schedule`), plus the copies.

  Args:
    problem: a v1 problem on a chip whose JAX device is one TensorCore (v5e, v6e, tpu7x).
    config: one of its configs.
    cache_dir: parent of the dump directories (reused when present).
    mxu_rows_per_cycle: see `bench.llo.report` (2: the peak at half the implied clock).

  Returns:
    {"issue_us", "mxu_us", "bound_us", "excess_us", "restated_us", "ratio"}: ratio is measured /
    restated.
  """
  from bench import costmodel, llo
  from pallas_moe.generations import get_generation

  if problem.kernel != "v1":
    raise ValueError("problem: only v1 (megablox's grid) compiles as a bench case.")
  gen = get_generation(problem.chip)
  if gen.tensorcores_per_device != 1:
    # NOTE: bench.llo divides the compiled cycles over the cores the megablox grid would be
    # split over, and v1 is grid-less: on a megacore device the two disagree.
    raise ValueError(f"problem: {problem.chip} has megacore devices; use v5e, v6e or tpu7x.")
  mc = model_config(problem, config)
  (rep,) = llo.analyze_case(
    impl="megablox-maxtext",
    op=problem.op,
    shape=_bench_shape(problem),
    generation=problem.chip,
    cache_dir=cache_dir,
    tiling=kernel_tiling(problem, config),
    group_sizes=problem.group_sizes,
    mxu_rows_per_cycle=mxu_rows_per_cycle,
  )
  excess = costmodel.compiled_excess_us(bound_us=rep.bound_us, mxu_us=rep.mxu_us)
  shape = _bench_shape(problem)
  gs = np.asarray(problem.group_sizes, np.int32)
  _, scheds = _v1_schedules(problem.op, shape, gs.tobytes(), kernel_tiling(problem, config))
  cost = costmodel.cost_with_compiled_schedule(
    real_schedules(problem, scheds), generation=gen, excess_us=[excess]
  )
  restated = cost.modeled_us + mc.copy_us
  return dict(
    issue_us=rep.issue_us,
    mxu_us=rep.mxu_us,
    bound_us=rep.bound_us,
    excess_us=excess,
    restated_us=restated,
    ratio=mc.measured_us / restated,
  )


# ----------------------------------------------------------------------------------------------
# Report.


def _quantiles(x: Sequence[float]) -> tuple[float, float, float]:
  a = np.asarray(x, np.float64)
  return tuple(float(v) for v in np.quantile(a, [0.5, 0.1, 0.9]))


def _op_label(r: dict) -> str:
  return r["op"] + ("+res" if r["residuals"] else "")


BAND = (0.8, 1.25)


def _reason(r: dict) -> str:
  """What the model says of a record, for the worst cases: what dominates it and the facts that
  the misses share (dims not multiples of 128, rows per group under the tile, few steps)."""
  parts = {
    "mxu": r["mxu_us"],
    "dma": r["dma_us"],
    "overhead": r["overhead_us"],
    "copy": r.get("copy_us", 0.0),
  }
  bound = max(parts, key=parts.get)
  rows_per_group = r["m"] / max(r["num_groups"], 1)
  bits = [
    f"model {bound}-bound",
    f"mxu {r['mxu_us']:.0f} dma {r['dma_us']:.0f} ovh {r['overhead_us']:.0f}"
    f" copies {r.get('copy_us', 0.0):.0f} us",
    f"{r['steps']} steps",
  ]
  if r["k"] % 128 or r["n"] % 128:
    bits.append("dims not multiples of 128: transposing layout copies (charged at HBM rate)")
  if rows_per_group < r["tiling"][0]:
    bits.append(f"~{rows_per_group:.0f} rows/group < tm")
  if r["steps"] <= 64:
    bits.append("few steps (launch and pipeline fill not modeled)")
  if r["tiling"][0] < 256 and r["chip"] in ("v6e", "tpu7x"):
    bits.append(f"tm {r['tiling'][0]} < the 256-wide MXU (charged as 256 rows)")
  return ", ".join(bits)


def _stats(ratios) -> str:
  med, lo, hi = _quantiles(ratios)
  a = np.asarray(ratios)
  inside = float(np.mean((a >= BAND[0]) & (a <= BAND[1])))
  return f"{med:5.2f} [{lo:4.2f}, {hi:4.2f}] {inside:4.0%}"


def summarize(records: list[dict], *, worst: int = 2) -> str:
  """Per (chip, kernel, op) and per chip: count, measured / modeled at each problem's best
  measured config (median [p10, p90], share within [0.8, 1.25]), the chip-rate kernel model's
  median for comparison, then the worst cases (largest |log ratio|) with their reasons.

  Args:
    records: `main`'s records (only those with `best` are used).
    worst: worst cases listed per group.

  Returns:
    The table (text).
  """
  groups: dict[tuple[str, str, str], list[dict]] = {}
  for r in records:
    if r["best"]:
      groups.setdefault((r["chip"], r["kernel"], _op_label(r)), []).append(r)
  head = "chip   kernel op        n   measured/modeled: median [p10, p90] in[0.8,1.25]   chip rates"
  lines = [head]
  details = []
  per_chip: dict[str, list[float]] = {}
  for (chip, kernel, op), items in sorted(groups.items()):
    ratio = [r["measured_us"] / r["modeled_us"] for r in items]
    chip_rates = [r["measured_us"] / r["modeled_chip_us"] for r in items]
    per_chip.setdefault(chip, []).extend(ratio)
    lines.append(
      f"{chip:<6} {kernel:<6} {op:<8} {len(items):>3}   {_stats(ratio)}"
      f"                  {_quantiles(chip_rates)[0]:5.2f}"
    )
    for r, x in sorted(zip(items, ratio, strict=True), key=lambda t: -abs(math.log(t[1])))[:worst]:
      if BAND[0] <= x <= BAND[1]:
        continue
      details.append(
        f"  worst {chip} {kernel} {op}: m={r['m']} k={r['k']} n={r['n']} G={r['num_groups']}"
        f"{' (generated sizes)' if r['generated_sizes'] else ''} tiles {tuple(r['tiling'])}: "
        f"measured {r['measured_us']:.0f} us, modeled {r['modeled_us']:.0f} us (x{x:.2f}); "
        f"{_reason(r)}"
      )
  lines.append("")
  for chip, ratio in per_chip.items():
    lines.append(f"{chip:<6} all           {len(ratio):>3}   {_stats(ratio)}")
  return "\n".join(lines + [""] + details)


def markdown_table(records: list[dict]) -> str:
  """`summarize`'s per (chip, kernel, op) and per chip figures as a markdown table.

  Args:
    records: `main`'s records (only those with `best` are used).

  Returns:
    The table (markdown).
  """
  groups: dict[tuple[str, str, str], list[dict]] = {}
  for r in records:
    if r["best"]:
      groups.setdefault((r["chip"], r["kernel"], _op_label(r)), []).append(r)
      groups.setdefault((r["chip"], "all", ""), []).append(r)
  lines = [
    "| chip | kernel | op | n | measured / modeled: median [p10, p90] | in [0.8, 1.25] "
    "| chip rates (before): median |",
    "|---|---|---|---:|---|---:|---:|",
  ]
  order = {c: i for i, c in enumerate(CHIP_DIRS)}
  for (chip, kernel, op), items in sorted(
    groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1] == "all", kv[0][1:])
  ):
    ratio = np.array([r["measured_us"] / r["modeled_us"] for r in items])
    chip_rates = [r["measured_us"] / r["modeled_chip_us"] for r in items]
    med, lo, hi = _quantiles(ratio)
    inside = float(np.mean((ratio >= BAND[0]) & (ratio <= BAND[1])))
    bold = "**" if kernel == "all" else ""
    lines.append(
      f"| {bold}{chip}{bold} | {bold}{kernel}{bold} | {op} | {len(items)} "
      f"| {bold}{med:.2f}{bold} [{lo:.2f}, {hi:.2f}] | {bold}{inside:.0%}{bold} "
      f"| {_quantiles(chip_rates)[0]:.2f} |"
    )
  return "\n".join(lines)


def fit_report(records: list[dict]) -> str:
  """What-if fits per chip on the forward problems, checked on the rest.

  measured ≈ a · T + b · steps + copies, where T = Σ_steps max(MXU, DMA) of the kernel's
  schedule at the rates of the TensorCores it runs on (`kernel_us` less its overhead): a is a
  uniform slowdown of the MXU / HBM rates (clock, efficiency), b the per-step cost. Two fits,
  least squares on the relative error over each chip's plain forward records whose dims are
  multiples of 128 (best configs, both kernels; problems the first fit misses by more than 25%
  left out of the second): b alone with a = 1 (how `TpuGeneration.step_overhead_s` was set),
  and (a, b) with b >= 0. Reported: measured / fitted (median [p10, p90]) per (kernel, op), on
  the fit set and on the rest.

  Args:
    records: `main`'s records.

  Returns:
    Text.
  """
  best = [r for r in records if r["best"]]
  lines = ["what-if fits: measured = a*T(on the TensorCores the kernel uses) + b*steps + copies"]

  def design(rs):
    t = np.array([r["kernel_us"] - r["overhead_us"] for r in rs])
    steps = np.array([r["overhead_steps"] for r in rs], np.float64)
    copies = np.array([r["copy_us"] for r in rs])
    return t, steps, np.array([r["measured_us"] for r in rs]) - copies, copies

  for chip in CHIP_DIRS:
    fit = [
      r
      for r in best
      if r["chip"] == chip
      and r["op"] == "fwd"
      and not r["residuals"]
      and not (r["k"] % 128 or r["n"] % 128)
    ]
    if len(fit) < 3:
      continue
    t, steps, y, _ = design(fit)

    def solve(tk, sk, yk):
      # NOTE: relative least squares (rows divided by the measurement): big problems do not
      # dominate.
      b1 = float(np.sum(sk / yk * (1 - tk / yk)) / np.sum((sk / yk) ** 2))
      x = np.stack([tk / yk, sk / yk], axis=1)
      (a2, b2), *_ = np.linalg.lstsq(x, np.ones_like(yk), rcond=None)
      if b2 < 0:
        a2, b2 = float(np.sum(tk / yk) / np.sum(tk**2 / yk**2)), 0.0
      return b1, float(a2), float(b2)

    b1, a2, b2 = solve(t, steps, y)
    keep = np.abs(np.log(y / (t + b1 * steps))) < math.log(1.25)
    if keep.sum() >= 3:
      b1, a2, b2 = solve(t[keep], steps[keep], y[keep])
    lines.append(
      f"{chip}: b = {b1:.2f} us/step (a = 1) | a = {a2:.3f}, b = {b2:.2f} us/step"
      f"  (fit on {int(keep.sum())} of {len(fit)} fwd problems)"
    )
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in best:
      if r["chip"] == chip:
        groups.setdefault((r["kernel"], _op_label(r)), []).append(r)
    for (kernel, op), rs in sorted(groups.items()):
      t, steps, y, c = design(rs)
      q1 = _quantiles((y + c) / (t + b1 * steps + c))
      q2 = _quantiles((y + c) / (a2 * t + b2 * steps + c))
      lines.append(
        f"  {kernel} {op:<8} {len(rs):>3}: measured/fitted {q1[0]:.2f} [{q1[1]:.2f}, {q1[2]:.2f}]"
        f" | {q2[0]:.2f} [{q2[1]:.2f}, {q2[2]:.2f}]"
      )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m bench.measured", description=__doc__.split("\n")[0])
  ap.add_argument("--chip", action="append", choices=sorted(CHIP_DIRS), help="repeatable")
  ap.add_argument("--op", action="append", choices=["fwd", "dlhs", "drhs"], help="repeatable")
  ap.add_argument("--kernel", action="append", choices=["v1", "v2"], help="repeatable")
  ap.add_argument("--limit", type=int, default=None, help="at most N problems per chip/kernel")
  ap.add_argument("--cache-dir", default=None, help="tokamax's data/autotuning (or a copy)")
  ap.add_argument("--all-configs", action="store_true", help="model every measured config")
  ap.add_argument("--per-problem", action="store_true", help="print one line per config")
  ap.add_argument("--json", default=None, help="write the records to this file")
  ap.add_argument("--from-json", default=None, help="summarize records written by --json")
  ap.add_argument("--fit", action="store_true", help="print the per-chip what-if fit")
  ap.add_argument("--markdown", action="store_true", help="also print the markdown table")
  ap.add_argument(
    "--compiled",
    default=None,
    metavar="DUMP_DIR",
    help="v1 on v5e/v6e/tpu7x: also charge the compiled excess (bench.llo; ~20 s per problem)",
  )
  ap.add_argument(
    "--mxu-rows-per-cycle", type=int, default=1, help="with --compiled: see bench.llo.report"
  )
  args = ap.parse_args(argv)

  if args.from_json:
    records = json.loads(Path(args.from_json).read_text())
  else:
    records = _model_all(args)
  print(summarize(records))
  if args.fit:
    print()
    print(fit_report(records))
  if args.markdown:
    print()
    print(markdown_table(records))
  if args.json and not args.from_json:
    Path(args.json).write_text(json.dumps(records, indent=1))
  return 0


def _model_all(args) -> list[dict]:
  from bench.impls import Unsupported
  from pallas_moe.generations import get_generation

  problems, skipped = load_problems(
    cache_dir=args.cache_dir, chips=args.chip, kernels=args.kernel or ("v1", "v2"), ops=args.op
  )
  if args.limit is not None:
    seen: dict[tuple[str, str], int] = {}
    kept = []
    for p in problems:
      n = seen.get((p.chip, p.kernel), 0)
      if n < args.limit:
        kept.append(p)
      seen[(p.chip, p.kernel)] = n + 1
    problems = kept
  reasons: dict[str, int] = {}
  for _, _, r in skipped:
    reasons[r] = reasons.get(r, 0) + 1
  print(f"{len(problems)} usable problems; skipped entries: {reasons}", file=sys.stderr)
  records, t0 = [], time.time()
  for i, p in enumerate(problems):
    best_c = p.best
    for c in p.configs if args.all_configs else (best_c,):
      try:
        mc = model_config(p, c)
      except Unsupported as e:
        print(f"{p.label} {c.fields}: not modeled ({e})", file=sys.stderr)
        continue
      records.append(
        dict(
          chip=p.chip,
          kernel=p.kernel,
          op=p.op,
          residuals=p.residuals,
          m=p.m,
          k=p.k,
          n=p.n,
          num_groups=p.num_groups,
          generated_sizes=p.generated,
          config=c.fields,
          best=c is best_c,
          tiling=list(mc.tiling),
          measured_us=mc.measured_us,
          modeled_us=mc.modeled_us,
          kernel_us=mc.kernel_us,
          modeled_chip_us=mc.modeled_chip_us,
          copy_us=mc.copy_us,
          mxu_us=mc.mxu_us,
          dma_us=mc.dma_us,
          overhead_us=mc.overhead_us,
          steps=mc.steps,
          overhead_steps=round(mc.overhead_us / (get_generation(p.chip).step_overhead_s * 1e6)),
          extra=mc.extra,
        )
      )
      if args.compiled:
        try:
          comp = compiled_restated(
            p, c, cache_dir=args.compiled, mxu_rows_per_cycle=args.mxu_rows_per_cycle
          )
        except RuntimeError as e:
          # NOTE: megablox's pallas_call keeps Mosaic's default scoped VMEM limit (tokamax's
          # kernel raises it), so some measured tiles do not compile as megablox.
          lines = str(e).strip().splitlines()
          why = next((x for x in reversed(lines) if "Error" in x), lines[-1])
          print(f"{p.label}: not compiled ({why[:160]})")
          continue
        records[-1]["compiled"] = comp
        print(
          f"{p.label}: compiled issue {comp['issue_us']:,.0f} us, bound {comp['bound_us']:,.0f}"
          f" us, MXU {comp['mxu_us']:,.0f} us; measured / (model + excess) x{comp['ratio']:.3f}"
          f" (was x{mc.ratio:.3f})"
        )
      if args.per_problem:
        f = c.fields
        print(
          f"{p.label:<52} {f.get('tile_m')!s:>5},{f.get('tile_k')!s:>5},{f.get('tile_n')!s:>5}"
          f" -> {str(mc.tiling):<20} meas {mc.measured_us:9.1f} model {mc.modeled_us:9.1f}"
          f" x{mc.ratio:5.2f} chip rates x{mc.measured_us / mc.modeled_chip_us:5.2f}"
          f" [{mc.bound}]{' *' if c is best_c else ''}"
        )
    print(f"[{i + 1}/{len(problems)}] {time.time() - t0:.0f}s", file=sys.stderr)
  return records


if __name__ == "__main__":
  sys.exit(main())
