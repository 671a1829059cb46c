"""tokamax's tuned tiles for its Pallas Mosaic TPU ragged dot (data, transcribed; no tokamax code).

Source: `tokamax/_src/ops/ragged_dot/pallas_mosaic_tpu.py` of openxla/tokamax at version 0.0.12
(commit 4936e75, "Update tokamax version to 0.0.12"): `GMM_TILING_TUNED_LUT` (forward),
`GMM_RHS_TRANSPOSE_TILING_TUNED_LUT` (dlhs) and `TGMM_TILING_TUNED_LUT` (drhs), keyed by
(m, k, n, G, is_quantized) and holding ((tile_m, tile_k, tile_n), input_buffer_count).
`_get_heuristics_config` looks the key up exactly and otherwise returns `Config()`:
(128, 128, 128) with an input buffer count of 2.

Key and tile conventions, as tokamax reads them:
- fwd: lhs [m, k], rhs [G, k, n]: key (m, k, n, G); tiles (tm, tk, tn), tk tiles k, tn tiles n.
- dlhs: dout [m, n], rhs [G, k, n]: key (m, k, n, G) (the forward's dims); the kernel runs with
  `transpose_rhs=True` and tiles (tm, tk, tn) with tk tiling the contraction n and tn the output k.
- drhs: lhs [m, k], dout [m, n], G = len(group_sizes): key (m, k, n, G); tgmm tiles (tm, tk, tn).
These are exactly megablox's kernel-terms tilings (`bench.impls._kernel_dims`).

The source dict literals repeat some keys (e.g. (131072, 7168, 2048, 256, False) twice in each
table); Python keeps the later value, and so do the tables below. The shadowed entries are listed
in `SHADOWED` for the record.

tokamax's kernel (`pallas_mosaic_tpu_kernel.py`) builds megablox's group metadata, grid
(tiles_n, active m-tiles, tiles_k) for gmm and (tiles_n, tiles_k, active m-tiles) for tgmm, and
megablox's index maps, run inside `emit_pipeline` with `input_buffer_count`-deep lhs buffering.
Our cost model cannot see inside `emit_pipeline`, so the bench models tokamax as megablox's
schedule at tokamax's tiles (`bench.impls`, impl "tokamax"); the buffer depth is recorded, not
modeled. It also requires m % tile_m == 0 (NotImplementedError otherwise), as megablox does.
"""

from __future__ import annotations

__all__ = ["DEFAULT_TILES", "LUTS", "SHADOWED", "TILE_SIZES", "lookup"]

# ((tile_m, tile_k, tile_n), input_buffer_count)
Entry = tuple[tuple[int, int, int], int]
Key = tuple[int, int, int, int, bool]

DEFAULT_TILES: Entry = ((128, 128, 128), 2)

_GMM: dict[Key, Entry] = {
  (262144, 7168, 2048, 256, False): ((256, 7168, 512), 2),
  (262144, 7168, 2048, 256, True): ((128, 7168, 2048), 2),
  (262144, 2048, 7168, 256, False): ((128, 2048, 3584), 2),
  (262144, 2048, 7168, 256, True): ((256, 2048, 3584), 3),
  (262144, 7168, 256, 256, False): ((1024, 128, 256), 3),
  (262144, 256, 7168, 256, False): ((512, 1024, 2048), 4),
  (327680, 2880, 2880, 128, False): ((512, 2944, 1536), 2),
  (393216, 2048, 768, 128, False): ((512, 2048, 768), 2),
  (393216, 768, 2048, 128, False): ((1024, 768, 2048), 2),
  (524288, 4096, 1536, 128, False): ((256, 4096, 1536), 2),
  (524288, 1536, 4096, 128, False): ((512, 1536, 1536), 2),
  (524288, 7168, 2048, 16, False): ((1024, 1024, 1024), 2),
  (524288, 7168, 2048, 16, True): ((1024, 1024, 1024), 2),
  (524288, 2048, 7168, 16, False): ((256, 256, 7168), 3),
  (524288, 2048, 7168, 16, True): ((256, 256, 7168), 3),
  (262144, 4096, 1536, 128, False): ((256, 4096, 1536), 2),
  (262144, 1536, 4096, 128, False): ((256, 1536, 4096), 2),
  (131072, 2048, 7168, 256, False): ((128, 2048, 3584), 2),
  (131072, 4096, 1536, 128, False): ((256, 4096, 1536), 2),
  (131072, 1536, 4096, 128, False): ((256, 1536, 4096), 2),
  (131072, 7168, 2048, 256, False): ((512, 3584, 1024), 2),
  (65536, 7168, 2048, 256, False): ((256, 3584, 1024), 2),
  (262144, 7168, 512, 256, False): ((512, 7168, 512), 2),
  (262144, 512, 7168, 256, False): ((256, 512, 7168), 2),
  (262144, 7168, 1024, 256, False): ((512, 7168, 1024), 2),
  (262144, 1024, 7168, 256, False): ((256, 1024, 7168), 3),
  (131072, 7168, 512, 256, False): ((128, 7168, 512), 3),
  (131072, 512, 7168, 256, False): ((256, 512, 7168), 2),
}

