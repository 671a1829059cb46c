"""MaxText's MoE layer as it runs with pallas_moe switched in: every gmm call, modeled per chip.

  python -m bench.maxtext_layer [--models ...] [--eps 8 32] [--tokens 4096 16384]
                                [--chips v5e v5p v6e tpu7x] [--json FILE] [--markdown]

Needs maxtext 0.2.5 (Python >= 3.12, the `maxtext` extra). For each (model, ep, tokens per
device) it:

1. Captures the layer's gmm calls from MaxText itself: MaxText's `RoutedMoE` (or
   `RoutedAndSharedMoE` where the model has shared experts) built from its own base.yml and model
   config, with its routing (gate, top-k, score function, bias), `sparse_matmul` + `megablox`,
   expert parallelism `ep` on `ep` CPU devices and its dropless receive buffer, runs forward on
   random tokens. Its `mblx.gmm` is replaced by a recorder that keeps each call's arguments as
   MaxText passes them (shapes after MaxText's row padding to `wi_tile_fwd_batch_seq`, the 9-int
   tiling, group_offset, transposes) and every device's group sizes (a host callback), and
   returns zeros instead of multiplying; `ragged_all_to_all` is replaced by a stand-in that moves
   no data (the group sizes come from MaxText's all-gathered counts, not from the rows moved).
   The hidden dims are scaled down for the capture (emb 32, expert width 8) and the calls'
   k and n mapped back to the model's (emb, expert width, or twice it for fused weights): the
   routing depends on the token count, experts and top-k, which stay the model's.
2. Models each call on the busiest device (most rows), forward and both backward kernels:
   - ours: the kernels and tiles `pallas_moe.maxtext.gmm` plans for that chip and call (traced
     through its VJP under `tiling.use_generation(chip)`: what a user who applied
     `swap_into(maxtext.layers.moe)` runs; `--honour_tiling` for MaxText's tiles honoured);
   - stock: megablox at MaxText's tiles, as MaxText's `_gmm_bwd` runs it (fwd tiling[0:3], dlhs
     gmm with the transposed weights at tiling[3:6], drhs tgmm at tiling[6:9], each clamped).
     It is the upstream megablox kernel (`jax.experimental.pallas.ops.tpu.megablox`), whose grid,
     index maps and group metadata MaxText's fork keeps.
   The model is `bench.costmodel`'s (per TensorCore on tpu7x); no TPU runs anything.

Records (`--json`): one per (model, ep, tokens, chip) with `ours_us`, `stock_us`, `ratio`, the
buffer and real rows, and per kernel its plan (kernel, tiles, why) and both modeled times.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time
import types
from typing import Any

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/accel0"):
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import impls  # noqa: E402
from bench.shapes import Shape  # noqa: E402

__all__ = [
  "CAPTURE_EMB",
  "CAPTURE_MLP",
  "CASES",
  "LayerCall",
  "capture",
  "layer_calls",
  "model_cases",
  "table",
]

# MaxText model configs (configs/models/<name>.yml) and the expert-parallel degrees benchmarked.
CASES = (
  ("deepseek2-16b", 4),
  ("deepseek2-16b", 8),
  ("qwen3-30b-a3b", 8),
  ("qwen3-30b-a3b", 32),
  ("mixtral-8x7b", 8),
  ("deepseek3-671b", 8),
  ("deepseek3-671b", 32),
)
TOKENS = (4096, 16384)
CHIPS = ("v5e", "v5p", "v6e", "tpu7x")
# Hidden dims of the capture run: distinct from each other, from twice the expert width and
# from any row count, so that each call's k and n map back to the model's dims unambiguously.
CAPTURE_EMB = 32
CAPTURE_MLP = 8
OURS = "pallas_moe-switch"
STOCK = "megablox-maxtext-stock"
_OPS = ("fwd", "dlhs", "drhs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCall(Shape):
  """One gmm call of MaxText's layer on one device, at the model's dims.

  `k` and `n` are the forward's (lhs [m, k], weights [G, k, n]); `tokens` and `top_k` the
  device's tokens and the model's top-k.

  Attributes:
    call: which call of the layer ("wi_0", "wi_1", "wo", or "wi" for fused weights).
    count: identical calls folded into this one (MaxText's wi_0 and wi_1 are the same problem).
    ep: expert-parallel degree.
    buffer_rows: the gmm's m: MaxText's receive buffer padded to `wi_tile_fwd_batch_seq`.
    rows: the rows the device's groups hold (sum(group_sizes)): the bounds' minimum bytes.
    tiling: the 9 ints MaxText passes.
    honour_tiling: model the switch with MaxText's tiles honoured.
  """

  call: str
  count: int
  ep: int
  buffer_rows: int
  rows: int
  tiling: tuple[int, ...]
  honour_tiling: bool = False

  @property
  def m(self) -> int:
    return self.buffer_rows

  @property
  def label(self) -> str:
    return f"{self.name}@{self.tokens}/ep{self.ep}/{self.call}"


# ----------------------------------------------------------------------------------------------
# 1. Capture.


class _Recorder(types.ModuleType):
  """Stands in for MaxText's `mblx`: records each gmm call, returns zeros."""

  def __init__(self, axis: str):
    super().__init__("pallas_moe_bench_mblx_recorder")
    self.axis = axis
    self.calls: list[dict[str, Any]] = []
    self.sizes: dict[tuple[int, int], np.ndarray] = {}

  def gmm(
    self,
    lhs,
    rhs,
    group_sizes,
    preferred_element_type=jnp.float32,
    tiling=None,
    group_offset=None,
    existing_out=None,
    transpose_rhs=False,
    interpret=None,
    **kwargs,
  ):
    index = len(self.calls)
    self.calls.append(
      dict(
        lhs=tuple(lhs.shape),
        rhs=tuple(rhs.shape),
        group_sizes=tuple(group_sizes.shape),
        tiling=tuple(tiling),
        group_offset=group_offset is not None,
        existing_out=existing_out is not None,
        transpose_rhs=bool(transpose_rhs),
        dtypes=(str(lhs.dtype), str(rhs.dtype), str(jnp.dtype(preferred_element_type))),
        quantize=(kwargs.get("lhs_quantize_dtype"), kwargs.get("rhs_quantize_dtype")),
      )
    )
    offset = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset)
    jax.debug.callback(
      functools.partial(self._keep, index), jax.lax.axis_index(self.axis), group_sizes, offset
    )
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    # NOTE: zeros that carry lhs's varying axes, as the real output does inside shard_map.
    return jnp.zeros((lhs.shape[0], n), preferred_element_type) + 0 * lhs[:, :1].astype(
      preferred_element_type
    )

  def _keep(self, index, device, group_sizes, offset):
    if int(offset) != 0:
      raise NotImplementedError("group_offset != 0 (ring of experts) is not captured")
    self.sizes[(index, int(device))] = np.asarray(group_sizes, np.int32)


