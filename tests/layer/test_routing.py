"""Tests for pallas_moe.routing: DeepSeek's routing methods against numpy references, inside the
EP block against a float64 dense reference, the aux-loss-free bias update, and the router's
compiled memory.

The numpy references are written from the published modeling code:
- `np_deepseek_v2_gate`: `MoEGate.forward` of DeepSeek-V2's Hugging Face `modeling_deepseek.py`
  (deepseek-ai/DeepSeek-V2, -V2-Lite): "greedy" and "group_limited_greedy" (softmax scores, group
  score = the group's max, masked experts filled with 0.0, weights normalised with a 1e-20 guard
  when `top_k > 1 and norm_topk_prob`, else times `routed_scaling_factor`).
- `np_deepseek_v3_gate`: `MoEGate.forward` of DeepSeek-V3's `modeling_deepseek.py` (topk_method
  "noaux_tc": sigmoid scores + `e_score_correction_bias` for the choice, group score = sum of the
  group's top-2 biased scores, weights gathered from the unbiased scores, normalised when
  `top_k > 1 and norm_topk_prob`, always times `routed_scaling_factor`), except that masked
  experts are filled with -inf as in DeepSeek-V3's `inference/model.py` `Gate` (and MaxText):
  the HF code's 0.0 fill lets a masked expert beat kept experts whose biased score is negative.

Tie-breaking: torch.topk leaves the order of equal values unspecified; the references (like the
router, via `jax.lax.top_k`) take the lower index first, for groups and for experts.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_moe import moe, routing
from pallas_moe.config import MoEConfig

# ---------------------------------------------------------------------------------------------
# numpy references (float64).
# ---------------------------------------------------------------------------------------------


def np_topk_ids(a: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k largest entries per row, equal values in ascending index order."""
  return np.argsort(-a, axis=-1, kind="stable")[..., :k]


