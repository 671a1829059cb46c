"""The fused expert kernel against float64 numpy: float, per-channel and 128 x 128 block-scaled
weights, decode-size row counts, empty experts, both interpret modes, the race detector, and AOT
compiles for each TPU generation."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import fused_experts as fe
from pallas_moe import quant, tiling
from tests.kernel_testing import (
  RACE_PARAMS,
  examples,
  group_sizes_strategy,
  no_races_or_oob,
  random_array,
)
from tests.kernels.test_aot import _device as aot_device

F32 = jnp.float32
I32 = jnp.int32


def np_experts(x, wi, wo, group_sizes, row_weights=None):
  """float64 SwiGLU experts over rows sorted by expert; rows past the groups are zero."""
  x, wi, wo = (np.asarray(a, np.float64) for a in (x, wi, wo))
  out = np.zeros((x.shape[0], wo.shape[2]))
  f = wi.shape[2] // 2
  r = 0
  for e, g in enumerate(np.asarray(group_sizes)):
    h = x[r : r + g] @ wi[e]
    act = h[:, :f] / (1 + np.exp(-h[:, :f])) * h[:, f:]
    if row_weights is not None:
      act = act * np.asarray(row_weights, np.float64)[r : r + g, None]
    out[r : r + g] = act @ wo[e]
    r += g
  return out


def _weights(kind: str, *, e: int, d: int, f: int, seed: int = 1):
  """(wi, wo) of `kind` and their float64 values as the kernel multiplies them."""
  wi = random_array(seed, (e, d, 2 * f), F32) / np.sqrt(d)
  wo = random_array(seed + 1, (e, f, d), F32) / np.sqrt(f)
  if kind == "float":
    return wi, wo, wi, wo
  if kind in ("int8", "fp8"):
    qi, qo = quant.quantize(wi, dtype=kind), quant.quantize(wo, dtype=kind)
    return qi, qo, quant.dequantize(qi), quant.dequantize(qo)
  dtype = kind.split("-")[1]
  qi, qo = quant.quantize_blocks(wi, dtype=dtype), quant.quantize_blocks(wo, dtype=dtype)
  return qi, qo, quant.dequantize_blocks(qi), quant.dequantize_blocks(qo)


def _check(out, want, *, atol=2e-5):
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=atol, rtol=2e-5)


@pytest.mark.parametrize("kind", ["float", "int8", "fp8", "block-fp8", "block-int8"])
@pytest.mark.parametrize("mode", ["hlo", "tpu"])
def test_kinds_at_decode_sizes(kind, mode):
  """One and eight tokens' rows (top-2 over 4 local experts), one expert empty, two chunks,
  each step's weights in two pieces of d."""
  d, f, e = 256, 256, 4
  wi, wo, wi64, wo64 = _weights(kind, e=e, d=d, f=f)
  interpret = True if mode == "hlo" else pltpu.InterpretParams()
  plan = fe.plan_fused(rows=16, d=d, f=f, num_experts=e, x_dtype=F32, w_dtype=F32, chunk=128)
  assert plan.pieces == 2
  for gs in ([1, 0, 1, 0], [5, 0, 3, 8]):
    gs = jnp.asarray(gs, jnp.int32)
    m = int(gs.sum())
    x = random_array(3, (m, d), F32)
    rw = jnp.asarray(np.random.default_rng(4).uniform(0.1, 1.0, m), F32)
    out = fe.fused_experts(x, wi, wo, gs, row_weights=rw, chunk=128, interpret=interpret)
    _check(out, np_experts(x, wi64, wo64, gs, rw))


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
@given(data=st.data())
@examples(0.5)
def test_group_sizes_property(stream, data):
  """Random, sparse, one-group and short group sizes over odd m and d: rows resident in VMEM
  (f not a multiple of 128), or streamed from HBM in visits of 16 rows (on one or two
  TensorCores)."""
  m, d, f, e = 37, 72, 128 if stream else 48, 5
  gs = jnp.asarray(data.draw(group_sizes_strategy(m=m, num_groups=e)))
  wi, wo, _, _ = _weights("float", e=e, d=d, f=f)
  x = random_array(5, (m, d), F32)
  if stream:
    cores = data.draw(st.sampled_from([1, 2]), label="cores")
    out = _streamed(x, wi, wo, gs, visit_rows=16, cores=cores, interpret=True)
  else:
    out = fe.fused_experts(x, wi, wo, gs, interpret=True)
  _check(out, np_experts(x, wi, wo, gs))


