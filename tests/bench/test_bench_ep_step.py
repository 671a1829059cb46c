"""bench.ep, the modeled EP step: the ICI hop model, the wire bytes, the pipeline bound, the CLI,
its expert placements (as `MoEConfig.expert_placement` takes them) and its chunk counts (as
`pallas_moe.batch_split` holds them)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bench import ep
from pallas_moe.config import MoEConfig


def _uniform(n, b=1.0):
  return np.full((n, n), b)


@pytest.mark.parametrize("n", [4, 6, 8])
def test_ring_torus_uniform_by_hand(n):
  # NOTE: on a ring of even n with wraparound, link i -> i+1 carries the flows that start at
  # most d-1 hops behind it and go d hops forward (d = 1 .. n/2 - 1: d flows each) plus half of
  # the antipodal flows (n/2 of them): sum_{d<n/2} d + n/4 = n^2/8.
  loads = ep.link_loads(traffic=_uniform(n), sl=ep.Slice(shape=(n,), wrap=(True,)))
  np.testing.assert_allclose(loads, n * n / 8)


def test_line_uniform_by_hand():
  # NOTE: a line of 4 without wraparound: the middle link carries the 2 x 2 pairs across it.
  loads = ep.link_loads(traffic=_uniform(4), sl=ep.Slice(shape=(4,), wrap=(False,)))
  assert loads.reshape(4, 2)[1, 0] == 4  # link 1 -> 2
  assert loads.reshape(4, 2)[0, 0] == 3  # link 0 -> 1: 0 sends to 1, 2, 3
  assert loads.reshape(4, 2)[0, 1] == 0  # no link 0 -> -1
  assert loads.max() == 4


def test_2d_torus_uniform_by_hand():
  # NOTE: 4x4 torus, dimension-ordered: each axis-0 ring carries its 4-ring load (2 per unit)
  # for each of the 4 destination columns; each axis-1 ring, for each of the 4 source rows.
  loads = ep.link_loads(traffic=_uniform(16), sl=ep.Slice(shape=(4, 4), wrap=(True, True)))
  np.testing.assert_allclose(loads, 8.0)


def test_all_to_all_time_and_self_traffic():
  sl = ep.Slice(shape=(4,), wrap=(True,))
  b = 1e9
  t = ep.all_to_all_us(traffic=_uniform(4, b), chip="v6e", sl=sl, latency=False)
  assert t == pytest.approx(2 * b / ep.CHIPS["v6e"].link_bytes_per_s * 1e6)
  # NOTE: rows a device keeps cost no ICI.
  assert ep.all_to_all_us(traffic=np.eye(4) * b, chip="v6e", sl=sl, latency=False) == 0.0
  with_lat = ep.all_to_all_us(traffic=_uniform(4, b), chip="v6e", sl=sl)
  assert with_lat - t == pytest.approx(ep.ALPHA_COLLECTIVE_US + ep.ALPHA_HOP_US * sl.diameter)


def test_chip_figures_and_slices():
  assert ep.CHIPS["v5e"].link_bytes_per_s == pytest.approx(50e9)
  assert ep.CHIPS["v6e"].link_bytes_per_s == pytest.approx(100e9)
  assert ep.CHIPS["v5p"].link_bytes_per_s == pytest.approx(100e9)
  assert ep.slice_for(chip="v5p", ep=64).wrap == (True, True, True)
  assert ep.slice_for(chip="v5p", ep=32).wrap == (False, False, False)
  assert ep.slice_for(chip="v6e", ep=64) == ep.Slice(shape=(8, 8), wrap=(False, False))
  assert ep.slice_for(chip="v6e", ep=64, wraparound=True).wrap == (True, True)


@pytest.mark.parametrize("buffer_rows", [1, 37, 60, 10_000])
def test_traffic_rows_match_the_blocks_plan(buffer_rows):
  from pallas_moe import collectives

  g, s = 4, 3
  counts = np.random.default_rng(1).integers(0, 9, size=(g, g * s)).astype(np.int32)

  def sent(c):
    plan = collectives.plan_from_send_counts(c, axis_name="x", buffer_rows=buffer_rows)
    return plan.dispatch_args[1].reshape(g, s).sum(axis=1)

  mesh = jax.make_mesh(
    (g,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:g]
  )
  f = jax.jit(jax.shard_map(sent, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  want = np.asarray(f(jnp.asarray(counts.reshape(-1)))).reshape(g, g)
  got = ep.traffic_rows(send_counts=counts, buffer_rows=buffer_rows)
  np.testing.assert_array_equal(got, want)


def test_pipeline_limits():
  # c = 1 is serial.
  assert ep.pipeline_us(comm_in=[3.0], gmm=[5.0], comm_out=[2.0]) == 10.0
  comm_in, comm_out, gmm = 300.0, 200.0, 1000.0
  for c in (1, 2, 8, 64, 512):
    t = ep.pipeline_us(comm_in=[comm_in / c] * c, gmm=[gmm / c] * c, comm_out=[comm_out / c] * c)
    # NOTE: compute-bound: the core's total plus the first dispatch and the last combine.
    assert t == pytest.approx(gmm + (comm_in + comm_out) / c)
  # NOTE: comm-bound: the ICI never idles (out_{i-1} between in_i and out_i covers gmm_i),
  # so the step is the ICI's total: max(comm, compute) with no fill.
  c = 100
  t = ep.pipeline_us(comm_in=[10.0] * c, gmm=[1.0] * c, comm_out=[10.0] * c)
  assert t == pytest.approx(2000.0)
  # NOTE: in general the pipeline bound: max(comm, compute) <= t <= that + one chunk of each.
  for g in (5.0, 15.0, 19.0, 25.0, 40.0):
    t = ep.pipeline_us(comm_in=[10.0] * c, gmm=[g] * c, comm_out=[10.0] * c)
    assert max(2000.0, g * c) <= t <= max(2000.0, g * c) + 10.0 + g + 10.0


def test_placement_cannot_help_uniform_on_a_torus():
  rows = np.full((8, 8), 100)
  st = ep.placement_study(rows=rows, sl=ep.Slice(shape=(8,), wrap=(True,)), iters=50)
  assert st["best"] == st["base"]


def test_default_batch_split_is_a_divisor():
  for key, c in ep.DEFAULT_BATCH_SPLIT.items():
    assert c >= 1 and key[2] % c == 0
  assert ep.default_batch_split(model="deepseek-v3", ep=32, tokens_per_device=16384, chip="v6e") > 1
  assert ep.default_batch_split(model="nope", ep=8, tokens_per_device=4096, chip="v6e") == 1


def test_cli_tiny(tmp_path, capsys):
  out = tmp_path / "ep.json"
  ep.main(
    [
      "--models=deepseek-v2-lite",
      "--ep=8",
      "--tokens=256",
      "--chips=v6e",
      "--chunks=1,2",
      "--placement",
      f"--json={out}",
      f"--markdown={tmp_path / 'ep.md'}",
    ]
  )
  rec = json.loads(out.read_text())["steps"][0]
  assert rec["chunked"]["1"]["step_us"] == pytest.approx(rec["serial_us"])
  assert rec["compute_only_us"] == pytest.approx(rec["gmm_fwd_us"] + rec["gmm_bwd_us"])
  # NOTE: uniform dispatch of 256 tokens x 6 rows x d_model 2048 bf16, 7/8 of it off-device.
  assert rec["dispatch_mb"] == pytest.approx(256 * 6 * 2048 * 2 * 7 / 8 / 1e6, rel=0.1)
  assert "Modeled EP step" in capsys.readouterr().out
  opts = {r["option"]: r for r in json.loads(out.read_text())["options"]}
  assert set(opts) == {"plain", "dedup", "dedup+int8", "dedup+fp8"}
  # NOTE: dedup sends 4.43 of 6 rows per token (uniform, 8 experts per device); int8 ~halves
  # the forward dispatch's row bytes; the backward stays bf16.
  ratio = opts["dedup"]["wire_rows_per_token"] / opts["plain"]["wire_rows_per_token"]
  assert ratio == pytest.approx(4.43 / 6, rel=0.05)  # busiest sender of a 256-token draw
  assert opts["dedup+int8"]["dispatch_row_bytes"] == 2560  # 2048 + 4 + 6 * 5, padded
  assert opts["dedup+int8"]["ici_bwd_us"] == pytest.approx(opts["dedup"]["ici_bwd_us"])
  assert (
    opts["dedup+int8"]["ici_fwd_us"] < opts["dedup"]["ici_fwd_us"] < opts["plain"]["ici_fwd_us"]
  )
  assert opts["dedup"]["local_us"] > 0


def test_dedup_fraction_and_row_bytes():
  """Deduplicated rows per (token, choice) row: exact for uniform routing, sampled for Zipf
  (between 1 / min(k, E_l) and 1); the dispatched row's bytes per format."""
  from pallas_moe.dedup import expected_destinations

  u = ep.dedup_fraction(model="qwen3-30b-a3b", ep=8, routing="uniform")
  r = expected_destinations(num_experts=128, top_k=8, expert_parallelism=8)
  np.testing.assert_allclose(u, r / 8)
  z = ep.dedup_fraction(model="qwen3-30b-a3b", ep=8, routing="zipf", samples=2048)
  assert ((z >= 1 / 8) & (z <= 1)).all() and z.std() > 0
  assert ep.dedup_fraction(model="mixtral-8x7b", ep=8, routing="uniform").tolist() == [1.0] * 8
  kw = dict(d=7168, top_k=8, num_local=8)
  assert ep.dispatch_row_bytes(**kw, dedup=False, quant=None) == 2 * 7168
  # NOTE: rows pad to 128 32-bit words in the TPU exchange (`dedup.wire_row_bytes`).
  assert ep.dispatch_row_bytes(**kw, dedup=False, quant="fp8") == 7680  # 7168 + 4 * 56
  assert ep.dispatch_row_bytes(**kw, dedup=True, quant="int8") == 7680  # 7168 + 4 + 8 * 5
  assert ep.dispatch_row_bytes(**kw, dedup=True, quant=None) == 2 * 7424  # 7168 + 18 words


