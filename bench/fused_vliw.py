"""The fused expert kernel's compiled VLIW schedule, step by step, against the decode model.

`bench.decode` models one step of `pallas_moe.fused_experts` (one chunk of one expert's
gate/up and down) as its weight copy against its MXU work. This module reads what Mosaic
actually scheduled: it compiles the kernel ahead of time for a TPU generation with libtpu's LLO
dumps on (as `bench.llo` does for the gmm kernels), finds the step loop (the program's largest
loop), and counts the bundles one step issues, split into

- products: the step loop's own bundles (the gate/up and down dots, the activation, the DMA
  issue and waits), and
- dequantization: the loops without MXU work inside it (kind "block": each piece's narrow
  values upcast, scaled and cast to the compute dtype, 128 rows of d per iteration),

each inner loop counted its static trip count (the compiled exit test) and every predicated
region as taken. Bundles are converted to µs at the clock the generation's bf16 peak implies
(`bench.llo.implied_clock_hz`: v5e 1.50, v5p 1.75 GHz, v6e 3.50 and tpu7x 4.40 GHz, the last
two above any published TPU clock, so their µs are lower bounds).

The case is DeepSeek-V3's expert (d 7,168, f 2,048) at decode size: 64 tokens, 4 local
experts, the tokens layout, the plan `plan_fused` makes for the generation. The dequantization
rate it measures (bundles per 1,024 values, at 16 and 128 tokens) is what
`bench.decode.ISSUE_BUNDLES` fits.

    python -m bench.fused_vliw --markdown bench/results/fused-vliw.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import llo

KERNEL = "pallas_moe_fused_experts"
CHIPS = ("v5e", "v5p", "v6e", "tpu7x")
WEIGHTS = ("fp8-block", "bf16")
DIMS = dict(d=7168, f=2048, experts=4, tokens=64)


def _compile_in_this_process(spec: dict[str, Any]) -> None:
  """Compiles the fused call of `spec` for its generation (dump flags set): DIMS' tokens layout,
  or with "ep" the plan `bench.decode` models at that grid point (`point_plan`)."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from pallas_moe import fused_experts as fe
  from pallas_moe import tiling

  gen = tiling.get_generation(spec["chip"])
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  dev = topologies.get_topology_desc(topology_name=gen.aot_topology, platform="tpu").devices[0]
  sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

  if "ep" in spec:
    layout, plan = point_plan(**{k: spec[k] for k in POINT_KEYS})
  else:
    layout = "tokens"
    plan = plan_for(
      spec["chip"], spec["weights"], spec["tokens"], spec.get("pieces"), spec.get("upcast")
    )
  # NOTE: a streamed plan's rows are the receive buffer's, in HBM.
  e, n = plan.num_experts, plan.rows
  args = (sds((n, plan.d), jnp.bfloat16), *_weights(sds, plan, spec["weights"]))
  args += (sds((e,), jnp.int32), sds((e, n), jnp.float32), sds((e, n), jnp.int32))

  def call(x, wi, wo, group_sizes, expert_weights, expert_tokens):
    if layout == "streamed":
      # NOTE: as the block path calls it (`moe._fused_forward`), without routing weights.
      kw = dict(stream=True, unowned_rows="undefined")
    else:
      kw = dict(expert_weights=expert_weights)
      if layout == "gathered":
        kw["expert_tokens"] = expert_tokens
    return fe.fused_experts(x, wi, wo, group_sizes, plan=plan, **kw)

  with tiling.use_generation(gen), jax.default_device(dev):
    jax.jit(call).lower(*args).compile()


