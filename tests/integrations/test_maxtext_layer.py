"""MaxText's own MoE layer (`maxtext==0.2.5`'s `RoutedMoE`) switched to pallas_moe, on 8 CPUs.

Builds MaxText's `RoutedMoE` from its own `configs/base.yml` with the deepseek2-16b model config
(DeepSeek-V2-Lite: 64 experts, top-6, softmax routing, silu x linear) scaled down, with
`sparse_matmul` and `megablox` and expert parallelism 4 x data 2, applies docs/maxtext.md's swap
(`pallas_moe.maxtext.swap_into(maxtext.layers.moe)`: its `mblx` and its
`jax.lax.ragged_all_to_all`), and checks forward and `jax.grad` against a float32 dense MoE built
from the same weights. The stock layer (no swap) does not run on CPU: asserted too.

Which kernels the compiled layer runs (`-m aot`, libtpu): the same layer (bf16, wider dims, tile
keys set) is compiled ahead of time for a v5e topology, value_and_grad included, and every Mosaic
call of the compiled program is read back as (kernel, tiles): the kernel is the call's name, the
tiles are the name scope `pallas_moe_tiles_<tm>x<tk>x<tn>` pallas_moe launches it under, both in
the call's op_name metadata. By default they are exactly the kernels `pallas_moe.record_plans`
planned (row-tile kernels at pallas_moe's tiles for v5e); with `swap_into(moe,
honour_tiling=True)`, visit-schedule kernels at MaxText's wi_tile_* / wo_tile_* triples.

maxtext 0.2.5 needs Python >= 3.12 (the `maxtext` extra, pulled by `test` there); on Python 3.11
this module is skipped with the reason printed.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import sys
import time
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

import pallas_moe as pm  # noqa: E402
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


def _build_layer(out_dir: str, **extra):
  """MaxText's RoutedMoE from its base.yml (and `extra` config keys): (config, mesh, graphdef,
  params, other state)."""
  mt = _mt()
  base_yml = os.path.join(os.path.dirname(mt.maxtext.__file__), "configs", "base.yml")
  overrides = OVERRIDES | extra
  cfg = mt.pyconfig.initialize([None, base_yml], base_output_directory=out_dir, **overrides)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.routed_score_func) == (64, 6, "softmax")
  assert "deepseek" in str(cfg.decoder_block).lower()
  assert bool(cfg.prefuse_moe_weights) == bool(extra.get("prefuse_moe_weights", False))
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
  """docs/maxtext.md's swap: RoutedMoE's forward and jax.grad (x, every weight) == dense f32 MoE."""
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


def test_maxtext_prefused_weights_with_pallas_moe_match_dense(tmp_path):
  """With MaxText's `prefuse_moe_weights` (wi stored as [E, d, 2f], gate and up as one gmm over
  it: one call fewer at decode sizes), the switched layer's forward and input gradient equal
  the dense f32 MoE of the same weights."""
  layer = _build_layer(str(tmp_path), prefuse_moe_weights=True)
  cfg, params = layer[0], layer[3]
  assert "wi" in params and "wi_0" not in params
  x, cot, _ = _inputs(layer)
  moe = _mt().moe
  originals = mblx.swap_into(moe)
  try:
    with pm.record_plans() as plans:
      (_, out), (dx, _) = _run(layer, x, params, cot)
  finally:
    for name, value in originals.items():
      setattr(moe, name, value)
  wi = params["wi"][...]
  f = wi.shape[-1] // 2
  weights = (params["gate"]["kernel"][...], wi[..., :f], wi[..., f:], params["wo"][...])

  def dense_loss(x):
    out = _dense(x, *weights, top_k=cfg.num_experts_per_tok)
    return jnp.sum(out * cot), out

  (_, want), want_dx = jax.value_and_grad(dense_loss, has_aux=True)(x)
  _close(out, want)
  _close(dx, want_dx)
  # NOTE: the gmm calls' output widths: gate and up as one [d, 2f] product, down as [f, d].
  widths = sorted({p.dims[2] for p in plans if p.op == "gmm"})
  assert widths == sorted({2 * f, cfg.emb_dim}), [p.describe() for p in plans]


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


# --------------------------------------------------------------------------------------------
# The compiled layer, ahead of time for a TPU: which Mosaic kernels it calls, at which tiles.
# --------------------------------------------------------------------------------------------

AOT_TOPOLOGY, AOT_GENERATION = "v5e:2x2", "v5e"  # 4 chips: expert parallelism 4
AOT_EMB, AOT_MLP, AOT_TOKENS = 256, 384, 128  # tokens per device
# A device's receive buffer: tokens x top-6 x min(ep, 64 / 6) rows (MaxText's dropless bound),
# already a multiple of wi_tile_fwd_batch_seq (256), MaxText's row padding.
AOT_ROWS = AOT_TOKENS * 6 * 4
# MaxText's 18 tile keys (base.yml: 512, 1024, 1024 everywhere), set so that each of the six
# (weight, pass) pairs has its own triple and each honoured pass runs a visit-schedule kernel
# (gmm: tk < k; tgmm: tk not dividing k or tn not dividing n); wo_tile_fwd_embed_dim is over
# n = emb, to be clamped.
AOT_TILE_KEYS = dict(
  wi_tile_fwd_batch_seq=256,
  wi_tile_fwd_embed_dim=128,
  wi_tile_fwd_mlp_dim=128,
  wi_tile_dlhs_batch_seq=128,
  wi_tile_dlhs_mlp_dim=128,
  wi_tile_dlhs_embed_dim=256,
  wi_tile_drhs_batch_seq=512,
  wi_tile_drhs_embed_dim=128,
  wi_tile_drhs_mlp_dim=256,
  wo_tile_fwd_batch_seq=256,
  wo_tile_fwd_mlp_dim=128,
  wo_tile_fwd_embed_dim=512,
  wo_tile_dlhs_batch_seq=512,
  wo_tile_dlhs_embed_dim=128,
  wo_tile_dlhs_mlp_dim=128,
  wo_tile_drhs_batch_seq=128,
  wo_tile_drhs_mlp_dim=256,
  wo_tile_drhs_embed_dim=128,
)
_WI, _WO = (AOT_ROWS, AOT_EMB, AOT_MLP), (AOT_ROWS, AOT_MLP, AOT_EMB)  # a gmm's (m, k, n)
# MaxText's triples in kernel coordinates (its get_wi_gmm_params / get_wo_gmm_params: fwd gmm
# (m, k, n), dlhs gmm over the transposed weights (m, n, k), drhs tgmm (m, k, n)), clamped.
MAXTEXT_TRIPLES = {
  (_WI, "fwd"): (256, 128, 128),
  (_WI, "dlhs"): (128, 128, 256),
  (_WI, "drhs"): (512, 128, 256),
  (_WO, "fwd"): (256, 128, 256),  # wo_tile_fwd_embed_dim 512 clamped to n = emb = 256
  (_WO, "dlhs"): (512, 128, 128),
  (_WO, "drhs"): (128, 256, 128),
}
AOT_OVERRIDES = dict(
  OVERRIDES,
  base_emb_dim=AOT_EMB,
  base_moe_mlp_dim=AOT_MLP,
  base_mlp_dim=AOT_EMB,
  ici_expert_parallelism=4,
  ici_data_parallelism=1,
  max_target_length=AOT_TOKENS,
  dtype="bfloat16",
  weight_dtype="bfloat16",
  matmul_precision="default",
  hardware="tpu",
  compile_topology_num_slices=1,
  run_name="pallas_moe_aot_test",
  **AOT_TILE_KEYS,
)

# A Mosaic call's op_name: <name stack>/pallas_moe_tiles_<tm>x<tk>x<tn>/<kernel>/pallas_call.
_MOSAIC_OP = re.compile(
  r'op_name="(?P<stack>[^"]*)/pallas_moe_tiles_(?P<tiles>\d+x\d+x\d+)/(?P<kernel>\w+)/pallas_call"'
)
# The start of an HLO instruction (a custom call's text may span several lines).
_INSTRUCTION = re.compile(r"\n(?=\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s)")


def _mosaic_calls(text: str) -> list[tuple[str, str, tuple[int, int, int]]]:
  """(phase, kernel, tiles) of every Mosaic call (tpu_custom_call) in compiled HLO text.

  phase: "bwd" for calls under the name stack's `transpose(...)` (the VJP), else "fwd". kernel:
  the kernel's name, which is also the instruction's name (checked). tiles: the scope's triple.
  """
  calls = []
  for instr in _INSTRUCTION.split(text):
    if 'custom_call_target="tpu_custom_call"' not in instr:
      continue
    op = _MOSAIC_OP.search(instr)
    assert op, f"a Mosaic call without pallas_moe's tiles scope: {instr[:400]}"
    name = instr.split("=", 1)[0].strip().removeprefix("ROOT").strip().lstrip("%")
    assert name.split(".")[0] == op["kernel"], (name, op["kernel"])
    phase = "bwd" if "transpose(" in op["stack"] else "fwd"
    tiles = tuple(int(t) for t in op["tiles"].split("x"))
    calls.append((phase, op["kernel"], tiles))
  return calls


def _planned(plans) -> list[tuple[str, str, tuple[int, int, int]]]:
  """(phase, kernel, tiles) of every kernel the recorded plans launch."""
  return [
    ("fwd" if name == "fwd" else "bwd", kt.kernel, tuple(kt.tiles))
    for plan in plans
    for name, kt in plan.kernels
  ]


def _aot_compile(out_dir: str, *, honour_tiling: bool):
  """value_and_grad of MaxText's swapped RoutedMoE, compiled for AOT_TOPOLOGY.

  Returns:
    (plans recorded while lowering, compiled HLO text, seconds to lower and compile).
  """
  mt = _mt()
  from jax.experimental import topologies
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from pallas_moe import record_plans, tiling

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  topo = topologies.get_topology_desc(topology_name=AOT_TOPOLOGY, platform="tpu")
  base_yml = os.path.join(os.path.dirname(mt.maxtext.__file__), "configs", "base.yml")
  cfg = mt.pyconfig.initialize([None, base_yml], base_output_directory=out_dir, **AOT_OVERRIDES)
  assert (cfg.emb_dim, cfg.moe_mlp_dim, cfg.num_experts) == (AOT_EMB, AOT_MLP, 64)
  mesh = Mesh(mt.maxtext_utils.create_device_mesh(cfg, devices=topo.devices), cfg.mesh_axes)
  assert dict(mesh.shape)["expert"] == 4 and mesh.size == 4
  rules = cfg.logical_axis_rules

  def abstract(tree):
    specs = mt.nnx.get_partition_spec(tree)
    return jax.tree.map(
      lambda v, s: jax.ShapeDtypeStruct(
        v.shape,
        v.dtype,
        sharding=NamedSharding(mesh, mt.partitioning.logical_to_mesh_axes(s, rules)),
      ),
      tree,
      specs,
    )

  moe = mt.moe
  originals = mblx.swap_into(moe, honour_tiling=honour_tiling)
  try:
    with jax.set_mesh(mesh), mt.partitioning.axis_rules(rules):
      model = mt.nnx.eval_shape(
        lambda: moe.RoutedMoE(
          config=cfg,
          num_experts=cfg.num_experts,
          num_experts_per_tok=cfg.num_experts_per_tok,
          mesh=mesh,
          kernel_init=mt.initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
          kernel_axes=("embed", None),
          intermediate_dim=cfg.moe_mlp_dim,
          dtype=cfg.dtype,
          weight_dtype=cfg.weight_dtype,
          rngs=mt.nnx.Rngs(0),
        )
      )
      graphdef, params, rest = mt.nnx.split(model, mt.nnx.Param, ...)
      params, rest = abstract(params), abstract(rest)
      x = jax.ShapeDtypeStruct(
        (mesh.size, AOT_TOKENS, AOT_EMB),
        jnp.bfloat16,
        sharding=NamedSharding(mesh, P(("data", "expert"), None, None)),
      )

      def loss(params, x, rest):
        out, _, _ = mt.nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(jnp.square(out.astype(F32)))

      step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
      start = time.perf_counter()
      with tiling.use_generation(AOT_GENERATION), jax.default_device(topo.devices[0]):
        with record_plans() as plans:
          lowered = step.lower(params, x, rest)
        text = lowered.compile().as_text()
      seconds = time.perf_counter() - start
  finally:
    for name, value in originals.items():
      setattr(moe, name, value)
  assert moe.jax is jax and moe.mblx is not mblx  # restored
  return plans, text, seconds


@pytest.mark.aot
@pytest.mark.parametrize("honour_tiling", [False, True], ids=["pallas_moe_tiles", "maxtext_tiles"])
def test_compiled_layer_runs_the_planned_kernels(tmp_path, honour_tiling):
  """The compiled training step calls exactly the planned Mosaic kernels at the planned tiles.

  Default swap: the three gmms (wi_0, wi_1, wo) each run pallas_moe's row-tile kernels (fwd,
  dlhs, drhs) at pallas_moe's tiles for v5e, none of them MaxText's; honour_tiling: the
  visit-schedule kernels at MaxText's triples, each pass its own. The HLO side is read from the
  compiled program alone (the kernel's name and its tiles scope in each Mosaic call's op_name);
  forward calls are outside the VJP's `transpose(...)`, backward ones inside.
  """
  plans, text, seconds = _aot_compile(str(tmp_path), honour_tiling=honour_tiling)
  print(f"{AOT_TOPOLOGY} honour_tiling={honour_tiling}: lowered and compiled in {seconds:.1f} s")
  assert [(p.op, p.dims, p.num_groups, p.generation) for p in plans] == [
    ("gmm", _WI, 16, AOT_GENERATION),
    ("gmm", _WI, 16, AOT_GENERATION),
    ("gmm", _WO, 16, AOT_GENERATION),
  ]
  compiled = _mosaic_calls(text)
  # NOTE: exactly: no zero fills either (MaxText's rows outside the local groups stay undefined).
  assert collections.Counter(compiled) == collections.Counter(_planned(plans))
  assert len(compiled) == 9

  for plan in plans:
    for name, kt in plan.kernels:
      maxtext_triple = MAXTEXT_TRIPLES[(plan.dims, name)]
      if honour_tiling:
        assert kt.kernel == ("pallas_moe_tgmm" if name == "drhs" else "pallas_moe_gmm"), (name, kt)
        assert tuple(kt.tiles) == maxtext_triple, (plan.dims, name, kt)
      else:
        assert kt.kernel == (
          "pallas_moe_tgmm_rowtile" if name == "drhs" else "pallas_moe_gmm_rowtile"
        )
        assert tuple(kt.tiles) != maxtext_triple, (plan.dims, name, kt)
        if name != "drhs":  # the row-tile gmm holds the whole contraction: tk = k
          m, k, n = plan.dims
          assert kt.tiles[1] == (k if name == "fwd" else n), (plan.dims, name, kt)
