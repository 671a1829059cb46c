"""pallas_moe: Pallas TPU kernels for Mixture-of-Experts training in JAX."""

from pallas_moe.collectives import BufferPolicy as BufferPolicy
from pallas_moe.collectives import RaggedPlan as RaggedPlan
from pallas_moe.collectives import combine as combine
from pallas_moe.collectives import dispatch as dispatch
from pallas_moe.collectives import exact_buffer_rows as exact_buffer_rows
from pallas_moe.collectives import plan_from_group_sizes as plan_from_group_sizes
from pallas_moe.collectives import plan_from_send_counts as plan_from_send_counts
from pallas_moe.collectives import ragged_all_to_all as ragged_all_to_all
