"""The device mesh and the mapping from the model's logical axis names to mesh axes.

The mesh has three axes, (data, fsdp, tensor), sized from the config with one -1 taking the devices left over.
Parameters are sharded by the rules in `config.mesh.rules`; optimizer state and EMA follow their parameter;
a batch is split over (data, fsdp).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from reve_jax import treepath

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


class MeshError(ValueError):
    """A mesh that does not fit the devices or the batch."""


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
    """Resolve (data, fsdp, tensor) sizes for `num_devices`; -1 takes what the others leave."""
    sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise MeshError(
                f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} does not fit {num_devices} devices: the fixed axes "
                f"multiply to {fixed}, which does not divide {num_devices}. Set --config.mesh.fsdp / "
                "--config.mesh.tensor to divisors of the device count."
            )
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise MeshError(
            f"mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices but "
            f"{num_devices} are available. Use -1 for one axis to take the rest."
        )
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """Build the (data, fsdp, tensor) mesh over `devices` (default: all), with Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    try:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except Exception:  # CPU and odd topologies: plain ordering is fine
        arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical: PartitionSpec | tuple, rules, mesh: Mesh, shape: tuple[int, ...]) -> PartitionSpec:
    """Map a logical PartitionSpec to mesh axes. A mesh axis is used at most once per array, and a dimension that
    the mesh axes do not divide stays replicated (small vectors on big meshes)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for dim, name in zip(shape, tuple(logical) + (None,) * (len(shape) - len(logical)), strict=True):
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else axes)
        else:
            out.append(None)
    return PartitionSpec(*out)


def param_shardings(abstract_params, logical_specs, rules, mesh: Mesh):
    """NamedShardings for a params pytree from its logical specs (from nnx.get_partition_spec)."""
    return jax.tree.map(
        lambda a, spec: NamedSharding(mesh, logical_to_spec(spec, rules, mesh, a.shape)),
        abstract_params,
        logical_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def follow_params(abstract_tree, abstract_params, p_shardings, mesh: Mesh):
    """Shardings for a tree (optimizer state) whose leaves mirror parameters: a leaf takes the sharding of the
    parameter whose path is the longest suffix of its own path with the same shape; anything else replicates."""
    by_path = {}
    for (path, a), (_, s) in zip(
        jax.tree_util.tree_flatten_with_path(abstract_params)[0],
        jax.tree_util.tree_flatten_with_path(p_shardings)[0],
        strict=True,
    ):
        by_path[treepath.parts(path)] = (a.shape, s)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        key = treepath.parts(path)
        for i in range(len(key)):
            hit = by_path.get(key[i:])
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_tree)


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading (batch) dimension over every data-parallel axis; the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *(None,) * (ndim - 1)))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def global_batch_from_local(local: dict, mesh: Mesh, global_batch: int) -> dict:
    """Per-process numpy batch -> global jax.Arrays sharded over the batch axes (works with any process count)."""
    out = {}
    for k, v in local.items():
        v = np.asarray(v)
        out[k] = jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v, (global_batch,) + v.shape[1:])
    return out


def describe_shardings(tree_of_shardings) -> str:
    """One line per leaf: its path and PartitionSpec (the golden-file format)."""
    lines = []
    for path, s in jax.tree_util.tree_flatten_with_path(tree_of_shardings)[0]:
        spec = tuple(s.spec) if isinstance(s, NamedSharding) else tuple(s)
        lines.append(f"{'/'.join(treepath.parts(path))}\t{spec}")
    return "\n".join(lines) + "\n"
