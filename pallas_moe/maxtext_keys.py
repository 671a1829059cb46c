"""MaxText's config keys for the MoE layer: what each means as a `MoEConfig` field.

`MoEConfig.from_dict` reads these beside Hugging Face's (`pallas_moe.hf_keys`). MaxText writes -1
for "unset" (`capacity_factor`, `n_routing_groups`): those set nothing; in its mesh keys
(`ici_*_parallelism`, `dcn_*_parallelism`, `mesh_fields`) -1 means "the devices that are left".
Its 18 `{wi,wo}_tile_{fwd,dlhs,drhs}_{batch_seq,embed_dim,mlp_dim}` keys are megablox's tiles,
read into a `Tiling` only when asked (`from_dict(..., honour_tiling=True)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pallas_moe import keys
from pallas_moe.tiles import Tiling


def dropless_if_nonpositive(v):
  """MaxText uses -1 for 'not set' (dropless); None and <= 0 mean dropless here."""
  return None if v is None or float(v) <= 0 else float(v)


def true_only(name: str) -> Callable[[Any], Any]:
  def check(v):
    if not v:
      raise ValueError(
        f"{name}={v!r}: this MoE layer only implements the sparse (grouped matmul) path."
      )
    return None

  return check


def routed_bias(v):
  """MaxText `routed_bias`: True is DeepSeek-V3's noaux_tc; False sets nothing (checked later)."""
  return "noaux_tc" if v else None


def groups(v):
  """MaxText's `n_routing_groups` / `topk_routing_group`: -1 (<= 0) means no groups (unset)."""
  return None if v is None or int(v) <= 0 else int(v)


# MaxText `quantization` -> (weight_quantization, activation_quantization). MaxText's "int8" is
# AQT int8 on both operands of the forward dot (fwd_bits=8, int32 accumulation) and "int8w" its
# weight-only mode; its "fp8" quantizes inputs and kernels alike.
MAXTEXT_QUANTIZATION = {"int8": ("int8", "int8"), "int8w": ("int8", None), "fp8": ("fp8", "fp8")}


def maxtext_quantization(v):
  """MaxText's `quantization`: "" / None -> not set; else its weight dtype (see from_dict)."""
  if v is None or v == "":
    return None
  if v not in MAXTEXT_QUANTIZATION:
    raise ValueError(
      f"MaxText quantization={v!r} is not supported: only '' (none), 'int8', 'int8w' and 'fp8' "
      "map to MoEConfig.weight_quantization / activation_quantization (per-channel weight "
      "scales, per-row activation scales)."
    )
  return MAXTEXT_QUANTIZATION[v][0]


# MaxText key -> (field, value conversion).
ALIASES: dict[str, tuple[str, keys.Conversion]] = {
  "num_experts_per_tok": ("top_k", int),
  "base_emb_dim": ("d_model", int),
  "emb_dim": ("d_model", int),
  "base_moe_mlp_dim": ("expert_ffn_dim", int),
  "moe_mlp_dim": ("expert_ffn_dim", int),
  "shared_experts": ("num_shared_experts", keys.shared),
  "routed_score_func": ("score_func", lambda v: str(v) if v else None),  # NOTE: "" = unset
  "routed_bias": ("topk_method", routed_bias),
  "n_routing_groups": ("n_group", groups),
  "topk_routing_group": ("topk_group", groups),
  "mlp_activations": ("activation", keys.activation),
  "capacity_factor": ("buffer_factor", dropless_if_nonpositive),
  "ragged_buffer_factor": ("buffer_factor", dropless_if_nonpositive),
  "megablox": ("gmm_impl", lambda v: "pallas" if v else "ragged_dot"),
  "sparse_matmul": ("gmm_impl", true_only("sparse_matmul")),
  "load_balance_loss_weight": ("aux_loss_coef", float),
  "max_target_length": ("aux_loss_seq_len", int),
  "quantization": ("weight_quantization", maxtext_quantization),
  "batch_split_factor": ("batch_split", int),
  "use_batch_split_schedule": ("batch_split", lambda v: None),  # NOTE: gates the factor (from_dict)
}

