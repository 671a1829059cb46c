"""`bench.fused_vliw`: a step's bundles split into products and dequantization loops, read from
a hand-written schedule in the compiled dumps' format."""

from __future__ import annotations

import pytest

from bench import decode, fused_vliw, llo
from pallas_moe.generations import get_generation, tensorcore_rates
from tests.bench.test_llo import _Schedule


def test_step_counts_split_products_and_dequantization():
  """The largest loop is the step (dynamic: counted once per step); its inner loop without MXU
  work is the dequantization (its static trip count times its bundles), every other bundle of
  the step its products, the dots' MXU cycles counted from their vmatmuls."""
  sched = _Schedule()
  lines, add, delay = sched.lines, sched.add, sched.delay

  add("smov")
  add("sld", label="LB", depth=1, tail="Start region 1")  # the step loop (dynamic)
  add("dma.hbm_to_vmem", depth=1)
  add("vld", label="LB", depth=2, tail="Start region 2")  # dequantization, 7 trips
  add("vunpack.c.0.if8.f32 ;; vmul.f32", depth=2)
  add("vpack.c.f32.bf16 ;; vst", depth=2)
  add("scmp.ge.s32.totalorder %s, 7 /* loop exit test */", depth=2)
  add("sbr.rel target = $region2", depth=2)
  delay(2)
  add("vmatpush.bf16.msra.mxu0", label="PF", depth=1, tail="Start region 3")
  add("vmatmul.mubr.bf16.gmra.mxu0", depth=1)
  add("vpop.f32.mrf.mxu0 ;; vadd.f32", depth=1)
  add("sbr.rel target = $region1", depth=1)  # back edge of the step loop
  delay(1)
  add("shalt.err")
  counts = fused_vliw.step_counts("\n".join(lines), "v5e")
  # NOTE: the inner loop spans its 5 bundles and its back edge's 4 delay slots.
  assert counts.dequant == 7 * 9
  step_bundles = len(lines) - 2 - 9  # all but the first and last bundles and the inner loop
  assert counts.products == step_bundles
  assert counts.mxu_cycles > 0


@pytest.mark.aot
def test_tpu7x_fp8_step_dequantizes_inside_its_products(tmp_path):
  """Compiled for tpu7x (real libtpu), a step of DeepSeek-V3's fp8 block-scaled expert at 64
  tokens has no dequantization loop: each block is dequantized on its way to the MXU, and the
  step issues fewer bundles per 1,024 values (0.76 with libtpu 0.0.50.1) than its products and
  a dequantization loop of their own did (1.18). `bench.decode.ISSUE_BUNDLES` charges what the
  compiled step issues."""
  d = fused_vliw.compile_dump(chip="tpu7x", weights="fp8-block", dump_dir=str(tmp_path), tokens=64)
  with open(llo.find_dump(d, fused_vliw.KERNEL)) as f:
    counts = fused_vliw.step_counts(f.read(), "tpu7x")
  rec = fused_vliw.record("tpu7x", "fp8-block", counts, 64)
  assert rec["upcast"] == "astype"
  assert counts.dequant == 0 and counts.mxu_cycles > 0
  assert rec["products_bundles_per_1024"] < 1.0
  base, per_row = decode.ISSUE_BUNDLES[("tpu7x", "astype")]
  assert abs(base + per_row * rec["window"] - rec["products_bundles_per_1024"]) < 0.1


def test_every_plan_the_grid_runs_has_its_compiled_step():
  """`bench.decode` stretches a step to its compiled issue (`issue_scale`) from
  `python -m bench.fused_vliw --points`' records: every fused plan `moe_decode` runs in the grid
  has one, so a plan changed without recompiling fails here instead of silently dropping back to
  the model's figure."""
  keys = decode.compiled_steps()
  points = fused_vliw.grid_points()
  assert points
  missing = [
    p for p in points if decode.plan_key(fused_vliw.point_plan(**p)[1], p["chip"]) not in keys
  ]
  assert not missing, f"rerun python -m bench.fused_vliw --points for {missing}"


