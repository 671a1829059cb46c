"""Decode-size expert work on one device, against the weight-read floor.

  python -m bench.decode [--json FILE] [--markdown FILE] [--tokens 1 8 32 128]
                         [--chips v5e v5p v6e tpu7x] [--models ...] [--seed 0]
  python -m bench --decode --json FILE [--markdown FILE]

At a few tokens per device an MoE layer's expert work is reading expert weights: the floor is the
bytes of the device's non-empty local experts' weights, as stored (values and scales), over the
device's HBM bandwidth. Per (model, weights, expert-parallel degree, tokens per device, chip) this
models the expert work of one device (gate/up, the activation and down; not routing or the
exchange) three ways, fixed costs included:

- "fused" (`pallas_moe.fused_experts`): `plan_fused` for the chip, then the kernel's schedule:
  steps of (non-empty expert, chunk of f), each copying `FusedPlan.step_weight_bytes`; the first
  step's copy is exposed, and each step costs max(its MXU work, the next step's copy), the copies
  being double-buffered. MXU work per window of rows and step: the window's rows padded to
  `generations.min_pass_rows`, contraction and columns to the MXU edge (what `bench.costmodel`
  charges the kernel's dots), at one TensorCore's bf16 peak (8-bit weights are upcast in VMEM; the
  upcast's VPU work is not modeled). Where the rows do not fit one call's VMEM (DeepSeek-V3 at 128
  tokens), whole experts are packed into the fewest calls that fit, each paying its own fixed
  cost and first copy. One call of one TensorCore: its grid is (1,) "arbitrary", so on v5p
  (two TensorCores per JAX device) it runs on one of them at half the device's bandwidth.
- "megablox-maxtext": upstream megablox's gmm as MaxText 0.2.5 calls it at decode: the dropless
  receive buffer (tokens x top_k x min(ep, E / top_k) rows) padded to 512 rows, three calls
  (wi_0, wi_1, wo) at base.yml's tiles (512, 1024, 1024) clamped to the dims, bf16 weights (also
  for the DeepSeek-V3 fp8 records: MaxText runs it dequantized), each call costed by
  `bench.costmodel` on the real pallas_call (TensorCores per kernel). Fixed: three calls and
  `MEGABLOX_XLA_OPS` top-level XLA instructions.
- "tpu-inference-fused": vLLM tpu-inference's fused MoE kernel's approach: one kernel that
  streams every local expert's weights, empty or not, double-buffered: the fused schedule with
  every local expert visited (empty ones with no MXU work), one call, one TensorCore.

Group sizes: one seeded draw per (model, ep, tokens): ep x tokens tokens each choose top_k
distinct experts uniformly; a device's local experts are a contiguous block of E / ep. Reported:
the device with the most non-empty local experts (ties: the most rows), since the layer waits for
its slowest device.

Fixed costs (`bench.costmodel.fixed_cost_us`): per Pallas call, measured - modeled of tokamax's one
small measured problem (`fit_call_fixed_us`); per XLA instruction, an assumption
(`costmodel.XLA_OP_FIXED_US`). `sensitivity` shows how the ratios move with both.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import costmodel  # noqa: E402
from pallas_moe.generations import get_generation, min_pass_rows, tensorcore_rates  # noqa: E402

# NOTE: the module, not the package's re-exported function of the same name.
fe = importlib.import_module("pallas_moe.fused_experts")

__all__ = [
  "DecodeModel",
  "MODELS",
  "WEIGHTS",
  "TOKENS",
  "CHIPS",
  "IMPLS",
  "MEGABLOX_XLA_OPS",
  "route",
  "busiest_device",
  "expert_bytes",
  "device_bandwidth",
  "max_call_rows",
  "pack_calls",
  "window_macs",
  "expert_windows",
  "model_fused",
  "model_fused_serving",
  "model_tpu_inference",
  "model_megablox",
  "fit_call_fixed_us",
  "records",
  "sensitivity",
  "verdict",
  "markdown",
  "run",
  "main",
]

TOKENS = (1, 8, 32, 128)
CHIPS = ("v5e", "v5p", "v6e", "tpu7x")
IMPLS = ("fused", "fused-serving", "megablox-maxtext", "tpu-inference-fused")
SEED = 0
LIMIT = 1.10
# Weights as stored: (dtype, `fused_experts.weight_kind`).
WEIGHTS = {"bf16": ("bfloat16", "float"), "fp8-block": ("float8_e4m3fn", "block")}
# MaxText's tiles (base.yml: wi / wo tile_fwd_batch_seq, embed_dim, mlp_dim) and its row padding.
MAXTEXT_TILING = (512, 1024, 1024)
MAXTEXT_PAD_ROWS = 512
# NOTE: top-level XLA instructions beside the three Mosaic calls when megablox's gmm runs wi_0,
# wi_1 and wo on one device as MaxText does (the SwiGLU fusion between them included): 44-48 at a
# 512-row buffer, AOT-compiled for v5e, v5p, v6e and tpu7x (jax 0.12.0.1, libtpu 0.0.50.1; the
# counting of `bench.decode_ops`). The calls share one group-metadata computation (XLA folds the
# identical ones), so this is per layer, not per call. Buffers of 8,192-32,768 rows compile to
# 67-114: the figure is low for megablox's larger buffers (128 tokens at EP 8 and 32).
MEGABLOX_XLA_OPS = 45
# Bytes of a block scale (DeepSeek-V3 stores f32 `weight_scale_inv`).
_SCALE_BYTES = 4
_ASSUMED_CALL_US = 2.0
_OP_US_GRID = (0.25, 0.5, 1.0, 2.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeModel:
  """A model's MoE dims and the expert-parallel degrees and weight formats modeled."""

  name: str
  experts: int
  top_k: int
  d: int
  f: int
  eps: tuple[int, ...]
  weights: tuple[str, ...]


