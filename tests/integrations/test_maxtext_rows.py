"""`pallas_moe.maxtext.gmm`: which rows outside the local groups hold zeros (MaxText's contract).

MaxText's megablox zeroes the rows outside the local groups, in the output and in the lhs
gradient, exactly when `rhs` holds fewer groups than `group_sizes` lists (the ring-of-experts
layout: every expert's rows, this shard's experts' weights), and MaxText's layer reads those rows
(times the tokens' routing weights, summed over the shards). When `rhs` holds every group, the
only unowned rows are past sum(group_sizes) (a ragged all-to-all receive buffer's slack, MaxText's
padding to a tile multiple): megablox leaves them unwritten and MaxText never reads them, so
pallas_moe writes no zeros there. Runs without MaxText, under the NaN-poisoning interpret mode
(`pltpu.InterpretParams()`: uninitialized memory is NaN), so any row left unwritten shows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_moe
from pallas_moe import maxtext as mblx
from pallas_moe import reference

F32 = jnp.float32
M, K, N = 64, 128, 128
# Four experts over two shards of two; rows sorted by expert, 20 rows past the groups (slack).
GROUP_SIZES = np.array([13, 9, 12, 10], np.int32)
TILES = (16, 128, 128)


def _operands(num_groups: int):
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (M, K), F32)
  w = jax.random.normal(kw, (num_groups, K, N), F32)
  dout = jax.random.normal(kc, (M, N), F32)  # nonzero on every row, like routing weights
  return x, w, dout


def _local_rows(first_group: int, num_groups: int) -> np.ndarray:
  ends = np.cumsum(GROUP_SIZES)
  starts = ends - GROUP_SIZES
  rows = np.zeros(M, bool)
  rows[starts[first_group] : ends[first_group + num_groups - 1]] = True
  return rows


def _want(x, w, dout, first_group: int, local: np.ndarray):
  """Reference output and lhs gradient of the local groups' rows (0 elsewhere)."""
  full = jnp.zeros((GROUP_SIZES.size, K, N), F32).at[first_group : first_group + w.shape[0]].set(w)
  gs = jnp.asarray(GROUP_SIZES)
  out, pull = jax.vjp(lambda a: reference.gmm(a, full, gs, F32), x)
  (dlhs,) = pull(dout)
  keep = jnp.asarray(local)[:, None]
  return jnp.where(keep, out, 0), jnp.where(keep, dlhs, 0)


# NOTE: float and int8 weights: the two callers of `_unowned_rows`.
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8-weights"])
@pytest.mark.parametrize("first_group", [0, 2], ids=["offset0", "offset2"])
def test_other_shards_rows_are_exact_zeros_in_output_and_lhs_gradient(first_group, quantized):
  """Ring of experts: rhs holds 2 of the 4 groups; the other groups' rows are read by MaxText.

  offset0 is the rolled layout (`group_offset=0`, the shard's experts first), offset2 the
  `use_ragged_sort` one (`group_offset` = the shard's first expert): the other shards' rows lie
  after, or on both sides of, the local ones. Output and lhs gradient there are exactly 0 (not
  NaN, not garbage); the cotangent is nonzero on every row, as MaxText's routing weights are.
  """
  x, w, dout = _operands(2)
  kw = dict(rhs_quantize_dtype=jnp.int8) if quantized else {}

  def f(a):
    return mblx.gmm(
      a,
      w,
      jnp.asarray(GROUP_SIZES),
      F32,
      tiling=TILES * 3,
      group_offset=jnp.int32(first_group),
      interpret=pltpu.InterpretParams(),
      **kw,
    )

  out, pull = jax.vjp(f, x)
  (dlhs,) = pull(dout)
  out, dlhs = np.asarray(out), np.asarray(dlhs)
  local = _local_rows(first_group, 2)
  assert np.isfinite(out).all() and np.isfinite(dlhs).all()
  assert (out[~local] == 0).all() and (dlhs[~local] == 0).all()
  if quantized:
    values, scales = mblx.quantize_absmax(w, dtype=jnp.int8, channel_axes=(2,))
    w = values.astype(F32) * scales  # MaxText's weight rule, dequantized
  want_out, want_dlhs = _want(x, w, dout, first_group, local)
  scale = float(np.abs(want_out).max())
  np.testing.assert_allclose(out, want_out, rtol=0, atol=2e-3 * scale)
  np.testing.assert_allclose(dlhs, want_dlhs, rtol=0, atol=2e-3 * float(np.abs(want_dlhs).max()))


