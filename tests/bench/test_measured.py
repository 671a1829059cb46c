"""Tests of bench.measured: tokamax's autotuning measurements mapped onto the cost model.

The fixture `tests/data/tokamax_autotuning` holds a few entries of tokamax 0.0.17's caches
(keys and values as shipped), laid out as tokamax's `data/autotuning`, so the tests do not need
tokamax installed.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from bench import impls
from bench import measured as ms
from bench.shapes import Shape

FIXTURE = Path(__file__).parent.parent / "data" / "tokamax_autotuning"


@pytest.fixture(scope="module")
def problems():
  ps, skipped = ms.load_problems(cache_dir=FIXTURE)
  return ps, skipped


def _find(ps, *, chip, kernel, op, residuals=False):
  (p,) = [p for p in ps if (p.chip, p.kernel, p.op, p.residuals) == (chip, kernel, op, residuals)]
  return p


def test_generate_group_sizes_is_tokamax_draw():
  # NOTE: values from tokamax 0.0.17's `generate_group_sizes(m=131072, num_groups=256)` (and
  # `GroupSizes(ShapeDtypeStruct([256], int32), 131072).representative_value`, the same).
  gs = ms.generate_group_sizes(m=131072, num_groups=256)
  assert gs.dtype == np.int32 and gs.shape == (256,) and int(gs.sum()) == 131072
  assert gs[:4].tolist() == [531, 507, 504, 519]
  assert (int(gs.min()), int(gs.max())) == (460, 579)
  assert ms.generate_group_sizes(m=8192, num_groups=8).tolist()[:4] == [1043, 1012, 1023, 1021]


def test_parse_ops_groups_and_skips(problems):
  ps, skipped = problems
  assert len(ps) == 7
  assert sorted(skipped) == [("v5e", "v1", "quantized operands"), ("v6e", "v2", "no measurements")]
  fwd = _find(ps, chip="v5e", kernel="v1", op="fwd")
  assert (fwd.m, fwd.k, fwd.n, fwd.num_groups) == (4096, 4096, 4096, 8)
  assert not fwd.generated and fwd.group_sizes.tolist() == [4096] + [0] * 7
  assert fwd.best.ms == pytest.approx(0.763)
  res = _find(ps, chip="v5e", kernel="v1", op="fwd", residuals=True)
  assert res.best.tiles == (1024, 1024, 512)
  # dlhs: dout [m, n] x rhs [G, k, n]; drhs: lhs [m, k] x dout [m, n], G from the group sizes.
  dlhs = _find(ps, chip="tpu7x", kernel="v1", op="dlhs")
  assert (dlhs.m, dlhs.k, dlhs.n, dlhs.num_groups) == (131072, 512, 7168, 256)
  drhs = _find(ps, chip="tpu7x", kernel="v1", op="drhs")
  assert (drhs.m, drhs.k, drhs.n, drhs.num_groups) == (131072, 7168, 1024, 256)
  assert drhs.generated
  np.testing.assert_array_equal(drhs.group_sizes, ms.generate_group_sizes(m=131072, num_groups=256))
  v2 = _find(ps, chip="tpu7x", kernel="v2", op="fwd")
  assert v2.best.tiles is None


def test_v1_tiles_follow_the_dlhs_field_order(problems):
  ps, _ = problems
  # tpu7x's v1 cache predates tokamax e919cdc: (tile_m, tile_k, tile_n) with tile_k on the
  # contraction (here n = 7168, measured with tile_k 7168).
  old = _find(ps, chip="tpu7x", kernel="v1", op="dlhs")
  assert ms.dlhs_old_order(old)
  assert ms.kernel_tiling(old, old.best) == (256, 7168, 512)
  # v5p's is newer: tile_n tiles the contraction (n = 1024), tile_k the output (k = 7168).
  new = _find(ps, chip="v5p", kernel="v1", op="dlhs")
  assert not ms.dlhs_old_order(new)
  assert new.best.tiles == (128, 1792, 1024)
  assert ms.kernel_tiling(new, new.best) == (128, 1024, 1792)
  drhs = _find(ps, chip="tpu7x", kernel="v1", op="drhs")
  assert ms.kernel_tiling(drhs, drhs.best) == (256, 1792, 1024)


def test_v1_model_at_measured_tiles(problems):
  ps, _ = problems
  p = _find(ps, chip="v5e", kernel="v1", op="fwd")
  mc = ms.model_config(p, p.best)
  # NOTE: megablox's schedule (bench.impls) at (1024, 512, 1024): one group of 4096 rows,
  # 4 m tiles x 4 n tiles x 8 k tiles, each step one [1024, 512] x [512, 1024] dot.
  assert mc.tiling == (1024, 512, 1024) and mc.steps == 128
  assert mc.mxu_us == pytest.approx(128 * 2 * 1024 * 512 * 1024 / 197e12 * 1e6, rel=1e-9)
  assert mc.modeled_us == pytest.approx(742.46, rel=1e-3)
  assert mc.ratio == pytest.approx(763.0 / 742.46, rel=1e-3)
  # v5e has one TensorCore and the default step overhead; no copies around a plain forward.
  assert mc.modeled_chip_us == mc.kernel_us == mc.modeled_us and mc.copy_us == 0


def test_harness_copies(problems):
  # The forward under jax.vjp returns its output twice: one copy (read + write) of [m, n].
  ps, _ = problems
  p = _find(ps, chip="v5e", kernel="v1", op="fwd", residuals=True)
  assert ms.harness_copy_bytes(p) == dict(residuals=2 * 4096 * 4096 * 2, layout=0)
  mc = ms.model_config(p, p.best)
  assert mc.copy_us == pytest.approx(2 * 4096 * 4096 * 2 / 819e9 * 1e6, rel=1e-9)
  assert mc.modeled_us == pytest.approx(mc.kernel_us + mc.copy_us, rel=1e-12)
  # gpt-oss dims (2880, not a multiple of 128): XLA gives the [m, 2880] arrays the transposed
  # layout, so both 2D arrays of each op are transposed on their way in / out; the 3D weights
  # keep theirs. A device's HBM: v5p's whole chip (both cores), one tpu7x core's.
  gpt = dataclasses.replace(p, op="drhs", m=327680, k=2880, n=2880, residuals=False)
  assert ms.harness_copy_bytes(gpt) == dict(residuals=0, layout=2 * (2 * 327680 * 2880 * 2))
  dl = dataclasses.replace(gpt, op="dlhs", k=2048, residuals=True)
  assert ms.harness_copy_bytes(dl) == dict(
    residuals=2 * 327680 * 2048 * 2, layout=2 * 327680 * 2880 * 2
  )
  assert ms.device_hbm_bytes_per_s("v5p") == 2765e9
  assert ms.device_hbm_bytes_per_s("tpu7x") == 7380e9 / 2


def test_v2_tiles_and_model(problems):
  ps, _ = problems
  p = _find(ps, chip="tpu7x", kernel="v2", op="fwd")
  mc = ms.model_config(p, p.best)
  # calculate_tiling on tpu7x (57.6 MiB limit): tile_m 128 grown to 3 buckets, full k and n.
  assert mc.tiling == (384, 7168, 1024)
  assert mc.extra == dict(bucket_base=128, lhs_buffer_count=2, row_tiles=512)
  # NOTE: a partial bucket's pass costs its rows down to 128 (`generations.min_pass_rows`).
  assert mc.modeled_chip_us == pytest.approx(1240.61, rel=1e-3)
  # One TensorCore's rates and tpu7x's per-step overhead (0.84 µs, not 0.35).
  assert mc.modeled_us == pytest.approx(2552.90, rel=1e-3)
  assert mc.modeled_us - mc.overhead_us == pytest.approx(
    2 * (mc.modeled_chip_us - mc.steps * 0.35), rel=1e-3
  )
  assert mc.overhead_us == pytest.approx(mc.steps * 0.84, rel=1e-9)
  d = _find(ps, chip="v6e", kernel="v2", op="dlhs")
  md = ms.model_config(d, d.best)
  # dlhs: contraction n = 512, output k = 7168; tile_m starts at 256 and grows to 4 buckets.
  assert md.tiling == (1024, 512, 7168)
  assert md.extra == dict(bucket_base=256, lhs_buffer_count=3, row_tiles=256)
  # One TensorCore is the chip; v6e's per-step cost is 0.68 µs (the chip-rate figure's 0.35).
  assert md.modeled_chip_us == pytest.approx(2467.02, rel=1e-3)
  assert md.modeled_us == pytest.approx(2467.02 + md.steps * (0.68 - 0.35), rel=1e-3)


def test_v2_row_tiles_stay_within_groups():
  gs = np.array([5, 0, 300, 17], np.int32)
  gid, lo, hi = impls.megablox_v2_row_tiles(gs, tile_m=128, sublane=8)
  ends = np.cumsum(gs)
  starts = ends - gs
  assert gid.tolist() == [0, 2, 2, 2, 3]
  assert (lo >= starts[gid]).all() and (hi <= ends[gid]).all()
  # The first tile of a group starts mid-sublane and so takes 128 - (start % 8) rows.
  assert (lo.tolist(), hi.tolist()) == ([0, 5, 128, 256, 305], [5, 128, 256, 305, 322])


def test_v2_impl_is_registered_for_the_bench():
  shape = Shape(name="t", tokens=2048, top_k=1, num_groups=4, k=512, n=1024)
  gs = np.array([512, 512, 0, 1024], np.int32)
  case = impls.IMPLS["megablox-v2"].build(op="fwd", shape=shape, group_sizes=gs, generation="v5e")
  (sched,) = case.schedules
  assert case.tiling == (512, 512, 1024) and sched.grid == (1, 4, 1)
  # One k tile: each group's weights are fetched once; lhs and output rows once each.
  assert sched.operand_bytes == dict(
    lhs=2048 * 512 * 2, rhs=3 * 512 * 1024 * 2, out=2048 * 1024 * 2
  )
  with pytest.raises(impls.Unsupported):
    impls.IMPLS["megablox-v2"].build(op="drhs", shape=shape, group_sizes=gs, generation="v5e")


def test_v2_tensorcores_per_kernel():
  # NOTE: v2's TensorCore mesh splits the n tiles between v5p's two cores: with 3 of them the
  # busiest core runs 2 (at one core's rates, half the chip's), with 1 it runs everything. A
  # tpu7x device is one TensorCore; v5e's rates are unchanged.
  from bench import costmodel

  shape = Shape(name="t", tokens=2048, top_k=1, num_groups=4, k=512, n=1024)
  gs = np.array([512, 512, 0, 1024], np.int32)
  sched, _ = impls.megablox_v2_schedule(op="fwd", shape=shape, group_sizes=gs, generation="v5p")
  sched3 = dataclasses.replace(
    sched,
    grid=(3, *sched.grid[1:]),
    steps=3 * sched.steps,
    step_bytes=np.tile(sched.step_bytes, 3),
    step_scale=np.tile(sched.step_scale, 3),
  )
  for s, n_tiles, busiest, cores in ((sched, 1, 1, 1), (sched3, 3, 2, 2)):
    chip = costmodel.cost([s], generation="v5p", tensorcores="chip").calls[0]
    (call,) = costmodel.cost([s], generation="v5p", tensorcores="kernel").calls
    assert call.tensorcores == cores and call.steps == s.steps
    assert call.mxu_us == pytest.approx(2 * chip.mxu_us * busiest / n_tiles, rel=1e-9)
    assert call.dma_us == pytest.approx(2 * chip.dma_us * busiest / n_tiles, rel=1e-9)
    assert call.overhead_us == pytest.approx(chip.overhead_us * busiest / n_tiles, rel=1e-9)
  for gen, factor in (("tpu7x", 2.0), ("v5e", 1.0)):
    chip = costmodel.cost([sched3], generation=gen, tensorcores="chip").calls[0]
    (call,) = costmodel.cost([sched3], generation=gen, tensorcores="kernel").calls
    assert call.tensorcores == 1
    assert call.mxu_us == pytest.approx(factor * chip.mxu_us, rel=1e-9)
    assert call.modeled_us == pytest.approx(
      factor * (chip.modeled_us - chip.overhead_us) + chip.overhead_us, rel=1e-9
    )


def test_v1_runs_on_one_tensorcore(problems):
  # tokamax v1 is a grid-less pallas_call: on v5p its megablox grid is not split between cores,
  # so the whole schedule runs at one core's rates (half the chip's).
  ps, _ = problems
  p = _find(ps, chip="v5p", kernel="v1", op="dlhs")
  shape = Shape(name="t", tokens=2048, top_k=1, num_groups=4, k=512, n=1024)
  gs = np.array([512, 512, 0, 1024], np.int32)
  sched, _ = impls.megablox_v2_schedule(op="fwd", shape=shape, group_sizes=gs, generation="v5p")
  assert sched.dimension_semantics[0] == "parallel"
  assert ms.real_schedules(p, [sched])[0].dimension_semantics is None
  mc = ms.model_config(p, p.best)
  assert mc.modeled_us - mc.overhead_us == pytest.approx(
    2 * (mc.modeled_chip_us - mc.overhead_us), rel=1e-9
  )


def test_cli_prints_the_band_share_and_markdown(capsys, tmp_path):
  out = tmp_path / "m.json"
  assert ms.main(["--cache-dir", str(FIXTURE), "--chip", "v5e", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  # v5e: the forward at 1.03x, the forward under jax.vjp with its output copy.
  assert "v5e    v1     fwd        1    1.03 [1.03, 1.03] 100%" in text
  assert ms.main(["--from-json", str(out), "--markdown"]) == 0
  assert "| **v5e** | **all** |  | 2 |" in capsys.readouterr().out


def test_compiled_restated_charges_the_excess(problems, monkeypatch):
  """`compiled_restated` passes the measured tiles and group sizes to bench.llo and charges
  bound - MXU on the modeled schedule (the compile itself is stubbed: tests/bench/test_llo.py)."""
  from bench import llo

  ps, _ = problems
  p = _find(ps, chip="v5e", kernel="v1", op="fwd")
  mc = ms.model_config(p, p.best)
  seen = {}

  def fake(**kw):
    seen.update(kw)
    rep = dataclasses.make_dataclass("R", ["issue_us", "mxu_us", "bound_us"])
    return [rep(issue_us=900.0, mxu_us=mc.mxu_us, bound_us=mc.mxu_us + 100.0)]

  monkeypatch.setattr(llo, "analyze_case", fake)
  comp = ms.compiled_restated(p, p.best, cache_dir="unused", mxu_rows_per_cycle=2)
  assert seen["tiling"] == (1024, 512, 1024) and seen["mxu_rows_per_cycle"] == 2
  assert list(seen["group_sizes"]) == list(p.group_sizes)
  assert comp["excess_us"] == pytest.approx(100.0)
  # NOTE: every step is MXU-bound here, so the whole excess adds to the modeled time.
  assert comp["restated_us"] == pytest.approx(mc.modeled_us + 100.0, rel=1e-6)
  assert comp["ratio"] == pytest.approx(mc.measured_us / comp["restated_us"])
  v5p = _find(ps, chip="v5p", kernel="v1", op="dlhs")
  with pytest.raises(ValueError, match="megacore"):
    ms.compiled_restated(v5p, v5p.best, cache_dir="unused")
