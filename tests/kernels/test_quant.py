"""Quantized (int8 / fp8) weights: quantize/dequantize, the quantized gmm kernel, its gradients.

The kernel is checked against `reference.gmm` with the dequantized weights (same semantics, so a
tight f32 tolerance); quantization error itself is measured separately against the float result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import (
  INTERPRET_MODES,
  RACE_PARAMS,
  examples,
  group_sizes_strategy,
  no_races_or_oob,
  np_gmm,
  np_tgmm,
  random_array,
)

import pallas_moe
from pallas_moe import MoEConfig, moe, quant, reference, tiling
from pallas_moe.gmm import gmm_pallas

F32 = jnp.float32
BF16 = jnp.bfloat16
DTYPES = ["int8", "float8_e4m3fn"]

# (m, k, n, tiles, num_local_groups, num_groups_total, transpose_rhs). Ragged k and n (odd
# sizes: the last k tile is masked, the last n tile partly out of bounds), EP shards.
CASES = [
  (72, 200, 130, (16, 128, 128), 3, 5, False),
  (40, 136, 72, (16, 128, 128), 2, 2, True),
]
CASE_IDS = ["kn", "nk_T"]


def _quant_axis(transpose_rhs: bool) -> int:
  return 2 if transpose_rhs else 1


def _weights(case, seed, dtype):
  m, k, n, _, g, _, transpose_rhs = case
  shape = (g, n, k) if transpose_rhs else (g, k, n)
  w = random_array(seed + 1, shape, F32)
  return w, pallas_moe.quantize(w, dtype=dtype, axis=_quant_axis(transpose_rhs))


# --- quantize / dequantize -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [1, 2])
def test_quantize_roundtrip(dtype, axis):
  w = random_array(0, (3, 40, 24), F32).at[1, :, 5].set(0.0).at[1, 5, :].set(0.0)
  q = pallas_moe.quantize(w, dtype=dtype, axis=axis)
  want_scales = (3, 1, 24) if axis == 1 else (3, 40, 1)
  assert q.values.dtype == jnp.dtype(dtype) and q.scales.shape == want_scales
  assert q.scales.dtype == F32
  qmax = 127.0 if dtype == "int8" else 448.0
  # Symmetric absmax: the largest magnitude of each channel maps to qmax; an all-zero channel
  # (one per layout, planted above) stays 0 with scale 1.
  absmax = np.abs(np.asarray(q.values, np.float32)).max(axis=axis)
  zero_channel = (1, 5)
  assert absmax[zero_channel] == 0 and np.asarray(q.scales).squeeze(axis)[zero_channel] == 1
  absmax[zero_channel] = qmax
  np.testing.assert_allclose(absmax, qmax)
  err = np.abs(np.asarray(pallas_moe.dequantize(q) - w))
  # int8 rounds to half a step; e4m3 has 3 mantissa bits: relative error <= 2^-4 of |w| (plus
  # the subnormal step 2^-9 * scale near zero).
  s = np.asarray(q.scales)
  bound = 0.5 * s + 1e-6 if dtype == "int8" else np.abs(np.asarray(w)) / 16 + s * 2.0**-9 + 1e-6
  assert (err <= bound).all()
  # A pytree: jit and tree_map see values and scales.
  leaves = jax.tree_util.tree_leaves(q)
  assert len(leaves) == 2


def test_quantize_bad_inputs():
  w = jnp.ones((2, 8, 8), F32)
  with pytest.raises(ValueError, match="Unsupported quantized weight dtype"):
    pallas_moe.quantize(w, dtype="int4")
  with pytest.raises(ValueError, match="3-d"):
    pallas_moe.quantize(jnp.ones((8, 8)), dtype="int8")
  with pytest.raises(TypeError, match="floating-point"):
    pallas_moe.quantize(jnp.ones((2, 8, 8), jnp.int32), dtype="int8")
  with pytest.raises(ValueError, match="contraction"):
    pallas_moe.quantize(w, dtype="int8", axis=0)


def test_gmm_bad_quantized_inputs():
  x = jnp.ones((16, 8), F32)
  gs = jnp.array([16], jnp.int32)
  q = pallas_moe.quantize(jnp.ones((1, 8, 4), F32), dtype="int8")
  bad_scales = pallas_moe.QuantizedWeights(values=q.values, scales=jnp.ones((1, 8, 1), F32))
  with pytest.raises(ValueError, match="scales has shape"):
    pallas_moe.gmm(x, bad_scales, gs, interpret=True)
  with pytest.raises(ValueError, match="scales has shape"):
    pallas_moe.gmm(x, q, gs, transpose_rhs=True, interpret=True)  # [G, 1, n] scales, [G, n, k]
  bad_values = pallas_moe.QuantizedWeights(values=q.values.astype(jnp.int32), scales=q.scales)
  with pytest.raises(TypeError, match="int8 or float8_e4m3fn"):
    pallas_moe.gmm(x, bad_values, gs, interpret=True)
  bf16_scales = pallas_moe.QuantizedWeights(values=q.values, scales=q.scales.astype(BF16))
  with pytest.raises(TypeError, match="float32"):
    pallas_moe.gmm(x, bf16_scales, gs, interpret=True)
  with pytest.raises(ValueError, match="already QuantizedWeights"):
    pallas_moe.gmm(x, q, gs, weight_quantization="int8", interpret=True)
  with pytest.raises(ValueError, match="Unsupported quantized weight dtype"):
    pallas_moe.gmm(x, jnp.ones((1, 8, 4), F32), gs, weight_quantization="int4", interpret=True)
  with pytest.raises(ValueError, match="k mismatch"):
    pallas_moe.gmm(jnp.ones((16, 6), F32), q, gs, interpret=True)


# --- the quantized kernel vs the dequantized reference ---------------------------------------


def _check_forward(case, dtype, sizes, seed, group_offset, interpret, lhs_dtype=F32):
  m, k, n, tiles, g, _, transpose_rhs = case
  x = random_array(seed, (m, k), lhs_dtype)
  _, q = _weights(case, seed, dtype)
  gs = jnp.asarray(sizes)
  # NOTE: existing_out on odd seeds: rows outside the local groups keep it.
  existing = random_array(seed + 2, (m, n), F32) if seed % 2 else None
  out = pallas_moe.gmm(
    x, q, gs, preferred_element_type=F32, tiling=tiles, group_offset=group_offset,
    existing_out=existing, transpose_rhs=transpose_rhs, interpret=interpret,
  )  # fmt: skip
  ref = reference.gmm(
    x,
    pallas_moe.dequantize(q),
    gs,
    F32,
    group_offset=group_offset,
    existing_out=existing,
    transpose_rhs=transpose_rhs,
  )
  assert out.shape == (m, n) and out.dtype == F32
  # The kernel multiplies lhs by the quantized values upcast to lhs's dtype (exact for int8 and
  # e4m3 in bf16 and f32) with f32 accumulation, then scales per column: the dequantized
  # product up to f32 rounding, for f32 and bf16 lhs alike. Tolerance of an f32 k-long dot.
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5 * np.sqrt(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@examples(0.5)
@given(data=st.data())
def test_quantized_gmm_matches_dequantized_reference_hlo(case, dtype, data):
  m, _, _, _, g, g_total, _ = case
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=g_total))
  group_offset = data.draw(st.integers(0, g_total - g))
  seed = data.draw(st.integers(0, 2**16))
  _check_forward(case, dtype, sizes, seed, group_offset, INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("dtype", DTYPES)
@examples(0.25)
@given(data=st.data())
def test_quantized_gmm_bf16_lhs_hlo(dtype, data):
  case = CASES[0]
  m, _, _, _, g, g_total, _ = case
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=g_total))
  group_offset = data.draw(st.integers(0, g_total - g))
  seed = data.draw(st.integers(0, 2**16))
  _check_forward(case, dtype, sizes, seed, group_offset, INTERPRET_MODES["hlo"], lhs_dtype=BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@examples(0.25)
@given(data=st.data())
def test_quantized_gmm_matches_dequantized_reference_tpu_sim(dtype, data):
  case = CASES[1] if dtype == "int8" else CASES[0]
  m, _, _, _, g, g_total, _ = case
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=g_total))
  group_offset = data.draw(st.integers(0, g_total - g))
  _check_forward(
    case, dtype, sizes, data.draw(st.integers(0, 99)), group_offset, INTERPRET_MODES["tpu"]
  )


# --- quantization error vs bf16 ----------------------------------------------------------------

_ERROR_BOUNDS = {"int8": 0.01, "float8_e4m3fn": 0.05}
# Activations and weights quantized: two independent roundings, errors add in quadrature.
_W8A8_BOUNDS = {"int8": 0.02, "float8_e4m3fn": 0.07}


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantization_error_vs_bf16(dtype):
  """Relative Frobenius error of the int8/fp8 gmm vs the same gmm with bf16 weights (and with
  the activations quantized too, on the narrow-dot path of v5e for int8)."""
  m, k, n, g = 128, 256, 128, 2
  x = random_array(7, (m, k), BF16)
  w = random_array(8, (g, k, n), F32)
  gs = jnp.array([50, 78], jnp.int32)
  q = pallas_moe.quantize(w, dtype=dtype)
  run = functools.partial(pallas_moe.gmm, tiling=(64, 128, 128), preferred_element_type=F32)
  exact = np.asarray(reference.gmm(x, w, gs, F32))
  out_bf16 = np.asarray(run(x, w.astype(BF16), gs, interpret=True))
  out_q = np.asarray(run(x, q, gs, interpret=True))

  def rel(a):
    return float(np.linalg.norm(a - exact) / np.linalg.norm(exact))

  with tiling.use_generation("v5e"):
    out_a = np.asarray(run(x, q, gs, interpret=True, activation_quantization=dtype))
  err_q, err_bf16, err_a = rel(out_q), rel(out_bf16), rel(out_a)
  print(
    f"\n{dtype}: rel. Frobenius error vs f32 weights {err_q:.4%} (bf16 weights: {err_bf16:.4%}; "
    f"{dtype} activations and weights: {err_a:.4%})"
  )
  assert err_q < _ERROR_BOUNDS[dtype]
  assert err_q < err_a < _W8A8_BOUNDS[dtype]


# --- gradients ---------------------------------------------------------------------------------


def _ste_reference(x, w, gs, *, dtype, transpose_rhs, group_offset):
  """jnp straight-through reference: forward with dequantize(quantize(w)), identity grad in w."""
  q = pallas_moe.quantize(w, dtype=dtype, axis=_quant_axis(transpose_rhs))
  w_q = w + jax.lax.stop_gradient(pallas_moe.dequantize(q) - w)
  return reference.gmm(x, w_q, gs, group_offset=group_offset, transpose_rhs=transpose_rhs)


# NOTE: each layout once and each dtype once (the four pairs took ~15 s each, mostly tracing and
# compiling the three interpret-mode kernels; the dtype does not change the code path).
@pytest.mark.parametrize(
  "case, dtype", [(CASES[0], DTYPES[0]), (CASES[1], DTYPES[1])], ids=["kn-int8", "nk_T-fp8"]
)
def test_quantized_gmm_gradients(case, dtype):
  m, k, n, tiles, g, g_total, transpose_rhs = case
  x = random_array(3, (m, k), F32)
  w0, _ = _weights(case, 4, dtype)
  # NOTE: a weight already on the quantization grid: quantizing it again inside jit and in the
  # eager reference gives the same values (an arbitrary weight can sit on a rounding tie that
  # the fused and unfused divisions round differently: one fp8 step apart).
  axis = _quant_axis(transpose_rhs)
  w = pallas_moe.dequantize(pallas_moe.quantize(w0, dtype=dtype, axis=axis))
  q = pallas_moe.quantize(w, dtype=dtype, axis=axis)
  sizes = np.array([m // 4, 0, m // 2, m // 8, 3][:g_total], np.int32)
  gs, group_offset = jnp.asarray(sizes), g_total - g
  dout = random_array(5, (m, n), F32)
  kw = dict(group_offset=group_offset, transpose_rhs=transpose_rhs)

  def loss_of(fn):
    return lambda x, w: jnp.sum(fn(x, w) * dout)

  ours = loss_of(
    lambda x, w: pallas_moe.gmm(
      x, w, gs, tiling=tiles, interpret=True, weight_quantization=dtype, **kw
    )
  )
  ref = loss_of(lambda x, w: _ste_reference(x, w, gs, dtype=dtype, **kw))
  dx, dw = jax.jit(jax.grad(ours, (0, 1)))(x, w)
  rdx, rdw = jax.jit(jax.grad(ref, (0, 1)))(x, w)
  tol = dict(rtol=2e-5, atol=1e-4 * np.sqrt(max(m, n, k)))
  np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), **tol)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(rdw), **tol)
  assert dw.dtype == w.dtype and dw.shape == w.shape

  # Frozen QuantizedWeights: the same lhs gradient; the weights get a zero cotangent.
  frozen = loss_of(lambda x, q: pallas_moe.gmm(x, q, gs, tiling=tiles, interpret=True, **kw))
  fdx, fdq = jax.jit(jax.grad(frozen, (0, 1), allow_int=True))(x, q)
  np.testing.assert_allclose(np.asarray(fdx), np.asarray(rdx), **tol)
  assert not np.any(np.asarray(fdq.scales))
  if dtype == "int8":
    assert fdq.values.dtype == jax.dtypes.float0


# --- AOT compilation with real Mosaic ------------------------------------------------------------


def _aot_compile(gen, dtype, *, grad: bool, transpose_rhs: bool = False):
  from test_aot import _compile, _sds

  m, k, n, g = 1024, 512, 768, 4
  x = _sds(gen, m, k)
  gs = _sds(gen, g, dtype=jnp.int32)
  if grad:
    w = _sds(gen, *((g, n, k) if transpose_rhs else (g, k, n)))

    def fn(x, w, gs):
      out = pallas_moe.gmm(x, w, gs, transpose_rhs=transpose_rhs, weight_quantization=dtype)
      return jnp.square(out.astype(F32)).sum()

    return _compile(gen, jax.grad(fn, argnums=(0, 1)), x, w, gs)
  q = pallas_moe.QuantizedWeights(
    values=_sds(gen, g, k, n, dtype=jnp.dtype(dtype)), scales=_sds(gen, g, 1, n, dtype=F32)
  )
  return _compile(gen, lambda x, q, gs: pallas_moe.gmm(x, q, gs), x, q, gs)


@pytest.mark.aot
@pytest.mark.parametrize(
  "gen, dtype",
  [("v5e", "int8"), ("v6e", "int8"), ("v6e", "float8_e4m3fn"), ("v5e", "float8_e4m3fn")],
)
def test_quantized_gmm_compiles_aot(gen, dtype):
  """Forward and the straight-through grad (fwd, dlhs, drhs kernels) compile with Mosaic.

  fp8 on v5e (no fp8 MXU, `supports_fp8` False) compiles too: the weights are upcast in VMEM.
  """
  if dtype == "float8_e4m3fn" and gen == "v5e":
    assert not tiling.get_generation(gen).supports_fp8
  # NOTE: each gmm also launches the zero fill of its unvisited tiles; tgmm has none.
  compiled = _aot_compile(gen, dtype, grad=False)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
  compiled = _aot_compile(gen, dtype, grad=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 5


# --- MoEConfig -------------------------------------------------------------------------------

_BASE = dict(num_experts=4, top_k=2, d_model=64, expert_ffn_dim=32)


@pytest.mark.parametrize(
  "raw, want, act",
  [("", None, None), (None, None, None), ("int8", "int8", "int8"), ("int8w", "int8", None),
   ("fp8", "fp8", "fp8")],
)  # fmt: skip
def test_config_maps_maxtext_quantization(raw, want, act):
  """MaxText's int8 / fp8 quantize both dot operands (AQT fwd_bits=8); int8w the weights only."""
  config = MoEConfig.from_dict({**_BASE, "quantization": raw})
  assert (config.weight_quantization, config.activation_quantization) == (want, act)


