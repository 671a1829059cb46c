"""Memory per device of one DeepSeek-V3 MoE layer's training step at scale, from the compiler.

  python -m bench.scale_memory [--json FILE] [--cases NAME,...] [--tokens_per_device 4096]

Each case compiles, ahead of time for a TPU topology from this host (libtpu, no TPU), the step
a trainer runs for one MoE layer: f32 master weights and Adam moments in, bf16 weights cast from
them, `grad` of the layer's loss, the Adam update, the new master weights and moments out
(donated: they alias the inputs). `compiled.memory_analysis()` gives the bytes; a device needs
about arguments + outputs - aliased + temp. The whole model holds 58 such layers' state (the
arguments) and, with each layer rematerialized, one layer's temp at a time: `model_gb` is
58 x arguments + temp, the MoE layers alone (attention, embeddings and the 3 dense layers
add to it).

"Before" meshes are what the layer could do without fsdp: experts split over the expert axis,
every weight replicated over the data axis. "After" meshes split every weight over fsdp too.
The schedule of each compiled step says where its fsdp collectives run (`fsdp_collectives`).
"""

from __future__ import annotations

import os

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import hlo_schedule  # noqa: E402
from pallas_moe import moe, tiling  # noqa: E402
from pallas_moe.config import MoEConfig  # noqa: E402
from pallas_moe.mesh import make_mesh  # noqa: E402

# DeepSeek-V3's MoE layer (its config.json), bf16 compute, f32 master weights.
DEEPSEEK_V3 = dict(
  num_experts=256,
  top_k=8,
  d_model=7168,
  expert_ffn_dim=2048,
  num_shared_experts=1,
  score_func="sigmoid",
  topk_method="noaux_tc",
  n_group=8,
  topk_group=4,
  norm_topk_prob=True,
  routed_scaling_factor=2.5,
  dtype="bfloat16",
  weight_dtype="float32",
)
MOE_LAYERS = 58
HBM_GB = {"v5p": 95.0, "v6e": 32.0, "v5e": 16.0, "tpu7x": 192.0}

# name -> (topology, {role: size}); roles absent are not axes of the mesh.
CASES = {
  "v5p-32 data4 x ep8 (before)": ("v5p:2x4x4", dict(data=4, expert=8)),
  "v5p-32 ep32": ("v5p:2x4x4", dict(expert=32)),
  "v5p-32 fsdp4 x ep8": ("v5p:2x4x4", dict(fsdp=4, expert=8)),
  "v5p-32 fsdp2 x tp2 x ep8": ("v5p:2x4x4", dict(fsdp=2, tensor=2, expert=8)),
  "v6e-32 data4 x ep8 (before)": ("v6e:4x8", dict(data=4, expert=8)),
  "v6e-32 ep32": ("v6e:4x8", dict(expert=32)),
  "v6e-32 fsdp4 x ep8": ("v6e:4x8", dict(fsdp=4, expert=8)),
  "v5p-256 data4 x ep64 (before)": ("v5p:4x8x8", dict(data=4, expert=64)),
  "v5p-256 ep256 (before)": ("v5p:4x8x8", dict(expert=256)),
  "v5p-256 fsdp4 x ep64": ("v5p:4x8x8", dict(fsdp=4, expert=64)),
}


def case_config(sizes: dict, **fields) -> MoEConfig:
  """DeepSeek-V3's layer on a mesh of `sizes` (each role's axis named as the role)."""
  axes = {f"{r}_axis": (r if r in sizes else None) for r in ("data", "fsdp", "tensor")}
  counts = {f"{r}_parallelism": n for r, n in sizes.items()}
  return MoEConfig(**{**DEEPSEEK_V3, **fields}, **axes, **counts)


def _adam_step(config, mesh, *, lr=1e-4, b1=0.9, b2=0.95, eps=1e-8):
  """One Adam step of the layer: (master, m, v, x) -> (master, m, v), all f32 state."""

  def loss(weights, state, x):
    params = {k: w.astype(jnp.bfloat16) for k, w in weights.items()} | state
    y, aux = moe.moe_layer(params, x, config, mesh)
    return jnp.mean(jnp.square(y.astype(jnp.float32))) + 1e-3 * aux["aux_loss"]

  def step(master, m, v, state, x):
    grads = jax.grad(loss)(master, state, x)
    m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g.astype(jnp.float32), m, grads)
    v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * jnp.square(g.astype(jnp.float32)), v, grads)
    master = jax.tree.map(lambda w, a, b: w - lr * a / (jnp.sqrt(b) + eps), master, m, v)
    return master, m, v

  return step


def compile_case(topology: str, sizes: dict, *, tokens_per_device: int, buffer_factor: float):
  """The compiled Adam step of one case and its config."""
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  config = case_config(sizes, buffer_factor=buffer_factor)
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  mesh = make_mesh(config, topo.devices)
  shapes = jax.eval_shape(lambda: moe.init_params(jax.random.key(0), config))
  p_shard, x_shard = moe.shardings(config, mesh, shapes)
  weights, state = moe.trainable(
    {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=p_shard[k]) for k, v in shapes.items()}
  )
  batch = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1) * mesh.shape["expert"]
  x = jax.ShapeDtypeStruct(
    (tokens_per_device * batch, config.d_model), jnp.bfloat16, sharding=x_shard
  )
  step = _adam_step(config, mesh)
  with jax.default_device(topo.devices[0]), tiling.use_generation(topology.split(":")[0]):
    lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(weights, weights, weights, state, x)
    return lowered.compile(), config


