"""What XLA makes of an expert-parallel MoE training step around the gmm kernels, AOT-compiled.

  python -m bench.aot_step [--topologies v5e:2x4 v6e:2x4] [--meshes 8x1 4x2] [--markdown]

The step: `jax.value_and_grad` of a sum-of-squares loss of MaxText's `RoutedAndSharedMoE`
(maxtext 0.2.5, DeepSeek-V2-Lite dims: emb 2048, expert width 1408, 64 experts top-6, 2 shared
experts; `sparse_matmul` + `megablox`, 4096 tokens per device, bf16 activations, the dropless
receive buffer), compiled for a TPU topology from this host (libtpu; no TPU needed) with expert
parallelism `ep` x data `data`. Variants:

- `megablox`: MaxText's stock layer (its megablox fork, `jax.lax.ragged_all_to_all`).
- `pallas_moe`: `pallas_moe.maxtext.swap_into(moe)`, the default switch: pallas_moe's kernels,
  which pick their kernels and tiles per chip and call (MaxText's 9-int tiling checked, not
  run).
- `pm_mt_tiles`: `swap_into(moe, honour_tiling=True)`: pallas_moe's kernels at MaxText's tiles
  (base.yml's 512, 1024, 1024: the visit kernels).
- `pm_moe_layer`: pallas_moe's own block (`pallas_moe.moe.moe_layer`) at the same dims and
  receive-buffer rows (the loss adds its aux loss).

Where maxtext is not installed (Python < 3.12), the first three run on a MaxText-shaped
`sparse_matmul` program of ours instead (`expert_program`: the receive buffer through the three
gmms of MaxText's experts, wi_0, wi_1, silu x linear, wo, inside `shard_map`, each handed
MaxText's 9-int tiling), with upstream megablox (`jax.experimental.pallas.ops.tpu.megablox`) as
the stock kernels.

Reported per compiled program (`analyze`): memory_analysis() temp / peak / argument bytes; the
live bytes at the program's peak (`live_peak`: XLA's dumped live ranges, the values live at the
instruction where their sum is largest, arguments included, unpadded: what the program holds,
before heap packing; `--no_live_peak` skips the dump); cost_analysis() bytes accessed split
into the Pallas kernels' own CostEstimates (read from the Mosaic custom calls' backend config)
and the rest (XLA's ops); the number of Mosaic calls; and every copy or transpose whose shape
has a receive-buffer-sized dimension (the HLO instruction, or the fusion whose root it is),
which is what an extra layout change or a copy of an aliased buffer looks like in the compiled
program; and the bytes XLA's memory-space assignment copies between HBM and VMEM
(`vmem_copies`: on v5e / v6e it may prefetch a kernel's whole weight operand into VMEM), which
XLA-op bytes include (about 4x a whole-array copy's bytes, 3x a sliced prefetch's), and the
XLA-op bytes net of that charge (`bytes_xla_net`).

`--stock_bytes_scale S [S ...]` compiles the stock variant with its kernels' declared
CostEstimate bytes scaled by each S (the kernels themselves unchanged): how much of the temp and
XLA-op bytes hangs on XLA's reading of one cost hint rather than on the kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import os
import re
import sys
import types
from typing import Any

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

__all__ = [
  "Dims",
  "analyze",
  "big_copies",
  "expert_program",
  "kernel_costs",
  "live_peak",
  "measure",
  "metadata_costs",
  "scaled_stock_estimates",
  "table",
  "vmem_copies",
]

VARIANTS = ("megablox", "pallas_moe", "pm_mt_tiles", "pm_moe_layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dims:
  """The MoE layer (DeepSeek-V2-Lite by default) and the tokens per device."""

  emb: int = 2048
  mlp: int = 1408
  num_experts: int = 64
  top_k: int = 6
  shared: int = 2
  tokens_per_device: int = 4096

  def buffer_rows(self, ep: int) -> int:
    """The dropless receive buffer (MaxText's `get_ragged_buffer_size`, ours is the same):
    tokens x top_k x min(ep, experts / top_k)."""
    return int(self.tokens_per_device * self.top_k * min(ep, self.num_experts / self.top_k))


DEEPSEEK_V2_LITE = Dims()
# MaxText's default megablox tiles (base.yml wi_tile_* / wo_tile_*: 512, 1024, 1024 everywhere).
MAXTEXT_TILES = (512, 1024, 1024)


def _topology(name: str):
  from jax.experimental import topologies

  return topologies.get_topology_desc(topology_name=name, platform="tpu")


# --------------------------------------------------------------------------------------------
# HLO analysis.
# --------------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(\S+?)\[([\d,]*)\]\S*\s+([\w\-]+)\(")
# NOTE: any instruction, whatever its type (tuples included: every `*-start`).
_STARTS = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s")


def _logical_lines(text: str) -> list[str]:
  """HLO text lines with instructions that span several lines (a custom call's metadata holds
  newlines) joined into one."""
  out = []
  for line in text.splitlines():
    header = not line[:1].isspace() and line.rstrip().endswith("{")
    starts = _STARTS.match(line) or header or line.strip() in ("}", "")
    if out and not starts:
      out[-1] += " " + line.strip()
    else:
      out.append(line)
  return out


def _computations(text: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in _logical_lines(text):
    head = re.match(r"^(?:ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      name = head.group(1).lstrip("%")
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  return comps


def _root_opcode(lines: list[str]) -> str | None:
  for line in lines:
    if line.strip().startswith("ROOT"):
      m = _INSTR.match(line)
      return m.group(4) if m else None
  return None


def _buffer_sized(dims: list[int], rows: int) -> bool:
  """A dimension of at least `rows`, or leading dimensions whose product is exactly `rows` (a
  buffer's rows split by a reshape: [rows / 8, 8, 2, 1024], s32 [rows / 128, 128]).

  NOTE: exactly, not at least: a weight [2048, 2816] or the send buffer [tokens x top_k / 8, 8,
  ...] has leading products above the rows without holding them.
  """
  lead = 1
  for d in dims:
    lead *= d
    if d >= rows or lead == rows:
      return True
  return False


def big_copies(text: str, *, rows: int) -> list[str]:
  """Copies and transposes of buffer-sized arrays in compiled HLO text.

  An instruction `copy`, `transpose` or `copy-start`, or a fusion whose fused computation's root
  is one of those, whose result shape is buffer-sized (`_buffer_sized`: a dimension of at least
  `rows`, or leading dimensions whose product is `rows`, the buffer's rows split by a reshape).

  Returns:
    "opcode dtype[shape]" per instruction (fusions as "fusion(root) dtype[shape]").
  """
  comps = _computations(text)
  out = []
  kinds = ("copy", "transpose", "copy-start")
  for name, lines in comps.items():
    if name.startswith("fused_") or ".fused" in name or "fused_computation" in name:
      continue
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      dtype, shape, op = m.group(2), m.group(3), m.group(4)
      dims = [int(d) for d in shape.split(",") if d]
      if not _buffer_sized(dims, rows):
        continue
      if op in kinds:
        out.append(f"{op} {dtype}[{shape}]")
      elif op == "fusion":
        called = re.search(r"calls=(%?[\w.\-]+)", line)
        root = _root_opcode(comps.get(called.group(1).lstrip("%"), [])) if called else None
        if root in kinds:
          out.append(f"fusion({root}) {dtype}[{shape}]")
  return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4}
_DTYPE_BYTES.update({"s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_COPY_START = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\((.*)\)\s+copy-start\(")
# NOTE: the dumped HLO spells an async slice `async-start(...), calls=...`, `as_text()` its sugared
# form `slice-start(...), slice={...}`.
_SLICE_START = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]*slice-start[\w.\-]*\s*=\s*\((.*)\)\s+(?:async|slice)-start\("
)


def vmem_copies(text: str) -> list[tuple[str, str, int]]:
  """The copies XLA's memory-space assignment makes between HBM and VMEM (`copy-start` whose
  destination, or source, layout is in memory space 1): prefetches (e.g. a kernel's whole
  weight operand, which the kernel then reads from VMEM) and evictions; and its sliced
  prefetches (an async `slice-start` from HBM into memory space 1: a slice of an operand of
  XLA's own ops, e.g. a dot's activation in row blocks), "prefetch slice".

  NOTE: these are XLA's choices, made per operand from its own cost model; cost_analysis counts
  about 4 x their bytes (copy-start and copy-done each a read and a write), so they move the
  XLA-op bytes between programs that are otherwise the same.

  Returns:
    ("prefetch", "evict" or "prefetch slice", "dtype[shape]", bytes) per copy, in program order.
  """
  out = []
  for line in _logical_lines(text):
    m = _SLICE_START.match(line)
    if m:
      # NOTE: an async slice's shape is ((source), destination, context).
      arrays = _ARRAY.findall(m.group(1))
      if len(arrays) >= 2:
        (_, _, src_layout), (dtype, shape, dst_layout) = arrays[0], arrays[1]
        if "S(1)" in dst_layout and "S(1)" not in src_layout and dtype in _DTYPE_BYTES:
          size = _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in shape.split(",") if d]))
          out.append(("prefetch slice", f"{dtype}[{shape}]", size))
      continue
    m = _COPY_START.match(line)
    if not m:
      continue
    arrays = _ARRAY.findall(m.group(1))
    if len(arrays) < 2:
      continue
    # NOTE: copy-start's shape is (destination, source, context).
    (dtype, shape, dst_layout), (_, _, src_layout) = arrays[0], arrays[1]
    into, out_of = "S(1)" in dst_layout, "S(1)" in src_layout
    if into == out_of or dtype not in _DTYPE_BYTES:
      continue
    size = _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in shape.split(",") if d]))
    out.append(("prefetch" if into else "evict", f"{dtype}[{shape}]", size))
  return out


# cost_analysis charges a whole-array HBM <-> VMEM copy about 4x its bytes (copy-start and
# copy-done each a read and a write): on the MaxText step at v5e EP 4 x 2 the XLA-op bytes of
# programs that differ only in which weights XLA prefetches differ by 4.0x the prefetched bytes;
# and a sliced prefetch about 3x: a small v5e program whose 8 MB weight XLA prefetches in four
# slices is charged 8.39 MB less than with the slicing off (`xla_tpu_sliced_prefetch_max_slices`
# 1: one whole prefetch), everything else the same (bench/results/memory.md).
VMEM_COPY_CHARGE = 4
VMEM_SLICE_CHARGE = 3

_PEAK_HEADER = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_CUMULATIVE = re.compile(r"\(cumulative: (\d+) bytes\)")


def live_peak(live_range_text: str) -> int | None:
  """The bytes live at the program's peak, from XLA's dumped live ranges.

  Reads a `*after_optimizations-live-range.txt` dump (`--xla_dump_to`): its "Live ranges at N
  (peak):" block lists the values live at instruction N, the one where their sum is largest
  (arguments and outputs included, each at its unpadded size), with a running total; returns
  that total. This is what the program holds at its peak, before the heap packing that
  memory_analysis() temp adds (a value's slot, alignment, fragmentation).

  Returns:
    Bytes, or None where the text has no peak block.
  """
  lines = live_range_text.splitlines()
  for i, line in enumerate(lines):
    if not _PEAK_HEADER.match(line):
      continue
    total = None
    for nxt in lines[i + 1 :]:
      m = _CUMULATIVE.search(nxt)
      if not m:
        break
      total = max(total or 0, int(m.group(1)))
    return total
  return None


def _live_peak_from_dump(dump_dir: str, text: str) -> int | None:
  """`live_peak` of the compiled module's live-range file in `dump_dir` (None if absent)."""
  import glob

  head = re.match(r"\s*HloModule\s+([\w.\-]+)", text)
  files = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt")))
  if head:
    named = [f for f in files if f".{head.group(1)}." in os.path.basename(f)]
    files = named or files
  if len(files) != 1:
    return None
  with open(files[0]) as f:
    return live_peak(f.read())


def kernel_costs(text: str) -> list[dict]:
  """The CostEstimate of every Mosaic call (tpu_custom_call) in compiled HLO text: name (the
  instruction's, i.e. the kernel's name), flops and bytes_accessed (0 where it has none)."""
  out = []
  for line in _logical_lines(text):
    if 'custom_call_target="tpu_custom_call"' not in line:
      continue
    m = _INSTR.match(line)
    name = m.group(1).lstrip("%").split(".")[0] if m else "?"
    flops, bytes_accessed = cost_estimate(line)
    out.append(dict(name=name, flops=flops, bytes_accessed=bytes_accessed))
  return out


def cost_estimate(line: str) -> tuple[float, float]:
  """(flops, bytes_accessed) of the CostEstimate in one instruction's line (0 where absent)."""
  cost = re.search(r'cost_estimate\\?":\{([^}]*)\}', line)
  fields = dict(re.findall(r'(\w+)\\?":\\?"?([\d.eE+\-]+)', cost.group(1))) if cost else {}
  return float(fields.get("flops", 0.0)), float(fields.get("bytes_accessed", 0.0))


def analyze(compiled, *, rows: int, dump_dir: str | None = None) -> dict[str, Any]:
  """Memory, cost, Mosaic calls and buffer-sized copies of a compiled program.

  Args:
    compiled: a `jax.stages.Compiled`.
    rows: the receive buffer's rows (copies of arrays with a dimension this large are listed).
    dump_dir: where it was compiled with `xla_dump_to` (`compiler_options`): the live bytes at
      its peak are read from there (`live_peak`); None: live_peak is None.

  Returns:
    dict(temp, peak, peak_unpadded, live_peak, args, out, bytes_total, bytes_kernels,
    bytes_xla, bytes_xla_net, flops_total, flops_kernels, mosaic_calls, kernels, copies,
    bytes_vmem_copies, bytes_vmem_slices, vmem_copies): peak and peak_unpadded are
    memory_analysis()'s peak_memory_in_bytes and peak_unpadded_heap_bytes (None where it has
    none); live_peak the live bytes at the program's peak (`live_peak`); vmem_copies lists
    `vmem_copies` of at least 1 MB; bytes_vmem_copies counts all the whole-array prefetches
    and evictions, bytes_vmem_slices the sliced prefetches; bytes_xla_net is bytes_xla less
    cost_analysis's charge for all of them (VMEM_COPY_CHARGE x bytes_vmem_copies +
    VMEM_SLICE_CHARGE x bytes_vmem_slices): XLA's own ops net of its VMEM prefetches.
  """
  ma = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  text = compiled.as_text()
  kernels = kernel_costs(text)
  total = float(cost.get("bytes accessed", 0.0))
  kbytes = sum(k["bytes_accessed"] for k in kernels)
  peak = getattr(ma, "peak_memory_in_bytes", None)
  unpadded = getattr(ma, "peak_unpadded_heap_bytes", None)
  moves = vmem_copies(text)
  whole = sum(size for kind, _, size in moves if kind != "prefetch slice")
  sliced = sum(size for kind, _, size in moves if kind == "prefetch slice")
  return dict(
    temp=int(ma.temp_size_in_bytes),
    peak=None if peak is None else int(peak),
    peak_unpadded=None if unpadded is None else int(unpadded),
    live_peak=None if dump_dir is None else _live_peak_from_dump(dump_dir, text),
    args=int(ma.argument_size_in_bytes),
    out=int(ma.output_size_in_bytes),
    bytes_total=total,
    bytes_kernels=kbytes,
    bytes_xla=total - kbytes,
    bytes_xla_net=total - kbytes - VMEM_COPY_CHARGE * whole - VMEM_SLICE_CHARGE * sliced,
    flops_total=float(cost.get("flops", 0.0)),
    flops_kernels=sum(k["flops"] for k in kernels),
    mosaic_calls=len(kernels),
    kernels=[k["name"] for k in kernels],
    copies=big_copies(text, rows=rows),
    bytes_vmem_copies=whole,
    bytes_vmem_slices=sliced,
    vmem_copies=[
      f"{kind} {shape} {size / 1e6:,.0f} MB" for kind, shape, size in moves if size >= 1e6
    ],
  )


# --------------------------------------------------------------------------------------------
# MaxText's layer.
# --------------------------------------------------------------------------------------------


def have_maxtext() -> bool:
  """maxtext (0.2.5, Python >= 3.12) is importable."""
  if sys.version_info < (3, 12):
    return False
  try:
    import maxtext.layers.moe  # noqa: F401
  except ImportError:
    return False
  return True


def _maxtext_config(dims: Dims, *, ep: int, data: int, out_dir: str):
  import maxtext
  from maxtext.configs import pyconfig

  base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  return pyconfig.initialize(
    [None, base_yml],
    base_output_directory=out_dir,
    model_name="deepseek2-16b",
    override_model_config=True,
    base_emb_dim=dims.emb,
    base_moe_mlp_dim=dims.mlp,
    num_experts=dims.num_experts,
    num_experts_per_tok=dims.top_k,
    shared_experts=dims.shared,
    ici_expert_parallelism=ep,
    ici_data_parallelism=data,
    ici_fsdp_parallelism=1,
    dcn_data_parallelism=1,
    per_device_batch_size=1,
    max_target_length=dims.tokens_per_device,
    dtype="bfloat16",
    sparse_matmul=True,
    megablox=True,
    attention="dot_product",
    hardware="tpu",
    compile_topology_num_slices=1,
    enable_checkpointing=False,
    skip_jax_distributed_system=True,
    run_name="pallas_moe_aot_step",
    jax_cache_dir="",
  )


def maxtext_compiled(
  variant: str,
  *,
  topology: str,
  ep: int,
  data: int,
  dims: Dims,
  out_dir: str,
  compiler_options: dict | None = None,
):
  """Compiles value_and_grad(sum(RoutedAndSharedMoE(x)**2)) over (params, x) for `topology`.

  `variant`: "megablox" (stock), "pallas_moe" (`swap_into(moe)`) or "pm_mt_tiles"
  (`swap_into(moe, honour_tiling=True)`). `compiler_options` go to `.compile()`.
  """
  from flax import nnx
  from flax.linen import partitioning
  from maxtext.layers import initializers, moe
  from maxtext.utils import maxtext_utils

  from pallas_moe import maxtext as mblx

  topo = _topology(topology)
  cfg = _maxtext_config(dims, ep=ep, data=data, out_dir=out_dir)
  mesh = Mesh(maxtext_utils.create_device_mesh(cfg, devices=topo.devices), cfg.mesh_axes)
  assert dict(mesh.shape)["expert"] == ep and dict(mesh.shape)["data"] == data
  if variant not in ("megablox", "pallas_moe", "pm_mt_tiles"):
    raise ValueError(f"variant={variant!r}: megablox, pallas_moe or pm_mt_tiles.")
  originals = None
  if variant != "megablox":
    originals = mblx.swap_into(moe, honour_tiling=variant == "pm_mt_tiles")
  try:
    with jax.set_mesh(mesh), partitioning.axis_rules(cfg.logical_axis_rules):

      def build():
        return moe.RoutedAndSharedMoE(
          config=cfg,
          mesh=mesh,
          kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
          kernel_axes=("embed", None),
          rngs=nnx.Rngs(0),
          weight_dtype=cfg.weight_dtype,
          dtype=cfg.dtype,
        )

      abstract = nnx.eval_shape(build)
      graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)

      def sds(tree):
        shardings = _logical_to_mesh(nnx.get_partition_spec(tree), mesh, cfg.logical_axis_rules)
        return jax.tree.map(
          lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), tree, shardings
        )

      params, rest = sds(state), sds(rest)
      batch = cfg.per_device_batch_size * mesh.size
      x_sharding = NamedSharding(mesh, P(("data", "expert"), None, None))
      x = jax.ShapeDtypeStruct(
        (int(batch), cfg.max_target_length, cfg.emb_dim), jnp.bfloat16, sharding=x_sharding
      )

      def loss(params, x, rest):
        out, _, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

      step = jax.value_and_grad(loss, argnums=(0, 1))
      with jax.default_device(topo.devices[0]):
        return jax.jit(step).lower(params, x, rest).compile(compiler_options=compiler_options)
  finally:
    if originals:
      for name, value in originals.items():
        setattr(moe, name, value)


def _logical_to_mesh(specs, mesh, rules):
  from flax import linen as nn

  return jax.tree.map(
    lambda s: NamedSharding(mesh, nn.logical_to_mesh_axes(s, rules)),
    specs,
    is_leaf=lambda s: isinstance(s, P),
  )


# --------------------------------------------------------------------------------------------
# Our MaxText-shaped program (no maxtext) and pallas_moe's own block.
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def scaled_stock_estimates(scale: float):
  """Stock megablox's kernels declare `scale` x their CostEstimate bytes while this is active.

  Patches the `pl` that upstream megablox's gmm module and MaxText's megablox fork (where it is
  installed) build their `pl.CostEstimate` with; their kernels, grids and flops are unchanged.
  pallas_moe's kernels are not affected.

  Args:
    scale: factor on `bytes_accessed`; 1.0 changes nothing.

  Yields:
    None.
  """
  from jax.experimental import pallas as pl

  # NOTE: by module path: the megablox packages export their gmm functions over the module names.
  modules = [importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")]
  try:
    modules.append(importlib.import_module("maxtext.kernels.megablox.backend"))
  except ImportError:
    pass

  def cost_estimate(*, flops, bytes_accessed, **kwargs):
    return pl.CostEstimate(flops=flops, bytes_accessed=int(bytes_accessed * scale), **kwargs)

  scaled = types.ModuleType("pallas_scaled_cost")
  scaled.__dict__.update(vars(pl))
  scaled.CostEstimate = cost_estimate
  saved = [(mod, mod.pl) for mod in modules]
  # NOTE: megablox's gmm and tgmm are jitted; their traces cached under the other estimate would
  # be reused, so the caches are dropped on the way in and out.
  if scale != 1.0:
    jax.clear_caches()
  try:
    for mod in modules:
      mod.pl = scaled
    yield
  finally:
    for mod, original in saved:
      mod.pl = original
    if scale != 1.0:
      jax.clear_caches()


def metadata_costs(
  *, topology: str, m: int, tm: int, num_groups: int, num_local_groups: int
) -> dict[str, dict[str, float]]:
  """What the kernels' group metadata costs XLA, compiled alone for one TPU chip.

  The metadata is computed by XLA ops before each Mosaic call (plain jnp: cumsums, a
  searchsorted), so it is part of a step's XLA-op bytes. Compiles, for one shard's
  `group_sizes` and traced `group_offset`: stock megablox's `make_group_metadata` for its gmm
  and its tgmm (MaxText's fork where it is installed, else upstream's), and pallas_moe's
  `metadata.make_schedule` for its visit gmm and tgmm (the kernels MaxText's tiles run).

  Args:
    topology: e.g. "v5e:2x4" (one chip of it compiles).
    m: the receive buffer's rows.
    tm: the m-tile.
    num_groups: experts over all shards.
    num_local_groups: experts on this shard.

  Returns:
    {"megablox": {...}, "pallas_moe": {...}}: cost_analysis() "bytes accessed" and "flops",
    and memory_analysis() temp bytes.
  """
  from jax.sharding import SingleDeviceSharding

  from pallas_moe import metadata

  try:
    stock = importlib.import_module("maxtext.kernels.megablox.backend")
  except ImportError:
    stock = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  device = _topology(topology).devices[0]

  def megablox(group_sizes, group_offset):
    return [
      stock.make_group_metadata(
        group_sizes=group_sizes,
        m=m,
        tm=tm,
        start_group=group_offset,
        num_nonzero_groups=num_local_groups,
        visit_empty_groups=visit_empty,
      )
      for visit_empty in (False, True)
    ]

  def ours(group_sizes, group_offset):
    # NOTE: the visit gmm fills uncovered tiles, the visit tgmm visits empty groups.
    return [
      metadata.make_schedule(
        group_sizes=group_sizes,
        group_offset=group_offset,
        num_local_groups=num_local_groups,
        m=m,
        tm=tm,
        fill_uncovered_tiles=fill,
        visit_empty_groups=not fill,
      )
      for fill in (True, False)
    ]

  sharding = SingleDeviceSharding(device)
  args = (
    jax.ShapeDtypeStruct((num_groups,), jnp.int32, sharding=sharding),
    jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding),
  )
  out = {}
  for name, fn in (("megablox", megablox), ("pallas_moe", ours)):
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out[name] = {
      "bytes": float(cost.get("bytes accessed", 0.0)),
      "flops": float(cost.get("flops", 0.0)),
      "temp": float(compiled.memory_analysis().temp_size_in_bytes),
    }
  return out


def _stock_gmm():
  """Upstream megablox's differentiable gmm (jax.experimental.pallas.ops.tpu.megablox)."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm

  return gmm


def expert_program(
  variant: str, *, mesh: Mesh, dims: Dims, rows: int, tiles=MAXTEXT_TILES, dtype=jnp.bfloat16
):
  """MaxText's `sparse_matmul` experts on a receive buffer, as a jittable step and its args.

  Per device (shard_map over ("data", "expert")): `rows` buffer rows [rows, emb] and the local
  experts' group sizes; wi_0 and wi_1 [E_l, emb, mlp], wo [E_l, mlp, emb]; out = gmm(silu(gmm(x,
  wi_0)) * gmm(x, wi_1), wo), MaxText's three calls, each handed its 9-int tiling (`tiles` for
  every pass); loss sum(out**2).
  The group sizes are an argument (their values are not static), so the kernels see a receive
  buffer with slack as in MaxText.

  Args:
    variant: "megablox" (upstream megablox at `tiles`), "pallas_moe" (`pallas_moe.maxtext.gmm`,
      the default `swap_into`: the 9 ints checked, pallas_moe's own kernels and tiles) or
      "pm_mt_tiles" (`pallas_moe.maxtext.gmm(..., honour_tiling=True)`: at `tiles`).
    mesh: a mesh with axes ("data", "expert").
    dims: the layer.
    rows: buffer rows per device.
    tiles: MaxText's (tm, tk, tn) for every pass.
    dtype: activations and weights.

  Returns:
    (step, args): `jax.value_and_grad` of the loss over (x, wi_0, wi_1, wo), and abstract args.
  """
  from pallas_moe import maxtext as mblx

  ep = dict(mesh.shape)["expert"]
  local = dims.num_experts // ep
  if variant == "megablox":
    stock = _stock_gmm()
    gmm = lambda x, w, gs: stock(x, w, gs, dtype, tiles)  # noqa: E731
  elif variant in ("pallas_moe", "pm_mt_tiles"):
    honour = variant == "pm_mt_tiles"
    gmm = lambda x, w, gs: mblx.gmm(x, w, gs, dtype, tiles * 3, honour_tiling=honour)  # noqa: E731
  else:
    raise ValueError(f"variant={variant!r}: megablox, pallas_moe or pm_mt_tiles.")

  def experts(x, wi_0, wi_1, wo, gs):
    h = jax.nn.silu(gmm(x, wi_0, gs)) * gmm(x, wi_1, gs)
    return gmm(h.astype(dtype), wo, gs)

  rows_spec, w_spec, gs_spec = P(("data", "expert")), P("expert"), P(("data", "expert"))
  sharded = jax.shard_map(
    experts,
    mesh=mesh,
    in_specs=(rows_spec, w_spec, w_spec, w_spec, gs_spec),
    out_specs=rows_spec,
    check_vma=False,
  )

  def loss(x, wi_0, wi_1, wo, gs):
    return jnp.sum(jnp.square(sharded(x, wi_0, wi_1, wo, gs).astype(jnp.float32)))

  def sds(shape, spec, dt=dtype):
    return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

  e, d, f = dims.num_experts, dims.emb, dims.mlp
  args = (
    sds((rows * mesh.size, d), rows_spec),
    sds((e, d, f), w_spec),
    sds((e, d, f), w_spec),
    sds((e, f, d), w_spec),
    sds((local * mesh.size,), gs_spec, jnp.int32),
  )
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), args


def _mesh(topology: str, *, ep: int, data: int) -> Mesh:
  devices = np.array(_topology(topology).devices)
  if devices.size != ep * data:
    raise ValueError(f"{topology} has {devices.size} devices, not ep * data = {ep * data}.")
  axis_types = (jax.sharding.AxisType.Explicit,) * 2
  return Mesh(devices.reshape(data, ep), ("data", "expert"), axis_types=axis_types)


def _compile(step, args, device, compiler_options: dict | None = None):
  with jax.default_device(device):
    return jax.jit(step).lower(*args).compile(compiler_options=compiler_options)


def moe_layer_compiled(
  *, topology: str, ep: int, data: int, dims: Dims, compiler_options: dict | None = None
):
  """pallas_moe.moe.moe_layer's value_and_grad at `dims`, dropless (the same buffer rows)."""
  from bench.moe_memory import aot_step_compiled
  from pallas_moe.config import MoEConfig

  config = MoEConfig(
    num_experts=dims.num_experts,
    top_k=dims.top_k,
    d_model=dims.emb,
    expert_ffn_dim=dims.mlp,
    num_shared_experts=dims.shared,
    dtype="bfloat16",
    weight_dtype="bfloat16",
    buffer_factor=None,
  )
  return aot_step_compiled(
    topology=topology,
    data=data,
    ep=ep,
    tokens_per_device=dims.tokens_per_device,
    config=config,
    with_value=True,
    compiler_options=compiler_options,
  )


def measure(
  variant: str,
  *,
  topology: str,
  ep: int,
  data: int,
  dims: Dims = DEEPSEEK_V2_LITE,
  program: str | None = None,
  out_dir: str = "/tmp/pallas_moe_aot_step",
  stock_bytes_scale: float = 1.0,
  with_live_peak: bool = True,
) -> dict[str, Any]:
  """Compiles one variant for one topology and mesh and analyzes it (`analyze`).

  Args:
    variant: one of VARIANTS.
    topology: e.g. "v5e:2x4".
    ep: expert parallelism.
    data: data parallelism (ep * data devices).
    dims: the layer.
    program: "maxtext" (MaxText's layer) or "ours" (`expert_program`); None: maxtext where it
      is installed. Ignored for "pm_moe_layer".
    out_dir: MaxText's base_output_directory.
    stock_bytes_scale: the megablox variant's kernels declare this x their CostEstimate bytes
      (`scaled_stock_estimates`); other variants take only 1.0.
    with_live_peak: compile with XLA's dumps into a temporary directory to read the live bytes
      at the program's peak (`live_peak`); the dumps do not change the program. False: None.

  Returns:
    `analyze`'s dict with variant, topology, ep, data, rows, program and stock_bytes_scale.
  """
  import tempfile

  from pallas_moe import tiling

  if stock_bytes_scale != 1.0 and variant != "megablox":
    raise ValueError(
      f"stock_bytes_scale={stock_bytes_scale} scales stock megablox's estimates; "
      f"variant={variant!r} has none: pass 1.0 or variant='megablox'."
    )
  rows = dims.buffer_rows(ep)
  if program is None:
    program = "maxtext" if have_maxtext() else "ours"
  # NOTE: pallas_moe picks tiles, VMEM limits and chunk counts for the current generation, which
  # on a CPU host is v5e unless set: compile each topology with its own chip's choices.
  with contextlib.ExitStack() as stack:
    dump_dir, options = None, None
    if with_live_peak:
      dump_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="aot_step_dump_"))
      # NOTE: MaxText's pyconfig sets XLA_FLAGS' --xla_dump_hlo_module_re to its train step's
      # name; every module here is dumped.
      options = {"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": ".*"}
    with (
      tiling.use_generation(topology.split(":")[0]),
      scaled_stock_estimates(stock_bytes_scale),
    ):
      if variant == "pm_moe_layer":
        compiled = moe_layer_compiled(
          topology=topology, ep=ep, data=data, dims=dims, compiler_options=options
        )
        program = "moe"
      elif program == "maxtext":
        compiled = maxtext_compiled(
          variant,
          topology=topology,
          ep=ep,
          data=data,
          dims=dims,
          out_dir=out_dir,
          compiler_options=options,
        )
      else:
        mesh = _mesh(topology, ep=ep, data=data)
        step, args = expert_program(variant, mesh=mesh, dims=dims, rows=rows)
        compiled = _compile(step, args, mesh.devices.flat[0], options)
    rec = analyze(compiled, rows=rows, dump_dir=dump_dir)
  rec.update(
    variant=variant,
    topology=topology,
    ep=ep,
    data=data,
    rows=rows,
    program=program,
    stock_bytes_scale=stock_bytes_scale,
  )
  return rec


