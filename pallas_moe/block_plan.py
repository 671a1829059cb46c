"""What the MoE block runs, decided before any data moves: `BlockPlan` and the rules behind it.

`plan_block` resolves every default of a `MoEConfig` for one device's tokens, once: the exchange
(none, plain or deduplicated), the batch-split chunk count, the receive-buffer rows and the
tiles and kernels of the experts' grouped matmuls. The modeled tables (`batch_split`, `dedup`),
the installed libtpu's flags and the tile pickers are read here and nowhere in the data path:
`moe.moe_block` then runs route, dispatch, experts and combine straight through with the plan's
values. `print(plan.describe())` says what was chosen and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_moe import batch_split as batch_split_lib
from pallas_moe import collectives, ops, sharding
from pallas_moe import dedup as dedup_lib
from pallas_moe import tiling as tiling_lib
from pallas_moe.config import MoEConfig
from pallas_moe.tiles import Tiling

__all__ = [
  "BlockPlan",
  "batch_split_for",
  "buffer_rows_for",
  "dedup_dispatch_for",
  "default_batch_split",
  "exchange_bytes_per_token",
  "plan_block",
]

EXCHANGES = ("none", "plain", "dedup")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockPlan:
  """What `moe_block` runs on one device's tokens.

  Attributes:
    tokens_per_device: T, the device's tokens.
    expert_parallelism: ep, the expert-axis size.
    tensor_parallelism: tp, the tensor-axis size: the device's expert gmms are over f / tp of
      the MLP width.
    num_local_experts: E_l = E / ep, the experts whose weights the device holds.
    batch_split: S, chunks of T / S tokens each routed, exchanged and computed on their own.
    exchange: "none" (ep = 1), "plain" (one row per (token, choice)) or "dedup" (one row per
      (token, device), `pallas_moe.dedup`).
    buffer_rows: a chunk's static expert-row capacity P on the receiving device.
    expert_rows: rows of the experts' grouped matmuls (P with an exchange, T / S * k without).
    expected_rows: the rows the gmms expect to be real (T / S * k where that is fewer than
      `expert_rows`): the hint their tiles and cost estimates were chosen for; None: all.
    generation: the TPU generation the tiles were chosen for.
    wi: the gate/up projection's `ops.GmmPlan` (fwd, dlhs, drhs kernels); None for
      `gmm_impl="ragged_dot"`.
    wo: the down projection's.
    fused: a streamed `fused_experts.FusedPlan` over the `expert_rows`: the experts run as one
      fused kernel (gate/up, SwiGLU, down) reading only the received rows, forward only (the
      serving path, `decode.plan_decode`); None: the gmm pair.
    reasons: (decision, why) pairs, in words.
  """

  tokens_per_device: int
  expert_parallelism: int
  num_local_experts: int
  tensor_parallelism: int = 1
  batch_split: int
  exchange: str
  buffer_rows: int
  expert_rows: int
  expected_rows: int | None
  generation: str
  wi: ops.GmmPlan | None
  wo: ops.GmmPlan | None
  fused: Any = None
  reasons: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

  @property
  def chunk_tokens(self) -> int:
    """Tokens per chunk, T / S."""
    return self.tokens_per_device // self.batch_split

  @property
  def dedup(self) -> bool:
    return self.exchange == "dedup"

  @property
  def wi_tiling(self) -> Tiling | None:
    """The gate/up gmm's tiles per pass, as the data path passes them (None: no tiles)."""
    return _tiling_of(self.wi)

  @property
  def wo_tiling(self) -> Tiling | None:
    return _tiling_of(self.wo)

  def describe(self) -> str:
    """The plan in words: one line per decision, then one per kernel."""
    why = dict(self.reasons)
    expected = "" if self.expected_rows is None else f", {self.expected_rows} expected real"
    lines = [
      f"MoE block: T={self.tokens_per_device} tokens per device, ep={self.expert_parallelism}, "
      f"E_l={self.num_local_experts} local experts"
      + (f", 1/{self.tensor_parallelism} of the MLP width" if self.tensor_parallelism > 1 else "")
      + f", tiles for {self.generation}",
      f"  exchange: {self.exchange} ({why.get('exchange', '')})",
      f"  batch_split: {self.batch_split} chunk(s) of {self.chunk_tokens} tokens "
      f"({why.get('batch_split', '')})",
      f"  buffer_rows: {self.buffer_rows} per chunk ({why.get('buffer_rows', '')}); expert gmms "
      f"over {self.expert_rows} rows{expected}",
    ]
    if self.fused is not None:
      p = self.fused
      lines.append(
        f"  experts: the fused kernel streaming the received rows (visits of {p.visit_rows} "
        f"rows, chunk {p.chunk} of f={p.f}, {p.kind} weights, forward only)"
      )
      return "\n".join(lines)
    for name, plan in (("wi", self.wi), ("wo", self.wo)):
      if plan is None:
        lines.append(f"  {name}: jax.lax.ragged_dot (gmm_impl='ragged_dot')")
        continue
      lines.extend(f"  {name}: {line}" for line in plan.describe().splitlines())
    return "\n".join(lines)


