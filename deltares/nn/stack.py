"""`DepthStack`: a stack of your own layers under any residual mode, as one linen module.

You write one layer's sublayers (attention and MLP, or any modules mapping [B, T, D] to a
delta [B, T, D], pre-norm included); the stack makes `n_layers` copies with parameters stacked
on a leading layer axis, one depth router per sublayer, the source bookkeeping, and, for the
routed modes under `remat`, the store-once depth pass (deltares.nn.depth.depth_scan), whose
backward pass keeps one source buffer instead of one per layer:

    stack = DepthStack(sublayers=(functools.partial(Attention, cfg), functools.partial(MLP, cfg)),
                       n_layers=16, mode="delta")
    out_BTD = stack(e_BTD)          # then your final norm and head

Layers need not be identical: `sublayers` may name any number of sublayers per layer (self-attention,
cross-attention, MLP), and several layer kinds repeated in a `pattern` (Gemma 3's five local layers
and one global), scanned one repeat of the pattern at a time with the remainder run after.

Each factory is called as `factory(name=...)` and must return a linen Module whose
`__call__(x_BTD, *args, **kwargs)` returns the delta, or (delta, output); `*args` are what you
pass after `e_BTD` (positions), the same for every layer and sublayer; a keyword argument of the
stack's call reaches only the sublayers whose `__call__` takes it (an attention mask,
`deterministic`), a `per_layer` one its layer's slice, and a sublayer naming `layer_index` learns
its layer's index. Rng streams, sown values and other collections (a decoding cache, batch
statistics) pass through the layers: see `DepthStack`. The NNX version is deltares.nn.nnx.DepthStack.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltares.nn import routing as routing_math
from deltares.nn.config import MODES, ROUTING_IMPLS, Mode
from deltares.nn.depth import Outputs, Prefix, depth_scan, init_depth_state, listed_group_prefix
from deltares.nn.layers import DepthRouter
from deltares.nn.routed import STATS_COLLECTION, DepthRouting, sublayer_stats, wants_stats

LAYER_INDEX = "layer_index"  # the keyword a sublayer (or stream hook) names to learn its layer's index
SUBLAYER = "sublayer"  # the keyword a stream hook names to learn which sublayer it follows


def check_names(names: Sequence[str], kind: str | None = None) -> None:
    """ValueError unless `names` are distinct strings, at least one (a layer's sublayers)."""
    where = "" if kind is None else f" of layer kind {kind!r}"
    if (isinstance(names, str) or not len(names) or len(set(names)) != len(names)
            or not all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"the sublayers{where} need names that are distinct strings (not empty), got {tuple(names)!r}")


def check_pattern(kinds: Sequence[str], pattern, n_layers) -> tuple[int, ...]:
    """The pattern (a sequence of kind names; None: the kinds in order) as indices into `kinds`;
    ValueError for a name that is no kind, a kind it leaves out, or one longer than the stack."""
    if pattern is None:
        pattern = tuple(kinds)
    if isinstance(pattern, str) or not isinstance(pattern, Sequence) or not len(pattern):
        raise ValueError(f"pattern must be a sequence of layer kinds ({', '.join(map(repr, kinds))}), got {pattern!r}")
    unknown = [p for p in pattern if p not in kinds]
    if unknown:
        raise ValueError(f"pattern names {unknown[0]!r}, which is not a layer kind; the kinds are "
                         f"{', '.join(map(repr, kinds))}")
    unused = [k for k in kinds if k not in pattern]
    if unused:
        raise ValueError(f"layer kind {unused[0]!r} is not in the pattern {tuple(pattern)!r}")
    if isinstance(n_layers, int) and len(pattern) > n_layers:
        raise ValueError(f"the pattern has {len(pattern)} layers, more than the stack's n_layers={n_layers}")
    return tuple(kinds.index(p) for p in pattern)


def linen_layers(sublayers, names, pattern, n_layers) -> tuple[tuple, ...]:
    """The layers of one repeat of a linen DepthStack's pattern, each a tuple of (name, factory)
    pairs in depth order, from its `sublayers` (factories named by `names`; a mapping name ->
    factory, one kind; or a mapping kind -> (name -> factory), several) and `pattern`."""
    if isinstance(sublayers, Mapping):
        values = list(sublayers.values())
        if values and all(isinstance(v, Mapping) for v in values):  # kinds of layers
            if tuple(names) != ("attn", "mlp"):
                raise ValueError("names come from the mappings' keys when sublayers maps layer kinds: leave names out")
            kinds = {}
            for kind, layer in sublayers.items():
                check_names(tuple(layer), kind)
                kinds[kind] = tuple(layer.items())
        elif any(isinstance(v, Mapping) for v in values):
            raise ValueError("sublayers must map sublayer names to factories (one kind of layer), or layer kinds to "
                             "such mappings, not a mix of the two")
        else:
            if tuple(names) != ("attn", "mlp"):
                raise ValueError("names come from the mapping's keys when sublayers is a mapping: leave names out")
            check_names(tuple(sublayers))
            kinds = {"layer": tuple(sublayers.items())}
    else:
        if isinstance(sublayers, str) or not isinstance(sublayers, Sequence):
            raise ValueError(f"sublayers must be a sequence of module factories named by `names`, or a mapping, got "
                             f"{sublayers!r}")
        check_names(names)
        if len(sublayers) != len(names):
            raise ValueError(f"{len(sublayers)} sublayers and {len(names)} names {tuple(names)!r}: one name per sublayer "
                             f"(a layer has {len(names)} sublayers here)")
        kinds = {"layer": tuple(zip(names, sublayers))}
    for kind, layer in kinds.items():
        for k, (name, f) in enumerate(layer):
            if not callable(f):
                raise ValueError(f"sublayers[{k}] ({name!r}) must be a factory of a module (a class or a function of "
                                 f"name=), got {f!r}")
    order = check_pattern(list(kinds), pattern if isinstance(sublayers, Mapping) and all(
        isinstance(v, Mapping) for v in sublayers.values()) else _one_kind_pattern(pattern), n_layers)
    layers = list(kinds.values())
    return tuple(layers[i] for i in order)


def _one_kind_pattern(pattern):
    """A stack of one kind of layer takes no pattern (or the one-kind pattern)."""
    if pattern is not None and tuple(pattern) != ("layer",):
        raise ValueError("pattern names layer kinds: give sublayers as a mapping of kinds to their sublayers")
    return None


def is_module_factory(f) -> bool:
    """A linen Module class, or functools.partial of one (not an instance, not a plain function)."""
    while isinstance(f, functools.partial):
        f = f.func
    return isinstance(f, type) and issubclass(f, nn.Module)


def check_hook(hook) -> None:
    """ValueError unless `hook` is None, a linen Module factory or a function (not a Module instance)."""
    if hook is None or is_module_factory(hook):
        return
    if isinstance(hook, nn.Module) or not callable(hook):
        raise ValueError(f"stream_hook must be a linen Module class (or functools.partial of one), built once per "
                         f"sublayer of every layer, or a function of the stream; got {hook!r}")


def takes_keyword(module, name: str, strict: bool = False) -> bool:
    """Whether `module.__call__` (or a function) accepts the keyword argument `name` (by name, or
    **kwargs unless `strict`)."""
    try:
        target = type(module).__call__ if not inspect.isfunction(module) and not isinstance(
            module, functools.partial) else module
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return not strict
    if name in params and params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        return True
    return not strict and any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_keywords(bodies, kwargs, names) -> None:
    """TypeError naming a keyword argument that no sublayer's `__call__` (nor stream hook) takes."""
    for key in kwargs:
        if not any(takes_keyword(body, key) for body in bodies if body is not None):
            which = "neither sublayer" if len(names) == 2 else "no sublayer"
            raise TypeError(f"the stack was called with the keyword argument {key!r}, which {which} "
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


class RoutedLayer(nn.Module):
    """One layer of a `DepthStack` (`layer`: its (name, factory) pairs in depth order) and its
    routers, run by `routing.layer`; a stack of one layer kind scans it as its unit. Called as
    `(state, unit, xs, kwargs, *args)`: the layer is layer `unit_layers * unit + position` of the
    stack, its sublayers from `unit_size * unit + offset` on; `args` reach every sublayer, the
    keyword arguments (`kwargs`, arrays; `static_kwargs`, hashable values as (name, value) pairs;
    `xs`, this layer's slice of the per-layer ones) only the sublayers whose `__call__` takes them
    (`takes_keyword`). `stream_hook`: a Module factory built per sublayer (`{name}_hook`) or a
    function, applied to the stream after each sublayer (`DepthRouting.layer`)."""

    routing: DepthRouting
    layer: tuple
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
    stream_hook: Any = None
    position: int = 0
    offset: int = 0

    @nn.compact
    def __call__(self, state, unit, xs, kwargs, *args, only=None, prefix=None):
        kwargs = {**dict(kwargs or {}), **dict(self.static_kwargs), **dict(xs or {})}
        names = tuple(name for name, _ in self.layer)
        bodies = [_build(factory, k, name) for k, (name, factory) in enumerate(self.layer)]
        hooks = [None] * len(names)
        if self.stream_hook is not None:
            hooks = [self.stream_hook(name=f"{name}_hook") if is_module_factory(self.stream_hook) else self.stream_hook
                     for name in names]
        check_keywords(bodies + [h for h in hooks if h is not None], kwargs, names)
        k_layers = self.routing.unit_layers
        index = unit if k_layers == 1 else k_layers * unit + self.position  # the layer's index in the stack
        pairs = []
        for k, (name, body, hook) in enumerate(zip(names, bodies, hooks)):
            router = self.routing.linen_router(k, len(names), f"{name}_router", gate=self.gate,
                                               null_source=self.null_source, impl=self.impl, interpret=self.interpret,
                                               dtype=self.dtype, param_dtype=self.param_dtype,
                                               query_init=self.query_init, gain_init=self.gain_init)
            kw = {k: v for k, v in kwargs.items() if takes_keyword(body, k)}
            if takes_keyword(body, LAYER_INDEX, strict=True):
                kw[LAYER_INDEX] = jnp.asarray(index, jnp.int32)
            pairs.append((router, lambda x, body=body, kw=kw: body(x, *args, **kw), _hook_fn(hook, name, index, kwargs)))
        first = None if k_layers == 1 else self.routing.plan.unit_size * unit + self.offset
        return self.routing.layer(state, unit, pairs, only=only, prefix=prefix, stats=self.stats, first=first)


def _hook_fn(hook, name: str, index, kwargs: dict):
    """The stream hook of sublayer `name` as h -> h, with the keyword arguments it takes: the stack's
    (`deterministic`, ...), and by name `layer_index` and `sublayer`."""
    if hook is None:
        return None
    kw = {k: v for k, v in kwargs.items() if takes_keyword(hook, k)}
    if takes_keyword(hook, LAYER_INDEX, strict=True):
        kw[LAYER_INDEX] = jnp.asarray(index, jnp.int32)
    if takes_keyword(hook, SUBLAYER, strict=True):
        kw[SUBLAYER] = name
    return lambda h_BTD: hook(h_BTD, **kw)


def slice_prefix(prefix, start: int, stop: int):
    """Sublayers [start, stop) of a unit's `Prefix` (leading axis: the unit's sublayers)."""
    if prefix is None:
        return None
    return prefix._replace(out_BTD=prefix.out_BTD[start:stop], lse_BT=prefix.lse_BT[start:stop])


def unit_outs(outs, sizes):
    """The out of a unit from its layers' outs (`DepthRouting.layer`'s: None, statistics stacked per
    sublayer, or `Outputs`), its sublayers in order; `sizes`: the layers' sublayer counts."""
    if all(o is None for o in outs):
        return None
    stats = [o.rest if isinstance(o, Outputs) else o for o in outs]
    stats = None if all(s is None for s in stats) else jax.tree.map(lambda *a: jnp.concatenate(a), *stats)
    if not any(isinstance(o, Outputs) for o in outs):
        return stats
    return Outputs(sum((o.sublayers if isinstance(o, Outputs) else (None,) * n for o, n in zip(outs, sizes)), ()),
                   stats)


class RoutedUnit(nn.Module):
    """One repeat of a `DepthStack`'s pattern of several layers (or the remainder's first layers of
    it): layer i of `layers` is the `RoutedLayer` named `str(i)`. Called as a `RoutedLayer` is;
    `xs` holds the per-layer keyword arguments with a leading axis of its layers; `only` and the
    `Prefix` count the unit's sublayers in order."""

    routing: DepthRouting
    layers: tuple
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
    stream_hook: Any = None

    @nn.compact
    def __call__(self, state, unit, xs, kwargs, *args, only=None, prefix=None):
        sizes = [len(layer) for layer in self.layers]
        offsets = np.r_[0, np.cumsum(sizes)]
        fields = (self.gate, self.null_source, self.stats, self.dtype, self.param_dtype, self.query_init,
                  self.gain_init, self.impl, self.interpret, self.static_kwargs, self.stream_hook)
        children = [RoutedLayer(self.routing, layer, *fields, position=i, offset=int(offsets[i]), name=str(i))
                    for i, layer in enumerate(self.layers)]

        def xs_of(i):
            return None if xs is None else jax.tree.map(lambda a: a[i], xs)

        if only is not None:  # one sublayer of the unit
            i = int(np.searchsorted(offsets, only, side="right")) - 1
            return children[i](state, unit, xs_of(i), kwargs, *args, only=only - int(offsets[i]),
                               prefix=slice_prefix(prefix, offsets[i], offsets[i + 1]))
        outs = []
        for i, child in enumerate(children):
            state, out = child(state, unit, xs_of(i), kwargs, *args,
                               prefix=slice_prefix(prefix, offsets[i], offsets[i + 1]))
            outs.append(out)
        return state, unit_outs(outs, sizes)


def stack_layers(parent: nn.Module, layer_cls, fields: tuple, routing: DepthRouting, state, args: tuple = (), *,
                 xs=None, scan: bool = True, remat: bool = True, policy=None, store_once: bool = True,
                 unroll: bool = False, queries_fn=None, impl: str = "xla", interpret: bool = False, tail=None,
                 tail_xs=None, layer_of=None, layer_axis: str | None = "layers"):
    """The layers of `parent` (a linen module, inside its compact call), in the units of
    `routing.plan` (one layer each, or one repeat of a layer pattern): `n_units` units
    `layer_cls(*fields)`, each called as `unit(state, index, xs_u, *args, only=None, prefix=None)
    -> (state, out)` (`xs`: a pytree with a leading unit axis, sliced per unit; `args` the same for
    every unit), then, where the plan has a remainder, `tail` = (class, fields) of the remainder
    unit, named `remainder`, called with index n_units and `tail_xs`. Returns (state, the units'
    outs stacked on a leading axis), with a remainder (state, (those, the remainder's out)).

    Parameters: `layers` (stacked, `scan`; the logical axis name `layer_axis` in front of each
    parameter's) or `layers_0`, `layers_1`, ... (unrolled; each sublayer reads only the sources it
    needs; `layer_of(l)` -> (class, fields, unit index) builds layer l of a stack whose units have
    several layers, and the outs are then a list, one per layer). `remat` recomputes each unit in
    the backward pass (`policy`: a jax.checkpoint policy); with it the routed modes differentiate a
    scan with the store-once pass (deltares.nn.depth.depth_scan) unless `store_once=False` (plain
    autodiff of the scan). `queries_fn` (a unit's parameters -> its routers' queries and gains;
    unrolled units of several layers: (a layer's parameters, its index) ->), `impl`, `interpret`:
    two-phase routing, in the store-once pass or, unrolled, by plain autodiff (`listed_group_prefix`
    at each group's first layer). `unroll`: the scans unrolled in the program.
    The one way deltares stacks layers: DepthStack and the Transformer both run it."""
    plan = routing.plan
    if not scan:
        return _unrolled(parent, layer_cls, fields, routing, state, args, xs, remat, policy, queries_fn, impl,
                         interpret, layer_of)
    if remat and store_once and routing.uses_routers and not parent.is_initializing():
        return _store_once(parent, layer_cls(*fields, parent=None), routing, state, args, xs=xs,
                           tail=None if tail is None else tail[0](*tail[1], parent=None), tail_xs=tail_xs,
                           unroll=unroll, queries_fn=queries_fn, impl=impl, interpret=interpret)
    # prevent_cse=False is safe only in a loop: fully unrolled, XLA would merge the recomputed forward
    # with the forward (jax 0.12 does) and the remat would silently not happen (nor be estimated).
    layer = nn.remat(layer_cls, prevent_cse=unroll, policy=policy) if remat else layer_cls
    # every collection (parameters, a decoding cache, batch statistics, sown values) stacked on the
    # layer axis, every rng stream (dropout, ...) split per unit
    n_units = plan.n_units
    scanned = nn.scan(layer, variable_axes={True: 0}, split_rngs={True: True},
                      in_axes=(0, 0) + (nn.broadcast,) * len(args), length=n_units,
                      metadata_params={nn.PARTITION_NAME: layer_axis} if layer_axis else {},
                      unroll=n_units if unroll else 1)
    state, out = scanned(*fields, name="layers")(state, jnp.arange(n_units), xs, *args)
    if tail is None:
        return state, out
    tail_cls = nn.remat(tail[0], static_argnums=(2,), policy=policy) if remat else tail[0]
    state, tail_out = tail_cls(*tail[1], name="remainder")(state, n_units, tail_xs, *args)
    return state, (out, tail_out)


def _unrolled(parent: nn.Module, layer_cls, fields: tuple, routing: DepthRouting, state, args: tuple, xs, remat: bool,
              policy, queries_fn, impl: str, interpret: bool, layer_of):
    """`stack_layers` with `scan=False`: one module per layer, `layers_0`, `layers_1`, ..."""
    plan = routing.plan
    n_layers, k = routing.n_layers, routing.unit_layers
    grouped = queries_fn is not None and routing.uses_routers and xs is None and not parent.is_initializing()
    params = nn.meta.unbox(parent.variables["params"]) if grouped else None
    G = plan.group_layers * k  # layers per two-phase group
    main = plan.n_units * k  # the layers of whole units: the remainder's route one pass per sublayer
    remat_of = functools.lru_cache(lambda cls: nn.remat(cls, static_argnums=(2,), policy=policy) if remat else cls)
    outs = []
    for index in range(n_layers):
        cls, fields_l, unit = (layer_cls, fields, index) if layer_of is None else layer_of(index)
        layer = remat_of(cls)
        xs_l = None if xs is None else jax.tree.map(lambda a, index=index: a[index], xs)
        kwargs = {}
        if grouped and index < main:  # two-phase: the group's queries over the slots before it, once, at its first layer
            first, i = index - index % G, index % G
            if i == 0:
                n = min(G, main - first)
                group = [params[f"layers_{m}"] for m in range(first, first + n)]
                if layer_of is not None:
                    group, fn = list(zip(group, range(first, first + n))), (lambda pl: queries_fn(*pl))
                else:
                    fn = queries_fn
                out_KBTD, lse_KBT = listed_group_prefix(fn, group, state, plan, first // k, n // k, impl=impl,
                                                        interpret=interpret, eps=routing.epsilon)
            start = int(plan.layer_first[index] - plan.layer_first[first])
            stop = start + plan.layer_sublayers[index]
            kwargs["prefix"] = Prefix(out_KBTD[start: stop], lse_KBT[start: stop])
        state, out = layer(*fields_l, name=f"layers_{index}")(state, unit, xs_l, *args, **kwargs)
        outs.append(out)
    if layer_of is not None:
        return state, outs
    return state, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _capturing():
    """The `capture_intermediates` filter of the apply in progress (False outside one)."""
    from flax.linen.module import _context  # noqa: PLC0415 - flax keeps the filter of the apply in progress here

    stack = getattr(_context, "capture_stack", None)
    capture = stack[-1] if stack else False
    if not capture:
        return False
    if capture is True:
        capture = nn.module.capture_call_intermediates

    def layers_only(module, method):  # not a layer's own output: its depth state is bookkeeping
        return not isinstance(module, (RoutedLayer, RoutedUnit)) and capture(module, method)

    return layers_only


def split_inexact(tree):
    """A pytree's leaves as (the floating ones, None elsewhere; the others, None elsewhere), lists."""
    leaves = jax.tree.leaves(tree)
    inexact = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in leaves]
    return ([a if f else None for a, f in zip(leaves, inexact)], [None if f else a for a, f in zip(leaves, inexact)],
            jax.tree.structure(tree))


def join_inexact(diff, const, treedef):
    return jax.tree.unflatten(treedef, [d if d is not None else c for d, c in zip(diff, const)])


def _store_once(parent: nn.Module, layer: nn.Module, routing: DepthRouting, state, args: tuple, xs=None, tail=None,
                tail_xs=None, **kw):
    """`stack_layers`' store-once pass (deltares.nn.depth.depth_scan) with everything Flax threads
    through a module: unit u runs as `layer.apply` on its slice of every collection under
    `parent`'s `layers` (parameters, and a cache or batch statistics where present; the remainder
    unit `tail` on those under `remainder`), with each rng stream of the call folded with u
    (`jax.random.fold_in(parent.make_rng(name), u)`: the backward pass recomputes a unit with the
    masks of its forward), and the mutable collections it writes (sown values,
    capture_intermediates, a cache) stacked on a leading unit axis back under `layers`, as `nn.scan`
    lays them out. Values written this way carry no gradient. The per-unit inputs `xs` are
    differentiated where they are floating point (with the parameters), read as they are elsewhere."""
    variables = parent.variables
    params_L = nn.meta.unbox(variables["params"]["layers"])
    tail_params = None if tail is None else nn.meta.unbox(variables["params"]["remainder"])

    def others(name):
        return {c: nn.meta.unbox(v[name]) for c, v in variables.items()
                if c != "params" and isinstance(v, Mapping) and name in v}

    others_L, others_T = others("layers"), (others("remainder") if tail is not None else {})
    keys = {name: parent.make_rng(name) for name in parent.scope.rngs if name != "params"}
    capture = _capturing()
    mutable = parent.scope.mutable
    has_xs = xs is not None or tail_xs is not None
    threads = bool(others_L or others_T or keys or capture or _mutable_beyond_params(parent) or tail is not None
                   or has_xs)
    xs_diff, xs_const, xs_tree = split_inexact(xs)
    tail_diff, tail_const, tail_tree = split_inexact(tail_xs)
    n_units = routing.plan.n_units

    def layer_fn(params_u, state, index, only=None, prefix=None, consts=None):
        if not threads:
            return layer.apply({"params": params_u}, state, index, None, *args, only=only, prefix=prefix)
        is_tail = isinstance(index, int) and index == n_units  # the remainder unit, called on its own
        params_u, diff_u = params_u
        others_L, others_T, keys, const_L, const_T = consts
        if is_tail:
            module, others_u, xs_u = tail, others_T, join_inexact(diff_u, const_T, tail_tree)
        else:
            module, others_u = layer, jax.tree.map(lambda a: a[index], others_L)
            xs_u = join_inexact(diff_u, jax.tree.map(lambda a: a[index], const_L), xs_tree)
        variables_u = {"params": params_u, **others_u}
        rngs = {name: jax.random.fold_in(key, index) for name, key in keys.items()}
        out = module.apply(variables_u, state, index, xs_u, *args, only=only, prefix=prefix, rngs=rngs,
                           mutable=mutable, capture_intermediates=capture)
        out, written = (out, {}) if mutable is False and not capture else out
        if only is not None:  # the backward pass's recomputation: what it writes is the forward's
            return out
        state, unit_out = out
        written = jax.lax.stop_gradient({c: v for c, v in written.items() if c != "params"})
        if isinstance(unit_out, Outputs):
            return state, unit_out._replace(rest=(unit_out.rest, written))
        return state, (unit_out, written)

    if not threads:
        return depth_scan(layer_fn, params_L, state, routing.plan, eps=routing.epsilon, **kw)
    if kw.get("queries_fn") is not None:  # the units' parameters come with their per-unit inputs
        kw["queries_fn"] = functools.partial(lambda fn, p: fn(p[0]), kw["queries_fn"])
    state, out = depth_scan(layer_fn, (params_L, xs_diff), state, routing.plan, eps=routing.epsilon,
                            consts=(others_L, others_T, keys, xs_const, tail_const),
                            tail_params=None if tail is None else (tail_params, tail_diff), **kw)
    out, tail_out = out if tail is not None else (out, None)
    out = _put_written(parent, "layers", out)
    if tail is None:
        return state, out
    return state, (out, _put_written(parent, "remainder", tail_out))


def _put_written(parent: nn.Module, name: str, out):
    """A unit's out from `_store_once`'s layer_fn: the collections it wrote put back under `name`;
    returns the unit's own out."""
    if isinstance(out, Outputs):
        (rest, written), out = out.rest, out
        out = out._replace(rest=rest)
    else:
        out, written = out
    for collection, tree in written.items():
        if jax.tree.leaves(tree):
            parent.put_variable(collection, name, tree)
    return out


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


def layer_outputs(position_outputs, tail_outputs, n_units: int):
    """Per-layer outputs stacked on the layer axis [L, ...] from each position of the pattern's
    outputs (a dict of sublayer name -> output with a leading unit axis) and the remainder's
    (one dict per layer, no unit axis): layer l is position l % k of unit l // k. ValueError where
    the layers' outputs differ in names or shapes (they are stacked)."""
    shapes = [jax.tree.map(lambda a: jnp.shape(a)[1:], o) for o in position_outputs]
    shapes += [jax.tree.map(jnp.shape, o) for o in tail_outputs]
    for i, s in enumerate(shapes[1:], 1):
        if jax.tree.structure(s) != jax.tree.structure(shapes[0]) or jax.tree.leaves(s) != jax.tree.leaves(shapes[0]):
            raise ValueError(f"the sublayers' outputs differ between layer {i} and layer 0 (their shapes: {s} and "
                             f"{shapes[0]}): per-layer outputs are stacked on the layer axis, so every layer must "
                             f"return the same names and shapes")
    k = len(position_outputs)
    if not k:
        return jax.tree.map(lambda *t: jnp.stack(t), *tail_outputs)
    main = jax.tree.map(lambda *a: jnp.stack(a, axis=1).reshape((n_units * k,) + a[0].shape[1:]), *position_outputs)
    if not tail_outputs:
        return main
    return jax.tree.map(lambda m, *t: jnp.concatenate([m, jnp.stack(t)]), main, *tail_outputs)


class DepthStack(nn.Module):
    """`n_layers` layers of your own sublayers under residual `mode`, one depth router per sublayer,
    as one linen module: the layers' parameters stacked on a leading layer axis, the source
    bookkeeping, and under `remat` the store-once backward pass (deltares.nn.depth.depth_scan),
    which keeps one source buffer instead of one per layer.

    Layers may differ: a layer has any number of named sublayers (self-attention, cross-attention,
    MLP), and several layer kinds repeat in a `pattern` (Gemma 3's five local layers and one global):
    layer l is of kind pattern[l % len(pattern)]; the stack scans one repeat of the pattern as one unit
    and runs the remaining n_layers % len(pattern) layers after it, on their own (as MaxText scans
    Gemma 3). Routing reads every sublayer in depth order; the block modes' blocks are `block_layers`
    whole layers, whatever their sublayers.

    Parameters: `layers`, each leaf stacked [n_layers / len(pattern), ...]: with one kind, sublayer
    `name` and its router `name_router` (query and gain [n_layers, D]) inside; with a pattern, layer i
    of each repeat under `layers/i`; the remaining layers under `remainder/i` (no layer axis); unrolled
    (`scan=False`) `layers_0`, `layers_1`, ...; and `final_router` (query, gain [D], the Kimi modes).
    `stack_params` moves a per-layer parameter tree into this layout, `layer_params` back. Every other
    collection (a decoding `cache`, `batch_stats`, values sown with `sow`, `capture_intermediates`)
    lives in the same layout; rng streams are split per unit (the store-once pass folds the unit's
    index into each, `jax.random.fold_in(key, u)`, and recomputes a unit in the backward pass with the
    masks of its forward). Under store-once, values a layer writes carry no gradient. Routing statistics
    (per sublayer: mean weight per source slot, mean max weight, mean entropy, number of sources) are
    sown as `variables["routing"]["stats"]` when you apply the stack with `mutable=["routing"]`.

    Attributes:
        sublayers: a layer's sublayers in depth order: factories of linen Modules (each called as
            `factory(name=...)`: a Module class, or functools.partial of one), named by `names`; or a
            mapping name -> factory (any number of sublayers); or a mapping of layer kinds to such
            mappings, repeated in `pattern`. Each sublayer maps x [B, T, D] (pre-norm included) to its
            delta [B, T, D], or to (delta, output).
        n_layers: L.
        mode: the residual scheme (deltares.nn.MODES).
        block_layers: layers per block of the block modes (1 in the others).
        include_partial: block modes, whether a sublayer routes over its block's partial sum.
        gate: the routers' scalar gate (a converted model's: routing starts at zero, and the stack then
            computes the unrouted model).
        null_source: the routers' learned null source.
        epsilon: the routers' key-norm epsilon.
        remat: recompute each unit in the backward pass; the routed modes then run the store-once pass
            unless `store_once=False`.
        policy: the units' jax.checkpoint policy.
        store_once: False: plain autodiff of the scan (the reference).
        scan: False unrolls the layers (parameters `layers_0`, `layers_1`, ...; each sublayer reads only
            the sources it needs): a program L times longer, compiled L times slower.
        names: the sublayers' names where `sublayers` is a sequence (default attention, MLP).
        axis_names: your logical axis names of the stream and the source buffer (deltares.nn.axes:
            roles `batch`, `length`, `embed`, `sources`).
        group_layers: where positive, two-phase routing in groups of that many units (block modes:
            blocks of whole pattern repeats; docs/explanations/store-once.md, the same math); 0: one
            routing pass per sublayer.
        scan_segments: the store-once pass in that many segments (the same math).
        impl: the routers' implementation: "xla", or a fused Pallas kernel ("pallas", "auto").
        interpret: run a Pallas kernel in interpret mode (CPU tests).
        dtype: the routed inputs' dtype (default the stream's).
        param_dtype: the routers' parameters' dtype.
        query_init: the routers' query initialiser (default zeros: uniform routing at step 0).
        gain_init: the routers' gain initialiser (default ones).
        pattern: a sequence of layer kinds (default each kind of `sublayers` once, in order).
        stream_hook: applied to the stream after every sublayer's delta is added (the stream the next
            sublayer, its routing and the block partials read; the sublayer's source slot holds what the
            hook made of its delta): a linen Module class (or functools.partial of one), built once per
            sublayer of every layer as `<name>_hook`, so that it may draw rngs (stream dropout) and `sow`
            (stream intermediates, stacked per layer like the parameters); or a function. Called as
            `hook(h_BTD, **kw) -> h_BTD` with the call's keyword arguments it takes (`deterministic`),
            and by name `layer_index` and `sublayer` (the sublayer's name).
        layer_axis: the logical axis name of the stacked axis in each parameter's partitioning
            metadata (the routers': (`layer_axis`, "embed")); None: none added.
        streams: `hyper`, `mhc`: the parallel residual streams R (deltares.nn.mixing).
        dynamic: `hyper`: input-dependent weights beside the static ones.
        sinkhorn_iterations: `mhc`: Sinkhorn-Knopp iterations.
        dilation: `denseformer`: layer l averages the outputs X_j with l - j a multiple of this.
        period: `denseformer`: only every period-th layer averages.

    In the mixing modes a sublayer's `name_router` holds its mixer: `hyper`, `mhc` a
    `deltares.nn.mixing.HyperConnection` in every sublayer; `denseformer` a `DepthWeights` in each
    layer's last sublayer. They take no store-once pass (the scan carries the R streams, or the
    layer outputs' buffer: unroll denseformer's layers, `scan=False`, to store each output once), and
    `hyper` and `mhc` no stream hook.

    Example:
        ```python
        import functools

        import flax.linen as nn
        import jax
        from deltares.nn import DepthStack


        class Attention(nn.Module):  # yours: pre-norm, a delta [B, T, D]
            window: int = 0

            @nn.compact
            def __call__(self, x_BTD, deterministic: bool = True):
                T = x_BTD.shape[1]
                mask = nn.make_causal_mask(x_BTD[..., 0])
                if self.window:  # a local layer attends to the last `window` tokens
                    mask = mask * (jax.numpy.arange(T)[:, None] - jax.numpy.arange(T)[None, :] < self.window)
                y_BTD = nn.MultiHeadDotProductAttention(2, dropout_rate=0.1)(nn.RMSNorm()(x_BTD), mask=mask,
                                                                             deterministic=deterministic)
                return y_BTD


        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x_BTD):
                return nn.Dense(x_BTD.shape[-1])(nn.gelu(nn.Dense(32)(nn.RMSNorm()(x_BTD))))


        local = {"attn": functools.partial(Attention, window=4), "mlp": MLP}
        stack = DepthStack({"local": local, "global": {"attn": Attention, "mlp": MLP}}, n_layers=5,
                           mode="delta_block", block_layers=2, pattern=("local", "local", "global"))
        e_BTD = jax.random.normal(jax.random.key(0), (2, 16, 16))
        variables = stack.init(jax.random.key(1), e_BTD)
        out_BTD = stack.apply(variables, e_BTD, deterministic=False, rngs={"dropout": jax.random.key(2)})
        params = nn.meta.unbox(variables["params"])  # the routers' logical names: ("layers", "embed")
        print(out_BTD.shape, params["layers"]["2"]["attn_router"]["query"].shape, sorted(params["remainder"]))
        # (2, 16, 16) (1, 16) ['0', '1']: one repeat of the pattern, the last 2 layers apart
        ```
    """

    sublayers: Any
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
    pattern: Any = None
    stream_hook: Any = None
    layer_axis: str | None = "layers"
    streams: int = 4
    dynamic: bool = True
    sinkhorn_iterations: int = 20
    dilation: int = 1
    period: int = 1

    def pattern_layers(self) -> tuple:
        """One repeat of the pattern: its layers, each a tuple of (sublayer name, factory) pairs."""
        return linen_layers(self.sublayers, self.names, self.pattern, self.n_layers)

    def _routing(self, layers) -> DepthRouting:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.group_layers, int) or self.group_layers < 0:
            raise ValueError(f"group_layers must be an integer >= 0 (0: one routing pass per sublayer), got "
                             f"{self.group_layers!r}")
        if self.impl not in ROUTING_IMPLS:
            raise ValueError(f"impl must be one of {ROUTING_IMPLS}, got {self.impl!r}")
        check_hook(self.stream_hook)
        k = len(layers)
        counts = tuple(len(layers[layer % k]) for layer in range(self.n_layers)) if isinstance(self.n_layers, int) else 2
        return DepthRouting(self.mode, self.n_layers, self.block_layers, self.include_partial, self.epsilon,
                            None if self.axis_names is None else dict(self.axis_names),
                            group_layers=max(1, self.group_layers), scan_segments=self.scan_segments,
                            sublayers=counts, unit_layers=k, streams=self.streams, dynamic=self.dynamic,
                            sinkhorn_iterations=self.sinkhorn_iterations, dilation=self.dilation, period=self.period)

    def _queries(self, params, index=None):
        """The routers' queries and gains, each [P, D], of a unit's parameters (two-phase routing); with
        `index`, of layer `index`'s (unrolled)."""
        layers = self.pattern_layers()
        if index is not None:
            parts = [(params, layers[index % len(layers)])]
        elif len(layers) == 1:
            parts = [(params, layers[0])]
        else:
            parts = [(params[str(i)], layer) for i, layer in enumerate(layers)]
        routers = [p[f"{name}_router"] for p, layer in parts for name, _ in layer]
        return tuple(jnp.stack([r[key] for r in routers]) for key in ("query", "gain"))

    @nn.compact
    def __call__(self, e_BTD, *args, per_layer=None, **kwargs):
        """The stack on the embeddings.

        Args:
            e_BTD: the embeddings [B, T, D].
            *args: passed to every sublayer after its input (positions, a mask), the same for every layer.
            per_layer: keyword arguments whose values have a leading layer axis [n_layers, ...] (as
                nn.scan's `in_axes` slices them): each layer gets its slice (a decoding cache, per-layer
                embeddings), where its sublayers' `__call__` takes the keyword.
            **kwargs: keyword arguments each reaching only the sublayers (and stream hooks) whose
                `__call__` takes them by name, or **kwargs (TypeError where none does): an attention
                mask, `deterministic`. Arrays are traced; other values (flags) stay Python values.

        A sublayer whose `__call__` names `layer_index` gets its layer's index (an int32 scalar).

        Returns:
            out [B, T, D], before your final norm; where a sublayer returns (delta, output), (out,
            outputs): {sublayer name: its outputs stacked on the layer axis [n_layers, ...]} (a returned
            cache, auxiliary losses: differentiated, the store-once pass included).
        """
        layers = self.pattern_layers()
        routing = self._routing(layers)
        plan = routing.plan
        if jnp.ndim(e_BTD) != 3:
            raise ValueError(f"the stack's input is [B, T, D], got shape {jnp.shape(e_BTD)}")
        arrays, static = split_kwargs(kwargs)
        xs_L = check_per_layer(per_layer, self.n_layers)
        k, n_units = len(layers), plan.n_units
        with routing.names():
            state = init_depth_state(e_BTD, plan, self.epsilon, listed=not self.scan)
            stats = wants_stats(self)
            grouped = self.group_layers > 0 and routing.uses_routers and not stats  # statistics need every weight
            if grouped and not plan.groups_tile_blocks:
                raise ValueError(f"two-phase routing (group_layers={self.group_layers}) in mode {self.mode!r} needs "
                                 f"blocks of whole pattern repeats: block_layers={self.block_layers} is not a multiple "
                                 f"of the pattern's {k} layers")
            common = (self.gate, self.null_source, stats, self.dtype, self.param_dtype, self.query_init,
                      self.gain_init, self.impl, self.interpret, static, self.stream_hook)
            tail = layer_of = xs_tail = None
            xs = xs_L
            if k == 1:
                unit = (RoutedLayer, (routing, layers[0]) + common)
            else:
                unit = (RoutedUnit, (routing, layers) + common)
                remaining = self.n_layers - n_units * k
                if remaining:
                    tail = (RoutedUnit, (routing, layers[:remaining]) + common)
                if xs_L is not None and self.scan:
                    xs = jax.tree.map(lambda a: a[: n_units * k].reshape((n_units, k) + a.shape[1:]), xs_L)
                    xs_tail = jax.tree.map(lambda a: a[n_units * k:], xs_L) if remaining else None
                if not self.scan:
                    layer_of = functools.partial(_unrolled_layer, routing, layers, common)
            queries_fn = None
            if grouped:
                queries_fn = self._queries
            state, out = stack_layers(self, *unit, routing, state, (arrays,) + args, xs=xs, scan=self.scan,
                                      remat=self.remat, policy=self.policy, store_once=self.store_once,
                                      queries_fn=queries_fn, impl=self.impl, interpret=self.interpret, tail=tail,
                                      tail_xs=xs_tail, layer_of=layer_of, layer_axis=self.layer_axis)
            stats_J, outputs = self._outs(layers, plan, out, tail is not None)
            if stats:
                self.sow(STATS_COLLECTION, "stats", stats_J)
            final_router = None
            if routing.uses_final_router:
                final_router = DepthRouter(impl=self.impl, interpret=self.interpret, epsilon=self.epsilon,
                                           dtype=self.dtype, param_dtype=self.param_dtype, query_init=self.query_init,
                                           gain_init=self.gain_init, name="final_router")
            out_BTD = routing.output(state, final_router)
            return out_BTD if outputs is None else (out_BTD, outputs)

    def _outs(self, layers, plan, out, has_tail: bool):
        """(the routing statistics per sublayer, or None; the per-layer outputs {name: [L, ...]}, or None)
        from what `stack_layers` returned: the units' outs (and the remainder's), or unrolled layers' list."""
        k = len(layers)
        if isinstance(out, list):  # unrolled layers of several kinds: one out per layer
            per_layer = [(o.rest if isinstance(o, Outputs) else o, o.sublayers if isinstance(o, Outputs) else None)
                         for o in out]
            stats = [s for s, _ in per_layer]
            stats_J = None
            if stats[0] is not None:  # the layers' sublayers in order
                stats_J = {key: jnp.concatenate([s[key] for s in stats]) for key in stats[0]}
                stats_J["n_sources"] = jnp.asarray(plan.n_sources)
            if all(o is None for _, o in per_layer):
                return stats_J, None
            dicts = [_named(layers[index % k], o) for index, (_, o) in enumerate(per_layer)]
            return stats_J, layer_outputs([], dicts, 0)
        units, tail_out = out if has_tail else (out, None)
        unit_stats = units.rest if isinstance(units, Outputs) else units
        tail_stats = tail_out.rest if isinstance(tail_out, Outputs) else tail_out
        stats_J = None if unit_stats is None else sublayer_stats(unit_stats, plan, tail_stats)
        if not isinstance(units, Outputs) and not isinstance(tail_out, Outputs):
            return stats_J, None
        offsets = np.r_[0, np.cumsum([len(layer) for layer in layers])]
        sub = units.sublayers if isinstance(units, Outputs) else (None,) * int(offsets[-1])
        positions = [_named(layer, sub[offsets[i]: offsets[i + 1]]) for i, layer in enumerate(layers)]
        tails = []
        if has_tail:
            tail_sub = tail_out.sublayers if isinstance(tail_out, Outputs) else (None,) * plan.tail_size
            tails = [_named(layer, tail_sub[offsets[i]: offsets[i + 1]])
                     for i, layer in enumerate(layers[: self.n_layers - plan.n_units * k])]
        return stats_J, layer_outputs(positions, tails, plan.n_units)


