"""pallas_moe: Pallas TPU kernels for Mixture-of-Experts training in JAX."""
