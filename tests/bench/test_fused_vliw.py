"""`bench.fused_vliw`: a step's bundles split into products and dequantization loops, read from
a hand-written schedule in the compiled dumps' format."""

from __future__ import annotations

from bench import fused_vliw
from tests.bench.test_llo import _line


def test_step_counts_split_products_and_dequantization():
  """The largest loop is the step (dynamic: counted once per step); its inner loop without MXU
  work is the dequantization (its static trip count times its bundles), every other bundle of
  the step its products, the dots' MXU cycles counted from their vmatmuls."""
  lines, a = [], 0

  def add(body, **kw):
    nonlocal a
    lines.append(_line(a, body, **kw))
    a += 1

  def delay(depth):
    for _ in range(4):
      add("", depth=depth)

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
