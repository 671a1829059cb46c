"""bench.decode: decode-size expert work per device against the weight-read floor.

The per-call fixed cost is refit from tokamax's measured small problem: from entries of tokamax
0.0.17's caches embedded here (so the old stack, without tokamax, checks it too) and, where
tokamax is installed, from its own data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import costmodel, measured
from bench import decode as dec
from pallas_moe import quant
from pallas_moe.generations import get_generation, min_pass_rows

ROOT = Path(__file__).resolve().parents[2]
QWEN = next(m for m in dec.MODELS if m.name == "qwen3-30b-a3b")
DSV3 = next(m for m in dec.MODELS if m.name == "deepseek-v3")

# NOTE: tokamax 0.0.17's v2 ragged-dot cache entries for its one small problem (plain forward),
# key and value as shipped.
_KEY = (
  '{"lhs":"bf16[8,4096]","rhs":"bf16[8,4096,4096]","group_sizes":[1,1,1,1,1,1,1,1],'
  '"ragged_dot_dimension_numbers":{"dot_dimension_numbers":[[[1],[1]],[[],[]]],'
  '"lhs_ragged_dimensions":[0],"rhs_group_dimensions":[0]},"precision":["DEFAULT","DEFAULT"],'
  '"preferred_element_type":null,"return_residuals":false,"group_offset":null,'
  '"activation":null,"manual_axis_type":null,"zero_initialize":false,'
  '"fuse_gateup_activation":null}'
)
_CONFIG = '{"tile_m":null,"tile_k":null,"tile_n":null,"bucket_base":null}'
_TIMES_MS = {
  "tpu_v5": [0.11] * 5,
  "tpu_v6_lite": [0.186] * 5,
  "tpu7x": [0.089, 0.089, 0.085, 0.09, 0.089],
}


@pytest.fixture(scope="module")
def small_problem_cache(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("autotuning")
  for chip_dir, times in _TIMES_MS.items():
    (root / chip_dir).mkdir()
    entry = {_KEY: {_CONFIG: {"evaluation_times_ms": times}}}
    (root / chip_dir / measured.KERNEL_FILES["v2"]).write_text(json.dumps(entry))
  return root


@pytest.fixture(scope="module")
def qwen_records():
  return dec.records(models=[QWEN], tokens=[1, 8], chips=["v5p", "v6e"])


def test_fixed_cost_fit_reproduces_the_constants(small_problem_cache):
  fit = dec.fit_call_fixed_us(small_problem_cache)
  assert set(fit) == {"v5p", "v6e", "tpu7x"}
  for chip, f in fit.items():
    assert f["fixed_us"] == pytest.approx(costmodel.CALL_FIXED_US[chip], abs=0.01)
    assert f["modeled_us"] + f["fixed_us"] == pytest.approx(f["measured_us"])
  # One problem size: the fixed cost and a bandwidth below peak look the same (1.13x floor).
  assert fit["v5p"]["measured_over_floor"] == pytest.approx(1.133, abs=0.005)
  assert fit["v6e"]["measured_over_floor"] == pytest.approx(1.135, abs=0.005)


def test_fixed_cost_fit_from_installed_tokamax():
  if measured.default_cache_dir() is None:
    pytest.skip("tokamax is not installed (the embedded entries are checked above)")
  fit = dec.fit_call_fixed_us()
  for chip, value in costmodel.CALL_FIXED_US.items():
    assert fit[chip]["fixed_us"] == pytest.approx(value, abs=0.01)
  assert fit["v5p+res"]["fixed_us"] > fit["v5p"]["fixed_us"]


def test_fixed_cost_function():
  assert costmodel.call_fixed_us("v5e") == costmodel.CALL_FIXED_US["v5p"]  # the stand-in
  assert costmodel.fixed_cost_us("v6e", calls=3, xla_ops=45) == pytest.approx(3 * 16.60 + 45)
  assert costmodel.fixed_cost_us("tpu7x", calls=2, call_us=0.0, op_us=0.5, xla_ops=4) == 2.0


def test_route_draw_and_busiest_device():
  sizes = dec.route(experts=256, top_k=8, ep=8, tokens=8)
  assert sizes.shape == (8, 32) and int(sizes.sum()) == 8 * 8 * 8
  # top_k distinct experts per token: no expert holds more rows than there are tokens.
  assert sizes.max() <= 8 * 8
  dev = dec.busiest_device(sizes)
  nonempty = (sizes > 0).sum(1)
  assert nonempty[dev] == nonempty.max()
  assert sizes[dev].sum() == sizes[nonempty == nonempty.max()].sum(1).max()
  np.testing.assert_array_equal(sizes, dec.route(experts=256, top_k=8, ep=8, tokens=8))


def test_pack_calls_keeps_experts_whole():
  sizes = np.array([30, 0, 50, 40, 0, 70], np.int32)
  calls = dec.pack_calls(sizes, 100)
  np.testing.assert_array_equal(sum(calls), sizes)
  assert all(c.sum() <= 100 for c in calls)
  assert all(((c > 0) & (c < sizes)).sum() == 0 for c in calls)  # no expert cut
  assert len(dec.pack_calls(np.array([250], np.int32), 100)) == 3  # an expert over the cap


@pytest.mark.parametrize(
  "chip, weights, by_token, gather",
  [
    ("v5e", "bf16", False, False),
    ("v5e", "fp8-block", False, False),
    ("v6e", "fp8-block", False, False),
    ("tpu7x", "fp8-block", False, False),
    ("v5p", "bf16", False, False),
    ("v6e", "bf16", True, False),
    ("v5p", "fp8-block", True, False),
    ("v5e", "bf16", True, True),
    ("v6e", "bf16", True, True),
    ("v5p", "fp8-block", True, True),
  ],
)
def test_window_macs_match_the_kernels_dots(chip, weights, by_token, gather):
  """The schedule's MXU work per window and step is what `costmodel.kernel_dot_macs` counts in
  the fused kernel's traced body (the step and window loops are `while` loops, counted once):
  block-scaled weights too (v5e, v5p, v6e: one product per 128-deep block row of the stored
  values; tpu7x: full-depth products, each block dequantized on its way to the MXU), the
  tokens layout, v5p's two-core grid, and the gathered layout's one-hot gather and transposed
  add (the add's 128-deep contraction padded to v6e's 256-wide MXU)."""
  gen = get_generation(chip)
  dtype, kind = dec.WEIGHTS[weights]
  e, d, f, m = 3, 256, 512, 200 if gather else 40
  plan = dec.fe.plan_fused(
    rows=m, d=d, f=f, num_experts=e, x_dtype=jnp.bfloat16, w_dtype=dtype, kind=kind, chunk=256,
    generation=gen, by_token=by_token, gather=gather,
  )  # fmt: skip
  assert plan.cores == gen.tensorcores_per_device and plan.gather == gather
  sds = jax.ShapeDtypeStruct
  wi, wo = sds((e, d, 2 * f), dtype), sds((e, f, d), dtype)
  if kind == "block":
    wi = quant.BlockQuantizedWeights(values=wi, scales=sds((e, d // 128, 2 * f // 128), "f4"))
    wo = quant.BlockQuantizedWeights(values=wo, scales=sds((e, f // 128, d // 128), "f4"))
  kw = dict(expert_weights=jnp.zeros((e, m), jnp.float32)) if by_token else {}
  if gather:
    kw["expert_tokens"] = jnp.zeros((e, m), jnp.int32)
  fn = functools.partial(dec.fe.fused_experts, plan=plan, interpret=False, **kw)
  gs = np.array([20, 0, 20], np.int32)
  (sched,) = costmodel.analyze(fn, sds((m, d), jnp.bfloat16), wi, wo, gs)
  macs, _, _ = costmodel.kernel_dot_macs(
    sched.kernel_jaxpr, mxu=gen.mxu_size, min_rows=min_pass_rows(gen)
  )
  gathered, added = dec.gather_macs(plan, gen)
  assert macs == dec.window_macs(plan, gen) + gathered + added
  rows, mxu, c = max(plan.window, min_pass_rows(gen)), gen.mxu_size, plan.chunk
  if plan.upcast == "partials":
    # One product per 128-deep block row of the stored values, the block padded to the MXU.
    b = max(128, mxu)
    want = rows * (2 * (d // 128) * b * max(c, mxu) + (c // 128) * b * max(d, mxu))
  else:
    # Full depth: one [window, d] x [d, chunk] product each for gate and up, one for down.
    want = 3 * rows * max(d, mxu) * max(c, mxu)
  assert dec.window_macs(plan, gen) == want
  if gather:
    # [128, N] x [N, d] one-hots and back: 128 x N x d each, the add's 128 padded to the MXU.
    assert (plan.rows, plan.window) == (256, 128)
    assert gathered == 128 * 256 * d and added == 256 * gen.mxu_size * d
  else:
    assert gathered == added == 0
  assert plan.expert_weight_bytes == dec.expert_bytes(
    dec.DecodeModel(name="t", experts=e, top_k=1, d=d, f=f, eps=(1,), weights=(weights,)),
    weights,
  )


def test_expert_windows_follow_the_kernels_loop():
  kw = dict(d=256, f=256, num_experts=4, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16)
  plan = dec.fe.plan_fused(rows=300, **kw)
  assert (plan.window, plan.align) == (128, 16)
  # Expert 2 starts at row 30 (window from row 16): rows 16..160 need two windows.
  np.testing.assert_array_equal(dec.expert_windows(plan, np.array([30, 0, 130, 5])), [1, 0, 2, 1])
  # Sorted rows: the [rows, 1] f32 row weights are a column in 128 lanes.
  assert dec.activation_bytes(plan) == 304 * 256 * (2 + 2) + 304 * 128 * 4
  # Tokens: every visited expert over all 200 tokens (padded to two 128-token windows).
  tokens = dec.fe.plan_fused(rows=200, by_token=True, **kw)
  assert (tokens.rows, tokens.window) == (256, 128)
  np.testing.assert_array_equal(dec.expert_windows(tokens, np.array([3, 0, 1, 9])), [2, 0, 2, 2])
  # The [E, 1, rows] f32 routing weights: E x rows x 4 bytes in HBM.
  assert dec.activation_bytes(tokens) == 256 * 256 * (2 + 2) + 4 * 256 * 4
  # Gathered: each visited expert over its own tokens, 128 at a time; the int32 token lists
  # come in beside the weights.
  gathered = dec.fe.plan_fused(rows=200, by_token=True, gather=True, **kw)
  sizes = np.array([3, 0, 129, 128])
  np.testing.assert_array_equal(dec.expert_windows(gathered, sizes), [1, 0, 2, 1])
  assert dec.activation_bytes(gathered) == 256 * 256 * (2 + 2) + 2 * 4 * 256 * 4


def test_records_fields_bytes_and_floor(qwen_records):
  recs = qwen_records
  fields = {
    "model", "ep", "tokens", "chip", "impl", "modeled_us", "floor_us", "ratio",
    "nonempty_experts", "local_experts", "weight_bytes_read", "fixed_us",
  }  # fmt: skip
  assert len(recs) == 2 * 2 * len(dec.IMPLS)
  for r in recs:
    assert fields <= set(r), fields - set(r)
    assert r["ratio"] == pytest.approx(r["modeled_us"] / r["floor_us"])
    assert r["fixed_us"] == pytest.approx(
      r["calls"] * costmodel.call_fixed_us(r["chip"]) + r["xla_ops"] * costmodel.XLA_OP_FIXED_US
    )
  point = lambda r: (r["tokens"], r["chip"])  # noqa: E731
  by = {(point(r), r["impl"]): r for r in recs}
  for (p, impl), r in by.items():
    if impl not in ("fused", "moe_decode"):
      continue
    tpi, mb = by[(p, "tpu-inference-fused")], by[(p, "megablox-maxtext")]
    assert r["weight_bytes_read"] == r["floor_bytes"]  # only the non-empty experts, once
    assert r["weight_bytes_read"] <= tpi["weight_bytes_read"]
    assert tpi["weight_bytes_read"] == r["local_experts"] * dec.expert_bytes(QWEN, "bf16")
    assert r["modeled_us"] >= r["floor_us"]
    assert mb["calls"] == 3 and mb["xla_ops"] == dec.MEGABLOX_XLA_OPS
    # The switch: the same three calls over MaxText's padded buffer, our gmm in them.
    sw = by[(p, "maxtext-switch")]
    assert sw["calls"] == 3 and sw["xla_ops"] == dec.SWITCH_XLA_OPS
    assert sw["buffer_rows"] == mb["buffer_rows"] and sw["weights_read_dtype"] == "bfloat16"
    # Every non-empty expert's bf16 weights once, with the rows the row-tile kernel copies.
    assert r["floor_bytes"] <= sw["weight_bytes_read"] < 1.05 * r["floor_bytes"]
    assert r["modeled_us"] < sw["modeled_us"] < mb["modeled_us"]
    # Prefused: gate and up in one call over the same bytes, one call's fixed cost less.
    pf = by[(p, "maxtext-switch-prefused")]
    assert pf["calls"] == 2 and pf["xla_ops"] == dec.SWITCH_PREFUSED_XLA_OPS
    assert pf["weight_bytes_read"] == pytest.approx(sw["weight_bytes_read"], rel=0.02)
    assert pf["modeled_us"] < sw["modeled_us"]
    # v5p: the weight stream split over the device's two TensorCores, the partial sums added
    # by one XLA op; each core reads half the bytes at one TensorCore's bandwidth.
    cores = get_generation(r["chip"]).tensorcores_per_device
    assert r["tensorcores"] == cores and r["xla_ops"] == cores - 1 and r["calls"] == 1
    assert r["steps"] == cores * r["core_steps"]
    core_bw = dec.tensorcore_rates(r["chip"])[1]
    assert r["dma_us"] * 1e-6 == pytest.approx(r["weight_bytes_read"] / cores / core_bw)
    if impl == "moe_decode":
      assert r["path"] == "fused" and r["layer_xla_ops"] == dec.DECODE_XLA_OPS
  # Two TensorCores on v5p: within 1.5x of the floor, as v6e (one core at the device's rate).
  assert by[((8, "v5p"), "moe_decode")]["ratio"] < 1.5
  assert by[((8, "v5p"), "tpu-inference-fused")]["ratio"] > 2.0  # one core: half the bandwidth


def test_serving_paths():
  """`moe_decode`'s paths as `plan_decode` picks them: up to 128 tokens on the expert axis every
  visited expert over all of them; to 512 each over its own tokens, gathered by a one-hot
  product; above that moe_block's forward with the streamed fused kernel."""
  gen = get_generation("v6e")
  small = dec.route(experts=256, top_k=8, ep=8, tokens=8)[0]
  r = dec.model_serving(DSV3, "bf16", small, "v6e", ep=8, tokens=8)
  assert (r["path"], r["layout"], r["calls"]) == ("fused", "all tokens", 1)
  assert r["gather_mxu_us"] == 0 and r["layer_xla_ops"] == dec.DECODE_XLA_OPS
  sizes = dec.route(experts=256, top_k=8, ep=8, tokens=32)[0]
  r = dec.model_serving(DSV3, "bf16", sizes, "v6e", ep=8, tokens=32)
  assert (r["path"], r["layout"], r["window"], r["calls"]) == ("fused", "gathered", 128, 1)
  assert r["layer_xla_ops"] == dec.DECODE_XLA_OPS + dec.GATHER_XLA_OPS
  plan = dec.serving_plan(DSV3, "bf16", "v6e", ep=8, tokens=32).fused
  assert plan.gather and plan.rows == 256 and r["chunk"] == plan.chunk
  flops = dec.tensorcore_rates(gen)[0]
  per_window = dec.window_macs(plan, gen) * 2 / flops
  windows = -(-sizes // 128)  # each visited expert's own tokens, not all 256
  gather = sum(dec.gather_macs(plan, gen)) * 2 / flops
  assert r["mxu_us"] == pytest.approx(windows.sum() * (plan.chunks * per_window + gather) * 1e6)
  assert r["gather_mxu_us"] == pytest.approx(windows.sum() * gather * 1e6)
  assert r["weight_bytes_read"] == int((sizes > 0).sum()) * dec.expert_bytes(DSV3, "bf16")
  # Past 512 tokens: moe_block's forward, its experts the streamed fused kernel.
  qwen = dec.route(experts=128, top_k=8, ep=8, tokens=128)[0]
  block = dec.model_serving(QWEN, "bf16", qwen, "v6e", ep=8, tokens=128)
  assert (block["path"], block["layout"], block["calls"], block["xla_ops"]) == (
    "block", "streamed", 1, 0
  )  # fmt: skip
  assert dec.path_label(block) == "block, streamed" and "1024 > 512 tokens" in block["reason"]
  assert block["layer_xla_ops"] == dec.BLOCK_STREAM_LAYER_XLA_OPS
  assert block["weight_bytes_read"] == int((qwen > 0).sum()) * dec.expert_bytes(QWEN, "bf16")
  # v5p: the streamed kernel's visits split between its two TensorCores, the granule they share
  # added back by SEAM_XLA_OPS instructions.
  v5p = dec.model_serving(QWEN, "bf16", qwen, "v5p", ep=8, tokens=128)
  assert (v5p["layout"], v5p["tensorcores"], v5p["xla_ops"]) == ("streamed", 2, dec.SEAM_XLA_OPS)
  plan = dec.serving_plan(QWEN, "bf16", "v5p", ep=8, tokens=128).block
  one = dec.model_block_stream(dataclasses.replace(plan.fused, cores=1), qwen, "v5p")
  assert v5p["kernel_us"] < 0.6 * one["kernel_us"] and v5p["steps"] == one["steps"]
  # A block plan without the fused kernel: the gmm pair.
  bare = dataclasses.replace(plan, fused=None)
  gmm = dec.model_block_path(QWEN, qwen, "v5p", ep=8, tokens=128, plan=bare)
  assert (gmm["path"], gmm["layout"], gmm["calls"]) == ("block", "gmm", 2)
  assert gmm["xla_ops"] == dec.BLOCK_EXPERT_XLA_OPS and dec.path_label(gmm) == "block, gmm"
  assert gmm["buffer_rows"] == 8 * 128 * 8 and gmm["expected_rows"] == 128 * 8
  swiglu = 8192 * 3 * QWEN.f * 2 / dec.device_bandwidth("v5p") * 1e6
  assert gmm["swiglu_us"] == pytest.approx(swiglu)


def test_gathered_distinct_design_is_bounded_and_grows_with_its_table():
  """The unbuilt design beside the streamed points: the gathered layout over a table of the
  device's distinct routed tokens. No faster than `bound_us` over those rows; more rows cost
  more; a table past the kernel's VMEM has no plan."""
  sizes = dec.route(experts=128, top_k=8, ep=8, tokens=128)
  dev = dec.busiest_device(sizes)
  kw = dict(experts=128, top_k=8, ep=8, tokens=128, device=dev)
  distinct = dec.routed_tokens(**kw)
  local = sizes[dev]
  assert distinct < local.sum()  # tokens that chose two of the device's experts
  gen = get_generation("v5e")
  design = dec.model_gathered_distinct(QWEN, "bf16", local, "v5e", distinct=distinct)
  floor = int((local > 0).sum()) * dec.expert_bytes(QWEN, "bf16") / dec.device_bandwidth(gen)
  rows = distinct * QWEN.d * 2 * 2 / dec.device_bandwidth(gen)
  mxu = dec.mxu_floor_us(QWEN, "bf16", local, gen)
  assert design >= dec.bound_us(floor * 1e6, mxu, costmodel.call_fixed_us(gen), rows * 1e6)
  pairs = dec.model_gathered_distinct(QWEN, "bf16", local, "v5e", distinct=int(local.sum()))
  assert pairs > design
  assert dec.model_gathered_distinct(QWEN, "bf16", local, "v5e", distinct=1 << 20) is None


def test_stream_visits_follow_the_kernel():
  """Visits as `fused_experts._stream_metadata` makes them: an expert's rows from its first row
  rounded down to 16, at most `visit_rows` past that per visit; rows in from the first rounded
  down to the chip's copy unit (8 on v6e, 16 on tpu7x), granules out."""
  kw = dict(rows=400, d=256, f=256, num_experts=4, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16)
  plan = dec.fe.plan_fused(**kw, stream=True, visit_rows=64, generation="v6e")
  assert (plan.align, plan.visit_rows, plan.row_unit) == (16, 64, 8)
  expert, lo, hi, rows_in, tiles_out = dec.stream_visits(plan, np.array([3, 0, 130, 10]))
  np.testing.assert_array_equal(expert, [0, 2, 2, 2, 3])
  np.testing.assert_array_equal(lo, [0, 3, 64, 128, 133])
  np.testing.assert_array_equal(hi, [3, 64, 128, 133, 143])
  np.testing.assert_array_equal(rows_in, [8, 64, 64, 8, 16])
  wide = dec.fe.plan_fused(**kw, stream=True, visit_rows=64, generation="tpu7x")
  np.testing.assert_array_equal(
    dec.stream_visits(wide, np.array([3, 0, 130, 10]))[3], [16, 64, 64, 16, 16]
  )
  # Finished granules out; the call's last (rows 128-143) after the last visit.
  np.testing.assert_array_equal(tiles_out, [0, 4, 4, 0, 1])


def test_fp8_block_past_one_call_streams_once():
  """Block-scaled weights past 512 tokens on the expert axis: moe_block's forward with the
  streamed fused kernel, each visited expert's fp8 weights read once, one call."""
  (r,) = dec.records(
    models=[dataclasses.replace(DSV3, eps=(32,), weights=("fp8-block",))],
    tokens=[128],
    chips=["v6e"],
    impls=["moe_decode"],
  )
  assert (r["path"], r["layout"], r["calls"]) == ("block", "streamed", 1)
  assert r["weight_bytes_read"] == r["floor_bytes"] and r["weights_read_dtype"] == "float8_e4m3fn"
  assert r["fixed_us"] == pytest.approx(costmodel.call_fixed_us("v6e"))
  assert r["visits"] >= r["nonempty_experts"] and r["row_copy_us"] > 0
  # NOTE: one TensorCore: every row copy is either exposed or queued between weight steps.
  assert r["io_us"] + r["row_stream_us"] == pytest.approx(r["row_copy_us"])
  assert "rows copied between the weights" in dec._why(r)
  assert r["modeled_us"] >= r["floor_us"] and "gathered_distinct_us" in r


def test_fp8_block_reads_the_floor_bytes_with_scales():
  sizes = dec.route(experts=256, top_k=8, ep=32, tokens=1)[0]
  r = dec.model_fused(DSV3, "fp8-block", sizes, "v6e")
  per_expert = 3 * 7168 * 2048 + 4 * (56 * 32 + 16 * 56)  # fp8 values + f32 128x128 scales
  assert dec.expert_bytes(DSV3, "fp8-block") == per_expert
  assert r["weight_bytes_read"] == int((sizes > 0).sum()) * per_expert
  assert r["kernel_us"] * 1e-6 >= r["weight_bytes_read"] / dec.device_bandwidth("v6e")


def test_mxu_floor_bounds_every_kernel():
  sizes = np.array([1, 0, 3, 200])
  elements = 3 * 7168 * 2048
  # v5p: 2 TensorCores of 4 128x128 MXUs at 1.75 GHz take in 0.90e12 weight elements per
  # second each, against 1.38e12 fp8 bytes per second of HBM each: 1.5x the floor at 1 row.
  v5p = dec.mxu_floor_us(DSV3, "fp8-block", np.array([1]), "v5p") * 1e-6
  assert v5p == pytest.approx(elements * 2 * 128 / 459e12, rel=1e-3)
  assert v5p / (elements / dec.device_bandwidth("v5p")) > 1.5
  # Rows above 128 cost one cycle each; empty experts nothing.
  mix = dec.mxu_floor_us(DSV3, "bf16", sizes, "v6e")
  one = dec.mxu_floor_us(DSV3, "bf16", np.array([1]), "v6e")
  assert mix == pytest.approx(one * (128 + 128 + 200) / 128)
  # tpu7x multiplies fp8 natively: twice bf16's rate.
  fp8 = dec.mxu_floor_us(DSV3, "fp8-block", sizes, "tpu7x")
  assert fp8 == pytest.approx(dec.mxu_floor_us(DSV3, "bf16", sizes, "tpu7x") / 2)
  assert dec.bound_us(100.0, 150.0, 10.0) == 160.0


def test_sensitivity_and_verdict(qwen_records):
  rows = dec.sensitivity(qwen_records)
  assert len(rows) == 3 * 4 + 1
  zero = next(r for r in rows if r["call"] == 0.0 and r["op_us"] == 0.25)
  fitted = next(r for r in rows if r["call"] == "fitted" and r["op_us"] == 2.0)
  for impl in ("moe_decode", "fused"):
    assert zero[impl]["median"] < fitted[impl]["median"]
  v = dec.verdict(qwen_records)
  assert v["impl"] == dec.HEADLINE and v["points"] == 4 and "no_path" not in v
  assert v["by_path"] == {"fused": dict(points=4, meets=len(v["meets"]))}
  assert len(v["meets"]) + len(v["impossible"]) + len(v["other"]) == 4
  # Qwen3 at 1 token on v6e: 16.6 µs per call is more than 10% of a 58 µs floor.
  assert any(r["chip"] == "v6e" and r["tokens"] == 1 for r in v["impossible"])
  assert "fixed +" in v["impossible"][0]["why"]
  for r in v["impossible"]:
    assert r["bound_us"] > dec.LIMIT * r["floor_us"] and r["limit"] == "fixed cost"
  for r in v["other"]:
    assert r["bound_us"] <= dec.LIMIT * r["floor_us"]
  assert 0 < v["near_bound"] <= 4


def test_cli_writes_json(tmp_path):
  out = tmp_path / "decode.json"
  md = tmp_path / "decode.md"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  cmd = [
    sys.executable, "-m", "bench", "--decode", "--json", str(out), "--markdown", str(md),
    "--chip", "v6e", "--shapes", "qwen3-30b-a3b", "--decode_tokens", "1",
  ]  # fmt: skip
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert {r["impl"] for r in result["records"]} == set(dec.IMPLS)
  assert {r["chip"] for r in result["records"]} == {"v6e"}
  assert result["assumptions"]["xla_op_fixed_us"] == costmodel.XLA_OP_FIXED_US
  assert "Which points meet 1.10x" in md.read_text()


def test_pipeline_exposes_one_piece_at_either_end():
  """Copy-bound steps end one piece's products after the last byte; MXU-bound steps start one
  piece's copy after time 0 (or the core's own work before it, if longer); rows queued ahead
  of a step delay its first product."""
  copy, mxu = 3.0, np.full(5, 1.5)
  for pieces in (1, 2, 4):
    first, total, copies = dec.pipeline(mxu, copy, pieces=pieces)
    assert copies == 5 * copy
    assert first == pytest.approx(copy * 2 / 3 / pieces)
    # NOTE: the stream never waits on the MXU; the last down piece's products are left.
    assert total == pytest.approx(5 * copy + 1.5 / 3 / pieces)
  first, total, _ = dec.pipeline(np.full(5, 6.0), copy, pieces=4)
  assert total == pytest.approx(copy / 6 + 5 * 6.0)
  _, late, _ = dec.pipeline(mxu, copy, pieces=4, head=[0, 2.0, 0, 0, 0])
  assert late == pytest.approx(5 * copy + 2.0 + 1.5 / 12)
  assert dec.pipeline(np.zeros(0), copy, pieces=2) == (0.0, 0.0, 0.0)
  # NOTE: the core's own work before its first product (the gathered table check) hides under
  # the first piece's copy, and past it delays an MXU-bound stream by the difference.
  hidden, _, _ = dec.pipeline(mxu, copy, pieces=4, start=0.1)
  assert hidden == pytest.approx(copy / 6)
  first, total, _ = dec.pipeline(np.full(5, 6.0), copy, pieces=4, start=2.0)
  assert (first, total) == pytest.approx((2.0, 2.0 + 5 * 6.0))
  # NOTE: work split over the last step's down pieces (the gathered adds back) leaves one
  # piece's share after the last byte; work before a step's products hides under its copies.
  _, added, _ = dec.pipeline(mxu, copy, pieces=4, after_down=[0, 0, 0, 0, 0.2])
  assert added == pytest.approx(5 * copy + 1.5 / 12 + 0.2 / 4)
  _, ahead, _ = dec.pipeline(mxu, copy, pieces=4, before=[0.5, 0, 0, 0, 0.5])
  assert ahead == pytest.approx(5 * copy + 1.5 / 12)


def test_bound_counts_the_routed_rows():
  """The bound moves each routed token's row in and result out once, beside the weights."""
  sizes = dec.route(experts=256, top_k=8, ep=32, tokens=128)
  dev = dec.busiest_device(sizes)
  unique = dec.routed_tokens(experts=256, top_k=8, ep=32, tokens=128, device=dev)
  # NOTE: an expert's rows are distinct tokens; a token may send several rows to one device.
  assert sizes[dev].max() <= unique <= min(32 * 128, sizes[dev].sum())
  assert dec.bound_us(100.0, 90.0, 5.0, 8.0) == 113.0
  assert dec.bound_us(100.0, 120.0, 5.0, 8.0) == 125.0


@pytest.mark.aot
def test_switch_xla_ops_as_compiled():
  """`SWITCH_XLA_OPS` is what MaxText's three gmm calls and the SwiGLU between them compile to
  with `pallas_moe.maxtext.gmm` (AOT for v6e, a 512-row buffer of 16 local experts), within 2;
  `SWITCH_PREFUSED_XLA_OPS` the same with gate and up as one call over the stored wi."""
  from bench import decode_ops

  for path, calls, ops in (
    ("switch", 3, dec.SWITCH_XLA_OPS),
    ("switch-prefused", 2, dec.SWITCH_PREFUSED_XLA_OPS),
  ):
    compiled = decode_ops.compile_maxtext_experts(topology="v6e:2x2", path=path, rows=512)
    counts = decode_ops.count(compiled.as_text())
    assert counts["mosaic"] == calls
    assert abs(counts["costed"] - ops) <= 2, (path, counts)


@pytest.mark.aot
def test_split_call_xla_ops_as_compiled():
  """What a fused call split over v5p's two TensorCores adds after the kernel, against the same
  call on v6e's one: rows resident in VMEM, one op adding the two partial sums (bf16, added in
  f32); streamed rows, `SEAM_XLA_OPS` (the shared granule added back in place)."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from bench import decode_ops
  from pallas_moe import fused_experts as fe
  from pallas_moe import tiling
  from tests.kernels.test_aot import _device as aot_device

  d, f, e = 512, 256, 4

  def costed(chip, m, stream):
    dev = aot_device(chip)
    sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())
    bf16 = jnp.bfloat16
    shapes = (((m, d), bf16), ((e, d, 2 * f), bf16), ((e, f, d), bf16), ((e,), jnp.int32))
    args = [jax.ShapeDtypeStruct(s, t, sharding=sh) for s, t in shapes]
    args.append(jax.ShapeDtypeStruct((m,), jnp.float32, sharding=sh))
    kw = dict(stream=True, unowned_rows="undefined") if stream else {}

    def call(x, wi, wo, gs, rw):
      return fe.fused_experts(x, wi, wo, gs, row_weights=rw, **kw)

    with tiling.use_generation(tiling.get_generation(chip)), jax.default_device(dev):
      counts = decode_ops.count(jax.jit(call).lower(*args).compile().as_text())
    assert counts["mosaic"] == 1
    return counts["costed"]

  for m, stream, ops in ((64, False, 1), (1024, True, dec.SEAM_XLA_OPS)):
    assert costed("v5p", m, stream) - costed("v6e", m, stream) == ops, stream
