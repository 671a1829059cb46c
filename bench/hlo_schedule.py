"""What a compiled program overlaps: collectives and the kernels scheduled under them.

Reads the scheduled HLO text of a compiled executable (`jax.jit(f).lower(...).compile()
.as_text()`, e.g. an ahead-of-time TPU compile from this host). In a scheduled module the order
of the instructions in each computation is the order they run in. An async collective is a
`<kind>-start` / `<kind>-done` pair (or an `async-start` / `async-done` pair wrapping a
collective); whatever is scheduled between the two runs while the collective is in flight. A
collective with neither is synchronous: the core waits for it.

For each async collective this module lists the custom calls (our Pallas kernels are
`tpu_custom_call`s named `pallas_moe_*`) scheduled between its start and its done, including
those inside computations called from there (while bodies, conditionals). Each instruction
carries its `op_name` metadata, so callers can tell forward from backward
(`transpose(jvp())` in the name) and, with `MoEConfig.batch_split`, which chunk it belongs to
(`batch_split_<c>`), and which exchange (the `dispatch` / `combine` scopes of `moe`).

Whether the MoE block's exchange is async at all depends on the libtpu version and two libtpu
flags (`pallas_moe.schedule`: `ASYNC_COLLECTIVE_OPTIONS`, `SYNC_COLLECTIVE_OPTIONS`,
`ragged_async_by_default`). Where it is async (AOT compiles of the EP training step for
v5e:2x4 and v6e:2x4; bench/results/ep-overlap.md, "What the compiled EP step overlaps"), the
scheduler puts work under the exchange: the weight gradients under the backward's dispatch;
with a batch split, another chunk's gmms.

The deduplicated exchange (`MoEConfig.dedup_dispatch`, `pallas_moe.dedup`) is still one native
`ragged-all-to-all` each way per chunk (its weights and ids travel packed in the rows), but the
receiver's passes are XLA ops between exchange and gmm: a sort of the received ids (expand), a
gather of the expert rows, a scatter-add of the weighted outputs (reduce), and the sender's
scatter-add home. What the compiler overlaps (v5e:2x4 / v6e:2x4, EP 8, `bench.ep_schedule`'s
layer): unsplit, nothing under the forward exchanges; those passes sit on the critical path on
every version (0.0.50.1 even leaves 2 of the 4 exchanges synchronous on v6e). With 2 chunks
and the exchange async, XLA fused the two chunks' receiver passes (the ids' unpacking and sort
keys) into one multi-output fusion, so each chunk's expert rows waited for both dispatches and
only one chunk's forward work ran under an exchange; the block now orders chunk c's receive
after chunk c-1's expand (`jax.lax.optimization_barrier`), and each chunk's expand, gmms and
reduce run under the other chunk's exchange, as the plain exchange's gmms do. In the backward
the weight gradients (tgmm) run under the last dispatch on v5e but after every exchange on v6e
(also unsplit); the plain exchange's run under it on both.

With three or more chunks the block also binds chunk c's dispatch to follow chunk c-2's combine,
and in the backward chunk c-2's combine gradient to follow chunk c's dispatch gradient
(`moe._fence`): without it XLA starts every chunk's combine gradient at once and holds every
chunk's backward buffers together.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = [
  "COLLECTIVE_KINDS",
  "AsyncCollective",
  "Instruction",
  "Schedule",
  "SyncCollective",
  "chunk_of",
  "cross_chunk_overlaps",
  "exchange_of",
  "is_backward",
  "parse_schedule",
  "summary",
]

COLLECTIVE_KINDS = frozenset(
  {
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-broadcast",
    "collective-permute",
    "ragged-all-to-all",
    "reduce-scatter",
    "recv",
    "send",
  }
)

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
# NOTE: the first lowercase word directly followed by "(" after "=" is the opcode: types such
# as `bf16[8]{0:T(128)S(1)}` or tuples `(f32[], u32[])` never put a lowercase word there.
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(
  r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations)="
  r"(\{[^}]*\}|%[\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a scheduled computation.

  Attributes:
    name: its HLO name (without `%`).
    opcode: e.g. "custom-call", "ragged-all-to-all-start".
    operands: names of its operands, in order.
    called: computations it calls (fusion bodies, while bodies, branches, ...).
    op_name: the `op_name` metadata ("" if none): JAX's name stack of the op.
    kernel: for a `tpu_custom_call`, the kernel's name (the Pallas call's name, e.g.
      "pallas_moe_gmm_rowtile"); None otherwise.
  """

  name: str
  opcode: str
  operands: tuple[str, ...]
  called: tuple[str, ...]
  op_name: str
  kernel: str | None


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
  """A collective issued as a start/done pair.

  Attributes:
    kind: the collective, e.g. "ragged-all-to-all".
    computation: the computation holding the pair.
    start: the start instruction.
    done: the done instruction.
    start_index: the start's position in the computation's schedule.
    done_index: the done's position.
    kernels_under: custom calls scheduled strictly between start and done (also inside
      computations called from there), in schedule order.
  """

  kind: str
  computation: str
  start: Instruction
  done: Instruction
  start_index: int
  done_index: int
  kernels_under: tuple[Instruction, ...]

  @property
  def op_name(self) -> str:
    return self.start.op_name


