"""How many XLA instructions a decode-size MoE layer compiles to, and where they come from.

  python -m bench.decode_ops [--tokens_per_device 8] [--topology v6e:2x2] [--ep 4]
      [--path serving|layer|megablox|switch|switch-prefused] [--rows 512]

At decode sizes (a few tokens per device) the layer's time is its fixed costs: one launch per
XLA instruction and Mosaic call beside the weight reads. This compiles a forward of Qwen3-30B-
A3B's MoE layer (128 experts top-8, d 2048, f 768, bf16) ahead of time for a TPU topology:
`moe_decode`, the serving forward (--path serving, the default), or `moe_layer`'s (--path layer;
only y is returned, so the aux-loss bookkeeping is dead code XLA drops), or the expert work of
MaxText's layer on one device (--path megablox: MaxText's megablox fork; --path switch:
`pallas_moe.maxtext.gmm`, the one-line switch; --path switch-prefused: the switch with MaxText's
`prefuse_moe_weights`, one gmm over [wi_0 | wi_1]): wi_0, wi_1 and wo over a `--rows` buffer
sorted by the 16 local experts, the SwiGLU between them, as MaxText's `sparse_matmul` calls
them. It counts the
top-level instructions of the entry computation (fusions count once; their bodies are not
top-level), grouped by opcode and by the layer's named scopes in their op_name (route, sort,
exchange_plan, dispatch, experts, combine, unsort, fsdp_gather; the rest is "other").
"""

from __future__ import annotations

import os

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import collections  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import hlo_schedule  # noqa: E402
from pallas_moe import decode, moe, tiling  # noqa: E402
from pallas_moe.config import MoEConfig  # noqa: E402
from pallas_moe.mesh import make_mesh  # noqa: E402

QWEN3_30B_A3B = dict(
  num_experts=128,
  top_k=8,
  d_model=2048,
  expert_ffn_dim=768,
  norm_topk_prob=True,
  dtype="bfloat16",
  weight_dtype="bfloat16",
)
# NOTE: MaxText's base.yml wi_tile_* / wo_tile_* (forward, dlhs, drhs), as its gmm calls pass them.
MAXTEXT_TILES = (512, 1024, 1024) * 3
# NOTE: bookkeeping instructions that cost no launch (operands, tuples, views).
FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant"}
SCOPES = (
  "route",
  "sort",
  "exchange_plan",
  "dispatch",
  "experts",
  "combine",
  "unsort",
  "fsdp_gather",
)


def scope_of(op_name: str) -> str:
  """The layer scope an instruction comes from (the last of `SCOPES` in its op_name)."""
  parts = op_name.split("/")
  for part in reversed(parts):
    for scope in SCOPES:
      if part == scope:
        return scope
  return "other"


def compile_decode(
  *, topology: str, ep: int, tokens_per_device: int, path: str = "serving", **fields
):
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  devices = topo.devices
  data = len(devices) // ep
  config = MoEConfig(**{**QWEN3_30B_A3B, **fields}, data_parallelism=data, expert_parallelism=ep)
  mesh = make_mesh(config, devices)
  shapes = jax.eval_shape(lambda: moe.init_params(jax.random.key(0), config))
  p_shard, x_shard = moe.shardings(config, mesh, shapes)
  params = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=p_shard[k]) for k, v in shapes.items()
  }
  x = jax.ShapeDtypeStruct(
    (tokens_per_device * len(devices), config.d_model), jnp.bfloat16, sharding=x_shard
  )

  def forward(p, x):
    if path == "serving":
      return decode.moe_decode(p, x, config, mesh)
    return moe.moe_layer(p, x, config, mesh)[0]

  with jax.default_device(devices[0]), tiling.use_generation(topology.split(":")[0]):
    return jax.jit(forward).lower(params, x).compile()


