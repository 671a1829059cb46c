"""Tests for `MoEConfig.batch_split` (MaxText `batch_split_factor`): the block split into chunks.

The split block runs the router once over all of a device's tokens, then sorts, dispatches, runs
the experts and combines each chunk on its own. Dropless, it must give the unsplit block's
outputs, aux values and gradients; buffers (and so drops under a capacity factor) are per chunk.
What the compiled TPU program overlaps is in tests/bench/test_schedule.py (bench's HLO reader).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from kernel_testing import reorder_tolerance
from test_moe import SMALL, _adversarial, _block_grads, _counts_per_device, _mesh, _setup

from pallas_moe import moe, reference
from pallas_moe.config import MoEConfig


@pytest.mark.parametrize(
  "data, ep, split, impl",
  # NOTE: (8, 1) is the ep = 1 path (no exchange) with 4 chunks of 2 tokens. The Pallas gmm
  # runs on two meshes (interpret-mode compiles dominate); (1, 8) checks the chunked exchange
  # with ragged_dot, since chunking only changes which rows each exchange and gmm see.
  [(8, 1, 4, "pallas"), (2, 4, 2, "pallas"), (1, 8, 2, "ragged_dot")],
)
def test_split_block_equals_unsplit(data, ep, split, impl):
  """Forward, aux loss, expert load and every gradient: chunked == unchunked (dropless)."""
  config = MoEConfig(**SMALL, gmm_impl=impl)
  params, x = _setup(config, tokens=64)
  mesh = _mesh(data, ep)
  want = _block_grads(params, x, config, mesh)
  got = _block_grads(params, x, dataclasses.replace(config, batch_split=split), mesh)
  y, aux, gp, gx = got
  wy, waux, wgp, wgx = want
  # NOTE: a chunk's gmm has fewer rows, so its tiles (and, in interpret mode, XLA:CPU's dot
  # shapes, vector widths and blockings) differ: the same products summed in another order. The
  # longest sum is a weight gradient's over the 64 tokens' rows; each value passes the router,
  # two gmms and the combine. A misrouted or dropped row is off by O(1), far above this.
  tol = reorder_tolerance(dtype=np.float32, terms=64, stages=4)
  np.testing.assert_allclose(np.asarray(y), np.asarray(wy), **tol, err_msg="y")
  np.testing.assert_allclose(float(aux["aux_loss"]), float(waux["aux_loss"]), **tol)
  np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(waux["expert_load"]))
  assert int(aux["dropped_rows"]) == int(waux["dropped_rows"]) == 0
  np.testing.assert_allclose(np.asarray(gx), np.asarray(wgx), **tol, err_msg="dx")
  for k in wgp:
    # NOTE: weight gradients sum the chunks' tgmms: the same terms in another order.
    np.testing.assert_allclose(np.asarray(gp[k]), np.asarray(wgp[k]), **tol, err_msg=f"d{k}")


def _forward(params, x, config, mesh, *, buffer_rows=None):
  """(y, aux) of `moe_layer` under jit; no gradients (half the interpret-mode compile)."""
  fn = lambda p, x: moe.moe_layer(p, x, config, mesh, buffer_rows=buffer_rows)
  return jax.jit(fn)(params, x)


def test_buffers_and_drops_are_per_chunk():
  """All tokens routed to one device: with a capacity factor each chunk's buffer is
  ceil(f * T/S * k) and each chunk drops its own overflow; the exact dropless buffer
  (`dropless_buffer_rows`) is a chunk's need and drops nothing. The plain exchange (one row
  per choice), whose drops are (token, choice) rows; test_dedup checks the deduplicated one's."""
  data, ep, split = 2, 4, 2
  base = MoEConfig(**SMALL, batch_split=split, dedup_dispatch=False)
  params, x = _adversarial(base, tokens=64, ep=ep)
  mesh = _mesh(data, ep)
  _, _, ids = reference.moe(params, x, base)
  ids = np.asarray(ids)
  t_chunk = 64 // (data * ep) // split
  # Rows each device receives, per chunk: [split, data, ep].
  per_chunk = np.stack(
    [
      _counts_per_device(
        ids.reshape(data * ep, split, t_chunk, -1)[:, c].reshape(-1, ids.shape[1]),
        num_experts=8,
        data=data,
        ep=ep,
      )
      for c in range(split)
    ]
  )
  assert per_chunk.max() == 4 * t_chunk * 2  # 4 senders x 4 tokens x top-2, all to one device

  factor = dataclasses.replace(base, buffer_factor=1.25)
  rows = math.ceil(1.25 * t_chunk * 2)
  assert moe.buffer_rows_for(factor, tokens_per_device=t_chunk, expert_parallelism=ep) == rows
  _, aux = _forward(params, x, factor, mesh)
  assert int(aux["buffer_rows"]) == rows
  assert int(aux["dropped_rows"]) == int(np.maximum(per_chunk - rows, 0).sum())

  exact = moe.dropless_buffer_rows(params, x, base, mesh)
  assert exact == per_chunk.max()  # a chunk's need (a multiple of 8 here), not the batch's
  y, aux = _forward(params, x, base, mesh, buffer_rows=exact)
  assert int(aux["dropped_rows"]) == 0 and int(aux["needed_rows"]) == exact
  ry, _, _ = reference.moe(params, x, base)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ry), rtol=2e-4, atol=2e-5)


