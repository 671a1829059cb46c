"""The serving forward of the MoE layer: few XLA ops and one fused expert kernel per device.

At decode sizes (1 to a few hundred tokens per device) a layer's time is the weight reads plus
a fixed cost per launched op, so this path is built for few ops, not for the training path's
features (no aux loss, no drop counters, no backward). On one device, inside `jax.shard_map`
over (data, expert), with T tokens and `ep` devices on the expert axis:

  exchange in   `all_gather` of the tokens over the expert axis: [ep * T, d], one collective.
                Every device routes all ep * T tokens itself (the router is replicated and the
                computation the same everywhere, so every device makes the same choice): no
                ids or weights cross the wire, and no exchange plan is computed.
  route         `routing.route` (every routing method of `MoEConfig`).
  select        each token's routing weight for each local expert, [E_l, ep * T] (0 where it
                chose another), and each local expert's token count: one small fusion, no sort.
  experts       `fused_experts.fused_experts(expert_weights=)`: every local expert a token chose
                runs over all ep * T tokens in one kernel (gate/up, SwiGLU, the weights, down,
                summed per token), reading only those experts' weights. At these sizes a pass
                over all the tokens costs the MXU what one over an expert's own rows would (a
                128-row pass), and no row is gathered or scattered.
  exchange out  `psum_scatter` over the expert axis, in the compute dtype: each device gets
                its own T tokens, summed over the devices that hold their experts.

The exchange moves ep * T * d elements each way where the ragged all-to-all of `moe_block`
moves about T * k * d: the same at k = ep, more for ep > k. At decode sizes those bytes take
microseconds; the exchange plan the ragged path needs (counts, offsets, a second collective) is
about a third of that layer's ops (`bench/results/decode-ops.md`).

Above `MAX_FUSED_TOKENS` tokens on the expert axis, or where the tokens do not fit the fused
kernel's VMEM (`fused_experts.plan_fused`), or above `GATHER_ABOVE` for fp8 block-scaled
experts multiplied as stored on a 128-wide MXU (whose partials outrun the MXU in the gathered
layout's 128-token windows), the forward is `moe.moe_block`'s (sort, ragged exchange), without
its aux outputs, and its experts are the fused kernel again, streaming the received rows from
HBM (`fused_experts(stream=True)`): each non-empty expert's weights read once, only the
received rows touched; on a megacore device (v5p) its two TensorCores take half of the visits
each.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_moe import fused_experts as fe
from pallas_moe import mesh as mesh_lib
from pallas_moe import quant
from pallas_moe import tiling as tiling_lib
from pallas_moe.block_plan import BlockPlan, plan_block
from pallas_moe.config import MoEConfig
from pallas_moe.generations import current_generation, get_generation
from pallas_moe.moe import _axis_size, expert_slots, moe_block, param_specs, shared_output
from pallas_moe.routing import BIAS_KEY, route

__all__ = [
  "DecodePlan",
  "plan_decode",
  "decode_block",
  "moe_decode",
  "GATHER_ABOVE",
  "MAX_FUSED_TOKENS",
]

# NOTE: up to one 128-row MXU pass, every visited expert runs over all ep * T tokens; above,
# the kernel gathers each expert's own tokens by a one-hot product (2 * N * d MACs per 128 of
# an expert's rows, against 3 * d * f for its MLP: a third more for Qwen3's f = 768 at 512).
GATHER_ABOVE = 128
MAX_FUSED_TOKENS = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePlan:
  """The serving forward's static choices for T tokens per device.

  Attributes:
    tokens: T, tokens per device.
    expert_parallelism: devices on the expert axis.
    path: "fused" (all-gather, the fused kernel over the ep * T tokens, reduce-scatter) or
      "block" (`moe.moe_block`'s forward: more tokens than the fused path takes).
    fused: the fused kernel's plan (path "fused").
    block: path "block": `moe_block`'s plan (its `fused`: the experts as the streamed fused
      kernel, or None: the gmm pair).
    reason: why the block path (empty on the fused path).
  """

  tokens: int
  expert_parallelism: int
  path: str
  fused: fe.FusedPlan | None = None
  block: BlockPlan | None = None
  reason: str = ""

  def describe(self) -> str:
    head = f"decode: {self.tokens} tokens per device, EP {self.expert_parallelism}: "
    if self.fused is None:
      experts = "the gmm pair" if self.block.fused is None else "the streamed fused kernel"
      return head + f"moe_block's forward, its experts {experts} ({self.reason})"
    p = self.fused
    layout = "each expert's tokens gathered" if p.gather else "every expert over all tokens"
    return head + (
      f"the fused kernel over {p.rows} tokens, {layout} (chunk {p.chunk} of "
      f"f={p.f}, {p.cores} TensorCore(s), {p.kind} weights, {p.vmem_bytes / 2**20:.1f} MiB VMEM)"
    )


def _local_experts(config: MoEConfig, ep: int) -> int:
  if config.num_experts % ep:
    raise ValueError(
      f"num_experts={config.num_experts} does not split over expert_parallelism={ep}."
    )
  return config.num_experts // ep


def plan_decode(
  config: MoEConfig,
  *,
  tokens_per_device: int,
  expert_parallelism: int = 1,
  weights: Any = None,
  generation: Any = None,
) -> DecodePlan:
  """Resolves the serving forward's choices before any data moves.

  Args:
    config: the layer config.
    tokens_per_device: T.
    expert_parallelism: devices on the expert axis.
    weights: the routed experts' `wi` (its kind and dtype pick the kernel's weight path);
      None: `config.weight_dtype` floats.
    generation: the TPU generation whose VMEM bounds the fused kernel (default: current).

  Returns:
    A `DecodePlan`.
  """
  ep, t = expert_parallelism, tokens_per_device
  e_local = _local_experts(config, ep)
  kind = fe.weight_kind(weights) if weights is not None else "float"
  plan = functools.partial(DecodePlan, tokens=t, expert_parallelism=ep)

  gen = get_generation(generation) if generation is not None else current_generation()

  def fused(rows: int, **layout) -> fe.FusedPlan:
    return fe.plan_fused(
      rows=rows,
      d=config.d_model,
      f=config.expert_ffn_dim,
      num_experts=e_local,
      x_dtype=config.compute_dtype,
      w_dtype=weights.dtype if weights is not None else config.weight_dtype,
      kind=kind,
      block=getattr(weights, "block", quant.BLOCK),
      generation=gen,
      **layout,
    )

  w_dtype = weights.dtype if weights is not None else config.weight_dtype
  route = fe.upcast_route(w_dtype, x_dtype=config.compute_dtype, generation=gen)
  # NOTE: the partials route's vector work grows with the window; on a 128-wide MXU it outruns
  # the MXU past `PARTIALS_MAX_WINDOW` rows. The gathered layout's windows are 128 tokens (the
  # routing weights' lane grid), so there its tokens go through the streamed kernel instead.
  fits = None
  if kind == "block" and route == "partials" and gen.mxu_size == 128:
    fits = fe.PARTIALS_MAX_WINDOW
  gather = ep * t > GATHER_ABOVE
  reason = f"{ep * t} > {MAX_FUSED_TOKENS} tokens"
  if gather and fits is not None:
    reason = (
      f"{ep * t} > {GATHER_ABOVE} tokens: the gathered layout's 128-token windows outrun the "
      f"MXU on block-scaled partials (a window of at most {fits} rows does not)"
    )
  elif ep * t <= MAX_FUSED_TOKENS:
    try:
      return plan(path="fused", fused=fused(ep * t, by_token=True, gather=gather))
    except ValueError as e:
      reason = str(e)
  with tiling_lib.use_generation(gen):
    # NOTE: no gmm tiles: the experts are the fused kernel below.
    block = plan_block(
      config, tokens_per_device=t, expert_parallelism=ep, tensor_parallelism=1, expert_tiles=False
    )
  # NOTE: the experts of moe_block's forward as one fused kernel streaming only the received
  # rows (no SwiGLU pass over the static buffer, no gmm metadata); a megacore device (v5p)
  # splits the visits between its two TensorCores.
  window = stream_window(ep * t * config.top_k / config.num_experts, fits=fits)
  block = dataclasses.replace(block, fused=fused(block.expert_rows, stream=True, window=window))
  return plan(path="block", block=block, reason=reason)


def stream_window(expected_rows: float, *, fits: int | None = None) -> int:
  """Rows per MXU pass of the streamed experts, for experts of `expected_rows` rows on
  average (ep x T x top_k / num_experts under even routing).

  An MXU pass costs at least 128 row cycles and a window its whole size, so 128 rows suit
  experts of up to about 128; above, one window covering an expert two and a half standard
  deviations (sqrt of the mean: rows are a sum of independent choices) past the mean costs
  less than two of 128. Capped at 256: a bigger expert takes two windows anyway.

  Args:
    expected_rows: the mean rows per expert.
    fits: where the step's vector work grows with the window (`fused_experts`' partials), the
      most rows a window may hold before it outruns the MXU: experts that fit it (to 2.5
      deviations) get a window of that many rows (each pass costs the MXU the same below it).
  """
  high = expected_rows + 2.5 * expected_rows**0.5
  if fits is not None and high <= fits:
    return fits
  if high <= 128:
    return 128
  return int(min(256, -(-high // 16) * 16))


def _check(config: MoEConfig, wi) -> None:
  if config.activation_quantization is not None:
    raise ValueError(
      f"activation_quantization={config.activation_quantization!r}: the serving forward "
      "multiplies activations in config.dtype; set it to None (weights may stay quantized)."
    )
  if config.weight_quantization is not None and fe.weight_kind(wi) == "float":
    raise ValueError(
      f"weight_quantization={config.weight_quantization!r} with float weights: the serving "
      "forward does not quantize per call; store them quantized once (pallas_moe.quantize or "
      "quantize_blocks) or set weight_quantization=None."
    )
  for role in ("fsdp_axis", "tensor_axis"):
    name = getattr(config, role)
    if (_axis_size(name) or 1) > 1:
      raise ValueError(
        f"the serving forward keeps each device's experts whole: {role}={name!r} splits "
        "them; serve on a (data, expert) mesh or call moe_layer."
      )


def _token_lists(weights):
  """([E_l, N] weights, [E_l, N] int32 tokens): each local expert's tokens first, with
  their weights at the same places; one sort of the [E_l, N] weights' zero pattern."""
  tokens = jnp.broadcast_to(jnp.arange(weights.shape[1], dtype=jnp.int32), weights.shape)
  _, tokens, weights = jax.lax.sort(
    ((weights == 0).astype(jnp.int32), tokens, weights), dimension=1, num_keys=1
  )
  return weights, tokens


