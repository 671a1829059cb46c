"""Tests for pallas_moe.collectives: ragged_all_to_all (forward, VJP, JVP), EP helpers, errors."""

import functools
import re

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_moe import collectives as C

D = 8
GROUPINGS = {
  "none": None,
  "halves": ((0, 1, 2, 3), (4, 5, 6, 7)),
  "interleaved": ((0, 2, 4, 6), (1, 3, 5, 7)),
}
S, N, M, F = 2, 48, 56, 2  # chunks per peer, operand rows, output rows, features
MODES = ["random", "sparse", "one_sender", "one_receiver", "all_zero"]


def _mesh(n=D):
  return jax.make_mesh(
    (n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
  )


def _groups_list(groups, d=D):
  return [list(g) for g in (groups or (tuple(range(d)),))]


def _place(rng, sizes, rows):
  """Random non-overlapping placement of chunks in `rows` rows, gaps between, random order.

  Zero-size chunks get adversarial offsets: 0, `rows`, or another chunk's start.
  """
  order = rng.permutation(len(sizes))
  free = rows - int(sizes.sum())
  gaps = rng.multinomial(free, np.ones(len(sizes) + 1) / (len(sizes) + 1))
  off = np.zeros(len(sizes), np.int32)
  at = 0
  for j, i in enumerate(order):
    at += gaps[j]
    off[i] = at
    at += sizes[i]
  starts = [0, rows] + [int(o) for o, z in zip(off, sizes, strict=True) if z]
  for i in np.flatnonzero(sizes == 0):
    off[i] = rng.choice(starts)
  return off


def _case(seed, *, mode, groups, n=N, m=M, max_count=3, d=D):
  """Global arguments [d, ...] of one valid ragged_all_to_all call on `d` devices."""
  rng = np.random.default_rng(seed)
  glist = _groups_list(groups, d)
  g = len(glist[0])
  k = g * S
  # NOTE: counts[src, dst_pos*S + e] = rows src sends to its group's member dst_pos, slot e.
  counts = rng.integers(0, max_count + 1, (d, k)).astype(np.int32)
  if mode == "sparse":
    counts *= rng.random((d, k)) < 0.3
  elif mode == "one_sender":
    counts[np.arange(d) != rng.integers(d)] = 0
  elif mode == "one_receiver":
    dst = rng.integers(g)
    keep = np.zeros(k, bool)
    keep[dst * S : (dst + 1) * S] = True
    counts[:, ~keep] = 0
  elif mode == "all_zero":
    counts[:] = 0
  in_off = np.stack([_place(rng, counts[i], n) for i in range(d)])
  out_off = np.zeros((d, k), np.int32)
  recv = np.zeros((d, k), np.int32)
  for grp in glist:
    for q, dst in enumerate(grp):
      # NOTE: chunk (src_pos p, slot e) arriving at dst is counts[grp[p], q*S + e].
      got = np.array([counts[grp[p], q * S + e] for p in range(g) for e in range(S)])
      recv[dst] = got
      where = _place(rng, got, m)
      for p in range(g):
        out_off[grp[p], q * S : (q + 1) * S] = where[p * S : (p + 1) * S]
  return dict(
    operand=rng.standard_normal((d, n, F)).astype(np.float32),
    output=rng.standard_normal((d, m, F)).astype(np.float32),
    input_offsets=in_off,
    send_sizes=counts,
    output_offsets=out_off,
    recv_sizes=recv,
    groups=groups,
  )


def _chunks(case):
  """(src, src_rows, dst, dst_rows) of every chunk, from the docstring's definition."""
  glist = _groups_list(case["groups"], len(case["operand"]))
  g = len(glist[0])
  for grp in glist:
    for q, dst in enumerate(grp):
      for i in range(g * S):
        src = grp[i // S]
        k = q * S + i % S  # NOTE: the sender's chunk index for this received chunk
        size = case["recv_sizes"][dst, i]
        a, b = case["input_offsets"][src, k], case["output_offsets"][src, k]
        yield src, slice(a, a + size), dst, slice(b, b + size)


def _model_forward(case):
  out = case["output"].copy()
  for src, rs, dst, rd in _chunks(case):
    out[dst, rd] = case["operand"][src, rs]
  return out


def _model_vjp(case, ct):
  d_operand = np.zeros_like(case["operand"])
  d_output = ct.copy()
  for src, rs, dst, rd in _chunks(case):
    d_operand[src, rs] += ct[dst, rd]
  for _, _, dst, rd in _chunks(case):
    d_output[dst, rd] = 0
  return d_operand, d_output


@functools.cache
def _op(groups, backend=None):
  """jit(shard_map(ragged_all_to_all)) over global [D*rows, ...] arrays."""
  mesh = _mesh()
  fn = functools.partial(
    C.ragged_all_to_all,
    axis_name="x",
    backend=backend,
    axis_index_groups=None if groups is None else [list(g) for g in groups],
  )
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))


