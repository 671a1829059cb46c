"""`python -m bench.slack`: modeled gmm time on expert-parallel receive buffers.

Under expert parallelism a device multiplies a receive buffer of `buffer_rows` static rows, of which
only `rows = sum(group_sizes)` are real, over its E_l = E / ep local experts. This module builds
that per-device problem for the EP cases of docs/design.md ("Expert-parallel cases: what a device's
gmm sees") and models each op (fwd, dlhs, drhs) with `bench.costmodel` over the real pallas_calls,
like `python -m bench`:

- rows: each of the ep peers sends the device the rows its T tokens route to the device's
  experts. Uniform routing gives T·top_k rows on average; the group sizes are a multinomial draw
  of ep·T·top_k rows over all E experts (fixed seed, uniform or Zipf(1) probabilities in a random
  expert order, as `bench.shapes.group_sizes`), of which the device keeps experts 0 .. E_l - 1.
- buffer policies (the block's, `pallas_moe.BufferPolicy`): "exact" (the rows, rounded up to
  8: `dropless_buffer_rows`), "cap1.25" / "cap2.0" (ceil(f·T·top_k); rows beyond it are dropped,
  so rows = min(rows, buffer)), and "static" (the dropless bound ep·T·min(top_k, E_l), plain jit).

Targets checked per (case, op, chip):
- `vs_slack1`: ours ("pallas_moe", exact zeros in the slack rows) ≤ 1.05 x ours on the same
  rows with no slack, plus the time to write those zeros (slack rows x output columns x 2 bytes
  / HBM bandwidth; tgmm writes no rows, so 0 there); and "pallas_moe-moe" (the MoE block's
  `unowned_rows="undefined"`: slack rows left unwritten) ≤ 1.05 x ours with no slack.
- `vs_mb`: pallas_moe-moe faster than megablox at MaxText's tiles (512, 1024, 1024) and, with
  `--impls ...,megablox-best`, than megablox at its best tiling. Like it, megablox leaves the
  slack rows unwritten (its grid covers the active tiles only); the exact-zero variant writes
  them and is compared through `vs_slack1`.
- `vs_bound`: pallas_moe-moe ≤ 1.10 x the achievable bound of the rows actually present.

Example: python -m bench.slack --chip v5e,v6e --json bench/out/slack.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from bench import costmodel  # noqa: E402
from bench.impls import IMPLS, Unsupported  # noqa: E402
from bench.shapes import SHAPES, Shape  # noqa: E402
from pallas_moe.tiling import get_generation  # noqa: E402

_SEED = 0
POLICIES = ("exact", "cap1.25", "cap2.0", "static")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpCase:
  """One device's problem after dispatch.

  Attributes:
    model: a `bench.shapes.SHAPES` name (k, n, top_k, and E = its groups at ep = 1... see
      `EP_MODELS` for the expert counts used).
    ep: expert-parallel degree.
    num_experts: experts of the model (E).
    tokens: tokens per device (T).
    policy: buffer policy (see the module docstring).
    routing: "uniform" or "zipf".
  """

  model: str
  ep: int
  num_experts: int
  tokens: int
  policy: str
  routing: str

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.ep

  @property
  def shape(self) -> Shape:
    return SHAPES[self.model]

  def group_sizes(self) -> np.ndarray:
    """[E_l] rows the device receives per local expert, before any capacity drop."""
    rng = np.random.default_rng(_SEED)
    e = self.num_experts
    p = np.full(e, 1.0 / e) if self.routing == "uniform" else 1.0 / np.arange(1, e + 1)
    p = rng.permutation(p / p.sum())
    sent = self.ep * self.tokens * self.shape.top_k
    return rng.multinomial(sent, p)[: self.local_experts].astype(np.int32)

  def buffer_rows(self, received: int) -> int:
    t, k, e_l = self.tokens, self.shape.top_k, self.local_experts
    if self.policy == "exact":
      return max(8, -(-received // 8) * 8)
    if self.policy.startswith("cap"):
      return math.ceil(float(self.policy[3:]) * t * k)
    if self.policy == "static":
      return self.ep * t * min(k, e_l)
    raise ValueError(f"unknown policy {self.policy!r}")


# (model, E, ep values): docs/design.md's EP table.
EP_MODELS = (
  ("deepseek-v3", 256, (32, 64)),
  ("qwen3-30b-a3b", 128, (8,)),
  ("deepseek-v2-lite", 64, (8,)),
  ("mixtral-8x7b", 8, (8,)),
)


def ep_cases(tokens=(4096, 16384), policies=POLICIES, routings=("uniform", "zipf")):
  return [
    EpCase(model=m, ep=ep, num_experts=e, tokens=t, policy=p, routing=r)
    for m, e, eps in EP_MODELS
    for ep in eps
    for t in tokens
    for p in policies
    for r in routings
  ]


def drop_to_capacity(sizes: np.ndarray, buffer: int) -> np.ndarray:
  """Group sizes after a capacity drop: rows past `buffer` (in expert order) are dropped."""
  ends = np.minimum(np.cumsum(sizes), buffer)
  return np.diff(np.concatenate([[0], ends])).astype(np.int32)


def model_op(impl: str, *, op: str, k: int, n: int, sizes: np.ndarray, m: int, generation):
  """(modeled µs, achievable-bound µs) of one impl on an [m]-row buffer with these groups."""
  # NOTE: megablox needs m % tm == 0: its buffer is padded up to its m-tile, as its caller must.
  for pad in (8, 512, 1024, 2048):
    shape = Shape(name="ep", tokens=-(-m // pad) * pad, top_k=1, num_groups=sizes.size, k=k, n=n)
    try:
      case = IMPLS[impl].build(op=op, shape=shape, group_sizes=sizes, generation=generation)
      break
    except Unsupported:
      if pad == 2048:
        raise
  scheds = costmodel.analyze(
    case.fn, *case.args, step_scale=case.step_scale, step_manual_bytes=case.step_manual_bytes
  )
  rows = int(sizes.sum())
  rep = costmodel.cost(
    scheds,
    generation=generation,
    row_macs=case.row_macs(generation.mxu_size) if case.row_macs else None,
    mxu_rows_useful=rows,
    useful_row_macs=k * n,
    floor_rows_count=costmodel.op_floor_rows(sizes, generation=generation, op=op),
    min_hbm_bytes=2 * (rows * (k + n) + sizes.size * k * n),
  )
  return rep.modeled_us, rep.achievable_us


def run_case(c: EpCase, *, chip: str, ops, impls) -> list[dict]:
  gen = get_generation(chip)
  shape = c.shape
  received = c.group_sizes()
  buffer = c.buffer_rows(int(received.sum()))
  sizes = drop_to_capacity(received, buffer)
  rows = int(sizes.sum())
  out = []
  for op in ops:
    # (contraction, output columns) of the op: fwd [m,k]x[k,n]; dlhs [m,n]x[n,k]; drhs [G,k,n].
    k, n = (shape.k, shape.n) if op != "dlhs" else (shape.n, shape.k)
    rec = dict(
      model=c.model,
      ep=c.ep,
      local_experts=c.local_experts,
      tokens=c.tokens,
      policy=c.policy,
      routing=c.routing,
      op=op,
      chip=chip,
      buffer_rows=buffer,
      rows=rows,
      dropped=int(received.sum()) - rows,
      slack=buffer / max(rows, 1),
    )
    dense_m = max(8, -(-rows // 8) * 8)
    fk, fn = (shape.k, shape.n) if op == "drhs" else (k, n)
    ours1, _ = model_op("pallas_moe", op=op, k=fk, n=fn, sizes=sizes, m=dense_m, generation=gen)
    for impl in impls:
      us, bound = model_op(impl, op=op, k=fk, n=fn, sizes=sizes, m=buffer, generation=gen)
      rec[f"{impl}_us"] = us
      if impl == "pallas_moe":
        rec["achievable_us"] = bound
    zero_write_us = 0.0 if op == "drhs" else (buffer - dense_m) * n * 2 / gen.hbm_bytes_per_s * 1e6
    ours = rec["pallas_moe_us"]
    rec["ours_slack1_us"] = ours1
    rec["zero_write_us"] = zero_write_us
    # NOTE: the MoE block's setting (`unowned_rows="undefined"`, no zero writes) where it is
    # modeled: like megablox, it leaves the slack rows unwritten.
    moe = rec.get("pallas_moe-moe_us", ours)
    rec["vs_slack1"] = ours <= 1.05 * ours1 + zero_write_us and moe <= 1.05 * ours1
    rec["vs_mb"] = all(moe < rec[f"{i}_us"] for i in impls if i.startswith("megablox"))
    rec["vs_bound"] = moe <= 1.10 * rec["achievable_us"]
    out.append(rec)
  return out


def _define_flags():
  """Defines the command-line flags (only when run as a program: `bench.__main__` defines flags
  of the same names, and tests import both modules into one process)."""
  global _CHIP, _OPS, _IMPLS, _TOKENS, _POLICIES, _ROUTINGS, _MODELS, _JSON, _MARKDOWN
  _CHIP = flags.DEFINE_list("chip", ["v5e", "v6e"], "TPU generations to model.")
  _OPS = flags.DEFINE_list("ops", ["fwd", "dlhs", "drhs"], "Ops.")
  _IMPLS = flags.DEFINE_list(
    "impls", ["pallas_moe", "pallas_moe-moe", "megablox-maxtext"], "Implementations."
  )
  _TOKENS = flags.DEFINE_list("tokens", ["4096", "16384"], "Tokens per device.")
  _POLICIES = flags.DEFINE_list("policies", list(POLICIES), "Buffer policies.")
  _ROUTINGS = flags.DEFINE_list("routings", ["uniform", "zipf"], "Routings.")
  _MODELS = flags.DEFINE_list("models", [m for m, _, _ in EP_MODELS], "Models.")
  _JSON = flags.DEFINE_string("json", None, "Write the records here.")
  _MARKDOWN = flags.DEFINE_string(
    "markdown", None, "Write a summary table (one row per case and chip, uniform routing) here."
  )


def markdown(records: list[dict]) -> str:
  """One row per (model, ep, tokens, policy, chip), uniform routing: slack, and per op the MoE
  block's gmm (pallas_moe-moe) µs / with exact zeros µs / megablox at MaxText's tiles µs."""
  rows = {}
  for r in records:
    if r["routing"] != "uniform":
      continue
    key = (r["model"], r["ep"], r["tokens"], r["policy"], r["chip"])
    rows.setdefault(key, {})[r["op"]] = r
  out = [
    "| model | ep | T | policy | chip | buffer / rows | "
    + " | ".join(f"{op}: moe / zeros / mb512 µs" for op in ("fwd", "dlhs", "drhs"))
    + " | targets |",
    "|---|---:|---:|---|---|---:|" + "---:|" * 3 + "---|",
  ]
  for (model, ep, tokens, policy, chip), ops in rows.items():
    any_op = next(iter(ops.values()))
    cells = []
    for op in ("fwd", "dlhs", "drhs"):
      r = ops.get(op)
      if r is None:
        cells.append("")
        continue
      moe = r.get("pallas_moe-moe_us", r["pallas_moe_us"])
      mb = r.get("megablox-maxtext_us", float("nan"))
      cells.append(f"{moe:,.0f} / {r['pallas_moe_us']:,.0f} / {mb:,.0f}")
    held = all(r["vs_slack1"] and r["vs_mb"] and r["vs_bound"] for r in ops.values())
    misses = [
      f"{op} {k}" for op, r in ops.items() for k in ("vs_slack1", "vs_mb", "vs_bound") if not r[k]
    ]
    out.append(
      f"| {model} | {ep} | {tokens} | {policy} | {chip} | "
      f"{any_op['buffer_rows']:,} / {any_op['rows']:,} | "
      + " | ".join(cells)
      + f" | {'all hold' if held else 'MISS: ' + ', '.join(misses)} |"
    )
  return "\n".join(out) + "\n"


def main(argv):
  del argv
  t0 = time.time()
  cases = [
    c
    for c in ep_cases(
      tokens=tuple(int(t) for t in _TOKENS.value),
      policies=tuple(_POLICIES.value),
      routings=tuple(_ROUTINGS.value),
    )
    if c.model in _MODELS.value
  ]
  impls = ["pallas_moe"] + [i for i in _IMPLS.value if i != "pallas_moe"]
  records = []
  header = (
    f"{'model':17s} {'ep':>3s} {'T':>6s} {'policy':8s} {'routing':8s} {'op':5s} {'chip':5s} "
    f"{'buffer':>8s} {'rows':>7s} {'slack':>6s} {'ours µs':>9s} {'slack1':>8s} {'+zeros':>7s} "
    + " ".join(f"{i[:16]:>16s}" for i in impls[1:])
    + f" {'bound':>8s} {'vs_s1':>5s} {'vs_mb':>5s} {'bound':>5s}"
  )
  print(header)
  for chip in _CHIP.value:
    for c in cases:
      for r in run_case(c, chip=chip, ops=_OPS.value, impls=impls):
        records.append(r)
        print(
          f"{r['model']:17s} {r['ep']:3d} {r['tokens']:6d} {r['policy']:8s} {r['routing']:8s} "
          f"{r['op']:5s} {chip:5s} {r['buffer_rows']:8d} {r['rows']:7d} {r['slack']:6.2f} "
          f"{r['pallas_moe_us']:9.0f} {r['ours_slack1_us']:8.0f} {r['zero_write_us']:7.0f} "
          + " ".join(f"{r[f'{i}_us']:16.0f}" for i in impls[1:])
          + f" {r['achievable_us']:8.0f} {'ok' if r['vs_slack1'] else 'MISS':>5s}"
          f" {'ok' if r['vs_mb'] else 'MISS':>5s} {'ok' if r['vs_bound'] else 'MISS':>5s}",
          flush=True,
        )
  for key in ("vs_slack1", "vs_mb", "vs_bound"):
    held = sum(r[key] for r in records)
    print(f"{key}: holds on {held} of {len(records)}")
  print(f"bench.slack total {time.time() - t0:.0f}s")
  if _MARKDOWN.value:
    with open(_MARKDOWN.value, "w") as f:
      f.write(markdown(records))
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as f:
      json.dump(records, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  sys.exit(app.run(main))
