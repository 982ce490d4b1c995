"""Sharding over a device mesh: one table of logical axis rules for parameters,
optimizer state, activations and the depth-source buffers.

Mesh axes are `data, fsdp, tensor` (`config.mesh`, sizes may be -1: fill). The
batch splits over `data` and `fsdp`; weights split over `fsdp` along their model
dimension (FSDP: gathered per layer by XLA) and over `tensor` along heads, MLP
width and vocabulary (Megatron-style). Activations between sublayers (the stream
and the depth-source buffer, `act_embed`) split their model dimension over
`tensor`, so the buffer costs 1/tensor per device; depth routing then runs under
`jax.shard_map` (deltares.nn.layers.xla_route). A logical name whose mesh axis is already
taken in the same array falls back to replicated, so one table serves
parameters (`embed` -> fsdp) and activations (`batch` takes fsdp first).
This module provides meshes and shardings; deltares.training.program assembles the sharded steps.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("act_embed", "tensor"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("length", None),
    ("norm", None),
    ("layers", None),
    ("sources", None),
)
MIN_SHARDED_FRACTION = 0.98


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    """Sizes of (data, fsdp, tensor); one -1 takes the devices the others leave."""
    sizes = [int(mesh_cfg.get(axis, 1)) for axis in MESH_AXES]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    if len(fill) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"config.mesh={dict(zip(MESH_AXES, sizes))}: sizes must be positive, with at most one -1")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        if n_devices % known:
            raise ValueError(f"config.mesh: {n_devices} devices cannot be split with fixed axes of product {known}")
        sizes[fill[0]] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(f"config.mesh={dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {n_devices}")
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def check_batch_split(train_cfg, mesh) -> None:
    """ValueError unless the global batch, and each micro-batch, split evenly over data x fsdp of `mesh`."""
    ways = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    batch, micro = train_cfg.global_batch, train_cfg.micro_batches
    if batch % ways:
        raise ValueError(f"config.train.global_batch={batch} does not split over data x fsdp = {ways} devices of "
                         f"mesh {dict(mesh.shape)}")
    if batch % micro or (batch // micro) % ways:
        raise ValueError(f"a micro-batch of {batch} / micro_batches={micro} rows does not split over data x fsdp = "
                         f"{ways} devices")


def logical_sharding(mesh, names, shape=None) -> NamedSharding:
    """The sharding of an array with logical axis `names`; with `shape`, a dimension that its
    mesh axes do not divide evenly (a vocabulary of 257, say) stays whole."""
    if not names:
        return NamedSharding(mesh, P())
    spec = list(nn.logical_to_mesh_axes(names, LOGICAL_RULES))
    for dim, axes in enumerate(spec):
        if shape is not None and axes is not None:
            size = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
            if shape[dim] % size:
                spec[dim] = None
    return NamedSharding(mesh, P(*spec))


def state_shardings(params_boxed, abstract_state, mesh):
    """A sharding for every leaf of the train state from logical names: parameters carry theirs;
    an optimizer leaf takes those of the parameter whose path ends its own (Adam's mu and nu)."""
    names = {
        jax.tree_util.keystr(path): box.names
        for path, box in jax.tree_util.tree_flatten_with_path(
            params_boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
        )[0]
    }

    def names_of(path, leaf):
        key = jax.tree_util.keystr(path)
        for param_key, param_names in names.items():
            if key.endswith(param_key) and len(param_names) == leaf.ndim:
                return logical_sharding(mesh, param_names, leaf.shape)
        return logical_sharding(mesh, ())

    return jax.tree_util.tree_map_with_path(names_of, abstract_state)


class MeshStep:
    """A jitted step that traces and runs inside its mesh and the logical axis rules."""

    def __init__(self, fn, mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args):
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(LOGICAL_RULES):
            return self.fn(*args)

    def lower(self, *args):
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(LOGICAL_RULES):
            return self.fn.lower(*args)


def sharded_fraction(abstract_state, shardings) -> float:
    """Fraction of parameter bytes that are split over at least one mesh axis of size > 1."""
    total = split = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_state["params"]), jax.tree.leaves(shardings["params"])):
        nbytes = leaf.size * leaf.dtype.itemsize
        total += nbytes
        if math.prod(sharding.shard_shape(leaf.shape)) < leaf.size:
            split += nbytes
    return split / max(total, 1)


def shard_batch(batch_BT: np.ndarray, batch_sharding: NamedSharding) -> jax.Array:
    """This process's rows of the global batch as one global array (multi-host ready)."""
    global_shape = (batch_BT.shape[0] * jax.process_count(),) + batch_BT.shape[1:]
    return jax.make_array_from_process_local_data(batch_sharding, np.asarray(batch_BT, np.int32), global_shape)