def _flat(case):
  return [case["operand"].reshape(-1, F), case["output"].reshape(-1, F)] + [
    case[k].reshape(-1) for k in ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
  ]


# --- 1. forward ---------------------------------------------------------------------------------


def test_docstring_example():
  """The two-device example of jax.lax.ragged_all_to_all's docstring (two groups of 2 here)."""
  groups = ((0, 1), (2, 3), (4, 5), (6, 7))
  mesh = _mesh()
  fn = functools.partial(
    C.ragged_all_to_all, axis_name="x", axis_index_groups=[list(g) for g in groups]
  )
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
  rep = lambda a, b: np.array([a, b] * 4, np.float32 if len(a) > 2 else np.int32).reshape(-1)
  out = f(
    rep([1, 2, 2], [3, 4, 0]),
    np.zeros(32, np.float32),
    rep([0, 1], [0, 1]),
    rep([1, 2], [1, 1]),
    rep([0, 0], [1, 2]),
    rep([1, 1], [2, 1]),
  )
  np.testing.assert_array_equal(
    np.asarray(out).reshape(4, 2, 4), [[[1, 3, 0, 0], [2, 2, 4, 0]]] * 4
  )


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(MODES))
def test_forward_matches_numpy(grouping, seed, mode):
  case = _case(seed, mode=mode, groups=GROUPINGS[grouping])
  out = _op(case["groups"])(*_flat(case))
  np.testing.assert_array_equal(np.asarray(out).reshape(D, M, F), _model_forward(case))


@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(MODES))
def test_forward_matches_numpy_padded_chunk_path(seed, mode):
  """M < N / S: the CPU path sends S chunks padded to M rows instead of the whole operand."""
  case = _case(seed, mode=mode, groups=GROUPINGS["interleaved"], m=20, max_count=2)
  out = _op(case["groups"])(*_flat(case))
  np.testing.assert_array_equal(np.asarray(out).reshape(D, 20, F), _model_forward(case))
  ct = np.random.default_rng(seed).standard_normal((D, 20, F)).astype(np.float32)
  d_operand, d_output = _vjp_fn(case["groups"])(ct.reshape(-1, F), *_flat(case))
  want_operand, want_output = _model_vjp(case, ct)
  np.testing.assert_array_equal(np.asarray(d_operand).reshape(D, N, F), want_operand)
  np.testing.assert_array_equal(np.asarray(d_output).reshape(D, 20, F), want_output)


# --- 2. gradients -------------------------------------------------------------------------------


@functools.cache
def _vjp_fn(groups):
  op = _op(groups)

  def f(operand, output, *idx):
    out, pullback = jax.vjp(lambda a, b: op(a, b, *idx), operand, output)
    return out, pullback

  @jax.jit
  def g(ct, operand, output, *idx):
    return f(operand, output, *idx)[1](ct)

  return g


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(MODES))
def test_vjp_matches_numpy(grouping, seed, mode):
  case = _case(seed, mode=mode, groups=GROUPINGS[grouping])
  ct = np.random.default_rng(seed + 1).standard_normal((D, M, F)).astype(np.float32)
  d_operand, d_output = _vjp_fn(case["groups"])(ct.reshape(D * M, F), *_flat(case))
  want_operand, want_output = _model_vjp(case, ct)
  np.testing.assert_array_equal(np.asarray(d_operand).reshape(D, N, F), want_operand)
  np.testing.assert_array_equal(np.asarray(d_output).reshape(D, M, F), want_output)


def _hand_case():
  """Device 0 receives 2 rows from device 1 at rows 0..1 and an EMPTY chunk from device 2 that
  also starts at row 0; every other chunk is empty and starts at row 4 (= M, the buffer's end).
  """
  n = m = 4
  k = D  # one chunk per peer
  in_off = np.zeros((D, k), np.int32)
  send = np.zeros((D, k), np.int32)
  out_off = np.full((D, k), m, np.int32)
  send[1, 0] = 2  # device 1 sends operand rows 0..1 to device 0 ...
  out_off[1, 0] = 0  # ... at rows 0..1
  out_off[2, 0] = 0  # device 2 sends 0 rows to device 0 at row 0
  recv = send.T.copy()  # NOTE: recv[dst, src] = send[src, dst]
  operand = np.arange(D * n, dtype=np.float32).reshape(D * n, 1) + 100
  output = np.zeros((D * m, 1), np.float32)
  idx = [a.reshape(-1) for a in (in_off, send, out_off, recv)]
  return operand, output, *idx


