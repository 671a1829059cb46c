"""`python -m bench`: modeled TPU time of grouped matmuls (and measured time on a TPU).

For each shape / op / chip / implementation: modeled_us (bench.costmodel over the real
pallas_call schedule), roofline_us, achievable_us, modeled/achievable, modeled/roofline, MXU row
waste (executed / useful rows), HBM bytes / minimum, and the speedup of the modeled time against
upstream megablox at MaxText's tiles (x_mb512), at its default 128^3 tiles (x_mb128), and at its
best tiling (x_mbbest) on the same chip (> 1: faster than megablox). On a TPU
(jax.default_backend() == "tpu") cases for the local chip are also timed: warm-up, several runs,
median, TFLOP/s, % of peak.

megablox-best is the fastest modeled megablox tiling of tm, tk, tn in {128, 256, 512, 1024, full
dim} (tk, tn also tokamax's tuned sizes: 768, 1536, 1792, 2944, 3584, ...) whose VMEM estimate
(`tiling.vmem_estimate_bytes`) fits 7/8 of the chip's physical VMEM: the budget megablox reaches
only if its caller raises Mosaic's scoped limit (it passes no vmem_limit_bytes); the table "Against
megablox at its best tiling" says whether that tiling also fits the scoped default, and `--impls
megablox-best-scoped` searches within the scoped default. The search prunes with a lower bound of
the model (`impls.megablox_lower_bound_us`): all 48 cases take 2-3 minutes on one core (about 150
tilings modeled of 4,400 that fit).

Off TPU, a second small table gives the CPU wall time of interpret mode (ours vs megablox) on a
reduced shape (--interpret_shape; --nointerpret_table to skip it). It says nothing about TPU
speed; it is there to show both run, and what interpret-mode tests cost.

--memory prints, per shape, the temp bytes XLA reports (`compiled.memory_analysis()`) for an
AOT-compiled gmm training step (fwd + dlhs + drhs) on one device of --memory_chip (needs libtpu).

Example: python -m bench --chip v5e,v6e --ops fwd,dlhs,drhs --tokens native,4096 --json out.json

Expert parallelism (`bench.ep_cases`, `bench.ep_report`): `--ep` models one device's
gmm after dispatch (m = the receive buffer, `rows` of it real, E_l local experts) per model, ep,
tokens per device, buffer policy and routing, with ours, megablox at MaxText's tiles,
megablox-best and tokamax at its tuned tiles; `--targets` adds ours at slack 1 and prints
the EP targets with pass/fail; `--block` prints the MoE block's six gmm kernels per layer on
the DeepSeek EP cases; `--plot FILE.png` draws the records.

Decode (`bench.decode`): `--decode` models one device's expert work at 1-128 tokens per device
(`--decode_tokens`) against the weight-read floor, fixed costs included.
"""

from __future__ import annotations

import json
import os
import sys
import time

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  # libtpu is installed for AOT checks; without a TPU, don't let `import jax` probe for one.
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from bench import costmodel  # noqa: E402
from bench.impls import IMPLS, OPS, Unsupported  # noqa: E402
from bench.shapes import ROUTINGS, SHAPES, SMALL_BATCH_TOKENS, get_shape, group_sizes  # noqa: E402
from pallas_moe.tiling import current_generation, get_generation  # noqa: E402