def _no_data_ragged_all_to_all(operand, output, *args, **kwargs):
  """The exchange's result buffer, with no rows moved (the capture needs only the counts)."""
  del args, kwargs
  return output + 0 * operand[:1].astype(output.dtype)


def _maxtext_config(model: str, *, ep: int, tokens: int, out_dir: str, dims=None):
  """MaxText's config of `model` for the capture mesh; `dims` (emb, expert width, dense MLP
  width) scale its hidden dims down."""
  import maxtext
  from maxtext.configs import pyconfig

  base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  extra = {}
  if dims is not None:
    emb, mlp, dense = dims
    extra = dict(override_model_config=True, base_emb_dim=emb, base_moe_mlp_dim=mlp)
    extra.update(base_mlp_dim=dense, base_num_decoder_layers=1)
  return pyconfig.initialize(
    [None, base_yml],
    base_output_directory=out_dir,
    model_name=model,
    ici_expert_parallelism=ep,
    ici_data_parallelism=1,
    ici_fsdp_parallelism=1,
    dcn_data_parallelism=1,
    per_device_batch_size=1,
    max_target_length=tokens,
    dtype="bfloat16",
    weight_dtype="float32",
    sparse_matmul=True,
    megablox=True,
    attention="dot_product",
    hardware="cpu",
    enable_checkpointing=False,
    skip_jax_distributed_system=True,
    run_name="pallas_moe_bench_maxtext_layer",
    jax_cache_dir="",
    **extra,
  )


