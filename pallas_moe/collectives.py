"""A differentiable `ragged_all_to_all` that also runs on CPU, plus expert-parallel helpers.

`jax.lax.ragged_all_to_all` (jax 0.10.2) has two problems this module fixes:

- XLA:CPU cannot run it (`UNIMPLEMENTED: HLO opcode 'ragged-all-to-all'`), so expert parallelism
  cannot be tested on a multi-device CPU mesh. Here the CPU lowering is built from `ppermute`.
- Its transpose rule gets the `output` cotangent wrong when a zero-size chunk starts where another
  chunk starts (it builds the written-row mask with `.at[off].set(1).at[off+size].add(-1)` and a
  cumsum, and the -1 of the empty chunk cancels the +1), and it ignores `axis_index_groups` when it
  exchanges the offsets. Here the op is its own primitive, linear in `(operand, output)`, with a
  transpose rule that tests rows against each chunk's interval.

Layout of the public API:

- `ragged_all_to_all`: same signature and forward semantics as `jax.lax.ragged_all_to_all`, plus
  `backend=`.
- `plan_from_send_counts` / `plan_from_group_sizes`: offsets and sizes for dispatch (tokens to the
  devices holding their experts) and combine (the reverse), with overflow clipping and drop counts.
- `dispatch` / `combine`: run the two exchanges from a plan.
- `BufferPolicy`, `exact_buffer_rows`: the static receive-buffer row count.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallas_moe import _jax_compat
from pallas_moe.common import host_value

__all__ = [
  "BufferPolicy",
  "RaggedPlan",
  "combine",
  "dispatch",
  "exact_buffer_rows",
  "plan_from_group_sizes",
  "plan_from_send_counts",
  "ragged_all_to_all",
]

_BACKENDS = (None, "native", "cpu")


# ---------------------------------------------------------------------------------------------
# Argument checking.
# ---------------------------------------------------------------------------------------------


def _axis_tuple(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _bound_axis_size(*, axis_name, api: str) -> int:
  """Size of the (possibly multi-name) mapped axis; a clear error when it is not bound."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(
      f"{api}: axis_name={axis_name!r} is not bound. Call it inside `jax.shard_map` (or another "
      f"mapped context) over a mesh that has this axis, and pass that axis's name. ({e})"
    ) from None


def _canonical_groups(
  *, axis_index_groups, axis_size: int, api: str
) -> tuple[tuple[int, ...], ...]:
  """Validated groups as a tuple of tuples; `None` means one group of the whole axis."""
  if axis_index_groups is None:
    return (tuple(range(axis_size)),)
  try:
    groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
  except TypeError:
    raise TypeError(
      f"{api}: axis_index_groups must be a list of lists of axis indices, got "
      f"{axis_index_groups!r}."
    ) from None
  flat = sorted(i for g in groups for i in g)
  if not groups or flat != list(range(axis_size)):
    raise ValueError(
      f"{api}: axis_index_groups={axis_index_groups!r} must cover every index 0..{axis_size - 1} "
      "of the axis exactly once."
    )
  if len({len(g) for g in groups}) != 1:
    raise ValueError(f"{api}: all axis_index_groups must have the same size, got {groups!r}.")
  return groups


def _concrete(x) -> np.ndarray | None:
  """The value of `x` as numpy when it is known at trace time, else None."""
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    # NOTE: host_value also reads a jax.Array spanning processes (gathered; all processes call it).
    return host_value(x)
  except Exception:  # noqa: BLE001  (e.g. a tracer wrapped in another type)
    return None


def _check_index_vector(x, *, name: str, api: str) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    x = np.asarray(x)
    dtype = x.dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      f"{api}: {name} must have an integer dtype, got {dtype}. Offsets and sizes are row counts: "
      f"cast with `.astype(jnp.int32)`."
    )
  if np.ndim(x) != 1 or np.shape(x)[0] < 1:
    raise ValueError(f"{api}: {name} must be a non-empty 1-D array, got shape {np.shape(x)}.")


def _vary(x, names: frozenset):
  """Marks `x` as varying over the mesh axes among `names` (for `shard_map(check_vma=True)`).

  NOTE: names that are not manual mesh axes (e.g. a `jax.vmap` axis_name) are skipped: `pcast`
  accepts only shard_map's axes, and the batching rule reports a vmap axis in `axis_name`.
  """
  mat = getattr(jax.typeof(x), "mat", None)
  have = getattr(mat, "varying", None)
  if have is None:
    return x
  manual = jax.sharding.get_abstract_mesh().manual_axes
  missing = tuple(n for n in names if n not in have and n in manual)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying_names(x) -> frozenset:
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(getattr(mat, "varying", ()) or ())


# ---------------------------------------------------------------------------------------------
# The op.
# ---------------------------------------------------------------------------------------------


