"""Expert-parallel benchmark cases: one device's gmm after dispatch (docs/design.md,
"Expert-parallel cases: what a device's gmm sees").

After `collectives.dispatch` a device multiplies a receive buffer of `buffer_rows` static rows
over its E_l = E / ep local experts; `rows = sum(group_sizes)` of them are real, sorted by local
expert (`RaggedPlan.recv_group_sizes`, what `moe.expert_mlp` passes to gmm; no group_offset).

Routing: each of the ep peers routes its T tokens: a multinomial draw of T·top_k rows over the E
global experts (uniform, or Zipf(1) over a random expert order; fixed seed, as
`bench.shapes.group_sizes`). NOTE: a multinomial ignores that a token's top_k experts are
distinct; at these sizes that changes per-device loads negligibly. The modeled device is the
busiest one (most rows wanted): it sets the step time, and under a capacity factor it is the one
that drops.

Buffer policies (the block's own code computes each size):
- "exact": `pallas_moe.exact_buffer_rows(send_counts)` (max rows any device receives) rounded up
  to 8, as `moe.dropless_buffer_rows` does with its default `multiple_of=8`;
- "cf1.25", "cf2.0": `BufferPolicy.factor(f).rows(...)` = min(ceil(f·T·k), ep·T·k); the rows past
  the buffer are dropped as `plan_from_send_counts` drops them (the tail of the receiver's
  (local expert, sender) layout: the last local experts lose rows first);
- "static": `moe.buffer_rows_for` without a factor or exact size: the dropless static bound
  ep·T·min(k, E_l).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bench.shapes import ROUTINGS, SHAPES, Shape

__all__ = [
  "EP_CONFIGS",
  "EP_TOKENS",
  "POLICIES",
  "EpShape",
  "ep_case",
  "ep_cases",
  "pad_rows_for_impl",
]

# (model, ep) pairs of docs/design.md's EP table; E_l = E / ep, E = the model's global expert count.
EP_CONFIGS: tuple[tuple[str, int], ...] = (
  ("deepseek-v3", 32),
  ("deepseek-v3", 64),
  ("qwen3-30b-a3b", 8),
  ("deepseek-v2-lite", 8),
  ("mixtral-8x7b", 8),
)
EP_TOKENS = (4096, 16384)
POLICIES = ("exact", "cf1.25", "cf2.0", "static")
# NOTE: `moe.dropless_buffer_rows`'s default bucket.
EXACT_MULTIPLE_OF = 8
_SEED = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpShape(Shape):
  """One device's gmm problem after an expert-parallel dispatch.

  `num_groups` is E_l (the local experts), `tokens` the tokens per device; `m` is the static
  receive buffer, of which `rows` are real.

  Attributes:
    ep: expert-parallel degree.
    policy: buffer policy (see the module docstring), or "slack1" (buffer = rows).
    buffer_rows: static receive-buffer rows (the gmm's m).
    rows: rows received and kept (sum of the local group sizes).
    wanted_rows: rows routed to this device before any drop.
  """

  ep: int
  policy: str
  buffer_rows: int
  rows: int
  wanted_rows: int

  @property
  def m(self) -> int:
    """The gmm's rows: the whole receive buffer."""
    return self.buffer_rows

  @property
  def slack(self) -> float:
    """buffer_rows / rows."""
    return self.buffer_rows / max(self.rows, 1)

  @property
  def label(self) -> str:
    return f"{self.name}@{self.tokens}/ep{self.ep}/{self.policy}"

  def record_fields(self) -> dict:
    """Fields for the bench's JSON record."""
    return dict(
      ep=self.ep,
      policy=self.policy,
      buffer_rows=self.buffer_rows,
      rows=self.rows,
      wanted_rows=self.wanted_rows,
      dropped_rows=self.wanted_rows - self.rows,
      slack=self.slack,
      local_experts=self.num_groups,
      k=self.k,
      n=self.n,
    )

  def with_buffer(self, buffer_rows: int, *, policy: str | None = None) -> EpShape:
    """The same rows in another buffer (e.g. slack 1, or padded for megablox)."""
    return dataclasses.replace(
      self, buffer_rows=int(buffer_rows), policy=self.policy if policy is None else policy
    )


def _send_counts(*, num_experts: int, ep: int, rows_per_peer: int, routing: str, seed: int):
  """[ep, E] rows each peer sends to each global expert."""
  rng = np.random.default_rng(seed)
  if routing == "uniform":
    p = np.full(num_experts, 1.0 / num_experts)
  elif routing == "zipf":
    p = 1.0 / np.arange(1, num_experts + 1)
    p = rng.permutation(p / p.sum())
  else:
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
  return rng.multinomial(rows_per_peer, p, size=ep).astype(np.int64)


def _buffer_rows(*, policy: str, model: Shape, ep: int, tokens: int, send_counts) -> int:
  # NOTE: imported here so that `bench.shapes` users do not pay for jax.
  from pallas_moe import collectives, exact_buffer_rows
  from pallas_moe.config import MoEConfig
  from pallas_moe.moe import buffer_rows_for

  if policy == "exact":
    need = exact_buffer_rows(send_counts)
    return max(1, -(-need // EXACT_MULTIPLE_OF) * EXACT_MULTIPLE_OF)
  if policy.startswith("cf"):
    policy_obj = collectives.BufferPolicy.factor(float(policy[2:]))
    return policy_obj.rows(tokens_per_device=tokens, top_k=model.top_k, axis_size=ep)
  if policy == "static":
    config = MoEConfig(
      num_experts=model.num_groups,
      top_k=model.top_k,
      d_model=model.k,
      expert_ffn_dim=model.n,
    )
    return buffer_rows_for(config, tokens_per_device=tokens, expert_parallelism=ep)
  raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def ep_case(
  *,
  model: str,
  ep: int,
  tokens: int,
  policy: str,
  routing: str = "uniform",
  seed: int = _SEED,
) -> tuple[EpShape, np.ndarray]:
  """The busiest device's gmm problem after dispatch.

  Args:
    model: a key of `bench.shapes.SHAPES` (its num_groups is the global expert count E).
    ep: expert-parallel degree (E % ep == 0).
    tokens: tokens per device (T).
    policy: one of `POLICIES`.
    routing: "uniform" or "zipf".
    seed: numpy seed (the same routing for every policy).

  Returns:
    (shape, group_sizes): int32 [E_l] rows per local expert after drops; shape.m = buffer_rows.
  """
  base = SHAPES[model]
  num_experts = base.num_groups
  if num_experts % ep:
    raise ValueError(f"{model}: E={num_experts} is not divisible by ep={ep}")
  local = num_experts // ep
  counts = _send_counts(
    num_experts=num_experts,
    ep=ep,
    rows_per_peer=tokens * base.top_k,
    routing=routing,
    seed=seed,
  )
  received = counts.sum(axis=0).reshape(ep, local)  # [device, local expert]
  device = int(np.argmax(received.sum(axis=1)))
  wanted = received[device]
  buffer_rows = _buffer_rows(policy=policy, model=base, ep=ep, tokens=tokens, send_counts=counts)
  # NOTE: as `plan_from_send_counts` clips: the receiver's layout is (local expert, sender); rows
  # past buffer_rows are dropped, so each expert keeps what fits after the earlier ones.
  ends = np.minimum(np.cumsum(wanted), buffer_rows)
  gs = np.diff(ends, prepend=0).astype(np.int32)
  shape = EpShape(
    name=base.name,
    tokens=tokens,
    top_k=base.top_k,
    num_groups=local,
    k=base.k,
    n=base.n,
    ep=ep,
    policy=policy,
    buffer_rows=buffer_rows,
    rows=int(gs.sum()),
    wanted_rows=int(wanted.sum()),
  )
  return shape, gs


def ep_cases(
  *,
  configs=EP_CONFIGS,
  tokens=EP_TOKENS,
  policies=POLICIES,
  routings=("uniform",),
  models: tuple[str, ...] | None = None,
) -> list[tuple[EpShape, str, np.ndarray]]:
  """All EP cases of a selection.

  Args:
    configs: (model, ep) pairs.
    tokens: tokens per device.
    policies: buffer policies.
    routings: routings.
    models: keep only these models (None: all of `configs`).

  Returns:
    [(shape, routing, group_sizes)], model-major.
  """
  out = []
  for model, ep in configs:
    if models is not None and model not in models:
      continue
    for t in tokens:
      for routing in routings:
        for policy in policies:
          shape, gs = ep_case(model=model, ep=ep, tokens=int(t), policy=policy, routing=routing)
          out.append((shape, routing, gs))
  return out


# NOTE: megablox and tokamax need m % tm == 0 (they raise otherwise); MaxText's `sparse_matmul`
# pads the dispatched rows to a multiple of `config.tile_batch_seq` (512) before calling either.
# megablox-best is padded to 1024 so that every tm of its grid (128 ... 1024) divides m. Both
# kernels visit only the m-tiles that hold rows, so the padding adds no modeled kernel time (the
# pad itself, an XLA copy of the lhs in MaxText, is not modeled).
_PAD_ROWS = {"megablox-maxtext": 512, "tokamax": 512, "megablox-default": 512}


def pad_rows_for_impl(impl: str) -> int:
  """Rows the buffer is padded to a multiple of before `impl` runs (1: no padding).

  Args:
    impl: registry name.

  Returns:
    The multiple.
  """
  if impl in _PAD_ROWS:
    return _PAD_ROWS[impl]
  if impl.startswith("megablox"):
    return 1024
  return 1


def shape_for_impl(shape: Shape, impl: str) -> Shape:
  """`shape`, its buffer padded as `pad_rows_for_impl(impl)` says (EP shapes only)."""
  mult = pad_rows_for_impl(impl)
  if not isinstance(shape, EpShape) or shape.buffer_rows % mult == 0:
    return shape
  return shape.with_buffer(math.ceil(shape.buffer_rows / mult) * mult)
