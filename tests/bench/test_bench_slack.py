"""bench.slack: the EP receive-buffer cases (rows, buffer policies, capacity drops)."""

from __future__ import annotations

import numpy as np

from bench.slack import EpCase, drop_to_capacity, ep_cases


def _case(policy: str, **kw) -> EpCase:
  args = dict(model="deepseek-v2-lite", ep=8, num_experts=64, tokens=4096, routing="uniform")
  return EpCase(**(args | kw), policy=policy)


def test_buffer_policies_are_the_blocks():
  received = int(_case("exact").group_sizes().sum())
  # Uniform routing: a device receives about T * top_k rows (ep peers x T x k x E_l / E).
  assert abs(received - 4096 * 6) < 0.05 * 4096 * 6
  assert _case("exact").buffer_rows(received) == -(-received // 8) * 8
  assert _case("cap1.25").buffer_rows(received) == 30720  # ceil(1.25 * 4096 * 6)
  assert _case("cap2.0").buffer_rows(received) == 49152
  assert _case("static").buffer_rows(received) == 8 * 4096 * 6  # ep * T * min(k=6, E_l=8)
  assert _case("static", model="qwen3-30b-a3b", num_experts=128).buffer_rows(1) == 8 * 4096 * 8


def test_capacity_drops_rows_past_the_buffer_in_expert_order():
  np.testing.assert_array_equal(drop_to_capacity(np.array([5, 0, 7, 4]), 9), [5, 0, 4, 0])
  np.testing.assert_array_equal(drop_to_capacity(np.array([5, 0, 7, 4]), 99), [5, 0, 7, 4])


def test_cases_cover_the_issue():
  cases = ep_cases()
  assert {(c.model, c.ep, c.local_experts) for c in cases} == {
    ("deepseek-v3", 32, 8),
    ("deepseek-v3", 64, 4),
    ("qwen3-30b-a3b", 8, 16),
    ("deepseek-v2-lite", 8, 8),
    ("mixtral-8x7b", 8, 1),
  }
  assert {c.policy for c in cases} == {"exact", "cap1.25", "cap2.0", "static"}
  assert {c.tokens for c in cases} == {4096, 16384} and {c.routing for c in cases} == {
    "uniform",
    "zipf",
  }
