"""bench.llo: the compiled kernel's VLIW schedule.

The parser tests read `tests/data/gmm_rowtile_v5e_final_bundles.txt`: the final bundles of our
row-tile gmm (`pallas_moe-maxtext` tiles, m = 2048, k = n = 256, 4 groups: grid (1, 4), tm = 512,
128-row sub-blocks) AOT-compiled for v5e, cut down by `llo.trim_dump`. The `aot` tests compile
a case end to end (on v5e, and on v6e where gmm pushes 128-row sub-blocks too).
"""

from __future__ import annotations

import os

import pytest

from bench import costmodel, impls, llo, shapes
from bench.shapes import Shape
from pallas_moe import tiling

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
FIXTURE = os.path.join(DATA, "gmm_rowtile_v5e_final_bundles.txt")
TINY = Shape(name="tiny", tokens=1024, top_k=2, num_groups=4, k=256, n=256)


@pytest.fixture(scope="module")
def bundles():
  with open(FIXTURE) as f:
    return llo.parse_bundles(f.read())


def _shape(node):
  return (node.kind, node.exit_bound, [_shape(c) for c in node.children])


def test_parse_fixture(bundles):
  assert len(bundles) == 452
  assert [b.addr for b in bundles] == list(range(452))
  assert sum(b.label == "LB" for b in bundles) == 3
  assert [b.exit_bound for b in bundles if b.exit_bound is not None] == [6]
  # NOTE: 4 MXUs on v5e, each streaming 8 vmatmuls of 16 bf16 rows per sub-block.
  ops = [op for b in bundles for op in b.ops if op.startswith("vmatmul")]
  assert len(ops) == 32
  assert {op.rsplit(".", 1)[1] for op in ops} == {"mxu0", "mxu1", "mxu2", "mxu3"}


def test_loop_tree_fixture(bundles):
  root = llo.loop_tree(bundles)
  # grid loop (4 steps + 2 pipeline iterations) > kernel body > group loop > group's region >
  # sub-block loop.
  sub = ("loop", None, [])
  assert _shape(root) == (
    "root",
    None,
    [("loop", 6, [("cond", None, [("loop", None, [("cond", None, [sub])])])])],
  )
  assert sum(n.own_bundles for n in root.walk()) == len(bundles)
  inner = [n for n in root.walk() if n.own_matmuls]
  assert len(inner) == 1
  assert inner[0].own_bundles == 188
  assert inner[0].own_matmuls == {0: 8, 1: 8, 2: 8, 3: 8}
  assert inner[0].own_mxu_cycles(tiling.get_generation("v5e")) == {0: 128, 1: 128, 2: 128, 3: 128}
  assert inner[0].own_counts["mxu_matmul"] == 32


def test_report_combines_tree_with_trip_counts():
  with open(FIXTURE) as f:
    text = f.read()
  counts = llo.KernelCounts(steps=4, loop_levels=(7, 19), per_group=4)
  rep = llo.report(kernel="pallas_moe_gmm_rowtile", text=text, counts=counts, generation="v5e")
  root = llo.loop_tree(llo.parse_bundles(text))
  own = [n.own_bundles for n in root.walk()]
  # root once, grid loop 6x, body 4x (steps), group loop and region 7x, sub-block loop 19x.
  assert rep.issue_cycles == sum(b * e for b, e in zip(own, (1, 6, 4, 7, 7, 19), strict=True))
  assert rep.mxu_cycles == 19 * 128
  assert rep.mxu_loop_bundles == 188 and rep.mxu_loop_mxu_cycles == 128
  # NOTE: only the sub-block loop has MXU work, and it is issue-bound here (188 > 128 cycles).
  assert rep.bound_cycles == rep.issue_cycles
  assert rep.ratio == pytest.approx(rep.issue_cycles / (19 * 128))
  assert rep.mxu_us == pytest.approx(19 * 128 / llo.implied_clock_hz("v5e") * 1e6)
  assert [k for k, _ in rep.top_non_mxu()] == ["vpu", "load"]
  with pytest.raises(ValueError, match="dynamic loops"):
    llo.report(
      kernel="x", text=text, counts=llo.KernelCounts(steps=4, loop_levels=(7,)), generation="v5e"
    )