_CHIP = flags.DEFINE_list("chip", ["v5e", "v6e"], "TPU generations to model.")
_TENSORCORES = flags.DEFINE_enum(
  "tensorcores",
  "kernel",
  list(costmodel.TENSORCORE_MODELS),
  "How the model counts TensorCores: 'kernel' one TensorCore's rates, split between a megacore "
  "device's two cores as Mosaic splits the kernel's grid (bench.costmodel, 5.; a tpu7x device "
  "is one TensorCore); 'chip' charges every kernel the whole chip's rates (2x optimistic on "
  "v5p and tpu7x against measured times).",
)
_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), f"Shapes: {', '.join(SHAPES)}.")
_OPS = flags.DEFINE_list("ops", list(OPS), "Ops: fwd, dlhs, drhs.")
# Default: ours (heuristic tiles) and upstream megablox at MaxText's, at its default, and at its
# best tiles. `pallas_moe-maxtext` (ours at MaxText's tiles) and `megablox-best-scoped` are
# registered too; select them with --impls.
DEFAULT_IMPLS = ["pallas_moe", "megablox-maxtext", "megablox-default", "megablox-best"]
_IMPLS = flags.DEFINE_list("impls", None, f"Implementations (default: {','.join(DEFAULT_IMPLS)}).")
_TOKENS = flags.DEFINE_list(
  "tokens",
  ["native", str(SMALL_BATCH_TOKENS)],
  f"Token counts: 'native' (the shape's own) and/or integers ({SMALL_BATCH_TOKENS} is the "
  "small-batch variant).",
)
_ROUTING = flags.DEFINE_list("routing", ["uniform"], f"Routings: {', '.join(ROUTINGS)}.")
_JSON = flags.DEFINE_string("json", None, "Write one JSON record per case here.")
_MARKDOWN = flags.DEFINE_string("markdown", None, "Write the tables as markdown here.")
_RUNS = flags.DEFINE_integer("runs", 10, "Timed runs per case on TPU (median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Warm-up runs per case on TPU.")
_INTERPRET_TABLE = flags.DEFINE_bool(
  "interpret_table", True, "Off TPU: time interpret mode (ours vs megablox) on a reduced shape."
)
_INTERPRET_SHAPE = flags.DEFINE_list(
  "interpret_shape", ["2048", "512", "256", "16"], "m, k, n, G of the interpret-mode table."
)
_INTERPRET_TILING = flags.DEFINE_list(
  "interpret_tiling", ["128", "128", "128"], "tm, tk, tn for both kernels in that table."
)
_MEMORY = flags.DEFINE_bool(
  "memory", False, "Print temp bytes of an AOT-compiled gmm training step per shape (libtpu)."
)
_MEMORY_CHIP = flags.DEFINE_string("memory_chip", "v5e", "Generation for --memory.")
# Expert-parallel cases (bench.ep_cases) and their tables (bench.ep_report).
_EP = flags.DEFINE_bool(
  "ep", False, "Model the EP cases (one device's receive buffer after dispatch), not --shapes."
)
_EP_MODELS = flags.DEFINE_list("ep_models", None, "EP: keep only these models (default: all).")
_EP_TOKENS = flags.DEFINE_list("ep_tokens", ["4096", "16384"], "EP: tokens per device.")
_EP_POLICIES = flags.DEFINE_list(
  "ep_policies", ["exact", "cf1.25", "cf2.0", "static"], "EP: buffer policies."
)
# NOTE: ours twice: gmm's default (the buffer's tail written with exact zeros) and what the MoE
# block runs (`unowned_rows="undefined"`: the tail is never written, as megablox leaves it).
EP_DEFAULT_IMPLS = ["pallas_moe", "pallas_moe-moe", "megablox-maxtext", "megablox-best", "tokamax"]
_TARGETS = flags.DEFINE_bool(
  "targets", False, "With --ep: also model ours at slack 1 and print the EP targets table."
)
_BLOCK = flags.DEFINE_bool(
  "block", False, "Print the MoE block's six gmm kernels per layer on the deepseek EP cases."
)
_BLOCK_IMPLS = flags.DEFINE_list(
  "block_impls",
  ["pallas_moe-moe", "megablox-maxtext"],
  "Implementations of the --block table (pallas_moe-moe: gmm as the block calls it).",
)
# Decode-size expert work per device against the weight-read floor (`bench.decode`).
_DECODE = flags.DEFINE_bool(
  "decode",
  False,
  "Model decode-size expert work (bench.decode): ours, megablox as MaxText calls it and "
  "tpu-inference's approach against the weight-read floor; --chip and --shapes narrow it when "
  "given, --json / --markdown write it.",
)
_DECODE_TOKENS = flags.DEFINE_list("decode_tokens", ["1", "8", "32", "128"], "--decode: T.")
_PLOT = flags.DEFINE_string(
  "plot",
  None,
  "Write a figure here (matplotlib, the `plot` extra): EP time vs slack, or "
  "modeled / achievable per impl for the dense cases.",
)


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _min_bytes(shape) -> int:
  """Each operand read once and the output written once (bf16): same for all three ops.

  NOTE: for an EP shape, of the rows actually present (`shape.rows`), not the whole buffer.
  """
  m, k, n, g = getattr(shape, "rows", shape.m), shape.k, shape.n, shape.num_groups
  return 2 * (m * k + m * n + g * k * n)


