"""How many token chunks the EP block pipelines by default (issue 15; MaxText's
`batch_split_factor`).

Chunking pays only where the expert exchange runs asynchronously, so that one chunk's dispatch
and combine can run under another chunk's expert matmuls. With libtpu 0.0.42.1's defaults the
block's `ragged-all-to-all`s compile synchronous (nothing runs under them, chunked or not;
`pallas_moe.schedule`, RESULTS.md "Issue 15: what the compiled EP step overlaps"); with
`xla_tpu_enable_async_ragged_all_to_all` and `xla_tpu_enable_async_all_to_all` they become
start/done pairs and the chunks overlap. So:

- exchanges synchronous (the default): 1 chunk, since splitting only makes the matmuls smaller;
- exchanges async (both flags in `LIBTPU_INIT_ARGS`, or the caller says so): the chunk count the
  step model picked for the case (`MODELED_BATCH_SPLIT`, from `python -m bench.ep`, which models
  the exchange on the slice's ICI and the gmm with `bench.costmodel`), else 1.

The table is keyed by the layer's dims, not by a model name, so a config with DeepSeek-V3's dims
gets DeepSeek-V3's choice whatever it is called. No jax at import.
"""

from __future__ import annotations

import os

__all__ = [
  "ASYNC_EXCHANGE_FLAGS",
  "MODELED_BATCH_SPLIT",
  "async_exchange_enabled",
  "modeled_batch_split",
]

# NOTE: the same flags as `pallas_moe.schedule.ASYNC_COLLECTIVE_OPTIONS` (that module parses
# HLO and needs nothing from here; these are the names as LIBTPU_INIT_ARGS spells them).
ASYNC_EXCHANGE_FLAGS = (
  "xla_tpu_enable_async_ragged_all_to_all",
  "xla_tpu_enable_async_all_to_all",
)

# (num_experts, top_k, d_model, expert_ffn_dim, expert parallelism, tokens per device,
#  generation) -> chunks. From `bench.ep.DEFAULT_BATCH_SPLIT` (the best of 1, 2, 4, 8 chunks in
# the modeled step, uniform routing, exact buffers); tests/test_batch_split.py checks the two
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
    (8, 4096): (2, 2, 2),
    (8, 16384): (4, 4, 4),
    (32, 4096): (8, 4, 2),
    (32, 16384): (8, 8, 2),
    (64, 4096): (8, 4, 2),
    (64, 16384): (8, 8, 2),
  },
  "qwen3-30b-a3b": {(8, 4096): (8, 4, 2), (8, 16384): (8, 8, 2)},
  "deepseek-v2-lite": {(8, 4096): (4, 4, 2), (8, 16384): (8, 8, 2)},
}
MODELED_BATCH_SPLIT: dict[tuple[int, int, int, int, int, int, str], int] = {
  (*_DIMS[model], ep, tokens, chip): c
  for model, cases in _CHOICES.items()
  for (ep, tokens), per_chip in cases.items()
  for chip, c in zip(("v5e", "v5p", "v6e"), per_chip, strict=True)
}


def async_exchange_enabled(environ=None) -> bool:
  """Whether both async-exchange flags are on in `LIBTPU_INIT_ARGS`.

  Args:
    environ: the environment to read (default `os.environ`).

  Returns:
    True when every flag of `ASYNC_EXCHANGE_FLAGS` is set to true there.
  """
  args = (os.environ if environ is None else environ).get("LIBTPU_INIT_ARGS", "")
  on = set()
  for token in args.split():
    name, _, value = token.lstrip("-").partition("=")
    if value.lower() in ("", "true", "1"):
      on.add(name)
    else:
      on.discard(name)
  return all(flag in on for flag in ASYNC_EXCHANGE_FLAGS)


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
  return c if tokens_per_device % c == 0 else 1
