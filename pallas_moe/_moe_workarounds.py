"""WORKAROUND for a gmm/tgmm bug under `jax.shard_map(check_vma=True)` (see the MoE report).

Symptom (jax 0.10.2): `pallas_moe.gmm(lhs, ...)` with `interpret=None` or `True` (the HLO
interpreter, what CPU uses) inside `jax.shard_map(check_vma=True)` fails to lower when `lhs` varies
over a mesh axis: "while_loop body function carry input and carry output must have equal types
... float32[16,32]{V:x} ... float32[16,32]". `_jax_compat.install_interpret_vma_workaround` lowers
the interpreter with the vma check off, but the interpreter is still traced from the operands'
avals, which carry the varying axes, so its while loop starts with varying carries and ends with
unvarying ones. The TPU simulator (`pltpu.InterpretParams`) and compiled Mosaic are unaffected.

Fix applied here: for interpret-mode lowerings, strip the manual-axis types from the lowering
context's avals before the (already vma-check-free) lowering runs. Lowering to HLO does not use
them; the pallas_call was type-checked when it was traced. Idempotent; wraps whatever rule is
registered, so it composes with `_jax_compat`'s patch. The proper home is `_jax_compat.py`.
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.pallas import pallas_call as pallas_call_lib

_PATCHED = "_pallas_moe_strip_vma_patch"


def _unvarying(aval):
  if getattr(aval, "manual_axis_type", None) is None:
    return aval
  return aval.update(manual_axis_type=jax_core.ManualAxisType())


def install() -> None:
  """Wraps pallas_call's lowering: interpret-mode lowerings see avals without varying axes."""
  prim = pallas_call_lib.pallas_call_p
  entry = mlir._lowerings.get(prim)
  if entry is None or getattr(entry.rule, _PATCHED, False):
    return
  inner = entry.rule

  def lowering(ctx, *in_nodes, interpret, **params):
    if not interpret:
      return inner(ctx, *in_nodes, interpret=interpret, **params)
    stripped = ctx.replace(
      avals_in=[_unvarying(a) for a in ctx.avals_in],
      avals_out=[_unvarying(a) for a in ctx.avals_out],
    )
    out = inner(stripped, *in_nodes, interpret=interpret, **params)
    # NOTE: effectful lowerings (the TPU simulator's callbacks) set tokens on the context they get.
    if stripped.tokens_out is not None:
      ctx.set_tokens_out(stripped.tokens_out)
    return out

  setattr(lowering, _PATCHED, True)
  mlir._lowerings[prim] = mlir.LoweringRuleEntry(lowering, entry.inline)
