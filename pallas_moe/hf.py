"""Hugging Face MoE weights to and from the `moe.init_params` layout (numpy, no torch needed).

Families (HF `model_type`): "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3".
Names are relative to the MoE block's prefix, e.g. "model.layers.3.mlp." (Mixtral checkpoints
name the block "model.layers.3.block_sparse_moe."; transformers >= 5 renames it to ".mlp." when
it loads them). Torch Linear weights are [out, in]:

  ours                        Hugging Face
  router [d, E]               gate.weight [E, d]
  wi [E, d, 2f]               experts.gate_up_proj [E, 2f, d] (fused, transformers >= 5 in
                              memory: gate rows then up rows), or per expert
                              experts.{i}.gate_proj.weight and experts.{i}.up_proj.weight [f, d]
                              (Mixtral: experts.{i}.w1.weight and experts.{i}.w3.weight)
  wo [E, f, d]                experts.down_proj [E, d, f] (fused), or
                              experts.{i}.down_proj.weight [d, f] (Mixtral: experts.{i}.w2.weight)
  shared_wi [d, 2s]           shared_experts.{gate_proj,up_proj}.weight [s, d] (DeepSeek), or
                              shared_expert.{gate_proj,up_proj}.weight (Qwen2-MoE)
  shared_wo [s, d]            shared_experts.down_proj.weight [d, s] (Qwen2-MoE: shared_expert.)
  shared_gate [d, 1]          shared_expert_gate.weight [1, d] (Qwen2-MoE)
  e_score_correction_bias [E] gate.e_score_correction_bias [E] (DeepSeek-V3)

Checkpoint files (and transformers < 5) hold the per-expert form; transformers 5 fuses the
experts when it loads a model (its `conversion_mapping.py`) and writes them back per expert when
it saves. `from_hf` reads either; `to_hf` writes either (`fused=`).

DeepSeek-V3's checkpoint files store each expert's three weights (and the shared experts') as
float8_e4m3fn, each beside a `<module>.weight_scale_inv` [ceil(rows/128), ceil(cols/128)] f32: one
scale per 128 x 128 block, which multiplies (w ~= weight * scale_inv over each block). `from_hf`
keeps the routed experts in fp8 as `quant.BlockQuantizedWeights` (the same layout moves applied to
the values and to the scales; nothing is widened), or widens them (`quantized_experts=`); `to_hf`
writes such params back as fp8 weights and their scales. Only the per-expert form of checkpoint
files is read this way, not transformers' in-memory fused fp8 experts.

Only the names and layouts are converted here; the routing semantics (softmax or sigmoid,
norm_topk_prob, DeepSeek's grouped methods, routed_scaling_factor) come from the `MoEConfig`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from pallas_moe.common import host_value
from pallas_moe.config import MoEConfig
from pallas_moe.moe import EXPERT_KEYS, place_experts
from pallas_moe.quant import BLOCK, BlockQuantizedWeights, check_block_quantized, is_quantized_dtype
from pallas_moe.routing import BIAS_KEY

__all__ = ["FAMILIES", "QUANTIZED_EXPERTS", "from_hf", "to_hf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Family:
  """How one HF family names its MoE block's weights (relative to the block's prefix)."""

  experts: tuple[str, str, str]  # per-expert gate, up, down module names
  shared: str | None  # the shared MLP's module name; None: the family has no shared experts
  shared_gate: bool  # Qwen2-MoE's `shared_expert_gate`
  bias: bool  # DeepSeek-V3's `gate.e_score_correction_bias`


_PROJ = ("gate_proj", "up_proj", "down_proj")
FAMILIES: dict[str, _Family] = {
  "mixtral": _Family(experts=("w1", "w3", "w2"), shared=None, shared_gate=False, bias=False),
  "qwen2_moe": _Family(experts=_PROJ, shared="shared_expert", shared_gate=True, bias=False),
  "qwen3_moe": _Family(experts=_PROJ, shared=None, shared_gate=False, bias=False),
  "deepseek_v2": _Family(experts=_PROJ, shared="shared_experts", shared_gate=False, bias=False),
  "deepseek_v3": _Family(experts=_PROJ, shared="shared_experts", shared_gate=False, bias=True),
}

_ROUTER = "gate.weight"
_BIAS = f"gate.{BIAS_KEY}"
_FUSED_WI = "experts.gate_up_proj"
_FUSED_WO = "experts.down_proj"
_SHARED_GATE = "shared_expert_gate.weight"
# A block-quantized weight `<module>.weight`'s scales are `<module>.weight_scale_inv`.
_SCALE = "_scale_inv"
# NOTE: transformers' fused fp8 experts name theirs `experts.gate_up_proj_scales_inv` (not read).
_SCALE_SUFFIXES = ("_scale_inv", "_scales_inv")
# `from_hf(quantized_experts=)`: keep block-quantized routed experts as stored, or widen them.
QUANTIZED_EXPERTS = ("keep", "dequantize")


def from_hf(
  state_dict: Mapping[str, Any],
  config: MoEConfig,
  *,
  prefix: str = "",
  family: str | None = None,
  quantized_experts: str = "keep",
) -> dict[str, Any]:
  """One MoE block's params from a Hugging Face state dict.

  Args:
    state_dict: name -> array (numpy, a jax.Array, or anything `np.asarray` takes; for torch
      tensors pass e.g. `{k: v.float().numpy() for k, v in model.state_dict().items()}`, and
      float8 tensors as `v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)`, since
      torch has no numpy float8). Keys outside `prefix` are ignored, so a whole model's dict
      works. A jax.Array sharded over several processes' devices is gathered (a collective: call
      `from_hf` on every process).
    config: the block's config; it decides which weights must be there (shared experts,
      `shared_expert_gate`, the DeepSeek-V3 bias) and their shapes.
    prefix: the block's prefix, e.g. "model.layers.3.mlp." (a missing final "." is added).
    family: one of `FAMILIES`, to accept only that family's names; None: the names found decide
      (Mixtral's w1/w2/w3 or gate_proj/up_proj/down_proj, Qwen2-MoE's `shared_expert` or
      DeepSeek's `shared_experts`).
    quantized_experts: what to do with block-quantized routed experts (float8_e4m3fn or int8
      `weight`s with their `weight_scale_inv`, as DeepSeek-V3's checkpoint files hold them, per
      expert): "keep" returns `wi`/`wo` as `BlockQuantizedWeights` whose values are the stored
      fp8 bytes, transposed and concatenated (needs d_model and expert_ffn_dim multiples of
      128); "dequantize" returns them as `config.weight_dtype` arrays, `weight * scale_inv`
      computed in f32 (for training, or for other dims). Float checkpoints read the same either
      way. Other block-quantized weights (DeepSeek-V3's shared experts) are small and dense:
      always dequantized to `config.weight_dtype`.

  Returns:
    `init_params`-layout numpy arrays in `config.weight_dtype` (the correction bias in f32), and
    with quantized_experts="keep" on a block-quantized checkpoint `wi` [E, d, 2f] (scales
    [E, d/128, 2f/128], the gate's blocks then the up's) and `wo` [E, f, d] (scales
    [E, f/128, d/128]) as `BlockQuantizedWeights` of numpy arrays; with
    `config.expert_placement`, `wi`/`wo` are in slot order (`moe.place_experts`).

  Raises:
    ValueError: a weight the config needs is missing, a name under `prefix` is not one of this
      block's, a shape does not match the config, a quantized weight lacks its scales (or they
      are misshapen), or the dims do not fit "keep"; the message names the key.
  """
  if quantized_experts not in QUANTIZED_EXPERTS:
    raise ValueError(
      f"from_hf: quantized_experts={quantized_experts!r} is not one of {QUANTIZED_EXPERTS}."
    )
  prefix = _norm_prefix(prefix)
  block = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
  if not block:
    near = sorted({k.rsplit(".experts.", 1)[0] + "." for k in state_dict if ".experts." in k})
    hint = f" MoE blocks found: {near[:4]}{' ...' if len(near) > 4 else ''}." if near else ""
    raise ValueError(f"from_hf: no key starts with prefix={prefix!r}.{hint}")
  fam = _family_for(block, config, family=family, prefix=prefix)
  _check_family(config, fam, family=family)
  fused = _FUSED_WI in block or _FUSED_WO in block
  names = _hf_names(config, fam, fused=fused)
  missing = [n for n in names if n not in block]
  if missing:
    raise ValueError(
      f"from_hf: missing {_list(prefix, missing)} for this config "
      f"({_layout(fused)} expert layout).{_missing_hint(missing)}"
    )
  scaled = [n for n in names if n + _SCALE in block]
  if fused and any(k.startswith("experts.") and k.endswith(_SCALE_SUFFIXES) for k in block):
    raise ValueError(
      f"from_hf: expert block scales under prefix={prefix!r} are read with the per-expert "
      "layout of checkpoint files (experts.{i}.gate_proj.weight_scale_inv), not with the fused "
      "experts.gate_up_proj; pass the checkpoint's tensors."
    )
  unexpected = [n for n in block if n not in names and n not in {m + _SCALE for m in scaled}]
  if unexpected:
    raise ValueError(
      f"from_hf: unexpected {_list(prefix, unexpected)} under prefix={prefix!r}."
      f"{_unexpected_hint(unexpected, config, fused=fused)}"
    )
  arrays = {n: host_value(block[n]) for n in names}
  want = _hf_shapes(config, fam, fused=fused)
  for n, a in arrays.items():
    if a.shape != want[n]:
      raise ValueError(
        f"from_hf: {prefix + n!r} has shape {a.shape}, the config needs {want[n]} "
        f"({_dims(config)})."
      )
  scales = _read_scales(block, arrays, prefix=prefix)
  experts = [] if fused else _expert_names(config, fam)
  keep = quantized_experts == "keep" and any(n in scales for n in experts)
  if keep:
    _check_keep(config, experts, scales, arrays, prefix=prefix)
  # NOTE: widened here: every block-quantized weight but the kept experts (f32, then cast below).
  kept = set(experts) if keep else set()
  arrays = {
    n: _dequantize(a, scales[n]) if n in scales and n not in kept else a for n, a in arrays.items()
  }
  params = _to_ours(arrays, config, fam, fused=fused)
  dt = config.param_dtype
  params = {
    k: v if keep and k in EXPERT_KEYS else v.astype(np.float32 if k == BIAS_KEY else dt)
    for k, v in params.items()
  }
  if keep:
    blocks = _experts_to_ours({n: scales[n] for n in experts}, config, fam)
    for k, s in zip(EXPERT_KEYS, blocks, strict=True):
      v, s = np.ascontiguousarray(params[k]), np.ascontiguousarray(s)
      params[k] = BlockQuantizedWeights(values=v, scales=s, block=BLOCK)
  return _place(params, config.expert_placement)


def to_hf(
  params: Mapping[str, Any],
  config: MoEConfig,
  *,
  family: str,
  prefix: str = "",
  fused: bool = False,
) -> dict[str, np.ndarray]:
  """The inverse of `from_hf`: one MoE block's params as Hugging Face names and layouts.

  Also converts anything shaped like the params, e.g. their gradients. `wi`/`wo` given as
  `BlockQuantizedWeights` (as `from_hf` keeps DeepSeek-V3's fp8 experts) are written as each
  expert's quantized `weight`s and their `weight_scale_inv` blocks, bit for bit (per expert only).

  Args:
    params: `init_params`-layout arrays (global shapes; `wi`/`wo` in slot order under
      `config.expert_placement`, which is undone). jax.Arrays sharded over several processes'
      devices are gathered to every process (a collective: call `to_hf` on every process).
    config: the block's config.
    family: one of `FAMILIES` (the names to write).
    prefix: the block's prefix, e.g. "model.layers.3.mlp." (a missing final "." is added).
    fused: write transformers >= 5's fused `experts.gate_up_proj` / `experts.down_proj`; default:
      one weight per expert, as checkpoint files hold them.

  Returns:
    name -> numpy array, in the params' dtypes.

  Raises:
    ValueError: unknown family, a family the config does not fit, or params whose keys or
      shapes do not match the config (naming the key).
  """
  if family not in FAMILIES:
    raise ValueError(f"to_hf: family={family!r} is not one of {sorted(FAMILIES)}.")
  prefix = _norm_prefix(prefix)
  fam = FAMILIES[family]
  _check_family(config, fam, family=family)
  want = _our_shapes(config)
  missing = [k for k in want if k not in params]
  unexpected = [k for k in params if k not in want]
  if missing or unexpected:
    raise ValueError(
      f"to_hf: params for this config have keys {sorted(want)}; missing {missing}, "
      f"unexpected {unexpected}."
    )
  ours = {k: _host(params[k], fused=fused) for k in want}
  for k, a in ours.items():
    if a.shape != want[k]:
      raise ValueError(
        f"to_hf: params[{k!r}] has shape {a.shape}, the config needs {want[k]} "
        f"({_dims(config)}); pass global (unsharded) arrays."
      )
  ours = _place(ours, config.expert_placement, undo=True)
  return {prefix + n: v for n, v in _to_hf(ours, config, fam, fused=fused).items()}


def _host(x: Any, *, fused: bool) -> Any:
  """A param on the host: numpy, or a `BlockQuantizedWeights` of numpy arrays."""
  if not isinstance(x, BlockQuantizedWeights):
    return host_value(x)
  check_block_quantized(x)
  if fused:
    raise ValueError(
      "to_hf: block-quantized wi/wo (BlockQuantizedWeights) are written per expert, as "
      "checkpoint files hold them (`weight` and `weight_scale_inv`); pass fused=False, or "
      "quant.dequantize_blocks them first."
    )
  return BlockQuantizedWeights(
    values=host_value(x.values), scales=host_value(x.scales), block=x.block
  )


def _place(params: dict, placement, *, undo: bool = False) -> dict:
  """`moe.place_experts`, also for `BlockQuantizedWeights` (values and scales alike)."""
  blocks = {k: v for k, v in params.items() if isinstance(v, BlockQuantizedWeights)}
  values = params | {k: v.values for k, v in blocks.items()}
  out = place_experts(values, placement=placement, undo=undo)
  scales = place_experts({k: v.scales for k, v in blocks.items()}, placement=placement, undo=undo)
  for k, v in blocks.items():
    out[k] = BlockQuantizedWeights(values=out[k], scales=scales[k], block=v.block)
  return out


# --- layouts --------------------------------------------------------------------------------------


def _t(w: np.ndarray) -> np.ndarray:
  return np.swapaxes(w, -1, -2)


def _to_ours(a: dict[str, np.ndarray], config: MoEConfig, fam: _Family, *, fused: bool):
  out = {"router": _t(a[_ROUTER])}
  if fused:
    # NOTE: gate_up_proj [E, 2f, d] holds the gate rows then the up rows (transformers'
    # `chunk(2, dim=-1)` of its output), which transposes to our gate columns then up columns.
    out["wi"] = _t(a[_FUSED_WI])
    out["wo"] = _t(a[_FUSED_WO])
  else:
    out["wi"], out["wo"] = _experts_to_ours(a, config, fam)
  if config.shared_width:
    s = fam.shared
    out["shared_wi"] = np.concatenate(
      [_t(a[f"{s}.gate_proj.weight"]), _t(a[f"{s}.up_proj.weight"])], axis=-1
    )
    out["shared_wo"] = _t(a[f"{s}.down_proj.weight"])
  if config.shared_expert_gate:
    out["shared_gate"] = _t(a[_SHARED_GATE])
  if config.has_routed_bias:
    out[BIAS_KEY] = a[_BIAS]
  return out


def _experts_to_ours(a: dict[str, np.ndarray], config: MoEConfig, fam: _Family):
  """Per-expert [out, in] weights (or their block scales, under the weights' names) stacked and
  transposed to wi [E, in, 2 out] (gate then up) and wo [E, in, out]; no dtype conversion."""
  e = config.num_experts
  g, u, dn = fam.experts
  gates = np.stack([a[f"experts.{i}.{g}.weight"] for i in range(e)])
  ups = np.stack([a[f"experts.{i}.{u}.weight"] for i in range(e)])
  wi = np.concatenate([_t(gates), _t(ups)], axis=-1)
  return wi, _t(np.stack([a[f"experts.{i}.{dn}.weight"] for i in range(e)]))


def _experts_to_hf(wi: Any, wo: Any, config: MoEConfig, fam: _Family) -> dict[str, np.ndarray]:
  """The inverse of `_experts_to_ours`, and a `BlockQuantizedWeights`'s values and scales as
  `weight` and `weight_scale_inv` (its scale columns split like its value columns)."""
  t = lambda w: np.ascontiguousarray(_t(w))
  g, u, dn = fam.experts
  out = {}
  for i in range(config.num_experts):
    for w, names in ((wi, (g, u)), (wo, (dn,))):
      parts = [(w, "weight")]
      if isinstance(w, BlockQuantizedWeights):
        parts = [(w.values, "weight"), (w.scales, "weight" + _SCALE)]
      for a, suffix in parts:
        half = a.shape[-1] // 2
        cols = [a[i, :, :half], a[i, :, half:]] if len(names) == 2 else [a[i]]
        out |= {f"experts.{i}.{n}.{suffix}": t(c) for n, c in zip(names, cols, strict=True)}
  return out


def _to_hf(p: dict[str, np.ndarray], config: MoEConfig, fam: _Family, *, fused: bool):
  t = lambda w: np.ascontiguousarray(_t(w))
  out = {_ROUTER: t(p["router"])}
  if config.has_routed_bias:
    out[_BIAS] = p[BIAS_KEY]
  if fused:
    out[_FUSED_WI] = t(p["wi"])
    out[_FUSED_WO] = t(p["wo"])
  else:
    out |= _experts_to_hf(p["wi"], p["wo"], config, fam)
  if config.shared_width:
    s, w = fam.shared, config.shared_width
    out[f"{s}.gate_proj.weight"] = t(p["shared_wi"][:, :w])
    out[f"{s}.up_proj.weight"] = t(p["shared_wi"][:, w:])
    out[f"{s}.down_proj.weight"] = t(p["shared_wo"])
  if config.shared_expert_gate:
    out[_SHARED_GATE] = t(p["shared_gate"])
  return out


def _our_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
  d, e, f, s = config.d_model, config.num_experts, config.expert_ffn_dim, config.shared_width
  shapes = {"router": (d, e), "wi": (e, d, 2 * f), "wo": (e, f, d)}
  if s:
    shapes |= {"shared_wi": (d, 2 * s), "shared_wo": (s, d)}
  if config.shared_expert_gate:
    shapes["shared_gate"] = (d, 1)
  if config.has_routed_bias:
    shapes[BIAS_KEY] = (e,)
  return shapes


def _hf_shapes(config: MoEConfig, fam: _Family, *, fused: bool) -> dict[str, tuple[int, ...]]:
  d, e, f, s = config.d_model, config.num_experts, config.expert_ffn_dim, config.shared_width
  shapes = {_ROUTER: (e, d)}
  if config.has_routed_bias:
    shapes[_BIAS] = (e,)
  if fused:
    shapes |= {_FUSED_WI: (e, 2 * f, d), _FUSED_WO: (e, d, f)}
  else:
    g, u, dn = fam.experts
    for i in range(e):
      shapes |= {
        f"experts.{i}.{g}.weight": (f, d),
        f"experts.{i}.{u}.weight": (f, d),
        f"experts.{i}.{dn}.weight": (d, f),
      }
  if s:
    sh = fam.shared
    shapes |= {
      f"{sh}.gate_proj.weight": (s, d),
      f"{sh}.up_proj.weight": (s, d),
      f"{sh}.down_proj.weight": (d, s),
    }
  if config.shared_expert_gate:
    shapes[_SHARED_GATE] = (1, d)
  return shapes


def _hf_names(config: MoEConfig, fam: _Family, *, fused: bool) -> tuple[str, ...]:
  return tuple(_hf_shapes(config, fam, fused=fused))


def _expert_names(config: MoEConfig, fam: _Family) -> list[str]:
  """The routed experts' per-expert weight names."""
  return [f"experts.{i}.{m}.weight" for i in range(config.num_experts) for m in fam.experts]


# --- block-quantized weights (DeepSeek-V3's fp8 checkpoints) -------------------------------------


def _read_scales(
  block: Mapping[str, Any], arrays: dict[str, np.ndarray], *, prefix: str
) -> dict[str, np.ndarray]:
  """weight name -> its f32 block scales, for each quantized weight: checks that every
  float8/int8 weight has its `weight_scale_inv`, of the shape its 128 x 128 blocks need, and
  that no float weight has one."""
  scales = {}
  for n, a in arrays.items():
    quantized = is_quantized_dtype(a.dtype)
    if n + _SCALE not in block:
      if quantized:
        raise ValueError(
          f"from_hf: {prefix + n!r} is {a.dtype} but its block scales "
          f"{prefix + n + _SCALE!r} are missing; pass the checkpoint's weight_scale_inv tensors "
          "with its weights."
        )
      continue
    if not quantized:
      raise ValueError(
        f"from_hf: {prefix + n + _SCALE!r} is given but {prefix + n!r} is {a.dtype}, not "
        "float8_e4m3fn or int8; drop the scales of weights that are already dequantized."
      )
    s = host_value(block[n + _SCALE])
    rows, cols = a.shape[-2:]
    want = (*a.shape[:-2], -(-rows // BLOCK), -(-cols // BLOCK))
    if s.shape != want:
      raise ValueError(
        f"from_hf: {prefix + n + _SCALE!r} has shape {s.shape}; {prefix + n!r} of shape "
        f"{a.shape} needs {want} (one scale per {BLOCK} x {BLOCK} block)."
      )
    scales[n] = s.astype(np.float32)
  return scales


def _check_keep(
  config: MoEConfig,
  experts: list[str],
  scales: dict[str, np.ndarray],
  arrays: dict[str, np.ndarray],
  *,
  prefix: str,
) -> None:
  """Checks that the routed experts can stay block-quantized: all of them are, in one dtype,
  and their blocks tile wi and wo (d_model and expert_ffn_dim are multiples of 128)."""
  plain = [n for n in experts if n not in scales]
  if plain:
    raise ValueError(
      f"from_hf: {len(experts) - len(plain)} of the {len(experts)} routed expert weights are "
      f"block-quantized, but not {_list(prefix, plain, limit=3)}; quantized_experts='keep' needs "
      "all of them quantized: pass quantized_experts='dequantize' to read them all as floats."
    )
  dtypes = sorted({str(arrays[n].dtype) for n in experts})
  if len(dtypes) > 1:
    raise ValueError(
      f"from_hf: the routed expert weights under prefix={prefix!r} mix dtypes {dtypes}; "
      "quantized_experts='keep' needs one: pass quantized_experts='dequantize'."
    )
  d, f = config.d_model, config.expert_ffn_dim
  if d % BLOCK or f % BLOCK:
    raise ValueError(
      f"from_hf: quantized_experts='keep' needs d_model and expert_ffn_dim (moe_intermediate_size)"
      f" to be multiples of {BLOCK}, the scale block, so that the blocks tile wi [E, d, 2f] and "
      f"wo [E, f, d]; got d_model={d}, expert_ffn_dim={f}. Pass quantized_experts='dequantize' "
      f"to read the experts as {config.param_dtype} weights."
    )


def _dequantize(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """`values * scales`, each scale over its 128 x 128 block (the last blocks may be partial),
  in f32."""
  rows, cols = values.shape[-2:]
  s = np.repeat(np.repeat(scales, BLOCK, axis=-2), BLOCK, axis=-1)[..., :rows, :cols]
  return values.astype(np.float32) * s


# --- families and messages -----------------------------------------------------------------------


def _family_for(
  block: Mapping[str, Any], config: MoEConfig, *, family: str | None, prefix: str
) -> _Family:
  """The given family, or the names the block's keys use (families that differ only in what
  the config decides, e.g. Mixtral and Qwen3-MoE when fused, convert the same way)."""
  if family is not None:
    if family not in FAMILIES:
      raise ValueError(f"from_hf: family={family!r} is not one of {sorted(FAMILIES)} (or None).")
    return FAMILIES[family]
  mixtral_names = any(k.startswith("experts.") and k.endswith(".w1.weight") for k in block)
  qwen2_names = _SHARED_GATE in block or any(k.startswith("shared_expert.") for k in block)
  deepseek_names = any(k.startswith("shared_experts.") for k in block)
  if qwen2_names and deepseek_names:
    raise ValueError(
      f"from_hf: under prefix={prefix!r} there are both Qwen2-MoE 'shared_expert.*' and DeepSeek "
      "'shared_experts.*' weights; give the block's own prefix, or family=."
    )
  experts = FAMILIES["mixtral"].experts if mixtral_names else _PROJ
  shared = "shared_expert" if qwen2_names else "shared_experts" if deepseek_names else None
  if shared is None and config.shared_width:
    # NOTE: none found, so they will be reported missing: under the name the config suggests.
    shared = "shared_expert" if config.shared_expert_gate else "shared_experts"
  # NOTE: whether the gate and the bias are expected is the config's call (`_hf_shapes`).
  return _Family(experts=experts, shared=shared, shared_gate=qwen2_names, bias=False)


def _check_family(config: MoEConfig, fam: _Family, *, family: str | None) -> None:
  """A named family's fixed structure against the config (with family=None: nothing to check)."""
  if family is None:
    return
  has_shared = config.shared_width > 0
  if has_shared != (fam.shared is not None):
    raise ValueError(
      f"{family!r} blocks {'have' if fam.shared else 'have no'} shared experts, but the config has "
      f"num_shared_experts={config.num_shared_experts}; fix the config or the family."
    )
  if config.shared_expert_gate != fam.shared_gate:
    raise ValueError(
      f"{family!r} blocks {'gate' if fam.shared_gate else 'do not gate'} their shared expert "
      f"(shared_expert_gate), but the config has shared_expert_gate={config.shared_expert_gate}."
    )
  if config.has_routed_bias != fam.bias:
    raise ValueError(
      f"{family!r} blocks {'have' if fam.bias else 'have no'} the correction bias "
      f"{_BIAS!r}, but the config has topk_method={config.topk_method!r} "
      f"({'noaux_tc' if fam.bias else 'not noaux_tc'} expected)."
    )


def _norm_prefix(prefix: str) -> str:
  if not isinstance(prefix, str):
    raise TypeError(f"prefix must be a str such as 'model.layers.3.mlp.', got {prefix!r}.")
  return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _layout(fused: bool) -> str:
  return "fused (experts.gate_up_proj)" if fused else "per-expert (experts.{i}.*)"


def _list(prefix: str, names: list[str], limit: int = 6) -> str:
  shown = ", ".join(repr(prefix + n) for n in names[:limit])
  more = f" and {len(names) - limit} more" if len(names) > limit else ""
  return f"{len(names)} key(s): {shown}{more}"


def _dims(config: MoEConfig) -> str:
  return (
    f"d_model={config.d_model}, num_experts={config.num_experts}, "
    f"expert_ffn_dim={config.expert_ffn_dim}, shared width={config.shared_width}"
  )


def _missing_hint(missing: list[str]) -> str:
  if _BIAS in missing:
    return " The config's topk_method='noaux_tc' needs DeepSeek-V3's correction bias."
  if _SHARED_GATE in missing:
    return " The config's shared_expert_gate=True needs Qwen2-MoE's shared_expert_gate.weight."
  if any(n.startswith("shared_") for n in missing):
    return " The config has shared experts (num_shared_experts > 0)."
  return ""


def _unexpected_hint(unexpected: list[str], config: MoEConfig, *, fused: bool) -> str:
  if _BIAS in unexpected:
    return " A correction bias needs topk_method='noaux_tc' (DeepSeek-V3) in the config."
  if _SHARED_GATE in unexpected:
    return " Qwen2-MoE's gate needs shared_expert_gate=True in the config."
  if any(n.startswith("shared_expert") for n in unexpected) and not config.shared_width:
    return " Shared-expert weights need num_shared_experts > 0 in the config."
  if any(n.startswith("experts.") for n in unexpected):
    return (
      f" Expected the {_layout(fused)} expert layout for num_experts={config.num_experts}, "
      "not a mix of layouts or more experts."
    )
  return " Is the prefix the MoE block's own (e.g. 'model.layers.3.mlp.')?"