def _expert_weights(routing, *, config: MoEConfig, ep_index, e_local: int):
  """([E_l, N] f32 each token's routing weight for each local expert, 0 where it chose
  another; [E_l] int32 tokens per local expert)."""
  slots = expert_slots(routing.expert_ids, placement=config.expert_placement)
  local = ep_index * e_local + jnp.arange(e_local, dtype=jnp.int32)
  # NOTE: [E_l, N, k] compares: a token chooses an expert at most once, so the sum over k
  # picks that choice's weight.
  chosen = slots[None, :, :] == local[:, None, None]
  weights = jnp.sum(jnp.where(chosen, routing.weights[None].astype(jnp.float32), 0.0), axis=2)
  counts = jnp.sum(chosen, axis=(1, 2), dtype=jnp.int32)
  return weights, counts


def decode_block(
  params: dict,
  x: jax.Array,
  config: MoEConfig,
  *,
  plan: DecodePlan | None = None,
  interpret: Any = None,
):
  """The serving forward on one device's tokens (inside `jax.shard_map`, or plainly for ep 1).

  Args:
    params: see `moe.init_params`: `wi` / `wo` this device's E / ep experts (float arrays,
      `quant.QuantizedWeights` or `quant.BlockQuantizedWeights`), router and shared weights
      whole.
    x: [T, d] this device's tokens.
    config: the layer config.
    plan: `plan_decode` for these T tokens and this expert axis; None: made here.
    interpret: the fused kernel's mode (see `fused_experts.fused_experts`).

  Returns:
    y [T, d] in `config.dtype`.
  """
  _check(config, params["wi"])
  ep = _axis_size(config.expert_axis) or 1
  ep_axis = config.expert_axis if ep > 1 else None
  t = x.shape[0]
  dt = config.compute_dtype
  if plan is None:
    plan = plan_decode(config, tokens_per_device=t, expert_parallelism=ep, weights=params["wi"])
  if (plan.tokens, plan.expert_parallelism) != (t, ep):
    raise ValueError(
      f"plan is for {plan.tokens} tokens and EP {plan.expert_parallelism}, the call has {t} "
      f"tokens and EP {ep}; plan with plan_decode(config, tokens_per_device={t}, "
      f"expert_parallelism={ep})."
    )
  if plan.path == "block":
    if plan.block.fused is None and fe.weight_kind(params["wi"]) == "block":
      raise ValueError(
        "block-scaled experts run only in the fused kernel, but the plan's block path has "
        "none; plan with plan_decode(..., weights=params['wi'])."
      )
    return moe_block(params, x, config, plan=plan.block)[0]
  x = x.astype(dt)
  y = _routed(params, x, config, plan=plan, ep_axis=ep_axis, interpret=interpret)
  if config.shared_width:
    y = y + shared_output(params, x, config)
  return y.astype(dt)


