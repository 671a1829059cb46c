"""Hugging Face config.json keys for the MoE layer: what each means as a `MoEConfig` field.

A config.json is read by its `model_type` (`HF_MODEL_TYPES`): each family's keys mean what that
family's transformers code does with them, and the settings that code hard-wires are implied.
`MoEConfig.from_dict` reads these beside MaxText's (`pallas_moe.maxtext_keys`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pallas_moe import keys

# Hugging Face key -> (field, value conversion), for every family (DeepSeek-V2/V3, Qwen-MoE,
# Mixtral).
ALIASES: dict[str, tuple[str, keys.Conversion]] = {
  "n_routed_experts": ("num_experts", int),
  "num_local_experts": ("num_experts", int),
  "hidden_size": ("d_model", int),
  "moe_intermediate_size": ("expert_ffn_dim", int),
  "n_shared_experts": ("num_shared_experts", keys.shared),
  "scoring_func": ("score_func", str),
  "hidden_act": ("activation", keys.activation),
  "aux_loss_alpha": ("aux_loss_coef", float),
  "router_aux_loss_coef": ("aux_loss_coef", float),
  "torch_dtype": ("dtype", keys.dtype_name),
}

# config.json keys about other layers or the checkpoint: skipped.
IGNORED_KEYS = frozenset(
  {
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "first_k_dense_replace",
    "moe_layer_freq",
    "initializer_range",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pretraining_tp",
    "rms_norm_eps",
    "tie_word_embeddings",
    "use_cache",
  }
)


def _hf_groups(v):
  """HF DeepSeek `n_group` / `topk_group`: null (transformers' V2 default) means no groups."""
  return None if v is None else int(v)


def _width(v):
  """Qwen2-MoE `shared_expert_intermediate_size`: 0 means no shared expert (unset)."""
  return None if v is None or int(v) == 0 else int(v)


@dataclasses.dataclass(frozen=True)
class HFFamily:
  """What one Hugging Face `model_type`'s config.json keys mean for the MoE layer.

  Attributes:
    name: the `model_type`.
    keys: whole-model keys accepted and skipped (beyond `IGNORED_KEYS`).
    checks: key -> a function that raises if the value changes the MoE layer in a way this
      layer does not implement (the key is skipped otherwise).
    aliases: key -> (field, conversion), read before the generic `_ALIASES`.
    fixed: fields the family's modeling code hard-wires (a key saying otherwise raises).
    defaults: fields set unless a key sets them.
    post: hook run after all keys, `post(values, put)`.
  """

  name: str
  keys: frozenset[str]
  checks: Mapping[str, Callable[[Any], None]] = dataclasses.field(default_factory=dict)
  aliases: Mapping[str, tuple[str, Callable[[Any], Any]]] = dataclasses.field(default_factory=dict)
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  post: Callable[[dict, Callable], None] | None = None


# Keys every transformers 5 MoE config.json may write that are not the MoE layer's business.
# `output_router_logits` is transformers' runtime switch for adding the aux loss to the model's
# loss; the block always returns the loss and the caller weighs it (`aux_loss_coef`).
_HF_COMMON = frozenset({"rope_parameters", "head_dim", "output_router_logits"})
_NO_JITTER = keys.must_be(
  "router_jitter_noise",
  0.0,
  "Mixtral's training-time multiplicative input jitter is not implemented by this layer; "
  "set it to 0.",
)
# NOTE: the router logits are in the model dtype in transformers' Mixtral and Qwen routers
# (F.linear on the hidden states, softmax in f32), in f32 in its DeepSeek routers.
_SOFTMAX_TOPK = {"score_func": "softmax", "topk_method": "greedy"}
_DEEPSEEK_KEYS = frozenset(
  {
    "intermediate_size",  # the dense layers' MLP (first_k_dense_replace)
    "qk_head_dim",
    "ep_size",  # DeepSeek's inference code: how many ranks hold the experts
    # NOTE: checkpoint storage (DeepSeek-V3: fp8 weights, 128 x 128 scale blocks), not the
    # layer's semantics: `from_hf` reads the weights and their `weight_scale_inv` blocks.
    "quantization_config",
  }
)
_DEEPSEEK_CHECKS = {
  "mlp_bias": keys.must_be("mlp_bias", False, "this layer's expert and shared MLPs have no bias."),
}
_DEEPSEEK_ALIASES = {"n_group": ("n_group", _hf_groups), "topk_group": ("topk_group", _hf_groups)}


def _qwen2_shared(values: dict, put: Callable) -> None:
  """Qwen2-MoE: one shared expert of `shared_expert_intermediate_size`, sigmoid-gated."""
  if values.get("shared_ffn_dim"):
    put("num_shared_experts", 1, "shared_expert_intermediate_size")
    put("shared_expert_gate", True, "model_type")


_QWEN_KEYS = frozenset(
  {
    "intermediate_size",  # the dense MLP of mlp_only_layers
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    # NOTE: these say WHICH layers are MoE (whole-model layer placement), not what one does.
    "decoder_sparse_step",
    "mlp_only_layers",
  }
)

HF_MODEL_TYPES: dict[str, HFFamily] = {
  f.name: f
  for f in (
    HFFamily(
      name="mixtral",
      keys=_HF_COMMON | {"sliding_window", "router_jitter_noise"},
      checks={"router_jitter_noise": _NO_JITTER},
      aliases={"intermediate_size": ("expert_ffn_dim", int)},
      # NOTE: MixtralTopKRouter: softmax, top-k, then always divides by the top-k sum.
      fixed={**_SOFTMAX_TOPK, "norm_topk_prob": True},
      defaults={"float32_gate_logits": False},
    ),
    HFFamily(
      name="qwen2_moe",
      keys=_HF_COMMON | _QWEN_KEYS | {"qkv_bias"},
      aliases={"shared_expert_intermediate_size": ("shared_ffn_dim", _width)},
      fixed=_SOFTMAX_TOPK,
      defaults={"float32_gate_logits": False},
      post=_qwen2_shared,
    ),
    HFFamily(
      name="qwen3_moe",
      keys=_HF_COMMON | _QWEN_KEYS,
      fixed=_SOFTMAX_TOPK,
      defaults={"float32_gate_logits": False},
    ),
    # NOTE: transformers' DeepseekV2TopkRouter: softmax, then `topk_method` ("greedy" by
    # default, or "group_limited_greedy"); its config writes topk_method but no scoring_func.
    HFFamily(
      name="deepseek_v2",
      keys=_HF_COMMON | _DEEPSEEK_KEYS | {"mlp_bias"},
      checks=_DEEPSEEK_CHECKS,
      aliases=_DEEPSEEK_ALIASES,
      fixed={"score_func": "softmax"},
    ),
    # NOTE: transformers' DeepseekV3TopkRouter is always noaux_tc on sigmoid scores; its config
    # writes neither topk_method nor scoring_func, DeepSeek's published config.json writes both.
    HFFamily(
      name="deepseek_v3",
      keys=_HF_COMMON | _DEEPSEEK_KEYS | {"rope_interleave", "num_nextn_predict_layers"},
      checks=_DEEPSEEK_CHECKS,
      aliases=_DEEPSEEK_ALIASES,
      fixed={"score_func": "sigmoid", "topk_method": "noaux_tc"},
    ),
  )
}
