"""CPU wall time of interpret mode: our kernels vs upstream megablox on a reduced shape.

Interpret mode runs the kernel body per grid step as XLA:CPU code, so this measures neither TPU
speed nor anything the cost model predicts; it shows that both implementations run on the same
inputs and what an interpret-mode test of that size costs. Both get the same tiles (megablox
needs m % tm == 0) and plain `interpret=True`.
"""

from __future__ import annotations

import functools
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_moe

__all__ = ["interpret_walltime", "table"]


def _median_s(fn, args, *, runs: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm-up
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def interpret_walltime(
  *, m: int, k: int, n: int, num_groups: int, tiling: tuple[int, int, int], runs: int = 3
) -> list[dict]:
  """Times fwd, dlhs and drhs of both implementations in interpret mode on this host.

  Args:
    m: rows.
    k: d_model.
    n: expert ffn.
    num_groups: groups (uniform multinomial sizes, seed 0).
    tiling: (tm, tk, tn) for both implementations.
    runs: timed runs after one warm-up (median reported).

  Returns:
    One record per (impl, op): impl, op, shape, tiling, wall_ms, max_abs_diff (ours vs
    megablox, in f32 of the bf16 outputs).
  """
  mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  if m % tiling[0]:
    raise ValueError(f"megablox needs m % tm == 0 (m={m}, tm={tiling[0]})")
  rng = np.random.default_rng(0)
  gs = jnp.asarray(rng.multinomial(m, np.full(num_groups, 1 / num_groups)), jnp.int32)
  keys = jax.random.split(jax.random.key(0), 3)
  bf = jnp.bfloat16
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(bf)
  w = jax.random.normal(keys[1], (num_groups, k, n), jnp.float32).astype(bf)
  dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(bf)
  tl = pallas_moe.Tiling(fwd=tiling, dlhs=tiling, drhs=tiling)
  ours = {
    "fwd": (functools.partial(pallas_moe.gmm, tiling=tl, interpret=True), (x, w, gs)),
    "dlhs": (
      functools.partial(pallas_moe.gmm, tiling=tl, transpose_rhs=True, interpret=True),
      (dy, w, gs),
    ),
    "drhs": (functools.partial(pallas_moe.tgmm, tiling=tiling, interpret=True), (x.T, dy, gs)),
  }
  theirs = {
    "fwd": (functools.partial(mb.gmm, tiling=tiling, interpret=True), (x, w, gs)),
    "dlhs": (
      functools.partial(mb.gmm, tiling=tiling, transpose_rhs=True, interpret=True),
      (dy, w, gs),
    ),
    "drhs": (functools.partial(mb.tgmm, tiling=tiling, interpret=True), (x.T, dy, gs)),
  }
  records = []
  for op in ("fwd", "dlhs", "drhs"):
    outs = {}
    for impl, (fn, args) in (("pallas_moe", ours[op]), ("megablox", theirs[op])):
      f = jax.jit(lambda *a, fn=fn: fn(*a, preferred_element_type=bf))
      outs[impl] = np.asarray(f(*args), np.float32)
      records.append(
        dict(
          impl=impl,
          op=op,
          shape=dict(m=m, k=k, n=n, num_groups=num_groups),
          tiling=list(tiling),
          wall_ms=_median_s(f, args, runs=runs) * 1e3,
        )
      )
    diff = float(np.max(np.abs(outs["pallas_moe"] - outs["megablox"])))
    for r in records[-2:]:
      r["max_abs_diff"] = diff
  return records


def table(records: list[dict], *, markdown: bool) -> str:
  """Formats `interpret_walltime` records.

  Args:
    records: from `interpret_walltime`.
    markdown: a markdown table instead of aligned text.

  Returns:
    The text.
  """
  if not records:
    return ""
  s = records[0]["shape"]
  title = (
    f"CPU interpret mode wall time (interpret=True; m={s['m']} k={s['k']} n={s['n']} "
    f"G={s['num_groups']}, tiling {'x'.join(map(str, records[0]['tiling']))})"
  )
  by = {(r["op"], r["impl"]): r for r in records}
  cols = ("op", "pallas_moe_ms", "megablox_ms", "megablox/ours", "max_abs_diff")
  rows = []
  for op in dict.fromkeys(r["op"] for r in records):
    o, t = by[(op, "pallas_moe")], by[(op, "megablox")]
    rows.append(
      [
        op,
        f"{o['wall_ms']:,.1f}",
        f"{t['wall_ms']:,.1f}",
        f"{t['wall_ms'] / o['wall_ms']:.2f}",
        f"{o['max_abs_diff']:.3g}",
      ]
    )
  if markdown:
    out = [f"### {title}\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
  else:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = [f"== {title}", "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
  return "\n".join(out) + "\n"
