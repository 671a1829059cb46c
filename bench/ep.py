"""A modeled expert-parallel MoE step on a TPU slice.

Run: `python -m bench.ep [--markdown FILE] [--json FILE]` (flags in `main`; `--help`).

For (model, ep, tokens per device T, chip) it reports, per MoE layer and device:

- Bytes on the wire. The rows each device sends to each peer come from the block's own plan
  (`traffic_rows` mirrors `collectives.plan_from_send_counts` in numpy; a test checks it against
  the real function): routing as `bench.ep_cases` draws it (uniform or Zipf(1), seed 0), experts
  split contiguously (device q holds experts [q·E_l, (q+1)·E_l)), the receive buffer from the
  policy (exact / cf1.25 / cf2.0 / static). A ragged all-to-all moves only the delivered rows,
  never the buffer's slack, and a device's rows for its own experts do not cross ICI. A row is
  d_model bf16 values. Forward: dispatch (matrix S, sender → expert's device) and combine (Sᵀ).
  Backward: combine's transpose moves d_out like a dispatch (S), dispatch's transpose moves
  d_rows like a combine (Sᵀ): the same bytes as the forward.
- ICI time. Devices are laid on the slice row-major (`slice_for`); a pair's bytes follow
  dimension-ordered shortest paths (x, then y, then z; on a torus ring a tie at half the ring
  splits half each way). All pairs' flows run at once: time = max over directed links of bytes
  on it / the link's one-way bandwidth, plus latency (`ALPHA_COLLECTIVE_US` per collective and
  `ALPHA_HOP_US` per hop of the slice's diameter).
- gmm time: the block's six kernels per layer (`moe.expert_mlp`: up = [B, d] x [E_l, d, 2f] with
  gate and up fused, down = [B, f] x [E_l, f, d]; forward fwd, backward dlhs + drhs of each), ours
  (`pallas_moe`), modeled by `bench.costmodel` on the busiest device's EP case
  (`bench.ep_cases.ep_case` + `bench.ep_report.block_cases`).
- Step = forward + backward of dispatch → gmm → combine, three ways: "serial" (no overlap: the
  three are data-dependent), "compiled" (serial minus `--compiled_overlap` × min(comm, gmm): what
  the compiled unchunked program hides; 0 until the AOT study of the real step says otherwise),
  and "chunked" (`pipeline_us`: T split into c chunks, chunk i+1's dispatch under chunk i's gmm,
  chunk i's combine under chunk i+1's gmm; gmm at the chunk's own size from the cost model).
- Compute-only step = the gmm time of the whole T (same kernels, no exchange).

ICI figures (per chip; "bidirectional" = summed over ports and both directions):

| chip | bidirectional ICI | ports | topology | source |
|---|---|---|---|---|
| v5e | 400 GB/s | 4 | 2D torus | Cloud TPU docs, "TPU v5e" (cloud.google.com/tpu/docs/v5e) |
| v6e | 800 GB/s | 4 | 2D torus | Cloud TPU docs, "TPU v6e" (docs.cloud.google.com/tpu/docs/v6e) |
| v5p | 1,200 GB/s | 6 | 3D torus | Cloud TPU docs, "TPU v5p" (docs.cloud.google.com/tpu/docs/v5p) |
| tpu7x | 1,200 GB/s | 6 | 3D torus | Cloud TPU docs, "TPU7x (Ironwood)" (…/tpu/docs/tpu7x) |

One link's one-way bandwidth = bidirectional / (2 · ports): v5e 50 GB/s, v6e 100 GB/s, v5p and
tpu7x 100 GB/s. The v5p page lists 6 ports implicitly (a 3D torus: two neighbours per axis) and
says "All 4x4x4 and larger slices (one cube) have full 3D torus" connectivity: smaller v5p
slices (2x2x2, 2x4x4) are modeled as meshes (no wraparound). The tpu7x page says it "shares
many similarities with TPU v5p"; its port count and wraparound rule are ASSUMED to be v5p's.
v5e/v6e slices (2x4, 4x8, 8x8) are ASSUMED to have no wraparound: the Cloud pages list the 2D
slice shapes without saying which have wraparound, and the public "How to Scale Your Model"
(jax-ml scaling book, "TPUs" chapter) describes wraparound on v5e/v6e only along an axis of the
full 16 chips. `--wraparound` overrides either way.

Latency ASSUMPTIONS (not measured, no source): 5 µs per collective (launch, the plan's count
all_gather, synchronisation) and 1 µs per hop of the slice's diameter.

Expert placement (`placement_study`): with every sender drawing from the same expert
distribution, a permutation of expert groups over devices cannot change what a device sends,
only where the hot receivers sit; on a wraparound torus all positions are equivalent, on a mesh
the central chips have more links. The study searches device permutations (pairwise swaps) to
minimise the busiest link of dispatch + combine and reports the saving against the serial step.
Uniform routing: < 1%. Zipf(1) on the v5e/v6e meshes: 6-17% (hot receivers moved to the middle),
so `topology_aware_placement` gives the block an expert order, `MoEConfig.expert_placement`
(bench/results/ep-step.md, "Expert placement").

Pipelining cannot beat max(comm, compute); where the exchange outweighs the gmm (every v6e case)
the chunked step is the exchange's time. `default_batch_split` is the block's chunk count.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time

import numpy as np

from bench.tables import format_table

__all__ = [
  "CHIPS",
  "DEFAULT_BATCH_SPLIT",
  "DEFAULT_BATCH_SPLIT_DEDUP",
  "EXCHANGE_OPTIONS",
  "IciSpec",
  "Slice",
  "all_to_all_us",
  "dedup_fraction",
  "default_batch_split",
  "dispatch_row_bytes",
  "link_loads",
  "local_extra_bytes",
  "main",
  "pipeline_us",
  "placement_study",
  "routing_matrix",
  "slice_for",
  "topology_aware_placement",
  "traffic_rows",
]

ALPHA_COLLECTIVE_US = 5.0
ALPHA_HOP_US = 1.0
BF16_BYTES = 2
# NOTE: DeepSeek-V3 dispatches in fp8 with one fp32 scale per 1x128 tile; it combines in bf16.
FP8_ROW_BYTES_PER_ELEM = 1 + 4 / 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class IciSpec:
  """One generation's inter-chip interconnect.

  Attributes:
    name: generation name.
    bidir_bytes_per_s: per chip, summed over ports and both directions.
    ports: ICI ports (links) per chip.
    dims: torus dimensionality.
    source: where the figures come from.
  """

  name: str
  bidir_bytes_per_s: float
  ports: int
  dims: int
  source: str

  @property
  def link_bytes_per_s(self) -> float:
    """One link, one direction."""
    return self.bidir_bytes_per_s / (2 * self.ports)


CHIPS: dict[str, IciSpec] = {
  c.name: c
  for c in (
    IciSpec(
      name="v5e", bidir_bytes_per_s=400e9, ports=4, dims=2, source="cloud.google.com/tpu/docs/v5e"
    ),
    IciSpec(
      name="v6e",
      bidir_bytes_per_s=800e9,
      ports=4,
      dims=2,
      source="docs.cloud.google.com/tpu/docs/v6e",
    ),
    IciSpec(
      name="v5p",
      bidir_bytes_per_s=1200e9,
      ports=6,
      dims=3,
      source="docs.cloud.google.com/tpu/docs/v5p",
    ),
    IciSpec(
      name="tpu7x",
      bidir_bytes_per_s=1200e9,
      ports=6,
      dims=3,
      source="docs.cloud.google.com/tpu/docs/tpu7x",
    ),
  )
}

# NOTE: slice shapes from the Cloud docs' supported-topology tables (v5e/v6e: 2x4, 4x8, 8x8;
# v5p: 2x2x2, 2x4x4, 4x4x4).
_SHAPES_2D = {4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_SHAPES_3D = {
  4: (2, 2, 1),
  8: (2, 2, 2),
  32: (2, 4, 4),
  64: (4, 4, 4),
  128: (4, 4, 8),
  256: (4, 8, 8),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slice:
  """A TPU slice's ICI graph.

  Attributes:
    shape: chips per axis (device i sits at the row-major coordinate of i, last axis fastest).
    wrap: per axis, whether the ring closes (torus) or not (mesh line).
  """

  shape: tuple[int, ...]
  wrap: tuple[bool, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def diameter(self) -> int:
    return sum(n // 2 if w else n - 1 for n, w in zip(self.shape, self.wrap, strict=True))

  @property
  def label(self) -> str:
    return "x".join(map(str, self.shape)) + (
      " torus" if all(self.wrap) else " mesh" if not any(self.wrap) else ""
    )


def slice_for(*, chip: str, ep: int, wraparound: bool | None = None) -> Slice:
  """The slice EP devices are laid on (the expert axis spans the whole slice).

  Args:
    chip: generation name (a key of `CHIPS`).
    ep: devices.
    wraparound: force torus (True) or mesh (False); None: the rule of the module docstring.

  Returns:
    The `Slice`.
  """
  spec = CHIPS[chip]
  table = _SHAPES_2D if spec.dims == 2 else _SHAPES_3D
  if ep not in table:
    raise ValueError(f"no {chip} slice shape for ep={ep}; known: {sorted(table)}")
  shape = table[ep]
  if wraparound is None:
    # NOTE: v5p-style: full torus from one 4x4x4 cube; v5e/v6e: only an axis of 16 wraps.
    wrap = (
      tuple(min(shape) >= 4 for _ in shape) if spec.dims == 3 else tuple(n == 16 for n in shape)
    )
  else:
    # NOTE: on an axis of 2 the "wraparound" neighbour is the other chip: nothing to add.
    wrap = tuple(bool(wraparound) and n > 2 for n in shape)
  return Slice(shape=shape, wrap=wrap)


def _ring_moves(a: int, b: int, n: int, wrap: bool) -> list[tuple[float, int, int]]:
  """(fraction, direction ±1, hops) options from a to b on one axis."""
  if a == b:
    return [(1.0, 1, 0)]
  if not wrap:
    return [(1.0, 1 if b > a else -1, abs(b - a))]
  fwd = (b - a) % n
  back = n - fwd
  if fwd < back:
    return [(1.0, 1, fwd)]
  if back < fwd:
    return [(1.0, -1, back)]
  return [(0.5, 1, fwd), (0.5, -1, back)]


@functools.lru_cache(maxsize=64)
def routing_matrix(sl: Slice) -> np.ndarray:
  """Fraction of pair (src, dst)'s bytes on each directed link under dimension-ordered routing.

  Links are indexed (node, axis, direction): `node * 2·D + axis * 2 + (0 for +, 1 for -)`, the
  link leaving `node` that way (absent links of a mesh carry nothing).

  Args:
    sl: the slice.

  Returns:
    float64 [links, N·N] (column src·N + dst).
  """
  shape, ndim, n = sl.shape, len(sl.shape), sl.size
  coords = np.array(list(np.ndindex(*shape)))
  strides = np.array([math.prod(shape[i + 1 :]) for i in range(ndim)])
  r = np.zeros((n * 2 * ndim, n * n))
  for src, dst in itertools.product(range(n), range(n)):
    if src == dst:
      continue
    # NOTE: each partial route is (fraction, current coordinate); axes are walked in order.
    routes = [(1.0, coords[src].copy())]
    for axis in range(ndim):
      nxt = []
      for frac, pos in routes:
        for f, step, hops in _ring_moves(pos[axis], coords[dst][axis], shape[axis], sl.wrap[axis]):
          p = pos.copy()
          for _ in range(hops):
            node = int(p @ strides)
            r[node * 2 * ndim + axis * 2 + (0 if step > 0 else 1), src * n + dst] += frac * f
            p[axis] = (p[axis] + step) % shape[axis]
          nxt.append((frac * f, p))
      routes = nxt
  return r


def link_loads(*, traffic: np.ndarray, sl: Slice) -> np.ndarray:
  """Bytes on every directed link.

  Args:
    traffic: [N, N] bytes from src (row) to dst (column); the diagonal is ignored.
    sl: the slice.

  Returns:
    [links] bytes (see `routing_matrix` for the index).
  """
  t = np.asarray(traffic, np.float64).copy()
  np.fill_diagonal(t, 0.0)
  return routing_matrix(sl) @ t.reshape(-1)


def all_to_all_us(*, traffic: np.ndarray, chip: str, sl: Slice, latency: bool = True) -> float:
  """Modeled time of one all-to-all: the busiest link's bytes at one link's one-way bandwidth.

  Args:
    traffic: [N, N] bytes from src to dst.
    chip: generation (its link bandwidth).
    sl: the slice.
    latency: add `ALPHA_COLLECTIVE_US` + `ALPHA_HOP_US` · diameter.

  Returns:
    Microseconds.
  """
  busiest = float(link_loads(traffic=traffic, sl=sl).max())
  us = busiest / CHIPS[chip].link_bytes_per_s * 1e6
  return us + (ALPHA_COLLECTIVE_US + ALPHA_HOP_US * sl.diameter if latency else 0.0)


def traffic_rows(*, send_counts: np.ndarray, buffer_rows: int) -> np.ndarray:
  """Rows each device delivers to each device in a dispatch (numpy mirror of the block's plan).

  As `collectives.plan_from_send_counts` with experts as slots: receiver dst lays its chunks out
  by (slot, src); rows past `buffer_rows` are dropped (each chunk clipped to its prefix).

  Args:
    send_counts: [ep, E] rows each device routes to each global expert.
    buffer_rows: the receive buffer's static rows.

  Returns:
    int64 [ep (src), ep (dst)] rows delivered (the diagonal: rows that stay on the device).
  """
  counts = np.asarray(send_counts, np.int64)
  g, e = counts.shape
  s = e // g
  c3 = counts.reshape(g, g, s)  # [src, dst, slot]
  by_dst = np.transpose(c3, (1, 2, 0)).reshape(g, s * g)
  offsets = np.transpose((np.cumsum(by_dst, axis=1) - by_dst).reshape(g, s, g), (2, 0, 1))
  start = np.minimum(offsets, buffer_rows)
  size = np.minimum(offsets + c3, buffer_rows) - start
  return size.sum(axis=2)


# ----------------------------------------------------------------------------------------------
# Pipeline.


def pipeline_us(*, comm_in: list[float], gmm: list[float], comm_out: list[float]) -> float:
  """Makespan of c chunks on two serial resources, ICI and the TensorCore.

  Chunk i: `comm_in[i]` (dispatch) → `gmm[i]` → `comm_out[i]` (combine). The ICI runs in the
  software-pipelined order in_0, in_1, out_0, in_2, out_1, ..., out_{c-1}; the TensorCore runs
  gmm_0 ... gmm_{c-1}. Each op starts when its resource is free and its input is done.
  NOTE: the dispatch of chunk i+1 and the combine of chunk i-1 share the links (both use every
  link of a symmetric all-to-all), so the ICI is one resource.

  Args:
    comm_in: per-chunk dispatch µs (incl. latency).
    gmm: per-chunk gmm µs.
    comm_out: per-chunk combine µs (incl. latency).

  Returns:
    Microseconds; c = 1 gives the serial sum.
  """
  c = len(gmm)
  order = [("in", 0)]
  for i in range(1, c):
    order += [("in", i), ("out", i - 1)]
  order.append(("out", c - 1))
  ici = core = 0.0
  in_done, gmm_done = [0.0] * c, [0.0] * c
  scheduled = 0  # NOTE: gmms run in chunk order; schedule them as the combines need them.
  for kind, i in order:
    if kind == "in":
      ici += comm_in[i]
      in_done[i] = ici
      continue
    while scheduled <= i:
      core = max(core, in_done[scheduled]) + gmm[scheduled]
      gmm_done[scheduled] = core
      scheduled += 1
    ici = max(ici, gmm_done[i]) + comm_out[i]
  return ici


def chunked_step(
  *,
  comm_dispatch_us: float,
  comm_combine_us: float,
  latency_us: float,
  gmm_chunk_us: float,
  chunks: int,
) -> float:
  """One direction (forward or backward) pipelined over `chunks` equal chunks.

  Args:
    comm_dispatch_us: the whole T's dispatch-direction exchange, bandwidth part only.
    comm_combine_us: the whole T's combine-direction exchange, bandwidth part only.
    latency_us: per collective.
    gmm_chunk_us: one chunk's gmm time (cost model at T / chunks).
    chunks: c.

  Returns:
    Microseconds.
  """
  c = chunks
  return pipeline_us(
    comm_in=[comm_dispatch_us / c + latency_us] * c,
    gmm=[gmm_chunk_us] * c,
    comm_out=[comm_combine_us / c + latency_us] * c,
  )


# ----------------------------------------------------------------------------------------------
# Cases.

# (model, ep) of the EP step cases.
STEP_CONFIGS: tuple[tuple[str, int], ...] = (
  ("deepseek-v3", 8),
  ("deepseek-v3", 32),
  ("deepseek-v3", 64),
  ("qwen3-30b-a3b", 8),
  ("deepseek-v2-lite", 8),
  ("deepseek-v2-lite", 4),
)
STEP_CHIPS = ("v5e", "v5p", "v6e")
STEP_TOKENS = (4096, 16384)
CHUNK_CHOICES = (1, 2, 4, 8)
# A chunk count within this fraction of the fastest modeled step counts as a tie (the fewest wins).
CHUNK_TIE = 0.005


def _send_counts(*, model: str, ep: int, tokens: int, routing: str) -> np.ndarray:
  from bench.ep_cases import _SEED, _send_counts
  from bench.shapes import SHAPES

  base = SHAPES[model]
  return _send_counts(
    num_experts=base.num_groups,
    ep=ep,
    rows_per_peer=tokens * base.top_k,
    routing=routing,
    seed=_SEED,
  )


def wire_rows(*, model: str, ep: int, tokens: int, policy: str, routing: str) -> np.ndarray:
  """[src, dst] rows a dispatch delivers (ep_cases' routing, the policy's buffer).

  Args:
    model: a key of `bench.shapes.SHAPES`.
    ep: expert-parallel degree.
    tokens: tokens per device.
    policy: a buffer policy of `bench.ep_cases.POLICIES`.
    routing: "uniform" or "zipf".

  Returns:
    int64 [ep, ep].
  """
  from bench.ep_cases import _buffer_rows
  from bench.shapes import SHAPES

  counts = _send_counts(model=model, ep=ep, tokens=tokens, routing=routing)
  buf = _buffer_rows(policy=policy, model=SHAPES[model], ep=ep, tokens=tokens, send_counts=counts)
  return traffic_rows(send_counts=counts, buffer_rows=buf)


# NOTE: the exchange options `case_row` models, as (dedup, dispatch quantization) pairs.
EXCHANGE_OPTIONS: dict[str, tuple[bool, str | None]] = {
  "plain": (False, None),
  "plain+int8": (False, "int8"),
  "dedup": (True, None),
  "dedup+int8": (True, "int8"),
  "dedup+fp8": (True, "fp8"),
}


def expert_probabilities(*, num_experts: int, routing: str, seed: int | None = None) -> np.ndarray:
  """[E] the per-row expert distribution `bench.ep_cases` draws its send counts from."""
  from bench.ep_cases import _SEED

  rng = np.random.default_rng(_SEED if seed is None else seed)
  if routing == "uniform":
    return np.full(num_experts, 1.0 / num_experts)
  p = 1.0 / np.arange(1, num_experts + 1)
  # NOTE: the same first draw as `ep_cases._send_counts` (its permutation of the Zipf weights).
  return rng.permutation(p / p.sum())


@functools.lru_cache(maxsize=64)
def dedup_fraction(*, model: str, ep: int, routing: str, samples: int = 16384) -> np.ndarray:
  """[ep] per destination: deduplicated rows per (token, choice) row.

  A token sends a device one row if any of its k experts is there (`pallas_moe.dedup`). Uniform
  routing: exactly `P(hit) / (k / ep)` with `P(hit) = 1 - C(E - E_l, k) / C(E, k)`. Zipf(1):
  tokens drawn as k distinct experts from the Zipf weights (Gumbel top-k, seed 0, `samples`
  tokens), the ratio of their hit rate to their row rate per device.

  Args:
    model: a key of `bench.shapes.SHAPES`.
    ep: devices.
    routing: "uniform" or "zipf".
    samples: Monte Carlo tokens for non-uniform routing.

  Returns:
    float64 [ep], each in [1/min(k, E_l), 1].
  """
  from bench.shapes import SHAPES
  from pallas_moe.dedup import expected_destinations

  base = SHAPES[model]
  e, k = base.num_groups, base.top_k
  if routing == "uniform":
    r = expected_destinations(num_experts=e, top_k=k, expert_parallelism=ep)
    return np.full(ep, r / k)
  p = expert_probabilities(num_experts=e, routing=routing)
  rng = np.random.default_rng(1)
  g = np.log(p)[None, :] + rng.gumbel(size=(samples, e))
  chosen = np.argpartition(-g, k - 1, axis=1)[:, :k] // (e // ep)  # [samples, k] devices
  pairs = np.stack([(chosen == q).sum(axis=1) for q in range(ep)], axis=1)  # [samples, ep]
  hits = (pairs > 0).sum(axis=0)
  return hits / np.maximum(pairs.sum(axis=0), 1)


def dispatch_row_bytes(*, d: int, top_k: int, num_local: int, dedup: bool, quant) -> float:
  """Bytes of one dispatched row: the values, their scales, the deduplicated row's extra words.

  Args:
    d: d_model.
    top_k: k.
    num_local: E_l (the ids' width: int8 up to 128).
    dedup: rows carry k f32 routing weights and k ids (`pallas_moe.dedup.pack_rows`).
    quant: None (bf16), "int8" (absmax per row: one f32 scale) or "fp8" (e4m3, one f32 scale
      per 128 columns, DeepSeek-V3's 1x128 tiles).

  Returns:
    Bytes per row as the TPU exchange moves it: padded to 128 32-bit words
    (`pallas_moe.dedup.wire_row_bytes`; a bf16 row of 2048 values plus 15 words of weights
    and ids takes 2304 values' room, an int8 row of 2048 + 34 bytes 2560).
  """
  from pallas_moe.dedup import wire_row_bytes

  meta = top_k * 4 + top_k * (1 if num_local <= 128 else 4) if dedup else 0
  if quant is None:
    return float(wire_row_bytes(d + -(-meta // BF16_BYTES), BF16_BYTES))
  if quant == "int8":
    return float(wire_row_bytes(d + 4 + meta, 1))
  if quant == "fp8":
    return float(wire_row_bytes(d + 4 * math.ceil(d / 128) + meta, 1))
  raise ValueError(f"quant must be None, 'int8' or 'fp8', got {quant!r}.")


def local_extra_bytes(
  *, d: int, pairs_in: float, rows_in: float, pairs_out: float, rows_out: float, quant
) -> float:
  """HBM bytes the deduplicated exchange adds per direction on one device (vs the plain one).

  Receiver: expand (gather `pairs_in` rows: read + write bf16, 4 B/elem), reduce (read the
  gmm's bf16 rows and scatter-add into f32 received rows: 2 + 8 B/elem), cast the `rows_in`
  sums to bf16 (6 B/elem). Sender: gathers and sums home `rows_out` rows instead of sorting and
  unsorting `pairs_out` (14 B/elem either way: the plain block's sort gather and weighted
  unsort, which the step model does not count, are credited back). An 8-bit dispatch adds the
  quantize pass on the sender (3 B/elem) and the dequantize pass on the receiver (3 B/elem). The
  backward does the transposes: the same bytes.

  Args:
    d: d_model.
    pairs_in: expert rows the busiest receiver runs.
    rows_in: deduplicated rows it receives.
    pairs_out: (token, choice) rows the busiest sender has.
    rows_out: deduplicated rows it sends.
    quant: dispatch quantization or None.

  Returns:
    Bytes (may be negative where the sender's savings win).
  """
  recv = 14 * pairs_in + 6 * rows_in
  send = 14 * (rows_out - pairs_out)
  q = 3 * (rows_in + rows_out) if quant else 0
  return float(d * (recv + send + q))


_GMM_CACHE: dict[tuple, dict[str, tuple[float, float]]] = {}


def gmm_us(*, model: str, ep: int, tokens: int, policy: str, routing: str, chips) -> dict:
  """The block's six gmm kernels on the busiest device, modeled (cached within the run).

  Args:
    model: a key of `bench.shapes.SHAPES`.
    ep: expert-parallel degree.
    tokens: tokens per device (a chunk's, for the chunked step).
    policy: buffer policy.
    routing: "uniform" or "zipf".
    chips: generation names.

  Returns:
    {chip: (fwd_us, bwd_us)}.
  """
  key = (model, ep, tokens, policy, routing)
  have = _GMM_CACHE.setdefault(key, {})
  missing = [c for c in chips if c not in have]
  if missing:
    import bench.__main__ as bench_main
    from bench import ep_cases, ep_report

    shape, gs = ep_cases.ep_case(model=model, ep=ep, tokens=tokens, policy=policy, routing=routing)
    recs = bench_main.run_cases(
      cases=ep_report.block_cases([(shape, routing, gs)]),
      chips=missing,
      ops=["fwd", "dlhs", "drhs"],
      # NOTE: gmm as the block calls it (the receive buffer's tail unwritten, tiles hinted
      # with T*k rows), not gmm's zero-tail default.
      impl_names=[ep_report.OURS_BLOCK],
    )
    for row in ep_report.block_totals(recs):
      if row["kernels"] != 6:
        raise RuntimeError(f"{key} on {row['chip']}: {row['kernels']} of 6 kernels modeled")
      have[row["chip"]] = (row["fwd_us"], row["bwd_us"])
  return {c: have[c] for c in chips}


def _option_label(*, dedup: bool, quant) -> str:
  return ("dedup" if dedup else "plain") + (f"+{quant}" if quant else "")


def case_row(
  *,
  model: str,
  ep: int,
  tokens: int,
  chip: str,
  policy: str,
  routing: str,
  chunks=CHUNK_CHOICES,
  compiled_overlap: float = 0.0,
  wraparound: bool | None = None,
  fp8_dispatch: bool = False,
  dedup: bool = False,
  dispatch_quantization: str | None = None,
) -> dict:
  """One modeled EP step (see the module docstring).

  Args:
    model: a key of `bench.shapes.SHAPES`.
    ep: expert-parallel degree.
    tokens: tokens per device.
    chip: generation.
    policy: buffer policy.
    routing: "uniform" or "zipf".
    chunks: chunk counts to try (T % c == 0).
    compiled_overlap: fraction of min(comm, gmm) the compiled unchunked step hides (0 = serial).
    wraparound: see `slice_for`.
    fp8_dispatch: the lever: the forward dispatch in fp8 with 1x128 scales (combine and the
      backward stay bf16); the same as `dispatch_quantization="fp8"`.
    dedup: the deduplicated exchange (`MoEConfig.dedup_dispatch`): rows per token = distinct
      destination devices (`dedup_fraction`), rows carry weights and ids
      (`dispatch_row_bytes`), and the receiver's expand/reduce HBM passes
      (`local_extra_bytes`) run on the TensorCore with the gmm.
    dispatch_quantization: None, "int8" or "fp8": the forward dispatch's row format (the
      combine and the backward's exchanges stay bf16).

  Returns:
    A dict of the figures.
  """
  from bench.shapes import SHAPES

  base = SHAPES[model]
  if fp8_dispatch:
    dispatch_quantization = "fp8"
  quant = dispatch_quantization
  sl = slice_for(chip=chip, ep=ep, wraparound=wraparound)
  pair_rows = wire_rows(model=model, ep=ep, tokens=tokens, policy=policy, routing=routing)
  rows = (
    pair_rows * dedup_fraction(model=model, ep=ep, routing=routing)[None, :]
    if dedup
    else (pair_rows)
  )
  off = rows.copy()
  np.fill_diagonal(off, 0)
  d = base.k
  num_local = base.num_groups // ep
  row_bytes = d * BF16_BYTES
  disp_row_bytes = dispatch_row_bytes(
    d=d, top_k=base.top_k, num_local=num_local, dedup=dedup, quant=quant
  )
  # NOTE: the dispatch's transpose carries the rows' and the weights' cotangents (bf16 rows and
  # the same extra words), the combine's transpose bf16 rows.
  back_row_bytes = dispatch_row_bytes(
    d=d, top_k=base.top_k, num_local=num_local, dedup=dedup, quant=None
  )
  t_disp = all_to_all_us(traffic=off * disp_row_bytes, chip=chip, sl=sl, latency=False)
  t_comb = all_to_all_us(traffic=off.T * row_bytes, chip=chip, sl=sl, latency=False)
  t_disp_bf16 = all_to_all_us(traffic=off * row_bytes, chip=chip, sl=sl, latency=False)
  t_back = all_to_all_us(traffic=off.T * back_row_bytes, chip=chip, sl=sl, latency=False)
  lat = ALPHA_COLLECTIVE_US + ALPHA_HOP_US * sl.diameter
  fwd_comm = t_disp + t_comb + 2 * lat
  bwd_comm = t_disp_bf16 + t_back + 2 * lat  # NOTE: d_out (dispatch-like), d_rows (combine-like).
  g_fwd, g_bwd = gmm_us(
    model=model, ep=ep, tokens=tokens, policy=policy, routing=routing, chips=[chip]
  )[chip]
  from pallas_moe.generations import get_generation

  hbm = get_generation(chip).hbm_bytes_per_s
  local = dict(pairs_in=0.0, rows_in=0.0, pairs_out=0.0, rows_out=0.0)
  local_us = 0.0
  if dedup or quant:
    local = dict(
      pairs_in=float(pair_rows.sum(axis=0).max()),
      rows_in=float(rows.sum(axis=0).max()),
      pairs_out=float(pair_rows.sum(axis=1).max()),
      rows_out=float(rows.sum(axis=1).max()),
    )
    if dedup:
      extra = local_extra_bytes(d=d, **local, quant=quant)
    else:
      extra = 3.0 * d * (local["rows_in"] + local["rows_out"])
    # NOTE: the backward's transposes: the same passes (the 8-bit ones only in the forward).
    q = 3.0 * d * (local["rows_in"] + local["rows_out"]) if quant else 0.0
    local_us = max(2 * extra - q, 0.0) / hbm * 1e6
  g_fwd_l = g_fwd + local_us / 2
  g_bwd_l = g_bwd + local_us / 2
  serial = fwd_comm + g_fwd_l + bwd_comm + g_bwd_l
  compute_only = g_fwd + g_bwd
  hidden = compiled_overlap * (min(fwd_comm, g_fwd_l) + min(bwd_comm, g_bwd_l))
  per_c = {}
  for c in chunks:
    if tokens % c:
      continue
    cf, cb = gmm_us(
      model=model, ep=ep, tokens=tokens // c, policy=policy, routing=routing, chips=[chip]
    )[chip]
    cf, cb = cf + local_us / 2 / c, cb + local_us / 2 / c
    fwd = chunked_step(
      comm_dispatch_us=t_disp, comm_combine_us=t_comb, latency_us=lat, gmm_chunk_us=cf, chunks=c
    )
    bwd = chunked_step(
      comm_dispatch_us=t_disp_bf16,
      comm_combine_us=t_back,
      latency_us=lat,
      gmm_chunk_us=cb,
      chunks=c,
    )
    per_c[c] = dict(fwd_us=fwd, bwd_us=bwd, step_us=fwd + bwd, gmm_us=c * (cf + cb))
  fastest = min(per_c[c]["step_us"] for c in per_c)
  # NOTE: the fewest chunks within CHUNK_TIE of the fastest: more chunks add collectives and
  # kernel launches for a difference the model does not resolve.
  best = min(c for c in per_c if per_c[c]["step_us"] <= fastest * (1 + CHUNK_TIE))
  return dict(
    model=model,
    ep=ep,
    tokens=tokens,
    chip=chip,
    policy=policy,
    routing=routing,
    fp8_dispatch=quant == "fp8",
    dedup=dedup,
    dispatch_quantization=quant,
    option=_option_label(dedup=dedup, quant=quant),
    slice=sl.label,
    wire_rows_per_token=float(off.sum(axis=1).max() / tokens),
    dispatch_row_bytes=disp_row_bytes,
    local_us=local_us,
    dispatch_mb=float(off.sum(axis=1).max() * disp_row_bytes / 1e6),
    combine_mb=float(off.sum(axis=0).max() * row_bytes / 1e6),
    self_fraction=float(np.trace(rows) / max(rows.sum(), 1)),
    ici_fwd_us=fwd_comm,
    ici_bwd_us=bwd_comm,
    gmm_fwd_us=g_fwd,
    gmm_bwd_us=g_bwd,
    compute_only_us=compute_only,
    serial_us=serial,
    compiled_us=serial - hidden,
    compiled_overlap=compiled_overlap,
    chunked=per_c,
    best_chunks=best,
    best_us=per_c[best]["step_us"],
    serial_ratio=serial / compute_only,
    best_ratio=per_c[best]["step_us"] / compute_only,
    comm_bound=fwd_comm + bwd_comm > compute_only,
  )


# ----------------------------------------------------------------------------------------------
# Expert placement.


def placement_study(*, rows: np.ndarray, sl: Slice, iters: int = 2000, seed: int = 0) -> dict:
  """Best device permutation of the expert groups for max link load (dispatch + combine).

  Hosting group q (the experts device q holds under the contiguous split) on device perm[q]
  moves column q of the dispatch traffic to column perm[q]; the senders (token shards) stay.
  The combine is the transpose. Search: random pairwise swaps of perm, kept when the sum of the
  two collectives' busiest-link loads drops (first improvement).

  Args:
    rows: [src, dst] rows delivered under the contiguous placement.
    sl: the slice.
    iters: swaps tried.
    seed: numpy seed.

  Returns:
    dict(base=max link rows, best=max link rows, perm=list: group q → device perm[q]).
  """
  n = rows.shape[0]
  r = routing_matrix(sl)

  def load(perm):
    t = np.zeros_like(rows, dtype=np.float64)
    t[:, perm] = rows  # NOTE: group q's traffic now lands on device perm[q].
    np.fill_diagonal(t, 0.0)
    # NOTE: dispatch t and combine tᵀ are separate collectives: each one's busiest link counts.
    return float((r @ t.reshape(-1)).max() + (r @ t.T.reshape(-1)).max())

  perm = np.arange(n)
  base = best = load(perm)
  rng = np.random.default_rng(seed)
  for _ in range(iters):
    a, b = rng.choice(n, 2, replace=False)
    trial = perm.copy()
    trial[[a, b]] = trial[[b, a]]
    v = load(trial)
    if v < best:
      best, perm = v, trial
  return dict(base=base, best=best, perm=perm.tolist())


def topology_aware_placement(
  *,
  send_counts: np.ndarray,
  chip: str,
  wraparound: bool | None = None,
  iters: int = 400,
  seed: int = 0,
) -> np.ndarray:
  """Which experts each device should host, from expected routing counts and the slice.

  Keeps the block's layout (device q holds E_l consecutive slots) and moves whole blocks of E_l
  experts between devices (`placement_study`): hot receivers go where the slice has the most
  link capacity into them (on a mesh, the middle). How the block uses it:
  `MoEConfig(expert_placement=order)` with the expert weights in slot order,
  `moe.place_experts(params, placement=order)` (`w_placed = w[order]`, sharded as before); it
  routes with the original expert ids (router weights, bias and DeepSeek's expert groups
  unchanged) and maps them to slots before sorting, `slot_ids = argsort(order)[expert_ids]`.

  Args:
    send_counts: [ep, E] expected rows each device routes to each expert (e.g. running counts).
    chip: generation (its slice).
    wraparound: see `slice_for`.
    iters: pairwise swaps tried.
    seed: numpy seed.

  Returns:
    int64 [E] `order`: slot j (on device j // E_l) holds global expert order[j].
  """
  counts = np.asarray(send_counts, np.int64)
  ep_, e = counts.shape
  local = e // ep_
  rows = traffic_rows(send_counts=counts, buffer_rows=int(counts.sum()) + 1)
  st = placement_study(
    rows=rows, sl=slice_for(chip=chip, ep=ep_, wraparound=wraparound), iters=iters, seed=seed
  )
  order = np.empty(e, np.int64)
  for q, dev in enumerate(st["perm"]):
    order[dev * local : (dev + 1) * local] = np.arange(q * local, (q + 1) * local)
  return order


# ----------------------------------------------------------------------------------------------
# The block's default chunk count.

# NOTE: from `python -m bench.ep` (bench/results/ep-step.md): the modeled best c of {1, 2, 4, 8} per
# case (the fewest within `CHUNK_TIE` of the fastest), exact buffers, uniform routing, default
# slices. (model, ep, tokens per device, chip) → c.
# v5p's with TensorCores counted per kernel (`costmodel`'s default) and tiles picked at one
# TensorCore's rates with the megacore split: the exchange is 0.4-1.3x the gmm there, and 4 or 8
# chunks beat 2 by 2-14% (all but deepseek-v3 EP 8 at 4,096 tokens, where c = 2 is best).
# Where the step is comm-bound (most cases) c = 2 already hides the gmm under the exchange and
# more chunks only add per-collective latency and smaller, relatively costlier gmms; where a
# larger c wins, its margin over c = 4 is a few percent.
DEFAULT_BATCH_SPLIT: dict[tuple[str, int, int, str], int] = {
  ("deepseek-v3", 8, 4096, "v5e"): 4,
  ("deepseek-v3", 8, 4096, "v5p"): 2,
  ("deepseek-v3", 8, 4096, "v6e"): 2,
  ("deepseek-v3", 8, 16384, "v5e"): 8,
  ("deepseek-v3", 8, 16384, "v5p"): 4,
  ("deepseek-v3", 8, 16384, "v6e"): 4,
  ("deepseek-v3", 32, 4096, "v5e"): 8,
  ("deepseek-v3", 32, 4096, "v5p"): 4,
  ("deepseek-v3", 32, 4096, "v6e"): 2,
  ("deepseek-v3", 32, 16384, "v5e"): 8,
  ("deepseek-v3", 32, 16384, "v5p"): 8,
  ("deepseek-v3", 32, 16384, "v6e"): 2,
  ("deepseek-v3", 64, 4096, "v5e"): 8,
  ("deepseek-v3", 64, 4096, "v5p"): 4,
  ("deepseek-v3", 64, 4096, "v6e"): 2,
  ("deepseek-v3", 64, 16384, "v5e"): 8,
  ("deepseek-v3", 64, 16384, "v5p"): 8,
  ("deepseek-v3", 64, 16384, "v6e"): 2,
  ("qwen3-30b-a3b", 8, 4096, "v5e"): 4,
  ("qwen3-30b-a3b", 8, 4096, "v5p"): 4,
  ("qwen3-30b-a3b", 8, 4096, "v6e"): 2,
  ("qwen3-30b-a3b", 8, 16384, "v5e"): 8,
  ("qwen3-30b-a3b", 8, 16384, "v5p"): 8,
  ("qwen3-30b-a3b", 8, 16384, "v6e"): 2,
  ("deepseek-v2-lite", 8, 4096, "v5e"): 4,
  ("deepseek-v2-lite", 8, 4096, "v5p"): 4,
  ("deepseek-v2-lite", 8, 4096, "v6e"): 2,
  ("deepseek-v2-lite", 8, 16384, "v5e"): 8,
  ("deepseek-v2-lite", 8, 16384, "v5p"): 8,
  ("deepseek-v2-lite", 8, 16384, "v6e"): 2,
  ("deepseek-v2-lite", 4, 4096, "v5e"): 4,
  ("deepseek-v2-lite", 4, 4096, "v5p"): 4,
  ("deepseek-v2-lite", 4, 4096, "v6e"): 2,
  ("deepseek-v2-lite", 4, 16384, "v5e"): 8,
  ("deepseek-v2-lite", 4, 16384, "v5p"): 8,
  ("deepseek-v2-lite", 4, 16384, "v6e"): 4,
}


# NOTE: the same with the deduplicated exchange (`--options dedup`; bench/results/ep_tables.md,
# "Exchange options"), for the cases `pallas_moe.dedup.MODELED_DEDUP` has modeled: its
# expand/reduce passes add TensorCore time per chunk that more chunks hide under the exchange, so
# the best count moves up (v6e at 16,384 tokens: 8 instead of 2 for qwen3-30b-a3b and
# deepseek-v2-lite).
DEFAULT_BATCH_SPLIT_DEDUP: dict[tuple[str, int, int, str], int] = {
  ("deepseek-v3", 32, 16384, "v6e"): 2,
  **{
    (model, 8, tokens, chip): 4 if tokens == 4096 else 8
    for model in ("qwen3-30b-a3b", "deepseek-v2-lite")
    for tokens in (4096, 16384)
    for chip in ("v5e", "v5p", "v6e")
  },
  ("qwen3-30b-a3b", 8, 4096, "v6e"): 2,
  ("deepseek-v2-lite", 8, 4096, "v5e"): 8,
}


def default_batch_split(*, model: str, ep: int, tokens_per_device: int, chip: str) -> int:
  """Chunks the block should split its tokens into (MaxText: batch_split_factor).

  Import-light (no jax): a table from this module's model; cases not in it get 1 (no split).

  Args:
    model: a key of `bench.shapes.SHAPES`.
    ep: expert-parallel degree.
    tokens_per_device: T.
    chip: generation name.

  Returns:
    c >= 1 dividing tokens_per_device.
  """
  c = DEFAULT_BATCH_SPLIT.get((model, ep, tokens_per_device, chip), 1)
  return c if tokens_per_device % c == 0 else 1


# ----------------------------------------------------------------------------------------------
# Report.


def _f(x, p=0) -> str:
  return f"{x:,.{p}f}"


_COLUMNS = (
  "case",
  "chip",
  "slice",
  "routing",
  "disp MB",
  "comb MB",
  "ICI fwd µs",
  "ICI bwd µs",
  "gmm fwd µs",
  "gmm bwd µs",
  "compute-only µs",
  "serial µs",
  "x",
  "compiled µs",
  "chunked µs (c)",
  "x",
)


def _option_suffix(r: dict) -> str:
  option = r.get("option", "fp8" if r["fp8_dispatch"] else "plain")
  if option == "fp8":
    return " fp8-dispatch"
  return "" if option == "plain" else f" {option}"


def step_table(rows: list[dict], *, markdown: bool, title: str) -> str:
  """Formats `case_row` rows.

  Args:
    rows: from `case_row`.
    markdown: markdown instead of aligned text.
    title: the table's title.

  Returns:
    The text.
  """
  body = [
    [
      f"{r['model']}@{r['tokens']}/ep{r['ep']}" + _option_suffix(r),
      r["chip"],
      r["slice"],
      r["routing"],
      _f(r["dispatch_mb"]),
      _f(r["combine_mb"]),
      _f(r["ici_fwd_us"]),
      _f(r["ici_bwd_us"]),
      _f(r["gmm_fwd_us"]),
      _f(r["gmm_bwd_us"]),
      _f(r["compute_only_us"]),
      _f(r["serial_us"]),
      _f(r["serial_ratio"], 2),
      _f(r["compiled_us"]),
      f"{_f(r['best_us'])} ({r['best_chunks']})",
      _f(r["best_ratio"], 2),
    ]
    for r in rows
  ]
  return format_table(title, _COLUMNS, body, markdown=markdown)


def option_table(rows: list[dict], *, markdown: bool) -> str:
  """One row per case and exchange option: wire rows, bytes, local passes, best step."""
  cols = [
    "case",
    "chip",
    "routing",
    "option",
    "wire rows/token",
    "disp B/row",
    "disp MB",
    "ICI fwd+bwd µs",
    "local µs",
    "compute-only µs",
    "best µs (c)",
    "x",
    "vs plain",
  ]
  plain = {
    (r["model"], r["ep"], r["tokens"], r["chip"], r["routing"]): r["best_us"]
    for r in rows
    if r["option"] == "plain"
  }
  body = [
    [
      f"{r['model']}@{r['tokens']}/ep{r['ep']}",
      r["chip"],
      r["routing"],
      r["option"],
      _f(r["wire_rows_per_token"], 2),
      _f(r["dispatch_row_bytes"]),
      _f(r["dispatch_mb"]),
      _f(r["ici_fwd_us"] + r["ici_bwd_us"]),
      _f(r["local_us"]),
      _f(r["compute_only_us"]),
      f"{_f(r['best_us'])} ({r['best_chunks']})",
      _f(r["best_ratio"], 2),
      _f(r["best_us"] / plain[(r["model"], r["ep"], r["tokens"], r["chip"], r["routing"])], 2),
    ]
    for r in rows
  ]
  return format_table(
    "Exchange options: modeled step fwd+bwd, best chunk count ('wire rows/token': rows a "
    "device sends off-device per token; 'local µs': the expand/reduce and 8-bit passes)",
    cols,
    body,
    markdown=markdown,
  )


def chunk_table(rows: list[dict], *, markdown: bool) -> str:
  """Step µs per chunk count (the pipeline's dependence on c)."""
  cs = sorted({c for r in rows for c in r["chunked"]})
  cols = ["case", "chip", "routing"] + [f"c={c}" for c in cs]
  body = [
    [f"{r['model']}@{r['tokens']}/ep{r['ep']}", r["chip"], r["routing"]]
    + [_f(r["chunked"][c]["step_us"]) if c in r["chunked"] else "-" for c in cs]
    for r in rows
    if r.get("option", "plain") == "plain"
  ]
  return format_table(
    "Chunked step µs per chunk count c (fwd + bwd)", cols, body, markdown=markdown
  )


def placement_table(rows: list[dict], *, markdown: bool) -> str:
  """Formats placement results."""
  cols = [
    "case",
    "chip",
    "slice",
    "routing",
    "ICI fwd+bwd µs",
    "placed µs",
    "saved µs",
    "% of serial step",
  ]
  body = [
    [
      f"{p['model']}@{p['tokens']}/ep{p['ep']}",
      p["chip"],
      p["slice"],
      p["routing"],
      _f(p["ici_us"]),
      _f(p["placed_us"]),
      _f(p["saved_us"]),
      _f(100 * p["saved_fraction"], 1),
    ]
    for p in rows
  ]
  return format_table("Topology-aware expert placement (modeled)", cols, body, markdown=markdown)


def _placement_row(r: dict, *, wraparound) -> dict:
  rows = wire_rows(
    model=r["model"], ep=r["ep"], tokens=r["tokens"], policy=r["policy"], routing=r["routing"]
  )
  sl = slice_for(chip=r["chip"], ep=r["ep"], wraparound=wraparound)
  st = placement_study(rows=rows, sl=sl, iters=400 if r["ep"] > 8 else 200)
  # NOTE: bandwidth part of (dispatch + combine) x 2 (fwd and bwd) scales with the max link load.
  bw_us = r["ici_fwd_us"] + r["ici_bwd_us"] - 4 * (ALPHA_COLLECTIVE_US + ALPHA_HOP_US * sl.diameter)
  saved = bw_us * (1 - st["best"] / st["base"]) if st["base"] else 0.0
  return dict(
    model=r["model"],
    ep=r["ep"],
    tokens=r["tokens"],
    chip=r["chip"],
    slice=r["slice"],
    routing=r["routing"],
    ici_us=r["ici_fwd_us"] + r["ici_bwd_us"],
    placed_us=r["ici_fwd_us"] + r["ici_bwd_us"] - saved,
    saved_us=saved,
    saved_fraction=saved / r["serial_us"],
    perm=st["perm"],
  )


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> None:
  """CLI: `python -m bench.ep --help`."""
  p = argparse.ArgumentParser(prog="python -m bench.ep", description=__doc__.split("\n")[0])
  p.add_argument("--models", default=None, help="comma list (default: all of the EP step cases)")
  p.add_argument("--ep", default=None, help="comma list of ep (default: each model's)")
  p.add_argument("--tokens", default=",".join(map(str, STEP_TOKENS)))
  p.add_argument("--chips", default=",".join(STEP_CHIPS))
  p.add_argument("--policy", default="exact")
  p.add_argument("--routing", default="uniform", help="comma list: uniform,zipf")
  p.add_argument("--chunks", default=",".join(map(str, CHUNK_CHOICES)))
  p.add_argument("--compiled_overlap", type=float, default=0.0)
  p.add_argument("--wraparound", choices=("auto", "yes", "no"), default="auto")
  p.add_argument("--placement", action="store_true", help="also the placement study")
  p.add_argument("--no_fp8", action="store_true", help="skip the fp8-dispatch rows")
  p.add_argument(
    "--options",
    default="dedup,dedup+int8,dedup+fp8",
    help=f"comma list of exchange options besides plain ({', '.join(EXCHANGE_OPTIONS)}); "
    "'' for none",
  )
  p.add_argument("--markdown", default=None)
  p.add_argument("--json", default=None)
  a = p.parse_args(argv)

  import jax

  t0 = time.time()
  jax.config.update("jax_disable_most_optimizations", True)
  wrap = {"auto": None, "yes": True, "no": False}[a.wraparound]
  models = a.models.split(",") if a.models else None
  eps = [int(x) for x in a.ep.split(",")] if a.ep else None
  configs = [
    (m, e)
    for m, e in (STEP_CONFIGS if models is None else [(m, e) for m in models for e in (eps or [8])])
    if (models is None or m in models) and (eps is None or e in eps)
  ]
  chunks = tuple(int(c) for c in a.chunks.split(","))
  rows, fp8, opts = [], [], []
  options = [o for o in a.options.split(",") if o and o != "plain"]
  for o in options:
    if o not in EXCHANGE_OPTIONS:
      raise SystemExit(f"--options: unknown option {o!r}; pick from {list(EXCHANGE_OPTIONS)}.")
  for (model, ep), tokens, routing, chip in itertools.product(
    configs, [int(t) for t in a.tokens.split(",")], a.routing.split(","), a.chips.split(",")
  ):
    kw = dict(model=model, ep=ep, tokens=tokens, chip=chip, policy=a.policy, routing=routing)
    rows.append(case_row(**kw, chunks=chunks, compiled_overlap=a.compiled_overlap, wraparound=wrap))
    if not a.no_fp8 and rows[-1]["comm_bound"]:
      fp8.append(
        case_row(
          **kw,
          chunks=chunks,
          compiled_overlap=a.compiled_overlap,
          wraparound=wrap,
          fp8_dispatch=True,
        )
      )
    opts.append(rows[-1])
    for o in options:
      dd, q = EXCHANGE_OPTIONS[o]
      opts.append(
        case_row(
          **kw,
          chunks=chunks,
          compiled_overlap=a.compiled_overlap,
          wraparound=wrap,
          dedup=dd,
          dispatch_quantization=q,
        )
      )
    _log(f"{model}@{tokens}/ep{ep} {routing} {chip}: done ({time.time() - t0:.0f}s)")
  jax.config.update("jax_disable_most_optimizations", False)
  place = [_placement_row(r, wraparound=wrap) for r in rows] if a.placement else []
  out = {"steps": rows, "fp8_dispatch": fp8, "options": opts, "placement": place}
  text, md = [], []
  for markdown, acc in ((False, text), (True, md)):
    acc.append(
      step_table(rows, markdown=markdown, title=f"Modeled EP step per layer ({a.policy} buffers)")
    )
    acc.append(chunk_table(rows, markdown=markdown))
    acc.append(
      step_table(
        fp8, markdown=markdown, title="Lever: forward dispatch in fp8 (labelled, not the baseline)"
      )
    )
    if options:
      acc.append(option_table(opts, markdown=markdown))
    acc.append(placement_table(place, markdown=markdown))
  print("\n".join(x for x in text if x))
  _log(f"bench.ep total {time.time() - t0:.0f}s")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1, default=str)
  if a.markdown:
    with open(a.markdown, "w") as f:
      f.write("\n".join(x for x in md if x))


if __name__ == "__main__":
  main()
