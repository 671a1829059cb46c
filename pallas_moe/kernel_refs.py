"""A kernel's refs by name: scalar-prefetch metadata, operands, outputs and scratch as pytrees.

Pallas hands a scalar-prefetch kernel its refs positionally (the prefetched arrays, the operands,
the outputs, the scratch) and its index maps the grid indices then the prefetch refs. The kernels
here describe each group as a NamedTuple whose absent members (an optional operand, scratch a
configuration does not use) are None: a pytree whose leaves are, in order, exactly what Pallas
passes. `kernel` and `index_map` rebuild those NamedTuples from the refs, so a kernel body reads
`meta.group_offsets[g]` and `scratch.lhs.at[slot]` rather than unpacking positional refs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def leaves(tree: Any) -> list[Any]:
  """The members of a ref layout, in the order Pallas passes them (absent ones dropped)."""
  return jax.tree.leaves(tree)


def kernel(body: Callable[..., None], *, layout: tuple[Any, ...]) -> Callable[..., None]:
  """The Pallas kernel that calls `body` with its refs in the shape of `layout`.

  Args:
    body: called with one argument per member of `layout` (metadata, inputs, outputs, scratch),
      each the same NamedTuple with refs in place of its leaves.
    layout: the groups of the call, whose leaves are the prefetched arrays, the operands, the
      output shapes and the scratch shapes passed to the pallas_call, in its order.

  Returns:
    The kernel function for `pl.pallas_call`.
  """
  treedef = jax.tree.structure(layout)

  def run(*refs):
    body(*jax.tree.unflatten(treedef, refs))

  return run


def index_map(fn: Callable[..., Any], *, metadata: Any, grid_rank: int) -> Callable[..., Any]:
  """The BlockSpec index map that calls fn(*grid indices, metadata refs as `metadata`'s pytree)."""
  treedef = jax.tree.structure(metadata)

  def index(*args):
    return fn(*args[:grid_rank], jax.tree.unflatten(treedef, args[grid_rank:]))

  return index
