"""An expert-parallel Mixture-of-Experts block built from small pure functions.

Data flow on one device (inside `jax.shard_map` over a mesh with a data axis and an expert axis;
`T` local tokens, `k = top_k`, `E` experts, `ep` = expert-axis size, `E_l = E / ep`):

  route        `routing.route`: logits = x @ router (f32) -> scores -> expert choice (greedy, or
               DeepSeek's group-limited methods) -> ids [T, k] and weights [T, k]
  sort         flat row r = t * k + j; `order` = stable argsort of the flat ids; sorted rows are
               x[order // k] (a gather; its VJP is a scatter-add into [T, d]), grouped by expert
  dispatch     ep > 1: `collectives.dispatch` sends expert e's rows to device e // E_l; received
               rows arrive sorted by (local expert, sender), with `recv_group_sizes` for gmm.
               ep == 1: no collective; the sorted rows are the buffer.
  experts      gmm(rows, wi[E_l, d, 2f]) -> SwiGLU -> gmm(., wo[E_l, f, d])
  combine      the reverse exchange; rows that were dropped come back masked to exactly 0
  unsort       an inverse-permutation gather back to (token, choice) order, then the weighted sum
               over the k choices (+ the shared-expert MLP, with Qwen2-MoE's per-token gate
               `sigmoid(x @ shared_gate)` when `config.shared_expert_gate`)

Deduplicated exchange (`config.dedup_dispatch`, `dedup_dispatch_for`; the default where it moves
fewer bytes): instead of sort / dispatch / combine / unsort above, a token crosses the exchange
once per destination device with its routing weights and local expert ids packed into the row;
the receiver expands it into one row per local expert for the gmm (an HBM gather) and sums their
weighted outputs into one row for the way back; the sender sums the rows that come home over
devices. Same sums in another order. See `pallas_moe.dedup` (it drops whole sent rows, each
with all of its token's choices on that device).
`config.dispatch_quantization` ("int8" | "fp8") sends those rows in 8 bits with their scales in
the same row (`dedup.quantized_dispatch`); the combine and the backward stay in `dtype`.

Weights split over fsdp and tensor axes (`config.fsdp_axis`, `config.tensor_axis`; see
`pallas_moe.sharding` and `pallas_moe.mesh`): the block gathers each weight's model dimension
over fsdp where it is split, pairs its gate/up columns across the tensor axis after the gate/up
gmm, and sums the layer's output over the tensor axis once, after the combine. Tokens are split
over (data, fsdp, expert) and replicated over tensor.

Expert placement (`config.expert_placement`, a permutation `placement` of range(E)): weight slot
j (device j // E_l) holds global expert placement[j]; `place_experts` stores `wi`/`wo` that way.
The router (weights, correction bias, DeepSeek's groups) keeps the original ids; right after the
choice, `expert_slots` maps them to slots, and sort / dispatch / experts / combine run on slots.
The aux loss and `expert_load` are in original expert order (`slot_counts_to_experts`).

No dense [tokens, experts] one-hot matrix is built: group sizes are a bincount, sorting is an
argsort, and every data movement is a gather/scatter of the rows' own size.

Receive-buffer rows (a static shape). See `buffer_rows_for`:
  - `config.buffer_factor = f`: `ceil(f * T * k)` rows; overflow is dropped and counted.
  - dropless (default), with `buffer_rows=` from `dropless_buffer_rows(...)`: exact. That helper
    runs the router ahead of the step on the concrete batch and returns the largest number of
    rows any device will receive (rounded up to a bucket so that the jitted step is recompiled
    only when the need grows past a bucket). This is what "exact" can mean with static shapes.
  - dropless without `buffer_rows=` (e.g. inside a jit that has no concrete routing): the static
    bound `ep * T * min(k, E_l)` (every token of every peer sends all of its choices that can
    land on one device to this device). Never drops, but is `ep`-times the balanced load.
  In every mode the block returns `dropped_rows` and `needed_rows` so callers can check:
  `dropped_rows` counts (token, choice) assignments that were not computed in either exchange
  (`dropped_exchange_rows` the rows refused on the wire, in the exchange's own unit).

Batch split (`config.batch_split`, MaxText `batch_split_factor`; `batch_split_for`): the router
runs once over all T tokens, then each of S chunks of T / S consecutive tokens goes through
sort -> dispatch -> experts -> combine -> unsort by itself, so one chunk's exchange can overlap
another chunk's gmms. The buffer rules above then apply to a chunk (T / S tokens): dropless
results equal the unsplit block's exactly; with a capacity factor each chunk drops on its own
(chunk-local overflow can differ from whole-batch overflow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_moe import collectives, sharding
from pallas_moe import dedup as dedup_lib
from pallas_moe import fused_experts as fe
from pallas_moe import mesh as mesh_lib
from pallas_moe.block_plan import (
  BlockPlan,
  batch_split_for,
  buffer_rows_for,
  dedup_dispatch_for,
  default_batch_split,
  exchange_bytes_per_token,
  plan_block,
)
from pallas_moe.config import MoEConfig, check_expert_placement
from pallas_moe.ops import gmm
from pallas_moe.routing import BIAS_KEY, Routing, route, router_logits, update_routed_bias
from pallas_moe.tiles import Tiling

__all__ = [
  "BlockPlan",
  "Routing",
  "aux_loss_probs",
  "batch_split_for",
  "buffer_rows_for",
  "dedup_dispatch_for",
  "default_batch_split",
  "dropless_buffer_rows",
  "exchange_bytes_per_token",
  "expert_slots",
  "init_params",
  "load_balance_loss",
  "moe_block",
  "moe_layer",
  "param_specs",
  "place_experts",
  "plan_block",
  "plan_layer",
  "route",
  "slot_counts_to_experts",
  "sort_by_expert",
  "swiglu",
  "trainable",
  "update_routed_bias",
]

_HIGHEST = jax.lax.Precision.HIGHEST

# The params indexed by expert (leading axis E, split over the expert axis, stored in slot order
# under `config.expert_placement`). The router and the correction bias are indexed by expert too,
# but in the original order: they are not here.
EXPERT_KEYS = ("wi", "wo")

# WORKAROUND: makes gmm's CPU interpret mode lower inside shard_map(check_vma=True); see the module.


# ---------------------------------------------------------------------------------------------
# Parameters.
# ---------------------------------------------------------------------------------------------


def init_params(key: jax.Array, config: MoEConfig) -> dict[str, jax.Array]:
  """Random parameters (fan-in scaled normals) in `config.weight_dtype`.

  Args:
    key: a PRNG key.
    config: the layer config.

  Returns:
    A dict: `router` [d, E]; `wi` [E, d, 2f] (gate columns then up columns); `wo` [E, f, d];
    with shared experts also `shared_wi` [d, 2s] and `shared_wo` [s, d], `s = config.shared_width`;
    with `shared_expert_gate` also `shared_gate` [d, 1] (Qwen2-MoE's `shared_expert_gate`);
    with `topk_method="noaux_tc"` also the correction bias `e_score_correction_bias` [E] f32,
    zeros (`routing.BIAS_KEY`): state, not a weight (its gradient is exactly 0; update it with
    `update_routed_bias`, leave it out of the optimizer with `trainable`).
  """
  d, e, f, s = config.d_model, config.num_experts, config.expert_ffn_dim, config.shared_width
  keys = jax.random.split(key, 5)
  dt = config.param_dtype

  def normal(k, shape, fan_in):
    return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dt)

  params = {
    "router": normal(keys[0], (d, e), d),
    "wi": normal(keys[1], (e, d, 2 * f), d),
    "wo": normal(keys[2], (e, f, d), f),
  }
  if s:
    params["shared_wi"] = normal(keys[3], (d, 2 * s), d)
    params["shared_wo"] = normal(keys[4], (s, d), s)
  if config.shared_expert_gate:
    # NOTE: fold_in, not a sixth split: the other params stay what they were for a given key.
    params["shared_gate"] = normal(jax.random.fold_in(key, 5), (d, 1), d)
  if config.has_routed_bias:
    # NOTE: f32 whatever weight_dtype is: updates of rate 1e-3 would vanish in bf16.
    params[BIAS_KEY] = jnp.zeros((e,), jnp.float32)
  return params


def trainable(params: dict) -> tuple[dict, dict]:
  """Splits params into `(weights, state)`: the state is the correction bias, if any.

  Args:
    params: see `init_params`.

  Returns:
    Two dicts whose union is `params`; give only the first to the optimizer.
  """
  state = {k: v for k, v in params.items() if k == BIAS_KEY}
  return {k: v for k, v in params.items() if k != BIAS_KEY}, state


def param_specs(config: MoEConfig, params: dict | None = None) -> dict[str, P]:
  """PartitionSpecs of the parameters over the config's mesh axes.

  The routed experts are split over the expert axis (experts), the fsdp axis (the model
  dimension d) and the tensor axis (the MLP width: `wi`'s 2f columns, `wo`'s f rows); the
  shared experts over fsdp (d) and tensor (their width); the router and the shared gate over
  fsdp (d). The correction bias (E floats of state) is replicated. No weight is replicated
  over an fsdp axis. Axes the config does not have are left out, so with only data and expert
  axes this is experts split, the rest replicated.

  Args:
    config: the layer config.
    params: the params (only their keys are used); default: those `init_params` makes.

  Returns:
    A dict of `PartitionSpec`s with the params' keys.
  """
  keys = params.keys() if params is not None else _param_keys(config)
  return sharding.weight_specs(config, keys)


def _param_keys(config: MoEConfig) -> tuple[str, ...]:
  keys = ("router", "wi", "wo")
  keys += ("shared_wi", "shared_wo") if config.shared_width else ()
  keys += ("shared_gate",) if config.shared_expert_gate else ()
  return keys + ((BIAS_KEY,) if config.has_routed_bias else ())


def place_experts(params: dict, *, placement, undo: bool = False) -> dict:
  """Reorders the expert weights into (or, with `undo`, out of) an expert placement's slots.

  Moves a checkpoint stored in expert order (`init_params`, Hugging Face, MaxText) to the slot
  order a `MoEConfig(expert_placement=placement)` block reads: `wi[j]` and `wo[j]` become
  expert placement[j]'s. The router and the correction bias stay in expert order (the block
  routes with the original ids). Apply it to optimizer moments of the same keys too.

  Args:
    params: a dict like `init_params`'s (only the `EXPERT_KEYS` entries are moved; they must
      have the whole E experts on their leading axis, i.e. unsharded or globally shaped).
    placement: a permutation of range(E) (`MoEConfig.expert_placement`); None returns `params`.
    undo: map slot-ordered weights back to expert order (e.g. to save a checkpoint, or to read
      gradients per expert).

  Returns:
    A new dict with the same keys; the other entries are the same arrays.
  """
  if placement is None:
    return dict(params)
  out = dict(params)
  for key in EXPERT_KEYS:
    if key not in params:
      continue
    w = params[key]
    order = np.asarray(check_expert_placement(placement, num_experts=w.shape[0]))
    # NOTE: placing gathers by the placement (slot j <- expert order[j]); undoing gathers by its
    # inverse (expert e <- slot argsort(order)[e]).
    out[key] = w[np.argsort(order) if undo else order]
  return out


# ---------------------------------------------------------------------------------------------
# Routing, sorting, experts.
# ---------------------------------------------------------------------------------------------


def sort_by_expert(expert_ids: jax.Array, *, num_experts: int):
  """Sorts the flat (token, choice) rows by expert.

  Args:
    expert_ids: [T, k] int chosen experts.
    num_experts: E.

  Returns:
    `(order, inverse, group_sizes)`: `order` [T*k] flat row indices (`t * k + j`) sorted stably by
    expert; `inverse` [T*k] its inverse permutation (`inverse[order[i]] = i`); `group_sizes` [E]
    int32 rows per expert.
  """
  flat = expert_ids.reshape(-1)
  n = flat.shape[0]
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  # NOTE: the inverse permutation by a scatter of positions: O(n), no second sort.
  inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, inverse, group_sizes


def expert_slots(expert_ids: jax.Array, *, placement: tuple[int, ...] | None) -> jax.Array:
  """The weight slots that hold the routed experts under an expert placement.

  Args:
    expert_ids: [T, k] int original expert ids (the router's choice).
    placement: `MoEConfig.expert_placement` (slot j holds expert placement[j]) or None.

  Returns:
    [T, k] int32 slot ids: `argsort(placement)[expert_ids]`; the ids themselves for None.
  """
  if placement is None:
    return expert_ids
  # NOTE: a static [E] table (the placement is part of the config), so a gather of T * k ints.
  return _slot_of(placement)[expert_ids]


def slot_counts_to_experts(slot_counts: jax.Array, *, placement: tuple[int, ...] | None):
  """Per-slot counts (e.g. rows per slot) back in original expert order.

  Args:
    slot_counts: [E] values per slot.
    placement: `MoEConfig.expert_placement` or None.

  Returns:
    [E] values per original expert: `out[placement[j]] = slot_counts[j]`.
  """
  if placement is None:
    return slot_counts
  # NOTE: expert e's count sits in slot slot_of[e] (the same table as `expert_slots`).
  return slot_counts[_slot_of(placement)]


def _slot_of(placement: tuple[int, ...]) -> jax.Array:
  """[E] int32: the slot holding each expert, the inverse permutation `argsort(placement)`."""
  return jnp.asarray(np.argsort(np.asarray(placement)), jnp.int32)


def swiglu(h: jax.Array) -> jax.Array:
  """`silu(gate) * up` of `h = [gate | up]` ([..., 2f] -> [..., f])."""
  f = h.shape[-1] // 2
  return jax.nn.silu(h[..., :f]) * h[..., f:]


def _grouped_matmul(
  rows, w, group_sizes, *, tiling, config: MoEConfig, expected_rows=None, scale_axis=None
):
  if config.gmm_impl == "ragged_dot":
    return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=rows.dtype)
  implementation = None if config.gmm_impl == "pallas" else config.gmm_impl
  return gmm(
    rows,
    w,
    group_sizes,
    preferred_element_type=rows.dtype,
    tiling=tiling,
    weight_quantization=config.weight_quantization,
    activation_quantization=config.activation_quantization,
    # NOTE: the receive buffer's rows past the received ones are never read (combine sends only
    # the received rows back; their gradients stay in those rows): no zero writes for them.
    unowned_rows="undefined",
    expected_rows=expected_rows,
    implementation=implementation,
    weight_scale_axis=scale_axis if config.weight_quantization is not None else None,
  )


def expert_mlp(
  rows,
  wi,
  wo,
  group_sizes,
  *,
  config: MoEConfig,
  expected_rows: int | None = None,
  row_weights: jax.Array | None = None,
  tilings: tuple[Tiling | None, Tiling | None] | None = None,
  tensor_axis: str | None = None,
  fused: Any = None,
) -> jax.Array:
  """SwiGLU experts over rows sorted by (local) expert.

  With `row_weights`, the down projection and the activation before it are rematerialized: the
  backward recomputes the scaled `swiglu(h)` from h (which the gate/up projection's backward
  keeps anyway), so neither a [B, f] activation nor the [B, d] output is kept from the forward
  to the backward. Without, `swiglu(h)` is kept (rematerializing it there saves nothing in the
  compiled MoE block: AOT v5e 2x4, its temp grew 56-127 MB).

  Args:
    rows: [B, d] rows sorted by expert; the outputs of rows past `sum(group_sizes)` are
      undefined (`gmm(..., unowned_rows="undefined")`): callers never read them.
    wi: [G, d, 2f] gate|up weights of the G experts `group_sizes` describes.
    wo: [G, f, d] down weights.
    group_sizes: [G] int32.
    config: the layer config (tilings, gmm_impl).
    expected_rows: how many of the B rows are expected to be real (a receive buffer's typical
      fill), a hint for gmm's default tiles (`gmm(..., expected_rows=)`); None: B.
    row_weights: optional [B] f32 per-row scales (routing weights), applied to the activation
      before the down projection: `(w * swiglu(h)) @ wo == w * (swiglu(h) @ wo)`, whose
      gradient for w needs the activation the backward recomputes, not the [B, d] output.
    tilings: the (gate/up, down) gmms' tiles, as a `BlockPlan` resolved them; None:
      `config.wi_tiling` / `config.wo_tiling` (None there: gmm's pickers).
    tensor_axis: the mesh axis the MLP width is split over (bound, size > 1): wi / wo hold
      this device's share (`sharding`), its [gate | up] columns are paired across the axis
      (`sharding.pair_gate_up`), quantized `wo` scales span the whole width, and the output is
      this device's partial sum. None: the width is whole.
    fused: a streamed `fused_experts.FusedPlan` (`BlockPlan.fused`): one fused kernel instead
      of the gmm pair, reading and writing only the rows of `group_sizes`; forward only (a
      gradient through it raises). wi / wo may then be quantized (`quant.QuantizedWeights`,
      `quant.BlockQuantizedWeights`).

  Returns:
    [B, d] expert outputs (scaled by `row_weights`).
  """
  with jax.named_scope("experts"):
    if fused is not None:
      if tensor_axis is not None:
        raise ValueError(
          "the fused expert kernel keeps each expert's MLP whole; with a tensor axis plan "
          "the block without it (BlockPlan.fused=None)."
        )
      return _fused_forward(rows, wi, wo, group_sizes, row_weights, plan=fused)
    return _expert_mlp(
      rows,
      wi,
      wo,
      group_sizes,
      config=config,
      expected_rows=expected_rows,
      row_weights=row_weights,
      tilings=tilings,
      tensor_axis=tensor_axis,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_forward(rows, wi, wo, group_sizes, row_weights, plan):
  return fe.fused_experts(
    rows,
    wi,
    wo,
    group_sizes,
    row_weights=row_weights,
    stream=True,
    unowned_rows="undefined",
    plan=plan,
  )


def _fused_fwd(rows, wi, wo, group_sizes, row_weights, plan):
  return _fused_forward(rows, wi, wo, group_sizes, row_weights, plan), None


def _fused_bwd(plan, residuals, g):
  raise ValueError(
    "the fused expert kernel (BlockPlan.fused) is forward only: differentiate a block planned "
    "with plan_block (the gmm pair), or serve with moe_decode."
  )


_fused_forward.defvjp(_fused_fwd, _fused_bwd)


def _expert_mlp(
  rows, wi, wo, group_sizes, *, config, expected_rows, row_weights, tilings, tensor_axis
):
  wi_tiling, wo_tiling = tilings or (config.wi_tiling, config.wo_tiling)
  kw = dict(config=config, expected_rows=expected_rows)
  h = _grouped_matmul(rows, wi, group_sizes, tiling=wi_tiling, **kw)
  if tensor_axis is not None:
    h = sharding.pair_gate_up(h, axis=tensor_axis, size=jax.lax.axis_size(tensor_axis))
  if row_weights is None:
    return _grouped_matmul(
      swiglu(h), wo, group_sizes, tiling=wo_tiling, scale_axis=tensor_axis, **kw
    )

  def down(h, wo, group_sizes, row_weights):
    act = (swiglu(h).astype(jnp.float32) * row_weights[:, None]).astype(h.dtype)
    return _grouped_matmul(act, wo, group_sizes, tiling=wo_tiling, scale_axis=tensor_axis, **kw)

  return jax.checkpoint(down)(h, wo, group_sizes, row_weights)


def shared_output(params: dict, x, config: MoEConfig, *, tensor_axis: str | None = None):
  """The shared experts' output on the tokens x (`config.shared_width` > 0): `shared_mlp` with
  the params' shared weights and, where the config gates it, the per-token gate."""
  gate = params["shared_gate"] if config.shared_expert_gate else None
  return shared_mlp(
    x,
    params["shared_wi"],
    params["shared_wo"],
    gate=gate,
    float32_gate=config.float32_gate_logits,
    tensor_axis=tensor_axis,
  )


def shared_mlp(
  x, wi, wo, *, gate=None, float32_gate: bool = True, tensor_axis: str | None = None
) -> jax.Array:
  """Dense SwiGLU MLP (the shared experts): `swiglu(x @ wi) @ wo`, optionally gated per token.

  Args:
    x: [T, d] tokens.
    wi: [d, 2s] gate|up weights.
    wo: [s, d] down weights.
    gate: None, or [d, 1] Qwen2-MoE's `shared_expert_gate`: the output is multiplied per token
      by `sigmoid(x @ gate)`.
    float32_gate: the gate's logit `x @ gate` in f32 (like the router's, `float32_gate_logits`);
      else in x's dtype. The sigmoid and the product are in f32 either way.
    tensor_axis: see `expert_mlp` (wi / wo then hold this device's share of the width s).

  Returns:
    [T, d] f32.
  """
  h = jnp.dot(x, wi)
  if tensor_axis is not None:
    h = sharding.pair_gate_up(h, axis=tensor_axis, size=jax.lax.axis_size(tensor_axis))
  out = jnp.dot(swiglu(h), wo).astype(jnp.float32)
  if gate is None:
    return out
  # NOTE: Hugging Face's Qwen2-MoE applies this Linear(d, 1) and the sigmoid in the model dtype.
  # Here the logit is computed like the router's (f32 by default): a [T, d] x [d, 1] product
  # costs nothing next to the MLP, and in bf16 the result differs from HF's only by rounding.
  return out * jax.nn.sigmoid(router_logits(x, gate, float32=float32_gate))


# ---------------------------------------------------------------------------------------------
# Load balancing and buffer sizing.
# ---------------------------------------------------------------------------------------------


def load_balance_loss(
  *,
  probs,
  group_sizes,
  top_k: int,
  axes: tuple[str, ...] = (),
  definition: str = "switch",
  expert_ids=None,
  seq_len: int | None = None,
):
  """The load-balancing loss of `MoEConfig.aux_loss_definition`, over the global batch.

  With `c_e` the rows routed to expert e, `T` tokens, `k = top_k`, `E` experts and
  `P_e = mean_t probs[t, e]` (`f_e` gets no gradient):

  - "switch": `E * sum_e f_e * P_e`, `f_e = c_e / (T * k)` (the share of routed rows). 1 for
    uniform routing. DeepSeek's `MoEGate.forward` with `seq_aux: false` (deepseek-ai's
    `modeling_deepseek.py`: `fi = one_hot(topk_idx).mean(0) * E`, `(Pi * fi).sum()`).
  - "hf": `E * sum_e (c_e / T) * P_e`, i.e. `k` times "switch": transformers'
    `load_balancing_loss_func` (`models/mixtral/modeling_mixtral.py`, the same in Qwen2-MoE and
    Qwen3-MoE): `tokens_per_expert` is the mean over tokens of the top-k one-hot. NOTE: HF pools
    all layers' counts and probabilities before the product; this is one layer's value.
  - "sequence": the mean over sequences of "switch" computed per sequence of `seq_len` tokens:
    DeepSeek's `MoEGate.forward` with `seq_aux: true` (`ce = counts / (S * k / E)`,
    `(ce * scores.mean(seq)).sum(1).mean()`) and MaxText's `MoeBlock.load_balance_loss`
    (`maxtext/layers/moe.py`: `density = mean_seq(one_hot) / k`,
    `mean(density * density_prob) * E**2`). Pass MaxText's `probs` for "maxtext_scored".
  - "maxtext_scored": "sequence"'s formula; the caller passes MaxText's `density_prob` input,
    `softmax(score_func(logits))` (see `aux_loss_probs`).

  With `seq_len=None` the per-sequence definitions take the whole batch as one sequence.

  Args:
    probs: [T, E] per-token probabilities (`Routing.probs`, or `aux_loss_probs`).
    group_sizes: [E] rows per expert on this device (original expert order).
    top_k: experts per token.
    axes: mesh axes the batch is split over (summed over with psum).
    definition: one of `config.AUX_LOSS_DEFINITIONS`.
    expert_ids: [T, k] chosen experts; needed for the per-sequence definitions with `seq_len`.
    seq_len: tokens per sequence (`MoEConfig.aux_loss_seq_len`); must divide T, so that each
      device holds whole sequences.

  Returns:
    Scalar f32 loss, the same on every device.
  """
  num_experts = probs.shape[-1]
  t = probs.shape[0]
  per_sequence = definition in ("sequence", "maxtext_scored") and seq_len is not None
  if definition not in ("switch", "hf", "sequence", "maxtext_scored"):
    raise ValueError(
      f"load_balance_loss: definition={definition!r} is not one of 'switch', 'hf', "
      "'sequence', 'maxtext_scored'."
    )
  if not per_sequence:
    counts = group_sizes.astype(jnp.float32)
    prob_sum = jnp.sum(probs, axis=0)
    tokens = jnp.asarray(t, jnp.float32)
    if axes:
      counts, prob_sum, tokens = (
        jax.lax.psum(_vary(v, axes), axes) for v in (counts, prob_sum, tokens)
      )
    rows = tokens if definition == "hf" else tokens * top_k
    f = jax.lax.stop_gradient(counts / rows)
    return num_experts * jnp.sum(f * prob_sum / tokens)
  if expert_ids is None or t % seq_len:
    raise ValueError(
      f"load_balance_loss: definition={definition!r} with seq_len={seq_len} needs expert_ids "
      f"and T={t} tokens on each device a multiple of seq_len (MoEConfig.aux_loss_seq_len: "
      "each device must hold whole sequences); change the batch or the sequence length."
    )
  nb = t // seq_len
  seq = jnp.arange(t, dtype=jnp.int32) // seq_len
  counts = jnp.zeros((nb, num_experts), jnp.float32).at[seq[:, None], expert_ids].add(1.0)
  f = jax.lax.stop_gradient(counts / (seq_len * top_k))
  p = jnp.mean(probs.reshape(nb, seq_len, num_experts), axis=1)
  total = num_experts * jnp.sum(f * p)
  sequences = jnp.asarray(nb, jnp.float32)
  if axes:
    total, sequences = (jax.lax.psum(_vary(v, axes), axes) for v in (total, sequences))
  return total / sequences


def aux_loss_probs(routing: Routing, x, router, *, config: MoEConfig):
  """The [T, E] probabilities `load_balance_loss` averages, per `config.aux_loss_definition`.

  `Routing.probs` (the unbiased scores normalised per token), except for "maxtext_scored":
  MaxText's gate applies `routed_score_func` and its loss applies softmax on top, so there
  `softmax(score_func(x @ router))`.
  """
  if config.aux_loss_definition != "maxtext_scored":
    return routing.probs
  logits = router_logits(x, router, float32=config.float32_gate_logits)
  softmax = config.score_func == "softmax"
  scores = jax.nn.softmax(logits, axis=-1) if softmax else jax.nn.sigmoid(logits)
  return jax.nn.softmax(scores, axis=-1)


# ---------------------------------------------------------------------------------------------
# The block.
# ---------------------------------------------------------------------------------------------


def _axis_size(name: str | None) -> int | None:
  if name is None:
    return None
  try:
    return int(jax.lax.axis_size(name))
  except NameError:
    return None


def _vary(x, axes):
  """Marks `x` as varying over `axes` (a no-op outside shard_map)."""
  have = getattr(getattr(jax.typeof(x), "mat", None), "varying", None)
  if have is None:
    return x
  missing = tuple(a for a in axes if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def moe_block(
  params: dict,
  x: jax.Array,
  config: MoEConfig,
  *,
  buffer_rows: int | None = None,
  plan: BlockPlan | None = None,
):
  """The MoE block on one device's tokens (call inside `jax.shard_map`, or plainly for ep = 1).

  Expert weights are this device's shard (`E / ep` contiguous slots; slot j holds expert
  `config.expert_placement[j]`, or j); router and shared weights are whole. Collectives run
  over `config.expert_axis` when that axis is bound with size > 1; the load-balancing loss and
  counters are summed over whichever of the data and expert axes are bound.

  Every default (exchange, chunks, buffer rows, tiles) is resolved first, into `plan`
  (`plan_block`); the data path below consults no table.

  With `S = plan.batch_split` > 1 chunks, the router runs once over all T tokens (so the
  load-balancing loss and `expert_load` are those of the whole batch), then each chunk of
  `T / S` consecutive tokens is sorted, dispatched, run through the experts and combined on its
  own, under `jax.named_scope(f"batch_split_{c}")`. No chunk reads another's results, so XLA may
  run chunk c's exchange while chunk c' computes.

  Args:
    params: see `init_params` (`wi`/`wo` sharded over the expert axis).
    x: [T, d] this device's tokens.
    config: the layer config.
    buffer_rows: static receive-buffer rows of one chunk; None: see `buffer_rows_for` (with
      the chunk's `T / S` tokens).
    plan: the resolved plan (`plan_block` for these T tokens and this expert axis, or
      `plan_layer`); None: made here. Its `buffer_rows` wins over the argument.

  Returns:
    `(y, aux)`: y [T, d] in `config.dtype`; aux a dict of scalars: `aux_loss` (unweighted
    load-balancing loss), `dropped_rows` (global count, over all chunks, of the (token, choice)
    assignments that were not computed because their row did not fit a receive buffer: the
    same unit whichever exchange runs, so a drop rate is `dropped_rows / (tokens * top_k)`),
    `dropped_exchange_rows` (global count of rows refused on the wire, in the exchange's unit:
    (token, choice) rows in the plain exchange, equal to `dropped_rows`; (token, device) rows
    with the deduplicated one, each taking all of that token's choices on that device, so
    `dropped_rows` >= it), `needed_rows` (the largest count of expert rows any device and chunk
    wanted: the exact dropless buffer of a chunk), `buffer_rows` (the static expert-row buffer
    of a chunk); and
    `expert_load` [E] int32, the rows routed to each expert over the global batch, in original
    expert order whatever `config.expert_placement` is (for `update_routed_bias`).
  """
  dt = config.compute_dtype
  k = config.top_k
  ep = _axis_size(config.expert_axis) or 1
  fsdp = _axis_size(config.fsdp_axis) or 1
  tp = _axis_size(config.tensor_axis) or 1
  axes = tuple(a for a in config.batch_axes if _axis_size(a) is not None)
  t, d = x.shape
  if plan is None:
    plan = plan_block(
      config,
      tokens_per_device=t,
      expert_parallelism=ep,
      tensor_parallelism=tp,
      buffer_rows=buffer_rows,
    )
  _check_plan(plan, tokens_per_device=t, expert_parallelism=ep, tensor_parallelism=tp)
  _check_local_weights(params, config, plan=plan, tp=tp)
  split, tc = plan.batch_split, plan.chunk_tokens
  tilings = (plan.wi_tiling, plan.wo_tiling)
  x = x.astype(dt)
  # NOTE: weights split over fsdp are gathered whole here (cast first: fewer bytes to move);
  # nothing below waits for the tokens to reach them, so the gathers overlap the routing.
  params = sharding.gather_model_dim(
    params,
    d=d,
    axis=config.fsdp_axis if fsdp > 1 else None,
    size=fsdp,
    dtypes={key: dt for key in ("wi", "wo", "shared_wi", "shared_wo")},
  )
  tensor = config.tensor_axis if tp > 1 else None
  with jax.named_scope("route"):
    routing = route(x, params["router"], config=config, bias=params.get(BIAS_KEY))
  # NOTE: routing in original ids; from here on rows go to weight slots (`expert_slots`).
  slot_ids = expert_slots(routing.expert_ids, placement=config.expert_placement)
  wi, wo = params["wi"], params["wo"]
  chunks = [
    _Chunk(
      x=x[c * tc : (c + 1) * tc],
      weights=routing.weights[c * tc : (c + 1) * tc],
      slot_ids=slot_ids[c * tc : (c + 1) * tc],
    )
    for c in range(split)
  ]
  for c, ch in enumerate(chunks):
    # NOTE: the scopes name the layer's stages in the compiled program (`bench.decode_ops`).
    with _chunk_scope(c, split), jax.named_scope("sort"):
      if plan.dedup:
        _layout_chunk(ch, config=config, ep=ep)
      else:
        _sort_chunk(ch, config=config)
  if plan.exchange == "none":
    for c, ch in enumerate(chunks):
      with _chunk_scope(c, split):
        ch.out = expert_mlp(
          ch.rows,
          wi,
          wo,
          ch.group_sizes,
          config=config,
          tilings=tilings,
          tensor_axis=tensor,
          fused=plan.fused,
        )
        ch.dropped = ch.dropped_exchange = jnp.zeros((), jnp.int32)
        ch.needed = jnp.asarray(tc * k, jnp.int32)
  elif plan.dedup:
    _pipelined_dedup_exchange(chunks, wi, wo, config=config, plan=plan, tensor_axis=tensor)
  else:
    _pipelined_exchange(chunks, wi, wo, config=config, plan=plan, tensor_axis=tensor)
  ys = []
  for c, ch in enumerate(chunks):
    with _chunk_scope(c, split), jax.named_scope("unsort"):
      if ch.y is not None:
        ys.append(ch.y)
        continue
      # NOTE: inverse[r] is where flat row r = t * k + j sits in sorted order.
      per_choice = ch.out[ch.inverse].reshape(tc, k, -1).astype(jnp.float32)
      ys.append(jnp.einsum("tk,tkd->td", ch.weights, per_choice, precision=_HIGHEST))
  y = ys[0] if split == 1 else jnp.concatenate(ys, axis=0)
  if config.shared_width:
    y = y + shared_output(params, x, config, tensor_axis=tensor)
  if tp > 1:
    # NOTE: the one tensor reduction of the layer: routed and shared partial outputs together,
    # in the output dtype (the bytes the reduction moves).
    y = jax.lax.psum(y.astype(dt), config.tensor_axis)
  aux = _block_aux(chunks, routing, x, params["router"], config=config, axes=axes, plan=plan)
  return y.astype(dt), aux


def _block_aux(chunks, routing: Routing, x, router, *, config: MoEConfig, axes, plan) -> dict:
  """The block's aux outputs (see `moe_block`), global over the batch `axes`."""
  # NOTE: the chunks' group sizes are per slot; the aux loss pairs them with the router's probs
  # and `update_routed_bias` with its bias, both in original expert order.
  group_sizes = slot_counts_to_experts(
    functools.reduce(jnp.add, [ch.group_sizes for ch in chunks]),
    placement=config.expert_placement,
  )
  dropped = functools.reduce(jnp.add, [ch.dropped for ch in chunks])
  dropped_exchange = functools.reduce(jnp.add, [ch.dropped_exchange for ch in chunks])
  needed = functools.reduce(jnp.maximum, [ch.needed for ch in chunks])
  return {
    "aux_loss": load_balance_loss(
      probs=aux_loss_probs(routing, x, router, config=config),
      group_sizes=group_sizes,
      top_k=config.top_k,
      axes=axes,
      definition=config.aux_loss_definition,
      expert_ids=routing.expert_ids,
      seq_len=config.aux_loss_seq_len,
    ),
    "dropped_rows": _global(dropped, axes, jax.lax.psum),
    "dropped_exchange_rows": _global(dropped_exchange, axes, jax.lax.psum),
    "needed_rows": _global(needed, axes, jax.lax.pmax),
    "buffer_rows": jnp.asarray(plan.buffer_rows, jnp.int32),
    "expert_load": _global(group_sizes, axes, jax.lax.psum),
  }


def _check_plan(
  plan: BlockPlan, *, tokens_per_device: int, expert_parallelism: int, tensor_parallelism: int
) -> None:
  made = (plan.tokens_per_device, plan.expert_parallelism, plan.tensor_parallelism)
  if made != (tokens_per_device, expert_parallelism, tensor_parallelism):
    raise ValueError(
      f"moe_block(plan=) was made for T={plan.tokens_per_device} tokens per device, "
      f"ep={plan.expert_parallelism}, tp={plan.tensor_parallelism}, but the block runs "
      f"T={tokens_per_device} with ep={expert_parallelism}, tp={tensor_parallelism}; make it "
      "with plan_block / plan_layer for this call."
    )


def _check_local_weights(params: dict, config: MoEConfig, *, plan: BlockPlan, tp: int) -> None:
  """This device's expert count and MLP widths are the mesh's shares (the model dim is checked
  where it is gathered, `sharding.gather_model_dim`)."""
  if params["wi"].shape[0] != plan.num_local_experts:
    raise ValueError(
      f"params['wi'] holds {params['wi'].shape[0]} experts on this device, expected "
      f"{plan.num_local_experts} = num_experts / expert-axis size; shard it over "
      f"{config.expert_axis!r} (moe.param_specs(config))."
    )
  widths = {"wi": 2 * config.expert_ffn_dim, "wo": config.expert_ffn_dim}
  if config.shared_width:
    widths |= {"shared_wi": 2 * config.shared_width, "shared_wo": config.shared_width}
  for key, width in widths.items():
    got = params[key].shape[sharding.WIDTH_DIM[key]]
    if got * tp != width:
      axis = f"its {config.tensor_axis!r} share " if tp > 1 else ""
      raise ValueError(
        f"params[{key!r}] {params[key].shape} holds {got} on its MLP width, expected "
        f"{axis}{width // tp}; place it with moe.param_specs(config)."
      )


@dataclasses.dataclass
class _Chunk:
  """One batch-split chunk's values as the block builds them (trace-time bookkeeping)."""

  x: jax.Array
  weights: jax.Array
  slot_ids: jax.Array
  order: jax.Array | None = None
  inverse: jax.Array | None = None
  group_sizes: jax.Array | None = None
  rows: jax.Array | None = None
  sorted_expert: jax.Array | None = None
  plan: collectives.RaggedPlan | None = None
  buf: jax.Array | None = None
  y_buf: jax.Array | None = None
  out: jax.Array | None = None
  # NOTE: dropped: (token, choice) assignments not computed; dropped_exchange: rows refused on
  # the wire, in the exchange's unit (the same rows in the plain exchange).
  dropped: jax.Array | None = None
  dropped_exchange: jax.Array | None = None
  needed: jax.Array | None = None
  # NOTE: the deduplicated path's send rows and their delivery, and its [T, d] f32 result.
  layout: dedup_lib.SendLayout | None = None
  delivered: jax.Array | None = None
  y: jax.Array | None = None


def _chunk_scope(c: int, split: int):
  # NOTE: the scope names the chunk in the HLO's op_name metadata (schedule checks read it).
  return jax.named_scope(f"batch_split_{c}") if split > 1 else contextlib.nullcontext()


def _sort_chunk(ch: _Chunk, *, config: MoEConfig) -> None:
  """Sorts a chunk's (token, choice) rows by weight slot; fills order, inverse, sizes, rows."""
  k = config.top_k
  slot_ids = ch.slot_ids
  # NOTE: slots, not expert ids (`expert_slots`): the group sizes, the plan and the received
  # groups follow the weights' order. Without a placement they are the same.
  ch.order, ch.inverse, ch.group_sizes = sort_by_expert(slot_ids, num_experts=config.num_experts)
  # NOTE: sorted row i is flat row order[i] = t * k + j, i.e. token order[i] // k.
  ch.rows = ch.x[ch.order // k]
  # NOTE: the expert of each sorted row, by a gather (a searchsorted over the group ends is a
  # while loop on TPU, which XLA's scheduler then places under the exchanges).
  ch.sorted_expert = slot_ids.reshape(-1)[ch.order].astype(jnp.int32)


def _layout_chunk(ch: _Chunk, *, config: MoEConfig, ep: int) -> None:
  """A chunk's deduplicated send rows (`dedup.send_layout`) and its per-slot group sizes."""
  num_local = config.num_experts // ep
  ch.layout = dedup_lib.send_layout(ch.slot_ids, ch.weights, num_local=num_local, ep=ep)
  # NOTE: per-slot counts for the aux loss and expert_load (the plain path's group sizes).
  ch.group_sizes = jnp.bincount(ch.slot_ids.reshape(-1), length=config.num_experts).astype(
    jnp.int32
  )


# NOTE: the pipeline's lookahead: chunk c is dispatched once chunk c - 2 has been combined.
_FENCE_LAG = 2


def _fence(send, done):
  """Ties chunk c's send rows to chunk c - `_FENCE_LAG`'s combined output; returns both.

  Forward: chunk c's dispatch waits for chunk c - 2's combine, the order the links run them in
  anyway (`bench.ep.pipeline_us`: in_0, in_1, out_0, in_2, out_1, ...). Backward, through the
  barrier's transpose: chunk c - 2's combine gradient (whose input, the loss gradient, is ready
  at once) waits for chunk c's dispatch gradient. Without it XLA issues every chunk's combine
  gradient up front and keeps every chunk's backward in flight at once: AOT v5e 2x4, EP 4 x data
  2, DeepSeek-V2-Lite in 4 chunks, 2,861 MB of temp against 2,426 MB with it.
  """
  return jax.lax.optimization_barrier((send, done))


def _pipelined_dedup_exchange(
  chunks: list[_Chunk], wi, wo, *, config: MoEConfig, plan: BlockPlan, tensor_axis=None
) -> None:
  """`_pipelined_exchange` with deduplicated rows (`pallas_moe.dedup`); fills y, the drops, needed.

  `plan.buffer_rows` is the expert-row capacity P of a chunk (as in the plain path); the
  exchange's receive buffer has `min(P, ep * T)` rows. Same trace order and barriers as
  `_pipelined_exchange`.
  """
  axis = config.expert_axis
  poison = config.debug_nan_poison
  split = len(chunks)
  ep, num_local, buffer_rows = plan.expert_parallelism, plan.num_local_experts, plan.buffer_rows
  tilings = (plan.wi_tiling, plan.wo_tiling)
  k = config.top_k
  tc = chunks[0].x.shape[0]
  unique_rows = max(1, min(buffer_rows, ep * tc))
  # NOTE: at the static worst case nothing can overflow: no clipping, no second all_gather.
  may_drop = buffer_rows < ep * tc * min(k, num_local)
  for c, ch in enumerate(chunks):
    with _chunk_scope(c, split), jax.named_scope("exchange_plan"):
      ch.plan, ch.delivered = dedup_lib.plan(
        ch.layout,
        axis_name=axis,
        buffer_rows=unique_rows,
        pair_rows=buffer_rows,
        may_drop=may_drop,
      )

  def dispatch(c):
    ch = chunks[c]
    x = ch.x
    if c >= _FENCE_LAG:
      x, chunks[c - _FENCE_LAG].y = _fence(x, chunks[c - _FENCE_LAG].y)
    with _chunk_scope(c, split), jax.named_scope("dispatch"):
      lay = ch.layout
      if config.dispatch_quantization is not None:
        ch.buf = dedup_lib.quantized_dispatch(
          x[lay.token],
          lay.weights,
          lay.local_ids,
          ch.plan,
          axis,
          config.dispatch_quantization,
          poison,
        )
        return
      packed = dedup_lib.pack_rows(x[lay.token], lay.weights, lay.local_ids)
      buf = collectives.dispatch(packed, ch.plan, axis_name=axis, poison=poison)
      ch.buf = dedup_lib.unpack_rows(buf, ch.x.shape[1], k, lay.local_ids.dtype)

  dispatch(0)
  prev = None
  for c, ch in enumerate(chunks):
    if c + 1 < split:
      dispatch(c + 1)
    with _chunk_scope(c, split):
      x_b, w_b, ids_b = ch.buf
      if prev is not None:
        # NOTE: without this XLA:TPU fuses the chunks' receiver passes (unpacking the ids, the
        # sort keys) into one multi-output fusion, so chunk c's expert rows wait for chunk c+1's
        # dispatch and nothing runs under the exchanges (AOT-compiled v5e/v6e 2x4, libtpu
        # 0.0.50.1). Ordering chunk c's receive after chunk c-1's expand keeps them apart.
        (x_b, w_b, ids_b), _ = jax.lax.optimization_barrier(((x_b, w_b, ids_b), prev))
      rows, sizes, src, weight, valid = dedup_lib.expand(
        x_b,
        w_b,
        ids_b,
        received=ch.plan.recv_group_sizes[0],
        num_local=num_local,
        pair_rows=buffer_rows,
      )
      prev = src
      # NOTE: the routing weights scale the expert rows' activations inside the MLP, so the
      # weights' gradient does not keep the [P, d] expert outputs for the backward. The fused
      # kernel is forward only: there they scale its outputs in the reduce's fusion, and the
      # kernel copies no [P, 1] f32 column (a row of 128 lanes, 512 bytes of HBM, per row).
      in_mlp = plan.fused is None
      y_rows = expert_mlp(
        rows,
        wi,
        wo,
        sizes,
        config=config,
        expected_rows=plan.expected_rows,
        row_weights=weight if in_mlp else None,
        tilings=tilings,
        tensor_axis=tensor_axis,
        fused=plan.fused,
      )
      y_u = dedup_lib.reduce_rows(
        y_rows, src=src, weight=None if in_mlp else weight, valid=valid, num_rows=unique_rows
      )
      with jax.named_scope("combine"):
        back = collectives.combine(
          y_u.astype(ch.x.dtype),
          ch.plan,
          num_rows=ch.layout.token.shape[0],
          axis_name=axis,
          poison=poison,
        )
      ch.y = dedup_lib.sum_home(back, ch.layout, ch.delivered, tokens=tc)
      # NOTE: a refused (token, device) row drops all of its token's choices on that device.
      ch.dropped = dedup_lib.dropped_pairs(ch.layout, ch.delivered)
      ch.dropped_exchange, ch.needed = ch.plan.num_dropped, ch.plan.needed_rows


def _pipelined_exchange(
  chunks: list[_Chunk], wi, wo, *, config: MoEConfig, plan: BlockPlan, tensor_axis=None
) -> None:
  """Dispatch -> experts -> combine for every chunk; fills out, the drops, needed.

  Traced in pipeline order: all plans, dispatch 0, then for each chunk c: dispatch c+1, experts
  c, combine c. Beyond the data dependences, one barrier per chunk binds XLA's scheduler
  (`_fence`): chunk c's dispatch follows chunk c-2's combine, and in the backward chunk c-2's
  combine gradient follows chunk c's dispatch gradient, so at most two chunks are in flight.
  """
  axis = config.expert_axis
  poison = config.debug_nan_poison
  split = len(chunks)
  buffer_rows = plan.buffer_rows
  tilings = (plan.wi_tiling, plan.wo_tiling)
  for c, ch in enumerate(chunks):
    with _chunk_scope(c, split), jax.named_scope("exchange_plan"):
      ch.plan = collectives.plan_from_group_sizes(
        ch.group_sizes, axis_name=axis, buffer_rows=buffer_rows
      )

  def dispatch(c):
    ch = chunks[c]
    rows = ch.rows
    if c >= _FENCE_LAG:
      rows, chunks[c - _FENCE_LAG].out = _fence(rows, chunks[c - _FENCE_LAG].out)
    # NOTE: the scopes name the two exchanges in op_name metadata (`bench.hlo_schedule`).
    with _chunk_scope(c, split), jax.named_scope("dispatch"):
      ch.buf = collectives.dispatch(rows, ch.plan, axis_name=axis, poison=poison)

  dispatch(0)
  for c, ch in enumerate(chunks):
    if c + 1 < split:
      dispatch(c + 1)
    with _chunk_scope(c, split):
      # NOTE: every device sends its chunk's T*k sorted rows, so a device receives that many
      # on average (more under skewed routing): the buffer's typical fill, the tiles' hint.
      ch.y_buf = expert_mlp(
        ch.buf,
        wi,
        wo,
        ch.plan.recv_group_sizes,
        config=config,
        expected_rows=plan.expected_rows,
        tilings=tilings,
        tensor_axis=tensor_axis,
        fused=plan.fused,
      )
      with jax.named_scope("combine"):
        back = collectives.combine(
          ch.y_buf, ch.plan, num_rows=ch.rows.shape[0], axis_name=axis, poison=poison
        )
      ch.out = _mask_dropped(back, ch.plan, ch.sorted_expert)
      # NOTE: a row here is one (token, choice): both drop counts are the same.
      ch.dropped = ch.dropped_exchange = ch.plan.num_dropped
      ch.needed = ch.plan.needed_rows


def _mask_dropped(back, plan, sorted_expert):
  """Rows the receiver's buffer dropped come back as exactly 0."""
  # NOTE: sorted row i belongs to slot e = sorted_expert[i]; it was sent in chunk e (slots
  # are contiguous per device, so chunk index = slot) of which only the first send_sizes[e]
  # rows were delivered. Rows past that were dropped: force them to exactly 0.
  input_offsets, send_sizes = plan.dispatch_args[0], plan.dispatch_args[1]
  i = jnp.arange(back.shape[0], dtype=jnp.int32)
  delivered = (i - input_offsets[sorted_expert]) < send_sizes[sorted_expert]
  return jnp.where(delivered[:, None], back, jnp.zeros_like(back))


def _global(v, axes, reduce):
  return reduce(_vary(v, axes), axes) if axes else v


# ---------------------------------------------------------------------------------------------
# shard_map wrapper and exact buffer sizing.
# ---------------------------------------------------------------------------------------------


def plan_layer(
  config: MoEConfig, mesh: jax.sharding.Mesh, *, tokens: int, buffer_rows: int | None = None
) -> BlockPlan:
  """The `BlockPlan` `moe_layer` runs for `tokens` global tokens on `mesh`, before any data.

    print(plan_layer(config, mesh, tokens=x.shape[0]).describe())

  Args:
    config: the layer config.
    mesh: a mesh with the config's axes (`pallas_moe.make_mesh(config)` builds one).
    tokens: global tokens (divisible by the mesh's data x fsdp x expert size).
    buffer_rows: see `moe_block`.

  Returns:
    The plan of each device's block (all devices run the same one).
  """
  sizes = mesh_lib.check_mesh(mesh, config)
  devices = sizes.batch_devices
  if tokens % devices:
    raise ValueError(
      f"moe_layer: {tokens} tokens do not split over the mesh's batch axes "
      f"{config.batch_axes} = {devices} devices; pad the batch to a multiple of {devices}."
    )
  return plan_block(
    config,
    tokens_per_device=tokens // devices,
    expert_parallelism=sizes.expert,
    tensor_parallelism=sizes.tensor,
    buffer_rows=buffer_rows,
  )


def moe_layer(
  params: dict,
  x: jax.Array,
  config: MoEConfig,
  mesh: jax.sharding.Mesh,
  *,
  buffer_rows: int | None = None,
):
  """`moe_block` under `jax.shard_map` over `mesh`.

  Specs: x [tokens, d] split over the batch axes (data, fsdp, expert) on tokens, replicated over
  tensor; the weights as `param_specs` splits them (experts over expert, d over fsdp, the MLP
  width over tensor). y like x; aux replicated.

  Args:
    params: see `init_params` (global arrays: the same params on any mesh).
    x: [tokens, d] global tokens; tokens must divide by the mesh's data x fsdp x expert size.
    config: the layer config.
    mesh: a mesh with the config's axes (`pallas_moe.make_mesh(config)` builds one).
    buffer_rows: see `moe_block`.

  Returns:
    `(y, aux)` as `moe_block`, y global [tokens, d].
  """
  plan = plan_layer(config, mesh, tokens=x.shape[0], buffer_rows=buffer_rows)
  tok = mesh_lib.token_spec(config)
  fn = functools.partial(moe_block, config=config, plan=plan)
  aux_keys = (
    "aux_loss",
    "dropped_rows",
    "dropped_exchange_rows",
    "needed_rows",
    "buffer_rows",
    "expert_load",
  )
  aux_spec = {k: P() for k in aux_keys}
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(param_specs(config, params), tok),
    out_specs=(tok, aux_spec),
  )(params, x)


def _receive_counts(expert_ids: np.ndarray, *, num_experts: int, data: int, ep: int) -> np.ndarray:
  """[data, ep] rows each device receives, from global [tokens, k] expert ids (host numpy).

  `data` counts the devices of the batch axes above the expert axis (data x fsdp).
  """
  # NOTE: tokens are split over (data, fsdp, expert), expert minor: device (a, b) (a the data x
  # fsdp index) holds token block a * ep + b. It receives every row, from the ep devices of its
  # slice a, whose expert is one of its E_l experts [b * E_l, (b + 1) * E_l), i.e. whose
  # expert // E_l == b.
  ids = expert_ids.reshape(data, -1) // (num_experts // ep)
  return np.stack([np.bincount(row, minlength=ep) for row in ids])


def dropless_buffer_rows(params: dict, x, config: MoEConfig, mesh, *, multiple_of: int = 8) -> int:
  """The exact dropless receive buffer for this batch, computed ahead of the step.

  Runs only the router (sharded like the block, so the routing is the block's), pulls the expert
  ids to the host and counts the rows each device will receive (per chunk when the block splits
  its tokens: `batch_split_for`). Pass the result as
  `buffer_rows=` (a static argument: a new value recompiles the step; `multiple_of` buckets it).

  Args:
    params: the params (only `router` is used).
    x: [tokens, d] the global batch (concrete; may be sharded over several processes'
      devices: then call this on every process, which all get the same count).
    config: the layer config.
    mesh: the mesh `moe_layer` runs on.
    multiple_of: round the row count up to this.

  Returns:
    Rows per device that drop nothing for this batch.
  """
  from pallas_moe.common import host_value

  sizes = mesh_lib.check_mesh(mesh, config)
  ep, data = sizes.expert, sizes.data * sizes.fsdp
  # NOTE: on a mesh over several processes the ids span them: host_value gathers them to every
  # process (a collective; every process calls this helper, as it calls the step).
  ids = host_value(_router_ids(config, mesh)(params["router"], params.get(BIAS_KEY), x))
  if config.expert_placement is not None:
    # NOTE: a row goes to the device holding its expert's slot (`expert_slots`).
    ids = np.argsort(np.asarray(config.expert_placement))[ids]
  t = ids.shape[0] // (data * ep)
  split = batch_split_for(config, tokens_per_device=t, expert_parallelism=ep)
  # NOTE: with chunks the buffer is a chunk's: chunk c of every device is its tokens
  # [c * T / S, (c + 1) * T / S); the need is the largest over devices and chunks.
  chunks = ids.reshape(data * ep, split, t // split, config.top_k)
  need = max(
    int(
      _receive_counts(
        chunks[:, c].reshape(-1, config.top_k),
        num_experts=config.num_experts,
        data=data,
        ep=ep,
      ).max()
    )
    for c in range(split)
  )
  return max(1, -(-need // multiple_of) * multiple_of)


@functools.lru_cache(maxsize=16)
def _router_ids(config: MoEConfig, mesh):
  tok = mesh_lib.token_spec(config)

  def ids(router, bias, x):
    return route(x.astype(config.compute_dtype), router, config=config, bias=bias).expert_ids

  # NOTE: the router enters whole (P()): jit gathers an fsdp-split one first.
  return jax.jit(jax.shard_map(ids, mesh=mesh, in_specs=(P(), P(), tok), out_specs=tok))


def shardings(config: MoEConfig, mesh, params: dict | None = None):
  """NamedShardings `(params, x)` matching `moe_layer`'s specs (for device_put / AOT lowering)."""
  mesh_lib.check_mesh(mesh, config)
  ps = {k: NamedSharding(mesh, s) for k, s in param_specs(config, params).items()}
  return ps, NamedSharding(mesh, mesh_lib.token_spec(config))
