"""`bench.fused_vliw`: a step's bundles split into products and dequantization loops, read from
a hand-written schedule in the compiled dumps' format."""

from __future__ import annotations

import pytest

from bench import decode, fused_vliw, llo
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
