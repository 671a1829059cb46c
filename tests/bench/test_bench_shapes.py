"""bench.shapes: the benchmark shapes, and the library tests' copy of them."""

from __future__ import annotations

from kernel_testing import MODEL_SHAPES

from bench.shapes import SHAPES


def test_kernel_testing_shapes_are_the_benchmark_shapes():
  """tests/kernel_testing.py's `MODEL_SHAPES` (the library's tests do not import bench) are
  bench/shapes.py's, one device's rows, k, n and groups at the native token counts."""
  assert MODEL_SHAPES == {name: (s.m, s.k, s.n, s.num_groups) for name, s in SHAPES.items()}
