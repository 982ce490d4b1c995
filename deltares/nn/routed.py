"""Depth routing in your own model: any of the five residual modes around your own sublayers.

deltares supplies each sublayer's routed input, the source bookkeeping (buffer, validity,
cached 1/rms, slot writes) and, when asked, the store-once depth pass; you supply the
sublayers (attention, MLP: anything mapping [B, T, D] to a delta [B, T, D], pre-norm included)
and one router per sublayer (linen `deltares.nn.layers.DepthRouter`, NNX
`deltares.nn.nnx.DepthRouter`, or a parameter dict for `apply_router`). Sublayers are numbered
j = 0 .. 2L-1 (j = 2l: attention of layer l, j = 2l+1: its MLP), as in docs/explanations/modes.md.

    routing = DepthRouting("delta_block", n_layers=L, block_layers=2)
    state = routing.start(e_BTD)
    for j in range(2 * L):
        x_BTD = routing.input(state, j, routers[j])
        state = routing.add(state, j, sublayer[j](x_BTD))
    out_BTD = routing.output(state, final_router)   # final_router: Kimi modes only

Or, for a stack of identical layers with stacked parameters, `routing.stack(...)`: a scan
whose backward pass stores each source once (deltares.nn.depth.depth_scan).
This is the code deltares' own DecoderLayer and Transformer run (deltares.nn.depth).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from deltares.nn import routing as routing_math
from deltares.nn.axes import check_axis_names, use_axis_names
from deltares.nn.config import BLOCK_MODES, MODES, Mode
from deltares.nn.depth import DepthState, add_delta, depth_scan, init_depth_state, stack_output, sublayer_input
from deltares.nn.layers import DepthRouter, apply_router, init_router_params
from deltares.nn.residual import ResidualPlan, make_plan

SUBLAYERS_PER_LAYER = 2  # attention, then MLP


@dataclasses.dataclass(frozen=True)
class DepthRouting:
    """The residual scheme of a stack of `n_layers` layers (no parameters: those live in the
    routers). `epsilon` is the key norm's (config.model.norm_eps). `axis_names`: your logical
    axis names for the roles `batch`, `length`, `embed`, `sources` of the stream and the source
    buffer (deltares.nn.axes; default deltares' own names and rules)."""

    mode: Mode
    n_layers: int
    block_layers: int = 1
    include_partial: bool = True
    epsilon: float = routing_math.NORM_EPS
    axis_names: Any = None

    plan: ResidualPlan = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown residual mode {self.mode!r}; allowed: {', '.join(MODES)}")
        check_axis_names(self.axis_names)
        if self.axis_names is not None:  # hashable, as a module attribute must be
            object.__setattr__(self, "axis_names", tuple(sorted(dict(self.axis_names).items())))
        if not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise ValueError(f"n_layers={self.n_layers!r} must be a positive integer")
        if not isinstance(self.block_layers, int) or not 1 <= self.block_layers <= self.n_layers:
            raise ValueError(f"block_layers={self.block_layers!r} must be an integer in [1, n_layers={self.n_layers}]")
        if self.block_layers != 1 and self.mode not in BLOCK_MODES:
            raise ValueError(f"block_layers={self.block_layers} means nothing in mode {self.mode!r}: only the block "
                             f"modes ({', '.join(BLOCK_MODES)}) have blocks; leave it at 1")
        object.__setattr__(self, "plan", make_plan(self.mode, self.n_layers, self.block_layers, self.include_partial))

    @classmethod
    def from_config(cls, model_cfg) -> DepthRouting:
        """The routing of a deltares `config.model`."""
        res = model_cfg.residual
        block_layers = res.block_layers if res.mode in BLOCK_MODES else 1  # one field for every mode of an experiment
        return cls(res.mode, model_cfg.n_layers, block_layers, res.include_partial, model_cfg.norm_eps)

    @property
    def uses_routers(self) -> bool:
        """False in baseline: no router is called and none needs parameters."""
        return self.plan.uses_sources

    @property
    def uses_final_router(self) -> bool:
        """The Kimi modes route the stack's output with one more router."""
        return self.plan.replaces_stream

    def names(self):
        """The context of this routing's axis names (deltares.nn.axes.use_axis_names)."""
        return use_axis_names(dict(self.axis_names) if self.axis_names else None)

    def _check_index(self, j) -> None:
        if isinstance(j, int) and not 0 <= j < SUBLAYERS_PER_LAYER * self.n_layers:
            raise ValueError(f"sublayer index {j} is out of range: {self.n_layers} layers have sublayers 0 .. "
                             f"{SUBLAYERS_PER_LAYER * self.n_layers - 1}")

    def start(self, e_BTD) -> DepthState:
        """The depth state before sublayer 0: stream e, and e in source slot 0."""
        with self.names():
            return init_depth_state(e_BTD, self.plan, self.epsilon)

    def input(self, state: DepthState, j, router=None, *, return_weights: bool = False, final: bool = False):
        """Sublayer j's input x_j [B, T, D]; with `return_weights` also (weights [S, B, T] or None).
        `router` is called in every mode but baseline (even where j has one source, so every
        sublayer has parameters, as in deltares' Transformer). `final`: `state` holds the final
        source buffer (a store-once backward pass, `layer(only=)`)."""
        if self.uses_routers and router is None:
            raise ValueError(f"mode {self.mode!r} routes sublayer inputs: pass a router")
        self._check_index(j)
        router = self._callable(router)
        with self.names():
            x_BTD, weights_SBT, _ = sublayer_input(self.plan, state, j, router, _has_null(router), self.epsilon, final)
        return (x_BTD, weights_SBT) if return_weights else x_BTD

    def add(self, state: DepthState, j, v_BTD) -> DepthState:
        """Adds sublayer j's delta v_j to the stream and to its source slot."""
        self._check_index(j)
        with self.names():
            return add_delta(self.plan, state, j, v_BTD.astype(state.h_BTD.dtype), self.epsilon)

    def output(self, state: DepthState, final_router=None):
        """The stack's output before the final norm (Kimi modes: routed with `final_router`)."""
        with self.names():
            return stack_output(self.plan, state, self._callable(final_router) if self.uses_final_router else None)

    def layer(self, state: DepthState, layer, sublayers: Sequence[tuple[Any, Callable]], only=None):
        """Layer `layer` (may be traced): `sublayers` = [(router, f)] for attention and MLP, f(x) -> delta.
        Returns (state, None), or with `only` = k sublayer k's (delta, its 1/rms) without writing
        (the protocol of deltares.nn.depth.depth_scan)."""
        if len(sublayers) != SUBLAYERS_PER_LAYER:
            raise ValueError(f"a layer has {SUBLAYERS_PER_LAYER} sublayers (attention, MLP), got {len(sublayers)}")
        def delta(k, state, final=False):
            router, fn = sublayers[k]
            x_BTD = self.input(state, SUBLAYERS_PER_LAYER * layer + k, router, final=final)
            return fn(x_BTD).astype(state.h_BTD.dtype)

        if only is not None:  # sublayer `only` alone on `state` (holding the final buffer)
            v_BTD = delta(only, state, final=True)
            return v_BTD, routing_math.inv_rms(v_BTD, self.epsilon)
        for k in range(SUBLAYERS_PER_LAYER):
            state = self.add(state, SUBLAYERS_PER_LAYER * layer + k, delta(k, state))
        return state, None

    def stack(self, sublayers_of: Callable, params_L, e_BTD, *, store_once: bool = True, remat: bool = True):
        """All L layers as one scan over `params_L` (a pytree stacked on a leading L axis);
        `sublayers_of(params_l)` returns that layer's [(router, f)] (see `layer`). Returns the
        final DepthState (then `output`). `store_once` (routed modes) runs deltares.nn.depth.depth_scan,
        whose backward pass keeps one source buffer instead of one per layer; otherwise plain AD of
        a scan, each layer rematerialised with `remat`."""

        def layer_fn(params_l, state, layer, only=None):
            return self.layer(state, layer, sublayers_of(params_l), only=only)

        state = self.start(e_BTD)
        if store_once and self.uses_routers:
            with self.names():
                return depth_scan(layer_fn, params_L, state, self.plan, eps=self.epsilon)[0]
        step = jax.checkpoint(layer_fn) if remat else layer_fn

        def body(state, xs):
            return step(xs[0], state, xs[1])

        return jax.lax.scan(body, state, (params_L, jnp.arange(self.n_layers)))[0]

    def _callable(self, router):
        """A router as a callable: parameter dicts go through apply_router with this epsilon."""
        if isinstance(router, Mapping):
            return _ParamRouter(router, self.epsilon)
        return router


@dataclasses.dataclass(frozen=True)
class _ParamRouter:
    params: Mapping
    epsilon: float

    def __call__(self, sources_SBTD, inv_rms_SBT, valid, residual_BTD=None, prefix=None):
        return apply_router(self.params, sources_SBTD, inv_rms_SBT, valid, residual_BTD, eps=self.epsilon, prefix=prefix)


def _has_null(router) -> bool:
    """Whether a router has a null source: linen's flag, or NNX's / a dict's parameter."""
    if isinstance(router, _ParamRouter) or hasattr(router, "param_names"):
        return "null_source" in (router.params if isinstance(router, _ParamRouter) else router.param_names)
    return bool(getattr(router, "null_source", False))


__all__ = ["DepthRouter", "DepthRouting", "DepthState", "apply_router", "init_router_params"]
