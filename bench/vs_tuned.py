"""Our kernels, modeled, against tokamax's best measured time on the problems tokamax measured.

tokamax 0.0.17's autotuning caches (`bench.measured`) hold real TPU timings of its ragged-dot
kernels (v1 and v2) on about 240 bf16 problems per kernel over four chips. This module maps each
usable measured problem to our op on the same operands and models our kernel on it:

- fwd (lhs [m, k] x rhs [G, k, n]) -> `pallas_moe.ops.gmm`; fwd+res (the forward under
  `jax.vjp`, timed by tokamax as its own problem) -> the same gmm (ours saves no extra copy).
- dlhs (dout [m, n] x rhs [G, k, n], contracting n) -> `ops.gmm` with `transpose_rhs`.
- drhs (lhs [m, k] x dout [m, n] -> [G, k, n]) -> `ops.tgmm`.
Same m, k, n, groups, group sizes (tokamax's own draw for `{num_groups, total_size}` keys) and
dtypes (bf16 in and out). Ours runs as `pallas_moe.ops` runs it (`bench.impls` "pallas_moe": the
row-tile kernels at `tiling.pick_rowtile_tiling`'s tiles), modeled with
`costmodel.cost(..., tensorcores="kernel")`: one TensorCore's rates, and a megacore (v5p)
device's steps split between its two cores only where Mosaic splits the grid; a tpu7x JAX device
is one TensorCore.

Per problem: tokamax's best measured time (min over the v1 and v2 caches, each config's median),
ours modeled, ours / tokamax, and the bound no kernel can beat on that device, max(useful
flops / peak, minimum HBM bytes / bandwidth) at the device's rates as the model counts them
(`CostReport.roofline_us`: rows = sum(group_sizes), each operand read once and the output
written once), with bound / tokamax. Target: ours <= 0.8 x tokamax. A problem whose bound /
tokamax exceeds 0.8 cannot get there with any kernel. Two tighter floors name the problems no
kernel of a kind can bring there: whole MXU passes from each group's first row (MXU-granular),
and those plus the per-step cost of the fewest grid steps any tiling fits in VMEM
(`fewest_steps`). A problem above the target under all of them is our kernel's gap. `--search`
models a small set of other row-tile tilings on the problems above the target, to tell a picker
miss from a kernel limit.

Usage: `python -m bench.vs_tuned [--chip v5e] [--op fwd] [--cache-dir DIR] [--search]
[--json FILE] [--markdown]`, or `--from-json FILE [--markdown]` to re-print a saved run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bench.measured import CHIP_DIRS, MeasuredProblem, load_problems

__all__ = [
  "TARGET",
  "TunedProblem",
  "tuned_problems",
  "our_op",
  "model_ours",
  "search_candidates",
  "compare",
  "summarize",
  "main",
]

# Ours must model at or below this fraction of tokamax's best measured time.
TARGET = 0.8


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunedProblem:
  """One measured problem with tokamax's best time over its kernels.

  Attributes:
    chip: generation name.
    op: "fwd", "dlhs" or "drhs".
    residuals: the forward under `jax.vjp` (tokamax's `return_residuals`).
    m: rows.
    k: the forward's contraction.
    n: the forward's output columns.
    num_groups: G.
    group_sizes: int32 [G].
    generated: group sizes drawn by tokamax's `generate_group_sizes`.
    best_ms: the best measured time (median of a config's runs), over v1 and v2.
    best_kernel: "v1" or "v2", whose config was best.
    best_config: that config's fields.
    kernels: the kernels measured on this problem.
  """

  chip: str
  op: str
  residuals: bool
  m: int
  k: int
  n: int
  num_groups: int
  group_sizes: np.ndarray
  generated: bool
  best_ms: float
  best_kernel: str
  best_config: dict
  kernels: tuple[str, ...]

  @property
  def op_label(self) -> str:
    return self.op + ("+res" if self.residuals else "")

  @property
  def label(self) -> str:
    return f"{self.chip} {self.op_label} m={self.m} k={self.k} n={self.n} G={self.num_groups}"


def tuned_problems(problems: Iterable[MeasuredProblem]) -> list[TunedProblem]:
  """Merges the v1 and v2 measurements of the same problem, keeping tokamax's best time.

  Args:
    problems: from `bench.measured.load_problems`.

  Returns:
    One `TunedProblem` per (chip, op, residuals, m, k, n, G, group sizes), in first-seen order.
  """
  merged: dict[tuple, list[MeasuredProblem]] = {}
  for p in problems:
    key = (p.chip, p.op, p.residuals, p.m, p.k, p.n, p.num_groups, p.group_sizes.tobytes())
    merged.setdefault(key, []).append(p)
  out = []
  for ps in merged.values():
    best = min(ps, key=lambda p: p.best.ms)
    p0 = ps[0]
    out.append(
      TunedProblem(
        chip=p0.chip,
        op=p0.op,
        residuals=p0.residuals,
        m=p0.m,
        k=p0.k,
        n=p0.n,
        num_groups=p0.num_groups,
        group_sizes=np.asarray(p0.group_sizes, np.int32),
        generated=p0.generated,
        best_ms=best.best.ms,
        best_kernel=best.kernel,
        best_config=dict(best.best.fields),
        kernels=tuple(sorted(p.kernel for p in ps)),
      )
    )
  return out


def our_op(op: str) -> tuple[str, dict]:
  """Which of our ops runs a tokamax op, and how.

  Args:
    op: "fwd", "dlhs" or "drhs".

  Returns:
    ("gmm" or "tgmm", keyword arguments that select the op's layout).
  """
  if op == "fwd":
    return "gmm", {"transpose_rhs": False}
  if op == "dlhs":
    return "gmm", {"transpose_rhs": True}
  if op == "drhs":
    return "tgmm", {}
  raise ValueError(f"op must be 'fwd', 'dlhs' or 'drhs', got {op!r}")


def _shape(*, m: int, k: int, n: int, num_groups: int):
  from bench.shapes import Shape

  return Shape(name="tokamax", tokens=m, top_k=1, num_groups=num_groups, k=k, n=n)


@functools.lru_cache(maxsize=64)
def _model_cached(chip, op, m, k, n, num_groups, gs_bytes, tiling):
  from bench import costmodel, impls
  from pallas_moe.generations import get_generation

  gen = get_generation(chip)
  gs = np.frombuffer(gs_bytes, np.int32)
  shape = _shape(m=m, k=k, n=n, num_groups=num_groups)
  case = impls._pallas_moe_build(tiling)(op=op, shape=shape, group_sizes=gs, generation=gen)
  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  rows = int(gs.sum())
  # NOTE: gmm reads only the weights of groups with rows; tgmm writes every group's output.
  weights = num_groups if op == "drhs" else int((gs > 0).sum())
  rep = costmodel.cost(
    scheds,
    generation=gen,
    tensorcores="kernel",
    mxu_rows_useful=rows,
    useful_row_macs=k * n,
    floor_rows_count=costmodel.op_floor_rows(gs, generation=gen, op=op),
    # NOTE: bf16; each operand's real rows read once, the output written once.
    min_hbm_bytes=2 * (rows * k + rows * n + weights * k * n),
  )
  return dict(
    tiling=tuple(int(t) for t in case.tiling),
    kernel=case.kernel or "visits",
    modeled_us=rep.modeled_us,
    roofline_us=rep.roofline_us,
    achievable_us=rep.achievable_us,
    mxu_us=sum(c.mxu_us for c in rep.calls),
    dma_us=sum(c.dma_us for c in rep.calls),
    overhead_us=sum(c.overhead_us for c in rep.calls),
    exposed_us=sum(c.exposed_us for c in rep.calls),
    steps=sum(c.steps for c in rep.calls),
    tensorcores=max(c.tensorcores for c in rep.calls),
  )


def model_ours(problem: TunedProblem, *, tiling: tuple[int, int, int] | None = None) -> dict:
  """Models our kernel on a problem (`costmodel.cost(..., tensorcores="kernel")`).

  Args:
    problem: the problem.
    tiling: (tm, tk, tn) in our op's terms (gmm: tk tiles the contraction, which is n for dlhs);
      None: the tiles `pallas_moe.ops` picks.

  Returns:
    dict: tiling, kernel ("rowtile", "rowtile-rows-stationary" or "visits"), modeled_us,
    roofline_us, achievable_us, mxu_us / dma_us / overhead_us (busiest TensorCore), steps,
    tensorcores (cores the busiest call runs on).
  """
  p = problem
  return _model_cached(p.chip, p.op, p.m, p.k, p.n, p.num_groups, p.group_sizes.tobytes(), tiling)


def search_candidates(problem: TunedProblem, *, limit: int = 12) -> list[tuple[int, int, int]]:
  """A small set of row-tile tilings for `--search`: tm in {256 .. 2048}, tn (and tgmm's tk)
  among the divisors of the dim the row-tile kernels accept, the largest few; within VMEM.

  Args:
    problem: the problem.
    limit: at most this many, the ones with the fewest grid steps first.

  Returns:
    Tilings in our op's terms.
  """
  import jax.numpy as jnp

  from pallas_moe.generations import get_generation
  from pallas_moe.tile_pickers import _divisor_tiles, rowtile_vmem_bytes
  from pallas_moe.vmem import usable_vmem_bytes

  p = problem
  gen = get_generation(p.chip)
  budget = usable_vmem_bytes(gen)
  kind = "tgmm" if p.op == "drhs" else "gmm"
  contract, out = (p.n, p.k) if p.op == "dlhs" else (p.k, p.n)
  tks = _divisor_tiles(contract)[-3:] if kind == "tgmm" else [contract]
  tns = _divisor_tiles(out)[-4:]
  cands = []
  for tm in (256, 512, 1024, 2048):
    tm = min(tm, p.m)
    for tk in tks:
      for tn in tns:
        est = rowtile_vmem_bytes(
          tm=tm,
          tk=tk,
          tn=tn,
          kind=kind,
          lhs_dtype=jnp.bfloat16,
          rhs_dtype=jnp.bfloat16,
          out_dtype=jnp.bfloat16,
          generation=gen,
        )
        if est <= budget:
          steps = -(-p.m // tm) * (-(-contract // tk) if kind == "tgmm" else 1) * (-(-out // tn))
          cands.append((steps, (tm, tk, tn)))
  cands = sorted(set(cands))
  return [t for _, t in cands[:limit]]


def fewest_steps(problem: TunedProblem) -> tuple[int, tuple[int, int, int]]:
  """The fewest grid steps any tiled kernel needs on this problem within the chip's VMEM.

  A step multiplies an lhs block by a weight block into an output block. A pipelined kernel holds
  at least two of each input block (the one it multiplies, the next one arriving), one output
  block, and an f32 accumulator when the contraction is split over steps; the bound counts only
  those (no temporaries, no margin) against the whole physical VMEM of one TensorCore, and group
  boundaries add no steps. Tiles: rows and contraction/output chunks in multiples of 128 (or the
  whole dim), any size up to the dim; steps = the product of the tile counts.

  Args:
    problem: the problem.

  Returns:
    (steps, (rows tile, contraction tile, output tile)) in our op's terms: gmm (fwd, dlhs) tiles
    its rows, contraction and output columns; tgmm (drhs) contracts the rows and tiles its [k, n]
    output (the tuple is then (rows chunk, k tile, n tile)).
  """
  from pallas_moe.generations import get_generation

  p = problem
  vmem = get_generation(p.chip).vmem_bytes
  item = 2  # bf16 operands and output
  # NOTE: dims = (contraction, output) for gmm (dlhs contracts n), tgmm's [k, n] output for drhs.
  rows, dims = p.m, ((p.n, p.k) if p.op == "dlhs" else (p.k, p.n))

  def choices(d, cap=None):
    top = d if cap is None else min(d, cap)
    return np.unique(np.minimum(np.append(np.arange(128, top + 128, 128), top), d))

  a = choices(rows, cap=32768)[:, None, None].astype(np.int64)
  b = choices(dims[0])[None, :, None].astype(np.int64)
  c = choices(dims[1])[None, None, :].astype(np.int64)
  if p.op == "drhs":
    # NOTE: rows are the contraction: lhs [rows, k-tile] and dout [rows, n-tile] in, the group's
    # [k-tile, n-tile] output accumulated in f32 across row chunks.
    need = 2 * item * (a * b + a * c) + (item + 4) * b * c
  else:
    # NOTE: lhs [rows, contraction-tile] and weights [contraction-tile, out-tile] in, one
    # output block out; the f32 accumulator only when the contraction is split.
    split = b < dims[0]
    need = 2 * item * (a * b + b * c) + item * a * c + np.where(split, 4 * a * c, 0)
  steps = -(-rows // a) * -(-dims[0] // b) * -(-dims[1] // c)
  steps = np.where(need <= vmem, steps, np.iinfo(np.int64).max)
  i = np.unravel_index(np.argmin(steps), steps.shape)
  return int(steps[i]), (int(a[i[0], 0, 0]), int(b[0, i[1], 0]), int(c[0, 0, i[2]]))


def _floor_rows(problem: TunedProblem) -> int:
  from bench.costmodel import op_floor_rows

  return op_floor_rows(problem.group_sizes, generation=problem.chip, op=problem.op)


def compare(problem: TunedProblem, *, search: bool = False) -> dict:
  """One record: tokamax's best measured time, ours modeled, the bound, and the verdict.

  Args:
    problem: the problem.
    search: also model `search_candidates` when ours at the picked tiles misses the target.

  Returns:
    The record (JSON-serializable).
  """
  from pallas_moe.generations import get_generation, tensorcore_rates

  p = problem
  tok_us = p.best_ms * 1e3
  ours = model_ours(p)
  rec = dict(
    chip=p.chip,
    op=p.op,
    residuals=p.residuals,
    our_op=our_op(p.op)[0] + (" (transpose_rhs)" if p.op == "dlhs" else ""),
    m=p.m,
    k=p.k,
    n=p.n,
    num_groups=p.num_groups,
    rows=int(p.group_sizes.sum()),
    floor_rows=_floor_rows(p),
    generated_sizes=p.generated,
    tokamax_us=tok_us,
    tokamax_kernel=p.best_kernel,
    tokamax_config=p.best_config,
    ours=ours,
    ratio=ours["modeled_us"] / tok_us,
    bound_us=ours["roofline_us"],
    bound_ratio=ours["roofline_us"] / tok_us,
    granular_us=ours["achievable_us"],
    granular_ratio=ours["achievable_us"] / tok_us,
    searched=None,
  )
  gen = get_generation(p.chip)
  core_flops, _ = tensorcore_rates(gen)
  # NOTE: the MXU-granular bound's compute alone (its passes at the device's peak), what
  # `verdict` splits ours against.
  rec["granular_mxu_us"] = (
    2 * rec["floor_rows"] * p.k * p.n / (core_flops * gen.tensorcores_per_device) * 1e6
  )
  steps, steps_tiling = fewest_steps(p)
  # NOTE: the per-step cost is the model's for every kernel (fit on tokamax's measured kernels);
  # a megacore device may split the steps over its TensorCores.
  steps_us = rec["granular_us"] + steps * gen.step_overhead_s * 1e6 / gen.tensorcores_per_device
  rec.update(
    fewest_steps=steps,
    fewest_steps_tiling=steps_tiling,
    steps_bound_us=steps_us,
    steps_bound_ratio=steps_us / tok_us,
  )
  if search and rec["ratio"] > TARGET:
    tried = []
    for til in search_candidates(p):
      if til == ours["tiling"]:
        continue
      try:
        r = model_ours(p, tiling=til)
      except ValueError as e:  # VMEM refusals
        if "VMEM" not in str(e):
          raise
        continue
      tried.append(r)
    best = min(tried, key=lambda r: r["modeled_us"], default=None)
    rec["searched"] = dict(
      tried=len(tried),
      best=best,
      best_ratio=best["modeled_us"] / tok_us if best else None,
    )
  return rec


# ----------------------------------------------------------------------------------------------
# Report.


def _op_label(r: dict) -> str:
  return r["op"] + ("+res" if r["residuals"] else "")


def _best_us(r: dict) -> float:
  s = r.get("searched")
  if s and s["best"] and s["best"]["modeled_us"] < r["ours"]["modeled_us"]:
    return s["best"]["modeled_us"]
  return r["ours"]["modeled_us"]


def category(r: dict) -> str:
  """ "ok" (ours <= TARGET x tokamax), "bound" (no kernel can: the roofline is above it),
  "granular" (no kernel that pushes whole MXU passes can, as the model charges every kernel: the
  MXU-granular bound is above it), "steps" (no kernel that pays the chip's per-step cost can:
  that bound plus the fewest grid steps any tiling within VMEM needs, `fewest_steps`, is above
  it), or "ours" (our kernel's gap)."""
  if r["ratio"] <= TARGET:
    return "ok"
  if r["bound_ratio"] > TARGET:
    return "bound"
  if r["granular_ratio"] > TARGET:
    return "granular"
  if r.get("steps_bound_ratio", 0.0) > TARGET:
    return "steps"
  return "ours"


def verdict(r: dict) -> str:
  """Why a record is above the target, with numbers."""
  o = r["ours"]
  cat = category(r)
  if cat == "ok":
    return "ok"
  ours_vs = f"ours at {o['modeled_us'] / r['granular_us']:.2f}x the MXU-granular bound"
  if cat == "bound":
    return (
      f"no kernel can reach {TARGET}x: the roofline is {r['bound_ratio']:.2f}x tokamax "
      f"(tokamax at {1 / r['bound_ratio']:.2f}x it); {ours_vs}"
    )
  if cat == "granular":
    return (
      f"no MXU-granular kernel can reach {TARGET}x: pushing each group's rows in whole MXU "
      f"passes from its first row ({r['floor_rows'] / r['rows']:.3f}x the rows) is "
      f"{r['granular_ratio']:.2f}x tokamax (roofline {r['bound_ratio']:.2f}x); {ours_vs}"
    )
  if cat == "steps":
    return (
      f"no kernel paying {r['fewest_steps']} grid steps (the fewest within VMEM, at "
      f"{tuple(r['fewest_steps_tiling'])}) can reach {TARGET}x: the MXU-granular bound plus "
      f"their per-step cost is {r['steps_bound_ratio']:.2f}x tokamax (MXU-granular "
      f"{r['granular_ratio']:.2f}x); {ours_vs}, {r['ours']['steps']} steps"
    )
  # NOTE: ours = Σ max(MXU, DMA) + exposed DMA + per-step cost (`costmodel.cost`), split here
  # against the MXU-granular passes: what the target asks to cut and where ours spends it.
  g_mxu = r.get("granular_mxu_us")
  wait = max(0.0, o["modeled_us"] - o["mxu_us"] - o.get("exposed_us", 0.0) - o["overhead_us"])
  bits = [
    f"our gap: ours {r['ratio']:.2f}x, roofline {r['bound_ratio']:.2f}x, MXU-granular "
    f"{r['granular_ratio']:.2f}x",
    f"ours/MXU-granular {o['modeled_us'] / r['granular_us']:.2f}",
  ]
  if g_mxu is not None:
    bits.append(
      f"{o['modeled_us'] - TARGET * r['tokamax_us']:.0f} us to cut; ours above the granular "
      f"passes' {g_mxu:.0f} us: MXU passes {o['mxu_us'] - g_mxu:.0f}, DMA beyond MXU "
      f"{wait:.0f}, exposed loads and writes {o.get('exposed_us', 0.0):.0f}, per-step cost "
      f"{o['overhead_us']:.0f} ({o['steps']} steps on {o['tensorcores']} TC; the fewest "
      f"within VMEM {r['fewest_steps']})"
    )
  else:
    bits += [
      f"mxu {o['mxu_us']:.0f} dma {o['dma_us']:.0f} ovh {o['overhead_us']:.0f} us",
      f"{o['steps']} steps on {o['tensorcores']} TC",
    ]
  s = r.get("searched")
  if s and s["best"]:
    bits.append(f"best searched {tuple(s['best']['tiling'])}: {s['best_ratio']:.2f}x")
  return ", ".join(bits)


def summarize(records: list[dict], *, markdown: bool = False) -> str:
  """Per (chip, op): problems, how many are at or below the target, ours / tokamax and bound /
  tokamax (median and max), then one line per problem above the target with its reason.

  Args:
    records: `compare`'s records.
    markdown: a markdown table instead of text columns.

  Returns:
    Text.
  """
  groups: dict[tuple[str, str], list[dict]] = {}
  for r in records:
    groups.setdefault((r["chip"], _op_label(r)), []).append(r)
  order = {c: i for i, c in enumerate(CHIP_DIRS)}
  head = [
    "chip",
    "op",
    "n",
    f"<= {TARGET}x",
    "bound > 0.8x",
    "ours/tokamax med [max]",
    "bound/tokamax med [max]",
    "tokamax ms med",
    "ours ms med",
  ]
  rows = []
  for (chip, op), items in sorted(groups.items(), key=lambda t: (order.get(t[0][0], 9), t[0][1])):
    ratio = np.array([r["ratio"] for r in items])
    bound = np.array([r["bound_ratio"] for r in items])
    rows.append(
      [
        chip,
        op,
        str(len(items)),
        str(int((ratio <= TARGET).sum())),
        str(int((bound > TARGET).sum())),
        f"{np.median(ratio):.2f} [{ratio.max():.2f}]",
        f"{np.median(bound):.2f} [{bound.max():.2f}]",
        f"{np.median([r['tokamax_us'] for r in items]) / 1e3:.3f}",
        f"{np.median([r['ours']['modeled_us'] for r in items]) / 1e3:.3f}",
      ]
    )
  total = len(records)
  ok = sum(r["ratio"] <= TARGET for r in records)
  cats = [category(r) for r in records]
  cannot, granular, stepped, gap = (cats.count(c) for c in ("bound", "granular", "steps", "ours"))
  if markdown:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
  else:
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
    lines = [fmt(head)] + [fmt(r) for r in rows]
  lines += [
    "",
    f"{total} problems: {ok} at or below {TARGET}x tokamax's best measured time; {cannot} where "
    f"no kernel can (roofline > {TARGET}x); {granular} where no MXU-granular kernel can "
    f"(MXU-granular bound > {TARGET}x); {stepped} where no kernel paying the per-step cost "
    f"can (that bound plus the fewest steps within VMEM > {TARGET}x); {gap} our kernel's gap.",
    "",
    "Above the target:",
  ]
  above = sorted(
    (r for r in records if r["ratio"] > TARGET),
    key=lambda r: (order.get(r["chip"], 9), _op_label(r), -r["ratio"]),
  )
  for r in above:
    lines.append(
      f"{'- ' if markdown else '  '}{r['chip']} {_op_label(r)} m={r['m']} k={r['k']} n={r['n']} "
      f"G={r['num_groups']}: tokamax {r['tokamax_kernel']} {r['tokamax_us'] / 1e3:.3f} ms, ours "
      f"{tuple(r['ours']['tiling'])} {r['ours']['modeled_us'] / 1e3:.3f} ms ({r['ratio']:.2f}x), "
      f"bound {r['bound_us'] / 1e3:.3f} ms; {verdict(r)}"
    )
  return "\n".join(lines)


def per_problem_line(r: dict) -> str:
  """One line per record."""
  o = r["ours"]
  return (
    f"{r['chip']:<6} {_op_label(r):<9} m={r['m']:<7} k={r['k']:<5} n={r['n']:<5} "
    f"G={r['num_groups']:<4} tokamax {r['tokamax_kernel']} {r['tokamax_us']:9.1f} us | ours "
    f"{str(tuple(o['tiling'])):<20} {o['modeled_us']:9.1f} us x{r['ratio']:.2f} | bound "
    f"{r['bound_us']:9.1f} us x{r['bound_ratio']:.2f}"
  )


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m bench.vs_tuned", description=__doc__.split("\n")[0])
  ap.add_argument("--chip", action="append", choices=sorted(CHIP_DIRS), help="repeatable")
  ap.add_argument("--op", action="append", choices=["fwd", "dlhs", "drhs"], help="repeatable")
  ap.add_argument("--cache-dir", default=None, help="tokamax's data/autotuning (or a copy)")
  ap.add_argument("--search", action="store_true", help="search tiles where ours misses")
  ap.add_argument("--per-problem", action="store_true", help="one line per problem")
  ap.add_argument("--markdown", action="store_true", help="markdown summary table")
  ap.add_argument("--json", default=None, help="write the records to this file")
  ap.add_argument("--from-json", default=None, help="summarize records written by --json")
  args = ap.parse_args(argv)
  if args.from_json:
    records = json.loads(Path(args.from_json).read_text())
  else:
    problems, _ = load_problems(cache_dir=args.cache_dir, chips=args.chip, ops=args.op)
    tuned = tuned_problems(problems)
    print(f"{len(tuned)} problems ({len(problems)} measured entries)", file=sys.stderr)
    records, t0 = [], time.time()
    for i, p in enumerate(tuned):
      records.append(compare(p, search=args.search))
      print(f"[{i + 1}/{len(tuned)}] {p.label} {time.time() - t0:.0f}s", file=sys.stderr)
    if args.json:
      Path(args.json).write_text(json.dumps(records, indent=1, default=_jsonable))
  if args.per_problem:
    for r in records:
      print(per_problem_line(r))
    print()
  print(summarize(records, markdown=args.markdown))
  return 0


def _jsonable(x):
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.floating):
    return float(x)
  raise TypeError(f"not JSON-serializable: {type(x)}")


if __name__ == "__main__":
  sys.exit(main())
