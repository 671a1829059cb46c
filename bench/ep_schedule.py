"""What the compiled EP training step overlaps: each exchange, async or not, kernels under it.

  python -m bench.ep_schedule [--topology v5e:2x4 v6e:2x4] [--batch_split 1 2] [--data 1]
                              [--flags default "async a2a" sync] [--dedup]

AOT-compiles `value_and_grad` of the MoE layer's loss (`bench.moe_memory.aot_step_compiled`) for
each topology, batch split and flag set (the default program; libtpu's async all-to-all flags
on, `pallas_moe.schedule.ASYNC_COLLECTIVE_OPTIONS`; the same flags off,
`schedule.SYNC_COLLECTIVE_OPTIONS`), parses the scheduled HLO (`bench.hlo_schedule`) and prints
the libtpu version and one markdown row per (ragged) all-to-all of the entry computation in
schedule order. What the default program does depends on the libtpu version (see
`pallas_moe.schedule`). Needs libtpu (the `tpu` extra); no TPU.
"""

from __future__ import annotations

import collections
import os
import re
import time

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

from bench import hlo_schedule  # noqa: E402
from bench.moe_memory import aot_step_compiled  # noqa: E402
from pallas_moe import schedule  # noqa: E402
from pallas_moe.config import MoEConfig  # noqa: E402

# NOTE: small enough that a v5e:2x4 step compiles in ~5-7 s: 16 experts (2 per device at ep=8),
# top-2, d = f = 512, bf16, 1024 tokens per device, capacity factor 2. At d = f = 256 and 256
# tokens XLA's scheduler on v6e chose not to put a chunk's gmms under another chunk's forward
# exchange (it did on v5e, and on v6e from this size up): see bench/results/ep-overlap.md, "What
# the compiled EP step overlaps".
SMALL_EP = dict(
  num_experts=16,
  top_k=2,
  d_model=512,
  expert_ffn_dim=512,
  dtype="bfloat16",
  weight_dtype="bfloat16",
  buffer_factor=2.0,
  # NOTE: the plain exchange (one row per choice), whose compiled schedule ep-overlap.md and
  # tests/bench/test_schedule.py describe; the deduplicated one (auto-on at these dims, `--dedup`)
  # adds the receiver's expand/reduce between exchange and gmm (`pallas_moe.schedule`'s
  # docstring; tests/layer/test_dedup.py pins its split step).
  dedup_dispatch=False,
)
TOKENS_PER_DEVICE = 1024
FLAG_SETS = {
  "default": None,
  "async a2a": schedule.ASYNC_COLLECTIVE_OPTIONS,
  "sync": schedule.SYNC_COLLECTIVE_OPTIONS,
}


def compiled_schedule(
  *,
  topology: str,
  batch_split: int,
  data: int = 1,
  compiler_options: dict | None = None,
  tokens_per_device: int = TOKENS_PER_DEVICE,
  overrides: dict | None = None,
) -> hlo_schedule.Schedule:
  """The parsed schedule of the small EP training step.

  Args:
    topology: e.g. "v5e:2x4" (8 devices).
    batch_split: `MoEConfig.batch_split`.
    data: data-axis size (the expert axis takes the rest of the 8 devices).
    compiler_options: libtpu/XLA options (None: the default program).
    tokens_per_device: tokens on each device.
    overrides: `MoEConfig` fields replacing `SMALL_EP`'s (e.g. a smaller `d_model`).

  Returns:
    `hlo_schedule.parse_schedule` of the compiled step.
  """
  config = MoEConfig(**{**SMALL_EP, **(overrides or {})}, batch_split=batch_split)
  compiled = aot_step_compiled(
    topology=topology,
    data=data,
    ep=8 // data,
    tokens_per_device=tokens_per_device,
    config=config,
    with_value=True,
    compiler_options=compiler_options,
  )
  return hlo_schedule.parse_schedule(compiled.as_text())


