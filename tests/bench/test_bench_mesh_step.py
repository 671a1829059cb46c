"""bench.mesh_step: the collective bytes and times by hand, the memory model, the enumeration,
the tables and the CLI (on a fabricated `ep.case_row` cache: no cost-model run)."""

import json
import os

import pytest

from bench import ep, mesh_step
from bench.shapes import SHAPES

LINK = 100e9  # v5p and v6e: one link, one way
ALPHA = ep.ALPHA_COLLECTIVE_US


@pytest.fixture(autouse=True)
def _restore_shapes():
  # NOTE: `mesh_step.tp_shape` registers "<model>/tp<n>" in the shared SHAPES dict; other tests
  # compare SHAPES with the benchmark's fixed list.
  saved = dict(SHAPES)
  yield
  SHAPES.clear()
  SHAPES.update(saved)


def _ep_row(*, best_us=20_000.0, chunks=1, buffer_rows=65536):
  return dict(
    best_us=best_us,
    best_chunks=chunks,
    ici_fwd_us=0.0,
    ici_bwd_us=0.0,
    gmm_fwd_us=0.0,
    gmm_bwd_us=0.0,
    serial_us=best_us,
    slice="2x2x2 mesh",
    buffer_rows=buffer_rows,
  )


def _mesh(data=1, fsdp=1, tensor=1, expert=1):
  return dict(data=data, fsdp=fsdp, tensor=tensor, expert=expert)


def test_gathered_bytes_deepseek_v3_ep8_by_hand():
  # NOTE: d = 7168, E = 256, f = 2048, one shared expert of 2048; ep 8 -> 32 local experts.
  got = mesh_step.gathered_bytes("deepseek-v3", ep=8, tp=1)
  assert got == dict(
    wi=32 * 7168 * 4096 * 2,
    wo=32 * 2048 * 7168 * 2,
    shared_wi=7168 * 4096 * 2,
    shared_wo=2048 * 7168 * 2,
    router=7168 * 256 * 2,
  )
  assert sum(got.values()) == 2_910_322_688
  tp2 = mesh_step.gathered_bytes("deepseek-v3", ep=8, tp=2)
  assert tp2["wi"] == got["wi"] // 2 and tp2["shared_wo"] == got["shared_wo"] // 2
  assert tp2["router"] == got["router"]  # the router is not split over tensor
  assert "shared_wi" not in mesh_step.gathered_bytes("qwen3-30b-a3b", ep=8, tp=1)


def test_fsdp4_time_deepseek_v3_ep8_by_hand():
  # NOTE: all-gather: 3/4 of 2.91 GB over 2 links of 100 GB/s = 10.91 ms; the reduce-scatter the
  # same; 5 weight arrays, one alpha each, each way.
  ag = 0.75 * 2_910_322_688 / (2 * LINK) * 1e6
  assert ag == pytest.approx(10_913.71, abs=0.01)
  parts = mesh_step.step_parts(
    model="deepseek-v3",
    mesh=_mesh(fsdp=4, expert=8),
    chip="v5p",
    tokens=4096,
    ep_row=_ep_row(),
  )
  assert parts["fsdp_us"] == pytest.approx(2 * (ag + 5 * ALPHA))
  assert parts["tensor_us"] == 0.0
  # NOTE: only the shared experts and the router are replicated (over expert = 8): their
  # fsdp shares' all-reduce, three arrays.
  shared = (7168 * 4096 + 2048 * 7168 + 7168 * 256) * 2 / 4
  assert parts["allreduce_us"] == pytest.approx(2 * 7 / 8 * shared / (2 * LINK) * 1e6 + 3 * ALPHA)
  assert parts["step_us"] == pytest.approx(
    parts["ep_us"] + parts["fsdp_us"] + parts["allreduce_us"]
  )


def test_ring_collective_formulas():
  b = 1e9
  assert mesh_step.ring_collective_us(b, group=1, chip="v6e", kind="all_gather") == 0.0
  ag = mesh_step.ring_collective_us(b, group=4, chip="v6e", kind="all_gather")
  assert ag == pytest.approx(3 / 4 * b / (2 * LINK) * 1e6 + ALPHA)
  ar = mesh_step.ring_collective_us(b, group=4, chip="v6e", kind="all_reduce")
  assert ar - ALPHA == pytest.approx(2 * (ag - ALPHA))
  pp = mesh_step.ring_collective_us(b, group=2, chip="v6e", kind="ppermute")
  assert pp == pytest.approx(b / LINK * 1e6 + ALPHA)


@pytest.mark.parametrize("tp,perms", [(2, 1), (4, 2)])
def test_tensor_time_by_hand(tp, perms):
  t, d, f, s, rows = 4096, 7168, 2048, 2048, 65536
  parts = mesh_step.step_parts(
    model="deepseek-v3",
    mesh=_mesh(tensor=tp, expert=8),
    chip="v5p",
    tokens=t,
    ep_row=_ep_row(buffer_rows=rows),
    allreduce=False,
  )
  reduce = 2 * (tp - 1) / tp * t * d * 2 / (2 * LINK) * 1e6 + ALPHA
  pair = rows * f // tp * 2 / LINK * 1e6 + ALPHA
  pair_shared = t * s // tp * 2 / LINK * 1e6 + ALPHA
  # NOTE: forward and backward each: one all-reduce, `perms` ppermutes of each pairing.
  want = 2 * reduce + 2 * perms * (pair + pair_shared)
  assert parts["tensor_us"] == pytest.approx(want)
  assert parts["fsdp_us"] == 0.0 and parts["allreduce_us"] == 0.0


