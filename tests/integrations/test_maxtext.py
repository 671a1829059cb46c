"""`pallas_moe.maxtext`: MaxText's megablox call verbatim; its sparse_matmul on a CPU mesh.

Part 1 checks every argument of MaxText's `kernels/megablox/ops.gmm` (maxtext 0.2.5 and commit
e591f30) against the references: 0.2.5's verbatim calls, int and fp8 quantization with qwix's
rule and MaxText's gradients, qwix without a rule, refused and unknown arguments.
Part 2 (the seed scenario) re-writes MaxText's `RoutedMoE.sparse_matmul` path with `megablox=True`
and expert parallelism (`layers/moe.py` at `maxtext.MAXTEXT_COMMIT`: `permute`, `ra2a_and_route`
with `get_all_to_all_params` and `local_permute`, `gmm_up`, the wo gmm, `unsort_output_and_ra2a`,
`unpermute`) with its two imports swapped for `pallas_moe.maxtext`, and trains it (forward and
`jax.grad`) on 8 CPU devices, data 2 x expert 4, with a scaled-down deepseek2-16b config. The same
program with JAX's own `jax.lax.ragged_all_to_all` does not compile on CPU: asserted too.
(tests/integrations/test_maxtext_layer.py runs MaxText 0.2.5's own layer on Python >= 3.12.)
"""

from __future__ import annotations

import functools
import math
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_moe
from pallas_moe import maxtext as mblx
from pallas_moe import reference

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST


def _close(a, b, *, tol=1e-4):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  scale = max(1.0, float(np.abs(b).max()))
  np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


# --- Part 1: the adapter, argument by argument ---------------------------------------------------

M, K, N, G = 40, 64, 256, 4
GROUP_SIZES = np.array([10, 0, 17, 9], np.int32)  # 36 of 40 rows: 4 rows past the groups


def _operands(*, transpose_rhs=False):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (M, K), F32)
  w = jax.random.normal(kw, (G, N, K) if transpose_rhs else (G, K, N), F32)
  return x, w, jnp.asarray(GROUP_SIZES)


def test_maxtext_call_forms_run_and_match_reference():
  """MaxText's call forms (tiling by keyword or position, `use_qwix_quantization`), ignored args."""
  x, w, gs = _operands()
  want = reference.gmm(x, w, gs, F32)
  _close(mblx.gmm(x, w, gs, F32, tiling=(128,) * 9), want)
  _close(mblx.gmm(x, w, gs, F32, (128,) * 9, use_qwix_quantization=False), want)
  ignored = mblx.gmm(
    x,
    w,
    gs,
    tiling=(128,) * 9,
    use_tokamax_backend=True,
    use_gmm_v2=True,
    use_gmm_v2_heuristic_tiling=True,
    input_buffer_count=(3, 3, 3),
    combine_scopes=True,
    qwix_rule=object(),  # MaxText ignores it too without use_qwix_quantization
    use_manual_quantization=True,  # no quantization: nothing to do
    lhs_vma_axes=(),
    rhs_vma_axes=(),
  )
  assert ignored.dtype == F32  # MaxText's default preferred_element_type
  _close(ignored, want)


def test_maxtext_0_2_5_calls_verbatim():
  """layers/moe.py's keyword call in MaxText 0.2.5, and ops.gmm's 0.2.5 positional order."""
  x, w, gs = _operands()
  partial = jnp.sin(jnp.arange(M * N, dtype=F32)).reshape(M, N)
  want = reference.gmm(x, w, gs, F32)
  # NOTE: the call of MaxText 0.2.5's RoutedMoE.sparse_matmul (no quantization, megablox).
  out = mblx.gmm(
    lhs=x,
    rhs=w,
    group_sizes=gs,
    preferred_element_type=F32,
    tiling=(128,) * 9,
    group_offset=None,
    lhs_quantize_dtype=None,
    rhs_quantize_dtype=None,
    use_qwix_quantization=False,
    use_tokamax_backend=False,
    weight_gather_axes=[],
    lhs_vma_axes=(),
    rhs_vma_axes=(),
    use_gmm_v2=False,
    use_gmm_v2_heuristic_tiling=False,
    partial_sum=partial,
    interpret=True,
  )
  _close(out, want + partial)
  # 0.2.5's positional order: ..., qwix_rule, use_manual_quantization, use_gmm_v2,
  # use_gmm_v2_heuristic_tiling, partial_sum.
  positional = (x, w, gs, F32, (128,) * 9, None, None, False, None, None, None, False, False, None)
  positional += ((), (), None, False, False, True, partial)
  _close(mblx.gmm(*positional), want + partial)
  # e591f30's position 20 is partial_sum: refused there, with the keyword to use.
  with pytest.raises(TypeError, match="pass `partial_sum` by keyword"):
    mblx.gmm(*positional[:19], partial)


def test_unknown_keyword_names_supported_maxtext_versions():
  x, w, gs = _operands()
  with pytest.raises(TypeError, match=r"`use_gmm_v3`.*MaxText 0\.2\.5.*e591f30"):
    mblx.gmm(x, w, gs, use_gmm_v3=True)
  assert mblx.MAXTEXT_VERSION == "0.2.5" and mblx.MAXTEXT_COMMIT.startswith("e591f30")