def _measure_us(fn, args, *, runs: int, warmup: int) -> float:
  """Median wall time of a jitted call on real (random) operands, in µs."""
  keys = iter(jax.random.split(jax.random.key(0), len(args)))
  real = []
  for a in args:
    if isinstance(a, jax.ShapeDtypeStruct):
      real.append(jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype))
    else:
      real.append(jnp.asarray(a))
  f = jax.jit(fn)
  for _ in range(warmup):
    jax.block_until_ready(f(*real))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*real))
    times.append(time.perf_counter() - t0)
  return float(np.median(times) * 1e6)


def run(*, chips, shape_names, ops, impl_names, tokens, routings, runs=10, warmup=3) -> list[dict]:
  """Models (and on TPU times) every case.

  Args:
    chips: generation names.
    shape_names: keys of `bench.shapes.SHAPES`.
    ops: subset of ("fwd", "dlhs", "drhs").
    impl_names: registry keys.
    tokens: "native" or token counts.
    routings: subset of ("uniform", "zipf").
    runs: timed runs on TPU.
    warmup: warm-up runs on TPU.

  Returns:
    One record (dict) per (impl, shape, routing, op, chip).
  """
  cases = []
  for s in shape_names:
    for t in tokens:
      shape = get_shape(s, tokens=None if t == "native" else int(t))
      cases.extend((shape, routing, group_sizes(shape, routing=routing)) for routing in routings)
  return run_cases(
    cases=cases, chips=chips, ops=ops, impl_names=impl_names, runs=runs, warmup=warmup
  )


