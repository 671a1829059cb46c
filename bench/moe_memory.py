"""Ahead-of-time TPU compile of one MoE training step; reports XLA's memory analysis.

  python -m bench.moe_memory [--topology v5e:2x4] [--ep 8] [--buffer_factor 2.0]

Needs libtpu (the `tpu` extra); no TPU: the step is compiled for a TPU topology from this host.
"""

from __future__ import annotations

import os

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_moe import moe  # noqa: E402
from pallas_moe.config import MoEConfig  # noqa: E402

# DeepSeek-V2-Lite's MoE layer at full width, bf16.
DEEPSEEK_V2_LITE = dict(
  num_experts=64,
  top_k=6,
  d_model=2048,
  expert_ffn_dim=1408,
  num_shared_experts=2,
  dtype="bfloat16",
  weight_dtype="bfloat16",
)


def aot_step_compiled(
  *,
  topology: str = "v5e:2x4",
  data: int = 1,
  ep: int = 8,
  tokens_per_device: int = 512,
  buffer_factor: float | None = 2.0,
  config: MoEConfig | None = None,
  with_value: bool = False,
  compiler_options: dict | None = None,
):
  """Compiles `jit(grad(sum(y**2) + aux_loss))` of `moe_layer` for a TPU topology.

  Args:
    topology: a `get_topology_desc` name, e.g. "v5e:2x4".
    data: data-axis size; `data * ep` must equal the topology's device count.
    ep: expert-axis size.
    tokens_per_device: tokens on each device.
    buffer_factor: receive-buffer factor (None: the dropless static bound, `ep` x the balanced
      load).
    config: the layer (default: DeepSeek-V2-Lite's MoE layer in bf16 with `buffer_factor`).
    with_value: compile `value_and_grad` (the training step's loss too) instead of `grad`.
    compiler_options: passed to `.compile(compiler_options=...)` (e.g. libtpu flags such as
      `pallas_moe.schedule.ASYNC_COLLECTIVE_OPTIONS`); None: the default program.

  Returns:
    The compiled executable (`.as_text()`, `.memory_analysis()`).
  """
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if config is None:
    config = MoEConfig(**DEEPSEEK_V2_LITE, buffer_factor=buffer_factor)
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  devices = np.array(topo.devices)
  if devices.size != data * ep:
    raise ValueError(f"{topology} has {devices.size} devices, not data*ep = {data * ep}.")
  mesh = jax.sharding.Mesh(
    devices.reshape(data, ep),
    (config.data_axis, config.expert_axis),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  params = jax.eval_shape(lambda: moe.init_params(jax.random.key(0), config))
  p_shard, x_shard = moe.shardings(config, mesh, params)
  params = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=p_shard[k]) for k, v in params.items()
  }
  x = jax.ShapeDtypeStruct(
    (tokens_per_device * data * ep, config.d_model), config.compute_dtype, sharding=x_shard
  )

  def loss(p, x):
    y, aux = moe.moe_layer(p, x, config, mesh)
    return jnp.sum(jnp.square(y.astype(jnp.float32))) + aux["aux_loss"]

  step = (jax.value_and_grad if with_value else jax.grad)(loss, argnums=(0, 1))
  from pallas_moe import tiling

  # NOTE: the block's tiles and chunk counts for the topology's chip (on a CPU host the current
  # generation is v5e unless set).
  with jax.default_device(topo.devices[0]), tiling.use_generation(topology.split(":")[0]):
    return jax.jit(step).lower(params, x).compile(compiler_options=compiler_options)


def aot_step_memory(**kwargs):
  """`compiled.memory_analysis()` of `aot_step_compiled(**kwargs)` (has `temp_size_in_bytes`,
  `argument_size_in_bytes`, ...)."""
  return aot_step_compiled(**kwargs).memory_analysis()


def aot_step_temp_bytes(**kwargs) -> int:
  """`temp_size_in_bytes` of `aot_step_memory(**kwargs)`."""
  return int(aot_step_memory(**kwargs).temp_size_in_bytes)


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5e:2x4")
  parser.add_argument("--data", type=int, default=1)
  parser.add_argument("--ep", type=int, default=8)
  parser.add_argument("--tokens_per_device", type=int, default=512)
  parser.add_argument("--buffer_factor", type=float, default=2.0)
  args = parser.parse_args()
  mem = aot_step_memory(**vars(args))
  print(mem)
  print(f"temp bytes: {mem.temp_size_in_bytes:,}")
