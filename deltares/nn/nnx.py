"""Flax NNX versions of deltares' routing layer, for use with `deltares.nn.routed.DepthRouting`.

`DepthRouter` is a native `nnx.Module` with the same parameters, initialisers and logical
axis names as the linen `deltares.nn.layers.DepthRouter` (query, gain, optionally null_source
and gate), and the same call (`apply_router`, one implementation). The axis names are kept
as `out_sharding` metadata with `eager_sharding=False`, so a router builds with default flax
settings and no mesh; `nnx.get_partition_spec(nnx.state(model))` reads them back, and the
logical rules of deltares.training.sharding map them onto a mesh as for linen.

(`flax.nnx.bridge.ToNNX(linen DepthRouter)` fails under flax 0.12's default eager sharding
because the linen parameters carry logical names; use these modules instead.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deltares.nn import routing
from deltares.nn.config import MODES, ROUTING_IMPLS, Mode
from deltares.nn.depth import depth_scan
from deltares.nn.layers import ROUTER_PARAMS, apply_router, router_param_names, router_param_shape


class DepthRouter(nnx.Module):
    """One sublayer's routing parameters on a model dimension `d_model`; see deltares.nn.layers.DepthRouter."""

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
        params = {name: getattr(self, name)[...] for name in self.param_names}
        out_BTD, weights_SBT = apply_router(params, sources_SBTD, inv_rms_SBT, valid, residual_BTD, impl=self.impl,
                                            interpret=self.interpret, eps=self.epsilon, prefix=prefix)
        return (out_BTD if self.dtype is None else out_BTD.astype(self.dtype)), weights_SBT


class StackLayer(nnx.Module):
    """One layer of an NNX `DepthStack`: sublayer `names[k]` and its router `names[k] + "_router"`."""

    def __init__(self, sublayers, names, d_model: int, routed: bool, gate: bool, null_source: bool, epsilon: float,
                 router_kw: dict | None = None):
        self.names = tuple(names)
        for name, module in zip(self.names, sublayers):
            setattr(self, name, module)
            setattr(self, f"{name}_router", DepthRouter(d_model, gate=gate, null_source=null_source, epsilon=epsilon,
                                                         **(router_kw or {})) if routed else None)

    def pairs(self, args, kwargs=None):
        """[(router, f)] for `DepthRouting.layer`, each f(x) = sublayer(x, *args, **the kwargs it takes)."""
        from deltares.nn.stack import check_keywords, takes_keyword  # noqa: PLC0415 - stack imports routed, which imports this module

        kwargs = kwargs or {}
        modules = [getattr(self, name) for name in self.names]
        check_keywords(modules, kwargs, self.names)
        return [(getattr(self, f"{name}_router"),
                 lambda x, m=m: m(x, *args, **{k: v for k, v in kwargs.items() if takes_keyword(m, k)}))
                for name, m in zip(self.names, modules)]


def _index(tree, layer):
    return jax.tree.map(lambda a: a[layer], tree)