def test_report_at_two_rows_per_cycle():
  """The same peak at half the clock: MXU µs unchanged, issue µs doubled, bound re-taken."""
  with open(FIXTURE) as f:
    text = f.read()
  counts = llo.KernelCounts(steps=4, loop_levels=(7, 19), per_group=4)
  one = llo.report(kernel="pallas_moe_gmm_rowtile", text=text, counts=counts, generation="v5e")
  two = llo.report(
    kernel="pallas_moe_gmm_rowtile",
    text=text,
    counts=counts,
    generation="v5e",
    mxu_rows_per_cycle=2,
  )
  assert two.clock_hz == pytest.approx(one.clock_hz / 2)
  assert two.issue_cycles == one.issue_cycles and two.mxu_cycles == one.mxu_cycles / 2
  assert two.mxu_us == pytest.approx(one.mxu_us) and two.issue_us == pytest.approx(2 * one.issue_us)
  assert two.mxu_loop_mxu_cycles == 64 and two.bound_cycles == two.issue_cycles
  with pytest.raises(ValueError, match="mxu_rows_per_cycle"):
    llo.report(kernel="x", text=text, counts=counts, generation="v5e", mxu_rows_per_cycle=0)


def test_build_case_at_given_tiles():
  gs = [512, 0, 1024, 512]
  case, _ = llo._build_case(
    impl="megablox-maxtext",
    op="dlhs",
    shape=TINY,
    tokens=None,
    generation="v6e",
    tiling=(256, 128, 256),
    group_sizes=gs,
  )
  assert tuple(case.tiling) == (256, 128, 256)
  assert list(case.args[-1]) == gs
  with pytest.raises(ValueError, match="tiling"):
    llo._build_case(
      impl="pallas_moe", op="fwd", shape=TINY, tokens=None, generation="v6e", tiling=(256, 256, 256)
    )


def _line(addr, body, *, label="", depth=0, tail=""):
  return f"{addr:#x} {label}: {'>' * depth} {{ {body} }}" + (f" /* {tail} */" if tail else "")


class _Schedule:
  """A hand-written final_bundles dump: `add` appends one bundle at the next address, `delay`
  a branch's four delay slots (as on v5e and v6e); `lines` holds them."""

  def __init__(self):
    self.lines = []

  def add(self, body, **kw):
    self.lines.append(_line(len(self.lines), body, **kw))

  def delay(self, depth):
    for _ in range(4):
      self.add("", depth=depth)


def test_branches_guards_and_per_group_regions():
  """A hand-written schedule: a grid loop, a dynamic loop with a zero-trip guard, a
  once-per-group region, and two sibling regions holding dots (the branches of a lax.cond)."""
  sched = _Schedule()
  lines, add, delay = sched.lines, sched.add, sched.delay

  add("smov")
  add("sadd.s32", label="LB", depth=1, tail="Start region 1")  # grid loop
  add("sbr.rel target = $region9", depth=1)  # guard of the group loop: skips exactly it
  delay(1)
  add("sld", label="LB", depth=2, tail="Start region 2")  # group loop (dynamic)
  add("sbr.rel target = $region3", depth=2)  # once-per-group region
  delay(2)
  for _ in range(llo.PER_GROUP_MIN_BUNDLES):
    add("vxpose.xlu0.b32.cont ;; vld ;; vst", depth=2)
  add("sadd.s32", label="PF", depth=2, tail="Start region 3")
  add("sbr.rel target = $region4", depth=2)  # branch 1 of a cond
  delay(2)
  add("vmatmul.mubr.bf16.gmra.mxu0 ;; vadd.f32", depth=2)
  add("sbr.rel target = $region5", label="PF", depth=2, tail="Start region 4")  # branch 2
  delay(2)
  add("vmatmul.mubr.bf16.gmra.mxu0 ;; vmatmul.mubr.bf16.gmra.mxu1", depth=2)
  add("scmp.ge.s32.totalorder", label="PF", depth=2, tail="Start region 5")
  add("sbr.rel target = $region2", depth=1)  # back edge of the group loop
  delay(2)
  add(
    "scmp.ge.s32.totalorder %s, 5 /* loop exit test */", label="PF", depth=1, tail="Start region 9"
  )
  add("sbr.rel target = $region1", depth=1)  # back edge of the grid loop
  delay(1)
  add("shalt.err")
  text = "\n".join(lines)
  root = llo.loop_tree(llo.parse_bundles(text))
  grid = root.children[0]
  assert grid.kind == "loop" and grid.exit_bound == 5
  (group,) = grid.children  # the guard was dropped
  assert group.kind == "loop" and group.exit_bound is None
  assert [c.kind for c in group.children] == ["cond"] * 3
  counts = llo.KernelCounts(steps=3, loop_levels=(10,), per_group=4)
  execs = llo.trip_counts(root, counts)
  prep, br1, br2 = group.children
  assert execs[id(grid)] == 5 and execs[id(group)] == 10
  assert execs[id(prep)] == 4  # once per group
  assert execs[id(br1)] == execs[id(br2)] == 5  # one branch of the two runs
  assert prep.own_counts["xlu"] == llo.PER_GROUP_MIN_BUNDLES
  assert br2.own_matmuls == {0: 1, 1: 1}


