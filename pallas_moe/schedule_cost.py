"""Analytic cost of the row-tile kernels' schedules: MXU work per sub-block dot, and the HBM
bytes of every grid step, including the manual per-group DMAs and which of them are exposed.

The cost model of docs/design.md ("The cost model": Σ over grid steps of max(MXU, DMA) + exposed DMA
+ per-step overhead) in closed form from the group sizes. `tile_pickers.pick_rowtile_tiling` scores
tilings with it, `pallas_moe.ops` asks `rows_stationary_pays` which MXU orientation a kernel runs,
and `bench.costmodel` shares `rowtile_manual_dma` with its hooks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pallas_moe.generations import (
  TpuGeneration,
  get_generation,
  min_pass_rows,
  pass_rows,
  sequential_sweeps,
  tensorcore_rates,
)
from pallas_moe.metadata import (
  group_pass_rows,
  merge_tail_rows,
  pass_align,
  pass_cut_rows,
  uses_pass_cuts,
)


def _dot_macs(*, rows: int, contract: int, cols: int, mxu: int, min_rows: int | None = None) -> int:
  """MACs one dot costs on an mxu x mxu systolic array (docs/design.md, "The cost model"; as in
  `bench.costmodel`): the stationary operand is cut into mxu x mxu tiles (contraction and output
  columns padded to the MXU), and each tile costs at least `min_rows` row passes (loading it takes
  as long; default mxu, `generations.min_pass_rows`)."""
  pad = lambda d: -(-d // mxu) * mxu  # noqa: E731
  return max(rows, mxu if min_rows is None else min_rows) * pad(contract) * pad(cols)


def rows_stationary_pays(
  *, kind: str, sub_m: int, tk: int, tn: int, generation: str | TpuGeneration
) -> bool:
  """Whether a row-tile kernel does less MXU work with its sub-block rows as the stationary
  operand (the kernels' `rows_stationary`: out^T = w^T @ x^T streams the tn columns as rows).

  The usual orientation streams the sub_m rows through [contraction, tn] weight tiles, so a tn
  that is not a multiple of the MXU width is padded to it (1408 -> 1536 on a 256-wide MXU:
  1.09x). Swapped, the rows are padded instead, and a sub_m that is a multiple of the MXU is not.
  Ties keep the usual orientation, which needs no transposes.

  Args:
    kind: "gmm" (contraction tk = the whole k; output [sub_m, tn]) or "tgmm" (contraction
      sub_m; output [tk, tn]).
    sub_m: rows per MXU pass.
    tk: gmm: k; tgmm: its k tile.
    tn: n tile.
    generation: TPU generation (its MXU edge).

  Returns:
    True when the swapped orientation costs strictly fewer MACs.
  """
  mxu = get_generation(generation).mxu_size
  floor = min_pass_rows(generation)
  if kind == "gmm":
    usual = _dot_macs(rows=sub_m, contract=tk, cols=tn, mxu=mxu, min_rows=floor)
    swapped = _dot_macs(rows=tn, contract=tk, cols=sub_m, mxu=mxu, min_rows=floor)
  elif kind == "tgmm":
    usual = _dot_macs(rows=tk, contract=sub_m, cols=tn, mxu=mxu, min_rows=floor)
    swapped = _dot_macs(rows=tn, contract=sub_m, cols=tk, mxu=mxu, min_rows=floor)
  else:
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  return swapped < usual


def _rowtile_pairs(
  starts: np.ndarray,
  ends: np.ndarray,
  *,
  tm: int,
  sub_m: int,
  align: int | None = None,
  cuts: dict[str, Any] | None = None,
  tail: int = 0,
):
  """The (group, tile) pairs a row-tile kernel multiplies, and the MXU rows of each.

  Args:
    starts: [groups] first row of each group (int64).
    ends: [groups] end row of each group.
    tm: m tile.
    sub_m: rows per MXU pass.
    align: the passes' alignment (`metadata.pass_align`); None: sub_m (the sub_m grid).
    cuts: gmm's pass-cut tiles (`metadata.pass_cut_rows(xp=np)`, in the coordinates of
      starts / ends); None: fixed m-tiles [t * tm, (t + 1) * tm).
    tail: gmm's widened last pass (`metadata.merge_tail_rows`; 0: none, as tgmm).

  Returns:
    (pair_g, pair_t, pair_rows), in group order (fixed tiles) or tile order (pass cuts): every
    non-empty group with each tile it has passes in, and the rows its passes push there
    (`metadata.group_pass_plan`: sub_m per pass, sub_m + tail for a widened last two). Tiles are
    m-tile indices, or pass-cut tile indices with cuts.
  """
  align = sub_m if align is None else align
  if cuts is not None:
    return _pass_cut_pairs(starts, ends, cuts=cuts, sub_m=sub_m, align=align, tail=tail, tm=tm)
  nonempty = ends > starts
  first_t = np.where(nonempty, starts // tm, 0)
  last_t = np.where(nonempty, (np.maximum(ends, 1) - 1) // tm, -1)
  counts = np.maximum(last_t - first_t + 1, 0)
  pair_g = np.repeat(np.arange(starts.size), counts)
  pair_t = np.repeat(first_t, counts) + (
    np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
  )
  lo = pair_t * tm
  s = np.maximum(starts[pair_g], lo) - lo
  e = np.minimum(ends[pair_g], lo + tm) - lo
  return pair_g, pair_t, group_pass_rows(s, e, sub_m=sub_m, align=align, tail=tail, tm=tm)


def _pass_cut_pairs(
  starts: np.ndarray, ends: np.ndarray, *, cuts, sub_m: int, align: int, tail: int, tm: int
):
  """`_rowtile_pairs` on pass-cut tiles: tile t's groups are tile_first_group[t] ..
  tile_last_group[t], and a group's passes there cover its rows in [tile_start[t],
  tile_start[t + 1]) as the kernel counts them (pairs without a pass are dropped)."""
  c = np.asarray(cuts["tile_start"], np.int64)
  num_tiles = int(np.asarray(cuts["num_tiles"]).reshape(-1)[0])
  first = np.asarray(cuts["tile_first_group"], np.int64)[:num_tiles]
  last = np.asarray(cuts["tile_last_group"], np.int64)[:num_tiles]
  counts = np.maximum(last - first + 1, 0)
  pair_t = np.repeat(np.arange(num_tiles), counts)
  pair_g = np.repeat(first, counts) + (
    np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
  )
  c0, c1 = c[pair_t], c[pair_t + 1]
  s = np.maximum(starts[pair_g], c0) - c0
  e = np.minimum(ends[pair_g], c1) - c0
  # NOTE: a widened last pass may reach the group's rows past the cut, as the kernel's.
  rows = group_pass_rows(
    s, e, sub_m=sub_m, align=align, tail=tail, tm=tm, cover_end=ends[pair_g] - c0
  )
  keep = (rows > 0) & (ends[pair_g] > starts[pair_g])
  return pair_g[keep], pair_t[keep], rows[keep]


def _sweep_pairs(
  *,
  starts: np.ndarray,
  ends: np.ndarray,
  tm: int,
  sub_m: int,
  kind: str,
  tiles_m: int,
  align: int | None,
  cuts: dict[str, Any] | None,
  tail: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
  """The work of one sweep as (tile, group) pairs in kernel order (tiles in order, groups in order
  within a tile), each with the MXU rows it pushes (`_rowtile_pairs`).

  Returns:
    (pair_g, pair_t, pair_rows, fin). fin: tgmm: [groups] the tile where each group is finalized
    (its output write starts after that pair); gmm: None.
  """
  nonempty = ends > starts
  pair_g, pair_t, pair_rows = _rowtile_pairs(
    starts, ends, tm=tm, sub_m=sub_m, align=align, cuts=cuts, tail=tail
  )
  fin = None
  if kind == "tgmm":
    # NOTE: tgmm also has a pair without work where an empty group is finalized (its zero output
    # is still written).
    fin = np.clip(np.where(nonempty, (ends - 1) // tm, starts // tm), 0, tiles_m - 1)
    empty = np.flatnonzero(~nonempty)
    pair_g = np.concatenate([pair_g, empty])
    pair_t = np.concatenate([pair_t, fin[empty]])
    pair_rows = np.concatenate([pair_rows, np.zeros(empty.size, np.int64)])
  order = np.lexsort((pair_g, pair_t))
  return pair_g[order], pair_t[order], pair_rows[order], fin


def _gmm_load_windows(*, pair_g: np.ndarray, pair_t: np.ndarray, tiles_m: int) -> tuple[list, ...]:
  """gmm's weight-load windows: (within, head_alone, tail_alone, cross), each a list of (first
  pair, end pair (exclusive), step that waits) over two consecutive sweeps' pairs.

  within: the loads inside a sweep; head_alone: a sweep's first load without sequential sweeps;
  tail_alone: none (no load is left unwaited at a sweep's end); cross: with sequential sweeps,
  the next sweep's first load, started in this one.
  """
  num_pairs = pair_g.size
  # NOTE: load r is waited at group r's first pair and started at group r - 1's first pair.
  # A group's first pair in kernel order is in the tile of its first pass (starts // tm with
  # fixed tiles; a pass-cut tile's index otherwise).
  _, first_pair = np.unique(pair_g, return_index=True)
  loads = first_pair.size
  within = [(first_pair[r - 1], first_pair[r], pair_t[first_pair[r]]) for r in range(1, loads)]
  # The first load of a sweep, started where it is waited for.
  head_alone = [(first_pair[0], first_pair[0], pair_t[first_pair[0]])] if loads else []
  # With sequential sweeps: started at the previous sweep's last group.
  cross = (
    [(first_pair[-1], num_pairs + first_pair[0], tiles_m + pair_t[first_pair[0]])] if loads else []
  )
  return within, head_alone, [], cross


def _tgmm_write_windows(
  *, pair_g: np.ndarray, pair_t: np.ndarray, fin: np.ndarray, tiles_m: int
) -> tuple[list, ...]:
  """tgmm's output-write windows: (within, head_alone, tail_alone, cross), each a list of (first
  pair, end pair (exclusive), step that waits) over two consecutive sweeps' pairs.

  within: writes waited for inside their sweep; head_alone: none; tail_alone: a sweep's last two
  writes, drained at its end without sequential sweeps; cross: with sequential sweeps, the same
  two, waited for in the next sweep.
  """
  num_groups = fin.size
  num_pairs = pair_g.size
  pair_key = pair_t * num_groups + pair_g
  # NOTE: write g is started after its finalize pair and waited at write g + 2's finalize
  # (after that pair's work), or at the drain after the sweep's (or the grid's) last pair.
  fin_pair = np.searchsorted(pair_key, fin * num_groups + np.arange(num_groups))
  within = [
    (fin_pair[g] + 1, fin_pair[g + 2] + 1, pair_t[fin_pair[g + 2]]) for g in range(num_groups - 2)
  ]
  last_two = range(max(num_groups - 2, 0), num_groups)
  tail_alone = [(fin_pair[g] + 1, num_pairs, tiles_m - 1) for g in last_two]
  if num_groups >= 2:
    cross = [
      (
        fin_pair[g] + 1,
        num_pairs + fin_pair[g + 2 - num_groups] + 1,
        tiles_m + pair_t[fin_pair[g + 2 - num_groups]],
      )
      for g in last_two
    ]
  else:
    # NOTE: a single group waits for the write two sweeps back; counted as if one sweep back.
    cross = [(fin_pair[0] + 1, 2 * num_pairs, 2 * tiles_m - 1)] if num_groups else []
  return within, [], tail_alone, cross


def _spread_windows(
  *,
  windows: tuple[list, ...],
  pair_t: np.ndarray,
  pair_rows: np.ndarray,
  tiles_m: int,
  block_bytes: float,
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per list of DMA windows: ([2 * tiles_m] overlapped, [2 * tiles_m] exposed) bytes over two
  consecutive sweeps' steps. A window's bytes are spread over its pairs in proportion to their
  MXU rows, or exposed in the step that waits where its pairs do no work."""
  # NOTE: two consecutive sweeps, for DMAs that cross from one into the next.
  step2 = np.concatenate([pair_t, pair_t + tiles_m])
  cum2 = np.concatenate([[0], np.cumsum(np.concatenate([pair_rows, pair_rows]))]).astype(np.float64)
  rows2 = np.concatenate([pair_rows, pair_rows]).astype(np.float64)
  spread = []
  for dmas in windows:
    over = np.zeros(2 * tiles_m)
    exposed = np.zeros(2 * tiles_m)
    for i, j, wait_step in dmas:
      work = cum2[j] - cum2[i]
      if work > 0:
        np.add.at(over, step2[i:j], block_bytes * rows2[i:j] / work)
      else:
        exposed[wait_step] += block_bytes
    spread.append((over, exposed))
  return spread