def test_config_name_alias_and_errors():
  assert MoEConfig(**SMALL).batch_split is None
  assert (
    moe.default_batch_split(
      config=MoEConfig(**SMALL), tokens_per_device=64, expert_parallelism=8, async_exchange=False
    )
    == 1
  )
  cfg = MoEConfig.from_dict({**SMALL, "batch_split_factor": 2})
  assert cfg.batch_split == 2
  assert MoEConfig.from_dict({**SMALL, "batch_split": 2, "batch_split_factor": 2}).batch_split == 2
  # MaxText splits only with use_batch_split_schedule: true.
  on = {**SMALL, "use_batch_split_schedule": True, "batch_split_factor": 4}
  assert MoEConfig.from_dict(on).batch_split == 4
  assert MoEConfig.from_dict({**on, "use_batch_split_schedule": False}).batch_split is None
  with pytest.raises(ValueError, match=r"'batch_split'=4 and 'batch_split_factor'=2"):
    MoEConfig.from_dict({**SMALL, "batch_split": 4, "batch_split_factor": 2})
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=r"batch_split \(MaxText batch_split_factor\)"):
      MoEConfig(**SMALL, batch_split=bad)
  with pytest.raises(ValueError, match=r"batch_split \(MaxText batch_split_factor\)"):
    MoEConfig.from_dict({**SMALL, "batch_split_factor": 0})
  odd = MoEConfig(**SMALL, batch_split=3)
  with pytest.raises(ValueError, match=r"batch_split.*=3 must divide the 8 tokens.*\[1, 2, 4, 8\]"):
    moe.batch_split_for(odd, tokens_per_device=8, expert_parallelism=4)
  params, x = _setup(odd, tokens=64)
  with pytest.raises(ValueError, match="must divide the 8 tokens per device"):
    jax.eval_shape(lambda p, x: moe.moe_layer(p, x, odd, _mesh(2, 4)), params, x)


def test_libtpu_version_and_its_default():
  import importlib.metadata

  from pallas_moe import schedule

  v = schedule.libtpu_version()
  assert v is not None, "the test extra installs libtpu (jax[tpu])"
  assert ".".join(map(str, v)) == importlib.metadata.version("libtpu")
  assert not schedule.ragged_async_by_default((0, 0, 42, 1))
  assert schedule.ragged_async_by_default((0, 0, 50, 1))
  assert schedule.ragged_async_by_default((0, 0, 52))
  assert not schedule.ragged_async_by_default(())
  # NOTE: jax 0.10.2 pins libtpu 0.0.42.1, jax 0.12.0.1 pins 0.0.50.1.
  assert schedule.ragged_async_by_default() == (v[:3] >= (0, 0, 50))


