"""The EP tables: ours against the slack, megablox and bound targets, and the MoE block's gmm time.

Everything here is modeled TPU time (`bench.costmodel` over the kernels' real schedules), as in
the rest of the bench. Run with `python -m bench --ep --targets --block` (see `bench.__main__`);
`python -m bench.ep_report RUN.json ...` renders the tables (and `--plot`) of saved runs together.
"""

from __future__ import annotations

import dataclasses

from bench.ep_cases import EpShape
from bench.tables import format_table
from pallas_moe.tiling import get_generation

__all__ = [
  "BLOCK_CONFIGS",
  "block_cases",
  "block_table",
  "block_totals",
  "merge_runs",
  "ours_in",
  "render",
  "slack_table",
  "slack1_cases",
  "tail_write_us",
  "targets",
  "targets_of_ours",
  "targets_table",
]

OURS = "pallas_moe"
# NOTE: what the MoE block runs: gmm with unowned_rows="undefined" (the tail is never written).
OURS_BLOCK = "pallas_moe-moe"
# Ours, and whether that variant writes the buffer's tail (exact zeros).
OURS_VARIANTS = {OURS: True, OURS_BLOCK: False}
MB512 = "megablox-maxtext"
MBBEST = "megablox-best"
# The EP targets: ours at slack vs slack 1, vs megablox, vs the achievable bound.
SLACK_TOLERANCE = 1.05
BOUND_TOLERANCE = 1.10


def slack1_cases(cases):
  """The same rows and group sizes in a buffer of exactly `rows` rows (slack 1).

  Args:
    cases: [(EpShape, routing, group_sizes)].

  Returns:
    The slack-1 cases; policy "<policy>-slack1" keeps labels (and the bench's cache keys) apart.
  """
  return [
    (s.with_buffer(max(s.rows, 1), policy=f"{s.policy}-slack1"), routing, gs)
    for s, routing, gs in cases
  ]


def tail_write_us(*, record: dict, shape: EpShape | None = None) -> float:
  """Time to write exact zeros into the buffer's tail rows at HBM bandwidth (bf16).

  gmm (fwd, dlhs) writes [buffer_rows, width] with rows past `rows` zero: the tail is
  (buffer_rows - rows) · width · 2 bytes, width = n (fwd) or k (dlhs). tgmm's output [G, k, n]
  has no tail.

  Args:
    record: a bench record of an EP case (`buffer_rows`, `rows`, `op`, `chip`).
    shape: its shape (for k, n); default from the record's `k`/`n` fields.

  Returns:
    Microseconds.
  """
  if record["op"] == "drhs":
    return 0.0
  k = shape.k if shape is not None else record["k"]
  n = shape.n if shape is not None else record["n"]
  width = n if record["op"] == "fwd" else k
  tail = (record["buffer_rows"] - record["rows"]) * width * 2
  return tail / get_generation(record["chip"]).hbm_bytes_per_s * 1e6


def _case_key(r: dict, *, policy: str | None = None) -> tuple:
  return (r["model"], r["ep"], r["tokens"], policy or r["policy"], r["routing"], r["op"], r["chip"])