def test_before_mesh_pays_the_data_all_reduce_fsdp_the_gathers():
  kw = dict(model="deepseek-v3", chip="v5p", tokens=4096, ep_row=_ep_row())
  before = mesh_step.step_parts(mesh=_mesh(data=4, expert=8), **kw)
  after = mesh_step.step_parts(mesh=_mesh(fsdp=4, expert=8), **kw)
  assert before["fsdp_us"] == 0.0 and before["allreduce_us"] > 0.0
  # NOTE: an all-reduce moves what an all-gather and a reduce-scatter together move.
  assert before["allreduce_us"] == pytest.approx(after["fsdp_us"] + after["allreduce_us"], rel=0.02)
  literal = mesh_step.step_parts(mesh=_mesh(data=4, expert=8), allreduce=False, **kw)
  assert literal["step_us"] == literal["ep_us"]


def test_memory_before_exceeds_fsdp_and_matches_hand():
  rows = 65536
  before = mesh_step.memory(model="deepseek-v3", mesh=_mesh(data=4, expert=8), buffer_rows=rows)
  fsdp = mesh_step.memory(model="deepseek-v3", mesh=_mesh(fsdp=4, expert=8), buffer_rows=rows)
  assert before["memory_gb"] > fsdp["memory_gb"]
  assert before["state_layer_gb"] == pytest.approx(4 * fsdp["state_layer_gb"])
  assert before["temp_layer_gb"] == pytest.approx(fsdp["temp_layer_gb"])
  routed, shared, router = 256 * 3 * 7168 * 2048, 3 * 7168 * 2048, 7168 * 256
  assert fsdp["state_layer_gb"] == pytest.approx(12 * (routed / 32 + shared / 4 + router / 4) / 1e9)
  assert fsdp["working_gb"] == pytest.approx((routed / 8 + shared + router) * 2 * 2 / 1e9)
  act = rows * (7168 + 2 * 2048 + 2048 + 7168) * 2 * 3 / 1e9
  assert fsdp["activation_gb"] == pytest.approx(act)
  assert fsdp["memory_gb"] == pytest.approx(58 * fsdp["state_layer_gb"] + fsdp["working_gb"] + act)
  tp2 = mesh_step.memory(
    model="deepseek-v3", mesh=_mesh(fsdp=2, tensor=2, expert=8), buffer_rows=rows
  )
  assert tp2["activation_gb"] < fsdp["activation_gb"]


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("chip,n", [("v5p", 32), ("v6e", 256)])
def test_meshes_are_valid_and_complete(model, chip, n):
  base = SHAPES[model]
  got = mesh_step.meshes(model=model, chip=chip, chips=n)
  labels = [mesh_step.mesh_label(m) for m in got]
  assert len(set(labels)) == len(labels)
  for m in got:
    assert m["data"] * m["fsdp"] * m["tensor"] * m["expert"] == n
    assert base.num_groups % m["expert"] == 0
    assert base.n % m["tensor"] == 0 and m["tensor"] in (1, 2, 4)
    assert base.k % m["fsdp"] == 0
    ep.slice_for(chip=chip, ep=m["expert"])  # raises without a slice shape
  # NOTE: a brute force over all 4-way splits finds the same set.
  slices = ep._SHAPES_3D if chip == "v5p" else ep._SHAPES_2D
  want = {
    f"{n // (f * t * e)}x{f}x{t}x{e}"
    for t in (1, 2, 4)
    for e in slices
    for f in range(1, n + 1)
    if n % (f * t * e) == 0 and base.num_groups % e == 0 and base.k % f == 0 and base.n % t == 0
  }
  assert set(labels) == want
  assert any(mesh_step.is_before(m) and m["data"] > 1 for m in got)


def test_tp_shape_registers_the_split_width():
  name = mesh_step.tp_shape("qwen3-30b-a3b", 4)
  assert name == "qwen3-30b-a3b/tp4"
  assert SHAPES[name].n == 768 // 4 and SHAPES[name].num_groups == 128
  assert mesh_step.tp_shape("qwen3-30b-a3b", 1) == "qwen3-30b-a3b"


def test_record_batch_and_fit():
  rec = mesh_step.mesh_record(
    model="qwen3-30b-a3b",
    chip="v6e",
    chips=32,
    tokens=4096,
    mesh=_mesh(data=2, tensor=2, expert=8),
    ep_row=_ep_row(),
  )
  assert rec["batch_us"] == pytest.approx(2 * rec["step_us"])
  assert rec["global_tokens"] == 4096 * 32 // 2
  assert rec["fits"] == (rec["memory_gb"] <= 32.0)
  assert rec["label"] == "2x1x2x8" and not rec["before"]


