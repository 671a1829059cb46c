"""The compiled kernel's own VLIW schedule: a second opinion on the cost model.

libtpu writes Mosaic's scheduled VLIW bundles for a deviceless AOT compile when
`LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true
--xla_jf_dump_to_filter=pallas"` is set before jax loads libtpu (docs/design.md, "Checks from
outside the model"). This module

1. compiles a bench case (`bench.impls`) for a TPU generation in a subprocess with that
   environment (`compile_dump`);
2. parses `DIR/*-<kernel name>*-NN-final_bundles.txt` (one bundle per line, one instruction per
   unit; `LB:` marks a loop body, one `>` per loop level, `PF:` a predicated region's
   fallthrough) into a tree of loops and predicated regions (`parse_bundles`, `loop_tree`),
   with instruction counts per class (`classify`);
3. gives every node an execution count: static loops from their compiled exit test, the
   kernel's dynamic loops (groups of a tile, sub-blocks of a group) and its once-per-group
   regions from the kernel's own prefetched metadata, as the hooks in `bench.impls` (checked
   against `probe.count_rows`) compute them (`trip_counts`);
4. reports static issue cycles (one bundle issues per cycle), MXU-busy cycles and their ratio
   (`report`).

MXU-busy cycles, the derivation. A `vmatmul` streams a block of lhs rows into its MXU (16 bf16
rows on v5e / v6e, 8 on tpu7x, twice as many 8-bit rows: `matmul_rows`, measured from the
instruction counts of known dots) against the MXU's stationary mxu x mxu weights. A systolic
array takes one row per cycle at the bf16 rate, so the instruction keeps its MXU busy `rows`
cycles and does rows * mxu^2 MACs; a narrow (int8 / fp8) mode with k times the bf16 peak takes
k rows per cycle (`cycles_per_row`: the 32-row int8 vmatmul of v5e / v6e takes 16 cycles).
With `num_mxus` MXUs (the `mxuN` ids in the dump: v5e 4, v6e 2, tpu7x 2, as jax's `tpu_info`
lists them) at clock f, the peak is 2 * num_mxus * mxu^2 * f, so the clock the peak implies is
f = peak / (2 * num_mxus * mxu^2) (per TensorCore: tpu7x's chip peak is split over its two
cores): v5e 197e12 / (2 * 4 * 128^2) = 1.50 GHz, v6e 918e12 / (2 * 2 * 256^2) = 3.50 GHz, tpu7x
(2307e12 / 2) / (2 * 2 * 256^2) = 4.40 GHz. (v4 and v5p give their published 1.05 and 1.75
GHz; v6e's and tpu7x's exceed any published TPU clock, so there a vmatmul may take fewer cycles
than its rows. Then MXU-busy cycles are fewer and issue/MXU larger than reported here: the ratio
is a lower bound on those two chips.) MXU-busy cycles of a loop = max over MXUs of Σ its
vmatmuls' cycles; issue cycles = bundles; both are converted to µs at f. Check: on every case
of bench/results/rowtile-vliw.md ("The compiled VLIW schedule") the compiled MXU-busy time
equals the analytic model's MXU time (except megablox's ragged-k branch, which the model charges
at its full tile).

What this is not: a simulation. It counts bundles as if each issued in one cycle with no stall
(no DMA waits, no MXU result latency beyond what the scheduler already placed), and predicated
regions as taken unless a kernel rule knows how often they run (see `trip_counts`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
  "Bundle",
  "Node",
  "CLASSES",
  "classify",
  "parse_bundles",
  "trim_dump",
  "loop_tree",
  "find_dump",
  "compiled_tensorcores",
  "implied_clock_hz",
  "matmul_kind",
  "matmul_rows",
  "cycles_per_row",
  "trip_counts",
  "LloReport",
  "report",
  "compile_dump",
  "analyze_case",
  "markdown_table",
  "restated_table",
]

# Instruction classes, in report order.
CLASSES = (
  "mxu_push",
  "mxu_matmul",
  "mxu_pop",
  "vpu",
  "load",
  "store",
  "xlu",
  "dma",
  "scalar",
)
# NOTE: a branch's delay slots: 4 bundles on v5e and v6e; on tpu7x fewer or more, filled with
# the region's own (predicated) instructions. At most this many follow a loop's back edge.
MAX_DELAY_SLOTS = 8
_LABELS = ("LB", "LH", "LE", "PB", "PF", "CT")
_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:([A-Z]{2}))?\s*:\s*(>*)\s*\{(.*)\}(.*)$", re.S)
_START = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2})?\s*:")
_BRANCH = re.compile(r"sbr\.rel\s*(?:\([^)]*\))?\s*target\s*=\s*\$region(\d+)")
_REGIONS = re.compile(r"(?:Start region|Start/End empty region) (\d+)")
_EXIT_TEST = re.compile(r"scmp\.\w+\.s32\.totalorder %\w+, (\d+) /\* loop exit test \*/")
_MXU_ID = re.compile(r"\.mxu(\d+)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bundle:
  """One VLIW bundle (one line of a final_bundles dump).

  Attributes:
    addr: its address.
    label: "LB", "PF", ... or "".
    depth: loop nesting (number of `>`); empty bundles print none, so it is -1 for them.
    ops: opcodes of its instructions (e.g. "vmatmul.mubr.bf16.gmra.mxu0").
    branch_region: the target region of an `sbr.rel` in it, or None.
    regions: regions that start here (from the trailing comment).
    exit_bound: the constant of a `/* loop exit test */` compare in it, or None.
  """

  addr: int
  label: str
  depth: int
  ops: tuple[str, ...]
  branch_region: int | None
  regions: tuple[int, ...]
  exit_bound: int | None


def _records(text: str) -> list[str]:
  """Bundle lines, each joined with its continuation lines (a DMA's multi-line comment)."""
  out: list[str] = []
  for line in text.splitlines():
    if _START.match(line):
      out.append(line)
    elif out and not line.startswith("="):
      out[-1] += " " + line
  return out


def _opcode(instr: str) -> str | None:
  instr = re.sub(r"/\*.*?\*/", "", instr).strip()
  if not instr:
    return None
  m = re.match(r"(?:%\S+\s*=\s*)?([A-Za-z_][\w.<>]*)", instr)
  return m.group(1) if m else None


def parse_bundles(text: str) -> list[Bundle]:
  """Parses a `*-final_bundles.txt` dump.

  Args:
    text: the file's text.

  Returns:
    The bundles in address order.
  """
  out = []
  for line in _records(text):
    m = _LINE.match(line)
    if not m:
      continue
    addr_s, label, marks, body, tail = m.groups()
    ops = tuple(o for o in (_opcode(x) for x in body.split(" ;; ")) if o)
    br = _BRANCH.search(body)
    ex = _EXIT_TEST.search(body)
    out.append(
      Bundle(
        addr=int(addr_s, 0),
        label=label or "",
        depth=len(marks) if ops else -1,
        ops=ops,
        branch_region=int(br.group(1)) if br else None,
        regions=tuple(int(r) for r in _REGIONS.findall(tail)),
        exit_bound=int(ex.group(1)) if ex else None,
      )
    )
  return out


def trim_dump(text: str) -> str:
  """A final_bundles dump cut down to what `parse_bundles` reads (for test fixtures).

  Keeps each bundle's address, label and loop marks; of each instruction its opcode (with the
  target of a branch and the bound of a loop exit test); of the trailing comment the regions
  that start there. Drops operands and multi-line comments.

  Args:
    text: a final_bundles dump.

  Returns:
    The trimmed text; `parse_bundles` gives the same bundles for it.
  """
  out = [line for line in text.splitlines()[:10] if line.startswith(("=", "L", "P", "C"))]
  for line in _records(text):
    m = _LINE.match(line)
    if not m:
      continue
    addr_s, label, marks, body, tail = m.groups()
    instrs = []
    for x in body.split(" ;; "):
      op = _opcode(x)
      if not op:
        continue
      br, ex = _BRANCH.search(x), _EXIT_TEST.search(x)
      if br:
        op = f"{op} target = $region{br.group(1)}"
      elif ex:
        op = f"{op} %s, {ex.group(1)} /* loop exit test */"
      instrs.append(op)
    regions = " :: ".join(f"Start region {r}" for r in _REGIONS.findall(tail))
    head = f"{addr_s:>6} {label or '  '}: {marks}"
    out.append(f"{head} {{ {' ;; '.join(instrs)} }}" + (f" /* {regions} */" if regions else ""))
  return "\n".join(out) + "\n"


def classify(op: str) -> str:
  """The class of an opcode (one of `CLASSES`).

  Args:
    op: an opcode as the dump prints it.

  Returns:
    "mxu_push" (weights into the MXU, and `vmatprep` of the streamed operand), "mxu_matmul"
    (`vmatmul`: rows streamed through the MXU), "mxu_pop" (results out of it), "xlu"
    (transposes, permutes and their pops), "load"/"store" (`vld`/`vst`: VMEM <-> vregs), "dma"
    (DMA starts, waits and sync flags), "vpu" (other vector ops), "scalar" (the rest).
  """
  if _MXU_ID.search(op) or ".mrf" in op:
    if op.startswith("vmatmul"):
      return "mxu_matmul"
    if op.startswith(("vmatpush", "vmatprep")):
      return "mxu_push"
    return "mxu_pop"
  if ".xlu" in op or op.startswith(("vxpose", "vperm", "vrot")) or ".trf" in op:
    return "xlu"
  if op.startswith("vld"):
    return "load"
  if op.startswith("vst"):
    return "store"
  if op.startswith(("dma", "vsync")):
    return "dma"
  if op.startswith("v"):
    return "vpu"
  return "scalar"


def matmul_kind(op: str) -> str:
  """The operand type of a `vmatmul`: "int8", "fp8", "f32" or "bf16"."""
  if re.search(r"\.(s8|u8)\b", op):
    return "int8"
  if re.search(r"\.(f8|e4m3\w*|e5m2\w*)\b", op):
    return "fp8"
  if ".f32" in op:
    return "f32"
  return "bf16"


def matmul_rows(kind: str, generation) -> int:
  """Rows one `vmatmul` streams through its MXU.

  bf16: 16 on v4 / v5e / v5p / v6e (a vreg of packed bf16 rows), 8 on tpu7x. These are
  measured, not documented: the vmatmuls Mosaic emits for a known dot, e.g. [256 x 2048] x
  [2048 x 1408] on v6e (2 MXUs, 256 x 256 weight tiles): 352 per MXU = 1408 * 2048 * 256 /
  (2 * 256^2 * 16); on tpu7x the same dot takes 704 per MXU. 8-bit operands pack twice the rows,
  f32 half.

  Args:
    kind: `matmul_kind` of the instruction.
    generation: a `TpuGeneration`.

  Returns:
    Rows.
  """
  bf16 = 8 if generation.name.startswith("tpu7") else 16
  return {"int8": 2 * bf16, "fp8": 2 * bf16, "f32": bf16 // 2, "bf16": bf16}[kind]


def cycles_per_row(kind: str, generation) -> float:
  """MXU cycles per streamed row: 1 at the bf16 rate; the narrow modes stream rows faster by
  their peak's ratio (int8 on v5e / v6e: 2 rows per cycle). f32 is counted as bf16 (our
  kernels' dots have no f32 operands)."""
  gen = generation
  if kind == "int8" and gen.supports_int8:
    return gen.peak_bf16_flops / gen.peak_int8_ops
  if kind == "fp8" and gen.supports_fp8:
    return gen.peak_bf16_flops / gen.peak_fp8_ops
  return 1.0


@dataclasses.dataclass(kw_only=True, eq=False)
class Node:
  """A loop, a predicated region, or the whole program.

  Attributes:
    kind: "root", "loop" or "cond".
    start: index of its first bundle.
    end: index of its last bundle (inclusive).
    children: nested loops and regions, in program order.
    exit_bound: a loop's static trip count (its compiled exit test), or None (dynamic).
    own_bundles: bundles not in a child.
    own_counts: instructions per class, not in a child.
    own_matmul: `vmatmul`s not in a child, per (MXU id, `matmul_kind`).
    dma_out: a DMA to HBM is among its own instructions.
  """

  kind: str
  start: int
  end: int
  children: list[Node] = dataclasses.field(default_factory=list)
  exit_bound: int | None = None
  own_bundles: int = 0
  own_counts: dict[str, int] = dataclasses.field(default_factory=dict)
  own_matmul: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
  dma_out: bool = False

  @property
  def own_matmuls(self) -> dict[int, int]:
    """`vmatmul`s per MXU id (all operand types)."""
    out: dict[int, int] = {}
    for (unit, _), count in self.own_matmul.items():
      out[unit] = out.get(unit, 0) + count
    return out

  def own_mxu_cycles(self, generation) -> dict[int, float]:
    """MXU-busy cycles per MXU id: vmatmuls x `matmul_rows` x `cycles_per_row`."""
    out: dict[int, float] = {}
    for (unit, kind), count in self.own_matmul.items():
      rows = count * matmul_rows(kind, generation) * cycles_per_row(kind, generation)
      out[unit] = out.get(unit, 0.0) + rows
    return out

  @property
  def bundles(self) -> int:
    """All bundles in its span."""
    return self.end - self.start + 1

  def walk(self):
    """This node and its descendants, pre-order."""
    yield self
    for c in self.children:
      yield from c.walk()

  def has_loop(self) -> bool:
    """Whether a loop is among its descendants."""
    return any(n.kind == "loop" for c in self.children for n in c.walk())

  def describe(self, *, indent: int = 0) -> str:
    """A text outline of the subtree (bundles, counts per class)."""
    counts = " ".join(f"{k}={v}" for k, v in self.own_counts.items() if v)
    trip = f" trip={self.exit_bound}" if self.exit_bound is not None else ""
    line = (
      f"{'  ' * indent}{self.kind}[{self.start}..{self.end}]{trip} own={self.own_bundles}"
      f" span={self.bundles} {counts}"
    )
    return "\n".join([line] + [c.describe(indent=indent + 1) for c in self.children])


def loop_tree(bundles: Sequence[Bundle]) -> Node:
  """Nests the loops and predicated regions of a bundle list.

  A loop runs from its `LB:` bundle to its back edge (the `sbr.rel` whose target region starts
  at the `LB:`) plus the branch's delay slots. A predicated region is what a forward `sbr.rel`
  skips, up to the bundle where its target region starts. Regions that would cross another's
  boundary are dropped.

  Args:
    bundles: from `parse_bundles`.

  Returns:
    The root node.
  """
  region_at: dict[int, int] = {}
  for i, b in enumerate(bundles):
    for r in b.regions:
      region_at.setdefault(r, i)
  spans: list[Node] = []
  for i, b in enumerate(bundles):
    if b.branch_region is None or b.branch_region not in region_at:
      continue
    j = region_at[b.branch_region]
    if j <= i and bundles[j].label == "LB":
      # NOTE: the loop's own exit test is at its own nesting level (its `LB:` bundle's, or its
      # body's shallowest: the back edge prints one level up); a deeper one is an inner
      # loop's, and would make a dynamic loop look static.
      own = bundles[j].depth
      if own < 0:
        own = min((x.depth for x in bundles[j:i] if x.depth >= 0), default=-1)
      exit_bound = next(
        (x.exit_bound for x in bundles[j : i + 1] if x.exit_bound is not None and x.depth == own),
        None,
      )
      # NOTE: the back edge's delay slots still belong to the loop: bundles up to the next
      # label, or to the first non-empty bundle outside the loop's nesting level.
      end, depth = i, bundles[j].depth
      while (
        end + 1 < len(bundles)
        and end - i < MAX_DELAY_SLOTS
        and not bundles[end + 1].label
        and (not bundles[end + 1].ops or bundles[end + 1].depth >= depth)
      ):
        end += 1
      spans.append(Node(kind="loop", start=j, end=end, exit_bound=exit_bound))
    elif j > i + 1:
      # NOTE: the delay slots of a forward branch run whether or not it is taken; they are few
      # (and empty, or the region's predicated instructions) and counted with the region.
      spans.append(Node(kind="cond", start=i + 1, end=j - 1))
  # NOTE: a forward branch that skips a loop and little else is the loop's zero-trip guard:
  # the loop's own count covers it.
  loops = [s for s in spans if s.kind == "loop"]
  spans = [
    s
    for s in spans
    if s.kind == "loop"
    or not any(
      s.start <= lp.start and lp.end <= s.end and s.bundles - lp.bundles <= MAX_DELAY_SLOTS
      for lp in loops
    )
  ]
  root = Node(kind="root", start=0, end=len(bundles) - 1)
  # NOTE: outer spans first (a loop before a region of the same extent); a span that crosses
  # the current innermost open span is not nested and is dropped.
  spans.sort(key=lambda s: (s.start, -s.end, s.kind != "loop"))
  stack = [root]
  for s in spans:
    while stack[-1] is not root and s.start > stack[-1].end:
      stack.pop()
    parent = stack[-1]
    if s.end > parent.end:
      continue
    parent.children.append(s)
    stack.append(s)
  owner = [root] * len(bundles)
  for node in root.walk():
    for i in range(node.start, node.end + 1):
      owner[i] = node
  for node in root.walk():
    node.own_counts = {c: 0 for c in CLASSES}
  for b, node in zip(bundles, owner, strict=True):
    node.own_bundles += 1
    for op in b.ops:
      node.own_counts[classify(op)] += 1
      if op.startswith("vmatmul"):
        mxu = _MXU_ID.search(op)
        unit = int(mxu.group(1)) if mxu else 0
        key = (unit, matmul_kind(op))
        node.own_matmul[key] = node.own_matmul.get(key, 0) + 1
      if op.startswith("dma.vmem_to_hbm"):
        node.dma_out = True
  return root


def find_dump(directory: str, kernel: str) -> str:
  """The final-bundles dump of a kernel in a dump directory.

  Args:
    directory: the `--xla_jf_dump_to` directory.
    kernel: the pallas_call's name (e.g. "pallas_moe_gmm_rowtile"); when no dump has it, the
      one dump with vmatmuls.

  Returns:
    The path (the largest if the kernel was compiled more than once).

  Raises:
    FileNotFoundError: none found.
  """
  every = glob.glob(os.path.join(directory, "*final_bundles.txt"))
  # NOTE: libtpu 0.0.42 names a dump "<id>-<kernel>[.<n>]-<pass>-final_bundles.txt"; 0.0.50
  # may add more dotted suffixes (e.g. "pallas_moe_zero_fill.1.refs_2_-71-final_bundles.txt").
  pat = re.compile(rf"^\d+-{re.escape(kernel)}(\.\w+)*-\d+-final_bundles\.txt$")
  paths = [p for p in every if pat.match(os.path.basename(p))]
  named = [p for p in every if f"-{kernel}" in os.path.basename(p)]
  if not paths and named:
    # NOTE: never fall back to another kernel's dump when this one's name is there.
    raise FileNotFoundError(f"{kernel}'s dumps are named in an unknown format: {named}")
  if not paths:
    # NOTE: a pallas_call without a `name=` (upstream megablox's) is dumped under its Python
    # function's name ("gmm", "tgmm"), not the jaxpr's: take the one program with MXU work.
    paths = [p for p in every if "vmatmul" in open(p).read()]
    if len(paths) > 1:
      raise FileNotFoundError(f"no {kernel} dump, and several with vmatmuls: {paths}")
  if not paths:
    raise FileNotFoundError(f"no {kernel} final_bundles dump in {directory}")
  return max(paths, key=os.path.getsize)


def compiled_tensorcores(directory: str, kernel: str) -> int:
  """TensorCores a compiled kernel runs on: 2 when Mosaic split its grid between a megacore
  device's two cores, else 1.

  NOTE: a split program starts with a `BarrierMegacore` check (kept in the final bundles) and
  then loops over its core's share of the parallel steps; an unsplit one on a megacore device
  runs its whole grid in a `PrimaryCoreRegion` (named in the earlier passes' dumps) that the
  other core skips; on a one-core device (v5e, v6e, tpu7x) there is neither.

  Args:
    directory: the `--xla_jf_dump_to` directory.
    kernel: the pallas_call's name (see `find_dump`).

  Returns:
    1 or 2.
  """
  with open(find_dump(directory, kernel)) as f:
    return 2 if "BarrierMegacore" in f.read() else 1


# ----------------------------------------------------------------------------------------------
# Execution counts.


def implied_clock_hz(generation) -> float:
  """The clock the generation's bf16 peak implies (module docstring), per TensorCore.

  Args:
    generation: a `pallas_moe.tiling.TpuGeneration` or its name.

  Returns:
    Hz.
  """
  from pallas_moe import tiling as tiling_lib

  gen = tiling_lib.get_generation(generation)
  per_core = gen.peak_bf16_flops / gen.cores_per_chip
  return per_core / (2 * _num_mxus(gen) * gen.mxu_size**2)


def _num_mxus(gen) -> int:
  # NOTE: jax's tpu_info (per TensorCore): 4 on v4/v5e/v5p, 2 on v6e and tpu7x; the dumps' mxuN
  # ids agree (v5e mxu0..3, v6e and tpu7x mxu0..1).
  return 4 if gen.mxu_size == 128 else 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelCounts:
  """How often a kernel's dynamic parts run, summed over its grid (from its metadata).

  Attributes:
    steps: grid steps.
    loop_levels: total iterations of its dynamic loops, outermost first (e.g. groups of a
      tile, then sub-blocks of a group). A tuple at a level gives each of the level's loops
      with MXU work its own total, in increasing order of their MXU cycles per iteration (the
      row-tile tgmm's single sub-block loop, then its interior-run loop).
    per_group: executions of the once-per-group regions (a weight load and transpose, an
      accumulator's zeroing and write), or None if the kernel has none.
    group_starts: executions of the once-per-group regions that hold vmatmuls (the row-tile
      tgmm's first sub-block of a group, written into the accumulator; the row-tile gmm's
      widened last pass), if not `per_group`.
    empty_groups: executions of the once-per-group regions that store and (almost) do not load
      (the row-tile tgmm's zeroing, for empty groups only), if not `per_group`.
  """

  steps: int
  loop_levels: tuple[float | tuple[float, ...], ...]
  per_group: float | None = None
  group_starts: float | None = None
  empty_groups: float | None = None


def kernel_counts(*, kernel: str, ctx, case) -> KernelCounts:
  """The `KernelCounts` of one pallas_call, from its prefetched schedule.

  Row-tile kernels (prefetch: offsets, first group, last group, ...): per step the group loop
  runs last - first + 1 times, the sub-block loop once per sub-block hit (`case.step_scale`, the
  hook checked against the kernels' `probe.count_rows`); a weight load (gmm) or an accumulator's
  write-out (tgmm) runs once per group and sweep. The tgmm (`case.tgmm_dots`) has two sub-block
  loops, single sub-blocks and interior runs, each with its own total, writes a non-empty
  group's first sub-block's product in a region once per group and sweep, and zeroes the
  accumulator only for empty groups. Visit-schedule kernels: one sub-block loop,
  hits per step from the hook (which divides by the kernel's two dot branches when k is ragged:
  then each branch's loop gets that share). megablox: no dynamic loop.

  Args:
    kernel: the pallas_call's name (without the "@path" suffix).
    ctx: its `costmodel.StepContext`.
    case: the `bench.impls.Case` (its `step_scale` hook).

  Returns:
    The counts.
  """
  steps = int(np.prod(ctx.grid))
  hits = float(np.sum(case.step_scale(ctx))) if case.step_scale is not None else 0.0
  if kernel.startswith(("pallas_moe_gmm_rowtile", "pallas_moe_tgmm_rowtile")):
    pre = [np.asarray(x) for x in ctx.index_operands]
    t = ctx.program_ids[-1]
    group_iters = float(np.sum(pre[2][t] - pre[1][t] + 1))
    sweeps = int(np.prod(ctx.grid[:-1]))
    offsets, goff = pre[0], int(pre[-1].reshape(-1)[0])
    # NOTE: prefetch[3] has one entry per local group (gmm: load_rank, tgmm: finalize_tile).
    local = pre[3].shape[0]
    sizes = np.diff(offsets)[goff : goff + local]
    groups = int(np.sum(sizes > 0)) if kernel.startswith("pallas_moe_gmm") else local
    dots = getattr(case, "tgmm_dots", None)
    if kernel.startswith("pallas_moe_tgmm_rowtile") and dots is not None:
      # NOTE: the tgmm writes each non-empty group's first sub-block's product in a region of
      # the group loop, then loops over its interior runs and its single sub-blocks; only
      # empty groups are zeroed.
      first, runs, singles = (float(np.sum(x)) for x in dots(ctx))
      empty = int(np.sum(sizes <= 0))
      return KernelCounts(
        steps=steps,
        loop_levels=(group_iters, (singles, runs)),
        per_group=groups * sweeps,
        group_starts=first,
        empty_groups=empty * sweeps,
      )
    passes = getattr(case, "gmm_passes", None)
    widened = None
    if kernel.startswith("pallas_moe_gmm_rowtile") and passes is not None:
      # NOTE: the sub-block loop runs the regular passes; a group's widened last pass is a
      # region of the group loop holding a dot, run once per widened pass.
      regular, wide = passes(ctx)
      hits, widened = float(np.sum(regular)), float(np.sum(wide))
    return KernelCounts(
      steps=steps,
      loop_levels=(group_iters, hits),
      per_group=groups * sweeps,
      group_starts=widened,
    )
  if kernel.startswith(("pallas_moe_gmm", "pallas_moe_tgmm")):
    return KernelCounts(steps=steps, loop_levels=(hits,))
  return KernelCounts(steps=steps, loop_levels=())


# NOTE: a predicated region inside the group loop at least this long, with no loop inside, is
# the once-per-group work (load + prepare, zero, finalize); shorter ones (semaphore waits, DMA
# starts) are counted as taken on every iteration.
PER_GROUP_MIN_BUNDLES = 64


def trip_counts(root: Node, counts: KernelCounts) -> dict[int, float]:
  """Total executions of every node of a kernel's loop tree.

  Rules: the root runs once. The grid loop (the outermost loop when the grid has more than one
  step) runs its compiled trip count (the pipeline adds prologue / epilogue iterations), and its
  largest predicated region, the kernel body, once per grid step. Other loops with a compiled
  exit bound run that many times per execution of their parent. Loops without one are the
  kernel's dynamic loops: the k-th nesting level gets `counts.loop_levels[k]` in total (split
  evenly when a level has several loops: the branches of one `lax.cond`). Sibling predicated
  regions that each hold vmatmuls are the branches of one `lax.cond` and share their parent's
  executions evenly (exact for megablox's last-k-tile branch when k has two tiles, otherwise an
  approximation: their bundle counts are within 1% in our dumps). Other predicated regions run
  as often as their parent (an upper bound) except the once-per-group regions (see
  `PER_GROUP_MIN_BUNDLES`), which run `counts.per_group` times.

  Args:
    root: from `loop_tree`.
    counts: from `kernel_counts`.

  Returns:
    {id(node): executions}.

  Raises:
    ValueError: the tree has more dynamic loop levels than the kernel's counts know.
  """
  grid_loop = None
  if counts.steps > 1:
    grid_loop = next((n for n in root.walk() if n.kind == "loop"), None)
  levels: dict[int, list[Node]] = collections.defaultdict(list)

  def find(node: Node, level: int):
    for c in node.children:
      dynamic = c.kind == "loop" and c is not grid_loop and c.exit_bound is None
      if dynamic:
        levels[level].append(c)
      find(c, level + dynamic)

  find(root, 0)
  loop_levels = counts.loop_levels
  if len(levels) > len(loop_levels):
    raise ValueError(
      f"{len(levels)} levels of dynamic loops in the schedule, the kernel's metadata "
      f"counts {len(loop_levels)}"
    )
  # NOTE: where a level also holds loops without MXU work (tpu7x's fp8 kernel copies its scales
  # in a 5-bundle loop beside the sub-block loop), the level's count goes to the loops with
  # MXU work; the others are counted once per execution of their parent.
  for lv, loops in list(levels.items()):
    mxu = [n for n in loops if any(x.own_matmuls for x in n.walk())]
    if mxu:
      levels[lv] = mxu
  level_of = {id(n): lv for lv, loops in levels.items() for n in loops}
  own: dict[int, float] = {}
  for lv, loops in levels.items():
    total = loop_levels[lv]
    if isinstance(total, tuple):
      # NOTE: per-loop totals, matched to the loops by their vmatmuls per iteration.
      if len(total) != len(loops):
        raise ValueError(f"{len(loops)} loops with MXU work at level {lv}, counts for {len(total)}")
      ranked = sorted(loops, key=lambda n: sum(sum(x.own_matmuls.values()) for x in n.walk()))
      own.update({id(n): float(t) for n, t in zip(ranked, total, strict=True)})
  execs = {id(root): 1.0}

  def visit(node: Node, in_group_loop: bool):
    conds = [x for x in node.children if x.kind == "cond"]
    body = max(conds, key=lambda x: x.bundles) if conds else None
    # NOTE: sibling regions that each hold a dot are the branches of one `lax.cond` (megablox's
    # last-k-tile branch, our visit kernels' ragged-k branch): one of them runs.
    dots = [x for x in conds if any(n.own_matmuls for n in x.walk())]
    branches = {id(x) for x in dots} if len(dots) > 1 else set()
    for c in node.children:
      inner = in_group_loop
      if c is grid_loop:
        e = float(c.exit_bound if c.exit_bound is not None else counts.steps)
      elif id(c) in level_of:
        lv = level_of[id(c)]
        e = own[id(c)] if id(c) in own else loop_levels[lv] / len(levels[lv])
        inner = lv == 0
      elif c.kind == "loop":
        e = execs[id(node)] * (c.exit_bound or 1)
        inner = False
      elif node is grid_loop and c is body:
        e = float(counts.steps)
      elif id(c) in branches:
        e = execs[id(node)] / len(branches)
      elif (
        in_group_loop
        and counts.per_group is not None
        and not c.has_loop()
        and c.bundles >= PER_GROUP_MIN_BUNDLES
      ):
        e = float(counts.per_group)
        totals = {k: sum(x.own_counts.get(k, 0) for x in c.walk()) for k in ("load", "store")}
        if counts.group_starts is not None and any(x.own_matmuls for x in c.walk()):
          e = float(counts.group_starts)
        elif counts.empty_groups is not None and totals["store"] > 64 * totals["load"]:
          # NOTE: a zeroing stores the block with next to no loads (2 scalar-address loads on
          # v5e); the write-out loads the block.
          e = float(counts.empty_groups)
      else:
        e = execs[id(node)]
      execs[id(c)] = e
      visit(c, inner)

  visit(root, False)
  return execs


# ----------------------------------------------------------------------------------------------
# Report.


@dataclasses.dataclass(frozen=True, kw_only=True)
class LloReport:
  """The compiled schedule of one pallas_call, with the case's trip counts.

  Attributes:
    kernel: the pallas_call's name.
    generation: TPU generation name.
    clock_hz: the clock the cycles are converted at: the one the peak implies
      (`implied_clock_hz`) over `mxu_rows_per_cycle`.
    cores: TensorCores the call runs on, as the cost model counts them: with TensorCores per
      kernel (the default) the call's own (`CallCost.tensorcores`: 1 on a tpu7x device or an
      unsplit grid, 2 where Mosaic splits a megacore device's grid), at chip rates the chip's.
      µs figures assume the grid splits evenly over them.
    steps: grid steps.
    program_bundles: bundles in the compiled program.
    issue_cycles: Σ over nodes of bundles x executions (one bundle issues per cycle).
    mxu_cycles: max over MXUs of Σ vmatmul rows x executions (over `mxu_rows_per_cycle`).
    bound_cycles: Σ over nodes of max(own bundles, own MXU-busy cycles) x executions: each
      loop body or region as long as the longer of its issue and its MXU work, regions one
      after another (the compiled schedule does not overlap a group's weight transpose, say,
      with the sub-block loop's MXU work).
    class_counts: instructions executed per class.
    mxu_loop_bundles: bundles of one iteration of the innermost loop holding vmatmuls.
    mxu_loop_mxu_cycles: MXU-busy cycles of that iteration (max over MXUs).
    mxu_loop_iterations: its executions.
    model_mxu_us: the analytic cost model's MXU time of the call (`bench.costmodel`).
    model_us: the analytic model's time of the call.
    tree: text outline of the loop tree with executions.
    tiling: the case's (tm, tk, tn), if known.
    form: the case's kernel form (`bench.impls.Case.kernel`), if known.
    achievable_us: the case's achievable bound (as the bench computes it), if known.
    restated_us: the call's modeled µs with the compiled excess added
      (`costmodel.cost_with_compiled_schedule`), if known.
  """

  kernel: str
  generation: str
  clock_hz: float
  cores: int
  steps: int
  program_bundles: int
  issue_cycles: float
  mxu_cycles: float
  bound_cycles: float
  class_counts: dict[str, float]
  mxu_loop_bundles: int
  mxu_loop_mxu_cycles: float
  mxu_loop_iterations: float
  model_mxu_us: float
  model_us: float
  tree: str
  tiling: tuple[int, ...] = ()
  form: str = ""
  achievable_us: float = float("nan")
  restated_us: float = float("nan")

  @property
  def issue_us(self) -> float:
    return self.issue_cycles / self.clock_hz / self.cores * 1e6

  @property
  def mxu_us(self) -> float:
    return self.mxu_cycles / self.clock_hz / self.cores * 1e6

  @property
  def bound_us(self) -> float:
    return self.bound_cycles / self.clock_hz / self.cores * 1e6

  @property
  def ratio(self) -> float:
    """Issue cycles / MXU-busy cycles of the whole call (> 1: issue-bound)."""
    return self.issue_cycles / self.mxu_cycles if self.mxu_cycles else float("inf")

  @property
  def mxu_loop_ratio(self) -> float:
    """The same for one iteration of the innermost MXU loop."""
    return self.mxu_loop_bundles / self.mxu_loop_mxu_cycles if self.mxu_loop_mxu_cycles else 0.0

  @property
  def issue_cycles_per_step(self) -> float:
    return self.issue_cycles / max(self.steps, 1)

  def top_non_mxu(self, n: int = 2) -> list[tuple[str, float]]:
    """The n most executed instruction classes other than the MXU's."""
    rest = [(k, v) for k, v in self.class_counts.items() if not k.startswith("mxu")]
    return sorted(rest, key=lambda kv: -kv[1])[:n]

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(
      issue_us=self.issue_us,
      mxu_us=self.mxu_us,
      bound_us=self.bound_us,
      ratio=self.ratio,
      mxu_loop_ratio=self.mxu_loop_ratio,
      issue_cycles_per_step=self.issue_cycles_per_step,
      top_non_mxu=self.top_non_mxu(),
    )
    return d


def report(
  *,
  kernel: str,
  text: str,
  counts: KernelCounts,
  generation,
  model_mxu_us: float = float("nan"),
  model_us: float = float("nan"),
  cores: int | None = None,
  mxu_rows_per_cycle: int = 1,
) -> LloReport:
  """Parses one kernel's final bundles and combines them with its trip counts.

  Args:
    kernel: the pallas_call's name.
    text: its final_bundles dump.
    counts: from `kernel_counts`.
    generation: TPU generation (name or `TpuGeneration`).
    model_mxu_us: the analytic model's MXU µs for the record.
    model_us: the analytic model's µs for the record.
    cores: TensorCores the call runs on (`LloReport.cores`); default the chip's.
    mxu_rows_per_cycle: bf16 rows an MXU takes per cycle. 1: the clock the peak implies
      (`implied_clock_hz`); r > 1: the same peak at 1/r of that clock, each vmatmul busy 1/r of
      its rows (the alternative for v6e and tpu7x, module docstring): MXU µs are unchanged,
      issue µs grow r times.

  Returns:
    The `LloReport`.
  """
  from pallas_moe import tiling as tiling_lib

  gen = tiling_lib.get_generation(generation)
  if not isinstance(mxu_rows_per_cycle, int) or mxu_rows_per_cycle < 1:
    raise ValueError(f"mxu_rows_per_cycle must be a positive int, got {mxu_rows_per_cycle!r}")
  rate = float(mxu_rows_per_cycle)
  bundles = parse_bundles(text)
  root = loop_tree(bundles)
  execs = trip_counts(root, counts)
  issue = bound = 0.0
  mxu_rows: dict[int, float] = collections.defaultdict(float)
  classes = {c: 0.0 for c in CLASSES}
  for node in root.walk():
    e = execs[id(node)]
    issue += node.own_bundles * e
    cycles = {u: c / rate for u, c in node.own_mxu_cycles(gen).items()}
    bound += max(node.own_bundles, *cycles.values(), 0) * e
    for unit, c in cycles.items():
      mxu_rows[unit] += c * e
    for c, v in node.own_counts.items():
      classes[c] += v * e
  mxu_nodes = [n for n in root.walk() if n.own_matmuls]
  inner = max(mxu_nodes, key=lambda n: execs[id(n)], default=None)
  lines = []

  def outline(node: Node, indent: int):
    counts_s = " ".join(f"{k}={v}" for k, v in node.own_counts.items() if v)
    trip = f" exit_bound={node.exit_bound}" if node.exit_bound is not None else ""
    lines.append(
      f"{'  ' * indent}{node.kind}{trip} x{execs[id(node)]:,.0f}: {node.own_bundles} bundles"
      f" ({node.bundles} with children) {counts_s}"
    )
    for c in node.children:
      outline(c, indent + 1)

  outline(root, 0)
  return LloReport(
    kernel=kernel,
    generation=gen.name,
    clock_hz=implied_clock_hz(gen) / rate,
    cores=gen.cores_per_chip if cores is None else cores,
    steps=counts.steps,
    program_bundles=len(bundles),
    issue_cycles=issue,
    mxu_cycles=max(mxu_rows.values(), default=0.0),
    bound_cycles=bound,
    class_counts=classes,
    mxu_loop_bundles=inner.own_bundles if inner else 0,
    mxu_loop_mxu_cycles=max(inner.own_mxu_cycles(gen).values()) / rate if inner else 0,
    mxu_loop_iterations=execs[id(inner)] if inner else 0.0,
    model_mxu_us=model_mxu_us,
    model_us=model_us,
    tree="\n".join(lines),
  )


# ----------------------------------------------------------------------------------------------
# Compiling a bench case with the dumps, and the whole pipeline.

DUMP_FLAGS = "--xla_jf_dump_to={dir} --xla_jf_dump_llo_text=true --xla_jf_dump_to_filter=pallas"


# NOTE: the impls whose fixed tiles a `tiling` argument may replace (upstream megablox's grid).
TILED_IMPLS = frozenset({"megablox-maxtext", "megablox-default"})


def _build_case(
  *,
  impl: str,
  op: str,
  shape,
  tokens: int | None,
  generation: str,
  tiling: Sequence[int] | None = None,
  group_sizes: Sequence[int] | None = None,
):
  from bench import impls, shapes
  from pallas_moe import tiling as tiling_lib

  if isinstance(shape, dict):
    shape = shapes.Shape(**shape)
  if isinstance(shape, str):
    shp = shapes.get_shape(shape, tokens=tokens)
  else:
    shp = shape.with_tokens(tokens) if tokens else shape
  gs = shapes.group_sizes(shp) if group_sizes is None else np.asarray(group_sizes, np.int32)
  gen = tiling_lib.get_generation(generation)
  if tiling is None:
    build = impls.IMPLS[impl].build
  elif impl in TILED_IMPLS and len(tiling) == 3:
    build = impls._megablox_build(tuple(int(t) for t in tiling))
  else:
    raise ValueError(
      f"tiling: a (tm, tk, tn) for one of {sorted(TILED_IMPLS)}, got {tiling!r} for {impl!r}"
    )
  case = build(op=op, shape=shp, group_sizes=gs, generation=gen)
  return case, gen


def _shape_and_sizes(shape, tokens):
  from bench import shapes

  if isinstance(shape, str):
    shp = shapes.get_shape(shape, tokens=tokens)
  else:
    shp = shape.with_tokens(tokens) if tokens else shape
  return shp, shapes.group_sizes(shp)


def _compile_in_this_process(spec: dict[str, Any]) -> None:
  """Compiles a case for its generation's AOT topology (run with the dump flags set)."""
  import jax
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  case, gen = _build_case(**spec)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  dev = topologies.get_topology_desc(topology_name=gen.aot_topology, platform="tpu").devices[0]
  sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())
  args = tuple(
    jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sh) if hasattr(a, "dtype") else a
    for a in case.args
  )
  with jax.default_device(dev):
    jax.jit(case.fn).lower(*args).compile()


