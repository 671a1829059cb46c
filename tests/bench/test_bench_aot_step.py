"""bench.aot_step: the compiled MaxText-shaped experts step makes no copy megablox's does not.

AOT (real Mosaic): `bench.aot_step.expert_program` (MaxText's three gmm calls on an
expert-parallel receive buffer with slack, wi_0, wi_1 -> silu x linear -> wo, value_and_grad)
AOT-compiled for v5e with pallas_moe's MaxText adapter, each call handed MaxText-style 9-int
tiles: honoured (`honour_tiling=True`, the visit kernels) and as the default switch runs them
(checked, not used: pallas_moe's own choice, the row-tile kernels). Pinned: exactly megablox's
nine Mosaic calls (three gmm, three lhs gradients, three weight gradients: no zero-fill kernels)
and no copy or transpose of a buffer-sized array (the weight-gradient kernels read the forward's
lhs as it is; no aliased zero buffer is shared between calls). Small dims keep each compile to a
few seconds.

Also: the bench's HLO readers (buffer-sized shapes, XLA's HBM <-> VMEM copies, the live bytes
at the peak of XLA's dumped live ranges) on hand-written lines.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench import aot_step

# The default switch ("pallas_moe") runs pallas_moe's own tiles, the row-tile kernels;
# MaxText-style tiles of 256 (tk below k, tn not dividing 384), honoured ("pm_mt_tiles"), run the
# visit kernels. 4 experts per device over ep 4; buffer 256 tokens x top-2 x 4 = 2048 rows.
DIMS = aot_step.Dims(emb=1024, mlp=384, num_experts=16, top_k=2, shared=0, tokens_per_device=256)
MT_TILES = (256, 256, 256)
MESH = dict(topology="v5e:2x2", ep=4, data=1)
STOCK_CALLS = 9


@pytest.mark.aot
@pytest.mark.parametrize("variant", ["pm_mt_tiles", "pallas_moe"])
def test_experts_step_has_no_copies_and_megablox_calls(variant, tmp_path):
  rows = DIMS.buffer_rows(MESH["ep"])
  mesh = aot_step._mesh(MESH["topology"], ep=MESH["ep"], data=MESH["data"])
  step, args = aot_step.expert_program(variant, mesh=mesh, dims=DIMS, rows=rows, tiles=MT_TILES)
  dump = str(tmp_path)
  compiled = aot_step._compile(step, args, mesh.devices.flat[0], {"xla_dump_to": dump})
  rec = aot_step.analyze(compiled, rows=rows, dump_dir=dump)
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
  # The live bytes at the peak, read from the dump: the arguments are live throughout.
  assert rec["live_peak"] is not None and rec["live_peak"] >= rec["args"], rec
  charge = 4 * rec["bytes_vmem_copies"] + 3 * rec["bytes_vmem_slices"]
  assert rec["bytes_xla_net"] == rec["bytes_xla"] - charge


@pytest.mark.aot
def test_big_copies_finds_a_transpose():
  """The detector itself: a transposed copy of a buffer-sized operand is listed."""
  mesh = aot_step._mesh(MESH["topology"], ep=MESH["ep"], data=MESH["data"])
  dev = mesh.devices.flat[0]
  x = jax.ShapeDtypeStruct(
    (2048, 256), jnp.bfloat16, sharding=jax.NamedSharding(jax.sharding.Mesh([dev], ("x",)), jax.P())
  )
  compiled = aot_step._compile(lambda x: (x.T * 2, x + 1), (x,), dev)
  assert aot_step.big_copies(compiled.as_text(), rows=2048)


def test_buffer_sized_and_prefetch_parsing():
  """The bench's HLO readers on hand-written lines: a buffer's rows split by a reshape count, a
  weight or a send buffer whose leading products pass the rows without equalling them does not;
  copy-start is (destination, source, context): a copy into memory space 1 is a prefetch, one
  out of it an eviction; an async slice into memory space 1 (dumped or `as_text()`'s sugared
  form) is a sliced prefetch, any other async-start (an exchange) is none."""
  rows = 98304
  assert aot_step._buffer_sized([12288, 8, 2, 1024], rows)
  assert aot_step._buffer_sized([768, 128], rows)
  assert aot_step._buffer_sized([1408, 98304], rows)
  assert not aot_step._buffer_sized([2048, 2816], rows)
  assert not aot_step._buffer_sized([3072, 8, 2, 1024], rows)
  text = "\n".join(
    [
      "  %copy-start.3 = (bf16[16,1408,2048]{2,1,0:T(8,128)(2,1)S(1)}, "
      "bf16[16,1408,2048]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w), backend_config={}",
      "  %copy-start.29 = (bf16[4096]{0:T(1024)(128)(2,1)}, bf16[4096]{0:T(1024)(128)(2,1)S(1)}, "
      "u32[]{:S(2)}) copy-start(%f), backend_config={}",
      "  %slice-start.12 = ((bf16[4096,2816]{1,0:T(8,128)(2,1)}), "
      "bf16[1024,2816]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) async-start(%fusion.201#0), "
      "calls=%async_computation.16, backend_config={}",
      # NOTE: `compiled.as_text()` prints the same async slice in its sugared form.
      "  %slice-start.1 = ((bf16[2048,2048]{1,0:T(8,128)(2,1)}), "
      "bf16[512,2048]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w.1), "
      "slice={[512:1024], [0:2048]}, backend_config={}",
      "  %ragged-all-to-all-start = ((bf16[24576,2,1024]{2,1,0}, bf16[196608,2,1024]{2,1,0}), "
      "bf16[196608,2,1024]{2,1,0}, u32[]{:S(2)}) async-start(%r, %e), calls=%a",
    ]
  )
  assert aot_step.vmem_copies(text) == [
    ("prefetch", "bf16[16,1408,2048]", 16 * 1408 * 2048 * 2),
    ("evict", "bf16[4096]", 4096 * 2),
    ("prefetch slice", "bf16[1024,2816]", 1024 * 2816 * 2),
    ("prefetch slice", "bf16[512,2048]", 512 * 2048 * 2),
  ]


def test_live_peak_reads_the_peak_block():
  """`live_peak` on a hand-written live-range dump: the running total of the values live at the
  peak instruction, not the lines around it."""
  text = "\n".join(
    [
      "HloLiveRange (max 29):",
      "  BufferLiveRange:",
      "    x.1{}:0-29",
      "  Live ranges at 27 (peak):",
      "    fusion.1{}: 16777216 bytes (cumulative: 16777216 bytes)",
      "    x.1{}: 16777216 bytes (cumulative: 33554432 bytes)",
      "    reduce{}: 4096 bytes (cumulative: 33558528 bytes)",
      "  Stack trace breakdown for peak usage: 33 558 528 bytes",
      "    main.1 (100.0%, total: 33 558 528 bytes, current: 0 bytes)",
    ]
  )
  assert aot_step.live_peak(text) == 33558528
  assert aot_step.live_peak("HloLiveRange (max 1):\n  BufferLiveRange:\n") is None


def test_scaled_stock_estimates_scales_only_megablox_bytes():
  """The sensitivity switch: megablox's `pl.CostEstimate` declares scale x the bytes (flops
  unchanged) inside the context and is restored after it; pallas_moe's variants refuse a scale."""
  import importlib

  from jax.experimental import pallas as pl

  upstream = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

  with aot_step.scaled_stock_estimates(1.5):
    est = upstream.pl.CostEstimate(flops=10, bytes_accessed=1000, transcendentals=0)
    assert (est.flops, est.bytes_accessed) == (10, 1500)
    assert pl.CostEstimate(flops=10, bytes_accessed=1000, transcendentals=0).bytes_accessed == 1000
  assert upstream.pl is pl
  with pytest.raises(ValueError, match="stock_bytes_scale"):
    aot_step.measure("pm_mt_tiles", topology="v5e:2x2", ep=4, data=1, stock_bytes_scale=1.1)


