"""Row-count instrumentation of the kernels, outside their signatures.

The four kernels (`gmm.gmm_pallas`, `gmm.gmm_rowtile_pallas`, `tgmm.tgmm_pallas`,
`tgmm.tgmm_rowtile_pallas`) can count, per grid step, the rows they push through the MXU and (the
row-tile ones) the blocks and rows their DMAs move. A kernel builder asks `active()` at trace time
whether a probe is open; if so it adds an SMEM counts output (interpret mode only: see
`common.call_kernel`) and hands the counts to the probe instead of returning them:

    with probe.count_rows() as counts:
      out = gmm_rowtile_pallas(lhs, rhs, group_sizes, ..., interpret=True)
    counts.value  # [tiles_n, tiles, 4] int32

Each kernel documents the layout of its counts. One probe records one kernel call. Under
`jax.jit` the value is a tracer of the traced function: return it from there
(`with_row_counts` does).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax


@dataclasses.dataclass
class RowCounts:
  """The counts one kernel call recorded (None until it has run)."""

  value: jax.Array | None = None

  def record(self, counts: jax.Array) -> None:
    """Stores a kernel's counts; a second kernel call under the same probe is an error."""
    if self.value is not None:
      raise ValueError("a row-count probe records one kernel call; open one probe per call.")
    self.value = counts


_OPEN: contextvars.ContextVar[tuple[RowCounts, ...]] = contextvars.ContextVar(
  "pallas_moe_row_counts", default=()
)


@contextlib.contextmanager
def count_rows() -> Iterator[RowCounts]:
  """Opens a probe: the kernel called inside the block records its per-step counts into it."""
  counts = RowCounts()
  token = _OPEN.set((*_OPEN.get(), counts))
  try:
    yield counts
  finally:
    _OPEN.reset(token)


def active() -> RowCounts | None:
  """The innermost open probe, or None: read by the kernel builders at trace time."""
  open_probes = _OPEN.get()
  return open_probes[-1] if open_probes else None


def with_row_counts(kernel: Callable[..., Any]) -> Callable[..., tuple[Any, jax.Array]]:
  """`kernel` returning (its result, the counts it recorded): usable inside `jax.jit`."""

  @functools.wraps(kernel)
  def counted(*args, **kwargs):
    with count_rows() as counts:
      out = kernel(*args, **kwargs)
    return out, counts.value

  return counted
