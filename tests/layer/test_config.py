"""Tests for pallas_moe.config: MaxText and Hugging Face names, aliases, validation."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_moe import Tiling
from pallas_moe.config import IGNORED_KEYS, MoEConfig

# MaxText's configs/models/deepseek2-16b.yml, plus the run flags a MoE training run sets.
MAXTEXT_DEEPSEEK2_16B = {
  "base_emb_dim": 2048,
  "base_num_query_heads": 16,
  "base_num_kv_heads": 16,
  "base_mlp_dim": 10944,
  "base_moe_mlp_dim": 1408,
  "base_num_decoder_layers": 27,
  "first_num_dense_layers": 1,
  "mlp_activations": ["silu", "linear"],
  "vocab_size": 102400,
  "enable_dropout": False,
  "logits_via_embedding": False,
  "normalization_layer_epsilon": 1.0e-6,
  "num_experts": 64,
  "num_experts_per_tok": 6,
  "shared_experts": 2,
  "routed_scaling_factor": 1.0,
  "routed_score_func": "softmax",
  "routed_bias": False,
  "decoder_block": "deepseek",
  "attention_type": "mla",
  "q_lora_rank": 0,
  "kv_lora_rank": 512,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "rope_type": "yarn",
  "rope_max_timescale": 10_000,
  "max_position_embeddings": 163840,
  "original_max_position_embeddings": 4096,
  "rope_factor": 40,
  "beta_fast": 32,
  "mscale": 0.707,
  "rope_interleave": True,
  "rope_truncate": True,
  "rope_attention_scaling": False,
  # run flags
  "dtype": "bfloat16",
  "megablox": True,
  "sparse_matmul": True,
  "capacity_factor": -1.0,
  "ragged_buffer_factor": -1.0,
  "load_balance_loss_weight": 0.001,
}

# deepseek-ai/DeepSeek-V2-Lite config.json.
HF_DEEPSEEK_V2_LITE = """{
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"},
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                   "type": "yarn"},
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
}"""


def test_maxtext_and_hf_deepseek_v2_lite_are_equal():
  mt = MoEConfig.from_dict(MAXTEXT_DEEPSEEK2_16B)
  hf = MoEConfig.from_dict(json.loads(HF_DEEPSEEK_V2_LITE))
  # NOTE: the same layer; each coefficient multiplies its own framework's loss: MaxText's
  # softmax over the gate's (already softmax) scores, DeepSeek's per-sequence loss (seq_aux).
  assert (mt.aux_loss_definition, hf.aux_loss_definition) == ("maxtext_scored", "sequence")
  assert mt == dataclasses.replace(hf, aux_loss_definition="maxtext_scored")
  assert (mt.num_experts, mt.top_k, mt.d_model, mt.expert_ffn_dim) == (64, 6, 2048, 1408)
  assert mt.num_shared_experts == 2 and mt.shared_width == 2 * 1408
  assert mt.buffer_factor is None  # dropless
  assert mt.dtype == "bfloat16" and mt.score_func == "softmax" and not mt.norm_topk_prob
  assert mt.gmm_impl == "pallas" and mt.aux_loss_coef == 0.001


def test_maxtext_tiles_map_to_pass_coordinates():
  tiles = {
    f"{proj}_tile_{p}_{dim}": v
    for proj, base in (("wi", 0), ("wo", 100))
    for p, pb in (("fwd", 0), ("dlhs", 10), ("drhs", 20))
    for dim, v0 in (("batch_seq", 1), ("embed_dim", 2), ("mlp_dim", 3))
    for v in [base + pb + v0]
  }
  # NOTE: MaxText's tiles are megablox's: read only when asked for.
  default = MoEConfig.from_dict({**MAXTEXT_DEEPSEEK2_16B, **tiles})
  assert default.wi_tiling is None and default.wo_tiling is None
  with pytest.raises(ValueError, match="'wi_tile_fwd_mlp_dim'='wide' must be a positive int"):
    MoEConfig.from_dict({**MAXTEXT_DEEPSEEK2_16B, "wi_tile_fwd_mlp_dim": "wide"})
  c = MoEConfig.from_dict({**MAXTEXT_DEEPSEEK2_16B, **tiles}, honour_tiling=True)
  # NOTE: (rows, contraction, out cols) of each pass: wi fwd contracts embed, dlhs contracts mlp.
  assert c.wi_tiling == Tiling(fwd=(1, 2, 3), dlhs=(11, 13, 12), drhs=(21, 22, 23))
  assert c.wo_tiling == Tiling(fwd=(101, 103, 102), dlhs=(111, 112, 113), drhs=(121, 123, 122))
  partial = MoEConfig.from_dict(
    {**MAXTEXT_DEEPSEEK2_16B, "wi_tile_fwd_batch_seq": 256}, honour_tiling=True
  )
  assert partial.wi_tiling == Tiling(fwd=(256, 1024, 1024)) and partial.wo_tiling is None


def test_values_and_aliases():
  c = MoEConfig.from_dict(
    {
      "n_routed_experts": 8,
      "num_experts_per_tok": 2,
      "emb_dim": 64,
      "moe_mlp_dim": 32,
      "capacity_factor": 1.5,
      "ici_expert_parallelism": 4,
      "megablox": False,
      "scoring_func": "sigmoid",
      "norm_topk_prob": True,
    }
  )
  assert c.buffer_factor == 1.5 and c.expert_parallelism == 4 and c.gmm_impl == "ragged_dot"
  assert c.score_func == "sigmoid" and c.norm_topk_prob
  # NOTE: MaxText's "unset" values agree with any other value of the same field.
  c2 = MoEConfig.from_dict(
    {**MAXTEXT_DEEPSEEK2_16B, "capacity_factor": -1, "ragged_buffer_factor": 2}
  )
  assert c2.buffer_factor == 2.0
  own = MoEConfig.from_dict(c.as_dict())
  assert own == c


@pytest.mark.parametrize(
  "extra, match",
  [
    ({"num_expert": 8}, r"unknown key 'num_expert'.*Did you mean 'num_experts'"),
    ({"moe_intermediat_size": 8}, r"unknown key 'moe_intermediat_size'.*'moe_intermediate_size'"),
    ({"wi_tile_fwd_batch": 8}, r"unknown key.*Did you mean 'wi_tile_fwd_batch_seq'"),
    ({"n_routed_experts": 32}, r"'num_experts'=64 and 'n_routed_experts'=32"),
    ({"emb_dim": 1024}, r"'base_emb_dim'=2048 and 'emb_dim'=1024 both set 'd_model'"),
    ({"ragged_buffer_factor": 2.0, "capacity_factor": 1.5}, r"'buffer_factor'"),
    ({"sparse_matmul": False}, r"sparse_matmul=False"),
    ({"topk_method": "aux_tc"}, r"topk_method must be one of"),
    ({"mlp_activations": ["gelu"]}, r"only \['silu', 'linear'\]"),
  ],
)
def test_errors_name_the_key(extra, match):
  with pytest.raises(ValueError, match=match):
    MoEConfig.from_dict({**MAXTEXT_DEEPSEEK2_16B, **extra})


def test_ignore_unknown_and_ignored_keys():
  d = {**MAXTEXT_DEEPSEEK2_16B, "some_new_flag": 1}
  with pytest.raises(ValueError, match="some_new_flag"):
    MoEConfig.from_dict(d)
  assert MoEConfig.from_dict(d, ignore_unknown=True) == MoEConfig.from_dict(MAXTEXT_DEEPSEEK2_16B)
  assert "vocab_size" in IGNORED_KEYS and "num_hidden_layers" in IGNORED_KEYS
  with pytest.raises(ValueError, match=r"missing \['expert_ffn_dim'\].*moe_intermediate_size"):
    MoEConfig.from_dict({"num_experts": 4, "top_k": 2, "d_model": 8})


def test_direct_validation():
  base = dict(num_experts=8, top_k=2, d_model=16, expert_ffn_dim=8)
  with pytest.raises(ValueError, match="top_k=9"):
    MoEConfig(**{**base, "top_k": 9})
  with pytest.raises(ValueError, match="buffer_factor"):
    MoEConfig(**base, buffer_factor=0.0)
  with pytest.raises(ValueError, match="must differ"):
    MoEConfig(**base, data_axis="x", expert_axis="x")
  with pytest.raises(TypeError):
    MoEConfig(8, 2, 16, 8)  # keyword-only
  with pytest.raises(dataclasses.FrozenInstanceError):
    MoEConfig(**base).top_k = 3


# --- DeepSeek routing: published MoE fields of the HF config.json files and of
# MaxText's model configs (src/maxtext/configs/models/*.yml), as dicts. -------------------------

HF_DEEPSEEK_V2_LITE_MOE = {
  "hidden_size": 2048,
  "moe_intermediate_size": 1408,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "num_experts_per_tok": 6,
  "topk_method": "greedy",
  "n_group": 1,
  "topk_group": 1,
  "scoring_func": "softmax",
  "norm_topk_prob": False,
  "routed_scaling_factor": 1.0,
  "aux_loss_alpha": 0.001,
  "seq_aux": True,
}
HF_DEEPSEEK_V2_MOE = {
  "hidden_size": 5120,
  "moe_intermediate_size": 1536,
  "n_routed_experts": 160,
  "n_shared_experts": 2,
  "num_experts_per_tok": 6,
  "topk_method": "group_limited_greedy",
  "n_group": 8,
  "topk_group": 3,
  "scoring_func": "softmax",
  "norm_topk_prob": False,
  "routed_scaling_factor": 16.0,
  "aux_loss_alpha": 0.003,
  "seq_aux": True,
}
HF_DEEPSEEK_V3_MOE = {
  "hidden_size": 7168,
  "moe_intermediate_size": 2048,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "num_experts_per_tok": 8,
  "topk_method": "noaux_tc",
  "n_group": 8,
  "topk_group": 4,
  "scoring_func": "sigmoid",
  "norm_topk_prob": True,
  "routed_scaling_factor": 2.5,
  "aux_loss_alpha": 0.001,
  "seq_aux": True,
}
_MAXTEXT_MOE_KEYS = (
  "base_emb_dim",
  "base_moe_mlp_dim",
  "num_experts",
  "num_experts_per_tok",
  "shared_experts",
  "routed_scaling_factor",
  "routed_score_func",
  "routed_bias",
)
MAXTEXT_DEEPSEEK2_16B_MOE = {k: MAXTEXT_DEEPSEEK2_16B[k] for k in _MAXTEXT_MOE_KEYS}
MAXTEXT_DEEPSEEK2_236B_MOE = {
  "base_emb_dim": 5120,
  "base_moe_mlp_dim": 1536,
  "num_experts": 160,
  "num_experts_per_tok": 6,
  "shared_experts": 2,
  "routed_scaling_factor": 16.0,
  "routed_score_func": "softmax",
  "routed_bias": False,
}
MAXTEXT_DEEPSEEK3_671B_MOE = {
  "base_emb_dim": 7168,
  "base_moe_mlp_dim": 2048,
  "num_experts": 256,
  "num_experts_per_tok": 8,
  "shared_experts": 1,
  "routed_scaling_factor": 2.5,
  "routed_score_func": "sigmoid",
  "routed_bias": True,
}
# MaxText base.yml's values of the routing keys the model files leave out.
MAXTEXT_BASE_ROUTING = {
  "n_routing_groups": -1,
  "topk_routing_group": -1,
  "routed_bias_update_rate": 0.0,
  "load_balance_loss_weight": 0.0,
}


def _routing(c: MoEConfig):
  return (
    c.topk_method,
    c.n_group,
    c.topk_group,
    c.score_func,
    c.norm_topk_prob,
    c.routed_scaling_factor,
    c.has_routed_bias,
  )


@pytest.mark.parametrize(
  "d, want",
  [
    (HF_DEEPSEEK_V2_LITE_MOE, ("greedy", 1, 1, "softmax", False, 1.0, False)),
    (HF_DEEPSEEK_V2_MOE, ("group_limited_greedy", 8, 3, "softmax", False, 16.0, False)),
    (HF_DEEPSEEK_V3_MOE, ("noaux_tc", 8, 4, "sigmoid", True, 2.5, True)),
    (MAXTEXT_DEEPSEEK2_16B_MOE, ("greedy", 1, 1, "softmax", False, 1.0, False)),
    # NOTE: MaxText routes DeepSeek-V2-236B greedily (its yml: "not fully supported"); with HF's
    # keys added it is V2's group-limited routing (next test).
    (MAXTEXT_DEEPSEEK2_236B_MOE, ("greedy", 1, 1, "softmax", False, 16.0, False)),
    # NOTE: without groups (MaxText's -1) noaux_tc is greedy on the biased scores; normalised
    # because MaxText's DeepSeek gate normalises sigmoid scores.
    (MAXTEXT_DEEPSEEK3_671B_MOE, ("noaux_tc", 1, 1, "sigmoid", True, 2.5, True)),
  ],
  ids=[
    "hf-v2-lite",
    "hf-v2",
    "hf-v3",
    "mt-deepseek2-16b",
    "mt-deepseek2-236b",
    "mt-deepseek3-671b",
  ],
)
def test_deepseek_configs_yield_their_routing(d, want):
  c = MoEConfig.from_dict(d)
  assert _routing(c) == want
  if "routed_score_func" in d:  # MaxText: base.yml's "unset" values change nothing
    assert MoEConfig.from_dict({**d, **MAXTEXT_BASE_ROUTING}) == c


# The MaxText model files set no loss weight; HF's aux_loss_alpha picks DeepSeek's loss.
_NO_AUX = dict(aux_loss_coef=0.0, aux_loss_definition="switch")


def test_maxtext_and_hf_deepseek_routing_agree():
  """MaxText's V3 file with its documented flags (n_routing_groups=8, topk_routing_group=4) is
  HF's V3; MaxText's V2-236B file plus HF's routing keys is HF's V2; the V2-Lite pair agrees."""
  hf_v3 = MoEConfig.from_dict(HF_DEEPSEEK_V3_MOE)
  mt_v3 = MoEConfig.from_dict(
    {**MAXTEXT_DEEPSEEK3_671B_MOE, "n_routing_groups": 8, "topk_routing_group": 4}
  )
  assert mt_v3 == dataclasses.replace(hf_v3, **_NO_AUX)
  hf_v2 = MoEConfig.from_dict(HF_DEEPSEEK_V2_MOE)
  keys = {k: HF_DEEPSEEK_V2_MOE[k] for k in ("topk_method", "n_group", "topk_group")}
  mt_v2 = MoEConfig.from_dict({**MAXTEXT_DEEPSEEK2_236B_MOE, **keys})
  assert mt_v2 == dataclasses.replace(hf_v2, **_NO_AUX)
  mt_v2 = MoEConfig.from_dict(
    {**MAXTEXT_DEEPSEEK2_236B_MOE, "n_routing_groups": 8, "topk_routing_group": 3, **keys}
  )
  assert mt_v2.n_group == 8 and mt_v2.topk_group == 3
  lite = MoEConfig.from_dict(HF_DEEPSEEK_V2_LITE_MOE)
  assert dataclasses.replace(lite, **_NO_AUX) == MoEConfig.from_dict(MAXTEXT_DEEPSEEK2_16B_MOE)
  # Bias update rate and f32 gate logits: MaxText's names are our field names.
  c = MoEConfig.from_dict(
    {**MAXTEXT_DEEPSEEK3_671B_MOE, "routed_bias_update_rate": 1e-3, "float32_gate_logits": False}
  )
  assert c.routed_bias_update_rate == 1e-3 and not c.float32_gate_logits


@pytest.mark.parametrize(
  "d, match",
  [
    (
      {**HF_DEEPSEEK_V3_MOE, "scoring_func": "softmax"},
      r"score_func='softmax'.*noaux_tc.*'sigmoid'",
    ),
    ({**HF_DEEPSEEK_V2_MOE, "scoring_func": "sigmoid"}, r"score_func='sigmoid'.*Set score_func="),
    ({**HF_DEEPSEEK_V3_MOE, "scoring_func": "sqrtsoftplus"}, r"score_func must be one of"),
    ({**HF_DEEPSEEK_V3_MOE, "n_group": 7}, r"n_group=7 .*must divide num_experts=256"),
    ({**HF_DEEPSEEK_V3_MOE, "topk_group": 9}, r"topk_group=9 .*must be <= n_group=8"),
    ({**HF_DEEPSEEK_V3_MOE, "topk_group": 0}, r"topk_group must be a positive int"),
    ({**HF_DEEPSEEK_V2_MOE, "n_group": 32, "topk_group": 1}, r"top_k=6 is more than the 5 "),
    (
      {**HF_DEEPSEEK_V3_MOE, "n_routed_experts": 8, "num_experts_per_tok": 2},
      r"n_group=8: noaux_tc scores a group by its two best experts, so groups need >= 2",
    ),
    ({**HF_DEEPSEEK_V2_MOE, "norm_topk_prob": True}, r"routed_scaling_factor=16.0 with norm"),
    ({**HF_DEEPSEEK_V2_LITE_MOE, "n_group": 8}, r"n_group=8, topk_group=1 .*grouped topk_method"),
    (
      {**MAXTEXT_DEEPSEEK2_236B_MOE, "n_routing_groups": 8, "topk_routing_group": 3},
      r"n_routing_groups.*'group_limited_greedy'.*routed_bias: true",
    ),
    (
      {**MAXTEXT_DEEPSEEK2_16B_MOE, "routed_bias_update_rate": 1e-3},
      r"routed_bias_update_rate=0.001 needs a correction bias",
    ),
    (
      {**HF_DEEPSEEK_V2_MOE, "routed_bias_update_rate": 1e-3},
      r"routed_bias_update_rate=0.001 needs topk_method='noaux_tc'",
    ),
    ({**HF_DEEPSEEK_V3_MOE, "routed_bias": False}, r"'routed_bias'=False but 'topk_method'"),
    ({**HF_DEEPSEEK_V2_MOE, "routed_bias": True}, r"'topk_method'='group_limited_greedy' and "),
    ({**HF_DEEPSEEK_V3_MOE, "routed_bias_update_rate": -1.0}, r"must be >= 0"),
  ],
)
def test_bad_deepseek_routing_raises_naming_key_and_fix(d, match):
  with pytest.raises(ValueError, match=match):
    MoEConfig.from_dict(d)


# --- Hugging Face transformers 5 config.json files per model family (tests/data/hf_configs). ---

HF_DIR = pathlib.Path(__file__).parent.parent / "data" / "hf_configs"


def _hf(name: str) -> dict:
  return json.loads((HF_DIR / f"{name}.json").read_text())


def _layer(c: MoEConfig):
  return (
    (c.num_experts, c.top_k, c.d_model, c.expert_ffn_dim),
    (c.num_shared_experts, c.shared_width, c.shared_expert_gate),
    (c.score_func, c.topk_method, c.n_group, c.topk_group, c.norm_topk_prob),
    (c.routed_scaling_factor, c.float32_gate_logits, c.dtype),
    (c.aux_loss_coef, c.aux_loss_definition),
  )


@pytest.mark.parametrize(
  "name, want",
  [
    # Mixtral: experts of intermediate_size; softmax, top-k, always renormalised; logits in
    # the model dtype; router_aux_loss_coef multiplies transformers' loss ("hf").
    (
      "mixtral_default",
      ((8, 2, 4096, 14336), (0, 0, False), ("softmax", "greedy", 1, 1, True)),
    ),
    ("mixtral_bf16", ((4, 2, 64, 32), (0, 0, False), ("softmax", "greedy", 1, 1, True))),
    # Qwen2-MoE: one sigmoid-gated shared expert of shared_expert_intermediate_size.
    (
      "qwen2_moe_default",
      ((60, 4, 2048, 1408), (1, 5632, True), ("softmax", "greedy", 1, 1, False)),
    ),
    (
      "qwen2_moe_no_shared",
      ((60, 4, 2048, 1408), (0, 0, False), ("softmax", "greedy", 1, 1, True)),
    ),
    ("qwen3_moe_default", ((128, 8, 2048, 768), (0, 0, False), ("softmax", "greedy", 1, 1, False))),
    # NOTE: mlp_only_layers / decoder_sparse_step say which layers are MoE: accepted.
    (
      "qwen3_moe_norm_topk",
      ((128, 8, 2048, 768), (0, 0, False), ("softmax", "greedy", 1, 1, True)),
    ),
    # DeepSeek: transformers' V2 writes topk_method but no scoring_func (softmax), n_group null;
    # its V3 writes neither (noaux_tc on sigmoid); neither writes an aux-loss coefficient.
    (
      "deepseek_v2_lite",
      ((64, 6, 2048, 1408), (2, 2816, False), ("softmax", "greedy", 1, 1, False)),
    ),
    (
      "deepseek_v2_group_limited",
      ((160, 6, 5120, 1536), (2, 3072, False), ("softmax", "group_limited_greedy", 8, 3, False)),
    ),
    (
      "deepseek_v3_default",
      ((256, 8, 7168, 2048), (1, 2048, False), ("sigmoid", "noaux_tc", 8, 4, True)),
    ),
  ],
)
def test_transformers_configs_yield_their_layer(name, want):
  d = _hf(name)
  c = MoEConfig.from_dict(d)
  assert _layer(c)[:3] == want
  hf_router = d["model_type"] != "deepseek_v2" and d["model_type"] != "deepseek_v3"
  assert c.float32_gate_logits is not hf_router
  assert c.dtype == d.get("dtype", "float32")
  coef = d.get("router_aux_loss_coef", 0.0)
  assert (c.aux_loss_coef, c.aux_loss_definition) == (coef, "hf" if coef else "switch")


def test_deepseek_hub_and_transformers_configs_agree():
  """DeepSeek's published config.json (topk_method, scoring_func, ep_size, fp8 storage) reads
  to the same layer as transformers' config class, which writes none of those."""
  assert MoEConfig.from_dict(_hf("deepseek_v3_hub")) == MoEConfig.from_dict(_hf("deepseek_v3_bf16"))
  hub_v2 = MoEConfig.from_dict(_hf("deepseek_v2_5_hub"))
  tf_v2 = MoEConfig.from_dict(_hf("deepseek_v2_group_limited"))
  assert (hub_v2.aux_loss_coef, hub_v2.aux_loss_definition) == (0.001, "sequence")
  assert hub_v2 == dataclasses.replace(
    tf_v2, dtype="bfloat16", aux_loss_coef=0.001, aux_loss_definition="sequence"
  )
  no_seq = MoEConfig.from_dict({**_hf("deepseek_v2_5_hub"), "seq_aux": False})
  assert no_seq.aux_loss_definition == "switch"