def test_qwix_quantization_without_rule_is_unquantized(monkeypatch):
  """use_qwix_quantization: MaxText's rule is qwix_rule, else qwix's current rule for "gmm";
  with none (quantization 'fp8' / 'int8' under qwix) the gmm runs unquantized, quantize dtypes
  unused. A rule, explicit or intercepted, is refused."""
  x, w, gs = _operands()
  want = reference.gmm(x, w, gs, F32)
  out = mblx.gmm(
    x, w, gs, F32, lhs_quantize_dtype=jnp.int8, rhs_quantize_dtype=jnp.int8,
    use_qwix_quantization=True,
  )  # fmt: skip
  _close(out, want)
  with pytest.raises(ValueError, match="use_qwix_quantization=True` with a qwix rule.*'fp8'"):
    mblx.gmm(x, w, gs, use_qwix_quantization=True, qwix_rule=object())
  try:
    import qwix.pallas as qpl
  except ImportError:  # NOTE: without qwix there is no interception: no rule.
    assert mblx._current_qwix_rule() is None
  else:
    assert mblx._current_qwix_rule() is None  # not intercepted
    asked = []
    monkeypatch.setattr(qpl, "get_current_rule", lambda op: asked.append(op) or "QtRule")
    with pytest.raises(ValueError, match="qwix rule"):
      mblx.gmm(x, w, gs, use_qwix_quantization=True)
    assert asked == ["gmm"]
  monkeypatch.setattr(mblx, "_current_qwix_rule", lambda: "QtRule")
  with pytest.raises(ValueError, match="qwix rule"):
    mblx.gmm(x, w, gs, use_qwix_quantization=True)
  _close(mblx.gmm(x, w, gs, use_qwix_quantization=False), want)  # not consulted without it


def test_tiling_nine_ints_map_to_passes():
  """tiling[3:6] are dlhs tiles over (m, n, k), as MaxText hands them to its transposed gmm."""
  t = mblx.maxtext_tiling((1, 2, 3, 4, 5, 6, 7, 8, 9))
  assert t == pallas_moe.Tiling(fwd=(1, 2, 3), dlhs=(4, 5, 6), drhs=(7, 8, 9))
  assert mblx.maxtext_tiling(None) is None and mblx.maxtext_tiling([8, 128, 128]) == (8, 128, 128)
  x, w, gs = _operands()
  # NOTE: dlhs tn = 64 is legal over k = 64 but not over n = 256: read in the wrong coordinates
  # (m, k, n), this tiling is refused, so running it shows MaxText's order is kept.
  tiles = (16, 64, 128, 16, 128, 64, 128, 8, 128)
  with pytest.raises(ValueError, match="tn=64"):
    pallas_moe.gmm(x, w, gs, F32, pallas_moe.Tiling(fwd=tiles[3:6]))

  # NOTE: test_quantized_forward_and_grads_follow_maxtext runs these tiles, with gradients.


MAXTEXT_BASE_TILES = (512, 1024, 1024) * 3  # base.yml's 18 wi_tile_* / wo_tile_* keys


def _kernels(plans):
  return [(p.op, name, kt.kernel, kt.tiles) for p in plans for name, kt in p.kernels]


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_maxtext_tiling_is_not_used_unless_asked(chip):
  """MaxText's 9 ints give pallas_moe's own plan; honoured only with honour_tiling (or the
  module `with_maxtext_tiles`), then the triples map to the passes. Checked per chip on the
  plans the calls trace (what a compiled program runs), at dims where MaxText's tk < k."""
  x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((8, 2048, 1408), jnp.bfloat16)
  gs = jax.ShapeDtypeStruct((8,), jnp.int32)
  tuned = (1024, 512, 1024, 512, 1024, 512, 1024, 512, 512)  # a recipe's non-default values

  def traced(fn, tiling, **kw):
    with pallas_moe.record_plans() as plans:
      jax.eval_shape(
        lambda a, b, c: jax.grad(
          lambda a, b: fn(a, b, c, tiling=tiling, **kw).astype(F32).sum(), (0, 1)
        )(a, b),
        x,
        w,
        gs,
      )
    return _kernels(plans)

  with pallas_moe.tiling.use_generation(chip):
    # NOTE: the plan of the call the switch makes: MaxText's f32 output, and the rows past
    # sum(group_sizes) undefined since w holds every group (`maxtext._unowned_rows`).
    plan = functools.partial(
      pallas_moe.gmm_plan, preferred_element_type=F32, unowned_rows="undefined"
    )
    own = _kernels([plan(x, w, gs)])
    honoured = _kernels([plan(x, w, gs, tiling=mblx.maxtext_tiling(tuned))])
    assert traced(mblx.gmm, MAXTEXT_BASE_TILES) == own
    assert traced(mblx.gmm, tuned) == own  # non-default values are not a request either
    assert traced(mblx.gmm, tuned, honour_tiling=True) == honoured
    assert traced(mblx.with_maxtext_tiles.gmm, tuned) == honoured
    # The quantized configs (int8 weights and activations: MaxText's quantization="int8") too.
    quantized = dict(lhs_quantize_dtype=jnp.int8, rhs_quantize_dtype=jnp.int8)
    own_q = traced(mblx.gmm, tuned, **quantized)
    honoured_q = traced(mblx.gmm, tuned, honour_tiling=True, **quantized)
  assert {t for *_, t in own_q}.isdisjoint({tuned[0:3], tuned[3:6], tuned[6:9]})
  # NOTE: the quantized VJP traces its frozen-weights gmm again for dlhs: two gmm plans.
  assert {k for _, name, k, _ in own_q if name == "fwd"} == {"pallas_moe_gmm_rowtile"}
  assert {t for _, name, _, t in honoured_q if name == "fwd"} == {tuned[0:3]}
  # pallas_moe's own picks run the row-tile kernels here; MaxText's tiles (tk < k) do not.
  assert {k for _, _, k, _ in own} == {"pallas_moe_gmm_rowtile", "pallas_moe_tgmm_rowtile"}
  assert [t for *_, t in honoured] == [(1024, 512, 1024), (512, 1024, 512), (1024, 512, 512)]
  assert {k for _, _, k, _ in honoured} == {"pallas_moe_gmm", "pallas_moe_tgmm"}


