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
from deltares.nn.config import MODES, Mode
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

    def __init__(self, sublayers, names, d_model: int, routed: bool, gate: bool, null_source: bool, epsilon: float):
        self.names = tuple(names)
        for name, module in zip(self.names, sublayers):
            setattr(self, name, module)
            setattr(self, f"{name}_router", DepthRouter(d_model, gate=gate, null_source=null_source, epsilon=epsilon)
                    if routed else None)

    def pairs(self, args):
        """[(router, f)] for `DepthRouting.layer`, each f(x) = sublayer(x, *args)."""
        return [(getattr(self, f"{name}_router"), lambda x, m=getattr(self, name): m(x, *args)) for name in self.names]


class DepthStack(nnx.Module):
    """`n_layers` layers under residual `mode`, NNX: `sublayers(rngs)` returns one layer's two
    modules (attention and MLP, or any modules mapping [B, T, D], pre-norm included, to a delta;
    called as `m(x_BTD, *args)`), created `n_layers` times with their state stacked on a leading
    axis (`nnx.vmap`). Calling the stack on e_BTD returns its output before the final norm.
    Options as deltares.nn.stack.DepthStack (the linen module): under `remat` the routed modes run
    the store-once pass (deltares.nn.depth.depth_scan) unless `store_once=False`; `axis_names` your
    logical axis names of the stream and the source buffer (deltares.nn.axes)."""

    def __init__(self, sublayers, n_layers: int, d_model: int, mode: Mode = "delta_block", *, block_layers: int = 1,
                 include_partial: bool = True, gate: bool = False, null_source: bool = False,
                 epsilon: float = routing.NORM_EPS, remat: bool = True, store_once: bool = True,
                 names=("attn", "mlp"), axis_names=None, rngs: nnx.Rngs):
        from deltares.nn.routed import DepthRouting  # noqa: PLC0415 - routed imports this module's router
        from deltares.nn.stack import check_names  # noqa: PLC0415

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_names(names)
        if not callable(sublayers):
            raise ValueError(f"sublayers must be a function of rngs returning a layer's two modules, got {sublayers!r}")
        self.routing = DepthRouting(mode, n_layers, block_layers, include_partial, epsilon, axis_names)
        self.remat, self.store_once = remat, store_once
        routed = self.routing.uses_routers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            made = tuple(sublayers(rngs))
            if len(made) != len(names):
                raise ValueError(f"sublayers(rngs) must return {len(names)} modules, got {len(made)}")
            return StackLayer(made, names, d_model, routed, gate, null_source, epsilon)

        self.layers = create(rngs)
        self.final_router = DepthRouter(d_model, epsilon=epsilon) if self.routing.uses_final_router else None

    def __call__(self, e_BTD, *args):
        graphdef, state_L = nnx.split(self.layers)
        routing_ = self.routing

        def layer_fn(state_l, state, layer, only=None):
            return routing_.layer(state, layer, nnx.merge(graphdef, state_l).pairs(args), only=only)

        with routing_.names():
            depth = routing_.start(e_BTD)
            if self.remat and self.store_once and routing_.uses_routers:
                depth, _ = depth_scan(layer_fn, state_L, depth, routing_.plan, eps=routing_.epsilon)
            else:
                step = jax.checkpoint(layer_fn) if self.remat else layer_fn
                depth = jax.lax.scan(lambda d, xs: step(xs[0], d, xs[1]), depth,
                                     (state_L, jnp.arange(routing_.n_layers)))[0]
            return routing_.output(depth, self.final_router)


__all__ = ["DepthRouter", "DepthStack", "StackLayer"]
