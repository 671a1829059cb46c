"""The makespan of a compiled program's schedule, with modeled times for what it runs.

  python -m bench.schedule_time DUMP.txt [DUMP.txt ...] --chip v5e --model deepseek-v2-lite
                                --ep 4 --tokens 4096 --chunks 4 [--dedup]

XLA:TPU runs one instruction at a time on the TensorCore, in the order of the scheduled HLO
(`compiled.as_text()`, or an `--xla_dump_to` dump's `*after_optimizations.txt`); an async
collective or copy (`*-start` / `*-done`) runs beside it, and its `-done` waits for it. This
walks the entry computation in that order with:
- a Mosaic kernel (`tpu_custom_call`): the roofline of its own CostEstimate (flops at the chip's
  bf16 peak, bytes at its HBM bandwidth);
- an XLA convolution (a dot): 2 * output elements * contraction at the bf16 peak, or its bytes;
- any other XLA op: its operand and output bytes at the HBM bandwidth (fusions as one op; 0 for
  bitcasts, tuples, parameters and constants); while loops: body x trip count; conditionals:
  the longest branch;
- an expert exchange (a `ragged-all-to-all` in the block's `dispatch` or `combine` scope): the
  step model's time for one chunk's exchange (`bench.ep.case_row`: the whole forward or
  backward ICI time / (2 * chunks)), the exchanges sharing the links one at a time; other
  collectives (the plans' small exchanges among them): their output bytes at one link's rate.
The result is the time the schedule needs under those times: with the same times for two
programs (e.g. with and without a barrier), it says what their orders cost, which counting the
kernels under each exchange (`bench.hlo_schedule`) does not. It is not a measurement: the op
times are a model, and XLA's own ops are charged by bytes alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from bench import hlo_schedule
from bench.aot_step import _logical_lines, cost_estimate
from pallas_moe import generations

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES.update(
  {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")
_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_FREE = {
  "parameter",
  "constant",
  "bitcast",
  "tuple",
  "get-tuple-element",
  "after-all",
  "partition-id",
  "replica-id",
  "iota",
  "opt-barrier",
}
_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Op:
  """One scheduled instruction: what its time depends on."""

  name: str
  opcode: str
  out_bytes: int
  out_dims: tuple[int, ...]
  operands: tuple[str, ...]
  called: tuple[str, ...]
  line: str


def _array_bytes(text: str) -> tuple[int, tuple[int, ...]]:
  """Total bytes of the arrays in an HLO type (a tuple sums them) and the first one's dims."""
  total, first = 0, None
  for dtype, dims in _ARRAY.findall(text):
    shape = tuple(int(d) for d in dims.split(",") if d)
    if first is None:
      first = shape
    total += math.prod(shape) * _DTYPE_BYTES.get(dtype, 4)
  return total, first or ()


def parse(text: str) -> tuple[dict[str, list[Op]], str]:
  """Computations of scheduled HLO text (name -> ops in order) and the entry's name."""
  comps: dict[str, list[Op]] = {}
  entry, name = None, None
  for line in _logical_lines(text):
    if not line.startswith(" "):
      head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
      if head:
        name = head.group(2)
        comps[name] = []
        if head.group(1):
          entry = name
      continue
    m = _HEAD.match(line)
    if not m or name is None:
      continue
    op_name, shape, opcode, rest = m.groups()
    out_bytes, dims = _array_bytes(shape)
    args = rest.split(")", 1)[0]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    called = tuple(re.findall(r"(?:calls|body|to_apply)=%([\w.\-]+)", rest))
    for branches in re.findall(r"branch_computations=\{([^}]*)\}", rest):
      called += tuple(b.strip().lstrip("%") for b in branches.split(","))
    comps[name].append(Op(op_name, opcode, out_bytes, dims, operands, called, line))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rates:
  """The chip's rates (per TensorCore) and the exchanges' modeled durations."""

  flops_per_s: float
  hbm_bytes_per_s: float
  link_bytes_per_s: float
  fwd_exchange_us: float
  bwd_exchange_us: float
  # NOTE: False charges only the kernels and the expert exchanges: what `bench.ep`'s pipeline
  # models, in the compiled program's order.
  xla_ops: bool = True
  # NOTE: multiplies every kernel's time (e.g. to the step model's gmm time for the step).
  kernel_scale: float = 1.0


