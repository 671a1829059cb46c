"""`unowned_rows="undefined"` as `bench.costmodel.analyze` reads the traced program: no zero-fill
kernel is launched, and the visit-schedule gmm spends no grid step on the m-tiles holding no
local row (a receive buffer's slack). tests/kernels/test_ops.py checks the values."""

from __future__ import annotations

import jax.numpy as jnp
from kernel_testing import random_array

import pallas_moe
from bench import costmodel as cm


def test_undefined_rows_launch_no_zero_fill():
  m, k, n = 96, 32, 128
  sizes = jnp.array([10, 0, 7, 5], jnp.int32)  # 22 rows of 96, the shard holds groups 1..2
  x = random_array(0, (m, k), jnp.float32)
  w = random_array(1, (2, k, n), jnp.float32)
  tiles = pallas_moe.Tiling(fwd=(16, k, n), dlhs=(16, n, k), drhs=(128, k, n))

  def run(unowned):
    return lambda x, w: pallas_moe.gmm(
      x, w, sizes, tiling=tiles, group_offset=1, interpret=True, unowned_rows=unowned
    )

  names = [s.name for s in cm.analyze(run("undefined"), x, w)]
  assert not any("zero_fill" in name for name in names) and len(names) == 1
  assert any("zero_fill" in s.name for s in cm.analyze(run("zero"), x, w))


def test_visit_kernel_with_undefined_rows_skips_the_slack_tiles():
  m, k, n = 128, 256, 128
  sizes = jnp.array([10, 0, 7, 5], jnp.int32)  # 22 rows of 128: six 16-row tiles hold none
  x = random_array(0, (m, k), jnp.float32)
  w = random_array(1, (4, k, n), jnp.float32)
  tiles = pallas_moe.Tiling(fwd=(16, 128, n), dlhs=(16, n, 128), drhs=(128, k, n))

  def run(unowned):
    return lambda x: pallas_moe.gmm(
      x, w, sizes, jnp.float32, tiles, interpret=False, unowned_rows=unowned
    )

  steps = {u: sum(s.steps for s in cm.analyze(run(u), x)) for u in ("zero", "undefined")}
  # NOTE: 2 k-steps per visit: a visit per (group, tile) of the 2 tiles holding rows (groups 0
  # and 3 in one each, group 2 in both), plus a fill visit per other tile (6) for "zero".
  assert steps == {"zero": 2 * 10, "undefined": 2 * 4}
