"""bench's quantized cases (`pallas_moe-int8`, `-fp8`, `-w8a8`) in the cost model: the weight and
activation bytes the kernels move, and the MXU rate each case is credited with."""

from __future__ import annotations

import numpy as np
import pytest

from bench import costmodel as cm
from bench.impls import IMPLS
from bench.shapes import Shape
from pallas_moe import quant, tiling


def _analyze(impl, op, shape, gs, gen):
  case = impl.build(op=op, shape=shape, group_sizes=gs, generation=gen)
  # NOTE: the last call is the kernel (a gmm's zero fill comes first; it writes nothing here,
  # where the group sizes fill m).
  *_, sched = cm.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  return sched


@pytest.mark.parametrize("op", ["fwd", "dlhs"])
def test_bench_int8_moves_fewer_weight_bytes(op):
  """The bench's pallas_moe-int8 case reads the weights at 1 byte/element plus f32 scales.

  Both passes run the row-tile kernel (weights and scales by manual DMA, once per non-empty
  group and n-tile), compared with the bf16 row-tile kernel.
  """
  shape = Shape(name="tiny", tokens=1024, top_k=1, num_groups=4, k=256, n=384)
  gs = np.array([300, 0, 500, 100], np.int32)
  v5e = tiling.get_generation("v5e")
  bf16 = _analyze(IMPLS["pallas_moe"], op, shape, gs, v5e)
  int8 = _analyze(IMPLS["pallas_moe-int8"], op, shape, gs, v5e)
  assert bf16.grid == int8.grid
  # Scales ride with each load of the 3 non-empty groups: fwd one f32 per output column (n in
  # all over the n-tiles); dlhs its whole contraction (n) once per n-tile.
  scale_bytes = shape.n * 4 * (1 if op == "fwd" else int8.grid[0])
  # NOTE: the manual DMAs also move the lhs rows and the output (the same bf16 bytes in both):
  # the difference is half the bf16 weights (each non-empty group's once) less the scales.
  weights = 3 * shape.k * shape.n * 2
  assert (
    int8.operand_bytes["manual"] == bf16.operand_bytes["manual"] - weights // 2 + 3 * scale_bytes
  )
  print(f"\n{op}: HBM bytes bf16 {bf16.hbm_bytes:,} int8 {int8.hbm_bytes:,}")


@pytest.mark.parametrize("gen_name", ["v5e", "tpu7x"])
def test_bench_quantized_impls_credit_the_narrow_peak_only_for_narrow_dots(gen_name):
  """fp8 weights move the int8 bytes; w8a8 also halves the activation bytes, and its fwd MXU time
  uses the int8 / fp8 peak only where the kernel's dot has 8-bit operands (table: int8 on v5e,
  fp8 on tpu7x); elsewhere the upcast dot runs at the bf16 peak."""
  from bench import costmodel as cm

  shape = Shape(name="tiny", tokens=1024, top_k=1, num_groups=4, k=256, n=384)
  gs = np.array([300, 0, 500, 100], np.int32)
  gen = tiling.get_generation(gen_name)

  def run(name):
    sched = _analyze(IMPLS[name], "fwd", shape, gs, gen)
    (call,) = cm.cost([sched], generation=gen).calls
    return sched, call

  bf16, bf16_cost = run("pallas_moe")  # the quantized forward runs the row-tile kernel too
  for dtype in ("int8", "fp8"):
    w, w_cost = run(f"pallas_moe-{dtype}")
    a, a_cost = run(f"pallas_moe-{dtype}-w8a8")
    # NOTE: a narrow w8a8 forward picks its own tiles (8-bit operands at the narrow rate).
    assert w.grid == bf16.grid and a.grid[0] == 1
    weights = 3 * shape.k * shape.n * 2
    assert (
      w.operand_bytes["manual"] == bf16.operand_bytes["manual"] - weights // 2 + 3 * shape.n * 4
    )
    # NOTE: the activations (lhs rows, fetched once: one n sweep) move at 1 byte per element,
    # their 900 rows rounded to the 32-row 8-bit DMA granule (bf16: 16).
    lhs = lambda itemsize, granule: -(-int(gs.sum()) // granule) * granule * shape.k * itemsize  # noqa: E731
    assert w.operand_bytes["manual"] - a.operand_bytes["manual"] == lhs(2, 16) - lhs(1, 32)
    assert w_cost.mxu_us == pytest.approx(bf16_cost.mxu_us)  # weights only: upcast, bf16 rate
    narrow_peak = gen.peak_int8_ops if dtype == "int8" else gen.peak_fp8_ops
    # NOTE: per padded MAC: w8a8's own tiles (and its 32-row pass alignment) push other rows.
    per_mac = lambda c: c.mxu_us / c.mxu_macs_padded  # noqa: E731
    if quant.narrow_dot_supported(dtype, gen):
      want = per_mac(bf16_cost) * gen.peak_bf16_flops / narrow_peak
      assert per_mac(a_cost) == pytest.approx(want)
    else:
      assert per_mac(a_cost) == pytest.approx(per_mac(bf16_cost))
