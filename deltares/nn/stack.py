"""`DepthStack`: a stack of your own layers under any residual mode, as one linen module.

You write one layer's two sublayers (attention and MLP, or any modules mapping [B, T, D] to a
delta [B, T, D], pre-norm included); the stack makes `n_layers` copies with parameters stacked
on a leading layer axis, one depth router per sublayer, the source bookkeeping, and, for the
routed modes under `remat`, the store-once depth pass (deltares.nn.depth.depth_scan), whose
backward pass keeps one source buffer instead of one per layer:

    stack = DepthStack(sublayers=(functools.partial(Attention, cfg), functools.partial(MLP, cfg)),
                       n_layers=16, mode="delta")
    out_BTD = stack(e_BTD)          # then your final norm and head

Each entry of `sublayers` is called as `factory(name=...)` and must return a linen Module whose
`__call__(x_BTD, *args)` returns the delta; `*args` are what you pass after `e_BTD` (positions,
masks), the same for every layer. The NNX version is deltares.nn.nnx.DepthStack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from deltares.nn import routing as routing_math
from deltares.nn.config import MODES, Mode
from deltares.nn.depth import Prefix, depth_scan, init_depth_state, listed_group_prefix
from deltares.nn.layers import DepthRouter
from deltares.nn.routed import STATS_COLLECTION, SUBLAYERS_PER_LAYER, DepthRouting, sublayer_stats, wants_stats


def check_names(names: Sequence[str]) -> None:
    """ValueError unless `names` are two distinct strings (a layer's two sublayers)."""
    if len(names) != SUBLAYERS_PER_LAYER or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"a layer has {SUBLAYERS_PER_LAYER} sublayers (attention, MLP): names must be "
                         f"{SUBLAYERS_PER_LAYER} distinct strings, got {tuple(names)!r}")


def check_sublayers(sublayers: Sequence, names: Sequence[str]) -> None:
    """ValueError unless `sublayers` are two module factories named by `names`."""
    check_names(names)
    if len(sublayers) != SUBLAYERS_PER_LAYER:
        raise ValueError(f"a layer has {SUBLAYERS_PER_LAYER} sublayers (attention, MLP), got {len(sublayers)}")
    for k, f in enumerate(sublayers):
        if not callable(f):
            raise ValueError(f"sublayers[{k}] must be a factory of a module (a class or a function of name=), got {f!r}")


class RoutedLayer(nn.Module):
    """One layer of a `DepthStack`: its sublayers and their routers, run by `routing.layer`."""

    routing: DepthRouting
    sublayers: tuple
    names: tuple = ("attn", "mlp")
    gate: bool = False
    null_source: bool = False
    stats: bool = False

    @nn.compact
    def __call__(self, state, layer, xs, *args, only=None, prefix=None):
        pairs = []
        for k, (name, factory) in enumerate(zip(self.names, self.sublayers)):
            body = _build(factory, k, name)
            router = None
            if self.routing.uses_routers:
                router = DepthRouter(self.gate, self.null_source, epsilon=self.routing.epsilon, name=f"{name}_router")
            pairs.append((router, lambda x, body=body: body(x, *args)))
        return self.routing.layer(state, layer, pairs, only=only, prefix=prefix, stats=self.stats)


def _build(factory, k: int, name: str) -> nn.Module:
    """sublayers[k] built as `factory(name=name)`; ValueError unless that makes a linen Module."""
    try:
        body = factory(name=name)
    except TypeError as err:
        if "name" not in str(err):
            raise
        body = None
    if not isinstance(body, nn.Module):
        raise ValueError(f"sublayers[{k}] must make a linen Module when called as factory(name={name!r}) (a Module "
                         f"class, or functools.partial of one), got {factory!r}")
    return body


