"""The serving forward (`moe_decode`) against Hugging Face's forward in float64: one and eight
tokens per device through the expert-parallel exchange on an 8-device CPU mesh, devices whose
local experts are all empty, both interpret modes, a DeepSeek-V3 fp8 block-scaled checkpoint
built here; AOT compiles for each TPU generation and the compiled op count."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_moe import decode, from_hf, moe, quant, tiling
from pallas_moe.config import MoEConfig
from tests.integrations.test_hf import (
  CONFIGS,
  _deq64,
  _fp8_config,
  fp8_state_dict,
  hf_choice,
  hf_moe,
  hf_state_dict,
)

# NOTE: f32 compute against float64: errors are a few f32 ulps of the largest entry; a routing,
# gather or combine mistake errs by O(1).
TOL = dict(rtol=1e-5, atol=1e-5)
DATA, EP = 2, 4


def _mesh():
  return jax.make_mesh((DATA, EP), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _tokens(d: int, per_device: int, seed: int = 3) -> np.ndarray:
  """Global tokens (split over data, then expert). At one token per device, the devices of an
  expert group get the same token: its k choices leave ep - k of them without a routed row."""
  rng = np.random.default_rng(seed)
  if per_device == 1:
    return np.repeat(rng.standard_normal((DATA, d)), EP, axis=0).astype(np.float32)
  return rng.standard_normal((DATA * EP * per_device, d)).astype(np.float32)


def _empty_devices(ids: np.ndarray, *, num_experts: int, per_device: int) -> int:
  """Devices none of whose local experts any token of their expert group chose."""
  e_local = num_experts // EP
  empty = 0
  for group in ids.reshape(DATA, EP * per_device, -1):
    owners = set((group // e_local).reshape(-1).tolist())
    empty += EP - len(owners)
  return empty


def _close(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  atol = TOL["atol"] * max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=TOL["rtol"], atol=atol)


def _run(params, x, config, **kw):
  return jax.jit(lambda p, x: decode.moe_decode(p, x, config, _mesh(), **kw))(params, x)


@pytest.mark.parametrize("per_device", [1, 8, 40])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_matches_hf_float64(family, per_device):
  """Greedy softmax routing (Qwen3) and DeepSeek-V3's biased group-limited routing with a
  shared expert; at one token per device some devices hold no routed row at all; at 40, 160
  tokens on the expert axis: each expert's own tokens gathered in the kernel."""
  config = CONFIGS[family]
  sd = hf_state_dict(family, fused=False)
  x = _tokens(config.d_model, per_device)
  params = from_hf(sd, config)
  plan = decode.plan_decode(config, tokens_per_device=per_device, expert_parallelism=EP)
  assert plan.fused.gather == (per_device * EP > decode.GATHER_ABOVE)
  ids = hf_choice(family, sd, x.astype(np.float64))
  if per_device == 1:
    assert _empty_devices(ids, num_experts=config.num_experts, per_device=1) > 0
  want = hf_moe(np, family, {k: np.asarray(v, np.float64) for k, v in sd.items()}, x, ids)
  _close(_run(params, jnp.asarray(x), config), want)


def test_simulator_mode():
  """The fused kernel under the TPU simulator (memory spaces, DMAs, NaN-filled scratch)."""
  config = CONFIGS["qwen3_moe"]
  sd = hf_state_dict("qwen3_moe", fused=False)
  x = _tokens(config.d_model, 1)
  ids = hf_choice("qwen3_moe", sd, x.astype(np.float64))
  want = hf_moe(np, "qwen3_moe", {k: np.asarray(v, np.float64) for k, v in sd.items()}, x, ids)
  got = _run(from_hf(sd, config), jnp.asarray(x), config, interpret=pltpu.InterpretParams())
  _close(got, want)