def capture(model: str, *, ep: int, tokens: int, out_dir: str = "/tmp/pallas_moe_maxtext_layer"):
  """Runs MaxText's layer forward with the recorder; its gmm calls and group sizes.

  Args:
    model: a MaxText model config name (configs/models/<model>.yml).
    ep: expert parallelism (needs `ep` JAX devices).
    tokens: tokens per device.
    out_dir: MaxText's base_output_directory.

  Returns:
    (real_dims, calls, sizes): the model's (emb, expert width, experts, top_k); the recorder's
    calls; {(call index, device): group sizes}.
  """
  from flax import nnx
  from flax.linen import partitioning
  from jax.sharding import Mesh
  from maxtext.layers import initializers, moe
  from maxtext.utils import maxtext_utils

  real = _maxtext_config(model, ep=ep, tokens=tokens, out_dir=out_dir)
  real_dims = (real.emb_dim, real.moe_mlp_dim, real.num_experts, real.num_experts_per_tok)
  # NOTE: MaxText requires a fully-MoE model's (Mixtral's) dense width to equal the experts'.
  dense = CAPTURE_MLP if real.mlp_dim == real.moe_mlp_dim else 4 * CAPTURE_EMB
  cfg = _maxtext_config(
    model, ep=ep, tokens=tokens, out_dir=out_dir, dims=(CAPTURE_EMB, CAPTURE_MLP, dense)
  )
  if len(jax.devices()) < ep:
    raise RuntimeError(
      f"ep={ep} needs {ep} devices, this process has {len(jax.devices())}: set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={ep} (main() does)."
    )
  devices = np.asarray(jax.devices()[:ep])
  mesh = Mesh(maxtext_utils.create_device_mesh(cfg, devices=devices), cfg.mesh_axes)
  from pallas_moe.maxtext import _Delegate

  recorder = _Recorder("expert")
  originals = {"mblx": moe.mblx, "jax": moe.jax}
  lax = _Delegate("jax.lax", jax.lax, ragged_all_to_all=_no_data_ragged_all_to_all)
  moe.mblx, moe.jax = recorder, _Delegate("jax", jax, lax=lax)
  try:
    with jax.set_mesh(mesh), partitioning.axis_rules(cfg.logical_axis_rules):
      common = dict(
        config=cfg,
        mesh=mesh,
        kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", None),
        rngs=nnx.Rngs(0),
        weight_dtype=jnp.float32,
        dtype=jnp.bfloat16,
      )
      if cfg.shared_experts:
        layer = moe.RoutedAndSharedMoE(**common)
      else:
        layer = moe.RoutedMoE(
          num_experts=cfg.num_experts,
          num_experts_per_tok=cfg.num_experts_per_tok,
          intermediate_dim=cfg.moe_mlp_dim,
          **common,
        )
      graphdef, state = nnx.split(layer)
      x = jax.random.normal(jax.random.key(1), (ep, tokens, cfg.emb_dim), jnp.bfloat16)

      @jax.jit
      def forward(state, x):
        return nnx.merge(graphdef, state)(x)[0]

      jax.block_until_ready(forward(state, x))
      jax.effects_barrier()
  finally:
    moe.mblx, moe.jax = originals["mblx"], originals["jax"]
  return real_dims, recorder.calls, recorder.sizes


