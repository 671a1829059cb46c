"""Tests for pallas_moe.hf (Hugging Face weights) and the Qwen2-MoE shared-expert gate.

Each family's block runs on HF-layout random weights converted by `from_hf`, through `moe_layer`
on 8 CPU devices, against a float64 rendering of that family's MoE forward written from
transformers 5's modeling code (`hf_moe` below; numpy for the forward, jnp under x64 for the
gradients). DeepSeek-V3's fp8 checkpoint layout (float8_e4m3fn weights with 128 x 128
`weight_scale_inv` blocks) is built here in numpy and read bit for bit. Nothing here needs torch
or transformers.
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_moe import from_hf, moe, reference, to_hf
from pallas_moe.config import MoEConfig
from pallas_moe.hf import FAMILIES
from pallas_moe.quant import BlockQuantizedWeights, check_block_quantized, dequantize_blocks

# NOTE: the block computes in f32 (eps 1.2e-7) on f32 weights, the reference in f64 on the same
# values: measured errors are 1-3e-7 of the largest entry (a few f32 ulps). 1e-5 of it (~80 ulps)
# leaves 30x room; a layout or routing mistake errs by O(1).
F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=5e-2, atol=2e-2)

D, F, E, K, T = 16, 8, 8, 2, 32
_DATA = pathlib.Path(__file__).parent.parent / "data" / "hf_configs"
# Each family's config.json as transformers 5 saves it (tests/data/hf_configs), with only the
# sizes shrunk to test scale; the routing keys stay as saved.
_SAVED = {
  "mixtral": "mixtral_default.json",
  "qwen2_moe": "qwen2_moe_default.json",
  "qwen3_moe": "qwen3_moe_norm_topk.json",
  "deepseek_v2": "deepseek_v2_group_limited.json",
  "deepseek_v3": "deepseek_v3_default.json",
}
_SIZES = {
  "hidden_size": D,
  "moe_intermediate_size": F,
  "shared_expert_intermediate_size": 12,
  "num_experts": E,
  "num_local_experts": E,
  "n_routed_experts": E,
  "num_experts_per_tok": K,
  "n_group": 4,
  "topk_group": 2,
}


def _saved_config(family: str) -> dict:
  """The family's saved config.json at test sizes (Mixtral's expert width is intermediate_size)."""
  hf = json.loads((_DATA / _SAVED[family]).read_text())
  hf |= {k: v for k, v in _SIZES.items() if k in hf}
  if family == "mixtral":
    hf["intermediate_size"] = F
  hf["dtype"] = "float32"
  return hf


# NOTE: the HF rendering below reads the saved dicts (HF_CONFIGS); the block runs the MoEConfig
# that `from_dict` reads strictly from the same dict: a misread routing key fails the comparison.
HF_CONFIGS = {family: _saved_config(family) for family in _SAVED}
CONFIGS = {family: MoEConfig.from_dict(hf) for family, hf in HF_CONFIGS.items()}


def _mesh(data: int, ep: int):
  return jax.make_mesh((data, ep), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def hf_state_dict(family: str, *, fused: bool, seed: int = 0, prefix: str = "") -> dict:
  """Random float32 weights of one MoE block under HF names and [out, in] layouts."""
  fam = FAMILIES[family]
  rng = np.random.default_rng(seed)
  w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
  g, u, dn = fam.experts
  sd = {"gate.weight": w(E, D)}
  if fam.bias:
    sd["gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
  if fused:
    sd["experts.gate_up_proj"] = w(E, 2 * F, D)
    sd["experts.down_proj"] = w(E, D, F)
  else:
    for i in range(E):
      sd |= {f"experts.{i}.{g}.weight": w(F, D), f"experts.{i}.{u}.weight": w(F, D)}
      sd[f"experts.{i}.{dn}.weight"] = w(D, F)
  if fam.shared:
    hf = HF_CONFIGS[family]
    s = hf.get("shared_expert_intermediate_size") or hf["n_shared_experts"] * F
    sd[f"{fam.shared}.gate_proj.weight"] = w(s, D)
    sd[f"{fam.shared}.up_proj.weight"] = w(s, D)
    sd[f"{fam.shared}.down_proj.weight"] = w(D, s)
  if fam.shared_gate:
    sd["shared_expert_gate.weight"] = w(1, D)
  return {prefix + k: v for k, v in sd.items()}


# --- the HF forward, written from transformers 5's modeling_{family}.py -----------------------


def _softmax(xp, z):
  z = z - z.max(axis=-1, keepdims=True)
  return xp.exp(z) / xp.exp(z).sum(axis=-1, keepdims=True)


def _sigmoid(xp, z):
  return 1.0 / (1.0 + xp.exp(-z))


def _mlp(xp, x, wg, wu, wd):
  """HF's SwiGLU MLP with [out, in] weights: down(silu(gate(x)) * up(x))."""
  h = x @ wg.T
  return ((h * _sigmoid(xp, h)) * (x @ wu.T)) @ wd.T


