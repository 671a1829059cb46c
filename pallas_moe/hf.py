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
from pallas_moe.moe import place_experts
from pallas_moe.routing import BIAS_KEY

__all__ = ["FAMILIES", "from_hf", "to_hf"]


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


def from_hf(
  state_dict: Mapping[str, Any],
  config: MoEConfig,
  *,
  prefix: str = "",
  family: str | None = None,
) -> dict[str, np.ndarray]:
  """One MoE block's params from a Hugging Face state dict.

  Args:
    state_dict: name -> array (numpy, a jax.Array, or anything `np.asarray` takes; for torch
      tensors pass e.g. `{k: v.float().numpy() for k, v in model.state_dict().items()}`). Keys
      outside `prefix` are ignored, so a whole model's dict works. A jax.Array sharded over
      several processes' devices is gathered (a collective: call `from_hf` on every process).
    config: the block's config; it decides which weights must be there (shared experts,
      `shared_expert_gate`, the DeepSeek-V3 bias) and their shapes.
    prefix: the block's prefix, e.g. "model.layers.3.mlp." (a missing final "." is added).
    family: one of `FAMILIES`, to accept only that family's names; None: the names found decide
      (Mixtral's w1/w2/w3 or gate_proj/up_proj/down_proj, Qwen2-MoE's `shared_expert` or
      DeepSeek's `shared_experts`).

  Returns:
    `init_params`-layout numpy arrays in `config.weight_dtype` (the correction bias in f32);
    with `config.expert_placement`, `wi`/`wo` are in slot order (`moe.place_experts`).

  Raises:
    ValueError: a weight the config needs is missing, a name under `prefix` is not one of this
      block's, or a shape does not match the config; the message names the key.
  """
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
  unexpected = [n for n in block if n not in names]
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
  params = _to_ours(arrays, config, fam, fused=fused)
  dt = config.param_dtype
  params = {k: v.astype(np.float32 if k == BIAS_KEY else dt) for k, v in params.items()}
  return place_experts(params, placement=config.expert_placement)


def to_hf(
  params: Mapping[str, Any],
  config: MoEConfig,
  *,
  family: str,
  prefix: str = "",
  fused: bool = False,
) -> dict[str, np.ndarray]:
  """The inverse of `from_hf`: one MoE block's params as Hugging Face names and layouts.

  Also converts anything shaped like the params, e.g. their gradients.

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
  ours = {k: host_value(params[k]) for k in want}
  for k, a in ours.items():
    if a.shape != want[k]:
      raise ValueError(
        f"to_hf: params[{k!r}] has shape {a.shape}, the config needs {want[k]} "
        f"({_dims(config)}); pass global (unsharded) arrays."
      )
  ours = place_experts(ours, placement=config.expert_placement, undo=True)
  return {prefix + n: v for n, v in _to_hf(ours, config, fam, fused=fused).items()}


# --- layouts --------------------------------------------------------------------------------------


def _to_ours(a: dict[str, np.ndarray], config: MoEConfig, fam: _Family, *, fused: bool):
  e = config.num_experts
  g, u, dn = fam.experts
  t = lambda w: np.swapaxes(w, -1, -2)
  out = {"router": t(a[_ROUTER])}
  if fused:
    # NOTE: gate_up_proj [E, 2f, d] holds the gate rows then the up rows (transformers'
    # `chunk(2, dim=-1)` of its output), which transposes to our gate columns then up columns.
    out["wi"] = t(a[_FUSED_WI])
    out["wo"] = t(a[_FUSED_WO])
  else:
    gates = np.stack([a[f"experts.{i}.{g}.weight"] for i in range(e)])
    ups = np.stack([a[f"experts.{i}.{u}.weight"] for i in range(e)])
    out["wi"] = np.concatenate([t(gates), t(ups)], axis=-1)
    out["wo"] = t(np.stack([a[f"experts.{i}.{dn}.weight"] for i in range(e)]))
  if config.shared_width:
    s = fam.shared
    out["shared_wi"] = np.concatenate(
      [t(a[f"{s}.gate_proj.weight"]), t(a[f"{s}.up_proj.weight"])], axis=-1
    )
    out["shared_wo"] = t(a[f"{s}.down_proj.weight"])
  if config.shared_expert_gate:
    out["shared_gate"] = t(a[_SHARED_GATE])
  if config.has_routed_bias:
    out[BIAS_KEY] = a[_BIAS]
  return out


def _to_hf(p: dict[str, np.ndarray], config: MoEConfig, fam: _Family, *, fused: bool):
  f = config.expert_ffn_dim
  g, u, dn = fam.experts
  t = lambda w: np.ascontiguousarray(np.swapaxes(w, -1, -2))
  out = {_ROUTER: t(p["router"])}
  if config.has_routed_bias:
    out[_BIAS] = p[BIAS_KEY]
  if fused:
    out[_FUSED_WI] = t(p["wi"])
    out[_FUSED_WO] = t(p["wo"])
  else:
    for i in range(config.num_experts):
      out[f"experts.{i}.{g}.weight"] = t(p["wi"][i, :, :f])
      out[f"experts.{i}.{u}.weight"] = t(p["wi"][i, :, f:])
      out[f"experts.{i}.{dn}.weight"] = t(p["wo"][i])
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
