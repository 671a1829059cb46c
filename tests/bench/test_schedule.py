"""Tests for bench.hlo_schedule, the scheduled-HLO parser, and what the compiled EP step overlaps.

The parser tests read `tests/data/ep_step_v5e_split2_async.hlo.txt`: the entry computation of a
real v5e:2x4 AOT compile of the EP training step (`bench.ep_schedule`'s config, batch_split=2,
`schedule.ASYNC_COLLECTIVE_OPTIONS`, jax 0.10.2 / libtpu 0.0.42.1), trimmed to its collectives,
start/done pairs, while loops and kernels (backend configs and other instructions dropped; the
order is the compiler's).
Regenerate with `python -m bench.ep_schedule --fixture tests/data/ep_step_v5e_split2_async.hlo.txt`
(on that stack: other versions name and order instructions differently).

The AOT tests compile the step for v5e:2x4 and v6e:2x4 (ep=8, ~5-7 s per program) and pin what
the installed libtpu does (`schedule.ragged_async_by_default`):
- libtpu 0.0.42.1: the default program's expert exchanges (`ragged-all-to-all`) are all
  synchronous; with `schedule.ASYNC_COLLECTIVE_OPTIONS` they are start/done pairs and the
  backward's last exchange has the weight-gradient kernels (tgmm) under it;
- libtpu 0.0.50.1 and 0.0.52: the default program is already like that (every exchange a
  start/done pair, the small all-to-alls synchronous), and `schedule.SYNC_COLLECTIVE_OPTIONS`
  makes every exchange synchronous;
- batch_split=2 in the program where the exchange is async (the flags on 0.0.42.1, the default
  from 0.0.50): in the forward and in the backward, a chunk's exchange is in flight while
  another chunk's gmm runs;
- the deduplicated exchange (`MoEConfig.dedup_dispatch`) with batch_split=2: each forward gmm is
  fed by its own chunk's dispatch only, and where the exchange is async another chunk's forward
  gmms run under it.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from bench import hlo_schedule
from pallas_moe import schedule
from pallas_moe.config import MoEConfig

FIXTURE = pathlib.Path(__file__).parent.parent / "data" / "ep_step_v5e_split2_async.hlo.txt"


@pytest.fixture(scope="module")
def fixture_schedule():
  return hlo_schedule.parse_schedule(FIXTURE.read_text())


def test_fixture_async_exchanges_and_their_chunks(fixture_schedule):
  s = fixture_schedule
  assert s.entry == "main.75_spmd"
  ragged = [a for a in s.async_collectives if a.kind == "ragged-all-to-all"]
  # fwd dispatch + combine and their two transposes, for each of the 2 chunks.
  assert len(ragged) == 8
  labels = sorted(
    (
      hlo_schedule.is_backward(a.op_name),
      hlo_schedule.exchange_of(a.op_name),
      hlo_schedule.chunk_of(a.op_name),
    )
    for a in ragged
  )
  assert labels == sorted(
    (bwd, ex, c) for bwd in (False, True) for ex in ("dispatch", "combine") for c in (0, 1)
  )
  for a in ragged:
    assert a.done.operands == (a.start.name,)
    assert a.start_index < a.done_index


def test_fixture_kernels_and_what_runs_under_each_exchange(fixture_schedule):
  s = fixture_schedule
  names = sorted(k.kernel for k in s.kernels)
  # fwd: wi and wo gmm per chunk; bwd: two dlhs gmms and two tgmms per chunk.
  assert names == ["pallas_moe_gmm_rowtile"] * 8 + ["pallas_moe_tgmm_rowtile"] * 4
  rows = {(r["where"], r["kind"]): r for r in hlo_schedule.summary(s)}
  fwd_dispatch_0 = rows[("fwd dispatch chunk 0", "ragged-all-to-all")]
  assert fwd_dispatch_0["async"]
  assert fwd_dispatch_0["kernels_under"] == ["pallas_moe_gmm_rowtile (fwd chunk 1)"] * 2
  pairs = hlo_schedule.cross_chunk_overlaps(s)
  assert {hlo_schedule.is_backward(a.op_name) for a, _ in pairs} == {False, True}
  # The one synchronous all-to-all XLA left (nothing to put under it).
  kinds = [c.kind for c in s.sync_collectives]
  assert kinds == ["all-reduce", "all-to-all", "all-reduce", "all-reduce"]


SYNTHETIC = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %k = f32[8]{0} custom-call(%p), custom_call_target="tpu_custom_call", metadata={op_name=\
"jit(f)/batch_split_1/pallas_moe_tgmm_rowtile/pallas_call"}
  ROOT %t = (s32[], f32[8]) tuple(%p, %k)
}

%ag (a: f32[8]) -> f32[64] {
  %a = f32[8]{0} parameter(0)
  ROOT %g = f32[64]{0} all-gather(%a), dimensions={0}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0:T(128)S(1)} parameter(0)
  %cs = (f32[8]{0}, f32[8]{0}, u32[]{:S(2)}) copy-start(%x)
  %as = ((f32[8]{0}), f32[64]{0}, s32[]) async-start(%x), calls=%ag, metadata={op_name=\
"jit(f)/batch_split_0/all_gather"}
  %w = (s32[], f32[8]) while(%x), condition=%cond, body=%body
  %cd = f32[8]{0} copy-done(%cs)
  %ad = f32[64]{0} async-done(%as), metadata={op_name="jit(f)/batch_split_0/all_gather"}
  %r = f32[8]{0} all-reduce(%cd), replica_groups={}, to_apply=%add
  ROOT %o = f32[8]{0} custom-call(%r), custom_call_target="tpu_custom_call"
}
"""