def ragged_all_to_all(
  operand,
  output,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  *,
  axis_name,
  axis_index_groups=None,
  backend: str | None = None,
):
  """`jax.lax.ragged_all_to_all` that is differentiable everywhere and runs on CPU.

  Forward semantics are exactly those of `jax.lax.ragged_all_to_all`: with `g` devices in a group
  and `K = len(input_offsets) = s * g`, chunk `k` of this device,
  `operand[input_offsets[k] : input_offsets[k] + send_sizes[k]]`, goes to group member `k // s`
  and is written there at rows `output_offsets[k] ...` (offsets in the *receiver's* buffer). The
  result is `output` with every received chunk written in; `recv_sizes[i]` is the size of the chunk
  received from member `i // s` (`send_sizes == all_to_all(recv_sizes)` must hold).

  Differentiation: the op is linear in `(operand, output)`. JVP applies the op to the tangents.
  The transpose sends chunk `i` of the output cotangent back to where it came from (the reverse
  exchange), and the `output` cotangent is the output cotangent with every row a received chunk
  wrote set to 0 (rows tested against each chunk's interval, so zero-size chunks anywhere are
  harmless). Offsets and sizes get no gradient. Limitation, shared with JAX's rule: when operand
  chunks overlap (the same row sent twice) its cotangent holds one copy's cotangent, not the sum;
  the helpers in this module never send a row twice.

  vmap: batched arguments (any of the six, batch axis anywhere) give the per-element exchanges,
  done as one exchange with the batch folded into the rows (see `_batch`); gradients compose with
  it in either order. `axis_name` must name mesh axes, not the enclosing vmap's axis.

  Backends: `backend=None` lowers to the native op on TPU/GPU and to the CPU implementation on CPU;
  the choice is made per lowering platform, so ahead-of-time lowering for TPU from a CPU host gets
  the native op. `"native"` or `"cpu"` forces one (the native op does not compile on XLA:CPU).

  CPU implementation cost, per device, with `N = operand rows`, `M = output rows`,
  `C = min(N, M)` (a static bound on a chunk's rows): `g - 1` `ppermute` rounds; round `r` sends to
  member `pos + r` either its `s` chunks each padded to `C` rows or, when that is not smaller, the
  whole operand, i.e. `min(N, s*C)` rows plus `2*s` ints. Bytes moved: `(g-1) * min(N, s*C)` rows
  (the native op moves only the chunk rows). Extra memory: one received buffer of `min(N, s*C)`
  rows per round (XLA may keep up to `g - 1` of them live at once) and the `M`-row result. Each
  round writes its chunks with an `M x s` interval test and an `M`-row gather.

  Checks: dtypes, ranks, lengths, the axis name and `axis_index_groups` are checked at trace time.
  Values (negative sizes or offsets, chunks past `operand` or past the receiver's buffer) are
  checked when they are concrete (e.g. numpy constants). Traced values are not checked: on the CPU
  path rows outside `[0, M)` are never written and reads past the operand are clamped; on the
  native path XLA's behaviour applies. Overlapping destination chunks: which one wins is
  unspecified.

  Args:
    operand: `[N, ...]` rows to send.
    output: `[M, ...]` buffer that received rows are written into (same dtype and trailing dims).
    input_offsets: `[K]` int, start of each chunk in `operand`.
    send_sizes: `[K]` int, rows of each sent chunk.
    output_offsets: `[K]` int, start of each sent chunk in its receiver's buffer.
    recv_sizes: `[K]` int, rows of each received chunk.
    axis_name: the mapped axis (or tuple of axes) to exchange over.
    axis_index_groups: optional list of equal-size lists of axis indices; exchanges stay inside a
      group and chunk `k` goes to the group member at position `k // s`.
    backend: None (per platform), "native" or "cpu".

  Returns:
    `[M, ...]` array: `output` with the received chunks written in.
  """
  api = "ragged_all_to_all"
  if backend not in _BACKENDS:
    raise ValueError(f"{api}: backend must be one of {_BACKENDS}, got {backend!r}.")
  names = _axis_tuple(axis_name)
  axis_size = _bound_axis_size(axis_name=names if len(names) > 1 else names[0], api=api)
  groups = _canonical_groups(axis_index_groups=axis_index_groups, axis_size=axis_size, api=api)
  operand = jnp.asarray(operand)
  output = jnp.asarray(output)
  if operand.ndim < 1 or output.ndim < 1:
    raise ValueError(
      f"{api}: operand and output need a leading row axis, got shapes "
      f"{operand.shape} and {output.shape}."
    )
  if operand.shape[1:] != output.shape[1:]:
    raise ValueError(
      f"{api}: operand {operand.shape} and output {output.shape} must have the same "
      "trailing dimensions."
    )
  if operand.dtype != output.dtype:
    raise TypeError(
      f"{api}: operand dtype {operand.dtype} must equal output dtype {output.dtype}; "
      "cast one of them."
    )
  idx = {
    "input_offsets": input_offsets,
    "send_sizes": send_sizes,
    "output_offsets": output_offsets,
    "recv_sizes": recv_sizes,
  }
  for name, x in idx.items():
    _check_index_vector(x, name=name, api=api)
  lengths = {name: int(np.shape(x)[0]) for name, x in idx.items()}
  if len(set(lengths.values())) != 1:
    raise ValueError(
      f"{api}: input_offsets, send_sizes, output_offsets and recv_sizes must "
      f"have the same length, got {lengths}."
    )
  k = lengths["input_offsets"]
  g = len(groups[0])
  if k % g:
    raise ValueError(
      f"{api}: the offset/size arrays have length {k}, which is not a multiple of the number of "
      f"devices exchanging ({g} = {'group size' if axis_index_groups else 'axis size'}). Use one "
      f"entry per (destination device, chunk): length = {g} * chunks_per_device."
    )
  _check_concrete_values(idx, operand_rows=operand.shape[0], output_rows=output.shape[0], api=api)

  # NOTE: make every input vary over the axis and over whatever the data already varies over, so
  # the result type (that of `output`) is right under shard_map(check_vma=True).
  vnames = frozenset(names) | _varying_names(operand) | _varying_names(output)
  args = [operand, output] + [jnp.asarray(x).astype(jnp.int32) for x in idx.values()]
  args = [_vary(a, vnames) for a in args]
  return _ragged_p.bind(
    *args,
    axis_name=names,
    axis_index_groups=None if axis_index_groups is None else groups,
    backend=backend,
  )