_GMM_RHS_TRANSPOSE: dict[Key, Entry] = {
  (262144, 7168, 2048, 256, False): ((256, 2048, 1792), 2),
  (262144, 7168, 2048, 256, True): ((256, 2048, 3584), 2),
  (262144, 2048, 7168, 256, False): ((256, 7168, 512), 2),
  (262144, 2048, 7168, 256, True): ((256, 7168, 1024), 2),
  (262144, 7168, 256, 256, False): ((256, 512, 1792), 2),
  (262144, 256, 7168, 256, False): ((512, 7168, 128), 4),
  (327680, 2880, 2880, 128, False): ((512, 2944, 1536), 2),
  (393216, 2048, 768, 128, False): ((1024, 768, 2048), 2),
  (393216, 768, 2048, 128, False): ((512, 2048, 768), 2),
  (524288, 4096, 1536, 128, False): ((1024, 1536, 1024), 2),
  (524288, 1536, 4096, 128, False): ((1024, 1024, 1536), 2),
  (524288, 7168, 2048, 16, False): ((512, 2048, 1792), 4),
  (524288, 7168, 2048, 16, True): ((512, 2048, 1792), 4),
  (524288, 2048, 7168, 16, False): ((512, 2048, 1792), 4),
  (262144, 4096, 1536, 128, False): ((512, 1536, 1024), 2),
  (262144, 1536, 4096, 128, False): ((1024, 1024, 1536), 2),
  (131072, 2048, 7168, 256, False): ((512, 7168, 512), 2),
  (131072, 4096, 1536, 128, False): ((512, 1536, 1024), 2),
  (131072, 1536, 4096, 128, False): ((512, 1024, 1536), 2),
  (131072, 7168, 2048, 256, False): ((512, 2048, 1792), 2),
  (65536, 7168, 2048, 256, False): ((512, 2048, 1024), 2),
  (262144, 7168, 512, 256, False): ((256, 512, 7168), 2),
  (262144, 512, 7168, 256, False): ((256, 7168, 512), 2),
  (262144, 7168, 1024, 256, False): ((512, 1024, 7168), 2),
  (262144, 1024, 7168, 256, False): ((256, 7168, 1024), 2),
  (131072, 7168, 512, 256, False): ((256, 512, 7168), 2),
  (131072, 512, 7168, 256, False): ((256, 7168, 512), 3),
}