def run_cases(*, cases, chips, ops, impl_names, runs=10, warmup=3) -> list[dict]:
  """Models (and on TPU times) every (shape, routing, group sizes) case.

  Args:
    cases: [(shape, routing, group_sizes)]; EP shapes (`bench.ep_cases.EpShape`) add their
      `record_fields()` to each record, and megablox/tokamax run on their buffer padded as
      `ep_cases.shape_for_impl` says.
    chips: generation names.
    ops: subset of ("fwd", "dlhs", "drhs").
    impl_names: registry keys.
    runs: timed runs on TPU.
    warmup: warm-up runs on TPU.

  Returns:
    One record (dict) per (impl, case, op, chip).
  """
  from bench.ep_cases import shape_for_impl

  gens = [get_generation(c) for c in chips]
  on_tpu = jax.default_backend() == "tpu"
  local = current_generation().name if on_tpu else None
  impls = []
  for name in impl_names:
    if name not in IMPLS:
      raise app.UsageError(f"unknown impl {name!r}; registered: {sorted(IMPLS)}")
    why = IMPLS[name].available()
    if why:
      _log(f"note: skipping impl {name}: {why}")
      continue
    impls.append(IMPLS[name])
  total = len(impls) * len(cases) * len(ops)
  records, done, cache = [], 0, {}
  t_start = time.time()
  for case_shape, routing, gs in cases:
    fields = case_shape.record_fields() if hasattr(case_shape, "record_fields") else {}
    for op in ops:
      for impl in impls:
        shape = shape_for_impl(case_shape, impl.name)
        done += 1
        for gen in gens:
          try:
            case = impl.build(op=op, shape=shape, group_sizes=gs, generation=gen)
          except Unsupported as e:
            _log(f"[{done}/{total}] {impl.name} {shape.label} {op}: skipped ({e})")
            break
          # NOTE: megablox's program depends on the tiles, not the chip; ours also on the chip
          # (MXU sub-block rows, VMEM limit and check), so it is analyzed per generation.
          key = (
            impl.name,
            shape.label,
            routing,
            op,
            tuple(case.tiling),
            gen.name if impl.program_depends_on_generation else None,
          )
          if key not in cache and case.schedules is not None:
            # NOTE: a tiling search (megablox-best) already analyzed its pick.
            cache[key] = list(case.schedules)
            _log(
              f"[{done}/{total}] {impl.name} {shape.label}/{routing} {op} on {gen.name}: "
              f"tiling={case.tiling} {case.extra} (elapsed {time.time() - t_start:.0f}s)"
            )
          if key not in cache:
            t0 = time.time()
            try:
              cache[key] = costmodel.analyze(
                case.fn,
                *case.args,
                step_scale=case.step_scale,
                step_manual_bytes=case.step_manual_bytes,
              )
            except ValueError as e:
              if "VMEM" not in str(e):
                raise
              _log(
                f"[{done}/{total}] {impl.name} {shape.label} {op} on {gen.name}: refused "
                f"({str(e)[:120]}...)"
              )
              continue
            steps = sum(s.steps for s in cache[key])
            _log(
              f"[{done}/{total}] {impl.name} {shape.label}/{routing} {op} "
              f"tiling={case.tiling}: {steps} grid steps, analyzed in "
              f"{time.time() - t0:.1f}s (elapsed {time.time() - t_start:.0f}s)"
            )
          rep = costmodel.cost(
            cache[key],
            generation=gen,
            row_macs=case.row_macs(gen.mxu_size) if case.row_macs else None,
            mxu_rows_useful=int(gs.sum()),
            useful_row_macs=shape.k * shape.n,
            floor_rows_count=costmodel.op_floor_rows(gs, generation=gen, op=op),
            min_hbm_bytes=_min_bytes(shape),
          )
          measured = tflops = pct = None
          if on_tpu and gen.name == local:
            measured = _measure_us(case.fn, case.args, runs=runs, warmup=warmup)
            tflops = 2 * int(gs.sum()) * shape.k * shape.n / (measured * 1e-6) / 1e12
            pct = 100 * tflops * 1e12 / gen.peak_bf16_flops
          records.append(
            dict(
              impl=impl.name,
              shape=shape.label,
              model=shape.name,
              tokens=shape.tokens,
              routing=routing,
              op=op,
              chip=gen.name,
              m=shape.m,
              tiling=list(case.tiling),
              kernel=case.kernel,
              modeled_us=rep.modeled_us,
              roofline_us=rep.roofline_us,
              achievable_us=rep.achievable_us,
              mxu_rows_executed=rep.mxu_rows_executed,
              mxu_rows_useful=rep.mxu_rows_useful,
              hbm_bytes=rep.hbm_bytes,
              min_hbm_bytes=rep.min_hbm_bytes,
              measured_us=measured,
              measured_tflops=tflops,
              measured_pct_peak=pct,
              steps=sum(c.steps for c in rep.calls),
              mxu_us=sum(c.mxu_us for c in rep.calls),
              dma_us=sum(c.dma_us for c in rep.calls),
              notes=sorted({n for c in rep.calls for n in c.notes}),
              **fields,
              **case.extra,
            )
          )
  _add_speedups(records)
  _log(f"done: {len(records)} records in {time.time() - t_start:.0f}s")
  return records