@pytest.mark.parametrize(
  "gen,rows,route,mode",
  [
    ("v5e", "bfloat16", "partials", "hlo"),
    ("v5p", "bfloat16", "partials", "races"),
    ("v6e", "bfloat16", "e4m3b11", "hlo"),
    ("v5e", "float32", "e4m3b11", "hlo"),
    ("tpu7x", "bfloat16", "astype", "hlo"),
  ],
)
def test_block_fp8_every_byte(gen, rows, route, mode, capfd):
  """Every finite float8_e4m3fn byte (subnormals, the 256-448 binade, -0) counts as its value
  times its block's scale on each route: products of the stored values with the partials
  scaled (bf16 rows where the MXU takes e4m3fn), values read as float8_e4m3b11fnuz, or
  converted as such (tpu7x). Three windows of rows, two pieces of d, two chunks."""
  d, f, e = 256, 256, 2
  rng = np.random.default_rng(7)
  finite = np.setdiff1d(np.arange(256, dtype=np.uint8), [0x7F, 0xFF])

  def weights(shape):
    raw = rng.choice(finite, size=shape).astype(np.uint8)
    raw.reshape(-1)[:256] = np.resize(finite, 256)  # every finite byte at least once
    values = jax.lax.bitcast_convert_type(jnp.asarray(raw), jnp.float8_e4m3fn)
    # NOTE: about 1 / sqrt(k) at the largest byte (448), as `quant.quantize_blocks` scales.
    scales = rng.uniform(0.5, 1.5, (shape[0], shape[1] // 128, shape[2] // 128))
    scales /= 448 * np.sqrt(shape[1])
    return quant.BlockQuantizedWeights(values, jnp.asarray(scales, F32))

  wi, wo = weights((e, d, 2 * f)), weights((e, f, d))
  assert bool(jnp.any(jax.lax.bitcast_convert_type(wi.values, jnp.uint8) == 0x80))
  m = 40
  plan = fe.plan_fused(
    rows=m, d=d, f=f, num_experts=e, x_dtype=rows, w_dtype=wi.dtype, out_dtype=F32,
    kind="block", generation=gen, chunk=128, pieces=2, window=16,
  )  # fmt: skip
  assert plan.upcast == route
  gs = jnp.asarray([31, 9], jnp.int32)
  x = random_array(8, (m, d), F32).astype(rows)
  interpret = RACE_PARAMS if mode == "races" else True
  with no_races_or_oob(capfd):
    out = fe.fused_experts(x, wi, wo, gs, plan=plan, interpret=interpret)
  wi64, wo64 = (np.asarray(quant.dequantize_blocks(w), np.float64) for w in (wi, wo))
  x64 = np.asarray(x.astype(F32), np.float64)
  if rows == "float32":
    _check(out, np_experts(x64, wi64, wo64, gs))
    return
  # NOTE: the kernel rounds the activation to the rows' dtype before down; so does this.
  want, r = np.zeros((m, d)), 0
  for g, size in enumerate(np.asarray(gs)):
    h = x64[r : r + size] @ wi64[g]
    act = h[:, :f] / (1 + np.exp(-h[:, :f])) * h[:, f:]
    act = np.asarray(jnp.asarray(act, jnp.bfloat16).astype(F32), np.float64)
    want[r : r + size] = act @ wo64[g]
    r += size
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-3, rtol=1e-3)


def test_every_expert_empty_gives_zeros():
  wi, wo, _, _ = _weights("float", e=3, d=128, f=128)
  x = random_array(6, (16, 128), F32)
  out = fe.fused_experts(x, wi, wo, jnp.zeros((3,), jnp.int32), interpret=True)
  assert np.all(np.asarray(out) == 0)


def test_bf16_rows_and_windows():
  """bf16 rows, 300 rows of one expert (three windows, the last moved back), bf16 output."""
  d, f, e = 128, 256, 2
  wi, wo, _, _ = _weights("float", e=e, d=d, f=f)
  wi, wo = wi.astype(jnp.bfloat16), wo.astype(jnp.bfloat16)
  x = random_array(7, (301, d), jnp.bfloat16)
  gs = jnp.asarray([1, 300], jnp.int32)
  out = fe.fused_experts(x, wi, wo, gs, interpret=True)
  assert out.dtype == jnp.bfloat16
  want = np_experts(*(np.asarray(a.astype(F32)) for a in (x, wi, wo)), gs)
  np.testing.assert_allclose(np.asarray(out.astype(F32)), want, atol=3e-2, rtol=3e-2)


def np_token_experts(x, wi, wo, expert_weights):
  """float64 sum over experts of each token's weighted SwiGLU expert output."""
  x, wi, wo = (np.asarray(a, np.float64) for a in (x, wi, wo))
  ew = np.asarray(expert_weights, np.float64)
  f = wi.shape[2] // 2
  out = np.zeros((x.shape[0], wo.shape[2]))
  for e in range(wi.shape[0]):
    h = x @ wi[e]
    act = h[:, :f] / (1 + np.exp(-h[:, :f])) * h[:, f:]
    out += (act * ew[e][:, None]) @ wo[e]
  return out


def _token_weights(rng, *, e: int, m: int, k: int):
  """[E, m] routing weights of k distinct experts per token; expert 1 chosen by none."""
  ew = np.zeros((e, m), np.float32)
  for t in range(m):
    chosen = rng.choice([i for i in range(e) if i != 1], size=k, replace=False)
    ew[chosen, t] = rng.uniform(0.1, 1.0, k)
  return ew


@pytest.mark.parametrize("kind", ["float", "block-fp8", "int8"])
@pytest.mark.parametrize("mode", ["hlo", "tpu", "races"])
def test_tokens_layout(kind, mode, capfd):
  """The serving layout: every chosen expert over all tokens, each token's product times its
  weight for the expert, summed per token; an expert no token chose is never visited."""
  m, d, f, e = 13, 256, 256, 4
  wi, wo, wi64, wo64 = _weights(kind, e=e, d=d, f=f)
  rng = np.random.default_rng(9)
  ew = _token_weights(rng, e=e, m=m, k=2)
  counts = jnp.asarray((ew > 0).sum(axis=1), jnp.int32)
  x = random_array(10, (m, d), F32)
  interpret = {"hlo": True, "tpu": pltpu.InterpretParams(), "races": RACE_PARAMS}[mode]
  with no_races_or_oob(capfd):
    out = fe.fused_experts(
      x, wi, wo, counts, expert_weights=jnp.asarray(ew), chunk=128, interpret=interpret
    )
  _check(out, np_token_experts(x, wi64, wo64, ew))


@pytest.mark.parametrize("kind", ["float", "block-fp8"])
@pytest.mark.parametrize("mode", ["hlo", "tpu", "races"])
def test_gathered_tokens(kind, mode, capfd):
  """Above one 128-row window of tokens: each expert's own tokens, listed first in
  `expert_tokens` (entries past its count name random tokens with junk weights), gathered
  in VMEM, run, and added back; 300 tokens, an expert's list spanning two windows."""
  m, d, f, e = 300, 256, 256, 4
  wi, wo, wi64, wo64 = _weights(kind, e=e, d=d, f=f)
  rng = np.random.default_rng(13)
  ew = _token_weights(rng, e=e, m=m, k=2)
  counts = (ew > 0).sum(axis=1)
  listed = np.arange(m)[None, :] < counts[:, None]
  order = np.argsort(~(ew > 0), axis=1, kind="stable")
  tokens = np.where(listed, order, rng.integers(0, m, (e, m))).astype(np.int32)
  weights = np.where(listed, np.take_along_axis(ew, order, axis=1), 5.0).astype(np.float32)
  x = random_array(14, (m, d), F32)
  interpret = {"hlo": True, "tpu": pltpu.InterpretParams(), "races": RACE_PARAMS}[mode]
  with no_races_or_oob(capfd):
    out = fe.fused_experts(
      x,
      wi,
      wo,
      jnp.asarray(counts, jnp.int32),
      expert_weights=jnp.asarray(weights),
      expert_tokens=jnp.asarray(tokens),
      chunk=128,
      interpret=interpret,
    )
  _check(out, np_token_experts(x, wi64, wo64, ew))


@pytest.mark.parametrize("mode", ["hlo", "races"])
def test_gathered_non_finite_token_stays_in_its_row(mode, capfd):
  """A token with an inf (routed) and one with a NaN (routed nowhere) among gathered tokens:
  their rows come out NaN and every other row matches float64; the one-hot gather and add back
  would otherwise spread 0 x inf = NaN to every token."""
  m, d, f, e = 40, 128, 128, 3
  wi, wo, wi64, wo64 = _weights("float", e=e, d=d, f=f)
  x = np.array(random_array(15, (m, d), F32))
  x[5, 7], x[9, 0] = np.inf, np.nan
  routed = {0: [1, 2, 3], 1: [2, 11], 2: [5, 12]}
  tokens = np.full((e, m), -1, np.int32)
  weights = np.zeros((e, m), np.float32)
  ew = np.zeros((e, m), np.float64)
  for ex, ts in routed.items():
    tokens[ex, : len(ts)], weights[ex, : len(ts)], ew[ex, ts] = ts, 0.5, 0.5
  interpret = {"hlo": True, "races": RACE_PARAMS}[mode]
  with no_races_or_oob(capfd) if mode == "races" else contextlib.nullcontext():
    out = fe.fused_experts(
      jnp.asarray(x),
      wi,
      wo,
      jnp.asarray([len(routed[i]) for i in range(e)], jnp.int32),
      expert_weights=jnp.asarray(weights),
      expert_tokens=jnp.asarray(tokens),
      interpret=interpret,
    )
  out = np.asarray(out, np.float64)
  assert np.isnan(out[[5, 9]]).all()
  clean = np.setdiff1d(np.arange(m), [5, 9])
  x[[5, 9]] = 0.0
  _check(out[clean], np_token_experts(jnp.asarray(x), wi64, wo64, ew)[clean])


@pytest.mark.parametrize("by_token", [False, True])
def test_two_tensorcores(by_token, capfd):
  """A megacore device's split: each of two TensorCores (grid steps under the simulator, with
  the race detector) streams half of every expert's chunks; their partial sums add up."""
  m, d, f, e = 16, 128, 512, 3
  wi, wo, _, _ = _weights("float", e=e, d=d, f=f)
  x = random_array(11, (m, d), F32)
  plan = fe.plan_fused(
    rows=m,
    d=d,
    f=f,
    num_experts=e,
    x_dtype=F32,
    w_dtype=F32,
    chunk=128,
    cores=2,
    by_token=by_token,
  )
  assert plan.cores == 2 and plan.core_chunks == 2
  if by_token:
    ew = _token_weights(np.random.default_rng(12), e=e, m=m, k=2)
    kw = dict(expert_weights=jnp.asarray(ew))
    gs = jnp.asarray((ew > 0).sum(axis=1), jnp.int32)
    want = np_token_experts(x, wi, wo, ew)
  else:
    gs = jnp.asarray([5, 0, 11], jnp.int32)
    kw = {}
    want = np_experts(x, wi, wo, gs)
  with no_races_or_oob(capfd):
    out = fe.fused_experts(x, wi, wo, gs, plan=plan, interpret=RACE_PARAMS, **kw)
  _check(out, want)


def test_two_tensorcores_bf16_partial_sums():
  """bf16 rows on two TensorCores: each core's partial sum comes out in bf16 and the two are
  added in f32, one rounding more than one core's result (as a tensor-parallel split of f):
  every value within a bf16 step of the largest result, the RMS error at most 1.5x one core's."""
  m, d, f, e = 16, 128, 512, 3
  wi, wo, _, _ = _weights("float", e=e, d=d, f=f)
  x = random_array(11, (m, d), F32).astype(jnp.bfloat16)
  wi, wo = wi.astype(jnp.bfloat16), wo.astype(jnp.bfloat16)
  gs = jnp.asarray([5, 0, 11], jnp.int32)
  want = np_experts(np.asarray(x.astype(F32)), wi.astype(F32), wo.astype(F32), gs)
  outs = []
  for cores in (1, 2):
    plan = fe.plan_fused(
      rows=m, d=d, f=f, num_experts=e, x_dtype=jnp.bfloat16, w_dtype=jnp.bfloat16,
      chunk=128, cores=cores,
    )  # fmt: skip
    assert plan.cores == cores
    outs.append(np.asarray(fe.fused_experts(x, wi, wo, gs, plan=plan).astype(F32), np.float64))
  err = [np.abs(o - want) for o in outs]
  # NOTE: measured: max 0.0059 (one core) and 0.0142 (two), rms 0.0014 and 0.0019, |result| <= 2.1.
  assert err[1].max() <= 2.0**-7 * np.abs(want).max()
  assert np.sqrt((err[1] ** 2).mean()) <= 1.5 * np.sqrt((err[0] ** 2).mean())


@pytest.mark.parametrize("kind", ["float", "block-fp8"])
def test_no_races_or_out_of_bounds(kind, capfd):
  d, f, e = 256, 256, 3
  wi, wo, wi64, wo64 = _weights(kind, e=e, d=d, f=f)
  gs = jnp.asarray([2, 0, 6], jnp.int32)
  x = random_array(8, (8, d), F32)
  with no_races_or_oob(capfd):
    out = fe.fused_experts(x, wi, wo, gs, chunk=128, interpret=RACE_PARAMS)
  _check(out, np_experts(x, wi64, wo64, gs))


def _streamed(x, wi, wo, gs, *, visit_rows, cores=1, **kw):
  m, d = x.shape
  values = getattr(wi, "values", wi)
  plan = fe.plan_fused(
    rows=m,
    d=d,
    f=values.shape[2] // 2,
    num_experts=values.shape[0],
    x_dtype=x.dtype,
    w_dtype=values.dtype,
    kind=fe.weight_kind(wi),
    chunk=128,
    stream=True,
    visit_rows=visit_rows,
    cores=cores,
  )
  assert plan.cores == cores
  return fe.fused_experts(x, wi, wo, gs, stream=True, plan=plan, **kw)


@pytest.mark.parametrize(
  "mode, kind, dtype, cores",
  [
    ("hlo", "float", F32, 1),
    ("races", "block-fp8", jnp.bfloat16, 1),
    ("tpu", "int8", jnp.bfloat16, 1),
    ("races", "float", jnp.bfloat16, 2),
    ("hlo", "block-fp8", F32, 2),
  ],
)
def test_streamed_rows(mode, kind, dtype, cores, capfd):
  """Rows sorted by expert that stay in HBM: visits of 32 rows, so an expert of 40 or 70 rows
  is visited two or three times and small experts share their first and last granules; rows
  past the groups come out zero, or are left unwritten ("undefined") with every owned row
  exact. On two TensorCores each takes half of the visits: the first three sizes share a
  granule between the cores (rows 43 and 70 end the first core's visits), the fourth does not
  (row 32)."""
  d, f, e, m = 256, 256, 5, 112
  wi, wo, wi64, wo64 = _weights(kind, e=e, d=d, f=f)
  interpret = {"hlo": True, "tpu": pltpu.InterpretParams(), "races": RACE_PARAMS}[mode]
  x = random_array(9, (m, d), F32).astype(dtype)
  rw = jnp.asarray(np.random.default_rng(5).uniform(0.1, 1.0, m), F32)
  tol = dict(atol=2e-5) if dtype == F32 else dict(atol=3e-2)
  x64 = np.asarray(x.astype(F32))
  cases = [[3, 0, 40, 1, 9], [70, 0, 0, 1, 2], [0, 0, 0, 0, 0]] + [[16, 0, 16, 5, 3]] * (cores - 1)
  for sizes in cases:
    gs = jnp.asarray(sizes, I32)
    want = np_experts(x64, wi64, wo64, gs, rw)
    with no_races_or_oob(capfd) if mode == "races" else contextlib.nullcontext():
      out = _streamed(
        x, wi, wo, gs, visit_rows=32, cores=cores, row_weights=rw, interpret=interpret
      )
    _check(out.astype(F32), want, **tol)
  loose = _streamed(
    x,
    wi,
    wo,
    gs := jnp.asarray([3, 0, 40, 1, 9], I32),
    visit_rows=32,
    cores=cores,
    row_weights=rw,
    unowned_rows="undefined",
    interpret=interpret,
  )
  _check(np.asarray(loose.astype(F32))[:53], np_experts(x64, wi64, wo64, gs, rw)[:53], **tol)


def test_streamed_window_wider_than_granules():
  """Windows of 48 rows over visits of 64: a visit's second window moves back to end at its
  held rows and keeps only the rows it owns."""
  d, f, e, m = 128, 256, 5, 112
  wi, wo, _, _ = _weights("float", e=e, d=d, f=f)
  x = random_array(13, (m, d), F32)
  rw = jnp.asarray(np.random.default_rng(6).uniform(0.1, 1.0, m), F32)
  plan = fe.plan_fused(
    rows=m, d=d, f=f, num_experts=e, x_dtype=F32, w_dtype=F32, stream=True, visit_rows=64,
    window=48,
  )  # fmt: skip
  assert (plan.window, plan.visit_rows, plan.step_rows) == (48, 64, 96)
  for sizes in ([3, 0, 70, 1, 9], [50, 0, 0, 2, 60]):
    gs = jnp.asarray(sizes, I32)
    out = fe.fused_experts(x, wi, wo, gs, row_weights=rw, stream=True, plan=plan, interpret=True)
    _check(out, np_experts(x, wi, wo, gs, rw))
  with pytest.raises(ValueError, match="window=20 must be a positive multiple of 8"):
    fe.plan_fused(rows=m, d=d, f=f, num_experts=e, x_dtype=F32, w_dtype=F32, stream=True, window=20)


def test_plan_streams_only_what_fits():
  """DeepSeek-V3's expert at 64 rows: the chunk is the largest that fits VMEM, and the rows'
  needs are refused with a clear error where they cannot fit."""
  plan = fe.plan_fused(
    rows=64,
    d=7168,
    f=2048,
    num_experts=8,
    x_dtype=jnp.bfloat16,
    w_dtype=jnp.float8_e4m3fn,
    kind="block",
    generation="v6e",
  )
  assert 2048 % plan.chunk == 0 and plan.chunk % 128 == 0
  assert plan.vmem_bytes <= fe._VMEM_SHARE * tiling.get_generation("v6e").vmem_bytes
  assert plan.expert_weight_bytes == 3 * 7168 * 2048 + 4 * 3 * 16 * 56
  # NOTE: each step's weights come in seven pieces of 1,024 rows of d (4 x 256: the MXU edge).
  assert (plan.pieces, plan.piece) == (7, 1024)
  # NOTE: a window of at most 32 rows takes up to 16 pieces: 14 of 512 rows (2 x 256).
  small = fe.plan_fused(
    rows=32, d=7168, f=2048, num_experts=8, x_dtype=jnp.bfloat16,
    w_dtype=jnp.float8_e4m3fn, kind="block", generation="v6e", by_token=True,
  )  # fmt: skip
  assert (small.window, small.pieces, small.piece) == (32, 14, 512)
  with pytest.raises(ValueError, match="fewer rows per call"):
    fe.plan_fused(
      rows=8192,
      d=7168,
      f=2048,
      num_experts=8,
      x_dtype=jnp.bfloat16,
      w_dtype=jnp.bfloat16,
      generation="v5e",
    )


def test_errors():
  wi, wo, _, _ = _weights("float", e=2, d=128, f=128)
  x = jnp.zeros((8, 128), F32)
  gs = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="wo must be"):
    fe.fused_experts(x, wi, wo[:, :64], gs, interpret=True)
  with pytest.raises(ValueError, match="group_sizes must be"):
    fe.fused_experts(x, wi, wo, jnp.asarray([8], jnp.int32), interpret=True)
  with pytest.raises(TypeError, match="same kind"):
    fe.fused_experts(x, quant.quantize(wi), wo, gs, interpret=True)
  with pytest.raises(ValueError, match="row_weights"):
    fe.fused_experts(x, wi, wo, gs, row_weights=jnp.ones((7,)), interpret=True)
  with pytest.raises(ValueError, match="pieces=3 must split d=256"):
    fe.plan_fused(rows=8, d=256, f=128, num_experts=2, x_dtype=F32, w_dtype=F32, pieces=3)
  with pytest.raises(ValueError, match="multiples of block"):
    fe.plan_fused(rows=8, d=96, f=128, num_experts=2, x_dtype=F32, w_dtype=jnp.int8, kind="block")
  fp8 = dict(rows=8, d=256, f=256, num_experts=2, w_dtype=jnp.float8_e4m3fn, kind="block")
  with pytest.raises(ValueError, match="upcast='partials' does not run .* it runs: astype"):
    fe.plan_fused(x_dtype=jnp.bfloat16, generation="tpu7x", upcast="partials", **fp8)
  # NOTE: a 128-deep partial product fills a 128-wide MXU, half of a 256-wide one.
  routes = {g: fe.plan_fused(x_dtype=jnp.bfloat16, generation=g, **fp8).upcast for g in GENS}
  assert routes == {"v5e": "partials", "v5p": "partials", "v6e": "e4m3b11", "tpu7x": "astype"}
  forced = fe.plan_fused(x_dtype=jnp.bfloat16, generation="v6e", upcast="partials", **fp8)
  assert forced.upcast == "partials"