def test_zero_size_chunk_at_shared_offset_hand_worked():
  """The case where JAX's transpose rule is wrong; expected values worked out by hand."""
  operand, output, *idx = _hand_case()
  ct = np.arange(D * 4, dtype=np.float32).reshape(D * 4, 1) + 1  # ct[0] = [1, 2, 3, 4]
  out, pullback = jax.vjp(lambda a, b: _op(None)(a, b, *idx), operand, output)
  d_operand, d_output = pullback(ct)
  # Forward: device 0's rows 0..1 are device 1's operand rows 0..1 (values 104, 105).
  np.testing.assert_array_equal(np.asarray(out)[:4, 0], [104, 105, 0, 0])
  # Output cotangent on device 0: rows 0..1 were written (-> 0), rows 2..3 pass through (3, 4).
  np.testing.assert_array_equal(np.asarray(d_output)[:4, 0], [0, 0, 3, 4])
  np.testing.assert_array_equal(np.asarray(d_output)[4:], ct[4:])  # nothing written elsewhere
  # Operand cotangent: device 1's rows 0..1 get ct[0][0..1] = 1, 2; all else 0.
  want = np.zeros(D * 4, np.float32)
  want[4:6] = [1, 2]
  np.testing.assert_array_equal(np.asarray(d_operand)[:, 0], want)
  # JAX's mask: .at[off].set(1).at[off+size].add(-1) then cumsum, with device 0's received
  # offsets [0, 0, 4, ...] and sizes [2, 0, 0, ...] (indices past the end are dropped).
  recv_off, recv_size = np.array([0, 0] + [4] * 6), np.array([2] + [0] * 7)
  mask = np.zeros(4, np.int32)
  mask[recv_off[recv_off < 4]] = 1
  np.add.at(mask, (recv_off + recv_size)[(recv_off + recv_size) < 4], -1)
  jax_d_output = np.where(np.cumsum(mask) != 0, 0, ct[:4, 0])
  np.testing.assert_array_equal(jax_d_output, [1, 2, 0, 0])  # exactly backwards


@pytest.mark.parametrize("grouping", ["none", "interleaved"])
def test_check_grads_fwd_and_rev(grouping):
  case = _case(7, mode="random", groups=GROUPINGS[grouping])
  operand, output, *idx = _flat(case)
  op = _op(case["groups"])
  jax.test_util.check_grads(
    lambda a, b: op(a, b, *idx),
    (operand, output),
    order=1,
    modes=("fwd", "rev"),
    atol=1e-2,
    rtol=1e-2,
  )


def test_jvp_is_the_op_on_tangents():
  case = _case(3, mode="sparse", groups=None)
  operand, output, *idx = _flat(case)
  op = _op(None)
  t_operand = np.ones_like(operand)
  t_output = -np.ones_like(output)
  _, tangent = jax.jvp(lambda a, b: op(a, b, *idx), (operand, output), (t_operand, t_output))
  np.testing.assert_array_equal(tangent, op(t_operand, t_output, *idx))


def test_grad_under_jit():
  case = _case(11, mode="random", groups=GROUPINGS["halves"])
  operand, output, *idx = _flat(case)
  op = _op(case["groups"])
  w = np.random.default_rng(0).standard_normal(output.shape).astype(np.float32)
  loss = lambda a, b: jnp.sum(jnp.sin(op(a, b, *idx)) * w)
  g = jax.jit(jax.grad(loss, argnums=(0, 1)))(operand, output)
  out = np.asarray(op(operand, output, *idx))
  want_operand, want_output = _model_vjp(case, (np.cos(out) * w).reshape(D, M, F))
  np.testing.assert_allclose(np.asarray(g[0]).reshape(D, N, F), want_operand, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g[1]).reshape(D, M, F), want_output, rtol=1e-6)


def test_transpose_of_transpose_is_the_op():
  """The transpose is built from the same linear op, so transposing twice gives the op back."""
  case = _case(13, mode="sparse", groups=GROUPINGS["interleaved"])
  operand, output, *idx = _flat(case)
  f = lambda ab: _op(case["groups"])(ab[0], ab[1], *idx)
  f_t = jax.linear_transpose(f, (operand, output))
  f_tt = jax.linear_transpose(lambda ct: f_t(ct)[0], output)
  np.testing.assert_array_equal(
    np.asarray(f_tt((operand, output))[0]), np.asarray(f((operand, output)))
  )


def test_grad_through_scan_and_checkpoint():
  """As a layer stack would use it: jax.checkpoint inside lax.scan, differentiated."""
  case = _case(17, mode="random", groups=None)
  operand, output, *idx = _flat(case)

  def body(x, out, *idx):
    layer = jax.checkpoint(lambda h: C.ragged_all_to_all(h, out, *idx, axis_name="x")[:N] * 2)
    return jax.lax.scan(lambda h, _: (layer(h), None), x, None, length=2)[0]

  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("x"),) * 6, out_specs=P("x")))
  got = jax.jit(jax.grad(lambda x: jnp.sum(f(x, output, *idx) ** 2)))(operand)
  ref = lambda x: _op(None)(x, output, *idx).reshape(D, M, F)[:, :N].reshape(-1, F) * 2
  want = jax.grad(lambda x: jnp.sum(ref(ref(x)) ** 2))(operand)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# --- 2b. vmap -----------------------------------------------------------------------------------