def test_config_refuses_other_quantizations():
  with pytest.raises(ValueError, match="means activation_quantization='int8'"):
    MoEConfig.from_dict({**_BASE, "quantization": "int8", "activation_quantization": None})
  with pytest.raises(ValueError, match="needs weight_quantization='int8'"):
    MoEConfig(**_BASE, activation_quantization="int8")
  with pytest.raises(ValueError, match="quantization='int4w' is not supported"):
    MoEConfig.from_dict({**_BASE, "quantization": "int4w"})
  with pytest.raises(ValueError, match="weight_quantization must be one of"):
    MoEConfig(**_BASE, weight_quantization="int4")
  with pytest.raises(ValueError, match="needs gmm_impl='pallas'"):
    MoEConfig(**_BASE, weight_quantization="int8", gmm_impl="ragged_dot")


def test_expert_mlp_with_weight_quantization():
  """The MoE experts quantize their weights: same as ragged_dot on the dequantized weights."""
  config = MoEConfig(**_BASE, weight_quantization="int8")
  g, d, f, rows = 4, _BASE["d_model"], _BASE["expert_ffn_dim"], 40
  x = random_array(11, (rows, d), F32)
  wi = random_array(12, (g, d, 2 * f), F32)
  wo = random_array(13, (g, f, d), F32)
  gs = jnp.array([10, 0, 20, 6], jnp.int32)
  out = moe.expert_mlp(x, wi, wo, gs, config=config)
  deq = [pallas_moe.dequantize(pallas_moe.quantize(w, dtype="int8")) for w in (wi, wo)]
  ref = moe.expert_mlp(x, *deq, gs, config=MoEConfig(**_BASE, gmm_impl="ragged_dot"))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-3)