GENS = ("v5e", "v5p", "v6e", "tpu7x")


# DeepSeek-V3's fp8 block-scaled expert (8 local experts at EP 32) on every generation, Qwen3's
# bf16 and int8 experts (16 local at EP 8) on v6e.
AOT_CASES = [
  ("v5e", "block-fp8", 7168, 2048, 8),
  ("v5p", "block-fp8", 7168, 2048, 8),
  ("v6e", "block-fp8", 7168, 2048, 8),
  ("tpu7x", "block-fp8", 7168, 2048, 8),
  ("v6e", "float", 2048, 768, 16),
  ("v6e", "int8", 2048, 768, 16),
]


@pytest.mark.aot
@pytest.mark.parametrize("gen,kind,d,f,e", AOT_CASES)
def test_compiles_for_tpu(gen, kind, d, f, e):
  """Mosaic compiles the kernel (real libtpu, ahead of time) at decode size: 64 rows sorted by
  expert, 64 tokens, 256 tokens gathered per expert (on v5p split over its two TensorCores),
  and 8,192 sorted rows streamed from HBM."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  dev = aot_device(gen)
  mesh = Mesh(np.array([dev]), ("x",))

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

  vdt = {"float": jnp.bfloat16, "int8": jnp.int8}.get(kind, jnp.float8_e4m3fn)
  wi_v, wo_v = sds((e, d, 2 * f), vdt), sds((e, f, d), vdt)
  if kind == "float":
    wi, wo = wi_v, wo_v
  elif kind == "int8":
    wi = quant.QuantizedWeights(wi_v, sds((e, 1, 2 * f), F32))
    wo = quant.QuantizedWeights(wo_v, sds((e, 1, d), F32))
  else:
    wi = quant.BlockQuantizedWeights(wi_v, sds((e, d // 128, 2 * f // 128), F32))
    wo = quant.BlockQuantizedWeights(wo_v, sds((e, f // 128, d // 128), F32))
  args = (sds((64, d), jnp.bfloat16), wi, wo, sds((e,), jnp.int32), sds((64,), F32))
  tokens = (*args[:4], sds((e, 64), F32))
  gathered = (sds((256, d), jnp.bfloat16), *args[1:4], sds((e, 256), F32), sds((e, 256), I32))

  def by_rows(x, wi, wo, gs, rw):
    return fe.fused_experts(x, wi, wo, gs, row_weights=rw)

  def by_tokens(x, wi, wo, gs, ew):
    return fe.fused_experts(x, wi, wo, gs, expert_weights=ew)

  def by_gathered(x, wi, wo, gs, ew, et):
    return fe.fused_experts(x, wi, wo, gs, expert_weights=ew, expert_tokens=et)

  streamed = (sds((8192, d), jnp.bfloat16), *args[1:4], sds((8192,), F32))

  def by_streamed(x, wi, wo, gs, rw):
    return fe.fused_experts(x, wi, wo, gs, row_weights=rw, stream=True, unowned_rows="undefined")

  cases = ((by_rows, args), (by_tokens, tokens), (by_gathered, gathered), (by_streamed, streamed))
  with tiling.use_generation(gen), jax.default_device(dev):
    for fn, a in cases:
      compiled = jax.jit(fn).lower(*a).compile()
      assert "pallas_moe_fused_experts" in compiled.as_text()


@pytest.mark.aot
@pytest.mark.parametrize(
  "gen,rows,values,route",
  [
    ("v5e", "float32", "float8_e4m3fn", "e4m3b11"),
    ("tpu7x", "bfloat16", "int8", "astype"),
    ("v4", "bfloat16", "float8_e4m3fn", "astype"),
  ],
)
def test_dequantizing_routes_compile_for_tpu(gen, rows, values, route):
  """The block-scaled routes that dequantize on the way to the MXU compile with Mosaic (real
  libtpu, ahead of time) where the bf16-row fp8 cases above do not reach them: f32 rows on v5e
  (bytes read as e4m3b11fnuz), int8 blocks on tpu7x, e4m3fn on v4 (no fp8 unpack); the tokens
  layout at 64 tokens, 4 experts of d 2,048, f 1,024."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  dev = aot_device(gen)
  sharding = NamedSharding(Mesh(np.array([dev]), ("x",)), P())

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  e, d, f, n = 4, 2048, 1024, 64
  wi = quant.BlockQuantizedWeights(
    sds((e, d, 2 * f), values), sds((e, d // 128, 2 * f // 128), F32)
  )
  wo = quant.BlockQuantizedWeights(sds((e, f, d), values), sds((e, f // 128, d // 128), F32))
  args = (sds((n, d), rows), wi, wo, sds((e,), jnp.int32), sds((e, n), F32))

  def call(x, wi, wo, gs, ew):
    return fe.fused_experts(x, wi, wo, gs, expert_weights=ew)

  with tiling.use_generation(gen), jax.default_device(dev):
    plan = fe.plan_fused(
      rows=n, d=d, f=f, num_experts=e, x_dtype=rows, w_dtype=values, kind="block", by_token=True
    )
    assert plan.upcast == route
    compiled = jax.jit(call).lower(*args).compile()
  assert "pallas_moe_fused_experts" in compiled.as_text()