# MaxText model-config keys about other layers or training: skipped.
IGNORED_KEYS = frozenset(
  {
    "base_num_query_heads",
    "base_num_kv_heads",
    "base_mlp_dim",
    "base_num_decoder_layers",
    "first_num_dense_layers",
    "enable_dropout",
    "logits_via_embedding",
    "normalization_layer_epsilon",
    "decoder_block",
    "attention_type",
    "rope_type",
    "rope_max_timescale",
    "rope_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "rope_interleave",
    "rope_truncate",
    "rope_attention_scaling",
    "model_name",
    # NOTE: how MaxText runs its own layer, not what the layer computes: its ring-of-experts
    # exchange (this layer picks its own exchange), the combine weights' sum in f32 (this layer
    # always sums in f32) and its pre-fused wi_0 | wi_1 (this layer's wi is fused).
    "use_ring_of_experts",
    "float32_weight_sum",
    "prefuse_moe_weights",
  }
)


TILE_PASSES = ("fwd", "dlhs", "drhs")
TILE_DIMS = ("batch_seq", "embed_dim", "mlp_dim")
TILE_KEYS = frozenset(
  f"{proj}_tile_{p}_{dim}" for proj in ("wi", "wo") for p in TILE_PASSES for dim in TILE_DIMS
)
# MaxText's defaults for tiles of a pass when only some of its three keys are given.
TILE_DEFAULT = {"batch_seq": 512, "embed_dim": 1024, "mlp_dim": 1024}

# NOTE: each pass's tiles are (rows, contraction, output columns) of that pass's own matmul:
# wi fwd  [m, embed] x [embed, mlp]: (batch_seq, embed_dim, mlp_dim)
# wi dlhs [m, mlp] x [mlp, embed]:   (batch_seq, mlp_dim, embed_dim)
# wi drhs tgmm over (m, k, n) of wi [embed, mlp]: (batch_seq, embed_dim, mlp_dim)
# wo is the same with embed and mlp swapped.
PASS_ORDER = {
  ("wi", "fwd"): ("batch_seq", "embed_dim", "mlp_dim"),
  ("wi", "dlhs"): ("batch_seq", "mlp_dim", "embed_dim"),
  ("wi", "drhs"): ("batch_seq", "embed_dim", "mlp_dim"),
  ("wo", "fwd"): ("batch_seq", "mlp_dim", "embed_dim"),
  ("wo", "dlhs"): ("batch_seq", "embed_dim", "mlp_dim"),
  ("wo", "drhs"): ("batch_seq", "mlp_dim", "embed_dim"),
}


def tiling_from_maxtext(tiles: dict[str, int], *, proj: str) -> Tiling | None:
  """A `Tiling` from MaxText's `{proj}_tile_{pass}_{dim}` keys; None when none is given."""
  per_pass = {}
  for p in TILE_PASSES:
    names = {dim: f"{proj}_tile_{p}_{dim}" for dim in TILE_DIMS}
    if not any(k in tiles for k in names.values()):
      per_pass[p] = None
      continue
    got = {dim: tiles.get(k, TILE_DEFAULT[dim]) for dim, k in names.items()}
    per_pass[p] = tuple(got[dim] for dim in PASS_ORDER[(proj, p)])
  if all(v is None for v in per_pass.values()):
    return None
  return Tiling(**per_pass)


# MaxText's mesh: axis names (its `mesh_axes`) of the roles the MoE layer uses, and their keys.
MESH_ROLES = ("data", "fsdp", "tensor", "expert")
MESH_KEYS = frozenset(
  f"{scope}_{role}_parallelism" for scope in ("ici", "dcn") for role in MESH_ROLES
)


def mesh_fields(d) -> dict:
  """The mesh fields MaxText's `ici_*_parallelism` / `dcn_*_parallelism` keys in `d` mean.

  Each role whose axis is sharded (a size other than 1 in either scope, -1 meaning "the devices
  that are left") gets its axis, named as MaxText names it; `{role}_parallelism` takes the ici
  size (per slice), `dcn_parallelism` the sizes across slices.
  """
  fields: dict = {}
  dcn = []
  for role in MESH_ROLES:
    sizes = {}
    for scope in ("ici", "dcn"):
      key = f"{scope}_{role}_parallelism"
      if key not in d:
        continue
      v = d[key]
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or (v < 1 and v != -1):
        raise ValueError(
          f"MoEConfig.from_dict: {key!r}={v!r} must be a positive int or -1 (the devices left)."
        )
      sizes[scope] = int(v)
    if not sizes:
      continue
    if "ici" in sizes:
      fields[f"{role}_parallelism"] = sizes["ici"]
    if sizes.get("dcn", 1) != 1:
      dcn.append((role, sizes["dcn"]))
    if any(v != 1 for v in sizes.values()):
      fields[f"{role}_axis"] = role
  if dcn:
    fields["dcn_parallelism"] = tuple(dcn)
  return fields
