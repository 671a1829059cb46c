"""Test setup: CPU only (libtpu is installed for AOT checks), 8 CPU devices, hypothesis profiles."""

import os

# With libtpu installed, `import jax` would try to open a TPU. Tests run on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Only one process may open libtpu unless this is set; AOT tests run in parallel test workers.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
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
# edge rows by manual DMAs (more kernel code to compile in interpret mode).
settings.register_profile(
  "ci",
  max_examples=7,
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
