"""Tests for `MoEConfig.expert_placement`: experts stored in slot order.

A placed block (weights moved by `moe.place_experts`, config with the placement) must compute
what the unplaced block computes: same outputs, aux loss, `expert_load` (original expert order)
and gradients (router's as they are; expert weights' after `place_experts(..., undo=True)`).
Only the device each expert's rows travel to changes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from kernel_testing import reorder_tolerance
from test_moe import SMALL, _adversarial, _block_grads, _mesh, _setup

from pallas_moe import moe
from pallas_moe.config import MoEConfig
from pallas_moe.routing import BIAS_KEY

# NOTE: a random permutation of the 8 experts; the assert below keeps it non-trivial for both
# meshes (experts change device under E_l = 2 and under E_l = 1).
PLACEMENT = tuple(int(v) for v in np.random.default_rng(15).permutation(8))
assert all(set(PLACEMENT[2 * q : 2 * q + 2]) != {2 * q, 2 * q + 1} for q in range(4)), PLACEMENT

# DeepSeek-V3-style routing: 4 groups of 2 contiguous (original) experts, best 2 groups, a bias.
NOAUX = dict(
  score_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True
)


@pytest.mark.parametrize(
  "data, ep, routing, split, impl",
  # NOTE: ragged_dot (4x faster here than the interpret-mode Pallas gmm): the placement only
  # changes ids and weight order before the gmm, which every other block test runs on Pallas.
  [
    (2, 4, "greedy", 1, "ragged_dot"),
    (1, 8, "greedy", 1, "ragged_dot"),
    (2, 4, "noaux_tc", 2, "ragged_dot"),
  ],
  ids=["2x4-greedy", "1x8-greedy", "2x4-noaux_tc-split2"],
)
def test_placed_block_equals_unplaced(data, ep, routing, split, impl):
  """Outputs, aux loss, expert_load and every gradient: placed == unplaced (dropless)."""
  config = MoEConfig(
    **SMALL, **(NOAUX if routing == "noaux_tc" else {}), batch_split=split, gmm_impl=impl
  )
  params, x = _setup(config, tokens=64)
  if config.has_routed_bias:
    # NOTE: a bias of the sigmoid scores' size, so that it changes choices (and groups).
    params[BIAS_KEY] = 0.3 * jax.random.normal(jax.random.key(9), (config.num_experts,))
  mesh = _mesh(data, ep)
  want = _block_grads(params, x, config, mesh)
  placed = dataclasses.replace(config, expert_placement=PLACEMENT)
  got = _block_grads(moe.place_experts(params, placement=PLACEMENT), x, placed, mesh)
  y, aux, gp, gx = got
  wy, waux, wgp, wgx = want
  # NOTE: placed experts sit in other weight slots, so their rows reach the gmms in another
  # order and tiles: the same sums in another order (see `reorder_tolerance`).
  tol = reorder_tolerance(dtype=np.float32, terms=64, stages=4)
  # NOTE: y equal under permuted weights means each row met its own expert's weights.
  np.testing.assert_allclose(np.asarray(y), np.asarray(wy), **tol, err_msg="y")
  np.testing.assert_allclose(float(aux["aux_loss"]), float(waux["aux_loss"]), **tol)
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(waux["expert_load"]))
  assert int(aux["dropped_rows"]) == int(waux["dropped_rows"]) == 0
  np.testing.assert_allclose(np.asarray(gx), np.asarray(wgx), **tol, err_msg="dx")
  # NOTE: the router's gradient needs no un-placing: it is in original expert order.
  np.testing.assert_allclose(np.asarray(gp["router"]), np.asarray(wgp["router"]), **tol)
  unplaced = moe.place_experts(gp, placement=PLACEMENT, undo=True)
  assert set(unplaced) == set(wgp)
  for k in wgp:
    np.testing.assert_allclose(np.asarray(unplaced[k]), np.asarray(wgp[k]), **tol, err_msg=k)


def test_dropless_buffer_rows_counts_slots():
  """`dropless_buffer_rows` sizes by the device that holds each expert's slot: all tokens on
  experts {0, 1} need 64 rows on one device unplaced, 32 on each of two devices placed apart."""
  data, ep = 2, 4
  config = MoEConfig(**SMALL)
  params, x = _adversarial(config, tokens=64, ep=ep)
  mesh = _mesh(data, ep)
  assert moe.dropless_buffer_rows(params, x, config, mesh) == 64
  apart = (0, 2, 1, 3, 4, 5, 6, 7)  # device 0: experts 0, 2; device 1: experts 1, 3
  placed = dataclasses.replace(config, expert_placement=apart)
  assert moe.dropless_buffer_rows(params, x, placed, mesh) == 32


def test_place_experts_round_trip_and_leaves_router():
  config = MoEConfig(**SMALL, **NOAUX)
  params = moe.init_params(jax.random.key(0), config)
  placed = moe.place_experts(params, placement=PLACEMENT)
  for k in ("wi", "wo"):
    np.testing.assert_array_equal(np.asarray(placed[k]), np.asarray(params[k])[list(PLACEMENT)])
  for k in set(params) - set(moe.EXPERT_KEYS):
    assert placed[k] is params[k], k  # router, bias, shared experts: expert order, untouched
  back = moe.place_experts(placed, placement=PLACEMENT, undo=True)
  for k in params:
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(params[k]))
  with pytest.raises(ValueError, match="has 4 entries, num_experts is 8"):
    moe.place_experts(params, placement=(0, 1, 2, 3))


def test_config_stores_a_tuple_and_from_dict_reads_the_key():
  config = MoEConfig(**SMALL, expert_placement=np.asarray(PLACEMENT))
  assert config.expert_placement == PLACEMENT and isinstance(config.expert_placement, tuple)
  assert all(type(v) is int for v in config.expert_placement)
  hash(config)
  assert MoEConfig(**SMALL, expert_placement=list(PLACEMENT)) == config
  d = {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 32, "moe_intermediate_size": 16}
  assert MoEConfig.from_dict({**d, "expert_placement": list(PLACEMENT)}).expert_placement == (
    PLACEMENT
  )


@pytest.mark.parametrize(
  "placement, match",
  [
    ((0, 1, 2, 3), "has 4 entries, num_experts is 8"),
    ((0, 1, 2, 3, 4, 5, 6, 6), r"missing \[7\], repeated or out of range \[6\]"),
    ((0, 1, 2, 3, 4, 5, 6, 8), r"missing \[7\], repeated or out of range \[8\]"),
    ((0.0, 1, 2, 3, 4, 5, 6, 7), "must hold ints .* got 0.0"),
    (np.arange(8.0), "must hold ints .* got 0.0"),
    ((True, 1, 2, 3, 4, 5, 6, 7), "must hold ints .* got True"),
    ("01234567", "must be a sequence of ints"),
    (8, "must be a sequence of ints"),
  ],
)
def test_bad_placements_raise(placement, match):
  with pytest.raises(ValueError, match=match):
    MoEConfig(**SMALL, expert_placement=placement)
