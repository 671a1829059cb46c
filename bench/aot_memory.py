"""XLA's memory analysis of an AOT-compiled gmm training step (fwd + dlhs + drhs) for a TPU.

Compiled from this host for one device of the generation's AOT topology (libtpu, the `tpu`
extra), with abstract operands and the heuristic tiles of that generation
(`tiling.use_generation`). Reports `compiled.memory_analysis()`: argument, output and temp bytes.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_moe
from bench.shapes import Shape
from pallas_moe import tiling

__all__ = ["training_step_memory", "table"]


def _loss(x, w, gs):
  # NOTE: the loss uses the forward's value, so the forward kernel stays in the program.
  return jnp.square(pallas_moe.gmm(x, w, gs).astype(jnp.float32)).sum()


def training_step_memory(shape: Shape, *, generation: str = "v5e") -> dict:
  """Compiles grad(loss(gmm)) wrt lhs and rhs for one device and reads its memory analysis.

  Args:
    shape: the problem (bf16 lhs [m, k], rhs [G, k, n], int32 group sizes).
    generation: TPU generation name.

  Returns:
    dict(shape, chip, argument_bytes, output_bytes, temp_bytes, error): byte counts are None and
    `error` holds XLA's message when the program does not compile (e.g. HBM too small).
  """
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  gen = tiling.get_generation(generation)
  dev = topologies.get_topology_desc(topology_name=gen.aot_topology, platform="tpu").devices[0]
  sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())
  m, k, n, g = shape.m, shape.k, shape.n, shape.num_groups
  args = (
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh),
    jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=sh),
    jax.ShapeDtypeStruct((g,), jnp.int32, sharding=sh),
  )
  rec = dict(shape=shape.label, chip=gen.name, error=None)
  try:
    with tiling.use_generation(gen), jax.default_device(dev):
      compiled = jax.jit(jax.grad(_loss, argnums=(0, 1))).lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:
    msg = str(e).splitlines()[0]
    rec.update(argument_bytes=None, output_bytes=None, temp_bytes=None, error=msg[:200])
    return rec
  ma = compiled.memory_analysis()
  rec.update(
    argument_bytes=int(ma.argument_size_in_bytes),
    output_bytes=int(ma.output_size_in_bytes),
    temp_bytes=int(ma.temp_size_in_bytes),
  )
  return rec


def table(records: list[dict], *, markdown: bool) -> str:
  """Formats `training_step_memory` records (GiB).

  Args:
    records: from `training_step_memory`.
    markdown: a markdown table instead of aligned text.

  Returns:
    The text.
  """
  gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
  cols = ("shape", "chip", "args_GiB", "outputs_GiB", "temp_GiB", "note")
  rows = [
    [
      r["shape"],
      r["chip"],
      gib(r["argument_bytes"]),
      gib(r["output_bytes"]),
      gib(r["temp_bytes"]),
      r["error"] or "",
    ]
    for r in records
  ]
  title = "AOT-compiled gmm training step (fwd + dlhs + drhs), memory_analysis()"
  if markdown:
    out = [f"### {title}\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
  else:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = [f"== {title}", "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
  return "\n".join(out) + "\n"
