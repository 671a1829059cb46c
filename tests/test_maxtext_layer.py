"""MaxText's own MoE layer (`maxtext==0.2.5`'s `RoutedMoE`) switched to pallas_moe, on 8 CPUs.

Builds MaxText's `RoutedMoE` from its own `configs/base.yml` with the deepseek2-16b model config
(DeepSeek-V2-Lite: 64 experts, top-6, softmax routing, silu x linear) scaled down, with
`sparse_matmul` and `megablox` and expert parallelism 4 x data 2, applies the README's swap
(`pallas_moe.maxtext.swap_into(maxtext.layers.moe)`: its `mblx` and its
`jax.lax.ragged_all_to_all`), and checks forward and `jax.grad` against a float32 dense MoE built
from the same weights. The stock layer (no swap) does not run on CPU: asserted too.

maxtext 0.2.5 needs Python >= 3.12 (the `maxtext` extra, pulled by `test` there); on Python 3.11
this module is skipped with the reason printed.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import numpy as np
import pytest

if sys.version_info < (3, 12):
  pytest.skip(
    "maxtext 0.2.5 (MaxText's own MoE layer) needs Python >= 3.12; this is "
    f"{sys.version_info.major}.{sys.version_info.minor}",
    allow_module_level=True,
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from pallas_moe import maxtext as mblx  # noqa: E402


@functools.cache
def _mt() -> types.SimpleNamespace:
  """MaxText's modules, imported when a test runs (importing them takes ~15 s: not at collection).

  NOTE: on Python >= 3.12 the test extra installs maxtext: a missing one is a failure.
  """
  try:
    import maxtext
    from flax import nnx
    from flax.linen import partitioning
    from maxtext.configs import pyconfig
    from maxtext.layers import initializers, moe
    from maxtext.utils import maxtext_utils
  except ImportError as e:
    raise ImportError(
      f"{e}: install the test extra (pip install -e '.[test]'), which pulls pallas_moe[maxtext] "
      f"(maxtext=={mblx.MAXTEXT_VERSION} and its MoE layer's imports) on Python >= 3.12."
    ) from e
  return types.SimpleNamespace(
    maxtext=maxtext,
    nnx=nnx,
    partitioning=partitioning,
    pyconfig=pyconfig,
    initializers=initializers,
    moe=moe,
    maxtext_utils=maxtext_utils,
  )


F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST
BATCH, SEQ = 8, 4  # global: one sequence of 4 tokens per device

# deepseek2-16b (configs/models/deepseek2-16b.yml) scaled down: emb 2048 -> 32, moe_mlp
# 1408 -> 16; 64 experts, top-6, softmax routing and routed_scaling_factor 1.0 are the model's.
OVERRIDES = dict(
  model_name="deepseek2-16b",
  override_model_config=True,
  base_emb_dim=32,
  base_moe_mlp_dim=16,
  base_mlp_dim=32,
  base_num_decoder_layers=2,
  ici_expert_parallelism=4,
  ici_data_parallelism=2,
  ici_fsdp_parallelism=1,
  dcn_data_parallelism=1,
  per_device_batch_size=1,
  max_target_length=SEQ,
  dtype="float32",
  weight_dtype="float32",
  matmul_precision="highest",
  sparse_matmul=True,
  megablox=True,
  attention="dot_product",
  hardware="cpu",
  enable_checkpointing=False,
  skip_jax_distributed_system=True,
  run_name="pallas_moe_test",
  # NOTE: base.yml's "~/jax_cache" would turn on JAX's persistent compilation cache for every
  # later test in this process (pyconfig.initialize sets it globally).
  jax_cache_dir="",
)


def test_maxtext_version_is_the_followed_one():
  from importlib import metadata

  assert metadata.version("maxtext") == mblx.MAXTEXT_VERSION


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
  return _build_layer(str(tmp_path_factory.mktemp("maxtext")))


def _build_layer(out_dir: str):
  """MaxText's RoutedMoE from its base.yml: (config, mesh, graphdef, params, other state)."""
  mt = _mt()
  base_yml = os.path.join(os.path.dirname(mt.maxtext.__file__), "configs", "base.yml")
  cfg = mt.pyconfig.initialize([None, base_yml], base_output_directory=out_dir, **OVERRIDES)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.routed_score_func) == (64, 6, "softmax")
  assert "deepseek" in str(cfg.decoder_block).lower() and not cfg.prefuse_moe_weights
  mesh = Mesh(mt.maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  assert dict(mesh.shape)["expert"] == 4 and dict(mesh.shape)["data"] == 2
  with jax.set_mesh(mesh), mt.partitioning.axis_rules(cfg.logical_axis_rules):
    model = mt.moe.RoutedMoE(
      config=cfg,
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh,
      kernel_init=mt.initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
      kernel_axes=("embed", None),
      intermediate_dim=cfg.moe_mlp_dim,
      dtype=F32,
      weight_dtype=F32,
      rngs=mt.nnx.Rngs(0),
    )
  graphdef, params, rest = mt.nnx.split(model, mt.nnx.Param, ...)
  return cfg, mesh, graphdef, params, rest


def _run(layer, x, params, cot, *, jit=jax.jit):
  """jit(value_and_grad) of sum(RoutedMoE(x) * cot) over (x, params); also the output."""
  cfg, mesh, graphdef, _, rest = layer

  def loss(x, params):
    module = _mt().nnx.merge(graphdef, params, rest)
    out, _, _ = module(x)
    return jnp.sum(out * cot), out

  with jax.set_mesh(mesh), _mt().partitioning.axis_rules(cfg.logical_axis_rules):
    return jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)