def _no_gradient(tree):
    return jax.tree.map(lambda a: jax.lax.stop_gradient(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a, tree)


class DepthStack(nnx.Module):
    """`n_layers` layers under residual `mode`, NNX: `sublayers(rngs)` returns one layer's two
    modules (attention and MLP, or any modules mapping [B, T, D], pre-norm included, to a delta
    [B, T, D]), created `n_layers` times with their state stacked on a leading axis [n_layers, ...]
    (`nnx.vmap`, each layer's rng streams split). `stack(e_BTD, *args, **kwargs)` returns the
    output [B, T, D] before the final norm; each sublayer is called as `m(x_BTD, *args, **kw)` with
    the keyword arguments its `__call__` takes (TypeError for one that neither takes).

    What the layers hold besides parameters (`nnx.Param`, differentiated) passes through the
    stack: rng streams (`nnx.Dropout(rngs=)`: masks differ per layer and per call; the store-once
    backward pass recomputes a layer with its forward's masks), batch statistics, caches and
    values sown with `self.sow` are read per layer and written back, stacked on the layer axis
    (under store-once, written values carry no gradient). With `stats=True` every call sows the
    routing statistics (deltares.nn.routed.sublayer_stats) as `nnx.Intermediate` `routing_stats`.

    Options as deltares.nn.stack.DepthStack (the linen module): under `remat` (`policy`: a
    jax.checkpoint policy) the routed modes run the store-once pass (deltares.nn.depth.depth_scan)
    unless `store_once=False`; `scan=False` runs the layers as a Python loop (parameters stay
    stacked; each sublayer reads only the sources it needs; a longer program, compiled slower);
    `group_layers` > 0 two-phase routing, `scan_segments`; the routers' `impl`, `interpret`,
    `epsilon`, `dtype`, `param_dtype`, `query_init`, `gain_init`; `axis_names` your logical axis
    names of the stream and the source buffer (deltares.nn.axes). The routers' parameters carry
    the logical names ("layers", "embed")."""

    def __init__(self, sublayers, n_layers: int, d_model: int, mode: Mode = "delta_block", *, block_layers: int = 1,
                 include_partial: bool = True, gate: bool = False, null_source: bool = False,
                 epsilon: float = routing.NORM_EPS, remat: bool = True, policy=None, store_once: bool = True,
                 scan: bool = True, names=("attn", "mlp"), axis_names=None, group_layers: int = 0,
                 scan_segments: int = 1, impl: str = "xla", interpret: bool = False, dtype=None,
                 param_dtype=jnp.float32, query_init=nnx.initializers.zeros, gain_init=nnx.initializers.ones,
                 stats: bool = False, rngs: nnx.Rngs):
        from deltares.nn.routed import DepthRouting  # noqa: PLC0415 - routed imports this module's router
        from deltares.nn.stack import check_names  # noqa: PLC0415

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_names(names)
        if not callable(sublayers):
            raise ValueError(f"sublayers must be a function of rngs returning a layer's two modules, got {sublayers!r}")
        if not isinstance(group_layers, int) or group_layers < 0:
            raise ValueError(f"group_layers must be an integer >= 0 (0: one routing pass per sublayer), got "
                             f"{group_layers!r}")
        if impl not in ROUTING_IMPLS:
            raise ValueError(f"impl must be one of {ROUTING_IMPLS}, got {impl!r}")
        self.routing = DepthRouting(mode, n_layers, block_layers, include_partial, epsilon, axis_names,
                                    group_layers=max(1, group_layers), scan_segments=scan_segments)
        self.remat, self.policy, self.store_once, self.scan = remat, policy, store_once, scan
        self.group_layers, self.impl, self.interpret, self.stats = group_layers, impl, interpret, stats
        self.names = tuple(names)
        routed = self.routing.uses_routers
        router_kw = dict(impl=impl, interpret=interpret, dtype=dtype, param_dtype=param_dtype, query_init=query_init,
                         gain_init=gain_init)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            made = tuple(sublayers(rngs))
            if len(made) != len(names):
                raise ValueError(f"sublayers(rngs) must return {len(names)} modules, got {len(made)}")
            return StackLayer(made, names, d_model, routed, gate, null_source, epsilon, router_kw)

        self.layers = create(rngs)
        self.final_router = (DepthRouter(d_model, epsilon=epsilon, **router_kw) if self.routing.uses_final_router
                             else None)

    def _queries(self, params_l):
        """A layer's two routers' query and gain, each [2, D] (two-phase routing)."""
        routers = [params_l[f"{name}_router"] for name in self.names]
        return tuple(jnp.stack([jnp.asarray(r[key][...]) for r in routers]) for key in ("query", "gain"))

    def __call__(self, e_BTD, *args, **kwargs):
        from deltares.nn.routed import sublayer_stats  # noqa: PLC0415 - routed imports this module's router

        if jnp.ndim(e_BTD) != 3:
            raise ValueError(f"the stack's input is [B, T, D], got shape {jnp.shape(e_BTD)}")
        graphdef, params_L, rest_L = nnx.split(self.layers, nnx.Param, ...)
        routing_ = self.routing
        stats = self.stats

        def layer_fn(params_l, state, layer, only=None, prefix=None, consts=None):
            rest = rest_L if consts is None else consts  # the layers' state but parameters
            module = nnx.merge(graphdef, params_l, _index(rest, layer))
            out = routing_.layer(state, layer, module.pairs(args, kwargs), only=only, prefix=prefix, stats=stats)
            if only is not None:  # the backward pass's recomputation: what it writes is the forward's
                return out
            return out[0], (out[1], _no_gradient(nnx.state(module, nnx.Not(nnx.Param))))

        grouped = self.group_layers > 0 and routing_.uses_routers and not stats
        with routing_.names():
            depth = routing_.start(e_BTD)
            if not self.scan:
                outs = []
                for layer in range(routing_.n_layers):
                    depth, out = layer_fn(_index(params_L, layer), depth, layer)
                    outs.append(out)
                stats_L2, written_L = jax.tree.map(lambda *a: jnp.stack(a), *outs)
            elif self.remat and self.store_once and routing_.uses_routers:
                depth, (stats_L2, written_L) = depth_scan(layer_fn, params_L, depth, routing_.plan, eps=routing_.epsilon,
                                                       consts=rest_L, queries_fn=self._queries if grouped else None, impl=self.impl,
                                                       interpret=self.interpret)
            else:
                step = jax.checkpoint(layer_fn, policy=self.policy) if self.remat else layer_fn
                depth, (stats_L2, written_L) = jax.lax.scan(lambda d, xs: step(xs[0], d, xs[1]), depth,
                                                         (params_L, jnp.arange(routing_.n_layers)))
            nnx.update(self.layers, written_L)
            if stats:
                self.sow(nnx.Intermediate, "routing_stats", sublayer_stats(stats_L2, routing_.plan))
            return routing_.output(depth, self.final_router)


__all__ = ["DepthRouter", "DepthStack", "StackLayer"]