def _scores(xp, family, sd, x):
  logits = x @ sd["gate.weight"].T
  return _sigmoid(xp, logits) if family == "deepseek_v3" else _softmax(xp, logits)


def _topk(a, k):
  return np.argsort(-a, axis=-1, kind="stable")[:, :k]


def hf_choice(family: str, sd: dict, x: np.ndarray) -> np.ndarray:
  """[T, k] chosen experts (numpy, float64): the routers' non-differentiable part."""
  hf = HF_CONFIGS[family]
  scores = _scores(np, family, sd, x)
  if family == "deepseek_v2":
    # DeepseekV2TopkRouter, group_limited_greedy: group score = max; other groups' scores -> 0.
    grouped = scores.reshape(len(x), hf["n_group"], -1)
    kept = _topk(grouped.max(-1), hf["topk_group"])
    mask = np.zeros(grouped.shape[:2], bool)
    np.put_along_axis(mask, kept, True, axis=1)
    scores = np.where(np.repeat(mask, E // hf["n_group"], axis=1), scores, 0.0)
  elif family == "deepseek_v3":
    # DeepseekV3TopkRouter: biased scores; group score = sum of the top 2; others -> -inf.
    choice = scores + sd["gate.e_score_correction_bias"]
    grouped = choice.reshape(len(x), hf["n_group"], -1)
    kept = _topk(np.sort(grouped, -1)[..., -2:].sum(-1), hf["topk_group"])
    mask = np.zeros(grouped.shape[:2], bool)
    np.put_along_axis(mask, kept, True, axis=1)
    scores = np.where(np.repeat(mask, E // hf["n_group"], axis=1), choice, -np.inf)
  return _topk(scores, hf["num_experts_per_tok"])


def hf_moe(xp, family: str, sd: dict, x, ids):
  """The family's MoE block output [T, d] given the choice `ids`, differentiable in sd and x."""
  hf, fam = HF_CONFIGS[family], FAMILIES[family]
  scores = _scores(xp, family, sd, x)
  w = xp.take_along_axis(scores, xp.asarray(ids), axis=1)
  if family == "mixtral" or (family in ("qwen2_moe", "qwen3_moe") and hf["norm_topk_prob"]):
    w = w / w.sum(axis=-1, keepdims=True)
  elif family == "deepseek_v2":
    w = w * hf["routed_scaling_factor"]  # HF 5 applies it whatever norm_topk_prob is
  elif family == "deepseek_v3":
    if hf["norm_topk_prob"]:
      w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    w = w * hf["routed_scaling_factor"]
  g, u, dn = fam.experts
  y = 0.0
  for e in range(E):
    if "experts.gate_up_proj" in sd:
      wg, wu = sd["experts.gate_up_proj"][e, :F], sd["experts.gate_up_proj"][e, F:]
      wd = sd["experts.down_proj"][e]
    else:
      wg, wu = sd[f"experts.{e}.{g}.weight"], sd[f"experts.{e}.{u}.weight"]
      wd = sd[f"experts.{e}.{dn}.weight"]
    coef = (w * (xp.asarray(ids) == e)).sum(axis=1)
    y = y + coef[:, None] * _mlp(xp, x, wg, wu, wd)
  if fam.shared:
    s = fam.shared
    shared = _mlp(
      xp, x, sd[f"{s}.gate_proj.weight"], sd[f"{s}.up_proj.weight"], sd[f"{s}.down_proj.weight"]
    )
    if fam.shared_gate:
      shared = _sigmoid(xp, x @ sd["shared_expert_gate.weight"].T) * shared
    y = y + shared
  return y


def _hf_grads(family, sd, x, ids, ct):
  """jax.grad of sum(hf_moe * ct) in float64 wrt (sd, x)."""
  with jax.enable_x64(True):
    f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
    loss = lambda p, x: jnp.sum(hf_moe(jnp, family, p, x, ids) * f64(ct))
    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(jax.tree.map(f64, sd), f64(x))
    return jax.tree.map(np.asarray, gp), np.asarray(gx)


def _block_grads(params, x, config, mesh, ct):
  def loss(p, x):
    y, _ = moe.moe_layer(p, x, config, mesh)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return np.asarray(y), jax.tree.map(np.asarray, gp), np.asarray(gx)


def _close(got, want, tol, name):
  atol = tol["atol"] * max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol["rtol"], atol=atol,
                             err_msg=name)  # fmt: skip


# NOTE: each family runs on the (2, 4) and (1, 8) meshes, one with each expert layout
# (test_layouts_agree_and_placement shows both give the same params). The experts' matmuls are
# `ragged_dot`: what is tested here is the conversion and the routing semantics; the Pallas gmm
# path is test_moe's (and costs ~4x the compile time on CPU).
@pytest.mark.parametrize("family", list(_SAVED))
@pytest.mark.parametrize("data, ep, fused", [(2, 4, False), (1, 8, True)])
def test_family_matches_hf_forward_and_grads(family, data, ep, fused):
  """from_hf + moe_layer (dropless) equals the family's HF forward; grads too (via to_hf)."""
  config = replace(CONFIGS[family], gmm_impl="ragged_dot")
  prefix = "model.layers.1.mlp."
  sd = hf_state_dict(family, fused=fused, prefix=prefix)
  # NOTE: another layer's weights in the same dict are ignored (a whole model's dict works).
  other = hf_state_dict(family, fused=fused, seed=1, prefix="model.layers.11.mlp.")
  params = from_hf(sd | other, config, prefix=prefix)
  rng = np.random.default_rng(2)
  x = rng.standard_normal((T, D)).astype(np.float32)
  ct = rng.standard_normal((T, D)).astype(np.float32)
  y, gp, gx = _block_grads(params, x, config, _mesh(data, ep), ct)

  block = {k.removeprefix(prefix): np.asarray(v, np.float64) for k, v in sd.items()}
  x64 = x.astype(np.float64)
  ids = hf_choice(family, block, x64)
  _close(y, hf_moe(np, family, block, x64, ids), F32_TOL, "y")
  want_gp, want_gx = _hf_grads(family, block, x64, ids, ct)
  _close(gx, want_gx, F32_TOL, "dx")
  got_gp = to_hf(gp, config, family=family, fused=fused)
  assert set(got_gp) == set(want_gp)
  for k in want_gp:
    _close(got_gp[k], want_gp[k], F32_TOL, f"d[{k}]")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("fused", [False, True])
def test_round_trip(family, fused):
  """to_hf(from_hf(sd)) == sd exactly (names, layouts, dtypes), with and without a prefix."""
  config = CONFIGS[family]
  prefix = "model.layers.0.mlp." if fused else ""
  sd = hf_state_dict(family, fused=fused, prefix=prefix)
  back = to_hf(from_hf(sd, config, prefix=prefix, family=family), config, family=family,
               prefix=prefix, fused=fused)  # fmt: skip
  assert list(back) == list(sd) or set(back) == set(sd)
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
    np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_layouts_agree_and_placement():
  """Fused and per-expert forms give the same params; a placement stores wi/wo in slot order."""
  config = CONFIGS["deepseek_v3"]
  per_expert = hf_state_dict("deepseek_v3", fused=False)
  fused = to_hf(from_hf(per_expert, config), config, family="deepseek_v3", fused=True)
  a, b = from_hf(per_expert, config), from_hf(fused, config)
  assert set(a) == set(b) == set(moe.param_specs(config))
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  assert a["e_score_correction_bias"].dtype == np.float32
  placement = (3, 1, 7, 0, 2, 6, 5, 4)
  placed_config = replace(config, expert_placement=placement)
  placed = from_hf(per_expert, placed_config)
  np.testing.assert_array_equal(placed["wi"], a["wi"][list(placement)])
  np.testing.assert_array_equal(placed["router"], a["router"])
  back = to_hf(placed, placed_config, family="deepseek_v3")
  for k, v in per_expert.items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_weight_dtype():
  """from_hf casts to config.weight_dtype (the correction bias stays f32); to_hf keeps dtypes."""
  config = replace(CONFIGS["deepseek_v3"], weight_dtype="bfloat16")
  sd = hf_state_dict("deepseek_v3", fused=True)
  params = from_hf(sd, config)
  bias = "e_score_correction_bias"
  assert all(v.dtype == jnp.bfloat16 for k, v in params.items() if k != bias)
  assert params[bias].dtype == np.float32
  np.testing.assert_array_equal(params["router"], sd["gate.weight"].T.astype(jnp.bfloat16))
  back = to_hf(params, config, family="deepseek_v3", fused=True)
  assert back["experts.down_proj"].dtype == jnp.bfloat16


def test_errors_name_the_key():
  config = CONFIGS["deepseek_v3"]
  pre = "model.layers.2.mlp."
  sd = hf_state_dict("deepseek_v3", fused=False, prefix=pre)
  missing = {k: v for k, v in sd.items() if not k.endswith("experts.5.up_proj.weight")}
  with pytest.raises(ValueError, match=r"missing .*'model\.layers\.2\.mlp\.experts\.5\.up_proj"):
    from_hf(missing, config, prefix=pre)
  with pytest.raises(ValueError, match=r"unexpected .*experts\.8\.gate_proj\.weight"):
    from_hf(sd | {pre + "experts.8.gate_proj.weight": np.zeros((F, D))}, config, prefix=pre)
  with pytest.raises(ValueError, match=r"shared_experts\.down_proj\.weight' has shape \(16, 7\)"):
    from_hf(sd | {pre + "shared_experts.down_proj.weight": np.zeros((D, 7))}, config, prefix=pre)
  with pytest.raises(ValueError, match=r"no key starts with prefix='model\.layers\.3\.mlp\.'"):
    from_hf(sd, config, prefix="model.layers.3.mlp")
  no_bias = replace(CONFIGS["deepseek_v2"], num_shared_experts=1)
  with pytest.raises(ValueError, match=r"gate\.e_score_correction_bias.*noaux_tc"):
    from_hf(sd, no_bias, prefix=pre)
  with pytest.raises(ValueError, match="'qwen2_moe' blocks gate their shared expert"):
    from_hf(sd, config, prefix=pre, family="qwen2_moe")
  with pytest.raises(ValueError, match="family='llama' is not one of"):
    to_hf(from_hf(sd, config, prefix=pre), config, family="llama")
  params = from_hf(sd, config, prefix=pre)
  with pytest.raises(ValueError, match=r"params\['wo'\] has shape \(4, 8, 16\)"):
    to_hf(params | {"wo": params["wo"][:4]}, config, family="deepseek_v3")
  with pytest.raises(ValueError, match=r"missing \['e_score_correction_bias'\]"):
    to_hf({k: v for k, v in params.items() if k != "e_score_correction_bias"}, config,
          family="deepseek_v3")  # fmt: skip
  qwen = CONFIGS["qwen2_moe"]
  ungated = hf_state_dict("qwen2_moe", fused=True)
  ungated.pop("shared_expert_gate.weight")
  with pytest.raises(ValueError, match="missing .*'shared_expert_gate.weight'.*shared_expert_gate"):
    from_hf(ungated, qwen)


# --- DeepSeek-V3's fp8 checkpoints: float8_e4m3fn weights with 128 x 128 block scales ----------

FP8 = jnp.float8_e4m3fn
QD = 256  # the fp8 tests' d_model: two 128-blocks


def _fp8_config(f: int = 128, **changes) -> MoEConfig:
  """DeepSeek-V3's saved config at d_model=QD, moe_intermediate_size=f (one shared expert)."""
  hf = _saved_config("deepseek_v3") | {"hidden_size": QD, "moe_intermediate_size": f}
  return replace(MoEConfig.from_dict(hf), **changes)


def _fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """w [rows, cols] as DeepSeek-V3's checkpoints store it: float8_e4m3fn values and the f32
  `weight_scale_inv` [ceil(rows/128), ceil(cols/128)], w ~= values * scale over each block."""
  rows, cols = w.shape
  padded = np.zeros((-(-rows // 128) * 128, -(-cols // 128) * 128), np.float32)
  padded[:rows, :cols] = w
  tiles = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
  amax = np.abs(tiles).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
  full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:rows, :cols]
  return np.clip(w / full, -448.0, 448.0).astype(FP8), scale


def fp8_state_dict(config: MoEConfig, *, prefix: str = "", seed: int = 0) -> dict:
  """A DeepSeek-V3 MoE block as its checkpoint files hold it: routed and shared experts in fp8,
  each `weight` beside its `weight_scale_inv`; the router in bf16, the correction bias in f32.
  Each 128-block gets its own magnitude, so that a misplaced scale shows."""
  rng = np.random.default_rng(seed)
  d, f, e, s = config.d_model, config.expert_ffn_dim, config.num_experts, config.shared_width

  def w(rows, cols):
    mags = np.exp(rng.uniform(-2, 2, (-(-rows // 128), -(-cols // 128))))
    mags = np.repeat(np.repeat(mags, 128, 0), 128, 1)[:rows, :cols]
    return (mags * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

  sd = {
    "gate.weight": w(e, d).astype(jnp.bfloat16),
    "gate.e_score_correction_bias": (0.1 * rng.standard_normal(e)).astype(np.float32),
  }
  shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
  mods = {f"experts.{i}.{m}": shape for i in range(e) for m, shape in shapes.items()}
  mods |= {f"shared_experts.{m}": (s, d) if m != "down_proj" else (d, s) for m in shapes}
  for m, shape in mods.items():
    sd[f"{m}.weight"], sd[f"{m}.weight_scale_inv"] = _fp8_blocks(w(*shape))
  return {prefix + k: v for k, v in sd.items()}


def _deq64(sd: dict, module: str) -> np.ndarray:
  """A stored fp8 weight dequantized in float64: weight * weight_scale_inv over each block."""
  v, s = sd[f"{module}.weight"], sd[f"{module}.weight_scale_inv"].astype(np.float64)
  rows, cols = v.shape
  return v.astype(np.float64) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:rows, :cols]


def _ours64(sd: dict, config: MoEConfig, mlp: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """float64 (wi [E, d, 2f], wo [E, f, d]) of the fp8 experts (or of the shared MLP `mlp`)."""
  mlps = [mlp] if mlp else [f"experts.{i}" for i in range(config.num_experts)]
  wi = [np.concatenate([_deq64(sd, f"{m}.gate_proj").T, _deq64(sd, f"{m}.up_proj").T], -1)
        for m in mlps]  # fmt: skip
  wo = [_deq64(sd, f"{m}.down_proj").T for m in mlps]
  return (wi[0], wo[0]) if mlp else (np.stack(wi), np.stack(wo))


def _bits(a) -> np.ndarray:
  return np.asarray(a).view(np.uint8)


def test_fp8_experts_stay_fp8():
  """DeepSeek-V3's fp8 experts load as BlockQuantizedWeights holding the stored bytes (only
  transposed and concatenated), dequantizing exactly as the checkpoint's blocks say; the fp8
  shared experts are dequantized; to_hf writes the experts and their scales back bit for bit."""
  config = _fp8_config()
  f, pre = config.expert_ffn_dim, "model.layers.3.mlp."
  sd = fp8_state_dict(config, prefix=pre)
  other = fp8_state_dict(config, prefix="model.layers.4.mlp.", seed=1)
  params = from_hf(sd | other, config, prefix=pre)
  block = {k.removeprefix(pre): v for k, v in sd.items()}
  wi, wo = params["wi"], params["wo"]
  assert isinstance(wi, BlockQuantizedWeights) and isinstance(wo, BlockQuantizedWeights)
  check_block_quantized(wi)
  check_block_quantized(wo)
  assert wi.values.dtype == FP8 and wo.values.dtype == FP8 and wi.block == wo.block == 128
  assert wi.scales.shape == (E, QD // 128, 2 * f // 128) and wo.scales.shape == (E, f // 128, 2)
  fb = f // 128
  for i in range(E):
    x = {m: (block[f"experts.{i}.{m}.weight"], block[f"experts.{i}.{m}.weight_scale_inv"])
         for m in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    np.testing.assert_array_equal(_bits(wi.values[i, :, :f]), _bits(x["gate_proj"][0].T))
    np.testing.assert_array_equal(_bits(wi.values[i, :, f:]), _bits(x["up_proj"][0].T))
    np.testing.assert_array_equal(_bits(wo.values[i]), _bits(x["down_proj"][0].T))
    np.testing.assert_array_equal(wi.scales[i, :, :fb], x["gate_proj"][1].T)
    np.testing.assert_array_equal(wi.scales[i, :, fb:], x["up_proj"][1].T)
    np.testing.assert_array_equal(wo.scales[i], x["down_proj"][1].T)
  # NOTE: fp8 (4 significant bits) times an f32 scale is exact in f64, so its f32 rounding is
  # the f32 product's: equality, not closeness.
  want_wi, want_wo = _ours64(block, config)
  np.testing.assert_array_equal(np.asarray(dequantize_blocks(wi)), want_wi.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(dequantize_blocks(wo)), want_wo.astype(np.float32))
  shared_wi, shared_wo = _ours64(block, config, "shared_experts")
  assert params["shared_wi"].dtype == params["shared_wo"].dtype == np.float32
  np.testing.assert_array_equal(params["shared_wi"], shared_wi.astype(np.float32))
  np.testing.assert_array_equal(params["shared_wo"], shared_wo.astype(np.float32))
  np.testing.assert_array_equal(params["router"], block["gate.weight"].T.astype(np.float32))

  back = to_hf(params, config, family="deepseek_v3", prefix=pre)
  shared_scales = {k for k in sd if ".shared_experts." in k and k.endswith("_scale_inv")}
  assert set(back) == set(sd) - shared_scales
  for k, v in back.items():
    if ".experts." in k:
      assert v.dtype == sd[k].dtype, k
      np.testing.assert_array_equal(_bits(v), _bits(sd[k]), err_msg=k)
    elif ".shared_experts." in k:
      want = _deq64(block, k[len(pre) :].removesuffix(".weight")).astype(np.float32)
      np.testing.assert_array_equal(v, want, err_msg=k)
    else:
      np.testing.assert_array_equal(v, np.asarray(sd[k], np.float32), err_msg=k)


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_fp8_experts_dequantized(weight_dtype):
  """quantized_experts="dequantize": wi/wo as config.weight_dtype arrays of weight * scale_inv."""
  config = _fp8_config(weight_dtype=weight_dtype)
  sd = fp8_state_dict(config)
  params = from_hf(sd, config, quantized_experts="dequantize")
  kept = from_hf(sd, config)
  want_wi, want_wo = _ours64(sd, config)
  dt = config.param_dtype
  for k, want in (("wi", want_wi), ("wo", want_wo)):
    assert isinstance(params[k], np.ndarray) and params[k].dtype == dt, k
    np.testing.assert_array_equal(params[k], want.astype(np.float32).astype(dt), err_msg=k)
    np.testing.assert_array_equal(params[k], np.asarray(dequantize_blocks(kept[k], dtype=dt)))
  assert all(params[k].dtype == dt for k in params if k != "e_score_correction_bias")


def test_fp8_placement():
  """With an expert placement, values and scales are both in slot order; to_hf undoes it."""
  placement = (3, 1, 7, 0, 2, 6, 5, 4)
  config = _fp8_config(f=256, expert_placement=placement)
  sd = fp8_state_dict(config)
  placed = from_hf(sd, config)
  plain = from_hf(sd, replace(config, expert_placement=None))
  for k in ("wi", "wo"):
    np.testing.assert_array_equal(_bits(placed[k].values), _bits(plain[k].values[list(placement)]))
    np.testing.assert_array_equal(placed[k].scales, plain[k].scales[list(placement)])
  back = to_hf(placed, config, family="deepseek_v3")
  for k in (k for k in sd if k.startswith("experts.")):
    np.testing.assert_array_equal(_bits(back[k]), _bits(sd[k]), err_msg=k)


def test_fp8_errors():
  config = _fp8_config()
  pre = "model.layers.3.mlp."
  sd = fp8_state_dict(config, prefix=pre)
  up, scale = pre + "experts.2.up_proj.weight", pre + "experts.2.up_proj.weight_scale_inv"
  no_scale = {k: v for k, v in sd.items() if k != scale}
  with pytest.raises(ValueError, match=rf"{up!r} is float8_e4m3fn but its block scales {scale!r}"):
    from_hf(no_scale, config, prefix=pre)
  with pytest.raises(ValueError, match=rf"{scale!r} has shape \(1, 1\); .* needs \(1, 2\)"):
    from_hf(sd | {scale: np.ones((1, 1), np.float32)}, config, prefix=pre)
  with pytest.raises(ValueError, match=rf"{scale!r} is given but {up!r} is float32"):
    from_hf(sd | {up: np.zeros((128, QD), np.float32)}, config, prefix=pre)
  with pytest.raises(ValueError, match=r"quantized_experts='fp8' is not one of \('keep', 'dequa"):
    from_hf(sd, config, prefix=pre, quantized_experts="fp8")
  # NOTE: one expert weight already widened: "keep" refuses the mix, "dequantize" reads it.
  mixed = no_scale | {up: _deq64(sd, up.removesuffix(".weight")).astype(np.float32)}
  with pytest.raises(ValueError, match=r"23 of the 24 routed .* quantized_experts='dequantize'"):
    from_hf(mixed, config, prefix=pre)
  got = from_hf(mixed, config, prefix=pre, quantized_experts="dequantize")
  want = from_hf(sd, config, prefix=pre, quantized_experts="dequantize")
  np.testing.assert_array_equal(got["wi"], want["wi"])
  # NOTE: f = 192 is no multiple of the 128 block: "keep" cannot tile wi; "dequantize" reads the
  # partial last blocks.
  odd = _fp8_config(f=192)
  odd_sd = fp8_state_dict(odd)
  dims = r"multiples of 128.*got d_model=256, expert_ffn_dim=192\. Pass quantized_experts="
  with pytest.raises(ValueError, match=dims):
    from_hf(odd_sd, odd)
  got = from_hf(odd_sd, odd, quantized_experts="dequantize")
  np.testing.assert_array_equal(got["wo"], _ours64(odd_sd, odd)[1].astype(np.float32))
  fused = hf_state_dict("deepseek_v3", fused=True)
  fused["experts.gate_up_proj_scales_inv"] = np.ones((E, 1, 1), np.float32)  # transformers' name
  with pytest.raises(ValueError, match=r"block scales .* per-expert layout of checkpoint files"):
    from_hf(fused, CONFIGS["deepseek_v3"])
  with pytest.raises(ValueError, match=r"to_hf: block-quantized wi/wo .* pass fused=False"):
    to_hf(from_hf(sd, config, prefix=pre), config, family="deepseek_v3", fused=True)


# --- the Qwen2-MoE shared-expert gate against pallas_moe.reference ----------------------------


def test_shared_expert_gate_config():
  with pytest.raises(ValueError, match="shared_expert_gate=True .* num_shared_experts=0"):
    MoEConfig(num_experts=E, top_k=K, d_model=D, expert_ffn_dim=F, shared_expert_gate=True)
  with pytest.raises(TypeError, match="shared_expert_gate must be a bool"):
    MoEConfig(num_experts=E, top_k=K, d_model=D, expert_ffn_dim=F, num_shared_experts=1,
              shared_expert_gate=1)  # fmt: skip
  config = CONFIGS["qwen2_moe"]
  params = moe.init_params(jax.random.key(0), config)
  assert params["shared_gate"].shape == (D, 1)
  assert moe.param_specs(config)["shared_gate"] == jax.sharding.PartitionSpec()
  # NOTE: the gate's key is folded in: the other params are those of the ungated config.
  ungated = moe.init_params(jax.random.key(0), replace(config, shared_expert_gate=False))
  for k, v in ungated.items():
    np.testing.assert_array_equal(params[k], v, err_msg=k)


@functools.cache
def _ref_grads_fn(config):
  def loss(p, x, ct):
    y, _, _ = reference.moe(p, x, config)
    return jnp.sum(y * ct), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# NOTE: ragged_dot experts as above: the gate acts after the experts, on the shared MLP only.
# The f32 gate on the (1, 8) mesh is test_family_matches_hf_forward_and_grads[qwen2_moe]'s.
@pytest.mark.parametrize("data, ep, dtype", [(2, 4, "bfloat16")])
def test_shared_expert_gate_matches_reference(data, ep, dtype):
  """moe_layer with the gated shared expert: forward and all grads equal reference.moe, here in
  bf16 with the gate's logit in bf16 too (`float32_gate_logits=False`, as HF computes it)."""
  config = replace(
    CONFIGS["qwen2_moe"],
    dtype=dtype,
    weight_dtype=dtype,
    float32_gate_logits=dtype == "float32",
    gmm_impl="ragged_dot",
  )
  params = moe.init_params(jax.random.key(4), config)
  x = jax.random.normal(jax.random.key(5), (T, D), jnp.float32).astype(dtype)
  ct = jax.random.normal(jax.random.key(6), (T, D), jnp.float32)
  y, gp, gx = _block_grads(params, x, config, _mesh(data, ep), ct)
  (_, ry), (rgp, rgx) = _ref_grads_fn(config)(params, x, ct)
  tol = F32_TOL if dtype == "float32" else BF16_TOL
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  _close(f64(y), f64(ry), tol, "y")
  _close(f64(gx), f64(rgx), tol, "dx")
  assert set(gp) == set(rgp)
  for k in rgp:
    _close(f64(gp[k]), f64(rgp[k]), tol, f"d{k}")
  assert float(np.abs(f64(gp["shared_gate"])).max()) > 0