@pytest.mark.parametrize(
  "name, extra, match",
  [
    ("deepseek_v2_default", {}, r"'num_experts_per_tok'=None .*unset; set it"),
    ("mixtral_default", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1.*set it to 0"),
    ("deepseek_v2_lite", {"mlp_bias": True}, r"mlp_bias=True.*no bias"),
    ("qwen3_moe_default", {"hidden_act": "gelu"}, r"only silu-gated"),
    ("mixtral_default", {"norm_topk_prob": False}, r"'model_type'='mixtral' \(which means "),
    ("deepseek_v3_hub", {"scoring_func": "softmax"}, r"'model_type'='deepseek_v3'.*'scoring_f"),
    ("deepseek_v3_default", {"topk_method": "greedy"}, r"'model_type'='deepseek_v3'"),
    ("mixtral_default", {"brand_new_key": 1}, r"unknown key 'brand_new_key'"),
    ("mixtral_default", {"decoder_sparse_step": 1}, r"not a key of model_type 'mixtral'"),
    ("mixtral_default", {"model_type": "glm4_moe"}, r"model_type='glm4_moe' is not a family"),
    ("qwen2_moe_default", {"model_type": None}, r"depends on the family.*no 'model_type'"),
  ],
)
def test_transformers_config_errors_name_the_key(name, extra, match):
  d = {**_hf(name), **extra}
  if d.get("model_type") is None:
    del d["model_type"]
  with pytest.raises(ValueError, match=match):
    MoEConfig.from_dict(d)


# --- The aux loss each framework's coefficient multiplies, against its formula in numpy. -------


def _np_softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_topk(scores, k):
  return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def hf_load_balancing_loss(logits, *, num_experts, top_k):
  """transformers `load_balancing_loss_func` (modeling_mixtral.py), one layer, no mask."""
  routing_weights = _np_softmax(logits)
  selected = _np_topk(routing_weights, top_k)
  tokens_per_expert = np.bincount(selected.reshape(-1), minlength=num_experts) / len(logits)
  router_prob_per_expert = routing_weights.mean(0)
  return num_experts * np.sum(tokens_per_expert * router_prob_per_expert)


def deepseek_moegate_aux(scores, topk_idx, *, bsz, seq_aux):
  """deepseek-ai modeling_deepseek.py `MoEGate.forward`'s aux loss (without `* alpha`)."""
  n_routed_experts, top_k = scores.shape[-1], topk_idx.shape[-1]
  seq_len = len(scores) // bsz
  if seq_aux:
    ce = np.zeros((bsz, n_routed_experts))
    np.add.at(ce, (np.arange(bsz)[:, None], topk_idx.reshape(bsz, -1)), 1.0)
    ce /= seq_len * top_k / n_routed_experts
    return (ce * scores.reshape(bsz, seq_len, -1).mean(1)).sum(1).mean()
  ce = np.eye(n_routed_experts)[topk_idx.reshape(-1)].mean(0)
  return (scores.mean(0) * ce * n_routed_experts).sum()


def maxtext_load_balance_loss(top_k_indices, gate_out, *, num_experts, top_k):
  """MaxText `MoeBlock.load_balance_loss` (layers/moe.py) on [batch, seq, ...] arrays, with
  the softmax its callers apply to the gate's output (without `* load_balance_loss_weight`)."""
  summed_expert_mask = np.eye(num_experts)[top_k_indices].sum(axis=2)
  density = summed_expert_mask.mean(axis=1) / top_k
  density_prob = _np_softmax(gate_out).mean(axis=1)
  return np.mean(density * density_prob) * num_experts**2


_SMALL_HF = {"hidden_size": 16, "num_experts_per_tok": 2, "gmm_impl": "ragged_dot"}
_SMALL_MT = {"num_experts": 8, "num_experts_per_tok": 2, "base_emb_dim": 16, "base_moe_mlp_dim": 8}


def _block_aux(config: MoEConfig, tokens: int = 16):
  """(aux_loss of the plain ep=1 block, [T, E] router logits) on random tokens."""
  from pallas_moe import moe

  params = moe.init_params(jax.random.key(0), config)
  x = jax.random.normal(jax.random.key(1), (tokens, config.d_model), jnp.float32)
  _, aux = jax.jit(functools.partial(moe.moe_block, config=config))(params, x)
  logits = np.asarray(x, np.float64) @ np.asarray(params["router"], np.float64)
  return float(aux["aux_loss"]), logits


@pytest.mark.parametrize("seq_aux", [True, False])
def test_aux_loss_deepseek_aux_loss_alpha(seq_aux):
  c = MoEConfig.from_dict(
    {
      **_SMALL_HF,
      "model_type": "deepseek_v2",
      "n_routed_experts": 8,
      "moe_intermediate_size": 8,
      "n_shared_experts": 0,
      "aux_loss_alpha": 0.001,
      "seq_aux": seq_aux,
      "aux_loss_seq_len": 4,
    }
  )
  assert c.aux_loss_definition == ("sequence" if seq_aux else "switch")
  got, logits = _block_aux(c)
  scores = _np_softmax(logits)
  want = deepseek_moegate_aux(scores, _np_topk(scores, 2), bsz=4, seq_aux=seq_aux)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_aux_loss_hf_router_aux_loss_coef_is_top_k_times_switch():
  d = {**_hf("mixtral_bf16"), "dtype": "float32", "gmm_impl": "ragged_dot"}
  c = MoEConfig.from_dict(d)
  assert (c.aux_loss_coef, c.aux_loss_definition, c.top_k) == (0.02, "hf", 2)
  got, logits = _block_aux(c)
  want = hf_load_balancing_loss(logits, num_experts=4, top_k=2)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  switch, _ = _block_aux(dataclasses.replace(c, aux_loss_definition="switch"))
  np.testing.assert_allclose(got, 2 * switch, rtol=1e-5)


@pytest.mark.parametrize("score_func", ["", "softmax", "sigmoid"])
def test_aux_loss_maxtext_load_balance_loss_weight(score_func):
  d = {**_SMALL_MT, "load_balance_loss_weight": 0.01, "max_target_length": 4, "megablox": False}
  if score_func:
    d["routed_score_func"] = score_func
  c = MoEConfig.from_dict(d)
  assert c.aux_loss_definition == ("maxtext_scored" if score_func else "sequence")
  assert c.aux_loss_seq_len == 4
  got, logits = _block_aux(c)
  # NOTE: MaxText's gate output is score_func(logits) when routed_score_func is set; its
  # top-k (and ours, with a zero correction bias and no groups) is over those scores.
  gate_out = {"": logits, "softmax": _np_softmax(logits), "sigmoid": 1 / (1 + np.exp(-logits))}
  g = gate_out[score_func]
  want = maxtext_load_balance_loss(
    _np_topk(g, 2).reshape(4, 4, 2), g.reshape(4, 4, 8), num_experts=8, top_k=2
  )
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_aux_loss_sequences_over_a_mesh():
  """Per-sequence loss under moe_layer: each device holds whole sequences; the mean over all."""
  from pallas_moe import moe

  c = MoEConfig(
    num_experts=8, top_k=2, d_model=16, expert_ffn_dim=8, gmm_impl="ragged_dot",
    aux_loss_definition="sequence", aux_loss_seq_len=4,
  )  # fmt: skip
  params = moe.init_params(jax.random.key(0), c)
  x = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32)
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  _, aux = jax.jit(functools.partial(moe.moe_layer, config=c, mesh=mesh))(params, x)
  scores = _np_softmax(np.asarray(x, np.float64) @ np.asarray(params["router"], np.float64))
  want = deepseek_moegate_aux(scores, _np_topk(scores, 2), bsz=16, seq_aux=True)
  np.testing.assert_allclose(float(aux["aux_loss"]), want, rtol=1e-5)
  bad = dataclasses.replace(c, aux_loss_seq_len=16)
  with pytest.raises(ValueError, match=r"T=8 tokens on each device a multiple of seq_len"):
    jax.jit(functools.partial(moe.moe_layer, config=bad, mesh=mesh))(params, x)
