"""How many token chunks the EP block pipelines by default (MaxText's `batch_split_factor`).

Chunking pays only where the expert exchange runs asynchronously, so that one chunk's dispatch
and combine can run under another chunk's expert matmuls. Whether it does depends on libtpu
(`pallas_moe.schedule`, bench/results/ep-overlap.md):

- libtpu 0.0.42.1 (jax 0.10.2): the block's `ragged-all-to-all`s compile synchronous by default
  (nothing runs under them, chunked or not); with `xla_tpu_enable_async_ragged_all_to_all` they
  become start/done pairs and the chunks overlap.
- libtpu 0.0.50.1 (jax 0.12.0.1's pin) and 0.0.52: they are start/done pairs by default and a
  batch split of 2 overlaps the chunks in the forward and backward without any flag;
  `xla_tpu_enable_async_ragged_all_to_all=false` makes them synchronous again.

So the default is:

- exchange synchronous (libtpu's default before 0.0.50, or no libtpu; or the ragged flag set
  false in `LIBTPU_INIT_ARGS`): 1 chunk, since splitting only makes the matmuls smaller;
- exchange async (libtpu's default from 0.0.50; or the ragged flag set true): the chunk count
  the step model picked for the case (`MODELED_BATCH_SPLIT`, from `python -m bench.ep`, which
  models the exchange on the slice's ICI and the gmm with `bench.costmodel`), else 1. With the
  deduplicated exchange (`MoEConfig.dedup_dispatch`) the step model's choice for that exchange
  (`MODELED_BATCH_SPLIT_DEDUP`): its receiver's expand/reduce passes run on the TensorCore
  beside the gmm, and more, smaller chunks hide more of them under the exchange (v6e: 8 chunks
  at 16,384 tokens where the plain exchange takes 2).

The table is keyed by the layer's dims, not by a model name, so a config with DeepSeek-V3's dims
gets DeepSeek-V3's choice whatever it is called. No jax at import.
"""

from __future__ import annotations

import os

from pallas_moe import schedule

__all__ = [
  "ASYNC_EXCHANGE_FLAGS",
  "MODELED_BATCH_SPLIT",
  "MODELED_BATCH_SPLIT_DEDUP",
  "async_exchange_enabled",
  "modeled_batch_split",
]

# NOTE: `schedule.ASYNC_COLLECTIVE_OPTIONS`'s flags as LIBTPU_INIT_ARGS spells them; the ragged
# exchange's flag first.
ASYNC_EXCHANGE_FLAGS = tuple(schedule.ASYNC_COLLECTIVE_OPTIONS)

# (num_experts, top_k, d_model, expert_ffn_dim, expert parallelism, tokens per device,
#  generation) -> chunks. From `bench.ep.DEFAULT_BATCH_SPLIT` (the best of 1, 2, 4, 8 chunks in
# the modeled step, uniform routing, exact buffers); tests/layer/test_batch_split.py checks the two
# agree. Dims: deepseek-v3 (256, 8, 7168, 2048), qwen3-30b-a3b (128, 8, 2048, 768),
# deepseek-v2-lite (64, 6, 2048, 1408).
_DIMS = {
  "deepseek-v3": (256, 8, 7168, 2048),
  "qwen3-30b-a3b": (128, 8, 2048, 768),
  "deepseek-v2-lite": (64, 6, 2048, 1408),
}
_CHOICES = {
  # model: {(ep, tokens): (v5e, v5p, v6e)}
  "deepseek-v3": {
    (8, 4096): (4, 2, 2),
    (8, 16384): (8, 4, 4),
    (32, 4096): (8, 4, 2),
    (32, 16384): (8, 8, 2),
    (64, 4096): (8, 4, 2),
    (64, 16384): (8, 8, 2),
  },
  "qwen3-30b-a3b": {(8, 4096): (4, 4, 2), (8, 16384): (8, 8, 2)},
  "deepseek-v2-lite": {
    (8, 4096): (4, 4, 2),
    (8, 16384): (8, 8, 2),
    (4, 4096): (4, 4, 2),
    (4, 16384): (8, 8, 4),
  },
}
MODELED_BATCH_SPLIT: dict[tuple[int, int, int, int, int, int, str], int] = {
  (*_DIMS[model], ep, tokens, chip): c
  for model, cases in _CHOICES.items()
  for (ep, tokens), per_chip in cases.items()
  for chip, c in zip(("v5e", "v5p", "v6e"), per_chip, strict=True)
}