def test_topology_aware_placement_is_a_block_permutation_that_helps_zipf_on_a_mesh():
  counts = ep._send_counts(model="deepseek-v2-lite", ep=8, tokens=1024, routing="zipf")
  order = ep.topology_aware_placement(send_counts=counts, chip="v6e", iters=200)
  e, local = counts.shape[1], counts.shape[1] // 8
  assert sorted(order.tolist()) == list(range(e))
  # NOTE: whole blocks of E_l consecutive experts move together (the block's layout).
  blocks = order.reshape(8, local)
  assert (np.diff(blocks, axis=1) == 1).all() and (blocks[:, 0] % local == 0).all()
  sl = ep.slice_for(chip="v6e", ep=8)
  big = int(counts.sum()) + 1

  def busiest(c):
    rows = ep.traffic_rows(send_counts=c, buffer_rows=big)
    return ep.link_loads(traffic=rows, sl=sl).max() + ep.link_loads(traffic=rows.T, sl=sl).max()

  # NOTE: slot j holds expert order[j]: the placed counts are the columns in slot order.
  assert busiest(counts[:, order]) < 0.95 * busiest(counts)
  # The block's use: weights in slot order, ids mapped to slots, the same weight per choice.
  w = np.random.default_rng(0).standard_normal((e, 3))
  ids = np.random.default_rng(1).integers(0, e, (16, 6))
  slot = np.argsort(order)[ids]
  np.testing.assert_array_equal(w[order][slot], w[ids])