def _check_concrete_values(idx: dict, *, operand_rows: int, output_rows: int, api: str) -> None:
  vals = {name: _concrete(x) for name, x in idx.items()}
  for name in ("send_sizes", "recv_sizes", "input_offsets", "output_offsets"):
    v = vals[name]
    if v is not None and (v < 0).any():
      kind = "sizes" if "sizes" in name else "offsets"
      raise ValueError(
        f"{api}: {name} has negative entries at {np.flatnonzero(v < 0).tolist()}; "
        f"{kind} must be >= 0."
      )
  off, size = vals["input_offsets"], vals["send_sizes"]
  if off is not None and size is not None:
    bad = np.flatnonzero(off + size > operand_rows)
    if bad.size:
      raise ValueError(
        f"{api}: chunks {bad.tolist()} run past the operand's {operand_rows} rows "
        f"(input_offsets + send_sizes = {(off + size)[bad].tolist()}). Shrink send_sizes or "
        "grow operand."
      )
  off, size = vals["output_offsets"], vals["send_sizes"]
  if off is not None and size is not None:
    bad = np.flatnonzero(off + size > output_rows)
    if bad.size:
      raise ValueError(
        f"{api}: sent chunks {bad.tolist()} run past the receiver's {output_rows}-row buffer "
        f"(output_offsets + send_sizes = {(off + size)[bad].tolist()}). Grow `output` or clip the "
        "chunks (plan_from_send_counts does this and counts the dropped rows)."
      )


# NOTE on the primitive: a custom_vjp would not support forward mode, and JAX's primitive has the
# wrong transpose, so the op is a primitive of its own that is linear in (operand, output).
_ragged_p = Primitive("pallas_moe_ragged_all_to_all")


def _abstract_eval(operand, output, *idx, axis_name, axis_index_groups, backend):
  del operand, idx, axis_index_groups, backend
  effects = {_jax_compat.named_axis_effect(n) for n in axis_name}
  return output.update(weak_type=False), effects


_ragged_p.def_effectful_abstract_eval(_abstract_eval)


def _jvp(primals, tangents, *, axis_name, axis_index_groups, backend):
  operand, output, *idx = primals
  d_operand, d_output, *_ = tangents
  params = dict(axis_name=axis_name, axis_index_groups=axis_index_groups, backend=backend)
  out = _ragged_p.bind(operand, output, *idx, **params)
  if type(d_operand) is ad.Zero and type(d_output) is ad.Zero:
    return out, ad.Zero.from_primal_value(out)
  d_operand = ad.instantiate_zeros(d_operand)
  d_output = ad.instantiate_zeros(d_output)
  return out, _ragged_p.bind(d_operand, d_output, *idx, **params)


def _group_all_to_all(x, *, axis_name, axis_index_groups):
  """`all_to_all(x, tiled=True)` of a 1-D vector inside the exchange groups."""
  name = axis_name if len(axis_name) > 1 else axis_name[0]
  groups = None if axis_index_groups is None else [list(g) for g in axis_index_groups]
  return jax.lax.all_to_all(x, name, 0, 0, tiled=True, axis_index_groups=groups)


def _written_rows(*, offsets, sizes, num_rows: int):
  """Bool `[num_rows]`: rows covered by some chunk `[offsets[i], offsets[i] + sizes[i])`."""
  rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
  # NOTE: a per-chunk interval test; an empty chunk covers no row wherever it starts.
  return jnp.any((rows >= offsets[None, :]) & (rows < offsets[None, :] + sizes[None, :]), axis=1)


