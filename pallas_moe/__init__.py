"""pallas_moe: Pallas TPU kernels for Mixture-of-Experts training and serving in JAX."""

from pallas_moe.block_plan import BlockPlan, plan_block
from pallas_moe.collectives import (
  BufferPolicy,
  RaggedPlan,
  combine,
  dispatch,
  exact_buffer_rows,
  plan_from_group_sizes,
  plan_from_send_counts,
  ragged_all_to_all,
)
from pallas_moe.config import MoEConfig, MoEModel, MoERun
from pallas_moe.decode import DecodePlan, decode_block, moe_decode, plan_decode
from pallas_moe.hf import from_hf, to_hf
from pallas_moe.mesh import make_mesh
from pallas_moe.moe import (
  dropless_buffer_rows,
  init_params,
  moe_block,
  moe_layer,
  place_experts,
  plan_layer,
)
from pallas_moe.ops import GmmPlan, Tiling, gmm, gmm_plan, record_plans, tgmm
from pallas_moe.quant import (
  BlockQuantizedWeights,
  QuantizedWeights,
  dequantize,
  dequantize_blocks,
  quantize,
  quantize_blocks,
)

__all__ = [
  "BlockPlan",
  "BlockQuantizedWeights",
  "BufferPolicy",
  "DecodePlan",
  "GmmPlan",
  "MoEConfig",
  "MoEModel",
  "MoERun",
  "QuantizedWeights",
  "RaggedPlan",
  "Tiling",
  "combine",
  "decode_block",
  "dequantize",
  "dequantize_blocks",
  "dispatch",
  "dropless_buffer_rows",
  "exact_buffer_rows",
  "from_hf",
  "gmm",
  "gmm_plan",
  "init_params",
  "make_mesh",
  "moe_block",
  "moe_decode",
  "moe_layer",
  "place_experts",
  "plan_block",
  "plan_decode",
  "plan_layer",
  "plan_from_group_sizes",
  "plan_from_send_counts",
  "quantize",
  "quantize_blocks",
  "record_plans",
  "ragged_all_to_all",
  "tgmm",
  "to_hf",
]
