"""The backends of `gmm` / `tgmm` (`implementation`): XLA's ragged_dot with the kernels' contract.

"xla" must keep everything the kernels promise (group_offset shards, existing_out, exact zeros
past the groups and for other shards' rows, their zero lhs gradient, quantized weights
straight-through), checked against float64 numpy and the interpret-mode kernels. A program
lowered for a GPU must hold no Pallas kernel and no interpret-mode loop under the default
(`implementation=None`): checked on the StableHLO exported for CUDA from this CPU host.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer_testing import SMALL, _block_grads, _mesh, _setup

import pallas_moe
from pallas_moe import ops
from pallas_moe.config import MoEConfig

F32 = jnp.float32


def _gmm64(x, w, gs, offset, existing, transpose_rhs):
  """float64 numpy: rows of local groups times their weights, the rest existing or 0."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  w = np.swapaxes(w, 1, 2) if transpose_rhs else w
  out = np.zeros((x.shape[0], w.shape[2])) if existing is None else np.asarray(existing, np.float64)
  ends = np.cumsum(gs)
  for g in range(w.shape[0]):
    lo, hi = ends[offset + g] - gs[offset + g], ends[offset + g]
    out[lo:hi] = x[lo:hi] @ w[g]
  return out


CASES = {
  # (m, k, n, group sizes, offset, local groups, existing_out, transpose_rhs)
  "shard-with-existing": (40, 64, 256, [10, 0, 17, 9], 1, 3, True, False),
  "empty-groups-tail": (37, 24, 40, [0, 5, 0, 20], 0, 4, False, True),
  "one-group-all-rows": (16, 8, 16, [16], 0, 1, False, False),
  "nothing-local": (24, 16, 8, [12, 0, 0, 12], 1, 2, True, False),
}


@pytest.mark.parametrize("case", CASES)
def test_xla_gmm_contract_and_gradients(case):
  """xla == float64 numpy (forward) and == the interpret-mode kernels (every gradient)."""
  m, k, n, sizes, offset, local, with_existing, transpose_rhs = CASES[case]
  gs = np.asarray(sizes, np.int32)
  kx, kw, ke, kc = jax.random.split(jax.random.key(len(case)), 4)
  x = jax.random.normal(kx, (m, k), F32)
  w = jax.random.normal(kw, (local, n, k) if transpose_rhs else (local, k, n), F32)
  existing = jax.random.normal(ke, (m, n), F32) if with_existing else None
  cot = jax.random.normal(kc, (m, n), F32)

  def loss(impl):
    def f(x, w, existing):
      out = pallas_moe.gmm(
        x, w, gs, F32, None, offset, existing, transpose_rhs, implementation=impl
      )
      return jnp.sum(out * cot), out

    return jax.value_and_grad(f, argnums=(0, 1, 2) if with_existing else (0, 1), has_aux=True)

  (_, out), grads = loss("xla")(x, w, existing)
  np.testing.assert_allclose(out, _gmm64(x, w, gs, offset, existing, transpose_rhs), atol=1e-4)
  (_, out_k), grads_k = loss("interpret")(x, w, existing)
  np.testing.assert_allclose(out, out_k, atol=1e-4)
  for a, b in zip(grads, grads_k, strict=True):
    np.testing.assert_allclose(a, b, atol=1e-4)
  # NOTE: rows outside the local groups get a zero lhs gradient, exactly.
  ends = np.cumsum(gs)
  lo, hi = ends[offset] - gs[offset], ends[offset + local - 1]
  assert not np.any(np.asarray(grads[0])[:lo]) and not np.any(np.asarray(grads[0])[hi:])


def test_xla_gmm_quantized_weights_match_kernels():
  """QuantizedWeights, on-the-fly int8 weights and fp8 activations: as the kernels compute."""
  x = jax.random.normal(jax.random.key(0), (40, 64), F32)
  w = jax.random.normal(jax.random.key(1), (4, 64, 128), F32)
  gs = np.asarray([10, 0, 17, 9], np.int32)
  q = pallas_moe.quantize(w, dtype="int8")
  for impl in ("xla", "interpret"):
    got = {
      "frozen": pallas_moe.gmm(x, q, gs, F32, implementation=impl),
      "int8": pallas_moe.gmm(x, w, gs, F32, weight_quantization="int8", implementation=impl),
      "fp8": pallas_moe.gmm(
        x, w, gs, F32, weight_quantization="fp8", activation_quantization="fp8",
        implementation=impl,
      ),
    }  # fmt: skip
    if impl == "xla":
      want = got
      continue
    for name, out in got.items():
      scale = float(np.abs(np.asarray(out)).max())
      np.testing.assert_allclose(want[name], out, atol=2e-3 * scale, err_msg=name)
  # Straight-through: the float weights' gradient is the float gmm's.
  dw = jax.grad(
    lambda w: pallas_moe.gmm(x, w, gs, F32, weight_quantization="int8", implementation="xla").sum()
  )(w)
  dw_float = jax.grad(lambda w: pallas_moe.gmm(x, w, gs, F32, implementation="xla").sum())(w)
  np.testing.assert_allclose(dw, dw_float, atol=1e-4)