FIELDS = ("operand", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")
# NOTE: one mode per batch element, so the elements' sizes differ and element 1 sends nothing.
VMAP_MODES = ("random", "all_zero", "sparse")
B = len(VMAP_MODES)
ALL_BATCHED = (0,) * 6


def _batch_cases(seed, *, d, groups=None, shared=()):
  """`B` cases on `d` devices; the fields in `shared` are element 0's in every element."""
  cases = [_case(seed + b, mode=mode, groups=groups, d=d) for b, mode in enumerate(VMAP_MODES)]
  for case in cases[1:]:
    case.update({name: cases[0][name] for name in shared})
  return cases


def _global(values, bdim):
  """Global array and in_spec of one argument from its `B` per-element `[d, rows, ...]` values.

  `bdim` is where the batch axis sits in each device's shard (None: unbatched, element 0's value).
  """
  if bdim is None:
    return values[0].reshape((-1,) + values[0].shape[2:]), P("x")
  x = np.stack(values, axis=2)  # NOTE: [d, rows, B, ...]
  x = x.reshape((-1,) + x.shape[2:])  # NOTE: [d*rows, B, ...], device shards along axis 0
  return (np.moveaxis(x, 1, 0), P(None, "x")) if bdim == 0 else (x, P("x"))


def _vmapped_args(cases, bdims):
  pairs = [_global([c[f] for c in cases], bd) for f, bd in zip(FIELDS, bdims, strict=True)]
  return [a for a, _ in pairs], tuple(s for _, s in pairs)


def _exchange(groups):
  return functools.partial(
    C.ragged_all_to_all,
    axis_name="x",
    axis_index_groups=None if groups is None else [list(g) for g in groups],
  )


@functools.cache
def _vmapped_op(d, groups, bdims, specs):
  body = jax.vmap(_exchange(groups), in_axes=bdims)
  f = jax.shard_map(body, mesh=_mesh(d), in_specs=specs, out_specs=P(None, "x"))
  return jax.jit(f)


@functools.cache
def _unbatched_op(d, groups):
  f = jax.shard_map(_exchange(groups), mesh=_mesh(d), in_specs=(P("x"),) * 6, out_specs=P("x"))
  return jax.jit(f)


@pytest.mark.parametrize(
  "d, groups, bdims, shared",
  [
    (2, None, ALL_BATCHED, ()),
    (8, None, ALL_BATCHED, ()),
    (4, ((0, 2), (1, 3)), ALL_BATCHED, ()),
    (4, None, (0, 0, None, None, None, None), FIELDS[2:]),
    (4, None, (None, None, 0, 0, 0, 0), FIELDS[:2]),
    (4, None, (1, 1, 1, 1, 1, 1), ()),
    (4, None, (None, 1, 0, None, 1, 0), ("operand",) + FIELDS[2:]),
  ],
  ids=[
    "d2",
    "d8",
    "d4_groups",
    "operand_batched_sizes_not",
    "sizes_batched_operand_not",
    "batch_axis_second",
    "per_array_mix",
  ],
)
def test_vmap_is_the_exchange_per_element(d, groups, bdims, shared):
  """vmap(ragged_all_to_all)[b] == the unbatched exchange of element b (and the numpy model)."""
  cases = _batch_cases(5, d=d, groups=groups, shared=shared)
  args, specs = _vmapped_args(cases, bdims)
  out = np.asarray(_vmapped_op(d, groups, bdims, specs)(*args)).reshape(B, d, M, F)
  unbatched = _unbatched_op(d, groups)
  for b, case in enumerate(cases):
    np.testing.assert_array_equal(out[b], np.asarray(unbatched(*_flat(case))).reshape(d, M, F))
    np.testing.assert_array_equal(out[b], _model_forward(case))


@functools.cache
def _vmapped_grads(d, bdims, specs, grad_outside):
  """Gradients w.r.t. operand and output of sum(vmap(op) * ct), grad outside or inside vmap."""
  exchange = _exchange(None)
  loss = lambda a, o, ct, *idx: jnp.sum(exchange(a, o, *idx) * ct)
  ct_spec = P(None, "x")
  mesh = _mesh(d)
  if grad_outside:
    body = jax.vmap(
      lambda a, o, ct, *idx: exchange(a, o, *idx) * ct, in_axes=(*bdims[:2], 0, *bdims[2:])
    )
    op = jax.shard_map(
      body, mesh=mesh, in_specs=(*specs[:2], ct_spec, *specs[2:]), out_specs=ct_spec
    )
    return jax.jit(jax.grad(lambda *a: jnp.sum(op(*a)), argnums=(0, 1)))
  body = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(*bdims[:2], 0, *bdims[2:]))
  op = jax.shard_map(
    body, mesh=mesh, in_specs=(*specs[:2], ct_spec, *specs[2:]), out_specs=(ct_spec, ct_spec)
  )
  return jax.jit(op)


