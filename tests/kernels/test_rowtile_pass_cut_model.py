"""The picker's closed-form model of the row-tile gmm on pass-cut tiles (`metadata.pass_cut_rows`):
a group pays exactly the passes of its own pass grid however many tiles it spans, the grid has
one step per pass-cut tile and sweep, and where the kernel keeps fixed m-tiles
(`metadata.uses_pass_cuts` false) the model is the fixed-tile one."""

import numpy as np
import pytest
from kernel_testing import pushed_rows

from pallas_moe import metadata, schedule_cost, tile_pickers, tiling

# NOTE: v6e gmm with tn a multiple of its 256-wide MXU passes 128 rows (`pass_rows`); bf16 rows
# align passes to 16 (`gmm_pass_align`); two n sweeps.
_GEN, _K, _N, _TN = "v6e", 256, 512, 256


def _kw(gs, *, tm, buffer_rows=None, unowned_rows="zero"):
  return dict(
    group_sizes=gs, k=_K, n=_N, tm=tm, tk=_K, tn=_TN, kind="gmm", lhs_itemsize=2,
    rhs_itemsize=2, out_itemsize=2, generation=_GEN, buffer_rows=buffer_rows,
    unowned_rows=unowned_rows,
  )  # fmt: skip


def _passes_per_step(gs, *, tm, fixed_tiles=False, **kw):
  """MXU passes of each grid step: the model's MXU seconds at a peak of one pass per second."""
  sub = tiling.pass_rows(tm, _GEN, kind="gmm", tn=_TN)
  assert not tiling.rows_stationary_pays(kind="gmm", sub_m=sub, tk=_K, tn=_TN, generation=_GEN)
  gen = tiling.get_generation(_GEN)
  macs = schedule_cost._dot_macs(
    rows=sub, contract=_K, cols=_TN, mxu=gen.mxu_size, min_rows=tiling.min_pass_rows(gen)
  )
  mxu, over, exposed = tiling.rowtile_step_costs(
    **_kw(gs, tm=tm, **kw), peak_flops=2.0 * macs, fixed_tiles=fixed_tiles
  )
  assert mxu.shape == over.shape == exposed.shape
  return mxu, sub


