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
`__call__(x_BTD, *args, **kwargs)` returns the delta; `*args` are what you pass after `e_BTD`
(positions), the same for every layer and both sublayers; a keyword argument of the stack's call
reaches only the sublayers whose `__call__` takes it (an attention mask, `deterministic`). Rng
streams, sown values and other collections (a decoding cache, batch statistics) pass through
the layers: see `DepthStack`. The NNX version is deltares.nn.nnx.DepthStack.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltares.nn import routing as routing_math
from deltares.nn.config import MODES, ROUTING_IMPLS, Mode
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
    """One layer of a `DepthStack`: its sublayers and their routers, run by `routing.layer`.
    Called as `(state, layer, xs, kwargs, *args)`: `args` reach both sublayers, the keyword
    arguments (`kwargs`, arrays; `static_kwargs`, hashable values as (name, value) pairs) only the
    sublayers whose `__call__` takes them (`takes_keyword`)."""

    routing: DepthRouting
    sublayers: tuple
    names: tuple = ("attn", "mlp")
    gate: bool = False
    null_source: bool = False
    stats: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    query_init: Any = nn.initializers.zeros
    gain_init: Any = nn.initializers.ones
    impl: str = "xla"
    interpret: bool = False
    static_kwargs: tuple = ()

    @nn.compact
    def __call__(self, state, layer, xs, kwargs, *args, only=None, prefix=None):
        pairs = []
        kwargs = {**dict(kwargs or {}), **dict(self.static_kwargs)}
        bodies = [_build(factory, k, name) for k, (name, factory) in enumerate(zip(self.names, self.sublayers))]
        check_keywords(bodies, kwargs, self.names)
        for name, body in zip(self.names, bodies):
            router = None
            if self.routing.uses_routers:
                router = DepthRouter(self.gate, self.null_source, impl=self.impl, interpret=self.interpret,
                                     epsilon=self.routing.epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
                                     query_init=self.query_init, gain_init=self.gain_init, name=f"{name}_router")
            kw = {k: v for k, v in kwargs.items() if takes_keyword(body, k)}
            pairs.append((router, lambda x, body=body, kw=kw: body(x, *args, **kw)))
        return self.routing.layer(state, layer, pairs, only=only, prefix=prefix, stats=self.stats)


def takes_keyword(module, name: str) -> bool:
    """Whether `module.__call__` accepts the keyword argument `name` (by name, or **kwargs)."""
    try:
        params = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return True
    if name in params and params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        return True
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_keywords(bodies, kwargs, names) -> None:
    """TypeError naming a keyword argument that no sublayer's `__call__` takes."""
    for key in kwargs:
        if not any(takes_keyword(body, key) for body in bodies):
            raise TypeError(f"the stack was called with the keyword argument {key!r}, which neither sublayer "
                            f"({', '.join(f'{n}: {type(b).__name__}' for n, b in zip(names, bodies))}) takes")


