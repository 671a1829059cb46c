"""Benchmark shapes (docs/design.md, "Benchmark shapes") and their group sizes."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Shape", "SHAPES", "SMALL_BATCH_TOKENS", "get_shape", "group_sizes", "ROUTINGS"]

SMALL_BATCH_TOKENS = 4096
ROUTINGS = ("uniform", "zipf")
_SEED = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  """One device's grouped-matmul problem.

  Attributes:
    name: model name.
    tokens: tokens on the device.
    top_k: experts per token.
    num_groups: local experts (G).
    k: d_model.
    n: expert ffn width.
  """

  name: str
  tokens: int
  top_k: int
  num_groups: int
  k: int
  n: int

  @property
  def m(self) -> int:
    """Rows: tokens x top_k."""
    return self.tokens * self.top_k

  def with_tokens(self, tokens: int) -> Shape:
    """The same model at another token count."""
    return dataclasses.replace(self, tokens=tokens)

  @property
  def label(self) -> str:
    return f"{self.name}@{self.tokens}"


SHAPES: dict[str, Shape] = {
  s.name: s
  for s in (
    Shape(name="mixtral-8x7b", tokens=16384, top_k=2, num_groups=8, k=4096, n=14336),
    Shape(name="deepseek-v2-lite", tokens=16384, top_k=6, num_groups=64, k=2048, n=1408),
    Shape(name="qwen3-30b-a3b", tokens=16384, top_k=8, num_groups=128, k=2048, n=768),
    Shape(name="deepseek-v3", tokens=32768, top_k=8, num_groups=256, k=7168, n=2048),
  )
}


def get_shape(name: str, *, tokens: int | None = None) -> Shape:
  """Looks up a benchmark shape.

  Args:
    name: a key of `SHAPES`.
    tokens: override the token count (e.g. `SMALL_BATCH_TOKENS`).

  Returns:
    The `Shape`.
  """
  if name not in SHAPES:
    raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
  shape = SHAPES[name]
  return shape.with_tokens(tokens) if tokens else shape


def group_sizes(shape: Shape, *, routing: str = "uniform", seed: int = _SEED) -> np.ndarray:
  """Rows per expert: a multinomial draw of m rows over G experts (fixed seed).

  Args:
    shape: the problem.
    routing: "uniform" (p_g = 1/G) or "zipf" (Zipf(1): p_g ∝ 1/(g+1), experts in a random
      order so the big groups are not all at the front).
    seed: numpy seed.

  Returns:
    int32 [G], summing to m.
  """
  rng = np.random.default_rng(seed)
  g = shape.num_groups
  if routing == "uniform":
    p = np.full(g, 1.0 / g)
  elif routing == "zipf":
    p = 1.0 / np.arange(1, g + 1)
    p = rng.permutation(p / p.sum())
  else:
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
  return rng.multinomial(shape.m, p).astype(np.int32)