@pytest.mark.parametrize("grad_outside", [True, False], ids=["grad_of_vmap", "vmap_of_grad"])
@pytest.mark.parametrize(
  "bdims, shared",
  [(ALL_BATCHED, ()), ((None, None, 0, 0, 0, 0), FIELDS[:2])],
  ids=["all_batched", "operand_output_unbatched"],
)
def test_vmap_gradients_per_element(bdims, shared, grad_outside):
  """Gradients under vmap are the per-element VJPs; an unbatched operand/output (shared by all
  elements) gets their sum when differentiated outside the vmap."""
  d = 4
  cases = _batch_cases(9, d=d, shared=shared)
  args, specs = _vmapped_args(cases, bdims)
  cts = np.random.default_rng(0).standard_normal((B, d, M, F)).astype(np.float32)
  d_operand, d_output = _vmapped_grads(d, bdims, specs, grad_outside)(
    *args[:2], cts.reshape(B, d * M, F), *args[2:]
  )
  want = [_model_vjp(case, ct) for case, ct in zip(cases, cts, strict=True)]
  for got, i, rows in ((d_operand, 0, N), (d_output, 1, M)):
    if grad_outside and bdims[i] is None:
      np.testing.assert_allclose(
        np.asarray(got).reshape(d, rows, F), sum(w[i] for w in want), rtol=1e-6, atol=1e-6
      )
    else:
      np.testing.assert_array_equal(
        np.asarray(got).reshape(B, d, rows, F), np.stack([w[i] for w in want])
      )


def test_nested_vmap_of_dispatch_and_combine():
  """Pipeline stages x microbatches as two vmaps around an EP dispatch -> combine round trip.

  NOTE: forward only (a gradient would double the compile time); gradients under vmap are
  checked per element by test_vmap_gradients_per_element.
  """
  d, t, e = 2, 4, 4
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 2, d * t, F)).astype(np.float32)
  # NOTE: per (stage, microbatch, device): t rows sorted by expert, random expert counts.
  sizes = rng.multinomial(t, np.ones(e) / e, size=(2, 2, d)).astype(np.int32).reshape(2, 2, -1)

  def roundtrip(x, group_sizes):
    plan = C.plan_from_group_sizes(group_sizes, axis_name="x", buffer_rows=d * t)
    y = C.dispatch(x, plan, axis_name="x")
    return C.combine(y * 2, plan, num_rows=t, axis_name="x")

  spec = P(None, None, "x")
  f = jax.shard_map(jax.vmap(jax.vmap(roundtrip)), mesh=_mesh(d), in_specs=spec, out_specs=spec)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, sizes)), 2 * x)


def test_vmap_over_the_exchange_axis_is_refused():
  """Exchanging over the vmapped axis itself is not supported: a clear error names axis_name."""
  f = jax.vmap(lambda x, o, *idx: C.ragged_all_to_all(x, o, *idx, axis_name="b"), axis_name="b")
  idx = [np.zeros((2, 2), np.int32)] * 4
  with pytest.raises(ValueError, match="axis_name='b' names the axis of the enclosing `jax.vmap`"):
    f(np.zeros((2, 4, 1), np.float32), np.zeros((2, 4, 1), np.float32), *idx)


# --- 3./4. expert-parallel helpers --------------------------------------------------------------


def _routing(seed, *, d, tokens, top_k, experts, adversarial):
  rng = np.random.default_rng(seed)
  if adversarial:  # NOTE: every token to experts of one device (its top_k distinct experts).
    e_local = experts // d
    target = rng.integers(d)
    pick = np.stack([rng.permutation(e_local)[:top_k] for _ in range(d * tokens)])
    return (target * e_local + pick).reshape(d, tokens, top_k).astype(np.int32)
  return np.stack(
    [[rng.permutation(experts)[:top_k] for _ in range(tokens)] for _ in range(d)]
  ).astype(np.int32)


@functools.cache
def _ep_roundtrip(d, *, tokens, top_k, experts, buffer_rows, poison):
  """jit(shard_map): sort rows by expert, dispatch, scale by (1 + global expert), combine."""
  e_local = experts // d

  def body(x, expert_ids):
    rows = jnp.repeat(x, top_k, axis=0)  # NOTE: row t*top_k + j is token t's j-th copy
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    plan = C.plan_from_group_sizes(group_sizes, axis_name="x", buffer_rows=buffer_rows)
    buf = C.dispatch(rows[order], plan, axis_name="x", poison=poison)
    # NOTE: received rows are sorted by local expert: row r belongs to the local expert whose
    # cumulative group-size range holds r.
    local = jnp.searchsorted(
      jnp.cumsum(plan.recv_group_sizes), jnp.arange(buffer_rows), side="right"
    )
    expert = jax.lax.axis_index("x") * e_local + local
    y = buf * (1.0 + expert[:, None].astype(buf.dtype))
    back = C.combine(y, plan, num_rows=rows.shape[0], axis_name="x", poison=poison)
    out = jnp.zeros_like(back).at[order].set(back)
    return (
      out,
      buf,
      plan.num_dropped[None],
      plan.num_unsent[None],
      plan.needed_rows[None],
      plan.recv_group_sizes,
    )

  return jax.jit(
    jax.shard_map(body, mesh=_mesh(d), in_specs=(P("x"), P("x")), out_specs=(P("x"),) * 6)
  )