def _transpose(
  ct,
  operand,
  output,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  *,
  axis_name,
  axis_index_groups,
  backend,
):
  params = dict(axis_name=axis_name, axis_index_groups=axis_index_groups, backend=backend)
  want_operand = ad.is_undefined_primal(operand)
  want_output = ad.is_undefined_primal(output)
  if type(ct) is ad.Zero:
    return [
      ad.Zero(operand.aval) if want_operand else None,
      ad.Zero(output.aval) if want_output else None,
    ] + [None] * 4
  # NOTE: entry i of these is what member i // s used for the chunk it sent here: where it sits in
  # this device's buffer (recv_offsets) and where it came from in the sender (src_offsets).
  recv_offsets = _group_all_to_all(
    output_offsets, axis_name=axis_name, axis_index_groups=axis_index_groups
  )
  d_operand = d_output = None
  if want_operand:
    src_offsets = _group_all_to_all(
      input_offsets, axis_name=axis_name, axis_index_groups=axis_index_groups
    )
    zeros = jnp.zeros(operand.aval.shape, operand.aval.dtype)
    zeros = _vary(zeros, _varying_names(ct))
    # NOTE: the reverse exchange; chunk i of ct goes back to member i // s at src_offsets[i].
    d_operand = _ragged_p.bind(
      ct, zeros, recv_offsets, recv_sizes, src_offsets, send_sizes, **params
    )
  if want_output:
    written = _written_rows(offsets=recv_offsets, sizes=recv_sizes, num_rows=ct.shape[0])
    written = written.reshape((-1,) + (1,) * (ct.ndim - 1))
    d_output = jnp.where(written, jnp.zeros((), ct.dtype), ct)
  return [d_operand, d_output] + [None] * 4


ad.primitive_jvps[_ragged_p] = _jvp
ad.primitive_transposes[_ragged_p] = _transpose


def _batch(axis_data, vals_in, dims_in, *, axis_name, axis_index_groups, backend):
  """vmap rule: the `B` exchanges become one exchange with `B` times the rows and chunks.

  Same construction as JAX's rule for `jax.lax.ragged_all_to_all`: batch element `b`'s rows sit
  at rows `[b*N, (b+1)*N)` of the merged operand (`[b*M, (b+1)*M)` of the merged output), its
  offsets are shifted by `b*N` (`b*M`), and the index arrays are laid out `[K, B]` and flattened,
  so merged chunk `k*B + b` is chunk `k` of element `b`. With `K*B = g * (s*B)` it still goes to
  group member `k // s`, and the receiver's entry `k*B + b` of `recv_sizes` is the size of the
  chunk element `b` received as its entry `k`. One exchange rather than a loop, so the native op
  is issued once per call; `axis_index_groups` need nothing extra (JAX's rule refuses them).

  Unbatched arguments are broadcast: an unbatched `operand` is read by all `B` elements and its
  cotangent is the sum of theirs, which the broadcast's transpose computes (the op's own
  transpose would keep one element's cotangent for rows sent more than once).

  Cost: the native op moves the same rows as `B` calls. The CPU path sees `B*N` operand rows,
  `B*M` output rows and `s*B` chunks per peer, so its per-round interval test is `B*M x s*B`
  (`B` times the `B` calls' work) and it sends the whole merged operand each round.

  Args:
    axis_data: the vmapped axis (its `.name` and `.size`).
    vals_in: the six arguments of the primitive.
    dims_in: their batch dimensions (None when unbatched).
    axis_name, axis_index_groups, backend: the primitive's parameters.

  Returns:
    The `[B, M, ...]` result and its batch dimension, 0.
  """
  params = dict(axis_name=axis_name, axis_index_groups=axis_index_groups, backend=backend)
  if axis_data.name in axis_name:
    names = axis_name if len(axis_name) > 1 else axis_name[0]
    raise ValueError(
      f"ragged_all_to_all: axis_name={names!r} names the axis of the enclosing `jax.vmap` "
      f"({axis_data.name!r}); this op exchanges over mesh axes only. Call it inside "
      "`jax.shard_map` with a mesh axis name, or give the vmap a different axis_name."
    )
  if all(d is None for d in dims_in):
    return _ragged_p.bind(*vals_in, **params), None
  size = axis_data.size

  def at_front(x, d):
    if d is None:
      return jnp.broadcast_to(x[None], (size,) + x.shape)
    return jnp.moveaxis(x, d, 0)

  operand, output = (at_front(x, d) for x, d in zip(vals_in[:2], dims_in[:2], strict=True))
  # NOTE: index arrays as [K, B], so that flattening keeps each chunk's B copies together.
  idx = [at_front(x, d).T for x, d in zip(vals_in[2:], dims_in[2:], strict=True)]
  input_offsets, send_sizes, output_offsets, recv_sizes = idx
  shift = jnp.arange(size, dtype=jnp.int32)[None, :]
  input_offsets = input_offsets + shift * operand.shape[1]
  output_offsets = output_offsets + shift * output.shape[1]
  args = [
    operand.reshape((-1,) + operand.shape[2:]),
    output.reshape((-1,) + output.shape[2:]),
  ] + [x.reshape(-1) for x in (input_offsets, send_sizes, output_offsets, recv_sizes)]
  # NOTE: the shifts are unvarying constants; keep every argument's varying axes equal.
  vnames = frozenset(axis_name).union(*(_varying_names(a) for a in args))
  out = _ragged_p.bind(*(_vary(a, vnames) for a in args), **params)
  return out.reshape(output.shape), 0