def test_rows_past_the_groups_get_no_zero_writes_when_rhs_holds_every_group():
  """Ragged all-to-all EP, no EP: the rows past sum(group_sizes) are left unwritten.

  MaxText slices off its padding and never sends a receive buffer's slack back, and megablox
  leaves those rows unwritten: pallas_moe pays no zero fill there (the rows stay NaN under
  the NaN-poisoning interpret mode, past the local rows' last DMA granule), and the rows of the
  groups are right.
  """
  x, w, dout = _operands(4)
  gs = jnp.asarray(GROUP_SIZES)
  out, pull = jax.vjp(
    lambda a: mblx.gmm(a, w, gs, F32, tiling=TILES * 3, interpret=pltpu.InterpretParams()), x
  )
  (dlhs,) = pull(dout)
  out, dlhs = np.asarray(out), np.asarray(dlhs)
  local = _local_rows(0, 4)
  want_out, want_dlhs = _want(x, w, dout, 0, local)
  np.testing.assert_allclose(out[local], want_out[local], rtol=0, atol=2e-3 * 30)
  np.testing.assert_allclose(dlhs[local], want_dlhs[local], rtol=0, atol=2e-3 * 30)
  # NOTE: the last row, 20 rows past the groups: beyond the DMA granule (8 f32 rows) of the
  # local rows' edge, which pallas_moe writes whole.
  assert np.isnan(out[-1]).all() and np.isnan(dlhs[-1]).all()


def test_unowned_rows_rule_is_megablox_rule(monkeypatch):
  """The mode each caller asks `pallas_moe.gmm` for: "zero" iff rhs holds fewer groups than
  group_sizes lists (or with existing_out), as megablox's `_zero_uninitialized_memory`."""
  seen = []
  real = pallas_moe.gmm

  def spy(*args, **kwargs):
    seen.append(kwargs["unowned_rows"])
    return real(*args, **kwargs)

  monkeypatch.setattr(pallas_moe, "gmm", spy)
  x = jnp.ones((M, K), F32)
  gs = jnp.asarray(GROUP_SIZES)
  cases = [
    (dict(rhs=jnp.ones((4, K, N), F32)), "undefined"),
    (dict(rhs=jnp.ones((4, K, N), F32), group_offset=jnp.int32(0)), "undefined"),
    (dict(rhs=jnp.ones((2, K, N), F32), group_offset=jnp.int32(0)), "zero"),
    (dict(rhs=jnp.ones((2, K, N), F32), group_offset=jnp.int32(2)), "zero"),
    (dict(rhs=jnp.ones((4, K, N), F32), existing_out=jnp.zeros((M, N), F32)), "zero"),
    (dict(rhs=jnp.ones((4, K, N), F32), rhs_quantize_dtype=jnp.int8), "undefined"),
    (dict(rhs=jnp.ones((2, K, N), F32), rhs_quantize_dtype=jnp.int8), "zero"),
  ]
  for kw, want in cases:
    seen.clear()
    rhs = kw.pop("rhs")
    jax.eval_shape(lambda a, r, kw=kw: mblx.gmm(a, r, gs, F32, tiling=TILES * 3, **kw), x, rhs)
    assert seen and set(seen) == {want}, (kw, seen)