def _seed_cache(folder, *, model, chip, tokens, eps, tps):
  os.makedirs(folder, exist_ok=True)
  for e in eps:
    for t in tps:
      key = f"{model}-tp{t}-ep{e}-T{tokens}-{chip}-{mesh_step.POLICY}-{mesh_step.ROUTING}.json"
      row = _ep_row(best_us=10_000.0 / t + 100.0 * e, buffer_rows=2 * tokens * 2)
      with open(os.path.join(folder, key), "w") as fh:
        json.dump(row, fh)


def test_cli_on_a_seeded_cache(tmp_path, capsys):
  cache = tmp_path / "cache"
  _seed_cache(str(cache), model="mixtral-8x7b", chip="v5p", tokens=4096, eps=(4, 8), tps=(1, 2, 4))
  out_json, out_md = tmp_path / "o.json", tmp_path / "o.md"
  mesh_step.main(
    [
      "--models=mixtral-8x7b",
      "--chips=v5p",
      "--counts=32",
      f"--cache={cache}",
      f"--json={out_json}",
      f"--markdown={out_md}",
      "--scale_memory=",
      "--header=# test",
    ]
  )
  recs = json.loads(out_json.read_text())["records"]
  assert len(recs) == len(mesh_step.meshes(model="mixtral-8x7b", chip="v5p", chips=32))
  md = out_md.read_text()
  assert md.startswith("# test") and "### Summary" in md and "mixtral-8x7b, v5p x 32" in md
  fastest = mesh_step.best(recs, fits=True)
  assert fastest is not None and fastest["label"] in md
  assert "Summary" in capsys.readouterr().out


def test_tables_on_fabricated_records():
  def rec(mesh, best_us):
    return mesh_step.mesh_record(
      model="qwen3-30b-a3b",
      chip="v5p",
      chips=32,
      tokens=4096,
      mesh=mesh,
      ep_row=_ep_row(best_us=best_us),
    )

  recs = [
    rec(_mesh(data=4, expert=8), 20_000.0),
    rec(_mesh(fsdp=4, expert=8), 20_000.0),
    rec(_mesh(expert=32), 90_000.0),
  ]
  assert all(r["fits"] for r in recs)
  # NOTE: fsdp4 pays 2 alphas per weight where the data all-reduce pays 1 (the same bytes): a
  # tie within RANK_TIE, won by fsdp4's smaller memory; ep32 is slow.
  by_step = sorted(recs, key=lambda r: r["batch_us"])
  assert [r["label"] for r in by_step] == ["4x1x1x8", "1x4x1x8", "1x1x1x32"]
  assert by_step[1]["batch_us"] <= by_step[0]["batch_us"] * (1 + mesh_step.RANK_TIE)
  assert by_step[1]["memory_gb"] < by_step[0]["memory_gb"]
  assert mesh_step.best(recs)["label"] == "1x4x1x8"
  assert mesh_step.best(recs, before=True)["label"] == "4x1x1x8"
  assert mesh_step.best(recs, fits=False) is None
  summary = mesh_step.summary_table(recs)
  assert "| qwen3-30b-a3b | v5p | 32 | 1x4x1x8 |" in summary
  assert "4x1x1x8: " in summary and "(fits)" in summary
  tables = mesh_step.mesh_tables(recs, markdown=True)
  rows = [line.split(" | ") for line in tables.splitlines() if line[2:3].isdigit()]
  assert [(r[0], r[-1]) for r in rows] == [
    ("| 1x4x1x8", "chosen |"),
    ("| 4x1x1x8", "(before) |"),
    ("| 1x1x1x32", "(before) |"),
  ]


def test_calibration_on_a_fabricated_record():
  rec = dict(
    case="v5p-32 fsdp4 x ep8",
    topology="v5p:2x4x4",
    mesh=dict(fsdp=4, expert=8),
    tokens_per_device=4096,
    argument_gb=4.4,
    temp_gb=12.0,
  )
  rows = mesh_step.calibration([rec, dict(case="broken", error="x")])
  assert len(rows) == 1
  mem = mesh_step.memory(model="deepseek-v3", mesh=_mesh(fsdp=4, expert=8), buffer_rows=65536)
  assert rows[0]["state_gb"] == pytest.approx(mem["state_layer_gb"])
  assert rows[0]["temp_gb"] == pytest.approx(mem["temp_layer_gb"])
  assert "v5p-32 fsdp4 x ep8" in mesh_step.calibration_table(rows)


def test_summary_when_nothing_fits():
  recs = [
    mesh_step.mesh_record(
      model="deepseek-v3", chip="v6e", chips=32, tokens=4096, mesh=m, ep_row=_ep_row()
    )
    for m in (_mesh(data=4, expert=8), _mesh(fsdp=4, expert=8))
  ]
  assert not any(r["fits"] for r in recs)
  assert mesh_step.best(recs, fits=True) is None
  summary = mesh_step.summary_table(recs)
  assert "none fits (least memory: 1x4x1x8" in summary
  assert "4x1x1x8: " in summary and "(does not fit)" in summary
  assert "least memory" in mesh_step.mesh_tables(recs)