def _variant_label(record: dict) -> str:
  scale = record.get("stock_bytes_scale", 1.0)
  return record["variant"] + ("" if scale == 1.0 else f" (est. bytes x{scale:g})")


def table(records: list[dict], *, markdown: bool) -> str:
  """Formats `measure` records: bytes in MB (1e6), flops in TFLOP.

  Columns: memory_analysis() temp, peak (peak_memory_in_bytes) and argument bytes; live_peak
  (`live_peak`); the kernels' declared bytes; XLA-op bytes; XLA's whole-array HBM <-> VMEM
  copies (`vmem_copies`) and its sliced prefetches into VMEM; XLA-op bytes net of the charge
  for both (bytes_xla_net); the kernels' declared TFLOP; Mosaic calls; the buffer-sized copies
  (`big_copies`).
  """
  mb = lambda b: "-" if b is None else f"{b / 1e6:,.0f}"  # noqa: E731
  cols = (
    "topology",
    "ep x data",
    "variant",
    "temp_MB",
    "peak_MB",
    "live_peak_MB",
    "args_MB",
    "kernel_est_MB",
    "xla_ops_MB",
    "vmem_copies_MB",
    "vmem_slices_MB",
    "xla_ops_net_MB",
    "kernel_TFLOP",
    "mosaic",
    "buffer-sized copies",
  )
  rows = []
  for r in records:
    copies = "; ".join(r["copies"]) or "none"
    rows.append(
      [
        r["topology"],
        f"{r['ep']}x{r['data']}",
        _variant_label(r),
        mb(r["temp"]),
        mb(r["peak"]),
        mb(r.get("live_peak")),
        mb(r["args"]),
        mb(r["bytes_kernels"]),
        mb(r["bytes_xla"]),
        mb(r.get("bytes_vmem_copies")),
        mb(r.get("bytes_vmem_slices")),
        mb(r.get("bytes_xla_net")),
        f"{r['flops_kernels'] / 1e12:.2f}",
        str(r["mosaic_calls"]),
        copies,
      ]
    )
  if markdown:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
  else:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
  return "\n".join(out) + "\n"