def test_synthetic_wrapped_collective_nested_kernel_and_sync():
  """async-start wrapping a collective counts; copies do not; a kernel inside a while body
  scheduled in the window is under it; an all-reduce without start/done is synchronous; a
  kernel without op_name is named by its instruction."""
  s = hlo_schedule.parse_schedule(SYNTHETIC)
  assert s.entry == "main"
  (a,) = s.async_collectives
  assert (a.kind, a.start.name, a.done.name) == ("all-gather", "as", "ad")
  assert [k.kernel for k in a.kernels_under] == ["pallas_moe_tgmm_rowtile"]
  assert [
    (p.start.name, k.name) for p, k in hlo_schedule.cross_chunk_overlaps(s, kinds=("all-gather",))
  ] == [("as", "k")]
  (r,) = s.sync_collectives
  assert (r.kind, r.instruction.name, r.computation) == ("all-reduce", "r", "main")
  assert sorted(k.kernel for k in s.kernels) == ["o", "pallas_moe_tgmm_rowtile"]


def test_no_entry_raises():
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo_schedule.parse_schedule("HloModule m\n")


# --- AOT: the compiled EP training step ------------------------------------------------------

GENERATIONS = ("v5e", "v6e")


# NOTE: the unsplit checks hold at a quarter of bench.ep_schedule's size (faster compiles).
TINY = dict(tokens_per_device=256, overrides=dict(d_model=256, expert_ffn_dim=256))


def _step(gen: str, *, batch_split: int, options, **kwargs):
  from bench.ep_schedule import compiled_schedule

  return compiled_schedule(
    topology=f"{gen}:2x4", batch_split=batch_split, compiler_options=options, **kwargs
  )


def _ragged(s: hlo_schedule.Schedule):
  return [a for a in s.async_collectives if a.kind == "ragged-all-to-all"], [
    c for c in s.sync_collectives if c.kind == "ragged-all-to-all"
  ]


# NOTE: from libtpu 0.0.50 the exchange is async in the default program (measured: 0.0.50.1,
# 0.0.52); 0.0.42.1 needs the flags.
ASYNC_DEFAULT = schedule.ragged_async_by_default()
ASYNC_PROGRAM = None if ASYNC_DEFAULT else schedule.ASYNC_COLLECTIVE_OPTIONS


def _check_tgmm_under_last_exchange(s: hlo_schedule.Schedule):
  asyncs, syncs = _ragged(s)
  assert len(asyncs) + len(syncs) == 4, hlo_schedule.summary(s)
  last = max(asyncs, key=lambda a: a.start_index)
  assert all(c.index < last.start_index for c in syncs), hlo_schedule.summary(s)
  assert (
    hlo_schedule.is_backward(last.op_name) and hlo_schedule.exchange_of(last.op_name) == "dispatch"
  )
  assert [k.kernel for k in last.kernels_under] == ["pallas_moe_tgmm_rowtile"] * 2
  return asyncs, syncs