def test_compiled_issue_takes_the_longer_of_model_and_compiled(monkeypatch):
  """Where a plan's compiled step issues less than the model's, the model's figure stays;
  where its unconditional bundles issue longer, every step's compute is stretched to them; its
  predicated bundles past the model's gathers and adds back are charged once per visited
  expert, at its first and last steps."""
  point = dict(model="qwen3-30b-a3b", weights="bf16", chip="v5e", ep=8, tokens=32)
  layout, plan = fused_vliw.point_plan(**point)
  assert layout == "gathered"
  gen = get_generation("v5e")
  model = decode.model_step_s(plan, gen) * 1e6
  gathers = sum(decode.gather_macs(plan, gen)) * 2 / tensorcore_rates(gen)[0] * 1e6
  products = model - gathers
  sizes = decode.route(experts=128, top_k=8, ep=8, tokens=32)
  local = sizes[decode.busiest_device(sizes)]

  def modeled(issue_us: float, predicated_us: float) -> dict:
    got = {decode.plan_key(plan, gen): (issue_us, predicated_us, 0.0)}
    monkeypatch.setattr(decode, "compiled_steps", lambda: got)
    return decode._stream(plan, local, gen, visit_all=False)

  base = modeled(0.5 * model, 0.0)
  assert (base["issue_scale"], base["issue_extra_s"]) == (1.0, 0.0)
  whole = modeled(2.0 * model, 0.0)
  assert whole["issue_scale"] == pytest.approx((2.0 * model - gathers) / products)
  assert whole["issue_extra_s"] == pytest.approx(0.0, abs=1e-12)
  assert whole["mxu_s"] > base["mxu_s"] and whole["stream_s"] > base["stream_s"]
  # NOTE: 3 µs of the step predicated, past the model's gathers: charged per visited expert.
  split = modeled(model + 3.0, gathers + 3.0)
  assert split["issue_scale"] == pytest.approx(1.0)
  windows = decode.expert_windows(plan, local)[local > 0]
  assert split["issue_extra_s"] == pytest.approx(windows.sum() * 3.0e-6)
  assert split["stream_s"] > base["stream_s"]


def test_streamed_visit_work_is_charged_per_granule(monkeypatch):
  """A streamed visit's own work in dynamic loops (clearing its sums, casting its rows out) is
  charged once per granule the visit reaches; the rest of its predicated work once."""
  point = dict(model="deepseek-v3", weights="bf16", chip="v6e", ep=8, tokens=128)
  layout, plan = fused_vliw.point_plan(**point)
  assert layout == "streamed"
  gen = get_generation("v6e")
  model = decode.model_step_s(plan, gen) * 1e6
  sizes = decode.route(experts=256, top_k=8, ep=8, tokens=128)
  local = sizes[decode.busiest_device(sizes)]
  _, lo, hi, _, _ = decode.stream_visits(plan, local)
  granules = (hi - lo // plan.align * plan.align) // plan.align + 1

  def extra_us(fixed: float, per_granule: float) -> float:
    got = {
      decode.plan_key(plan, gen): (model + fixed + per_granule, fixed + per_granule, per_granule)
    }
    monkeypatch.setattr(decode, "compiled_steps", lambda: got)
    return decode.model_block_stream(plan, local, "v6e")["issue_extra_us"]

  assert extra_us(0.0, 0.0) == 0.0
  assert extra_us(2.0, 0.0) == pytest.approx(2.0 * len(lo))
  assert extra_us(2.0, 0.5) == pytest.approx(2.0 * len(lo) + 0.5 * granules.sum())
  assert granules.sum() > len(lo)  # visits reach more than one granule here


@pytest.mark.aot
def test_compiled_point_matches_its_record(tmp_path):
  """The committed record of a grid point's compiled step is what its plan compiles to now
  (real libtpu): the gathered layout at Qwen3-30B-A3B dims on v5e, EP 8, 32 tokens."""
  point = dict(model="qwen3-30b-a3b", weights="bf16", chip="v5e", ep=8, tokens=32)
  (rec,) = fused_vliw.run_points([point], work=str(tmp_path), jobs=1)
  issue, predicated, loops = decode.compiled_steps()[rec["plan_key"]]
  assert issue == pytest.approx(rec["issue_us"], rel=0.02)
  assert predicated == pytest.approx(rec["predicated_us"], rel=0.05, abs=0.05)
  assert loops == pytest.approx(rec["predicated_loops_us"], rel=0.05, abs=0.05)
  assert rec["layout"] == "gathered" and rec["mxu_busy_us"] > 0