def test_maxtext_tiling_choice_is_logged_and_checked(caplog):
  """Each call logs its kernels, tiles and why at INFO; a malformed tiling is refused even when
  it would not be used; honour_tiling must be a bool; swap_into's switch picks the module."""
  x, w, gs = _operands()
  with caplog.at_level("INFO", logger="pallas_moe.maxtext"):
    jax.eval_shape(lambda a, b: mblx.gmm(a, b, gs, F32, MAXTEXT_BASE_TILES), x, w)
  text = caplog.text
  assert "MaxText's tiling (512, 1024, 1024, 512," in text and "not used" in text
  assert "fwd  pallas_moe_gmm_rowtile" in text and "row-tile model" in text
  caplog.clear()
  with caplog.at_level("INFO", logger="pallas_moe.maxtext"):
    jax.eval_shape(
      lambda a, b: mblx.with_maxtext_tiles.gmm(
        a, b, gs, F32, (16, 64, 128, 16, 128, 64, 128, 64, 128)
      ),
      x,
      w,
    )
  assert "honoured" in caplog.text and "tk = 128 < k = 256" in caplog.text
  with pytest.raises(ValueError, match="9 ints"):
    mblx.gmm(x, w, gs, F32, (512, 1024, 1024, 512))
  with pytest.raises(TypeError, match="honour_tiling"):
    mblx.gmm(x, w, gs, F32, MAXTEXT_BASE_TILES, honour_tiling="yes")
  module = types.SimpleNamespace(mblx="stock", jax=jax)
  mblx.swap_into(module)
  assert module.mblx is mblx
  mblx.swap_into(module, honour_tiling=True)
  assert module.mblx is mblx.with_maxtext_tiles and module.mblx.ragged_all_to_all is not None