@pytest.mark.parametrize("unowned_rows", ["zero", "undefined"])
def test_pass_cut_mxu_rows_are_the_pass_floor(unowned_rows):
  """Per sweep, the MXU rows are at most Σ_g ceil((e_g - align_down(s_g, 16)) / sub_m) * sub_m
  (no partial pass where a tile boundary cuts a group), exactly the kernel's passes on the cut
  tiles (a group's last two in a tile as one widened pass of 192 rows where the last would hold
  at most 64 of its rows), at most the fixed tiles' and, over a few draws, fewer; the per-step
  arrays hold num_tiles x sweeps steps."""
  tm, align, sweeps = 512, 16, _N // _TN
  saved = 0
  for seed in range(4):
    rng = np.random.default_rng(seed)
    gs = rng.multinomial(int(rng.integers(2000, 5000)), np.full(12, 1 / 12))
    gs[rng.random(12) < 0.2] = 0  # empty groups too
    rows = int(gs.sum())
    buffer_rows = rows + int(rng.integers(0, 700))
    ends = np.cumsum(gs)
    starts = ends - gs
    assert metadata.uses_pass_cuts(m=buffer_rows, tm=tm, sub_m=128, align=align)
    cut_steps, sub = _passes_per_step(gs, tm=tm, buffer_rows=buffer_rows, unowned_rows=unowned_rows)
    fixed_steps, _ = _passes_per_step(
      gs, tm=tm, buffer_rows=buffer_rows, unowned_rows=unowned_rows, fixed_tiles=True
    )
    assert sub == 128
    floor = np.where(gs > 0, -(-(ends - starts // align * align) // sub), 0).sum() * sub
    cuts = metadata.pass_cut_rows(
      starts=starts, ends=ends, first_row=0, fixed_end=min(-(-rows // tm) * tm, buffer_rows),
      m=buffer_rows, tm=tm, sub_m=sub, align=align,
      write_whole_tiles=unowned_rows != "undefined", xp=np,
    )  # fmt: skip
    num_tiles = int(cuts["num_tiles"][0])
    assert cut_steps.size == num_tiles * sweeps, seed
    assert fixed_steps.size == -(-rows // tm) * sweeps, seed
    per_sweep = cut_steps.reshape(sweeps, num_tiles)
    assert (per_sweep == per_sweep[0]).all()
    c = cuts["tile_start"]
    want = [
      sum(
        pushed_rows(
          max(starts[g], c[t]) - c[t],
          min(ends[g], c[t + 1]) - c[t],
          ends[g] - c[t],
          sub_m=sub,
          align=align,
          tail=64,
          tm=tm,
        )  # fmt: skip
        for g in range(cuts["tile_first_group"][t], cuts["tile_last_group"][t] + 1)
        if gs[g] > 0 and min(ends[g], c[t + 1]) > max(starts[g], c[t])
      )
      for t in range(num_tiles)
    ]
    np.testing.assert_allclose(per_sweep[0] * sub, want, err_msg=str(seed))
    assert per_sweep[0].sum() * sub <= floor, seed
    fixed = fixed_steps.reshape(sweeps, -1)[0].sum() * sub
    assert per_sweep[0].sum() * sub <= fixed, seed
    saved += fixed - per_sweep[0].sum() * sub
  assert saved > 0


def test_pass_cut_weight_loads_each_once():
  """Every non-empty group's weight block is loaded once per sweep on pass-cut tiles, spread
  over the work before it or exposed; without sequential sweeps each sweep's first load is
  exposed, in its first step."""
  gs = np.array([300, 0, 450, 77, 0, 610, 5, 290, 0])
  ends = np.cumsum(gs)
  starts = ends - gs
  cuts = metadata.pass_cut_rows(
    starts=starts, ends=ends, first_row=0, fixed_end=2048, m=2048, tm=512, sub_m=128, align=16,
    write_whole_tiles=True, xp=np,
  )  # fmt: skip
  num_tiles = int(cuts["num_tiles"][0])
  over, exposed = tiling.rowtile_manual_dma(
    starts=starts, ends=ends, m=2048, tm=512, sub_m=128, kind="gmm", sweeps=2, block_bytes=100.0,
    sequential_sweeps=False, align=16, cuts=cuts,
  )  # fmt: skip
  assert over.size == exposed.size == 2 * num_tiles
  np.testing.assert_allclose((over + exposed).sum(), 2 * 100.0 * np.count_nonzero(gs))
  np.testing.assert_allclose(exposed.reshape(2, num_tiles)[:, 0], [100.0, 100.0])
  assert exposed.sum() == 200.0
  with pytest.raises(ValueError, match="cuts"):
    tiling.rowtile_manual_dma(
      starts=starts, ends=ends, m=2048, tm=512, sub_m=128, kind="tgmm", sweeps=1,
      block_bytes=1.0, sequential_sweeps=False, cuts=cuts,
    )  # fmt: skip


@pytest.mark.parametrize(
  "tm, tn, buffer_rows",
  [
    (128, 256, None),  # tm < 2 sub_m (one 128-row pass per tile)
    (4096, 256, 4096),  # m <= tm (one tile)
    (256, 128, None),  # tn off the MXU width: 256-row passes, align == sub_m
  ],
)
def test_without_pass_cuts_the_model_is_the_fixed_tiles_one(tm, tn, buffer_rows):
  gs = np.random.default_rng(0).multinomial(3000, np.full(8, 1 / 8))
  kw = _kw(gs, tm=tm, buffer_rows=buffer_rows) | dict(tn=tn)
  sub = tiling.pass_rows(tm, _GEN, kind="gmm", tn=tn)
  align = tiling.gmm_pass_align(sub_m=sub, tm=tm, lhs_itemsize=2, out_itemsize=2)
  m = max(3000, buffer_rows or 0)
  assert not metadata.uses_pass_cuts(m=m, tm=tm, sub_m=sub, align=align)
  got = tiling.rowtile_step_costs(**kw)
  fixed = tiling.rowtile_step_costs(**kw, fixed_tiles=True)
  assert got[0].size == -(-3000 // tm) * (_N // tn)
  for a, b in zip(got, fixed, strict=True):
    np.testing.assert_array_equal(a, b)
  assert tiling.rowtile_modeled_seconds(**kw) == tiling.rowtile_modeled_seconds(
    **kw, fixed_tiles=True
  )


@pytest.mark.parametrize(
  "gen, dims, tiles, want",
  [
    # MXU-bound steps: the partial passes saved outweigh a few more grid steps.
    ("v5e", (131072, 4096, 1536, 128), (1024, 4096, 768), True),
    ("tpu7x", (131072, 4096, 1536, 128), (1024, 4096, 768), True),
    # HBM-bound steps on v6e: the saved MXU time is hidden, the extra steps are not.
    ("v6e", (262144, 7168, 1024, 256), (1024, 7168, 1024), False),
    # One pass per tile: nothing to cut.
    ("v6e", (131072, 4096, 1536, 128), (128, 4096, 768), False),
  ],
  ids=str,
)
def test_pass_cuts_pay_where_the_model_says(gen, dims, tiles, want):
  """`rowtile_pass_cuts_pay` (what ops runs the kernel with) is the model's comparison of the
  two tile layouts on the picker's draws, and the picker scores gmm tiles at the better one."""
  import jax.numpy as jnp

  m, k, n, g = dims
  dtypes = dict(lhs_dtype=jnp.bfloat16, rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
  got = tiling.rowtile_pass_cuts_pay(
    m=m, k=k, n=n, num_groups=g, tiles=tiles, generation=gen, **dtypes
  )
  assert got is want
  draws = tile_pickers._picker_draws(m=m, num_groups=g, expected_rows=None)
  tm, tk, tn = tiles
  kw = dict(k=k, n=n, tm=tm, tk=tk, tn=tn, kind="gmm", lhs_itemsize=2, rhs_itemsize=2)
  kw.update(out_itemsize=2, generation=gen, buffer_rows=m)
  cut = tile_pickers._draws_seconds(draws, **kw)
  fixed = tile_pickers._draws_seconds(draws, **kw, fixed_tiles=True)
  assert (cut < fixed) is want