def _np_group_keep(choice, *, n_group, topk_group, group_score):
  t, e = choice.shape
  grouped = choice.reshape(t, n_group, e // n_group)
  if group_score == "max":
    gs = grouped.max(-1)
  else:
    gs = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
  keep = np.zeros((t, n_group), bool)
  np.put_along_axis(keep, np_topk_ids(gs, topk_group), True, axis=1)
  return keep


def np_deepseek_v2_gate(
  scores, *, top_k, topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor
):
  """DeepSeek-V2 `MoEGate` (see the module docstring) on [T, E] softmax scores.

  Returns:
    `(ids [T, k], weights [T, k], kept groups [T, n_group] bool)`.
  """
  t, e = scores.shape
  keep = np.ones((t, n_group), bool)
  tmp = scores
  if topk_method == "group_limited_greedy":
    keep = _np_group_keep(scores, n_group=n_group, topk_group=topk_group, group_score="max")
    tmp = np.where(np.repeat(keep, e // n_group, axis=1), scores, 0.0)
  ids = np_topk_ids(tmp, top_k)
  w = np.take_along_axis(tmp, ids, axis=1)
  if top_k > 1 and norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  else:
    w = w * routed_scaling_factor
  return ids, w, keep


def np_deepseek_v3_gate(
  scores, bias, *, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
):
  """DeepSeek-V3 `MoEGate`, noaux_tc (see the module docstring) on [T, E] sigmoid scores.

  Returns:
    `(ids [T, k], weights [T, k], kept groups [T, n_group] bool)`.
  """
  e = scores.shape[1]
  choice = scores + bias[None, :]
  keep = _np_group_keep(choice, n_group=n_group, topk_group=topk_group, group_score="top2_sum")
  tmp = np.where(np.repeat(keep, e // n_group, axis=1), choice, -np.inf)
  ids = np_topk_ids(tmp, top_k)
  w = np.take_along_axis(scores, ids, axis=1)
  if top_k > 1 and norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return ids, w * routed_scaling_factor, keep


def np_scores(logits, score_func):
  logits = np.asarray(logits, np.float64)
  if score_func == "softmax":
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)
  return 1.0 / (1.0 + np.exp(-logits))


def np_gate(scores, bias, config: MoEConfig):
  """The reference gate for `config.topk_method`: `(ids, weights, kept groups)`."""
  kw = dict(
    top_k=config.top_k,
    n_group=config.n_group,
    topk_group=config.topk_group,
    norm_topk_prob=config.norm_topk_prob,
    routed_scaling_factor=config.routed_scaling_factor,
  )
  if config.topk_method == "noaux_tc":
    return np_deepseek_v3_gate(scores, np.asarray(bias, np.float64), **kw)
  return np_deepseek_v2_gate(scores, topk_method=config.topk_method, **kw)


# ---------------------------------------------------------------------------------------------
# Configs.
# ---------------------------------------------------------------------------------------------

SMALL = dict(num_experts=16, d_model=16, expert_ffn_dim=8, num_shared_experts=1)
# DeepSeek-V2-like: softmax, 4 groups of 4, best 2 groups, top-3, scaled (V2 uses 16.0).
V2 = MoEConfig(
  **SMALL,
  top_k=3,
  topk_method="group_limited_greedy",
  n_group=4,
  topk_group=2,
  routed_scaling_factor=2.0,
)
# DeepSeek-V3-like: sigmoid + bias, 4 groups of 4, best 2 groups, top-4, normalised, x2.5.
V3 = MoEConfig(
  **SMALL,
  top_k=4,
  score_func="sigmoid",
  topk_method="noaux_tc",
  n_group=4,
  topk_group=2,
  norm_topk_prob=True,
  routed_scaling_factor=2.5,
  routed_bias_update_rate=1e-3,
)
GREEDY = MoEConfig(**SMALL, top_k=3, routed_scaling_factor=1.5)


def _params(config, *, seed=0):
  params = moe.init_params(jax.random.key(seed), config)
  if config.has_routed_bias:
    # NOTE: a bias of the sigmoid scores' own size, so that it changes choices.
    params[routing.BIAS_KEY] = 0.3 * jax.random.normal(
      jax.random.key(seed + 9), (config.num_experts,)
    )
  return params


# ---------------------------------------------------------------------------------------------
# The router against the references.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [GREEDY, V2, V3], ids=["greedy", "v2_group_limited", "v3_noaux"])
def test_route_matches_deepseek_reference(config):
  """ids exactly and weights to f32 rounding, on 256 tokens."""
  params = _params(config, seed=1)
  x = jax.random.normal(jax.random.key(2), (256, config.d_model), jnp.float32)
  bias = params.get(routing.BIAS_KEY)
  got = jax.jit(functools.partial(routing.route, config=config))(x, params["router"], bias=bias)
  x64, router64 = np.asarray(x, np.float64), np.asarray(params["router"], np.float64)
  logits = x64 @ router64
  ids, w, keep = np_gate(np_scores(logits, config.score_func), bias, config)
  # NOTE: the choice is exact wherever it does not hinge on f32 rounding. The f32 logits may
  # differ from float64 by up to d * eps * sum|x_i w_i| (another CPU sums in another order); a
  # token whose float64 choice changes under such a shift of its logits is a near tie that either
  # answer resolves correctly. Those are few; every other token's ids must match exactly.
  bound = config.d_model * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(router64))
  rng = np.random.default_rng(0)
  stable = np.ones(len(ids), bool)
  for _ in range(8):
    shift = bound * rng.choice([-1.0, 1.0], size=bound.shape)
    stable &= (np_gate(np_scores(logits + shift, config.score_func), bias, config)[0] == ids).all(1)
  assert stable.mean() > 0.95, stable.mean()
  np.testing.assert_array_equal(np.asarray(got.expert_ids)[stable], ids[stable])
  np.testing.assert_allclose(np.asarray(got.weights)[stable], w[stable], rtol=2e-6, atol=1e-7)
  if config.topk_method != "greedy":
    # NOTE: the groups really limit the choice: some token's plain top-k leaves its kept groups.
    plain = np_topk_ids(np_scores(logits, config.score_func), config.top_k)
    assert (plain != ids).any()
    assert keep.sum(1).tolist() == [config.topk_group] * 256


@st.composite
def _grouped_case(draw):
  method = draw(st.sampled_from(["group_limited_greedy", "noaux_tc"]))
  n_group = draw(st.sampled_from([1, 2, 4, 8]))
  per_group = draw(st.integers(2, 4))
  topk_group = draw(st.integers(1, n_group))
  top_k = draw(st.integers(1, topk_group * per_group))
  e = n_group * per_group
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  # NOTE: scores on a coarse grid (exact in f32, sums too) make ties common: the tie rule is
  # tested, not just generic inputs. Softmax scores are > 0, so V2's 0.0 fill never ties them.
  low = 1 if method == "group_limited_greedy" else 0
  scores = rng.integers(low, 5, size=(64, e)) / 4.0
  # NOTE: biases down to -1.5 make many biased scores negative: a 0.0 fill of masked experts
  # (Hugging Face's DeepSeek-V3 code) would then pick them; the -inf fill never does.
  bias = rng.integers(-12, 5, size=(e,)) / 8.0 if method == "noaux_tc" else np.zeros(e)
  return method, n_group, topk_group, top_k, scores, bias


@given(_grouped_case())
def test_grouped_choice_stays_in_kept_groups(case):
  """No token picks an expert outside its kept groups; ids equal the reference, ties included."""
  method, n_group, topk_group, top_k, scores, bias = case
  e = scores.shape[1]
  ids = routing.select_experts(
    jnp.asarray(scores, jnp.float32),
    top_k=top_k,
    topk_method=method,
    n_group=n_group,
    topk_group=topk_group,
    bias=jnp.asarray(bias, jnp.float32),
  )
  ids = np.asarray(ids)
  kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=False)
  if method == "noaux_tc":
    want, _, keep = np_deepseek_v3_gate(scores, bias, routed_scaling_factor=1.0, **kw)
  else:
    want, _, keep = np_deepseek_v2_gate(scores, topk_method=method, routed_scaling_factor=1, **kw)
  group_of_choice = ids // (e // n_group)
  assert np.take_along_axis(keep, group_of_choice, axis=1).all()
  assert all(len(set(row)) == top_k for row in ids.tolist())
  np.testing.assert_array_equal(ids, want)


def test_masked_experts_never_beat_negative_biased_scores():
  """Kept experts whose biased scores are negative still win over masked ones (-inf fill)."""
  scores = jnp.array([[0.1, 0.2, 0.0, 0.05]])
  bias = jnp.array([-1.0, -1.0, -2.0, -2.0])  # choice: [-0.9, -0.8 | -2.0, -1.95]
  ids = routing.select_experts(
    scores, top_k=2, topk_method="noaux_tc", n_group=2, topk_group=1, bias=bias
  )
  assert np.asarray(ids).tolist() == [[1, 0]]


# ---------------------------------------------------------------------------------------------
# The EP block against a float64 dense reference.
# ---------------------------------------------------------------------------------------------


def _dense_reference_grads(params, x, ct, config):
  """(y, aux, grads wrt params and x) of `sum(y * ct) + aux_loss`, all in float64.

  The expert choice comes from the numpy gate (float64); the combine weights are gathered from
  the float64 scores, so the router gets its gradient through them (and the aux loss). Every
  token goes through every expert (a dense einsum), weighted by its weight for that expert.
  """
  f64 = lambda a: np.asarray(a, np.float64)
  logits = f64(x) @ f64(params["router"])
  ids, _, _ = np_gate(np_scores(logits, config.score_func), params.get(routing.BIAS_KEY), config)
  with jax.enable_x64(True):
    p64 = {k: jnp.asarray(f64(v)) for k, v in params.items() if k != routing.BIAS_KEY}
    y, aux, gp, gx = _dense_grads_fn(config)(p64, jnp.asarray(f64(x)), jnp.asarray(ct), ids)
    out = jax.tree.map(np.asarray, (y, aux, gp, gx))
  return (*out, ids)


@functools.cache
def _dense_grads_fn(config):
  """jit (one compile per config, under x64) of the dense float64 loss and its gradients."""
  num_e, f = config.num_experts, config.expert_ffn_dim

  def loss(p, x, ct, ids):
    lg = x @ p["router"]
    if config.score_func == "softmax":
      scores = jax.nn.softmax(lg, axis=-1)
      probs = scores
    else:
      scores = jax.nn.sigmoid(lg)
      probs = scores / scores.sum(-1, keepdims=True)
    w = jnp.take_along_axis(scores, ids, axis=1)
    if config.norm_topk_prob and config.top_k > 1:
      w = w / (w.sum(-1, keepdims=True) + 1e-20)
    if config.topk_method != "group_limited_greedy" or not config.norm_topk_prob:
      w = w * config.routed_scaling_factor
    coef = jnp.zeros((x.shape[0], num_e), x.dtype).at[jnp.arange(x.shape[0])[:, None], ids].add(w)
    h = jnp.einsum("td,edf->etf", x, p["wi"])
    out = jnp.einsum("etf,efd->etd", jax.nn.silu(h[..., :f]) * h[..., f:], p["wo"])
    y = jnp.einsum("te,etd->td", coef, out)
    hs = x @ p["shared_wi"]
    s = hs.shape[1] // 2
    y = y + (jax.nn.silu(hs[:, :s]) * hs[:, s:]) @ p["shared_wo"]
    load = jnp.bincount(ids.reshape(-1), length=num_e) / (x.shape[0] * config.top_k)
    aux = num_e * jnp.sum(load * probs.mean(0))
    return jnp.sum(y * ct) + aux, (y, aux)

  def run(p, x, ct, ids):
    (_, (y, aux)), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      p, x, ct.astype(x.dtype), ids
    )
    return y, aux, gp, gx

  return jax.jit(run)


def _mesh(data, ep):
  return jax.make_mesh((data, ep), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("data, ep", [(8, 1), (2, 4), (1, 8)], ids=["8x1", "2x4", "1x8"])
@pytest.mark.parametrize("config", [V2, V3], ids=["v2", "v3"])
def test_ep_block_matches_float64_dense_reference(config, data, ep):
  """Forward, aux loss, all gradients; the bias gets exactly zero gradient."""
  # NOTE: routing decides ids and weights before any gmm, so the Pallas kernels run on one mesh
  # per method (interpret-mode compiles dominate) and the other meshes use ragged_dot.
  if (config is V2) != (ep == 4):
    config = dataclasses.replace(config, gmm_impl="ragged_dot")
  params = _params(config, seed=3)
  x = jax.random.normal(jax.random.key(4), (64, config.d_model), jnp.float32)
  ct = jax.random.normal(jax.random.key(5), x.shape, jnp.float32)
  mesh = _mesh(data, ep)

  def loss(p, x):
    y, aux = moe.moe_layer(p, x, config, mesh)
    return jnp.sum(y * ct) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    params, x
  )
  ry, raux, rgp, rgx, ids = _dense_reference_grads(params, x, ct, config)
  assert int(aux["dropped_rows"]) == 0
  np.testing.assert_array_equal(
    np.asarray(aux["expert_load"]), np.bincount(ids.reshape(-1), minlength=config.num_experts)
  )

  def close(a, b, name):
    a = np.asarray(a, np.float64)
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(b).max()), err_msg=name)

  close(y, ry, "y")
  close(aux["aux_loss"], raux, "aux_loss")
  close(gx, rgx, "dx")
  for k in rgp:
    close(gp[k], rgp[k], f"d{k}")
  if config.has_routed_bias:
    assert set(gp) == set(rgp) | {routing.BIAS_KEY}
    assert not np.asarray(gp[routing.BIAS_KEY]).any()  # state: exactly zero gradient


