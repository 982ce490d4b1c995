"""Run by tests/test_axis_names.py with 8 simulated CPU devices: a DepthStack under (1) JAX's default
mesh (Explicit axes) with an explicitly sharded input, and (2) MaxText-style rule names on an Auto
mesh with `axis_names`; each against the same stack without a mesh. Prints one JSON object."""

import functools
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltares.nn import BLOCK_MODES, DepthStack  # noqa: E402

D, L = 16, 3
RULES = (("activation_batch", "data"), ("activation_length", None), ("activation_embed", "model"))
NAMES = dict(batch="activation_batch", length="activation_length", embed="activation_embed")


class Dense(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        y = x @ self.param("w", nn.initializers.normal(0.5), (D, D))
        return jnp.tanh(y) if self.kind == "tanh" else jnp.sin(y)


def stack(mode, **kw):
    return DepthStack((functools.partial(Dense, "tanh"), functools.partial(Dense, "sin")), L, mode, block_layers=2 if mode in BLOCK_MODES else 1,
                      **kw)


def randomized(params):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def value_and_grad(model, params, e):
    return jax.jit(jax.value_and_grad(lambda p, e: jnp.sum(jnp.sin(model.apply({"params": p}, e)) * jnp.arange(D)),
                                      argnums=(0, 1)))(params, e)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def sharded_buffers(model, params, e) -> list[str]:
    """The specs of the sharding constraints on rank-4 arrays (the source buffer) in the forward's jaxpr."""
    lines = str(jax.make_jaxpr(lambda p, e: model.apply({"params": p}, e))(params, e)).splitlines()
    specs = set()
    for i, line in enumerate(lines):
        if "= sharding_constraint[" in line and line.split("[", 1)[1].split("]")[0].count(",") == 3:
            spec = next((x for x in lines[i:i + 4] if "spec=P(" in x), "")
            specs.add(spec.split("spec=")[1].rstrip(")") + ")" if spec else "none")
    return sorted(specs)


def main():
    assert jax.device_count() == 8
    e = jax.random.normal(jax.random.key(0), (8, 4, D))
    out = {}
    for mode in ("delta", "delta_block", "full_attnres"):
        model = stack(mode)
        params = randomized(nn.meta.unbox(model.init(jax.random.key(1), e)["params"]))
        ref = value_and_grad(model, params, e)
        with jax.set_mesh(jax.make_mesh((8,), ("data",))):  # JAX's default: Explicit axes
            e_sharded = jax.device_put(e, jax.P("data"))
            explicit = value_and_grad(model, params, e_sharded)
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        named = stack(mode, axis_names=NAMES)
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            theirs = value_and_grad(named, params, e)
            specs_named = sharded_buffers(named, params, e)
            specs_default = sharded_buffers(model, params, e)
        out[mode] = dict(explicit_value=float(explicit[0]), value=float(ref[0]), explicit_diff=max_diff(explicit, ref),
                         named_value=float(theirs[0]), named_diff=max_diff(theirs, ref),
                         specs_named=specs_named, specs_default=specs_default,
                         grad_scale=max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref[1])))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