def _dense(x, gate, wi_0, wi_1, wo, *, top_k):
  """The float32 dense MoE of the same weights, routed as MaxText's RoutedMoE routes deepseek2.

  GateLogit applies the score function (softmax) to x @ gate; get_topk takes the top-k of those
  probabilities; deepseek_scale_weights multiplies by routed_scaling_factor (1.0) and, for a
  softmax score, does not renormalize. Each token: sum_j w_j * (silu(x wi_0[e]) * x wi_1[e]) wo[e].
  """
  probs = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, gate, precision=HI), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  combine = jnp.sum(jax.nn.one_hot(experts, gate.shape[1], dtype=F32) * weights[..., None], -2)
  h0 = jnp.einsum("bsd,edm->bsem", x, wi_0, precision=HI)
  h1 = jnp.einsum("bsd,edm->bsem", x, wi_1, precision=HI)
  y = jnp.einsum("bsem,emd->bsed", jax.nn.silu(h0) * h1, wo, precision=HI)
  return jnp.einsum("bsed,bse->bsd", y, combine, precision=HI)


def _close(a, b, *, tol=2e-5):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.abs(b).max())))


def _inputs(layer):
  cfg, params = layer[0], layer[3]
  kx, kc = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (BATCH, SEQ, cfg.emb_dim), F32)
  cot = jax.random.normal(kc, (BATCH, SEQ, cfg.emb_dim), F32)
  return x, cot, params


def test_maxtext_routed_moe_with_pallas_moe_matches_dense(layer):
  """README's swap: RoutedMoE's forward and jax.grad (x and every weight) == dense f32 MoE."""
  cfg = layer[0]
  x, cot, params = _inputs(layer)
  moe = _mt().moe
  originals = mblx.swap_into(moe)
  try:
    assert moe.mblx is mblx
    assert moe.jax.lax.ragged_all_to_all is mblx.ragged_all_to_all
    (_, out), (dx, dparams) = _run(layer, x, params, cot)
  finally:
    for name, value in originals.items():
      setattr(moe, name, value)
  assert moe.jax is jax  # restored

  names = ("gate", "wi_0", "wi_1", "wo")
  weights = [params["gate"]["kernel"][...]] + [params[n][...] for n in names[1:]]

  def dense_loss(x, *weights):
    out = _dense(x, *weights, top_k=cfg.num_experts_per_tok)
    return jnp.sum(out * cot), out

  (_, want), grads = jax.value_and_grad(dense_loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
    x, *weights
  )
  _close(out, want)
  _close(dx, grads[0])
  got = [dparams["gate"]["kernel"][...]] + [dparams[n][...] for n in names[1:]]
  for name, a, b in zip(names, got, grads[1:], strict=True):
    assert a.shape == b.shape, name
    _close(a, b)
  # NOTE: the experts that get tokens (most of the 64: 32 tokens x top-6) get the same gradients.
  used = np.count_nonzero(np.abs(np.asarray(grads[4])).max(axis=(1, 2)))
  assert used > 32 and np.count_nonzero(np.abs(np.asarray(got[3])).max(axis=(1, 2))) == used


def test_stock_maxtext_routed_moe_fails_on_cpu(layer):
  """Without the swap, MaxText's layer calls jax.lax.ragged_all_to_all: no XLA:CPU kernel."""
  cfg, mesh, graphdef, params, rest = layer
  x, _, _ = _inputs(layer)
  assert _mt().moe.jax is jax and _mt().moe.mblx is not mblx

  def forward(params, x):
    return _mt().nnx.merge(graphdef, params, rest)(x)[0]

  with jax.set_mesh(mesh), _mt().partitioning.axis_rules(cfg.logical_axis_rules):
    with pytest.raises(Exception, match="ragged-all-to-all"):
      jax.block_until_ready(jax.jit(forward)(params, x))