@pytest.mark.parametrize(
  "op, cls",
  [
    ("vmatpush.bf16.msra.mxu1", "mxu_push"),
    ("vmatprep.mubr.bf16.mxu0", "mxu_push"),
    ("vmatmul.mubr.bf16.gmra.mxu0", "mxu_matmul"),
    ("vpop.f32.mrf.mxu2", "mxu_pop"),
    ("vpop.trf.xlu0", "xlu"),
    ("vxpose.xlu1.c.b16.cont", "xlu"),
    ("vpop.sfrf", "vpu"),
    ("vadd.f32", "vpu"),
    ("vsel", "vpu"),
    ("vld", "load"),
    ("vst", "store"),
    ("dma.hbm_to_vmem", "dma"),
    ("vsyncadd", "dma"),
    ("sadd.s32", "scalar"),
  ],
)
def test_classify(op, cls):
  assert llo.classify(op) == cls


def test_implied_clock():
  # NOTE: v5e's and v5p's published clocks; v6e's and tpu7x's are what their peaks imply with
  # the two MXUs per core the dumps show.
  assert llo.implied_clock_hz("v5e") == pytest.approx(1.50e9, rel=0.01)
  assert llo.implied_clock_hz("v5p") == pytest.approx(1.75e9, rel=0.01)
  assert llo.implied_clock_hz("v6e") == pytest.approx(3.50e9, rel=0.01)
  v5e, tpu7x = tiling.get_generation("v5e"), tiling.get_generation("tpu7x")
  assert llo.matmul_kind("vmatmul.mubr.bf16.gmra.mrb[4].mxu1") == "bf16"
  assert llo.matmul_rows("bf16", v5e) == 16 and llo.matmul_rows("bf16", tpu7x) == 8
  # NOTE: an int8 vmatmul streams 32 rows at twice the bf16 rate on v5e / v6e: 16 cycles.
  assert llo.matmul_kind("vmatmul.s8.vlgmr.msra.gmra.mxu2") == "int8"
  assert llo.matmul_rows("int8", v5e) == 32
  assert llo.cycles_per_row("int8", v5e) == pytest.approx(0.5, rel=0.01)
  assert llo.cycles_per_row("fp8", v5e) == 1.0


def test_cost_with_compiled_schedule_adds_the_excess():
  case = impls.IMPLS["pallas_moe-maxtext"].build(
    op="fwd",
    shape=TINY,
    group_sizes=shapes.group_sizes(TINY),
    generation=tiling.get_generation("v5e"),
  )
  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  base = costmodel.cost(scheds, generation="v5e")
  # NOTE: two calls: the row-tile gmm and its zero fill of the unvisited rows.
  assert [s.name.split("@")[0] for s in scheds] == [
    "pallas_moe_zero_fill",
    "pallas_moe_gmm_rowtile",
  ]
  same = costmodel.cost_with_compiled_schedule(scheds, generation="v5e", excess_us=[0.0, 0.0])
  assert same.modeled_us == base.modeled_us
  assert costmodel.compiled_excess_us(bound_us=3.0, mxu_us=2.0) == 1.0
  assert costmodel.compiled_excess_us(bound_us=1.0, mxu_us=2.0) == 0.0
  big = costmodel.cost_with_compiled_schedule(scheds, generation="v5e", excess_us=[0.0, 1e3])
  fill, call = big.calls
  assert fill.compute_excess_us == 0.0
  # NOTE: an excess far above the DMA time makes every step compute-bound: MXU + excess (plus
  # the overhead and the exposed DMAs: the first weight load and lhs rows, the last write).
  assert call.compute_excess_us == 1e3
  stall_us = scheds[1].step_exposed_bytes.sum() / tiling.get_generation("v5e").hbm_bytes_per_s * 1e6
  assert big.modeled_us == pytest.approx(
    fill.modeled_us + call.mxu_us + 1e3 + call.overhead_us + stall_us, rel=1e-9
  )
  assert call.mxu_us == base.calls[1].mxu_us