def _qwix_dequantized(x, bits: int, channel_axes) -> jax.Array:
  """qwix absmax (MaxText's AQT-style rule) written out: quantized, then dequantized, in f32.

  NOTE: in jnp, not numpy: an absmax element divided by its scale lands within an ulp of the
  tie qmax + 0.5, and whether it rounds to -128 or -127 depends on the backend's division (qwix
  uses jnp.divide too). Ties exactly at the bound are checked in test_quantize_absmax_is_qwix_rule.
  """
  axes = tuple(a for a in range(x.ndim) if a not in channel_axes)
  scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / (2 ** (bits - 1) - 0.5)
  scale = jnp.where(scale == 0, 1.0, scale)
  values = jnp.clip(jnp.round(x / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
  return values * scale


def test_quantize_absmax_is_qwix_rule():
  """scale = absmax / (qmax + 0.5); round half to even; saturate: -absmax -> -128, +absmax -> 127.

  (Ties exactly at the bound: the scale is 1.)
  """
  x = jnp.array([[-127.5, 64.0, 127.5, 0.5], [0.0, 0.0, 0.0, 0.0], [3.0, -0.1, 0.7, -3.0]], F32)
  values, scales = mblx.quantize_absmax(x, dtype=jnp.int8, channel_axes=(0,))
  assert values.dtype == jnp.int8 and scales.shape == (3, 1)
  assert float(scales[0, 0]) == 1.0
  np.testing.assert_array_equal(values[0], [-128, 64, 127, 0])
  np.testing.assert_array_equal(values[1], 0)  # an all-zero row: scale 1
  assert float(scales[1, 0]) == 1.0
  v4, s4 = mblx.quantize_absmax(x, dtype="int4", channel_axes=(1,))
  assert s4.shape == (1, 4) and int(v4.min()) >= -8 and int(v4.max()) <= 7
  np.testing.assert_allclose(v4 * s4, _qwix_dequantized(x, 4, (1,)), rtol=1e-6)


def _grads_against_reference(
  x, w, gs, existing, x_deq, w_deq, *, tiling, offset, transpose_rhs, **quantize
):
  """(value, grads) of sum(mblx.gmm(...) * cot) and of the float reference on the dequantized
  operands (grads over x, w and, when given, existing_out), and that reference loss itself."""
  cot = jnp.cos(jnp.arange(M * N, dtype=F32)).reshape(M, N)

  def got(x, w, existing):
    # NOTE: MaxText's tiles honoured, so that their pass order is exercised with gradients.
    out = mblx.gmm(
      x, w, gs, F32, tiling, offset, existing, transpose_rhs, honour_tiling=True, **quantize
    )
    return jnp.sum(out * cot)

  def want(x, w, existing):
    out = reference.gmm(x, w, gs, F32, offset, existing, transpose_rhs=transpose_rhs)
    return jnp.sum(out * cot)

  argnums = (0, 1) if existing is None else (0, 1, 2)
  value, grads = jax.jit(jax.value_and_grad(got, argnums=argnums))(x, w, existing)
  value_ref, grads_ref = jax.value_and_grad(want, argnums=argnums)(x_deq, w_deq, existing)
  return value, grads, value_ref, grads_ref, want


QUANT_CASES = {
  # lhs and rhs int8, an expert shard (group_offset 1, 3 of 4 groups) chained with existing_out
  "w8a8-shard": dict(lhs_q=jnp.int8, rhs_q=jnp.int8, transpose_rhs=False, shard=True),
  # int4 weights, transposed layout [G, n, k]: the weight scales are per n, axis 1
  "w4-transposed": dict(lhs_q=None, rhs_q=jnp.int4, transpose_rhs=True, shard=False),
  # int4 activations with float weights: the weight gradient sees the quantized lhs
  "a4": dict(lhs_q=jnp.int4, rhs_q=None, transpose_rhs=False, shard=False),
}


@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_forward_and_grads_follow_maxtext(case):
  """Forward on dequantized operands; dlhs = dout @ deq(rhs)^T, drhs = deq(lhs)^T @ dout."""
  lhs_q, rhs_q, transpose_rhs, shard = QUANT_CASES[case].values()
  x, w, gs = _operands(transpose_rhs=transpose_rhs)
  offset = 1 if shard else 0
  w = w[offset:]
  existing = jax.random.normal(jax.random.key(3), (M, N), F32) if shard else None
  bits = {None: None, jnp.int8: 8, jnp.int4: 4}
  x_deq = x if lhs_q is None else _qwix_dequantized(x, bits[lhs_q], (0,))
  channel = (1,) if transpose_rhs else (2,)
  w_deq = w if rhs_q is None else _qwix_dequantized(w, bits[rhs_q], channel)
  value, grads, value_ref, grads_ref, want = _grads_against_reference(
    x, w, gs, existing, x_deq, w_deq,
    tiling=(16, 64, 128, 16, 128, 64, 128, 64, 128), offset=offset, transpose_rhs=transpose_rhs,
    lhs_quantize_dtype=lhs_q, rhs_quantize_dtype=rhs_q,
  )  # fmt: skip
  _close(value, value_ref)
  for a, b in zip(grads, grads_ref, strict=True):
    _close(a, b)
  # NOTE: the quantization is real: the float operands give a different value.
  assert abs(float(want(x, w, existing)) - float(value)) > 1e-3 * abs(float(value))


def _qwix_fp8(x, channel_axes):
  """qwix absmax to float8_e4m3fn written out (scale in x's dtype), dequantized exactly in f32."""
  axes = tuple(a for a in range(x.ndim) if a not in channel_axes)
  scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / jnp.asarray(448.0, x.dtype)
  scale = jnp.where(scale < jnp.sqrt(jnp.finfo(x.dtype).tiny), jnp.ones_like(scale), scale)
  max_ = jnp.asarray(448.0, x.dtype)
  values = jnp.clip(x / scale, -max_, max_).astype(jnp.float8_e4m3fn)
  return values, scale


def test_quantize_absmax_fp8_is_qwix_rule():
  """fp8: scale = absmax / 448 in x's dtype; x / scale clipped and cast; as qwix (if present)."""
  x, w, _ = _operands()
  for dtype in (F32, jnp.bfloat16):
    for a, axes in ((x.astype(dtype), (0,)), (w.astype(dtype), (2,))):
      values, scales = mblx.quantize_absmax(a, dtype="float8_e4m3fn", channel_axes=axes)
      want_v, want_s = _qwix_fp8(a, axes)
      assert values.dtype == jnp.float8_e4m3fn and scales.dtype == dtype
      # NOTE: exact on purpose: a max (order-free), one correctly rounded division, a clip and
      # a cast per element, the same IEEE operations as qwix's; no sum whose order could vary.
      np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(want_v, np.float32))
      np.testing.assert_array_equal(np.asarray(scales, np.float32), np.asarray(want_s, np.float32))
      assert float(jnp.max(jnp.abs(values.astype(F32)))) == 448.0
      try:
        import qwix.pallas as qpl
      except ImportError:
        continue
      q = qpl.quantize(
        a, jnp.float8_e4m3fn, channelwise_axes=list(axes), calibration_method="absmax"
      )
      np.testing.assert_array_equal(
        np.asarray(values, np.float32), np.asarray(q.qvalue, np.float32)
      )
      np.testing.assert_array_equal(np.asarray(scales, np.float32), np.asarray(q.scale, np.float32))


FP8_CASES = {
  # f32 operands, an expert shard chained with existing_out
  "f32-shard": dict(dtype=F32, transpose_rhs=False, shard=True),
  # bf16 operands (MaxText's usual), weights [G, n, k]
  "bf16-transposed": dict(dtype=jnp.bfloat16, transpose_rhs=True, shard=False),
}


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_forward_and_grads_follow_maxtext(case):
  """quantization='fp8': float8_e4m3fn activations (per row) and weights (per output channel) run
  pallas_moe's fp8 kernels; out = deq(lhs) @ deq(rhs) in f32; dlhs = dout @ deq(rhs)^T and
  drhs = deq(lhs)^T @ dout (MaxText's _gmm_bwd)."""
  dtype, transpose_rhs, shard = FP8_CASES[case].values()
  x, w, gs = _operands(transpose_rhs=transpose_rhs)
  offset = 1 if shard else 0
  x, w = x.astype(dtype), w[offset:].astype(dtype)
  existing = jax.random.normal(jax.random.key(3), (M, N), F32) if shard else None
  xv, xs = _qwix_fp8(x, (0,))
  wv, ws = _qwix_fp8(w, (1,) if transpose_rhs else (2,))
  x_deq = xv.astype(F32) * xs.astype(F32)
  w_deq = wv.astype(F32) * ws.astype(F32)
  value, grads, value_ref, grads_ref, want = _grads_against_reference(
    x, w, gs, existing, x_deq, w_deq,
    tiling=None, offset=offset, transpose_rhs=transpose_rhs,
    lhs_quantize_dtype=jnp.float8_e4m3fn, rhs_quantize_dtype="float8_e4m3fn",
  )  # fmt: skip
  _close(value, value_ref)
  assert grads[0].dtype == dtype and grads[1].dtype == dtype
  # NOTE: bf16 gradients are bf16 results (MaxText's too): one rounding, 2**-8.
  tol = 1e-4 if dtype == F32 else 1e-2
  for a, b in zip(grads, grads_ref, strict=True):
    _close(a, b, tol=tol)
  # NOTE: the quantization is real: the float operands give a different value.
  plain = float(want(x.astype(F32), w.astype(F32), existing))
  assert abs(plain - float(value)) > 1e-3 * abs(float(value))


def test_weight_gather_partial_sum_vma_axes_in_shard_map():
  """weight_gather_axes all-gathers the weights (gradient reduce-scattered back), partial_sum is
  added, lhs_vma_axes marks the output varying; on a 2-device mesh."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  x, w, gs = _operands()
  w = w[1:]  # an expert shard: groups 1..3 of 4
  k1, k2 = jax.random.split(jax.random.key(4))
  existing = jax.random.normal(k1, (M, N), F32)
  partial = jax.random.normal(k2, (M, N), F32)
  cot = jnp.cos(jnp.arange(2 * M * N, dtype=F32)).reshape(2 * M, N)
  seen = []

  def body(x, w_shard, existing, partial):
    out = mblx.gmm(
      x, w_shard, gs, F32, None, 1, existing, weight_gather_axes=[("fsdp", 2)],
      lhs_vma_axes=("fsdp",), rhs_vma_axes=("fsdp",), partial_sum=partial,
    )  # fmt: skip
    seen.append(jax.typeof(out))
    return out

  sharded = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P(), P(None, None, "fsdp"), P(), P()),
    out_specs=P("fsdp"),
    check_vma=True,
  )

  def got(*args):
    return jnp.sum(sharded(*args) * cot)

  def want(x, w, existing, partial):
    out = reference.gmm(x, w, gs, F32, 1, existing) + partial
    return jnp.sum(jnp.concatenate([out, out]) * cot)

  args = (x, w, existing, partial)
  value, grads = jax.jit(jax.value_and_grad(got, argnums=(0, 1, 2, 3)))(*args)
  value_ref, grads_ref = jax.value_and_grad(want, argnums=(0, 1, 2, 3))(*args)
  assert "fsdp" in str(seen[0])  # varying over fsdp: lhs_vma_axes
  _close(value, value_ref)
  for a, b in zip(grads, grads_ref, strict=True):
    _close(a, b)


def test_refused_arguments_say_what_to_use():
  x, w, gs = _operands()
  with pytest.raises(ValueError, match="use_qwix_quantization.*lhs_quantize_dtype"):
    mblx.gmm(x, w, gs, use_qwix_quantization=True, qwix_rule=object())
  with pytest.raises(ValueError, match="rhs_quantize_dtype.*int8, jnp.int4 or jnp.float8_e4m3fn"):
    mblx.gmm(x, w, gs, rhs_quantize_dtype=jnp.float8_e5m2)
  # NOTE: MaxText's quantization='nanoo_fp8' (AMD GPUs): no TPU e4m3fnuz, not an e4m3fn subset.
  for fnuz in (jnp.float8_e4m3fnuz, "float8_e4m3fnuz"):
    with pytest.raises(ValueError, match="e4m3fnuz.*cannot be re-encoded losslessly"):
      mblx.gmm(x, w, gs, lhs_quantize_dtype=fnuz, rhs_quantize_dtype=fnuz)

  class QArray:  # qwix's pre-quantized operand (moe_quantize_token_all_gather)
    qvalue, scale = x, None

  with pytest.raises(ValueError, match="QArray.*moe_quantize_token_all_gather"):
    mblx.gmm(QArray(), w, gs)
  with pytest.raises(ValueError, match="use_manual_quantization"):
    mblx.gmm(x, w, gs, lhs_quantize_dtype=jnp.int8, use_manual_quantization=True)
  with pytest.raises(ValueError, match="9 ints"):
    mblx.gmm(x, w, gs, tiling=(128,) * 6)
  with pytest.raises(TypeError, match="must be ints"):
    mblx.gmm(x, w, gs, tiling=(128,) * 8 + (128.0,))
  with pytest.raises(ValueError, match="weight_gather_axes.*mesh axis name"):
    mblx.gmm(x, w, gs, weight_gather_axes=[("fsdp", 3)])
  with pytest.raises(ValueError, match="lhs_vma_axes"):
    mblx.gmm(x, w, gs, lhs_vma_axes="expert")
  with pytest.raises(ValueError, match="partial_sum"):
    mblx.gmm(x, w, gs, partial_sum=jnp.zeros((M, N + 1), F32))
  assert mblx.ragged_all_to_all is pallas_moe.ragged_all_to_all


@pytest.mark.aot
def test_aot_int4_weights_compile_for_v6e():
  """int4 weights on TPU: Mosaic compiles a kernel reading an int4 weight block (so a native int4
  path is possible); the adapter's int4 path (int4 values held as int8) compiles for v6e too."""
  from jax.experimental import pallas as pl
  from jax.experimental import topologies

  from pallas_moe import tiling

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  device = topologies.get_topology_desc(topology_name="v6e:2x2", platform="tpu").devices[0]
  mesh = Mesh(np.array([device]), ("x",))

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

  def int4_block(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...].astype(x_ref.dtype), preferred_element_type=F32)

  native = pl.pallas_call(int4_block, out_shape=jax.ShapeDtypeStruct((256, 256), F32))

  def adapter(x, w, gs):
    return mblx.gmm(x, w, gs, F32, rhs_quantize_dtype=jnp.int4)

  with tiling.use_generation("v6e"), jax.default_device(device):
    jax.jit(native).lower(sds((256, 512), jnp.bfloat16), sds((512, 256), jnp.int4)).compile()
    compiled = (
      jax.jit(adapter)
      .lower(sds((256, 512), jnp.bfloat16), sds((4, 512, 256), jnp.bfloat16), sds((4,), jnp.int32))
      .compile()
    )
  # NOTE: the gmm kernel alone: rows outside the groups are undefined, as in megablox (no fill).
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
  assert "pallas_moe_zero_fill" not in compiled.as_text()