# ---------------------------------------------------------------------------------------------
# The aux-loss-free bias update.
# ---------------------------------------------------------------------------------------------


def test_update_routed_bias_formula():
  bias = jnp.array([0.0, 0.5, -0.5, 0.25], jnp.float32)
  load = jnp.array([10, 2, 4, 4], jnp.int32)  # mean 5
  got = routing.update_routed_bias(bias, load, rate=0.125)
  np.testing.assert_array_equal(np.asarray(got), [-0.125, 0.625, -0.375, 0.375])
  assert got.dtype == jnp.float32
  even = routing.update_routed_bias(bias, jnp.full((4,), 3), rate=0.125)
  np.testing.assert_array_equal(np.asarray(even), np.asarray(bias))  # sign(0) = 0


def test_bias_update_evens_out_skewed_load():
  """Skewed routing: max/mean load falls over steps of the jitted update."""
  config = V3
  params = _params(config, seed=6)
  x = jax.random.normal(jax.random.key(7), (512, config.d_model), jnp.float32)
  # NOTE: feature 0 is 1 for every token and the router's row 0 ramps from +2 (expert 0) to -2:
  # low experts are chosen far more often than their share.
  x = x.at[:, 0].set(1.0)
  router = params["router"].at[0].add(jnp.linspace(2.0, -2.0, config.num_experts))
  steps = 200

  @jax.jit
  def run(bias):
    def step(bias, _):
      r = routing.route(x, router, config=config, bias=bias)
      load = jnp.bincount(r.expert_ids.reshape(-1), length=config.num_experts)
      ratio = load.max() / load.mean()
      return routing.update_routed_bias(bias, load, rate=0.01), ratio

    return jax.lax.scan(step, bias, None, length=steps)

  bias, ratios = run(jnp.zeros((config.num_experts,), jnp.float32))
  ratios = np.asarray(ratios)
  assert ratios[0] > 2.0, ratios[:5]
  assert ratios[-20:].mean() < 1.3, ratios[-20:]
  assert ratios[-20:].mean() < 0.5 * ratios[0]
  # NOTE: the bias went up for the starved high experts and down for the favoured low ones.
  assert float(bias[-1]) > 0 > float(bias[0])


