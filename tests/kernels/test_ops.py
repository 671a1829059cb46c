"""Differentiable gmm: gradients, tilings per pass, positional megablox call, shard_map."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from kernel_testing import (
  INTERPRET_MODES,
  examples,
  group_sizes_strategy,
  np_gmm,
  np_tgmm,
  random_array,
  reorder_tolerance,
  rounded,
  tolerance,
)

import pallas_moe
from pallas_moe import reference


def np_gmm_grads(lhs, rhs, sizes, cot, *, group_offset=0, transpose_rhs=False):
  """float64 gradients of sum(gmm(lhs, rhs) * cot) wrt lhs and rhs."""
  rhs64 = np.asarray(rhs, np.float64)
  rhs_kn = rhs64.transpose(0, 2, 1) if transpose_rhs else rhs64
  # dlhs[rows of g] = cot[rows] @ rhs[g]^T: a gmm against [G, n, k].
  dlhs = np_gmm(cot, rhs_kn.transpose(0, 2, 1), sizes, group_offset=group_offset)
  drhs = np_tgmm(
    np.asarray(lhs, np.float64).T,
    cot,
    sizes,
    group_offset=group_offset,
    num_actual_groups=rhs64.shape[0],
  )
  if transpose_rhs:
    drhs = drhs.transpose(0, 2, 1)
  return dlhs, drhs


# Static configurations: (m, k, n, tiling, num_groups, in dtype, transpose_rhs). Ragged m, k, n;
# k below 128; 1 to 32 groups.
CASES = [
  (200, 300, 100, (64, 128, 128), 8, jnp.float32, False),
  (130, 96, 256, (128, 128, 128), 32, jnp.float32, True),
  (64, 256, 130, (32, 128, 128), 1, jnp.bfloat16, False),
  (100, 200, 256, (32, 128, 128), 5, jnp.bfloat16, True),
  (600, 128, 256, (256, 128, 128), 10, jnp.float32, False),
]
CASE_IDS = [f"m{c[0]}k{c[1]}n{c[2]}g{c[4]}" + ("T" if c[6] else "") for c in CASES]


@functools.cache
def _grads_of(case, interpret, *, ours: bool):
  """jit(grad) of sum(gmm(lhs, rhs, group_sizes) * cot) wrt lhs and rhs, once per case (the
  hypothesis examples of a case share it: group sizes are an argument, not a constant)."""
  _, _, _, tiling, _, _, transpose_rhs = case

  def gmm(lhs, rhs, gs):
    if ours:
      return pallas_moe.gmm(lhs, rhs, gs, jnp.float32, tiling, None, None, transpose_rhs, interpret)
    return reference.gmm(lhs, rhs, gs, jnp.float32, transpose_rhs=transpose_rhs)

  def loss(lhs, rhs, gs, cot):
    return jnp.sum(gmm(lhs, rhs, gs).astype(jnp.float32) * cot)

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def check_grads_case(case, sizes, interpret):
  m, k, n, tiling, num_groups, in_dtype, transpose_rhs = case
  lhs = random_array(0, (m, k), in_dtype)
  rhs = random_array(1, (num_groups, n, k) if transpose_rhs else (num_groups, k, n), in_dtype)
  cot = random_array(2, (m, n), jnp.float32)
  gs = jnp.asarray(sizes)

  dlhs, drhs = _grads_of(case, interpret, ours=True)(lhs, rhs, gs, cot)
  assert dlhs.dtype == in_dtype and drhs.dtype == in_dtype
  assert dlhs.shape == lhs.shape and drhs.shape == rhs.shape
  # The backward kernels multiply the cotangent in the input dtype (bf16 for bf16 inputs).
  cot_used = rounded(cot, in_dtype)
  np_dlhs, np_drhs = np_gmm_grads(
    rounded(lhs, in_dtype), rounded(rhs, in_dtype), sizes, cot_used, transpose_rhs=transpose_rhs
  )
  np.testing.assert_allclose(
    np.asarray(dlhs, np.float32), np_dlhs, **tolerance(in_dtype=in_dtype, out_dtype=in_dtype, k=n)
  )
  np.testing.assert_allclose(
    np.asarray(drhs, np.float32), np_drhs, **tolerance(in_dtype=in_dtype, out_dtype=in_dtype, k=m)
  )
  if in_dtype == jnp.float32:
    r_dlhs, r_drhs = _grads_of(case, None, ours=False)(lhs, rhs, gs, cot)
    np.testing.assert_allclose(np.asarray(dlhs), np.asarray(r_dlhs), rtol=2e-5, atol=2e-5 * m**0.5)
    np.testing.assert_allclose(np.asarray(drhs), np.asarray(r_drhs), rtol=2e-5, atol=2e-5 * m**0.5)
  # Rows past sum(group_sizes) get exactly zero gradient.
  assert not np.any(np.asarray(dlhs, np.float32)[int(sizes.sum()) :])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@examples(0.5)
@given(data=st.data())
def test_grads_match_references(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[4]))
  check_grads_case(case, sizes, INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("case", CASES[2:], ids=CASE_IDS[2:])
@examples(0.1)
@given(data=st.data())
def test_grads_match_references_tpu_simulator(case, data):
  sizes = data.draw(group_sizes_strategy(m=case[0], num_groups=case[4]))
  check_grads_case(case, sizes, INTERPRET_MODES["tpu"])


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_sharded_grads_chain_to_unsharded(transpose_rhs):
  """Gradients of a chain of expert shards (group_offset + existing_out) = unsharded ones."""
  m, k, n, num_groups = 100, 128, 130, 8
  sizes = jnp.array([10, 0, 25, 5, 0, 30, 12, 8], jnp.int32)  # 90 of 100 rows
  lhs = random_array(3, (m, k), jnp.float32)
  rhs = random_array(4, (num_groups, n, k) if transpose_rhs else (num_groups, k, n), jnp.float32)
  cot = random_array(5, (m, n), jnp.float32)
  kw = dict(tiling=(32, 128, 128), transpose_rhs=transpose_rhs, interpret=True)

  def chained(lhs, rhs):
    out = None
    for shard in range(2):
      local = rhs[4 * shard : 4 * shard + 4]
      out = pallas_moe.gmm(lhs, local, sizes, group_offset=4 * shard, existing_out=out, **kw)
    return jnp.sum(out * cot)

  def full(lhs, rhs):
    return jnp.sum(pallas_moe.gmm(lhs, rhs, sizes, **kw) * cot)

  g_chain = jax.jit(jax.grad(chained, argnums=(0, 1)))(lhs, rhs)
  g_full = jax.jit(jax.grad(full, argnums=(0, 1)))(lhs, rhs)
  np_grads = np_gmm_grads(lhs, rhs, sizes, cot, transpose_rhs=transpose_rhs)
  for a, b, c in zip(g_chain, g_full, np_grads, strict=True):
    # NOTE: the weight gradient sums m rows, the lhs gradient n columns, in the chained
    # program's order.
    tol = reorder_tolerance(dtype=np.float32, terms=max(m, n), scale=np.sqrt(max(m, n)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    np.testing.assert_allclose(np.asarray(a), c, rtol=2e-5, atol=4e-4)


def test_existing_out_gradient_passes_through_unwritten_rows():
  m, k, n = 48, 128, 128
  sizes = jnp.array([10, 20, 5, 13], jnp.int32)  # 48 rows; shard holds groups 1..2 = rows 10..35
  lhs = random_array(6, (m, k), jnp.float32)
  rhs = random_array(7, (2, k, n), jnp.float32)
  existing = random_array(8, (m, n), jnp.float32)
  cot = random_array(9, (m, n), jnp.float32)
  d_existing = jax.grad(
    lambda e: jnp.sum(
      pallas_moe.gmm(
        lhs, rhs, sizes, tiling=(16, 128, 128), group_offset=1, existing_out=e, interpret=True
      )
      * cot
    )
  )(existing)
  expected = np.asarray(cot).copy()
  expected[10:35] = 0
  np.testing.assert_array_equal(np.asarray(d_existing), expected)


def test_positional_megablox_call_order():
  """pallas_moe.gmm(lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset,
  existing_out, transpose_rhs, interpret), as MaxText calls megablox's ops.gmm."""
  m, k, n = 64, 128, 128
  sizes = jnp.array([20, 30, 14, 0], jnp.int32)
  lhs = random_array(10, (m, k), jnp.bfloat16)
  rhs = random_array(11, (2, n, k), jnp.bfloat16)
  existing = jnp.full((m, n), 7.0, jnp.float32)
  out = pallas_moe.gmm(lhs, rhs, sizes, jnp.float32, (16, 128, 128), 1, existing, True, True)
  assert out.dtype == jnp.float32
  expected = np_gmm(
    rounded(lhs, jnp.bfloat16),
    rounded(rhs, jnp.bfloat16),
    sizes,
    group_offset=1,
    existing_out=existing,
    transpose_rhs=True,
  )
  np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=1e-3)