def test_default_chunks_follow_the_model_only_where_the_exchange_is_async():
  """The library's table (keyed by the layer's dims; tests/bench/test_bench_ep_step.py checks it is
  `bench.ep`'s modeled choice) applies only where the exchange compiles async (synchronous
  exchanges hide nothing under chunks): libtpu's default from 0.0.50, else
  `xla_tpu_enable_async_ragged_all_to_all=true`."""
  from pallas_moe import batch_split, schedule, tiling

  ragged, a2a = batch_split.ASYNC_EXCHANGE_FLAGS
  env = lambda args: {"LIBTPU_INIT_ARGS": args}
  # libtpu 0.0.42.1: synchronous unless the ragged exchange's flag is set true (the all-to-all
  # flag alone changes nothing the chunks need).
  old = (0, 0, 42, 1)
  assert not batch_split.async_exchange_enabled({}, libtpu_version=old)
  assert not batch_split.async_exchange_enabled(env(f"--{a2a}=true"), libtpu_version=old)
  assert batch_split.async_exchange_enabled(env(f"--xla_foo=1 --{ragged}"), libtpu_version=old)
  off = env(f"--{ragged}=true --{a2a}=true --{ragged}=false")
  assert not batch_split.async_exchange_enabled(off, libtpu_version=old)
  # libtpu 0.0.50.1 and 0.0.52: async unless set false; no libtpu: synchronous.
  for new in ((0, 0, 50, 1), (0, 0, 52)):
    assert batch_split.async_exchange_enabled({}, libtpu_version=new)
    assert not batch_split.async_exchange_enabled(env(f"--{ragged}=false"), libtpu_version=new)
  assert not batch_split.async_exchange_enabled({}, libtpu_version=())
  assert batch_split.async_exchange_enabled({}) == schedule.ragged_async_by_default()
  v3 = MoEConfig(num_experts=256, top_k=8, d_model=7168, expert_ffn_dim=2048)
  kw = dict(config=v3, tokens_per_device=16384, expert_parallelism=32)
  plain = dict(kw, config=dataclasses.replace(v3, dedup_dispatch=False))
  with tiling.use_generation("v6e"):
    # NOTE: auto dedup is on for these dims on v6e (dedup.MODELED_DEDUP): the dedup table's 2
    # (the fewest chunks within 0.5% of the fastest, `bench.ep.CHUNK_TIE`).
    assert moe.dedup_dispatch_for(v3, expert_parallelism=32, tokens_per_device=16384)
    assert moe.default_batch_split(**kw, async_exchange=True) == 2
    assert moe.default_batch_split(**plain, async_exchange=True) == 2
    assert moe.default_batch_split(**kw, async_exchange=False) == 1
  with tiling.use_generation("v5e"):
    assert moe.default_batch_split(**kw, async_exchange=True) == 8
    lite = MoEConfig(num_experts=64, top_k=6, d_model=2048, expert_ffn_dim=1408)
    lkw = dict(config=lite, tokens_per_device=4096, expert_parallelism=8, async_exchange=True)
    assert moe.default_batch_split(**lkw) == 4  # NOTE: plain on v5e for these dims (auto).
    qwen = MoEConfig(num_experts=128, top_k=8, d_model=2048, expert_ffn_dim=768)
    assert moe.default_batch_split(**dict(lkw, config=qwen)) == 4  # NOTE: dedup auto-on.
    forced = dict(lkw, config=dataclasses.replace(qwen, dedup_dispatch=False))
    assert moe.default_batch_split(**forced) == 4  # NOTE: 8 is within 0.5% (ep.CHUNK_TIE).
    # NOTE: EP 4 (MaxText's 4 x data 2): the plain exchange, 4 chunks.
    assert not moe.dedup_dispatch_for(lite, expert_parallelism=4, tokens_per_device=4096)
    assert moe.default_batch_split(**dict(lkw, expert_parallelism=4)) == 4
  with tiling.use_generation("v6e"):
    assert moe.default_batch_split(**dict(lkw, expert_parallelism=4)) == 2
    assert moe.default_batch_split(**lkw) == 4  # NOTE: dedup auto-on; plain takes 2 here.
    assert moe.default_batch_split(**dict(lkw, tokens_per_device=16384)) == 8
    assert moe.default_batch_split(**dict(lkw, async_exchange=False)) == 1
    # NOTE: a case the model has not seen, or a count that does not divide T: no split.
    assert moe.default_batch_split(**{**kw, "tokens_per_device": 1000}, async_exchange=True) == 1
