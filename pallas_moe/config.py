"""MoE layer configuration, readable from MaxText and Hugging Face config dicts.

`MoEConfig` is a frozen keyword-only dataclass. `MoEConfig.from_dict` accepts our own field names
and the names MaxText (`num_experts`, `num_experts_per_tok`, `base_moe_mlp_dim`, `wi_tile_*`, ...)
and Hugging Face DeepSeek/Qwen configs (`n_routed_experts`, `moe_intermediate_size`,
`hidden_size`, ...) use for the same things. Rules:

- Every alias maps to exactly one field (with a value conversion where the ecosystems differ).
  MaxText's "unset" values (`capacity_factor=-1`, `n_routing_groups=-1`) set nothing, so
  the field keeps its default (e.g. `buffer_factor=None`: dropless) unless another key sets it.
- Two aliases of one field with different (converted) values raise, naming both keys.
- Keys that are valid in those ecosystems but describe other parts of the model (attention,
  vocabulary, layer count, ...) are listed in `IGNORED_KEYS` and skipped.
- A Hugging Face config.json is read by its `model_type` (`HF_MODEL_TYPES`: mixtral, qwen2_moe,
  qwen3_moe, deepseek_v2, deepseek_v3): its keys mean what that family's transformers code
  does with them, the settings that code hard-wires are implied, and the family's whole-model
  keys (including which layers are MoE: `decoder_sparse_step`, `mlp_only_layers`,
  `first_k_dense_replace`, `moe_layer_freq`) are skipped. Settings of the MoE layer it does not
  implement (`router_jitter_noise` != 0, `mlp_bias`, a non-silu `hidden_act`) raise.
- Any other key raises, naming the key and the closest valid name; `ignore_unknown=True` skips
  them instead (for dicts from newer framework versions).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_moe import hf_keys, keys, maxtext_keys
from pallas_moe.hf_keys import HF_MODEL_TYPES
from pallas_moe.tiles import Tiling

__all__ = [
  "AUX_LOSS_DEFINITIONS",
  "HF_MODEL_TYPES",
  "IGNORED_KEYS",
  "MoEConfig",
  "MoEModel",
  "MoERun",
  "check_expert_placement",
]

_SCORE_FUNCS = ("softmax", "sigmoid")
_ACTIVATIONS = ("swiglu",)
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# NOTE: the score function each DeepSeek method is defined with (their code raises otherwise).
_METHOD_SCORE_FUNC = {"group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}
_GMM_IMPLS = ("pallas", "mosaic", "interpret", "xla", "ragged_dot")
# The load-balancing losses `moe.load_balance_loss` computes (see MoEConfig.aux_loss_definition).
AUX_LOSS_DEFINITIONS = ("switch", "hf", "sequence", "maxtext_scored")
_WEIGHT_QUANTIZATIONS = (None, "int8", "fp8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEModel:
  """What the MoE layer is: sizes, routing and its loss, the same on any mesh or chip.

  A checkpoint fixes these (`from_hf` reads them from a config.json).

  Attributes:
    num_experts: routed experts.
    top_k: experts per token.
    d_model: model (embedding) width.
    expert_ffn_dim: hidden width of each routed expert.
    num_shared_experts: experts every token goes through (a dense MLP).
    shared_ffn_dim: hidden width of each shared expert (default `expert_ffn_dim`); the shared
      MLP is one SwiGLU MLP of width `num_shared_experts * shared_ffn_dim`, as in DeepSeek.
    shared_expert_gate: multiply the shared experts' output per token by
      `sigmoid(x @ shared_gate)` (Qwen2-MoE).
    activation: "swiglu": `silu(x @ w_gate) * (x @ w_up)`.
    score_func: router scores, "softmax" or "sigmoid" over the expert logits.
    norm_topk_prob: divide the top-k scores by their sum.
    routed_scaling_factor: multiplies the routed experts' combined output.
    topk_method: "greedy" (plain top-k), "group_limited_greedy" (DeepSeek-V2: softmax, group
      score = its best expert's score) or "noaux_tc" (DeepSeek-V3: sigmoid plus a correction
      bias used only for the choice, group score = sum of its two best biased scores). See
      `pallas_moe.routing`. "noaux_tc" makes `init_params` create the bias (MaxText
      `routed_bias: true`).
    n_group: expert groups for the grouped methods (HF `n_group`, MaxText `n_routing_groups`);
      must divide num_experts; 1 with "greedy".
    topk_group: groups each token may use (HF `topk_group`, MaxText `topk_routing_group`).
    routed_bias_update_rate: speed of the aux-loss-free bias update
      (`routing.update_routed_bias`); needs "noaux_tc". 0 leaves the bias fixed.
    float32_gate_logits: router matmul in f32 (default); False: in `dtype` (MaxText's flag).
      NOTE: MaxText's base.yml defaults it to false; ours is true because DeepSeek's published
      gate (HF `MoEGate`) computes its logits in f32, and bf16 logits flip top-k choices on
      near ties. A MaxText config that sets the key keeps its value. The shared expert's
      gate logit (`shared_expert_gate`) follows the same flag. `from_dict` of a Mixtral or
      Qwen config.json sets it False (their routers compute logits in the model dtype) unless
      the dict sets it.
    aux_loss_coef: weight of the load-balancing loss (the block returns it unweighted too).
    aux_loss_definition: which load-balancing loss `aux_loss_coef` multiplies, so that a
      framework's coefficient keeps its strength; the formulas and their sources are in
      `moe.load_balance_loss`. "switch" (default): `E * sum_e f_e * P_e` over the whole batch,
      `f_e` = share of the `T * top_k` routed rows (DeepSeek's MoEGate with `seq_aux: false`).
      "hf": Hugging Face transformers' `load_balancing_loss_func` (Mixtral, Qwen2/3-MoE), whose
      `f_e` is per token, not per row: `top_k` times "switch". "sequence": the mean over
      sequences of "switch" per sequence (DeepSeek's MoEGate with `seq_aux: true`; MaxText's
      `load_balance_loss` when the router has no score function). "maxtext_scored": MaxText's
      `load_balance_loss` when `routed_score_func` is set: per sequence, with `P_e` the mean of
      `softmax(score_func(logits))` (MaxText's gate applies the score function, its loss
      applies softmax again). `from_dict` sets it from the key that gave the coefficient:
      `router_aux_loss_coef` -> "hf", `aux_loss_alpha` -> "sequence" (`seq_aux`, DeepSeek's
      default, true) or "switch" (`seq_aux: false`), `load_balance_loss_weight` -> "sequence"
      or "maxtext_scored".
    aux_loss_seq_len: tokens per sequence for the per-sequence definitions ("sequence",
      "maxtext_scored"; MaxText `max_target_length`): the block's tokens are consecutive
      sequences of this length, each device holding whole ones. None: the whole (global) batch
      counts as one sequence, which is "switch" (config.json files do not say the training
      sequence length).
    weight_dtype: parameter dtype name (`init_params`).
  """

  num_experts: int
  top_k: int
  d_model: int
  expert_ffn_dim: int
  num_shared_experts: int = 0
  shared_ffn_dim: int | None = None
  shared_expert_gate: bool = False
  activation: str = "swiglu"
  score_func: str = "softmax"
  norm_topk_prob: bool = False
  routed_scaling_factor: float = 1.0
  topk_method: str = "greedy"
  n_group: int = 1
  topk_group: int = 1
  routed_bias_update_rate: float = 0.0
  float32_gate_logits: bool = True
  aux_loss_coef: float = 0.0
  aux_loss_definition: str = "switch"
  aux_loss_seq_len: int | None = None
  weight_dtype: str = "float32"

  def __post_init__(self):
    for name in ("num_experts", "top_k", "d_model", "expert_ffn_dim"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}.")
    if self.top_k > self.num_experts:
      raise ValueError(f"MoEConfig.top_k={self.top_k} must be <= num_experts={self.num_experts}.")
    if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
      raise ValueError(
        f"MoEConfig.num_shared_experts must be an int >= 0, got {self.num_shared_experts!r}."
      )
    if self.shared_ffn_dim is not None and self.shared_ffn_dim < 1:
      raise ValueError(f"MoEConfig.shared_ffn_dim must be >= 1, got {self.shared_ffn_dim!r}.")
    if not isinstance(self.shared_expert_gate, bool):
      raise TypeError(
        f"MoEConfig.shared_expert_gate must be a bool, got {self.shared_expert_gate!r}."
      )
    if self.shared_expert_gate and self.num_shared_experts < 1:
      raise ValueError(
        "MoEConfig.shared_expert_gate=True gates the shared experts' output, but "
        "num_shared_experts=0: set num_shared_experts >= 1 (Qwen2-MoE: 1) or the gate to False."
      )
    _check_choice("activation", self.activation, _ACTIVATIONS)
    _check_choice("aux_loss_definition", self.aux_loss_definition, AUX_LOSS_DEFINITIONS)
    v = self.aux_loss_seq_len
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(
        f"MoEConfig.aux_loss_seq_len must be None (the whole batch is one sequence) or a "
        f"positive int (tokens per sequence), got {v!r}."
      )
    _check_choice("score_func", self.score_func, _SCORE_FUNCS)
    _check_choice("topk_method", self.topk_method, _TOPK_METHODS)
    self._check_routing()
    for name in ("weight_dtype",):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r} is not a dtype.") from None

  def _check_routing(self) -> None:
    """Grouped-routing values that neither DeepSeek model defines raise, naming key and fix."""
    method, e = self.topk_method, self.num_experts
    for name in ("n_group", "topk_group"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(
          f"MoEConfig.{name} must be a positive int, got {v!r} (MaxText writes -1 for 'no "
          "groups': leave the key out or use 1)."
        )
    if not self.routed_bias_update_rate >= 0:
      raise ValueError(
        f"MoEConfig.routed_bias_update_rate must be >= 0, got {self.routed_bias_update_rate!r}."
      )
    if method == "greedy":
      if (self.n_group, self.topk_group) != (1, 1):
        raise ValueError(
          f"MoEConfig.n_group={self.n_group}, topk_group={self.topk_group} (MaxText "
          "n_routing_groups / topk_routing_group) need a grouped topk_method: "
          "'group_limited_greedy' (DeepSeek-V2) or 'noaux_tc' (DeepSeek-V3; MaxText "
          "routed_bias: true). Plain greedy ignores groups: set both to 1 (MaxText -1)."
        )
      if self.routed_bias_update_rate:
        raise ValueError(
          f"MoEConfig.routed_bias_update_rate={self.routed_bias_update_rate} needs a correction "
          "bias: set topk_method='noaux_tc' (MaxText routed_bias: true) or the rate to 0."
        )
      return
    want = _METHOD_SCORE_FUNC[method]
    if self.score_func != want:
      raise ValueError(
        f"MoEConfig.score_func={self.score_func!r} (HF scoring_func, MaxText routed_score_func) "
        f"is not defined for topk_method={method!r}: DeepSeek's {method} uses {want!r}. "
        f"Set score_func={want!r}."
      )
    if method != "noaux_tc" and self.routed_bias_update_rate:
      raise ValueError(
        f"MoEConfig.routed_bias_update_rate={self.routed_bias_update_rate} needs "
        f"topk_method='noaux_tc' (got {method!r}); set the rate to 0."
      )
    if e % self.n_group:
      raise ValueError(
        f"MoEConfig.n_group={self.n_group} (HF n_group, MaxText n_routing_groups) must divide "
        f"num_experts={e}; pick a divisor of {e}."
      )
    if self.topk_group > self.n_group:
      raise ValueError(
        f"MoEConfig.topk_group={self.topk_group} (HF topk_group, MaxText topk_routing_group) "
        f"must be <= n_group={self.n_group}."
      )
    kept = self.topk_group * (e // self.n_group)
    if self.top_k > kept:
      raise ValueError(
        f"MoEConfig.top_k={self.top_k} is more than the {kept} experts that topk_group="
        f"{self.topk_group} groups of {e // self.n_group} hold; raise topk_group or lower top_k."
      )
    if method == "noaux_tc" and self.n_group > 1 and e // self.n_group < 2:
      raise ValueError(
        f"MoEConfig.n_group={self.n_group}: noaux_tc scores a group by its two best experts, "
        f"so groups need >= 2 of the {e} experts; use n_group <= {e // 2}."
      )
    if method == "group_limited_greedy" and self.norm_topk_prob and self.routed_scaling_factor != 1:
      # NOTE: DeepSeek-V2's gate applies routed_scaling_factor only when it does not normalise.
      raise ValueError(
        f"MoEConfig.routed_scaling_factor={self.routed_scaling_factor} with norm_topk_prob=True: "
        "DeepSeek-V2's group_limited_greedy ignores the factor when it normalises; set "
        "routed_scaling_factor=1.0 or norm_topk_prob=False."
      )

  @property
  def has_routed_bias(self) -> bool:
    """Whether the router uses a correction bias (`init_params` creates it)."""
    return self.topk_method == "noaux_tc"

  @property
  def shared_width(self) -> int:
    """Hidden width of the shared-expert MLP (0 without shared experts)."""
    per = self.expert_ffn_dim if self.shared_ffn_dim is None else self.shared_ffn_dim
    return self.num_shared_experts * per

  @property
  def param_dtype(self):
    return jnp.dtype(self.weight_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoERun:
  """How the MoE layer runs: mesh axes, exchange, buffers, chunks, kernels, tiles and numerics.

  None of these change the parameters' keys or shapes: the same checkpoint runs under any of them.

  Attributes:
    buffer_factor: None (default): dropless, see `moe.buffer_rows_for`. A float `f`: each
      device's receive buffer has `ceil(f * tokens_per_device * top_k)` rows; overflowing rows
      are dropped and counted.
    gmm_impl: "pallas": `pallas_moe.gmm` on the lowering platform's backend (Mosaic kernels for
      TPU, XLA's ragged_dot for GPU, interpret mode elsewhere); "mosaic", "interpret" or "xla":
      `pallas_moe.gmm` on that backend everywhere (its `implementation`); "ragged_dot": plain
      `jax.lax.ragged_dot` (MaxText's `megablox: false`), no quantized weights.
    wi_tiling: gmm tiles for the gate/up projection (`Tiling` or None for the heuristic).
    wo_tiling: gmm tiles for the down projection.
    data_axis: mesh axis the batch is split over (besides the fsdp and expert axes), or None
      (the mesh has none).
    fsdp_axis: mesh axis the batch and every weight are split over (fully sharded data
      parallelism: the routed experts' model dimension, the router's and the shared experts'),
      gathered inside the layer, gradients reduce-scattered; None (default): no such axis.
    tensor_axis: mesh axis the expert MLP width (the routed and shared experts' `f` / `s`) is
      split over; tokens are replicated over it and the layer sums its partial outputs over it
      once. None (default): no such axis.
    expert_axis: mesh axis the experts are split over (and the batch).
    data_parallelism, fsdp_parallelism, tensor_parallelism, expert_parallelism: each axis's size
      within a slice (MaxText's `ici_*_parallelism`; the mesh axis is that times the axis's
      `dcn_parallelism`), checked against the mesh when known; -1: whatever devices are left
      (`pallas_moe.mesh.make_mesh` fills it, as MaxText does); None: not said (1 in
      `make_mesh`, any size on a given mesh).
    dcn_parallelism: ((role, size), ...) or a dict: the part of an axis that spans slices
      (MaxText's `dcn_*_parallelism`), role one of "data", "fsdp", "tensor", "expert";
      -1 fills the slices. `make_mesh` puts that part outermost. Empty (default): one slice.
    dtype: activation and matmul dtype name.
    weight_quantization: None, "int8" or "fp8": the routed experts' gmms quantize their float
      weights on the fly (per-expert, per-output-channel scales; straight-through gradients; see
      `pallas_moe.gmm`). Weights only: activations stay in `dtype`. Not with gmm_impl="ragged_dot".
      MaxText's `quantization` maps here ("" means None; "int8" and "fp8" also set
      activation_quantization, "int8w" is weight-only); its other modes are refused.
    activation_quantization: None, or the weight_quantization dtype: the routed experts' gmms
      also quantize their input rows per row (one scale per row) and multiply int8 x int8 /
      fp8 x fp8 where the MXU supports it (straight-through gradients; see `pallas_moe.gmm`).
    debug_nan_poison: fill unwritten exchange-buffer rows with NaN (debugging).
    batch_split: split each device's tokens into this many equal chunks, each routed,
      dispatched, run through the experts and combined on its own, so that one chunk's
      exchange can overlap another chunk's expert matmuls (MaxText `batch_split_factor`).
      None (default): `moe.default_batch_split` picks it. Must divide the tokens per device.
      `from_dict` reads MaxText's `batch_split_factor` unless the same dict has
      `use_batch_split_schedule: false` (MaxText splits only when that is true).
      Buffers are per chunk (see `moe.buffer_rows_for`): dropless results equal the unsplit
      block's; with `buffer_factor`, each chunk drops on its own.
    expert_placement: None (default: slot j holds expert j) or a permutation of
      range(num_experts): weight slot j (device j // E_l, E_l = num_experts / expert axis size)
      holds global expert `expert_placement[j]`. The router, its bias, DeepSeek's groups, the
      aux loss and `expert_load` keep the original expert ids; only `wi`/`wo` are stored in slot
      order (`moe.place_experts`). A list or numpy array is stored as a tuple of ints. Get one
      from `bench.ep.topology_aware_placement` (docs/expert-parallelism.md, "Placing experts on
      the slice").
    dedup_dispatch: True: a token crosses the expert exchange once per destination device
      (not once per routed expert); the receiver expands it into one row per local expert and
      sums their weighted outputs into one row for the way back (`pallas_moe.dedup`). False:
      one row per (token, choice) each way. None (default): the step model's verdict for
      layers it has seen (off where the receiver's extra HBM passes cost more than the
      exchange saves, e.g. v5p), else True where it moves fewer bytes under uniform routing
      (`moe.dedup_dispatch_for`; never when E_l = 1 or top_k = 1).
    dispatch_quantization: None (default), "int8" or "fp8": the forward dispatch sends 8-bit
      rows (int8: absmax per row; fp8: e4m3 with one f32 scale per 128 columns, as
      DeepSeek-V3), their f32 scales in the same row; dequantized on arrival. The combine and
      the backward's exchanges stay in `dtype`; gradients are straight-through
      (`dedup.quantized_dispatch`). Uses the deduplicated exchange's packed rows, so it turns
      `dedup_dispatch=None` on (and refuses `dedup_dispatch=False`). No effect without expert
      parallelism (nothing is exchanged).
  """

  buffer_factor: float | None = None
  gmm_impl: str = "pallas"
  wi_tiling: Tiling | None = None
  wo_tiling: Tiling | None = None
  data_axis: str | None = "data"
  fsdp_axis: str | None = None
  tensor_axis: str | None = None
  expert_axis: str = "expert"
  data_parallelism: int | None = None
  fsdp_parallelism: int | None = None
  tensor_parallelism: int | None = None
  expert_parallelism: int | None = None
  dcn_parallelism: tuple[tuple[str, int], ...] = ()
  dtype: str = "float32"
  weight_quantization: str | None = None
  activation_quantization: str | None = None
  debug_nan_poison: bool = False
  batch_split: int | None = None
  expert_placement: tuple[int, ...] | None = None
  dedup_dispatch: bool | None = None
  dispatch_quantization: str | None = None

  def __post_init__(self):
    _check_choice("gmm_impl", self.gmm_impl, _GMM_IMPLS)
    _check_choice("weight_quantization", self.weight_quantization, _WEIGHT_QUANTIZATIONS)
    if self.weight_quantization is not None and self.gmm_impl == "ragged_dot":
      raise ValueError(
        f"MoEConfig.weight_quantization={self.weight_quantization!r} needs gmm_impl='pallas' "
        "(or 'mosaic', 'interpret', 'xla'), not 'ragged_dot': plain ragged_dot has no "
        "quantized-weight path."
      )
    _check_choice("activation_quantization", self.activation_quantization, _WEIGHT_QUANTIZATIONS)
    if self.activation_quantization not in (None, self.weight_quantization):
      raise ValueError(
        f"MoEConfig.activation_quantization={self.activation_quantization!r} needs "
        f"weight_quantization={self.activation_quantization!r} (got "
        f"{self.weight_quantization!r}): activations are quantized only together with the "
        "weights, in the same dtype."
      )
    if self.buffer_factor is not None and not self.buffer_factor > 0:
      raise ValueError(
        f"MoEConfig.buffer_factor must be None (dropless) or > 0, got {self.buffer_factor!r}."
      )
    for name in ("wi_tiling", "wo_tiling"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, Tiling):
        raise TypeError(f"MoEConfig.{name} must be a pallas_moe.Tiling or None, got {v!r}.")
    for name in ("dtype",):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r} is not a dtype.") from None
    v = self.batch_split
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(
        f"MoEConfig.batch_split (MaxText batch_split_factor) must be None (the default rule) or "
        f"an int >= 1, got {v!r}; use 1 for no split."
      )
    if not (self.dedup_dispatch is None or isinstance(self.dedup_dispatch, bool)):
      raise ValueError(
        f"MoEConfig.dedup_dispatch must be None (auto), True or False, got {self.dedup_dispatch!r}."
      )
    _check_choice("dispatch_quantization", self.dispatch_quantization, (None, "int8", "fp8"))
    if self.dispatch_quantization is not None and self.dedup_dispatch is False:
      raise ValueError(
        f"MoEConfig.dispatch_quantization={self.dispatch_quantization!r} sends the deduplicated "
        "exchange's packed rows: leave dedup_dispatch None (or True), or set "
        "dispatch_quantization=None."
      )
    _check_axes(self)
    if self.expert_placement is not None:
      # NOTE: frozen dataclass: store a tuple so the config stays hashable (jit keys); the
      # permutation is checked against num_experts by `MoEConfig`.
      object.__setattr__(self, "expert_placement", _placement_tuple(self.expert_placement))

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes the tokens are split over, major to minor: data, fsdp, expert (those set)."""
    return tuple(a for a in (self.data_axis, self.fsdp_axis, self.expert_axis) if a is not None)

  @property
  def mesh_axes(self) -> dict[str, str]:
    """role -> axis name of every axis the layer uses, in MaxText's mesh order."""
    return {r: getattr(self, f"{r}_axis") for r in MESH_ROLES if getattr(self, f"{r}_axis")}


MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(MoEModel))
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(MoERun))


@dataclasses.dataclass(frozen=True, init=False)
class MoEConfig:
  """A Mixture-of-Experts layer: what it is (`model`) and how it runs (`run`).

  Built from the fields of both, by keyword, or from the two parts:

    MoEConfig(num_experts=64, top_k=6, d_model=2048, expert_ffn_dim=1408, dtype="bfloat16")
    MoEConfig(model=MoEModel(...), run=MoERun(expert_axis="ep"))
    MoEConfig(model=config.model, batch_split=2)   # a part, with fields changed

  Every field of either part reads as an attribute (`config.top_k`, `config.expert_axis`), and
  `dataclasses.replace(config, field=value)` changes any of them.

  Attributes:
    model: sizes, routing and the load-balancing loss (`MoEModel`).
    run: mesh axes, exchange, buffers, chunks, kernels, tiles, numerics (`MoERun`).
  """

  model: MoEModel
  run: MoERun

  def __init__(self, *, model: MoEModel | None = None, run: MoERun | None = None, **fields):
    unknown = sorted(set(fields) - set(MODEL_FIELDS) - set(RUN_FIELDS))
    if unknown:
      close = {k: difflib.get_close_matches(k, MODEL_FIELDS + RUN_FIELDS, n=1) for k in unknown}
      hints = "; ".join(
        f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items()
      )
      raise TypeError(
        f"MoEConfig got unknown fields {hints}. MaxText and Hugging Face names are read by "
        "MoEConfig.from_dict."
      )
    model = _part(MoEModel, model, {k: v for k, v in fields.items() if k in MODEL_FIELDS})
    run = _part(MoERun, run, {k: v for k, v in fields.items() if k in RUN_FIELDS})
    if run.expert_placement is not None:
      placement = check_expert_placement(run.expert_placement, num_experts=model.num_experts)
      run = dataclasses.replace(run, expert_placement=placement)
    object.__setattr__(self, "model", model)
    object.__setattr__(self, "run", run)

  def __getattr__(self, name: str):
    # NOTE: only reached when normal lookup fails; `model` / `run` themselves are instance
    # attributes (guarded against recursion while unpickling, before they are set).
    if name.startswith("__") or name in ("model", "run"):
      raise AttributeError(name)
    for part in (self.model, self.run):
      if hasattr(type(part), name) or name in part.__dataclass_fields__:
        return getattr(part, name)
    raise AttributeError(f"MoEConfig has no attribute {name!r}.")

  def as_dict(self) -> dict[str, Any]:
    """Every field of both parts by name: `MoEConfig(**config.as_dict()) == config`."""
    return {name: getattr(self, name) for name in MODEL_FIELDS + RUN_FIELDS}

  @classmethod
  def from_dict(
    cls, d: Mapping[str, Any], *, ignore_unknown: bool = False, honour_tiling: bool = False
  ) -> MoEConfig:
    """Builds a config from our field names, MaxText names or Hugging Face names.

    A Hugging Face `config.json` is read by its `model_type` (see `HF_MODEL_TYPES`): each
    family's keys mean what that family's transformers code does with them (Mixtral's
    `intermediate_size` is the expert width, Qwen's and DeepSeek's the dense MLP's), settings
    its code hard-wires are implied (Mixtral renormalises the top-k weights, DeepSeek-V3 routes
    with noaux_tc on sigmoid scores, Qwen2-MoE gates its shared expert), and its whole-model
    keys (attention, rope, which layers are MoE) are accepted and skipped. Keys that would
    change the MoE layer in a way this layer does not implement raise, naming the key.

    Args:
      d: the mapping, e.g. a MaxText model yaml plus flags, or a HF `config.json`.
      ignore_unknown: skip keys that are neither fields, aliases nor `IGNORED_KEYS` (nor the
        keys of the dict's `model_type`) (default: raise, naming the closest valid key).
      honour_tiling: set `wi_tiling` / `wo_tiling` from MaxText's 18 `wi_tile_*` / `wo_tile_*`
        keys. By default they are checked and not used: they are megablox's tiles (base.yml
        sets all 18), and at tk < k they force the visit-schedule kernels where pallas_moe's
        own choice per chip and call runs the row-tile kernels (`pallas_moe.maxtext`).

    Returns:
      The `MoEConfig`.
    """
    family = _hf_family(d, ignore_unknown=ignore_unknown)
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    tiles: dict[str, int] = {}

    def put(field: str, value, key: str) -> None:
      if field in values and values[field] != value:
        raise ValueError(
          f"MoEConfig.from_dict: {_shown(source[field], d, field, values[field])} and "
          f"{_shown(key, d, field, value)} both set {field!r} to different values; drop one of "
          "them."
        )
      values[field] = value
      source[field] = key

    if family is not None:
      for field, value in family.fixed.items():
        put(field, value, "model_type")
    # NOTE: MaxText reads batch_split_factor only when use_batch_split_schedule is true.
    split_off = "use_batch_split_schedule" in d and not d["use_batch_split_schedule"]
    for field, value in maxtext_keys.mesh_fields(d).items():
      put(field, value, "ici_*/dcn_*_parallelism")
    for key, raw in d.items():
      if key in IGNORED_KEYS or key in maxtext_keys.MESH_KEYS:
        continue
      if split_off and key == "batch_split_factor":
        continue
      if key == "seq_aux":
        continue  # NOTE: picks the aux-loss definition of aux_loss_alpha (below).
      if family is not None and key in family.keys:
        check = family.checks.get(key)
        if check is not None:
          check(raw)
        continue
      if key in maxtext_keys.TILE_KEYS:
        if isinstance(raw, bool) or not isinstance(raw, (int, np.integer)) or raw <= 0:
          raise ValueError(
            f"MoEConfig.from_dict: {key!r}={raw!r} must be a positive int (a MaxText tile size)."
          )
        tiles[key] = int(raw)
        continue
      if family is not None and key in family.aliases:
        field, convert = family.aliases[key]
      elif key in _FIELDS:
        field, convert = key, _FIELD_CONVERT.get(key, keys.same)
      elif key in _ALIASES:
        field, convert = _ALIASES[key]
      elif ignore_unknown:
        continue
      elif key in _FAMILY_ONLY_KEYS and family is None:
        raise ValueError(
          f"MoEConfig.from_dict: {key!r} is a key of Hugging Face {_FAMILY_ONLY_KEYS[key]} "
          "config.json files and its meaning depends on the family; the dict has no "
          f"'model_type' to say which: add it (one of {sorted(hf_keys.HF_MODEL_TYPES)})."
        )
      elif key in _FAMILY_ONLY_KEYS:
        raise ValueError(
          f"MoEConfig.from_dict: {key!r} is not a key of model_type {family.name!r} configs "
          f"(it is one of {_FAMILY_ONLY_KEYS[key]}); drop it or fix 'model_type'."
        )
      else:
        raise ValueError(_unknown_key_message(key))
      try:
        value = convert(raw)
      except TypeError as e:
        why = "the config leaves it unset; set it" if raw is None else str(e)
        raise ValueError(f"MoEConfig.from_dict: {key!r}={raw!r} is not valid: {why}.") from None
      if value is None:
        continue  # NOTE: the ecosystem's "unset" value (e.g. capacity_factor=-1), or a check.
      put(field, value, key)
    if family is not None:
      for field, value in family.defaults.items():
        values.setdefault(field, value)
      if family.post is not None:
        family.post(values, put)
    if source.get("weight_quantization") == "quantization":
      # NOTE: MaxText's one key sets both modes; an explicit activation_quantization must agree.
      act = maxtext_keys.MAXTEXT_QUANTIZATION[d["quantization"]][1]
      # NOTE: read from the dict, not `values`: an explicit None there sets nothing.
      if "activation_quantization" in d and d["activation_quantization"] != act:
        raise ValueError(
          f"MoEConfig.from_dict: 'quantization'={d['quantization']!r} means "
          f"activation_quantization={act!r} but 'activation_quantization'="
          f"{d['activation_quantization']!r}; drop one of them."
        )
      values["activation_quantization"] = act
    if "routed_bias" in d and not d["routed_bias"] and values.get("topk_method") == "noaux_tc":
      raise ValueError(
        f"MoEConfig.from_dict: 'routed_bias'=False but {source['topk_method']!r}='noaux_tc' "
        "(which needs the correction bias); drop one of them."
      )
    if "routed_score_func" in d:
      # NOTE: MaxText's DeepSeek gate normalises the chosen weights iff the scores are sigmoid
      # (its deepseek_scale_weights; it has no norm_topk_prob of its own for DeepSeek), so a
      # MaxText DeepSeek-V3 config means norm_topk_prob=True, as HF's config.json says.
      values["norm_topk_prob"] = bool(values.get("norm_topk_prob")) or (
        values.get("score_func") == "sigmoid"
      )
    # NOTE: each framework's coefficient multiplies its own loss; a zero coefficient (MaxText's
    # base.yml default) sets nothing.
    for key, definition in _aux_loss_definitions(d).items():
      put("aux_loss_definition", definition, key)
    if not isinstance(honour_tiling, bool):
      raise TypeError(
        f"MoEConfig.from_dict: `honour_tiling` must be a bool, got {honour_tiling!r}."
      )
    for proj in ("wi", "wo") if honour_tiling else ():
      tiling = maxtext_keys.tiling_from_maxtext(tiles, proj=proj)
      if tiling is not None:
        field = f"{proj}_tiling"
        if field in values and values[field] != tiling:
          raise ValueError(
            f"MoEConfig.from_dict: {field!r} and the {proj}_tile_* keys disagree; drop one."
          )
        values[field] = tiling
    missing = [f for f in ("num_experts", "top_k", "d_model", "expert_ffn_dim") if f not in values]
    if missing:
      hints = {f: [k for k, (t, _) in _ALIASES.items() if t == f] for f in missing}
      if "expert_ffn_dim" in hints:
        hints["expert_ffn_dim"].append("intermediate_size (model_type 'mixtral')")
      raise ValueError(f"MoEConfig.from_dict: missing {missing}; accepted names: {hints}.")
    return cls(**values)


def _part(cls, part, fields: dict[str, Any]):
  """`cls(**fields)`, or `part` with `fields` replaced; type-checked."""
  if part is None:
    return cls(**fields)
  if not isinstance(part, cls):
    raise TypeError(f"MoEConfig: expected a {cls.__name__}, got {type(part).__name__}.")
  return dataclasses.replace(part, **fields) if fields else part


def _placement_tuple(placement) -> tuple:
  """An expert placement as a tuple (the permutation is checked by `check_expert_placement`)."""
  if isinstance(placement, (str, bytes, Mapping)) or not hasattr(placement, "__len__"):
    raise ValueError(
      f"MoEConfig.expert_placement must be a sequence of ints, got {placement!r}; give a "
      "permutation of range(num_experts) or None."
    )
  items = placement.tolist() if hasattr(placement, "tolist") else placement
  return tuple(int(v) if isinstance(v, np.integer) else v for v in items)


def check_expert_placement(placement, *, num_experts: int) -> tuple[int, ...]:
  """Checks an expert placement (see `MoEConfig.expert_placement`) and returns it as a tuple.

  Args:
    placement: a sequence or 1-D integer array: slot j holds global expert placement[j].
    num_experts: E; the placement must be a permutation of range(E).

  Returns:
    The placement as a tuple of Python ints.

  Raises:
    ValueError: not a 1-D sequence of ints, wrong length, or not a permutation (names the
      missing and repeated experts).
  """
  fix = (
    f"give a permutation of range({num_experts}) (e.g. bench.ep.topology_aware_placement's "
    "order) or None"
  )
  if isinstance(placement, (str, bytes, Mapping)) or not hasattr(placement, "__len__"):
    raise ValueError(
      f"MoEConfig.expert_placement must be a sequence of ints, got {placement!r}; {fix}."
    )
  items = list(placement.tolist() if hasattr(placement, "tolist") else placement)
  bad = [v for v in items if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
  if bad:
    raise ValueError(
      f"MoEConfig.expert_placement must hold ints (expert ids), got {bad[0]!r}; {fix}."
    )
  if len(items) != num_experts:
    raise ValueError(
      f"MoEConfig.expert_placement has {len(items)} entries, num_experts is {num_experts}; {fix}."
    )
  got = [int(v) for v in items]
  if sorted(got) != list(range(num_experts)):
    missing = sorted(set(range(num_experts)) - set(got))
    repeated = sorted({v for v in got if got.count(v) > 1 or not 0 <= v < num_experts})
    raise ValueError(
      f"MoEConfig.expert_placement is not a permutation of range({num_experts}): missing "
      f"{missing}, repeated or out of range {repeated}; {fix}."
    )
  return tuple(got)


MESH_ROLES = maxtext_keys.MESH_ROLES


def _check_axes(run: MoERun) -> None:
  """Axis names distinct, sizes None / -1 / positive, sizes > 1 only on axes that exist."""
  if not isinstance(run.expert_axis, str):
    raise ValueError(f"MoEConfig.expert_axis must be a mesh axis name, got {run.expert_axis!r}.")
  names = {}
  for role in MESH_ROLES:
    axis = getattr(run, f"{role}_axis")
    if axis is not None and not isinstance(axis, str):
      raise ValueError(f"MoEConfig.{role}_axis must be a mesh axis name or None, got {axis!r}.")
    if axis is not None and axis in names:
      raise ValueError(
        f"MoEConfig.{names[axis]}_axis and {role}_axis must differ, both are {axis!r}."
      )
    if axis is not None:
      names[axis] = role
    size = getattr(run, f"{role}_parallelism")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
      raise ValueError(
        f"MoEConfig.{role}_parallelism must be None, -1 or a positive int, got {size!r}."
      )
    if size is not None and size != -1 and size < 1:
      raise ValueError(
        f"MoEConfig.{role}_parallelism must be None, -1 or a positive int, got {size!r}."
      )
    if axis is None and size not in (None, 1):
      raise ValueError(
        f"MoEConfig.{role}_parallelism={size} needs a {role} axis: set {role}_axis (MaxText "
        f"names it {role!r})."
      )
  dcn = run.dcn_parallelism
  if isinstance(dcn, Mapping):
    dcn = tuple(dcn.items())
  try:
    dcn = tuple(sorted((str(r), int(v)) for r, v in dcn if int(v) != 1))
  except (TypeError, ValueError):
    raise ValueError(
      f"MoEConfig.dcn_parallelism must be pairs (role, size) or a dict, got "
      f"{run.dcn_parallelism!r}."
    ) from None
  for role, size in dcn:
    if role not in MESH_ROLES:
      raise ValueError(f"MoEConfig.dcn_parallelism names {role!r}; roles are {MESH_ROLES}.")
    if size != -1 and size < 1:
      raise ValueError(f"MoEConfig.dcn_parallelism[{role!r}]={size} must be -1 or positive.")
    if getattr(run, f"{role}_axis") is None:
      raise ValueError(
        f"MoEConfig.dcn_parallelism spans slices over {role!r}, which has no axis: set {role}_axis."
      )
  object.__setattr__(run, "dcn_parallelism", dcn)


def _check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"MoEConfig.{name} must be one of {choices}, got {value!r}.")


_FIELDS = frozenset(MODEL_FIELDS + RUN_FIELDS)

# alias -> (field, value conversion), MaxText's then Hugging Face's (`maxtext_keys`, `hf_keys`).
_ALIASES: dict[str, tuple[str, keys.Conversion]] = {
  **maxtext_keys.ALIASES,
  **hf_keys.ALIASES,
  **keys.COMMON_ALIASES,
}
# Keys of MaxText model configs and HF config.json files that are about other layers or about
# training, not the MoE block. Skipped by from_dict.
IGNORED_KEYS = keys.COMMON_IGNORED_KEYS | maxtext_keys.IGNORED_KEYS | hf_keys.IGNORED_KEYS
# Field names whose value still needs a conversion (transformers 5 writes `dtype`, maybe null).
_FIELD_CONVERT: dict[str, keys.Conversion] = {"dtype": keys.optional_dtype_name}

# Keys some family knows but whose meaning depends on it: without `model_type` they raise.
_FAMILY_ONLY_KEYS: dict[str, list[str]] = {}
for _f in hf_keys.HF_MODEL_TYPES.values():
  for _k in sorted(_f.keys | set(_f.aliases)):
    if _k not in _ALIASES and _k not in _FIELDS:
      _FAMILY_ONLY_KEYS.setdefault(_k, []).append(_f.name)


def _hf_family(d: Mapping[str, Any], *, ignore_unknown: bool) -> hf_keys.HFFamily | None:
  if "model_type" not in d:
    return None
  family = hf_keys.HF_MODEL_TYPES.get(d["model_type"])
  if family is None and not ignore_unknown:
    raise ValueError(
      f"MoEConfig.from_dict: model_type={d['model_type']!r} is not a family this layer "
      f"reads; supported: {sorted(hf_keys.HF_MODEL_TYPES)} (ignore_unknown=True reads the generic "
      "names only)."
    )
  return family


def _aux_loss_definitions(d: Mapping[str, Any]) -> dict[str, str]:
  """The `aux_loss_definition` each nonzero framework coefficient in `d` means (key -> value)."""
  out = {}
  if d.get("router_aux_loss_coef"):
    out["router_aux_loss_coef"] = "hf"
  if d.get("aux_loss_alpha"):
    # NOTE: DeepSeek's configuration_deepseek.py defaults seq_aux to true.
    out["aux_loss_alpha"] = "sequence" if d.get("seq_aux", True) else "switch"
  if d.get("load_balance_loss_weight"):
    scored = bool(d.get("routed_score_func"))
    out["load_balance_loss_weight"] = "maxtext_scored" if scored else "sequence"
  return out


def _shown(key: str, d: Mapping[str, Any], field: str, value) -> str:
  """How a conflict message names the key that set a field."""
  if key == "model_type":
    return f"'model_type'={d['model_type']!r} (which means {field}={value!r})"
  if key in d and d[key] == value:
    return f"{key!r}={value!r}"
  return f"{key!r} (which means {field}={value!r})"


def _unknown_key_message(key: str) -> str:
  valid = sorted(_FIELDS | set(_ALIASES) | maxtext_keys.TILE_KEYS | maxtext_keys.MESH_KEYS)
  close = difflib.get_close_matches(key, valid + sorted(IGNORED_KEYS), n=1, cutoff=0.6)
  hint = f" Did you mean {close[0]!r}?" if close else ""
  return (
    f"MoEConfig.from_dict: unknown key {key!r}.{hint} Pass ignore_unknown=True to skip keys "
    "this layer does not know."
  )