def _counts(expert_ids, experts):
  return np.stack([np.bincount(e.reshape(-1), minlength=experts) for e in expert_ids])


@pytest.mark.parametrize("d", [2, 4, 8])
@settings(max_examples=max(3, settings().max_examples // 3))  # NOTE: a compile per buffer size
@given(seed=st.integers(0, 2**32 - 1), adversarial=st.booleans())
def test_dispatch_combine_roundtrip_exact(d, seed, adversarial):
  tokens, top_k, experts = 6, 2, 2 * d
  ids = _routing(seed, d=d, tokens=tokens, top_k=top_k, experts=experts, adversarial=adversarial)
  counts = _counts(ids, experts)
  policy = C.BufferPolicy.exact(counts)
  rows = policy.rows(tokens_per_device=tokens, top_k=top_k, axis_size=d)
  assert rows == max(1, counts.reshape(d, d, -1).sum(axis=(0, 2)).max())
  x = np.random.default_rng(seed).standard_normal((d * tokens, 3)).astype(np.float32)
  out, _, dropped, unsent, needed, recv = _ep_roundtrip(
    d, tokens=tokens, top_k=top_k, experts=experts, buffer_rows=rows, poison=True
  )(x, ids.reshape(d * tokens, top_k))
  want = np.repeat(x, top_k, axis=0) * (1.0 + ids.reshape(-1, 1))
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
  assert not np.asarray(dropped).any() and not np.asarray(unsent).any()
  assert (np.asarray(needed) == counts.reshape(d, d, -1).sum(axis=(0, 2)).max()).all()
  np.testing.assert_array_equal(np.asarray(recv), counts.sum(axis=0))


@pytest.mark.parametrize("adversarial", [True, False])
def test_overflow_drops_are_counted_and_clipped(adversarial):
  d, tokens, top_k, experts = 4, 6, 2, 8
  ids = _routing(5, d=d, tokens=tokens, top_k=top_k, experts=experts, adversarial=adversarial)
  counts = _counts(ids, experts)
  wanted = counts.reshape(d, d, -1).sum(axis=(0, 2))  # rows each device wants to receive
  rows = int(wanted.max()) - 5
  x = np.random.default_rng(1).standard_normal((d * tokens, 3)).astype(np.float32)
  out, buf, dropped, unsent, needed, recv = _ep_roundtrip(
    d, tokens=tokens, top_k=top_k, experts=experts, buffer_rows=rows, poison=True
  )(x, ids.reshape(d * tokens, top_k))
  np.testing.assert_array_equal(np.asarray(dropped), np.maximum(wanted - rows, 0))
  n_dropped = np.maximum(wanted - rows, 0).sum()
  assert np.asarray(unsent).sum() == np.asarray(dropped).sum() == n_dropped >= 5
  assert (np.asarray(needed) == wanted.max()).all()
  # NOTE: numpy model of the receive layout (local expert, then sender), clipped to `rows`.
  rep = np.repeat(x.reshape(d, tokens, 3), top_k, axis=1)
  flat_ids = ids.reshape(d, -1)
  buf = np.asarray(buf).reshape(d, rows, 3)
  out = np.asarray(out).reshape(d, tokens * top_k, 3)
  delivered = np.zeros((d, tokens * top_k), bool)
  for dst in range(d):
    layout = [
      (src, r)
      for e in range(dst * 2, dst * 2 + 2)
      for src in range(d)
      for r in np.flatnonzero(flat_ids[src] == e)
    ]
    kept = layout[:rows]
    want_rows = np.array([rep[s, r] for s, r in kept]).reshape(-1, 3)
    np.testing.assert_array_equal(buf[dst, : len(kept)], want_rows)
    assert np.isnan(buf[dst, len(kept) :]).all()  # poison: rows nobody wrote
    for s, r in kept:
      delivered[s, r] = True
  want = rep * (1.0 + flat_ids[..., None])
  np.testing.assert_allclose(out[delivered], want[delivered], rtol=1e-6)
  assert np.isnan(out[~delivered]).all() and (~delivered).sum() == n_dropped


@pytest.mark.parametrize("grouping", ["halves", "interleaved"])
def test_plan_from_send_counts_with_groups(grouping):
  groups = [list(g) for g in GROUPINGS[grouping]]
  g, n = 4, 24
  counts = np.random.default_rng(2).integers(0, 4, (D, g * S)).astype(np.int32)
  rows = C.exact_buffer_rows(counts, axis_index_groups=groups)
  x = np.random.default_rng(3).standard_normal((D, n, F)).astype(np.float32)

  def body(x, c):
    plan = C.plan_from_send_counts(c, axis_name="x", buffer_rows=rows, axis_index_groups=groups)
    buf = C.dispatch(x, plan, axis_name="x", axis_index_groups=groups)
    back = C.combine(buf, plan, num_rows=n, axis_name="x", axis_index_groups=groups)
    return buf, back, plan.num_dropped[None]

  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=P("x")))
  buf, back, dropped = f(x.reshape(D * n, F), counts.reshape(-1))
  assert not np.asarray(dropped).any()
  sent = np.cumsum(counts, axis=1)[:, -1]
  for d in range(D):
    np.testing.assert_array_equal(np.asarray(back).reshape(D, n, F)[d, : sent[d]], x[d, : sent[d]])
  # NOTE: receiver layout is (slot, sender position); sender chunks start at cumsum of counts.
  starts = np.cumsum(counts, axis=1) - counts
  for grp in groups:
    for q, dst in enumerate(grp):
      want = [
        x[src, starts[src, q * S + e] + j]
        for e in range(S)
        for src in grp
        for j in range(counts[src, q * S + e])
      ]
      got = np.asarray(buf).reshape(D, rows, F)[dst, : len(want)]
      np.testing.assert_array_equal(got, np.array(want).reshape(-1, F))