def targets(
  records: list[dict], slack1: list[dict], *, ours: str = OURS, tail_written: bool | None = None
) -> list[dict]:
  """The EP targets per EP case of ours: one row per (case, op, chip).

  - slack: ours ≤ 1.05 × ours at slack 1 + the tail's zero-write time (`tail_write_us`), or
    ≤ 1.05 × ours at slack 1 where the tail is not written (`tail_written=False`);
  - megablox: ours faster than megablox at MaxText's tiles and at its best tiling;
  - bound: ours ≤ 1.10 × the achievable bound of the rows present.

  Args:
    records: bench records of the EP cases (ours, megablox-maxtext, megablox-best).
    slack1: ours on `slack1_cases` of the same cases.
    ours: which of our impls (`OURS_VARIANTS`) the rows are for.
    tail_written: whether ours writes the buffer's tail (exact zeros); False drops the allowance.
      Default: `OURS_VARIANTS[ours]`.

  Returns:
    Rows (dicts) with the figures and `pass_slack`, `pass_mb512`, `pass_mbbest`, `pass_bound`
    (None where a figure is missing).
  """
  if tail_written is None:
    tail_written = OURS_VARIANTS[ours]
  by = {(r["impl"], *_case_key(r)): r for r in records}
  s1 = {
    _case_key(r, policy=r["policy"].removesuffix("-slack1")): r for r in slack1 if r["impl"] == ours
  }
  out = []
  for r in records:
    if r["impl"] != ours or "ep" not in r:
      continue
    key = _case_key(r)
    one = s1.get(key)
    mb = by.get((MB512, *key))
    best = by.get((MBBEST, *key))
    tail = tail_write_us(record=r) if tail_written else 0.0
    allowed = SLACK_TOLERANCE * one["modeled_us"] + tail if one else None
    t = r["modeled_us"]
    out.append(
      dict(
        case=f"{r['model']}@{r['tokens']}/ep{r['ep']}",
        impl=ours,
        policy=r["policy"],
        routing=r["routing"],
        op=r["op"],
        chip=r["chip"],
        slack=r["slack"],
        ours_us=t,
        slack1_us=one["modeled_us"] if one else None,
        tail_us=tail,
        slack_ratio=t / allowed if allowed else None,
        mb512_us=mb["modeled_us"] if mb else None,
        mbbest_us=best["modeled_us"] if best else None,
        achievable_us=r["achievable_us"],
        bound_ratio=t / r["achievable_us"] if r["achievable_us"] else None,
        pass_slack=None if allowed is None else t <= allowed,
        pass_mb512=None if mb is None else t < mb["modeled_us"],
        pass_mbbest=None if best is None else t < best["modeled_us"],
        pass_bound=None if not r["achievable_us"] else t <= BOUND_TOLERANCE * r["achievable_us"],
      )
    )
  return out


def ours_in(records: list[dict]) -> list[str]:
  """Which of our variants (`OURS_VARIANTS`, in that order) the records hold."""
  return [o for o in OURS_VARIANTS if any(r["impl"] == o for r in records)]


def targets_of_ours(records: list[dict], slack1: list[dict]) -> list[dict]:
  """`targets` rows of every variant of ours that `slack1` holds, variant by variant."""
  return [t for o in ours_in(slack1) for t in targets(records, slack1, ours=o)]


_TARGET_COLUMNS = (
  "case",
  "impl",
  "policy",
  "routing",
  "op",
  "chip",
  "slack",
  "ours µs",
  "slack1 µs",
  "tail µs",
  "ours/(1.05·s1+tail)",
  "slack",
  "mb512 µs",
  "<mb512",
  "mbbest µs",
  "<mbbest",
  "ours/ach",
  "≤1.10",
)


def _fmt(x, p=1) -> str:
  return "-" if x is None else f"{x:,.{p}f}"


def _pf(x) -> str:
  return "-" if x is None else ("pass" if x else "FAIL")


def targets_table(rows: list[dict], *, markdown: bool) -> str:
  """Formats `targets` rows, with a pass count per target at the end.

  Args:
    rows: from `targets`.
    markdown: a markdown table instead of aligned text.

  Returns:
    The text.
  """
  body = [
    [
      t["case"],
      t["impl"],
      t["policy"],
      t["routing"],
      t["op"],
      t["chip"],
      _fmt(t["slack"], 2),
      _fmt(t["ours_us"]),
      _fmt(t["slack1_us"]),
      _fmt(t["tail_us"]),
      _fmt(t["slack_ratio"], 2),
      _pf(t["pass_slack"]),
      _fmt(t["mb512_us"]),
      _pf(t["pass_mb512"]),
      _fmt(t["mbbest_us"]),
      _pf(t["pass_mbbest"]),
      _fmt(t["bound_ratio"], 2),
      _pf(t["pass_bound"]),
    ]
    for t in rows
  ]
  text = format_table("EP targets, ours, modeled", _TARGET_COLUMNS, body, markdown=markdown)
  summary = []
  for name, col in (
    ("slack: ours <= 1.05 x slack-1 (+ tail zero-write where written)", "pass_slack"),
    ("faster than megablox at MaxText's tiles", "pass_mb512"),
    ("faster than megablox at its best tiling", "pass_mbbest"),
    ("ours <= 1.10 x achievable bound of the rows present", "pass_bound"),
  ):
    for impl in dict.fromkeys(t["impl"] for t in rows):
      vals = [t[col] for t in rows if t[col] is not None and t["impl"] == impl]
      summary.append(f"{impl}, {name}: {sum(vals)} of {len(vals)} pass")
  sep = "\n\n" if markdown else "\n"
  return text + sep + ("\n".join(f"- {s}" for s in summary) if markdown else "\n".join(summary))