@pytest.mark.parametrize("per_device", [1, 8])
def test_deepseek_v3_fp8_checkpoint(per_device):
  """A DeepSeek-V3 MoE block stored as its checkpoints store it (fp8 experts, 128 x 128
  `weight_scale_inv`), loaded without widening and served from fp8: equal to the float64 HF
  forward on the dequantized weights."""
  config = _fp8_config()
  sd = fp8_state_dict(config)
  params = from_hf(sd, config)
  assert isinstance(params["wi"], quant.BlockQuantizedWeights)
  assert params["wi"].values.dtype == jnp.float8_e4m3fn
  deq = {k: np.asarray(v, np.float64) for k, v in sd.items() if not k.endswith("_scale_inv")}
  for key in list(deq):
    if key.endswith(".weight") and f"{key}_scale_inv" in sd:
      deq[key] = _deq64(sd, key.removesuffix(".weight"))
  x = _tokens(config.d_model, per_device)
  ids = hf_choice("deepseek_v3", deq, x.astype(np.float64))
  want = hf_moe(np, "deepseek_v3", deq, x, ids)
  _close(_run(params, jnp.asarray(x), config), want)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_above_the_fused_path(fp8):
  """640 tokens on the expert axis, past one fused call's 512: moe_block's forward, its experts
  the fused kernel streaming the received rows from HBM (float and fp8 block-scaled weights);
  equal to HF's float64 forward."""
  per_device = 160
  if fp8:
    config = _fp8_config(gmm_impl="xla")
    sd = fp8_state_dict(config)
    ref = {k: np.asarray(v, np.float64) for k, v in sd.items() if not k.endswith("_scale_inv")}
    for key in list(ref):
      if f"{key}_scale_inv" in sd:
        ref[key] = _deq64(sd, key.removesuffix(".weight"))
  else:
    config = dataclasses.replace(CONFIGS["qwen3_moe"], gmm_impl="xla")
    sd = hf_state_dict("qwen3_moe", fused=False)
    ref = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  family = "deepseek_v3" if fp8 else "qwen3_moe"
  params = from_hf(sd, config)
  plan = decode.plan_decode(
    config, tokens_per_device=per_device, expert_parallelism=EP, weights=params["wi"]
  )
  assert plan.path == "block" and plan.block.tokens_per_device == per_device
  assert plan.block.fused.stream and plan.block.fused.rows >= plan.block.expert_rows
  # NOTE: the streamed experts use no gmm tiles, so none are searched for.
  assert plan.block.wi is None and plan.block.wo is None
  assert "streamed fused kernel" in plan.describe()
  x = _tokens(config.d_model, per_device)
  want = hf_moe(np, family, ref, x, hf_choice(family, ref, x.astype(np.float64)))
  _close(_run(params, jnp.asarray(x), config), want)


def test_streamed_block_is_forward_only():
  """A gradient through the block's streamed fused experts raises a clear error (the training
  path plans the gmm pair)."""
  config = dataclasses.replace(CONFIGS["qwen3_moe"], gmm_impl="xla")
  params = from_hf(hf_state_dict("qwen3_moe", fused=False), config)
  plan = decode.plan_decode(config, tokens_per_device=600, generation="v6e")
  assert plan.path == "block" and plan.block.fused is not None
  x = jnp.asarray(_tokens(config.d_model, 600)[:600])
  loss = lambda x: jnp.sum(moe.moe_block(params, x, config, plan=plan.block)[0])  # noqa: E731
  # NOTE: the backward is traced (and raises) without running the forward.
  with pytest.raises(ValueError, match="forward only"):
    jax.eval_shape(jax.grad(loss), x)


def test_stream_window_follows_the_rows_per_expert():
  """128-row windows up to experts of about 128 rows, one window of about an expert's rows
  above (2.5 standard deviations past the mean), at most 256; the plan takes it."""
  assert [decode.stream_window(r) for r in (1, 32, 96, 128, 200, 400)] == [
    128, 128, 128, 160, 240, 256
  ]  # fmt: skip
  config = MoEConfig(**_deepseek_v3(), data_parallelism=1, expert_parallelism=32)
  plan = decode.plan_decode(config, tokens_per_device=128, expert_parallelism=32, generation="v6e")
  assert plan.path == "block" and plan.block.fused.window == 160
  # NOTE: where a window's vector work outruns the MXU past `fits` rows, experts that fit get
  # that window; bigger ones as before.
  assert [decode.stream_window(r, fits=96) for r in (1, 32, 64, 128)] == [96, 96, 96, 160]


