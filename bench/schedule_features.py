"""`python -m bench.schedule_features`: what each optional schedule feature of the row-tile
kernels gains in the cost model (bench/results/schedule-features.md).

For every bench case (the standard `python -m bench` set and the `--ep` set), the modeled time
with the feature on (as the kernels run today) and off, and gain = (off - on) / off. A feature is
switched off by replacing the helper that turns it on, in every loaded `pallas_moe` / `bench`
module that holds it (the kernels, `pallas_moe.ops`, the picker, `schedule_cost` and the bench's
cost-model hooks all read the same helpers):

- pass_cuts: `metadata.uses_pass_cuts` -> False (fixed m-tiles; `rowtile_pass_cuts_pay` and the
  picker then never cut);
- merge_tail: `metadata.merge_tail_rows` -> 0 (sub_m-row passes only);
- rows_stationary: `schedule_cost.rows_stationary_pays` -> False (the usual orientation);
  rows_stationary+granule also drops `generations.pass_granule`'s tn rule (gmm keeps MXU-edge
  passes where tn is not a multiple of the MXU edge, only for rows_stationary's sake);
- sequential_sweeps: `generations.sequential_sweeps` -> False (DMAs do not cross sweeps).

"off" re-picks the tiles as the picker would without the feature (what removing it would run);
"off@same" keeps the tiles picked with the feature on.

Engines: "bench" is `python -m bench`'s model (`bench.costmodel.analyze` over the real
pallas_call, with the row-tile hooks: the `modeled_us` of `python -m bench --json`), 2-30 s a
case on one core; "closed" (the default) is the closed form the picker scores with
(`schedule_cost.rowtile_modeled_seconds`, same accounting) at the tiles and pass-cut choice the
bench's build resolves, about 30x faster. `--engine_check` shows the two agree; `--llo` compiles
the largest gains with the feature on and off (`bench.llo`; needs libtpu).

Example: python -m bench.schedule_features --out_json /tmp/f.json --out_markdown /tmp/f.md
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from bench import __main__ as _bench_main  # noqa: E402,F401  (its flags: defined once)
from bench.shapes import SHAPES, SMALL_BATCH_TOKENS, get_shape, group_sizes  # noqa: E402

_DENSE_ENGINE = flags.DEFINE_enum("dense_engine", "closed", ["bench", "closed"], "Dense cases.")
_EP_ENGINE = flags.DEFINE_enum("ep_engine", "closed", ["bench", "closed"], "EP cases.")
_CHIPS = flags.DEFINE_list("chips", ["v5e", "v6e"], "Generations (python -m bench's default).")
_FEATURES = flags.DEFINE_list("features", None, "Features (default: all).")
_SETS = flags.DEFINE_list("sets", ["dense", "ep"], "Case sets: dense, ep.")
_EP_MODELS = flags.DEFINE_list("feature_ep_models", None, "EP: keep only these models.")
_EP_CONFIGS = flags.DEFINE_list(
  "feature_ep_configs", None, "EP: keep only these model:ep configs (e.g. deepseek-v3:32)."
)
_MERGE = flags.DEFINE_list(
  "merge_json", None, "Only tabulate these --out_json files (runs split by --sets / models)."
)
_LLO = flags.DEFINE_bool(
  "llo", False, "Only run the compiled-schedule checks (LLO_CHECKS; needs libtpu: .venv-new)."
)
_ENGINE_CHECK = flags.DEFINE_bool(
  "engine_check", False, "Only compare the bench model and the closed form (ENGINE_CHECKS)."
)
_JSON = flags.DEFINE_string("out_json", None, "Write the records here.")
_MARKDOWN = flags.DEFINE_string("out_markdown", None, "Write the tables here.")

OPS = ("fwd", "dlhs", "drhs")
DENSE_IMPLS = ("pallas_moe",)
EP_IMPLS = ("pallas_moe", "pallas_moe-moe")


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _switches() -> dict[str, list[tuple[str, object]]]:
  """feature -> [(helper name, replacement)]."""
  from pallas_moe import generations

  orig_granule = generations.pass_granule

  def granule_without_tn(generation, *, kind, tn=None):
    del tn
    return orig_granule(generation, kind=kind)

  rs = [("rows_stationary_pays", lambda **kw: False)]
  return {
    "pass_cuts": [("uses_pass_cuts", lambda **kw: False)],
    "merge_tail": [("merge_tail_rows", lambda **kw: 0)],
    "rows_stationary": rs,
    "rows_stationary+granule": rs + [("pass_granule", granule_without_tn)],
    "sequential_sweeps": [("sequential_sweeps", lambda *a, **kw: False)],
  }


def _import_all() -> None:
  """Imports every pallas_moe module (and the bench's model modules) before a switch: a module
  first imported while a helper is replaced would keep the replacement."""
  import importlib
  import pkgutil

  import pallas_moe

  for info in pkgutil.iter_modules(pallas_moe.__path__):
    try:
      importlib.import_module(f"pallas_moe.{info.name}")
    except Exception:  # noqa: BLE001  (optional dependencies: a module we do not need)
      pass
  for name in ("bench.impls", "bench.costmodel", "bench.ep_cases", "bench.llo"):
    importlib.import_module(name)


def _clear_caches() -> None:
  from pallas_moe import tile_pickers

  tile_pickers.pick_rowtile_tiling.cache_clear()
  jax.clear_caches()


@contextlib.contextmanager
def feature_off(feature: str | None):
  """Switches `feature` off (None: nothing) in every loaded pallas_moe / bench module."""
  if feature is None:
    yield
    return
  _import_all()
  patched = []
  for name, new in _switches()[feature]:
    from pallas_moe import generations, metadata, schedule_cost

    orig = None
    for home in (metadata, schedule_cost, generations):
      if hasattr(home, name):
        orig = getattr(home, name)
        break
    if orig is None:
      raise AttributeError(f"no helper {name!r} to switch {feature} off")
    for mod in list(sys.modules.values()):
      modname = getattr(mod, "__name__", "")
      if not (modname.startswith("pallas_moe") or modname.startswith("bench")):
        continue
      if getattr(mod, name, None) is orig:
        setattr(mod, name, new)
        patched.append((mod, name, orig))
  _clear_caches()
  try:
    yield
  finally:
    for mod, name, orig in reversed(patched):
      setattr(mod, name, orig)
    _clear_caches()


def dense_cases():
  out = []
  for s in SHAPES:
    for t in ("native", str(SMALL_BATCH_TOKENS)):
      shape = get_shape(s, tokens=None if t == "native" else int(t))
      out.append((shape, "uniform", group_sizes(shape, routing="uniform")))
  return out


def ep_case_list(models=None, configs=None):
  from bench import ep_cases
  from bench.shapes import ROUTINGS

  kw = {}
  if configs:
    kw["configs"] = tuple((c.split(":")[0], int(c.split(":")[1])) for c in configs)
  return ep_cases.ep_cases(routings=list(ROUTINGS), models=models, **kw)


def _dims(op, shape):
  if op == "drhs":
    return "tgmm", shape.k, shape.n
  return ("gmm", shape.k, shape.n) if op == "fwd" else ("gmm", shape.n, shape.k)


def _closed_us(*, impl, op, shape, gs, gen, tiling, kernel) -> float | None:
  """`rowtile_modeled_seconds` at the tiles and pass-cut choice the bench's build runs."""
  import jax.numpy as jnp

  from pallas_moe import tiling as tiling_lib

  if not kernel.startswith("rowtile"):
    return None
  kind, dk, dn = _dims(op, shape)
  m = shape.m
  unowned = "undefined" if impl == "pallas_moe-moe" else "zero"
  expected = shape.tokens * shape.top_k if unowned == "undefined" else None
  hint = expected if expected is not None and expected < m else None
  tm, tk, tn = tiling
  kw = dict(
    group_sizes=np.asarray(gs, np.int64),
    k=dk,
    n=dn,
    tm=tm,
    tk=tk,
    tn=tn,
    kind=kind,
    lhs_itemsize=2,
    rhs_itemsize=2,
    out_itemsize=2,
    generation=gen,
    buffer_rows=m,
  )
  if kind == "gmm":
    bf = jnp.bfloat16
    cuts = tiling_lib.rowtile_pass_cuts_pay(
      m=m,
      k=dk,
      n=dn,
      num_groups=shape.num_groups,
      tiles=(tm, tk, tn),
      lhs_dtype=bf,
      rhs_dtype=bf,
      out_dtype=bf,
      generation=gen,
      expected_rows=hint,
      unowned_rows=unowned,
    )
    kw.update(unowned_rows=unowned, fixed_tiles=not cuts)
  else:
    kw.update(transpose_lhs=True)
  return tiling_lib.rowtile_modeled_seconds(**kw) * 1e6


def model_case(*, engine, impl, op, shape, routing, gs, chip, tiling=None) -> dict:
  """One record: modeled µs, tiles and kernel of `impl` on the case (tiles re-picked unless
  `tiling` is given)."""
  from bench import __main__ as bm
  from bench import impls
  from pallas_moe.generations import get_generation

  gen = get_generation(chip)
  if engine == "bench":
    impl_name = impl if tiling is None else _fixed_impl(impl, tiling)
    recs = bm.run_cases(
      cases=[(shape, routing, gs)], chips=[chip], ops=[op], impl_names=[impl_name]
    )
    if not recs:
      return dict(us=None, tiling=None, kernel="refused")
    r = recs[0]
    return dict(us=r["modeled_us"], tiling=list(r["tiling"]), kernel=r["kernel"])
  if tiling is not None:
    # NOTE: at tiles the row-tile kernel already ran with every feature on.
    til = list(tiling)
    us = _closed_us(impl=impl, op=op, shape=shape, gs=gs, gen=gen, tiling=til, kernel="rowtile")
    return dict(us=us, tiling=til, kernel="rowtile")
  case = impls.IMPLS[impl].build(op=op, shape=shape, group_sizes=gs, generation=gen)
  til = list(case.tiling)
  us = _closed_us(impl=impl, op=op, shape=shape, gs=gs, gen=gen, tiling=til, kernel=case.kernel)
  return dict(us=us, tiling=til, kernel=case.kernel)


def active_at(feature: str, *, impl: str, op: str, shape, chip: str, tiling) -> bool:
  """Whether `feature` changes the kernel at these tiles (with every feature on). Where it does
  not, its "off" time equals "on" at these tiles, and the picker (whose scores can only rise
  without a feature) keeps them up to its 0.25% VMEM tie-break."""
  import jax.numpy as jnp

  from pallas_moe import generations, metadata, schedule_cost
  from pallas_moe import tiling as tiling_lib

  gen = generations.get_generation(chip)
  kind, dk, dn = _dims(op, shape)
  tm, tk, tn = tiling
  sub = generations.pass_rows(tm, gen, kind=kind, tn=tn)
  rs = schedule_cost.rows_stationary_pays(kind=kind, sub_m=sub, tk=tk, tn=tn, generation=gen)
  if feature == "rows_stationary":
    return rs
  if feature == "rows_stationary+granule":
    # NOTE: the granule rule changes gmm's sub_m for any tn off the MXU edge: re-pick always.
    return rs or (kind == "gmm" and gen.mxu_size > generations.min_pass_rows(gen))
  if feature == "sequential_sweeps":
    return generations.sequential_sweeps(gen) and (dk // tk) * (dn // tn) > 1
  if kind != "gmm":
    return False
  align = schedule_cost.gmm_pass_align(sub_m=sub, tm=tm, lhs_itemsize=2, out_itemsize=2)
  if feature == "merge_tail":
    return metadata.merge_tail_rows(sub_m=sub, tm=tm, align=align, rows_stationary=rs) > 0
  if feature == "pass_cuts":
    unowned = "undefined" if impl == "pallas_moe-moe" else "zero"
    expected = shape.tokens * shape.top_k if unowned == "undefined" else None
    hint = expected if expected is not None and expected < shape.m else None
    bf = jnp.bfloat16
    return tiling_lib.rowtile_pass_cuts_pay(
      m=shape.m, k=dk, n=dn, num_groups=shape.num_groups, tiles=tuple(tiling), lhs_dtype=bf,
      rhs_dtype=bf, out_dtype=bf, generation=gen, expected_rows=hint, unowned_rows=unowned,
    )  # fmt: skip
  raise ValueError(feature)


# Re-pick the tiles without the feature where its gain at the "on" tiles exceeds this (the
# picker's search is the slow part; below it the re-picked gain cannot reach 2% unless the
# picker's draws and the case's routing disagree badly).
REPICK_ABOVE = 0.005


def run_set(*, cases, impl_names, chips, features, engine, label) -> list[dict]:
  """Feature-major (the picker's cache then serves every case of one switch state)."""
  records = []
  t0 = time.time()
  keys = [
    (shape, routing, gs, impl, op, chip)
    for shape, routing, gs in cases
    for impl in impl_names
    for op in OPS
    for chip in chips
  ]
  for i, (shape, routing, gs, impl, op, chip) in enumerate(keys):
    on = model_case(engine=engine, impl=impl, op=op, shape=shape, routing=routing, gs=gs, chip=chip)
    records.append(
      dict(
        set=label,
        engine=engine,
        impl=impl,
        case=getattr(shape, "label", shape.name),
        policy=getattr(shape, "policy", None),
        routing=routing,
        op=op,
        chip=chip,
        on_us=on["us"],
        on_tiling=on["tiling"],
        kernel=on["kernel"],
        off={},
      )
    )
    if i % 20 == 0:
      _log(f"[{label} on {i + 1}/{len(keys)}] ({time.time() - t0:.0f}s)")
  for f in features:
    act = []
    for key, rec in zip(keys, records, strict=True):
      if rec["on_us"] is None or not rec["kernel"].startswith("rowtile"):
        continue
      shape, routing, gs, impl, op, chip = key
      if active_at(f, impl=impl, op=op, shape=shape, chip=chip, tiling=rec["on_tiling"]):
        act.append((key, rec))
      else:
        rec["off"][f] = dict(us=rec["on_us"], tiling=rec["on_tiling"], same_us=rec["on_us"],
                             active=False, repicked=False)  # fmt: skip
    with feature_off(f):
      for j, (key, rec) in enumerate(act):
        shape, routing, gs, impl, op, chip = key
        common = dict(engine=engine, impl=impl, op=op, shape=shape, routing=routing, gs=gs)
        same = model_case(**common, chip=chip, tiling=rec["on_tiling"])["us"]
        g = gain(rec["on_us"], same)
        entry = dict(us=same, tiling=rec["on_tiling"], same_us=same, active=True, repicked=False)
        if engine == "bench" or g is None or g > REPICK_ABOVE or f == "rows_stationary+granule":
          off = model_case(**common, chip=chip)
          entry.update(us=off["us"], tiling=off["tiling"], kernel=off["kernel"], repicked=True)
        rec["off"][f] = entry
        if j % 20 == 0:
          _log(f"[{label} {f} {j + 1}/{len(act)}] ({time.time() - t0:.0f}s)")
    _log(f"[{label}] {f}: {len(act)} active of {len(records)} ({time.time() - t0:.0f}s)")
  return records


def gain(on, off):
  if on is None or off is None or not off:
    return None
  return (off - on) / off


def summary(records: list[dict], features, *, same: bool = False) -> list[dict]:
  """Per (set, feature): cases, active cases (gain != 0), max / median gain, the max case."""
  rows = []
  labels = sorted({r["set"] for r in records})
  for label in labels + (["all"] if len(labels) > 1 else []):
    rs = [r for r in records if label in ("all", r["set"])]
    for f in features:
      gains = []
      for r in rs:
        if f not in r["off"]:
          g = 0.0 if r["on_us"] is not None else None
        else:
          off = r["off"][f]["same_us" if same else "us"]
          g = gain(r["on_us"], off)
        if g is not None:
          gains.append((g, r))
      if not gains:
        continue
      vals = [g for g, _ in gains]
      gmax, rmax = max(gains, key=lambda x: x[0])
      active = [g for g in vals if abs(g) > 1e-12]
      rows.append(
        dict(
          set=label,
          feature=f,
          cases=len(vals),
          active=len(active),
          max_gain=gmax,
          median_gain=statistics.median(vals),
          median_active=statistics.median(active) if active else 0.0,
          min_gain=min(vals),
          over_2pct=sum(g >= 0.02 for g in vals),
          max_case=(
            f"{rmax['case']}/{rmax['routing']} {rmax['impl']} {rmax['op']} {rmax['chip']} "
            f"{'x'.join(map(str, rmax['on_tiling'] or []))}"
          ),
          verdict="keep" if gmax >= 0.02 else "remove",
        )
      )
  return rows


def _fixed_impl(impl: str, tiling) -> str:
  """Registers (once) `impl` at fixed tiles as a bench impl; returns its name."""
  from bench import impls

  name = f"_fixed_{impl}_{'x'.join(map(str, tiling))}"
  if name not in impls.IMPLS:
    unowned = "undefined" if impl == "pallas_moe-moe" else "zero"
    impls.register(
      impls.Impl(
        name=name,
        build=impls._pallas_moe_build(tuple(tiling), unowned_rows=unowned),
        available=impls._pallas_moe_available,
        tiling_depends_on_generation=True,
        program_depends_on_generation=True,
      )
    )
  return name


def _llo_compile(spec: dict) -> None:
  """Subprocess side of `llo_case`: compiles with the feature off (libtpu dump flags set)."""
  from bench import llo

  spec = dict(spec)
  feature = spec.pop("feature")
  impl, tiling = spec.pop("base_impl"), spec.pop("fixed_tiling")
  spec["impl"] = _fixed_impl(impl, tiling)
  if isinstance(spec["shape"], dict) and "ep" in spec["shape"]:
    from bench.ep_cases import EpShape

    spec["shape"] = EpShape(**spec["shape"])
  with feature_off(feature):
    llo._compile_in_this_process(spec)


def llo_case(*, feature, impl, shape, tokens, op, chip, tiling, cache_dir, group_sizes=None):
  """`bench.llo.analyze_case` of a dense case at fixed tiles with `feature` off (None: on): the
  compiled bundle counts x the kernel's trip counts. Needs libtpu (the .venv-new env)."""
  import subprocess

  from bench import llo

  name = _fixed_impl(impl, tiling)

  def compile_dump(*, impl, op, shape, generation, tokens=None, dump_dir, tiling=None, **kw):
    done = os.path.join(dump_dir, "compiled.ok")
    if os.path.exists(done):
      return dump_dir
    os.makedirs(dump_dir, exist_ok=True)
    if not isinstance(shape, str):
      import dataclasses

      shape = dataclasses.asdict(shape)
    spec = dict(impl=impl, op=op, shape=shape, tokens=tokens, generation=generation)
    spec.update(feature=feature, base_impl=base, fixed_tiling=list(fixed))
    env = dict(os.environ)
    env.update(
      JAX_PLATFORMS="cpu",
      ALLOW_MULTIPLE_LIBTPU_LOAD="1",
      LIBTPU_INIT_ARGS=env.get("LIBTPU_INIT_ARGS", "") + " " + llo.DUMP_FLAGS.format(dir=dump_dir),
    )
    proc = subprocess.run(
      [sys.executable, "-m", "bench.schedule_features", "--_llo_compile", json.dumps(spec)],
      env=env,
      capture_output=True,
      text=True,
      timeout=1200,
      check=False,
    )
    if proc.returncode:
      raise RuntimeError(f"compile of {spec} failed:\n{proc.stderr[-3000:]}")
    with open(done, "w") as f:
      f.write(json.dumps(spec) + "\n")
    return dump_dir

  base, fixed = impl, tiling
  orig = llo.compile_dump
  llo.compile_dump = compile_dump
  try:
    with feature_off(feature):
      return llo.analyze_case(
        impl=name,
        op=op,
        shape=shape,
        generation=chip,
        tokens=tokens,
        cache_dir=os.path.join(cache_dir, feature or "on"),
        group_sizes=group_sizes,
      )
  finally:
    llo.compile_dump = orig


def feature_tables(records: list[dict], features) -> str:
  """One table per feature: per case set, the gain with the tiles re-picked without it ("off")
  and at the tiles picked with it ("off@same"); the verdict under the 2% rule on the re-picked
  gain (the kernels as they would run without the feature)."""
  repick = {(r["set"], r["feature"]): r for r in summary(records, features)}
  same = {(r["set"], r["feature"]): r for r in summary(records, features, same=True)}
  cols = ("set", "cases", "active", "≥2%", "max gain", "median", "median (active)", "min",
          "max @same", "median @same", "max-gain case", "verdict")  # fmt: skip
  out = []
  pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
  for f in features:
    out += [f"#### {f}\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (label, feat), r in repick.items():
      if feat != f:
        continue
      s = same[(label, feat)]
      out.append(
        "| " + " | ".join([
          label, str(r["cases"]), str(r["active"]), str(r["over_2pct"]), pct(r["max_gain"]),
          pct(r["median_gain"]), pct(r["median_active"]), pct(r["min_gain"]), pct(s["max_gain"]),
          pct(s["median_gain"]), r["max_case"], r["verdict"],
        ]) + " |"
      )  # fmt: skip
    out.append("")
  return "\n".join(out)


# (feature, case, impl, op, chip, tiles): a dense case is (shape, tokens), an EP case (model, ep,
# tokens, policy, routing). The features' largest modeled gains.
LLO_CHECKS = (
  ("merge_tail", ("deepseek-v2-lite", 4096), "pallas_moe", "fwd", "v5e", (3072, 2048, 1408)),
  ("rows_stationary", ("deepseek-v2-lite", 16384), "pallas_moe", "drhs", "v6e", (4096, 2048, 1408)),
  ("rows_stationary", ("deepseek-v2-lite", 16384), "pallas_moe", "fwd", "v6e", (6144, 2048, 1408)),
  ("pass_cuts", ("deepseek-v2-lite", 16384), "pallas_moe", "fwd", "v6e", (6144, 2048, 1408)),
  ("sequential_sweeps", ("mixtral-8x7b", 4096), "pallas_moe", "drhs", "v6e", (4096, 2048, 2048)),
)  # fmt: skip
ENGINE_CHECKS = (
  ("pass_cuts", ("deepseek-v2-lite", 8, 4096, "cf1.25", "uniform"), "pallas_moe", "fwd", "v6e",
   (3072, 2048, 1408)),
  ("merge_tail", ("deepseek-v2-lite", 8, 4096, "exact", "uniform"), "pallas_moe", "dlhs", "v5e",
   (1792, 1408, 2048)),
  ("rows_stationary", ("deepseek-v2-lite", 8, 16384, "cf1.25", "zipf"), "pallas_moe-moe", "fwd",
   "v6e", (6144, 2048, 1408)),
  ("sequential_sweeps", ("mixtral-8x7b", 8, 4096, "cf1.25", "zipf"), "pallas_moe", "drhs", "v6e",
   (2048, 2048, 3584)),
)  # fmt: skip


def _check_case(case):
  """(shape, routing, group sizes, tokens for bench.llo) of a check's case."""
  from bench import ep_cases

  if len(case) == 2:
    shape = get_shape(case[0], tokens=case[1])
    return shape, "uniform", group_sizes(shape), case[1]
  model, ep, tokens, policy, routing = case
  shape, gs = ep_cases.ep_case(model=model, ep=ep, tokens=tokens, policy=policy, routing=routing)
  return shape, routing, gs, None


def run_llo_checks(cache_dir: str) -> str:
  """`bench.llo` on LLO_CHECKS, feature on and off at the same tiles: a markdown table."""
  out = [
    "| feature | case | program bundles on / off | issue cycles on / off | MXU cycles on / off "
    "| bound cycles on / off | model µs on / off | restated µs on / off |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for feature, case, impl, op, chip, tiles in LLO_CHECKS:
    shape, routing, gs, tokens = _check_case(case)
    label = f"{shape.label}/{routing} {impl} {op} {chip} {'x'.join(map(str, tiles))}"
    reps = {}
    for f in (None, feature):
      reps[f] = llo_case(
        feature=f,
        impl=impl,
        shape=shape.name if tokens else shape,
        tokens=tokens,
        op=op,
        chip=chip,
        tiling=list(tiles),
        cache_dir=os.path.join(cache_dir, label.replace("/", "-").replace(" ", "-")),
        group_sizes=None if tokens else gs,
      )[0]
    on, off = reps[None], reps[feature]

    def cell(a, b, fmt="{:,.0f}"):
      g = (b - a) / b if b else 0.0
      return f"{fmt.format(a)} / {fmt.format(b)} ({100 * g:+.1f}%)"

    out.append(
      f"| {feature} | {label} | {on.program_bundles:,} / {off.program_bundles:,} | "
      f"{cell(on.issue_cycles, off.issue_cycles)} | {cell(on.mxu_cycles, off.mxu_cycles)} | "
      f"{cell(on.bound_cycles, off.bound_cycles)} | {cell(on.model_us, off.model_us, '{:.1f}')} | "
      f"{cell(on.restated_us, off.restated_us, '{:.1f}')} |"
    )
    _log(out[-1])
  return "\n".join(out) + "\n"


def run_engine_checks() -> str:
  """The bench model (`costmodel.analyze`) against the closed form on ENGINE_CHECKS."""
  out = ["| feature | case | bench on / off (gain) | closed on / off (gain) |", "|---|---|---|---|"]
  for feature, case, impl, op, chip, tiles in ENGINE_CHECKS:
    shape, routing, gs, _ = _check_case(case)
    cells = []
    for engine in ("bench", "closed"):
      kw = dict(engine=engine, impl=impl, op=op, shape=shape, routing=routing, gs=gs, chip=chip)
      on = model_case(**kw, tiling=list(tiles))["us"]
      with feature_off(feature):
        off = model_case(**kw, tiling=list(tiles))["us"]
      cells.append(f"{on:.4f} / {off:.4f} ({100 * gain(on, off):.3f}%)")
    label = f"{shape.label}/{routing} {impl} {op} {chip} {'x'.join(map(str, tiles))}"
    out.append(f"| {feature} | {label} | {cells[0]} | {cells[1]} |")
    _log(out[-1])
  return "\n".join(out) + "\n"


def main(argv) -> None:
  del argv
  if _LLO.value:
    import tempfile

    print(run_llo_checks(tempfile.mkdtemp(prefix="llo-features-")))
    return
  if _ENGINE_CHECK.value:
    jax.config.update("jax_disable_most_optimizations", True)
    print(run_engine_checks())
    return
  jax.config.update("jax_disable_most_optimizations", True)
  features = _FEATURES.value or list(_switches())
  records = []
  if _MERGE.value:
    for path in _MERGE.value:
      with open(path) as f:
        records += json.load(f)
  sets = [] if _MERGE.value else _SETS.value
  if "dense" in sets:
    records += run_set(
      cases=dense_cases(),
      impl_names=DENSE_IMPLS,
      chips=_CHIPS.value,
      features=features,
      engine=_DENSE_ENGINE.value,
      label="dense",
    )
  if "ep" in sets:
    records += run_set(
      cases=ep_case_list(_EP_MODELS.value, _EP_CONFIGS.value),
      impl_names=EP_IMPLS,
      chips=_CHIPS.value,
      features=features,
      engine=_EP_ENGINE.value,
      label="ep",
    )
  text = feature_tables(records, features)
  print(text)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(records, f, indent=1)
  if _MARKDOWN.value:
    with open(_MARKDOWN.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--_llo_compile":
    _llo_compile(json.loads(sys.argv[2]))
  else:
    app.run(main)