def compile_dump(
  *,
  impl: str,
  op: str,
  shape,
  generation: str,
  tokens: int | None = None,
  dump_dir: str,
  tiling: Sequence[int] | None = None,
  timeout_s: float = 900,
) -> str:
  """AOT-compiles a bench case in a subprocess with the LLO dumps on.

  NOTE: libtpu reads LIBTPU_INIT_ARGS once, when jax first loads it, so the dump directory
  must be set in a fresh process. A directory whose compile finished (`compiled.ok`) is reused;
  one without is compiled into again.

  Args:
    impl: a `bench.impls.IMPLS` key.
    op: "fwd", "dlhs" or "drhs".
    shape: a `bench.shapes.SHAPES` key or a `bench.shapes.Shape`.
    generation: TPU generation name.
    tokens: token count (None: the shape's native one).
    dump_dir: where libtpu writes the dumps.
    tiling: (tm, tk, tn) in place of a `TILED_IMPLS` impl's fixed tiles.
    timeout_s: subprocess timeout.

  Returns:
    dump_dir.

  Raises:
    RuntimeError: the compile failed (its stderr's tail in the message).
  """
  done = os.path.join(dump_dir, "compiled.ok")
  if os.path.exists(done):
    return dump_dir
  os.makedirs(dump_dir, exist_ok=True)
  if not isinstance(shape, str):
    shape = dataclasses.asdict(shape)
  spec = dict(impl=impl, op=op, shape=shape, tokens=tokens, generation=generation)
  if tiling is not None:
    spec["tiling"] = [int(t) for t in tiling]
  return dump_compile("bench.llo", spec, dump_dir=dump_dir, timeout_s=timeout_s)