# The same for the deduplicated exchange, from `bench.ep.DEFAULT_BATCH_SPLIT_DEDUP` (the best of
# 1, 2, 4, 8 chunks of `python -m bench.ep --options dedup`, uniform routing, exact buffers), for
# the layers `dedup.MODELED_DEDUP` has modeled.
_CHOICES_DEDUP = {
  "deepseek-v3": {(32, 16384): (None, None, 2)},
  "qwen3-30b-a3b": {(8, 4096): (4, 4, 2), (8, 16384): (8, 8, 8)},
  "deepseek-v2-lite": {(8, 4096): (8, 4, 4), (8, 16384): (8, 8, 8)},
}
MODELED_BATCH_SPLIT_DEDUP: dict[tuple[int, int, int, int, int, int, str], int] = {
  (*_DIMS[model], ep, tokens, chip): c
  for model, cases in _CHOICES_DEDUP.items()
  for (ep, tokens), per_chip in cases.items()
  for chip, c in zip(("v5e", "v5p", "v6e"), per_chip, strict=True)
  if c is not None
}


def _flag_values(environ) -> dict[str, bool]:
  """The boolean libtpu flags set in `LIBTPU_INIT_ARGS` (the last setting of a flag wins)."""
  args = (os.environ if environ is None else environ).get("LIBTPU_INIT_ARGS", "")
  values = {}
  for token in args.split():
    name, _, value = token.lstrip("-").partition("=")
    values[name] = value.lower() in ("", "true", "1")
  return values


def async_exchange_enabled(environ=None, *, libtpu_version: tuple[int, ...] | None = None) -> bool:
  """Whether the block's exchange compiles async: libtpu's default unless `LIBTPU_INIT_ARGS`
  sets `xla_tpu_enable_async_ragged_all_to_all`.

  Args:
    environ: the environment to read (default `os.environ`).
    libtpu_version: the libtpu to assume (`schedule.libtpu_version()` form; `()` for none);
      None: the installed one.

  Returns:
    The flag's value in `LIBTPU_INIT_ARGS` if set there (the last setting wins), else
    `schedule.ragged_async_by_default(libtpu_version)` (True from libtpu 0.0.50).
  """
  # NOTE: only the ragged exchange's flag decides. `xla_tpu_enable_async_all_to_all` makes the
  # small all-to-alls of the transpose async too, but the chunks overlapped the same without it
  # (v5e:2x4, batch split 2: libtpu 0.0.42.1 with only the ragged flag, 0.0.50.1 by default).
  values = _flag_values(environ)
  flag = ASYNC_EXCHANGE_FLAGS[0]
  return values[flag] if flag in values else schedule.ragged_async_by_default(libtpu_version)


def modeled_batch_split(
  *,
  num_experts: int,
  top_k: int,
  d_model: int,
  expert_ffn_dim: int,
  expert_parallelism: int,
  tokens_per_device: int,
  generation: str,
  async_exchange: bool,
  dedup: bool = False,
) -> int:
  """The chunk count for a layer: the modeled choice where the exchange is async, else 1.

  Args:
    num_experts: global experts.
    top_k: experts per token.
    d_model: model width.
    expert_ffn_dim: expert hidden width.
    expert_parallelism: the expert-axis size.
    tokens_per_device: T.
    generation: TPU generation name ("v5e", "v5p", "v6e", ...).
    async_exchange: whether the compiled exchange is async (`async_exchange_enabled`).
    dedup: the block deduplicates its exchange (`moe.dedup_dispatch_for`): look the case up in
      `MODELED_BATCH_SPLIT_DEDUP` (falling back to `MODELED_BATCH_SPLIT`).

  Returns:
    c >= 1 dividing `tokens_per_device`.
  """
  if not async_exchange:
    return 1
  key = (
    num_experts,
    top_k,
    d_model,
    expert_ffn_dim,
    expert_parallelism,
    tokens_per_device,
    generation,
  )
  c = MODELED_BATCH_SPLIT.get(key, 1)
  if dedup:
    c = MODELED_BATCH_SPLIT_DEDUP.get(key, c)
  return c if tokens_per_device % c == 0 else 1