@pytest.mark.aot
def test_aot_fp8_forward_and_grads_compile_for_v5e_and_tpu7x():
  """quantization='fp8' on TPU: the forward (fp8 x fp8), dlhs and drhs kernels compile with fp8
  operands for v5e (no fp8 MXU: upcast in VMEM) and tpu7x (fp8 MXU)."""
  from jax.experimental import topologies

  from pallas_moe import tiling

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  fp8 = jnp.float8_e4m3fn

  def loss(x, w, gs):
    out = mblx.gmm(x, w, gs, F32, lhs_quantize_dtype=fp8, rhs_quantize_dtype=fp8)
    return jnp.sum(out)

  for generation, topology in (("v5e", "v5e:2x2"), ("tpu7x", "tpu7x:2x2x1")):
    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    mesh = Mesh(np.array([device]), ("x",))

    def sds(shape, dtype, mesh=mesh):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    args = (sds((512, 256), jnp.bfloat16), sds((4, 256, 512), jnp.bfloat16), sds((4,), jnp.int32))
    with tiling.use_generation(generation), jax.default_device(device):
      text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    # NOTE: the lhs-gradient gmm and the weight-gradient tgmm (grad does not use the forward's
    # value, so XLA drops the forward kernel; no zero fill: unowned rows are undefined).
    assert text.count('custom_call_target="tpu_custom_call"') == 2, generation
    assert "pallas_moe_zero_fill" not in text, generation
    assert "f8e4m3fn" in text, generation


