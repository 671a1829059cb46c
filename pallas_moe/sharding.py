"""Weights split over the fsdp and tensor axes: their specs, and what the layer does with them.

fsdp (fully sharded data parallelism): every weight's model dimension d is split. The layer
all-gathers each weight over the axis where it needs it whole (`gather_model_dim`); the
gather's transpose is a reduce-scatter, so gradients come back split as the weights are. XLA
issues the gathers asynchronously: they do not depend on the tokens, so they can run under the
routing and the dispatch.

tensor (Megatron's MLP split): the expert MLP width f is split. Each device's gate/up
projection yields its own columns of `[gate | up]` and its down projection a partial sum of
the output; the layer sums those once, over the whole layer's output (routed and shared
experts together), after the combine: one [T, d] reduction per layer, not one per expert.

The parameters keep one layout on every mesh: `wi` [E, d, 2f] is gate columns then up
columns, as `init_params` and `from_hf` make it. Split into T contiguous column blocks over a
tensor axis of size T, device s holds gate columns (s < T / 2) or up columns, not a matching
pair; `pair_gate_up` exchanges half of each device's [rows, 2f / T] activations with two
`ppermute`s so that device s holds `gate[:, J_s] | up[:, J_s]` for its f / T columns J_s, the
rows of `wo` it holds. Moving activations costs rows x 2f / T per device; re-laying the
weights instead would move E_l x d x 2f / T, more whenever rows < E_l x d (every training and
serving size).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

__all__ = ["check_tensor_split", "gather_model_dim", "pair_gate_up", "weight_specs"]

# Where each weight holds the model dimension d (the dimension an fsdp axis splits).
MODEL_DIM = {"router": 0, "wi": 1, "wo": 2, "shared_wi": 0, "shared_wo": 1, "shared_gate": 0}
# Where each weight holds its MLP width (the dimension a tensor axis splits).
WIDTH_DIM = {"wi": 2, "wo": 1, "shared_wi": 1, "shared_wo": 0}


def weight_specs(config, keys: Iterable[str]) -> dict[str, P]:
  """PartitionSpecs of the params `keys` (see `moe.param_specs`)."""
  expert, fsdp, tensor = config.expert_axis, config.fsdp_axis, config.tensor_axis
  specs = {
    "wi": P(expert, fsdp, tensor),
    "wo": P(expert, tensor, fsdp),
    "router": P(fsdp, None),
    "shared_wi": P(fsdp, tensor),
    "shared_wo": P(tensor, fsdp),
    "shared_gate": P(fsdp, None),
  }
  return {k: _trim(specs.get(k, P())) for k in keys}


def _trim(spec: P) -> P:
  """A spec without trailing Nones (`P('expert', None, None)` is `P('expert')`)."""
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return P(*parts)


def check_tensor_split(config, tensor_parallelism: int) -> None:
  """Raises unless the tensor axis splits every MLP width into whole gate/up pairs."""
  tp = tensor_parallelism
  if tp == 1:
    return
  widths = {"expert_ffn_dim": config.expert_ffn_dim}
  if config.shared_width:
    widths["shared expert width"] = config.shared_width
  bad = {name: w for name, w in widths.items() if w % tp}
  if tp % 2 or bad:
    raise ValueError(
      f"the tensor axis {config.tensor_axis!r} has size {tp}: it must be even and divide every "
      f"MLP width ({widths}) so that each device's share of [gate | up] pairs up with one "
      "other device's; use a tensor axis of size 2, 4, ... dividing them, or none."
    )


def gather_model_dim(params: dict, *, d: int, axis: str | None, size: int, dtypes: dict) -> dict:
  """The weights with their model dimension whole, cast to `dtypes[key]` before the gather.

  Args:
    params: this device's weights: the model dimension whole, or its 1 / `size` share.
    d: the model dimension.
    axis: the fsdp axis (None: no such axis bound).
    size: its size.
    dtypes: key -> the dtype the layer computes that weight in (cast first: the gather then
      moves those bytes).

  Returns:
    A new dict; other entries (the correction bias) unchanged.
  """
  out = dict(params)
  for key, dim in MODEL_DIM.items():
    if key not in params:
      continue
    w = params[key]
    # NOTE: quantized experts (`quant.QuantizedWeights`, `BlockQuantizedWeights`: the serving
    # path's fused kernel takes them) keep their stored bytes and come whole.
    quantized = hasattr(w, "scales")
    if key in dtypes and not quantized:
      w = w.astype(dtypes[key])
    if w.shape[dim] == d:
      out[key] = w
    elif quantized:
      raise ValueError(
        f"params[{key!r}] is quantized and holds {w.shape[dim]} of d = {d} on its model "
        "dimension: quantized experts are served whole on each device (no fsdp split)."
      )
    elif axis is not None and w.shape[dim] * size == d:
      # NOTE: the scope names the gathers in the compiled program's op_name metadata.
      with jax.named_scope("fsdp_gather"):
        out[key] = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
    else:
      share = "" if axis is None else f" or d / {size} = {d // size} (its {axis!r} share)"
      raise ValueError(
        f"params[{key!r}] has {w.shape[dim]} on its model dimension (axis {dim} of "
        f"{w.shape}); expected d = {d}{share}. Place it with moe.param_specs(config)."
      )
  return out


def pair_gate_up(h: jax.Array, *, axis: str, size: int) -> jax.Array:
  """This device's `[gate[:, J] | up[:, J]]` from its contiguous columns of `[gate | up]`.

  Args:
    h: [rows, 2f / size]: device s's columns [s * 2f / size, (s + 1) * 2f / size) of a
      gate/up product.
    axis: the tensor axis; `size` its (even) size.

  Returns:
    [rows, 2f / size]: gate then up columns J_s = [s * f / size, (s + 1) * f / size).
  """
  c = h.shape[-1] // 2
  half = size // 2
  i = jax.lax.axis_index(axis)
  first, second = h[..., :c], h[..., c:]
  is_gate = i < half
  # NOTE: gate device s (s < half) holds gate columns [2s c, 2s c + 2c), which belong to devices
  # 2s (first half) and 2s + 1 (second); up device s holds up columns for 2(s - half) and
  # 2(s - half) + 1. Exchange "a" carries gate halves to even devices and up halves to odd ones,
  # "b" the rest; each is a permutation of the axis.
  dest_a = [2 * s if s < half else 2 * (s - half) + 1 for s in range(size)]
  dest_b = [2 * s + 1 if s < half else 2 * (s - half) for s in range(size)]
  got = []
  for dest, send in ((dest_a, jnp.where(is_gate, first, second)),
                     (dest_b, jnp.where(is_gate, second, first))):  # fmt: skip
    if dest == list(range(size)):
      got.append(send)
    else:
      got.append(jax.lax.ppermute(send, axis, perm=list(enumerate(dest))))
  even = (i % 2) == 0
  gate = jnp.where(even, got[0], got[1])
  up = jnp.where(even, got[1], got[0])
  return jnp.concatenate([gate, up], axis=-1)