def test_topology_aware_placement_is_accepted():
  """bench.ep's order for a Zipf-skewed small case is a permutation the config takes."""
  rng = np.random.default_rng(0)
  counts = rng.zipf(1.5, size=(4, 8))
  order = ep.topology_aware_placement(send_counts=counts, chip="v6e", iters=50)
  config = MoEConfig(num_experts=8, top_k=2, d_model=32, expert_ffn_dim=16, expert_placement=order)
  assert config.expert_placement == tuple(order.tolist())


def test_library_batch_split_tables_are_the_modeled_choice():
  """`pallas_moe.batch_split`'s tables are `bench.ep`'s modeled chunk counts, keyed by the
  layer's dims instead of the model's name (tests/layer/test_batch_split.py: where they apply)."""
  from bench.shapes import SHAPES
  from pallas_moe import batch_split

  def by_dims(table):
    return {
      (SHAPES[m].num_groups, SHAPES[m].top_k, SHAPES[m].k, SHAPES[m].n, e, t, chip): c
      for (m, e, t, chip), c in table.items()
    }

  assert batch_split.MODELED_BATCH_SPLIT == by_dims(ep.DEFAULT_BATCH_SPLIT)
  assert batch_split.MODELED_BATCH_SPLIT_DEDUP == by_dims(ep.DEFAULT_BATCH_SPLIT_DEDUP)