# --- Part 2: the seed scenario, MaxText's sparse_matmul with megablox and EP ---------------------

# deepseek2-16b (MaxText's configs/models/deepseek2-16b.yml) with base.yml's MoE keys, scaled
# down: emb 2048 -> 64, moe_mlp 1408 -> 32, batch_seq tiles 512 -> 64. 64 experts, top-6,
# softmax routing, routed_scaling_factor 1.0 and silu x linear are the model's own.
CONFIG = dict(
  num_experts=64,
  num_experts_per_tok=6,
  emb_dim=64,
  moe_mlp_dim=32,
  routed_score_func="softmax",
  routed_scaling_factor=1.0,
  mlp_activations=("silu", "linear"),
  megablox=True,
  sparse_matmul=True,
  capacity_factor=-1.0,
  ragged_buffer_factor=-1.0,
  use_ring_of_experts=False,
  float32_weight_sum=True,
  prefuse_moe_weights=True,
  **{f"{w}_tile_{p}_batch_seq": 64 for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")},
  **{
    f"{w}_tile_{p}_{d}": 1024
    for w in ("wi", "wo")
    for p in ("fwd", "dlhs", "drhs")
    for d in ("embed_dim", "mlp_dim")
  },
)
# NOTE: drhs batch_seq is tgmm's lane-dim tm: a multiple of 128 (MaxText's own default is 512).
CONFIG["wi_tile_drhs_batch_seq"] = CONFIG["wo_tile_drhs_batch_seq"] = 128
BATCH, SEQ = 8, 8  # global; each of the 8 devices holds one sequence of 8 tokens


def _tiles(c, w: str, a: str, b: str):
  """MaxText's get_wi_gmm_params / get_wo_gmm_params: (a, b) = (embed, mlp) or (mlp, embed)."""
  return (
    c[f"{w}_tile_fwd_batch_seq"], c[f"{w}_tile_fwd_{a}"], c[f"{w}_tile_fwd_{b}"],
    c[f"{w}_tile_dlhs_batch_seq"], c[f"{w}_tile_dlhs_{b}"], c[f"{w}_tile_dlhs_{a}"],
    c[f"{w}_tile_drhs_batch_seq"], c[f"{w}_tile_drhs_{a}"], c[f"{w}_tile_drhs_{b}"],
  )  # fmt: skip


def _a2a_params(matrix, shard):
  """MaxText's get_all_to_all_params (batch sharded by expert, no buffer factor).

  `matrix[i, j]`: rows shard i sends to shard j. Offsets into the sender's buffer, and into the
  receiver's (`output_offsets[j]`: rows that shards before this one send to j).
  """
  row = matrix[shard]
  input_offsets = jnp.concatenate([jnp.zeros((1,), row.dtype), jnp.cumsum(row)[:-1]])
  with_zero = jnp.concatenate([jnp.zeros((1, matrix.shape[1]), matrix.dtype), matrix])
  output_offsets = jnp.cumsum(with_zero, axis=0)[shard]
  return input_offsets, row, output_offsets, matrix[:, shard]


def _sparse_matmul(x, gate_scores, w0, w1, wo, *, num_ep, gmm, ragged_all_to_all):
  """One device's MaxText sparse_matmul (megablox, not ring-of-experts), inside shard_map.

  Args:
    x: [B, S, D] this device's tokens.
    gate_scores: [B, S, E] softmax router scores (deepseek2's GateLogit output).
    w0: [E_local, D, F] gate projection (w1: up projection), wo: [E_local, F, D].
    num_ep: size of the "expert" mesh axis.
    gmm: MaxText's `mblx.gmm`.
    ragged_all_to_all: `jax.lax.ragged_all_to_all` in MaxText.
  """
  c = CONFIG
  b, s, d = x.shape
  num_experts, top_k = c["num_experts"], c["num_experts_per_tok"]
  # permute: top-k, then rows sorted by expert (each token repeated top_k times)
  x2 = x.reshape(b * s, d)
  weights, selected = jax.lax.top_k(gate_scores, top_k)
  weights = weights * c["routed_scaling_factor"]  # deepseek_scale_weights for softmax
  flat = selected.reshape(-1)
  sorted_selected = jnp.argsort(flat)
  x = jnp.repeat(x2, top_k, axis=0)[sorted_selected]
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  if num_ep > 1:
    # ra2a_and_route, batch sharded by expert
    shard = jax.lax.axis_index("expert")
    local_experts = num_experts // num_ep
    per_shard = jnp.sum(group_sizes.reshape(-1, local_experts), axis=1)
    all_shards = jax.lax.all_gather(per_shard, axis_name="expert")
    buffer_size = int(x.shape[0] * min(num_ep, num_experts / top_k))  # get_ragged_buffer_size
    x = ragged_all_to_all(
      x,
      jnp.zeros((buffer_size, d), x.dtype),
      *_a2a_params(all_shards, shard),
      axis_name="expert",
    )
    global_group_sizes = jax.lax.all_gather(group_sizes, axis_name="expert")
    # local_permute: received chunks (one per sender, each sorted by expert) -> sorted by expert
    local_sizes = jax.lax.dynamic_slice_in_dim(
      global_group_sizes, shard * local_experts, local_experts, axis=1
    )
    group_sizes = jnp.sum(local_sizes, axis=0)
    expert_ids = jnp.repeat(
      jnp.arange(num_ep * local_experts) % local_experts,
      local_sizes.reshape(-1),
      total_repeat_length=buffer_size,
    )
    local_sorted = jnp.argsort(expert_ids)
    x = x[local_sorted]

  def call(inputs, kernel, tiling):
    # sparse_matmul's gmm(): pad rows to a multiple of wi_tile_fwd_batch_seq, then mblx.gmm
    rows = inputs.shape[0]
    pad = -rows % c["wi_tile_fwd_batch_seq"]
    inputs = jnp.pad(inputs, ((0, pad), (0, 0)))
    out = gmm(
      lhs=inputs,
      rhs=kernel,
      group_sizes=group_sizes,
      preferred_element_type=x.dtype,
      tiling=tiling,
      group_offset=0,
      lhs_quantize_dtype=None,
      rhs_quantize_dtype=None,
      use_qwix_quantization=False,
      use_tokamax_backend=False,
      weight_gather_axes=[],
      use_gmm_v2=False,
      partial_sum=None,
    )
    return out[:rows]

  # gmm_up with prefuse_moe_weights: one gmm over [w0 | w1], split into the two projections
  layer = call(x, jnp.concatenate([w0, w1], axis=-1), _tiles(c, "wi", "embed_dim", "mlp_dim"))
  layer_w0, layer_w1 = jnp.split(layer, 2, axis=-1)
  intermediate = jax.nn.silu(layer_w0) * layer_w1
  out = call(intermediate, wo, _tiles(c, "wo", "mlp_dim", "embed_dim"))
  if num_ep > 1:
    # unsort_output_and_ra2a: back to per-sender chunks, then the reverse exchange
    out = out[jnp.argsort(local_sorted)]
    out = ragged_all_to_all(
      out,
      jnp.zeros((b * s * top_k, d), out.dtype),
      *_a2a_params(all_shards.T, shard),
      axis_name="expert",
    )
  # unpermute: original order, weighted sum over the top-k in f32 (float32_weight_sum)
  out = out[jnp.argsort(sorted_selected)].reshape(b * s, top_k, d)
  y = jnp.einsum("BKE,BK->BE", out.astype(F32), weights.reshape(b * s, top_k).astype(F32))
  return y.reshape(b, s, d).astype(x2.dtype)


def _mesh(num_ep: int) -> Mesh:
  devices = np.array(jax.devices()[:8]).reshape(8 // num_ep, num_ep)
  return Mesh(devices, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _moe(params, x, *, num_ep, gmm=mblx.gmm, ragged_all_to_all=mblx.ragged_all_to_all):
  """MaxText's routed MoE: gate outside, sparse_matmul inside shard_map over (data, expert)."""
  scores = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, params["gate"], precision=HI), axis=-1)
  batch = P(("data", "expert"))
  fn = jax.shard_map(
    lambda *a: _sparse_matmul(*a, num_ep=num_ep, gmm=gmm, ragged_all_to_all=ragged_all_to_all),
    mesh=_mesh(num_ep),
    in_specs=(batch, batch, P("expert"), P("expert"), P("expert")),
    out_specs=batch,
    check_vma=True,
  )
  return fn(x, scores, params["w0"], params["w1"], params["wo"])


def _dense(params, x):
  """Every token through its top-k experts, plain jnp in f32 on the global batch."""
  c = CONFIG
  scores = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, params["gate"], precision=HI), axis=-1)
  weights, selected = jax.lax.top_k(scores, c["num_experts_per_tok"])
  coef = jnp.sum(
    jax.nn.one_hot(selected, c["num_experts"], dtype=F32) * weights[..., None], axis=2
  )  # [B, S, E]
  h0 = jnp.einsum("bsd,edf->bsef", x, params["w0"], precision=HI)
  h1 = jnp.einsum("bsd,edf->bsef", x, params["w1"], precision=HI)
  out = jnp.einsum("bsef,efd->bsed", jax.nn.silu(h0) * h1, params["wo"], precision=HI)
  return jnp.einsum("bsed,bse->bsd", out, coef, precision=HI)


