"""The MoE router: scores, expert choice (greedy, DeepSeek-V2 and DeepSeek-V3 group-limited),
combine weights, and DeepSeek-V3's aux-loss-free correction-bias update.

Methods (`MoEConfig.topk_method`, Hugging Face names):

- "greedy": top-k of the scores.
- "group_limited_greedy" (DeepSeek-V2): softmax scores; the experts are split into `n_group`
  contiguous groups; a group's score is its best expert's score; each token keeps its best
  `topk_group` groups and takes the top-k among their experts.
- "noaux_tc" (DeepSeek-V3): sigmoid scores; a per-expert correction bias is added for the choice
  only; a group's score is the sum of its two best biased scores; top-k among the kept groups'
  experts by biased score; the combine weights are the *unbiased* scores of the chosen experts.

Combine weights: normalised to sum 1 if `norm_topk_prob` (DeepSeek methods: only when top_k > 1,
as in their code), then times `routed_scaling_factor`.

Ties break deterministically towards the lower index, at both stages: between equal group scores
the lower group index is kept, between equal expert scores the lower expert id is chosen
(`jax.lax.top_k`'s documented order). Experts outside the kept groups are masked to -inf, so they
are never chosen (see `select_experts`).

Memory: every temporary is [T, E] or smaller ([T, n_group, E / n_group] is a reshape of [T, E];
the group mask is [T, n_group]); nothing is [T, E, E].

The correction bias is state, not a weight: `init_params` stores it as `params[BIAS_KEY]` (f32
[E]); the router reads it through `stop_gradient`, so its gradient is exactly 0, and
`update_routed_bias` moves it after a step from the global per-expert load (`aux["expert_load"]`
of the MoE block).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

__all__ = [
  "BIAS_KEY",
  "Routing",
  "combine_weights",
  "group_mask",
  "route",
  "router_logits",
  "select_experts",
  "update_routed_bias",
]

# NOTE: Hugging Face's name of DeepSeek-V3's gate buffer, so checkpoints convert by key.
BIAS_KEY = "e_score_correction_bias"

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["expert_ids", "weights", "probs"],
  meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class Routing:
  """The router's decision for a block of tokens.

  Attributes:
    expert_ids: [T, k] int32 chosen experts (distinct per token), best first.
    weights: [T, k] f32 combine weights (normalised if `norm_topk_prob`, times
      `routed_scaling_factor`).
    probs: [T, E] f32 unbiased scores normalised to sum to 1 per token (for the
      load-balancing loss).
  """

  expert_ids: jax.Array
  weights: jax.Array
  probs: jax.Array


def router_logits(x: jax.Array, router: jax.Array, *, float32: bool = True) -> jax.Array:
  """Gate logits `x @ router` as f32.

  Args:
    x: [T, d] tokens.
    router: [d, E] router weights.
    float32: multiply in f32 (MaxText `float32_gate_logits=True`); else in x's dtype.

  Returns:
    [T, E] f32 logits.
  """
  dt = jnp.float32 if float32 else x.dtype
  logits = jnp.dot(x.astype(dt), router.astype(dt), precision=_HIGHEST)
  return logits.astype(jnp.float32)


def group_mask(
  choice_scores: jax.Array, *, n_group: int, topk_group: int, group_score: str
) -> jax.Array:
  """Which experts lie in each token's best `topk_group` groups.

  Args:
    choice_scores: [T, E] the scores the choice is made on (biased for DeepSeek-V3).
    n_group: groups of `E / n_group` contiguous experts.
    topk_group: groups kept per token.
    group_score: "max" (DeepSeek-V2: the group's best score) or "top2_sum" (DeepSeek-V3: the sum
      of its two best scores).

  Returns:
    [T, E] bool, True for experts of kept groups. Equal group scores keep the lower group.
  """
  t, e = choice_scores.shape
  grouped = choice_scores.reshape(t, n_group, e // n_group)
  if group_score == "max":
    scores = jnp.max(grouped, axis=-1)
  elif group_score == "top2_sum":
    scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  else:
    raise ValueError(f"group_score must be 'max' or 'top2_sum', got {group_score!r}.")
  _, kept = jax.lax.top_k(scores, topk_group)  # [T, topk_group], ties -> lower group
  # NOTE: [T, topk_group, n_group] compares, then any: at most [T, E] elements (groups <= E).
  keep = jnp.any(kept[:, :, None] == jnp.arange(n_group, dtype=kept.dtype), axis=1)
  return jnp.broadcast_to(keep[:, :, None], grouped.shape).reshape(t, e)


def select_experts(
  scores: jax.Array,
  *,
  top_k: int,
  topk_method: str = "greedy",
  n_group: int = 1,
  topk_group: int = 1,
  bias: jax.Array | None = None,
) -> jax.Array:
  """The chosen experts of each token (no gradient flows through a choice).

  Args:
    scores: [T, E] f32 unbiased scores (softmax or sigmoid of the logits).
    top_k: experts per token.
    topk_method: "greedy", "group_limited_greedy" or "noaux_tc".
    n_group: expert groups (grouped methods).
    topk_group: groups kept per token (grouped methods).
    bias: [E] correction bias added to the scores for the choice ("noaux_tc").

  Returns:
    [T, top_k] int32 expert ids, best (by choice score) first; ties -> lower id.
  """
  choice = scores
  if topk_method == "noaux_tc":
    if bias is None:
      raise ValueError(f"topk_method='noaux_tc' needs the correction bias (params[{BIAS_KEY!r}]).")
    choice = scores + bias.astype(jnp.float32)[None, :]
  if topk_method != "greedy" and n_group > 1:
    kind = "top2_sum" if topk_method == "noaux_tc" else "max"
    keep = group_mask(choice, n_group=n_group, topk_group=topk_group, group_score=kind)
    # NOTE: -inf, not the 0.0 of Hugging Face's DeepSeek code: a masked expert can never win
    # over a kept one, even when biased scores are negative (as in DeepSeek-V3's inference code).
    choice = jnp.where(keep, choice, -jnp.inf)
  _, ids = jax.lax.top_k(jax.lax.stop_gradient(choice), top_k)
  return ids.astype(jnp.int32)


def combine_weights(
  scores: jax.Array,
  ids: jax.Array,
  *,
  norm_topk_prob: bool,
  routed_scaling_factor: float,
  deepseek_rules: bool = False,
) -> jax.Array:
  """The chosen experts' unbiased scores, normalised if asked, times the scaling factor.

  Args:
    scores: [T, E] unbiased scores.
    ids: [T, k] chosen experts.
    norm_topk_prob: divide by the chosen scores' sum.
    routed_scaling_factor: multiplies the weights.
    deepseek_rules: DeepSeek-V2/V3's code: normalise only when k > 1, and add 1e-20 to the sum.

  Returns:
    [T, k] f32 weights (differentiable in `scores`).
  """
  w = jnp.take_along_axis(scores, ids, axis=-1)
  return _scale_chosen(
    w,
    norm_topk_prob=norm_topk_prob,
    routed_scaling_factor=routed_scaling_factor,
    deepseek_rules=deepseek_rules,
  )


def _scale_chosen(w, *, norm_topk_prob, routed_scaling_factor, deepseek_rules):
  """`combine_weights` from the chosen scores [T, k]."""
  if norm_topk_prob and not (deepseek_rules and w.shape[-1] == 1):
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + (1e-20 if deepseek_rules else 0.0))
  return w * routed_scaling_factor


def route(x: jax.Array, router: jax.Array, *, config, bias: jax.Array | None = None) -> Routing:
  """The router: logits, scores, expert choice by `config.topk_method`, combine weights.

  Args:
    x: [T, d] tokens.
    router: [d, E] router weights.
    config: the `MoEConfig` (score_func, topk_method, n_group, topk_group, top_k,
      norm_topk_prob, routed_scaling_factor, float32_gate_logits).
    bias: [E] correction bias (needed for "noaux_tc"); read through stop_gradient.

  Returns:
    A `Routing`.
  """
  logits = router_logits(x, router, float32=config.float32_gate_logits)
  if config.score_func == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  if bias is not None:
    bias = jax.lax.stop_gradient(bias)
  if config.topk_method == "greedy":
    # NOTE: the choice is made on the scores themselves: top_k's values are the chosen scores
    # (and carry their gradient), so no gather by the ids follows it.
    chosen, ids = jax.lax.top_k(scores, config.top_k)
    weights = _scale_chosen(
      chosen,
      norm_topk_prob=config.norm_topk_prob,
      routed_scaling_factor=config.routed_scaling_factor,
      deepseek_rules=False,
    )
    return Routing(expert_ids=ids.astype(jnp.int32), weights=weights, probs=probs)
  ids = select_experts(
    scores,
    top_k=config.top_k,
    topk_method=config.topk_method,
    n_group=config.n_group,
    topk_group=config.topk_group,
    bias=bias,
  )
  weights = combine_weights(
    scores,
    ids,
    norm_topk_prob=config.norm_topk_prob,
    routed_scaling_factor=config.routed_scaling_factor,
    deepseek_rules=config.topk_method != "greedy",
  )
  return Routing(expert_ids=ids, weights=weights, probs=probs)


def update_routed_bias(bias: jax.Array, expert_load: jax.Array, *, rate: float) -> jax.Array:
  """DeepSeek-V3's aux-loss-free balancing step: `bias + rate * sign(mean_load - load_e)`.

  Under-loaded experts get a higher bias (chosen more often next step), over-loaded ones a lower
  one. Pure and jit-friendly; call it once per training step with the step's global counts.

  Args:
    bias: [E] f32 correction bias (`params[BIAS_KEY]`).
    expert_load: [E] rows routed to each expert over the global batch (`aux["expert_load"]`).
    rate: the update speed (MaxText `routed_bias_update_rate`; DeepSeek-V3 used 0.001).

  Returns:
    The new [E] bias, in bias's dtype.
  """
  load = expert_load.astype(jnp.float32)
  step = rate * jnp.sign(jnp.mean(load) - load)
  return (bias.astype(jnp.float32) + step).astype(bias.dtype)