def _real_dim(d: int, *, emb: int, mlp: int) -> int:
  table = {CAPTURE_EMB: emb, CAPTURE_MLP: mlp, 2 * CAPTURE_MLP: 2 * mlp}
  if d not in table:
    raise ValueError(f"captured dim {d} is none of the scaled-down hidden dims {sorted(table)}")
  return table[d]


def layer_calls(
  model: str, *, ep: int, tokens: int, honour_tiling: bool = False
) -> tuple[list[tuple[LayerCall, np.ndarray]], dict[str, Any]]:
  """The busiest device's gmm calls of MaxText's layer at the model's dims (see `capture`).

  Returns:
    ([(call, group_sizes)], info): identical calls folded (`count`); info has the device, its
    rows, the buffer rows and the per-device rows.
  """
  (emb, mlp, num_experts, top_k), calls, sizes = capture(model, ep=ep, tokens=tokens)
  if not calls:
    raise RuntimeError(f"{model}: MaxText's layer made no mblx.gmm call (megablox path off?)")
  rows = {d: int(sizes[(0, d)].sum()) for d in range(ep)}
  device = max(rows, key=rows.get)
  names = ["wi_0", "wi_1", "wo"] if len(calls) == 3 else ["wi", "wo"]
  folded: dict[tuple, list] = {}
  for i, c in enumerate(calls):
    if c["transpose_rhs"] or c["group_offset"] and len(sizes[(i, device)]) != c["rhs"][0]:
      raise NotImplementedError(f"{model}: call {i} ({c}) is not a plain local-expert gmm")
    m, k = c["lhs"]
    n = c["rhs"][2]
    key = (m, k, n, c["rhs"][0], c["tiling"], sizes[(i, device)].tobytes())
    if key in folded:
      folded[key][1] += 1
      folded[key][0] += "+" + names[i]
      continue
    folded[key] = [names[i], 1, i, m, k, n]
  out = []
  for name, count, i, m, k, n in folded.values():
    gs = sizes[(i, device)]
    shape = LayerCall(
      name=model,
      tokens=tokens,
      top_k=top_k,
      num_groups=len(gs),
      k=_real_dim(k, emb=emb, mlp=mlp),
      n=_real_dim(n, emb=emb, mlp=mlp),
      call=name,
      count=count,
      ep=ep,
      buffer_rows=m,
      rows=int(gs.sum()),
      tiling=calls[i]["tiling"],
      honour_tiling=honour_tiling,
    )
    out.append((shape, gs))
  info = dict(
    device=device,
    rows=rows[device],
    buffer_rows=out[0][0].buffer_rows,
    rows_per_device=[rows[d] for d in range(ep)],
    num_experts=num_experts,
    calls=[c | dict(lhs=list(c["lhs"]), rhs=list(c["rhs"])) for c in calls],
  )
  return out, info


# ----------------------------------------------------------------------------------------------
# 2. Model: the switch's plan, and stock megablox at MaxText's tiles.


@functools.cache
def _switch_plan(shape: LayerCall, generation: str) -> dict[str, Any]:
  """{pass: KernelTiling} of `pallas_moe.maxtext.gmm` on this call, for `generation`."""
  import pallas_moe
  from pallas_moe import maxtext as mblx
  from pallas_moe import tiling as tiling_lib

  dt = impls.DTYPE
  lhs = jax.ShapeDtypeStruct((shape.m, shape.k), dt)
  rhs = jax.ShapeDtypeStruct((shape.num_groups, shape.k, shape.n), dt)
  gs = jax.ShapeDtypeStruct((shape.num_groups,), jnp.int32)

  def loss(x, w, gs):
    # NOTE: MaxText's call: the 9 ints, group_offset 0 (ragged all-to-all path), bf16 output.
    out = mblx.gmm(
      x, w, gs, dt, tiling=shape.tiling, group_offset=0, honour_tiling=shape.honour_tiling
    )
    return out.astype(jnp.float32).sum()

  with tiling_lib.use_generation(generation), pallas_moe.record_plans() as plans:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1)), lhs, rhs, gs)
  if len(plans) != 1 or plans[0].op != "gmm":
    raise RuntimeError(f"expected one gmm plan for {shape.label}, got {plans}")
  return dict(plans[0].kernels)