def test_buffer_policy_rows():
  kw = dict(tokens_per_device=100, top_k=2, axis_size=8)
  assert C.BufferPolicy.worst_case().rows(**kw) == 1600
  assert C.BufferPolicy.factor(1.25, multiple_of=128).rows(**kw) == 256
  assert C.BufferPolicy.factor(100.0).rows(**kw) == 1600  # capped at the worst case
  assert C.BufferPolicy.fixed(77).rows(**kw) == 77
  counts = np.zeros((2, 4), np.int32)
  counts[:, :2] = 3  # both devices send 6 rows to device 0
  assert C.exact_buffer_rows(counts) == 12
  assert C.BufferPolicy.exact(counts, multiple_of=8).rows(**kw) == 16


# --- 5. bad input -------------------------------------------------------------------------------


def _call_with(**over):
  """Calls the op inside shard_map with numpy (concrete) offsets, overriding some arguments."""
  k = D
  args = dict(
    operand=np.zeros((N, F), np.float32),
    output=np.zeros((M, F), np.float32),
    input_offsets=np.zeros(k, np.int32),
    send_sizes=np.zeros(k, np.int32),
    output_offsets=np.zeros(k, np.int32),
    recv_sizes=np.zeros(k, np.int32),
  )
  kwargs = dict(axis_name="x")
  for name, v in over.items():
    (args if name in args else kwargs)[name] = v

  def body(a, b):
    return C.ragged_all_to_all(a, b, *list(args.values())[2:], **kwargs)

  f = jax.shard_map(body, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"))
  return jax.jit(f)(np.tile(args["operand"], (D, 1)), np.tile(args["output"], (D, 1)))


@pytest.mark.parametrize(
  "over, err, match",
  [
    (dict(send_sizes=np.array([-1] + [0] * 7, np.int32)), ValueError, "send_sizes has negative"),
    (dict(recv_sizes=np.array([0] * 7 + [-2], np.int32)), ValueError, "recv_sizes has negative"),
    (dict(input_offsets=np.full(8, -1, np.int32)), ValueError, "input_offsets has negative"),
    (
      dict(input_offsets=np.full(8, N - 1, np.int32), send_sizes=np.full(8, 2, np.int32)),
      ValueError,
      "run past the operand",
    ),
    (
      dict(output_offsets=np.full(8, M - 1, np.int32), send_sizes=np.full(8, 2, np.int32)),
      ValueError,
      "run past the receiver",
    ),
    (dict(input_offsets=np.zeros(8, np.float32)), TypeError, "input_offsets must have an integer"),
    (dict(output_offsets=np.zeros(8, np.float32)), TypeError, "output_offsets must have an int"),
    (
      dict(
        input_offsets=np.zeros(12, np.int32),
        send_sizes=np.zeros(12, np.int32),
        output_offsets=np.zeros(12, np.int32),
        recv_sizes=np.zeros(12, np.int32),
      ),
      ValueError,
      "length 12, which is not a multiple",
    ),
    (dict(recv_sizes=np.zeros(16, np.int32)), ValueError, "same length"),
    (
      dict(input_offsets=np.zeros((2, 4), np.int32)),
      ValueError,
      "input_offsets must be a non-empty",
    ),
    (dict(axis_name="y"), ValueError, "axis_name='y' is not bound"),
    (dict(axis_index_groups=[[0, 1, 2], [3, 4, 5, 6, 7]]), ValueError, "same size"),
    (dict(axis_index_groups=[[0, 1, 2, 3], [3, 4, 5, 6]]), ValueError, "exactly once"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
    (dict(output=np.zeros((M, F + 1), np.float32)), ValueError, "trailing dimensions"),
    (dict(output=np.zeros((M, F), np.int32)), TypeError, "dtype"),
  ],
)
def test_bad_input(over, err, match):
  with pytest.raises(err, match=match):
    _call_with(**over)


def test_bad_input_group_length():
  """With two groups of 4, the length must be a multiple of 4, not of 8."""
  with pytest.raises(ValueError, match="group size"):
    _call_with(
      axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]],
      **{
        k: np.zeros(6, np.int32)
        for k in ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
      },
    )