def _unrolled_layer(routing: DepthRouting, layers: tuple, common: tuple, index: int):
    """Layer `index` of an unrolled stack of a pattern: (RoutedLayer, its fields, its unit's index)."""
    unit, i = divmod(index, len(layers))
    offset = sum(len(layer) for layer in layers[:i])
    return RoutedLayer, (routing, layers[i]) + common + (i, offset), unit


def _named(layer, outputs) -> dict:
    """A layer's outputs by sublayer name (those that returned one)."""
    return {name: o for (name, _), o in zip(layer, outputs) if o is not None}


def check_per_layer(per_layer, n_layers: int):
    """`per_layer` (a mapping of keyword name -> pytree of arrays [n_layers, ...]), or None; ValueError
    for a value without that leading axis."""
    if per_layer is None:
        return None
    if not isinstance(per_layer, Mapping):
        raise ValueError(f"per_layer must map keyword argument names to values with a leading layer axis, got "
                         f"{type(per_layer).__name__}")
    for key, value in per_layer.items():
        for leaf in jax.tree.leaves(value):
            if not jnp.ndim(leaf) or jnp.shape(leaf)[0] != n_layers:
                raise ValueError(f"per_layer[{key!r}] holds an array of shape {jnp.shape(leaf)}: per-layer values have "
                                 f"a leading axis of the stack's {n_layers} layers")
    return dict(per_layer)


__all__ = ["DepthStack", "RoutedLayer", "RoutedUnit", "check_per_layer", "layer_outputs", "linen_layers",
           "stack_layers", "with_layer_layout"]
