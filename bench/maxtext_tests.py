"""`python -m bench.maxtext_tests`: MaxText's own MoE tests, with stock megablox and pallas_moe.

Runs MaxText's `tests/unit/moe_test.py` (e.g. from commit e591f30 of AI-Hypercomputer/maxtext,
which you fetch yourself: this repository holds none of MaxText's code) with pytest against the
installed `maxtext` package (0.2.5), on 8 CPU devices, once with MaxText's own megablox ("stock")
and once with the switch `pallas_moe.maxtext.swap_into(maxtext.layers.moe)` ("pallas_moe"), and
prints one row per test: stock result, pallas_moe result, and the first line of each failure.

  python -m bench.maxtext_tests --tests /tmp/moe_test.py [--switch both|stock|pallas_moe]
      [-k EXPR] [--json OUT.json]

Each run is a pytest subprocess started in a scratch directory holding a copy of the test file,
with this module as a plugin (`-p bench.maxtext_tests`, configured by environment variables):

- 8 CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, `JAX_PLATFORMS=cpu`) and
  `jax_disable_most_optimizations` (the interpret-mode kernels compile faster; same results).
- `tests.utils.test_helpers.get_test_config_path` (MaxText's test helper, which the test file
  imports) is provided by the plugin: it returns the installed package's `configs/base.yml`.
- Reduced dims (`REDUCED`, `MAX_SEQ`): every `pyconfig.initialize` call gets
  `override_model_config=True`, d_model (`base_emb_dim`) 128 and expert ffn (`base_mlp_dim`,
  `base_moe_mlp_dim`) 256 instead of mixtral-8x7b's 4096 and 14336 (or the 7168 / 256 some tests
  pass), and sequences of at most 32 tokens (`max_target_length`) instead of 128 or 256. Experts
  (8), top-k (2), per-device batch sizes, meshes, dtypes, tiles and tolerances are the tests' own
  (FusedMlpMoETest builds its layer without `intermediate_dim`, so its expert ffn is RoutedMoE's
  default, 2048, and its sequence its own, 16). Nothing in the test file is edited.
- The `tpu_only` marker is ignored (the point is to run those tests on CPU): MaxText's layer runs
  megablox in interpret mode off TPU (`interpret=True`), and pallas_moe's
  `ragged_all_to_all` runs on CPU under the switch, where XLA:CPU has no ragged-all-to-all.
- With `PALLAS_MOE_SWITCH=1` (the "pallas_moe" run), `maxtext.layers.moe` is switched before
  the tests are collected.

The default selection (`DEFAULT_K`) is the tests whose layer calls `mblx.gmm`: megablox=True
with sparse_matmul, and the tokamax gmm v2 configurations (use_tokamax_gmm with use_gmm_v2, or
quantized), which MaxText also routes through `mblx.gmm`. `-k ''` runs the whole file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

# Reduced model dims for every pyconfig.initialize call of the tests (see the module docstring).
REDUCED = {
  "override_model_config": True,
  "base_emb_dim": 128,
  "base_mlp_dim": 256,
  "base_moe_mlp_dim": 256,
}
# Sequence length cap (`max_target_length`): the tests' 128 or 256 become 32; shorter ones stay.
MAX_SEQ = 32

# Tests whose MoE layer calls `mblx.gmm` (the tests with megablox=True, and tokamax gmm v2 /
# quantized tokamax, which MaxText also sends through mblx.gmm).
DEFAULT_K = (
  "test_megablox or test_ring_of_expert or test_ragged_sort or test_moe_fsdp_two_stage "
  "or test_gmm_grad_equivalence or test_moe_emb_chunking or test_prefuse_moe_weights "
  "or test_fused_vs_sparse or test_prefused_vs_sparse"
)

_ENV_SWITCH = "PALLAS_MOE_SWITCH"
_ENV_RESULTS = "PALLAS_MOE_RESULTS"
_MARKERS = (
  "tpu_only",
  "gpu_only",
  "cpu_only",
  "skip_on_tpu7x",
  "post_training",
  "external_serving",
  "decoupled",
  "integration_test",
  "scheduled_only",
)

# ---------------------------------------------------------------------------------------------
# The pytest plugin (runs inside the pytest subprocess).
# ---------------------------------------------------------------------------------------------

_results: dict[str, dict] = {}


def _install_test_helpers() -> None:
  """`tests.utils.test_helpers.get_test_config_path`, as MaxText's test helper (not decoupled)."""
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # noqa: PLC0415

  def get_test_config_path(relative_path: str = "base.yml") -> str:
    return os.path.join(MAXTEXT_CONFIGS_DIR, relative_path)

  names = ("tests", "tests.utils", "tests.utils.test_helpers")
  mods = [types.ModuleType(name) for name in names]
  for mod in mods[:2]:
    mod.__path__ = []
  mods[2].get_test_config_path = get_test_config_path
  for name, mod in zip(names, mods, strict=True):
    sys.modules[name] = mod


def _reduce_dims() -> None:
  """Every `pyconfig.initialize` call gets the reduced dims (`REDUCED`)."""
  from maxtext.configs import pyconfig  # noqa: PLC0415

  original = pyconfig.initialize
  if getattr(original, "_pallas_moe_reduced", False):
    return

  def initialize(argv, **kwargs):
    seq = min(kwargs.get("max_target_length", MAX_SEQ), MAX_SEQ)
    return original(argv, **{**kwargs, **REDUCED, "max_target_length": seq})

  initialize._pallas_moe_reduced = True
  pyconfig.initialize = initialize


