"""The compiled MaxText-shaped experts step makes no copy megablox's does not, on real Mosaic.

`bench.aot_step.expert_program` (MaxText's three gmm calls on an expert-parallel receive buffer
with slack, wi_0, wi_1 -> silu x linear -> wo, value_and_grad) AOT-compiled for v5e with
pallas_moe's MaxText adapter, at MaxText's tiles (the visit kernels) and at pallas_moe's own
(the row-tile kernels). Pinned: exactly megablox's nine Mosaic calls (three gmm, three lhs
gradients, three weight gradients: no zero-fill kernels) and no copy or transpose of a
buffer-sized array (the weight-gradient kernels read the forward's lhs as it is; no aliased
zero buffer is shared between calls). Small dims keep each compile to a few seconds.
"""

from __future__ import annotations

import pytest

from bench import aot_step

pytestmark = pytest.mark.aot

# pallas_moe's own tiles run the row-tile kernels; MaxText-style tiles of 256 (tk below k, tn not
# dividing 384) run the visit kernels. 4 experts per device over ep 4; buffer 256 tokens x top-2
# x 4 = 2048 rows.
DIMS = aot_step.Dims(emb=1024, mlp=384, num_experts=16, top_k=2, shared=0, tokens_per_device=256)
MT_TILES = (256, 256, 256)
MESH = dict(topology="v5e:2x2", ep=4, data=1)
STOCK_CALLS = 9


@pytest.mark.parametrize("variant", ["pm_mt_tiles", "pm_own_tiles"])
def test_experts_step_has_no_copies_and_megablox_calls(variant):
  rows = DIMS.buffer_rows(MESH["ep"])
  mesh = aot_step._mesh(MESH["topology"], ep=MESH["ep"], data=MESH["data"])
  step, args = aot_step.expert_program(variant, mesh=mesh, dims=DIMS, rows=rows, tiles=MT_TILES)
  compiled = aot_step._compile(step, args, mesh.devices.flat[0])
  rec = aot_step.analyze(compiled, rows=rows)
  kernels = rec["kernels"]
  if variant == "pm_mt_tiles":
    assert kernels.count("pallas_moe_tgmm") == 3, kernels  # the visit kernels
  else:
    assert "pallas_moe_tgmm_rowtile" in kernels and "pallas_moe_gmm_rowtile" in kernels, kernels
  assert rec["mosaic_calls"] == STOCK_CALLS, kernels
  assert rec["copies"] == []
  # NOTE: the cost estimates say the kernels' work: each of the nine has 2 * rows * k * n flops.
  k_n = DIMS.emb * DIMS.mlp
  assert rec["flops_kernels"] == 9 * 2 * rows * k_n


def test_big_copies_finds_a_transpose():
  """The detector itself: a transposed copy of a buffer-sized operand is listed."""
  import jax
  import jax.numpy as jnp

  mesh = aot_step._mesh(MESH["topology"], ep=MESH["ep"], data=MESH["data"])
  dev = mesh.devices.flat[0]
  x = jax.ShapeDtypeStruct(
    (2048, 256), jnp.bfloat16, sharding=jax.NamedSharding(jax.sharding.Mesh([dev], ("x",)), jax.P())
  )
  compiled = aot_step._compile(lambda x: (x.T * 2, x + 1), (x,), dev)
  assert aot_step.big_copies(compiled.as_text(), rows=2048)
