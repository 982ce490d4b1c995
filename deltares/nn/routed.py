"""Depth routing in your own model: any of the five residual modes around your own sublayers.

deltares supplies each sublayer's routed input, the source bookkeeping (buffer, validity,
cached 1/rms, slot writes) and, when asked, the store-once depth pass; you supply the
sublayers (attention, MLP: anything mapping [B, T, D] to a delta [B, T, D], pre-norm included)
and one router per sublayer (linen `deltares.nn.layers.DepthRouter`, NNX
`deltares.nn.nnx.DepthRouter`, or a parameter dict for `apply_router`). Sublayers are numbered
j = 0 .. J-1 in depth order: with two sublayers a layer (the default), j = 2l is the attention of
layer l and j = 2l+1 its MLP, as in docs/explanations/modes.md; `DepthRouting(sublayers=3)` (a
decoder layer with cross-attention) or a count per layer numbers them in the same way.

    routing = DepthRouting("delta_block", n_layers=L, block_layers=2)
    state = routing.start(e_BTD)
    for j in range(2 * L):
        x_BTD = routing.input(state, j, routers[j])
        state = routing.add(state, j, sublayer[j](x_BTD))
    out_BTD = routing.output(state, final_router)   # final_router: Kimi modes only

Or, for a stack of identical layers with stacked parameters, `routing.stack(...)`: a scan
whose backward pass stores each source once (deltares.nn.depth.depth_scan).
`DepthRouting.layer` is the code deltares' own DecoderLayer runs, and the Transformer stacks its layers
with deltares.nn.stack.stack_layers, as `DepthStack` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deltares.nn import mixing
from deltares.nn import routing as routing_math
from deltares.nn.axes import SOURCES_AXES, STREAM_AXES, check_axis_names, constrain, use_axis_names
from deltares.common.domains import AT_LEAST_1
from deltares.nn.config import (
    BLOCK_MODES, HYPER_MODES, MIXING_MODES, MODES, SINKHORN_ITERATIONS, STREAMS, Mode, has_router,
)
from deltares.nn.depth import (
    DepthState, Outputs, Prefix, select, add_delta, depth_scan, init_depth_state, stack_output, sublayer_input,
    sublayer_prefix,
)
from deltares.nn.layers import DepthRouter, apply_router, init_router_params
from deltares.nn.residual import ResidualPlan, make_plan, row


@dataclasses.dataclass(frozen=True)
class DepthRouting:
    """The residual scheme of a stack of `n_layers` layers, for a layer loop of your own: which
    sources each sublayer routes over, its input, and where its delta goes (no parameters: those
    live in the routers). Sublayers are numbered j = 0 .. J-1 in depth order.

    Args:
        mode: the residual scheme (deltares.nn.MODES).
        n_layers: L.
        block_layers: layers per block of the block modes (1 in the others); the last block may be shorter.
        include_partial: block modes, whether a sublayer routes over its block's partial sum.
        epsilon: the routers' key-norm epsilon (config.model.norm_eps).
        axis_names: your logical axis names for the roles `batch`, `length`, `embed`, `sources` of
            the stream and the source buffer (deltares.nn.axes; default deltares' own names and rules).
        group_layers: units per two-phase routing group of the store-once pass (`stack`).
        scan_segments: segments of the store-once pass (the same math).
        sublayers: the sublayers of every layer (2: attention, MLP), or one count per layer.
        unit_layers: the layers a scanned stack runs as one unit (a layer pattern's length).
        streams: `hyper`, `mhc`: the parallel residual streams R.
        dynamic: `hyper`: input-dependent weights beside the static ones.
        sinkhorn_iterations: `mhc`: Sinkhorn-Knopp iterations.
        dilation: `denseformer`: layer l averages the outputs X_j with l - j a multiple of this.
        period: `denseformer`: only every period-th layer averages.

    In `hyper` and `mhc` the state holds R streams and each sublayer's router is its
    `deltares.nn.mixing.HyperConnection` (NNX: `deltares.nn.nnx.HyperConnection`), passed to `add` as
    well; in `denseformer` the router of each layer's last sublayer is its
    `deltares.nn.mixing.DepthWeights` (NNX: `deltares.nn.nnx.DepthWeights`), passed to `add`, the
    others None.

    Example:
        ```python
        import flax.linen as nn
        import jax
        from deltares.nn import DepthRouter, DepthRouting


        class Stack(nn.Module):  # a decoder of three sublayers a layer, written as a loop
            n_layers: int = 3

            @nn.compact
            def __call__(self, e_BTD, memory_BMD):
                routing = DepthRouting("delta_block", self.n_layers, block_layers=2, sublayers=3)
                state = routing.start(e_BTD)                         # stream h = e, source slot 0 = e
                for j in range(3 * self.n_layers):                   # self-attention, cross-attention, MLP
                    x_BTD = routing.input(state, j, DepthRouter(name=f"router_{j}"))  # h_j + route(S_j)
                    y_BTD = nn.RMSNorm()(x_BTD)
                    if j % 3 == 1:                                   # cross-attention reads the memory
                        y_BTD = nn.MultiHeadDotProductAttention(2)(y_BTD, memory_BMD)
                    state = routing.add(state, j, nn.Dense(x_BTD.shape[-1])(y_BTD))
                return routing.output(state)                         # h_J (the Kimi modes: routed)


        e_BTD, memory_BMD = jax.numpy.ones((2, 5, 8)), jax.numpy.ones((2, 3, 8))
        variables = Stack().init(jax.random.key(0), e_BTD, memory_BMD)
        print(Stack().apply(variables, e_BTD, memory_BMD).shape)  # (2, 5, 8)
        ```
    """

    mode: Mode
    n_layers: int
    block_layers: int = 1
    include_partial: bool = True
    epsilon: float = routing_math.NORM_EPS
    axis_names: Any = None
    group_layers: int = 1
    scan_segments: int = 1
    sublayers: Any = 2
    unit_layers: int = 1
    streams: int = 4
    dynamic: bool = True
    sinkhorn_iterations: int = 20
    dilation: int = 1
    period: int = 1

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
        counts = self.sublayers
        if isinstance(counts, int) and not isinstance(counts, bool):
            counts = (counts,) * self.n_layers
        if (not isinstance(counts, (tuple, list)) or len(counts) != self.n_layers
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts)):
            raise ValueError(f"sublayers={self.sublayers!r} must be a positive integer (the sublayers of every layer) or "
                             f"one per layer ({self.n_layers})")
        object.__setattr__(self, "sublayers", counts[0] if len(set(counts)) == 1 else tuple(counts))
        if not isinstance(self.unit_layers, int) or not 1 <= self.unit_layers <= self.n_layers:
            raise ValueError(f"unit_layers={self.unit_layers!r} must be an integer in [1, n_layers={self.n_layers}]")
        for name, domain in (("streams", STREAMS), ("sinkhorn_iterations", SINKHORN_ITERATIONS),
                             ("dilation", AT_LEAST_1), ("period", AT_LEAST_1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or domain.problem(value):
                raise ValueError(f"{name}={value!r} must be an integer {domain}")
        beyond = {"dilation": "each layer averages only its own output", "period": "no layer averages"}
        for name, meaning in beyond.items():  # DenseFormer's spacings: beyond the depth they mean nothing
            if self.mode == "denseformer" and getattr(self, name) > self.n_layers:
                raise ValueError(f"{name}={getattr(self, name)} must be an integer in [1, n_layers={self.n_layers}]: "
                                 f"beyond the depth {meaning}")
        object.__setattr__(self, "plan", make_plan(self.mode, self.n_layers, self.block_layers, self.include_partial,
                                                   self.group_layers, self.scan_segments, tuple(counts),
                                                   self.unit_layers, self.streams, self.dilation, self.period))

    @classmethod
    def from_config(cls, model_cfg) -> DepthRouting:
        """The routing of a deltares `config.model`: its mode, depth, block size, key-norm epsilon and
        store-once settings.

        Args:
            model_cfg: a `config.model` (`model_config`).
        """
        res = model_cfg.residual
        block_layers = res.block_layers if res.mode in BLOCK_MODES else 1  # one field for every mode of an experiment
        return cls(res.mode, model_cfg.n_layers, block_layers, res.include_partial, model_cfg.norm_eps,
                   group_layers=max(1, res.group_layers), scan_segments=res.scan_segments, streams=res.streams,
                   dynamic=res.dynamic, sinkhorn_iterations=res.sinkhorn_iterations, dilation=res.dilation,
                   period=res.period)

    @property
    def uses_routers(self) -> bool:
        """False in baseline: no router is called and none needs parameters."""
        return self.plan.uses_sources

    @property
    def mixes(self) -> bool:
        """The other depth-mixing families (`hyper`, `mhc`, `denseformer`): their routers are mixers."""
        return self.mode in MIXING_MODES

    def linen_router(self, k: int, n: int, name: str, **router_kw):
        """A sublayer's router as a linen module, or None where it has none (deltares.nn.config.has_router):
        a `DepthRouter`, or the mixing modes' `HyperConnection` or `DepthWeights`.

        Args:
            k: the sublayer's position in its layer.
            n: the layer's sublayers.
            name: the module's name.
            **router_kw: a `DepthRouter`'s other fields (gate, null_source, impl, interpret, dtype,
                param_dtype, query_init, gain_init); the mixers take `param_dtype` only.
        """
        if not has_router(self.mode, k, n):
            return None
        if self.mode in HYPER_MODES:
            return mixing.HyperConnection(self.streams, self.mode == "mhc", self.dynamic, self.sinkhorn_iterations,
                                          self.epsilon, router_kw.get("param_dtype", jnp.float32), name=name)
        if self.mixes:
            return mixing.DepthWeights(self.plan.n_slots, router_kw.get("param_dtype", jnp.float32), name=name)
        return DepthRouter(epsilon=self.epsilon, name=name, **router_kw)

    @property
    def uses_final_router(self) -> bool:
        """The Kimi modes route the stack's output with one more router."""
        return self.plan.replaces_stream

    def names(self):
        """The context of this routing's axis names (deltares.nn.axes.use_axis_names)."""
        return use_axis_names(dict(self.axis_names) if self.axis_names else None)

    def _check_index(self, j) -> None:
        if isinstance(j, int) and not 0 <= j < self.plan.n_sublayers:
            raise ValueError(f"sublayer index {j} is out of range: {self.n_layers} layers have sublayers 0 .. "
                             f"{self.plan.n_sublayers - 1}")

    def start(self, e_BTD) -> DepthState:
        """The depth state before sublayer 0: stream e, and e in source slot 0.

        Args:
            e_BTD: the embeddings [B, T, D].
        """
        with self.names():
            return init_depth_state(e_BTD, self.plan, self.epsilon)

    def input(self, state: DepthState, j, router=None, *, return_weights: bool = False, final: bool = False):
        """Sublayer j's input x_j [B, T, D]: h_j + route(S_j) in the Delta modes, route(S_j) in the
        Kimi modes, h_j in baseline.

        Args:
            state: the depth state (`start`, then `add`).
            j: the sublayer's index (an int, or traced in a scanned loop).
            router: its router (a linen `DepthRouter`, an NNX `deltares.nn.nnx.DepthRouter`, or a
                parameter dict `{"query": [D], "gain": [D]}`); called in every mode but baseline, even
                where j has one source, so that every sublayer has parameters.
            return_weights: also return the routing weights [S, B, T] (None in baseline or from a kernel).
            final: `state` holds the final source buffer (a store-once backward pass, `layer(only=)`).
        """
        x_BTD, weights_SBT, _, _ = self._input(state, j, router, final)
        return (x_BTD, weights_SBT) if return_weights else x_BTD

    def _input(self, state: DepthState, j, router, final: bool = False, prefix: Prefix | None = None):
        """(x_j, weights or None, whether j routes, the state with the sources a kernel passed through):
        `sublayer_input` under this routing's names."""
        self._check_index(j)
        if self.mode in HYPER_MODES:
            return self._mixer(router, j)(state.streams_RBTD, j), None, jnp.asarray(True), state
        if self.mixes:  # denseformer: the stream, averaged after each layer (`add`)
            return state.h_BTD, None, jnp.asarray(False), state
        if self.uses_routers and router is None:
            raise ValueError(f"mode {self.mode!r} routes sublayer inputs: pass a router")
        router = self._callable(router)
        with self.names():
            return sublayer_input(self.plan, state, j, router, _has_null(router), self.epsilon, final, prefix)

    def add(self, state: DepthState, j, v_BTD, router=None) -> DepthState:
        """The depth state after sublayer j: its delta added to the stream and to its source slot.

        Args:
            state: the depth state before sublayer j.
            j: the sublayer's index.
            v_BTD: its delta [B, T, D] (ValueError for another shape).
            router: the mixing modes' mixer of sublayer j (`hyper`, `mhc`: every sublayer's, which writes
                the delta into the streams; `denseformer`: the layer's last sublayer's, which averages
                the layer outputs; j must then be an int). The routing modes take none.
        """
        self._check_index(j)
        stream = state.h_BTD if state.streams_RBTD is None else state.streams_RBTD[0]
        if jnp.shape(v_BTD) != jnp.shape(stream):
            which = f"sublayer {j}" if isinstance(j, int) else "a sublayer of a scanned layer"
            raise ValueError(f"{which} returned a delta of shape {jnp.shape(v_BTD)}; the stream is "
                             f"{jnp.shape(stream)} [B, T, D]: a sublayer maps [B, T, D] to [B, T, D]")
        v_BTD = v_BTD.astype(stream.dtype)
        with self.names():
            if self.mode in HYPER_MODES:
                return state._replace(streams_RBTD=self._mixer(router, j)(state.streams_RBTD, j, v_BTD))
            if self.mixes:
                if not isinstance(j, int):
                    raise TypeError("denseformer's add needs a Python int sublayer index; a scanned layer runs "
                                    "through DepthRouting.layer")
                layer = int(np.searchsorted(self.plan.layer_first, j, side="right")) - 1
                return self._average(state, v_BTD, layer, self.plan.layer_last[j], router)
            return add_delta(self.plan, state, j, v_BTD, self.epsilon)

    def _mixer(self, router, j):
        if router is None:
            which = f"sublayer {j}" if isinstance(j, int) else "each sublayer"
            raise ValueError(f"mode {self.mode!r} mixes the streams through {which}'s hyper-connection: pass it as "
                             f"the router")
        return router

    def _average(self, state: DepthState, v_BTD, layer, closes: bool, router=None, stats: bool = False):
        """denseformer: the stream plus the delta; where the sublayer `closes` its layer, the layer's
        output X_(layer+1) = that stream goes into its slot and, in the averaging layers, the stream
        becomes the depth-weighted average of the outputs (`router`: the layer's DepthWeights).
        `layer` may be traced (a scanned layer). Returns the state, with `stats` (state, statistics)."""
        h_BTD = constrain(state.h_BTD + v_BTD, STREAM_AXES)
        if not closes:
            return DepthState(h_BTD, state.sources_SBTD, None)
        if router is None:
            raise ValueError(f"mode 'denseformer' averages after each layer: pass layer {layer}'s last sublayer's "
                             f"router (DepthWeights)")
        valid_LS, applies_L = mixing.dwa_tables(self.n_layers, self.dilation, self.period)
        if isinstance(state.sources_SBTD, tuple):  # unrolled: layer is known
            sources = state.sources_SBTD + (h_BTD,)
            averaged = router(sources, layer, valid_LS[layer][: len(sources)])
            out = DepthState(averaged if applies_L[layer] else h_BTD, sources, None)
        else:
            sources = constrain(state.sources_SBTD.at[layer + 1].set(h_BTD), SOURCES_AXES)
            averaged = router(sources, layer, row(valid_LS, layer))
            out = DepthState(select(row(applies_L, layer), averaged, h_BTD), sources, None)
        if not stats:
            return out
        applies = jnp.asarray(row(applies_L, layer), jnp.float32)  # a layer that does not average: zeros
        return out, jax.tree.map(lambda a: a * applies, router(sources, layer, row(valid_LS, layer), stats=True))

    def output(self, state: DepthState, final_router=None):
        """The stack's output [B, T, D] before your final norm.

        Args:
            state: the depth state after the last sublayer.
            final_router: the Kimi modes' router of the output (a router as in `input`), which routes
                over every source; the other modes return the stream.
        """
        with self.names():
            return stack_output(self.plan, state, self._callable(final_router) if self.uses_final_router else None)

    def layer(self, state: DepthState, layer, sublayers: Sequence[tuple], only=None, prefix: Prefix | None = None,
              stats: bool = False, first=None):
        """Runs one layer's sublayers on the depth state: each routed input, its sublayer, its delta added.

        Args:
            state: the depth state before the layer.
            layer: the layer's index (may be traced where every layer has as many sublayers).
            sublayers: [(router, f)] or [(router, f, hook)] of its sublayers in depth order. `f(x)` returns
                the sublayer's delta [B, T, D], or a pair (delta, output). `hook(h)` (optional) maps the
                stream after the delta is added to the stream the next sublayer sees; the sublayer's
                source slot then holds hook(h + v) - h, so routing reads what the stream holds.
            only: k: sublayer k alone on `state` (holding the final buffer: a store-once backward
                pass, deltares.nn.depth.depth_scan's protocol), writing nothing.
            prefix: the layer's two-phase routing `Prefix` (depth_scan with `queries_fn`).
            stats: also return each sublayer's routing statistics (`routing_stats`).
            first: the layer's first sublayer index (default: its index in the plan).

        Returns:
            (state, None); with `stats` (state, the statistics stacked on a leading axis of the layer's
            sublayers); where any sublayer returned an output (state, `depth.Outputs(outputs, stats)`), one
            output (or None) per sublayer, differentiated; with `only` the sublayer's (delta, its 1/rms[,
            output]).
        """
        n = len(sublayers)
        if first is None:
            if isinstance(layer, int):
                if not 0 <= layer < self.n_layers:
                    raise ValueError(f"layer index {layer} is out of range: {self.n_layers} layers")
                if self.plan.layer_sublayers[layer] != n:
                    raise ValueError(f"layer {layer} has {self.plan.layer_sublayers[layer]} sublayers, got {n}")
                if len(set(self.plan.layer_sublayers)) > 1:
                    first = int(self.plan.layer_first[layer])
            elif set(self.plan.layer_sublayers) != {n}:
                raise ValueError(f"a scanned layer of {n} sublayers in a stack whose layers have "
                                 f"{sorted(set(self.plan.layer_sublayers))}: pass the layer's first sublayer (`first=`)")
        if prefix is not None and stats:
            raise ValueError("routing statistics need the whole weights: call without a prefix")

        def index(k):
            return (n * layer if first is None else first) + k

        if self.mixes:
            if only is not None or prefix is not None:
                raise ValueError(f"mode {self.mode!r} has no store-once pass nor two-phase routing (only=, prefix=)")
            return self._mixed_layer(state, sublayers, index, stats)

        def delta(k, state, final=False):
            router, fn, hook = (tuple(sublayers[k]) + (None,))[:3]
            x_BTD, weights_SBT, routed, state = self._input(state, index(k), router, final,
                                                            sublayer_prefix(prefix, k))
            stats_k = None
            if stats:
                stats_k = routing_stats(weights_SBT, routed) if self.uses_routers else empty_stats(self.plan.n_slots)
            out, output = _split_output(fn(x_BTD))
            v_BTD = out.astype(state.h_BTD.dtype)
            if hook is not None:  # the stream the next sublayer sees: its slot holds what was added
                v_BTD = hook(state.h_BTD + v_BTD).astype(state.h_BTD.dtype) - state.h_BTD
            return v_BTD, stats_k, output, state

        if only is not None:  # sublayer `only` alone on `state` (holding the final buffer)
            v_BTD, _, output, _ = delta(only, state, final=True)
            inv_BT = routing_math.inv_rms(v_BTD, self.epsilon)
            return (v_BTD, inv_BT) if output is None else (v_BTD, inv_BT, output)
        per_sublayer, outputs = [], []
        for k in range(n):
            v_BTD, stats_k, output, state = delta(k, state)  # the state with any sources the router passed through
            state = self.add(state, index(k), v_BTD)
            per_sublayer.append(stats_k)
            outputs.append(output)
        return state, _layer_outs(per_sublayer, outputs, stats)

    def _mixed_layer(self, state: DepthState, sublayers: Sequence[tuple], index, stats: bool):
        """`layer` in the mixing modes: each sublayer's input read from the streams (hyper, mhc) or the
        stream (denseformer), its delta written back, and in denseformer the layer's average after its
        last sublayer."""
        n, plan = len(sublayers), self.plan
        per_sublayer, outputs = [], []
        j0 = index(0)
        layer = (int(np.searchsorted(plan.layer_first, j0, side="right")) - 1 if isinstance(j0, int) else
                 jnp.searchsorted(jnp.asarray(plan.layer_first), j0, side="right") - 1)
        for k in range(n):
            router, fn, hook = (tuple(sublayers[k]) + (None,))[:3]
            j = index(k)
            stats_k = empty_stats(plan.n_slots) if stats else None
            with self.names():
                if self.mode in HYPER_MODES:
                    if hook is not None:
                        raise ValueError(f"mode {self.mode!r} carries {self.streams} streams: stream hooks are not "
                                         f"available")
                    mixer, H_RBTD = self._mixer(router, j), state.streams_RBTD
                    if stats:
                        stats_k = mixer(H_RBTD, j, stats=True)
                    out, output = _split_output(fn(mixer(H_RBTD, j)))
                    state = state._replace(streams_RBTD=mixer(H_RBTD, j, out.astype(H_RBTD.dtype)))
                else:
                    out, output = _split_output(fn(state.h_BTD))
                    v_BTD = out.astype(state.h_BTD.dtype)
                    if hook is not None:
                        v_BTD = hook(state.h_BTD + v_BTD).astype(state.h_BTD.dtype) - state.h_BTD
                    closes = k == n - 1
                    state = self._average(state, v_BTD, layer, closes, router, stats and closes)
                    if stats and closes:
                        state, stats_k = state
            per_sublayer.append(stats_k)
            outputs.append(output)
        return state, _layer_outs(per_sublayer, outputs, stats)

    def stack(self, sublayers_of: Callable, params_L, e_BTD, *, store_once: bool = True, remat: bool = True):
        """All L identical layers as one scan, differentiable; returns the final depth state (then `output`).

        Args:
            sublayers_of: `sublayers_of(params_l)` returns layer l's [(router, f)] (see `layer`).
            params_L: the layers' parameters, a pytree stacked on a leading axis [L, ...].
            e_BTD: the embeddings [B, T, D].
            store_once: in the routed modes, run deltares.nn.depth.depth_scan, whose backward pass keeps
                one source buffer instead of one per layer; otherwise plain autodiff of the scan.
            remat: with plain autodiff, recompute each layer in the backward pass.
        """

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


def _layer_outs(per_sublayer: list, outputs: list, stats: bool):
    """What `DepthRouting.layer` returns beside the state: the statistics stacked per sublayer (or None),
    in `Outputs` with the sublayers' outputs where any returned one."""
    stats_out = jax.tree.map(lambda *a: jnp.stack(a), *per_sublayer) if stats else None
    if any(o is not None for o in outputs):
        return Outputs(tuple(outputs), stats_out)
    return stats_out


def _split_output(out):
    """A sublayer's result as (delta, output or None)."""
    return out if isinstance(out, tuple) and len(out) == 2 else (out, None)


def routing_stats(weights_SBT, routed):
    """Mean weight per slot [S], mean max weight and mean entropy; zeros when not routed.
    Diagnostics only: no gradient flows through them."""
    weights_SBT = jax.lax.stop_gradient(weights_SBT)
    scale = routed.astype(jnp.float32)
    entropy_BT = -jnp.sum(weights_SBT * jnp.log(jnp.where(weights_SBT > 0, weights_SBT, 1.0)), axis=0)
    return dict(
        weights=weights_SBT.mean(axis=(1, 2)) * scale,
        max_weight=weights_SBT.max(axis=0).mean() * scale,
        entropy=entropy_BT.mean() * scale,
    )


def sublayer_stats(stats_L2, plan: ResidualPlan, tail=None):
    """The routing statistics of a stack's units (`layer(stats=True)` stacked, leading axes [units, P]; a
    remainder unit's `tail`, leading axis its sublayers) per sublayer, leading axis J, with `n_sources`
    [J]: what the models return and sow (STATS_COLLECTION)."""
    out = {k: v.reshape((plan.n_units * plan.unit_size,) + v.shape[2:]) for k, v in stats_L2.items()}
    if tail is not None:
        out = {k: jnp.concatenate([v, tail[k]]) for k, v in out.items()}
    out["n_sources"] = jnp.asarray(plan.n_sources)
    return out


STATS_COLLECTION = "routing"  # models sow their routing statistics as variables["routing"]["stats"]


def wants_stats(module) -> bool:
    """Whether a linen module's call should sow routing statistics: its STATS_COLLECTION is mutable
    (`apply(..., mutable=["routing"])`), outside initialisation."""
    return module.is_mutable_collection(STATS_COLLECTION) and not module.is_initializing()


def empty_stats(n_slots: int):
    """`routing_stats` of a sublayer that does not route (baseline)."""
    return dict(weights=jnp.zeros((n_slots,), jnp.float32), max_weight=jnp.float32(0), entropy=jnp.float32(0))


def _has_null(router) -> bool:
    """Whether a router has a null source: linen's flag, or NNX's / a dict's parameter."""
    if isinstance(router, _ParamRouter) or hasattr(router, "param_names"):
        return "null_source" in (router.params if isinstance(router, _ParamRouter) else router.param_names)
    return bool(getattr(router, "null_source", False))


__all__ = ["DepthRouter", "DepthRouting", "DepthState", "Outputs", "apply_router", "init_router_params"]