def _libtpu_version() -> str:
  from importlib import metadata

  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return "?"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topologies", nargs="+", default=["v5e:2x4", "v6e:2x4"])
  parser.add_argument("--meshes", nargs="+", default=["8x1", "4x2"], help="ep x data")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  parser.add_argument("--program", choices=["maxtext", "ours"], default=None)
  parser.add_argument("--markdown", action="store_true")
  parser.add_argument("--json", default=None, help="also write the records to this file")
  parser.add_argument(
    "--no_live_peak",
    action="store_true",
    help="compile without XLA's dumps: no live bytes at the peak (live_peak_MB '-')",
  )
  parser.add_argument(
    "--stock_bytes_scale",
    nargs="+",
    type=float,
    default=[1.0],
    help="compile the megablox variant once per factor on its kernels' declared CostEstimate "
    "bytes (the kernels unchanged); other variants run once, unscaled",
  )
  parser.add_argument(
    "--metadata_only",
    action="store_true",
    help="only compile the kernels' group metadata (stock megablox's and pallas_moe's) per "
    "topology and mesh, at MaxText's tm and the dropless buffer, and print its XLA cost",
  )
  args = parser.parse_args(argv)
  import json

  if args.metadata_only:
    dims = DEEPSEEK_V2_LITE
    for topology in args.topologies:
      for mesh in args.meshes:
        ep = int(mesh.split("x")[0])
        costs = metadata_costs(
          topology=topology,
          m=dims.buffer_rows(ep),
          tm=MAXTEXT_TILES[0],
          num_groups=dims.num_experts,
          num_local_groups=dims.num_experts // ep,
        )
        for name, c in costs.items():
          print(
            f"{topology} ep {ep}: {name} metadata (gmm + tgmm): {c['bytes'] / 1e6:.2f} MB "
            f"accessed, {c['flops']:.0f} flops, temp {c['temp'] / 1e6:.2f} MB"
          )
    return

  records = []
  for topology in args.topologies:
    for mesh in args.meshes:
      ep, data = (int(x) for x in mesh.split("x"))
      for variant in args.variants:
        scales = args.stock_bytes_scale if variant == "megablox" else [1.0]
        for scale in scales:
          rec = measure(
            variant,
            topology=topology,
            ep=ep,
            data=data,
            program=args.program,
            stock_bytes_scale=scale,
            with_live_peak=not args.no_live_peak,
          )
          print(json.dumps(rec), file=sys.stderr, flush=True)
          records.append(rec)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(records, f, indent=1)
  print(
    f"# {datetime.date.today()} jax {jax.__version__}, libtpu {_libtpu_version()}, "
    f"DeepSeek-V2-Lite dims, {DEEPSEEK_V2_LITE.tokens_per_device} tokens per device"
  )
  print(table(records, markdown=args.markdown), end="")


if __name__ == "__main__":
  main()