def _ours_build(*, op, shape, group_sizes, generation):
  kt = _switch_plan(shape, generation.name)[op]
  unowned = "zero" if kt.fill_unowned else "undefined"
  case = impls._pallas_moe_build(kt.tiles, unowned_rows=unowned)(
    op=op, shape=shape, group_sizes=group_sizes, generation=generation
  )
  if case.kernel.startswith("rowtile") != kt.rowtile:
    raise RuntimeError(f"{shape.label} {op}: the bench's kernel differs from the plan's {kt}")
  return dataclasses.replace(
    case, extra=dict(case.extra, plan_kernel=kt.kernel, plan_reason=kt.reason)
  )


def _stock_build(*, op, shape, group_sizes, generation):
  triple = {"fwd": shape.tiling[0:3], "dlhs": shape.tiling[3:6], "drhs": shape.tiling[6:9]}[op]
  return impls._megablox_build(tuple(triple))(
    op=op, shape=shape, group_sizes=group_sizes, generation=generation
  )


impls.register(
  impls.Impl(
    name=OURS,
    build=_ours_build,
    tiling_depends_on_generation=True,
    program_depends_on_generation=True,
  )
)
impls.register(impls.Impl(name=STOCK, build=_stock_build))


def model_cases(cases, *, chips) -> list[dict]:
  """Models captured calls (`layer_calls`) on each chip: one record per (case, chip).

  Args:
    cases: [(calls, info)] from `layer_calls`.
    chips: generation names.

  Returns:
    Records: model, ep, tokens, chip, ours_us, stock_us, ratio, rows, buffer_rows, kernels.
  """
  import bench.__main__ as bench_main

  out = []
  for calls, info in cases:
    recs = bench_main.run_cases(
      cases=[(shape, "maxtext", gs) for shape, gs in calls],
      chips=chips,
      ops=list(_OPS),
      impl_names=[OURS, STOCK],
    )
    by = {(r["shape"], r["op"], r["impl"], r["chip"]): r for r in recs}
    first = calls[0][0]
    for chip in chips:
      kernels, ours, stock = [], 0.0, 0.0
      for shape, _ in calls:
        for op in _OPS:
          o, s = by[(shape.label, op, OURS, chip)], by[(shape.label, op, STOCK, chip)]
          ours += shape.count * o["modeled_us"]
          stock += shape.count * s["modeled_us"]
          kernels.append(
            dict(
              call=shape.call,
              count=shape.count,
              op=op,
              m=shape.m,
              k=shape.k,
              n=shape.n,
              groups=shape.num_groups,
              kernel=o["plan_kernel"],
              tiles=o["tiling"],
              why=o["plan_reason"],
              ours_us=o["modeled_us"],
              bound_us=o["achievable_us"],
              stock_tiles=s["tiling"],
              stock_us=s["modeled_us"],
            )
          )
      out.append(
        dict(
          model=first.name,
          ep=first.ep,
          tokens=first.tokens,
          chip=chip,
          honour_tiling=first.honour_tiling,
          ours_us=ours,
          stock_us=stock,
          ratio=ours / stock,
          rows=info["rows"],
          buffer_rows=info["buffer_rows"],
          bound_us=sum(k["count"] * k["bound_us"] for k in kernels),
          group_sizes=[int(g) for g in calls[0][1]],
          maxtext_tiling=list(first.tiling),
          kernels=kernels,
        )
      )
  return out


