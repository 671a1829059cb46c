"""Test setup: CPU only (libtpu is installed for AOT checks), 8 CPU devices, hypothesis profiles."""

import os

# With libtpu installed, `import jax` would try to open a TPU. Tests run on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Only one process may open libtpu unless this is set; AOT tests run in parallel test workers.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)
# Interpret-mode kernels compile to large XLA:CPU while loops; compiling them without most
# optimizations makes the suite ~1.5x faster and does not change what is computed.
jax.config.update("jax_disable_most_optimizations", True)

settings.register_profile(
  "default",
  max_examples=6,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  derandomize=True,
)
# NOTE: ci is 1.33x the default's examples. 16 took the suite past 10 minutes on 2 cores once the
# row-tile and quantized kernels doubled the kernel tests (10:41 on this VM); 12 did too once
# the row-tile kernels ran in both sweep modes (9:41-10:55 on clean clones), and 10 once they
# ran in both MXU orientations (10:21); 8 took 17:14 once the row-tile kernels moved their
# edge rows by manual DMAs (more kernel code to compile in interpret mode); 7 took the oldest
# leg (jax 0.10.2, about 1.2x the newest's time per test) to 15:20 once the fused expert
# kernel and the serving layer landed.
settings.register_profile(
  "ci",
  max_examples=6,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  derandomize=True,
)
settings.register_profile(
  "deep",
  max_examples=200,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Deep cases: parametrizations that repeat a code path another case of the same test already
# runs (more chips, meshes, shapes, modes). Marked `slow`: the default run deselects them (the
# summary says how many); `python -m pytest -m slow` runs them, `-m "slow or not slow"` all.
SLOW_CASES = tuple(
  f"tests/{case}"
  for case in (
    # AOT: one shape per chip compiles by default (v4 mixtral, v6e qwen3, tpu7x v2-lite).
    "kernels/test_aot.py::test_grad_compiles[v6e-mixtral-8x7b]",
    "kernels/test_aot.py::test_grad_compiles[v6e-deepseek-v3]",
    "kernels/test_aot.py::test_grad_compiles[v6e-deepseek-v2-lite]",
    "kernels/test_aot.py::test_grad_compiles[v5e-deepseek-v3]",
    "kernels/test_aot.py::test_grad_compiles[v5e-qwen3-30b-a3b]",
    "kernels/test_aot.py::test_grad_compiles[v5p-mixtral-8x7b]",
    "kernels/test_aot.py::test_grad_compiles[tpu7x-mixtral-8x7b]",
    "kernels/test_aot.py::test_rowtile_estimate_covers_mosaic[tpu7x-fwd-",
    "kernels/test_aot.py::test_rowtile_estimate_covers_mosaic[v6e-drhs-",
    "kernels/test_aot.py::test_over_default_tiling_gets_a_raised_limit[v5e-gmm-",
    "kernels/test_aot.py::test_over_default_tiling_gets_a_raised_limit[v6e-gmm-",
    "kernels/test_quant.py::test_activation_quantized_gmm_compiles_aot[v6e-",
    "kernels/test_quant.py::test_activation_quantized_gmm_compiles_aot[v5e-float8_e4m3fn]",
    "kernels/test_quant.py::test_activation_quantized_gmm_compiles_aot[v4-",
    "kernels/test_quant.py::test_quantized_gmm_compiles_aot[v6e-",
    "kernels/test_quant.py::test_quantized_gmm_compiles_aot[v5e-float8_e4m3fn]",
    "bench/test_schedule.py::test_unsplit_step_exchanges[v6e]",
    "bench/test_schedule.py::test_split_step_overlaps_chunks[v6e]",
    # NOTE: test_split_step_keeps_two_chunks_in_flight[v5e-False] asserts cross-chunk overlap in
    # both passes of a split step too (4 chunks), and test_dedup_split_step_compiles_for_tpu_and_
    # overlaps_chunks[v5e] that of the deduplicated exchange.
    "bench/test_schedule.py::test_split_step_overlaps_chunks[v5e]",
    "bench/test_schedule.py::test_split_step_keeps_two_chunks_in_flight[v6e-True]",
    # NOTE: the same v5e:2x4 EP 8 training step (64 experts, top-6, d 256, 128 tokens per
    # device) compiles in test_dedup_split_step_compiles_for_tpu_and_overlaps_chunks[v5e].
    "layer/test_moe.py::test_training_step_compiles_for_v5e_2x4_ep8",
    "bench/test_schedule.py::test_dedup_split_step_compiles_for_tpu_and_overlaps_chunks[v6e]",
    # Interpret mode: the same kernel path at another size or offset.
    "kernels/test_rowtile.py::test_gmm_rowtile_matches_references[m300k128n256tm128g9l9]",
    "kernels/test_rowtile.py::test_gmm_rowtile_moves_only_local_rows[one-tile]",
    "kernels/test_rowtile.py::test_gmm_rowtile_passes_start_at_each_group[plain]",
    "kernels/test_ops.py::test_shard_map_check_vma_forward_and_grads[hlo]",
    "kernels/test_ops.py::test_sharded_grads_chain_to_unsharded[True]",
    "bench/test_bench_rowtile.py::test_tgmm_rowtile_interior_runs[odd-2-",
    "bench/test_bench_rowtile.py::test_tgmm_rowtile_interior_runs[whole-tiles-2-",
    "integrations/test_maxtext_rows.py::test_other_shards_rows_are_exact_zeros_in_output_and_lhs_gradient[offset0-float]",
    "integrations/test_maxtext_rows.py::test_other_shards_rows_are_exact_zeros_in_output_and_lhs_gradient[offset2-int8-weights]",
    # Each Hugging Face family on the 2 x 4 mesh; the 1 x 8 mesh for two of them.
    "integrations/test_hf.py::test_family_matches_hf_forward_and_grads[1-8-True-mixtral]",
    "integrations/test_hf.py::test_family_matches_hf_forward_and_grads[1-8-True-qwen2_moe]",
    "integrations/test_hf.py::test_family_matches_hf_forward_and_grads[1-8-True-deepseek_v2]",
    # The layer on a third mesh (1 x 8: every device one expert group) where 2 x 4 and 8 x 1 run.
    "layer/test_moe.py::test_block_matches_dense_reference[1-8-float32]",
    "layer/test_moe.py::test_adversarial_routing_dropless[static_bound]",
    "layer/test_routing.py::test_ep_block_matches_float64_dense_reference[v2-1x8]",
    "layer/test_routing.py::test_ep_block_matches_float64_dense_reference[v3-1x8]",
    "layer/test_batch_split.py::test_split_block_equals_unsplit[8-1-4-pallas]",
    "layer/test_dedup.py::test_dedup_equals_plain_block[1x8]",
    "layer/test_placement.py::test_placed_block_equals_unplaced[1x8-greedy]",
    # The fused expert kernel: DeepSeek-V3's fp8 expert compiles on v5p and tpu7x by default
    # (and on all four chips inside test_decode's layer); the simulator runs the float and
    # block-scaled kinds, interpretation every kind; the serving layer's fp8 chunks compile
    # where the same gathered kernel already does.
    "kernels/test_fused_experts.py::test_compiles_for_tpu[v5e-block-fp8-",
    "kernels/test_fused_experts.py::test_compiles_for_tpu[v6e-block-fp8-",
    "kernels/test_fused_experts.py::test_kinds_at_decode_sizes[tpu-int8]",
    "kernels/test_fused_experts.py::test_kinds_at_decode_sizes[tpu-fp8]",
    "kernels/test_fused_experts.py::test_kinds_at_decode_sizes[tpu-block-int8]",
    "kernels/test_fused_experts.py::test_tokens_layout[tpu-int8]",
    "kernels/test_fused_experts.py::test_tokens_layout[races-int8]",
    "layer/test_decode.py::test_large_batches_compile[v6e-True]",
    # NOTE: the two-TensorCore streamed kernel compiles for v5p in test_compiles_for_tpu and
    # runs under the race detector in test_streamed_rows[races-float-bfloat16-2].
    "layer/test_decode.py::test_large_batches_compile[v5p-False]",
    "kernels/test_fused_experts.py::test_streamed_rows[hlo-block-fp8-float32-2]",
    "kernels/test_fused_experts.py::test_kinds_at_decode_sizes[hlo-fp8]",
    "kernels/test_fused_experts.py::test_kinds_at_decode_sizes[hlo-block-int8]",
    "kernels/test_fused_experts.py::test_kinds_at_decode_sizes[tpu-float]",
    "kernels/test_fused_experts.py::test_tokens_layout[tpu-float]",
    "kernels/test_fused_experts.py::test_tokens_layout[races-float]",
    "kernels/test_fused_experts.py::test_tokens_layout[hlo-block-fp8]",
    "kernels/test_fused_experts.py::test_tokens_layout[tpu-block-fp8]",
    "kernels/test_fused_experts.py::test_tokens_layout[hlo-int8]",
    "kernels/test_fused_experts.py::test_gathered_tokens[hlo-float]",
    "kernels/test_fused_experts.py::test_gathered_tokens[tpu-float]",
    "kernels/test_fused_experts.py::test_gathered_tokens[tpu-block-fp8]",
    "kernels/test_fused_experts.py::test_gathered_tokens[races-block-fp8]",
    "kernels/test_fused_experts.py::test_no_races_or_out_of_bounds[float]",
    "kernels/test_fused_experts.py::test_compiles_for_tpu[v6e-int8-",
    # The serving layer: one and eight tokens per device each on one family (both at 40); the
    # fp8 checkpoint at eight; DeepSeek-V3's fp8 layer compiled on v5e and v6e (the kernel
    # itself on v5p and tpu7x).
    "layer/test_decode.py::test_matches_hf_float64[qwen3_moe-1]",
    "layer/test_decode.py::test_matches_hf_float64[deepseek_v3-8]",
    "layer/test_decode.py::test_deepseek_v3_fp8_checkpoint[1]",
    "layer/test_decode.py::test_deepseek_v3_fp8_compiles[v5p]",
    "layer/test_decode.py::test_deepseek_v3_fp8_compiles[tpu7x]",
    # A second variant of a path the default run keeps once (the oldest leg ran past 15
    # minutes): a mesh, routing family or TPU-simulator shape another case already runs.
    "layer/test_moe.py::test_block_matches_dense_reference[4-2-bfloat16]",
    "layer/test_moe.py::test_deepseek_v2_lite_grad_under_jit",
    "layer/test_routing.py::test_ep_block_matches_float64_dense_reference[v3-8x1]",
    "layer/test_sharding.py::test_sharded_layer_equals_plain_block[fsdp2-ep4]",
    "layer/test_dropped_rows.py::test_dropped_rows_count_assignments_in_every_mode[skewed-None-2]",
    "layer/test_dropped_rows.py::test_dropped_rows_count_assignments_in_every_mode[adversarial-True-1]",
    "layer/test_collectives.py::test_dispatch_combine_roundtrip_exact[4]",
    "kernels/test_rowtile.py::test_tgmm_rowtile_matches_references[m200k96n256tm128g16l16-seq]",
    "kernels/test_rowtile.py::test_tgmm_rowtile_matches_references[m67k32n48tm16g3l1-seq]",
    "kernels/test_rowtile.py::test_gmm_rowtile_matches_references[m67k40n48tm16g5l3-seq]",
    "bench/test_bench_rowtile.py::test_tgmm_rowtile_interior_runs[whole-tiles-3-",
    "bench/test_bench_rowtile.py::test_tgmm_rowtile_interior_runs[whole-tiles-1-",
    "bench/test_bench_rowtile.py::test_cost_model_hooks_match_kernel_counts[dlhs-sequential]",
    "bench/test_bench_rowtile.py::test_cost_model_hooks_match_kernel_counts[drhs-sequential]",
    "kernels/test_ops.py::test_grads_match_references_tpu_simulator[m600k128n256g10]",
    "kernels/test_gmm_kernel.py::test_gmm_matches_references_tpu_simulator[m200k1408n100g8]",
    "kernels/test_gmm_kernel.py::test_gmm_matches_references_tpu_simulator[m300k200n256g5T]",
    "kernels/test_tgmm_kernel.py::test_tgmm_matches_references_tpu_simulator[m300k96n256g32]",
    "kernels/test_tgmm_kernel.py::test_tgmm_matches_references_tpu_simulator[m700k136n128g12]",
    "kernels/test_xla_backend.py::test_xla_gmm_contract_and_gradients[shard-with-existing]",
    "kernels/test_xla_backend.py::test_xla_gmm_contract_and_gradients[empty-groups-tail]",
    "layer/test_moe.py::test_block_matches_dense_reference[8-1-bfloat16]",
    "layer/test_routing.py::test_ep_block_matches_float64_dense_reference[v2-2x4]",
    "layer/test_sharding.py::test_sharded_layer_equals_plain_block[data2-tp2-ep2]",
    "kernels/test_rowtile.py::test_tgmm_rowtile_matches_references[m101k32n48tm64g6l4-tl]",
    "kernels/test_rowtile.py::test_gmm_rowtile_matches_references[m130k64n128tm256g6l4-rs]",
    "kernels/test_rowtile.py::test_slack_buffers_match_references[hlo-True]",
    "bench/test_bench_rowtile.py::test_tgmm_rowtile_interior_runs[odd-1-tl]",
    "bench/test_bench_rowtile.py::test_tgmm_rowtile_interior_runs[odd-1-rs-tl]",
    "bench/test_bench_rowtile.py::test_cost_model_hooks_match_kernel_counts[dlhs-parallel]",
    "integrations/test_hf.py::test_family_matches_hf_forward_and_grads[1-8-True-qwen3_moe]",
    # Streamed rows: f32 rows in plain interpretation also run in
    # test_group_sizes_property[streamed]; the TPU simulator runs the streamed kernel in the
    # two race-detector cases, int8 weights in the resident layouts. fsdp alone on a 4-wide axis:
    # fsdp2-tp2-ep2 shards over fsdp, tensor and expert at once.
    "kernels/test_fused_experts.py::test_streamed_rows[hlo-float-float32-1]",
    "kernels/test_fused_experts.py::test_streamed_rows[tpu-int8-bfloat16-1]",
    "layer/test_sharding.py::test_sharded_layer_equals_plain_block[fsdp4-ep2]",
    # A 4-wide tensor axis (fsdp2-tp2-ep2 shards over tensor, fsdp and expert at once). The
    # chunked block's gradients with the Pallas gmm on 2 x 4: chunking only changes which rows
    # each exchange and gmm see; the default run keeps the chunked gradients on 1 x 8
    # (ragged_dot), the chunked Pallas forward on 2 x 4 (test_buffers_and_drops_are_per_chunk)
    # and the Pallas gradients on 2 x 4 (test_block_matches_dense_reference[2-4-float32]).
    "layer/test_sharding.py::test_sharded_layer_equals_plain_block[tp4-ep2]",
    "layer/test_batch_split.py::test_split_block_equals_unsplit[2-4-2-pallas]",
    # Placement on 2 x 4 with greedy routing (the noaux_tc-split2 case places on 2 x 4 too); the
    # sharded-groups chain over 2 shards (the 4-shard cases run both weight layouts).
    "layer/test_placement.py::test_placed_block_equals_unplaced[2x4-greedy]",
    "kernels/test_gmm_kernel.py::test_sharded_groups_chain_to_unsharded[hlo-2-False]",
  )
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks the `SLOW_CASES` (before `-m` deselects by marker)."""
  for item in items:
    if item.nodeid.startswith(SLOW_CASES):
      item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  """Says what the default `-m 'not slow'` left out (pytest-xdist's summary does not count it)."""
  if config.option.markexpr == "not slow":
    terminalreporter.write_line(
      f"deselected by default: the deep cases matching tests/conftest.py SLOW_CASES "
      f"({len(SLOW_CASES)} patterns, marked slow); run them with -m slow"
    )
