"""pallas_moe: Pallas TPU kernels for Mixture-of-Experts training in JAX."""

from pallas_moe.ops import Tiling, gmm, tgmm

__all__ = ["Tiling", "gmm", "tgmm"]