@dataclasses.dataclass(frozen=True)
class SyncCollective:
  """A collective without start/done: the core waits for it.

  Attributes:
    kind: the collective.
    computation: the computation holding it.
    instruction: the instruction.
    index: its position in the computation's schedule.
  """

  kind: str
  computation: str
  instruction: Instruction
  index: int

  @property
  def op_name(self) -> str:
    return self.instruction.op_name


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A parsed scheduled module.

  Attributes:
    computations: computation name -> its instructions in schedule order.
    entry: the entry computation's name.
    async_collectives: every async collective, by computation then start position.
    sync_collectives: every synchronous collective, likewise.
    kernels: every `tpu_custom_call`, likewise.
  """

  computations: dict[str, tuple[Instruction, ...]]
  entry: str
  async_collectives: tuple[AsyncCollective, ...]
  sync_collectives: tuple[SyncCollective, ...]
  kernels: tuple[Instruction, ...]


def _kernel_name(name: str, rest: str) -> str | None:
  if 'custom_call_target="tpu_custom_call"' not in rest:
    return None
  op = _OP_NAME.search(rest)
  if op:
    # NOTE: the Pallas call's name is the name-stack entry just before "pallas_call".
    parts = op.group(1).split("/")
    if "pallas_call" in parts and parts.index("pallas_call") > 0:
      return parts[parts.index("pallas_call") - 1]
  return re.sub(r"\.\d+$", "", name)


def _parse_instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  name, rest = m.group(2), m.group(3)
  op = _OPCODE.search(rest)
  if not op:
    return None
  opcode = op.group(1)
  # NOTE: operands are the %names inside the opcode's parentheses (up to the matching ")").
  depth, i = 0, op.end() - 1
  for i in range(op.end() - 1, len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    if depth == 0:
      break
  operands = tuple(_OPERAND.findall(rest[op.end() : i]))
  called = tuple(n for group in _CALLED.findall(rest) for n in _OPERAND.findall(group))
  op_name = _OP_NAME.search(rest)
  return Instruction(
    name=name,
    opcode=opcode,
    operands=operands,
    called=called,
    op_name=op_name.group(1) if op_name else "",
    kernel=_kernel_name(name, rest) if opcode == "custom-call" else None,
  )


def _split_computations(text: str) -> tuple[dict[str, tuple[Instruction, ...]], str]:
  comps: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      h = _HEADER.match(line)
      if h and not line.startswith("HloModule"):
        current = h.group(2)
        comps[current] = []
        if h.group(1):
          entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    inst = _parse_instruction(line)
    if inst is not None:
      comps[current].append(inst)
  if not entry:
    raise ValueError("no ENTRY computation found: pass `compiled.as_text()` of a compiled program.")
  return {k: tuple(v) for k, v in comps.items()}, entry


def _async_kind(start: Instruction, comps) -> str | None:
  """The collective a start instruction begins, or None (a copy, a non-collective offload)."""
  base = start.opcode.removesuffix("-start")
  if base in COLLECTIVE_KINDS:
    return base
  if start.opcode in ("async-start", "call-start"):
    for c in start.called:
      for inst in comps.get(c, ()):
        kind = inst.opcode.removesuffix("-start")
        if kind in COLLECTIVE_KINDS:
          return kind
  return None


def _nested_kernels(inst: Instruction, comps, seen: set[str]) -> list[Instruction]:
  out = [inst] if inst.kernel is not None else []
  for c in inst.called:
    if c in seen:
      continue
    seen.add(c)
    for sub in comps.get(c, ()):
      out.extend(_nested_kernels(sub, comps, seen))
  return out


def parse_schedule(text: str) -> Schedule:
  """Parses `compiled.as_text()` of a scheduled module.

  Args:
    text: the HLO text after scheduling (XLA's `as_text()` of a compiled executable).

  Returns:
    A `Schedule`.
  """
  comps, entry = _split_computations(text)
  # NOTE: a collective inside a computation an async-start wraps is the async op's body.
  wrapped = {
    c
    for insts in comps.values()
    for inst in insts
    if inst.opcode in ("async-start", "call-start")
    for c in inst.called
  }
  asyncs, syncs, kernels = [], [], []
  for cname, insts in comps.items():
    starts: dict[str, int] = {}
    for i, inst in enumerate(insts):
      if inst.kernel is not None:
        kernels.append(inst)
      if inst.opcode.endswith("-start"):
        starts[inst.name] = i
      elif inst.opcode.endswith("-done") and inst.operands and inst.operands[0] in starts:
        j = starts.pop(inst.operands[0])
        kind = _async_kind(insts[j], comps)
        if kind is None:
          continue
        under: list[Instruction] = []
        for mid in insts[j + 1 : i]:
          under.extend(_nested_kernels(mid, comps, set()))
        asyncs.append(
          AsyncCollective(
            kind=kind,
            computation=cname,
            start=insts[j],
            done=inst,
            start_index=j,
            done_index=i,
            kernels_under=tuple(under),
          )
        )
      elif inst.opcode in COLLECTIVE_KINDS and cname not in wrapped:
        syncs.append(SyncCollective(kind=inst.opcode, computation=cname, instruction=inst, index=i))
  asyncs.sort(key=lambda a: (a.computation != entry, a.computation, a.start_index))
  syncs.sort(key=lambda s: (s.computation != entry, s.computation, s.index))
  return Schedule(
    computations=comps,
    entry=entry,
    async_collectives=tuple(asyncs),
    sync_collectives=tuple(syncs),
    kernels=tuple(kernels),
  )


def chunk_of(op_name: str) -> int | None:
  """The batch-split chunk an op belongs to (`batch_split_<c>` in its name stack), or None."""
  m = re.search(r"batch_split_(\d+)", op_name)
  return int(m.group(1)) if m else None


def is_backward(op_name: str) -> bool:
  """Whether an op comes from the backward pass (JAX names those `transpose(jvp(...))`)."""
  return "transpose(" in op_name


def exchange_of(op_name: str) -> str | None:
  """ "dispatch" or "combine" for ops of the MoE block's two exchanges (its named scopes)."""
  parts = op_name.split("/")
  for role in ("dispatch", "combine"):
    if role in parts:
      return role
  return None


def _label(op_name: str) -> str:
  c = chunk_of(op_name)
  role = exchange_of(op_name)
  return " ".join(
    [("bwd" if is_backward(op_name) else "fwd")]
    + ([role] if role else [])
    + ([] if c is None else [f"chunk {c}"])
  )


def cross_chunk_overlaps(
  schedule: Schedule, *, kinds: tuple[str, ...] = ("ragged-all-to-all",), gmm_only: bool = True
) -> list[tuple[AsyncCollective, Instruction]]:
  """Pairs (collective of chunk c, kernel of chunk c' != c) where the kernel runs in its window.

  Args:
    schedule: from `parse_schedule` of a program with `MoEConfig.batch_split` > 1.
    kinds: the collectives to consider.
    gmm_only: count only the grouped-matmul kernels (`pallas_moe_gmm*` / `pallas_moe_tgmm*`).

  Returns:
    The pairs, in schedule order.
  """
  out = []
  for a in schedule.async_collectives:
    c = chunk_of(a.op_name)
    if a.kind not in kinds or c is None:
      continue
    for k in a.kernels_under:
      if gmm_only and not re.match(r"pallas_moe_t?gmm", k.kernel or ""):
        continue
      kc = chunk_of(k.op_name)
      if kc is not None and kc != c:
        out.append((a, k))
  return out


def summary(schedule: Schedule, *, kinds: tuple[str, ...] = ("ragged-all-to-all", "all-to-all")):
  """Rows describing each collective of `kinds` in the entry computation, in schedule order.

  Args:
    schedule: from `parse_schedule`.
    kinds: the collectives to list.

  Returns:
    A list of dicts: `kind`, `name`, `where` ("fwd"/"bwd", plus "chunk c" with a batch split),
    `async` (bool), `kernels_under` (list of "kernel (where)" strings).
  """
  rows = []
  for a in schedule.async_collectives:
    if a.computation == schedule.entry and a.kind in kinds:
      under = [f"{k.kernel} ({_label(k.op_name)})" for k in a.kernels_under]
      rows.append((a.start_index, a.kind, a.start.name, a.op_name, True, under))
  for s in schedule.sync_collectives:
    if s.computation == schedule.entry and s.kind in kinds:
      rows.append((s.index, s.kind, s.instruction.name, s.op_name, False, []))
  rows.sort()
  return [
    dict(kind=k, name=n, where=_label(op), **{"async": a}, kernels_under=u)
    for _, k, n, op, a, u in rows
  ]