@pytest.mark.parametrize("transpose_lhs", [False, True])
def test_xla_tgmm_matches_kernels(transpose_lhs):
  """tgmm: a shard of groups with existing_out, empty groups exact zeros; and quantized scales."""
  m, k, n = 40, 24, 136
  gs = np.asarray([10, 0, 17, 9], np.int32)
  x = jax.random.normal(jax.random.key(2), (m, k), F32)
  y = jax.random.normal(jax.random.key(3), (m, n), F32)
  existing = jax.random.normal(jax.random.key(4), (3, k, n), F32)
  lhs = x if transpose_lhs else x.T
  kw = dict(group_offset=1, num_actual_groups=3, existing_out=existing)
  xla = pallas_moe.tgmm(lhs, y, gs, transpose_lhs=transpose_lhs, implementation="xla", **kw)
  ker = pallas_moe.tgmm(lhs, y, gs, transpose_lhs=transpose_lhs, interpret=True, **kw)
  np.testing.assert_allclose(xla, ker, atol=1e-4)
  np.testing.assert_array_equal(xla[0], existing[0])  # group 1 is empty
  if transpose_lhs:
    return
  values = jnp.clip(jnp.round(x.T * 20), -127, 127).astype(jnp.int8)
  scales = jnp.full((k, 1), 0.05, F32)
  got = pallas_moe.tgmm(values, y, gs, lhs_scales=scales, implementation="xla")
  want = pallas_moe.tgmm(values, y, gs, lhs_scales=scales, interpret=True)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def _cuda_stablehlo(fn, *args) -> str:
  return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def _loops(text: str) -> int:
  """while loops in a StableHLO module, outside the decompositions of `chlo.scan` composites
  (jax >= 0.11 lowers a cumsum over the group sizes to one, a loop over G elements)."""
  funcs = re.split(r"\n\s*func\.func ", text)
  return sum(f.count("stablehlo.while") for f in funcs if "@chlo.scan.impl" not in f[:80])


def test_default_program_for_gpu_has_no_pallas_kernel_or_interpret_loop():
  """Exported for CUDA, gmm, grad(gmm) and tgmm are ragged_dots: no while loop, no kernel."""
  x = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 64, 128), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  gs = jax.ShapeDtypeStruct((4,), jnp.int32)

  def grad_gmm(x, w, gs):
    return jax.grad(lambda x, w: pallas_moe.gmm(x, w, gs).astype(F32).sum(), (0, 1))(x, w)

  programs = {
    "gmm": _cuda_stablehlo(lambda x, w, gs: pallas_moe.gmm(x, w, gs), x, w, gs),
    "grad(gmm)": _cuda_stablehlo(grad_gmm, x, w, gs),
    "tgmm": _cuda_stablehlo(
      lambda x, y, gs: pallas_moe.tgmm(x, y, gs, transpose_lhs=True), x, y, gs
    ),
  }
  for name, text in programs.items():
    assert _loops(text) == 0, name
    assert "tpu_custom_call" not in text and "mosaic" not in text.lower(), name
    assert "ragged_dot" in text, name
  # MaxText's call (interpret=True off TPU) through the switch: XLA on a GPU too.
  from pallas_moe import maxtext as mblx

  switched = _cuda_stablehlo(
    lambda x, w, gs: mblx.gmm(x, w, gs, jnp.bfloat16, (512, 1024, 1024) * 3, 0, interpret=True),
    x, w, gs,
  )  # fmt: skip
  assert _loops(switched) == 0 and "ragged_dot" in switched
  # NOTE: the same calls lowered for the CPU run the interpret-mode kernels (the test path).
  cpu = jax.jit(lambda x, w, gs: pallas_moe.gmm(x, w, gs)).lower(x, w, gs).as_text()
  assert _loops(cpu) > 0 and "ragged_dot" not in cpu


def test_implementation_is_checked_and_planned():
  x, w, gs = jnp.ones((8, 8)), jnp.ones((1, 8, 128)), jnp.asarray([8], jnp.int32)
  with pytest.raises(ValueError, match="must be one of"):
    pallas_moe.gmm(x, w, gs, implementation="cuda")
  with pytest.raises(ValueError, match="disagree"):
    pallas_moe.gmm(x, w, gs, implementation="mosaic", interpret=True)
  with pytest.raises(ValueError, match="runs no"):
    pallas_moe.tgmm(x, jnp.ones((8, 128)), gs, implementation="xla", interpret=True)
  assert "XLA's ragged_dot" in pallas_moe.gmm_plan(x, w, gs, implementation="xla").describe()
  assert "Mosaic when lowered for TPU" in pallas_moe.gmm_plan(x, w, gs).describe()
  assert ops._check_implementation(None, False) == ("mosaic", False)


def test_block_on_xla_equals_block_on_kernels():
  """The EP block with gmm_impl="xla": forward, aux values and every gradient as the kernels'."""
  config = MoEConfig(**SMALL, gmm_impl="interpret")
  params, x = _setup(config, tokens=32)
  mesh = _mesh(2, 4)
  want = _block_grads(params, x, config, mesh)
  got = _block_grads(params, x, dataclasses.replace(config, gmm_impl="xla"), mesh)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