def stack_layers(parent: nn.Module, layer_cls, fields: tuple, routing: DepthRouting, state, args: tuple = (), *,
                 xs=None, scan: bool = True, remat: bool = True, policy=None, store_once: bool = True,
                 unroll: bool = False, queries_fn=None, impl: str = "xla", interpret: bool = False):
    """The layers of `parent` (a linen module, inside its compact call): `routing.n_layers` layers
    `layer_cls(*fields)`, each called as `layer(state, index, xs_l, *args, only=None, prefix=None)
    -> (state, out)` (`xs`: a pytree with a leading layer axis, sliced per layer; `args` the same for
    every layer). Returns (state, the layers' outs stacked on a leading axis).

    Parameters: `layers` (stacked, `scan`) or `layers_0`, `layers_1`, ... (unrolled; each sublayer
    reads only the sources it needs). `remat` recomputes each layer in the backward pass (`policy`:
    a jax.checkpoint policy); with it the routed modes differentiate a scan with the store-once pass
    (deltares.nn.depth.depth_scan) unless `store_once=False` (plain autodiff of the scan). `queries_fn`
    (a layer's parameters -> its routers' queries and gains), `impl`, `interpret`: two-phase routing,
    in the store-once pass or, unrolled, by plain autodiff (`listed_group_prefix` at each group's first
    layer). `unroll`: the scans unrolled in the program.
    The one way deltares stacks layers: DepthStack and the Transformer both run it."""
    n_layers = routing.n_layers
    if not scan:
        layer = nn.remat(layer_cls, static_argnums=(2,), policy=policy) if remat else layer_cls
        grouped = queries_fn is not None and routing.uses_routers and xs is None and not parent.is_initializing()
        params = nn.meta.unbox(parent.variables["params"]) if grouped else None
        G = routing.plan.group_layers
        outs = []
        for index in range(n_layers):
            xs_l = None if xs is None else jax.tree.map(lambda a, index=index: a[index], xs)
            kwargs = {}
            if grouped:  # two-phase: the group's queries over the slots before it, once, at its first layer
                first, i = index - index % G, index % G
                if i == 0:
                    n = min(G, n_layers - first)
                    out_KBTD, lse_KBT = listed_group_prefix(
                        queries_fn, [params[f"layers_{k}"] for k in range(first, first + n)], state, routing.plan,
                        first, n, impl=impl, interpret=interpret, eps=routing.epsilon)
                kwargs["prefix"] = Prefix(out_KBTD[2 * i: 2 * i + 2], lse_KBT[2 * i: 2 * i + 2])
            state, out = layer(*fields, name=f"layers_{index}")(state, index, xs_l, *args, **kwargs)
            outs.append(out)
        return state, jax.tree.map(lambda *a: jnp.stack(a), *outs)
    if remat and store_once and routing.uses_routers and xs is None and not parent.is_initializing():
        layer = layer_cls(*fields, parent=None)

        def layer_fn(params_l, state, index, only=None, prefix=None):
            return layer.apply({"params": params_l}, state, index, None, *args, only=only, prefix=prefix)

        params_L = nn.meta.unbox(parent.variables["params"]["layers"])
        return depth_scan(layer_fn, params_L, state, routing.plan, unroll=unroll, eps=routing.epsilon,
                          queries_fn=queries_fn, impl=impl, interpret=interpret)
    # prevent_cse=False is safe only in a loop: fully unrolled, XLA would merge the recomputed forward
    # with the forward (jax 0.12 does) and the remat would silently not happen (nor be estimated).
    layer = nn.remat(layer_cls, prevent_cse=unroll, policy=policy) if remat else layer_cls
    scanned = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(0, 0) + (nn.broadcast,) * len(args), length=n_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"}, unroll=n_layers if unroll else 1)
    return scanned(*fields, name="layers")(state, jnp.arange(n_layers), xs, *args)


def with_layer_layout(params: dict, scanned: bool) -> dict:
    """`params` (a stack's or a Transformer's) with their layers in the layout `stack_layers` gives
    them: one stacked `layers` [L, ...] (`scanned`) or `layers_0 .. layers_{L-1}` (unrolled); the same
    values either way, so a checkpoint of one layout initialises a model of the other."""
    params = dict(params)
    if scanned and "layers" not in params and "layers_0" in params:
        split = []
        while f"layers_{len(split)}" in params:
            split.append(params.pop(f"layers_{len(split)}"))
        params["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *split)
    elif not scanned and "layers" in params:
        stacked = params.pop("layers")
        for index in range(len(jax.tree.leaves(stacked)[0])):
            params[f"layers_{index}"] = jax.tree.map(lambda a, index=index: a[index], stacked)
    return params


class DepthStack(nn.Module):
    """`n_layers` layers of `sublayers` (two module factories) under residual `mode`; returns the
    stack's output before the final norm (the Kimi modes route it with one more router,
    `final_router`). Parameters: `layers` (each leaf with a leading axis of `n_layers`; sublayer
    `names[k]` and its router `names[k] + "_router"` inside), and `final_router`.

    `block_layers`: layers per block of the block modes (1 elsewhere). `remat` (default): each
    layer recomputed in the backward pass; with it the routed modes run the store-once pass unless
    `store_once=False` (plain autodiff of the scan, the reference). `scan=False` unrolls the
    layers (parameters `layers_0`, `layers_1`, ...; each sublayer reads only the sources it needs).
    `epsilon`: the routers' key-norm epsilon. `axis_names`: your logical axis names of the stream
    and the source buffer (deltares.nn.axes: roles `batch`, `length`, `embed`, `sources`).
    Routing statistics (per sublayer: mean weight per source slot, mean max weight, mean entropy,
    number of sources) are sown as `variables["routing"]["stats"]` when you apply the stack with
    `mutable=["routing"]`."""

    sublayers: tuple
    n_layers: int
    mode: Mode = "delta_block"
    block_layers: int = 1
    include_partial: bool = True
    gate: bool = False
    null_source: bool = False
    epsilon: float = routing_math.NORM_EPS
    remat: bool = True
    store_once: bool = True
    scan: bool = True
    names: tuple = ("attn", "mlp")
    axis_names: Any = None

    def _routing(self) -> DepthRouting:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_sublayers(self.sublayers, self.names)
        return DepthRouting(self.mode, self.n_layers, self.block_layers, self.include_partial, self.epsilon,
                            None if self.axis_names is None else dict(self.axis_names))

    @nn.compact
    def __call__(self, e_BTD, *args):
        routing = self._routing()
        if e_BTD.ndim != 3:
            raise ValueError(f"the stack's input is [B, T, D], got shape {e_BTD.shape}")
        with routing.names():
            state = init_depth_state(e_BTD, routing.plan, self.epsilon, listed=not self.scan)
            stats = wants_stats(self)
            fields = (routing, tuple(self.sublayers), tuple(self.names), self.gate, self.null_source, stats)
            state, stats_L2 = stack_layers(self, RoutedLayer, fields, routing, state, args, scan=self.scan,
                                           remat=self.remat, store_once=self.store_once)
            if stats:
                self.sow(STATS_COLLECTION, "stats", sublayer_stats(stats_L2, routing.plan))
            final_router = None
            if routing.uses_final_router:
                final_router = DepthRouter(epsilon=self.epsilon, name="final_router")
            return routing.output(state, final_router)


__all__ = ["DepthStack", "RoutedLayer", "stack_layers", "with_layer_layout"]
