"""Flax NNX versions of deltares' routing layer and stack: `DepthRouter`, and `DepthStack`
(the NNX counterpart of deltares.nn.stack.DepthStack, over `deltares.nn.routed.DepthRouting`).

`DepthRouter` is a native `nnx.Module` with the same parameters, initialisers and logical
axis names as the linen `deltares.nn.layers.DepthRouter` (query, gain, optionally null_source
and gate), and the same call (`apply_router`, one implementation). The axis names are kept
as `out_sharding` metadata with `eager_sharding=False`, so a router builds with default flax
settings and no mesh; `nnx.get_partition_spec(nnx.state(model))` reads them back, and the
logical rules of deltares.training.sharding map them onto a mesh as for linen. A `DepthStack`
adds its layer axis name in front of every stacked variable's (`nnx.vmap`'s `transform_metadata`).

(`flax.nnx.bridge.ToNNX(linen DepthRouter)` fails under flax 0.12's default eager sharding
because the linen parameters carry logical names; use these modules instead.)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deltares.nn import mixing, routing
from deltares.nn.config import HYPER_MODES, MIXING_MODES, MODES, ROUTING_IMPLS, Mode, has_router
from deltares.nn.depth import Outputs, depth_scan
from deltares.nn.layers import ROUTER_PARAMS, apply_router, router_param_names, router_param_shape


class DepthRouter(nnx.Module):
    """One sublayer's routing parameters on a model dimension `d_model`: the pseudo-query and the
    key norm's gain, each [D] (`gate`: a scalar gate [1] on the routed term, zero at the start;
    `null_source`: a learned source [D]); the NNX counterpart of deltares.nn.layers.DepthRouter.

    Args:
        d_model: D, the width of the sources it routes over.
        gate: add the gate (a converted model's exact start: `h + gate * route(S)`, gate 0).
        null_source: add a learned null source to every routing.
        impl: "xla", or a fused Pallas kernel ("pallas", "auto"; deltares.nn.config.ROUTING_IMPLS).
        interpret: run a Pallas kernel in interpret mode (CPU tests).
        epsilon: the key norm's epsilon (the one the cached 1/rms of the sources was taken with).
        dtype: the routed output's dtype (default the sources').
        param_dtype: the parameters' dtype.
        query_init: the query's initialiser (default zeros: uniform routing at step 0).
        gain_init: the gain's initialiser (default ones).
        rngs: for initialisers that draw (the defaults are constants).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from deltares.nn.nnx import DepthRouter
        from deltares.nn.routing import inv_rms

        sources_SBTD = jax.random.normal(jax.random.key(0), (3, 2, 4, 8))
        router = DepthRouter(8)
        out_BTD, weights_SBT = router(sources_SBTD, inv_rms(sources_SBTD), jnp.array([True, True, False]))
        print(out_BTD.shape, weights_SBT[:, 0, 0])  # (2, 4, 8) [0.5 0.5 0. ]: a zero query is uniform
        ```
    """

    def __init__(self, d_model: int, *, gate: bool = False, null_source: bool = False, impl: str = "xla",
                 interpret: bool = False, epsilon: float = routing.NORM_EPS, dtype=None, param_dtype=jnp.float32,
                 query_init=nnx.initializers.zeros, gain_init=nnx.initializers.ones, rngs: nnx.Rngs | None = None):
        self.param_names = router_param_names(gate, null_source)
        self.impl, self.interpret, self.epsilon, self.dtype = impl, interpret, epsilon, dtype
        inits = dict(query=query_init, gain=gain_init)
        for name in self.param_names:
            init, axes = ROUTER_PARAMS[name]
            key = rngs.params() if rngs is not None else jax.random.key(0)  # the default initialisers are constants
            value = inits.get(name, init)(key, router_param_shape(name, d_model), param_dtype)
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))

    def __call__(self, sources_SBTD, inv_rms_SBT, valid, residual_BTD=None, prefix=None):
        """Routes the sources; returns (out_BTD, weights_SBT or None).

        Args:
            sources_SBTD: the sources [S, B, T, D] (or a sequence of S arrays [B, T, D]).
            inv_rms_SBT: each source's 1/rms [S, B, T] (float32, `routing.inv_rms` with `epsilon`).
            valid: [S] bool, or broadcastable to [S, B, T]: the sources routed over (at least one).
            residual_BTD: the stream [B, T, D]: with it out = residual + route (the Delta modes), else
                route (the Kimi modes).
            prefix: two-phase routing's (out [B, T, D], lse [B, T]) over earlier sources.
        """
        params = {name: getattr(self, name)[...] for name in self.param_names}
        out_BTD, weights_SBT = apply_router(params, sources_SBTD, inv_rms_SBT, valid, residual_BTD, impl=self.impl,
                                            interpret=self.interpret, eps=self.epsilon, prefix=prefix)
        return (out_BTD if self.dtype is None else out_BTD.astype(self.dtype)), weights_SBT


def _params(module: nnx.Module, shapes: dict, param_dtype, rngs) -> None:
    """The parameters of `shapes` (deltares.nn.mixing) as attributes of `module`, with their axis names."""
    for name, (shape, value, axes) in shapes.items():
        key = rngs.params() if rngs is not None else jax.random.key(0)
        setattr(module, name, nnx.Param(mixing.initializer(value)(key, shape, param_dtype), out_sharding=axes,
                                        eager_sharding=False))


class HyperConnection(nnx.Module):
    """One sublayer's (manifold-constrained, `mhc`) hyper-connection over `streams` streams of width
    `d_model`; the NNX counterpart of deltares.nn.mixing.HyperConnection, called the same way:
    `module(H, j)` the input, `module(H, j, y)` the streams after the sublayer, `stats=True` statistics.
    `rngs` draws mHC's random phi (default: a fixed key)."""

    def __init__(self, d_model: int, streams: int = 4, *, mhc: bool = False, dynamic: bool = True,
                 sinkhorn_iterations: int = 20, epsilon: float = routing.NORM_EPS, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.param_names = tuple(mixing.connection_shapes(streams, d_model, mhc, dynamic))
        self.sinkhorn_iterations, self.epsilon = sinkhorn_iterations, epsilon
        _params(self, mixing.connection_shapes(streams, d_model, mhc, dynamic), param_dtype, rngs)

    def __call__(self, H_RBTD, j, y_BTD=None, stats: bool = False):
        params = {name: getattr(self, name)[...] for name in self.param_names}
        return mixing.connect(params, H_RBTD, j, y_BTD, stats, iterations=self.sinkhorn_iterations, eps=self.epsilon)


class DepthWeights(nnx.Module):
    """One layer's DenseFormer weights over `n_slots` layer outputs; the NNX counterpart of
    deltares.nn.mixing.DepthWeights, called the same way."""

    def __init__(self, n_slots: int, *, param_dtype=jnp.float32):
        self.n_slots = n_slots
        _params(self, {"weights": ((n_slots,), 0.0, (None,))}, param_dtype, None)

    def __call__(self, sources, layer, valid_S, stats: bool = False):
        return mixing.depth_average(self.weights[...], sources, layer, valid_S, stats)


def mixer_factory(mode: str, d_model: int, n_layers: int, *, streams: int = 4, dynamic: bool = True,
                  sinkhorn_iterations: int = 20, epsilon: float = routing.NORM_EPS, param_dtype=jnp.float32):
    """`routers(k, n, rngs)` for a `StackLayer` of mixing `mode`: sublayer k's `HyperConnection` (hyper,
    mhc; `rngs` draws mHC's phi) or, the layer's last, its `DepthWeights` (denseformer), else None
    (deltares.nn.config.has_router)."""

    def routers(k: int, n: int, rngs: nnx.Rngs | None = None):
        if not has_router(mode, k, n):
            return None
        if mode in HYPER_MODES:
            return HyperConnection(d_model, streams, mhc=mode == "mhc", dynamic=dynamic,
                                   sinkhorn_iterations=sinkhorn_iterations, epsilon=epsilon, param_dtype=param_dtype,
                                   rngs=rngs)
        return DepthWeights(n_layers + 1, param_dtype=param_dtype)

    return routers


def _is_factory(hook) -> bool:
    """A stream hook given as a factory: a callable with a parameter named `rngs` (or an nnx.Module class)."""
    if isinstance(hook, type):
        return issubclass(hook, nnx.Module)
    try:
        return "rngs" in inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return False


class StackLayer(nnx.Module):
    """One layer of an NNX `DepthStack`: sublayer `names[k]` (attribute of that name), its router
    `names[k] + "_router"` and, where the stack has a stream hook built per sublayer, its hook
    `names[k] + "_hook"`.

    Args:
        sublayers: the layer's modules, in depth order.
        names: their names.
        d_model: D.
        routed: whether the mode routes (else no routers: baseline).
        gate: the routers' gate (`DepthRouter`).
        null_source: the routers' null source.
        epsilon: the routers' key-norm epsilon.
        router_kw: the routers' other arguments (impl, interpret, dtype, param_dtype, query_init, gain_init).
        hooks: the stream hook module of each sublayer, or None.
        routers: `routers(k, n)` makes sublayer k's router (of a layer of n) or None, in place of a
            `DepthRouter` each where `routed` (the mixing modes' mixers, `mixer_factory`).

    Example:
        ```python
        from flax import nnx
        from deltares.nn.nnx import StackLayer

        layer = StackLayer([nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 8, rngs=nnx.Rngs(1))], ("attn", "mlp"),
                           8, routed=True, gate=False, null_source=False, epsilon=1e-6)
        print(layer.names, layer.attn_router.query.shape)  # ('attn', 'mlp') (8,)
        ```
    """

    def __init__(self, sublayers, names, d_model: int, routed: bool, gate: bool, null_source: bool, epsilon: float,
                 router_kw: dict | None = None, hooks=None, routers=None):
        self.names = tuple(names)
        hooks = hooks if hooks is not None else [None] * len(self.names)
        for k, (name, module, hook) in enumerate(zip(self.names, sublayers, hooks)):
            setattr(self, name, module)
            if routers is not None:
                router = routers(k, len(self.names))
            else:
                router = (DepthRouter(d_model, gate=gate, null_source=null_source, epsilon=epsilon,
                                      **(router_kw or {})) if routed else None)
            setattr(self, f"{name}_router", router)
            setattr(self, f"{name}_hook", hook)

    def pairs(self, args, kwargs=None, index=None, call_rngs=None, first_position: int = 0, hook_function=None):
        """The layer's [(router, f, hook)] for `DepthRouting.layer`.

        Args:
            args: passed to every sublayer after its input: f(x) = sublayer(x, *args, **kw).
            kwargs: keyword arguments, each given to the sublayers (and hooks) that take it (TypeError
                where none does).
            index: the layer's index, given as `layer_index` (an int32 scalar) to a sublayer naming it.
            call_rngs: {keyword: {stream: key}}: each sublayer and each hook taking the keyword gets an
                `nnx.Rngs` of its own, drawn from the keys folded with its position in the unit.
            first_position: the layer's first sublayer's position in its unit.
            hook_function: the stream hook where the layer holds no hook module.
        """
        from deltares.nn.stack import LAYER_INDEX, SUBLAYER, check_keywords, takes_keyword  # noqa: PLC0415 - stack imports routed, which imports this module

        kwargs = dict(kwargs or {})
        modules = [getattr(self, name) for name in self.names]
        hooks = [getattr(self, f"{name}_hook", None) or hook_function for name in self.names]
        check_keywords(modules + [h for h in hooks if h is not None], {**kwargs, **(call_rngs or {})}, self.names)
        out = []
        for k, (name, m, hook) in enumerate(zip(self.names, modules, hooks)):
            def keywords(target, strict_extra=(), k=k, name=name):
                kw = {key: v for key, v in kwargs.items() if takes_keyword(target, key)}
                draw = 2 * (first_position + k) + (SUBLAYER in strict_extra)  # the sublayer's, or its hook's
                for key, streams in (call_rngs or {}).items():
                    if takes_keyword(target, key):
                        kw[key] = nnx.Rngs(**{s: jax.random.fold_in(v, draw) for s, v in streams.items()})
                if index is not None and takes_keyword(target, LAYER_INDEX, strict=True):
                    kw[LAYER_INDEX] = jnp.asarray(index, jnp.int32)
                if SUBLAYER in strict_extra and takes_keyword(target, SUBLAYER, strict=True):
                    kw[SUBLAYER] = name
                return kw

            hook_fn = None
            if hook is not None:
                hook_fn = (lambda h, hook=hook, kw=keywords(hook, (SUBLAYER,)): hook(h, **kw))
            out.append((getattr(self, f"{name}_router"), lambda x, m=m, kw=keywords(m): m(x, *args, **kw), hook_fn))
        return out

    def run(self, routing_, state, unit, args, kwargs, xs, call_rngs, only=None, prefix=None, stats=False, index=None,
            first=None, first_position: int = 0, hook_function=None):
        """The layer on the depth state (`DepthRouting.layer`): its result.

        Args:
            routing_: the stack's `DepthRouting`.
            state: the depth state before the layer.
            unit: the index of the layer's unit (its layer where the units are single layers).
            args: passed to every sublayer after its input.
            kwargs: keyword arguments (see `pairs`).
            xs: the layer's slice of the per-layer keyword arguments.
            call_rngs: see `pairs`.
            only: `DepthRouting.layer`'s: sublayer k alone (a store-once backward pass).
            prefix: the layer's two-phase routing `Prefix`.
            stats: also return the routing statistics.
            index: the layer's index (default `unit`).
            first: the layer's first sublayer (default the plan's, from `unit`).
            first_position: see `pairs`.
            hook_function: see `pairs`.
        """
        pairs = self.pairs(args, {**kwargs, **(xs or {})}, unit if index is None else index, call_rngs, first_position,
                           hook_function)
        return routing_.layer(state, unit, pairs, only=only, prefix=prefix, stats=stats, first=first)


class StackUnit(nnx.Module):
    """One repeat of an NNX `DepthStack`'s pattern of several layers (or the remainder's first layers
    of it): layer i is the `StackLayer` attribute `str(i)`."""

    def __init__(self, layers):
        self.n = len(layers)
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)

    def run(self, routing_, state, unit, args, kwargs, xs, call_rngs, only=None, prefix=None, stats=False,
            hook_function=None):
        from deltares.nn.stack import slice_prefix, unit_outs  # noqa: PLC0415

        layers = [getattr(self, str(i)) for i in range(self.n)]
        sizes = [len(layer.names) for layer in layers]
        offsets = np.r_[0, np.cumsum(sizes)]
        k_layers = routing_.unit_layers

        def call(i, state, **kw):
            xs_i = None if xs is None else jax.tree.map(lambda a: a[i], xs)
            return layers[i].run(routing_, state, unit, args, kwargs, xs_i, call_rngs, stats=stats,
                                 index=k_layers * unit + i, first=routing_.plan.unit_size * unit + int(offsets[i]),
                                 first_position=int(offsets[i]), hook_function=hook_function, **kw)

        if only is not None:
            i = int(np.searchsorted(offsets, only, side="right")) - 1
            return call(i, state, only=only - int(offsets[i]), prefix=slice_prefix(prefix, offsets[i], offsets[i + 1]))
        outs = []
        for i in range(self.n):
            state, out = call(i, state, prefix=slice_prefix(prefix, offsets[i], offsets[i + 1]))
            outs.append(out)
        return state, unit_outs(outs, sizes)


def _index(tree, layer):
    return jax.tree.map(lambda a: a[layer], tree)


def _no_gradient(tree):
    return jax.tree.map(lambda a: jax.lax.stop_gradient(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a, tree)


def nnx_layers(sublayers, names, pattern, n_layers):
    """One repeat of an NNX DepthStack's pattern: its layers' factories, each (function of rngs, names or None),
    from `sublayers` (a function of rngs returning a layer's modules, named by `names`, or a mapping
    name -> module; or a mapping of layer kinds to such functions) and `pattern`."""
    from deltares.nn.stack import check_names, check_pattern  # noqa: PLC0415

    if isinstance(sublayers, Mapping):
        if not all(callable(f) for f in sublayers.values()):
            raise ValueError("sublayers must map layer kinds to functions of rngs that return a layer's modules")
        kinds = {kind: (f, None if tuple(names) == ("attn", "mlp") else tuple(names)) for kind, f in sublayers.items()}
    else:
        if not callable(sublayers):
            raise ValueError(f"sublayers must be a function of rngs returning a layer's modules (a tuple named by "
                             f"`names`, or a mapping name -> module), or a mapping of layer kinds to such functions, "
                             f"got {sublayers!r}")
        check_names(names)
        kinds = {"layer": (sublayers, tuple(names))}
        if pattern is not None and tuple(pattern) != ("layer",):
            raise ValueError("pattern names layer kinds: give sublayers as a mapping of kinds to their functions")
        pattern = None
    order = check_pattern(list(kinds), pattern, n_layers)
    return tuple(list(kinds.values())[i] for i in order), [list(kinds)[i] for i in order]


def _made(made, names, kind):
    """A layer's modules as (names, modules), from what its function returned."""
    from deltares.nn.stack import check_names  # noqa: PLC0415

    if isinstance(made, Mapping):
        check_names(tuple(made), kind)
        return tuple(made), tuple(made.values())
    made = tuple(made)
    if names is None:
        names = ("attn", "mlp")
    if len(made) != len(names):
        raise ValueError(f"sublayers(rngs) of layer kind {kind!r} must return {len(names)} modules (names "
                         f"{tuple(names)!r}), or a mapping name -> module; got {len(made)}")
    return tuple(names), made


def _call_rngs(kwargs: dict):
    """The call's keyword arguments without its `nnx.Rngs` ones, and of those one key per stream
    ({keyword: {stream: key}}: each draw advances the caller's Rngs, so every call draws new masks)."""
    rest, keys = {}, {}
    for name, value in kwargs.items():
        if isinstance(value, nnx.Rngs):
            keys[name] = {stream: value[stream]() for stream, _ in value.items()}
        elif isinstance(value, nnx.RngStream):
            keys[name] = {"default": value()}
        else:
            rest[name] = value
    return rest, keys


class DepthStack(nnx.Module):
    """`n_layers` layers of your own sublayers under residual `mode`, NNX: created `n_layers` times
    with their state stacked on a leading layer axis (`nnx.vmap`, each layer's rng streams split),
    one `DepthRouter` per sublayer; the NNX counterpart of deltares.nn.stack.DepthStack (the same
    options, the same math).

    Args:
        sublayers: a function of `rngs` returning one layer's modules in depth order (a tuple named
            by `names`, or a mapping name -> module: any number of sublayers, e.g. self-attention,
            cross-attention, MLP; each maps x [B, T, D], pre-norm included, to a delta [B, T, D], or
            to (delta, output)); or a mapping of layer kinds to such functions, repeated in `pattern`.
        n_layers: L, the number of layers.
        d_model: D, the stream's width (the routers').
        mode: the residual scheme (deltares.nn.MODES).
        block_layers: layers per block of the block modes (whole layers, whatever their sublayers).
        include_partial: block modes, whether a sublayer reads its block's partial sum.
        gate: the routers' scalar gate (a converted model's: routing starts at zero, and the stack then
            computes the unrouted model).
        null_source: the routers' learned null source.
        epsilon: the routers' key-norm epsilon.
        remat: recompute each unit in the backward pass; the routed modes then run the store-once pass
            (deltares.nn.depth.depth_scan) unless `store_once=False`.
        policy: the units' jax.checkpoint policy.
        store_once: False: plain autodiff of the scan (the reference).
        scan: False runs the units as a Python loop (parameters stay stacked; each sublayer reads only
            the sources it needs; a longer program, compiled slower).
        names: the sublayers' names where `sublayers` returns a tuple (default attention, MLP).
        axis_names: your logical axis names of the stream and the source buffer (deltares.nn.axes).
        group_layers: where positive, two-phase routing in groups of that many units (the same math).
        scan_segments: the store-once pass in that many segments (the same math).
        impl: the routers' implementation (`DepthRouter`).
        interpret: run a Pallas kernel in interpret mode.
        dtype: the routed inputs' dtype (default the stream's).
        param_dtype: the routers' parameters' dtype.
        query_init: the routers' query initialiser (default zeros).
        gain_init: the routers' gain initialiser (default ones).
        stats: sow the routing statistics (deltares.nn.routed.sublayer_stats) as `nnx.Intermediate`
            `routing_stats` at every call.
        pattern: a sequence of layer kinds (default each kind once, in order): layer l is of kind
            pattern[l % len(pattern)]; one repeat of the pattern is scanned as one unit (attribute
            `layers`, its layer i `layers.<i>`), the remaining n_layers % len(pattern) layers run after
            it (attribute `remainder`, no layer axis), as MaxText scans Gemma 3.
        stream_hook: applied to the stream after every sublayer's delta is added (what the next
            sublayer, its routing and the block partials read; the sublayer's source slot holds what
            the hook made of its delta): a function of `rngs` (a parameter of that name) returning a
            module, built once per sublayer of every layer (`<name>_hook`, so it may draw rngs and
            `sow`), or a function of the stream. Called as `hook(h_BTD, **kw) -> h_BTD` with the
            call's keyword arguments it takes, and by name `layer_index` and `sublayer`.
        layer_axis: the logical axis name of the stacked axis, put in front of every stacked
            variable's `out_sharding` metadata (`nnx.vmap`'s `transform_metadata`); None: none.
        streams: `hyper`, `mhc`: the parallel residual streams R (deltares.nn.mixing).
        dynamic: `hyper`: input-dependent weights beside the static ones.
        sinkhorn_iterations: `mhc`: Sinkhorn-Knopp iterations.
        dilation: `denseformer`: layer l averages the outputs X_j with l - j a multiple of this.
        period: `denseformer`: only every period-th layer averages.
        rngs: the parameters' (and the layers' own streams') `nnx.Rngs`.

    Call: `stack(e_BTD, *args, per_layer=None, **kwargs) -> out_BTD` [B, T, D] (before your final
    norm); where a sublayer returns (delta, output), `-> (out_BTD, outputs)`, outputs {sublayer name:
    value stacked [n_layers, ...]}. Each sublayer is called as `m(x_BTD, *args, **kw)` with the
    keyword arguments its `__call__` takes (TypeError for one that none takes); `per_layer`: keyword
    arguments whose values have a leading layer axis [n_layers, ...], each layer its slice (a decoding
    cache); a sublayer naming `layer_index` gets its layer's index. An `nnx.Rngs` passed as a keyword
    argument is split per layer and sublayer (each gets an `nnx.Rngs` of its own, drawn from one key
    per stream of the caller's, which advances at every call).

    What the layers hold besides parameters (`nnx.Param`, differentiated) passes through the
    stack: rng streams (`nnx.Dropout(rngs=)`: masks differ per layer and per call; the store-once
    backward pass recomputes a layer with its forward's masks), batch statistics, caches and
    values sown with `self.sow` (or collected by `nnx.capture`) are read per layer and written
    back, stacked on the layer axis (under store-once, written values carry no gradient). The
    routers' parameters carry the logical names (`layer_axis`, "embed").

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from deltares.nn.nnx import DepthStack

        stack = DepthStack(lambda rngs: (nnx.Linear(16, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs)),
                           n_layers=4, d_model=16, mode="delta", rngs=nnx.Rngs(0))
        e_BTD = jax.random.normal(jax.random.key(1), (2, 8, 16))
        grads = nnx.grad(lambda m: jnp.mean(m(e_BTD) ** 2))(stack)
        print(stack(e_BTD).shape, grads.layers.mlp_router.query.shape)  # (2, 8, 16) (4, 16)
        print(nnx.get_partition_spec(nnx.state(stack, nnx.Param))["layers"]["attn_router"]["query"].get_value())
        ```
    """

    def __init__(self, sublayers, n_layers: int, d_model: int, mode: Mode = "delta_block", *, block_layers: int = 1,
                 include_partial: bool = True, gate: bool = False, null_source: bool = False,
                 epsilon: float = routing.NORM_EPS, remat: bool = True, policy=None, store_once: bool = True,
                 scan: bool = True, names=("attn", "mlp"), axis_names=None, group_layers: int = 0,
                 scan_segments: int = 1, impl: str = "xla", interpret: bool = False, dtype=None,
                 param_dtype=jnp.float32, query_init=nnx.initializers.zeros, gain_init=nnx.initializers.ones,
                 stats: bool = False, pattern=None, stream_hook=None, layer_axis: str | None = "layers",
                 streams: int = 4, dynamic: bool = True, sinkhorn_iterations: int = 20, dilation: int = 1,
                 period: int = 1, rngs: nnx.Rngs):
        from deltares.nn.routed import DepthRouting  # noqa: PLC0415 - routed imports this module's router

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        kinds, kind_names = nnx_layers(sublayers, names, pattern, n_layers)
        if not isinstance(group_layers, int) or group_layers < 0:
            raise ValueError(f"group_layers must be an integer >= 0 (0: one routing pass per sublayer), got "
                             f"{group_layers!r}")
        if impl not in ROUTING_IMPLS:
            raise ValueError(f"impl must be one of {ROUTING_IMPLS}, got {impl!r}")
        if stream_hook is not None and (isinstance(stream_hook, nnx.Module) or not callable(stream_hook)):
            raise ValueError(f"stream_hook must be a function of rngs returning a module (built once per sublayer of "
                             f"every layer), or a function of the stream; got {stream_hook!r}")
        k = len(kinds)
        routed = mode != "baseline"
        routers = None
        if mode in MIXING_MODES:
            routers = mixer_factory(mode, d_model, n_layers, streams=streams, dynamic=dynamic,
                                    sinkhorn_iterations=sinkhorn_iterations, epsilon=epsilon, param_dtype=param_dtype)
        router_kw = dict(impl=impl, interpret=interpret, dtype=dtype, param_dtype=param_dtype, query_init=query_init,
                         gain_init=gain_init)
        counts = {}

        def make_layer(i, rngs):
            function, layer_names = kinds[i]
            layer_names, made = _made(function(rngs), layer_names, kind_names[i])
            counts[i] = len(made)
            hooks = None
            if stream_hook is not None and _is_factory(stream_hook):
                hooks = [stream_hook(rngs=rngs) for _ in layer_names]
            return StackLayer(made, layer_names, d_model, routed, gate, null_source, epsilon, router_kw, hooks,
                              None if routers is None else (lambda k, n: routers(k, n, rngs)))

        def make_unit(n, rngs):
            return make_layer(0, rngs) if k == 1 else StackUnit([make_layer(i, rngs) for i in range(n)])

        n_units, remaining = divmod(n_layers, k) if isinstance(n_layers, int) and n_layers >= 1 else (n_layers, 0)
        metadata = {nnx.PARTITION_NAME: layer_axis} if layer_axis else {}

        @nnx.split_rngs(splits=n_units)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=metadata)
        def create(rngs):
            return make_unit(k, rngs)

        self.layers = create(rngs)
        self.remainder = make_unit(remaining, rngs) if remaining else None
        self.routing = DepthRouting(mode, n_layers, block_layers, include_partial, epsilon, axis_names,
                                    group_layers=max(1, group_layers), scan_segments=scan_segments,
                                    sublayers=tuple(counts[layer % k] for layer in range(n_layers)), unit_layers=k,
                                    streams=streams, dynamic=dynamic, sinkhorn_iterations=sinkhorn_iterations,
                                    dilation=dilation, period=period)
        if group_layers > 0 and routed and not self.routing.plan.groups_tile_blocks:
            raise ValueError(f"two-phase routing (group_layers={group_layers}) in mode {mode!r} needs blocks of whole "
                             f"pattern repeats: block_layers={block_layers} is not a multiple of the pattern's {k} layers")
        self.remat, self.policy, self.store_once, self.scan = remat, policy, store_once, scan
        self.group_layers, self.impl, self.interpret, self.stats = group_layers, impl, interpret, stats
        self.hook_function = None if stream_hook is None or _is_factory(stream_hook) else stream_hook
        self.final_router = (DepthRouter(d_model, epsilon=epsilon, **router_kw) if self.routing.uses_final_router
                             else None)

    def _layer_list(self, unit):
        return [unit] if isinstance(unit, StackLayer) else [getattr(unit, str(i)) for i in range(unit.n)]

    def _queries(self, params_u):
        """A unit's routers' queries and gains, each [P, D] (two-phase routing)."""
        layers = self._layer_list(self.layers)
        parts = [params_u] if len(layers) == 1 else [params_u[str(i)] for i in range(len(layers))]
        routers = [p[f"{name}_router"] for p, layer in zip(parts, layers) for name in layer.names]
        return tuple(jnp.stack([jnp.asarray(r[key][...]) for r in routers]) for key in ("query", "gain"))

    def __call__(self, e_BTD, *args, per_layer=None, **kwargs):
        """The stack on the embeddings.

        Args:
            e_BTD: the embeddings [B, T, D].
            *args: passed to every sublayer after its input, the same for every layer.
            per_layer: keyword arguments whose values have a leading layer axis [n_layers, ...]: each
                layer gets its slice, where its sublayers' `__call__` takes the keyword.
            **kwargs: keyword arguments each reaching only the sublayers (and stream hooks) whose
                `__call__` takes them (TypeError where none does); an `nnx.Rngs` is split per layer and
                sublayer.

        Returns:
            out [B, T, D], before your final norm; where a sublayer returns (delta, output), (out,
            outputs): {sublayer name: its outputs stacked on the layer axis [n_layers, ...]}.
        """
        from deltares.nn.routed import sublayer_stats  # noqa: PLC0415 - routed imports this module's router
        from deltares.nn.stack import join_inexact, split_inexact, check_per_layer, layer_outputs  # noqa: PLC0415

        if jnp.ndim(e_BTD) != 3:
            raise ValueError(f"the stack's input is [B, T, D], got shape {jnp.shape(e_BTD)}")
        routing_ = self.routing
        plan = routing_.plan
        k, n_units = routing_.unit_layers, plan.n_units
        kwargs, call_rngs = _call_rngs(kwargs)
        xs_L = check_per_layer(per_layer, routing_.n_layers)
        xs_U = xs_T = None
        if xs_L is not None:
            xs_U = jax.tree.map(lambda a: a[: n_units * k].reshape((n_units, k) + a.shape[1:]) if k > 1 else a, xs_L)
            xs_T = jax.tree.map(lambda a: a[n_units * k:], xs_L) if self.remainder is not None else None
        graphdef, params_L, rest_L = nnx.split(self.layers, nnx.Param, ...)
        tail = self.remainder
        tail_def = tail_params = tail_rest = None
        if tail is not None:
            tail_def, tail_params, tail_rest = nnx.split(tail, nnx.Param, ...)
        stats, hook_function = self.stats, self.hook_function
        unit_keys = {kw: {s: jax.vmap(lambda u, key=key: jax.random.fold_in(key, u))(jnp.arange(n_units + 1))
                          for s, key in streams.items()} for kw, streams in call_rngs.items()}

        # per-layer inputs: the floating ones differentiated with the parameters, the others read as they are
        diff_U, const_U, tree_U = split_inexact(xs_U)
        diff_T, const_T, tree_T = split_inexact(xs_T)

        def layer_fn(params_u, state, unit, only=None, prefix=None, consts=None):
            rest_L_, rest_T, keys_U, const_U_, const_T_ = ((rest_L, tail_rest, unit_keys, const_U, const_T)
                                                           if consts is None else consts)
            params_u, diff_u = params_u
            is_tail = isinstance(unit, int) and unit == n_units
            if is_tail:  # rebuilt: the module's sown values must not grow the caller's containers
                module = nnx.merge(tail_def, params_u, jax.tree.map(lambda a: a, rest_T))
                xs_u = join_inexact(diff_u, const_T_, tree_T)
            else:
                module = nnx.merge(graphdef, params_u, _index(rest_L_, unit))
                xs_u = join_inexact(diff_u, _index(const_U_, unit), tree_U)
            keys_u = {kw: {s: key[unit] for s, key in streams.items()} for kw, streams in keys_U.items()}
            out = module.run(routing_, state, unit, args, kwargs, xs_u, keys_u, only=only, prefix=prefix, stats=stats,
                             hook_function=hook_function)
            if only is not None:  # the backward pass's recomputation: what it writes is the forward's
                return out
            state, unit_out = out
            written = _no_gradient(nnx.state(module, nnx.Not(nnx.Param)))
            if isinstance(unit_out, Outputs):
                return state, unit_out._replace(rest=(unit_out.rest, written))
            return state, (unit_out, written)

        grouped = self.group_layers > 0 and routing_.uses_routers and not stats
        consts = (rest_L, tail_rest, unit_keys, const_U, const_T)
        params_U, params_T = (params_L, diff_U), (tail_params, diff_T)
        with routing_.names():
            depth = routing_.start(e_BTD)
            tail_out = None
            if not self.scan:
                outs = []
                for unit in range(n_units):
                    depth, out = layer_fn(_index(params_U, unit), depth, unit)
                    outs.append(out)
                units_out = jax.tree.map(lambda *a: jnp.stack(a), *outs)
                if tail is not None:
                    depth, tail_out = layer_fn(params_T, depth, n_units)
            elif self.remat and self.store_once and routing_.uses_routers:
                queries_fn = (lambda p: self._queries(p[0])) if grouped else None
                depth, units_out = depth_scan(layer_fn, params_U, depth, plan, eps=routing_.epsilon, consts=consts,
                                              queries_fn=queries_fn, impl=self.impl, interpret=self.interpret,
                                              tail_params=params_T if tail is not None else None)
                if tail is not None:
                    units_out, tail_out = units_out
            else:
                step = jax.checkpoint(layer_fn, policy=self.policy) if self.remat else layer_fn
                depth, units_out = jax.lax.scan(lambda d, xs: step(xs[0], d, xs[1]), depth,
                                                (params_U, jnp.arange(n_units)))
                if tail is not None:
                    tail_step = jax.checkpoint(layer_fn, policy=self.policy, static_argnums=(2,)) if self.remat else \
                        layer_fn
                    depth, tail_out = tail_step(params_T, depth, n_units)
            units_out, written_L = _split_written(units_out)
            nnx.update(self.layers, written_L)
            if tail is not None:
                tail_out, written_T = _split_written(tail_out)
                nnx.update(tail, written_T)
            unit_stats = units_out.rest if isinstance(units_out, Outputs) else units_out
            if stats:
                tail_stats = tail_out.rest if isinstance(tail_out, Outputs) else tail_out
                self.sow(nnx.Intermediate, "routing_stats", sublayer_stats(unit_stats, plan, tail_stats))
            out_BTD = routing_.output(depth, self.final_router)
        if not isinstance(units_out, Outputs) and not isinstance(tail_out, Outputs):
            return out_BTD
        layers = self._layer_list(self.layers)
        offsets = np.r_[0, np.cumsum([len(layer.names) for layer in layers])]

        def named(layer, sub):
            return {name: o for name, o in zip(layer.names, sub) if o is not None}

        sub = units_out.sublayers if isinstance(units_out, Outputs) else (None,) * int(offsets[-1])
        positions = [named(layer, sub[offsets[i]: offsets[i + 1]]) for i, layer in enumerate(layers)]
        tails = []
        if tail is not None:
            tail_sub = tail_out.sublayers if isinstance(tail_out, Outputs) else (None,) * plan.tail_size
            tails = [named(layer, tail_sub[offsets[i]: offsets[i + 1]]) for i, layer in
                     enumerate(self._layer_list(tail) if k > 1 else [tail])]
        return out_BTD, layer_outputs(positions, tails, n_units)


def _split_written(out):
    """A unit's out from the stack's layer_fn as (its own out, the state it wrote)."""
    if isinstance(out, Outputs):
        rest, written = out.rest
        return out._replace(rest=rest), written
    return out


__all__ = ["DepthRouter", "DepthStack", "StackLayer"]