# ----------------------------------------------------------------------------------------------
# The MoE block's gmm calls per layer.
#
# NOTE: `moe.expert_mlp` makes two differentiable gmm calls per layer: up = gmm(rows [B, d],
# wi [E_l, d, 2f]) (gate and up fused) and down = gmm(swiglu [B, f], wo [E_l, f, d]). In the
# backward each runs dlhs (gmm with the transposed weights) and drhs (tgmm): six kernels per
# layer, two forward and four backward, all on the B = buffer_rows receive buffer.

BLOCK_CONFIGS: tuple[tuple[str, int], ...] = (
  ("deepseek-v2-lite", 8),
  ("deepseek-v3", 32),
  ("deepseek-v3", 64),
)
PROJECTIONS = ("up", "down")


def block_cases(cases):
  """The block's two projections of each EP case.

  Args:
    cases: [(EpShape, routing, group_sizes)] (k = d_model, n = expert ffn f).

  Returns:
    [(shape, routing, group_sizes)]: per case "up" (k = d, n = 2f) then "down" (k = f, n = d);
    the shape's name is "<model>/<projection>".
  """
  out = []
  for s, routing, gs in cases:
    d, f = s.k, s.n
    for proj, (k, n) in zip(PROJECTIONS, ((d, 2 * f), (f, d)), strict=True):
      out.append((dataclasses.replace(s, name=f"{s.name}/{proj}", k=k, n=n), routing, gs))
  return out


def block_totals(records: list[dict]) -> list[dict]:
  """Σ of the six kernels (up and down × fwd, dlhs, drhs) per (case, impl, chip).

  Args:
    records: bench records of `block_cases` (all three ops).

  Returns:
    Rows: model, ep, tokens, policy, routing, chip, impl, slack, fwd_us, bwd_us, total_us,
    kernels (how many of the six were modeled).
  """
  acc: dict[tuple, dict] = {}
  for r in records:
    model = r["model"].split("/")[0]
    key = (model, r["ep"], r["tokens"], r["policy"], r["routing"], r["chip"], r["impl"])
    row = acc.setdefault(
      key,
      dict(
        model=model,
        ep=r["ep"],
        tokens=r["tokens"],
        policy=r["policy"],
        routing=r["routing"],
        chip=r["chip"],
        impl=r["impl"],
        buffer_rows=r["buffer_rows"],
        rows=r["rows"],
        slack=r["slack"],
        fwd_us=0.0,
        bwd_us=0.0,
        kernels=0,
      ),
    )
    row["fwd_us" if r["op"] == "fwd" else "bwd_us"] += r["modeled_us"]
    row["kernels"] += 1
  for row in acc.values():
    row["total_us"] = row["fwd_us"] + row["bwd_us"]
  return list(acc.values())


_BLOCK_COLUMNS = (
  "case",
  "policy",
  "routing",
  "chip",
  "buffer",
  "rows",
  "slack",
  "impl",
  "fwd µs",
  "bwd µs",
  "total µs",
  "vs exact",
)


def block_table(rows: list[dict], *, markdown: bool) -> str:
  """Formats `block_totals` rows; `vs exact` = total / the same impl's total under "exact".

  Args:
    rows: from `block_totals`.
    markdown: a markdown table instead of aligned text.

  Returns:
    The text.
  """
  exact = {
    (r["model"], r["ep"], r["tokens"], r["routing"], r["chip"], r["impl"]): r["total_us"]
    for r in rows
    if r["policy"] == "exact"
  }
  body = []
  for r in rows:
    ref = exact.get((r["model"], r["ep"], r["tokens"], r["routing"], r["chip"], r["impl"]))
    body.append(
      [
        f"{r['model']}@{r['tokens']}/ep{r['ep']}",
        r["policy"],
        r["routing"],
        r["chip"],
        f"{r['buffer_rows']:,}",
        f"{r['rows']:,}",
        _fmt(r["slack"], 2),
        r["impl"] + ("" if r["kernels"] == 6 else f" ({r['kernels']}/6 kernels)"),
        _fmt(r["fwd_us"]),
        _fmt(r["bwd_us"]),
        _fmt(r["total_us"]),
        _fmt(r["total_us"] / ref if ref else None, 2),
      ]
    )
  title = "MoE block, gmm kernels per layer (up, down x fwd, dlhs, drhs), modeled"
  return format_table(title, _BLOCK_COLUMNS, body, markdown=markdown)