batching.fancy_primitive_batchers[_ragged_p] = _batch


def _native_impl(operand, output, *idx, axis_name, axis_index_groups):
  name = axis_name if len(axis_name) > 1 else axis_name[0]
  groups = None if axis_index_groups is None else [list(g) for g in axis_index_groups]
  return jax.lax.ragged_all_to_all(operand, output, *idx, axis_name=name, axis_index_groups=groups)


def _cpu_impl(
  operand,
  output,
  input_offsets,
  send_sizes,
  output_offsets,
  recv_sizes,
  *,
  axis_name,
  axis_index_groups,
):
  """The exchange as `g - 1` ppermute rounds; see `ragged_all_to_all` for its cost."""
  name = axis_name if len(axis_name) > 1 else axis_name[0]
  axis_size = int(jax.lax.axis_size(name))
  groups = axis_index_groups or (tuple(range(axis_size)),)
  g = len(groups[0])
  s = input_offsets.shape[0] // g
  n, m = operand.shape[0], output.shape[0]
  if n == 0 or m == 0:
    return output  # NOTE: nothing to send or nowhere to write.
  c = min(n, m)
  whole = n <= s * c  # NOTE: send the operand itself when padded chunks would not be smaller.
  position = np.zeros(axis_size, np.int32)
  for grp in groups:
    for q, i in enumerate(grp):
      position[i] = q
  pos = jnp.asarray(position)[jax.lax.axis_index(name)]
  slot = jnp.arange(s, dtype=jnp.int32)
  rows = jnp.arange(m, dtype=jnp.int32)[:, None]
  result = output
  for r in range(g):
    # NOTE: round r: send chunks pos*... for member (pos + r) % g, receive from (pos - r) % g.
    send_k = ((pos + r) % g) * s + slot
    starts = input_offsets[send_k]
    if whole:
      data = operand
    else:
      # NOTE: chunk e occupies payload rows [e*c, (e+1)*c); rows past the operand are clamped.
      src = jnp.clip(starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :], 0, n - 1)
      data = operand[src.reshape(-1)]
      starts = slot * c
    meta = jnp.stack([starts, output_offsets[send_k]])
    if r:
      perm = [(grp[q], grp[(q + r) % g]) for grp in groups for q in range(g)]
      data, meta = jax.lax.ppermute((data, meta), name, perm)
    starts, offsets = meta[0], meta[1]
    sizes = jnp.clip(recv_sizes[((pos - r) % g) * s + slot], 0, c)
    # NOTE: row m gets row starts[e] + (m - offsets[e]) of the payload when chunk e covers it; the
    # last covering chunk wins (overlaps are unspecified). Rows outside [0, M) are never touched.
    hit = (rows >= offsets[None, :]) & (rows < offsets[None, :] + sizes[None, :])
    e = (s - 1) - jnp.argmax(hit[:, ::-1], axis=1)
    src_row = jnp.clip(starts[e] + rows[:, 0] - offsets[e], 0, data.shape[0] - 1)
    covered = hit.any(axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
    result = jnp.where(covered, data[src_row], result)
  return result


def _lowering(ctx, *args, axis_name, axis_index_groups, backend, platform_default):
  impl = _cpu_impl if (backend or platform_default) == "cpu" else _native_impl
  fn = partial(impl, axis_name=axis_name, axis_index_groups=axis_index_groups)
  return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


mlir.register_lowering(_ragged_p, partial(_lowering, platform_default="cpu"), platform="cpu")
mlir.register_lowering(_ragged_p, partial(_lowering, platform_default="native"))


# ---------------------------------------------------------------------------------------------
# Expert-parallel helpers.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BufferPolicy:
  """How many rows each device's receive buffer has (a static shape).

  Rows a device wants to receive depend on routing, but buffer shapes are static, so:

  - `worst_case()`: `axis_size * tokens_per_device * top_k` rows, enough when every device sends
    all its rows to one device. Never drops; memory and expert compute are `axis_size` times the
    balanced load.
  - `factor(f)`: `ceil(f * tokens_per_device * top_k)` rows (the balanced load times a capacity
    factor, capped at the worst case). Small and static; drops rows when routing is imbalanced
    (the plan reports how many).
  - `fixed(rows)`, and `exact(send_counts)`: the smallest buffer that drops nothing, computed on
    the host from concrete counts. Exact only for those counts; a new value means a new shape and
    a recompile. Inside jit use `RaggedPlan.needed_rows` (the group maximum of rows wanted) after a
    step to size the next compile.

  `multiple_of` rounds the row count up (e.g. to the gmm row tile).
  """

  kind: str
  value: float | int | None = None
  multiple_of: int = 1

  def __post_init__(self):
    if self.kind not in ("worst_case", "factor", "fixed"):
      raise ValueError(f"BufferPolicy.kind must be worst_case, factor or fixed, got {self.kind!r}.")
    if not isinstance(self.multiple_of, (int, np.integer)) or self.multiple_of < 1:
      raise ValueError(
        f"BufferPolicy.multiple_of must be a positive int, got {self.multiple_of!r}."
      )
    if self.kind == "factor" and not (isinstance(self.value, (int, float)) and self.value > 0):
      raise ValueError(f"BufferPolicy.factor needs a positive factor, got {self.value!r}.")
    if self.kind == "fixed" and not (isinstance(self.value, (int, np.integer)) and self.value >= 1):
      raise ValueError(f"BufferPolicy.fixed needs a positive int row count, got {self.value!r}.")

  @classmethod
  def worst_case(cls, *, multiple_of: int = 1) -> BufferPolicy:
    return cls("worst_case", None, multiple_of)

  @classmethod
  def factor(cls, factor: float, *, multiple_of: int = 1) -> BufferPolicy:
    return cls("factor", factor, multiple_of)

  @classmethod
  def fixed(cls, rows: int, *, multiple_of: int = 1) -> BufferPolicy:
    return cls("fixed", int(rows) if isinstance(rows, np.integer) else rows, multiple_of)

  @classmethod
  def exact(cls, send_counts, *, axis_index_groups=None, multiple_of: int = 1) -> BufferPolicy:
    """`fixed` at `exact_buffer_rows(send_counts)` (host values only)."""
    rows = exact_buffer_rows(send_counts, axis_index_groups=axis_index_groups)
    return cls("fixed", max(rows, 1), multiple_of)

  def rows(self, *, tokens_per_device: int, top_k: int = 1, axis_size: int) -> int:
    """Static receive-buffer rows.

    Args:
      tokens_per_device: tokens on each device before routing.
      top_k: experts per token (rows sent per token).
      axis_size: devices exchanging (the group size with axis_index_groups).

    Returns:
      The row count, rounded up to `multiple_of`.
    """
    balanced = tokens_per_device * top_k
    worst = axis_size * balanced
    if self.kind == "worst_case":
      rows = worst
    elif self.kind == "factor":
      rows = min(math.ceil(self.value * balanced), worst)
    else:
      rows = self.value
    return max(1, -(-rows // self.multiple_of) * self.multiple_of)


def exact_buffer_rows(send_counts, *, axis_index_groups=None) -> int:
  """Smallest receive buffer that drops nothing, from concrete host counts.

  Args:
    send_counts: `[D, K]` ints, row `d` = the `send_counts` device `d` passes to
      `plan_from_send_counts` (for `plan_from_group_sizes`, the per-expert group sizes).
    axis_index_groups: the groups used in the exchange, if any.

  Returns:
    The maximum over devices of the rows it receives.
  """
  counts = _concrete(send_counts)
  if counts is None:
    raise TypeError(
      "exact_buffer_rows needs concrete (host) counts, got a tracer. Static shapes cannot depend "
      "on traced values: use BufferPolicy.worst_case()/factor(), or read RaggedPlan.needed_rows "
      "after a step and recompile with BufferPolicy.fixed(rows)."
    )
  if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer):
    raise ValueError(
      f"exact_buffer_rows: send_counts must be a 2-D int array [devices, K], got "
      f"{counts.dtype}{list(counts.shape)}."
    )
  groups = _canonical_groups(
    axis_index_groups=axis_index_groups, axis_size=counts.shape[0], api="exact_buffer_rows"
  )
  g = len(groups[0])
  if counts.shape[1] % g:
    raise ValueError(f"exact_buffer_rows: K={counts.shape[1]} is not a multiple of {g} devices.")
  best = 0
  for grp in groups:
    c3 = counts[list(grp)].reshape(g, g, -1)  # [src, dst, slot]
    best = max(best, int(c3.sum(axis=(0, 2)).max()))
  return best


@partial(
  jax.tree_util.register_dataclass,
  data_fields=[
    "dispatch_args",
    "combine_args",
    "recv_group_sizes",
    "num_dropped",
    "num_unsent",
    "needed_rows",
  ],
  meta_fields=["buffer_rows"],
)
@dataclasses.dataclass(frozen=True)
class RaggedPlan:
  """Offsets and sizes for one dispatch and its combine, as seen by one device.

  Attributes:
    dispatch_args: `(input_offsets, send_sizes, output_offsets, recv_sizes)` for the dispatch.
    combine_args: the same four for the reverse exchange (combine).
    recv_group_sizes: `[s]` rows received per slot (per local expert), after clipping.
    num_dropped: rows that did not fit this device's receive buffer.
    num_unsent: rows of this device's operand that were not delivered (dropped at the receiver).
    needed_rows: the group maximum of rows wanted; the exact buffer size for these counts.
    buffer_rows: static receive-buffer rows.
  """

  dispatch_args: tuple
  combine_args: tuple
  recv_group_sizes: Any
  num_dropped: Any
  num_unsent: Any
  needed_rows: Any
  buffer_rows: int


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def plan_from_send_counts(
  send_counts, *, axis_name, buffer_rows: int, axis_index_groups=None
) -> RaggedPlan:
  """Plans a dispatch from this device's send counts (call inside shard_map).

  Chunk `k` of `send_counts` (`K = g * s`) goes to group member `k // s`, slot `k % s`. The
  sender's rows are laid out by chunk: chunk `k` is rows `[cumsum[k-1], cumsum[k])`. The receiver
  lays them out by slot, then by sender: slot 0 from member 0, slot 0 from member 1, ..., slot 1
  from member 0, ... (for experts as slots: sorted by local expert, as gmm wants).

  Overflow: rows past `buffer_rows` in the receiver's layout are dropped, deterministically the
  last rows of that layout (highest slot, highest sender); each chunk is clipped to a prefix, so
  nothing is ever written outside the buffer. `num_dropped`/`num_unsent` count them.

  Cost: one `all_gather` of `K` ints, then `O(g * K)` local integer work.

  Args:
    send_counts: `[K]` int rows this device sends per chunk. Must sum to at most the operand
      rows. Negative concrete counts raise; negative traced counts are treated as 0.
    axis_name: the mapped axis to exchange over.
    buffer_rows: static receive-buffer rows (see `BufferPolicy`).
    axis_index_groups: optional equal-size groups of axis indices; exchanges stay in a group.

  Returns:
    A `RaggedPlan`.
  """
  api = "plan_from_send_counts"
  if isinstance(buffer_rows, bool) or not isinstance(buffer_rows, (int, np.integer)):
    raise TypeError(
      f"{api}: buffer_rows must be a static Python int, got {buffer_rows!r}; get "
      "one from BufferPolicy(...).rows(...) or exact_buffer_rows(...)."
    )
  if buffer_rows < 1:
    raise ValueError(f"{api}: buffer_rows must be >= 1, got {buffer_rows}.")
  buffer_rows = int(buffer_rows)
  _check_index_vector(send_counts, name="send_counts", api=api)
  axis_size = _bound_axis_size(axis_name=axis_name, api=api)
  groups = _canonical_groups(axis_index_groups=axis_index_groups, axis_size=axis_size, api=api)
  g = len(groups[0])
  k = int(np.shape(send_counts)[0])
  if k % g:
    raise ValueError(
      f"{api}: len(send_counts)={k} must be a multiple of the {g} devices "
      "exchanging (one count per destination device and slot)."
    )
  s = k // g
  concrete = _concrete(send_counts)
  if concrete is not None and (concrete < 0).any():
    raise ValueError(
      f"{api}: send_counts has negative entries at "
      f"{np.flatnonzero(concrete < 0).tolist()}; counts must be >= 0."
    )
  counts = jnp.maximum(jnp.asarray(send_counts).astype(jnp.int32), 0)
  counts = _vary(counts, frozenset(_axis_tuple(axis_name)))
  groups_arg = None if axis_index_groups is None else [list(gr) for gr in groups]
  everyone = jax.lax.all_gather(counts, axis_name, axis_index_groups=groups_arg)  # [g, K]
  c3 = everyone.reshape(g, g, s)  # NOTE: [src, dst, slot], src/dst are group positions.
  position = np.zeros(axis_size, np.int32)
  for grp in groups:
    for q, i in enumerate(grp):
      position[i] = q
  me = jnp.asarray(position)[jax.lax.axis_index(axis_name)]

  # NOTE: receiver dst orders its chunks by (slot, src): flatten [dst, slot, src], exclusive cumsum.
  by_dst = jnp.transpose(c3, (1, 2, 0)).reshape(g, s * g)
  offsets = jnp.transpose(_exclusive_cumsum(by_dst).reshape(g, s, g), (2, 0, 1))  # [src, dst, e]
  start = jnp.minimum(offsets, buffer_rows)
  size = jnp.minimum(offsets + c3, buffer_rows) - start  # NOTE: the prefix that fits.
  send_offsets = _exclusive_cumsum(everyone)  # [src, K]: each sender's chunk starts.

  dispatch_args = (
    send_offsets[me],
    size[me].reshape(k),
    start[me].reshape(k),
    size[:, me, :].reshape(k),
  )
  # NOTE: reverse: chunk i = (src, e) of my buffer goes back to src, where it came from.
  combine_args = (
    start[:, me, :].reshape(k),
    size[:, me, :].reshape(k),
    jax.lax.dynamic_slice_in_dim(send_offsets, me * s, s, axis=1).reshape(k),
    size[me].reshape(k),
  )
  recv_group_sizes = size[:, me, :].sum(axis=0)
  wanted = c3.sum(axis=(0, 2))  # [dst]
  return RaggedPlan(
    dispatch_args=dispatch_args,
    combine_args=combine_args,
    recv_group_sizes=recv_group_sizes,
    num_dropped=wanted[me] - recv_group_sizes.sum(),
    num_unsent=c3[me].sum() - size[me].sum(),
    needed_rows=wanted.max(),
    buffer_rows=buffer_rows,
  )


def plan_from_group_sizes(
  group_sizes, *, axis_name, buffer_rows: int, axis_index_groups=None
) -> RaggedPlan:
  """Plans an expert-parallel dispatch from per-expert group sizes (call inside shard_map).

  This device's rows are sorted by expert, `group_sizes[e]` rows for expert `e`. Experts are split
  contiguously: device (group position) `q` holds experts `[q * E_local, (q + 1) * E_local)` with
  `E_local = num_experts // g`. Received rows are sorted by local expert (then by sender), and
  `recv_group_sizes` are the local experts' group sizes, ready for gmm.

  Args:
    group_sizes: `[num_experts]` int rows per expert on this device.
    axis_name: the expert-parallel mesh axis.
    buffer_rows: static receive-buffer rows (see `BufferPolicy`).
    axis_index_groups: optional equal-size groups; experts are split within each group.

  Returns:
    A `RaggedPlan` (slots are local experts).
  """
  api = "plan_from_group_sizes"
  _check_index_vector(group_sizes, name="group_sizes", api=api)
  axis_size = _bound_axis_size(axis_name=axis_name, api=api)
  groups = _canonical_groups(axis_index_groups=axis_index_groups, axis_size=axis_size, api=api)
  e = int(np.shape(group_sizes)[0])
  if e % len(groups[0]):
    raise ValueError(
      f"{api}: num_experts={e} (len(group_sizes)) must be divisible by the "
      f"{len(groups[0])} expert-parallel devices."
    )
  return plan_from_send_counts(
    group_sizes, axis_name=axis_name, buffer_rows=buffer_rows, axis_index_groups=axis_index_groups
  )


def _buffer(*, rows: int, like, poison: bool):
  if poison:
    if not jnp.issubdtype(like.dtype, jnp.inexact):
      raise TypeError(f"poison=True needs a floating dtype to fill with NaN, got {like.dtype}.")
    return jnp.full((rows,) + like.shape[1:], jnp.nan, like.dtype)
  return jnp.zeros((rows,) + like.shape[1:], like.dtype)


def dispatch(
  x,
  plan: RaggedPlan,
  *,
  axis_name,
  axis_index_groups=None,
  poison: bool = False,
  backend: str | None = None,
):
  """Sends this device's rows to their destinations (call inside shard_map).

  Args:
    x: `[N, ...]` rows laid out by chunk as the plan's `send_counts` describe.
    plan: from `plan_from_send_counts` / `plan_from_group_sizes`.
    axis_name: the mapped axis.
    axis_index_groups: the groups the plan was made with.
    poison: fill rows no chunk writes with NaN (debugging: catches code that reads them).
    backend: see `ragged_all_to_all`.

  Returns:
    `[plan.buffer_rows, ...]` received rows; rows past `plan.recv_group_sizes.sum()` are 0 (NaN
    with `poison`).
  """
  out = _buffer(rows=plan.buffer_rows, like=x, poison=poison)
  return ragged_all_to_all(
    x,
    out,
    *plan.dispatch_args,
    axis_name=axis_name,
    axis_index_groups=axis_index_groups,
    backend=backend,
  )


def combine(
  y,
  plan: RaggedPlan,
  *,
  num_rows: int,
  axis_name,
  axis_index_groups=None,
  poison: bool = False,
  backend: str | None = None,
):
  """Returns dispatched rows to where they came from (the reverse exchange; call inside shard_map).

  Args:
    y: `[plan.buffer_rows, ...]` rows in the dispatch's receive layout (e.g. expert outputs).
    plan: the plan used for the dispatch.
    num_rows: rows of the original `x`.
    axis_name: the mapped axis.
    axis_index_groups: the groups the plan was made with.
    poison: fill rows that come back from nowhere (dropped or unsent rows) with NaN.
    backend: see `ragged_all_to_all`.

  Returns:
    `[num_rows, ...]`; rows that were dropped or never sent are 0 (NaN with `poison`).
  """
  if y.shape[0] != plan.buffer_rows:
    raise ValueError(
      f"combine: y has {y.shape[0]} rows, the plan's buffer has "
      f"{plan.buffer_rows}; pass the dispatch's output layout."
    )
  out = _buffer(rows=num_rows, like=y, poison=poison)
  return ragged_all_to_all(
    y,
    out,
    *plan.combine_args,
    axis_name=axis_name,
    axis_index_groups=axis_index_groups,
    backend=backend,
  )