@pytest.mark.aot
def test_quantized_grad_transposed_layout_compiles_aot():
  """[G, n, k] weights: the dlhs kernel reads [tk, 1] scale blocks (a column vector)."""
  compiled = _aot_compile("v6e", "int8", grad=True, transpose_rhs=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 5  # 2 zero fills


# --- helpers for the narrow-dot checks ---------------------------------------------------------


def _kernel_dot_dtypes(fn, *args) -> set[tuple[str, str, str]]:
  """(lhs, rhs, result) dtypes of every dot inside the pallas kernels `fn` traces."""
  found = set()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        a, b = (np.dtype(v.aval.dtype).name for v in eqn.invars)
        found.add((a, b, np.dtype(eqn.outvars[0].aval.dtype).name))
      for p in eqn.params.values():
        for q in p if isinstance(p, (tuple, list)) else (p,):
          if isinstance(q, jax.extend.core.ClosedJaxpr):
            visit(q.jaxpr)
          elif isinstance(q, jax.extend.core.Jaxpr):
            visit(q)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _on_grid(x, dtype):
  """Activations already on the per-row quantization grid: quantizing them again (in jit or
  eagerly) gives the same values, so the kernel and the reference see identical operands."""
  values, scales = quant.quantize_rows(x, dtype=dtype)
  return values.astype(F32) * scales


# Narrow MXU mode per (dtype, generation) in the table: int8 on v5e (not tpu7x), fp8 on tpu7x.
GENS = ["v5e", "tpu7x"]


def _narrow_expected(dtype: str, gen: str) -> bool:
  return quant.narrow_dot_supported(dtype, tiling.get_generation(gen))


# --- gmm with quantized activations (per-row scales) and weights -------------------------------


def _check_act_forward(case, dtype, gen, sizes, seed, group_offset, interpret):
  m, k, n, tiles, g, _, transpose_rhs = case
  x = _on_grid(random_array(seed, (m, k), F32), dtype)
  _, q = _weights(case, seed, dtype)
  gs = jnp.asarray(sizes)
  existing = random_array(seed + 2, (m, n), F32) if seed % 2 else None
  kw = dict(
    preferred_element_type=F32, tiling=tiles, group_offset=group_offset, existing_out=existing,
    transpose_rhs=transpose_rhs, interpret=interpret, activation_quantization=dtype,
  )  # fmt: skip
  with tiling.use_generation(gen):
    out = pallas_moe.gmm(x, q, gs, **kw)
  xv, xs = quant.quantize_rows(x, dtype=dtype)
  ref = reference.quantized_gmm(
    xv, xs, q.values, q.scales, gs, group_offset=group_offset, existing_out=existing,
    transpose_rhs=transpose_rhs,
  )  # fmt: skip
  want = np_gmm(
    np.asarray(xv, np.float64) * np.asarray(xs, np.float64),
    np.asarray(q.values, np.float64) * np.asarray(q.scales, np.float64),
    sizes, group_offset=group_offset, existing_out=existing, transpose_rhs=transpose_rhs,
  )  # fmt: skip
  # Products of 8-bit values are exact (int32, or f32 for fp8 / upcast bf16); the f32 sums and
  # the two scale multiplies round: the tolerance of an f32 k-long dot.
  tol = dict(rtol=2e-5, atol=2e-5 * np.sqrt(k))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **tol)
  np.testing.assert_allclose(np.asarray(out), want, **tol)