def _tiling_of(plan: ops.GmmPlan | None) -> Tiling | None:
  if plan is None:
    return None
  kernels = dict(plan.kernels)
  return Tiling(fwd=kernels["fwd"].tiles, dlhs=kernels["dlhs"].tiles, drhs=kernels["drhs"].tiles)


def plan_block(
  config: MoEConfig,
  *,
  tokens_per_device: int,
  expert_parallelism: int,
  tensor_parallelism: int = 1,
  buffer_rows: int | None = None,
  async_exchange: bool | None = None,
  expert_tiles: bool = True,
) -> BlockPlan:
  """Resolves the block's defaults for T tokens per device into a `BlockPlan`.

  Args:
    config: the layer config; its explicit choices win over every rule below.
    tokens_per_device: T.
    expert_parallelism: ep, the expert-axis size (1: no exchange).
    tensor_parallelism: tp, the tensor-axis size (the MLP width is split over it).
    buffer_rows: an explicit receive-buffer row count per chunk (e.g. `dropless_buffer_rows`).
    async_exchange: whether the exchange compiles async (decides the default batch split);
      None: the installed libtpu and `LIBTPU_INIT_ARGS` (`batch_split.async_exchange_enabled`).
    expert_tiles: pick the gate/up and down gmms' tiles now (a search over the tilings, about
      a second per plan); False for a caller that sets `fused` (the serving path's streamed
      experts), whose plan leaves `wi` / `wo` None.

  Returns:
    The plan; `moe_block(..., plan=)` runs it.

  Raises:
    ValueError: E not divisible by ep, a batch split that does not divide T, or a tensor axis
      that does not split the MLP widths into gate/up pairs.
  """
  t, ep, k = tokens_per_device, expert_parallelism, config.top_k
  sharding.check_tensor_split(config, tensor_parallelism)
  if config.num_experts % ep:
    raise ValueError(
      f"num_experts={config.num_experts} is not divisible by the expert axis size {ep}."
    )
  reasons = []
  dedup, why = _exchange_choice(config, expert_parallelism=ep, tokens_per_device=t)
  exchange = "none" if ep == 1 else ("dedup" if dedup else "plain")
  reasons.append(("exchange", why))
  split, why = _batch_split_choice(
    config, tokens_per_device=t, expert_parallelism=ep, async_exchange=async_exchange
  )
  reasons.append(("batch_split", why))
  tc = t // split
  rows, why = _buffer_rows_choice(
    config, tokens_per_device=tc, expert_parallelism=ep, buffer_rows=buffer_rows
  )
  reasons.append(("buffer_rows", why))
  expert_rows = rows if ep > 1 else max(1, tc * k)
  expected = tc * k if 0 < tc * k < expert_rows else None
  num_local = config.num_experts // ep
  wi, wo = None, None
  if expert_tiles:
    wi, wo = _expert_gmm_plans(
      config, rows=expert_rows, num_local=num_local, expected=expected, tp=tensor_parallelism
    )
  return BlockPlan(
    tokens_per_device=t,
    expert_parallelism=ep,
    num_local_experts=num_local,
    tensor_parallelism=tensor_parallelism,
    batch_split=split,
    exchange=exchange,
    buffer_rows=rows,
    expert_rows=expert_rows,
    expected_rows=expected,
    generation=tiling_lib.current_generation().name,
    wi=wi,
    wo=wo,
    reasons=tuple(reasons),
  )