def dump_compile(module: str, spec: dict[str, Any], *, dump_dir: str, timeout_s: float) -> str:
  """Runs `python -m <module> --_compile <spec as JSON>` in a fresh process with libtpu's LLO
  dumps on (libtpu reads LIBTPU_INIT_ARGS once, when jax first loads it), then marks the
  directory done (`compiled.ok`, which `compile_dump` and its kin check first).

  Returns:
    dump_dir.

  Raises:
    RuntimeError: the compile failed (its stderr's tail in the message).
  """
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    ALLOW_MULTIPLE_LIBTPU_LOAD="1",
    LIBTPU_INIT_ARGS=(env.get("LIBTPU_INIT_ARGS", "") + " " + DUMP_FLAGS.format(dir=dump_dir)),
  )
  proc = subprocess.run(
    [sys.executable, "-m", module, "--_compile", json.dumps(spec)],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout_s,
    check=False,
  )
  if proc.returncode:
    raise RuntimeError(f"compile of {spec} failed:\n{proc.stderr[-3000:]}")
  with open(os.path.join(dump_dir, "compiled.ok"), "w") as f:
    f.write(json.dumps(spec) + "\n")
  return dump_dir


# NOTE: pallas_calls that only move bytes (gmm's fill of the unvisited rows, gmm.py): the
# schedule has nothing to say about them beyond the model's DMA time.
DMA_ONLY_KERNELS = frozenset({"pallas_moe_zero_fill"})