@pytest.mark.aot
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_analyze_case_end_to_end(tmp_path, chip):
  (rep,) = llo.analyze_case(
    impl="pallas_moe-maxtext", op="fwd", shape=TINY, generation=chip, cache_dir=str(tmp_path)
  )
  assert rep.kernel == "pallas_moe_gmm_rowtile" and rep.steps == 4
  # NOTE: the compiled program's vmatmul rows x trip counts are the analytic model's MXU work;
  # on v6e (256-wide MXU, tn = 256) gmm pushes 128-row sub-blocks, and the model must count
  # the same rows as the kernel multiplies.
  assert rep.mxu_us == pytest.approx(rep.model_mxu_us, rel=1e-6)
  assert rep.mxu_loop_bundles > 0 and rep.issue_cycles > rep.mxu_loop_bundles
  gen = tiling.get_generation(chip)
  assert tiling.pass_granule(gen, kind="gmm", tn=TINY.n) == 128
  # NOTE: one sub-block iteration: 128 rows through k x n / mxu^2 weight tiles, over the MXUs.
  tiles = -(-TINY.k // gen.mxu_size) * -(-TINY.n // gen.mxu_size)
  assert rep.mxu_loop_mxu_cycles == 128 * tiles / llo._num_mxus(gen)


def test_tgmm_loops_and_regions_get_their_own_counts():
  """The row-tile tgmm's two sub-block loops (single sub-blocks, then runs with twice the
  vmatmuls) get their own totals, its first-write region (vmatmuls) the group starts, its
  zeroing region (stores only) the empty groups, its write-out (loads) every group."""
  lines, pending = [], []

  def add(body, *, label="", depth=1, starts=()):
    # NOTE: a region starts at the first bundle after the code its branch skips.
    tail = " :: ".join(f"Start region {r}" for r in (*pending, *starts))
    pending.clear()
    lines.append(_line(len(lines), body, label=label, depth=depth, tail=tail))

  def delay(depth):
    for _ in range(4):
      add("", depth=depth)

  def region(r, body):
    add(f"sbr.rel target = $region{r}")
    delay(1)
    for _ in range(llo.PER_GROUP_MIN_BUNDLES):
      add(body)
    pending.append(r)

  def loop(r, body):
    add(body, label="LB", depth=2, starts=(r,))
    add(f"sbr.rel target = $region{r}", depth=2)
    delay(2)

  add("sld", label="LB", starts=(1,))  # group loop (dynamic)
  region(2, "vst")  # zeroing (empty groups)
  region(3, "vmatmul.mubr.bf16.gmra.mxu0 ;; vst")  # a group's first sub-block, written
  loop(4, "vmatmul.mubr.bf16.gmra.mxu0 ;; vld")  # single sub-blocks
  add("sadd.s32")
  loop(5, "vmatmul.mubr.bf16.gmra.mxu0 ;; vmatmul.mubr.bf16.gmra.mxu1")  # interior runs
  add("sadd.s32")
  region(6, "vld ;; vst")  # write-out
  add("sadd.s32")
  add("sbr.rel target = $region1")  # back edge of the group loop
  delay(1)
  add("shalt.err", depth=0)
  root = llo.loop_tree(llo.parse_bundles("\n".join(lines)))
  counts = llo.KernelCounts(
    steps=1, loop_levels=(10, (7.0, 3.0)), per_group=4, group_starts=2, empty_groups=1
  )
  execs = llo.trip_counts(root, counts)
  (group,) = root.children
  assert execs[id(group)] == 10
  loops = {sum(c.own_matmuls.values()): execs[id(c)] for c in group.children if c.kind == "loop"}
  assert loops == {1: 7.0, 2: 3.0}
  regions = {}
  for c in group.children:
    if c.kind == "cond":
      kind = "first" if c.own_matmuls else ("write" if c.own_counts["load"] else "zero")
      regions[kind] = execs[id(c)]
  assert regions == {"zero": 1.0, "first": 2.0, "write": 4.0}


@pytest.mark.aot
def test_compiled_tensorcores_match_the_model(tmp_path):
  # NOTE: on v5p (megacore) Mosaic splits a grid whose leading "parallel" axes have more than
  # one step between the two TensorCores and runs any other kernel on one; the cost model's
  # `step_tensorcores` must agree with the compiled program. Our gmm with 2 n tiles splits; its
  # zero fill (one "arbitrary" step) does not.
  shape = Shape(name="tiny", tokens=1024, top_k=2, num_groups=4, k=256, n=2048)
  case = impls.IMPLS["pallas_moe-maxtext"].build(
    op="fwd",
    shape=shape,
    group_sizes=shapes.group_sizes(shape),
    generation=tiling.get_generation("v5p"),
  )
  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  modeled = {
    s.name.split("@")[0]: costmodel.step_tensorcores(
      grid=s.grid, dimension_semantics=s.dimension_semantics, tensorcores_per_device=2
    )[0]
    for s in scheds
  }
  d = llo.compile_dump(
    impl="pallas_moe-maxtext", op="fwd", shape=shape, generation="v5p", dump_dir=str(tmp_path)
  )
  compiled = {name: llo.compiled_tensorcores(d, name) for name in modeled}
  assert modeled == compiled == {"pallas_moe_zero_fill": 1, "pallas_moe_gmm_rowtile": 2}