# Speedup columns: modeled time of these references / the row's modeled time, same chip.
SPEEDUP_REFS = {
  "x_mb512": "megablox-maxtext",
  "x_mb128": "megablox-default",
  "x_mbbest": "megablox-best",
}
MBBEST = "megablox-best"


def _add_speedups(records: list[dict]) -> None:
  """Adds `speedup_vs` {column: ref modeled / this modeled (or None)} to every record, and
  `mbbest_us` / `mbbest_tiling` (megablox-best's time and tiling on the same case and chip)."""
  by_case = {(r["impl"], r["shape"], r["routing"], r["op"], r["chip"]): r for r in records}
  for r in records:
    r["speedup_vs"] = {}
    for col, ref in SPEEDUP_REFS.items():
      t = by_case.get((ref, r["shape"], r["routing"], r["op"], r["chip"]))
      r["speedup_vs"][col] = (
        t["modeled_us"] / r["modeled_us"] if t and t["modeled_us"] and r["modeled_us"] else None
      )
    best = by_case.get((MBBEST, r["shape"], r["routing"], r["op"], r["chip"]))
    r["mbbest_us"] = best["modeled_us"] if best else None
    r["mbbest_tiling"] = best["tiling"] if best else None


_COLUMNS = (
  "chip",
  "impl",
  "tiling",
  "steps",
  "modeled_us",
  "roofline_us",
  "achievable_us",
  "mod/ach",
  "mod/roof",
  "x_mb512",
  "x_mb128",
  "x_mbbest",
  "row_waste",
  "hbm/min",
  "mxu_us",
  "dma_us",
  "measured_us",
  "%peak",
)


def _tiling_cell(r: dict) -> str:
  """tm x tk x tn; "(rs)" marks a row-tile kernel run with `rows_stationary` (out^T)."""
  mark = " (rs)" if r.get("kernel", "").endswith("rows-stationary") else ""
  return "x".join(map(str, r["tiling"])) + mark


def _row(r: dict) -> list[str]:
  f = lambda x, p=1: "-" if x is None else f"{x:,.{p}f}"
  waste = (
    r["mxu_rows_executed"] / r["mxu_rows_useful"]
    if r["mxu_rows_executed"] is not None and r["mxu_rows_useful"]
    else None
  )
  ratio = r["modeled_us"] / r["achievable_us"] if r["achievable_us"] else None
  roof = r["modeled_us"] / r["roofline_us"] if r["roofline_us"] else None
  sp = r.get("speedup_vs", {})
  return [
    r["chip"],
    r["impl"],
    _tiling_cell(r),
    str(r["steps"]),
    f(r["modeled_us"]),
    f(r["roofline_us"]),
    f(r["achievable_us"]),
    f(ratio, 2),
    f(roof, 2),
    f(sp.get("x_mb512"), 2),
    f(sp.get("x_mb128"), 2),
    f(sp.get("x_mbbest"), 2),
    f(waste, 2),
    f(r["hbm_bytes"] / r["min_hbm_bytes"], 2),
    f(r["mxu_us"]),
    f(r["dma_us"]),
    f(r["measured_us"]),
    f(r["measured_pct_peak"]),
  ]


