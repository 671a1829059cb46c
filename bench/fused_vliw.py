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
  """Compiles the tokens-layout fused call of `spec` for its generation (dump flags set)."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from pallas_moe import fused_experts as fe
  from pallas_moe import quant, tiling

  gen = tiling.get_generation(spec["chip"])
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  dev = topologies.get_topology_desc(topology_name=gen.aot_topology, platform="tpu").devices[0]
  sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())
  d, f, e, n = (spec[k] for k in ("d", "f", "experts", "tokens"))

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

  if spec["weights"] == "bf16":
    wi, wo = sds((e, d, 2 * f), jnp.bfloat16), sds((e, f, d), jnp.bfloat16)
  else:
    b, f8, f32 = quant.BLOCK, jnp.float8_e4m3fn, jnp.float32
    wi = quant.BlockQuantizedWeights(sds((e, d, 2 * f), f8), sds((e, d // b, 2 * f // b), f32))
    wo = quant.BlockQuantizedWeights(sds((e, f, d), f8), sds((e, f // b, d // b), f32))
  args = (sds((n, d), jnp.bfloat16), wi, wo, sds((e,), jnp.int32), sds((e, n), jnp.float32))

  plan = plan_for(spec["chip"], spec["weights"], n, spec.get("pieces"), spec.get("upcast"))

  def call(x, wi, wo, group_sizes, expert_weights):
    return fe.fused_experts(x, wi, wo, group_sizes, expert_weights=expert_weights, plan=plan)

  with tiling.use_generation(gen), jax.default_device(dev):
    jax.jit(call).lower(*args).compile()


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
  done = os.path.join(dump_dir, "compiled.ok")
  if os.path.exists(done):
    return dump_dir
  os.makedirs(dump_dir, exist_ok=True)
  spec = DIMS | dict(chip=chip, weights=weights, tokens=tokens, pieces=pieces, upcast=upcast)
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

  return StepCounts(products=_issued(step) - dequant, dequant=dequant, mxu_cycles=mxu(step))


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


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--chips", nargs="*", default=list(CHIPS))
  p.add_argument("--weights", nargs="*", default=list(WEIGHTS))
  p.add_argument("--tokens", nargs="*", type=int, default=[16, 64, 128])
  p.add_argument("--pieces", type=int, default=None, help="force the plan's parts of d")
  p.add_argument(
    "--upcast", default=None, help="force the fp8 block-scaled route (`FusedPlan.upcast`)"
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
  text = markdown(recs, command=command.strip(), versions=versions)
  print(text)
  if a.markdown:
    with open(a.markdown, "w") as fh:
      fh.write(text)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(recs, fh, indent=1)


if __name__ == "__main__":
  main()
