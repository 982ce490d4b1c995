"""Run by tests/test_layer_patterns.py with 4 simulated CPU devices: a small NNX language model whose
layers are a `deltares.nn.nnx.DepthStack` (a local/global pattern with a remainder, delta_block),
trained a few AdamW steps (`nnx.Optimizer`) on one device, then created and trained the same way under
an Explicit mesh of fsdp=2 x tensor=2 (parameters sharded at creation by their logical names: the
stacked ones with the layer axis in front, batch over fsdp). Prints one JSON object: both runs' losses,
the largest parameter difference at the end, the parameters' partition specs and the sharding of a
stacked kernel as it lies on the mesh."""

import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltares.nn.nnx import DepthStack  # noqa: E402

V, D, H, F, L = 32, 16, 4, 32, 4  # vocabulary, width, heads (of width D / H), MLP width, layers
RULES = (("batch", "fsdp"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
         ("layers", None), ("length", None), ("act_embed", None), ("sources", None))
STEPS = 3


def param(rngs, shape, names, scale=0.3):
    return nnx.Param(jax.random.normal(rngs.params(), shape) * scale, out_sharding=names)


def gathered(w, spec):
    """An FSDP-sharded weight gathered over fsdp for use (a no-op without a mesh)."""
    return jax.sharding.reshard(w, spec) if jax.sharding.get_abstract_mesh().shape_tuple else w


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def out_spec(*spec):
    return P(*spec) if jax.sharding.get_abstract_mesh().shape_tuple else None


class Attention(nnx.Module):
    """Multi-head causal attention, heads over `tensor` (within `window` tokens where > 0)."""

    def __init__(self, rngs, window=0):
        self.qkv = param(rngs, (3, D, H, D // H), (None, "embed", "heads", None))
        self.o = param(rngs, (H, D // H, D), ("heads", None, "embed"))
        self.window = window

    def __call__(self, x_BTD):
        qkv = gathered(self.qkv[...], P(None, None, "tensor", None))
        q, k, v = (jnp.einsum("btd,dhe->bthe", rms_norm(x_BTD), qkv[i]) for i in range(3))
        T = x_BTD.shape[1]
        pos = jnp.arange(T)
        allowed = pos[None, :] <= pos[:, None]
        if self.window:
            allowed &= pos[None, :] > pos[:, None] - self.window
        scores = jnp.where(allowed, jnp.einsum("bthe,bche->bhtc", q, k) / np.sqrt(D // H), -jnp.inf)
        out = jnp.einsum("bhtc,bche->bthe", jax.nn.softmax(scores, -1), v)
        return jnp.einsum("bthe,hed->btd", out, gathered(self.o[...], P("tensor", None, None)),
                          out_sharding=out_spec("fsdp", None, None))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = param(rngs, (D, F), ("embed", "mlp"))
        self.down = param(rngs, (F, D), ("mlp", "embed"))

    def __call__(self, x_BTD):
        hidden = jax.nn.gelu(rms_norm(x_BTD) @ gathered(self.up[...], P(None, "tensor")))
        return jnp.einsum("btf,fd->btd", hidden, gathered(self.down[...], P("tensor", None)),
                          out_sharding=out_spec("fsdp", None, None))


class LM(nnx.Module):
    def __init__(self, rngs):
        self.embed = param(rngs, (V, D), ("vocab", "embed"), 1.0)
        self.stack = DepthStack({"local": lambda rngs: {"attn": Attention(rngs, 2), "mlp": MLP(rngs)},
                                 "global": lambda rngs: {"attn": Attention(rngs), "mlp": MLP(rngs)}},
                                L, D, "delta_block", block_layers=2, pattern=("local", "local", "global"), rngs=rngs)

    def __call__(self, tokens_BT):
        table_VD = gathered(self.embed[...], P(None, None))
        e_BTD = table_VD.at[tokens_BT].get(out_sharding=out_spec("fsdp", None, None))  # batch over fsdp
        return jnp.einsum("btd,vd->btv", rms_norm(self.stack(e_BTD)), table_VD)


def loss_fn(model, tokens_BT):
    logits = model(tokens_BT[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()


def train(tokens):
    model = LM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens_BT):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens_BT)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, t)) for t in tokens]
    return model, losses


def main():
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, V, (4, 9)).astype(np.int32) for _ in range(STEPS)]
    with nnx.use_eager_sharding(False):  # one device: the logical names stay metadata
        single, single_losses = train([jnp.asarray(b) for b in batches])
        initial = nnx.to_pure_dict(nnx.state(LM(nnx.Rngs(0)), nnx.Param))
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        tokens = [jax.device_put(b, jax.NamedSharding(mesh, P("fsdp", None))) for b in batches]
        sharded, sharded_losses = train(tokens)
        specs = nnx.get_partition_spec(nnx.state(sharded, nnx.Param))
    params = nnx.to_pure_dict(nnx.state(single, nnx.Param))
    params_mesh = nnx.to_pure_dict(nnx.state(sharded, nnx.Param))
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial)))
    diff = max(float(jnp.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(params),
                                                                                   jax.tree.leaves(params_mesh)))
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(params))
    stack_specs = specs["stack"]
    up = getattr(sharded.stack.layers, "0").mlp.up
    print(json.dumps(dict(
        single=single_losses, mesh=sharded_losses, max_param_diff=diff, param_scale=scale, moved=moved,
        up_spec=str(stack_specs["layers"]["0"]["mlp"]["up"].get_value()),
        up_sharding=str(up[...].sharding.spec), up_shape=list(up[...].shape),
        remainder_up_spec=str(stack_specs["remainder"]["0"]["mlp"]["up"].get_value()),
        router_spec=str(stack_specs["layers"]["2"]["attn_router"]["query"].get_value()),
        remainder_router_spec=str(stack_specs["remainder"]["0"]["mlp_router"]["query"].get_value()),
    )))


if __name__ == "__main__":
    main()