def analyze_case(
  *,
  impl: str,
  op: str,
  shape,
  generation: str,
  tokens: int | None = None,
  cache_dir: str | None = None,
  tiling: Sequence[int] | None = None,
  group_sizes: Sequence[int] | None = None,
  mxu_rows_per_cycle: int = 1,
) -> list[LloReport]:
  """Compiles (or reuses) a bench case's dumps and reports each of its pallas_calls.

  Trip counts come from the case's own metadata: `bench.costmodel.analyze` evaluates the
  kernel's scalar prefetch for the case's group sizes (uniform routing, seed 0, as the bench).

  Args:
    impl: a `bench.impls.IMPLS` key.
    op: "fwd", "dlhs" or "drhs".
    shape: a `bench.shapes.SHAPES` key or a `bench.shapes.Shape`.
    generation: TPU generation name.
    tokens: token count (None: native).
    cache_dir: parent of the per-case dump directories (default: a temp dir, removed).
    tiling: (tm, tk, tn) in place of a `TILED_IMPLS` impl's fixed tiles.
    group_sizes: rows per group for the trip counts and the model (default the shape's uniform
      routing); the compiled program does not depend on them.
    mxu_rows_per_cycle: see `report`.

  Returns:
    One `LloReport` per pallas_call with MXU work, in program order (`DMA_ONLY_KERNELS`, the
    row-tile gmm's zero fill, are left out; their excess is 0).
  """
  from bench import costmodel

  case, gen = _build_case(
    impl=impl,
    op=op,
    shape=shape,
    tokens=tokens,
    generation=generation,
    tiling=tiling,
    group_sizes=group_sizes,
  )
  ctxs = []

  def capture(ctx):
    ctxs.append(ctx)
    return case.step_scale(ctx) if case.step_scale is not None else 1.0

  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=capture, step_manual_bytes=case.step_manual_bytes
  )
  shp, gs = _shape_and_sizes(shape, tokens)
  if group_sizes is not None:
    gs = np.asarray(group_sizes, np.int32)
  # NOTE: as the bench's `cost` call (bench/__main__.py), for the achievable bound.
  cost_kw = dict(
    generation=gen,
    mxu_rows_useful=int(gs.sum()),
    useful_row_macs=shp.k * shp.n,
    floor_rows_count=costmodel.op_floor_rows(gs, generation=gen, op=op),
    min_hbm_bytes=2 * (shp.m * shp.k + shp.m * shp.n + shp.num_groups * shp.k * shp.n),
  )
  base = costmodel.cost(scheds, **cost_kw)
  costs = base.calls
  tmp = None
  if cache_dir is None:
    tmp = tempfile.TemporaryDirectory(prefix="llo-")
    cache_dir = tmp.name
  name = shape if isinstance(shape, str) else f"{shape.name}-{shape.m}x{shape.k}x{shape.n}"
  label = f"{impl}-{name}-{tokens or 'native'}-{op}-{gen.name}"
  if tiling is not None:
    label += "-" + "x".join(str(int(t)) for t in tiling)
  dump_dir = compile_dump(
    impl=impl,
    op=op,
    shape=shape,
    tokens=tokens,
    generation=gen.name,
    dump_dir=os.path.join(cache_dir, label),
    tiling=tiling,
  )
  out, excess = [], []
  for sched, ctx, cc in zip(scheds, ctxs, costs, strict=True):
    name = sched.name.split("@")[0]
    if name in DMA_ONLY_KERNELS:
      # NOTE: no MXU work to hold against: the model charges its DMA bytes, and its issue time
      # (a few scalar bundles per chunk) hides under them.
      excess.append(0.0)
      continue
    with open(find_dump(dump_dir, name)) as f:
      text = f.read()
    rep = report(
      kernel=name,
      text=text,
      counts=kernel_counts(kernel=name, ctx=ctx, case=case),
      generation=gen,
      model_mxu_us=cc.mxu_us,
      model_us=cc.modeled_us,
      # NOTE: the compiled cycles are the whole grid's at one TensorCore's clock; they are
      # held against the model's busiest core, so divide by the cores the model runs it on.
      cores=(cc.tensorcores if costmodel.current_tensorcores() == "kernel" else gen.cores_per_chip),
      mxu_rows_per_cycle=mxu_rows_per_cycle,
    )
    out.append(dataclasses.replace(rep, tiling=tuple(case.tiling), form=case.kernel))
    excess.append(costmodel.compiled_excess_us(bound_us=rep.bound_us, mxu_us=rep.mxu_us))
  if tmp is not None:
    tmp.cleanup()
  restated = costmodel.cost_with_compiled_schedule(scheds, excess_us=excess, **cost_kw)
  restated_us = [
    c.modeled_us
    for sched, c in zip(scheds, restated.calls, strict=True)
    if sched.name.split("@")[0] not in DMA_ONLY_KERNELS
  ]
  return [
    dataclasses.replace(r, achievable_us=base.achievable_us, restated_us=us)
    for r, us in zip(out, restated_us, strict=True)
  ]


