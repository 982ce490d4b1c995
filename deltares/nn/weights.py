"""Moving per-layer parameters into a `DepthStack`'s layout and back, exactly.

A model written as a loop keeps one parameter tree per layer (a list, or names holding a layer
index: `layers_0`, `h.3`, ...); a `DepthStack` (linen or NNX) keeps them stacked on a leading
axis, per repeat of its pattern (`layers`; with a pattern of several layers, layer i of each
repeat under `layers/<i>`), the remaining layers apart (`remainder/<i>`), or unrolled
(`layers_<l>`, linen `scan=False`). `stack_params` moves a per-layer tree in (filling what the
per-layer trees lack, the routers, from the stack's own parameters), `layer_params` moves it
back out; both only stack and slice, so the round trip is exact.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def _layout(stack) -> tuple[int, int, bool]:
    """(n_layers, layers per scanned unit, scanned) of a linen or NNX DepthStack."""
    routing = getattr(stack, "routing", None)
    if routing is not None and hasattr(routing, "unit_layers"):  # NNX: the layers stay stacked, scanned or not
        return routing.n_layers, routing.unit_layers, True
    if hasattr(stack, "pattern_layers"):  # linen
        return stack.n_layers, len(stack.pattern_layers()), bool(stack.scan)
    raise ValueError(f"stack must be a deltares DepthStack (deltares.nn or deltares.nn.nnx), got {type(stack).__name__}")


def _pure(tree):
    """A parameter tree as nested dicts of arrays (linen's FrozenDict and partitioning boxes unwrapped)."""
    tree = nn.meta.unbox(tree)
    if isinstance(tree, Mapping):
        return {k: _pure(v) for k, v in tree.items()}
    return tree


def _as_list(layers, n_layers: int) -> list:
    """The per-layer trees as a list: a sequence, or a mapping whose keys each hold one layer index."""
    if isinstance(layers, Mapping):
        indexed = {}
        for key in layers:
            found = re.findall(r"\d+", str(key))
            if len(found) != 1:
                raise ValueError(f"per-layer name {key!r} must hold exactly one layer index (as layers_3 or h.3 do)")
            index = int(found[0])
            if index in indexed:
                raise ValueError(f"per-layer names {indexed[index][0]!r} and {key!r} both name layer {index}")
            indexed[index] = (key, layers[key])
        if sorted(indexed) != list(range(len(indexed))):
            raise ValueError(f"per-layer names must number the layers 0 .. n - 1, got indices {sorted(indexed)}")
        layers = [indexed[i][1] for i in range(len(indexed))]
    elif isinstance(layers, str) or not isinstance(layers, Sequence):
        raise ValueError(f"layers must be a list of per-layer parameter trees, or a mapping of names holding a layer "
                         f"index to them; got {type(layers).__name__}")
    if len(layers) != n_layers:
        raise ValueError(f"{len(layers)} per-layer trees for a stack of {n_layers} layers")
    return [_pure(layer) for layer in layers]


def _paths(tree) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_like(layer, like_layer, index: int) -> dict:
    """Layer `index`'s tree over the stack's own layer tree `like_layer`: the given leaves in place of
    the stack's (same paths, shapes and dtypes), the stack's where the given tree has none."""
    given, own = _paths(layer), _paths(like_layer)
    extra = sorted(set(given) - set(own))
    if extra:
        raise ValueError(f"layer {index} has {extra[0]}, which the stack's layer {index} has not (it has "
                         f"{', '.join(sorted(own)) or 'nothing'})")
    for path, value in given.items():
        if jnp.shape(value) != jnp.shape(own[path]) or jnp.result_type(value) != jnp.result_type(own[path]):
            raise ValueError(f"layer {index}{path} is {jnp.result_type(value)}{list(jnp.shape(value))}, the stack's is "
                             f"{jnp.result_type(own[path])}{list(jnp.shape(own[path]))}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like_layer)
    return jax.tree.unflatten(treedef, [given.get(jax.tree_util.keystr(p), leaf) for p, leaf in leaves])


def _stacked(trees, where: str):
    """Trees of one structure stacked on a new leading axis; ValueError naming what differs."""
    first = jax.tree.map(jnp.shape, trees[0])
    for index, tree in enumerate(trees[1:], 1):
        shapes = jax.tree.map(jnp.shape, tree)
        if jax.tree.structure(shapes) != jax.tree.structure(first) or jax.tree.leaves(shapes) != jax.tree.leaves(first):
            raise ValueError(f"{where}: the layers stacked together must have one structure and shape, but "
                             f"{index} differs from the first ({shapes} vs {first})")
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def layer_params(params, stack, names: str | None = None):
    """`stack`'s parameters `params` (its variables' `params`, a linen `DepthStack`'s or an NNX
    `DepthStack`'s pure state dict, `nnx.to_pure_dict(nnx.state(stack, nnx.Param))`; or any other
    collection in the same layout) as one tree per layer, in layer order.

    Args:
        params: the stack's parameter tree (boxed or not; other top-level entries such as
            `final_router` are left out).
        stack: the `DepthStack` (linen or NNX) the parameters belong to (its depth, pattern, scan).
        names: a format with one `{}` for the layer index (e.g. "layers_{}"): a dict of those names.

    Returns:
        A list of n_layers trees (or with `names` a dict), each holding the layer's sublayers and
        routers (`attn`, `attn_router`, ...) without a layer axis.

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        import flax.linen as nn
        from deltares.nn import DepthStack, layer_params, stack_params

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x_BTD):
                return nn.Dense(x_BTD.shape[-1])(nn.RMSNorm()(x_BTD))

        stack = DepthStack((MLP, MLP), n_layers=3, mode="delta")
        params = stack.init(jax.random.key(0), jnp.ones((1, 4, 8)))["params"]
        layers = layer_params(params, stack)                  # 3 trees: attn, attn_router, mlp, mlp_router
        back = stack_params(layers, stack, like=params)       # the same parameters, exactly
        print(len(layers), sorted(layers[0]), all(jax.tree.leaves(jax.tree.map(
            lambda a, b: bool((a == b).all()), back, nn.meta.unbox(params)))))
        ```
    """
    n_layers, k, scanned = _layout(stack)
    params = _pure(params)
    n_units = n_layers // k
    out = []
    for index in range(n_layers):
        unit, i = divmod(index, k)
        if not scanned:
            out.append(_entry(params, f"layers_{index}"))
        elif k == 1:
            out.append(jax.tree.map(lambda a, unit=unit: a[unit], _entry(params, "layers")))
        elif unit < n_units:
            out.append(jax.tree.map(lambda a, unit=unit: a[unit], _entry(_entry(params, "layers"), str(i))))
        else:
            out.append(_entry(_entry(params, "remainder"), str(i)))
    return out if names is None else {names.format(index): layer for index, layer in enumerate(out)}


def _entry(tree, key: str):
    if not isinstance(tree, Mapping) or key not in tree:
        raise ValueError(f"the parameters have no {key!r} (they have {sorted(tree) if isinstance(tree, Mapping) else tree}):"
                         f" are they this stack's, in its layout?")
    return tree[key]


def stack_params(layers, stack, like=None):
    """Per-layer parameter trees moved into `stack`'s layout (the inverse of `layer_params`).

    Args:
        layers: one tree per layer, in layer order (a list), or a mapping whose names each hold one
            layer index (`layers_0`, `h.3`, ...); each tree holds the layer's sublayers by their names
            in the stack (a model written as a loop: its layer's `attn` and `mlp`), and may hold its
            routers (`attn_router`, ...).
        stack: the `DepthStack` (linen or NNX) to move them into.
        like: the stack's own parameters (from `init`, or an NNX stack's pure state dict), boxed or
            not: each given leaf must be at a path of the stack's layer with the same shape and dtype
            (ValueError otherwise), and what the given trees lack (the routers, a converted model's:
            zero queries, and with the stack's `gate` zero gates) and the stack's other entries
            (`final_router`) come from it. Without it, only the layers' entries are returned.

    Returns:
        The parameters in the stack's layout (`layers`, and `remainder`, or `layers_<l>` unrolled),
        plain arrays: `{"params": ...}` for a linen stack's `apply`, or for an NNX stack
        `nnx.replace_by_pure_dict` and `nnx.update`.

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        import flax.linen as nn
        from deltares.nn import DepthStack, stack_params

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x_BTD):
                return nn.Dense(x_BTD.shape[-1])(nn.RMSNorm()(x_BTD))

        # an unrouted model's per-layer weights (here drawn at random), three layers of two MLPs
        mlp = MLP().init(jax.random.key(0), jnp.ones((1, 4, 8)))["params"]
        loop_layers = [{"attn": mlp, "mlp": mlp} for _ in range(3)]
        stack = DepthStack((MLP, MLP), n_layers=3, mode="delta", gate=True)  # routing starts at zero
        params = stack_params(loop_layers, stack, like=stack.init(jax.random.key(1), jnp.ones((1, 4, 8)))["params"])
        print(jax.tree.map(jnp.shape, params)["layers"]["mlp"])  # each leaf with the layer axis [3, ...]
        ```
    """
    n_layers, k, scanned = _layout(stack)
    layers = _as_list(layers, n_layers)
    like = None if like is None else _pure(like)
    if like is not None:
        own = layer_params(like, stack)
        layers = [_check_like(layer, own_layer, index) for index, (layer, own_layer) in enumerate(zip(layers, own))]
    out = {} if like is None else {key: value for key, value in like.items()
                                   if key not in ("layers", "remainder") and not re.fullmatch(r"layers_\d+", key)}
    n_units = n_layers // k
    if not scanned:
        out.update({f"layers_{index}": layer for index, layer in enumerate(layers)})
    elif k == 1:
        out["layers"] = _stacked(layers, "layers")
    else:
        out["layers"] = {str(i): _stacked(layers[i: n_units * k: k], f"layer {i} of the pattern") for i in range(k)}
        if n_layers > n_units * k:
            out["remainder"] = {str(i): layer for i, layer in enumerate(layers[n_units * k:])}
    return out


__all__ = ["layer_params", "stack_params"]
