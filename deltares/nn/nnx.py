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

import jax.numpy as jnp
from flax import nnx

from deltares.nn import routing
from deltares.nn.layers import ROUTER_PARAMS, apply_router, router_param_names, router_param_shape


class DepthRouter(nnx.Module):
    """One sublayer's routing parameters on a model dimension `d_model`; see deltares.nn.layers.DepthRouter."""

    def __init__(self, d_model: int, *, gate: bool = False, null_source: bool = False, impl: str = "xla",
                 interpret: bool = False, eps: float = routing.NORM_EPS):
        self.param_names = router_param_names(gate, null_source)
        self.impl, self.interpret, self.eps = impl, interpret, eps
        for name in self.param_names:
            init, axes = ROUTER_PARAMS[name]
            value = init(None, router_param_shape(name, d_model), jnp.float32)
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))

    def __call__(self, sources_SBTD, inv_rms_SBT, valid, residual_BTD=None, prefix=None):
        params = {name: getattr(self, name)[...] for name in self.param_names}
        return apply_router(params, sources_SBTD, inv_rms_SBT, valid, residual_BTD, impl=self.impl,
                            interpret=self.interpret, eps=self.eps, prefix=prefix)
