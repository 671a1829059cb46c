"""`aux["dropped_rows"]` is one unit in every exchange mode: (token, choice) assignments that were
not computed. `aux["dropped_exchange_rows"]` is the exchange's own: (token, choice) rows in the
plain exchange, (token, device) rows in the deduplicated one (`MoEConfig.dedup_dispatch`).

Both are checked against a numpy simulation of the receive buffers (written from the documented
fill orders, not from the library's helpers) on the block's own routing, and the block's output
against the dense reference with exactly the simulated assignments removed. Forward only, tiny
shapes, `gmm_impl="ragged_dot"`: the exchange, not the kernel, is under test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe import F32_TOL, _adversarial, _mesh, _setup

from pallas_moe import moe, reference
from pallas_moe.config import MoEConfig
from pallas_moe.routing import BIAS_KEY

# NOTE: E_l = 4 on the 2x4 mesh: a top-4 token has 0 to 4 choices on one device.
CFG = dict(num_experts=16, top_k=4, d_model=32, expert_ffn_dim=16, num_shared_experts=1)
DATA, EP, TOKENS = 2, 4, 64


def _skewed(config):
  """Params and tokens that send 0 to 4 of a token's choices to device 0, most 2 or 3."""
  params, x = _setup(config, tokens=TOKENS, seed=5)
  x = x.at[:, 0].set(jnp.abs(x[:, 0]) + 0.5)
  params["router"] = params["router"].at[0, : config.num_experts // EP].add(1.0)
  return params, x


def _simulate(ids, *, num_local, split, pair_rows, dedup):
  """Host numpy: `(keep [T, k] bool, refused wire rows)` for one layer call on the 2x4 mesh.

  Tokens are split over (data, expert) data-major: device (a, b) holds token block a * EP + b;
  its chunk c is that block's c-th T / split tokens. Per data slice, chunk and receiver:
  - plain: one row per (token, choice); the receiver lays rows out by (local expert, sender,
    the sender's stable sort order = token then choice) and keeps the first `pair_rows`;
  - dedup: one row per (token, receiver) holding all of that token's choices there; rows come
    by (sender, token) and are accepted while their choices fit in `pair_rows`; the first row
    that does not fit and every later one are refused, with all of their choices.
  """
  t_dev = ids.shape[0] // (DATA * EP)
  tc = t_dev // split
  keep = np.zeros(ids.shape, bool)
  refused = 0
  for a in range(DATA):
    for c in range(split):
      tokens = {
        src: range((a * EP + src) * t_dev + c * tc, (a * EP + src) * t_dev + (c + 1) * tc)
        for src in range(EP)
      }
      for dst in range(EP):
        if dedup:
          used, full = 0, False
          for src in range(EP):
            for t in tokens[src]:
              on = ids[t] // num_local == dst
              if not on.any():
                continue
              full = full or used + on.sum() > pair_rows
              if full:
                refused += 1
              else:
                used += on.sum()
                keep[t] |= on
        else:
          rows = [
            (t, j)
            for e in range(dst * num_local, (dst + 1) * num_local)
            for src in range(EP)
            for t in tokens[src]
            for j in range(ids.shape[1])
            if ids[t, j] == e
          ]
          for t, j in rows[:pair_rows]:
            keep[t, j] = True
          refused += max(len(rows) - pair_rows, 0)
  return keep, refused


@functools.cache
def _forward(config):
  mesh = _mesh(DATA, EP)
  return jax.jit(lambda p, x: moe.moe_layer(p, x, config, mesh))


@functools.cache
def _reference(config):
  return jax.jit(lambda p, x, keep: reference.moe(p, x, config, keep=keep)[0])


@pytest.mark.parametrize(
  "routing, dedup, split",
  [
    ("adversarial", False, 1),
    ("adversarial", True, 1),
    ("skewed", False, 1),
    ("skewed", True, 1),
    ("skewed", None, 2),
    ("skewed", True, 2),
  ],
)
def test_dropped_rows_count_assignments_in_every_mode(routing, dedup, split):
  """`dropped_rows` is the (token, choice) assignments not computed, whichever exchange runs;
  `dropped_exchange_rows` the rows refused on the wire. The issue's example ("adversarial"):
  every token's 4 choices on one device of a full buffer; the deduplicated exchange refuses 44
  (token, device) rows, i.e. 176 assignments, as many as the plain exchange drops."""
  factor = 1.25 if routing == "adversarial" else 0.5
  config = MoEConfig(
    **CFG, buffer_factor=factor, dedup_dispatch=dedup, batch_split=split, gmm_impl="ragged_dot"
  )
  if routing == "adversarial":
    params, x = _adversarial(config, tokens=TOKENS, ep=EP)
  else:
    params, x = _skewed(config)
  mesh = _mesh(DATA, EP)
  # NOTE: the block's own routing (the router sharded as the block runs it).
  ids = np.asarray(moe._router_ids(config, mesh)(params["router"], params.get(BIAS_KEY), x))
  tc = TOKENS // (DATA * EP) // split
  pair_rows = moe.buffer_rows_for(config, tokens_per_device=tc, expert_parallelism=EP)
  assert pair_rows == int(np.ceil(factor * tc * 4))
  used_dedup = moe.dedup_dispatch_for(config, expert_parallelism=EP, tokens_per_device=tc * split)
  if dedup is not None:
    assert used_dedup is dedup
  keep, refused = _simulate(ids, num_local=4, split=split, pair_rows=pair_rows, dedup=used_dedup)
  want = int((~keep).sum())
  y, aux = _forward(config)(params, x)
  assert int(aux["dropped_rows"]) == want
  assert int(aux["dropped_exchange_rows"]) == refused
  if not used_dedup:
    assert refused == want
  if routing == "adversarial":
    assert (ids // 4 == 0).all()  # NOTE: all 4 choices of every token on device 0
    # 10 of a data slice's 32 tokens fit 40 expert rows: 2 * 22 rows or 2 * 88 assignments.
    assert want == 2 * 88
    assert refused == (2 * 22 if used_dedup else want)
  else:
    # NOTE: a refused row of the deduplicated exchange held 1 to 4 choices: the units differ.
    assert want > refused if used_dedup else want == refused
    assert 0 < want < ids.size
  # The output is the reference's with exactly the simulated assignments removed.
  ry = _reference(config)(params, x, jnp.asarray(keep))
  scale = max(1.0, float(np.abs(np.asarray(ry)).max()))
  np.testing.assert_allclose(
    np.asarray(y), np.asarray(ry), rtol=F32_TOL["rtol"], atol=F32_TOL["atol"] * scale
  )


def test_no_drops_and_no_exchange():
  """Dropless: both counts 0 in both exchanges; ep = 1 (no exchange): both 0 too."""
  for data, ep, dedup in ((2, 4, True), (2, 4, False), (8, 1, None)):
    config = MoEConfig(**CFG, dedup_dispatch=dedup, gmm_impl="ragged_dot")
    params, x = _setup(config, tokens=TOKENS)
    mesh = _mesh(data, ep)
    _, aux = jax.jit(lambda p, x, c=config, m=mesh: moe.moe_layer(p, x, c, m))(params, x)
    assert int(aux["dropped_rows"]) == int(aux["dropped_exchange_rows"]) == 0