def _expert_gmm_plans(
  config: MoEConfig, *, rows: int, num_local: int, expected: int | None, tp: int = 1
):
  """The `GmmPlan`s of the experts' two grouped matmuls (gate/up, down) over `rows` rows."""
  if config.gmm_impl == "ragged_dot":
    return None, None
  dt = config.compute_dtype
  f, d = config.expert_ffn_dim // tp, config.d_model
  sizes = jax.ShapeDtypeStruct((num_local,), jnp.int32)
  kw = dict(
    preferred_element_type=dt,
    weight_quantization=config.weight_quantization,
    activation_quantization=config.activation_quantization,
    unowned_rows="undefined",
    expected_rows=expected,
    implementation=None if config.gmm_impl == "pallas" else config.gmm_impl,
  )
  plans = []
  for (k, n), tiling in (((d, 2 * f), config.wi_tiling), ((f, d), config.wo_tiling)):
    lhs = jax.ShapeDtypeStruct((rows, k), dt)
    rhs = jax.ShapeDtypeStruct((num_local, k, n), dt)
    plans.append(ops.gmm_plan(lhs, rhs, sizes, tiling=tiling, **kw))
  return tuple(plans)


def buffer_rows_for(
  config: MoEConfig, *, tokens_per_device: int, expert_parallelism: int, buffer_rows=None
) -> int:
  """The static receive-buffer rows the block uses (see the module docstring).

  Args:
    config: the layer config (`buffer_factor`, `top_k`, `num_experts`).
    tokens_per_device: T (the tokens of one chunk when the block splits its batch).
    expert_parallelism: expert-axis size.
    buffer_rows: an explicit row count (e.g. from `dropless_buffer_rows`); wins when given.

  Returns:
    Rows per device; with `ep == 1` always `T * top_k` (no exchange, nothing can drop).
  """
  return _buffer_rows_choice(
    config,
    tokens_per_device=tokens_per_device,
    expert_parallelism=expert_parallelism,
    buffer_rows=buffer_rows,
  )[0]


