"""The serving forward of the MoE layer: few XLA ops and one fused expert kernel per device.

At decode sizes (1 to a few hundred tokens per device) a layer's time is the weight reads plus
a fixed cost per launched op, so this path is built for few ops, not for the training path's
features (no aux loss, no drop counters, no backward). On one device, inside `jax.shard_map`
over (data, expert), with T tokens and `ep` devices on the expert axis:

  exchange in   `all_gather` of the tokens over the expert axis: [ep * T, d], one collective.
                Every device routes all ep * T tokens itself (the router is replicated, the
                computation is the same everywhere, so every device gets the same choice):
                no ids or weights cross the wire, and no exchange plan is computed.
  route         `routing.route` (every routing method of `MoEConfig`).
  select        the (token, choice) rows whose expert lives here, sorted by local expert (one
                argsort of ep * T * k keys), their group sizes, a gather of their token rows.
  experts       `fused_experts.fused_experts`: gate/up, SwiGLU, the routing weights and down in
                one kernel that reads only the non-empty local experts' weights.
  exchange out  a scatter-add of the rows into their tokens, then `psum_scatter` over the expert
                axis: each device gets its own T tokens, summed over the devices that hold
                their experts.

The exchange moves ep * T * d elements each way where the ragged all-to-all of `moe_block`
moves about T * k * d: the same at k = ep, more for ep > k. At decode sizes those bytes take
microseconds; the exchange plan the ragged path needs (counts, offsets, a second collective) is
about a third of that layer's ops (`bench/results/decode-ops.md`).

Where the rows do not fit the fused kernel's VMEM (`fused_experts.plan_fused`), the experts
run as the gmm pair of `moe.expert_mlp`; the rest of the path is the same.
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
from pallas_moe.config import MoEConfig
from pallas_moe.moe import _axis_size, expert_mlp, expert_slots, param_specs, shared_mlp
from pallas_moe.routing import BIAS_KEY, route

__all__ = ["DecodePlan", "plan_decode", "decode_block", "moe_decode"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePlan:
  """The serving forward's static choices for T tokens per device.

  Attributes:
    tokens: T, tokens per device.
    expert_parallelism: devices on the expert axis.
    rows: rows of the expert buffer: every (token, choice) of the ep * T tokens that can land
      here, ep * T * min(k, E_l).
    experts: "fused" (`fused_experts`) or "gmm" (`moe.expert_mlp`, where the rows do not fit
      the fused kernel's VMEM).
    fused: the fused kernel's plan ("fused" only).
  """

  tokens: int
  expert_parallelism: int
  rows: int
  experts: str
  fused: fe.FusedPlan | None

  def describe(self) -> str:
    head = f"decode: {self.tokens} tokens per device, EP {self.expert_parallelism}, "
    if self.fused is None:
      return head + f"{self.rows} expert rows through the gmm pair (too many for VMEM)"
    p = self.fused
    return head + (
      f"{self.rows} expert rows through the fused kernel (chunk {p.chunk} of f={p.f}, "
      f"window {p.window}, {p.kind} weights, {p.vmem_bytes / 2**20:.1f} MiB VMEM)"
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
  ep = expert_parallelism
  e_local = _local_experts(config, ep)
  rows = ep * tokens_per_device * min(config.top_k, e_local)
  kind = fe.weight_kind(weights) if weights is not None else "float"
  w_dtype = weights.dtype if weights is not None else config.weight_dtype
  try:
    fused = fe.plan_fused(
      rows=rows,
      d=config.d_model,
      f=config.expert_ffn_dim,
      num_experts=e_local,
      x_dtype=config.compute_dtype,
      w_dtype=w_dtype,
      kind=kind,
      block=getattr(weights, "block", quant.BLOCK),
      generation=generation,
      tokens=ep * tokens_per_device,
    )
  except ValueError:
    if kind == "block":
      raise
    fused = None
  return DecodePlan(
    tokens=tokens_per_device,
    expert_parallelism=ep,
    rows=rows,
    experts="fused" if fused is not None else "gmm",
    fused=fused,
  )


def _check(config: MoEConfig) -> None:
  for role in ("fsdp_axis", "tensor_axis"):
    name = getattr(config, role)
    if (_axis_size(name) or 1) > 1:
      raise ValueError(
        f"the serving forward keeps each device's experts whole: {role}={name!r} splits "
        "them; serve on a (data, expert) mesh or call moe_layer."
      )


def _select_local(routing, *, config: MoEConfig, ep_index, e_local: int, rows: int):
  """(token of each row, routing weight of each row, group sizes): the (token, choice) rows
  whose expert is on this device, sorted by local expert; rows past the groups' sum are other
  devices' (the kernel never reads them)."""
  k = config.top_k
  slots = expert_slots(routing.expert_ids, placement=config.expert_placement).reshape(-1)
  here = slots // e_local == ep_index
  # NOTE: rows of other devices sort last (key e_local). One sort carries each row's token and
  # weight along, so no gather by the permutation follows it; the order within an expert's
  # rows is free (each row carries its own token and weight), so the sort need not be stable.
  key = jnp.where(here, slots % e_local, e_local).astype(jnp.int32)
  token = jnp.arange(key.shape[0], dtype=jnp.int32) // k
  _, token, weight = jax.lax.sort(
    (key, token, routing.weights.reshape(-1).astype(jnp.float32)), num_keys=1, is_stable=False
  )
  # NOTE: a [rows, E_l] compare-and-sum: one small fusion where a bincount is a scatter.
  group_sizes = jnp.sum(
    key[:, None] == jnp.arange(e_local, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32
  )
  return token[:rows], weight[:rows], group_sizes


# NOTE: every token index is in range by construction, so the row gather and scatter-add are
# XLA's own, without the index wrapping and clamping jnp's indexing adds around them.
_ROWS = dict(mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _take_rows(table, index):
  """table[index] for [n, d] table and [r] int32 indices."""
  dims = jax.lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
  )
  return jax.lax.gather(table, index[:, None], dims, slice_sizes=(1, table.shape[1]), **_ROWS)


def _add_rows(table, index, rows):
  """table.at[index].add(rows) for [n, d] table, [r] int32 indices, [r, d] rows."""
  dims = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
  )
  return jax.lax.scatter_add(table, index[:, None], rows, dims, **_ROWS)


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
  _check(config)
  ep = _axis_size(config.expert_axis) or 1
  ep_axis = config.expert_axis if ep > 1 else None
  t, d = x.shape
  dt = config.compute_dtype
  wi, wo = params["wi"], params["wo"]
  if plan is None:
    plan = plan_decode(config, tokens_per_device=t, expert_parallelism=ep, weights=wi)
  if (plan.tokens, plan.expert_parallelism) != (t, ep):
    raise ValueError(
      f"plan is for {plan.tokens} tokens and EP {plan.expert_parallelism}, the call has {t} "
      f"tokens and EP {ep}; plan with plan_decode(config, tokens_per_device={t}, "
      f"expert_parallelism={ep})."
    )
  e_local = _local_experts(config, ep)
  x = x.astype(dt)
  with jax.named_scope("dispatch"):
    tokens = x if ep == 1 else jax.lax.all_gather(x, ep_axis, tiled=True)
  with jax.named_scope("route"):
    routing = route(tokens, params["router"], config=config, bias=params.get(BIAS_KEY))
  with jax.named_scope("sort"):
    me = jax.lax.axis_index(ep_axis) if ep_axis is not None else 0
    token_of, row_weights, group_sizes = _select_local(
      routing, config=config, ep_index=me, e_local=e_local, rows=plan.rows
    )
  with jax.named_scope("experts"):
    if plan.fused is not None:
      # NOTE: the kernel gathers the rows from the tokens and sums them back per token.
      y = fe.fused_experts(
        tokens,
        wi,
        wo,
        group_sizes,
        row_weights=row_weights,
        row_tokens=token_of,
        plan=plan.fused,
        interpret=interpret,
      )
    else:
      rows = _take_rows(tokens, token_of)
      out = expert_mlp(rows, wi, wo, group_sizes, config=config, row_weights=row_weights)
      y = _add_rows(jnp.zeros((ep * t, d), jnp.float32), token_of, out.astype(jnp.float32))
  with jax.named_scope("combine"):
    if ep > 1:
      y = jax.lax.psum_scatter(y, ep_axis, tiled=True)
  if config.shared_width:
    gate = params["shared_gate"] if config.shared_expert_gate else None
    y = y + shared_mlp(
      x,
      params["shared_wi"],
      params["shared_wo"],
      gate=gate,
      float32_gate=config.float32_gate_logits,
    )
  return y.astype(dt)


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
