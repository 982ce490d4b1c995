"""The logical axis names of depth routing's arrays, and the caller's own names for them.

The stream and each source [B, T, D] are constrained with the logical names `batch`, `length`,
`act_embed` and the source buffer [S, B, T, D] with `sources` in front (deltares' rules,
deltares.training.sharding.LOGICAL_RULES, map them onto mesh axes). A code base with rules of
its own names (MaxText's `activation_batch`, ...) passes `axis_names`, a mapping from the roles
`batch`, `length`, `embed`, `sources` to its logical names (None: that dimension whole): inside
`use_axis_names`, deltares' names resolve to the mesh axes the caller's names resolve to under
the caller's rules in context, so routing shards as the caller's own activations do.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import flax.linen as nn
import jax

ROLES = {"batch": "batch", "length": "length", "embed": "act_embed", "sources": "sources"}  # role -> deltares' name
STREAM_AXES = (ROLES["batch"], ROLES["length"], ROLES["embed"])  # the stream and each source [B, T, D]
SOURCES_AXES = (ROLES["sources"],) + STREAM_AXES  # the source buffer [S, B, T, D]


def check_axis_names(axis_names: Mapping | None) -> None:
    """ValueError unless `axis_names` maps some of the roles to logical names (str) or None."""
    if axis_names is None:
        return
    if not isinstance(axis_names, Mapping):
        raise ValueError(f"axis_names must be a mapping of {sorted(ROLES)} to logical axis names, got {axis_names!r}")
    unknown = set(axis_names) - set(ROLES)
    if unknown:
        raise ValueError(f"axis_names: unknown role(s) {sorted(unknown)}; the roles are {sorted(ROLES)}")
    for role, name in axis_names.items():
        if name is not None and not isinstance(name, str):
            raise ValueError(f"axis_names[{role!r}] must be a logical axis name (str) or None, got {name!r}")


def alias_rules(axis_names: Mapping, rules=None) -> tuple:
    """Rules mapping deltares' names of the roles in `axis_names` to the mesh axes that the caller's
    names map to under `rules` (default: the rules in context); a caller's name without a rule
    (or None) leaves the dimension whole."""
    check_axis_names(axis_names)
    rules = tuple(nn.get_logical_axis_rules() if rules is None else rules)
    out = []
    for role, theirs in axis_names.items():
        mesh_axes = None
        if theirs is not None:
            mesh_axes = next((axes for name, axes in rules if name == theirs), None)
        out.append((ROLES[role], mesh_axes))
    return tuple(out)


@contextlib.contextmanager
def use_axis_names(axis_names: Mapping | None):
    """Within it, deltares' routing arrays shard as the caller's `axis_names` say (see module doc);
    a no-op for None."""
    if not axis_names:
        yield
        return
    current = tuple(nn.get_logical_axis_rules())
    with nn.logical_axis_rules(alias_rules(axis_names, current) + current):
        yield


def explicit_mesh():
    """The abstract mesh in context when any of its axes is Explicit (JAX's default for
    `jax.make_mesh`), else None: there an array's type carries its sharding."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    return mesh


def constrain(x, names):
    """`nn.with_logical_constraint(x, names)`; under Explicit mesh axes `x` unchanged: its type
    carries the sharding of the stream it was computed from (the source buffer follows the
    stream the caller sharded, over batch, tokens or width), where a constraint from rules that
    may not name those axes would only assert a different sharding."""
    if explicit_mesh() is not None:
        return x
    return nn.with_logical_constraint(x, names)


def type_spec(x, ndim: int) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of `x`'s type (Explicit axes), padded to `ndim` entries."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return jax.sharding.PartitionSpec(*(spec + (None,) * (ndim - len(spec))))


def shard_spec(mesh, names, shape) -> jax.sharding.PartitionSpec:
    """The `jax.shard_map` spec of an array with logical axis `names` and `shape` on `mesh`, from
    the logical axis rules in context (`nn.logical_axis_rules`; training and AOT set
    deltares.training.sharding.LOGICAL_RULES): mesh axes of size 1 are dropped, and a dimension
    its axes do not divide evenly stays whole. Without rules every dimension is whole."""
    spec = []
    for axes, size in zip(nn.logical_to_mesh_axes(names), shape):
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if mesh.shape.get(a, 1) > 1)
        if not axes or size % math.prod(mesh.shape[a] for a in axes):
            spec.append(None)
        else:
            spec.append(axes[0] if len(axes) == 1 else axes)
    return jax.sharding.PartitionSpec(*spec)


__all__ = ["ROLES", "SOURCES_AXES", "STREAM_AXES", "alias_rules", "check_axis_names", "constrain", "explicit_mesh", "shard_spec", "type_spec", "use_axis_names"]
