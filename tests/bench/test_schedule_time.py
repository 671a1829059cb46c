"""Tests for bench.schedule_time: a compiled schedule's makespan under modeled op times."""

from __future__ import annotations

import pytest

from bench import schedule_time

# NOTE: 1 flop/µs and 1 byte/µs make times readable: a kernel declaring 30 flops and 40 bytes
# takes 40 µs (its roofline); an exchange 100 µs forward, 50 µs backward.
RATES = schedule_time.Rates(
  flops_per_s=1e6,
  hbm_bytes_per_s=1e6,
  link_bytes_per_s=1e6,
  fwd_exchange_us=100.0,
  bwd_exchange_us=50.0,
)

_KERNEL = (
  'custom-call(%p0), custom_call_target="tpu_custom_call", '
  'backend_config={{"custom_call_config": {{"cost_estimate":{{"bytes_accessed":"{b}",'
  '"flops":"{f}","transcendentals":"0"}}}}}}'
)
_EXCHANGE = 'metadata={{op_name="jit(f)/{p}batch_split_{c}/dispatch/ragged_all_to_all"}}'

_FWD0, _FWD2 = _EXCHANGE.format(p="", c=0), _EXCHANGE.format(p="", c=2)
_BWD1 = _EXCHANGE.format(p="transpose(jvp())/", c=1)
_START = "((bf16[8]{0}), bf16[8]{0}, u32[]) ragged-all-to-all-start"
_TRIP = '{"known_trip_count":{"n":"3"}}'

SCHEDULE = f"""HloModule m, is_scheduled=true

%body (a: s32[]) -> s32[] {{
  %a = s32[] parameter(0)
  ROOT %k3 = bf16[4]{{0}} {_KERNEL.format(b=10, f=20)}
}}

%fused (x: bf16[8]) -> bf16[8] {{
  %x = bf16[8]{{0}} parameter(0)
  ROOT %n = bf16[8]{{0}} negate(%x)
}}

ENTRY %main (p0: bf16[8]) -> bf16[8] {{
  %p0 = bf16[8]{{0}} parameter(0)
  %s0 = {_START}(%p0), {_FWD0}
  %k1 = bf16[4]{{0}} {_KERNEL.format(b=40, f=30)}
  %d0 = bf16[8]{{0}} ragged-all-to-all-done(%s0), {_FWD0}
  %s1 = {_START}(%d0), {_BWD1}
  %s2 = {_START}(%d0), {_FWD2}
  %f = bf16[8]{{0}} fusion(%d0), kind=kLoop, calls=%fused
  %w = s32[] while(%p0), condition=%body, body=%body, backend_config={_TRIP}
  %d2 = bf16[8]{{0}} ragged-all-to-all-done(%s2), {_FWD2}
  %d1 = bf16[8]{{0}} ragged-all-to-all-done(%s1), {_BWD1}
  ROOT %out = bf16[8]{{0}} bitcast(%d1)
}}
"""


def test_makespan_by_hand():
  """k1 (40 µs) runs under the 100 µs forward exchange: the core waits 60 µs at d0 (t = 100).
  Then a 50 µs backward exchange and a 100 µs forward one share the links: done at 150 and 250.
  The fusion reads and writes 16 bytes each (32 µs, t = 132), the loop runs its 20 µs kernel
  3 times (t = 192). d2 waits until 250 (58 µs idle), d1 is long done."""
  r = schedule_time.makespan(SCHEDULE, RATES)
  assert r["total_us"] == pytest.approx(250.0)
  assert r["kernel_us"] == pytest.approx(40.0)  # NOTE: the loop's kernel counts as the loop
  assert r["core_us"] == pytest.approx(40 + 32 + 60)
  assert r["exchange_us"] == pytest.approx(250.0)
  assert r["waiting_us"] == pytest.approx(60 + 58)


def test_no_entry_raises():
  with pytest.raises(ValueError, match="ENTRY"):
    schedule_time.makespan("HloModule m\n", RATES)


def test_kernels_only_and_kernel_scale():
  """Without XLA's ops the fusion is free: k1 40, wait to 100, the loop 60 (t = 160), wait to
  250. Kernels at twice their time: k1 80 (t = 100 after a 20 µs wait), the loop 120: t = 220,
  then d2 at 250."""
  import dataclasses

  r = schedule_time.makespan(SCHEDULE, dataclasses.replace(RATES, xla_ops=False))
  assert (r["total_us"], r["core_us"], r["waiting_us"]) == pytest.approx((250, 100, 150))
  r = schedule_time.makespan(SCHEDULE, dataclasses.replace(RATES, xla_ops=False, kernel_scale=2.0))
  assert (r["total_us"], r["core_us"], r["waiting_us"]) == pytest.approx((250, 200, 50))


def test_synchronous_exchange_waits_for_the_links():
  """A synchronous expert exchange after an async one: it starts when the links are free (100)
  and the core waits through it (to 200)."""
  text = SCHEDULE.replace(
    "  ROOT %out = bf16[8]{0} bitcast(%d1)",
    f"  %x = bf16[8]{{0}} ragged-all-to-all(%d1), {_FWD2}\n  ROOT %out = bf16[8]{{0}} bitcast(%x)",
  )
  text = text.replace("%s1 = ", "%s1_unused = ").replace("%s2 = ", "%s2_unused = ")
  text = text.replace("ragged-all-to-all-done(%s2)", "bitcast(%d0)")
  text = text.replace("ragged-all-to-all-done(%s1)", "bitcast(%d0)")
  r = schedule_time.makespan(text, RATES)
  # NOTE: s0 100 (links to 100), s1_unused 50 (to 150), s2_unused 100 (to 250): the core is
  # at 192 after the loop, the synchronous exchange waits for the links (250) and runs to 350.
  assert r["total_us"] == pytest.approx(350.0)
  assert r["exchange_us"] == pytest.approx(350.0)
  assert r["waiting_us"] == pytest.approx(60 + 58 + 100)