_TGMM: dict[Key, Entry] = {
  (262144, 7168, 2048, 256, False): ((512, 1024, 2048), 3),
  (262144, 7168, 2048, 256, True): ((512, 1024, 2048), 2),
  (262144, 2048, 7168, 256, False): ((256, 2048, 1024), 3),
  (262144, 2048, 7168, 256, True): ((512, 512, 3584), 2),
  (262144, 7168, 256, 256, False): ((1024, 128, 1024), 3),
  (262144, 256, 7168, 256, False): ((1024, 256, 1024), 3),
  (327680, 2880, 2880, 128, False): ((512, 2944, 768), 2),
  (393216, 2048, 768, 128, False): ((512, 2048, 768), 3),
  (393216, 768, 2048, 128, False): ((512, 768, 2048), 3),
  (524288, 4096, 1536, 128, False): ((512, 4096, 512), 2),
  (524288, 1536, 4096, 128, False): ((512, 512, 4096), 2),
  (524288, 7168, 2048, 16, False): ((256, 512, 3584), 4),
  (524288, 7168, 2048, 16, True): ((256, 512, 3584), 4),
  (524288, 2048, 7168, 16, False): ((256, 512, 3584), 4),
  (524288, 2048, 7168, 16, True): ((256, 512, 3584), 4),
  (262144, 4096, 1536, 128, False): ((512, 4096, 512), 2),
  (262144, 1536, 4096, 128, False): ((512, 512, 4096), 2),
  (131072, 2048, 7168, 256, False): ((256, 2048, 1024), 2),
  (131072, 4096, 1536, 128, False): ((512, 1024, 1536), 2),
  (131072, 1536, 4096, 128, False): ((512, 512, 4096), 2),
  (131072, 7168, 2048, 256, False): ((256, 1792, 1024), 3),
  (65536, 7168, 2048, 256, False): ((256, 1024, 2048), 2),
  (262144, 7168, 512, 256, False): ((256, 7168, 512), 3),
  (262144, 512, 7168, 256, False): ((512, 512, 7168), 2),
  (262144, 7168, 1024, 256, False): ((256, 3584, 1024), 4),
  (262144, 1024, 7168, 256, False): ((512, 1024, 3584), 2),
  (131072, 7168, 512, 256, False): ((256, 7168, 512), 3),
  (131072, 512, 7168, 256, False): ((256, 256, 7168), 3),
}

# The earlier values of keys the source literals repeat (Python keeps the later one).
SHADOWED: dict[str, dict[Key, Entry]] = {
  "fwd": {(131072, 7168, 2048, 256, False): ((128, 7168, 1024), 2)},
  "dlhs": {(131072, 7168, 2048, 256, False): ((256, 2048, 1792), 2)},
  "drhs": {(131072, 7168, 2048, 256, False): ((256, 1024, 2048), 2)},
}

LUTS: dict[str, dict[Key, Entry]] = {"fwd": _GMM, "dlhs": _GMM_RHS_TRANSPOSE, "drhs": _TGMM}

# Every tile_k / tile_n value in the tables (for megablox-best's search).
TILE_SIZES: tuple[int, ...] = tuple(
  sorted({t for lut in LUTS.values() for (_, tk, tn), _ in lut.values() for t in (tk, tn)})
)


def lookup(
  *, op: str, m: int, k: int, n: int, num_groups: int, quantized: bool = False
) -> tuple[tuple[int, int, int], int, bool]:
  """tokamax 0.0.12's tiles for one ragged dot, as `_get_heuristics_config` picks them.

  Args:
    op: "fwd", "dlhs" or "drhs".
    m: rows of the lhs tokamax sees (after any padding by the caller).
    k: d_model side of the weights (rhs [G, k, n]).
    n: expert ffn side.
    num_groups: G (rhs experts; for drhs len(group_sizes)).
    quantized: whether an operand is a quantized array.

  Returns:
    ((tile_m, tile_k, tile_n) in the kernel's terms, input_buffer_count, whether the table had
    the key (False: the (128, 128, 128) default)).
  """
  if op not in LUTS:
    raise ValueError(f"op must be one of {tuple(LUTS)}, got {op!r}")
  entry = LUTS[op].get((m, k, n, num_groups, bool(quantized)))
  if entry is None:
    return DEFAULT_TILES[0], DEFAULT_TILES[1], False
  return entry[0], entry[1], True
