"""Workarounds for jax 0.10.2 behaviour this library depends on. Each names the jax symptom.

Interpret mode inside `jax.shard_map(check_vma=True)`:
  The pallas_call interpreter (both `interpret=True` and `pltpu.InterpretParams`) is traced at
  *lowering* time, under shard_map's varying-axes check, but evaluates kernel and index-map jaxprs
  that were traced with the check off. Any read of a varying prefetched scalar with an unvarying
  grid index then fails: "Primitive dynamic_slice requires varying manual axes to match". The
  compiled (Mosaic) lowering never evaluates those jaxprs and is unaffected.
  Fix: lower interpret-mode pallas_calls from operand/result types with the varying axes stripped
  (turning the check off instead leaves the interpreter's while-loop carries with mismatched
  types). The kernel's operands and outputs were already type-checked (outputs declare their
  varying axes) when the call was traced, so nothing that shard_map checks is lost.
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.pallas import pallas_call as pallas_call_lib

_PATCHED = "_pallas_moe_interpret_vma_patch"


def install_interpret_vma_workaround() -> None:
  """Wraps pallas_call's lowering so interpret mode lowers with the vma check off. Idempotent."""
  prim = pallas_call_lib.pallas_call_p
  entry = mlir._lowerings.get(prim)
  if entry is None or getattr(entry.rule, _PATCHED, False):
    return
  original = entry.rule

  def strip(aval):
    if isinstance(aval, jax_core.ShapedArray):
      return aval.update_manual_axis_type(jax_core.empty_mat)
    return aval

  def lowering(ctx, *in_nodes, interpret, **params):
    if not interpret:
      return original(ctx, *in_nodes, interpret=interpret, **params)
    stripped = ctx.replace(
      avals_in=[strip(a) for a in ctx.avals_in], avals_out=[strip(a) for a in ctx.avals_out]
    )
    out = original(stripped, *in_nodes, interpret=interpret, **params)
    # NOTE: the interpreter's callbacks thread effect tokens through the context it was given.
    if stripped.tokens_out is not None:
      ctx.set_tokens_out(stripped.tokens_out)
    return out

  setattr(lowering, _PATCHED, True)
  mlir._lowerings[prim] = mlir.LoweringRuleEntry(lowering, entry.inline)