def _sweeps_dma_bytes(
  *,
  within: tuple[np.ndarray, np.ndarray],
  head_alone: tuple[np.ndarray, np.ndarray],
  tail_alone: tuple[np.ndarray, np.ndarray],
  cross: tuple[np.ndarray, np.ndarray],
  sweeps: int,
  tiles_m: int,
  sequential_sweeps: bool,
) -> tuple[np.ndarray, np.ndarray]:
  """(overlapped, exposed), each [sweeps, tiles_m]: the spread windows (`_spread_windows`) laid
  over the grid's sweeps."""
  w_over, w_exp = within
  h_over, h_exp = head_alone
  t_over, t_exp = tail_alone
  c_over, c_exp = cross
  over = np.zeros((sweeps, tiles_m))
  exposed = np.zeros((sweeps, tiles_m))
  over += w_over[:tiles_m]
  exposed += w_exp[:tiles_m]
  if not sequential_sweeps:
    # NOTE: every sweep is a chain of its own: its first load and its last writes stand alone.
    over += h_over[:tiles_m] + t_over[:tiles_m]
    exposed += h_exp[:tiles_m] + t_exp[:tiles_m]
  else:
    # NOTE: one chain over the grid: only the grid's first load and last writes stand alone;
    # the others cross from a sweep into the next (their second half counted there).
    over[0] += h_over[:tiles_m]
    exposed[0] += h_exp[:tiles_m]
    over[-1] += t_over[:tiles_m]
    exposed[-1] += t_exp[:tiles_m]
    over[:-1] += c_over[:tiles_m]
    exposed[:-1] += c_exp[:tiles_m]
    over[1:] += c_over[tiles_m:]
    exposed[1:] += c_exp[tiles_m:]
  return over, exposed


