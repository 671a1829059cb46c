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
from kernel_testing import INTERPRET_MODES, examples, group_sizes_strategy, random_array

import pallas_moe
from pallas_moe import MoEConfig, moe, reference, tiling

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantization_error_vs_bf16(dtype):
  """Relative Frobenius error of the int8/fp8 gmm vs the same gmm with bf16 weights."""
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

  err_q, err_bf16 = rel(out_q), rel(out_bf16)
  print(
    f"\n{dtype}: rel. Frobenius error vs f32 weights {err_q:.4%} (bf16 weights: {err_bf16:.4%})"
  )
  assert err_q < _ERROR_BOUNDS[dtype]


# --- gradients ---------------------------------------------------------------------------------


def _ste_reference(x, w, gs, *, dtype, transpose_rhs, group_offset):
  """jnp straight-through reference: forward with dequantize(quantize(w)), identity grad in w."""
  q = pallas_moe.quantize(w, dtype=dtype, axis=_quant_axis(transpose_rhs))
  w_q = w + jax.lax.stop_gradient(pallas_moe.dequantize(q) - w)
  return reference.gmm(x, w_q, gs, group_offset=group_offset, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
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
  dx, dw = jax.grad(ours, (0, 1))(x, w)
  rdx, rdw = jax.grad(ref, (0, 1))(x, w)
  tol = dict(rtol=2e-5, atol=1e-4 * np.sqrt(max(m, n, k)))
  np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), **tol)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(rdw), **tol)
  assert dw.dtype == w.dtype and dw.shape == w.shape

  # Frozen QuantizedWeights: the same lhs gradient; the weights get a zero cotangent.
  frozen = loss_of(lambda x, q: pallas_moe.gmm(x, q, gs, tiling=tiles, interpret=True, **kw))
  fdx, fdq = jax.grad(frozen, (0, 1), allow_int=True)(x, q)
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
  compiled = _aot_compile(gen, dtype, grad=False)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
  compiled = _aot_compile(gen, dtype, grad=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3


# --- MoEConfig -------------------------------------------------------------------------------

_BASE = dict(num_experts=4, top_k=2, d_model=64, expert_ffn_dim=32)


@pytest.mark.parametrize("raw, want", [("", None), (None, None), ("int8", "int8"), ("fp8", "fp8")])
def test_config_maps_maxtext_quantization(raw, want):
  assert MoEConfig.from_dict({**_BASE, "quantization": raw}).weight_quantization == want


def test_config_refuses_other_quantizations():
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


# --- bench ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["fwd", "dlhs"])
def test_bench_int8_moves_fewer_weight_bytes(op):
  """The bench's pallas_moe-int8 case reads the weights at 1 byte/element plus f32 scales."""
  from bench import costmodel as cm
  from bench.impls import IMPLS
  from bench.shapes import Shape

  shape = Shape(name="tiny", tokens=1024, top_k=1, num_groups=4, k=256, n=384)
  gs = np.array([300, 0, 500, 100], np.int32)
  v5e = tiling.get_generation("v5e")
  (bf16,) = cm.analyze(*_case_call(IMPLS["pallas_moe-visits"], op, shape, gs, v5e))
  (int8,) = cm.analyze(*_case_call(IMPLS["pallas_moe-int8"], op, shape, gs, v5e))
  assert bf16.grid == int8.grid
  w_key, s_key = "in1:args[7]", "in2:args[8]"
  # The weight blocks fetched are the same; int8 halves their bytes. Scales: one f32 per column
  # of each fetched group (here the tiles span k and n: the 3 non-empty groups, once each).
  assert int8.operand_bytes[w_key] * 2 == bf16.operand_bytes[w_key]
  assert int8.operand_bytes[s_key] == 3 * shape.n * 4
  for key in ("in0:args[6]", "out0:outputs"):
    assert int8.operand_bytes[key] == bf16.operand_bytes[key]
  print(f"\n{op}: HBM bytes bf16 {bf16.hbm_bytes:,} int8 {int8.hbm_bytes:,}")


def _case_call(impl, op, shape, gs, gen):
  case = impl.build(op=op, shape=shape, group_sizes=gs, generation=gen)
  return case.fn, *case.args


@pytest.mark.aot
def test_quantized_grad_transposed_layout_compiles_aot():
  """[G, n, k] weights: the dlhs kernel reads [tk, 1] scale blocks (a column vector)."""
  compiled = _aot_compile("v6e", "int8", grad=True, transpose_rhs=True)
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3
