"""Every use of JAX internals, and every difference between supported jax versions, in one place.

pallas_moe supports jax 0.10.2 to 0.12.x (tested: 0.10.2 and 0.12.0.1). Everything else in the
library, the bench and the tests uses public API only (`jax.extend.core`, `jax.core`,
`jax.sharding`, `jax.experimental.pallas`); what follows has no public equivalent, and each entry
says why and which versions need it.

Interpret mode inside `jax.shard_map(check_vma=True)` (jax 0.10.2 and 0.12.0.1):
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

import dataclasses
from typing import Any

import jax

# NOTE: the jax._src imports are the only ones in pallas_moe, bench and tests; each serves one
# thing no public API offers (see where it is used).
from jax._src import core as _core
from jax._src.interpreters import mlir as _mlir
from jax._src.pallas import core as _pallas_core
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interpret
from jax._src.state import discharge as _state_discharge
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = [
  "DYNAMIC_GRID_DIM",
  "discharge_state",
  "install_interpret_vma_workaround",
  "interpret_params",
  "named_axis_effect",
  "races_found",
]


# ----------------------------------------------------------------------------------------------
# Jaxpr-level internals used by `bench.costmodel` (all supported versions).

# NOTE: the grid entry of a pallas_call's `grid_mapping` that is sized at run time (its size is
# one of the call's leading operands). Pallas exposes grid mappings (in the pallas_call
# equation's params) but not this sentinel.
DYNAMIC_GRID_DIM: Any = _pallas_core.dynamic_grid_dim


def discharge_state(closed_jaxpr):
  """The pure (Ref-free) form of a stateful closed jaxpr, e.g. a Pallas index map.

  NOTE: no public API discharges state: an index map with scalar-prefetch operands reads them
  through Refs, and evaluating it outside a kernel (as the cost model does, vmapped over the grid)
  needs the discharged form. The discharged jaxpr returns the original outputs first, then the
  final values of the Refs.

  Args:
    closed_jaxpr: a closed jaxpr (jax.extend.core.ClosedJaxpr) with Ref inputs.

  Returns:
    A closed jaxpr taking the Refs' values instead of the Refs.
  """
  return _state_discharge.discharge_state(closed_jaxpr)


# ----------------------------------------------------------------------------------------------
# Effects of the differentiable ragged all-to-all (all supported versions).


def named_axis_effect(axis_name) -> Any:
  """The effect JAX's own collectives carry for a named mesh axis.

  NOTE: a primitive that communicates over a named axis must declare this effect so that
  shard_map / vmap check the axis is bound; JAX has no public constructor for it.

  Args:
    axis_name: one mesh axis name.

  Returns:
    The `NamedAxisEffect` for that axis.
  """
  return _core.NamedAxisEffect(axis_name)


# ----------------------------------------------------------------------------------------------
# TPU interpret mode (the simulator).

# NOTE: jax 0.12 added `InterpretParams.on_race` ("raise" by default: the first race aborts the
# kernel with a RuntimeError); jax 0.10.2 has no such field and always reports races by printing
# "RACE DETECTED" and setting `races_found`. "warn" keeps the 0.10.2 behaviour (report, record,
# continue), so a test sees every race through `races_found` on both versions.
_HAS_ON_RACE = "on_race" in {f.name for f in dataclasses.fields(pltpu.InterpretParams)}


def interpret_params(**kwargs) -> pltpu.InterpretParams:
  """`pltpu.InterpretParams(**kwargs)` that records races instead of raising on them.

  Args:
    **kwargs: fields of `pltpu.InterpretParams`.

  Returns:
    The params; on jax versions with `on_race` (0.12 and later) it defaults to "warn".
  """
  if _HAS_ON_RACE:  # jax 0.12.0.1; absent in jax 0.10.2
    kwargs.setdefault("on_race", "warn")
  return pltpu.InterpretParams(**kwargs)


def races_found() -> bool:
  """Whether the TPU simulator's race detector found a race since its state was last reset.

  NOTE: the detector's state lives in the simulator module (`races`, reset by
  `pltpu.reset_tpu_interpret_mode_state`); no public API reads it. It is None until a call with
  `detect_races=True` runs.

  Returns:
    True when a race was recorded (jax 0.10.2 and 0.12.0.1 both keep `races.races_found`).
  """
  races = _tpu_interpret.races
  return races is not None and bool(races.races_found)


# ----------------------------------------------------------------------------------------------
# pallas_call lowering under shard_map's vma check (see the module docstring).

_PATCHED = "_pallas_moe_interpret_vma_patch"


def install_interpret_vma_workaround() -> None:
  """Wraps pallas_call's lowering so interpret mode lowers with the vma check off. Idempotent.

  NOTE: needed on jax 0.10.2 and still on 0.12.0.1 (tests/kernels/test_ops.py's shard_map tests fail
  without it on both). Wrapping an existing lowering rule needs JAX's lowering registry, which
  has no public reader (`jax.interpreters.mlir.register_lowering` only adds rules).
  """
  prim = pl.pallas_call_p
  entry = _mlir._lowerings.get(prim)
  if entry is None or getattr(entry.rule, _PATCHED, False):
    return
  original = entry.rule
  unvarying = jax.sharding.ManualAxisType()

  def strip(aval):
    if isinstance(aval, jax.core.ShapedArray):
      return aval.update_manual_axis_type(unvarying)
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
  _mlir._lowerings[prim] = _mlir.LoweringRuleEntry(lowering, entry.inline)
