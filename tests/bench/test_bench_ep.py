"""bench's EP cases: buffer sizes per policy, tokamax's tiles, the records' fields."""

import dataclasses
import importlib
import json
import math

import numpy as np
import pytest

from bench import ep_cases, ep_report, tokamax_tiles
from bench.impls import megablox_tilings
from bench.shapes import SHAPES

bench_main = importlib.import_module("bench.__main__")


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_ep_case_buffer_rows_and_rows_per_policy(routing):
  t, ep = 64, 8
  base = SHAPES["deepseek-v2-lite"]  # E = 64, top_k = 6 -> E_l = 8
  counts = ep_cases._send_counts(
    num_experts=base.num_groups, ep=ep, rows_per_peer=t * base.top_k, routing=routing, seed=0
  )
  received = counts.sum(axis=0).reshape(ep, -1)
  busiest = received[received.sum(axis=1).argmax()]
  expected = {
    "exact": math.ceil(received.sum(axis=1).max() / 8) * 8,
    "cf1.25": math.ceil(1.25 * t * 6),
    "cf2.0": 2 * t * 6,
    "static": ep * t * min(6, 8),
  }
  for policy, buf in expected.items():
    shape, gs = ep_cases.ep_case(
      model="deepseek-v2-lite", ep=ep, tokens=t, policy=policy, routing=routing
    )
    assert shape.buffer_rows == shape.m == buf, policy
    assert gs.shape == (8,) and gs.dtype == np.int32
    assert shape.wanted_rows == busiest.sum()
    assert shape.rows == gs.sum() == min(buf, busiest.sum())
    # Drops take the tail of the (local expert, sender) layout: a prefix of experts is kept.
    np.testing.assert_array_equal(np.cumsum(gs), np.minimum(np.cumsum(busiest), buf))
  rec = ep_cases.ep_case(model="deepseek-v2-lite", ep=ep, tokens=t, policy="static")[0]
  assert rec.record_fields()["slack"] == rec.buffer_rows / rec.rows


def test_megablox_padding_and_slack1():
  shape, gs = ep_cases.ep_case(model="mixtral-8x7b", ep=8, tokens=64, policy="exact")
  assert shape.num_groups == 1 and shape.buffer_rows % 8 == 0
  for impl, mult in (("megablox-maxtext", 512), ("megablox-best", 1024), ("pallas_moe", 1)):
    padded = ep_cases.shape_for_impl(shape, impl)
    assert padded.m % mult == 0 and padded.m - shape.m < mult and padded.rows == shape.rows
  ((one, _, gs1),) = ep_report.slack1_cases([(shape, "uniform", gs)])
  assert one.m == shape.rows and one.policy == "exact-slack1" and gs1 is gs


def test_tokamax_lookup_falls_back_to_128_cubed():
  assert tokamax_tiles.lookup(op="fwd", m=1000, k=256, n=256, num_groups=3) == (
    (128, 128, 128),
    2,
    False,
  )
  # deepseek-v3 at its native 262144 rows, G = 256: tuned per op.
  dims = dict(m=262144, k=7168, n=2048, num_groups=256)
  assert tokamax_tiles.lookup(op="fwd", **dims) == ((256, 7168, 512), 2, True)
  assert tokamax_tiles.lookup(op="dlhs", **dims) == ((256, 2048, 1792), 2, True)
  assert tokamax_tiles.lookup(op="drhs", **dims) == ((512, 1024, 2048), 3, True)
  assert {1792, 2944, 3584} <= set(tokamax_tiles.TILE_SIZES)
  # megablox-best's search covers tokamax's tk/tn sizes.
  tilings = megablox_tilings(op="fwd", shape=SHAPES["deepseek-v3"])
  assert any(tk == 1792 for _, tk, _ in tilings) and any(tn == 1792 for *_, tn in tilings)


def test_ep_records_have_the_fields_and_targets_run():
  base, gs = ep_cases.ep_case(model="mixtral-8x7b", ep=8, tokens=32, policy="cf2.0")
  # NOTE: small weights keep the analysis quick; the EP fields are what is checked.
  shape = dataclasses.replace(base, k=256, n=256)
  cases = [(shape, "uniform", gs)]
  common = dict(chips=["v5e"], ops=["fwd"])
  recs = bench_main.run_cases(
    cases=cases, impl_names=["pallas_moe", "megablox-maxtext", "tokamax"], **common
  )
  assert {r["impl"] for r in recs} == {"pallas_moe", "megablox-maxtext", "tokamax"}
  for r in recs:
    for field in ("buffer_rows", "rows", "policy", "ep", "slack", "modeled_us"):
      assert field in r, field
    assert r["policy"] == "cf2.0" and r["ep"] == 8 and r["rows"] == int(gs.sum())
  mb = next(r for r in recs if r["impl"] == "megablox-maxtext")
  assert mb["m"] % 512 == 0 and mb["buffer_rows"] == shape.buffer_rows
  slack1 = bench_main.run_cases(
    cases=ep_report.slack1_cases(cases), impl_names=["pallas_moe"], **common
  )
  (row,) = ep_report.targets(recs, slack1)
  assert row["slack1_us"] == slack1[0]["modeled_us"] and row["pass_mb512"] is not None
  assert row["tail_us"] == pytest.approx(
    (shape.buffer_rows - shape.rows) * 256 * 2 / 819e9 * 1e6, rel=0.02
  )
  assert "of 1 pass" in ep_report.targets_table(ep_report.targets(recs, slack1), markdown=False)


def test_saved_runs_render_together(tmp_path):
  """Split runs (here: two records of one case, one per impl) merge into one set of tables."""
  shape, gs = ep_cases.ep_case(
    model="deepseek-v2-lite", ep=8, tokens=256, policy="cf2.0", routing="uniform"
  )
  rec = dict(
    model="deepseek-v2-lite",
    ep=8,
    tokens=256,
    policy="cf2.0",
    routing="uniform",
    op="fwd",
    chip="v5e",
    buffer_rows=shape.m,
    rows=shape.rows,
    slack=shape.m / shape.rows,
    k=shape.k,
    n=shape.n,
    achievable_us=10.0,
  )
  ours = dict(rec, impl="pallas_moe-moe", modeled_us=10.5)
  mb = dict(rec, impl="megablox-maxtext", modeled_us=20.0)
  one = dict(rec, impl="pallas_moe-moe", policy="cf2.0-slack1", slack=1.0, modeled_us=10.4)
  paths = []
  for i, run in enumerate(({"modeled": [ours], "ep_slack1": [one]}, {"modeled": [mb]})):
    paths.append(tmp_path / f"run{i}.json")
    paths[-1].write_text(json.dumps(run))
  md = tmp_path / "t.md"
  ep_report.main([*map(str, paths), "--markdown", str(md)])
  text = md.read_text()
  # NOTE: the block's variant writes no tail: 10.5 <= 1.05 * 10.4, faster than megablox.
  assert "pallas_moe-moe, slack: ours <= 1.05 x slack-1" in text and "1 of 1 pass" in text
  assert "| 20.0 | pass |" in text  # megablox's figure came from the second run
