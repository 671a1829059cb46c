"""One sub-block of our kernels as a standalone Pallas kernel, in several formulations.

`python -m bench.llo_variants --chip v6e --dims 256,2048,1408 --variant rs_masked` compiles the
variant deviceless with the LLO dumps on (`bench.llo.compile_dump`'s environment) and prints its
bundles, MXU-busy cycles and instruction classes. Analysis only: the kernels in `pallas_moe/`
are unchanged. Dims are (sub_m, k, tn) for the gmm variants and (sub_m, tk, tn) for the tgmm
ones.

Variants:
  masked / unmasked: gmm sub-block, out = where(row mask, x @ w, out) or a plain store.
  rs_masked / rs_unmasked: the same with rows stationary (out^T = w^T @ x^T, w given [tn, k]).
  wT: the once-per-group weight transpose [k, tn] -> [tn, k] of `rows_stationary`.
  kacc: the gmm contraction in 256-deep chunks summed in an f32 value.
  t_both / t_rhs / t_none: tgmm sub-block acc[tk, tn] += lhs[tk, sub_m] @ rhs[sub_m, tn] with
    both operands masked (as the kernel), only the rhs rows, or none.

Block-scaled fp8 variants, dims (rows, k, n): the fused kernel's gate and up products of one
piece, [rows, k] x [k, n] each, beside the dequantization of fp8 values with one f32 scale per
128 x 128 block (scales in SMEM):
  dq_products: the products of weights already dequantized (bf16 in VMEM).
  dq_loop: only the dequantization of the next piece, a loop over its 128-row block rows into a
    bf16 copy in VMEM (the fused kernel's route before it dequantized inline).
  dq_products_loop: the two, one after the other.
  dq_one_body: the two in one loop body (the dequantization unrolled beside the products).
  dq_inline / dq_inline_b11: the products of the fp8 values dequantized block by block on their
    way to the MXU (converted as float8_e4m3fn, or read as float8_e4m3b11fnuz), no copy.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

DEQUANT_VARIANTS = (
  "dq_products",
  "dq_loop",
  "dq_products_loop",
  "dq_one_body",
  "dq_inline",
  "dq_inline_b11",
)
VARIANTS = (
  *DEQUANT_VARIANTS,
  "masked",
  "unmasked",
  "rs_masked",
  "rs_unmasked",
  "wT",
  "kacc",
  "t_both",
  "t_rhs",
  "t_none",
)


def _compile_dequant(*, chip: str, variant: str, sub_m: int, k: int, tn: int) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental import topologies
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from pallas_moe import tiling

  b, bf16, f32 = 128, jnp.bfloat16, jnp.float32
  cb, kbs = tn // b, k // b

  def dequantized(v, scale):
    if variant == "dq_inline_b11":
      # NOTE: e4m3fn = 16 x e4m3b11fnuz of the same byte; 0x80 (-0) reads as NaN there.
      w = lax.bitcast_convert_type(v, jnp.float8_e4m3b11fnuz).astype(f32) * (scale * 16.0)
      return jnp.where(w == w, w, 0.0).astype(bf16)
    return (v.astype(f32) * scale).astype(bf16)

  def kernel(s_ref, x_ref, q_ref, w_ref, sums_ref, copy_ref):
    def block(which, kb, j):
      v = q_ref[which, pl.ds(kb * b, b), j * b : (j + 1) * b]
      return dequantized(v, s_ref[which, j, kb])

    def products():
      for which in range(2):
        sums_ref[which] = jnp.dot(x_ref[...], w_ref[which], preferred_element_type=f32)

    def store_row(kb):
      for which in range(2):
        for j in range(cb):
          copy_ref[which, pl.ds(kb * b, b), j * b : (j + 1) * b] = block(which, kb, j)

    def dequant_loop():
      def body(kb, carry):
        store_row(kb)
        return carry

      lax.fori_loop(0, kbs, body, 0)

    if variant in ("dq_products", "dq_products_loop", "dq_one_body"):
      products()
    if variant in ("dq_loop", "dq_products_loop"):
      dequant_loop()
    if variant == "dq_one_body":
      for kb in range(kbs):
        store_row(kb)
    if variant.startswith("dq_inline"):
      for which in range(2):
        rows = [
          jnp.concatenate([block(which, kb, j) for j in range(cb)], axis=1) for kb in range(kbs)
        ]
        w = jnp.concatenate(rows, axis=0)
        sums_ref[which] = jnp.dot(x_ref[...], w, preferred_element_type=f32)

  def f(s, x, q, w):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
      kernel,
      out_shape=(
        jax.ShapeDtypeStruct((2, sub_m, tn), f32),
        jax.ShapeDtypeStruct((2, k, tn), bf16),
      ),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), vmem, vmem, vmem],
      out_specs=(vmem, vmem),
      compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 * 2**20),
      name=f"variant_{variant}",
    )(s, x, q, w)

  gen = tiling.get_generation(chip)
  dev = topologies.get_topology_desc(topology_name=gen.aot_topology, platform="tpu").devices[0]
  sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())

  def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

  args = (
    sds((2, cb, kbs), f32),
    sds((sub_m, k), bf16),
    sds((2, k, tn), jnp.float8_e4m3fn),
    sds((2, k, tn), bf16),
  )
  with jax.default_device(dev):
    jax.jit(f).lower(*args).compile()


def _compile(*, chip: str, variant: str, sub_m: int, k: int, tn: int) -> None:
  if variant in DEQUANT_VARIANTS:
    _compile_dequant(chip=chip, variant=variant, sub_m=sub_m, k=k, tn=tn)
    return
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental import topologies
  from jax.experimental.pallas import tpu as pltpu
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from pallas_moe import tiling

  bf16 = jnp.bfloat16

  def row_mask(shape, start, end, dim):
    ids = lax.broadcasted_iota(jnp.int32, shape, dim)
    return (ids >= start) & (ids < end)

  def kernel(b_ref, x_ref, w_ref, o_ref):
    start, end = b_ref[0], b_ref[1]
    if variant == "wT":
      o_ref[...] = w_ref[...].T
      return
    if variant.startswith("t_"):
      lhs, rhs = x_ref[...], w_ref[...]
      if variant == "t_both":
        lhs = jnp.where(row_mask((k, sub_m), start, end, 1), lhs, 0)
      if variant in ("t_both", "t_rhs"):
        rhs = jnp.where(row_mask((sub_m, tn), start, end, 0), rhs, 0)
      o_ref[...] += jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
      return
    x = x_ref[...]
    if variant.startswith("rs_"):
      dims = (((1,), (1,)), ((), ()))
      prod = lax.dot_general(w_ref[...], x, dims, preferred_element_type=jnp.float32).T
    elif variant == "kacc":
      prod = jnp.zeros((sub_m, tn), jnp.float32)
      for c in range(0, k, 256):
        part = jnp.dot(x[:, c : c + 256], w_ref[c : c + 256, :], preferred_element_type=jnp.float32)
        prod = prod + part
    else:
      prod = jnp.dot(x, w_ref[...], preferred_element_type=jnp.float32)
    if variant.endswith("masked") and not variant.endswith("unmasked"):
      mine = row_mask((sub_m, tn), start, end, 0)
      o_ref[...] = jnp.where(mine, prod.astype(o_ref.dtype), o_ref[...])
    else:
      o_ref[...] = prod.astype(o_ref.dtype)

  x_shape, w_shape, o_shape, o_dt = (sub_m, k), (k, tn), (sub_m, tn), bf16
  if variant.startswith("rs_"):
    w_shape = (tn, k)
  if variant == "wT":
    o_shape = (tn, k)
  if variant.startswith("t_"):
    x_shape, w_shape, o_shape, o_dt = (k, sub_m), (sub_m, tn), (k, tn), jnp.float32

  def f(b, x, w):
    return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(o_shape, o_dt),
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(1,),
        in_specs=[
          pl.BlockSpec(x_shape, lambda i, b: (0, 0)),
          pl.BlockSpec(w_shape, lambda i, b: (0, 0)),
        ],
        out_specs=pl.BlockSpec(o_shape, lambda i, b: (0, 0)),
      ),
      compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 * 2**20),
      name=f"variant_{variant}",
    )(b, x, w)

  gen = tiling.get_generation(chip)
  dev = topologies.get_topology_desc(topology_name=gen.aot_topology, platform="tpu").devices[0]
  sh = NamedSharding(Mesh(np.array([dev]), ("x",)), P())
  args = (
    jax.ShapeDtypeStruct((2,), jnp.int32, sharding=sh),
    jax.ShapeDtypeStruct(x_shape, bf16, sharding=sh),
    jax.ShapeDtypeStruct(w_shape, bf16, sharding=sh),
  )
  with jax.default_device(dev):
    jax.jit(f).lower(*args).compile()


def main(argv=None) -> None:
  from bench import llo
  from bench.fused_vliw import _issued

  p = argparse.ArgumentParser(prog="python -m bench.llo_variants")
  p.add_argument("--chip", default="v6e")
  p.add_argument("--variant", default="masked", help=f"comma list of {VARIANTS}")
  p.add_argument("--dims", default="256,2048,1408", help="sub_m,k,tn")
  p.add_argument("--_compile", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args._compile:
    _compile(**json.loads(args._compile))
    return
  from pallas_moe import tiling

  sub_m, k, tn = (int(x) for x in args.dims.split(","))
  gen = tiling.get_generation(args.chip)
  for variant in args.variant.split(","):
    with tempfile.TemporaryDirectory(prefix="llo-variant-") as d:
      env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
      env["LIBTPU_INIT_ARGS"] = llo.DUMP_FLAGS.format(dir=d)
      spec = dict(chip=args.chip, variant=variant, sub_m=sub_m, k=k, tn=tn)
      cmd = [sys.executable, "-m", "bench.llo_variants", "--_compile", json.dumps(spec)]
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
      if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
      with open(llo.find_dump(d, f"variant_{variant}")) as f:
        bundles = llo.parse_bundles(f.read())
    root = llo.loop_tree(bundles)
    classes = collections.Counter()
    mxu = collections.Counter()
    for n in root.walk():
      classes.update(n.own_counts)
      mxu.update(n.own_mxu_cycles(gen))
    ops = collections.Counter(op.split(".")[0] for b in bundles for op in b.ops)
    counts = " ".join(f"{c}={v}" for c, v in classes.items() if v)
    # NOTE: issued: static loops counted their trip count times (the dq_ variants' loops).
    print(
      f"{args.chip} {variant} {args.dims}: {len(bundles)} bundles ({_issued(root)} issued),"
      " MXU-busy"
      f" {max(mxu.values(), default=0):.0f} cycles; {counts}; vsel={ops['vsel']}"
      f" vadd={ops['vadd']} vxpose={ops['vxpose']}"
    )


if __name__ == "__main__":
  main()