@pytest.mark.parametrize("gen", GENS)
@pytest.mark.parametrize("dtype", DTYPES)
@examples(0.25)
@given(data=st.data())
def test_activation_quantized_gmm_hlo(gen, dtype, data):
  case = CASES[0]
  m, _, _, _, g, g_total, _ = case
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=g_total))
  group_offset = data.draw(st.integers(0, g_total - g))
  seed = data.draw(st.integers(0, 2**16))
  _check_act_forward(case, dtype, gen, sizes, seed, group_offset, INTERPRET_MODES["hlo"])


@pytest.mark.parametrize("dtype, gen", [("int8", "v5e"), ("float8_e4m3fn", "tpu7x")])
@examples(0.125)
@given(data=st.data())
def test_activation_quantized_gmm_tpu_sim(dtype, gen, data):
  """The narrow dots in the TPU simulator, the transposed [G, n, k] layout."""
  case = CASES[1]
  m, _, _, _, g, g_total, _ = case
  sizes = data.draw(group_sizes_strategy(m=m, num_groups=g_total))
  seed = data.draw(st.integers(0, 99))
  _check_act_forward(case, dtype, gen, sizes, seed, g_total - g, INTERPRET_MODES["tpu"])


@pytest.mark.parametrize("gen", GENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantized_gmm_uses_the_narrow_dot_where_supported(gen, dtype):
  """int8 x int8 -> int32 on v5e, fp8 x fp8 -> f32 on tpu7x; bf16 (upcast) elsewhere."""
  x = jnp.ones((64, 128), F32)
  q = pallas_moe.quantize(jnp.ones((2, 128, 128), F32), dtype=dtype)
  gs = jnp.array([30, 34], jnp.int32)
  fn = functools.partial(pallas_moe.gmm, interpret=True, activation_quantization=dtype)
  with tiling.use_generation(gen):
    dots = _kernel_dot_dtypes(lambda x, q: fn(x, q, gs), x, q)
  if _narrow_expected(dtype, gen):
    acc = "int32" if dtype == "int8" else "float32"
    assert dots == {(dtype, dtype, acc)}
  else:
    assert dots == {("bfloat16", "bfloat16", "float32")}
  # Weights only (float lhs): always the upcast to lhs's dtype.
  with tiling.use_generation(gen):
    dots = _kernel_dot_dtypes(lambda x, q: pallas_moe.gmm(x, q, gs, interpret=True), x, q)
  assert dots == {("float32", "float32", "float32")}


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantized_gradients_are_straight_through(dtype):
  """dlhs = dout @ deq(q(w))^T, dw = x^T @ dout: the STE through both quantizers."""
  case = CASES[0]
  m, k, n, tiles, g, g_total, _ = case
  x = _on_grid(random_array(3, (m, k), F32), dtype)
  w0, _ = _weights(case, 4, dtype)
  w = pallas_moe.dequantize(pallas_moe.quantize(w0, dtype=dtype))
  gs, group_offset = jnp.array([18, 0, 36, 9, 3], jnp.int32), g_total - g
  dout = random_array(5, (m, n), F32)

  def ours(x, w):
    out = pallas_moe.gmm(
      x, w, gs, tiling=tiles, group_offset=group_offset, interpret=True,
      weight_quantization=dtype, activation_quantization=dtype,
    )  # fmt: skip
    return jnp.sum(out * dout)

  def ref(x, w):
    xv, xs = quant.quantize_rows(x, dtype=dtype)
    x_q = x + jax.lax.stop_gradient(xv.astype(F32) * xs - x)
    q = pallas_moe.quantize(w, dtype=dtype)
    w_q = w + jax.lax.stop_gradient(pallas_moe.dequantize(q) - w)
    return jnp.sum(reference.gmm(x_q, w_q, gs, group_offset=group_offset) * dout)

  got, want = jax.jit(jax.grad(ours, (0, 1)))(x, w), jax.jit(jax.grad(ref, (0, 1)))(x, w)
  tol = dict(rtol=2e-5, atol=1e-4 * np.sqrt(max(m, n, k)))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
  np.testing.assert_allclose(float(ours(x, w)), float(ref(x, w)), rtol=1e-5)


# --- tgmm with quantized operands -----------------------------------------------------------------


def _quantize_axis(x, dtype, axis):
  """Symmetric absmax quantization with the scales' `axis` reduced (for tgmm's operands)."""
  name = quant.canonical_dtype(dtype)
  x32 = x.astype(F32)
  amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
  scales = jnp.where(amax > 0, amax / (127.0 if name == "int8" else 448.0), 1.0)
  if name == "int8":
    return jnp.clip(jnp.round(x32 / scales), -127, 127).astype(jnp.int8), scales
  return (x32 / scales).astype(jnp.float8_e4m3fn), scales


# (lhs scales, rhs scales): "chan" per output row / column, "token" per row of m, None a float
# operand (f32).
TGMM_MODES = [("chan", "chan"), ("token", None), (None, "token"), ("token", "chan")]
TGMM_IDS = ["chan-chan", "token-f32", "f32-token", "token-chan"]


def _tgmm_operands(mode, dtype, seed, k, m, n):
  lhs = random_array(seed, (k, m), F32)
  rhs = random_array(seed + 1, (m, n), F32)
  lmode, rmode = mode
  ls = rs = None
  if lmode is not None:
    lhs, ls = _quantize_axis(lhs, dtype, 1 if lmode == "chan" else 0)
  if rmode is not None:
    rhs, rs = _quantize_axis(rhs, dtype, 0 if rmode == "chan" else 1)
  return lhs, ls, rhs, rs


def _check_tgmm_quant(mode, dtype, gen, sizes, seed, group_offset, interpret, *, race=False):
  k, m, n, num_local = 200, 150, 130, 3  # ragged k, m and n over (128, 128, 128) tiles
  lhs, ls, rhs, rs = _tgmm_operands(mode, dtype, seed, k, m, n)
  gs = jnp.asarray(sizes)
  existing = random_array(seed + 2, (num_local, k, n), F32) if seed % 2 else None
  with tiling.use_generation(gen):
    out = pallas_moe.tgmm(
      lhs, rhs, gs, F32, (128, 128, 128), group_offset, num_local, existing, interpret,
      lhs_scales=ls, rhs_scales=rs,
    )  # fmt: skip
  # NOTE: with both operands quantized the kernel multiplies in bf16: token-scaled values are
  # rounded to bf16 there (per-channel ones stay exact), so the reference rounds them too.
  both = mode[0] is not None and mode[1] is not None
  kw = dict(group_offset=group_offset, num_actual_groups=num_local, existing_out=existing)
  ref = reference.quantized_tgmm(
    lhs, ls, rhs, rs, gs, round_token_scaled_to=BF16 if both else None, **kw
  )

  def np_deq(values, scales, token):
    x = reference.dequantize(values, scales)
    if both and token:
      x = x.astype(BF16).astype(F32)
    return np.asarray(x, np.float64)

  want = np_tgmm(
    np_deq(lhs, ls, mode[0] == "token"), np_deq(rhs, rs, mode[1] == "token"), sizes, **kw
  )
  tol = dict(rtol=2e-5, atol=2e-5 * np.sqrt(m))
  out = np.asarray(out)
  np.testing.assert_allclose(out, np.asarray(ref), **tol)
  np.testing.assert_allclose(out, want, **tol)
  empty = np.asarray(sizes)[group_offset : group_offset + num_local] == 0
  base = np.zeros_like(out) if existing is None else np.asarray(existing)
  np.testing.assert_array_equal(out[empty], base[empty])  # empty groups: exact


# Every scale layout on v5e (int8 narrow, fp8 upcast); per-channel on tpu7x too (int8 upcast, fp8
# narrow): the generation only matters where both operands have per-channel scales.
TGMM_HLO_CASES = [(mode, dtype, "v5e") for mode in TGMM_MODES for dtype in DTYPES] + [
  (TGMM_MODES[0], dtype, "tpu7x") for dtype in DTYPES
]


@pytest.mark.parametrize(
  "mode, dtype, gen",
  TGMM_HLO_CASES,
  ids=[f"{TGMM_IDS[TGMM_MODES.index(c[0])]}-{c[1]}-{c[2]}" for c in TGMM_HLO_CASES],
)
@examples(0.25)
@given(data=st.data())
def test_quantized_tgmm_hlo(mode, dtype, gen, data):
  sizes = data.draw(group_sizes_strategy(m=150, num_groups=5))
  group_offset = data.draw(st.integers(0, 2))
  seed = data.draw(st.integers(0, 2**16))
  _check_tgmm_quant(mode, dtype, gen, sizes, seed, group_offset, INTERPRET_MODES["hlo"])


@pytest.mark.parametrize(
  "mode, dtype, gen",
  [(("chan", "chan"), "int8", "v5e"), (("chan", "chan"), "float8_e4m3fn", "tpu7x"),
   (("token", "chan"), "int8", "v5e")],
  ids=["int8-narrow", "fp8-narrow", "int8-token"],
)  # fmt: skip
@examples(0.125)
@given(data=st.data())
def test_quantized_tgmm_tpu_sim(mode, dtype, gen, data):
  sizes = data.draw(group_sizes_strategy(m=150, num_groups=5))
  group_offset = data.draw(st.integers(0, 2))
  seed = data.draw(st.integers(0, 99))
  _check_tgmm_quant(mode, dtype, gen, sizes, seed, group_offset, INTERPRET_MODES["tpu"])


@pytest.mark.parametrize("gen", GENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_tgmm_narrow_dot_where_supported(gen, dtype):
  lhs, ls, rhs, rs = _tgmm_operands(("chan", "chan"), dtype, 0, 128, 128, 128)
  gs = jnp.array([60, 68], jnp.int32)
  with tiling.use_generation(gen):
    dots = _kernel_dot_dtypes(
      lambda a, b: pallas_moe.tgmm(a, b, gs, interpret=True, lhs_scales=ls, rhs_scales=rs),
      lhs, rhs,
    )  # fmt: skip
  if _narrow_expected(dtype, gen):
    assert dots == {(dtype, dtype, "int32" if dtype == "int8" else "float32")}
  else:
    assert dots == {("bfloat16", "bfloat16", "float32")}


# --- race detector (2 cores) on the quantized kernels ------------------------------------------


def test_quantized_kernels_no_race_no_oob_two_cores(capfd):
  """int8 activations x int8 weights (narrow dot) in gmm and tgmm, race detector on 2 cores."""
  m, k, n = 150, 200, 260  # ragged everything
  sizes = jnp.array([0, 30, 0, 70, 20, 0], jnp.int32)
  x = _on_grid(random_array(5, (m, k), F32), "int8")
  q = pallas_moe.quantize(random_array(6, (4, k, n), F32), dtype="int8")
  existing = random_array(7, (m, n), F32)
  lhs, ls, rhs, rs = _tgmm_operands(("chan", "chan"), "int8", 8, k, m, n)
  with no_races_or_oob(capfd), tiling.use_generation("v5e"):
    out = pallas_moe.gmm(
      x, q, sizes, F32, (128, 128, 128), 1, existing, interpret=RACE_PARAMS,
      activation_quantization="int8",
    )  # fmt: skip
    tout = pallas_moe.tgmm(
      lhs, rhs, sizes, F32, (128, 128, 128), 1, 4, interpret=RACE_PARAMS, lhs_scales=ls,
      rhs_scales=rs,
    )  # fmt: skip
    out, tout = np.asarray(out), np.asarray(tout)
  xv, xs = quant.quantize_rows(x, dtype="int8")
  ref = reference.quantized_gmm(
    xv, xs, q.values, q.scales, sizes, group_offset=1, existing_out=existing
  )
  np.testing.assert_allclose(out, np.asarray(ref), rtol=2e-5, atol=2e-5 * np.sqrt(k))
  tref = reference.quantized_tgmm(lhs, ls, rhs, rs, sizes, group_offset=1, num_actual_groups=4)
  np.testing.assert_allclose(tout, np.asarray(tref), rtol=2e-5, atol=2e-5 * np.sqrt(m))


# --- the MoE block with quantized weights under shard_map ---------------------------------------


def test_moe_layer_weight_quantization_shard_map():
  """int8 weights and activations, EP=4 on a (2, 4) CPU mesh (shard_map): forward and gradients
  match the dense float reference on the dequantized expert weights (weights pre-snapped to the
  int8 grid, so quantizing them again inside the block is exact)."""
  from layer_testing import SMALL, _assert_close, _block_grads, _mesh, _ref_grads, _setup

  config = MoEConfig(
    **SMALL, weight_quantization="int8", activation_quantization="int8", norm_topk_prob=True
  )
  ref_config = MoEConfig(**SMALL, norm_topk_prob=True)
  params, x = _setup(config, tokens=64)
  for name in ("wi", "wo"):
    params[name] = pallas_moe.dequantize(pallas_moe.quantize(params[name], dtype="int8"))
  got = _block_grads(params, x, config, _mesh(2, 4))
  assert int(got[1]["dropped_rows"]) == 0
  want = _ref_grads(params, x, ref_config)
  # Expert inputs (x, then the SwiGLU output) are quantized per row: int8 rounds each value by up
  # to 1/254 of its row's absmax. Gradients are straight-through, so they track the float
  # reference as closely as the forward does.
  _assert_close(got, want, dict(rtol=5e-2, atol=2e-2))


# --- bad input ------------------------------------------------------------------------------------


def test_tgmm_bad_quantized_inputs():
  k, m, n = 16, 32, 8
  gs = jnp.array([32], jnp.int32)
  lhs_q = jnp.ones((k, m), jnp.int8)
  rhs = jnp.ones((m, n), F32)
  ones = lambda *s: jnp.ones(s, F32)
  tg = functools.partial(pallas_moe.tgmm, interpret=True)
  with pytest.raises(TypeError, match=r"`lhs` is int8 \(quantized\): pass `lhs_scales`"):
    tg(lhs_q, rhs, gs)
  with pytest.raises(ValueError, match=r"`lhs_scales` has shape \(1, 16\).*\(16, 1\).*\(1, 32\)"):
    tg(lhs_q, rhs, gs, lhs_scales=ones(1, k))
  with pytest.raises(ValueError, match=r"`rhs_scales` has shape \(8, 1\).*\(1, 8\).*\(32, 1\)"):
    tg(lhs_q, rhs.astype(jnp.int8), gs, lhs_scales=ones(k, 1), rhs_scales=ones(n, 1))
  with pytest.raises(TypeError, match="`lhs_scales` must be float32"):
    tg(lhs_q, rhs, gs, lhs_scales=jnp.ones((k, 1), BF16))
  with pytest.raises(ValueError, match="`rhs_scales` was given but `rhs` is float32"):
    tg(lhs_q, rhs, gs, lhs_scales=ones(k, 1), rhs_scales=ones(1, n))
  with pytest.raises(TypeError, match="floating-point"):
    tg(lhs_q.astype(jnp.int32), rhs, gs)
  q = pallas_moe.quantize(jnp.ones((1, k, n), F32))
  with pytest.raises(TypeError, match="QuantizedWeights is gmm's rhs"):
    tg(q, rhs, gs)


def test_gmm_bad_activation_quantization():
  x = jnp.ones((16, 8), F32)
  gs = jnp.array([16], jnp.int32)
  w = jnp.ones((1, 8, 4), F32)
  q = pallas_moe.quantize(w, dtype="int8")
  with pytest.raises(ValueError, match="needs quantized weights: pass rhs as QuantizedWeights"):
    pallas_moe.gmm(x, w, gs, interpret=True, activation_quantization="int8")
  with pytest.raises(ValueError, match="differs from the weights' int8"):
    pallas_moe.gmm(x, q, gs, interpret=True, activation_quantization="fp8")
  with pytest.raises(ValueError, match="Unsupported quantized weight dtype 'int4'"):
    pallas_moe.gmm(x, q, gs, interpret=True, activation_quantization="int4")
  # Quantized operands in the wrong argument.
  with pytest.raises(TypeError, match="QuantizedWeights is gmm's rhs"):
    pallas_moe.gmm(q, w, gs, interpret=True)
  with pytest.raises(TypeError, match="activation_quantization"):
    pallas_moe.gmm(x.astype(jnp.int8), q, gs, interpret=True)


# --- AOT: quantized activations and the narrow MXU dot with real Mosaic ---------------------------


@pytest.mark.aot
@pytest.mark.parametrize(
  "gen, dtype",
  [
    ("v5e", "int8"),  # narrow int8 x int8 -> int32
    ("v6e", "int8"),  # narrow
    ("tpu7x", "float8_e4m3fn"),  # narrow fp8 x fp8 -> f32
    ("v6e", "float8_e4m3fn"),  # no native e4m3fn mode: upcast to bf16 in VMEM
    ("v5e", "float8_e4m3fn"),  # no fp8 MXU: upcast
    ("v4", "float8_e4m3fn"),  # no int8 / fp8 MXU at all: upcast
  ],
)
def test_activation_quantized_gmm_compiles_aot(gen, dtype):
  """Forward (activations and weights quantized) and its straight-through grad compile; the
  forward's kernel dot is the narrow one exactly where the generation table says so."""
  from test_aot import _compile, _sds

  m, k, n, g = 1024, 512, 768, 4
  x, w, gs = _sds(gen, m, k), _sds(gen, g, k, n), _sds(gen, g, dtype=jnp.int32)
  q = pallas_moe.QuantizedWeights(
    values=_sds(gen, g, k, n, dtype=jnp.dtype(dtype)), scales=_sds(gen, g, 1, n, dtype=F32)
  )

  def fwd(x, q, gs):
    return pallas_moe.gmm(x, q, gs, activation_quantization=dtype)

  def loss(x, w, gs):
    out = pallas_moe.gmm(x, w, gs, weight_quantization=dtype, activation_quantization=dtype)
    return jnp.square(out.astype(F32)).sum()

  # NOTE: each gmm also launches the zero fill of its unvisited tiles.
  compiled = _compile(gen, fwd, x, q, gs)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
  compiled = _compile(gen, jax.grad(loss, argnums=(0, 1)), x, w, gs)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 5
  with tiling.use_generation(gen):
    dots = _kernel_dot_dtypes(fwd, x, q, gs)
  if _narrow_expected(dtype, gen):
    assert dots == {(dtype, dtype, "int32" if dtype == "int8" else "float32")}
  else:
    assert dots == {("bfloat16", "bfloat16", "float32")}


def _raw_narrow_gmm(gen, dtype):
  from test_aot import _compile, _sds

  m, k, n, g = 512, 256, 256, 2
  narrow = jnp.dtype(dtype)

  def fn(x, xs, w, ws, gs):
    return gmm_pallas(
      x, w, gs, tiling=(128, 256, 256), out_dtype=F32, group_offset=jnp.zeros((), jnp.int32),
      rhs_scales=ws, lhs_scales=xs, narrow_dot=True, interpret=False,
    )  # fmt: skip

  args = (
    _sds(gen, m, k, dtype=narrow), _sds(gen, m, 1, dtype=F32), _sds(gen, g, k, n, dtype=narrow),
    _sds(gen, g, 1, n, dtype=F32), _sds(gen, g, dtype=jnp.int32),
  )  # fmt: skip
  return _compile(gen, fn, *args)


@pytest.mark.aot
def test_narrow_dot_forced_where_the_table_says_no():
  """Why the policy follows the table: Mosaic accepts an e4m3fn dot on v6e (jax's tpu_info gives
  it v6e's bf16 rate, so the bench credits no speedup), and v4 rejects 8-bit dots outright."""
  _raw_narrow_gmm("v6e", "float8_e4m3fn")
  # NOTE: jax re-raises Mosaic's compile error as a MosaicError (a JaxRuntimeError subclass when
  # raised by the compiler, a Python-side wrapper here); match the message, not the class.
  with pytest.raises(Exception, match="CompileTimeMosaicUnsupportedRhsType"):
    _raw_narrow_gmm("v4", "int8")


@pytest.mark.aot
@pytest.mark.parametrize(
  "gen, dtype, token",
  [("v5e", "int8", False), ("v6e", "int8", False), ("tpu7x", "float8_e4m3fn", False),
   ("v5e", "int8", True)],
  ids=["v5e-int8", "v6e-int8", "tpu7x-fp8", "v5e-int8-token"],
)  # fmt: skip
def test_quantized_tgmm_compiles_aot(gen, dtype, token):
  """Both tgmm operands quantized: per-channel scales (narrow dot), or per-token lhs scales
  (upcast, scaled in VMEM before the dot)."""
  from test_aot import _compile, _sds

  k, m, n, g = 512, 1024, 768, 4
  narrow = jnp.dtype(dtype)
  args = (
    _sds(gen, k, m, dtype=narrow), _sds(gen, m, n, dtype=narrow),
    _sds(gen, 1, m, dtype=F32) if token else _sds(gen, k, 1, dtype=F32),
    _sds(gen, 1, n, dtype=F32), _sds(gen, g, dtype=jnp.int32),
  )  # fmt: skip

  def fn(a, b, a_s, b_s, gs):
    return pallas_moe.tgmm(a, b, gs, lhs_scales=a_s, rhs_scales=b_s)

  compiled = _compile(gen, fn, *args)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
  with tiling.use_generation(gen):
    dots = _kernel_dot_dtypes(fn, *args)
  if not token and _narrow_expected(dtype, gen):
    assert dots == {(dtype, dtype, "int32" if dtype == "int8" else "float32")}
  else:
    assert dots == {("bfloat16", "bfloat16", "float32")}


@pytest.mark.aot
@pytest.mark.parametrize("gen, dtype", [("v6e", "int8"), ("tpu7x", "float8_e4m3fn")])
def test_quantized_tgmm_compiles_aot_for_odd_shapes(gen, dtype):
  """k, m, n = 200, 150, 130 (the visit kernel; m-tile = all of m): the sub-block index is
  static (a traced offset into the lane dim of the [tk, 150] lhs block does not compile)."""
  from test_aot import _compile, _sds

  k, m, n, g = 200, 150, 130, 3
  narrow = jnp.dtype(dtype)
  args = (
    _sds(gen, k, m, dtype=narrow), _sds(gen, m, n, dtype=narrow), _sds(gen, k, 1, dtype=F32),
    _sds(gen, 1, n, dtype=F32), _sds(gen, g, dtype=jnp.int32),
  )  # fmt: skip

  def fn(a, b, a_s, b_s, gs):
    return pallas_moe.tgmm(a, b, gs, lhs_scales=a_s, rhs_scales=b_s)

  assert _compile(gen, fn, *args).as_text().count('custom_call_target="tpu_custom_call"') == 1


def test_narrow_forward_tiles_use_the_narrow_rate():
  """w8a8 on v6e (int8 MXU at twice the bf16 rate): the forward's tiles are scored on the 8-bit
  operands at the int8 rate. On a mixtral-like layer (m = 65536, k = 4096, n = 7168, G = 8) that
  picks other tiles than bf16 (fewer, larger steps once the MXU time per step halves), which
  model faster at the int8 rate; ops resolves the same tiles."""
  from pallas_moe import ops

  m, k, n, g = 65536, 4096, 7168, 8
  kw = dict(m=m, k=k, n=n, num_groups=g, kind="gmm", out_dtype=jnp.bfloat16, generation="v6e")
  bf16 = tiling.pick_rowtile_tiling(lhs_dtype=jnp.bfloat16, rhs_dtype=jnp.bfloat16, **kw)
  int8 = tiling.pick_rowtile_tiling(lhs_dtype=jnp.int8, rhs_dtype=jnp.int8, narrow_dot=True, **kw)
  assert int8 != bf16
  sizes = np.random.default_rng(0).multinomial(m, np.full(g, 1 / g))

  def seconds_at_int8(tiles):  # at the better of fixed and pass-cut tiles, as the picker scores
    tm, tk, tn = tiles
    return min(
      tiling.rowtile_modeled_seconds(
        group_sizes=sizes, k=k, n=n, tm=tm, tk=tk, tn=tn, kind="gmm", lhs_itemsize=1,
        rhs_itemsize=1, out_itemsize=2, generation="v6e",
        peak_flops=tiling.narrow_peak("v6e", jnp.int8), fixed_tiles=fixed,
      )
      for fixed in (True, False)
    )  # fmt: skip

  assert seconds_at_int8(int8) < seconds_at_int8(bf16)
  with tiling.use_generation("v6e"):
    resolved = ops._resolve_tiles(
      None,
      dims=(m, k, n),
      kind="gmm",
      num_groups=g,
      dtypes=(jnp.dtype(jnp.int8), jnp.dtype(jnp.int8), jnp.dtype(jnp.bfloat16)),
      interpret=None,
      narrow_dot=True,
    )
  assert resolved.tiles == int8
  with pytest.raises(ValueError, match="no native float8_e4m3fn MXU mode"):
    tiling.narrow_peak("v6e", jnp.float8_e4m3fn)