# ---------------------------------------------------------------------------------------------
# Compiled memory of the router (AOT, v5e).
# ---------------------------------------------------------------------------------------------


def _largest_intermediate(jaxpr) -> int:
  """Elements of the largest array any equation of `jaxpr` (and its sub-jaxprs) produces."""
  best = 0
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      best = max(best, int(np.prod(getattr(v.aval, "shape", ()) or (1,))))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      best = max(best, _largest_intermediate(sub))
  return best


def test_router_has_no_tokens_x_experts_x_experts_temporaries():
  """Forward and gradient of DeepSeek-V3-style routing: no array larger than [T, E] (accept. 5).

  The traced program is what every backend compiles; the compiled v5e figure for 256 experts at
  8192 tokens is in bench/results/memory.md (`python tests/layer/test_routing.py`, minutes of
  compile).
  """
  config = MoEConfig(
    num_experts=64,
    top_k=8,
    d_model=32,
    expert_ffn_dim=8,
    score_func="sigmoid",
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
  )
  t, e = 256, config.num_experts
  x = jnp.zeros((t, config.d_model))
  router = jnp.zeros((config.d_model, e))
  bias = jnp.zeros((e,))

  def loss(x, router):
    r = routing.route(x, router, config=config, bias=bias)
    return jnp.sum(r.weights) + jnp.sum(r.probs.mean(0) ** 2)

  fwd = jax.make_jaxpr(lambda x, w: routing.route(x, w, config=config, bias=bias))(x, router)
  bwd = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, router)
  assert _largest_intermediate(fwd.jaxpr) == t * e
  assert _largest_intermediate(bwd.jaxpr) == t * e
  # NOTE: the walker does see a [T, E, E] temporary (a pairwise rank), even inside a jit.
  pairwise = jax.jit(lambda s: jnp.sum(s[:, :, None] > s[:, None, :], axis=-1))
  assert _largest_intermediate(jax.make_jaxpr(pairwise)(jnp.zeros((t, e))).jaxpr) == t * e * e


