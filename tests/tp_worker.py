"""Run by tests/test_axis_names.py with 4 simulated CPU devices: a DepthStack whose stream is split
over the model width (tensor parallelism), over batch and width, and over batch and tokens, under
Explicit mesh axes (JAX's default) and under Auto axes with the caller's logical names and rules;
each against the same stack without a mesh. Prints one JSON object."""

import functools
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltares.nn import BLOCK_MODES, DepthStack  # noqa: E402

D, L = 16, 3
NAMES = dict(batch="activation_batch", length="activation_length", embed="activation_embed")


def rules(batch, length, embed):
    """The caller's rules: its activations' names, and `embed` for parameters (the routers' too)."""
    return (("activation_batch", batch), ("activation_length", length), ("activation_embed", embed),
            ("embed", embed), ("layers", None))


class Dense(nn.Module):
    """A toy sublayer: whole rows of the width for its matrix (under Explicit axes it gathers the
    width and splits its output again as its input was), a nonlinearity."""

    kind: str

    @nn.compact
    def __call__(self, x_BTD):
        w = self.param("w", nn.initializers.normal(0.5), (D, D))
        mesh = jax.sharding.get_abstract_mesh()
        spec = jax.typeof(x_BTD).sharding.spec if not mesh.empty and mesh.are_all_axes_explicit else None
        if spec is not None:
            x_BTD = jax.sharding.reshard(x_BTD, P(spec[0], spec[1], None))
        y = x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD * x_BTD, -1, keepdims=True) + 1e-6) @ w
        y = jnp.tanh(y) if self.kind == "tanh" else jnp.sin(y)
        return y if spec is None else jax.sharding.reshard(y, spec)


def stack(mode, **kw):
    return DepthStack((functools.partial(Dense, "tanh"), functools.partial(Dense, "sin")), L, mode,
                      block_layers=2 if mode in BLOCK_MODES else 1, axis_names=NAMES, **kw)


def value_and_grad(model, params, e):
    def loss(p, e):
        return jnp.sum(jnp.sin(model.apply({"params": p}, e)) * jnp.arange(D))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, e)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


CASES = {  # name: (mesh shape, axis names, the input's spec, rules, routers placed by the rules)
    "batch_x_width": ((2, 2), ("data", "model"), P("data", None, "model"), rules("data", None, "model"), True),
    "width": ((4,), ("model",), P(None, None, "model"), rules(None, None, "model"), False),
    "batch_x_tokens": ((2, 2), ("data", "seq"), P("data", "seq", None), rules("data", "seq", None), True),
}

ALL = [(kind, case) for kind in (AxisType.Explicit, AxisType.Auto) for case in CASES]
RUNS = {"delta": ALL, "delta_block": [(AxisType.Explicit, "batch_x_width"), (AxisType.Auto, "width")]}


def main():
    assert jax.device_count() == 4
    e = jax.random.normal(jax.random.key(0), (4, 4, D))
    out = {}
    for mode, runs in RUNS.items():
        model = stack(mode)
        boxed = model.init(jax.random.key(1), e)["params"]
        params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(3), x.shape), nn.meta.unbox(boxed))
        ref = value_and_grad(model, params, e)
        scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref[1]))
        for kind, case in runs:
            shape, axes, spec, rules_, placed = CASES[case]
            mesh = jax.make_mesh(shape, axes, axis_types=(kind,) * len(shape))
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules_):
                shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules_)
                p = jax.device_put(params, shardings) if placed else params
                e_sharded = jax.device_put(e, NamedSharding(mesh, spec))
                got = value_and_grad(model, p, e_sharded)
                closed = jax.make_jaxpr(lambda p, e: model.apply({"params": p}, e))(p, e_sharded)
                jaxpr, out_spec = str(closed), str(closed.out_avals[0].sharding.spec)
            out[f"{mode}/{kind.name}/{case}"] = dict(
                diff=max_diff(got, ref) / scale, router_spec=str(shardings["layers"]["attn_router"]["query"].spec),
                shard_map="shard_map" in jaxpr, out_spec=out_spec)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