def _weights(sds, plan, weights: str):
  """Abstract [gate | up] and down weights of the plan's experts, stored as `weights`."""
  import jax.numpy as jnp

  from pallas_moe import quant

  e, d, f = plan.num_experts, plan.d, plan.f
  if weights == "bf16":
    return sds((e, d, 2 * f), jnp.bfloat16), sds((e, f, d), jnp.bfloat16)
  b, f8, f32 = quant.BLOCK, jnp.float8_e4m3fn, jnp.float32
  wi = quant.BlockQuantizedWeights(sds((e, d, 2 * f), f8), sds((e, d // b, 2 * f // b), f32))
  wo = quant.BlockQuantizedWeights(sds((e, f, d), f8), sds((e, f // b, d // b), f32))
  return wi, wo


POINT_KEYS = ("model", "weights", "chip", "ep", "tokens")


def point_plan(*, model: str, weights: str, chip: str, ep: int, tokens: int):
  """The fused kernel's layout and plan at a point of `bench.decode`'s grid, as its serving
  model runs it (`bench.decode.model_serving`).

  Returns:
    (layout: "tokens", "gathered" or "streamed", `FusedPlan`), or None where the point's
    experts are the gmm pair.
  """
  from bench import decode as bd

  m = next(x for x in bd.MODELS if x.name == model)
  plan = bd.serving_plan(m, weights, chip, ep=ep, tokens=tokens)
  if plan.path == "block":
    return None if plan.block.fused is None else ("streamed", plan.block.fused)
  return ("gathered" if plan.fused.gather else "tokens"), plan.fused


def compile_dump(
  *,
  chip: str,
  weights: str,
  dump_dir: str,
  tokens: int = DIMS["tokens"],
  pieces: int | None = None,
  upcast: str | None = None,
  timeout_s: float = 900,
) -> str:
  """AOT-compiles the case in a fresh process with the LLO dumps on (libtpu reads its flags
  once, when jax loads it); a directory whose compile finished is reused.

  Returns:
    dump_dir.
  """
  spec = DIMS | dict(chip=chip, weights=weights, tokens=tokens, pieces=pieces, upcast=upcast)
  return _dumped(spec, dump_dir, timeout_s=timeout_s)


def _dumped(spec: dict[str, Any], dump_dir: str, *, timeout_s: float) -> str:
  """`spec` compiled with the LLO dumps on into `dump_dir` (`_compile_in_this_process`, in a
  fresh process), unless a finished compile is there already.

  Returns:
    dump_dir.
  """
  if os.path.exists(os.path.join(dump_dir, "compiled.ok")):
    return dump_dir
  os.makedirs(dump_dir, exist_ok=True)
  return llo.dump_compile("bench.fused_vliw", spec, dump_dir=dump_dir, timeout_s=timeout_s)


def _issued(node: llo.Node) -> int:
  """Bundles one pass over `node` issues: static loops their trip count, dynamic loops once,
  predicated regions as taken."""
  total = node.own_bundles
  for child in node.children:
    trips = (child.exit_bound or 1) if child.kind == "loop" else 1
    total += _issued(child) * trips
  return total


def _has_matmul(node: llo.Node) -> bool:
  return any(n.own_matmul for n in node.walk())


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCounts:
  """One step's compiled bundles (see the module docstring)."""

  products: int
  dequant: int
  mxu_cycles: float
  # NOTE: of products + dequant, the bundles in predicated regions (`pl.when` bodies Mosaic
  # branched around: an expert's first step's gathers, its last step's adds back, a visit's
  # row copies), counted as taken; of those, the ones in dynamic loops (one iteration each: a
  # gathered expert's windows, a streamed visit's granules).
  predicated: int = 0
  predicated_loops: int = 0


def step_counts(text: str, generation) -> StepCounts:
  """The step loop's bundles from a final_bundles dump of the fused kernel.

  Args:
    text: the dump's text.
    generation: its TPU generation or its name (for the vmatmuls' MXU cycles).

  Returns:
    `StepCounts`: the step loop is the program's largest loop; its inner loops without MXU work
    are the dequantization, the rest its products.
  """
  from pallas_moe.generations import get_generation

  generation = get_generation(generation)
  root = llo.loop_tree(llo.parse_bundles(text))
  step = max((n for n in root.walk() if n.kind == "loop"), key=lambda n: n.bundles)
  inner = [c for c in step.children if c.kind == "loop" and not _has_matmul(c)]
  dequant = sum(_issued(c) * (c.exit_bound or 1) for c in inner)

  def mxu(node: llo.Node) -> float:
    own = max(node.own_mxu_cycles(generation).values(), default=0.0)
    trips = [(c.exit_bound or 1) if c.kind == "loop" else 1 for c in node.children]
    return own + sum(mxu(c) * t for c, t in zip(node.children, trips, strict=True))

  return StepCounts(
    products=_issued(step) - dequant,
    dequant=dequant,
    mxu_cycles=mxu(step),
    predicated=_predicated(step),
    predicated_loops=_predicated_loops(step),
  )


def _predicated_loops(node: llo.Node, predicated: bool = False) -> int:
  """Bundles of `_issued(node)` inside dynamic loops inside predicated regions."""
  total = 0
  for child in node.children:
    trips = (child.exit_bound or 1) if child.kind == "loop" else 1
    if predicated and child.kind == "loop" and child.exit_bound is None:
      total += _issued(child)
    else:
      total += _predicated_loops(child, predicated or child.kind == "cond") * trips
  return total


def _predicated(node: llo.Node) -> int:
  """Bundles of `_issued(node)` inside predicated regions."""
  total = 0
  for child in node.children:
    trips = (child.exit_bound or 1) if child.kind == "loop" else 1
    total += (_issued(child) if child.kind == "cond" else _predicated(child)) * trips
  return total


def plan_for(
  chip: str,
  weights: str,
  tokens: int = DIMS["tokens"],
  pieces: int | None = None,
  upcast: str | None = None,
):
  """The fused plan of the case, as `plan_fused` makes it for the generation (`pieces`: its
  parts of d forced; `upcast`: its route for block-scaled values forced)."""
  from bench import decode as bd
  from pallas_moe import fused_experts as fe

  dtype, kind = bd.WEIGHTS[weights]
  return fe.plan_fused(
    rows=tokens,
    d=DIMS["d"],
    f=DIMS["f"],
    num_experts=DIMS["experts"],
    x_dtype="bfloat16",
    w_dtype=dtype,
    kind=kind,
    generation=chip,
    by_token=True,
    pieces=pieces,
    upcast=upcast if weights == "fp8-block" else None,
  )


def record(
  chip: str,
  weights: str,
  counts: StepCounts,
  tokens: int = DIMS["tokens"],
  pieces: int | None = None,
  upcast: str | None = None,
) -> dict:
  """The compiled step beside the model's: µs at the implied clock, the model's copy and MXU
  time of the step (one TensorCore's rates), the dequantization's bundles per 1,024 values."""
  from bench import decode as bd
  from pallas_moe.generations import get_generation, tensorcore_rates

  gen = get_generation(chip)
  plan = plan_for(chip, weights, tokens, pieces, upcast)
  clock = llo.implied_clock_hz(gen)
  flops, bw = tensorcore_rates(gen)
  values = 3 * plan.d * plan.chunk
  us = 1e6 / clock
  return dict(
    chip=chip,
    weights=weights,
    tokens=tokens,
    window=plan.window,
    chunk=plan.chunk,
    pieces=plan.pieces,
    upcast=plan.upcast if plan.kind == "block" else "",
    clock_ghz=clock / 1e9,
    products_us=counts.products * us,
    dequant_us=counts.dequant * us,
    issue_us=(counts.products + counts.dequant) * us,
    mxu_busy_us=counts.mxu_cycles * us,
    copy_us=plan.step_weight_bytes / bw * 1e6,
    model_mxu_us=bd.window_macs(plan, gen) * 2 / flops * 1e6,
    dequant_bundles_per_1024=counts.dequant / values * 1024,
    products_bundles_per_1024=counts.products / values * 1024,
  )


def point_record(counts: StepCounts, **point) -> dict:
  """A grid point's compiled step beside `bench.decode`'s (one TensorCore's rates).

  The compiled step counts a dynamic loop once and every predicated region as taken, so it is
  one window of a gathered or streamed step (an expert's first step's gathers and its last
  step's adds back both included), and all of a tokens step's windows. The model's step is
  the same: its windows at the longer of their MXU time and their fp8 issue
  (`bench.decode.step_compute_s`), plus the gathered layout's one-hot products.
  """
  from bench import decode as bd
  from pallas_moe.generations import get_generation, tensorcore_rates

  layout, plan = point_plan(**point)
  gen = get_generation(point["chip"])
  flops, bw = tensorcore_rates(gen)
  us = 1e6 / llo.implied_clock_hz(gen)
  return dict(
    point,
    layout=layout,
    rows=plan.rows,
    window=plan.window,
    windows=1 if layout != "tokens" else plan.rows // plan.window,
    chunk=plan.chunk,
    pieces=plan.pieces,
    cores=plan.cores,
    upcast=plan.upcast if plan.kind == "block" else "",
    issue_us=(counts.products + counts.dequant) * us,
    predicated_us=counts.predicated * us,
    predicated_loops_us=counts.predicated_loops * us,
    mxu_busy_us=counts.mxu_cycles * us,
    model_step_us=bd.model_step_s(plan, gen) * 1e6,
    model_gather_us=sum(bd.gather_macs(plan, gen)) * 2 / flops * 1e6,
    copy_us=plan.step_weight_bytes / bw * 1e6,
    plan_key=bd.plan_key(plan, gen),
  )


def grid_points(chips: Sequence[str] = CHIPS) -> list[dict]:
  """One point of `bench.decode`'s grid per distinct fused plan it models (points whose
  experts are the gmm pair left out), in grid order."""
  from bench import decode as bd

  seen, out = set(), []
  for m, w, ep, t, *_ in bd._cases(bd.MODELS, bd.TOKENS):
    for chip in chips:
      point = dict(model=m.name, weights=w, chip=chip, ep=ep, tokens=t)
      got = point_plan(**point)
      if got is None:
        continue
      layout, plan = got
      # NOTE: the local experts change the operands' shapes, not the step.
      key = (layout, bd.plan_key(plan, chip))
      if key not in seen:
        seen.add(key)
        out.append(point)
  return out


def run_points(points: Sequence[dict], *, work: str, jobs: int | None = None) -> list[dict]:
  """Compiles each point's plan, `jobs` compiles at a time (default: one per CPU), a dump
  directory per point under `work` (reused where its compile finished), and returns
  `point_record`s in `points` order."""
  from concurrent.futures import ThreadPoolExecutor

  from pallas_moe.generations import get_generation

  def one(point: dict) -> dict:
    where = os.path.join(work, "{model}-{weights}-{chip}-ep{ep}-t{tokens}".format(**point))
    _dumped(point, where, timeout_s=1800)
    with open(llo.find_dump(where, KERNEL)) as f:
      counts = step_counts(f.read(), get_generation(point["chip"]))
    return point_record(counts, **point)

  with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
    return list(pool.map(one, points))


def run(
  chips: Sequence[str] = CHIPS,
  weights: Sequence[str] = WEIGHTS,
  tokens: Sequence[int] = (DIMS["tokens"],),
  *,
  work: str,
  pieces: int | None = None,
  upcast: str | None = None,
) -> list:
  from pallas_moe.generations import get_generation

  out = []
  for chip in chips:
    for w in weights:
      for t in tokens:
        tag = (f"-p{pieces}" if pieces else "") + (f"-{upcast}" if upcast else "")
        where = os.path.join(work, f"{chip}-{w}-{t}{tag}")
        kw = dict(pieces=pieces, upcast=upcast)
        d = compile_dump(chip=chip, weights=w, dump_dir=where, tokens=t, **kw)
        text = open(llo.find_dump(d, KERNEL)).read()
        out.append(record(chip, w, step_counts(text, get_generation(chip)), t, **kw))
  return out


def markdown(recs: Sequence[dict], *, command: str, versions: str) -> str:
  lines = [
    "# The fused kernel's compiled step against the decode model",
    "",
    f"`{command}` ({versions}; 2-core VM, no TPU: compiled ahead of time, nothing ran). "
    "DeepSeek-V3's expert (d 7,168, f 2,048), 4 local experts, the tokens layout (one window "
    "of all the tokens); one step is one chunk of one expert. Bundles issued per step at the "
    "clock the bf16 peak implies (v6e's and tpu7x's exceed published clocks: their µs are "
    "lower bounds); copy: the step's weight bytes at one TensorCore's HBM bandwidth; model "
    "MXU: `bench.decode`'s MXU time of the step (rows padded to 128 per pass).",
    "",
    "| chip | weights | tokens | chunk | upcast | issued µs | MXU-busy µs | model MXU µs "
    "| copy µs | issued / copy | bundles per 1,024 values |",
    "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in recs:
    lines.append(
      f"| {r['chip']} | {r['weights']} | {r['tokens']} | {r['chunk']} | {r['upcast'] or '-'} "
      f"| {r['issue_us']:.1f} | {r['mxu_busy_us']:.1f} | {r['model_mxu_us']:.1f} "
      f"| {r['copy_us']:.1f} | {r['issue_us'] / r['copy_us']:.2f} "
      f"| {r['products_bundles_per_1024'] + r['dequant_bundles_per_1024']:.2f} |"
    )
  looped = [r for r in recs if r["dequant_us"]]
  lines.append("")
  if looped:
    lines.append(
      "Steps with loops without MXU work (a dequantization of their own), µs of the issue: "
      + ", ".join(
        f"{r['chip']} {r['weights']} {r['tokens']}: {r['dequant_us']:.1f}" for r in looped
      )
      + "."
    )
  else:
    lines.append("No step has a loop without MXU work (no dequantization loop of its own).")
  return "\n".join(lines) + "\n"


def markdown_points(recs: Sequence[dict], *, command: str, versions: str) -> str:
  """The grid points' compiled steps against `bench.decode`'s, one row per distinct plan."""
  lines = [
    "# The fused kernel's compiled step at the decode grid's plans",
    "",
    f"`{command}` ({versions}; 2-core VM, no TPU: compiled ahead of time, nothing ran). One "
    "point per distinct plan `bench.decode` models for `moe_decode` (the local experts change "
    "the operands, not the step). A gathered or streamed step is one window (dynamic loops "
    "counted once), its first chunk's gathers and last chunk's adds back both taken; a tokens "
    "step is all its windows. Issued: the step loop's bundles at the clock the bf16 peak "
    "implies; model: `bench.decode`'s step (`step_compute_s`, plus the gathered layout's "
    "one-hot products); copy: the step's weights at one TensorCore's HBM bandwidth.",
    "",
    "| model | weights | chip | EP | T | layout | rows | window | chunk | pieces | issued µs "
    "| MXU-busy µs | model µs | issued / model | copy µs | issued / copy |",
    "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in recs:
    lines.append(
      f"| {r['model']} | {r['weights']} | {r['chip']} | {r['ep']} | {r['tokens']} "
      f"| {r['layout']} | {r['rows']} | {r['window']} | {r['chunk']} | {r['pieces']} "
      f"| {r['issue_us']:.2f} | {r['mxu_busy_us']:.2f} | {r['model_step_us']:.2f} "
      f"| {r['issue_us'] / r['model_step_us']:.2f} | {r['copy_us']:.2f} "
      f"| {r['issue_us'] / r['copy_us']:.2f} |"
    )
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--chips", nargs="*", default=list(CHIPS))
  p.add_argument("--weights", nargs="*", default=list(WEIGHTS))
  p.add_argument("--tokens", nargs="*", type=int, default=[16, 64, 128])
  p.add_argument("--pieces", type=int, default=None, help="force the plan's parts of d")
  p.add_argument(
    "--upcast", default=None, help="force the fp8 block-scaled route (`FusedPlan.upcast`)"
  )
  p.add_argument(
    "--points",
    action="store_true",
    help="compile the plans bench.decode models at its grid's points (one per distinct plan) "
    "instead of DeepSeek-V3's tokens layout",
  )
  p.add_argument("--work", default=None, help="dump directory (default: a temporary one)")
  p.add_argument("--markdown", default=None, help="write the table here")
  p.add_argument("--json", default=None, help="write the records here")
  p.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a._compile:
    _compile_in_this_process(json.loads(a._compile))
    return
  import jax

  with tempfile.TemporaryDirectory() as tmp:
    if a.points:
      recs = run_points(grid_points(a.chips), work=a.work or tmp)
    else:
      recs = run(a.chips, a.weights, a.tokens, work=a.work or tmp, pieces=a.pieces, upcast=a.upcast)
  # NOTE: the dump and JSON paths are where this run kept things, not what it measured.
  shown = list(argv if argv is not None else sys.argv[1:])
  for flag in ("--work", "--json"):
    if flag in shown:
      i = shown.index(flag)
      del shown[i : i + 2]
  command = "python -m bench.fused_vliw " + " ".join(shown)
  from importlib.metadata import version

  versions = f"jax {jax.__version__}, libtpu {version('libtpu')}"
  text = (markdown_points if a.points else markdown)(
    recs, command=command.strip(), versions=versions
  )
  print(text)
  if a.markdown:
    with open(a.markdown, "w") as fh:
      fh.write(text)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(recs, fh, indent=1)


if __name__ == "__main__":
  main()
