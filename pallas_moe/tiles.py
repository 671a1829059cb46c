"""The `Tiling` a caller gives the differentiable gmm: tiles per pass, in plain data.

Kept apart from `pallas_moe.ops` so that configuration (`pallas_moe.config`) can hold tilings
without importing the kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pallas_moe import common

Tiles = tuple[int, int, int]
TileFn = Callable[[int, int, int], Tiles | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling:
  """Tiles for each pass of the differentiable gmm.

  Each entry is (tm, tk, tn) in that pass's own (rows, contraction, output columns) coordinates
  (see the module docstring), a callable (m, k, n) -> (tm, tk, tn) like megablox's tiling LUT, or
  None for the heuristic. drhs's tm must be a multiple of 128 (or all of m): it is the last dim of
  tgmm's lhs block. A single (tm, tk, tn) given for all passes has its drhs tm rounded up to that.
  """

  fwd: Tiles | TileFn | None = None
  dlhs: Tiles | TileFn | None = None
  drhs: Tiles | TileFn | None = None

  @classmethod
  def of(cls, tiling: Tiling | Tiles | TileFn | None) -> Tiling:
    """A Tiling from a Tiling, one (tm, tk, tn) for all passes, a callable, or None."""
    if isinstance(tiling, Tiling):
      return tiling
    if isinstance(tiling, list):
      tiling = tuple(tiling)
    if tiling is None or callable(tiling) or isinstance(tiling, tuple):
      return cls(fwd=tiling, dlhs=tiling, drhs=_lane_aligned_tm(tiling))
    raise TypeError(
      "`tiling` must be a (tm, tk, tn) tuple, a Tiling(fwd=, dlhs=, drhs=), a callable "
      f"(m, k, n) -> (tm, tk, tn), or None; got {type(tiling).__name__}."
    )


def _round_tm(tiles: Any) -> Any:
  if isinstance(tiles, tuple) and len(tiles) == 3 and isinstance(tiles[0], int) and tiles[0] > 0:
    return (-(-tiles[0] // common.LANE) * common.LANE, *tiles[1:])
  return tiles


def _lane_aligned_tm(spec: Tiles | TileFn | None) -> Tiles | TileFn | None:
  """drhs tiles from tiles meant for all passes: tm rounded up to a multiple of 128.

  NOTE: tgmm's tm is the lane (last) dim of its [tk, tm] lhs block, so it must be a multiple of
  128 (or all of m); gmm's tm only needs 8. One tiling given for all passes is adapted here.
  """
  if callable(spec):
    return lambda m, k, n: _round_tm(spec(m, k, n))
  return _round_tm(spec)