def table(records: list[dict], *, markdown: bool) -> str:
  """One row per record: model, ep, tokens, chip, rows / buffer, ours, stock, ratio."""
  cols = ("model", "ep", "tokens", "chip", "rows / buffer", "ours_us", "stock_us", "ours/stock")
  rows = [
    [
      r["model"],
      str(r["ep"]),
      str(r["tokens"]),
      r["chip"],
      f"{r['rows']:,} / {r['buffer_rows']:,}",
      f"{r['ours_us']:,.0f}",
      f"{r['stock_us']:,.0f}",
      f"{r['ratio']:.2f}",
    ]
    for r in records
  ]
  if markdown:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
  else:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
  if records:
    ratios = sorted(r["ratio"] for r in records)
    lines.append(
      f"\nours/stock over {len(ratios)} cases: median {float(np.median(ratios)):.2f}, "
      f"min {ratios[0]:.2f}, max {ratios[-1]:.2f}; below 1.0 on "
      f"{sum(x < 1.0 for x in ratios)}"
    )
  return "\n".join(lines) + "\n"


def chip_table(records: list[dict]) -> str:
  """Markdown: one row per (model, ep), ours/stock per chip as "4096 tokens / 16384 tokens"."""
  chips = [c for c in CHIPS if any(r["chip"] == c for r in records)]
  keys = sorted({(r["model"], r["ep"]) for r in records}, key=lambda k: (k[0], k[1]))
  by = {(r["model"], r["ep"], r["tokens"], r["chip"]): r for r in records}
  lines = ["| model | ep | " + " | ".join(chips) + " |", "|---|---|" + "---|" * len(chips)]
  for model, ep in keys:
    cells = []
    for chip in chips:
      got = [by.get((model, ep, t, chip)) for t in TOKENS]
      cells.append(" / ".join("-" if r is None else f"{r['ratio']:.2f}" for r in got))
    lines.append(f"| {model} | {ep} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=sorted({m for m, _ in CASES}))
  parser.add_argument("--eps", nargs="+", type=int, default=None, help="default: CASES' degrees")
  parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  parser.add_argument("--chips", nargs="+", default=list(CHIPS))
  parser.add_argument("--honour_tiling", action="store_true", help="ours at MaxText's tiles")
  parser.add_argument("--json", default=None)
  parser.add_argument("--markdown", action="store_true")
  parser.add_argument(
    "--from_json", nargs="+", default=None, help="only print the tables of saved records"
  )
  args = parser.parse_args(argv)
  if args.from_json:
    records = [r for path in args.from_json for r in json.load(open(path))]
    print(table(records, markdown=args.markdown), end="")
    print("\nours / stock per chip, 4096 / 16384 tokens per device:\n")
    print(chip_table(records), end="")
    return
  todo = [(m, ep) for m, ep in CASES if m in args.models and (args.eps is None or ep in args.eps)]
  if not todo:
    raise SystemExit(f"no case selected; CASES = {CASES}")
  jax.config.update("jax_num_cpu_devices", max(ep for _, ep in todo))
  records = []
  for model, ep in todo:
    for tokens in args.tokens:
      t0 = time.time()
      calls, info = layer_calls(model, ep=ep, tokens=tokens, honour_tiling=args.honour_tiling)
      print(
        f"# captured {model} ep {ep} tokens {tokens}: {len(info['calls'])} gmm calls, busiest "
        f"device {info['device']} with {info['rows']:,} of {info['buffer_rows']:,} rows "
        f"({time.time() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
      )
      recs = model_cases([(calls, info)], chips=args.chips)
      for r in recs:
        print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), file=sys.stderr)
      records.extend(recs)
      if args.json:
        with open(args.json, "w") as f:
          json.dump(records, f, indent=1)
  print(
    f"# {datetime.date.today()} jax {jax.__version__}; MaxText's layer captured on CPU, "
    "kernels modeled (no TPU)"
  )
  print(table(records, markdown=args.markdown), end="")


if __name__ == "__main__":
  main()
