"""The block decides first, then moves data: `plan_block` / `plan_layer` resolve every default
(exchange, chunks, buffer rows, tiles) before routing, and the data path consults no table.

The proof: with the tables and pickers replaced by functions that raise, a layer given its plan
runs and equals the layer that planned for itself; the kernels the block traces are the ones
its plan printed.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_moe import F32_TOL, _mesh, _setup

import pallas_moe
from pallas_moe import batch_split, dedup, moe, tiling
from pallas_moe.config import MoEConfig, MoEModel, MoERun

CFG = dict(num_experts=8, top_k=2, d_model=32, expert_ffn_dim=16, num_shared_experts=1)
DATA, EP, TOKENS = 2, 4, 64


def _forbid(monkeypatch):
  """Every modeled table, libtpu flag reader and tile picker raises if the data path calls it."""

  def boom(*args, **kwargs):
    raise AssertionError("the data path consulted a table")

  for module, name in (
    (batch_split, "modeled_batch_split"),
    (batch_split, "async_exchange_enabled"),
    (dedup, "modeled_choice"),
    (tiling, "pick_rowtile_tiling"),
    (tiling, "pick_tiling"),
  ):
    monkeypatch.setattr(module, name, boom)


def test_layer_runs_its_plan_without_tables(monkeypatch):
  # NOTE: XLA's grouped matmul keeps it fast; its plan still resolves the tiles a kernel would
  # run (`test_plan_names_the_kernels_the_block_runs` traces the kernels with them).
  config = MoEConfig(**CFG, dedup_dispatch=True, batch_split=2, gmm_impl="xla")
  mesh = _mesh(DATA, EP)
  params, x = _setup(config, tokens=TOKENS)
  reference = dataclasses.replace(config, gmm_impl="ragged_dot")
  want_y, want_aux = jax.jit(lambda p, x: moe.moe_layer(p, x, reference, mesh))(params, x)
  plan = moe.plan_layer(config, mesh, tokens=TOKENS)
  assert plan.exchange == "dedup" and plan.wi is not None
  assert (plan.batch_split, plan.chunk_tokens) == (2, TOKENS // (DATA * EP) // 2)
  with monkeypatch.context() as m:
    _forbid(m)
    with pytest.raises(AssertionError, match="consulted a table"):
      moe.plan_layer(dataclasses.replace(config, batch_split=None), mesh, tokens=TOKENS)
    block = jax.shard_map(
      lambda p, x: moe.moe_block(p, x, config, plan=plan),
      mesh=mesh,
      in_specs=(moe.param_specs(config, params), P(("data", "expert"))),
      out_specs=(P(("data", "expert")), P()),
    )
    y, aux = jax.jit(block)(params, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), **F32_TOL)
  for key in ("dropped_rows", "needed_rows", "buffer_rows", "expert_load"):
    np.testing.assert_array_equal(np.asarray(aux[key]), np.asarray(want_aux[key]))


def test_plan_names_the_kernels_the_block_runs():
  config = MoEConfig(**CFG, dtype="bfloat16")
  mesh = _mesh(DATA, EP)
  params, x = _setup(config, tokens=TOKENS)
  plan = moe.plan_layer(config, mesh, tokens=TOKENS)
  text = plan.describe()
  for words in ("exchange:", "batch_split:", "buffer_rows:", "wi:", "wo:", "fwd", "drhs"):
    assert words in text, text

  def loss(p, x):
    y, aux = moe.moe_layer(p, x, config, mesh)
    return (y.astype("float32") ** 2).sum() + aux["aux_loss"]

  with pallas_moe.record_plans() as traced:
    jax.jit(jax.grad(loss)).lower(params, x)
  # NOTE: each expert gmm traces once (its backward kernels are part of its plan).
  assert [p.dims for p in traced] == [plan.wi.dims, plan.wo.dims]
  for got, want in zip(traced, (plan.wi, plan.wo), strict=True):
    assert [(name, kt.tiles, kt.kernel) for name, kt in got.kernels] == [
      (name, kt.tiles, kt.kernel) for name, kt in want.kernels
    ]


def test_plan_checks_the_call_it_is_given():
  config = MoEConfig(**CFG)
  params, x = _setup(config, tokens=16)
  plan = moe.plan_block(config, tokens_per_device=32, expert_parallelism=1)
  with pytest.raises(ValueError, match="made for T=32 tokens per device"):
    moe.moe_block(params, x, config, plan=plan)
  with pytest.raises(ValueError, match="do not split over the mesh"):
    moe.plan_layer(config, _mesh(DATA, EP), tokens=12)


def test_config_is_a_model_and_how_it_runs():
  config = MoEConfig(**CFG, expert_axis="ep", batch_split=2, dtype="bfloat16")
  assert isinstance(config.model, MoEModel) and isinstance(config.run, MoERun)
  assert (config.model.top_k, config.run.expert_axis) == (2, "ep")
  assert (config.top_k, config.expert_axis, config.batch_split) == (2, "ep", 2)
  assert MoEConfig(model=config.model, run=config.run) == config
  assert MoEConfig(**config.as_dict()) == config
  changed = dataclasses.replace(config, batch_split=4, top_k=3)
  assert (changed.batch_split, changed.top_k, changed.run.expert_axis) == (4, 3, "ep")
  # NOTE: the same model under another run: what a checkpoint keeps across meshes and chips.
  other = MoEConfig(model=config.model, expert_axis="expert")
  assert other.model == config.model and other.run != config.run
  with pytest.raises(TypeError, match="did you mean 'expert_axis'"):
    MoEConfig(**CFG, expert_axes="ep")
  with pytest.raises(ValueError, match="not a permutation"):
    MoEConfig(**CFG, expert_placement=(0, 0, 1, 2, 3, 4, 5, 6))
