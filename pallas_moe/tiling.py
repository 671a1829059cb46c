"""Tiles for the grouped matmuls: the public names of four modules, one concern each.

- `pallas_moe.generations`: TPU generation facts (`TpuGeneration`, `GENERATIONS`,
  `get_generation`, `use_generation`, `current_generation`, `narrow_peak`, `sequential_sweeps`,
  `rows_per_pass`).
- `pallas_moe.vmem`: VMEM accounting (`vmem_estimate_bytes`, `check_fits_vmem`,
  `usable_vmem_bytes`, `vmem_limit_for`).
- `pallas_moe.schedule_cost`: the row-tile kernels' analytic schedule cost
  (`rows_stationary_pays`, `rowtile_manual_dma`, `rowtile_row_dma`, `rowtile_step_costs`,
  `rowtile_modeled_seconds`, `rowtile_fill_bytes`, `tile_rows_moved`, `row_granule_of`,
  `gmm_pass_align`, `tgmm_pass_align`).
- `pallas_moe.tile_pickers`: the default tiles (`pick_tiling`, `pick_rowtile_tiling`).

Every name stays importable from here (`pallas_moe.tiling.use_generation`, ...), where users and
the README found them.
"""

from pallas_moe.generations import (
  GENERATIONS,
  TpuGeneration,
  current_generation,
  get_generation,
  min_pass_rows,
  narrow_peak,
  pass_granule,
  pass_rows,
  rows_per_pass,
  sequential_sweeps,
  use_generation,
)
from pallas_moe.schedule_cost import (
  gmm_pass_align,
  row_granule_of,
  rows_stationary_pays,
  rowtile_fill_bytes,
  rowtile_manual_dma,
  rowtile_modeled_seconds,
  rowtile_row_dma,
  rowtile_step_costs,
  tgmm_pass_align,
  tile_rows_moved,
)
from pallas_moe.tile_pickers import pick_rowtile_tiling, pick_tiling, rowtile_pass_cuts_pay
from pallas_moe.vmem import check_fits_vmem, usable_vmem_bytes, vmem_estimate_bytes, vmem_limit_for

__all__ = [
  "TpuGeneration",
  "GENERATIONS",
  "get_generation",
  "current_generation",
  "use_generation",
  "usable_vmem_bytes",
  "vmem_limit_for",
  "vmem_estimate_bytes",
  "check_fits_vmem",
  "pick_tiling",
  "pick_rowtile_tiling",
  "rowtile_pass_cuts_pay",
  "rowtile_manual_dma",
  "rowtile_modeled_seconds",
  "rowtile_row_dma",
  "rowtile_fill_bytes",
  "tile_rows_moved",
  "row_granule_of",
  "gmm_pass_align",
  "tgmm_pass_align",
  "narrow_peak",
  "min_pass_rows",
  "pass_granule",
  "pass_rows",
  "rows_per_pass",
  "rows_stationary_pays",
  "rowtile_step_costs",
  "sequential_sweeps",
]