def _print(rep: LloReport, *, label: str, tree: bool) -> None:
  top = ", ".join(f"{k} {v:,.0f}" for k, v in rep.top_non_mxu())
  print(f"== {label}: {rep.kernel} on {rep.generation} (clock {rep.clock_hz / 1e9:.2f} GHz)")
  print(f"  grid steps {rep.steps}, program {rep.program_bundles} bundles")
  print(
    f"  issue cycles {rep.issue_cycles:,.0f} ({rep.issue_cycles_per_step:,.0f} per step) ="
    f" {rep.issue_us:,.1f} us; MXU-busy cycles {rep.mxu_cycles:,.0f} = {rep.mxu_us:,.1f} us;"
    f" issue/MXU {rep.ratio:.3f}"
  )
  print(
    f"  per region max(issue, MXU), in sequence: {rep.bound_cycles:,.0f} cycles ="
    f" {rep.bound_us:,.1f} us ({rep.bound_us / rep.model_mxu_us - 1:+.1%} vs the model's MXU)"
  )
  print(
    f"  innermost MXU loop: {rep.mxu_loop_bundles} bundles / {rep.mxu_loop_mxu_cycles} MXU"
    f" cycles per iteration = {rep.mxu_loop_ratio:.3f}, x{rep.mxu_loop_iterations:,.0f}"
  )
  print(
    f"  analytic model: MXU {rep.model_mxu_us:,.1f} us, modeled {rep.model_us:,.1f} us;"
    f" compiled issue - model MXU = {rep.issue_us - rep.model_mxu_us:+,.1f} us"
    f" ({rep.issue_us / rep.model_mxu_us - 1:+.1%})"
  )
  print(f"  top non-MXU classes: {top}")
  if rep.restated_us == rep.restated_us:
    print(
      f"  modeled with the compiled excess: {rep.restated_us:,.1f} us ="
      f" {rep.restated_us / rep.achievable_us:.3f} x the achievable bound"
      f" (was {rep.model_us / rep.achievable_us:.3f})"
    )
  if tree:
    print(rep.tree)


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m bench.llo", description=__doc__.splitlines()[0])
  p.add_argument("--impl", default="pallas_moe")
  p.add_argument("--shape", default="deepseek-v2-lite")
  p.add_argument("--tokens", type=int, default=None)
  p.add_argument("--op", default="fwd")
  p.add_argument("--chip", default="v5e")
  p.add_argument("--cache_dir", default=None, help="keep dumps here (reused when present)")
  p.add_argument("--tree", action="store_true", help="print the loop tree")
  p.add_argument("--json", default=None, help="append the reports as JSON lines to this file")
  p.add_argument("--table", default=None, help="print a markdown table of a --json file, exit")
  p.add_argument("--restated", default=None, help="print the restated-model table of a --json file")
  p.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args._compile:
    _compile_in_this_process(json.loads(args._compile))
    return
  if args.table or args.restated:
    with open(args.table or args.restated) as f:
      recs = [json.loads(line) for line in f if line.strip()]
    print(markdown_table(recs) if args.table else restated_table(recs))
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  for shape in args.shape.split(","):
    for impl in args.impl.split(","):
      for op in args.op.split(","):
        for chip in args.chip.split(","):
          reps = analyze_case(
            impl=impl,
            op=op,
            shape=shape,
            generation=chip,
            tokens=args.tokens,
            cache_dir=args.cache_dir,
          )
          label = f"{impl} {shape}@{args.tokens or 'native'} {op}"
          for rep in reps:
            _print(rep, label=label, tree=args.tree)
            if args.json:
              with open(args.json, "a") as f:
                rec = dict(impl=impl, shape=shape, tokens=args.tokens, op=op, **rep.as_dict())
                f.write(json.dumps(rec) + "\n")