def test_block_scaled_partials_plan():
  """DeepSeek-V3's fp8 experts on v5e: the stored values multiplied as they are ("partials"),
  streamed in 96-row windows where experts fit them; more than 128 tokens on the expert axis
  go through the streamed kernel, not the gathered layout's 128-token windows. On tpu7x (which
  unpacks e4m3fn itself) they are dequantized, and the gathered layout stays."""
  config = MoEConfig(**_deepseek_v3(), data_parallelism=1, expert_parallelism=8)
  e, d, f, b = 32, config.d_model, config.expert_ffn_dim, quant.BLOCK
  wi = quant.BlockQuantizedWeights(
    jax.ShapeDtypeStruct((e, d, 2 * f), jnp.float8_e4m3fn),
    jax.ShapeDtypeStruct((e, d // b, 2 * f // b), jnp.float32),
  )
  plan = functools.partial(decode.plan_decode, config, expert_parallelism=8, weights=wi)
  small = plan(tokens_per_device=8, generation="v5e")
  assert small.path == "fused" and small.fused.upcast == "partials"
  gathered = plan(tokens_per_device=32, generation="v5e")
  assert gathered.path == "block" and "gathered layout" in gathered.reason
  assert gathered.block.fused.upcast == "partials" and gathered.block.fused.window == 96
  native = plan(tokens_per_device=32, generation="tpu7x")
  assert native.path == "fused" and native.fused.gather and native.fused.upcast == "astype"


def test_plan_and_errors():
  config = CONFIGS["qwen3_moe"]
  plan = decode.plan_decode(config, tokens_per_device=8, expert_parallelism=EP)
  assert plan.path == "fused" and plan.fused.by_token and plan.fused.rows == EP * 8
  assert "fused kernel" in plan.describe()
  big = decode.plan_decode(config, tokens_per_device=256, expert_parallelism=EP)
  assert big.path == "block" and "1024 > 512 tokens" in big.describe()
  params = moe.init_params(jax.random.key(0), config)
  x = jnp.zeros((4, config.d_model))
  with pytest.raises(ValueError, match="plan is for 8 tokens"):
    decode.decode_block(params, x, config, plan=plan)
  fsdp = dataclasses.replace(config, fsdp_axis="fsdp", data_axis=None)
  mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match="keeps each device's experts whole"):
    decode.moe_decode(params, jnp.zeros((16, config.d_model)), fsdp, mesh)
  with pytest.raises(ValueError, match="store them quantized once"):
    decode.decode_block(params, x, dataclasses.replace(config, weight_quantization="int8"))


# --- compiled for TPUs (real libtpu, ahead of time) ---------------------------------------------


def _qwen3() -> dict:
  from bench.decode_ops import QWEN3_30B_A3B

  return QWEN3_30B_A3B


def _deepseek_v3() -> dict:
  from bench.scale_memory import DEEPSEEK_V3

  return DEEPSEEK_V3 | dict(weight_dtype="bfloat16")


def _compile_decode(topology: str, fields: dict, *, per_device: int, fp8: bool = False):
  from jax.experimental import topologies

  from pallas_moe.mesh import make_mesh

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  config = MoEConfig(**fields, data_parallelism=1, expert_parallelism=len(devices))
  mesh = make_mesh(config, devices)
  shapes = jax.eval_shape(lambda: moe.init_params(jax.random.key(0), config))
  if fp8:
    shapes = {
      k: jax.eval_shape(quant.quantize_blocks, v) if k in ("wi", "wo") else v
      for k, v in shapes.items()
    }
  specs = decode._weight_specs(config, shapes)
  shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
  params = jax.tree.map(
    lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shard(s)),
    shapes,
    specs,
    is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
  )
  x = jax.ShapeDtypeStruct(
    (per_device * len(devices), config.d_model),
    jnp.bfloat16,
    sharding=shard(jax.sharding.PartitionSpec(config.batch_axes)),
  )
  with jax.default_device(devices[0]), tiling.use_generation(topology.split(":")[0]):
    fn = jax.jit(lambda p, x: decode.moe_decode(p, x, config, mesh))
    return fn.lower(params, x).compile()


@pytest.mark.aot
@pytest.mark.parametrize("gen", ["v5e", "v5p", "v6e", "tpu7x"])
def test_deepseek_v3_fp8_compiles(gen):
  """DeepSeek-V3's layer from fp8 block-scaled experts, 8 tokens per device, EP over the
  topology's devices."""
  topology = tiling.get_generation(gen).aot_topology
  compiled = _compile_decode(topology, _deepseek_v3(), per_device=8, fp8=True)
  assert "pallas_moe_fused_experts" in compiled.as_text()


@pytest.mark.aot
@pytest.mark.parametrize("gen, fp8", [("v6e", False), ("v6e", True), ("v5p", False)])
def test_large_batches_compile(gen, fp8):
  """Past the fused path's 512 tokens (256 per device at EP 4): moe_block's forward, planned
  outside the shard_map, its experts one streamed fused kernel (bf16 and fp8 block-scaled
  weights), no gmm; on v5p over both TensorCores, the granule they share added back by one
  in-place dynamic-update-slice."""
  fields = _deepseek_v3() if fp8 else _qwen3()
  compiled = _compile_decode(
    tiling.get_generation(gen).aot_topology, fields, per_device=256, fp8=fp8
  )
  text = compiled.as_text()
  assert text.count("tpu_custom_call") == 1 and "pallas_moe_fused_experts" in text
  assert "pallas_moe_gmm" not in text
  assert ("dynamic-update-slice(" in text) == (gen == "v5p")


@pytest.mark.aot
def test_compiled_op_count():
  """Qwen3-30B-A3B's MoE layer, 8 tokens per device, EP 4 on v6e: at most 40 top-level XLA
  instructions in the compiled program, collectives, parameters and the kernel included."""
  from bench import decode_ops

  compiled = _compile_decode("v6e:2x2", _qwen3(), per_device=8)
  counts = decode_ops.count(compiled.as_text())
  assert counts["mosaic"] == 1, counts
  assert counts["total"] <= 40, counts
