"""Key conversions shared by the MaxText and Hugging Face key tables (`maxtext_keys`, `hf_keys`).

Each table maps a framework's config key to one `MoEConfig` field and a value conversion; a
conversion returning None means "not set" (the framework's unset value) or marks a check-only key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

Conversion = Callable[[Any], Any]

# Keys both ecosystems spell as the field does: listed so that error hints name them.
COMMON_ALIASES: dict[str, tuple[str, Conversion]] = {
  "num_experts": ("num_experts", int),
  "norm_topk_prob": ("norm_topk_prob", bool),
  "routed_scaling_factor": ("routed_scaling_factor", float),
  "topk_method": ("topk_method", str),
}

# Keys of both ecosystems' configs about other layers (attention, embeddings): skipped.
COMMON_IGNORED_KEYS = frozenset(
  {
    "vocab_size",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_theta",
    "rope_scaling",
  }
)


def same(v):
  return v


def optional_dtype_name(v):
  return None if v is None else dtype_name(v)


def activation(v) -> str:
  # NOTE: MaxText writes SwiGLU as mlp_activations ["silu", "linear"] (gate, up); HF as "silu".
  if isinstance(v, (list, tuple)):
    v = tuple(v)
    if v == ("silu", "linear"):
      return "swiglu"
    raise ValueError(f"mlp_activations={list(v)!r}: only ['silu', 'linear'] (SwiGLU) is supported.")
  if v in ("silu", "swish", "swiglu"):
    return "swiglu"
  raise ValueError(f"activation {v!r}: only silu-gated (SwiGLU) experts are supported.")


def shared(v) -> int:
  return 0 if v is None else int(v)


def dtype_name(v) -> str:
  return jnp.dtype(str(v).removeprefix("torch.")).name


def must_be(key: str, want, why: str) -> Callable[[Any], None]:
  def check(v):
    if v != want and not (want is False and not v):
      raise ValueError(f"MoEConfig.from_dict: {key}={v!r}: {why}")

  return check