def rowtile_manual_dma(
  *,
  starts,
  ends,
  m: int,
  tm: int,
  sub_m: int,
  kind: str,
  sweeps: int,
  block_bytes: float,
  sequential_sweeps: bool,
  align: int | None = None,
  cuts: dict[str, Any] | None = None,
  tail: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
  """Per grid step: bytes of the row-tile kernels' manual DMAs, split into overlapped and exposed.

  A manual DMA runs from the point the kernel starts it to the point it waits for it, concurrent
  with the MXU work in between: gmm starts a group's weight load when the previous group starts
  computing and waits for it before the group computes; tgmm starts a group's output write after
  its last rows are reduced and waits for it when the write two later needs its staging slot (or
  at the drain). The bytes are spread over that window's (group, tile) sub-block work in
  proportion to its MXU rows, and counted in the grid steps doing that work, so a step's time is
  max(MXU, pipelined + overlapped bytes / bandwidth). A DMA with no MXU work in its window (the
  first load of a sweep, the last write before a drain) stalls the kernel: its bytes are
  "exposed", added to the step that waits for it on top of that max.

  Args:
    starts: [local groups] first row of each local group (numpy, sorted, clipped to m).
    ends: [local groups] end row of each local group.
    m: rows.
    tm: m tile.
    sub_m: rows per MXU pass.
    kind: "gmm" (weight loads) or "tgmm" (output writes).
    sweeps: grid steps over the other axes (gmm: n-tiles; tgmm: k-tiles x n-tiles).
    block_bytes: bytes of one load / write.
    sequential_sweeps: the kernels' option: DMAs cross sweeps (see the kernels).
    align: the passes' alignment (`gmm_pass_align`, `tgmm_pass_align`); None: sub_m.
    cuts: gmm only: the kernel's pass-cut tiles (`metadata.pass_cut_rows(xp=np)`, in the
      coordinates of starts / ends), whose tiles are the grid steps of a sweep; None: fixed
      m-tiles (m and tm give their number).
    tail: gmm only: its widened last pass (`metadata.merge_tail_rows`).

  Returns:
    (overlapped, exposed), each [sweeps * tiles] bytes in grid-step order (tiles: cdiv(m, tm),
    or cuts' num_tiles).
  """
  if kind not in ("gmm", "tgmm"):
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
  if cuts is not None and kind != "gmm":
    raise ValueError("cuts (pass-cut tiles) are gmm's only; pass cuts=None for kind='tgmm'.")
  if tail and kind != "gmm":
    raise ValueError("tail (the widened last pass) is gmm's only; pass tail=0 for kind='tgmm'.")
  starts = np.asarray(starts, np.int64)
  ends = np.asarray(ends, np.int64)
  if cuts is None:
    tiles_m = max(1, -(-m // tm))
  else:
    tiles_m = int(np.asarray(cuts["num_tiles"]).reshape(-1)[0])
  pair_g, pair_t, pair_rows, fin = _sweep_pairs(
    starts=starts,
    ends=ends,
    tm=tm,
    sub_m=sub_m,
    kind=kind,
    tiles_m=tiles_m,
    align=align,
    cuts=cuts,
    tail=tail,
  )
  if kind == "gmm":
    windows = _gmm_load_windows(pair_g=pair_g, pair_t=pair_t, tiles_m=tiles_m)
  else:
    windows = _tgmm_write_windows(pair_g=pair_g, pair_t=pair_t, fin=fin, tiles_m=tiles_m)
  within, head_alone, tail_alone, cross = _spread_windows(
    windows=windows, pair_t=pair_t, pair_rows=pair_rows, tiles_m=tiles_m, block_bytes=block_bytes
  )
  over, exposed = _sweeps_dma_bytes(
    within=within,
    head_alone=head_alone,
    tail_alone=tail_alone,
    cross=cross,
    sweeps=sweeps,
    tiles_m=tiles_m,
    sequential_sweeps=sequential_sweeps,
  )
  return over.reshape(-1), exposed.reshape(-1)


def row_granule_of(itemsize: int, *, lanes: bool = False) -> int:
  """`common.row_granule` from an element size: rows a manual DMA along m moves at a time (8
  sublanes of 32 bits: f32 8, bf16 16, 8-bit 32; 128 when m is the lane axis)."""
  return 128 if lanes else 8 * max(1, 4 // int(itemsize))


def gmm_pass_align(*, sub_m: int, tm: int, lhs_itemsize: int, out_itemsize: int) -> int:
  """`metadata.pass_align` of the row-tile gmm, whose passes slice its lhs and output rows:
  the larger of their row granules (`row_granule_of`)."""
  granule = max(row_granule_of(lhs_itemsize), row_granule_of(out_itemsize))
  return pass_align(sub_m=sub_m, tm=tm, row_granule=granule)


def tgmm_pass_align(
  *, sub_m: int, tm: int, lhs_itemsize: int, rhs_itemsize: int, transpose_lhs: bool
) -> int:
  """`metadata.pass_align` of the row-tile tgmm, whose passes slice its lhs and rhs rows: the
  larger of their row granules (`row_granule_of`), lhs's a lane granule (128) unless it comes as
  [m, k] (`transpose_lhs`, as gmm's backward passes it)."""
  granule = max(row_granule_of(lhs_itemsize, lanes=not transpose_lhs), row_granule_of(rhs_itemsize))
  return pass_align(sub_m=sub_m, tm=tm, row_granule=granule)


def _padded(rows: int, granule: int, tm: int) -> int:
  """gmm's row count after padding to the DMA granule (when the granule divides tm)."""
  return -(-rows // granule) * granule if tm % granule == 0 else rows


def tile_rows_moved(*, row0, lo, hi, tm: int, m: int, granule: int) -> np.ndarray:
  """Rows a row-tile kernel's manual DMA moves for rows [lo, hi) of the tile at `row0` (relative
  to it): the range rounded out to the granule and clipped at m, or the whole tile clipped at m
  when the granule does not divide tm (`common.tile_row_copies`; numpy, elementwise)."""
  row0, lo, hi = (np.asarray(x, np.int64) for x in (row0, lo, hi))
  if tm % granule:
    return np.maximum(np.minimum(tm, m - row0), 0)
  first = (lo // granule) * granule
  end = np.minimum(-(-hi // granule) * granule, m - row0)
  if m % granule:
    # NOTE: a range reaching m's unaligned tail moves the tile from its row 0 (Mosaic slices).
    first = np.where(end > m - m % granule - row0, 0, first)
  return np.where(hi > lo, np.maximum(end - first, 0), 0)


def rowtile_row_dma(
  *,
  fetches,
  writes,
  sweeps: int,
  sequential_sweeps: bool,
) -> tuple[np.ndarray, np.ndarray]:
  """Per grid step: bytes of the row-tile kernels' manual row-block DMAs (gmm's lhs and output,
  tgmm's lhs and rhs), split into overlapped and exposed.

  The kernels double-buffer these blocks by hand along a chain of grid steps: the whole grid
  with `sequential_sweeps` (one core runs it in order), else each sweep. A step's blocks are
  fetched during the previous step of the chain (overlapped with its work: counted there); the
  chain's first step fetches its own and waits (exposed). A block equal to the previous step's
  (same key: one visited tile across a chain of sweeps) is not fetched again. A step's output
  block is written back during the next step of the chain (counted there); the chain's last
  write is drained with nothing to overlap (exposed).

  Args:
    fetches: [(bytes, key)], one per fetched operand: [steps] bytes its block moves at each step
      (the tile's rows, `tile_rows_moved`) and [steps] int keys identifying the block.
    writes: [steps] bytes written back after each step (zeros: none).
    sweeps: chains of equal length without `sequential_sweeps` (the grid's other axes).
    sequential_sweeps: the kernels' option.

  Returns:
    (overlapped, exposed), each [steps] in grid-step order.
  """
  writes = np.asarray(writes, np.float64)
  steps = writes.size
  over = np.zeros(steps)
  exposed = np.zeros(steps)
  if steps == 0:
    return over, exposed
  chain_len = steps if sequential_sweeps else steps // max(sweeps, 1)
  pos = np.arange(steps) % chain_len
  first, last = pos == 0, pos == chain_len - 1
  for nbytes, key in fetches:
    nbytes = np.broadcast_to(np.asarray(nbytes, np.float64), (steps,))
    key = np.broadcast_to(np.asarray(key), (steps,))
    moved = first.copy()
    moved[1:] |= key[1:] != key[:-1]
    b = np.where(moved, nbytes, 0.0)
    exposed += np.where(first, b, 0.0)
    over[:-1] += np.where(first[1:], 0.0, b[1:])
  exposed += np.where(last, writes, 0.0)
  over[1:] += np.where(last[:-1], 0.0, writes[:-1])
  return over, exposed


class _RowtileGrid(NamedTuple):
  """A row-tile kernel's grid over its local groups, as `rowtile_step_costs` models it."""

  kind: str
  starts: np.ndarray  # [groups] first local row of each group
  ends: np.ndarray  # [groups] end row of each group
  m: int  # local rows: sum(group_sizes)
  end: int  # the operands' rows (the buffer's, when it has slack)
  tm: int
  sub_m: int
  align: int  # the passes' alignment (`gmm_pass_align`, `tgmm_pass_align`)
  cuts: dict[str, Any] | None  # gmm's pass-cut tiles; None: fixed m-tiles
  tiles_m: int  # grid steps per sweep: visited m-tiles or pass-cut tiles
  tail: int  # gmm's widened last pass (`metadata.merge_tail_rows`; 0: none)
  rows_stationary: bool  # the MXU orientation the kernel runs (`rows_stationary_pays`)


def _rowtile_grid(
  *,
  group_sizes,
  buffer_rows: int | None,
  kind: str,
  tm: int,
  tk: int,
  tn: int,
  gen: TpuGeneration,
  lhs_itemsize: int,
  rhs_itemsize: int,
  out_itemsize: int,
  unowned_rows: str,
  fixed_tiles: bool,
  transpose_lhs: bool,
) -> _RowtileGrid:
  """The local groups' rows, the kernel's passes and its m-tiles (`rowtile_step_costs`' args)."""
  sub = pass_rows(tm, gen, kind=kind, tn=tn)
  gs = np.maximum(np.asarray(group_sizes, np.int64), 0)
  ends = np.cumsum(gs)
  starts = ends - gs
  m = int(ends[-1]) if gs.size else 0
  tiles_m = max(1, -(-m // tm))
  end = m if buffer_rows is None else max(m, buffer_rows)
  cuts = None
  if kind == "tgmm":
    align = tgmm_pass_align(
      sub_m=sub,
      tm=tm,
      lhs_itemsize=lhs_itemsize,
      rhs_itemsize=rhs_itemsize,
      transpose_lhs=transpose_lhs,
    )
  else:
    align = gmm_pass_align(sub_m=sub, tm=tm, lhs_itemsize=lhs_itemsize, out_itemsize=out_itemsize)
    if not fixed_tiles and gs.size and uses_pass_cuts(m=end, tm=tm, sub_m=sub, align=align):
      # NOTE: as `metadata.make_pass_cut_tiles` on the local rows [0, m): the first visited
      # fixed tile is tile 0, and the fixed tiles visited end at cdiv(m, tm) * tm (at least one
      # tile), clipped at the buffer's end.
      cuts = pass_cut_rows(
        starts=starts,
        ends=ends,
        first_row=0,
        fixed_end=min(tiles_m * tm, end),
        m=end,
        tm=tm,
        sub_m=sub,
        align=align,
        write_whole_tiles=unowned_rows != "undefined",
        xp=np,
      )
      tiles_m = int(cuts["num_tiles"][0])
  swap = rows_stationary_pays(kind=kind, sub_m=sub, tk=tk, tn=tn, generation=gen)
  tail = 0
  if kind == "gmm":
    tail = merge_tail_rows(sub_m=sub, tm=tm, align=align, rows_stationary=swap)
  return _RowtileGrid(
    kind=kind,
    starts=starts,
    ends=ends,
    m=m,
    end=end,
    tm=tm,
    sub_m=sub,
    align=align,
    cuts=cuts,
    tiles_m=tiles_m,
    tail=tail,
    rows_stationary=swap,
  )


def _rowtile_mxu_seconds(
  *, grid: _RowtileGrid, k: int, tk: int, tn: int, gen: TpuGeneration, peak_flops: float | None
) -> np.ndarray:
  """[tiles_m] MXU seconds of one sweep's steps: each (group, tile) pair's passes
  (`_rowtile_pairs`) at the cost of one sub-block dot in the orientation the kernel runs."""
  sub = grid.sub_m
  _, t, pair_rows = _rowtile_pairs(
    grid.starts,
    grid.ends,
    tm=grid.tm,
    sub_m=sub,
    align=grid.align,
    cuts=grid.cuts,
    tail=grid.tail,
  )
  # NOTE: gmm's widened last passes (`metadata.merge_tail_rows`) cost their rows, as a pass of
  # at least the MXU's minimum rows does.
  hits = pair_rows / sub
  swap = grid.rows_stationary
  if grid.kind == "gmm":
    shape = dict(rows=tn, contract=k, cols=sub) if swap else dict(rows=sub, contract=k, cols=tn)
  else:
    shape = dict(rows=tn, contract=sub, cols=tk) if swap else dict(rows=tk, contract=sub, cols=tn)
  macs = _dot_macs(**shape, mxu=gen.mxu_size, min_rows=min_pass_rows(gen))
  peak = gen.peak_bf16_flops if peak_flops is None else peak_flops
  return np.bincount(t, hits * 2.0 * macs, grid.tiles_m) / peak


def _tile_row_ranges(*, grid: _RowtileGrid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(row0, lo, hi), each [tiles_m]: each step's tile's first row and the rows [lo, hi) its row
  blocks hold, relative to it (`tile_rows_moved`'s arguments)."""
  tiles_m, cuts = grid.tiles_m, grid.cuts
  # NOTE: the row blocks move the tile's local rows [0, m) rounded out to the granule and
  # clipped at the operands' end (the buffer's, when it has slack); a pass-cut tile's lhs the
  # rows its passes reach (past its end where it computes rows carried over to the next).
  if cuts is None:
    row0 = np.arange(tiles_m) * grid.tm
    return row0, np.zeros(tiles_m, np.int64), np.minimum(grid.m - row0, grid.tm)
  row0 = cuts["tile_start"][:tiles_m]
  return row0, np.zeros(tiles_m, np.int64), cuts["tile_reach"][:tiles_m] - row0


def _gmm_row_blocks(
  *,
  grid: _RowtileGrid,
  k: int,
  tn: int,
  sweeps: int,
  lhs_itemsize: int,
  rhs_itemsize: int,
  out_itemsize: int,
  unowned_rows: str,
) -> tuple[list, np.ndarray, float]:
  """gmm's (fetches, writes, block_bytes): its lhs row blocks and output write-backs per step
  (`rowtile_row_dma`), and the bytes of one weight load."""
  tm, end, tiles_m = grid.tm, grid.end, grid.tiles_m
  row0, lo, hi = _tile_row_ranges(grid=grid)

  def moved(g, hi=hi):
    # NOTE: gmm pads its lhs and output rows to the granule (when the granule divides tm).
    return tile_rows_moved(row0=row0, lo=lo, hi=hi, tm=tm, m=_padded(end, g, tm), granule=g)

  out_granule = row_granule_of(out_itemsize)
  if grid.cuts is not None:
    # NOTE: a pass-cut tile writes its rows [tile_start[t], tile_start[t + 1]): the local rows,
    # or (written whole) the visited fixed tiles' rows, cut the same way.
    out_rows = moved(out_granule, hi=grid.cuts["tile_start"][1 : tiles_m + 1] - row0)
  elif unowned_rows == "undefined":
    out_rows = moved(out_granule)
  else:
    out_rows = np.minimum(_padded(end, out_granule, tm) - row0, tm)
  tile = np.tile(np.arange(tiles_m), sweeps)
  fetches = [(np.tile(moved(row_granule_of(lhs_itemsize)) * k * lhs_itemsize, sweeps), tile)]
  writes = np.tile(out_rows * tn * out_itemsize, sweeps)
  return fetches, writes, k * tn * rhs_itemsize


def _tgmm_row_blocks(
  *,
  grid: _RowtileGrid,
  tk: int,
  tn: int,
  sweeps: int,
  lhs_itemsize: int,
  rhs_itemsize: int,
  out_itemsize: int,
  transpose_lhs: bool,
) -> tuple[list, np.ndarray, float]:
  """tgmm's (fetches, writes, block_bytes): its lhs and rhs row blocks per step
  (`rowtile_row_dma`; no row writes), and the bytes of one output write."""
  row0, lo, hi = _tile_row_ranges(grid=grid)

  def moved(g):
    return tile_rows_moved(row0=row0, lo=lo, hi=hi, tm=grid.tm, m=grid.end, granule=g)

  # NOTE: tgmm fetches both every step (a single visited tile too: its k and n windows change
  # with the sweep).
  every = np.arange(sweeps * grid.tiles_m)
  lhs_rows = moved(row_granule_of(lhs_itemsize, lanes=not transpose_lhs))
  rhs_rows = moved(row_granule_of(rhs_itemsize))
  fetches = [
    (np.tile(lhs_rows * tk * lhs_itemsize, sweeps), every),
    (np.tile(rhs_rows * tn * rhs_itemsize, sweeps), every),
  ]
  return fetches, np.zeros(sweeps * grid.tiles_m), tk * tn * out_itemsize


def _rowtile_dma_bytes(
  *,
  grid: _RowtileGrid,
  k: int,
  tk: int,
  tn: int,
  sweeps: int,
  gen: TpuGeneration,
  lhs_itemsize: int,
  rhs_itemsize: int,
  out_itemsize: int,
  unowned_rows: str,
  transpose_lhs: bool,
) -> tuple[np.ndarray, np.ndarray]:
  """(overlapped, exposed) bytes, each [sweeps * tiles_m] in grid-step order: the row blocks'
  (`rowtile_row_dma`) plus the per-group weight loads' / output writes' (`rowtile_manual_dma`)."""
  itemsizes = dict(lhs_itemsize=lhs_itemsize, rhs_itemsize=rhs_itemsize, out_itemsize=out_itemsize)
  if grid.kind == "gmm":
    fetches, writes, block = _gmm_row_blocks(
      grid=grid, k=k, tn=tn, sweeps=sweeps, **itemsizes, unowned_rows=unowned_rows
    )
  else:
    fetches, writes, block = _tgmm_row_blocks(
      grid=grid, tk=tk, tn=tn, sweeps=sweeps, **itemsizes, transpose_lhs=transpose_lhs
    )
  # NOTE: the kernels' `sequential_sweeps` follows the generation, as in `pallas_moe.ops`.
  seq = sequential_sweeps(gen)
  row_over, row_exposed = rowtile_row_dma(
    fetches=fetches, writes=writes, sweeps=sweeps, sequential_sweeps=seq
  )
  over, exposed = rowtile_manual_dma(
    starts=grid.starts,
    ends=grid.ends,
    m=grid.m,
    tm=grid.tm,
    sub_m=grid.sub_m,
    kind=grid.kind,
    sweeps=sweeps,
    block_bytes=block,
    sequential_sweeps=seq,
    align=grid.align,
    cuts=grid.cuts,
    tail=grid.tail,
  )
  return over + row_over, exposed + row_exposed


def rowtile_step_costs(
  *,
  group_sizes,
  k: int,
  n: int,
  tm: int,
  tk: int,
  tn: int,
  kind: str,
  lhs_itemsize: int,
  rhs_itemsize: int,
  out_itemsize: int,
  generation: str | TpuGeneration,
  peak_flops: float | None = None,
  buffer_rows: int | None = None,
  unowned_rows: str = "zero",
  fixed_tiles: bool = False,
  transpose_lhs: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-step MXU seconds and HBM bytes of a row-tile kernel's whole grid.

  The same accounting as `bench.costmodel` applies to the real kernel (its manual DMAs: the
  per-group weight loads / output writes spread over the work they overlap,
  `rowtile_manual_dma`, and the row blocks double-buffered along the grid, `rowtile_row_dma`), in
  closed form from the group sizes: the picker's model. The local groups hold the operands'
  first sum(group_sizes) rows (a receive buffer's layout). The kernels' `sequential_sweeps`
  follows the generation, as in `pallas_moe.ops`. The zero fill of gmm's unvisited rows (a
  separate kernel) is not a step here: `rowtile_fill_bytes`.

  gmm cuts its tiles on the groups' pass grids where `metadata.uses_pass_cuts` holds (m: the
  buffer's rows): the grid then walks the `metadata.pass_cut_rows` tiles, a group pays no
  partial pass where a tile boundary cuts it, and each tile moves its own rows.

  Args:
    group_sizes: rows per local group (numpy).
    k: gmm's contraction / tgmm's output rows.
    n: output columns.
    tm: m tile.
    tk: tgmm's k tile (gmm: k).
    tn: n tile.
    kind: "gmm" or "tgmm".
    lhs_itemsize: bytes per lhs element.
    rhs_itemsize: bytes per rhs element.
    out_itemsize: bytes per output element.
    generation: TPU generation.
    peak_flops: the dot's MXU rate (default the bf16 peak; `narrow_peak` for a narrow dot).
    buffer_rows: the operands' m when it exceeds sum(group_sizes) (a receive buffer with slack).
      The grid visits only the tiles holding rows and moves only their real rows, rounded out to
      the DMA granule (`row_granule_of`) and clipped at the buffer's end; but see unowned_rows.
    unowned_rows: gmm only: "undefined" (`gmm(unowned_rows="undefined")`, the MoE block): only
      the local rows of a tile are written back (rounded to the output's granule); "zero" (the
      default) or "existing" (an `existing_out`): rows outside them are part of the result, so
      every visited tile is written whole (clipped at the buffer's end).
    fixed_tiles: gmm: model fixed m-tiles even where the kernel cuts its tiles on the pass
      grids (the kernel without pass cuts, for comparisons).
    transpose_lhs: tgmm: lhs comes as [m, k] (gmm's backward): its rows move in sublane
      granules and the passes start at each group's first row (`tgmm_pass_align`).

  Returns:
    (mxu_seconds, overlapped_bytes, exposed_bytes), each [sweeps * tiles] in grid-step order
    (tiles: the visited m-tiles, or the pass-cut tiles): a step takes max(mxu, overlapped /
    bandwidth) + exposed / bandwidth.
  """
  if unowned_rows not in ("zero", "undefined", "existing"):
    raise ValueError(
      f"unowned_rows must be 'zero', 'undefined' or 'existing', got {unowned_rows!r}"
    )
  gen = get_generation(generation)
  itemsizes = dict(lhs_itemsize=lhs_itemsize, rhs_itemsize=rhs_itemsize, out_itemsize=out_itemsize)
  grid = _rowtile_grid(
    group_sizes=group_sizes,
    buffer_rows=buffer_rows,
    kind=kind,
    tm=tm,
    tk=tk,
    tn=tn,
    gen=gen,
    **itemsizes,
    unowned_rows=unowned_rows,
    fixed_tiles=fixed_tiles,
    transpose_lhs=transpose_lhs,
  )
  mxu_s = _rowtile_mxu_seconds(grid=grid, k=k, tk=tk, tn=tn, gen=gen, peak_flops=peak_flops)
  sweeps = (k // tk) * (n // tn)
  over, exposed = _rowtile_dma_bytes(
    grid=grid,
    k=k,
    tk=tk,
    tn=tn,
    sweeps=sweeps,
    gen=gen,
    **itemsizes,
    unowned_rows=unowned_rows,
    transpose_lhs=transpose_lhs,
  )
  return np.tile(mxu_s, sweeps), over, exposed


def rowtile_fill_bytes(
  *, group_sizes, n: int, tm: int, out_itemsize: int, buffer_rows: int | None = None
) -> int:
  """Bytes gmm's zero fill (`unowned_rows="zero"`, a one-step kernel before the row-tile one)
  writes: the buffer's rows past the visited tiles, [buffer_rows - visited tiles x tm, n)."""
  total = int(np.maximum(np.asarray(group_sizes, np.int64), 0).sum())
  end = total if buffer_rows is None else max(total, buffer_rows)
  visited = max(1, -(-total // tm)) * tm
  return max(end - visited, 0) * n * out_itemsize


def rowtile_modeled_seconds(
  *, step_overhead_s: float | None = None, tensorcores: str = "kernel", **step_costs_kwargs: Any
) -> float:
  """Modeled time of a row-tile kernel's whole grid: Σ over steps of max(MXU, overlapped HBM time) +
  exposed HBM time + per-step overhead (docs/design.md, "The cost model"), from `rowtile_step_costs`
  (same keyword arguments); for gmm with `unowned_rows="zero"` (the default) plus its zero fill's
  one step (`rowtile_fill_bytes` at HBM bandwidth).

  TensorCores as `bench.costmodel.cost` counts them: "kernel" (the default) at one
  TensorCore's rates (`tensorcore_rates`), and on a megacore device (two TensorCores behind one
  JAX device, v4 / v5p) the kernel's (k, n) sweeps split between the cores as Mosaic splits its
  leading "parallel" grid axes (none with `sequential_sweeps`): the time is the busiest core's.
  "chip": every step at the whole chip's rates on one core (the previous model).
  `step_overhead_s` defaults to the generation's (`TpuGeneration.step_overhead_s`).
  """
  if tensorcores not in ("kernel", "chip"):
    raise ValueError(f"tensorcores must be 'kernel' or 'chip', got {tensorcores!r}")
  gen = get_generation(step_costs_kwargs["generation"])
  mxu_s, over, exposed = rowtile_step_costs(**step_costs_kwargs)
  if step_overhead_s is None:
    step_overhead_s = gen.step_overhead_s
  bw = gen.hbm_bytes_per_s
  if tensorcores == "kernel":
    core_flops, bw = tensorcore_rates(gen)
    mxu_s = mxu_s * (gen.peak_bf16_flops / core_flops)
  step = np.maximum(mxu_s, over / bw) + exposed / bw + step_overhead_s
  kw = step_costs_kwargs
  sweeps = (kw["k"] // kw["tk"]) * (kw["n"] // kw["tn"])
  cores = gen.tensorcores_per_device if tensorcores == "kernel" else 1
  if cores > 1 and sweeps > 1 and not sequential_sweeps(gen):
    # NOTE: steps run sweep-major (grid (k tiles, n tiles, m tiles)); core c runs sweeps
    # [c * per_core, (c + 1) * per_core), as `costmodel.step_tensorcores`.
    per_core = -(-sweeps // cores)
    core = (np.arange(step.size) // (step.size // sweeps)) // per_core
    total = float(np.bincount(core, weights=step).max())
  else:
    total = float(step.sum())
  if kw["kind"] == "gmm" and kw.get("unowned_rows", "zero") == "zero":
    fill = rowtile_fill_bytes(
      group_sizes=kw["group_sizes"],
      n=kw["n"],
      tm=kw["tm"],
      out_itemsize=kw["out_itemsize"],
      buffer_rows=kw.get("buffer_rows"),
    )
    total += fill / bw + step_overhead_s
  return total
