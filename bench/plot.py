"""`python -m bench --plot FILE.png`: the bench's records as a figure (matplotlib, `plot` extra).

EP records (`--ep`): modeled time against slack (buffer_rows / rows) per implementation, one
panel per (case, op, chip), one line per (implementation, routing) through its buffer policies.
Dense records: modeled / achievable bound per implementation, one panel per chip.
All figures are modeled TPU time (`bench.costmodel`), not measurements.
"""

from __future__ import annotations

__all__ = ["plot"]

_STYLES = {"uniform": "-", "zipf": "--"}


def _split(records: list[dict]) -> tuple[list[dict], list[dict]]:
  ep = [r for r in records if "ep" in r]
  return ep, [r for r in records if "ep" not in r]


def _plot_ep(records: list[dict], *, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  cases = list(dict.fromkeys(f"{r['model']}@{r['tokens']}/ep{r['ep']}" for r in records))
  cols = list(dict.fromkeys((r["op"], r["chip"]) for r in records))
  impls = list(dict.fromkeys(r["impl"] for r in records))
  colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
  fig, axes = plt.subplots(
    len(cases),
    len(cols),
    figsize=(max(8.0, 3.2 * len(cols)), 2.6 * len(cases) + 1.0),
    squeeze=False,
    constrained_layout=True,
  )
  lines: dict[tuple, list[tuple[float, float, str]]] = {}
  for r in records:
    key = (f"{r['model']}@{r['tokens']}/ep{r['ep']}", r["op"], r["chip"], r["impl"], r["routing"])
    lines.setdefault(key, []).append((r["slack"], r["modeled_us"], r["policy"]))
  for (case, op, chip, impl, routing), pts in lines.items():
    ax = axes[cases.index(case), cols.index((op, chip))]
    pts.sort()
    ax.plot(
      [p[0] for p in pts],
      [p[1] for p in pts],
      _STYLES.get(routing, ":"),
      marker="o",
      markersize=3,
      color=colors[impl],
      label=f"{impl} ({routing})",
    )
  for i, case in enumerate(cases):
    for j, (op, chip) in enumerate(cols):
      ax = axes[i, j]
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
      ax.set_title(f"{case} {op} {chip}", fontsize=8)
      ax.tick_params(labelsize=7)
      if i == len(cases) - 1:
        ax.set_xlabel("slack = buffer_rows / rows", fontsize=7)
      if j == 0:
        ax.set_ylabel("modeled µs", fontsize=7)
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
  fig.suptitle("EP cases: modeled TPU time vs buffer slack (cost model)", fontsize=10)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _plot_dense(records: list[dict], *, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  chips = list(dict.fromkeys(r["chip"] for r in records))
  impls = list(dict.fromkeys(r["impl"] for r in records))
  cases = list(dict.fromkeys(f"{r['shape']} {r['routing'][:4]} {r['op']}" for r in records))
  fig, axes = plt.subplots(
    len(chips),
    1,
    figsize=(max(8, 0.45 * len(cases) * len(impls) / 2), 4 * len(chips)),
    squeeze=False,
    constrained_layout=True,
  )
  width = 0.8 / len(impls)
  for ci, chip in enumerate(chips):
    ax = axes[ci, 0]
    for ii, impl in enumerate(impls):
      ys = []
      for c in cases:
        r = next(
          (
            r
            for r in records
            if r["chip"] == chip
            and r["impl"] == impl
            and f"{r['shape']} {r['routing'][:4]} {r['op']}" == c
          ),
          None,
        )
        ys.append(r["modeled_us"] / r["achievable_us"] if r and r["achievable_us"] else np.nan)
      ax.bar(np.arange(len(cases)) + ii * width, ys, width, label=impl, color=f"C{ii}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(1.10, color="k", linewidth=0.6, linestyle=":")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
    ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("modeled / achievable bound")
    ax.set_title(f"{chip}: modeled / achievable bound per implementation (cost model, no TPU)")
    ax.legend(fontsize=7, ncol=len(impls))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot(records: list[dict], *, path: str) -> None:
  """Writes the figure for a bench run.

  Args:
    records: `bench.__main__.run` / `run_cases` records.
    path: output file (.png, .svg, ...). With both EP and dense records, EP goes to `path` and
      dense to `<stem>-dense<suffix>`.
  """
  ep, dense = _split(records)
  if ep:
    _plot_ep(ep, path=path)
  if dense:
    if ep:
      stem, dot, suffix = path.rpartition(".")
      path = f"{stem}-dense.{suffix}" if dot else f"{path}-dense"
    _plot_dense(dense, path=path)
