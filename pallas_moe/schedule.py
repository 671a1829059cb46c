"""libtpu options for the expert exchange: whether XLA:TPU compiles it as an async collective.

The MoE block's exchange (`collectives.ragged_all_to_all`) lowers to XLA's native
`ragged-all-to-all` on every libtpu version measured (not decomposed into all-to-all /
collective-permute, no custom call), and its transpose adds two small `all-to-all`s of offsets.
An async collective is a `-start` / `-done` pair that the latency-hiding scheduler can put compute
under; a synchronous one makes the core wait. Which one the compiler emits depends on the libtpu
version and two libtpu flags (AOT compiles of the EP training step for v5e:2x4 and v6e:2x4,
bench/results/ep-overlap.md; `bench.hlo_schedule` reads the compiled programs):
- libtpu 0.0.42.1 (jax 0.10.2): synchronous by default, the `all-to-all`s too; libtpu's
  `xla_tpu_enable_async_ragged_all_to_all` and `xla_tpu_enable_async_all_to_all` make them
  `-start`/`-done` pairs (`ASYNC_COLLECTIVE_OPTIONS`).
- libtpu 0.0.50.1 (what jax 0.12.0.1's `tpu` extra pins) and 0.0.52: every `ragged-all-to-all`
  is a `ragged-all-to-all-start`/`-done` pair by default (setting
  `xla_tpu_enable_async_ragged_all_to_all=false` makes them synchronous again); the `all-to-all`s
  stay synchronous unless `xla_tpu_enable_async_all_to_all` is on. Both flags are still accepted;
  `SYNC_COLLECTIVE_OPTIONS` (both false) brings back the synchronous program.
Versions between 0.0.42.1 and 0.0.50.1 were not measured: `ragged_async_by_default` treats
them as the older behaviour. `pallas_moe.batch_split` reads it to pick the default chunk count.
"""

from __future__ import annotations

import importlib.metadata

__all__ = [
  "ASYNC_COLLECTIVE_OPTIONS",
  "ASYNC_RAGGED_DEFAULT_SINCE",
  "SYNC_COLLECTIVE_OPTIONS",
  "libtpu_version",
  "ragged_async_by_default",
]

# NOTE: libtpu flags that turn the expert exchange (and the small all-to-alls of its transpose)
# into start/done pairs the latency-hiding scheduler can put compute under. Both off by default
# in libtpu 0.0.42.1; from 0.0.50.1 the ragged one is on by default, the all-to-all one is not.
# Pass as `jax.jit(f).lower(...).compile(compiler_options=ASYNC_COLLECTIVE_OPTIONS)` or as
# `LIBTPU_INIT_ARGS="--xla_tpu_enable_async_ragged_all_to_all=true ..."` before jax loads libtpu.
ASYNC_COLLECTIVE_OPTIONS = {
  "xla_tpu_enable_async_ragged_all_to_all": True,
  "xla_tpu_enable_async_all_to_all": True,
}
# NOTE: the same flags off: the synchronous exchange of libtpu 0.0.42.1's default program, on any
# version that has the flags (0.0.42.1 .. 0.0.52 measured).
SYNC_COLLECTIVE_OPTIONS = dict.fromkeys(ASYNC_COLLECTIVE_OPTIONS, False)
# NOTE: the oldest libtpu measured to compile `ragged-all-to-all` async by default is 0.0.50.1
# (0.0.42.1 did not; nothing in between was measured). Compared against the first three parts
# of the version.
ASYNC_RAGGED_DEFAULT_SINCE = (0, 0, 50)


def libtpu_version() -> tuple[int, ...] | None:
  """The installed libtpu's version as integers (e.g. (0, 0, 50, 1)), or None without libtpu.

  Read from the package metadata (libtpu is not loaded). A suffix such as ".dev2025..." ends the
  tuple.
  """
  for dist in ("libtpu", "libtpu-nightly"):
    try:
      text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      continue
    parts = []
    for p in text.split("."):
      if not p.isdigit():
        break
      parts.append(int(p))
    return tuple(parts)
  return None


def ragged_async_by_default(version: tuple[int, ...] | None = None) -> bool:
  """Whether libtpu compiles `ragged-all-to-all` as a start/done pair without any flag.

  Args:
    version: a libtpu version (`libtpu_version()`); None: the installed one. Without libtpu there
      is no TPU compiler: False.

  Returns:
    True from `ASYNC_RAGGED_DEFAULT_SINCE` (measured: 0.0.50.1, 0.0.52), False before (0.0.42.1).
  """
  if version is None:
    version = libtpu_version()
  return version is not None and tuple(version[:3]) >= ASYNC_RAGGED_DEFAULT_SINCE