MODELS = (
  DecodeModel(
    name="deepseek-v3",
    experts=256,
    top_k=8,
    d=7168,
    f=2048,
    eps=(8, 32),
    weights=("fp8-block", "bf16"),
  ),
  DecodeModel(
    name="qwen3-30b-a3b", experts=128, top_k=8, d=2048, f=768, eps=(8,), weights=("bf16",)
  ),
  DecodeModel(
    name="mixtral-8x7b", experts=8, top_k=2, d=4096, f=14336, eps=(1,), weights=("bf16",)
  ),
)


# ----------------------------------------------------------------------------------------------
# Routing and the floor.


def route(*, experts: int, top_k: int, ep: int, tokens: int, seed: int = SEED) -> np.ndarray:
  """Rows per local expert of every device after one seeded routing draw.

  Args:
    experts: E.
    top_k: experts per token (distinct).
    ep: devices (expert-parallel degree); device r holds experts [r E / ep, (r + 1) E / ep).
    tokens: tokens per device (ep x tokens in all).
    seed: numpy seed.

  Returns:
    int32 [ep, E / ep].
  """
  rng = np.random.default_rng(seed)
  keys = rng.random((ep * tokens, experts))
  # NOTE: the top_k smallest of i.i.d. uniform keys: a uniform subset of top_k distinct experts.
  choice = np.argpartition(keys, top_k - 1, axis=1)[:, :top_k]
  sizes = np.bincount(choice.ravel(), minlength=experts)
  return sizes.reshape(ep, experts // ep).astype(np.int32)


def busiest_device(sizes: np.ndarray) -> int:
  """The device with the most non-empty local experts (ties: the most rows, then the last)."""
  return int(np.lexsort((sizes.sum(1), (sizes > 0).sum(1)))[-1])


def expert_bytes(model: DecodeModel, weights: str) -> int:
  """HBM bytes of one expert's weights as stored: gate, up and down values, and block scales."""
  dtype, kind = WEIGHTS[weights]
  d, f = model.d, model.f
  values = 3 * d * f * jnp.dtype(dtype).itemsize
  if kind == "block":
    b = 128
    return values + _SCALE_BYTES * ((d // b) * (2 * f // b) + (f // b) * (d // b))
  return values


def device_bandwidth(generation) -> float:
  """One JAX device's HBM bandwidth: one TensorCore's share of the chip's times the device's
  TensorCores (`tensorcore_rates`, as `bench.measured.device_hbm_bytes_per_s`): the chip's on
  v5e, v5p and v6e, half the chip's on tpu7x (a device is one of its two TensorCores)."""
  gen = get_generation(generation)
  return tensorcore_rates(gen)[1] * gen.tensorcores_per_device


# ----------------------------------------------------------------------------------------------
# The fused kernel's schedule.


def _plan(
  model: DecodeModel, weights: str, *, rows: int, local: int, gen, tokens: int | None = None
) -> fe.FusedPlan:
  dtype, kind = WEIGHTS[weights]
  return fe.plan_fused(
    rows=rows,
    d=model.d,
    f=model.f,
    num_experts=local,
    x_dtype=jnp.bfloat16,
    w_dtype=dtype,
    kind=kind,
    generation=gen,
    tokens=tokens,
  )


@functools.cache
def max_call_rows(model: DecodeModel, weights: str, *, local: int, chip: str, limit: int) -> int:
  """The most rows (a multiple of 16, at most `limit` rounded up) one fused call fits in VMEM.

  Returns:
    Rows (0: not even 16 rows fit).
  """
  gen = get_generation(chip)

  def fits(rows: int) -> bool:
    try:
      _plan(model, weights, rows=rows, local=local, gen=gen)
    except ValueError:
      return False
    return True

  lo, hi = 0, -(-max(limit, 1) // 16)
  while lo < hi:  # NOTE: the VMEM estimate grows with the rows: bisect on 16-row units.
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(16 * mid) else (lo, mid - 1)
  return 16 * lo


def pack_calls(sizes: np.ndarray, cap: int) -> list[np.ndarray]:
  """Splits one device's rows (sorted by local expert) into fused calls of at most `cap` rows:
  whole experts, in order, packed greedily (an expert of more than `cap` rows alone is cut into
  calls of `cap`, each re-reading its weights).

  Returns:
    Per call, the [E_l] group sizes it is given (zeros for the experts of other calls).
  """
  if cap <= 0:
    raise ValueError(f"cap={cap}: not even one row fits a fused call")
  calls, cur = [], np.zeros_like(sizes)
  for e, s in enumerate(sizes):
    if s and cur.sum() + s > cap and cur.any():
      calls.append(cur)
      cur = np.zeros_like(sizes)
    while s > cap:
      piece = np.zeros_like(sizes)
      piece[e] = cap
      calls.append(piece)
      s -= cap
    cur[e] += s
  if cur.any() or not calls:
    calls.append(cur)
  return calls


def window_macs(plan: fe.FusedPlan, generation) -> float:
  """Padded MACs of one window pass of one step: gate, up and down of `plan.window` rows over a
  chunk, as `bench.costmodel.kernel_dot_macs` counts the kernel's dots (rows to at least
  `min_pass_rows`, contraction and columns to the MXU edge; block-scaled weights multiply per
  128-row block of the contraction)."""
  gen = get_generation(generation)
  mxu = gen.mxu_size
  rows = max(plan.window, min_pass_rows(gen))

  def pad(x: int) -> int:
    return -(-x // mxu) * mxu

  d, c = plan.d, plan.chunk
  if plan.kind == "block":
    b = plan.block
    gate_up = 2 * (d // b) * rows * pad(b) * pad(c)
    down = plan.chunk_blocks * rows * pad(b) * pad(d)
  else:
    gate_up = 2 * rows * pad(d) * pad(c)
    down = rows * pad(c) * pad(d)
  return float(gate_up + down)


def expert_windows(plan: fe.FusedPlan, sizes: np.ndarray) -> np.ndarray:
  """Window passes per expert and step, as the kernel loops (`fused_experts._expert_step`): from
  the expert's first row rounded down to `plan.align` to its end, `plan.window` rows at a time."""
  sizes = np.asarray(sizes, np.int64)
  ends = np.cumsum(sizes)
  start = ((ends - sizes) // plan.align) * plan.align
  return np.where(sizes > 0, -(-(ends - start) // plan.window), 0)


def _stream(plan: fe.FusedPlan, sizes: np.ndarray, gen, *, visit_all: bool) -> dict:
  """One call's streamed schedule at one TensorCore's rates (seconds and bytes)."""
  flops, bw = tensorcore_rates(gen)
  visits = np.arange(len(sizes)) if visit_all else np.flatnonzero(sizes)
  per_window = window_macs(plan, gen) * 2 / flops
  mxu = np.repeat(expert_windows(plan, sizes)[visits] * per_window, plan.chunks)
  steps = len(mxu)
  dma = plan.step_weight_bytes / bw
  nxt = np.full(steps, dma)
  if steps:
    nxt[-1] = 0.0  # NOTE: the last step starts no copy.
  stream = float(np.maximum(mxu, nxt).sum())
  return dict(
    steps=steps,
    weight_bytes=steps * plan.step_weight_bytes,
    exposed_s=dma if steps else 0.0,
    stream_s=stream,
    mxu_excess_s=stream - float(nxt.sum()),
    mxu_s=float(mxu.sum()),
    dma_s=steps * dma,
  )


def _summed(parts: list[dict], plans: list[fe.FusedPlan], gen, **extra) -> dict:
  kernel_s = sum(p["exposed_s"] + p["stream_s"] for p in parts)
  steps = sum(p["steps"] for p in parts)
  return dict(
    kernel_us=kernel_s * 1e6,
    calls=len(parts),
    xla_ops=0,
    steps=steps,
    weight_bytes_read=int(sum(p["weight_bytes"] for p in parts)),
    mxu_us=sum(p["mxu_s"] for p in parts) * 1e6,
    dma_us=sum(p["dma_s"] for p in parts) * 1e6,
    exposed_us=sum(p["exposed_s"] for p in parts) * 1e6,
    mxu_excess_us=sum(p["mxu_excess_s"] for p in parts) * 1e6,
    chunk=min(p.chunk for p in plans),
    window=max(p.window for p in plans),
    tensorcores=1,
    step_overhead_us=steps * gen.step_overhead_s * 1e6,
    **extra,
  )


def _balanced(sizes: np.ndarray, cap: int, calls: int) -> list[np.ndarray] | None:
  """`pack_calls` at the smallest cap (a multiple of 16, at most `cap`) that needs at most
  `calls` calls: calls of even size, so each holds fewer rows and gets a wider chunk."""
  step = 16
  for c in range(-(-int(sizes.sum()) // (calls * step)) * step, cap + 1, step):
    packed = pack_calls(sizes, c)
    if len(packed) <= calls:
      return packed
  return None


def model_fused(model: DecodeModel, weights: str, sizes: np.ndarray, chip: str) -> dict:
  """Ours: the non-empty experts' weights streamed once, in one call where the rows fit VMEM.

  Where they do not, whole experts go to the fewest calls that fit, rows balanced between them
  (fewer rows per call leave VMEM for a wider chunk), or to up to two more calls where that
  models faster (each call pays its own first copy and fixed cost).

  Returns:
    kernel_us (fixed costs not included), calls, steps, weight_bytes_read, mxu_us, dma_us,
    exposed_us, mxu_excess_us (time the MXU work adds over the stream of copies), chunk (the
    narrowest of the calls'), window, step_overhead_us (the generation's per-step overhead times
    the steps: not charged, see `sensitivity`), both_cores_us (v5p: the same work split evenly
    between the device's two TensorCores, a hypothetical).
  """
  gen = get_generation(chip)
  sizes = np.asarray(sizes)
  local, rows = len(sizes), int(sizes.sum())
  cap = max_call_rows(model, weights, local=local, chip=gen.name, limit=rows)
  fewest = len(pack_calls(sizes, cap))
  best = None
  for n in range(fewest, fewest + 3 if fewest > 1 else 2):
    packed = _balanced(sizes, cap, n) if n > 1 else pack_calls(sizes, cap)
    if packed is None:
      continue
    plans = [_plan(model, weights, rows=max(int(c.sum()), 1), local=local, gen=gen) for c in packed]
    parts = [_stream(p, c, gen, visit_all=False) for p, c in zip(plans, packed, strict=True)]
    total = sum(p["exposed_s"] + p["stream_s"] for p in parts) + len(parts) * (
      costmodel.call_fixed_us(gen) * 1e-6
    )
    if best is None or total < best[0]:
      best = (total, plans, parts)
  _, plans, parts = best
  both = None
  if gen.tensorcores_per_device > 1:
    # NOTE: each core streams half the steps at its own rates: the exposed copy once per core.
    n = gen.tensorcores_per_device
    both = sum(p["exposed_s"] + p["stream_s"] / n for p in parts) * 1e6
  return _summed(parts, plans, gen, both_cores_us=both)


def gather_scatter_macs(plan: fe.FusedPlan, generation) -> tuple[float, float]:
  """Padded MACs of the token mode's one-hot products (`fused_experts._gather_rows` and
  `_scatter_rows`): the gather [R, n] x [n, d] (rows R = plan.rows, contraction n tokens) and
  the scatter [n, R] x [R, d] in f32 at HIGHEST precision."""
  gen = get_generation(generation)
  mxu, p = gen.mxu_size, min_pass_rows(gen)

  def pad(x: int) -> int:
    return -(-x // mxu) * mxu

  n, r, d = plan.tokens, plan.rows, plan.d
  return float(max(r, p) * pad(n) * pad(d)), float(max(n, p) * pad(r) * pad(d))


# NOTE: an f32 x f32 product at HIGHEST precision is six bf16 passes on the MXU.
_F32_HIGHEST_PASSES = 6


def model_fused_serving(
  model: DecodeModel, weights: str, sizes: np.ndarray, chip: str, *, ep: int, tokens: int
) -> dict | None:
  """Ours as `pallas_moe.decode.moe_decode` runs it: one call planned for the static buffer of
  `plan_decode` (ep x T x min(top_k, E_l) rows, the ep x T token table in VMEM), the kernel
  gathering its rows and summing them per token with one-hot products (exposed: the gather
  before the first copy starts, the scatter after the last step).

  Returns:
    As `model_fused` (plus gather_scatter_us), or None where that plan does not fit VMEM
    (`moe_decode` then runs the gmm pair for float weights and refuses block-scaled ones).
  """
  gen = get_generation(chip)
  local = len(sizes)
  rows = ep * tokens * min(model.top_k, local)
  try:
    plan = _plan(model, weights, rows=rows, local=local, gen=gen, tokens=ep * tokens)
  except ValueError:
    return None
  part = _stream(plan, np.asarray(sizes), gen, visit_all=False)
  gather, scatter = gather_scatter_macs(plan, gen)
  flops = tensorcore_rates(gen)[0]
  onehot_s = 2 * (gather + _F32_HIGHEST_PASSES * scatter) / flops
  part["exposed_s"] += onehot_s
  return _summed([part], [plan], gen, gather_scatter_us=onehot_s * 1e6, buffer_rows=rows)


def model_tpu_inference(model: DecodeModel, weights: str, sizes: np.ndarray, chip: str) -> dict:
  """tpu-inference's approach: every local expert's weights streamed, one call (its steps as
  ours at the same plan; an empty expert's steps copy and do no MXU work)."""
  gen = get_generation(chip)
  local = len(sizes)
  rows = int(sizes.sum())
  cap = max_call_rows(model, weights, local=local, chip=gen.name, limit=rows)
  plan = _plan(model, weights, rows=max(1, min(rows, cap)), local=local, gen=gen)
  return _summed([_stream(plan, np.asarray(sizes), gen, visit_all=True)], [plan], gen)


# ----------------------------------------------------------------------------------------------
# megablox as MaxText calls it.


def maxtext_buffer_rows(model: DecodeModel, *, ep: int, tokens: int) -> int:
  """MaxText's dropless receive buffer, tokens x top_k x min(ep, E / top_k) rows, padded to
  `MAXTEXT_PAD_ROWS` (see `bench.maxtext_layer`)."""
  rows = tokens * model.top_k * min(ep, model.experts // model.top_k)
  return -(-rows // MAXTEXT_PAD_ROWS) * MAXTEXT_PAD_ROWS


@functools.lru_cache(maxsize=64)
def _megablox_schedules(k: int, n: int, local: int, buffer_rows: int, sizes: bytes):
  from bench import impls
  from bench.shapes import Shape

  gs = np.frombuffer(sizes, np.int32)
  shape = Shape(name="decode", tokens=buffer_rows, top_k=1, num_groups=local, k=k, n=n)
  case = impls._megablox_build(MAXTEXT_TILING)(
    op="fwd", shape=shape, group_sizes=gs, generation=None
  )
  return tuple(costmodel.analyze(case.fn, *case.args, step_scale=case.step_scale))


def model_megablox(model: DecodeModel, sizes: np.ndarray, chip: str, *, ep: int, tokens: int):
  """megablox's gmm as MaxText runs it: wi_0 and wi_1 ([d, f] each) and wo ([f, d]), bf16."""
  gen = get_generation(chip)
  rows = maxtext_buffer_rows(model, ep=ep, tokens=tokens)
  gs = np.asarray(sizes, np.int32).tobytes()
  wi = _megablox_schedules(model.d, model.f, len(sizes), rows, gs)
  wo = _megablox_schedules(model.f, model.d, len(sizes), rows, gs)
  calls = (wi, wi, wo)
  reps = [costmodel.cost(s, generation=gen, tensorcores="kernel") for s in calls]
  weight = sum(
    v for s in calls for c in s for k, v in c.operand_bytes.items() if k.startswith("in1")
  )
  return dict(
    kernel_us=sum(r.modeled_us for r in reps),
    calls=len(calls),
    xla_ops=MEGABLOX_XLA_OPS,
    steps=sum(c.steps for r in reps for c in r.calls),
    weight_bytes_read=int(weight),
    hbm_bytes=int(sum(r.hbm_bytes for r in reps)),
    mxu_us=sum(c.mxu_us for r in reps for c in r.calls),
    dma_us=sum(c.dma_us for r in reps for c in r.calls),
    exposed_us=sum(c.exposed_us for r in reps for c in r.calls),
    buffer_rows=rows,
    tensorcores=max(c.tensorcores for r in reps for c in r.calls),
  )


# ----------------------------------------------------------------------------------------------
# The per-call fixed cost from tokamax's measurements.


def fit_call_fixed_us(cache_dir: str | Path | None = None) -> dict[str, dict]:
  """Measured - modeled of tokamax's small problem (v2 forward, m=8, k=n=4096, G=8) per chip.

  Args:
    cache_dir: tokamax's data/autotuning (default: the installed tokamax's).

  Returns:
    {chip or chip+"+res" (under `jax.vjp`): {measured_us, modeled_us, fixed_us, floor_us,
    measured_over_floor}}; `costmodel.CALL_FIXED_US` holds the plain forward's fixed_us.
  """
  from bench import measured

  problems, _ = measured.load_problems(cache_dir=cache_dir, kernels=("v2",), ops=("fwd",))
  out = {}
  for p in problems:
    if (p.m, p.k, p.n, p.num_groups) != (8, 4096, 4096, 8):
      continue
    mc = measured.model_config(p, p.best)
    floor = p.num_groups * p.k * p.n * 2 / device_bandwidth(p.chip) * 1e6
    out[p.chip + ("+res" if p.residuals else "")] = dict(
      measured_us=mc.measured_us,
      modeled_us=mc.modeled_us,
      fixed_us=mc.measured_us - mc.modeled_us,
      floor_us=floor,
      measured_over_floor=mc.measured_us / floor,
    )
  return out


# ----------------------------------------------------------------------------------------------
# Records.


def _cases(models, tokens):
  for m in models:
    for ep in m.eps:
      for t in tokens:
        sizes = route(experts=m.experts, top_k=m.top_k, ep=ep, tokens=t)
        dev = busiest_device(sizes)
        for w in m.weights:
          yield m, w, ep, t, dev, sizes[dev]


def records(
  *,
  models: Sequence[DecodeModel] = MODELS,
  tokens: Sequence[int] = TOKENS,
  chips: Sequence[str] = CHIPS,
  impls: Sequence[str] = IMPLS,
  log=None,
) -> list[dict]:
  """One record per (model, weights, ep, tokens, chip, impl), fixed costs at the defaults."""
  out = []
  for m, w, ep, t, dev, sizes in _cases(models, tokens):
    t0 = time.time()
    nonempty = int((sizes > 0).sum())
    floor_bytes = nonempty * expert_bytes(m, w)
    for chip in chips:
      gen = get_generation(chip)
      floor_us = floor_bytes / device_bandwidth(gen) * 1e6
      for impl in impls:
        if impl == "fused":
          rec = model_fused(m, w, sizes, chip)
        elif impl == "fused-serving":
          rec = model_fused_serving(m, w, sizes, chip, ep=ep, tokens=t)
          if rec is None:
            out.append(
              dict(
                model=m.name,
                weights=w,
                ep=ep,
                tokens=t,
                chip=gen.name,
                impl=impl,
                modeled_us=None,
                floor_us=floor_us,
                ratio=None,
                fits=False,
                nonempty_experts=nonempty,
                local_experts=len(sizes),
                rows=int(sizes.sum()),
              )
            )
            continue
        elif impl == "tpu-inference-fused":
          rec = model_tpu_inference(m, w, sizes, chip)
        else:
          rec = model_megablox(m, sizes, chip, ep=ep, tokens=t)
        fixed = costmodel.fixed_cost_us(gen, calls=rec["calls"], xla_ops=rec["xla_ops"])
        modeled = rec["kernel_us"] + fixed
        read_dtype = "bfloat16" if impl == "megablox-maxtext" else WEIGHTS[w][0]
        out.append(
          dict(
            model=m.name,
            weights=w,
            ep=ep,
            tokens=t,
            chip=gen.name,
            impl=impl,
            modeled_us=modeled,
            floor_us=floor_us,
            ratio=modeled / floor_us,
            nonempty_experts=nonempty,
            local_experts=len(sizes),
            rows=int(sizes.sum()),
            device=dev,
            floor_bytes=int(floor_bytes),
            fixed_us=fixed,
            call_fixed_us=costmodel.call_fixed_us(gen),
            weights_read_dtype=read_dtype,
            fits=True,
            **rec,
          )
        )
    if log:
      log(f"{m.name} {w} ep {ep} tokens {t}: {time.time() - t0:.1f}s")
  return out


def _ratio(r: dict, *, call_us: float | None, op_us: float, step: bool = False) -> float:
  call = r["call_fixed_us"] if call_us is None else call_us
  extra = r.get("step_overhead_us", 0.0) if step else 0.0
  return (r["kernel_us"] + extra + r["calls"] * call + r["xla_ops"] * op_us) / r["floor_us"]


def sensitivity(recs: list[dict]) -> list[dict]:
  """How the ratios move with the fixed costs: per-call 0, 2 µs or the fitted figure, per XLA
  instruction 0.25-2 µs; and ours with the generation's per-step overhead charged per step.

  Returns:
    Rows: {call, op_us, step_overhead, per impl: median ratio, points <= LIMIT, points}.
  """
  rows = []
  settings = [(c, o, False) for c in (0.0, _ASSUMED_CALL_US, None) for o in _OP_US_GRID]
  settings.append((None, costmodel.XLA_OP_FIXED_US, True))
  for call, op_us, step in settings:
    row = dict(call="fitted" if call is None else call, op_us=op_us, step_overhead=step)
    for impl in IMPLS:
      ratios = np.array(
        [
          _ratio(r, call_us=call, op_us=op_us, step=step)
          for r in recs
          if r["impl"] == impl and r["fits"]
        ]
      )
      if ratios.size:
        row[impl] = dict(
          median=float(np.median(ratios)), meets=int((ratios <= LIMIT).sum()), points=ratios.size
        )
    rows.append(row)
  return rows


def _why(r: dict) -> str:
  """What puts a fused record above the floor, as shares of the floor."""
  gen = get_generation(r["chip"])
  floor = r["floor_us"]
  core_bw = tensorcore_rates(gen)[1]
  parts = {
    "fixed": r["fixed_us"],
    "first copies": r["exposed_us"],
    "one TensorCore of two": r["floor_bytes"] / core_bw * 1e6 - floor,
    "MXU over DMA": r["mxu_excess_us"],
    "weights re-read": (r["weight_bytes_read"] - r["floor_bytes"]) / core_bw * 1e6,
  }
  items = sorted(parts.items(), key=lambda kv: -kv[1])
  return ", ".join(f"{k} +{v / floor:.0%}" for k, v in items if v >= 0.005 * floor)


def verdict(recs: list[dict]) -> dict:
  """Which fused points meet LIMIT x floor, and which no kernel can (one call's fitted fixed
  cost alone over LIMIT - 1 of the floor)."""
  fused = [r for r in recs if r["impl"] == "fused"]
  v5p = [r for r in fused if r.get("both_cores_us") is not None]
  both = [(r["both_cores_us"] + r["fixed_us"]) / r["floor_us"] for r in v5p]
  key = ("model", "weights", "ep", "tokens", "chip")
  meets = [{k: r[k] for k in key} | {"ratio": r["ratio"]} for r in fused if r["ratio"] <= LIMIT]
  impossible, other = [], []
  for r in fused:
    if r["ratio"] <= LIMIT:
      continue
    row = {k: r[k] for k in key} | dict(
      ratio=r["ratio"], floor_us=r["floor_us"], call_fixed_us=r["call_fixed_us"], why=_why(r)
    )
    (impossible if r["call_fixed_us"] > (LIMIT - 1) * r["floor_us"] else other).append(row)
  return dict(
    meets=meets,
    impossible=impossible,
    other=other,
    points=len(fused),
    both_cores=dict(
      points=len(both),
      meets=int(sum(x <= LIMIT for x in both)),
      median=float(np.median(both)) if both else None,
    ),
  )


# ----------------------------------------------------------------------------------------------
# Report.


def _config_label(r: dict) -> str:
  ep = f"EP {r['ep']}" if r["ep"] > 1 else "no EP"
  return f"{r['model']} {r['weights']}, {ep}"


def _grid(recs: list[dict], cell) -> list[str]:
  """Rows (model, weights, ep) x chip, columns tokens per device: `cell(records of the point)`."""
  points: dict[tuple, dict[int, list[dict]]] = {}
  for r in recs:
    points.setdefault((_config_label(r), r["chip"]), {}).setdefault(r["tokens"], []).append(r)
  tokens = sorted({r["tokens"] for r in recs})
  lines = [
    "| model, weights, EP | chip | " + " | ".join(f"T={t}" for t in tokens) + " |",
    "|---|---|" + "---:|" * len(tokens),
  ]
  for (label, chip), row in points.items():
    cells = [cell(row[t]) if t in row else "" for t in tokens]
    lines.append(f"| {label} | {chip} | " + " | ".join(cells) + " |")
  return lines


def _by_impl(rs: list[dict]) -> dict[str, dict]:
  return {r["impl"]: r for r in rs}


def _fused_cell(rs: list[dict]) -> str:
  r = _by_impl(rs)["fused"]
  x = f"{r['ratio']:.2f}"
  x = f"**{x}**" if r["ratio"] <= LIMIT else x
  calls = f", {r['calls']} calls" if r["calls"] > 1 else ""
  return f"{x} ({r['floor_us']:,.0f} µs, {r['nonempty_experts']}/{r['local_experts']}{calls})"


def _serving_cell(rs: list[dict]) -> str:
  r = _by_impl(rs)["fused-serving"]
  if not r["fits"]:
    return "gmm" if r["weights"] == "bf16" else "refused"
  x = f"{r['ratio']:.2f}"
  x = f"**{x}**" if r["ratio"] <= LIMIT else x
  return f"{x} (chunk {r['chunk']})"


def _others_cell(rs: list[dict]) -> str:
  by = _by_impl(rs)
  return " · ".join(
    f"{by[i]['ratio']:.2f}" for i in ("megablox-maxtext", "tpu-inference-fused") if i in by
  )


def _fit_lines(fit: dict | None) -> list[str]:
  lines = [
    "| chip | measured µs | modeled µs | measured - modeled (per-call fixed) | floor µs "
    "| measured / floor | under jax.vjp: fixed |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for chip in CHIPS:
    if fit and chip in fit:
      f, res = fit[chip], fit.get(chip + "+res", {})
      lines.append(
        f"| {chip} | {f['measured_us']:.1f} | {f['modeled_us']:.2f} | **{f['fixed_us']:.2f}** "
        f"| {f['floor_us']:.2f} | {f['measured_over_floor']:.3f} "
        f"| {res.get('fixed_us', float('nan')):.2f} |"
      )
    else:
      stand_in = costmodel.CALL_FIXED_STAND_IN.get(chip, chip)
      lines.append(
        f"| {chip} | no problem | | {costmodel.call_fixed_us(chip):.2f} (assumed: {stand_in}'s)"
        " | | | |"
      )
  return lines


def _sensitivity_lines(rows: list[dict]) -> list[str]:
  lines = [
    "| per call µs | per XLA op µs | "
    + " | ".join(f"{i}: median, points ≤ {LIMIT:.2f}" for i in IMPLS)
    + " |",
    "|---|---:|" + "---:|" * len(IMPLS),
  ]
  for row in rows:
    call = row["call"] if row["call"] == "fitted" else f"{row['call']:g}"
    if row["step_overhead"]:
      call += " + per-step overhead on ours"
    cells = [f"{row[i]['median']:.2f}, {row[i]['meets']}/{row[i]['points']}" for i in IMPLS]
    lines.append(f"| {call} | {row['op_us']:g} | " + " | ".join(cells) + " |")
  return lines


def _verdict_lines(v: dict) -> list[str]:
  lines = [
    f"**Fused ≤ {LIMIT:.2f}x floor: {len(v['meets'])} of {v['points']} points.**",
    "",
    f"Points no kernel can bring to {LIMIT:.2f}x: one call's fitted fixed cost alone is more "
    f"than {LIMIT - 1:.0%} of the floor ({len(v['impossible'])}):",
    "",
    "| model, weights, EP | T | chip | floor µs | one call's fixed µs | fixed / floor "
    "| fused / floor |",
    "|---|---:|---|---:|---:|---:|---:|",
  ]
  for r in v["impossible"]:
    lines.append(
      f"| {_config_label(r)} | {r['tokens']} | {r['chip']} | {r['floor_us']:,.1f} "
      f"| {r['call_fixed_us']:.2f} | {r['call_fixed_us'] / r['floor_us']:.0%} | {r['ratio']:.2f} |"
    )
  both = v["both_cores"]
  if both["points"]:
    lines += [
      "",
      "v5p, hypothetically with the fused work split between the device's two TensorCores (a "
      f"leading parallel grid axis; not what the kernel does): median {both['median']:.2f}, "
      f"{both['meets']} of {both['points']} points ≤ {LIMIT:.2f}x.",
    ]
  lines += [
    "",
    f"Other points above {LIMIT:.2f}x ({len(v['other'])}), with what puts fused above the floor "
    "(shares of the floor):",
    "",
    "| model, weights, EP | T | chip | fused / floor | why |",
    "|---|---:|---|---:|---|",
  ]
  for r in v["other"]:
    lines.append(
      f"| {_config_label(r)} | {r['tokens']} | {r['chip']} | {r['ratio']:.2f} | {r['why']} |"
    )
  return lines


def markdown(result: dict) -> str:
  """The report: assumptions, the fixed-cost fit, the tables, the verdict and the sensitivity."""
  recs = result["records"]
  a = result["assumptions"]
  out = [
    "# Decode-size expert work: modeled time against the weight-read floor",
    "",
    f"`{a['command']}` ({a['software']}; {a['machine']}; {a['date']}). **Modeled, not "
    "measured**: no TPU ran anything. One device's expert work of one MoE layer (gate/up, "
    "SwiGLU, down; routing and the exchange not included), fixed costs included, over the "
    "floor: the bytes of the device's non-empty local experts' weights as stored (values and "
    "scales) over the device's HBM bandwidth.",
    "",
    "**How to read.** Each cell is modeled / floor for the device with the most non-empty local "
    "experts of one seeded routing draw (the layer waits for its slowest device); 1.00 is the "
    "floor, bold is at most 1.10. The fused table adds the floor in µs and the device's "
    "non-empty / local experts (and the number of fused calls where the rows need more than "
    "one). The chips' rates are per JAX device, floor included: one TensorCore's share of the "
    "chip times the device's TensorCores (`generations.tensorcore_rates`): a tpu7x device is "
    "one TensorCore (half the chip's bandwidth); a v5p device is two, and a kernel runs on one "
    "of them unless its grid has a parallel axis Mosaic splits (the fused kernel and the "
    "tpu-inference-style kernel do not; megablox's n tiles do).",
    "",
    "## Assumptions",
    "",
  ]
  out += [f"- {line}" for line in a["notes"]]
  out += ["", "## The per-call fixed cost, from tokamax's measured times", ""]
  out += _fit_lines(result.get("fit"))
  out += ["", "## Fused (ours) / floor", ""]
  out += _grid(recs, _fused_cell)
  out += ["", "## Ours as the serving path runs it (`moe_decode`) / floor", ""]
  out += [
    "`plan_decode` plans the fused call for a static buffer of ep x T x min(top_k, E_l) rows "
    "and the ep x T token table (the kernel gathers its rows and sums them per token). "
    "gmm: that plan does not fit VMEM and `moe_decode` runs the gmm pair instead (not modeled "
    "here); refused: the same for fp8 block-scaled weights, which `plan_decode` refuses.",
    "",
  ]
  out += _grid(recs, _serving_cell)
  out += ["", "## megablox-maxtext / floor · tpu-inference-fused / floor", ""]
  out += _grid(recs, _others_cell)
  out += ["", "## Which points meet 1.10x", ""]
  out += _verdict_lines(result["verdict"])
  out += ["", "## Sensitivity to the fixed costs", ""]
  out += _sensitivity_lines(result["sensitivity"])
  return "\n".join(out) + "\n"


def _notes(fit: dict | None) -> list[str]:
  calls = ", ".join(f"{k} {v:.2f} µs" for k, v in costmodel.CALL_FIXED_US.items())
  src = "refit from the installed tokamax" if fit else "tokamax not installed: the constants"
  return [
    f"Per-call fixed cost (`costmodel.CALL_FIXED_US`): {calls}; v5e takes v5p's (tokamax has "
    f"no small problem for v5e) ({src}). It is measured - modeled of one problem size, so it "
    "cannot be told apart from HBM below its peak (measured / floor 1.13 on v5p and v6e): "
    "charged as a fixed cost it is an upper bound. Were it bandwidth efficiency instead, no "
    "kernel could come within 1.10x of the floor at any size on v5p and v6e.",
    f"Per XLA instruction: {costmodel.XLA_OP_FIXED_US:g} µs (assumed: no measurement pins it). "
    f"megablox-maxtext pays {MEGABLOX_XLA_OPS} (its group metadata, shared by its three calls, "
    "and the SwiGLU fusion; AOT-counted at a 512-row buffer: 44-48 on the four chips, 67-114 at "
    "8,192-32,768 rows, so low for its 128-token points). Ours and the tpu-inference-style "
    "kernel: none (group metadata in SMEM; rows assumed to arrive aligned).",
    "Fused: the generation's per-step overhead is not charged per streamed step (the next "
    "step's copies are issued before this step's work, so the DMA queue never runs dry); the "
    "sensitivity table's last row charges it.",
    "MXU: one TensorCore's bf16 peak (fp8 weights upcast in VMEM: the upcast's VPU work and "
    "the scales' multiplies are not modeled); each window's rows padded to 128 "
    "(`min_pass_rows`), contraction and columns to the MXU edge (so a 128-row block of "
    "block-scaled weights costs a 256-deep pass on v6e and tpu7x).",
    "DMA: at one TensorCore's bandwidth, no efficiency loss for the [d, chunk] gate/up blocks' "
    "strided rows (chunk x itemsize contiguous bytes per row).",
    "megablox-maxtext: bf16 weights (also for the fp8 records, whose floor stays fp8: MaxText "
    "runs DeepSeek-V3 dequantized); rows padded to MaxText's dropless buffer; three calls; the "
    "pad and MaxText's own sort / permute not charged.",
    "tpu-inference-fused: every local expert's weights at HBM bandwidth, the first copy "
    "exposed, one call; its per-expert exposed first copies and in-kernel all-to-all (the "
    "kernel also routes and exchanges) not charged: a lower bound for it.",
    f"Routing: seed {SEED}, one draw per (model, EP, tokens); top_k distinct experts per token, "
    "uniform; the device with the most non-empty local experts.",
  ]


def run(
  *,
  json_path: str | None = None,
  markdown_path: str | None = None,
  tokens: Sequence[int] = TOKENS,
  chips: Sequence[str] = CHIPS,
  models: Sequence[str] | None = None,
  command: str = "python -m bench.decode",
  log=None,
) -> dict:
  """Models every point, prints the report, writes the JSON and markdown when asked.

  Returns:
    {"assumptions", "fit", "records", "sensitivity", "verdict"}.
  """
  from bench import measured

  t0 = time.time()
  fit = fit_call_fixed_us() if measured.default_cache_dir() is not None else None
  chosen = [m for m in MODELS if models is None or m.name in models]
  recs = records(models=chosen, tokens=tokens, chips=chips, log=log)
  result = dict(
    assumptions=dict(
      command=command,
      machine="2-core VM, no TPU",
      software=f"Python {sys.version_info.major}.{sys.version_info.minor}, jax {jax.__version__}",
      date=datetime.date(2026, 11, 28).isoformat(),
      limit=LIMIT,
      seed=SEED,
      call_fixed_us=dict(costmodel.CALL_FIXED_US),
      call_fixed_stand_in=dict(costmodel.CALL_FIXED_STAND_IN),
      xla_op_fixed_us=costmodel.XLA_OP_FIXED_US,
      megablox_xla_ops=MEGABLOX_XLA_OPS,
      maxtext_tiling=list(MAXTEXT_TILING),
      maxtext_pad_rows=MAXTEXT_PAD_ROWS,
      notes=_notes(fit),
    ),
    fit=fit,
    records=recs,
    sensitivity=sensitivity(recs),
    verdict=verdict(recs),
  )
  text = markdown(result)
  print(text)
  if json_path:
    Path(json_path).write_text(json.dumps(result, indent=1))
  if markdown_path:
    Path(markdown_path).write_text(text)
  if log:
    log(f"bench.decode: {len(recs)} records in {time.time() - t0:.0f}s")
  return result


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n")[0])
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--markdown", default=None, help="write the report here")
  ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
  ap.add_argument("--chips", nargs="+", default=list(CHIPS), choices=list(CHIPS))
  ap.add_argument("--models", nargs="+", default=None, choices=[m.name for m in MODELS])
  ap.add_argument("--fit", action="store_true", help="print the per-call fixed-cost fit only")
  args = ap.parse_args(argv)
  if args.fit:
    print(json.dumps(fit_call_fixed_us(), indent=1))
    return 0
  cmd = "python -m bench.decode" + "".join(
    f" {a}" for a in (argv if argv is not None else sys.argv[1:])
  )
  run(
    json_path=args.json,
    markdown_path=args.markdown,
    tokens=args.tokens,
    chips=args.chips,
    models=args.models,
    command=cmd,
    log=lambda s: print(s, file=sys.stderr, flush=True),
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