def compile_maxtext_experts(*, topology: str, path: str, rows: int, experts: int = 16):
  """MaxText's expert work on one device at Qwen3-30B-A3B's dims: gmm(x, wi_0), gmm(x, wi_1),
  silu(gate) * up, gmm(h, wo) over `rows` rows (bf16, f32 products cast back, as MaxText),
  with megablox (`path` "megablox", MaxText's installed fork) or the switch ("switch"; with
  "switch-prefused" gate and up as one gmm over their concatenation, MaxText's
  `prefuse_moe_weights`, the concatenation of adjacent slices of its stored wi)."""
  from jax.experimental import topologies

  if path == "megablox":
    from maxtext.kernels import megablox as mblx
  else:
    from pallas_moe import maxtext as mblx
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  dev = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
  d, f = QWEN3_30B_A3B["d_model"], QWEN3_30B_A3B["expert_ffn_dim"]
  bf16 = jnp.bfloat16

  def gmm(a, w, group_sizes):
    # NOTE: as MaxText's `sparse_matmul` calls it on a TPU mesh (base.yml's tiles).
    return mblx.gmm(
      lhs=a,
      rhs=w,
      group_sizes=group_sizes,
      preferred_element_type=bf16,
      tiling=MAXTEXT_TILES,
      use_tokamax_backend=False,
      interpret=False,
    )

  def experts_fn(x, w0, w1, wo, group_sizes):
    gate, up = gmm(x, w0, group_sizes), gmm(x, w1, group_sizes)
    return gmm(jax.nn.silu(gate) * up, wo, group_sizes)

  def prefused_fn(x, wi, wo, group_sizes):
    # NOTE: MaxText stores wi as [E, d, 2f] and slices wi_0 / wi_1 from it; their concatenation
    # is wi again (XLA folds it).
    w0, w1 = wi[..., :f], wi[..., f:]
    h = gmm(x, jnp.concatenate([w0, w1], axis=-1), group_sizes)
    return gmm(jax.nn.silu(h[:, :f]) * h[:, f:], wo, group_sizes)

  sds = jax.ShapeDtypeStruct
  x, wo, gs = sds((rows, d), bf16), sds((experts, f, d), bf16), sds((experts,), jnp.int32)
  if path == "switch-prefused":
    fn, args = prefused_fn, (x, sds((experts, d, 2 * f), bf16), wo, gs)
  else:
    fn, args = experts_fn, (x, sds((experts, d, f), bf16), sds((experts, d, f), bf16), wo, gs)
  with jax.default_device(dev), tiling.use_generation(topology.split(":")[0]):
    return jax.jit(fn).lower(*args).compile()


def count(text: str) -> dict:
  """Top-level instruction counts of the entry computation: total, costed, by opcode, by scope."""
  sched = hlo_schedule.parse_schedule(text)
  entry = sched.computations[sched.entry]
  costed = [i for i in entry if i.opcode not in FREE]
  return dict(
    total=len(entry),
    costed=len(costed),
    mosaic=sum(i.kernel is not None for i in costed),
    by_opcode=collections.Counter(i.opcode for i in costed).most_common(),
    by_scope=collections.Counter(scope_of(i.op_name) for i in costed).most_common(),
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v6e:2x2")
  parser.add_argument("--ep", type=int, default=4)
  parser.add_argument("--tokens_per_device", type=int, default=8)
  parser.add_argument(
    "--path",
    choices=("serving", "layer", "megablox", "switch", "switch-prefused"),
    default="serving",
  )
  parser.add_argument("--rows", type=int, default=512, help="megablox / switch: buffer rows")
  args = parser.parse_args(argv)
  if args.path in ("megablox", "switch", "switch-prefused"):
    compiled = compile_maxtext_experts(topology=args.topology, path=args.path, rows=args.rows)
    where = f"{args.topology.split(':')[0]}, one device, a {args.rows}-row buffer"
  else:
    compiled = compile_decode(
      topology=args.topology, ep=args.ep, tokens_per_device=args.tokens_per_device, path=args.path
    )
    where = f"{args.topology} EP {args.ep}, {args.tokens_per_device} tokens per device"
  c = count(compiled.as_text())
  print(
    f"{args.path}: {where}: "
    f"{c['total']} top-level instructions, {c['costed']} beside parameters / tuples / "
    f"bitcasts / constants, {c['mosaic']} Mosaic calls"
  )
  print("by scope:", ", ".join(f"{k} {v}" for k, v in c["by_scope"]))
  print("by opcode:", ", ".join(f"{k} {v}" for k, v in c["by_opcode"]))


if __name__ == "__main__":
  main()