def trimmed_entry(text: str, *, title: str) -> str:
  """The entry computation of a scheduled module, cut down to what `hlo_schedule` reads.

  Keeps, in schedule order, the collectives and their start/done pairs, while loops and
  `tpu_custom_call`s, each as `name = type opcode(operands)` plus its `op_name` (backend configs,
  Mosaic bodies and every other instruction dropped). This is how
  `tests/data/ep_step_v5e_split2_async.hlo.txt` was made.

  Args:
    text: `compiled.as_text()`.
    title: the HloModule name to write.

  Returns:
    The trimmed module text.
  """
  parsed = hlo_schedule.parse_schedule(text)
  header = next(line for line in text.splitlines() if line.startswith("ENTRY"))
  out = [f"HloModule {title}, is_scheduled=true", "", header.split(" (")[0] + " () -> () {"]
  types = {}
  for line in text[text.index(header) :].splitlines()[1:]:
    m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s[a-z][a-z0-9\-]*\(", line)
    if m:
      types[m.group(1)] = m.group(2)
    if line.startswith("}"):
      break
  for inst in parsed.computations[parsed.entry]:
    base = inst.opcode.removesuffix("-start").removesuffix("-done")
    if not (base in hlo_schedule.COLLECTIVE_KINDS or inst.kernel or inst.opcode == "while"):
      continue
    ops = ", ".join("%" + o for o in inst.operands)
    target = ', custom_call_target="tpu_custom_call"' if inst.kernel else ""
    out.append(
      f"  %{inst.name} = {types[inst.name]} {inst.opcode}({ops}){target}, "
      f'metadata={{op_name="{inst.op_name}"}}'
    )
  return "\n".join(out + ["}", ""])


def _kernels(under: list[str]) -> str:
  counts = collections.Counter(
    k.removeprefix("pallas_moe_").removesuffix("_rowtile") for k in under
  )
  return ", ".join(f"{n}×{k}" for k, n in counts.items()) or "-"


def table(rows: list[tuple[str, str, int, dict]]) -> str:
  """Markdown: one row per collective of `hlo_schedule.summary`, prefixed by its program's keys."""
  out = [
    "| topology | flags | split | collective | pass, exchange, chunk | async | kernels under it |",
    "|---|---|---|---|---|---|---|",
  ]
  for topo, flags, split, r in rows:
    out.append(
      f"| {topo} | {flags} | {split} | {r['kind']} | {r['where']} | "
      f"{'yes' if r['async'] else 'no'} | {_kernels(r['kernels_under'])} |"
    )
  return "\n".join(out)


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", nargs="+", default=["v5e:2x4", "v6e:2x4"])
  parser.add_argument("--batch_split", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--data", type=int, default=1)
  parser.add_argument("--dedup", action="store_true", help="the deduplicated exchange")
  parser.add_argument("--flags", nargs="+", choices=list(FLAG_SETS), default=list(FLAG_SETS))
  parser.add_argument(
    "--fixture", help="write the trimmed v5e:2x4 async batch_split=2 program here, and stop"
  )
  args = parser.parse_args()
  if args.fixture:
    config = MoEConfig(**SMALL_EP, batch_split=2)
    compiled = aot_step_compiled(
      topology="v5e:2x4",
      ep=8,
      tokens_per_device=TOKENS_PER_DEVICE,
      config=config,
      with_value=True,
      compiler_options=schedule.ASYNC_COLLECTIVE_OPTIONS,
    )
    text = trimmed_entry(compiled.as_text(), title="ep_step_v5e_2x4_split2_async_trimmed")
    with open(args.fixture, "w") as f:
      f.write(text)
    raise SystemExit(0)
  rows = []
  version = schedule.libtpu_version()
  print(f"# libtpu {'.'.join(map(str, version)) if version else 'not installed'}")
  for topo in args.topology:
    for flags in args.flags:
      opts = FLAG_SETS[flags]
      for split in args.batch_split:
        t0 = time.perf_counter()
        sched = compiled_schedule(
          topology=topo,
          batch_split=split,
          data=args.data,
          compiler_options=opts,
          overrides=dict(dedup_dispatch=True) if args.dedup else None,
        )
        print(f"# {topo} {flags} split={split}: compiled in {time.perf_counter() - t0:.1f} s")
        rows.extend((topo, flags, split, r) for r in hlo_schedule.summary(sched))
  print(table(rows))