def test_tiling_per_pass_and_callable():
  """Tiling(fwd=, dlhs=, drhs=) and a megablox-style LUT callable give the same gradients."""
  m, k, n = 96, 256, 256
  sizes = jnp.array([30, 0, 50, 16], jnp.int32)
  lhs = random_array(12, (m, k), jnp.float32)
  rhs = random_array(13, (4, k, n), jnp.float32)
  seen = []

  def lut(m_, k_, n_):
    seen.append((m_, k_, n_))
    return (32, 128, 128)

  def grads(tiling):
    def loss(a, b):
      return jnp.sum(jnp.sin(pallas_moe.gmm(a, b, sizes, tiling=tiling, interpret=True)))

    return jax.grad(loss, argnums=(0, 1))(lhs, rhs)

  per_pass = pallas_moe.Tiling(fwd=(16, 256, 128), dlhs=(32, 128, 256), drhs=(128, 128, 128))
  g1, g2 = grads(per_pass), grads(lut)
  assert (m, k, n) in seen and (m, n, k) in seen  # fwd and dlhs dims looked up
  ref = jax.grad(lambda a, b: jnp.sum(jnp.sin(reference.gmm(a, b, sizes))), argnums=(0, 1))(
    lhs, rhs
  )
  # Different tk split the f32 sums differently: agreement to f32 rounding of k-long sums.
  for a, b, c in zip(g1, g2, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("mode", INTERPRET_MODES)
def test_shard_map_check_vma_forward_and_grads(mode):
  """Inside jax.shard_map(check_vma=True) on 4 CPU devices, each shard holds 2 of 8 groups."""
  mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
  m, k, n, num_groups = 96, 128, 128, 8
  sizes = jnp.array([10, 0, 20, 6, 0, 30, 10, 4], jnp.int32)  # 80 of 96 rows
  lhs = random_array(14, (m, k), jnp.float32)
  rhs = random_array(15, (num_groups, k, n), jnp.float32)

  def shard_fn(lhs, rhs, sizes):
    offset = jax.lax.axis_index("expert") * rhs.shape[0]
    out = pallas_moe.gmm(
      lhs, rhs, sizes, tiling=(32, 128, 128), group_offset=offset, interpret=INTERPRET_MODES[mode]
    )
    return jax.lax.psum(out, "expert")

  layer = jax.shard_map(
    shard_fn, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P(), check_vma=True
  )

  def loss(lhs, rhs):
    return jnp.sum(jnp.sin(layer(lhs, rhs, sizes)))

  out = jax.jit(layer)(lhs, rhs, sizes)
  np.testing.assert_allclose(np.asarray(out), np_gmm(lhs, rhs, sizes), rtol=2e-5, atol=3e-4)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
  ref_grads = jax.grad(lambda a, b: jnp.sum(jnp.sin(reference.gmm(a, b, sizes))), argnums=(0, 1))(
    lhs, rhs
  )
  for a, b in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_shard_map_varying_lhs_hlo_interpreter():
  """The HLO interpreter under check_vma with an lhs that varies over the mesh axis (the EP MoE
  case; jax 0.10.2 and 0.12.0.1 need `_jax_compat`'s lowering fix)."""
  mesh = jax.make_mesh(
    (4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
  )
  lhs = jax.random.normal(jax.random.key(0), (4 * 16, 128))
  rhs = jax.random.normal(jax.random.key(1), (4, 128, 128))
  sizes = jnp.array([4, 4, 4, 4] * 4, jnp.int32)
  fn = lambda lhs, rhs, gs: pallas_moe.gmm(lhs, rhs, gs, interpret=True)
  sm = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P("x"))
  out = jax.jit(sm)(lhs, rhs, sizes)
  want = jnp.concatenate(
    [reference.gmm(lhs[i * 16 : (i + 1) * 16], rhs, sizes[:4]) for i in range(4)]
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_package_exports_the_functions_and_the_kernel_modules_stay_importable():
  """As in megablox: `pallas_moe.gmm` / `.tgmm` are the differentiable functions, while the
  kernel modules `pallas_moe/gmm.py` / `tgmm.py` are reached by import, never by attribute."""
  import importlib

  from pallas_moe import ops
  from pallas_moe.gmm import gmm_pallas, gmm_rowtile_pallas
  from pallas_moe.tgmm import tgmm_pallas, tgmm_rowtile_pallas

  gmm_module = importlib.import_module("pallas_moe.gmm")
  tgmm_module = importlib.import_module("pallas_moe.tgmm")
  assert pallas_moe.gmm is ops.gmm and pallas_moe.tgmm is ops.tgmm
  assert gmm_module.__name__ == "pallas_moe.gmm" and tgmm_module.__name__ == "pallas_moe.tgmm"
  assert gmm_module.gmm_pallas is gmm_pallas and gmm_module.gmm_rowtile_pallas is gmm_rowtile_pallas
  assert tgmm_module.tgmm_pallas is tgmm_pallas
  assert tgmm_module.tgmm_rowtile_pallas is tgmm_rowtile_pallas


def test_unowned_rows_undefined_matches_on_owned_rows():
  """`unowned_rows="undefined"`: owned rows (and their gradients) as with "zero"; a bad value is
  refused by name (tests/bench/test_bench_unowned_rows.py: no zero fill is launched)."""
  m, k, n = 96, 32, 128
  sizes = jnp.array([10, 0, 7, 5], jnp.int32)  # 22 rows of 96, the shard holds groups 1..2
  x = random_array(0, (m, k), jnp.float32)
  w = random_array(1, (2, k, n), jnp.float32)
  tiles = pallas_moe.Tiling(fwd=(16, k, n), dlhs=(16, n, k), drhs=(128, k, n))

  def loss(unowned):
    def f(x, w):
      y = pallas_moe.gmm(x, w, sizes, tiling=tiles, group_offset=1, interpret=True,
                         unowned_rows=unowned)  # fmt: skip
      return jnp.sum(jnp.where(jnp.arange(m)[:, None] < 22, y, 0.0) ** 2), y

    return f

  (_, y0), g0 = jax.jit(jax.value_and_grad(loss("zero"), (0, 1), has_aux=True))(x, w)
  (_, y1), g1 = jax.jit(jax.value_and_grad(loss("undefined"), (0, 1), has_aux=True))(x, w)
  owned = slice(10, 17)
  # NOTE: the same kernels on the same tiles, but in two programs that XLA:CPU may block
  # differently around them: equal to reordered-sum rounding (k for y, n for dx, rows for dw).
  tol = reorder_tolerance(dtype=np.float32, terms=n, scale=np.sqrt(n), stages=2)
  np.testing.assert_allclose(np.asarray(y1)[owned], np.asarray(y0)[owned], **tol)
  np.testing.assert_allclose(np.asarray(g1[0])[owned], np.asarray(g0[0])[owned], **tol)
  np.testing.assert_allclose(np.asarray(g1[1]), np.asarray(g0[1]), **tol)
  with pytest.raises(ValueError, match="unowned_rows"):
    pallas_moe.gmm(x, w, sizes, group_offset=1, unowned_rows="garbage")


def test_visit_kernel_with_undefined_rows_is_exact_on_owned_rows():
  """The visit-schedule gmm (tiles with tk < k) under `unowned_rows="undefined"`: owned rows
  and their gradients exact under the TPU simulator (which NaN-poisons what is not written).
  tests/bench/test_bench_unowned_rows.py: the m-tiles holding no local row cost no grid step."""
  m, k, n = 128, 256, 128
  sizes = jnp.array([10, 0, 7, 5], jnp.int32)  # 22 rows of 128: six 16-row tiles hold none
  x = random_array(0, (m, k), jnp.float32)
  w = random_array(1, (4, k, n), jnp.float32)
  tiles = pallas_moe.Tiling(fwd=(16, 128, n), dlhs=(16, n, 128), drhs=(128, k, n))

  def run(unowned, interpret):
    return lambda x: pallas_moe.gmm(
      x, w, sizes, jnp.float32, tiles, interpret=interpret, unowned_rows=unowned
    )

  sim = pltpu.InterpretParams()
  y = run("undefined", sim)(x)
  want = reference.gmm(x, w, sizes, jnp.float32)
  np.testing.assert_allclose(np.asarray(y)[:22], np.asarray(want)[:22], rtol=1e-5, atol=1e-4)
  dx = jax.grad(lambda x: jnp.sum(run("undefined", True)(x)[:22] ** 2))(x)
  dx_want = jax.grad(lambda x: jnp.sum(reference.gmm(x, w, sizes, jnp.float32)[:22] ** 2))(x)
  np.testing.assert_allclose(np.asarray(dx)[:22], np.asarray(dx_want)[:22], rtol=1e-4, atol=1e-3)


def test_megacore_keeps_the_visit_kernel_where_the_row_tile_one_would_idle_a_core():
  """n = 2880: no 128-multiple divides it, so the row-tile gmm's only tn is all of n, one sweep.
  On v5p (two TensorCores per device) that runs on one core while the visit kernel splits its
  two n-tiles: the picker declines the row tiles there (the visit model is faster), and keeps
  them on v6e (one core), where the visit model is the slower one."""
  from pallas_moe import tiling
  from pallas_moe.tile_pickers import visit_tiling_and_seconds

  kw = dict(
    m=16384, k=2880, n=2880, num_groups=32, kind="gmm", lhs_dtype=jnp.bfloat16,
    rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
  )  # fmt: skip
  assert tiling.pick_rowtile_tiling(**kw, generation="v5p") is None
  visit_tiles, _ = visit_tiling_and_seconds(**kw, generation="v5p")
  assert visit_tiles[2] < 2880  # several n-tiles, one per core
  rowtile = tiling.pick_rowtile_tiling(**kw, generation="v6e")
  assert rowtile is not None and rowtile[2] == 2880
  gs = np.random.default_rng(0).multinomial(16384, np.full(32, 1 / 32))
  one_core = tiling.rowtile_modeled_seconds(
    group_sizes=gs, k=2880, n=2880, tm=rowtile[0], tk=2880, tn=2880, kind="gmm",
    lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2, generation="v6e",
  )  # fmt: skip
  assert one_core < visit_tiling_and_seconds(**kw, generation="v6e")[1]


def test_picker_takes_an_m_tile_between_powers_of_two_where_it_saves_steps():
  """tpu7x (0.84 us per step) at k = 7168: the two weight slots leave room for 768 rows of lhs,
  not 1024; (768, 7168, 1024) takes 1.5x fewer steps than (512, 7168, 1024) and models >= 3%
  faster than every power-of-two tiling that fits."""
  from pallas_moe import tile_pickers, tiling

  kw = dict(
    m=131072, k=7168, n=2048, num_groups=128, kind="gmm", lhs_dtype=jnp.bfloat16,
    rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, generation="tpu7x",
  )  # fmt: skip
  picked = tiling.pick_rowtile_tiling(**kw)
  assert picked == (768, 7168, 1024)
  draws = tile_pickers._picker_draws(m=131072, num_groups=128, expected_rows=None)

  model = dict(
    k=7168, n=2048, tk=7168, kind="gmm", lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
    generation="tpu7x", buffer_rows=131072,
  )  # fmt: skip

  def seconds(tm, tn):
    # NOTE: as the picker scores: the better of fixed and pass-cut tiles.
    return min(
      tile_pickers._draws_seconds(draws, tm=tm, tn=tn, fixed_tiles=fixed, **model)
      for fixed in (True, False)
    )

  budget = tiling.usable_vmem_bytes("tpu7x")
  for tm in (128, 256, 512, 1024, 2048, 4096):
    for tn in (128, 256, 512, 1024, 2048):
      est = tiling.vmem_estimate_bytes(
        tm=tm, tk=7168, tn=tn, lhs_dtype=jnp.bfloat16, rhs_dtype=jnp.bfloat16,
        out_dtype=jnp.bfloat16, kind="gmm_rowtile", generation="tpu7x",
      )  # fmt: skip
      if est <= budget:
        assert seconds(768, 1024) < 0.97 * seconds(tm, tn), (tm, tn)


def test_expected_rows_picks_tiles_for_the_real_rows_and_changes_nothing_else():
  """`expected_rows` is a hint for the default tiles of a receive buffer with slack: on
  mixtral's EP weight gradient (one expert, 8,192 of 16,384 rows) the picker scores the tiles on
  the rows the grid really visits (three 4,096-row tiles, the last nearly empty, balance worse
  than 1,024-row ones; the slack itself costs nothing since the kernels move only real rows);
  results are identical with and without it; bad values are refused by name."""
  from pallas_moe import tiling

  kw = dict(
    m=16384, k=4096, n=14336, num_groups=1, kind="tgmm", lhs_dtype=jnp.bfloat16,
    rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, generation="v6e",
  )  # fmt: skip
  full = tiling.pick_rowtile_tiling(**kw)
  hinted = tiling.pick_rowtile_tiling(**kw, expected_rows=8192)
  assert full[0] == 4096 and hinted[0] < 4096
  # NOTE: modeled on the buffer, with 8,276 real rows (ep 8's busiest device, 2x capacity).
  gs = np.array([8276])
  cost = lambda t: tiling.rowtile_modeled_seconds(
    group_sizes=gs, k=4096, n=14336, tm=t[0], tk=t[1], tn=t[2], kind="tgmm", lhs_itemsize=2,
    rhs_itemsize=2, out_itemsize=2, generation="v6e", buffer_rows=16384,
  )  # fmt: skip
  assert cost(hinted) < 0.9 * cost(full)
  assert tiling.pick_rowtile_tiling(**kw, expected_rows=kw["m"]) == full

  m, k, n = 64, 32, 128
  sizes = jnp.array([9, 0, 14], jnp.int32)
  x = random_array(0, (m, k), jnp.float32)
  w = random_array(1, (3, k, n), jnp.float32)
  y = pallas_moe.gmm(x, w, sizes, interpret=True)
  y_hint = pallas_moe.gmm(x, w, sizes, interpret=True, expected_rows=24)
  # NOTE: the hint may pick other tiles: the same sums, possibly in another order.
  tol = reorder_tolerance(dtype=np.float32, terms=k, scale=np.sqrt(k))
  np.testing.assert_allclose(np.asarray(y_hint), np.asarray(y), **tol)
  dw = pallas_moe.tgmm(x.T, y, sizes, interpret=True, expected_rows=24)
  want_dw = pallas_moe.tgmm(x.T, y, sizes, interpret=True)
  scale = float(np.abs(want_dw).max())
  np.testing.assert_allclose(
    np.asarray(dw), np.asarray(want_dw), **reorder_tolerance(dtype=np.float32, terms=m, scale=scale)
  )
  with pytest.raises(ValueError, match="expected_rows"):
    pallas_moe.gmm(x, w, sizes, expected_rows=0)
  with pytest.raises(TypeError, match="expected_rows"):
    pallas_moe.tgmm(x.T, y, sizes, expected_rows=jnp.int32(24))


@pytest.mark.parametrize(
  "gen, kind, tn, sub_m, rows_stationary",
  [
    ("v5e", "gmm", 512, 128, False),
    # NOTE: a 128-row pass costs 128 rows on the 256-wide MXU (`generations.min_pass_rows`).
    ("v6e", "gmm", 512, 128, False),
    ("tpu7x", "gmm", 512, 128, False),
    # NOTE: n = 1408 is no multiple of 256: 256-row passes, so the rows can be the stationary
    # operand and tn is not padded to 1536.
    ("v6e", "gmm", 1408, 256, True),
    # NOTE: tgmm contracts over its rows, which the MXU pads to its edge.
    ("v6e", "tgmm", 512, 256, False),
  ],
)
def test_pass_rows_follow_the_generation(gen, kind, tn, sub_m, rows_stationary):
  from pallas_moe import ops
  from pallas_moe import tiling as tiling_lib

  m, k, n = 4096, 512, tn
  dt = (jnp.bfloat16,) * 3
  with tiling_lib.use_generation(gen):
    kt = ops._resolve_tiles(
      (1024, k if kind == "gmm" else 256, tn),
      dims=(m, k, n),
      kind=kind,
      num_groups=8,
      dtypes=dt,
      interpret=False,
    )
  assert kt.rowtile
  assert kt.sub_m == sub_m
  assert kt.rows_stationary == rows_stationary