@pytest.mark.aot
@pytest.mark.parametrize("gen", GENERATIONS)
def test_unsplit_step_exchanges(gen):
  """4 exchanges: fwd dispatch, combine; their transposes. Where they are async, the weight
  gradients (tgmm) run under the backward's last exchange (the dispatch's transpose, which
  returns dx while dW is computed). libtpu 0.0.42.1: all synchronous by default; with the async
  flags as above (XLA turns a start/done pair with nothing between back into a synchronous op:
  on v6e 2 of the 4 stay synchronous). From 0.0.50: all 4 async by default and the 4 small
  all-to-alls of the transposes synchronous; with the flags off all synchronous."""
  default = _step(gen, batch_split=1, options=None, **TINY)
  if ASYNC_DEFAULT:
    asyncs, syncs = _check_tgmm_under_last_exchange(default)
    assert (len(asyncs), len(syncs)) == (4, 0), hlo_schedule.summary(default)
    assert [a.kind for a in default.async_collectives] == ["ragged-all-to-all"] * 4
    assert [c.kind for c in default.sync_collectives].count("all-to-all") == 4
    off = _step(gen, batch_split=1, options=schedule.SYNC_COLLECTIVE_OPTIONS, **TINY)
    asyncs, syncs = _ragged(off)
    assert (len(asyncs), len(syncs)) == (0, 4), hlo_schedule.summary(off)
    assert not off.async_collectives, hlo_schedule.summary(off)
  else:
    asyncs, syncs = _ragged(default)
    assert (len(asyncs), len(syncs)) == (0, 4), hlo_schedule.summary(default)
    assert not default.async_collectives, hlo_schedule.summary(default)
    _check_tgmm_under_last_exchange(
      _step(gen, batch_split=1, options=schedule.ASYNC_COLLECTIVE_OPTIONS, **TINY)
    )


@pytest.mark.aot
@pytest.mark.parametrize("gen", GENERATIONS)
def test_split_step_overlaps_chunks(gen):
  """batch_split=2 where the exchange is async (libtpu >= 0.0.50: the default program; 0.0.42.1:
  the async flags): in the forward and in the backward, one chunk's exchange is in flight while
  the other chunk's gmm runs."""
  s = _step(gen, batch_split=2, options=ASYNC_PROGRAM)
  asyncs, syncs = _ragged(s)
  assert len(asyncs) + len(syncs) == 8
  pairs = hlo_schedule.cross_chunk_overlaps(s)
  fwd = [(a, k) for a, k in pairs if not hlo_schedule.is_backward(a.op_name)]
  bwd = [(a, k) for a, k in pairs if hlo_schedule.is_backward(a.op_name)]
  assert fwd, hlo_schedule.summary(s)
  assert bwd, hlo_schedule.summary(s)
  for _, k in fwd:
    assert not hlo_schedule.is_backward(k.op_name)  # the forward's gmms, not the backward's


def _exchange_spans(s: hlo_schedule.Schedule) -> dict[tuple[str, str, int], tuple[int, int]]:
  """(pass, exchange, chunk) -> (start, done) positions of each expert exchange in the entry."""
  spans = {}
  for a in s.async_collectives:
    if a.kind == "ragged-all-to-all" and a.computation == s.entry:
      spans[_where(a.op_name)] = (a.start_index, a.done_index)
  for c in s.sync_collectives:
    if c.kind == "ragged-all-to-all" and c.computation == s.entry:
      spans[_where(c.op_name)] = (c.index, c.index)
  return spans


def _where(op_name: str) -> tuple[str, str, int]:
  return (
    "bwd" if hlo_schedule.is_backward(op_name) else "fwd",
    hlo_schedule.exchange_of(op_name),
    hlo_schedule.chunk_of(op_name),
  )


@pytest.mark.aot
@pytest.mark.parametrize("gen, dedup", [("v5e", False), ("v6e", True)])
def test_split_step_keeps_two_chunks_in_flight(gen, dedup):
  """batch_split=4: chunk c's dispatch starts after chunk c-2's combine is done, and in the
  backward chunk c-2's combine gradient starts after chunk c's dispatch gradient is done (the
  block's barriers; without them XLA starts every chunk's combine gradient at once and keeps
  all four chunks' backward buffers live). Chunks still overlap: some chunk's gmm runs under
  another's exchange, in both passes."""
  s = _step(gen, batch_split=4, options=ASYNC_PROGRAM, overrides=dict(dedup_dispatch=dedup))
  spans = _exchange_spans(s)
  assert len(spans) == 16, hlo_schedule.summary(s)
  for c in (2, 3):
    assert spans["fwd", "dispatch", c][0] > spans["fwd", "combine", c - 2][1], hlo_schedule.summary(
      s
    )
    assert spans["bwd", "combine", c - 2][0] > spans["bwd", "dispatch", c][1], hlo_schedule.summary(
      s
    )
  pairs = hlo_schedule.cross_chunk_overlaps(s)
  assert any(not hlo_schedule.is_backward(a.op_name) for a, _ in pairs), hlo_schedule.summary(s)
  assert any(hlo_schedule.is_backward(a.op_name) for a, _ in pairs), hlo_schedule.summary(s)