def _params_and_tokens():
  c = CONFIG
  e, d, f = c["num_experts"], c["emb_dim"], c["moe_mlp_dim"]
  k = jax.random.split(jax.random.key(1), 5)
  params = {
    "gate": jax.random.normal(k[0], (d, e), F32) / math.sqrt(d),
    "w0": jax.random.normal(k[1], (e, d, f), F32) / math.sqrt(d),
    "w1": jax.random.normal(k[2], (e, d, f), F32) / math.sqrt(d),
    "wo": jax.random.normal(k[3], (e, f, d), F32) / math.sqrt(f),
  }
  x = jax.random.normal(k[4], (BATCH, SEQ, d), F32)
  return params, x


def _loss(moe):
  """Mean squared error against a fixed target, with the layer's output as aux."""
  target = jnp.sin(jnp.arange(BATCH * SEQ * CONFIG["emb_dim"], dtype=F32)).reshape(BATCH, SEQ, -1)

  def loss(params, x):
    y = moe(params, x)
    return jnp.mean((y - target) ** 2), y

  return loss


# NOTE: where maxtext 0.2.5 installs (Python >= 3.12), tests/integrations/test_maxtext_layer.py
# runs MaxText's own layer instead of this hand-written copy of commit e591f30's path (same mesh,
# both asserts).
_OWN_LAYER_RUNS = pytest.mark.skipif(
  sys.version_info >= (3, 12),
  reason="MaxText 0.2.5's own RoutedMoE runs here instead "
  "(tests/integrations/test_maxtext_layer.py)",
)


