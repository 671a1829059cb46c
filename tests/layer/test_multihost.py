"""Multi-host: 2 processes x 4 CPU devices (`jax.distributed`, gloo) against one process's 8.

Two subprocesses run tests/layer/multihost_worker.py: each joins `jax.distributed.initialize` on
127.0.0.1 and runs `multihost_worker.compute` on a data=2 x expert=4 mesh whose expert groups
span both processes: the exchange (forward and VJP), eager `gmm`, the layer's forward, gradients
and two SGD steps, `dropless_buffer_rows`, `exact_buffer_rows`, `place_experts`,
`update_routed_bias`, `to_hf` / `from_hf` of sharded params and the demo's training loop, every
result gathered to the host. This process runs the same `compute` on its own 8 devices; the
results must agree.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax
import multihost_worker as worker
import numpy as np

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
REPO = WORKER.parent.parent
# NOTE: the whole test takes about 32 s on 2 cores (the workers and this process compute at
# once); the bound only stops a hang (a process waiting forever in a collective for a peer that
# died).
TIMEOUT_S = 300
# NOTE: the same programs on the same shards; only sums over devices (psum over gloo) may add in
# another order: measured differences are at most 1.5e-7 of an array's largest entry (about one
# f32 ulp); integers (counts, buffer rows, loads) agree exactly.
F32_TOL = dict(rtol=2e-6, atol=2e-6)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
  return env


def _tail(path: pathlib.Path, lines: int = 40) -> str:
  """The end of a worker's log, without gloo's connection chatter."""
  text = path.read_text(errors="replace").splitlines()
  keep = [t for t in text if "[Gloo]" not in t]
  return "\n".join(keep[-lines:])


def _start_workers(tmp_path: pathlib.Path):
  port = _free_port()
  out = tmp_path / "multihost.npz"
  procs, logs = [], []
  for i in range(2):
    log = tmp_path / f"worker{i}.log"
    with open(log, "w") as f:
      cmd = [sys.executable, str(WORKER), str(i), str(port), str(out)]
      procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env()))
    logs.append(log)
  return procs, logs, out


def _kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _wait(procs, logs, deadline: float) -> None:
  """Waits for both workers until `deadline` (time.monotonic); kills both on a timeout or as
  soon as one fails (its peer would wait for it in a collective)."""
  try:
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if None not in codes or any(c not in (None, 0) for c in codes):
        break
      time.sleep(0.2)
  finally:
    _kill(procs)
  codes = [p.returncode for p in procs]
  if codes != [0, 0]:
    report = "\n".join(
      f"--- process {i}: exit code {c} ({'killed' if c is not None and c < 0 else 'exited'}) ---\n"
      f"{_tail(log)}"
      for i, (c, log) in enumerate(zip(codes, logs, strict=True))
    )
    raise AssertionError(
      f"the 2 worker processes failed or ran past {TIMEOUT_S} s (negative exit code: killed "
      f"here):\n{report}"
    )


def test_two_processes_match_one(tmp_path):
  """Every multi-process result equals the single-process one (integers exactly)."""
  deadline = time.monotonic() + TIMEOUT_S
  procs, logs, out = _start_workers(tmp_path)
  try:
    # NOTE: the reference runs while the workers do (they mostly compile).
    want = worker.compute(worker.mesh_of(jax.devices()))
  except BaseException:
    _kill(procs)
    raise
  _wait(procs, logs, deadline)
  got = dict(np.load(out))
  assert sorted(got) == sorted(want)
  for key, w in want.items():
    g = got[key]
    assert g.shape == w.shape and g.dtype == w.dtype, (key, g.shape, g.dtype, w.shape, w.dtype)
    if np.issubdtype(w.dtype, np.floating):
      atol = F32_TOL["atol"] * max(1.0, float(np.abs(w).max(initial=0.0)))
      np.testing.assert_allclose(g, w, rtol=F32_TOL["rtol"], atol=atol, err_msg=key)
    else:
      np.testing.assert_array_equal(g, w, err_msg=key)
  # NOTE: the cases ran and did what they test (not only agreed).
  assert int(got["layer/['aux']['dropped_rows']"]) == 0
  assert int(got["noaux/['aux']['dropped_rows']"]) == 0
  assert int(got["demo/dropped_rows"]) == 0
  np.testing.assert_array_equal(got["noaux/['bias_sharded']"], got["noaux/['bias']"])
  for k, v in got.items():
    if k.startswith("noaux/from_hf/"):
      np.testing.assert_array_equal(v, got["noaux/['placed']" + f"['{k.split('/')[-1]}']"])
