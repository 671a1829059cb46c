"""The wheel holds the library alone: every file in it is under `pallas_moe/` or its dist-info.

bench/ (the benchmark and modeling lab) and tests/ run from a source checkout and must not ship.
The wheel is built from a copy of the checkout (so no `build/` or egg-info lands in the source
tree) with the environment's own setuptools, without build isolation: nothing is downloaded.
setuptools >= 70.1 comes with the `test` extra; without it the test fails and says so.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
# NOTE: what a wheel build reads plus what must stay out of it (bench/, tests/), so the check is
# not passed merely because bench/ was never there.
COPIED = ("pyproject.toml", "README.md", "pallas_moe", "bench", "tests")
SETUPTOOLS_MIN = (70, 1)


def _version(dist: str) -> tuple[int, ...] | None:
  try:
    text = importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None
  parts = []
  for p in text.split("."):
    if not p.isdigit():
      break
    parts.append(int(p))
  return tuple(parts)


def test_wheel_holds_only_the_library(tmp_path):
  found = _version("setuptools")
  assert found is not None and found >= SETUPTOOLS_MIN, (
    f"building the wheel needs setuptools >= {'.'.join(map(str, SETUPTOOLS_MIN))} in this "
    f"environment (found {found}): pip install -e '.[test]'"
  )
  src = tmp_path / "src"
  src.mkdir()
  ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "out", "build")
  for name in COPIED:
    path = ROOT / name
    if path.is_dir():
      shutil.copytree(path, src / name, ignore=ignore)
    else:
      shutil.copy2(path, src / name)
  dist = tmp_path / "dist"
  cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
  cmd += ["--no-index", "--wheel-dir", str(dist), "--quiet"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert done.returncode == 0, done.stdout + done.stderr
  (wheel,) = dist.glob("pallas_moe-*.whl")
  with zipfile.ZipFile(wheel) as zf:
    names = zf.namelist()
  dist_info = f"pallas_moe-{wheel.name.split('-')[1]}.dist-info/"
  stray = [n for n in names if not n.startswith(("pallas_moe/", dist_info))]
  assert not stray, stray
  # NOTE: and the whole library: every module of the checkout's pallas_moe/ (subpackages too).
  modules = {p.relative_to(src).as_posix() for p in (src / "pallas_moe").rglob("*.py")}
  assert "pallas_moe/__init__.py" in modules
  assert modules <= set(names), sorted(modules - set(names))
