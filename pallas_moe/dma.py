"""Manual DMA double buffering, shared by the row-tile gmm and tgmm kernels.

Both row-tile kernels keep their big operands in HBM (`pl.ANY`) and move blocks themselves: each
double-buffered block has two VMEM slots, and the grid steps that share the buffers form a
*chain* (`Chain`): the whole grid when one TensorCore runs it in order (`sequential_sweeps`),
else each sweep of the grid's last axis alone (sweeps may run on different TensorCores, so
nothing is prefetched across them). Step c of a chain uses slot c % 2; it starts the fetch of
step c + 1 into the other slot while it computes, and only the chain's first step fetches its own
block, exposed (`fetch_ahead`). A block written back from a slot completes while the next steps
compute, and is waited for before its slot is reused (`wait_behind`).

Copies are Pallas async-copy descriptors, or (predicate, descriptor) pairs where a copy runs only
under a traced condition (`common.tile_row_copies`, which moves a tile's local rows in DMA
granules). A copy is waited for by rebuilding its descriptor from the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


class Chain(NamedTuple):
  """A grid step's place in its chain of double-buffered steps.

  Attributes:
    index: the step's position in the chain (traced).
    length: steps in the chain (traced).
    slot: the VMEM slot the step's blocks use, index % 2.
  """

  index: Any
  length: Any
  slot: Any


def chain(*, sequential: bool, sweep: Any, num_sweeps: int, step: Any, num_steps: Any) -> Chain:
  """The chain position of grid step `step` of sweep `sweep`.

  Args:
    sequential: one TensorCore runs the whole grid in order, so the chain spans every sweep
      (sweep-major, like the grid); else each sweep is a chain of its own.
    sweep: the sweep's index (the grid's outer axes, flattened in grid order).
    num_sweeps: sweeps in the grid (static).
    step: the step's index along the grid's last axis.
    num_steps: steps per sweep.

  Returns:
    The `Chain`.
  """
  if sequential:
    index, length = sweep * num_steps + step, num_sweeps * num_steps
  else:
    index, length = step, num_steps
  return Chain(index=index, length=length, slot=index % 2)


def slot_copy(hbm: Any, slots: Any, slot: Any, sem: Any, *, to_hbm: bool = False) -> Any:
  """The copy between an HBM block and slot `slot` of a double-buffered VMEM block `slots`.

  Args:
    hbm: the HBM ref, indexed to the block.
    slots: the [2, ...] VMEM ref.
    slot: 0 or 1 (may be traced).
    sem: the DMA semaphore the copy signals.
    to_hbm: write the slot to HBM (default: fetch the HBM block into the slot).

  Returns:
    The descriptor (start it, or wait for it).
  """
  src, dst = hbm, slots.at[slot]
  if to_hbm:
    src, dst = dst, src
  return pltpu.make_async_copy(src, dst, sem)


def _run(copies: Iterable[Any], *, wait: bool) -> None:
  for copy in copies:
    pred, desc = copy if isinstance(copy, tuple) else (True, copy)
    action = desc.wait if wait else desc.start
    if pred is True:
      action()
    else:
      pl.when(pred)(action)


def start(copies: Iterable[Any]) -> None:
  """Starts each copy (a descriptor, or a (predicate, descriptor) pair: under its predicate)."""
  _run(copies, wait=False)


def wait(copies: Iterable[Any]) -> None:
  """Waits for each copy (the descriptors that started them, rebuilt), as `start` started it."""
  _run(copies, wait=True)


def fetch_ahead(fetch: Callable[[Any, Any], Any], *, chain: Chain, prefetch: Any = None) -> None:
  """Starts the fetches of chain steps index + j: j = 0 (the step's own, at the chain's start
  only) and j = 1 (the next step's, into the other slot).

  NOTE: one loop over j, so the kernel holds one copy of the (many, predicated) row DMAs.

  Args:
    fetch: the loop body (j, carry) -> carry that starts chain step index + j's fetches.
    chain: the step's `Chain`.
    prefetch: whether there is a next step to fetch (default: the chain goes on).
  """
  first = jnp.where(chain.index == 0, 0, 1)
  if prefetch is None:
    prefetch = chain.index + 1 < chain.length
  lax.fori_loop(first, jnp.where(prefetch, 2, 1), fetch, 0)


def wait_behind(wait_for: Callable[[Any, Any], Any], *, chain: Chain) -> None:
  """Waits for the previous step's write-back (j = 0: done while this step computed, before the
  next step reuses its slot) and, at the chain's end, this step's own (j = 1), so that nothing is
  pending when the chain ends.

  Args:
    wait_for: the loop body (j, carry) -> carry that waits for chain step index - 1 + j's writes.
    chain: the step's `Chain`.
  """
  lax.fori_loop(
    jnp.where(chain.index >= 1, 0, 1),
    jnp.where(chain.index + 1 == chain.length, 2, 1),
    wait_for,
    0,
  )