def tables(records: list[dict], *, markdown: bool) -> str:
  """Formats records as one table per (shape, routing, op).

  Args:
    records: from `run`.
    markdown: markdown tables instead of aligned text.

  Returns:
    The text.
  """
  out = []
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r["shape"], r["routing"], r["op"]), []).append(r)
  for (shape, routing, op), rs in groups.items():
    rows = [_row(r) for r in rs]
    title = f"{shape} ({routing} routing) {op}"
    if markdown:
      out.append(f"### {title}\n")
      out.append("| " + " | ".join(_COLUMNS) + " |")
      out.append("|" + "---|" * len(_COLUMNS))
      out.extend("| " + " | ".join(row) + " |" for row in rows)
    else:
      widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
      out.append(f"== {title}")
      out.append("  ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths, strict=True)))
      out.extend("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in rows)
    out.append("")
  return "\n".join(out)


_MBBEST_COLUMNS = (
  "shape",
  "routing",
  "op",
  "chip",
  "impl",
  "µs",
  "tiling",
  "mbbest µs",
  "mbbest tiling",
  "mbbest scoped",
  "vs mbbest",
)


def mbbest_table(records: list[dict], *, markdown: bool) -> str:
  """One row per (case, chip) of each implementation against megablox at its best tiling.

  `vs mbbest` = megablox-best's modeled time / the implementation's (< 1: megablox is faster);
  `mbbest scoped`: whether megablox's best tiling fits the chip's scoped VMEM default (the
  search's budget is 7/8 of physical VMEM).

  Args:
    records: from `run`.
    markdown: a markdown table instead of aligned text.

  Returns:
    The text ("" without megablox-best records).
  """
  f = lambda x, p=1: "-" if x is None else f"{x:,.{p}f}"
  best = {(r["shape"], r["routing"], r["op"], r["chip"]): r for r in records if r["impl"] == MBBEST}
  rows = []
  for r in records:
    b = best.get((r["shape"], r["routing"], r["op"], r["chip"]))
    if b is None or r["impl"].startswith("megablox"):
      continue
    rows.append(
      [
        r["shape"],
        r["routing"],
        r["op"],
        r["chip"],
        r["impl"],
        f(r["modeled_us"]),
        _tiling_cell(r),
        f(b["modeled_us"]),
        "x".join(map(str, b["tiling"])),
        "yes" if b["grid_search"]["fits_scoped"] else "no",
        f(r["speedup_vs"]["x_mbbest"], 3),
      ]
    )
  if not rows:
    return ""
  title = (
    "Against megablox at its best tiling (tm, tk, tn in {128, 256, 512, 1024, full}; tk, tn "
    "also tokamax's tuned sizes)"
  )
  if markdown:
    out = [f"### {title}\n", "| " + " | ".join(_MBBEST_COLUMNS) + " |"]
    out.append("|" + "---|" * len(_MBBEST_COLUMNS))
    out.extend("| " + " | ".join(row) + " |" for row in rows)
  else:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_MBBEST_COLUMNS)]
    out = [f"== {title}"]
    out.append("  ".join(c.rjust(w) for c, w in zip(_MBBEST_COLUMNS, widths, strict=True)))
    out.extend("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in rows)
  return "\n".join(out) + "\n"


def _run_decode() -> None:
  from bench import decode

  decode.run(
    json_path=_JSON.value,
    markdown_path=_MARKDOWN.value,
    tokens=[int(t) for t in _DECODE_TOKENS.value],
    chips=_CHIP.value if _CHIP.present else decode.CHIPS,
    models=_SHAPES.value if _SHAPES.present else None,
    command="python -m bench " + " ".join(sys.argv[1:]),
    log=_log,
  )


def main(argv) -> None:
  del argv
  if _DECODE.value:
    _run_decode()
    return
  t_start = time.time()
  impl_names = _IMPLS.value or DEFAULT_IMPLS
  # NOTE: the cost model compiles many small XLA:CPU programs (schedules, vmapped index maps);
  # without most optimizations they compile ~30% faster and compute the same integers.
  jax.config.update("jax_disable_most_optimizations", True)
  extra_text, extra_md, out = [], [], {}
  common = dict(chips=_CHIP.value, ops=_OPS.value, runs=_RUNS.value, warmup=_WARMUP.value)
  if _EP.value or _BLOCK.value:
    from bench import ep_cases, ep_report

    # NOTE: EP cases default to both routings (uniform and Zipf); --routing narrows them.
    routings = _ROUTING.value if _ROUTING.present else list(ROUTINGS)
    selection = dict(
      tokens=[int(t) for t in _EP_TOKENS.value],
      policies=_EP_POLICIES.value,
      routings=routings,
      models=_EP_MODELS.value,
    )
  if _EP.value:
    cases = ep_cases.ep_cases(**selection)
    records = run_cases(cases=cases, impl_names=_IMPLS.value or EP_DEFAULT_IMPLS, **common)
    extra_text.append(ep_report.slack_table(records, markdown=False))
    extra_md.append(ep_report.slack_table(records, markdown=True))
    if _TARGETS.value:
      ours = ep_report.ours_in(records)
      _log(f"targets: {', '.join(ours)} at slack 1")
      slack1 = run_cases(cases=ep_report.slack1_cases(cases), impl_names=ours, **common)
      out["ep_slack1"] = slack1
      rows = ep_report.targets_of_ours(records, slack1)
      out["ep_targets"] = rows
      extra_text.append(ep_report.targets_table(rows, markdown=False))
      extra_md.append(ep_report.targets_table(rows, markdown=True))
  elif _BLOCK.value:
    records = []  # NOTE: --block alone prints only the block table.
  else:
    records = run(
      shape_names=_SHAPES.value,
      impl_names=impl_names,
      tokens=_TOKENS.value,
      routings=_ROUTING.value,
      **common,
    )
  if _BLOCK.value:
    configs = ep_report.BLOCK_CONFIGS
    cases = ep_cases.ep_cases(**{**selection, "configs": configs})
    block = run_cases(
      cases=ep_report.block_cases(cases),
      impl_names=_BLOCK_IMPLS.value,
      **{**common, "ops": ["fwd", "dlhs", "drhs"]},
    )
    totals = ep_report.block_totals(block)
    out["block"], out["block_totals"] = block, totals
    extra_text.append(ep_report.block_table(totals, markdown=False))
    extra_md.append(ep_report.block_table(totals, markdown=True))
  jax.config.update("jax_disable_most_optimizations", False)
  out["modeled"] = records
  text, md = [tables(records, markdown=False)], [tables(records, markdown=True)]
  if any(r["impl"] == MBBEST for r in records):
    text.append(mbbest_table(records, markdown=False))
    md.append(mbbest_table(records, markdown=True))
  text.extend(extra_text)
  md.extend(extra_md)
  if _INTERPRET_TABLE.value and jax.default_backend() != "tpu" and not (_EP.value or _BLOCK.value):
    from bench import interpret_time

    m, k, n, g = map(int, _INTERPRET_SHAPE.value)
    til = tuple(map(int, _INTERPRET_TILING.value))
    t0 = time.time()
    recs = interpret_time.interpret_walltime(m=m, k=k, n=n, num_groups=g, tiling=til)
    _log(f"interpret-mode table in {time.time() - t0:.0f}s")
    out["interpret_cpu"] = recs
    text.append(interpret_time.table(recs, markdown=False))
    md.append(interpret_time.table(recs, markdown=True))
  if _MEMORY.value:
    from bench import aot_memory

    recs = []
    for s in _SHAPES.value:
      t0 = time.time()
      recs.append(aot_memory.training_step_memory(get_shape(s), generation=_MEMORY_CHIP.value))
      _log(f"memory analysis {s} in {time.time() - t0:.0f}s")
    out["aot_memory"] = recs
    text.append(aot_memory.table(recs, markdown=False))
    md.append(aot_memory.table(recs, markdown=True))
  print("\n".join(text))
  if _PLOT.value:
    from bench import plot

    plot.plot(records, path=_PLOT.value)
    _log(f"wrote {_PLOT.value}")
  _log(f"bench total {time.time() - t_start:.0f}s")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(out, f, indent=1)
  if _MARKDOWN.value:
    with open(_MARKDOWN.value, "w") as f:
      f.write("\n".join(md))


def _main(argv) -> None:
  with costmodel.use_tensorcores(_TENSORCORES.value):
    main(argv)


if __name__ == "__main__":
  app.run(_main)