def pytest_configure(config) -> None:
  if os.environ.get(_ENV_RESULTS) is None:
    return  # NOTE: imported by pytest elsewhere (e.g. collected as a module): do nothing.
  for marker in _MARKERS:
    config.addinivalue_line("markers", f"{marker}: MaxText marker (ignored here)")
  import jax  # noqa: PLC0415

  jax.config.update("jax_disable_most_optimizations", True)
  _install_test_helpers()
  _reduce_dims()
  if os.environ.get(_ENV_SWITCH) == "1":
    import maxtext.layers.moe  # noqa: PLC0415

    import pallas_moe.maxtext  # noqa: PLC0415

    pallas_moe.maxtext.swap_into(maxtext.layers.moe)


def _first_line(report) -> str:
  if report.skipped and isinstance(report.longrepr, tuple):
    return str(report.longrepr[2])
  crash = getattr(report.longrepr, "reprcrash", None)
  text = crash.message if crash is not None else str(report.longrepr or "")
  return text.strip().splitlines()[0][:300] if text.strip() else ""


def pytest_runtest_logreport(report) -> None:
  if os.environ.get(_ENV_RESULTS) is None:
    return
  name = report.nodeid.split("::", 1)[-1]
  entry = _results.setdefault(name, {"outcome": "passed", "why": "", "seconds": 0.0})
  entry["seconds"] += report.duration
  if report.failed:
    entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
    entry["why"] = _first_line(report)
  elif report.skipped and entry["outcome"] == "passed":
    entry["outcome"] = "skipped"
    entry["why"] = _first_line(report)


def pytest_sessionfinish(session, exitstatus) -> None:
  del session, exitstatus
  path = os.environ.get(_ENV_RESULTS)
  if path:
    with open(path, "w") as f:
      json.dump(_results, f, indent=1)


# ---------------------------------------------------------------------------------------------
# The runner.
# ---------------------------------------------------------------------------------------------


def _repo_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tests(tests: str, *, switch: bool, k: str, timeout: float) -> tuple[dict, float, str]:
  """One pytest run of MaxText's test file; returns (results by test, seconds, output tail)."""
  with tempfile.TemporaryDirectory(prefix="maxtext_moe_tests_") as tmp:
    shutil.copy(tests, os.path.join(tmp, "moe_test.py"))
    results = os.path.join(tmp, "results.json")
    env = dict(os.environ)
    env.update(
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
      PYTHONPATH=os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH")) if p),
      **{_ENV_RESULTS: results, _ENV_SWITCH: "1" if switch else "0"},
    )
    cmd = [sys.executable, "-m", "pytest", "moe_test.py", "-p", "bench.maxtext_tests", "-q"]
    cmd += ["-p", "no:cacheprovider", "--rootdir", tmp, "-o", "addopts=", "-W", "ignore"]
    if k:
      cmd += ["-k", k]
    start = time.perf_counter()
    try:
      proc = subprocess.run(
        cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout, check=False
      )
      tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      tail = out[-3000:] + f"\n[timed out after {timeout:.0f} s]"
    seconds = time.perf_counter() - start
    found = {}
    if os.path.exists(results):
      with open(results) as f:
        found = json.load(f)
    return found, seconds, tail


def _cell(entry: dict | None) -> str:
  if entry is None:
    return "-"
  return f"{entry['outcome']} ({entry['seconds']:.0f} s)"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tests", required=True, help="path to MaxText's tests/unit/moe_test.py")
  parser.add_argument("--switch", choices=("both", "stock", "pallas_moe"), default="both")
  parser.add_argument("-k", default=DEFAULT_K, help="pytest -k expression ('' runs all)")
  parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
  parser.add_argument("--json", help="write the results here")
  parser.add_argument("--verbose", action="store_true", help="print each run's pytest output")
  args = parser.parse_args(argv)

  runs = {"stock": False, "pallas_moe": True}
  if args.switch != "both":
    runs = {args.switch: runs[args.switch]}
  results, seconds = {}, {}
  for name, switch in runs.items():
    results[name], seconds[name], tail = run_tests(
      args.tests, switch=switch, k=args.k, timeout=args.timeout
    )
    print(f"[{name}] {len(results[name])} tests in {seconds[name]:.0f} s", flush=True)
    if args.verbose or not results[name]:
      print(tail)

  names = sorted(set().union(*(r.keys() for r in results.values())))
  width = max([len(n) for n in names] + [4])
  print(f"\n{'test':<{width}}  " + "  ".join(f"{r:<16}" for r in runs))
  for test in names:
    print(f"{test:<{width}}  " + "  ".join(f"{_cell(results[r].get(test)):<16}" for r in runs))
  print("\nwhy (first line of each failure or skip):")
  for test in names:
    for r in runs:
      entry = results[r].get(test)
      if entry and entry["outcome"] != "passed":
        print(f"  {test} [{r}]: {entry['why']}")
  print("\nwall: " + ", ".join(f"{r} {s:.0f} s" for r, s in seconds.items()))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"results": results, "seconds": seconds, "k": args.k}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
