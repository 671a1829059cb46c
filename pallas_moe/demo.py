"""Demo: train a scaled-down DeepSeek-V2-Lite-shaped MoE layer on 8 CPU devices (data=2 x expert=4).

  python -m pallas_moe.demo [--steps 30] [--routing noaux_tc] [--dispatch_quantization int8]

64 routed experts, top-6, 2 shared experts, small widths. `--routing noaux_tc` routes as
DeepSeek-V3 does instead (sigmoid scores, 8 groups of 8 experts, best 4 groups, a correction bias
for the choice) and updates the bias inside the jitted step from the step's global per-expert load
(`update_routed_bias`, aux-loss-free balancing); the bias is state, not trained by Adam.

A synthetic regression: a fixed random "teacher" (a dense tanh MLP) maps fresh random tokens to
targets; the MoE layer learns them with Adam on the mean squared error plus the weighted
load-balancing loss. Buffers are dropless and exact: before each step the router runs on the batch
(`moe.dropless_buffer_rows`) and the step is compiled once per buffer bucket. Prints the loss every
step, then tokens/s (steps that did not compile) and dropped rows.
"""

from __future__ import annotations

import os
import time

DATA, EXPERT = 2, 4


def _cpu_setup() -> None:
  """8 CPU devices; must run before jax initialises its backends."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  # NOTE: `python -m` imports pallas_moe (and jax) before this runs, so set the config too.
  jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  jax.config.update("jax_num_cpu_devices", DATA * EXPERT)
  # NOTE: interpret-mode kernels compile to big XLA:CPU loops; this only makes compiles faster.
  jax.config.update("jax_disable_most_optimizations", True)


def demo_config(routing: str = "greedy"):
  """The scaled-down DeepSeek-V2-Lite (DeepSeekV2-16B) MoE layer.

  Args:
    routing: "greedy" (DeepSeek-V2-Lite's) or "noaux_tc" (DeepSeek-V3's, with its bias update).
  """
  from pallas_moe.config import MoEConfig

  base = dict(num_experts=64, top_k=6, d_model=32, expert_ffn_dim=16, num_shared_experts=2)
  if routing == "noaux_tc":
    return MoEConfig(
      **base,
      score_func="sigmoid",
      topk_method="noaux_tc",
      n_group=8,
      topk_group=4,
      norm_topk_prob=True,
      routed_scaling_factor=2.5,
      routed_bias_update_rate=1e-3,
    )
  return MoEConfig(**base, score_func="softmax", aux_loss_coef=1e-3)


def _adam(grads, state, params, *, lr: float, b1=0.9, b2=0.999, eps=1e-8):
  """One Adam step (pure): returns (params, state)."""
  import jax
  import jax.numpy as jnp

  step, mu, nu = state
  step = step + 1
  mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
  nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
  scale = lr * jnp.sqrt(1 - b2**step) / (1 - b1**step)
  params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, mu, nu)
  return params, (step, mu, nu)


def main(
  *,
  steps: int = 30,
  tokens: int = 256,
  lr: float = 1e-2,
  log: bool = True,
  routing: str = "greedy",
  dispatch_quantization: str | None = None,
  gmm_impl: str = "pallas",
) -> dict:
  """Trains the student for `steps` steps.

  Args:
    steps: training steps.
    tokens: global tokens per step (split over the 8 devices).
    lr: Adam learning rate.
    log: print per-step losses and the summary.
    routing: see `demo_config`.
    dispatch_quantization: None, "int8" or "fp8": 8-bit forward dispatch
      (`MoEConfig.dispatch_quantization`).
    gmm_impl: the experts' grouped matmuls (`MoEConfig.gmm_impl`): "pallas" (the kernels;
      interpreted on CPU, whose compile is most of a short run's time) or "xla" / "ragged_dot".

  Returns:
    dict with `losses` (per step MSE), `tokens_per_s`, `dropped_rows` (total (token, choice)
    assignments not computed, `aux["dropped_rows"]` summed over steps), `buffer_rows`
    (per compiled bucket), `max_over_mean_load` (per step, busiest expert's rows / mean).
  """
  import dataclasses
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_moe import moe

  config = dataclasses.replace(demo_config(routing), gmm_impl=gmm_impl)
  if dispatch_quantization is not None:
    config = dataclasses.replace(config, dispatch_quantization=dispatch_quantization)
  mesh = jax.make_mesh(
    (DATA, EXPERT),
    (config.data_axis, config.expert_axis),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  # NOTE: the teacher is a fixed random dense tanh MLP (cheap to evaluate, smooth to learn).
  ka, kb = jax.random.split(jax.random.key(0))
  teacher_a = jax.random.normal(ka, (config.d_model, 4 * config.d_model)) / config.d_model**0.5
  teacher_b = (
    jax.random.normal(kb, (4 * config.d_model, config.d_model)) / 2.0 / config.d_model**0.5
  )
  params = moe.init_params(jax.random.key(1), config)
  p_shard, x_shard = moe.shardings(config, mesh, params)
  params = jax.device_put(params, p_shard)
  # NOTE: Adam sees only the weights; the correction bias (noaux_tc) is state (moe.trainable).
  zeros = lambda: jax.tree.map(jnp.zeros_like, moe.trainable(params)[0])
  state = (jnp.zeros(()), zeros(), zeros())  # NOTE: distinct buffers (the step donates them)

  @jax.jit
  def batch(key):
    x = jax.random.normal(key, (tokens, config.d_model), jnp.float32)
    y = jnp.tanh(x @ teacher_a) @ teacher_b
    return jax.device_put(x, x_shard), jax.device_put(y, x_shard)

  @functools.partial(jax.jit, static_argnames="buffer_rows", donate_argnums=(0, 1))
  def step(params, state, x, target, *, buffer_rows):
    weights, bias_state = moe.trainable(params)

    def loss_fn(w):
      y, aux = moe.moe_layer({**w, **bias_state}, x, config, mesh, buffer_rows=buffer_rows)
      mse = jnp.mean((y - target) ** 2)
      return mse + config.aux_loss_coef * aux["aux_loss"], (mse, aux)

    (_, (mse, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
    weights, state = _adam(grads, state, weights, lr=lr)
    # NOTE: DeepSeek-V3's aux-loss-free balancing: after the step, move the bias against the
    # step's global per-expert load (aux["expert_load"], already summed over the mesh).
    bias_state = {
      k: moe.update_routed_bias(b, aux["expert_load"], rate=config.routed_bias_update_rate)
      for k, b in bias_state.items()
    }
    return {**weights, **bias_state}, state, mse, aux

  # NOTE: round the exact need up to a quarter of the balanced per-device load (T * k), so
  # routing noise rarely changes the bucket (each new bucket is a compile).
  bucket = max(8, tokens // (DATA * EXPERT) * config.top_k // 4)
  losses, dropped, compiled, timed, timed_tokens, balance = [], 0, [], 0.0, 0, []
  for i in range(steps):
    x, target = batch(jax.random.key(100 + i))
    rows = moe.dropless_buffer_rows(params, x, config, mesh, multiple_of=bucket)
    fresh = rows not in compiled
    if fresh:
      compiled.append(rows)
    t0 = time.perf_counter()
    params, state, mse, aux = step(params, state, x, target, buffer_rows=rows)
    mse = float(mse)
    elapsed = time.perf_counter() - t0
    if not fresh:
      timed += elapsed
      timed_tokens += tokens
    dropped += int(aux["dropped_rows"])
    losses.append(mse)
    load = np.asarray(aux["expert_load"])
    balance.append(float(load.max() / load.mean()))
    if log:
      print(
        f"step {i:3d}  loss {mse:.5f}  aux {float(aux['aux_loss']):.3f}  max/mean load "
        f"{balance[-1]:.2f}  buffer_rows {rows}"
        f"  needed {int(aux['needed_rows'])}  dropped {int(aux['dropped_rows'])}"
        + ("  (compiled)" if fresh else "")
      )
  tps = timed_tokens / timed if timed else float("nan")
  if log:
    print(
      f"loss {losses[0]:.5f} -> {losses[-1]:.5f}; {tps:,.0f} tokens/s ({jax.default_backend()}, "
      f"gmm_impl={config.gmm_impl!r}, steps without a compile); dropped rows {dropped}; buffer "
      f"buckets {compiled}"
    )
  return {
    "losses": np.asarray(losses),
    "tokens_per_s": tps,
    "dropped_rows": dropped,
    "buffer_rows": compiled,
    "max_over_mean_load": np.asarray(balance),
  }


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--routing", choices=("greedy", "noaux_tc"), default="greedy")
  parser.add_argument(
    "--dispatch_quantization",
    choices=("int8", "fp8"),
    default=None,
    help="8-bit forward dispatch (MoEConfig.dispatch_quantization); default: none",
  )
  parser.add_argument(
    "--gmm_impl",
    choices=("pallas", "mosaic", "interpret", "xla", "ragged_dot"),
    default="pallas",
    help="the experts' grouped matmuls (MoEConfig.gmm_impl); default: the Pallas kernels",
  )
  args = parser.parse_args()
  _cpu_setup()
  main(
    steps=args.steps,
    tokens=args.tokens,
    routing=args.routing,
    dispatch_quantization=args.dispatch_quantization,
    gmm_impl=args.gmm_impl,
  )
