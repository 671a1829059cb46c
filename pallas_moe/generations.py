"""TPU generation facts: per-chip VMEM, MXU, peak rates, bandwidth, and which chip is current.

Facts (per chip) are those of docs/design.md, "Platform facts the code relies on", which agree with
jax's own table in `jax/_src/pallas/mosaic/tpu_info.py` (jax 0.10.2). The *scoped* VMEM default is
what Mosaic lets one kernel use when `pltpu.CompilerParams(vmem_limit_bytes=...)` is not set; it is
much smaller than the physical VMEM. jax does not ship these defaults (libtpu owns them). The
figures below are the ones publicly reported for the XLA flag `--xla_tpu_scoped_vmem_limit_kib` (16
MiB on v4/v5e/v5p, 32 MiB on v6e and tpu7x); tpu7x's is the least certain.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import numpy as np

_MIB = 1024 * 1024

# NOTE: the constants fit on measured TPU times (tokamax's autotuning data, `python -m
# bench.measured --fit`) are v6e's and tpu7x's per-step costs; every other figure is a
# datasheet's or a compiled program's. v6e: its forward problems (44 of 46, dims multiples of
# 128, rates fixed) give 0.68 µs per step (0.35 µs left its median at 1.11).
V6E_STEP_OVERHEAD_S = 0.68e-6
# NOTE: the fewest rows a pass through one weight tile costs. On a 256-wide MXU the model charged
# a 128-row pass as 256 (loading the 256 x 256 tile taking as long as 256 rows), which made
# tokamax's 16 measured tm = 128 forward problems on tpu7x run 0.64-0.79x the model; the compiled
# kernel streams 128 rows per tile (16 weight pushes per tile, ~33 bundles per tile), and at 128
# rows those problems measure 1.01x (plain) and 1.02x (under `jax.vjp`). v6e's four fit either
# charge (0.84-1.02x at 256, 0.89-1.10x at 128). No measured problem has narrower passes.
MIN_PASS_ROWS = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuGeneration:
  """Per-chip facts of one TPU generation.

  Attributes:
    name: short name ("v5e", "v6e", ...).
    vmem_bytes: physical VMEM per TensorCore.
    scoped_vmem_default_bytes: Mosaic's default per-kernel VMEM limit (no `vmem_limit_bytes`).
    mxu_size: systolic array edge (rows per MXU pass, and weight tile edge).
    peak_bf16_flops: chip peak bf16 flop/s.
    supports_int8: native int8 x int8 MXU matmul (int32 accumulation), faster than bf16.
    supports_fp8: native float8_e4m3fn x float8_e4m3fn MXU matmul, faster than bf16.
    peak_int8_ops: chip peak int8 op/s where `supports_int8`, else 0.
    peak_fp8_ops: chip peak fp8 flop/s where `supports_fp8`, else 0.
    hbm_bytes_per_s: chip HBM bandwidth.
    cores_per_chip: TensorCores per chip (the per-chip rates are shared by them).
    tensorcores_per_device: TensorCores behind one JAX device: 2 on a megacore device (v4, v5p),
      where Mosaic splits a kernel's leading "parallel" grid axes between them; 1 on v5e, v6e
      and tpu7x (a tpu7x chip is two JAX devices, one TensorCore each). NOTE: v4's split is not
      seen in a compiled program: its AOT topology ("v4:2x2x1") has one-TensorCore devices.
    aot_topology: topology name for ahead-of-time compilation (`get_topology_desc`).
    device_kinds: `jax.Device.device_kind` strings of this generation.
    step_overhead_s: the cost model's fixed time per Pallas grid step (pipeline bookkeeping,
      DMA issue and waits), on top of max(MXU, DMA) (`bench.costmodel`).
    unpacks_fp8: 8-bit float dtypes the vector unit converts to f32 in one instruction per
      value (no fix-ups), as Mosaic compiles `astype(float32)` for the generation.
    mxu_pushes_fp8: 8-bit float dtypes Mosaic multiplies bf16 rows by as they are: the MXU
      converts the weights as they are pushed in, and no converted copy passes through the
      vector unit.
    copy_row_unit: the row a DMA into VMEM of 16-bit rows (or f32 ones beside them) may start
      on is a multiple of this: Mosaic's tile of such a VMEM buffer ("offsets along tiled
      dimensions must be aligned to tiles"). Compiled: 8 on v5e, v5p and v6e, 16 on tpu7x; 16
      where not compiled.
  """

  name: str
  vmem_bytes: int
  scoped_vmem_default_bytes: int
  mxu_size: int
  peak_bf16_flops: float
  supports_int8: bool
  supports_fp8: bool
  hbm_bytes_per_s: float
  cores_per_chip: int
  tensorcores_per_device: int
  aot_topology: str
  device_kinds: tuple[str, ...] = ()
  peak_int8_ops: float = 0.0
  peak_fp8_ops: float = 0.0
  step_overhead_s: float = 0.35e-6
  unpacks_fp8: tuple[str, ...] = ()
  mxu_pushes_fp8: tuple[str, ...] = ()
  copy_row_unit: int = 16


# NOTE on the narrow MXU modes (int8 / fp8). Sources: Cloud TPU docs per chip ("Peak compute per
# chip (Int8)": v5e 393 TOPs, v5p 918 TOPs, v6e 1836 TOPs; tpu7x "(fp8)": 4614 TFLOPs) and jax
# 0.10.2's `jax/_src/pallas/mosaic/tpu_info.py`, whose `is_matmul_supported` lists int8 x int8 for
# generations 5 and 6 but float8_e4m3fn only from generation 7 (v5/v6 list e5m2 and e4m3b11fnuz),
# gives v6e's fp8 rate as its bf16 rate (9.2e14), and lists no int8 rate for tpu7x or v4.
# So v6e gets no fp8 credit: Mosaic accepts an e4m3fn dot there (AOT, also on v5e) but gains
# nothing over bf16; our kernels upcast in VMEM instead. v4 rejects int8 and fp8 dots outright
# (AOT: CompileTimeMosaicUnsupportedRhsType).
#
# NOTE on `unpacks_fp8` (compiled ahead of time, libtpu 0.0.50.1: `astype(float32)` of a VMEM
# block, the scheduled bundles read back): v5e, v5p and v6e unpack float8_e4m3b11fnuz and
# float8_e5m2 in one `vunpack` per value; their float8_e4m3fn takes that unpack plus a
# multiply, two compares, two selects and a mask (its 256-448 binade and NaN are encoded
# differently). tpu7x unpacks float8_e4m3fn itself. v4 builds every 8-bit float from integer
# operations (about 12 bundles per 1,024 values).
#
# NOTE on `mxu_pushes_fp8` (compiled the same way: a bf16 [64, 128] x float8_e4m3fn [128, 2048]
# dot): v5e, v5p and v6e push the e4m3fn weights into the MXU as e4m3b11 (`vmatpush.f8e4m3b11`),
# after a fix-up of three operations per 4,096 bytes for the byte 0x80, and scale the result by
# 16; no upcast weights are written. Cast to bf16 first (`astype`), the same dot converts every
# value on the vector unit.
_UNPACKS_V5 = ("float8_e4m3b11fnuz", "float8_e5m2")
_PUSHES_V5 = ("float8_e4m3fn",)


GENERATIONS: dict[str, TpuGeneration] = {
  g.name: g
  for g in (
    TpuGeneration(
      name="v4",
      vmem_bytes=16 * _MIB,
      scoped_vmem_default_bytes=16 * _MIB,
      mxu_size=128,
      peak_bf16_flops=275e12,
      supports_int8=False,
      supports_fp8=False,
      hbm_bytes_per_s=1200e9,
      cores_per_chip=2,
      tensorcores_per_device=2,
      aot_topology="v4:2x2x1",
      device_kinds=("TPU v4",),
    ),
    TpuGeneration(
      name="v5e",
      vmem_bytes=128 * _MIB,
      scoped_vmem_default_bytes=16 * _MIB,
      mxu_size=128,
      peak_bf16_flops=197e12,
      supports_int8=True,
      supports_fp8=False,
      peak_int8_ops=393e12,
      hbm_bytes_per_s=819e9,
      cores_per_chip=1,
      tensorcores_per_device=1,
      aot_topology="v5e:2x2",
      device_kinds=("TPU v5e", "TPU v5 lite"),
      unpacks_fp8=_UNPACKS_V5,
      mxu_pushes_fp8=_PUSHES_V5,
      copy_row_unit=8,
    ),
    TpuGeneration(
      name="v5p",
      vmem_bytes=64 * _MIB,
      scoped_vmem_default_bytes=16 * _MIB,
      mxu_size=128,
      peak_bf16_flops=459e12,
      supports_int8=True,
      supports_fp8=False,
      peak_int8_ops=918e12,
      hbm_bytes_per_s=2765e9,
      cores_per_chip=2,
      tensorcores_per_device=2,
      aot_topology="v5p:2x2x1",
      device_kinds=("TPU v5", "TPU v5p"),
      unpacks_fp8=_UNPACKS_V5,
      mxu_pushes_fp8=_PUSHES_V5,
      copy_row_unit=8,
    ),
    TpuGeneration(
      name="v6e",
      vmem_bytes=128 * _MIB,
      scoped_vmem_default_bytes=32 * _MIB,
      mxu_size=256,
      peak_bf16_flops=918e12,
      supports_int8=True,
      supports_fp8=False,
      peak_int8_ops=1836e12,
      hbm_bytes_per_s=1638e9,
      cores_per_chip=1,
      tensorcores_per_device=1,
      aot_topology="v6e:2x2",
      device_kinds=("TPU v6e", "TPU v6 lite"),
      step_overhead_s=V6E_STEP_OVERHEAD_S,
      unpacks_fp8=_UNPACKS_V5,
      mxu_pushes_fp8=_PUSHES_V5,
      copy_row_unit=8,
    ),
    TpuGeneration(
      name="tpu7x",
      vmem_bytes=64 * _MIB,
      scoped_vmem_default_bytes=32 * _MIB,
      mxu_size=256,
      peak_bf16_flops=2307e12,
      supports_int8=False,
      supports_fp8=True,
      peak_fp8_ops=4614e12,
      hbm_bytes_per_s=7380e9,
      cores_per_chip=2,
      tensorcores_per_device=1,
      aot_topology="tpu7x:2x2x1",
      device_kinds=("TPU7x",),
      unpacks_fp8=("float8_e4m3fn",),
      # NOTE: fit on tokamax's measured tpu7x forward problems (`python -m bench.measured
      # --fit`: 35 of 43, both kernels, dims multiples of 128) with the rates fixed at one
      # TensorCore's: 0.84 µs per step. The same fit gives 0.44 (v5e) and 0.15 µs (v5p), whose
      # medians stay within 5% at the default 0.35 µs; v6e's and tpu7x's were 11% and 17% slow.
      step_overhead_s=0.84e-6,
    ),
  )
}


_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "7x": "tpu7x", "v7x": "tpu7x"}


def get_generation(name: str | TpuGeneration) -> TpuGeneration:
  """Looks up a TPU generation by short name.

  Args:
    name: "v4", "v5e", "v5p", "v6e" or "tpu7x" (a few aliases accepted), or a `TpuGeneration`
      (returned as is).

  Returns:
    The `TpuGeneration`.
  """
  if isinstance(name, TpuGeneration):
    return name
  key = _ALIASES.get(name.lower(), name.lower())
  if key not in GENERATIONS:
    raise ValueError(f"Unknown TPU generation {name!r}; known: {sorted(GENERATIONS)}")
  return GENERATIONS[key]


_GENERATION_OVERRIDE: contextvars.ContextVar[TpuGeneration | None] = contextvars.ContextVar(
  "pallas_moe_tpu_generation", default=None
)


@contextlib.contextmanager
def use_generation(generation: str | TpuGeneration) -> Iterator[TpuGeneration]:
  """Makes `current_generation()` return `generation` inside the block.

  For ahead-of-time compilation from a host that is not that TPU (e.g. compiling for a v6e
  topology from a CPU): the default tiles (`pick_tiling`) and the VMEM check of `pallas_moe.gmm`
  / `tgmm` then follow the target, not the host. The override applies when the ops are *traced*
  (e.g. inside `jax.jit(f).lower(...)`), so lower inside the block. Nests; thread- and
  asyncio-safe (a `contextvars.ContextVar`).

  Args:
    generation: a generation name ("v5e", "v6e", ...) or a `TpuGeneration`.

  Yields:
    The `TpuGeneration` in effect.
  """
  gen = get_generation(generation)
  token = _GENERATION_OVERRIDE.set(gen)
  try:
    yield gen
  finally:
    _GENERATION_OVERRIDE.reset(token)


def current_generation() -> TpuGeneration:
  """The generation set by `use_generation`, else that of `jax.devices()[0]` on TPU, else v5e.

  Returns:
    The `TpuGeneration`.
  """
  override = _GENERATION_OVERRIDE.get()
  if override is not None:
    return override
  import jax

  try:
    kind = jax.devices()[0].device_kind
  except RuntimeError:
    return GENERATIONS["v5e"]
  for gen in GENERATIONS.values():
    if kind in gen.device_kinds:
      return gen
  return GENERATIONS["v5e"]


def narrow_peak(generation: str | TpuGeneration, dtype) -> float:
  """MXU rate of a dot that multiplies two `dtype` (int8 / fp8) operands natively.

  Raises:
    ValueError: the generation has no native mode for `dtype` (its dots upcast to bf16).
  """
  gen = get_generation(generation)
  name = np.dtype(dtype).name
  if name == "int8" and gen.supports_int8:
    return gen.peak_int8_ops
  if name.startswith("float8") and gen.supports_fp8:
    return gen.peak_fp8_ops
  raise ValueError(f"{gen.name} has no native {name} MXU mode: its {name} dots run upcast.")


def min_pass_rows(generation: str | TpuGeneration) -> int:
  """Rows one pass through an mxu x mxu weight tile costs at least: a dot with r rows costs
  max(r, min_pass_rows) row cycles per weight tile (`bench.costmodel`, `schedule_cost`):
  min(mxu, `MIN_PASS_ROWS`)."""
  return min(get_generation(generation).mxu_size, MIN_PASS_ROWS)


def tensorcore_rates(generation: str | TpuGeneration) -> tuple[float, float]:
  """One TensorCore's bf16 peak and HBM bandwidth: the chip's figures over its TensorCores.

  NOTE: jax's `tpu_info` lists v5p's and tpu7x's figures per core as half the chip's. That a
  TensorCore running alone gets only half the chip's HBM bandwidth is an assumption; it matches
  tokamax's measurements of grid-less kernels on v5p (`bench.measured`).

  Returns:
    (flop/s, bytes/s).
  """
  gen = get_generation(generation)
  return gen.peak_bf16_flops / gen.cores_per_chip, gen.hbm_bytes_per_s / gen.cores_per_chip


def sequential_sweeps(generation: str | TpuGeneration) -> bool:
  """Whether the row-tile kernels run their sweeps in order with DMAs crossing them.

  On a device with one TensorCore (v5e, v6e, and tpu7x, whose chip is two one-core devices) a
  grid runs in order anyway, so the kernels prefetch across sweeps; on a megacore device (v4,
  v5p) the sweeps stay independent so that Mosaic can split them between the two cores.
  NOTE: AOT-compiled for tpu7x, a grid with a "parallel" axis loops over every step on its one
  core, as an all-"arbitrary" grid does (no megacore split in the program).
  """
  return get_generation(generation).tensorcores_per_device == 1


def rows_per_pass(tm: int, mxu: int) -> int:
  """Rows the kernels push through the MXU per sub-block (their `sub_m`): `mxu` (the pass
  granule, `pass_granule`) when it divides tm (sub-blocks without rows of a group are skipped),
  else the whole tile."""
  return mxu if tm % mxu == 0 else tm


def pass_granule(generation: str | TpuGeneration, *, kind: str, tn: int | None = None) -> int:
  """The row granule of a kernel's MXU passes.

  gmm streams its rows through the weight tiles, and a pass of `min_pass_rows` rows costs that
  many (128 on a 256-wide MXU), so a group's rows are rounded out to 128 there, not 256: half
  the rows at group boundaries. tgmm contracts over its rows, which the MXU pads to its edge.

  Args:
    generation: TPU generation.
    kind: "gmm" or "tgmm".
    tn: gmm's output-column tile, if known. NOTE: when it is not a multiple of the MXU edge
      (1408 on a 256-wide MXU) gmm keeps MXU-edge passes, so that streaming the tn columns
      through [k, sub_m] tiles (`rows_stationary_pays`) can save their padding: a 128-row
      sub-block would be padded to the edge there instead.

  Returns:
    Rows.
  """
  gen = get_generation(generation)
  if kind == "gmm":
    if tn is not None and tn % gen.mxu_size:
      return gen.mxu_size
    return min_pass_rows(gen)
  if kind == "tgmm":
    return gen.mxu_size
  raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")


def pass_rows(tm: int, generation: str | TpuGeneration, *, kind: str, tn: int | None = None) -> int:
  """A kernel's sub_m: `rows_per_pass` at the op's `pass_granule`."""
  return rows_per_pass(tm, pass_granule(generation, kind=kind, tn=tn))
