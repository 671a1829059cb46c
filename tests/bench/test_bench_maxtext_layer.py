"""bench.maxtext_layer: MaxText 0.2.5's own MoE layer's gmm calls, captured and modeled.

maxtext 0.2.5 needs Python >= 3.12 (the `maxtext` extra, pulled by `test` there); on Python 3.11
this module is skipped with the reason printed.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

if sys.version_info < (3, 12):
  pytest.skip(
    "maxtext 0.2.5 (MaxText's own MoE layer) needs Python >= 3.12; this is "
    f"{sys.version_info.major}.{sys.version_info.minor}",
    allow_module_level=True,
  )

from bench import maxtext_layer as ml  # noqa: E402


def test_bench_maxtext_layer_captures_the_layers_calls():
  """`bench.maxtext_layer` captures MaxText's own calls (three gmms over the padded dropless
  buffer, base.yml's 9 tiles, every device's group sizes summing to the tokens' choices) and
  models the switch's plan against stock megablox at MaxText's tiles on the same calls."""
  tokens, ep = 64, 4
  calls, info = ml.layer_calls("deepseek2-16b", ep=ep, tokens=tokens)
  assert [c["lhs"][1] for c in info["calls"]] == [ml.CAPTURE_EMB] * 2 + [ml.CAPTURE_MLP]
  assert sum(info["rows_per_device"]) == ep * tokens * 6  # every (token, choice) lands once
  assert info["rows"] == max(info["rows_per_device"])
  # MaxText's dropless buffer (T * k * min(ep, E / k)) padded to wi_tile_fwd_batch_seq.
  assert info["buffer_rows"] == -(-tokens * 6 * ep // 512) * 512
  (wi, wi_gs), (wo, wo_gs) = calls
  assert (wi.call, wi.count, wi.k, wi.n, wi.num_groups) == ("wi_0+wi_1", 2, 2048, 1408, 16)
  assert (wo.call, wo.count, wo.k, wo.n) == ("wo", 1, 1408, 2048)
  assert wi.tiling == (512, 1024, 1024) * 3 and int(wi_gs.sum()) == info["rows"]
  np.testing.assert_array_equal(wi_gs, wo_gs)
  (rec,) = ml.model_cases([([(wo, wo_gs)], info)], chips=["v5e"])
  kernels = {k["op"]: k for k in rec["kernels"]}
  assert kernels["fwd"]["kernel"] == "pallas_moe_gmm_rowtile"
  assert kernels["drhs"]["kernel"] == "pallas_moe_tgmm_rowtile"
  assert [k["stock_tiles"] for k in rec["kernels"]] == [[512, 1024, 1024]] * 3
  assert rec["ours_us"] == pytest.approx(sum(k["ours_us"] for k in rec["kernels"]))
  assert 0 < rec["ours_us"] < rec["stock_us"]