def _kernel_us(op: Op, rates: Rates) -> float:
  flops, nbytes = cost_estimate(op.line)
  return rates.kernel_scale * max(flops / rates.flops_per_s, nbytes / rates.hbm_bytes_per_s) * 1e6


def _conv_flops(op: Op, sizes: dict[str, tuple[int, ...]]) -> float:
  """2 * output elements * the contraction: the lhs dimension labelled `f` in dim_labels."""
  labels = re.search(r"dim_labels=(\w+)_", op.line)
  lhs = sizes.get(op.operands[0]) if op.operands else None
  if not labels or not lhs or "f" not in labels.group(1):
    return 0.0
  return 2.0 * math.prod(op.out_dims) * lhs[labels.group(1).index("f")]


def _expert_exchange_us(op: Op, rates: Rates) -> float | None:
  """The modeled time of an expert exchange (a ragged all-to-all in the block's `dispatch` or
  `combine` scope, async or not), else None."""
  name = re.search(r'op_name="([^"]*)"', op.line)
  if "ragged" not in op.line or not name or not hlo_schedule.exchange_of(name.group(1)):
    return None
  return rates.bwd_exchange_us if hlo_schedule.is_backward(name.group(1)) else rates.fwd_exchange_us


def _by_name(ops: list[Op]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
  """Each op's output dims and output bytes, by name."""
  return {o.name: o.out_dims for o in ops}, {o.name: o.out_bytes for o in ops}


def _trip_count(op: Op) -> int:
  m = re.search(r'known_trip_count\\?":\{\\?"n\\?":\\?"(\d+)', op.line)
  return int(m.group(1)) if m else 1


def _op_us(op: Op, comps, rates: Rates, sizes, nbytes, memo) -> float:
  """The TensorCore time of one synchronous op (async pairs are handled by `makespan`)."""
  if op.opcode in _FREE or op.opcode.endswith("-done") or op.opcode.endswith("-start"):
    return 0.0
  if op.opcode == "custom-call":
    return _kernel_us(op, rates) if 'custom_call_target="tpu_custom_call"' in op.line else 0.0
  if op.opcode == "while":
    return _trip_count(op) * sum(_comp_us(c, comps, rates, memo) for c in op.called[:1])
  if op.opcode == "conditional":
    return max((_comp_us(c, comps, rates, memo) for c in op.called), default=0.0)
  if op.opcode == "call":
    return sum(_comp_us(c, comps, rates, memo) for c in op.called)
  if not rates.xla_ops:
    return 0.0
  if op.opcode in _COLLECTIVES or op.opcode == "ragged-all-to-all":
    return op.out_bytes / rates.link_bytes_per_s * 1e6
  flops = _conv_flops(op, sizes) if op.opcode == "convolution" else 0.0
  if op.opcode == "fusion" and op.called:
    fused = comps.get(op.called[0], [])
    inner_sizes, _ = _by_name(fused)
    flops += sum(_conv_flops(o, inner_sizes) for o in fused if o.opcode == "convolution")
  moved = op.out_bytes + sum(nbytes.get(o, 0) for o in op.operands)
  return max(flops / rates.flops_per_s, moved / rates.hbm_bytes_per_s) * 1e6


def _comp_us(name: str, comps, rates: Rates, memo: dict) -> float:
  if name not in memo:
    memo[name] = 0.0  # NOTE: guards recursion; HLO computations are not recursive.
    ops = comps.get(name, [])
    sizes, nbytes = _by_name(ops)
    memo[name] = sum(_op_us(o, comps, rates, sizes, nbytes, memo) for o in ops)
  return memo[name]


def makespan(text: str, rates: Rates) -> dict[str, float]:
  """Walks the entry computation in schedule order; see the module docstring.

  Returns:
    total_us (the makespan), core_us (TensorCore busy time), kernel_us (Mosaic kernels),
    exchange_us (modeled expert exchanges, summed) and waiting_us (the core idle at a `-done`).
  """
  comps, entry = parse(text)
  ops = comps[entry]
  sizes, nbytes = _by_name(ops)
  memo: dict[str, float] = {}
  t = core = kernels = exchanges = waiting = 0.0
  links_free = 0.0
  ends: dict[str, float] = {}
  for op in ops:
    dur = _expert_exchange_us(op, rates)
    if op.opcode.endswith("-start"):
      if dur is not None:
        # NOTE: the exchanges share the links: one at a time, in the order they start.
        links_free = max(links_free, t) + dur
        ends[op.name] = links_free
        exchanges += dur
      elif not rates.xla_ops:
        ends[op.name] = t
      elif any(c in op.opcode for c in _COLLECTIVES):
        ends[op.name] = t + op.out_bytes / 2 / rates.link_bytes_per_s * 1e6
      else:
        # NOTE: copies and slices between HBM and VMEM, on the DMA engines.
        ends[op.name] = t + op.out_bytes / rates.hbm_bytes_per_s * 1e6
      continue
    if op.opcode.endswith("-done"):
      end = max((ends.get(o, 0.0) for o in op.operands), default=0.0)
      waiting += max(0.0, end - t)
      t = max(t, end)
      continue
    if op.opcode == "ragged-all-to-all" and dur is not None:
      # NOTE: a synchronous expert exchange: the core waits for the links and the transfer.
      links_free = max(links_free, t) + dur
      waiting += links_free - t
      exchanges += dur
      t = links_free
      continue
    us = _op_us(op, comps, rates, sizes, nbytes, memo)
    if op.opcode == "custom-call" and us:
      kernels += us
    t += us
    core += us
  return dict(
    total_us=t, core_us=core, kernel_us=kernels, exchange_us=exchanges, waiting_us=waiting
  )


def rates_for(
  *, chip: str, model: str, ep: int, tokens: int, chunks: int, dedup: bool
) -> tuple[Rates, tuple[float, float]]:
  """The chip's per-core rates and one chunk's modeled exchange times (`bench.ep.case_row`),
  and the step model's own figures for that chunked step: (step µs, its gmm µs), forward and
  backward."""
  from bench import ep as ep_model

  row = ep_model.case_row(
    model=model,
    ep=ep,
    tokens=tokens,
    chip=chip,
    policy="exact",
    routing="uniform",
    chunks=(chunks,),
    dedup=dedup,
  )
  flops, hbm = generations.tensorcore_rates(chip)
  return Rates(
    flops_per_s=flops,
    hbm_bytes_per_s=hbm,
    link_bytes_per_s=ep_model.CHIPS[chip].link_bytes_per_s,
    fwd_exchange_us=row["ici_fwd_us"] / (2 * chunks),
    bwd_exchange_us=row["ici_bwd_us"] / (2 * chunks),
  ), (row["chunked"][chunks]["step_us"], row["chunked"][chunks]["gmm_us"])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("hlo", nargs="+", help="scheduled HLO text files")
  parser.add_argument("--chip", required=True)
  parser.add_argument("--model", default="deepseek-v2-lite")
  parser.add_argument("--ep", type=int, required=True)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--chunks", type=int, required=True)
  parser.add_argument("--dedup", action="store_true")
  parser.add_argument(
    "--kernels_only",
    action="store_true",
    help="charge only the kernels (scaled to the step model's gmm time) and expert exchanges: "
    "the step model's pipeline in the compiled order",
  )
  args = parser.parse_args(argv)
  rates, (model_us, model_gmm_us) = rates_for(
    chip=args.chip,
    model=args.model,
    ep=args.ep,
    tokens=args.tokens,
    chunks=args.chunks,
    dedup=args.dedup,
  )
  rates = dataclasses.replace(rates, xla_ops=not args.kernels_only)
  print(json.dumps(dataclasses.asdict(rates)))
  print(f"step model: {model_us:.1f} us, of which gmm {model_gmm_us:.1f} us")
  for path in args.hlo:
    with open(path) as f:
      text = f.read()
    r = makespan(text, rates)
    if args.kernels_only:
      scaled = dataclasses.replace(rates, kernel_scale=model_gmm_us / r["kernel_us"])
      r = makespan(text, scaled)
    print(path, json.dumps({k: round(v, 1) for k, v in r.items()}))


if __name__ == "__main__":
  main()