def _buffer_rows_choice(
  config: MoEConfig, *, tokens_per_device: int, expert_parallelism: int, buffer_rows=None
) -> tuple[int, str]:
  """`buffer_rows_for` and why, in words."""
  t, k, ep = tokens_per_device, config.top_k, expert_parallelism
  if ep == 1:
    return max(1, t * k), "no exchange: the chunk's T * k rows"
  if buffer_rows is not None:
    return max(1, int(buffer_rows)), "given by the caller (buffer_rows=)"
  if config.buffer_factor is not None:
    policy = collectives.BufferPolicy.factor(config.buffer_factor)
    rows = policy.rows(tokens_per_device=t, top_k=k, axis_size=ep)
    return rows, f"buffer_factor={config.buffer_factor}: overflowing rows are dropped and counted"
  # NOTE: a token's k experts are distinct, so at most min(k, E_l) of its rows land on a device.
  rows = max(1, ep * t * min(k, config.num_experts // ep))
  return rows, (
    "dropless, static bound ep * T * min(k, E_l): nothing can drop (dropless_buffer_rows(...) "
    "gives the exact need of a batch)"
  )


def default_batch_split(
  *,
  config: MoEConfig,
  tokens_per_device: int,
  expert_parallelism: int,
  async_exchange: bool | None = None,
) -> int:
  """The number of token chunks `moe_block` uses when `config.batch_split` is None.

  Chunks pay only where the expert exchange compiles async (one chunk's dispatch and combine
  under another chunk's matmuls). Where it is synchronous (libtpu 0.0.42.1's default; see
  `batch_split.async_exchange_enabled`) the default is 1; where it is async (libtpu >= 0.0.50's
  default, or `xla_tpu_enable_async_ragged_all_to_all=true` in `LIBTPU_INIT_ARGS` on 0.0.42.1) it is
  the chunk count the modeled EP step picked for the layer's dims, expert parallelism, tokens
  per device and the current TPU generation (`batch_split.MODELED_BATCH_SPLIT`, or
  `MODELED_BATCH_SPLIT_DEDUP` when the block deduplicates its exchange, `dedup_dispatch_for`; 1
  for a case the model has not seen). See `pallas_moe.batch_split`.

  Args:
    config: the layer config.
    tokens_per_device: T, the tokens of one device.
    expert_parallelism: the expert-axis size.
    async_exchange: whether the exchange compiles async; None: `async_exchange_enabled()` (the
      installed libtpu and `LIBTPU_INIT_ARGS`).

  Returns:
    An int >= 1 that divides `tokens_per_device`.
  """
  if async_exchange is None:
    async_exchange = batch_split_lib.async_exchange_enabled()
  return batch_split_lib.modeled_batch_split(
    num_experts=config.num_experts,
    top_k=config.top_k,
    d_model=config.d_model,
    expert_ffn_dim=config.expert_ffn_dim,
    expert_parallelism=expert_parallelism,
    tokens_per_device=tokens_per_device,
    generation=tiling_lib.current_generation().name,
    async_exchange=async_exchange,
    dedup=dedup_dispatch_for(
      config, expert_parallelism=expert_parallelism, tokens_per_device=tokens_per_device
    ),
  )


def batch_split_for(config: MoEConfig, *, tokens_per_device: int, expert_parallelism: int) -> int:
  """The chunk count the block uses: `config.batch_split`, or `default_batch_split` when None.

  Args:
    config: the layer config.
    tokens_per_device: T.
    expert_parallelism: the expert-axis size.

  Returns:
    The number of chunks; each has `T // chunks` tokens.

  Raises:
    ValueError: the count does not divide T (names the key and the divisors to pick from).
  """
  return _batch_split_choice(
    config, tokens_per_device=tokens_per_device, expert_parallelism=expert_parallelism
  )[0]


def _batch_split_choice(
  config: MoEConfig,
  *,
  tokens_per_device: int,
  expert_parallelism: int,
  async_exchange: bool | None = None,
) -> tuple[int, str]:
  """`batch_split_for` and why, in words."""
  t = tokens_per_device
  split = config.batch_split
  why = "config.batch_split (MaxText batch_split_factor)"
  if split is None:
    if async_exchange is None:
      async_exchange = batch_split_lib.async_exchange_enabled()
    split = default_batch_split(
      config=config,
      tokens_per_device=t,
      expert_parallelism=expert_parallelism,
      async_exchange=async_exchange,
    )
    why = (
      f"the modeled EP step's choice for these dims on {tiling_lib.current_generation().name} "
      "(the exchange compiles async)"
      if async_exchange
      else "1: the exchange compiles synchronously (libtpu default or LIBTPU_INIT_ARGS), so "
      "chunks would not overlap"
    )
  if t % split:
    divisors = [d for d in range(1, min(t, 64) + 1) if t % d == 0]
    raise ValueError(
      f"MoEConfig.batch_split (MaxText batch_split_factor)={split} must divide the {t} tokens "
      f"per device; pick one of {divisors} (or change the batch)."
    )
  return split, why


def exchange_bytes_per_token(
  config: MoEConfig, *, expert_parallelism: int, dedup: bool
) -> tuple[float, float]:
  """Expected bytes one token sends in the dispatch and in the combine, under uniform routing.

  Args:
    config: the layer config (`num_experts`, `top_k`, `d_model`, `dtype`).
    expert_parallelism: ep.
    dedup: the deduplicated exchange (`pallas_moe.dedup`) or the plain one.

  Returns:
    `(dispatch, combine)` bytes, counting every row (a row to the sender's own device too).
    Plain: k rows of d each way. Dedup: `dedup.expected_destinations` rows each way, the
    dispatch's carrying the f32 weights and the ids of the row's choices as extra words (with
    `dispatch_quantization`: 1 B per value plus the f32 scales); every row padded as the TPU
    exchange pads it (`dedup.wire_row_bytes`).
  """
  d, k = config.d_model, config.top_k
  isz = jnp.dtype(config.compute_dtype).itemsize
  row = dedup_lib.wire_row_bytes(d, isz)
  if not dedup:
    return float(k * row), float(k * row)
  ep = expert_parallelism
  rows = dedup_lib.expected_destinations(
    num_experts=config.num_experts, top_k=k, expert_parallelism=ep
  )
  num_local = config.num_experts // ep
  quant = config.dispatch_quantization
  if quant is not None:
    # NOTE: 1 B per value, then f32 scales, f32 weights and int8/int32 ids as raw bytes.
    ids = k * jnp.dtype(dedup_lib._id_dtype(num_local)).itemsize
    sent = d + 4 * dedup_lib.scale_columns(d=d, kind=quant) + 4 * k + ids
    return rows * dedup_lib.wire_row_bytes(sent, 1), rows * row
  extra = dedup_lib.extra_words(k=k, dt=config.compute_dtype, num_local=num_local)
  return rows * dedup_lib.wire_row_bytes(d + extra, isz), rows * row


def dedup_dispatch_for(
  config: MoEConfig, *, expert_parallelism: int, tokens_per_device: int | None = None
) -> bool:
  """Whether the block deduplicates its exchange (`config.dedup_dispatch`; None: auto).

  Auto: for a layer the step model has seen (`dedup.MODELED_DEDUP`: DeepSeek-V2-Lite,
  Qwen3-30B-A3B, DeepSeek-V3 dims), its verdict for the current TPU generation, so that no
  modeled case gets slower (the receiver's expand/reduce passes cost TensorCore time the
  exchange must pay back; on v5p it does not). Other layers: True where the deduplicated
  exchange moves fewer bytes (dispatch + combine, uniform routing, `exchange_bytes_per_token`).
  With E_l = 1 or top_k = 1 a token never has two choices on one device: False.
  `config.dispatch_quantization` needs it: True.

  Args:
    config: the layer config.
    expert_parallelism: ep.
    tokens_per_device: T (for the modeled verdict); None: the bytes rule.

  Returns:
    The choice (False for ep = 1: there is no exchange).
  """
  return _exchange_choice(
    config, expert_parallelism=expert_parallelism, tokens_per_device=tokens_per_device
  )[0]


def _exchange_choice(
  config: MoEConfig, *, expert_parallelism: int, tokens_per_device: int | None = None
) -> tuple[bool, str]:
  """`dedup_dispatch_for` and why, in words."""
  ep = expert_parallelism
  if ep <= 1:
    return False, "no expert axis: nothing is exchanged"
  if config.dedup_dispatch is not None:
    return config.dedup_dispatch, "config.dedup_dispatch"
  if config.dispatch_quantization is not None:
    # NOTE: the 8-bit rows travel in the deduplicated exchange's packed layout.
    return True, "dispatch_quantization sends the deduplicated exchange's packed rows"
  if config.top_k == 1 or config.num_experts // ep == 1:
    return False, "top_k = 1 or E_l = 1: a token never has two choices on one device"
  generation = tiling_lib.current_generation().name
  if tokens_per_device is not None:
    verdict = dedup_lib.modeled_choice(
      num_experts=config.num_experts,
      top_k=config.top_k,
      d_model=config.d_model,
      ep=ep,
      tokens=tokens_per_device,
      generation=generation,
    )
    if verdict is not None:
      return verdict, f"the modeled EP step's verdict for these dims on {generation}"
  plain = sum(exchange_bytes_per_token(config, expert_parallelism=ep, dedup=False))
  dedup = sum(exchange_bytes_per_token(config, expert_parallelism=ep, dedup=True))
  return dedup < plain, (
    f"uniform routing: {dedup:.0f} B per token deduplicated vs {plain:.0f} B plain"
  )
