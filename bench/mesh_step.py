"""Which mesh (data x fsdp x tensor x expert) trains an MoE layer fastest within a chip's HBM.

Run: `python -m bench.mesh_step [--json FILE] [--markdown FILE] [--models ...] [--chips ...]
[--counts ...]` (from the repository root; `--help`).

For each model, chip, chip count N and tokens per device T it enumerates the meshes
data x fsdp x tensor x expert = N (`meshes`) and models, per MoE layer and device, one training
step's time (forward + backward) and the whole model's MoE memory. The roles are those of
`pallas_moe.mesh` / `pallas_moe.sharding`: data (tokens split, weights replicated), fsdp (tokens
split and every weight's model dimension d split), tensor (tokens replicated, the expert MLP
width f split), expert (tokens split, experts split, rows exchanged by ragged all-to-all).
T = global tokens / (data x fsdp x expert): a tensor group shares its T tokens, so a mesh with
tensor = tp processes N·T / tp tokens per step.

Enumeration (`meshes`): expert = ep divides E and `bench.ep.slice_for(chip=, ep=)` has a slice
shape for it (so ep = 1 and ep = 2 are never enumerated: ep.py has no slice for them); tensor in
{1, 2, 4} with f % tp == 0 (and the shared width too); fsdp any divisor of N / (tp·ep) with
d % fsdp == 0; data the rest. A "before" mesh has fsdp = 1 and tensor = 1 (weights replicated
over data, the layer as it was before the fsdp and tensor axes).

Time of one step (µs, `step_parts`) = the sum of four parts, modeled as NOT overlapped with each
other or with compute (the compiled program makes the fsdp all-gathers synchronous on libtpu
0.0.50.1 defaults; the other collectives are assumed serial too):

- ep_us: `bench.ep.case_row(model=<the tp-derived shape>, ep, tokens=T, chip, policy "cf2.0",
  routing "uniform")["best_us"]`: dispatch, the six gmm kernels and combine, forward and
  backward, with the best chunk count. The tp-derived shape is the model with n = f / tp,
  registered in `bench.shapes.SHAPES` as "<model>/tp<tp>" (`tp_shape`). The exchange moves the
  same d-wide rows whatever tp (each tensor rank exchanges its own copy of the rows over its
  expert group). ep.py lays the expert group on its own slice of ep chips (`slice_for`); here
  that sub-slice is assumed to be a contiguous part of the N-chip slice.
- fsdp_us: per weight array (wi, wo, shared_wi, shared_wo, router: one collective each), the
  forward all-gather of the device's bf16 share and the backward reduce-scatter of the same
  bytes, each (F-1)/F x gathered bytes / (2 x one link's one-way bandwidth) +
  `ALPHA_COLLECTIVE_US` (a ring over the fsdp group using 2 links, one per direction;
  `ring_collective_us`). Gathered bytes: routed wi [E/ep, d, 2f/tp] and wo [E/ep, f/tp, d],
  shared wi [d, 2s/tp] and wo [s/tp, d], router [d, E] (`gathered_bytes`). The layer keeps the
  gathered copy for the backward: no second gather.
- tensor_us (tp > 1): the layer output [T, d] bf16 summed over tensor in the forward and the
  input gradient [T, d] summed in the backward, each 2(tp-1)/tp x bytes / (2 x link) + alpha;
  and the gate/up pairing (`pallas_moe.sharding.pair_gate_up`): [rows, f/tp] bf16 per
  ppermute, one ppermute for tp = 2 (the other is the identity), two for tp = 4, forward and
  the same in the backward, once per chunk, rows = the EP buffer rows B of the case; the
  shared experts pair [T, s/tp] the same way. A ppermute is bytes / one link's one-way
  bandwidth + alpha (the partner ASSUMED one hop away).
- allreduce_us: the gradient all-reduce over the axes a weight is replicated on (an addition
  to the layer's own collectives, which jit inserts; `--no_allreduce` drops it): routed
  experts over data, shared experts over data x expert, the router over data x expert x
  tensor, of the bf16 gradient of the device's share (after the fsdp reduce-scatter), one ring
  all-reduce per weight array as above. Without it a "before" mesh's data axis would be free
  while fsdp's reduce-scatter of the same gradient is charged. A trainer that accumulates
  gradients over micro-batches pays it once per optimizer step, the fsdp gathers once per
  micro-batch.

A ring collective spans its group as if the group formed a ring of neighbours with both
directions used (2 links); the slice's real placement of the fsdp, tensor and data groups is
not modeled, nor contention between them and the EP exchange (they do not overlap here).

Ranking: `batch_us` = tp x step_us, the time to process the N·T tokens a tp = 1 mesh processes
in one step (tp steps of T tokens per tensor group). `--rank step` ranks by step_us instead
(which favours tensor meshes for doing less work per step). Steps within `RANK_TIE` (1%) of
the fastest are a tie, won by the least memory: an fsdp mesh and the data mesh it replaces move
the same gradient bytes (all-gather + reduce-scatter = all-reduce) and differ by latencies.

Memory per device (GB, `memory`), the whole model's MoE layers:

- state: layers x `STATE_BYTES_PER_PARAM` (12: f32 master weights + two f32 Adam moments) x the
  device's parameters per layer: routed / (ep·fsdp·tp) + shared / (fsdp·tp) + router / fsdp.
  Not counted: a separate f32 gradient buffer for every layer (a trainer that holds all layers'
  gradients before the update adds 4 bytes per parameter, 2 in bf16), the routing bias (E
  floats), attention, embeddings, dense layers, and XLA's fragmentation and reserve.
- one layer's working set, with layers rematerialized one at a time: the gathered bf16 weights
  (routed / (ep·tp) + shared / tp + router) x 2 bytes x `WORKING_COPIES` (2: the weights and
  their gradients before the reduce-scatter), plus `activation_bytes`: B x (d + 2f/tp + f/tp +
  d) x 2 bytes x `ACTIVATION_COPIES` (3: an ASSUMPTION, to calibrate against the compiler's
  temp; `calibration` compares with `bench/scale_memory.py`'s AOT `memory_analysis()` records
  when `bench/results/scale-memory.json` exists). Against its DeepSeek-V3 records as of
  2026-11-28 (T = 4096, cf2.0; v5p-32 / v6e-32: data4 x ep8, ep32, fsdp4 x ep8, fsdp2 x tp2 x
  ep8; v5p-256 data4 x ep64) the state matches the compiled arguments within 2%; the temp is
  1.07-2.08x the compiled temp (over by 0.9-5 GB). A least-squares fit of the compiled temp
  gives ~2.9 bytes per gathered parameter, ~4.1 bytes per parameter of the device's fsdp shard
  (the f32 gradient, not in this estimate) and ~1.9 bytes per activation element
  (B x (2d + 3f/tp)), i.e. about one bf16 copy, not 3 (5 distinct meshes: the split between
  the three terms is loose). The defaults are left as stated.
- fits: memory <= the chip's HBM. `pallas_moe.generations.TpuGeneration` has no HBM capacity
  field, so `HBM_GB` holds the published figures (v5e 16 GB, v6e 32 GB, v5p 95 GB, tpu7x
  192 GB; the same as `bench.scale_memory.HBM_GB`).

Left out of the time: the shared experts' compute (dense [T, d] x [d, 2s/tp] and [T, s/tp] x
[s/tp, d]; their weights are in the bytes and the memory), the router's compute, attention and
every non-MoE layer, and any overlap. `SHARED_WIDTH` and `MOE_LAYERS` are the models' configs
(DeepSeek-V3: 1 shared expert of 2048, 58 MoE layers; DeepSeek-V2-Lite: 2 of 1408, 26; Qwen3-30B-
A3B: none, 48; Mixtral-8x7B: none, 32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from bench import ep
from bench.shapes import SHAPES
from bench.tables import format_table

__all__ = [
  "HBM_GB",
  "activation_bytes",
  "calibration",
  "calibration_table",
  "ep_part",
  "gathered_bytes",
  "main",
  "memory",
  "mesh_record",
  "mesh_tables",
  "meshes",
  "param_counts",
  "ring_collective_us",
  "step_parts",
  "summary_table",
  "sweep",
  "tp_shape",
]

STEP_MODELS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")
STEP_CHIPS = ("v5p", "v6e")
CHIP_COUNTS = (32, 256)
TOKENS = 4096
POLICY = "cf2.0"
ROUTING = "uniform"
TENSOR_CHOICES = (1, 2, 4)
ROLES = ("data", "fsdp", "tensor", "expert")

# Per model: shared experts' total width s (num_shared x width) and MoE layers (the models'
# configs).
SHARED_WIDTH = {
  "deepseek-v3": 1 * 2048,
  "deepseek-v2-lite": 2 * 1408,
  "qwen3-30b-a3b": 0,
  "mixtral-8x7b": 0,
}
MOE_LAYERS = {"deepseek-v3": 58, "deepseek-v2-lite": 26, "qwen3-30b-a3b": 48, "mixtral-8x7b": 32}
# NOTE: no HBM capacity in `pallas_moe.generations`; published per-chip figures.
HBM_GB = {"v5e": 16.0, "v6e": 32.0, "v5p": 95.0, "tpu7x": 192.0}

BF16_BYTES = ep.BF16_BYTES
STATE_BYTES_PER_PARAM = 12  # f32 master + Adam m + Adam v
WORKING_COPIES = 2  # gathered bf16 weights + their bf16 gradients
ACTIVATION_COPIES = 3  # ASSUMPTION: saved activations + temporaries, to calibrate
RING_LINKS = 2  # a ring collective uses one link per direction
GB = 1e9
TOP_MESHES = 5
# Steps within this fraction of the fastest count as a tie (the least memory wins).
RANK_TIE = 0.01
SCALE_MEMORY_JSON = "bench/results/scale-memory.json"
CACHE_DIR = "bench/out/mesh_step"
# The case_row fields a record keeps.
_EP_FIELDS = (
  "best_us",
  "best_chunks",
  "ici_fwd_us",
  "ici_bwd_us",
  "gmm_fwd_us",
  "gmm_bwd_us",
  "serial_us",
  "slice",
)


def _dims(model: str) -> tuple[int, int, int, int]:
  """(d, E, f, s) of a model."""
  base = SHAPES[model]
  return base.k, base.num_groups, base.n, SHARED_WIDTH[model]


def tp_shape(model: str, tp: int) -> str:
  """The `SHAPES` key of the model with its expert width split tp ways.

  NOTE: it adds "<model>/tp<tp>" to the process-wide `bench.shapes.SHAPES` (what
  `bench.ep_cases.ep_case` reads) if absent.

  Args:
    model: a key of `SHAPES` (a base model).
    tp: tensor-parallel degree (f % tp == 0).

  Returns:
    `model` for tp = 1, else "<model>/tp<tp>" (n = f / tp).
  """
  if tp == 1:
    return model
  base = SHAPES[model]
  if base.n % tp:
    raise ValueError(f"{model}: f={base.n} is not divisible by tp={tp}")
  name = f"{model}/tp{tp}"
  SHAPES.setdefault(name, dataclasses.replace(base, name=name, n=base.n // tp))
  return name


def _has_slice(chip: str, n: int) -> bool:
  try:
    ep.slice_for(chip=chip, ep=n)
  except ValueError:
    return False
  return True


def meshes(*, model: str, chip: str, chips: int) -> list[dict]:
  """The meshes of the sweep (see the module docstring).

  Args:
    model: a base model (key of `SHAPES` and `SHARED_WIDTH`).
    chip: generation.
    chips: N, the mesh's device count.

  Returns:
    [{data, fsdp, tensor, expert}] with product N, ordered by (tensor, expert, fsdp).
  """
  d, e, f, s = _dims(model)
  out = []
  for tp in TENSOR_CHOICES:
    if f % tp or s % tp or chips % tp:
      continue
    for ep_ in range(1, e + 1):
      if e % ep_ or (chips // tp) % ep_ or not _has_slice(chip, ep_):
        continue
      rest = chips // (tp * ep_)
      for fsdp in range(1, rest + 1):
        if rest % fsdp == 0 and d % fsdp == 0:
          out.append(dict(data=rest // fsdp, fsdp=fsdp, tensor=tp, expert=ep_))
  return out


def param_counts(model: str) -> dict[str, int]:
  """One MoE layer's parameters.

  Args:
    model: a base model.

  Returns:
    {routed: E·3·d·f, shared: 3·d·s, router: d·E}.
  """
  d, e, f, s = _dims(model)
  return dict(routed=e * 3 * d * f, shared=3 * d * s, router=d * e)


def gathered_bytes(model: str, *, ep: int, tp: int) -> dict[str, int]:
  """bf16 bytes of one device's weights after the fsdp all-gather, per weight array.

  Args:
    model: a base model.
    ep: expert-parallel degree.
    tp: tensor-parallel degree.

  Returns:
    {wi: [E/ep, d, 2f/tp], wo: [E/ep, f/tp, d], shared_wi: [d, 2s/tp], shared_wo: [s/tp, d],
    router: [d, E]} in bytes (the shared keys only with shared experts).
  """
  d, e, f, s = _dims(model)
  out = dict(wi=e // ep * d * 2 * f // tp, wo=e // ep * f // tp * d)
  if s:
    out |= dict(shared_wi=d * 2 * s // tp, shared_wo=s // tp * d)
  out["router"] = d * e
  return {k: v * BF16_BYTES for k, v in out.items()}


def ring_collective_us(nbytes: float, *, group: int, chip: str, kind: str) -> float:
  """One ring collective over `group` devices (2 links: one per direction), with latency.

  Args:
    nbytes: all-gather: the gathered (output) bytes; reduce-scatter: the input bytes;
      all-reduce: the array's bytes; ppermute: the bytes each device sends.
    group: devices in the collective's group (1: no collective, 0 µs).
    chip: generation (`ep.CHIPS`).
    kind: "all_gather", "reduce_scatter", "all_reduce" or "ppermute".

  Returns:
    µs: all-gather / reduce-scatter (g-1)/g·bytes / (2·link), all-reduce twice that, ppermute
    bytes / link (one hop); plus `ep.ALPHA_COLLECTIVE_US`.
  """
  if group == 1:
    return 0.0
  link = ep.CHIPS[chip].link_bytes_per_s
  if kind == "ppermute":
    wire = nbytes / link
  else:
    steps = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[kind]
    wire = steps * (group - 1) / group * nbytes / (RING_LINKS * link)
  return wire * 1e6 + ep.ALPHA_COLLECTIVE_US


def ep_part(
  *, model: str, ep_: int, tp: int, chip: str, tokens: int, cache_dir: str | None = None
) -> dict:
  """The EP step of the tp-derived shape (`ep.case_row`, policy cf2.0, uniform routing), cached.

  Args:
    model: a base model.
    ep_: expert-parallel degree.
    tp: tensor-parallel degree.
    chip: generation.
    tokens: tokens per device T.
    cache_dir: a folder of JSON files, one per case (None: no disk cache).

  Returns:
    `_EP_FIELDS` of the case_row, plus buffer_rows (the EP receive buffer's rows B).
  """
  from bench import ep_cases

  name = tp_shape(model, tp)
  path = None
  if cache_dir:
    key = f"{model}-tp{tp}-ep{ep_}-T{tokens}-{chip}-{POLICY}-{ROUTING}.json"
    path = os.path.join(cache_dir, key)
    if os.path.exists(path):
      with open(path) as fh:
        return json.load(fh)
  row = ep.case_row(model=name, ep=ep_, tokens=tokens, chip=chip, policy=POLICY, routing=ROUTING)
  out = {k: row[k] for k in _EP_FIELDS}
  shape, _ = ep_cases.ep_case(model=name, ep=ep_, tokens=tokens, policy=POLICY, routing=ROUTING)
  out["buffer_rows"] = shape.buffer_rows
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    with open(path, "w") as fh:
      json.dump(out, fh)
  return out


def step_parts(
  *,
  model: str,
  mesh: dict,
  chip: str,
  tokens: int,
  ep_row: dict,
  allreduce: bool = True,
) -> dict[str, float]:
  """One layer's forward + backward time on one device, by part (µs; not overlapped).

  Args:
    model: a base model.
    mesh: {data, fsdp, tensor, expert}.
    chip: generation.
    tokens: tokens per device T.
    ep_row: `ep_part`'s dict for (model, expert, tensor, chip, T).
    allreduce: include the gradient all-reduce over replicated axes.

  Returns:
    {ep_us, fsdp_us, tensor_us, allreduce_us, step_us}.
  """
  d, _, f, s = _dims(model)
  dp, fsdp, tp, ep_ = (mesh[r] for r in ROLES)
  gathered = gathered_bytes(model, ep=ep_, tp=tp)
  fsdp_us = sum(
    ring_collective_us(b, group=fsdp, chip=chip, kind=kind)
    for b in gathered.values()
    for kind in ("all_gather", "reduce_scatter")
  )
  tensor_us = 0.0
  if tp > 1:
    out_bytes = tokens * d * BF16_BYTES
    tensor_us += 2 * ring_collective_us(out_bytes, group=tp, chip=chip, kind="all_reduce")
    perms = 1 if tp == 2 else 2
    chunks = ep_row["best_chunks"]
    pair = [(ep_row["buffer_rows"] // chunks * f // tp * BF16_BYTES, perms * chunks)]
    if s:
      pair.append((tokens * s // tp * BF16_BYTES, perms))
    # NOTE: forward and backward (the transposed ppermutes move the same bytes).
    tensor_us += sum(
      2 * n * ring_collective_us(b, group=tp, chip=chip, kind="ppermute") for b, n in pair
    )
  allreduce_us = 0.0
  if allreduce:
    replicas = dict(wi=dp, wo=dp, shared_wi=dp * ep_, shared_wo=dp * ep_, router=dp * ep_ * tp)
    allreduce_us = sum(
      ring_collective_us(b / fsdp, group=replicas[k], chip=chip, kind="all_reduce")
      for k, b in gathered.items()
    )
  parts = dict(
    ep_us=ep_row["best_us"], fsdp_us=fsdp_us, tensor_us=tensor_us, allreduce_us=allreduce_us
  )
  parts["step_us"] = sum(parts.values())
  return parts


def activation_bytes(*, buffer_rows: int, d: int, f: int, tp: int) -> float:
  """One layer's activations and temporaries on one device (the calibratable estimate).

  Args:
    buffer_rows: the EP receive buffer's rows B.
    d: d_model.
    f: expert MLP width (whole; the device holds f / tp).
    tp: tensor-parallel degree.

  Returns:
    Bytes: B x (d + 2f/tp + f/tp + d) x bf16 x `ACTIVATION_COPIES` (the received rows, the
    gate/up product, the SwiGLU output and the down product, each ASSUMED held 3 times over:
    saved for the backward, its cotangent, a temporary).
  """
  cols = d + 2 * f // tp + f // tp + d
  return float(buffer_rows * cols * BF16_BYTES * ACTIVATION_COPIES)


def memory(*, model: str, mesh: dict, buffer_rows: int) -> dict[str, float]:
  """Memory per device of the whole model's MoE layers (GB; see the module docstring).

  Args:
    model: a base model.
    mesh: {data, fsdp, tensor, expert}.
    buffer_rows: the EP receive buffer's rows B.

  Returns:
    {state_layer_gb (one layer's f32 state), working_gb (one layer's gathered bf16 weights and
    gradients), activation_gb, temp_layer_gb (working + activations), memory_gb (layers x
    state + temp)}.
  """
  d, _, f, _ = _dims(model)
  _, fsdp, tp, ep_ = (mesh[r] for r in ROLES)
  p = param_counts(model)
  held = p["routed"] / (ep_ * fsdp * tp) + p["shared"] / (fsdp * tp) + p["router"] / fsdp
  gathered = p["routed"] / (ep_ * tp) + p["shared"] / tp + p["router"]
  state = STATE_BYTES_PER_PARAM * held / GB
  working = gathered * BF16_BYTES * WORKING_COPIES / GB
  act = activation_bytes(buffer_rows=buffer_rows, d=d, f=f, tp=tp) / GB
  return dict(
    state_layer_gb=state,
    working_gb=working,
    activation_gb=act,
    temp_layer_gb=working + act,
    memory_gb=MOE_LAYERS[model] * state + working + act,
  )


def mesh_label(mesh: dict) -> str:
  """The mesh as data x fsdp x tensor x expert, e.g. "4x1x1x8"."""
  return "x".join(str(mesh[r]) for r in ROLES)


def is_before(mesh: dict) -> bool:
  """A mesh without fsdp and tensor axes (weights replicated over data)."""
  return mesh["fsdp"] == 1 and mesh["tensor"] == 1


def mesh_record(
  *,
  model: str,
  chip: str,
  chips: int,
  tokens: int,
  mesh: dict,
  ep_row: dict,
  allreduce: bool = True,
) -> dict:
  """One mesh's JSON record: time parts, memory, fit.

  Args:
    model: a base model.
    chip: generation.
    chips: N.
    tokens: tokens per device T.
    mesh: {data, fsdp, tensor, expert}.
    ep_row: `ep_part`'s dict for the mesh's (expert, tensor).
    allreduce: see `step_parts`.

  Returns:
    A dict (model, chip, chips, tokens, mesh, label, before, global_tokens, step_us, batch_us,
    ep_us, fsdp_us, tensor_us, allreduce_us, the `memory` fields, hbm_gb, fits, ep fields).
  """
  parts = step_parts(
    model=model, mesh=mesh, chip=chip, tokens=tokens, ep_row=ep_row, allreduce=allreduce
  )
  mem = memory(model=model, mesh=mesh, buffer_rows=ep_row["buffer_rows"])
  return dict(
    model=model,
    chip=chip,
    chips=chips,
    tokens=tokens,
    mesh=dict(mesh),
    label=mesh_label(mesh),
    before=is_before(mesh),
    global_tokens=tokens * chips // mesh["tensor"],
    **parts,
    batch_us=parts["step_us"] * mesh["tensor"],
    **mem,
    hbm_gb=HBM_GB[chip],
    fits=mem["memory_gb"] <= HBM_GB[chip],
    buffer_rows=ep_row["buffer_rows"],
    best_chunks=ep_row["best_chunks"],
    ep_slice=ep_row["slice"],
  )


def sweep(
  *,
  models=STEP_MODELS,
  chips=STEP_CHIPS,
  counts=CHIP_COUNTS,
  tokens: int = TOKENS,
  cache_dir: str | None = CACHE_DIR,
  allreduce: bool = True,
  log=None,
) -> list[dict]:
  """Every mesh's record of a selection.

  Args:
    models: base models.
    chips: generations.
    counts: chip counts N.
    tokens: tokens per device T.
    cache_dir: `ep_part`'s cache.
    allreduce: see `step_parts`.
    log: a callable for progress lines (None: silent).

  Returns:
    Records, (model, chip, N)-major.
  """
  out = []
  for model in models:
    for chip in chips:
      for n in counts:
        for mesh in meshes(model=model, chip=chip, chips=n):
          t0 = time.time()
          row = ep_part(
            model=model,
            ep_=mesh["expert"],
            tp=mesh["tensor"],
            chip=chip,
            tokens=tokens,
            cache_dir=cache_dir,
          )
          if log and time.time() - t0 > 1:
            log(f"{model} {chip} ep{mesh['expert']} tp{mesh['tensor']}: {time.time() - t0:.0f}s")
          out.append(
            mesh_record(
              model=model,
              chip=chip,
              chips=n,
              tokens=tokens,
              mesh=mesh,
              ep_row=row,
              allreduce=allreduce,
            )
          )
  return out


def _groups(records: list[dict]) -> dict[tuple, list[dict]]:
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r["model"], r["chip"], r["chips"]), []).append(r)
  return groups


def best(records: list[dict], *, rank: str = "batch", before: bool = False, fits=None):
  """The fastest record of a group (None if none qualifies); ties go to the least memory.

  Args:
    records: one (model, chip, N)'s records.
    rank: "batch" (batch_us) or "step" (step_us).
    before: only "before" meshes.
    fits: None: any; True / False: only those that do / do not fit.

  Returns:
    Of the records within `RANK_TIE` of the fastest, the one with the least memory (the model
    cannot tell such steps apart: e.g. an fsdp mesh and the data mesh it replaces move the
    same gradient bytes), or None.
  """
  key = f"{rank}_us"
  pool = [r for r in records if (not before or r["before"]) and (fits is None or r["fits"] == fits)]
  if not pool:
    return None
  fastest = min(r[key] for r in pool)
  return min(
    (r for r in pool if r[key] <= fastest * (1 + RANK_TIE)), key=lambda r: (r["memory_gb"], r[key])
  )


def _ms(us: float) -> str:
  return f"{us / 1e3:.1f}"


_MESH_COLUMNS = (
  "mesh (data x fsdp x tensor x expert)",
  "step ms",
  "batch ms",
  "EP ms",
  "fsdp ms",
  "tensor ms",
  "all-reduce ms",
  "memory GB",
  "fits",
  "note",
)


def _mesh_row(r: dict, note: str) -> list[str]:
  return [
    r["label"],
    _ms(r["step_us"]),
    _ms(r["batch_us"]),
    _ms(r["ep_us"]),
    _ms(r["fsdp_us"]),
    _ms(r["tensor_us"]),
    _ms(r["allreduce_us"]),
    f"{r['memory_gb']:.1f}",
    "yes" if r["fits"] else "no",
    note,
  ]


def mesh_tables(records: list[dict], *, rank: str = "batch", markdown: bool = True) -> str:
  """Per (model, chip, N): the chosen mesh (`best` of those that fit), the next fastest that fit
  (`TOP_MESHES` in all), the fastest overall if it does not fit, the fastest "before" mesh, and
  the least memory when none fits.

  Args:
    records: `sweep`'s records.
    rank: "batch" or "step" (see `best`).
    markdown: markdown instead of aligned text.

  Returns:
    The tables.
  """
  key = f"{rank}_us"
  out = []
  for (model, chip, n), group in _groups(records).items():
    ranked = sorted(group, key=lambda r: r[key])
    chosen = best(group, rank=rank, fits=True)
    picks = [(chosen, "chosen")] if chosen else []
    picks += [(r, "") for r in ranked if r["fits"] and r is not chosen][: TOP_MESHES - len(picks)]
    picks.append((ranked[0], "fastest, does not fit"))
    picks.append((best(group, rank=rank, before=True), "best before"))
    if chosen is None:
      picks.append((min(group, key=lambda r: r["memory_gb"]), "least memory"))
    rows, seen = [], set()
    for r, note in picks:
      if r is None or r["label"] in seen:
        continue
      seen.add(r["label"])
      if r["before"] and note != "best before":
        note = f"{note} (before)".strip()
      rows.append(_mesh_row(r, note))
    title = (
      f"{model}, {chip} x {n}, T = {group[0]['tokens']} ({len(group)} meshes, "
      f"{sum(r['fits'] for r in group)} fit in {HBM_GB[chip]:.0f} GB; ranked by {rank}_us)"
    )
    out.append(format_table(title, _MESH_COLUMNS, rows, markdown=markdown))
  return "\n".join(out)


def summary_table(records: list[dict], *, rank: str = "batch", markdown: bool = True) -> str:
  """model | chip | chips | fastest that fits | its step | its memory | best before (fits?).

  Args:
    records: `sweep`'s records.
    rank: "batch" or "step".
    markdown: markdown instead of aligned text.

  Returns:
    The table.
  """
  rows = []
  for (model, chip, n), group in _groups(records).items():
    win = best(group, rank=rank, fits=True)
    b = best(group, rank=rank, before=True)
    low = min(group, key=lambda r: r["memory_gb"])
    rows.append(
      [
        model,
        chip,
        str(n),
        win["label"]
        if win
        else f"none fits (least memory: {low['label']}, {low['memory_gb']:.0f} GB)",
        f"{_ms(win['step_us'])} ms (batch {_ms(win['batch_us'])})" if win else "-",
        f"{win['memory_gb']:.1f} GB" if win else "-",
        (
          f"{b['label']}: {_ms(b['step_us'])} ms, {b['memory_gb']:.1f} GB "
          f"({'fits' if b['fits'] else 'does not fit'})"
        )
        if b
        else "-",
      ]
    )
  cols = (
    "model",
    "chip",
    "chips",
    "fastest that fits (data x fsdp x tensor x expert)",
    "its step",
    "its memory",
    "best before (fits?)",
  )
  return format_table(f"Summary (ranked by {rank}_us)", cols, rows, markdown=markdown)


def calibration(scale_records: list[dict], *, model: str = "deepseek-v3") -> list[dict]:
  """This module's per-layer estimate next to `bench.scale_memory`'s compiled records.

  Args:
    scale_records: records with case, mesh ({role: size}, absent roles 1), tokens_per_device,
      argument_gb, temp_gb (and topology; records with an error are skipped).
    model: the model the records compiled (scale_memory: DeepSeek-V3).

  Returns:
    [{case, state_gb (ours), argument_gb, temp_gb (ours), compiled_temp_gb, activation_gb}].
  """
  from bench import ep_cases

  out = []
  for rec in scale_records:
    if "argument_gb" not in rec:
      continue
    mesh = {r: int(rec["mesh"].get(r, 1)) for r in ROLES}
    t = int(rec["tokens_per_device"])
    name = tp_shape(model, mesh["tensor"])
    shape, _ = ep_cases.ep_case(
      model=name, ep=mesh["expert"], tokens=t, policy=POLICY, routing=ROUTING
    )
    mem = memory(model=model, mesh=mesh, buffer_rows=shape.buffer_rows)
    out.append(
      dict(
        case=rec["case"],
        state_gb=mem["state_layer_gb"],
        argument_gb=rec["argument_gb"],
        temp_gb=mem["temp_layer_gb"],
        compiled_temp_gb=rec["temp_gb"],
        activation_gb=mem["activation_gb"],
      )
    )
  return out


def calibration_table(rows: list[dict], *, markdown: bool = True) -> str:
  """`calibration`'s rows as a table (ratios ours / compiled)."""
  cols = (
    "case",
    "state GB (ours)",
    "arguments GB (compiled)",
    "ratio",
    "temp GB (ours)",
    "temp GB (compiled)",
    "ratio",
  )
  body = [
    [
      r["case"],
      f"{r['state_gb']:.2f}",
      f"{r['argument_gb']:.2f}",
      f"{r['state_gb'] / r['argument_gb']:.2f}" if r["argument_gb"] else "-",
      f"{r['temp_gb']:.2f}",
      f"{r['compiled_temp_gb']:.2f}",
      f"{r['temp_gb'] / r['compiled_temp_gb']:.2f}" if r["compiled_temp_gb"] else "-",
    ]
    for r in rows
  ]
  title = "Per-layer estimate vs bench.scale_memory (AOT memory_analysis)"
  return format_table(title, cols, body, markdown=markdown)


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> None:
  """CLI: `python -m bench.mesh_step --help`."""
  p = argparse.ArgumentParser(prog="python -m bench.mesh_step", description=__doc__.split("\n")[0])
  p.add_argument("--models", default=",".join(STEP_MODELS))
  p.add_argument("--chips", default=",".join(STEP_CHIPS))
  p.add_argument("--counts", default=",".join(map(str, CHIP_COUNTS)), help="chip counts N")
  p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per device T")
  p.add_argument("--rank", choices=("batch", "step"), default="batch")
  p.add_argument("--no_allreduce", action="store_true", help="drop the gradient all-reduce")
  p.add_argument("--cache", default=CACHE_DIR, help="case_row cache folder ('' for none)")
  p.add_argument("--scale_memory", default=SCALE_MEMORY_JSON)
  p.add_argument("--header", default="", help="text put above the markdown tables")
  p.add_argument("--markdown", default=None)
  p.add_argument("--json", default=None)
  a = p.parse_args(argv)

  import jax

  t0 = time.time()
  jax.config.update("jax_disable_most_optimizations", True)
  records = sweep(
    models=a.models.split(","),
    chips=a.chips.split(","),
    counts=[int(n) for n in a.counts.split(",")],
    tokens=a.tokens,
    cache_dir=a.cache or None,
    allreduce=not a.no_allreduce,
    log=_log,
  )
  jax.config.update("jax_disable_most_optimizations", False)
  calib = []
  if a.scale_memory and os.path.exists(a.scale_memory):
    with open(a.scale_memory) as fh:
      calib = calibration(json.load(fh))
  parts = []
  for markdown in (False, True):
    text = [summary_table(records, rank=a.rank, markdown=markdown)]
    text.append(mesh_tables(records, rank=a.rank, markdown=markdown))
    if calib:
      text.append(calibration_table(calib, markdown=markdown))
    parts.append("\n".join(x for x in text if x))
  print(parts[0])
  _log(f"bench.mesh_step: {len(records)} meshes in {time.time() - t0:.0f}s")
  if a.json:
    with open(a.json, "w") as fh:
      json.dump({"records": records, "calibration": calib}, fh, indent=1)
  if a.markdown:
    with open(a.markdown, "w") as fh:
      fh.write((a.header.rstrip() + "\n\n" if a.header else "") + parts[1])


if __name__ == "__main__":
  main()