def split_kwargs(kwargs: dict) -> tuple[dict, tuple]:
    """A call's keyword arguments as (those holding arrays, traced; the others as sorted (name, value)
    pairs, static: flags such as `deterministic` or `decode` stay Python values). TypeError for a
    static value that cannot be hashed."""
    arrays, static = {}, []
    for key, value in kwargs.items():
        if any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(value)):
            arrays[key] = value
        else:
            try:
                hash(value)
            except TypeError:
                raise TypeError(f"keyword argument {key!r}={value!r}: pass arrays, or hashable Python values "
                                f"(flags, numbers, strings, tuples)") from None
            static.append((key, value))
    return arrays, tuple(sorted(static))


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
        return _store_once(parent, layer_cls(*fields, parent=None), routing, state, args, unroll=unroll,
                           queries_fn=queries_fn, impl=impl, interpret=interpret)
    # prevent_cse=False is safe only in a loop: fully unrolled, XLA would merge the recomputed forward
    # with the forward (jax 0.12 does) and the remat would silently not happen (nor be estimated).
    layer = nn.remat(layer_cls, prevent_cse=unroll, policy=policy) if remat else layer_cls
    # every collection (parameters, a decoding cache, batch statistics, sown values) stacked on the
    # layer axis, every rng stream (dropout, ...) split per layer
    scanned = nn.scan(layer, variable_axes={True: 0}, split_rngs={True: True},
                      in_axes=(0, 0) + (nn.broadcast,) * len(args), length=n_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"}, unroll=n_layers if unroll else 1)
    return scanned(*fields, name="layers")(state, jnp.arange(n_layers), xs, *args)


def _capturing():
    """The `capture_intermediates` filter of the `apply` in progress (False outside one)."""
    from flax.linen.module import _context  # noqa: PLC0415 - flax keeps the filter of the apply in progress here

    stack = getattr(_context, "capture_stack", None)
    capture = stack[-1] if stack else False
    if not capture:
        return False
    if capture is True:
        capture = nn.module.capture_call_intermediates

    def layers_only(module, method):  # not a layer's own output: its depth state is bookkeeping
        return not isinstance(module, RoutedLayer) and capture(module, method)

    return layers_only


def _store_once(parent: nn.Module, layer: nn.Module, routing: DepthRouting, state, args: tuple, **kw):
    """`stack_layers`' store-once pass (deltares.nn.depth.depth_scan) with everything Flax threads
    through a module: layer l runs as `layer.apply` on its slice of every collection under
    `parent`'s `layers` (parameters, and a cache or batch statistics where present), with each rng
    stream of the call folded with l (`jax.random.fold_in(parent.make_rng(name), l)`: the backward
    pass recomputes a layer with the masks of its forward), and the mutable collections it writes
    (sown values, capture_intermediates, a cache) stacked on a leading layer axis back under
    `layers`, as `nn.scan` lays them out. Values written this way carry no gradient."""
    variables = parent.variables
    params_L = nn.meta.unbox(variables["params"]["layers"])
    others_L = {c: nn.meta.unbox(v["layers"]) for c, v in variables.items()
                if c != "params" and isinstance(v, Mapping) and "layers" in v}
    keys = {name: parent.make_rng(name) for name in parent.scope.rngs if name != "params"}
    capture = _capturing()
    mutable = parent.scope.mutable
    threads = bool(others_L or keys or capture or _mutable_beyond_params(parent))

    def layer_fn(params_l, state, index, only=None, prefix=None, consts=None):
        if not threads:
            return layer.apply({"params": params_l}, state, index, None, *args, only=only, prefix=prefix)
        others_L, keys = consts
        variables_l = {"params": params_l, **jax.tree.map(lambda a: a[index], others_L)}
        rngs = {name: jax.random.fold_in(key, index) for name, key in keys.items()}
        out = layer.apply(variables_l, state, index, None, *args, only=only, prefix=prefix, rngs=rngs,
                          mutable=mutable, capture_intermediates=capture)
        out, written = (out, {}) if mutable is False and not capture else out
        if only is not None:  # the backward pass's recomputation: what it writes is the forward's
            return out
        state, stats = out
        written = jax.lax.stop_gradient({c: v for c, v in written.items() if c != "params"})
        return state, (stats, written)

    state, out = depth_scan(layer_fn, params_L, state, routing.plan, eps=routing.epsilon,
                            consts=(others_L, keys) if threads else None, **kw)
    if not threads:
        return state, out
    stats, written_L = out
    for collection, tree in written_L.items():
        if jax.tree.leaves(tree):
            parent.put_variable(collection, "layers", tree)
    return state, stats


def _mutable_beyond_params(parent: nn.Module) -> bool:
    """Whether the apply in progress may write a collection other than `params` (a filter naming
    one, True, or a deny list)."""
    mutable = parent.scope.mutable
    if isinstance(mutable, (bool, str)):
        return mutable is True or (isinstance(mutable, str) and mutable != "params")
    if isinstance(mutable, (list, tuple, set)):
        return any(m is True or (m != "params") for m in mutable)
    return True  # a DenyList: everything but what it names


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
    """`n_layers` layers of `sublayers` (two module factories) under residual `mode`.

    Call: `stack(e_BTD, *args, **kwargs) -> out_BTD`, e and out [B, T, D] (out before your final
    norm; the Kimi modes route it with one more router, `final_router`). Each sublayer is called as
    `sublayer(x_BTD, *args, **its_kwargs) -> delta_BTD`: `args` reach both sublayers, a keyword
    argument only the sublayers whose `__call__` takes it by name (or **kwargs; TypeError if
    neither does): an attention mask for attention, `deterministic` for whichever has dropout.
    Parameters: `layers` (each leaf [n_layers, ...]; sublayer `names[k]` and its router
    `names[k] + "_router"`, query and gain [n_layers, D], inside), and `final_router` (query, gain [D]).

    Everything else Flax threads through a module passes through the layers, scanned or unrolled,
    store-once or not: rng streams are split per layer (scanned by `nn.scan`; the store-once pass
    folds the layer index into each stream, `jax.random.fold_in(key, l)`, and recomputes a layer in
    the backward pass with the masks of its forward); collections other than `params` (a decoding
    `cache`, `batch_stats`, values sown with `sow`, `capture_intermediates`) live under `layers`
    with a leading layer axis [n_layers, ...] (scanned) or under `layers_0`, `layers_1`, ...
    (`scan=False`), as the parameters do. Under store-once, values a layer writes carry no gradient.

    `block_layers`: layers per block of the block modes (1 elsewhere). `remat` (default): each
    layer recomputed in the backward pass (`policy`: a jax.checkpoint policy); with it the routed
    modes run the store-once pass unless `store_once=False` (plain autodiff of the scan, the
    reference). `scan=False` unrolls the layers (parameters `layers_0`, `layers_1`, ...; each
    sublayer reads only the sources it needs): a program L times longer, compiled L times slower.
    `group_layers` > 0: two-phase routing in groups of that many layers, and `scan_segments`:
    the store-once pass in segments (docs/explanations/store-once.md; the same math). Routers:
    `impl` ("xla", or a fused Pallas kernel), `interpret`, `epsilon` (key-norm epsilon), `dtype`
    (of the routed input; default the stream's), `param_dtype`, `query_init`, `gain_init`.
    `axis_names`: your logical axis names of the stream and the source buffer (deltares.nn.axes:
    roles `batch`, `length`, `embed`, `sources`); the routers' parameters carry the logical names
    ("layers", "embed"). Routing statistics (per sublayer: mean weight per source slot, mean max
    weight, mean entropy, number of sources) are sown as `variables["routing"]["stats"]` when you
    apply the stack with `mutable=["routing"]`."""

    sublayers: tuple
    n_layers: int
    mode: Mode = "delta_block"
    block_layers: int = 1
    include_partial: bool = True
    gate: bool = False
    null_source: bool = False
    epsilon: float = routing_math.NORM_EPS
    remat: bool = True
    policy: Any = None
    store_once: bool = True
    scan: bool = True
    names: tuple = ("attn", "mlp")
    axis_names: Any = None
    group_layers: int = 0
    scan_segments: int = 1
    impl: str = "xla"
    interpret: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    query_init: Any = nn.initializers.zeros
    gain_init: Any = nn.initializers.ones

    def _routing(self) -> DepthRouting:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_sublayers(self.sublayers, self.names)
        if not isinstance(self.group_layers, int) or self.group_layers < 0:
            raise ValueError(f"group_layers must be an integer >= 0 (0: one routing pass per sublayer), got "
                             f"{self.group_layers!r}")
        if self.impl not in ROUTING_IMPLS:
            raise ValueError(f"impl must be one of {ROUTING_IMPLS}, got {self.impl!r}")
        return DepthRouting(self.mode, self.n_layers, self.block_layers, self.include_partial, self.epsilon,
                            None if self.axis_names is None else dict(self.axis_names),
                            group_layers=max(1, self.group_layers), scan_segments=self.scan_segments)

    def _queries(self, params_l):
        """A layer's two routers' query and gain, each [2, D] (two-phase routing)."""
        routers = [params_l[f"{name}_router"] for name in self.names]
        return tuple(jnp.stack([r[key] for r in routers]) for key in ("query", "gain"))

    @nn.compact
    def __call__(self, e_BTD, *args, **kwargs):
        routing = self._routing()
        if jnp.ndim(e_BTD) != 3:
            raise ValueError(f"the stack's input is [B, T, D], got shape {jnp.shape(e_BTD)}")
        arrays, static = split_kwargs(kwargs)
        with routing.names():
            state = init_depth_state(e_BTD, routing.plan, self.epsilon, listed=not self.scan)
            stats = wants_stats(self)
            grouped = self.group_layers > 0 and routing.uses_routers and not stats  # statistics need every weight
            fields = (routing, tuple(self.sublayers), tuple(self.names), self.gate, self.null_source, stats,
                      self.dtype, self.param_dtype, self.query_init, self.gain_init, self.impl, self.interpret, static)
            state, stats_L2 = stack_layers(self, RoutedLayer, fields, routing, state, (arrays,) + args,
                                           scan=self.scan, remat=self.remat, policy=self.policy,
                                           store_once=self.store_once, queries_fn=self._queries if grouped else None,
                                           impl=self.impl, interpret=self.interpret)
            if stats:
                self.sow(STATS_COLLECTION, "stats", sublayer_stats(stats_L2, routing.plan))
            final_router = None
            if routing.uses_final_router:
                final_router = DepthRouter(impl=self.impl, interpret=self.interpret, epsilon=self.epsilon,
                                           dtype=self.dtype, param_dtype=self.param_dtype, query_init=self.query_init,
                                           gain_init=self.gain_init, name="final_router")
            return routing.output(state, final_router)


__all__ = ["DepthStack", "RoutedLayer", "stack_layers", "with_layer_layout"]