@_OWN_LAYER_RUNS
def test_seed_scenario_maxtext_sparse_matmul_ep4_trains_on_cpu():
  """EP=4 x data=2: forward matches EP=1 (data=8) and the dense reference, jax.grad the dense one.

  NOTE: EP=1 runs the forward only (its gradient program would double the test's time); the
  gradient is checked against the dense reference, which shares no code with either.
  """
  params, x = _params_and_tokens()
  loss = _loss(lambda p, t: _moe(p, t, num_ep=4))
  (value4, y4), grads4 = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  y1 = jax.jit(lambda p, t: _moe(p, t, num_ep=1))(params, x)
  y_ref = _dense(params, x)
  (value_ref, _), grads_ref = jax.value_and_grad(_loss(_dense), argnums=(0, 1), has_aux=True)(
    params, x
  )
  _close(y4, y_ref)
  _close(y1, y_ref)
  _close(y4, y1)
  _close(value4, value_ref, tol=1e-5)
  for name, got, want in zip(("params", "tokens"), grads4, grads_ref, strict=True):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert float(jnp.abs(r).max()) > 0, name
      _close(g, r)


@_OWN_LAYER_RUNS
def test_seed_scenario_jax_ragged_all_to_all_fails_on_cpu():
  """The same program with JAX's own ragged_all_to_all: XLA:CPU has no ragged-all-to-all."""
  params, x = _params_and_tokens()
  moe = jax.jit(lambda p, t: _moe(p, t, num_ep=4, ragged_all_to_all=jax.lax.ragged_all_to_all))
  with pytest.raises(Exception, match="(?s)UNIMPLEMENTED.*ragged-all-to-all"):
    jax.block_until_ready(moe(params, x))


# MaxText's base.yml mesh keys under the seed's `ici_expert_parallelism=4`: fsdp takes the rest.
SEED_MESH = dict(
  ici_data_parallelism=1,
  ici_fsdp_parallelism=-1,
  ici_tensor_parallelism=1,
  ici_expert_parallelism=4,
  dcn_data_parallelism=-1,
  dcn_fsdp_parallelism=1,
  dcn_tensor_parallelism=1,
  dcn_expert_parallelism=1,
)


def test_seed_configuration_runs_sharded_as_maxtext_shards_it():
  """The seed's config with base.yml's mesh keys: `make_mesh` builds fsdp 2 x expert 4 on the 8
  devices, every weight is split over fsdp (the experts over expert too), the tokens over both;
  the layer's forward and gradients equal the dense reference's."""
  config = pallas_moe.MoEConfig.from_dict({**CONFIG, **SEED_MESH})
  mesh = pallas_moe.make_mesh(config)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 4}
  params, x = _params_and_tokens()
  ours = {
    "router": params["gate"],
    "wi": jnp.concatenate([params["w0"], params["w1"]], axis=-1),
    "wo": params["wo"],
  }
  p_shard, x_shard = pallas_moe.moe.shardings(config, mesh, ours)
  assert {k: s.spec for k, s in p_shard.items()} == {
    "router": P("fsdp"),
    "wi": P("expert", "fsdp"),
    "wo": P("expert", None, "fsdp"),
  }
  assert x_shard.spec == P(("data", "fsdp", "expert"))

  def layer(p, x):
    y, _ = pallas_moe.moe_layer(p, x.reshape(-1, x.shape[-1]), config, mesh)
    return y.reshape(x.shape)

  (value, y), grads = jax.jit(jax.value_and_grad(_loss(layer), argnums=(0, 1), has_aux=True))(
    jax.device_put(ours, p_shard), x
  )
  (value_ref, y_ref), (g_ref, gx_ref) = jax.value_and_grad(
    _loss(_dense), argnums=(0, 1), has_aux=True
  )(params, x)
  _close(y, y_ref)
  _close(value, value_ref, tol=1e-5)
  _close(grads[1], gx_ref)
  _close(grads[0]["router"], g_ref["gate"])
  _close(grads[0]["wi"], jnp.concatenate([g_ref["w0"], g_ref["w1"]], axis=-1))
  _close(grads[0]["wo"], g_ref["wo"])
  assert grads[0]["wi"].sharding.spec == P("expert", "fsdp")