def router_temp_bytes(*, tokens: int = 8192, topology: str = "v5e:2x2") -> dict[str, int]:
  """Compiled temp bytes of DeepSeek-V3's router (256 experts, 8 groups, top-4 groups, top-8)
  on one device of a TPU topology (AOT, needs libtpu): forward (`route`) and forward + backward
  (grad of a loss of the combine weights and the aux-loss probabilities wrt x and router).

  Args:
    tokens: tokens on the device.
    topology: a `get_topology_desc` name.

  Returns:
    `{"fwd": bytes, "fwd_bwd": bytes}`.
  """
  from jax.experimental import topologies

  config = MoEConfig(
    num_experts=256,
    top_k=8,
    d_model=7168,
    expert_ffn_dim=2048,
    score_func="sigmoid",
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    dtype="bfloat16",
  )
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  dev = jax.sharding.SingleDeviceSharding(topo.devices[0])
  x = jax.ShapeDtypeStruct((tokens, config.d_model), jnp.bfloat16, sharding=dev)
  router = jax.ShapeDtypeStruct((config.d_model, config.num_experts), jnp.float32, sharding=dev)
  bias = jax.ShapeDtypeStruct((config.num_experts,), jnp.float32, sharding=dev)

  def fwd(x, router, bias):
    r = routing.route(x, router, config=config, bias=bias)
    return r.expert_ids, r.weights, r.probs

  def loss(x, router, bias):
    r = routing.route(x, router, config=config, bias=bias)
    return jnp.sum(r.weights) + jnp.sum(r.probs.mean(0) ** 2)

  out = {}
  with jax.default_device(topo.devices[0]):
    for name, fn in (("fwd", fwd), ("fwd_bwd", jax.grad(loss, argnums=(0, 1)))):
      compiled = jax.jit(fn).lower(x, router, bias).compile()
      out[name] = int(compiled.memory_analysis().temp_size_in_bytes)
  return out


if __name__ == "__main__":
  # NOTE: the figure in bench/results/memory.md:
  # JAX_PLATFORMS=cpu PYTHONPATH=. python tests/layer/test_routing.py
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  t, e = 8192, 256
  temp = router_temp_bytes(tokens=t)
  print(f"v5e router temp bytes, T={t} tokens, E={e}: {temp}")
  print(f"one f32 [T, E] array: {t * e * 4:,} B; one f32 [T, E, E] array: {t * e * e * 4:,} B")