@pytest.mark.aot
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_dedup_split_step_compiles_for_tpu_and_overlaps_chunks(gen):
  """The native path (TPU ragged-all-to-all, Pallas gmm) of a deduplicated training step
  compiles ahead of time for a 2x4 topology, EP 8, and what its schedule overlaps.

  Each chunk's exchange is one native ragged-all-to-all each way (4 per chunk with the
  backward's transposes), never decomposed. Where the exchange is async (libtpu >= 0.0.50's
  default) each chunk's forward gmms run under another chunk's exchange: the block keeps XLA
  from fusing the chunks' receiver passes into one (which made both chunks wait for both
  dispatches). The weight gradients run under the backward's last dispatch on v5e, after every
  exchange on v6e. libtpu 0.0.42.1's default program: every exchange synchronous."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from bench.moe_memory import aot_step_compiled

  config = MoEConfig(
    num_experts=64,
    top_k=6,
    d_model=256,
    expert_ffn_dim=256,
    dtype="bfloat16",
    weight_dtype="bfloat16",
    buffer_factor=2.0,
    dedup_dispatch=True,
    batch_split=2,
  )
  compiled = aot_step_compiled(
    topology=f"{gen}:2x4", data=1, ep=8, tokens_per_device=128, config=config
  )
  text = compiled.as_text()
  assert compiled.memory_analysis().temp_size_in_bytes > 0
  s = hlo_schedule.parse_schedule(text)
  ragged = [a for a in s.async_collectives if a.kind == "ragged-all-to-all"]
  ragged_sync = [c for c in s.sync_collectives if c.kind == "ragged-all-to-all"]
  where = sorted(
    (
      hlo_schedule.is_backward(c.op_name),
      hlo_schedule.exchange_of(c.op_name),
      hlo_schedule.chunk_of(c.op_name),
    )
    for c in ragged + ragged_sync
  )
  assert where == sorted(
    (b, ex, c) for b in (False, True) for ex in ("dispatch", "combine") for c in (0, 1)
  ), hlo_schedule.summary(s)
  assert not {"collective-permute", "all-gather"} & {a.kind for a in s.async_collectives}
  # NOTE: a forward gmm is fed by its own chunk's dispatch only (no fusion across chunks).
  entry = {i.name: i for i in s.computations[s.entry]}
  gmms = [k for k in s.kernels if k.name in entry and k.kernel == "pallas_moe_gmm_rowtile"]
  fwd_gmms = [k for k in gmms if not hlo_schedule.is_backward(k.op_name)]
  assert len(fwd_gmms) == 4
  for k in fwd_gmms:
    seen, todo = set(), [k.name]
    while todo:
      n = todo.pop()
      if n not in seen and n in entry:
        seen.add(n)
        todo.extend(entry[n].operands)
    fed = {hlo_schedule.chunk_of(entry[n].op_name) for n in seen if "ragged" in entry[n].opcode}
    assert fed == {hlo_schedule.chunk_of(k.op_name)}, (k.name, fed)
  if not schedule.ragged_async_by_default():
    assert not ragged, hlo_schedule.summary(s)
    return
  pairs = hlo_schedule.cross_chunk_overlaps(s)
  assert [k for a, k in pairs if not hlo_schedule.is_backward(k.op_name)], hlo_schedule.summary(s)
  last = max(ragged, key=lambda a: a.start_index)
  assert (
    hlo_schedule.is_backward(last.op_name) and hlo_schedule.exchange_of(last.op_name) == "dispatch"
  )
  tgmm_under = [k for k in last.kernels_under if k.kernel == "pallas_moe_tgmm_rowtile"]
  assert len(tgmm_under) == (4 if gen == "v5e" else 0), hlo_schedule.summary(s)