def _routed(params, x, config: MoEConfig, *, plan: DecodePlan, ep_axis, interpret):
  """The routed experts' output [T, d] f32 for this device's tokens."""
  ep = plan.expert_parallelism
  e_local = _local_experts(config, ep)
  with jax.named_scope("dispatch"):
    tokens = x if ep == 1 else jax.lax.all_gather(x, ep_axis, tiled=True)
  with jax.named_scope("route"):
    routing = route(tokens, params["router"], config=config, bias=params.get(BIAS_KEY))
  with jax.named_scope("sort"):
    me = jax.lax.axis_index(ep_axis) if ep_axis is not None else 0
    weights, counts = _expert_weights(routing, config=config, ep_index=me, e_local=e_local)
    lists = None
    if plan.fused.gather:
      weights, lists = _token_lists(weights)
  with jax.named_scope("experts"):
    y = fe.fused_experts(
      tokens,
      params["wi"],
      params["wo"],
      counts,
      expert_weights=weights,
      expert_tokens=lists,
      plan=plan.fused,
      interpret=interpret,
    )
  with jax.named_scope("combine"):
    if ep > 1:
      y = jax.lax.psum_scatter(y, ep_axis, tiled=True)
  return y


def moe_decode(
  params: dict, x: jax.Array, config: MoEConfig, mesh: jax.sharding.Mesh, *, interpret: Any = None
):
  """`decode_block` under `jax.shard_map` over a (data, expert) mesh.

  Args:
    params: global params (`moe.init_params`, or loaded with `from_hf`); `wi` / `wo` may be
      quantized (`quant.quantize`, `quant.quantize_blocks`).
    x: [tokens, d] global tokens, split over the mesh's batch axes.
    config: the layer config.
    mesh: a mesh with the config's axes; fsdp and tensor axes of size 1.
    interpret: see `decode_block`.

  Returns:
    y [tokens, d] like x.
  """
  sizes = mesh_lib.check_mesh(mesh, config)
  if sizes.fsdp > 1 or sizes.tensor > 1:
    raise ValueError(
      f"moe_decode keeps each device's experts whole, but the mesh splits them (fsdp "
      f"{sizes.fsdp}, tensor {sizes.tensor}); serve on a (data, expert) mesh."
    )
  devices = sizes.batch_devices
  if x.shape[0] % devices:
    raise ValueError(
      f"moe_decode: {x.shape[0]} tokens do not split over {devices} devices; pad the batch."
    )
  plan = plan_decode(
    config,
    tokens_per_device=x.shape[0] // devices,
    expert_parallelism=sizes.expert,
    weights=params["wi"],
  )
  tok = mesh_lib.token_spec(config)
  specs = _weight_specs(config, params)
  fn = functools.partial(decode_block, config=config, plan=plan, interpret=interpret)
  return jax.shard_map(fn, mesh=mesh, in_specs=(specs, tok), out_specs=tok)(params, x)


def _weight_specs(config: MoEConfig, params: dict) -> dict:
  """`param_specs`, with a quantized weight's scales split like its values over experts."""
  specs = param_specs(config, params)
  out = {}
  for key, spec in specs.items():
    value = params[key]
    if isinstance(value, (quant.QuantizedWeights, quant.BlockQuantizedWeights)):
      expert = P(spec[0]) if len(spec) else P()
      out[key] = dataclasses.replace(value, values=expert, scales=expert)
    else:
      out[key] = spec
  return out