@pytest.mark.aot
def test_scaled_stock_estimates_reach_the_compiled_program():
  """Stock megablox's kernels compiled under a scale declare that much more in the compiled HLO's
  CostEstimates, with the same flops and Mosaic calls."""
  rows = DIMS.buffer_rows(MESH["ep"])
  mesh = aot_step._mesh(MESH["topology"], ep=MESH["ep"], data=MESH["data"])
  recs = []
  for scale in (1.0, 2.0):
    with aot_step.scaled_stock_estimates(scale):
      step, args = aot_step.expert_program(
        "megablox", mesh=mesh, dims=DIMS, rows=rows, tiles=MT_TILES
      )
      compiled = aot_step._compile(step, args, mesh.devices.flat[0])
    recs.append(aot_step.analyze(compiled, rows=rows))
  base, scaled = recs
  assert scaled["mosaic_calls"] == base["mosaic_calls"] == STOCK_CALLS
  assert scaled["flops_kernels"] == base["flops_kernels"]
  assert scaled["bytes_kernels"] == pytest.approx(2 * base["bytes_kernels"], rel=1e-6)


@pytest.mark.aot
def test_metadata_costs_less_xla_traffic_than_megablox():
  """The group metadata the visit kernels' XLA ops compute before each call, compiled for v5e
  at the MaxText step's dims (DeepSeek-V2-Lite at EP 8: the dropless 196,608-row buffer, 8 of 64
  experts, MaxText's tm = 512), moves fewer bytes than stock megablox's: at that step pallas_moe's
  schedule adds no XLA-op bytes of its own (`python -m bench.aot_step --metadata_only`)."""
  dims = aot_step.DEEPSEEK_V2_LITE
  costs = aot_step.metadata_costs(
    topology="v5e:2x2",
    m=dims.buffer_rows(8),
    tm=aot_step.MAXTEXT_TILES[0],
    num_groups=dims.num_experts,
    num_local_groups=dims.num_experts // 8,
  )
  ours, stock = costs["pallas_moe"], costs["megablox"]
  assert 0 < ours["bytes"] < stock["bytes"], costs
  assert 0 < ours["flops"] < stock["flops"], costs