def fsdp_collectives(text: str) -> dict:
  """Where the compiled step runs its fsdp collectives (the gathers and their transposes).

  Args:
    text: `compiled.as_text()` of a step whose weights are split over an fsdp axis.

  Returns:
    dict: `gathers` / `reduce_scatters`: how many in the entry computation; `asynchronous`:
    how many of them are start/done pairs; `before_dispatch`: gathers scheduled before the
    first dispatch exchange starts (nothing token-dependent waits on them there);
    `under_exchange`: synchronous ones issued while an async exchange is in flight (their
    link time overlaps the exchange's); `instructions`: the entry's instruction count.
  """
  sched = hlo_schedule.parse_schedule(text)
  entry = sched.computations[sched.entry]
  windows = [
    (a.start_index, a.done_index)
    for a in sched.async_collectives
    if a.computation == sched.entry and a.kind == "ragged-all-to-all"
  ]
  dispatch = min(
    (a.start_index for a in sched.async_collectives
     if a.computation == sched.entry and hlo_schedule.exchange_of(a.op_name) == "dispatch"),
    default=len(entry),
  )  # fmt: skip
  out = dict(gathers=0, reduce_scatters=0, asynchronous=0, before_dispatch=0, under_exchange=0)
  for i, inst in enumerate(entry):
    kind = inst.opcode.removesuffix("-start")
    if kind not in ("all-gather", "reduce-scatter") or "fsdp_gather" not in inst.op_name:
      continue
    out["gathers" if kind == "all-gather" else "reduce_scatters"] += 1
    out["asynchronous"] += inst.opcode.endswith("-start")
    out["before_dispatch"] += kind == "all-gather" and i < dispatch
    out["under_exchange"] += any(s < i < d for s, d in windows)
  out["instructions"] = len(entry)
  return out


def run_case(name: str, *, tokens_per_device: int, buffer_factor: float) -> dict:
  topology, sizes = CASES[name]
  chip = topology.split(":")[0]
  t0 = time.time()
  rec = dict(case=name, topology=topology, mesh=sizes, tokens_per_device=tokens_per_device)
  try:
    compiled, config = compile_case(
      topology, sizes, tokens_per_device=tokens_per_device, buffer_factor=buffer_factor
    )
  except jax.errors.JaxRuntimeError as e:
    rec.update(error=str(e).splitlines()[0][:300], compile_s=round(time.time() - t0, 1))
    return rec
  mem = compiled.memory_analysis()
  gb = 1e-9
  args, out, alias, temp = (
    mem.argument_size_in_bytes,
    mem.output_size_in_bytes,
    mem.alias_size_in_bytes,
    mem.temp_size_in_bytes,
  )
  rec.update(
    compile_s=round(time.time() - t0, 1),
    argument_gb=round(args * gb, 3),
    output_gb=round(out * gb, 3),
    alias_gb=round(alias * gb, 3),
    temp_gb=round(temp * gb, 3),
    layer_gb=round((args + out - alias + temp) * gb, 3),
    model_gb=round((MOE_LAYERS * args + temp) * gb, 2),
    hbm_gb=HBM_GB[chip],
    fsdp=fsdp_collectives(compiled.as_text()),
  )
  rec["layer_fits"] = rec["layer_gb"] <= HBM_GB[chip]
  rec["model_fits"] = rec["model_gb"] <= HBM_GB[chip]
  return rec


def table(records: list[dict]) -> str:
  head = (
    "| case | state (args) GB | temp GB | one layer GB | 58 layers GB | HBM | fits (layer / 58) "
    "| fsdp gathers / reduce-scatters (async) | gathers before dispatch | under the exchange "
    "|\n|---|---|---|---|---|---|---|---|---|---|"
  )
  rows = [head]
  for r in records:
    if "error" in r:
      rows.append(f"| {r['case']} | does not compile: {r['error'][:80]} ||||||||")
      continue
    f = r["fsdp"]
    rows.append(
      f"| {r['case']} | {r['argument_gb']:.1f} | {r['temp_gb']:.1f} | {r['layer_gb']:.1f} | "
      f"{r['model_gb']:.0f} | {r['hbm_gb']:.0f} | {'yes' if r['layer_fits'] else 'no'} / "
      f"{'yes' if r['model_fits'] else 'no'} | {f['gathers']} / {f['reduce_scatters']} "
      f"({f['asynchronous']}) | {f['before_dispatch']} | {f['under_exchange']} |"
    )
  return "\n".join(rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
  parser.add_argument("--tokens_per_device", type=int, default=4096)
  parser.add_argument("--buffer_factor", type=float, default=2.0)
  parser.add_argument("--json", default=None, help="write the records here")
  args = parser.parse_args(argv)
  records = []
  for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
    rec = run_case(name, tokens_per_device=args.tokens_per_device, buffer_factor=args.buffer_factor)
    print(json.dumps(rec), flush=True)
    records.append(rec)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
  print(table(records))


if __name__ == "__main__":
  main()