def slack_table(records: list[dict], *, markdown: bool) -> str:
  """One row per (case, routing, op, chip): ours per buffer policy (µs, slack), and the
  references under the exact policy (megablox and tokamax visit only the active m-tiles, so the
  buffer policy changes their time only through the rows a capacity factor drops).

  Args:
    records: bench records of EP cases.
    markdown: a markdown table instead of aligned text.

  Returns:
    The text.
  """
  policies = list(dict.fromkeys(r["policy"] for r in records if "ep" in r))
  impls = list(dict.fromkeys(r["impl"] for r in records if "ep" in r))
  ours = [i for i in impls if i in OURS_VARIANTS]
  refs = [i for i in impls if i not in OURS_VARIANTS]
  by = {(r["impl"], *_case_key(r)): r for r in records if "ep" in r}
  keys = list(
    dict.fromkeys(
      (r["model"], r["ep"], r["tokens"], r["routing"], r["op"], r["chip"])
      for r in records
      if "ep" in r
    )
  )
  columns = ["case", "routing", "op", "chip"]
  columns += [f"{o} {p}" for o in ours for p in policies] + [f"{i} (exact)" for i in refs]
  body = []
  for model, ep, tokens, routing, op, chip in keys:
    row = [f"{model}@{tokens}/ep{ep}", routing, op, chip]
    for o in ours:
      for p in policies:
        r = by.get((o, model, ep, tokens, p, routing, op, chip))
        row.append(f"{r['modeled_us']:,.0f} ({r['slack']:.2f}x)" if r else "-")
    for i in refs:
      r = by.get((i, model, ep, tokens, "exact", routing, op, chip))
      row.append(_fmt(r["modeled_us"], 0) if r else "-")
    body.append(row)
  title = "EP cases: ours per buffer policy (µs, slack) and the references, modeled"
  return format_table(title, columns, body, markdown=markdown)


# ----------------------------------------------------------------------------------------------
# Rendering saved runs: `python -m bench.ep_report a.json b.json [--markdown F] [--plot F]`.
#
# NOTE: the full EP matrix takes about an hour on a 2-core VM; split runs (by op, impl or policy)
# write their records with `python -m bench ... --json`, and this puts the tables back together.


def merge_runs(runs: list[dict]) -> dict[str, list[dict]]:
  """Concatenates the record lists of several `python -m bench --json` outputs.

  Later runs win where two runs modeled the same (impl, case, op, chip).

  Args:
    runs: the loaded JSON objects.

  Returns:
    {"modeled": [...], "ep_slack1": [...], "block": [...]}.
  """
  out = {}
  for key in ("modeled", "ep_slack1", "block"):
    merged = {}
    for run in runs:
      for r in run.get(key, []):
        if "ep" in r:
          merged[(r["impl"], *_case_key(r))] = r
    out[key] = list(merged.values())
  return out


def render(merged: dict[str, list[dict]], *, markdown: bool) -> str:
  """The EP tables of merged runs: per-policy table, targets per variant of ours, block table.

  Args:
    merged: from `merge_runs`.
    markdown: markdown tables instead of aligned text.

  Returns:
    The text.
  """
  parts = []
  if merged["modeled"]:
    parts.append(slack_table(merged["modeled"], markdown=markdown))
  if merged["ep_slack1"]:
    rows = targets_of_ours(merged["modeled"], merged["ep_slack1"])
    parts.append(targets_table(rows, markdown=markdown))
  if merged["block"]:
    parts.append(block_table(block_totals(merged["block"]), markdown=markdown))
  return "\n\n".join(parts)


def main(argv=None) -> None:
  import argparse
  import json

  p = argparse.ArgumentParser(prog="python -m bench.ep_report", description=__doc__.splitlines()[0])
  p.add_argument("runs", nargs="+", help="JSON files written by `python -m bench --ep --json`.")
  p.add_argument("--markdown", help="Also write the tables as markdown here.")
  p.add_argument("--plot", help="Draw the EP records (time vs slack) here (matplotlib).")
  args = p.parse_args(argv)
  runs = []
  for path in args.runs:
    with open(path) as f:
      runs.append(json.load(f))
  merged = merge_runs(runs)
  print(render(merged, markdown=False))
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(render(merged, markdown=True) + "\n")
  if args.plot:
    from bench import plot

    plot.plot(merged["modeled"], path=args.plot)


if __name__ == "__main__":
  main()
