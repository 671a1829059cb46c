"""The MoE layer's mesh: which axes it splits tokens and weights over, and building one.

Four roles, each an optional mesh axis named by the config (`MoEConfig.{role}_axis`), in
MaxText's mesh order:

  data    tokens split; weights replicated.
  fsdp    tokens split; every weight split too (fully sharded data parallelism): the layer
          gathers a weight where it needs it whole and its gradient comes back reduce-scattered.
  tensor  tokens replicated; the expert MLP width split (Megatron's column / row split of each
          MLP), partial outputs summed once per layer.
  expert  tokens split; the routed experts split, rows exchanged (`collectives`).

Tokens are split over (data, fsdp, expert), major to minor: device (a, f, e) holds token block
`(a * F + f) * EP + e`, as MaxText's `activation_batch` rule splits a batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_moe.config import MESH_ROLES, MoEConfig

__all__ = ["MeshSizes", "check_mesh", "make_mesh", "token_spec"]


class MeshSizes(NamedTuple):
  """The size of each role's axis on a mesh (1 where the config has no such axis)."""

  data: int
  fsdp: int
  tensor: int
  expert: int

  @property
  def batch_devices(self) -> int:
    """Devices holding distinct tokens: data x fsdp x expert."""
    return self.data * self.fsdp * self.expert


def token_spec(config: MoEConfig) -> P:
  """The PartitionSpec of [tokens, d] activations: tokens over (data, fsdp, expert)."""
  return P(config.batch_axes)


def check_mesh(mesh: Mesh, config: MoEConfig) -> MeshSizes:
  """Checks that `mesh` has the config's axes at the sizes it expects; returns their sizes.

  Raises:
    ValueError: an axis the config names is missing, has another size than the config's
      `{role}_parallelism` (times its `dcn_parallelism`), or the mesh has an axis of size > 1
      the config does not use (the layer would repeat its whole work over it).
  """
  sizes = {}
  dcn = dict(config.dcn_parallelism)
  for role in MESH_ROLES:
    axis = getattr(config, f"{role}_axis")
    if axis is None:
      sizes[role] = 1
      continue
    if axis not in mesh.shape:
      raise ValueError(
        f"mesh axes {tuple(mesh.shape)} lack {axis!r} (MoEConfig.{role}_axis); build the mesh "
        f"with pallas_moe.make_mesh(config), or set {role}_axis to one of the mesh's axes"
        + (" or None." if role != "expert" else ".")
      )
    size = mesh.shape[axis]
    ici, across = getattr(config, f"{role}_parallelism"), dcn.get(role, 1)
    if ici is not None and ici > 0 and across > 0 and size != ici * across:
      said = f"{role}_parallelism={ici}" + (f" x dcn {across}" if across != 1 else "")
      raise ValueError(
        f"MoEConfig.{said} but the mesh's {axis!r} axis has size {size}; make them agree "
        "(or set the parallelism to -1 or None)."
      )
    sizes[role] = int(size)
  used = set(config.mesh_axes.values())
  idle = {a: n for a, n in mesh.shape.items() if a not in used and n > 1}
  if idle:
    raise ValueError(
      f"mesh axes {idle} are not axes of the MoE layer (MoEConfig's axes: {config.mesh_axes}): "
      "its whole work would be repeated over them. Name them as one of the config's axes or "
      "build the mesh without them."
    )
  return MeshSizes(**sizes)


def make_mesh(config: MoEConfig, devices=None) -> Mesh:
  """The mesh the config describes, over `devices`, its axes in MaxText's order.

  Sizes come from `{role}_parallelism` (per slice; -1: the devices left, None: 1) and
  `dcn_parallelism` (across slices, outermost; -1: the slices left), as MaxText's
  `ici_*_parallelism` / `dcn_*_parallelism`. One slice unless the devices say otherwise (TPU
  `slice_index`); with `dcn_parallelism` on devices that have no slices, each process is one.

  Args:
    config: the layer config.
    devices: the devices (default `jax.devices()`).

  Returns:
    A `jax.sharding.Mesh` with one axis per role the config has.
  """
  devices = list(jax.devices() if devices is None else devices)
  roles = [r for r in MESH_ROLES if getattr(config, f"{r}_axis") is not None]
  dcn_given = dict(config.dcn_parallelism)
  has_slices = all(getattr(d, "slice_index", None) is not None for d in devices)
  granule = "slice" if has_slices else "process"
  if granule == "slice":
    slices = len({d.slice_index for d in devices})
  else:
    slices = len({d.process_index for d in devices}) if dcn_given else 1
  if len(devices) % slices:
    raise ValueError(f"make_mesh: {len(devices)} devices do not split into {slices} slices.")
  dcn = _fill([dcn_given.get(r, 1) for r in roles], slices, roles, what="dcn_parallelism")
  ici = _fill(
    [getattr(config, f"{r}_parallelism") or 1 for r in roles],
    len(devices) // slices,
    roles,
    what="parallelism",
  )
  names = tuple(getattr(config, f"{r}_axis") for r in roles)
  if slices == 1:
    array = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  else:
    array = mesh_utils.create_hybrid_device_mesh(
      ici,
      dcn,
      devices,
      process_is_granule=granule == "process",
      allow_split_physical_axes=True,
    )
  return Mesh(np.asarray(array).reshape([i * c for i, c in zip(ici, dcn, strict=True)]), names)


def _fill(sizes: list[int], total: int, roles: list[str], *, what: str) -> list[int]:
  """Replaces the one -1 in `sizes` by what makes their product `total`; checks the product."""
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ValueError(
      f"make_mesh: {[roles[i] for i in free]} all have {what} -1; at most one axis can take "
      "the devices that are left."
    )
  known = math.prod(s for s in sizes if s != -1)
  if free:
    if total % known:
      raise ValueError(
        f"make_mesh: {dict(zip(roles, sizes, strict=True))} ({what}) leaves no whole size for "
        f"{roles[free[0]]!r} over {total} devices."
      )
    sizes = list(sizes)
    sizes[free[0]] = total // known
  elif known != total:
    raise ValueError(
      f"make_mesh: {dict(zip(roles, sizes, strict=True))} ({what}) uses {known} of {total} "
      "devices; set one of them to -1 to take the rest."
    )
  return sizes
