"""Decode-size expert work on one device, against the weight-read floor.

  python -m bench.decode [--json FILE] [--markdown FILE] [--tokens 1 8 32 128]
                         [--chips v5e v5p v6e tpu7x] [--models ...] [--seed 0]
  python -m bench --decode --json FILE [--markdown FILE]

At a few tokens per device an MoE layer's expert work is reading expert weights: the floor is the
bytes of the device's non-empty local experts' weights, as stored (values and scales), over the
device's HBM bandwidth. Per (model, weights, expert-parallel degree, tokens per device, chip) this
models the expert work of one device (gate/up, the activation and down; not routing or the
exchange) six ways, fixed costs included:

- "moe_decode" (the headline): ours as the serving path `pallas_moe.decode.moe_decode` runs it,
  planned by its own `plan_decode`. Path "fused" (ep x T <= `MAX_FUSED_TOKENS` and VMEM fits):
  one `fused_experts` call in the tokens layout, each token's product scaled by its routing
  weight. Up to `GATHER_ABOVE` tokens every visited local expert (one a token chose) runs over
  all ep x T tokens, one 128-row window per step; above, each visited expert runs over its own
  tokens only (`FusedPlan.gather`): at its first chunk (per TensorCore) it gathers them into
  ceil(count / 128) windows by a one-hot [128, N] x [N, d] product per window, each step runs
  gate/up/down over those windows, and at its last chunk it adds them back by the transposed
  product ([128, N] contracted over the 128 with [128, d]), both bf16 on the MXU. Path "block"
  (above `MAX_FUSED_TOKENS`, or VMEM does not fit): `moe.moe_block`'s forward at `plan_decode`'s
  `plan_block(..., tensor_parallelism=1)`. Its experts are the fused kernel streaming the
  receive buffer's rows (`BlockPlan.fused`, `model_block_stream`: each visit copies its rows in
  and its finished rows out beside the weights), on a megacore device (v5p) its visits split
  between the two TensorCores. A block plan without the fused kernel (`BlockPlan.fused` None:
  the training layer's) runs our two row-tile gmm calls (gate/up, then down) over the buffer,
  each costed by `bench.costmodel` on the real pallas_call as `bench.impls`' "pallas_moe-moe"
  builds it, with the SwiGLU fusion between them (`model_block_path`).
- "fused": the same kernel on the routed rows sorted by expert (`fused_experts` without
  `expert_weights`), whole experts packed into the fewest calls whose rows fit VMEM: what the
  kernel alone does where the serving path leaves it.
- "megablox-maxtext": upstream megablox's gmm as MaxText 0.2.5 calls it at decode: the dropless
  receive buffer (tokens x top_k x min(ep, E / top_k) rows) padded to 512 rows, three calls
  (wi_0, wi_1, wo) at base.yml's tiles (512, 1024, 1024) clamped to the dims, bf16 weights (also
  for the DeepSeek-V3 fp8 records: MaxText runs it dequantized), each call costed by
  `bench.costmodel` on the real pallas_call (TensorCores per kernel). Fixed: three calls and
  `MEGABLOX_XLA_OPS` top-level XLA instructions.
- "maxtext-switch": the same MaxText call with `pallas_moe.maxtext.gmm` in megablox's place (the
  one-line switch, docs/maxtext.md): three calls over the same padded buffer, our gmm's own
  tiles for the buffer's rows (MaxText passes no hint of the rows it expects to fill), bf16
  weights, the SwiGLU fusion between them. Fixed: three calls and `SWITCH_XLA_OPS`.
- "maxtext-switch-prefused": the switch with MaxText's `prefuse_moe_weights`: gate and up as one
  gmm over [wi_0 | wi_1] (adjacent slices of the stored wi, so no copy). Fixed: two calls and
  `SWITCH_PREFUSED_XLA_OPS`.
- "tpu-inference-fused": vLLM tpu-inference's fused MoE kernel's approach: one kernel that
  streams every local expert's weights, empty or not, double-buffered: the fused schedule with
  every local expert visited (empty ones with no MXU work), one call, one TensorCore.

The fused kernel's schedule (`pallas_moe.fused_experts`): steps of (visited expert, chunk of f),
each copying `FusedPlan.step_weight_bytes`. On a device with two TensorCores (v5p) the grid is
(2,) "parallel" and each core streams `FusedPlan.core_chunks` of every visited expert: each core
is modeled at one TensorCore's rates with its half of the steps, the call's time is the busiest
core's, and one XLA op adds the two partial sums (in the result's dtype) after the call. Per
core: the activations' copies (rows in, routing weights in, result out; the inputs are read
whole into one VMEM copy) are exposed; the weight steps run as `pipeline` replays them: each
step's copies in `FusedPlan.pieces` pieces of d, served in order, each piece's products as soon
as it has arrived, so the first piece's copy and the last piece's products are what the stream
exposes.
MXU work per window of rows and step: one [window, d] x [d, chunk] product each for gate and up,
one [window, chunk] x [chunk, d] for down, the window padded to `generations.min_pass_rows`,
contraction and columns to the MXU edge (what `bench.costmodel` charges the kernel's dots), at one
TensorCore's bf16 peak; in the gathered layout, a visited expert's first step on a core gathers
its windows by one-hot products before its first piece's products, and its last step adds each
down piece's columns back by the transposed product once that piece is done (`gather_macs`),
so only the last piece's add back follows the last copy. Block-scaled
fp8 weights take vector work inside the products' loop (scaled partials, or each block
dequantized on its way to the MXU): the compiled step issues `ISSUE_BUNDLES` bundles per 1,024
values per window (`bench.fused_vliw`), and a window takes the longer of that and its MXU time
(`step_compute_s`). Where the compiled step of a plan the grid runs issues longer than that
(`bench.fused_vliw --points`: the gathered layout's one-hot builds and f32 adds, the activation
between the products), the model takes the compiled issue (`compiled_issue`).

Group sizes: one seeded draw per (model, ep, tokens): ep x tokens tokens each choose top_k
distinct experts uniformly; a device's local experts are a contiguous block of E / ep. Reported:
the device with the most non-empty local experts (ties: the most rows), since the layer waits for
its slowest device.

Fixed costs (`bench.costmodel.fixed_cost_us`): per Pallas call, measured - modeled of tokamax's one
small measured problem (`fit_call_fixed_us`); per XLA instruction, an assumption
(`costmodel.XLA_OP_FIXED_US`). `sensitivity` shows how the ratios move with both. The layer's
other XLA instructions (routing, the exchange) are not expert work: `DECODE_XLA_OPS`,
`GATHER_XLA_OPS`, `BLOCK_LAYER_XLA_OPS` and `LAYER_XLA_OPS` give their fixed cost apart from the
ratios.
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
from bench.llo import implied_clock_hz  # noqa: E402
from bench.shapes import Shape  # noqa: E402
from pallas_moe import quant  # noqa: E402
from pallas_moe.config import MoEConfig  # noqa: E402
from pallas_moe.generations import get_generation, min_pass_rows, tensorcore_rates  # noqa: E402

# NOTE: the modules, not the package's re-exported functions of the same names.
fe = importlib.import_module("pallas_moe.fused_experts")
serving = importlib.import_module("pallas_moe.decode")

__all__ = [
  "DecodeModel",
  "MODELS",
  "WEIGHTS",
  "TOKENS",
  "CHIPS",
  "IMPLS",
  "HEADLINE",
  "MEGABLOX_XLA_OPS",
  "DECODE_XLA_OPS",
  "LAYER_XLA_OPS",
  "BLOCK_LAYER_XLA_OPS",
  "BLOCK_EXPERT_XLA_OPS",
  "GATHER_XLA_OPS",
  "route_choices",
  "route",
  "busiest_device",
  "expert_bytes",
  "device_bandwidth",
  "max_call_rows",
  "pack_calls",
  "window_macs",
  "gather_macs",
  "model_step_s",
  "plan_key",
  "compiled_steps",
  "compiled_issue",
  "expert_windows",
  "activation_bytes",
  "model_fused",
  "model_serving",
  "serving_plan",
  "path_label",
  "path_kind",
  "PATH_KINDS",
  "model_block_path",
  "BLOCK_STREAM_LAYER_XLA_OPS",
  "model_block_stream",
  "stream_visits",
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
IMPLS = (
  "moe_decode",
  "fused",
  "megablox-maxtext",
  "maxtext-switch",
  "maxtext-switch-prefused",
  "tpu-inference-fused",
)
# NOTE: the impl the 1.10x verdict is about: the serving path.
HEADLINE = "moe_decode"
LABELS = {
  "moe_decode": "ours (moe_decode)",
  "fused": "fused kernel, sorted rows",
  "megablox-maxtext": "megablox-maxtext",
  "maxtext-switch": "maxtext-switch",
  "maxtext-switch-prefused": "maxtext-switch-prefused",
  "tpu-inference-fused": "tpu-inference-fused",
}
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
# NOTE: the same with `pallas_moe.maxtext.gmm` (the switch): 45-49 costed top-level instructions
# at a 512-row buffer, the three Mosaic calls among them, on the four chips (`python -m
# bench.decode_ops --path switch --topology v6e:2x2`; megablox 44-49 the same way).
SWITCH_XLA_OPS = 47
# NOTE: with MaxText's `prefuse_moe_weights` (one gmm for gate and up): 42-44, two Mosaic calls
# among them (`python -m bench.decode_ops --path switch-prefused`).
SWITCH_PREFUSED_XLA_OPS = 43
# NOTE: `moe_decode`'s compiled layer (`python -m bench.decode_ops`: Qwen3-30B-A3B dims, EP 4,
# v6e:2x2, jax 0.12.0.1, libtpu 0.0.50.1, at 9110b14): 8 tokens per device, 33 top-level
# instructions, 21 beside parameters, tuples, bitcasts and constants, one of them the Mosaic
# call (`bench/results/decode-ops.md`'s 22 predate 63650e8, which dropped a layout op of the
# routing weights). None of the 21 is expert work (routing, the selection fusion, the all-gather,
# the reduce-scatter): they are reported apart from the ratios. At 64 tokens per device (256 on
# the expert axis, the gathered layout) it compiles to 26: `GATHER_XLA_OPS` more (the token
# lists' iota and sort of [E_l, N] and a fusion in the sort scope, two reshapes of the lists for
# the kernel). The block path, `moe_block`'s forward, at 256 tokens per device (1,024 on the
# expert axis, past the fused path): with the gmm pair 210 top-level, 143 costed, both for
# `moe_decode` and `moe_layer` (`--path layer`), 52 of them in the experts scope (the two gmm
# calls' group metadata, the receiver's expand and reduce): the block path's expert work pays
# those 52, the rest is reported apart. With the streamed fused kernel (`moe_decode` since
# 5511db3), 127 top-level, 88 costed, and the experts scope is the one Mosaic call. `moe_layer`'s
# forward at 8 tokens per device compiles to 124 costed (38 experts scope;
# `bench/results/decode-ops.md`): the column ours is compared with.
DECODE_XLA_OPS = 21
GATHER_XLA_OPS = 5
LAYER_XLA_OPS = 124
BLOCK_LAYER_XLA_OPS = 143
BLOCK_EXPERT_XLA_OPS = 52
BLOCK_STREAM_LAYER_XLA_OPS = 88
# NOTE: a streamed call split over two TensorCores (v5p): the shared granule added (a fusion of
# its slice and the add) and written back in place, at the row the kernel wrote as one uint32
# (compiled for v5p; `test_seam_xla_ops_as_compiled`).
SEAM_XLA_OPS = 2
# NOTE: block-scaled fp8 weights pass through the vector unit inside the products' loop: on the
# "partials" route (v5e, v5p: the stored values multiplied as they are, one product per
# 128-deep block row, the partials scaled; v6e's row is kept for comparison), on "e4m3b11"
# (v6e: each block's bytes read as float8_e4m3b11fnuz, scaled and cast to bf16 on its way to
# the MXU) and on "astype" (tpu7x: the same, converted as stored; no dequantized copy in VMEM). The
# compiled step's bundles per 1,024 values, base + per_row x the window's rows, fit on the step
# compiled at 16 and 128 tokens (one window of them; `python -m bench.fused_vliw`,
# bench/results/fused-vliw.md). Vector and MXU work are one loop, so the step takes the longer
# of this issue and the MXU's time, at the clock the bf16 peak implies (a lower bound on v6e and
# tpu7x, whose implied clocks exceed published ones).
ISSUE_BUNDLES = {
  ("v5e", "partials"): (0.3573, 0.016016),  # at 64 rows: 1.382 (compiled 1.383)
  ("v5p", "partials"): (0.3689, 0.018089),  # 1.527 (1.505)
  # NOTE: partials on v6e (no longer its route), fit before a 16-row window took 14 pieces.
  ("v6e", "partials"): (0.4131, 0.00851),  # 0.958 (0.940)
  ("v6e", "e4m3b11"): (0.9481, 0.001513),  # 1.045 (1.022)
  ("tpu7x", "astype"): (0.7335, 0.000696),  # 0.778 (0.755)
}
# Bytes of a block scale (DeepSeek-V3 stores f32 `weight_scale_inv`).
# NOTE: the gathered layout's table check at the call's start (`fused_experts._clean_table`:
# non-finite values zeroed, their rows marked), bundles per 1,024 table values, read from the
# compiled kernel's schedule: DeepSeek-V3's fp8 experts over 256 gathered tokens, 16 trips of a
# loop over one 16-row granule (v5e 269, v5p 270, v6e 292, tpu7x 295 bundles a trip). It runs
# while the first step's copies stream; the first product waits for both.
TABLE_CHECK_BUNDLES = {"v5e": 2.40, "v5p": 2.41, "v6e": 2.61, "tpu7x": 2.63}
# NOTE: the compiled step of every fused plan the grid models (`python -m bench.fused_vliw
# --points`): where it issues longer than the model's MXU time and fp8 issue, the model takes
# the compiled figure (`compiled_issue`).
COMPILED_STEPS = Path(__file__).parent / "results" / "fused-vliw-points.json"
_SCALE_BYTES = 4
# NOTE: the sorted-rows layout's [rows, 1] f32 row weights: a column laid out in 128 lanes.
_COLUMN_BYTES = 128 * 4
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

  def config(self) -> MoEConfig:
    """The layer config `plan_decode` and `plan_block` plan for (bf16 compute)."""
    return MoEConfig(
      num_experts=self.experts,
      top_k=self.top_k,
      d_model=self.d,
      expert_ffn_dim=self.f,
      dtype="bfloat16",
      weight_dtype="bfloat16",
    )


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


def route_choices(*, experts: int, top_k: int, ep: int, tokens: int, seed: int = SEED):
  """Each token's experts after one seeded routing draw.

  Args:
    experts: E.
    top_k: experts per token (distinct).
    ep: devices (expert-parallel degree).
    tokens: tokens per device (ep x tokens in all, device-major: device r's are r T to
      (r + 1) T - 1, as `moe_decode`'s all-gather lays them out).
    seed: numpy seed.

  Returns:
    int [ep x tokens, top_k].
  """
  rng = np.random.default_rng(seed)
  keys = rng.random((ep * tokens, experts))
  # NOTE: the top_k smallest of i.i.d. uniform keys: a uniform subset of top_k distinct experts.
  return np.argpartition(keys, top_k - 1, axis=1)[:, :top_k]


def route(*, experts: int, top_k: int, ep: int, tokens: int, seed: int = SEED) -> np.ndarray:
  """Rows per local expert of every device after one seeded routing draw (`route_choices`);
  device r holds experts [r E / ep, (r + 1) E / ep).

  Returns:
    int32 [ep, E / ep].
  """
  choice = route_choices(experts=experts, top_k=top_k, ep=ep, tokens=tokens, seed=seed)
  sizes = np.bincount(choice.ravel(), minlength=experts)
  return sizes.reshape(ep, experts // ep).astype(np.int32)


def routed_tokens(
  *, experts: int, top_k: int, ep: int, tokens: int, device: int, seed: int = SEED
) -> int:
  """The distinct tokens of one routing draw (`route_choices`) that chose at least one of
  `device`'s local experts: the rows any kernel of that device's experts must read (and whose
  results it must write) at least once."""
  choice = route_choices(experts=experts, top_k=top_k, ep=ep, tokens=tokens, seed=seed)
  local = choice // (experts // ep) == device
  return int(local.any(axis=1).sum())


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


def mxu_floor_us(model: DecodeModel, weights: str, sizes: np.ndarray, generation) -> float:
  """The least time any MXU kernel needs to multiply the non-empty experts' weights by their rows.

  An MXU takes in at most one `mxu_size`-wide row of a weight tile per cycle: a pass through a
  tile costs `min_pass_rows` row cycles however few rows multiply it (`costmodel`'s charge,
  checked against tokamax's measured tm = 128 problems), and one cycle per row above that. So
  expert e (`sizes[e]` rows, 3 d f weight elements) takes 2 x max(rows, `min_pass_rows`) x 3 d f
  flops of MXU time, at the fastest rate the chip multiplies these weights by bf16 rows: bf16,
  or fp8 where the MXU multiplies fp8 natively (tpu7x; v5e, v5p and v6e run fp8 weights upcast).
  """
  gen = get_generation(generation)
  dtype, _ = WEIGHTS[weights]
  peak = tensorcore_rates(gen)[0] * gen.tensorcores_per_device
  if jnp.dtype(dtype).itemsize == 1 and gen.supports_fp8:
    peak = max(peak, gen.peak_fp8_ops / gen.cores_per_chip * gen.tensorcores_per_device)
  sizes = np.asarray(sizes, np.int64)
  rows = np.where(sizes > 0, np.maximum(sizes, min_pass_rows(gen)), 0).sum()
  return float(rows) * 2 * 3 * model.d * model.f / peak * 1e6


def bound_us(floor_us: float, mxu_us: float, call_us: float, rows_us: float = 0.0) -> float:
  """The least time one call of any kernel can take: its fixed cost, then the longer of moving
  the weights (the floor) and the routed tokens' rows in and results out (`rows_us`) through
  HBM, and taking the weights into the MXUs (`mxu_floor_us`)."""
  return max(floor_us + rows_us, mxu_us) + call_us


# ----------------------------------------------------------------------------------------------
# The fused kernel's schedule.


def _plan(
  model: DecodeModel,
  weights: str,
  *,
  rows: int,
  local: int,
  gen,
  cores: int | None = None,
  **layout,
) -> fe.FusedPlan:
  """`plan_fused` for `rows` bf16 rows over `local` experts of `model` (`layout`: by_token,
  gather, stream)."""
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
    cores=cores,
    **layout,
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
  `min_pass_rows`, contraction and columns to the MXU edge). Every weight kind runs the same
  full-depth products (block-scaled weights dequantized on their way to the MXU), except the
  "partials" route's 128-deep ones."""
  gen = get_generation(generation)
  mxu = gen.mxu_size
  rows = max(plan.window, min_pass_rows(gen))

  def pad(x: int) -> int:
    return -(-x // mxu) * mxu

  d, c = plan.d, plan.chunk
  if plan.kind == "block" and plan.upcast == "partials":
    # NOTE: one product per 128-deep block row: each contraction is the block, padded to the
    # MXU edge (twice the MACs on a 256-wide MXU).
    b = plan.block
    return float(2 * rows * (d // b) * pad(b) * pad(c) + rows * (c // b) * pad(b) * pad(d))
  return float(2 * rows * pad(d) * pad(c) + rows * pad(c) * pad(d))


def window_issue_s(plan: fe.FusedPlan, generation) -> float:
  """Seconds the compiled step issues per window of block-scaled weights (`ISSUE_BUNDLES` at
  the plan's window and route, at `bench.llo.implied_clock_hz`); 0 for other kinds.

  Raises:
    KeyError: a (generation, route) the compiled schedule has not been read for.
  """
  if plan.kind != "block":
    return 0.0
  gen = get_generation(generation)
  base, per_row = ISSUE_BUNDLES[(gen.name, plan.upcast)]
  values = 3 * plan.d * plan.chunk
  return values / 1024 * (base + per_row * plan.window) / implied_clock_hz(gen)


def table_check_s(plan: fe.FusedPlan, generation) -> float:
  """Seconds the gathered layout's table check issues (`TABLE_CHECK_BUNDLES`); 0 otherwise."""
  if not plan.gather:
    return 0.0
  gen = get_generation(generation)
  return plan.rows * plan.d / 1024 * TABLE_CHECK_BUNDLES[gen.name] / implied_clock_hz(gen)


def step_compute_s(plan: fe.FusedPlan, windows, per_window: float, generation):
  """Each step's compute seconds for its `windows` windows: the MXU's time, or the compiled
  step's issue where that is longer (block-scaled weights, whose vector work shares the
  products' loop: `window_issue_s`)."""
  windows = np.asarray(windows, float)
  return np.maximum(windows * per_window, windows * window_issue_s(plan, generation))


def model_step_s(plan: fe.FusedPlan, generation) -> float:
  """The model's compute of one step as the compiled step's issue counts it
  (`bench.fused_vliw.step_counts`: a dynamic loop once, predicated regions taken): one window
  of a gathered or streamed step, its gathers and adds back both included; all the windows of
  a tokens step."""
  gen = get_generation(generation)
  flops, _ = tensorcore_rates(gen)
  windows = 1 if (plan.gather or plan.stream) else plan.rows // plan.window
  per_window = window_macs(plan, gen) * 2 / flops
  step = float(step_compute_s(plan, [windows], per_window, gen)[0])
  return step + sum(gather_macs(plan, gen)) * 2 / flops


def plan_key(plan: fe.FusedPlan, generation) -> str:
  """A fused plan's step on a generation, as text: the generation and every field of the plan
  but those that change the operands and not the step (the local experts, the VMEM figures)."""
  fields = dataclasses.asdict(plan)
  for name in ("num_experts", "vmem_bytes", "vmem_limit_bytes"):
    fields.pop(name)
  fields["generation"] = get_generation(generation).name
  return json.dumps(fields, sort_keys=True)


@functools.cache
def compiled_steps(path: str = str(COMPILED_STEPS)) -> dict[str, tuple[float, float, float]]:
  """`plan_key` -> the compiled step's (issue, of it predicated, of that in dynamic loops: one
  iteration each) in µs, from `python -m bench.fused_vliw --points`' records (empty where the
  file is absent)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    recs = json.load(f)
  return {
    r["plan_key"]: (r["issue_us"], r["predicated_us"], r["predicated_loops_us"]) for r in recs
  }


def compiled_issue(plan: fe.FusedPlan, generation) -> tuple[float, float]:
  """What the compiled step issues beyond the model's compute of it (`model_step_s`).

  The compiled step counts every predicated region as taken. Its products are its
  unconditional bundles, less the model's gathers and adds back where Mosaic predicated them
  instead of branching (at most the whole step less those): each step's compute takes the
  longer of that and the model's (the scale). The rest of the whole step, past the scaled
  compute and the model's gathers and adds back, is an expert's first and last steps' own work
  (the extra: a gathered expert's one-hot builds and f32 adds, a streamed visit's row copies).

  Returns:
    (scale >= 1 of every step's compute, extra seconds per visited expert of one window, of
    them the part in dynamic loops: one iteration each, a streamed visit's granules); (1, 0,
    0) where the plan was not compiled.
  """
  got = compiled_steps().get(plan_key(plan, generation))
  if got is None:
    return 1.0, 0.0, 0.0
  issue, predicated, loops = (x * 1e-6 for x in got)
  gen = get_generation(generation)
  flops, _ = tensorcore_rates(gen)
  gathers = sum(gather_macs(plan, gen)) * 2 / flops
  products = model_step_s(plan, gen) - gathers
  scale = max(1.0, min(issue - predicated, issue - gathers) / products)
  extra = max(0.0, issue - products * scale - gathers)
  return scale, extra, min(extra, loops)


def gather_macs(plan: fe.FusedPlan, generation) -> tuple[float, float]:
  """Padded MACs of one window's one-hot gather and of its transposed add, as
  `bench.costmodel.kernel_dot_macs` counts them (`fused_experts._gathered_step`).

  Returns:
    (gather: [window, N] x [N, d], N = `plan.rows`; add back: [window, N] contracted over the
    window with [window, d] into [N, d]): each window x N x d true MACs, the contraction and the
    columns padded to the MXU edge (the add back's 128-deep contraction pads to 256 on a 256-wide
    MXU). (0, 0) unless `plan.gather`.
  """
  if not plan.gather:
    return 0.0, 0.0
  gen = get_generation(generation)
  mxu = gen.mxu_size

  def pad(x: int) -> int:
    return -(-x // mxu) * mxu

  n, w, d = plan.rows, plan.window, plan.d
  return float(max(w, min_pass_rows(gen)) * pad(n) * pad(d)), float(n * pad(w) * pad(d))


def expert_windows(plan: fe.FusedPlan, sizes: np.ndarray) -> np.ndarray:
  """Window passes per expert and step, as the kernel loops (`fused_experts._expert_step`,
  `_gathered_step`).

  Sorted rows: from the expert's first row rounded down to `plan.align` to its end, `plan.window`
  rows at a time. Tokens (`plan.by_token`): every visited expert over all `plan.rows` tokens;
  gathered (`plan.gather`): over its own tokens, ceil(tokens / `plan.window`) windows.
  """
  sizes = np.asarray(sizes, np.int64)
  if plan.gather:
    return -(-sizes // plan.window)
  if plan.by_token:
    return np.where(sizes > 0, -(-plan.rows // plan.window), 0)
  ends = np.cumsum(sizes)
  start = ((ends - sizes) // plan.align) * plan.align
  return np.where(sizes > 0, -(-(ends - start) // plan.window), 0)


def activation_bytes(plan: fe.FusedPlan) -> int:
  """HBM bytes one TensorCore's call copies besides the weights, all exposed: its rows in, the
  routing weights in (tokens layout: [E_l, 1, rows] f32, E_l x rows x 4 bytes, and as much again
  for the gathered layout's [E_l, 1, rows] int32 token lists; sorted rows: [rows, 1] f32, a
  column in 128 lanes), its result out (its partial sum where the call is split over
  TensorCores, in the result's dtype)."""
  x_item = jnp.dtype(plan.x_dtype).itemsize
  out_item = jnp.dtype(plan.out_dtype).itemsize
  if plan.by_token:
    weights = plan.num_experts * plan.rows * 4 * (2 if plan.gather else 1)
  else:
    weights = plan.rows * _COLUMN_BYTES
  return plan.rows * plan.d * (x_item + out_item) + weights


def _partial_sum_s(plan: fe.FusedPlan, gen) -> float:
  """The XLA op after a split call: the cores' partial sums read, the result written
  (streamed rows: one shared granule, `SEAM_XLA_OPS`' fixed cost only)."""
  if plan.cores == 1 or plan.stream:
    return 0.0
  out_item = jnp.dtype(plan.out_dtype).itemsize
  return plan.rows * plan.d * (plan.cores + 1) * out_item / device_bandwidth(gen)


def pipeline(
  mxu: np.ndarray,
  copy: float,
  *,
  pieces: int,
  head=None,
  tail=None,
  start: float = 0.0,
  before=None,
  after_down=None,
) -> tuple[float, float, float]:
  """One TensorCore's steps as the fused kernel runs them (`fused_experts._kernel`), piece by
  piece.

  A step's weights come in `pieces` gate/up pieces (2/3 of its bytes and of its MXU work,
  split evenly) then as many down pieces (1/3). The DMA queue is served in order at the
  TensorCore's bandwidth. Step s starts once step s - 1's products are done; it waits for its
  first gate/up piece, then queues all of step s + 1's copies (its slot's last reader was step
  s - 1), then multiplies each piece once it has arrived and the previous piece's product is
  done.

  Args:
    mxu: each step's MXU seconds.
    copy: one step's weight copy, seconds.
    pieces: `FusedPlan.pieces`.
    head: per step, seconds of copies queued just ahead of its weights (a visit's rows, which
      `_visit_rows_turn` starts before the next step's weights).
    tail: per step, seconds queued just behind its weights (a visit's finished rows, started
      after its last step's products).
    start: seconds of the core's own work before its first product (the gathered layout's
      table check), run while the first copies stream.
    before: per step, seconds of work at its start, once its first piece is in, before its
      first product (the gathered layout's one-hot gathers at an expert's first step).
    after_down: per step, seconds of work after each down piece's products, split evenly
      over the pieces (the gathered layout's adds back at an expert's last step).

  Returns:
    (seconds until the first product can start, seconds until the last is done, seconds of
    all the copies).
  """
  steps = len(mxu)
  if not steps:
    return 0.0, 0.0, 0.0
  head = np.zeros(steps) if head is None else np.asarray(head, float)
  tail = np.zeros(steps) if tail is None else np.asarray(tail, float)
  before = np.zeros(steps) if before is None else np.asarray(before, float)
  after_down = np.zeros(steps) if after_down is None else np.asarray(after_down, float)
  shares = np.array([2 / 3 / pieces] * pieces + [1 / 3 / pieces] * pieces)
  down = np.array([0.0] * pieces + [1 / pieces] * pieces)
  free = 0.0

  def queue(s, at):
    nonlocal free
    t = max(at, free) + head[s]
    arrivals = t + np.cumsum(shares * copy)
    free = float(arrivals[-1] + tail[s])
    return arrivals

  arrivals = queue(0, 0.0)
  first = max(start, float(arrivals[0]))
  done = start
  for s in range(steps):
    begin = max(done, float(arrivals[0]))
    nxt = queue(s + 1, begin) if s + 1 < steps else None
    t = begin + before[s]
    for k, share in enumerate(shares):
      t = max(t, float(arrivals[k])) + mxu[s] * share + after_down[s] * down[k]
    done, arrivals = t, nxt
  return first, done, float(steps * copy + head.sum() + tail.sum())


def _stream(plan: fe.FusedPlan, sizes: np.ndarray, gen, *, visit_all: bool) -> dict:
  """One call's schedule on one of its TensorCores (each streams `plan.core_chunks` of every
  visited expert, so all are alike), at one TensorCore's rates (seconds and bytes). Gathered: a
  visited expert's first step adds its windows' one-hot gathers, its last step their adds back
  (on each core)."""
  flops, bw = tensorcore_rates(gen)
  visits = np.arange(len(sizes)) if visit_all else np.flatnonzero(sizes)
  per_window = window_macs(plan, gen) * 2 / flops
  windows = expert_windows(plan, sizes)[visits]
  scale, extra, _ = compiled_issue(plan, gen)
  compute = step_compute_s(plan, windows, per_window, gen) * scale
  vector = float((compute - windows * per_window).sum()) * plan.core_chunks
  mxu = np.repeat(compute, plan.core_chunks)
  mxu = mxu.reshape(len(visits), plan.core_chunks)
  gather, scatter = (m * 2 / flops for m in gather_macs(plan, gen))
  before, after_down = np.zeros_like(mxu), np.zeros_like(mxu)
  if len(visits):
    # NOTE: the compiled step's own work at an expert's first and last steps, half each (per
    # window where the windows are the expert's own).
    own = windows if plan.gather else np.ones_like(windows)
    before[:, 0] = windows * gather + own * extra / 2
    after_down[:, -1] = windows * scatter + own * extra / 2
  mxu, before, after_down = mxu.ravel(), before.ravel(), after_down.ravel()
  steps = len(mxu)
  dma = plan.step_weight_bytes / bw
  first, total, copies = pipeline(
    mxu, dma, pieces=plan.pieces, start=table_check_s(plan, gen), before=before,
    after_down=after_down,
  )  # fmt: skip
  return dict(
    core_steps=steps,
    steps=steps * plan.cores,
    weight_bytes=steps * plan.cores * plan.step_weight_bytes,
    io_s=activation_bytes(plan) / bw,
    exposed_s=first,
    stream_s=total - first,
    mxu_excess_s=total - copies,
    mxu_s=float(mxu.sum() + before.sum() + after_down.sum()),
    gather_mxu_s=float(windows.sum() * (gather + scatter)),
    vector_s=vector,
    dma_s=copies,
    issue_scale=scale,
    issue_extra_s=float(before.sum() + after_down.sum())
    - float(windows.sum() * (gather + scatter)),
  )


def _summed(parts: list[dict], plans: list[fe.FusedPlan], gen, **extra) -> dict:
  """Calls in sequence: each its busiest core's time, then its partial sums' XLA op."""
  sums = sum(_partial_sum_s(p, gen) for p in plans)
  kernel_s = sum(p["io_s"] + p["exposed_s"] + p["stream_s"] for p in parts) + sums
  core_steps = sum(p["core_steps"] for p in parts)
  total = lambda key: sum(p[key] for p in parts) * 1e6  # noqa: E731
  return dict(
    kernel_us=kernel_s * 1e6,
    calls=len(parts),
    xla_ops=sum((SEAM_XLA_OPS if p.stream else 1) for p in plans if p.cores > 1),
    steps=sum(p["steps"] for p in parts),
    core_steps=core_steps,
    weight_bytes_read=int(sum(p["weight_bytes"] for p in parts)),
    mxu_us=total("mxu_s"),
    gather_mxu_us=total("gather_mxu_s"),
    vector_us=total("vector_s"),
    dma_us=total("dma_s"),
    io_us=total("io_s"),
    exposed_us=total("exposed_s"),
    mxu_excess_us=total("mxu_excess_s"),
    partial_sum_us=sums * 1e6,
    chunk=min(p.chunk for p in plans),
    pieces=min(p.pieces for p in plans),
    window=max(p.window for p in plans),
    tensorcores=max(p.cores for p in plans),
    step_overhead_us=core_steps * gen.step_overhead_s * 1e6,
    issue_scale=max(p.get("issue_scale", 1.0) for p in parts),
    issue_extra_us=total("issue_extra_s") if all("issue_extra_s" in p for p in parts) else 0.0,
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
  """The fused kernel on the routed rows sorted by expert: the non-empty experts' weights
  streamed once, in one call where the rows fit VMEM.

  Where they do not, whole experts go to the fewest calls that fit, rows balanced between them
  (fewer rows per call leave VMEM for a wider chunk), or to up to two more calls where that
  models faster (each call pays its own fixed cost, activation copies and first copy).

  Returns:
    kernel_us (per-call and per-op fixed costs not included), calls, xla_ops (the partial sums
    of split calls), steps (all cores'), core_steps (one core's), weight_bytes_read; per core:
    mxu_us (gather_mxu_us of it: the gathered layout's one-hot products), dma_us, io_us
    (activation copies), exposed_us (until the first weight piece is in), mxu_excess_us (time
    the MXU work adds over the stream of copies); partial_sum_us, chunk (the narrowest of the
    calls'), pieces, window, tensorcores, step_overhead_us (the generation's per-step overhead times
    one core's steps: not charged, see `sensitivity`).
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
    rec = _summed(parts, plans, gen)
    total = rec["kernel_us"] + costmodel.fixed_cost_us(
      gen, calls=rec["calls"], xla_ops=rec["xla_ops"]
    )
    if best is None or total < best[0]:
      best = (total, rec)
  return best[1]


def model_tpu_inference(model: DecodeModel, weights: str, sizes: np.ndarray, chip: str) -> dict:
  """tpu-inference's approach: every local expert's weights streamed, one call on one
  TensorCore (its steps as ours at the same plan; an empty expert's steps copy and do no MXU
  work)."""
  gen = get_generation(chip)
  local = len(sizes)
  rows = int(sizes.sum())
  cap = max_call_rows(model, weights, local=local, chip=gen.name, limit=rows)
  plan = _plan(model, weights, rows=max(1, min(rows, cap)), local=local, gen=gen, cores=1)
  return _summed([_stream(plan, np.asarray(sizes), gen, visit_all=True)], [plan], gen)


# ----------------------------------------------------------------------------------------------
# The serving path.


def _stored(model: DecodeModel, weights: str, local: int):
  """The device's `wi` as `plan_decode` reads it (its kind and dtype), abstract."""
  dtype, kind = WEIGHTS[weights]
  values = jax.ShapeDtypeStruct((local, model.d, 2 * model.f), dtype)
  if kind != "block":
    return values
  b = quant.BLOCK
  scales = jax.ShapeDtypeStruct((local, model.d // b, 2 * model.f // b), jnp.float32)
  return quant.BlockQuantizedWeights(values=values, scales=scales, block=b)


def serving_plan(
  model: DecodeModel, weights: str, chip: str, *, ep: int, tokens: int
) -> serving.DecodePlan:
  """`plan_decode`'s plan for the device's local experts on `chip` (its block path's
  `plan_block` under that generation's tiling, as on the chip)."""
  from pallas_moe import tiling as tiling_lib

  gen = get_generation(chip)
  with tiling_lib.use_generation(gen):
    return serving.plan_decode(
      model.config(),
      tokens_per_device=tokens,
      expert_parallelism=ep,
      weights=_stored(model, weights, model.experts // ep),
      generation=gen,
    )


def _layer_ops(plan: serving.DecodePlan) -> int:
  """The layer's XLA instructions beside the expert work: the fused call's all-gather, routing
  and sort (`DECODE_XLA_OPS`, `GATHER_XLA_OPS` more for the token lists); `moe_block`'s forward
  on the block path (`BLOCK_STREAM_LAYER_XLA_OPS` with the streamed kernel)."""
  if plan.path == "block":
    return BLOCK_LAYER_XLA_OPS if plan.block.fused is None else BLOCK_STREAM_LAYER_XLA_OPS
  return DECODE_XLA_OPS + (GATHER_XLA_OPS if plan.fused.gather else 0)


def model_serving(
  model: DecodeModel, weights: str, sizes: np.ndarray, chip: str, *, ep: int, tokens: int
) -> dict:
  """Ours as `pallas_moe.decode.moe_decode` runs it, on the path its `plan_decode` picks.

  Path "fused": one `fused_experts` call in the tokens layout (every visited expert over all
  ep x T tokens, or gathered: over its own). Path "block": at the plan's `plan_block`, its
  experts the streamed fused kernel (`model_block_stream`) or the gmm pair (`model_block_path`).

  Returns:
    As `model_fused` (plus gather_mxu_us), `model_block_stream` or `model_block_path`, plus
    path, layout ("all tokens", "gathered", "streamed" or "gmm"), reason (why the path is not
    one fused call) and layer_xla_ops (the layer's XLA instructions beside the expert work,
    `_layer_ops`).
  """
  gen = get_generation(chip)
  sizes = np.asarray(sizes)
  plan = serving_plan(model, weights, chip, ep=ep, tokens=tokens)
  extra = dict(reason=plan.reason, layer_xla_ops=_layer_ops(plan))
  if plan.path == "block":
    if plan.block.fused is not None:
      return model_block_stream(plan.block.fused, sizes, chip) | extra
    return model_block_path(model, sizes, chip, ep=ep, tokens=tokens, plan=plan.block) | extra
  layout = "gathered" if plan.fused.gather else "all tokens"
  stream = _stream(plan.fused, sizes, gen, visit_all=False)
  return _summed(
    [stream], [plan.fused], gen, path="fused", layout=layout, rows_per_call=plan.fused.rows, **extra
  )


def stream_visits(plan: fe.FusedPlan, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
  """A streamed call's visits as the kernel makes them (`fused_experts._stream_metadata`), rows
  sorted by expert in `sizes` order.

  Returns:
    Per visit: (expert, first row, end row, rows copied in, granules copied out): a visit
    holds its rows from the first rounded down to `plan.align`, at most `plan.visit_rows` past
    that; it copies in its rows from the first rounded down to `plan.row_unit`, whole units;
    it copies out the granules it finishes (the last, unfinished one is carried on, and the
    call's last is copied out at its end).
  """
  a, u, held = plan.align, plan.row_unit, plan.visit_rows
  out, row = [], 0
  for e, size in enumerate(np.asarray(sizes, np.int64)):
    end, lo = row + int(size), row
    while lo < end:
      base = lo // a * a
      hi = min(end, base + held)
      out.append((e, lo, hi, -(-(hi - lo // u * u) // u) * u, (hi - base) // a))
      lo = hi
    row = end
  cols = np.array(out, np.int64).reshape(-1, 5)
  if row % a:
    cols[-1, 4] += 1  # NOTE: the call's last granule, copied out after the last visit.
  return tuple(cols.T)


def model_block_stream(plan: fe.FusedPlan, sizes: np.ndarray, chip: str) -> dict:
  """The streamed fused kernel over the block path's receive buffer (`BlockPlan.fused`). The
  weight steps as `_stream`'s, one per (visit, chunk): an expert over `visit_rows` rows is
  streamed again. Rows move beside the weights: a visit's first step starts the next visit's
  rows in (queued ahead of the next step's weights), its last step its finished rows out
  (behind them); only a core's first visit's rows in and last visit's rows out (and the call's
  last granule) are exposed. On a megacore device (`plan.cores` 2) the first TensorCore takes
  the first half of the visits (rounded up), the second the rest; the call takes the busier
  core's time, then `SEAM_XLA_OPS` XLA instructions add in the granule they share.

  Returns:
    As `_summed` (the busier core's times), plus path "block", layout "streamed", visits,
    row_copy_us (all the rows' copies at one TensorCore's bandwidth; `io_us` is their exposed
    part on the busier core), row_stream_us (the busier core's rows copied between its weight
    steps, in the DMA queue: time a DMA-bound stream adds to its weights').
  """
  gen = get_generation(chip)
  flops, bw = tensorcore_rates(gen)
  expert, lo, hi, copied_in, tiles_out = stream_visits(plan, sizes)
  visits, chunks = len(expert), plan.chunks
  windows = -(-(hi - lo // plan.align * plan.align) // plan.window)
  per_window = window_macs(plan, gen) * 2 / flops
  # NOTE: the block path's rows come without routing weights (they scale the kernel's output
  # rows in the reduce after it: `moe._pipelined_dedup_exchange`).
  row_in = plan.d * jnp.dtype(plan.x_dtype).itemsize
  granule_out = plan.align * plan.d * jnp.dtype(plan.out_dtype).itemsize
  rows_in, rows_out = copied_in * row_in / bw, tiles_out * granule_out / bw
  dma = plan.step_weight_bytes / bw

  scale, extra, per_granule = compiled_issue(plan, gen)
  # NOTE: a visit's own work: its dynamic loops (clearing its sums, casting and copying its
  # rows) once per granule it reaches, the rest once.
  granules = (hi - lo // plan.align * plan.align) // plan.align + 1
  visit_extra = extra - per_granule + per_granule * granules

  def core(v0: int, v1: int) -> dict:
    n = v1 - v0
    compute = step_compute_s(plan, windows[v0:v1], per_window, gen) * scale
    vector = float((compute - windows[v0:v1] * per_window).sum()) * chunks
    mxu = np.repeat(compute, chunks)
    head, tail = np.zeros(len(mxu)), np.zeros(len(mxu))
    before, after_down = np.zeros(len(mxu)), np.zeros(len(mxu))
    if n:
      starts = np.arange(n) * chunks
      # NOTE: a visit's first step starts the next visit's rows ahead of the next step's
      # weights; its last step starts its finished rows out behind them.
      head[starts[:-1] + 1] += rows_in[v0 + 1 : v1]
      tail[starts[:-1] + chunks] += rows_out[v0 : v1 - 1]
      # NOTE: the compiled step's own work at a visit's first and last steps, half each.
      before[starts] += visit_extra[v0:v1] / 2
      after_down[starts + chunks - 1] += visit_extra[v0:v1] / 2
    first, total, copies = pipeline(
      mxu, dma, pieces=plan.pieces, head=head, tail=tail, before=before, after_down=after_down
    )
    return dict(
      rows_stream_s=float(head.sum() + tail.sum()),
      core_steps=len(mxu),
      io_s=float(rows_in[v0] + rows_out[v1 - 1]) if n else 0.0,
      exposed_s=first,
      stream_s=total - first,
      mxu_excess_s=total - copies,
      mxu_s=float(mxu.sum()),
      gather_mxu_s=0.0,
      vector_s=vector,
      dma_s=copies,
      issue_scale=scale,
      issue_extra_s=float(before.sum() + after_down.sum()),
    )

  half = -(-visits // plan.cores)
  cores = [core(min(c * half, visits), min((c + 1) * half, visits)) for c in range(plan.cores)]
  part = max(cores, key=lambda c: c["io_s"] + c["exposed_s"] + c["stream_s"])
  steps = visits * chunks
  part = part | dict(steps=steps, weight_bytes=steps * plan.step_weight_bytes)
  return _summed(
    [part], [plan], gen, path="block", layout="streamed", visits=visits,
    row_copy_us=float(rows_in.sum() + rows_out.sum()) * 1e6,
    row_stream_us=part["rows_stream_s"] * 1e6,
  )  # fmt: skip


def model_gathered_distinct(
  model: DecodeModel, weights: str, sizes: np.ndarray, chip: str, *, distinct: int
) -> float | None:
  """A design not built, modeled to decide whether to build it: the block path's experts as
  the fused kernel's gathered layout over a table of the device's `distinct` routed tokens (the
  deduplicated exchange's received rows, each read and written once), in place of the
  streamed kernel over one row per (token, expert) pair.

  Optimistic for the design: the table holds only the distinct rows (a receive buffer holds
  more, and its one-hot products would contract over what is copied in), and the XLA ops it
  would add (token lists from the received rows) or remove (the expand and reduce) are not
  counted.

  Returns:
    Its modeled µs, fixed costs included (as a record's `modeled_us`); None where its table
    does not fit the kernel's VMEM.
  """
  gen = get_generation(chip)
  try:
    plan = _plan(
      model, weights, rows=max(distinct, 1), local=len(sizes), gen=gen, by_token=True,
      gather=True,
    )  # fmt: skip
  except ValueError:
    return None
  rec = _summed([_stream(plan, np.asarray(sizes), gen, visit_all=False)], [plan], gen)
  return rec["kernel_us"] + costmodel.fixed_cost_us(gen, calls=rec["calls"], xla_ops=rec["xla_ops"])


class _BufferShape(Shape):
  """A `Shape` whose rows are a receive buffer's, not tokens x top_k (which stays the rows the
  gmm expects to be real, its tiles' hint)."""

  def __init__(self, *, rows: int, **kw):
    super().__init__(**kw)
    object.__setattr__(self, "_rows", rows)

  @property
  def m(self) -> int:
    return self._rows


@functools.lru_cache(maxsize=64)
def _gmm_schedules(k: int, n: int, *, tokens: int, top_k: int, rows: int, sizes: bytes, chip: str):
  from bench import impls

  gen = get_generation(chip)
  gs = np.frombuffer(sizes, np.int32)
  shape = _BufferShape(
    name="decode", tokens=tokens, top_k=top_k, num_groups=len(gs), k=k, n=n, rows=rows
  )
  case = impls._pallas_moe_build(None, unowned_rows="undefined")(
    op="fwd", shape=shape, group_sizes=gs, generation=gen
  )
  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  row_macs = case.row_macs(gen.mxu_size) if case.row_macs else None
  return tuple(case.tiling), tuple(scheds), row_macs


def _swiglu_us(rows: int, f: int, gen) -> float:
  """The XLA fusion between the gate/up and down gmms: [rows, 2f] in, [rows, f] out (bf16), over
  the whole static buffer, at the device's bandwidth."""
  return rows * 3 * f * 2 / device_bandwidth(gen) * 1e6


def _gmm_calls(
  schedules, gen, *, row_macs=None, swiglu_us: float, xla_ops: int, weights=("in1", "manual")
) -> dict:
  """gmm calls in sequence, each costed on its schedules (`costmodel.cost`, TensorCores per
  kernel), and the SwiGLU fusion between them: the record fields they share.

  Args:
    schedules: per call, its `costmodel.analyze` schedules.
    row_macs: per call, its `row_macs` (None: none).
    weights: operand-bytes keys (prefixes) that hold the weights: "in1" for BlockSpec'd
      weights; our row-tile gmm copies its weights (and its rows) by manual DMA ("manual").
  """
  macs = row_macs or [None] * len(schedules)
  reps = [
    costmodel.cost(s, generation=gen, row_macs=m, tensorcores="kernel")
    for s, m in zip(schedules, macs, strict=True)
  ]
  weight = sum(
    v for s in schedules for c in s for k, v in c.operand_bytes.items() if k.startswith(weights)
  )
  calls = [c for r in reps for c in r.calls]
  return dict(
    kernel_us=sum(r.modeled_us for r in reps) + swiglu_us,
    calls=len(schedules),
    xla_ops=xla_ops,
    steps=sum(c.steps for c in calls),
    weight_bytes_read=int(weight),
    hbm_bytes=int(sum(r.hbm_bytes for r in reps)),
    mxu_us=sum(c.mxu_us for c in calls),
    dma_us=sum(c.dma_us for c in calls),
    exposed_us=sum(c.exposed_us for c in calls),
    swiglu_us=swiglu_us,
    tensorcores=max(c.tensorcores for c in calls),
  )


def model_block_path(
  model: DecodeModel, sizes: np.ndarray, chip: str, *, ep: int, tokens: int, plan=None
) -> dict:
  """`moe.moe_block`'s forward's expert work: our gmm on the receive buffer's rows, the SwiGLU
  fusion, our gmm again; the experts scope's `BLOCK_EXPERT_XLA_OPS` instructions.

  Args:
    plan: the `BlockPlan` (default: `plan_block(..., tensor_parallelism=1)` under the chip's
      tiling, as `plan_decode` plans it); one chunk (no batch split) is modeled.
  """
  from pallas_moe import block_plan
  from pallas_moe import tiling as tiling_lib

  gen = get_generation(chip)
  bp = plan
  if bp is None:
    with tiling_lib.use_generation(gen):
      bp = block_plan.plan_block(
        model.config(), tokens_per_device=tokens, expert_parallelism=ep, tensor_parallelism=1
      )
  if bp.batch_split != 1:
    raise NotImplementedError(f"batch_split={bp.batch_split}: only one chunk is modeled")
  expected = bp.expected_rows or bp.expert_rows
  gs = np.asarray(sizes, np.int32).tobytes()
  kw = dict(tokens=expected, top_k=1, rows=bp.expert_rows, sizes=gs, chip=gen.name)
  calls = [_gmm_schedules(model.d, 2 * model.f, **kw), _gmm_schedules(model.f, model.d, **kw)]
  return _gmm_calls(
    [s for _, s, _ in calls],
    gen,
    row_macs=[m for _, _, m in calls],
    swiglu_us=_swiglu_us(bp.expert_rows, model.f, gen),
    xla_ops=BLOCK_EXPERT_XLA_OPS,
  ) | dict(
    path="block",
    layout="gmm",
    chunks=1,
    buffer_rows=bp.expert_rows,
    expected_rows=bp.expected_rows,
    tiles=[list(t) for t, _, _ in calls],
    layer_xla_ops=BLOCK_LAYER_XLA_OPS,
  )


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

  gs = np.frombuffer(sizes, np.int32)
  shape = Shape(name="decode", tokens=buffer_rows, top_k=1, num_groups=local, k=k, n=n)
  case = impls._megablox_build(MAXTEXT_TILING)(
    op="fwd", shape=shape, group_sizes=gs, generation=None
  )
  return tuple(costmodel.analyze(case.fn, *case.args, step_scale=case.step_scale))


def model_megablox(model: DecodeModel, sizes: np.ndarray, chip: str, *, ep: int, tokens: int):
  """megablox's gmm as MaxText runs it: wi_0 and wi_1 ([d, f] each) and wo ([f, d]), bf16, and
  the SwiGLU fusion over the buffer between them."""
  gen = get_generation(chip)
  rows = maxtext_buffer_rows(model, ep=ep, tokens=tokens)
  gs = np.asarray(sizes, np.int32).tobytes()
  wi = _megablox_schedules(model.d, model.f, len(sizes), rows, gs)
  wo = _megablox_schedules(model.f, model.d, len(sizes), rows, gs)
  return _gmm_calls(
    (wi, wi, wo),
    gen,
    swiglu_us=_swiglu_us(rows, model.f, gen),
    xla_ops=MEGABLOX_XLA_OPS,
    weights=("in1",),
  ) | dict(buffer_rows=rows)


def model_maxtext_switch(
  model: DecodeModel, sizes: np.ndarray, chip: str, *, ep: int, tokens: int, prefused: bool = False
):
  """MaxText's gmm calls with the switch: our gmm on megablox's padded buffer (no hint of the
  rows to expect: the tiles are chosen for the buffer's rows; the padding rows are never read
  or written), bf16 weights, the SwiGLU fusion over the buffer between them. Three calls (wi_0,
  wi_1, wo), or two with `prefused` (MaxText's `prefuse_moe_weights`: one over [wi_0 | wi_1])."""
  gen = get_generation(chip)
  rows = maxtext_buffer_rows(model, ep=ep, tokens=tokens)
  gs = np.asarray(sizes, np.int32).tobytes()
  kw = dict(tokens=rows, top_k=1, rows=rows, sizes=gs, chip=gen.name)
  wo = _gmm_schedules(model.f, model.d, **kw)
  if prefused:
    calls = (_gmm_schedules(model.d, 2 * model.f, **kw), wo)
  else:
    wi = _gmm_schedules(model.d, model.f, **kw)
    calls = (wi, wi, wo)
  return _gmm_calls(
    [s for _, s, _ in calls],
    gen,
    row_macs=[m for _, _, m in calls],
    swiglu_us=_swiglu_us(rows, model.f, gen),
    xla_ops=SWITCH_PREFUSED_XLA_OPS if prefused else SWITCH_XLA_OPS,
  ) | dict(buffer_rows=rows, tiles=[list(t) for t, _, _ in calls[-2:]])


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
        kw = dict(experts=m.experts, top_k=m.top_k, ep=ep, tokens=t, device=dev)
        unique = routed_tokens(**kw)
        for w in m.weights:
          yield m, w, ep, t, dev, sizes[dev], unique


def _impl_record(impl: str, m: DecodeModel, w: str, sizes: np.ndarray, chip: str, *, ep, t, dev):
  if impl == "moe_decode":
    return model_serving(m, w, sizes, chip, ep=ep, tokens=t)
  if impl == "fused":
    return model_fused(m, w, sizes, chip)
  if impl == "tpu-inference-fused":
    return model_tpu_inference(m, w, sizes, chip)
  if impl.startswith("maxtext-switch"):
    prefused = impl == "maxtext-switch-prefused"
    return model_maxtext_switch(m, sizes, chip, ep=ep, tokens=t, prefused=prefused)
  return model_megablox(m, sizes, chip, ep=ep, tokens=t)


def records(
  *,
  models: Sequence[DecodeModel] = MODELS,
  tokens: Sequence[int] = TOKENS,
  chips: Sequence[str] = CHIPS,
  impls: Sequence[str] = IMPLS,
  log=None,
) -> list[dict]:
  """One record per (model, weights, ep, tokens, chip, impl), fixed costs at the defaults
  (weights_read_dtype: what the kernels read, bf16 for megablox-maxtext)."""
  out = []
  for m, w, ep, t, dev, sizes, unique in _cases(models, tokens):
    t0 = time.time()
    nonempty = int((sizes > 0).sum())
    floor_bytes = nonempty * expert_bytes(m, w)
    for chip in chips:
      gen = get_generation(chip)
      floor_us = floor_bytes / device_bandwidth(gen) * 1e6
      mxu_us = mxu_floor_us(m, w, sizes, gen)
      # NOTE: bf16 rows in, bf16 results out, each routed token once.
      rows_us = unique * m.d * 2 * 2 / device_bandwidth(gen) * 1e6
      least_us = bound_us(floor_us, mxu_us, costmodel.call_fixed_us(gen), rows_us)
      for impl in impls:
        rec = _impl_record(impl, m, w, sizes, chip, ep=ep, t=t, dev=dev)
        if impl == HEADLINE and rec.get("layout") == "streamed":
          # NOTE: the design the streamed points' row copies ask for, modeled beside them.
          design = model_gathered_distinct(m, w, sizes, chip, distinct=unique)
          rec = rec | dict(gathered_distinct_us=design)
        base = dict(
          model=m.name,
          weights=w,
          ep=ep,
          tokens=t,
          chip=gen.name,
          impl=impl,
          floor_us=floor_us,
          nonempty_experts=nonempty,
          local_experts=len(sizes),
          rows=int(sizes.sum()),
          device=dev,
          floor_bytes=int(floor_bytes),
          call_fixed_us=costmodel.call_fixed_us(gen),
          mxu_floor_us=mxu_us,
          routed_tokens=unique,
          rows_floor_us=rows_us,
          bound_us=least_us,
        )
        fixed = costmodel.fixed_cost_us(gen, calls=rec["calls"], xla_ops=rec["xla_ops"])
        modeled = rec["kernel_us"] + fixed
        read_dtype = "bfloat16" if impl.startswith(("megablox", "maxtext")) else WEIGHTS[w][0]
        out.append(
          base
          | dict(
            modeled_us=modeled,
            ratio=modeled / floor_us,
            fixed_us=fixed,
            weights_read_dtype=read_dtype,
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
  instruction 0.25-2 µs; and the fused kernel's with the generation's per-step overhead charged
  per step (the gmm calls' model charges it already).

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
        [_ratio(r, call_us=call, op_us=op_us, step=step) for r in recs if r["impl"] == impl]
      )
      if ratios.size:
        row[impl] = dict(
          median=float(np.median(ratios)), meets=int((ratios <= LIMIT).sum()), points=ratios.size
        )
    rows.append(row)
  return rows


PATH_KINDS = ("fused", "fused, gathered", "block, streamed", "block, gmm")


def path_label(r: dict) -> str:
  """A headline record's path (`PATH_KINDS`): "fused" (every visited expert over all tokens),
  "fused, gathered", "block, streamed" (moe_block's forward, its experts the streamed fused
  kernel) or "block, gmm" (its experts the gmm pair)."""
  if r.get("path", "fused") == "block":
    return "block, streamed" if r.get("layout") == "streamed" else "block, gmm"
  return "fused, gathered" if r.get("layout") == "gathered" else "fused"


def path_kind(r: dict) -> str:
  """`path_label`: one of `PATH_KINDS`."""
  return path_label(r)


def _why(r: dict) -> str:
  """What puts a record above the floor, as shares of the floor."""
  floor = r["floor_us"]
  op_us = costmodel.XLA_OP_FIXED_US
  if r.get("layout") == "gmm" or r["impl"].startswith(("megablox", "maxtext")):
    parts = {
      f"{r['calls']} calls' fixed": r["calls"] * r["call_fixed_us"],
      f"{r['xla_ops']} XLA ops": r["xla_ops"] * op_us,
      "SwiGLU over the buffer": r["swiglu_us"],
      "gmm kernels over the floor": r["kernel_us"] - r["swiglu_us"] - floor,
    }
  else:
    core_bw = tensorcore_rates(r["chip"])[1] * r["tensorcores"]
    # NOTE: the stream's time past its copies: products the copies do not hide (the last
    # piece's, or the MXU's where it is slower than HBM) and the first piece's wait.
    mxu = "MXU over DMA"
    if r.get("vector_us"):
      mxu = "MXU and vector issue over DMA"
      mxu += f" (issue past the MXU's time: {r['vector_us'] / r['mxu_us']:.0%} of that compute)"
    if r.get("gather_mxu_us"):
      mxu += f" (one-hot gather and add back: {r['gather_mxu_us'] / r['mxu_us']:.0%} of the MXU)"
    if r.get("issue_scale", 1.0) > 1.0 or r.get("issue_extra_us", 0.0) > 0.0:
      mxu += (
        f" (compiled issue: products x{r.get('issue_scale', 1.0):.2f}, "
        f"{r.get('issue_extra_us', 0.0):.1f} µs at experts' first and last steps)"
      )
    calls = f"{r['calls']} calls' fixed" if r["calls"] > 1 else "fixed"
    parts = {
      calls: r["fixed_us"],
      "activation copies": r["io_us"],
      "rows copied between the weights": r.get("row_stream_us", 0.0),
      "partial sums": r["partial_sum_us"],
      mxu: r["mxu_excess_us"],
      "one TensorCore of two": r["floor_bytes"] / core_bw * 1e6 - floor,
      "weights re-read": (r["weight_bytes_read"] - r["floor_bytes"]) / core_bw * 1e6,
    }
  items = sorted(parts.items(), key=lambda kv: -kv[1])
  return ", ".join(f"{k} +{v / floor:.0%}" for k, v in items if v >= 0.005 * floor)


_KEY = ("model", "weights", "ep", "tokens", "chip")


def _limit(r: dict) -> str:
  """What keeps a point's `bound_us` over LIMIT x the floor: "MXU intake" (`mxu_floor_us`
  over the floor and the rows), "fixed cost" (one call's, with the floor, alone over it), or
  "fixed cost and rows" (the routed tokens' rows too)."""
  if r["mxu_floor_us"] > r["floor_us"] + r["rows_floor_us"]:
    return "MXU intake"
  if r["floor_us"] + r["call_fixed_us"] > LIMIT * r["floor_us"]:
    return "fixed cost"
  return "fixed cost and rows"


def verdict(recs: list[dict], impl: str = HEADLINE) -> dict:
  """Which of `impl`'s points meet LIMIT x floor, which no kernel can (one call's fitted fixed
  cost alone over LIMIT - 1 of the floor), and why the others fail."""
  runs = [r for r in recs if r["impl"] == impl]
  meets = [{k: r[k] for k in _KEY} | {"ratio": r["ratio"]} for r in runs if r["ratio"] <= LIMIT]
  impossible, other = [], []
  for r in runs:
    if r["ratio"] <= LIMIT:
      continue
    row = {k: r[k] for k in _KEY} | dict(
      ratio=r["ratio"],
      floor_us=r["floor_us"],
      call_fixed_us=r["call_fixed_us"],
      mxu_floor_us=r["mxu_floor_us"],
      rows_floor_us=r["rows_floor_us"],
      bound_us=r["bound_us"],
      bound_ratio=r["bound_us"] / r["floor_us"],
      limit=_limit(r),
      path=path_label(r),
      why=_why(r),
      gathered_distinct_us=r.get("gathered_distinct_us"),
    )
    (impossible if r["bound_us"] > LIMIT * r["floor_us"] else other).append(row)
  by_path = {}
  for kind in PATH_KINDS:
    kinds = [r for r in runs if path_kind(r) == kind]
    if kinds:
      meets_kind = sum(r["ratio"] <= LIMIT for r in kinds)
      by_path[kind] = dict(points=len(kinds), meets=int(meets_kind))
  near_bound = sum(r["modeled_us"] <= LIMIT * r["bound_us"] for r in runs)
  return dict(
    impl=impl,
    meets=meets,
    near_bound=int(near_bound),
    impossible=impossible,
    other=other,
    points=len(runs),
    by_path=by_path,
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


def _bold(ratio: float) -> str:
  x = f"{ratio:.2f}"
  return f"**{x}**" if ratio <= LIMIT else x


def _headline_cell(rs: list[dict]) -> str:
  r = _by_impl(rs).get(HEADLINE)
  if r is None:
    return ""
  path = path_label(r).removeprefix("fused").removeprefix(", ")
  path = f", {path}" if path else ""
  return (
    f"{_bold(r['ratio'])} ({r['floor_us']:,.0f} µs, {r['nonempty_experts']}/"
    f"{r['local_experts']}{path})"
  )


def _layer_ops_cell(rs: list[dict]) -> str:
  r = _by_impl(rs).get(HEADLINE)
  if r is None:
    return ""
  op, floor = costmodel.XLA_OP_FIXED_US, r["floor_us"]
  return f"{r['layer_xla_ops'] * op / floor:.2f} · {LAYER_XLA_OPS * op / floor:.2f}"


def _fused_cell(rs: list[dict]) -> str:
  r = _by_impl(rs).get("fused")
  if r is None:
    return ""
  calls = f", {r['calls']} calls" if r["calls"] > 1 else ""
  return f"{_bold(r['ratio'])} (chunk {r['chunk']}{calls})"


def _others_cell(rs: list[dict]) -> str:
  by = _by_impl(rs)
  return " · ".join(
    f"{by[i]['ratio']:.2f}"
    for i in (
      "megablox-maxtext",
      "maxtext-switch",
      "maxtext-switch-prefused",
      "tpu-inference-fused",
    )
    if i in by
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
  impls = [i for i in IMPLS if any(i in row for row in rows)]
  lines = [
    "| per call µs | per XLA op µs | "
    + " | ".join(f"{LABELS[i]}: median, points ≤ {LIMIT:.2f}" for i in impls)
    + " |",
    "|---|---:|" + "---:|" * len(impls),
  ]
  for row in rows:
    call = row["call"] if row["call"] == "fitted" else f"{row['call']:g}"
    if row["step_overhead"]:
      call += " + per-step overhead on the fused kernel"
    cells = [f"{row[i]['median']:.2f}, {row[i]['meets']}/{row[i]['points']}" for i in impls]
    lines.append(f"| {call} | {row['op_us']:g} | " + " | ".join(cells) + " |")
  return lines


def _verdict_lines(v: dict) -> list[str]:
  paths = "; ".join(f"{p}: {c['meets']} of {c['points']}" for p, c in v["by_path"].items())
  lines = [
    f"**{LABELS[v['impl']]} ≤ {LIMIT:.2f}x floor: {len(v['meets'])} of {v['points']} points** "
    f"(by path: {paths}). Within {LIMIT:.2f}x of the least any one call can take "
    f"(`bound_us`): {v['near_bound']} of {v['points']}.",
    "",
    f"Points no kernel can bring to {LIMIT:.2f}x ({len(v['impossible'])}): the least one call "
    "can take, its fitted fixed cost plus the longer of HBM's traffic (the floor's weights, and "
    "the routed tokens' bf16 rows in and results out, each distinct token once: `rows_floor_us`) "
    "and the MXU's intake of the weights (`mxu_floor_us`: 2 x max(rows, 128) flops per weight "
    f"element of each visited expert at the chip's peak), is more than {LIMIT:.2f}x the floor. "
    "Ours against that bound in the last column:",
    "",
    "| model, weights, EP | T | chip | floor µs | rows µs | MXU intake µs | one call's fixed µs "
    "| bound / floor | limited by | ours / floor | path | ours / bound |",
    "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---:|",
  ]
  for r in v["impossible"]:
    lines.append(
      f"| {_config_label(r)} | {r['tokens']} | {r['chip']} | {r['floor_us']:,.1f} "
      f"| {r['rows_floor_us']:,.1f} | {r['mxu_floor_us']:,.1f} | {r['call_fixed_us']:.2f} "
      f"| {r['bound_ratio']:.2f} "
      f"| {r['limit']} | {r['ratio']:.2f} | {r['path']} "
      f"| {_bold(r['ratio'] * r['floor_us'] / r['bound_us'])} |"
    )
  lines += [
    "",
    f"Other points above {LIMIT:.2f}x ({len(v['other'])}), with what puts them above the floor "
    "(shares of the floor). Last column, for the streamed block path: the design its row copies "
    "ask for, not built, modeled to decide whether to build it (`model_gathered_distinct`: the "
    "gathered layout over a table of the device's distinct routed tokens, each read and "
    "written once; optimistic for it):",
    "",
    "| model, weights, EP | T | chip | ours / floor | bound / floor | ours / bound | path | why "
    "| gathered over distinct tokens / floor |",
    "|---|---:|---|---:|---:|---:|---|---|---:|",
  ]
  for r in v["other"]:
    bound = r["bound_us"] / r["floor_us"]
    design = r.get("gathered_distinct_us")
    design = "" if design is None else f"{design / r['floor_us']:.3f}"
    lines.append(
      f"| {_config_label(r)} | {r['tokens']} | {r['chip']} | {r['ratio']:.3f} | {bound:.3f} "
      f"| {r['ratio'] / bound:.3f} | {r['path']} | {r['why']} | {design} |"
    )
  return lines


def markdown(result: dict) -> str:
  """The report: assumptions, the fixed-cost fit, the tables, the verdict and the sensitivity."""
  recs = result["records"]
  a = result["assumptions"]
  op = costmodel.XLA_OP_FIXED_US
  fused_v = result.get("verdict_fused")
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
    f"floor, bold is at most {LIMIT:.2f}. The headline table adds the floor in µs and the "
    "device's non-empty / local experts. The chips' rates are per JAX device, floor included: "
    "one TensorCore's share of the chip times the device's TensorCores "
    "(`generations.tensorcore_rates`): a tpu7x device is one TensorCore (half the chip's "
    "bandwidth); a v5p device is two, and the fused kernel splits its weight stream between "
    "them (megablox's and our gmm's n tiles split too; the tpu-inference-style kernel is "
    "modeled on one).",
    "",
    "## Assumptions",
    "",
  ]
  out += [f"- {line}" for line in a["notes"]]
  out += ["", "## The per-call fixed cost, from tokamax's measured times", ""]
  out += _fit_lines(result.get("fit"))
  out += ["", f"## {LABELS[HEADLINE]} / floor", ""]
  out += [
    "`plan_decode`'s path. No mark: one fused call in the tokens layout, every visited local "
    f"expert over all ep x T tokens (up to {serving.GATHER_ABOVE} on the expert axis). "
    '"gathered": one fused call, each visited expert over its own tokens, gathered by a one-hot '
    f'product (up to {serving.MAX_FUSED_TOKENS}). "block": past one call, `moe_block`\'s '
    "forward, its experts the fused kernel streaming the receive buffer's rows from HBM (on v5p "
    'its visits split between the two TensorCores); "block, gmm": a block plan without the '
    "fused kernel, our two gmm calls over its receive buffer.",
    "",
  ]
  out += _grid(recs, _headline_cell)
  out += ["", "## Beside the expert work: the layer's XLA instructions / floor", ""]
  out += [
    f"Not in the ratios above. At {op:g} µs per instruction (assumed), over the same floor: "
    f"ours · `moe_layer`'s. Ours on the fused path: {DECODE_XLA_OPS} costed top-level "
    "instructions per call (routing, the selection fusion, the all-gather, the reduce-scatter; "
    f"one is the Mosaic call), {GATHER_XLA_OPS} more per gathered call (the token lists' sort "
    "and their reshapes for the kernel; compiled ahead of time for v6e:2x2 at Qwen3-30B-A3B "
    "dims, EP 4, 8 and 64 tokens per device); on the block path `moe_block`'s forward, "
    f"{BLOCK_STREAM_LAYER_XLA_OPS} with the streamed kernel and {BLOCK_LAYER_XLA_OPS} with "
    "the gmm pair (the same dims at 256 tokens per device). `moe_layer`'s: "
    f"{LAYER_XLA_OPS} (`bench/results/decode-ops.md`, the same dims at 8 tokens per device). "
    "The counts are applied to every point.",
    "",
  ]
  out += _grid(recs, _layer_ops_cell)
  out += ["", "## The fused kernel on sorted rows / floor (chunk, calls)", ""]
  if fused_v:
    out += [
      f"The kernel without the serving path's layout: ≤ {LIMIT:.2f}x at "
      f"{len(fused_v['meets'])} of {fused_v['points']} points.",
      "",
    ]
  out += _grid(recs, _fused_cell)
  out += [
    "",
    "## megablox-maxtext · maxtext-switch · maxtext-switch-prefused · tpu-inference-fused "
    "(/ floor)",
    "",
    "MaxText's own layer with megablox, then with the one-line switch to `pallas_moe.maxtext` "
    "(three gmm calls; prefused: MaxText's `prefuse_moe_weights`, two): the gmm calls change, "
    "the padded buffer and the bf16 weights do not.",
    "",
  ]
  out += _grid(recs, _others_cell)
  out += ["", f"## Which points meet {LIMIT:.2f}x", ""]
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
    "Expert work pays: ours on the fused path, the one op adding a split call's two partial "
    f"sums (v5p), per call; ours on the block path, the {BLOCK_EXPERT_XLA_OPS} of its experts "
    "scope (`moe_block`'s forward compiled for v6e:2x2 at Qwen3-30B-A3B dims, EP 4, 256 tokens "
    "per device: the two gmm calls' group metadata, the receiver's expand and reduce; 38 at 8 "
    "tokens per device, `bench/results/decode-ops.md`); megablox-maxtext, "
    f"{MEGABLOX_XLA_OPS} (its group metadata, shared by its three calls, and the SwiGLU fusion; "
    "AOT-counted at a 512-row buffer: 44-48 on the four chips, 67-114 at 8,192-32,768 rows, so "
    "low for its 128-token points); the "
    "tpu-inference-style kernel, none. The layer's other instructions are reported apart.",
    "Fused kernel: per TensorCore, the activations' copies (the rows in, the routing weights in: "
    "the tokens layout's [E_l, 1, rows] f32, E_l x rows x 4 bytes, and as much again for the "
    "gathered layout's int32 token lists, or the sorted rows' [rows, 1] f32 column in 128 "
    "lanes; the result out) exposed; the weights as `pipeline` replays the kernel: each step's "
    "copies in `FusedPlan.pieces` pieces of d (gate/up's then down's) served in order, the "
    "next step's queued once this step's first piece is in, each piece multiplied once it has "
    "arrived (the first piece's copy and the last piece's products exposed); a v5p call's "
    "two partial sums (in the result's dtype) added by one XLA op at the device's bandwidth. "
    "Streamed (the block path's experts): one TensorCore; rows come in from a visit's first "
    "row rounded down to the chip's VMEM copy unit (8 rows; 16 on tpu7x) and go out in whole "
    "granules of 16 (their routing weights scale the output rows in the reduce after the "
    "call): a visit's "
    "first step starts the next visit's rows in and "
    "its last step its finished rows out, queued ahead of and behind the next step's weights; "
    "the first "
    "visit's rows in and the last's out are exposed; an expert's rows past one visit's "
    "`visit_rows` stream its weights again. The "
    "generation's per-step overhead is not charged per streamed step (the next step's copies "
    "are issued before this step's work, so the DMA queue never runs dry); the sensitivity "
    "table's last row charges it.",
    "MXU: one TensorCore's bf16 peak; each window's rows padded to 128 (`min_pass_rows`), "
    "contraction and columns to the MXU edge. Gathered layout: per visited expert and "
    "TensorCore, ceil(its tokens / 128) windows per step, plus at its first step one [128, N] x "
    "[N, d] one-hot product per window before the first piece's products, and at its last the "
    "transposed one ([N, d] out, the 128-deep contraction padded to the MXU edge: twice the "
    "MACs on v6e and tpu7x) piece by piece of d, each after that piece's down products, as "
    "`costmodel.kernel_dot_macs` counts the kernel's dots.",
    "Vector work of fp8 block-scaled weights, in the products' loop: v5e and v5p (128-wide "
    'MXUs) multiply the stored values ("partials": one product per 128-deep block row) and '
    "scale the partials; v6e (bytes read as e4m3b11fnuz) and tpu7x (e4m3fn as stored) upcast, "
    "scale and cast each 128 x 128 block to bf16 on its way to the MXU "
    "(`fused_experts.upcast_route`). The compiled step's bundles per 1,024 values per window "
    "(base + per row x the window's rows): "
    + ", ".join(
      f"{g} {route} {a:.3f} + {b:.5f} x rows"
      for (g, route), (a, b) in ISSUE_BUNDLES.items()
      if fe.upcast_route("float8_e4m3fn", generation=g) == route
    )
    + ", read from the compiled kernel's schedule (`python -m bench.fused_vliw`, "
    "bench/results/fused-vliw.md), at the clock the bf16 peak implies (v5e 1.50, v5p 1.75, v6e "
    "3.50, tpu7x 4.40 GHz: the last two exceed published clocks, so there this is a lower "
    "bound). A window takes the longer of this issue and its MXU time. The gathered layout's "
    "table check (non-finite values zeroed, their rows marked, so that the one-hot products "
    "cannot spread 0 x inf = NaN to other tokens) at the call's start, under the first "
    "step's copies: "
    + ", ".join(f"{g} {b:.2f}" for g, b in TABLE_CHECK_BUNDLES.items())
    + " bundles per 1,024 table values, from the compiled schedule.",
    "Compiled issue: every fused plan `moe_decode` runs in this grid is compiled ahead of time "
    "(`python -m bench.fused_vliw --points`, bench/results/fused-vliw-points.md), its step "
    "counted with every predicated region taken. Where that issues longer than the model's "
    "compute (work the model does not count: the activation and accumulations between the "
    "products, the gathered layout's one-hot builds and f32 adds, a streamed visit's row "
    "copies), the model takes the compiled figure (`compiled_issue`): each step's compute "
    "stretched to the step's unconditional bundles (less the model's gathers and adds back "
    "where Mosaic predicated them), and the rest of the whole step charged once per visited "
    "expert, half at its first step, half after its last step's down pieces. Where the compiled "
    "step issues less, the model's figure stays. The other impls' plans are not compiled: "
    "their figures are the model's (optimistic for them where ours is stretched).",
    "DMA: at one TensorCore's bandwidth, no efficiency loss for the [d, chunk] gate/up blocks' "
    "strided rows (chunk x itemsize contiguous bytes per row).",
    "Block path with the gmm pair (float weights on v5p): `plan_decode`'s "
    "`plan_block(..., tensor_parallelism=1)` under the chip's tiling, one chunk at every point "
    "here; the gmm calls costed over the receive buffer's rows with the rows expected to be "
    "real as their tiles' hint; the SwiGLU fusion over the whole static buffer ([rows, 2f] in, "
    "[rows, f] out) at the device's bandwidth.",
    "megablox-maxtext: bf16 weights (also for the fp8 records, whose floor stays fp8: MaxText "
    "runs DeepSeek-V3 dequantized); rows padded to MaxText's dropless buffer; three calls and "
    "the SwiGLU fusion over the buffer; the pad and MaxText's own sort / permute not charged. "
    "maxtext-switch: the same with our gmm, its tiles chosen for the buffer's rows (no hint of "
    "the rows MaxText fills); prefused: gate and up in one call.",
    "tpu-inference-fused: every local expert's weights at one TensorCore's bandwidth (on v5p "
    "half the device's), the activations' and first copies exposed, one call; its per-expert "
    "exposed first copies and in-kernel all-to-all (the kernel also routes and exchanges) not "
    "charged: a lower bound for it.",
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
    {"assumptions", "fit", "records", "sensitivity", "verdict" (the headline's),
    "verdict_fused" (the fused kernel on sorted rows)}.
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
      date=datetime.date.today().isoformat(),
      limit=LIMIT,
      seed=SEED,
      headline=HEADLINE,
      call_fixed_us=dict(costmodel.CALL_FIXED_US),
      call_fixed_stand_in=dict(costmodel.CALL_FIXED_STAND_IN),
      xla_op_fixed_us=costmodel.XLA_OP_FIXED_US,
      megablox_xla_ops=MEGABLOX_XLA_OPS,
      decode_xla_ops=DECODE_XLA_OPS,
      layer_xla_ops=LAYER_XLA_OPS,
      block_layer_xla_ops=BLOCK_LAYER_XLA_OPS,
      block_expert_xla_ops=BLOCK_EXPERT_XLA_OPS,
      gather_xla_ops=GATHER_XLA_OPS,
      issue_bundles_per_1024={f"{g} {u}": list(v) for (g, u), v in ISSUE_BUNDLES.items()},
      gather_above=serving.GATHER_ABOVE,
      max_fused_tokens=serving.MAX_FUSED_TOKENS,
      maxtext_tiling=list(MAXTEXT_TILING),
      maxtext_pad_rows=MAXTEXT_PAD_ROWS,
      notes=_notes(fit),
    ),
    fit=fit,
    records=recs,
    sensitivity=sensitivity(recs),
    verdict=verdict(recs),
    verdict_fused=verdict(recs, "fused"),
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