_OPS = ("fwd", "dlhs", "drhs")


def _sorted(records):
  return sorted(
    records,
    key=lambda r: (
      r["shape"],
      -(r.get("tokens") or 1 << 30),
      _OPS.index(r["op"]) if r["op"] in _OPS else 9,
      {"v5e": 0, "v6e": 1}.get(r["generation"], 2),
      r["impl"],
    ),
  )


def _tiling_label(record: dict[str, Any]) -> str:
  """ "tmxtkxtn", with " (rs)" when the kernel runs `rows_stationary`."""
  form = " (rs)" if record.get("form") == "rowtile-rows-stationary" else ""
  return "x".join(str(t) for t in record.get("tiling") or ()) + form


def restated_table(records: Sequence[dict[str, Any]]) -> str:
  """Markdown: the model's time with and without the compiled excess, against the bound.

  Args:
    records: `--json` records (one per case).

  Returns:
    Markdown.
  """
  from bench import costmodel

  cols = (
    "shape | op | chip | tiling | modeled µs | /ach | compiled excess µs | restated µs |"
    " restated/ach | inner loop issue/MXU"
  )
  out = ["| " + cols + " |", "|" + "---|" * len(cols.split(" | "))]
  for r in _sorted(records):
    tiling = _tiling_label(r)
    excess = costmodel.compiled_excess_us(bound_us=r["bound_us"], mxu_us=r["mxu_us"])
    label = f"{r['shape']}@{r.get('tokens') or 'native'}"
    out.append(
      f"| {label} | {r['op']} | {r['generation']} | {tiling} | {r['model_us']:,.0f} |"
      f" {r['model_us'] / r['achievable_us']:.3f} | {excess:,.0f} | {r['restated_us']:,.0f} |"
      f" {r['restated_us'] / r['achievable_us']:.3f} | {r['mxu_loop_ratio']:.2f} |"
    )
  return "\n".join(out)


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
  """The RESULTS.md table of `--json` records.

  Args:
    records: `LloReport.as_dict()` plus impl, shape, tokens, op.

  Returns:
    Markdown.
  """
  cols = (
    "shape | op | chip | impl | tiling | model MXU µs | compiled MXU µs | issue µs | "
    "bound µs | bound − model MXU | issue/MXU | inner loop issue/MXU | top non-MXU classes"
  )
  out = ["| " + cols + " |", "|" + "---|" * len(cols.split(" | "))]
  for r in _sorted(records):
    tiling = _tiling_label(r)
    top = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in r["top_non_mxu"])
    diff = r["bound_us"] - r["model_mxu_us"]
    out.append(
      f"| {r['shape']} | {r['op']} | {r['generation']} | {r['impl']} | {tiling} |"
      f" {r['model_mxu_us']:,.0f} | {r['mxu_us']:,.0f} | {r['issue_us']:,.0f} |"
      f" {r['bound_us']:,.0f} | {diff:+,.0f} ({diff / r['model_mxu_us']:+.1%}) |"
      f" {r['ratio']:.2f} | {r['mxu_loop_ratio']:.2f} | {top} |"
    )
  return "\n".join(out)


if __name__ == "__main__":
  main()