def _plan_with(counts, **kwargs):
  kwargs.setdefault("buffer_rows", 8)
  f = lambda c: C.plan_from_group_sizes(c, axis_name="x", **kwargs).num_dropped[None]
  return jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("x"), out_specs=P("x")))(counts)


def test_bad_helper_input():
  with pytest.raises(ValueError, match="num_experts=12 .* divisible by the 8"):
    _plan_with(np.zeros(D * 12, np.int32))
  with pytest.raises(TypeError, match="buffer_rows must be a static Python int"):
    _plan_with(np.zeros(D * 8, np.int32), buffer_rows=8.0)
  with pytest.raises(TypeError, match="group_sizes must have an integer dtype"):
    _plan_with(np.zeros(D * 8, np.float32))
  with pytest.raises(ValueError, match="send_counts has negative"):
    jax.jit(
      jax.shard_map(
        lambda _: C.plan_from_send_counts(
          np.array([-1] + [0] * 7, np.int32), axis_name="x", buffer_rows=4
        ).num_dropped[None],
        mesh=_mesh(),
        in_specs=P("x"),
        out_specs=P("x"),
      )
    )(np.zeros(D))
  with pytest.raises(TypeError, match="concrete"):
    jax.jit(C.exact_buffer_rows)(np.zeros((2, 2), np.int32))
  with pytest.raises(ValueError, match="factor"):
    C.BufferPolicy.factor(-1.0)
  with pytest.raises(TypeError, match="poison=True needs a floating dtype"):
    C._buffer(rows=2, like=np.zeros((2, 2), np.int32), poison=True)


# --- 6. ahead-of-time TPU compile ---------------------------------------------------------------


@pytest.mark.aot
@pytest.mark.parametrize(
  "groups, backend, batch",
  [(None, None, None), ([[0, 1], [2, 3]], None, None), (None, "cpu", None), (None, None, 3)],
)
def test_grad_compiles_for_tpu(groups, backend, batch):
  """backend=None picks the native op when lowering for TPU, even from this CPU-only process.

  The forward and the reverse exchange each compile to one native `ragged-all-to-all`:
  synchronous with libtpu 0.0.42.1, a `ragged-all-to-all-start`/`-done` pair from libtpu 0.0.50
  (measured: 0.0.50.1, 0.0.52; `schedule.ragged_async_by_default`). backend="cpu" has none.
  Under `jax.vmap` (`batch` elements) the count is the same: the batch is folded into one exchange.
  """
  import os

  from jax.experimental import topologies

  from pallas_moe import schedule

  # NOTE: AOT only compiles; this lets it run while another process holds libtpu's lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  d = len(topo.devices)
  g = d if groups is None else len(groups[0])

  def body(x, out, *idx):
    return C.ragged_all_to_all(
      x, out, *idx, axis_name="x", axis_index_groups=groups, backend=backend
    )

  # NOTE: batched arguments are [batch, d * rows, ...], sharded along their second axis.
  lead, pspec = ((), P("x")) if batch is None else ((batch,), P(None, "x"))
  if batch is not None:
    body = jax.vmap(body)
  op = jax.shard_map(body, mesh=mesh, in_specs=(pspec,) * 6, out_specs=pspec)
  loss = lambda x, out, *idx: jnp.sum(op(x, out, *idx) ** 2)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(
    lead + shape, dtype, sharding=NamedSharding(mesh, pspec)
  )
  args = [spec((d * 16, 128), jnp.float32), spec((d * 32, 128), jnp.float32)]
  args += [spec((d * 2 * g,), jnp.int32)] * 4
  with jax.default_device(topo.devices[0]):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  hlo = compiled.as_text()
  # NOTE: an instruction's opcode follows its result type: `= <type> ragged-all-to-all-start(`
  # for an async exchange (its `-done` names the start), `= <type> ragged-all-to-all(` for a
  # synchronous one; instruction names carry a `.N` suffix instead of the parenthesis.
  ops = re.findall(r"\s(ragged-all-to-all(?:-start)?)\(", hlo)
  n_async, n_sync = ops.count("ragged-all-to-all-start"), ops.count("ragged-all-to-all")
  if backend == "cpu":
    assert (n_async, n_sync) == (0, 0), hlo
    assert hlo.count("collective-permute") >= 2, hlo  # forward and the reverse exchange
  elif schedule.ragged_async_by_default():
    assert (n_async, n_sync) == (2, 0), hlo
  else:
    assert (n_async, n_sync) == (0, 2), hlo
