"""Qwen3 building blocks as Flax linen modules, with logical axis names on every parameter.

Logical names: `vocab, embed, heads, kv, head_dim, mlp, norm, layers`. Sharding
maps them onto mesh axes through one rules table; here they are only labels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from deltares.nn import routing
from deltares.nn.attention import causal_attention
from deltares.nn.axes import SOURCES_AXES, explicit_mesh, shard_spec, type_spec
from kernels_pallas.depth_route.api import implementation_for

P = jax.sharding.PartitionSpec

Dtype = Any
dense_init = nn.initializers.normal(stddev=0.02)


def _param_init(init, names):
    """`init` boxed with logical axis `names`; under Explicit mesh axes the value is made with the
    sharding the rules in context give those names (flax's unboxing then asserts that sharding)."""
    def placed(key, shape, dtype=jnp.float32):
        value = init(key, shape, dtype)
        if explicit_mesh() is not None:
            value = jax.sharding.reshard(value, nn.logical_to_mesh_axes(names))
        return value

    return nn.with_logical_partitioning(placed, names)


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in float32, returned in `dtype`."""

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", _param_init(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


class Rope(NamedTuple):
    """Where each token sits: the rotary tables, and with document masks its document.

    `cos`, `sin` are [T, head_dim] (one position per column, shared by the rows) or [B, T, head_dim]
    (positions restarting at every document: `config.data.document_mask`); `segments` [B, T] (or None)
    numbers the documents of each row, and attention then stays inside a document."""

    cos: jax.Array
    sin: jax.Array
    segments: jax.Array | None = None


def rope_tables(positions, head_dim: int, theta: float):
    """cos and sin [..., head_dim] of Qwen3's rotary embedding (rotate-half layout) at `positions` [...]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def document_rope(segments_BT, head_dim: int, theta: float) -> Rope:
    """The `Rope` of rows holding several documents (`segments_BT` numbers them, nondecreasing along
    each row): positions restart at 0 at every document."""
    T = segments_BT.shape[1]
    index_BT = jnp.broadcast_to(jnp.arange(T), segments_BT.shape)
    starts_BT = jax.lax.cummax(jnp.where(jnp.diff(segments_BT, axis=1, prepend=segments_BT[:, :1] - 1) != 0,
                                         index_BT, 0), axis=1)
    cos, sin = rope_tables(index_BT - starts_BT, head_dim, theta)
    return Rope(cos, sin, segments_BT)


def apply_rope(x_BTHE, cos, sin):
    """`x` rotated by the tables of `rope_tables`: [T, E] shared by the rows, or [B, T, E] per row."""
    x32 = x_BTHE.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    cos, sin = (t[None, :, None, :] if t.ndim == 2 else t[:, :, None, :] for t in (cos, sin))
    out = x32 * cos + rotated * sin
    return out.astype(x_BTHE.dtype)


class Projection(nn.Module):
    """y = einsum(spec, x, kernel) with a kernel of `shape` and logical `names`, no bias.
    (flax's DenseGeneral initialises a flattened kernel, which clashes with 3-axis names.)"""

    spec: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        # setup, not compact: a parent can read `kernel` without applying the projection
        # (the chunked loss multiplies by the LM head's kernel itself)
        self.kernel = self.param("kernel", _param_init(dense_init, self.names), self.shape, self.param_dtype)

    def __call__(self, x):
        return jnp.einsum(self.spec, x.astype(self.dtype), self.kernel.astype(self.dtype))


class Attention(nn.Module):
    """Causal grouped-query attention with per-head q/k RMSNorm and rotary embeddings."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    impl: str = "auto"  # deltares.nn.attention.ATTENTION_IMPLS (generation with a cache: always xla)
    interpret: bool = False  # impl "splash" in the Pallas interpreter (CPU tests)

    @nn.compact
    def __call__(self, x_BTD, rope: Rope, cache=None, pos=None):
        """With `cache` = (k_BCKE, v_BCKE) of earlier positions, the T tokens of `x_BTD` sit at
        positions pos..pos+T-1: their keys and values are written into the cache and they attend
        to everything up to themselves. With `rope.segments` a token attends only to the earlier
        tokens of its own document. Returns the output, and the new cache when given one."""
        D = x_BTD.shape[-1]
        common = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        def proj(name, heads, names):
            return Projection("btd,dhe->bthe", (D, heads, self.head_dim), names, name=name, **common)

        q_BTHE = proj("q_proj", self.n_heads, ("embed", "heads", "head_dim"))(x_BTD)
        k_BTKE = proj("k_proj", self.n_kv_heads, ("embed", "kv", "head_dim"))(x_BTD)
        v_BTKE = proj("v_proj", self.n_kv_heads, ("embed", "kv", "head_dim"))(x_BTD)
        norm = dict(epsilon=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        q_BTHE = apply_rope(RMSNorm(name="q_norm", **norm)(q_BTHE), rope.cos, rope.sin)
        k_BTKE = apply_rope(RMSNorm(name="k_norm", **norm)(k_BTKE), rope.cos, rope.sin)
        q_BTHE = nn.with_logical_constraint(q_BTHE, ("batch", "length", "heads", "head_dim"))
        if cache is None:
            out_BTHE = causal_attention(q_BTHE, k_BTKE, v_BTKE, rope.segments, impl=self.impl,
                                        interpret=self.interpret)
        else:
            k_BCKE, v_BCKE = (jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (0, pos, 0, 0))
                              for c, x in zip(cache, (k_BTKE, v_BTKE)))
            cache = (k_BCKE, v_BCKE)
            T, C = x_BTD.shape[1], k_BCKE.shape[1]
            mask_TC = jnp.arange(C)[None, :] <= pos + jnp.arange(T)[:, None]
            out_BTHE = jax.nn.dot_product_attention(q_BTHE, k_BCKE.astype(self.dtype), v_BCKE.astype(self.dtype),
                                                    mask=mask_TC[None, None])
        o_shape = (self.n_heads, self.head_dim, D)
        out_BTD = Projection("bthe,hed->btd", o_shape, ("heads", "head_dim", "embed"), name="o_proj", **common)(out_BTHE)
        return out_BTD if cache is None else (out_BTD, cache)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    d_ff: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        D = x_BTD.shape[-1]
        common = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=False)
        up_init = _param_init(dense_init, ("embed", "mlp"))
        gate_BTF = nn.Dense(self.d_ff, kernel_init=up_init, name="gate_proj", **common)(x_BTD)
        up_BTF = nn.Dense(self.d_ff, kernel_init=up_init, name="up_proj", **common)(x_BTD)
        hidden_BTF = nn.with_logical_constraint(nn.silu(gate_BTF) * up_BTF, ("batch", "length", "mlp"))
        return nn.Dense(D, kernel_init=_param_init(dense_init, ("mlp", "embed")), name="down_proj", **common)(hidden_BTF)


class DepthRouter(nn.Module):
    """One sublayer's routing parameters: pseudo-query w (zeros) and key-norm gain g (ones), each [D].

    Routes a source buffer: softmax over the sources of w . RMSNorm_g(s), the weighted sum of the
    sources; with a residual (the Delta modes) residual + that sum. The parameters take the width D
    of the sources at `init`. For converting pretrained checkpoints (docs/explanations/modes.md):
    `gate` adds a scalar gate [1] (zeros) on the routed term, `residual + gate * route`, so a converted
    model computes exactly the pretrained function at step 0; `null_source` adds the paper's learned
    null source [D] (zeros) to every routing. Logits and softmax are float32. Parameters carry the
    logical axis names ("embed",) (the gate ("norm",)).

    Attributes:
        gate: add the scalar gate (additive routing only).
        null_source: add the learned null source.
        impl: "xla", or a fused Pallas kernel ("pallas": the best for the backend; "auto"), which
            returns no weights.
        interpret: run the kernel in Pallas interpret mode (CPU tests).
        epsilon: the key norm's epsilon: the one the cached 1/rms of the sources was computed with
            (config.model.norm_eps); it also normalises the null source and, in the kernel, every source.
        dtype: the output's dtype (default the sources').
        param_dtype: the parameters' dtype.
        query_init: the query's initialiser (default zeros: uniform routing at step 0, the paper's).
        gain_init: the gain's initialiser (default ones).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from deltares.nn import DepthRouter
        from deltares.nn.routing import inv_rms

        sources_SBTD = jax.random.normal(jax.random.key(0), (3, 2, 4, 8))  # S = 3 sources of [B, T, D]
        valid_S = jnp.array([True, True, False])                             # the last is not written yet
        router = DepthRouter()
        variables = router.init(jax.random.key(1), sources_SBTD, inv_rms(sources_SBTD), valid_S)
        out_BTD, weights_SBT = router.apply(variables, sources_SBTD, inv_rms(sources_SBTD), valid_S)
        print(out_BTD.shape, weights_SBT[:, 0, 0])  # (2, 4, 8) [0.5 0.5 0. ]
        ```
    """

    gate: bool = False
    null_source: bool = False
    impl: str = "xla"  # else the fused Pallas kernel ("pallas": best for the backend), which returns no weights
    interpret: bool = False  # run the kernel in Pallas interpret mode (CPU tests)
    epsilon: float = routing.NORM_EPS
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    query_init: Callable = nn.initializers.zeros
    gain_init: Callable = nn.initializers.ones

    @nn.compact
    def __call__(self, sources_SBTD, inv_rms_SBT, valid, residual_BTD=None, prefix=None):
        """Routes the sources; returns (out_BTD, weights_SBT or None).

        Args:
            sources_SBTD: the sources [S, B, T, D] (or a sequence of S arrays [B, T, D]).
            inv_rms_SBT: each source's 1/rms [S, B, T] (float32, `routing.inv_rms` with `epsilon`).
            valid: [S] bool, or broadcastable to [S, B, T]: the sources routed over (at least one).
            residual_BTD: the stream [B, T, D]: with it, out = residual + route (the Delta modes;
                with `gate`, residual + gate * route), else out = route (the Kimi modes).
            prefix: two-phase routing's (out [B, T, D], lse [B, T]) over earlier sources, merged
                as one more source (deltares.nn.routing.route_normalized).

        Returns:
            out [B, T, D] in `dtype` (default the sources'); the weights [S, B, T] (float32), None
            from a fused kernel.
        """
        if self.gate and residual_BTD is None:
            raise ValueError("a routing gate needs additive routing (a residual)")
        D = sources_SBTD[0].shape[-1]  # an array [S, B, T, D] or S arrays [B, T, D]
        for name in router_param_names(self.gate, self.null_source):
            if self.has_variable("params", name):
                _check_width(name, jnp.shape(nn.meta.unbox(self.get_variable("params", name))), D)
        inits = dict(query=self.query_init, gain=self.gain_init)
        params = {name: self.param(name, _param_init(inits.get(name, ROUTER_PARAMS[name][0]), ROUTER_PARAMS[name][1]),
                                   router_param_shape(name, D), self.param_dtype)
                  for name in router_param_names(self.gate, self.null_source)}
        out_BTD, weights_SBT = apply_router(params, sources_SBTD, inv_rms_SBT, valid, residual_BTD, impl=self.impl,
                                            interpret=self.interpret, eps=self.epsilon, prefix=prefix)
        return (out_BTD if self.dtype is None else out_BTD.astype(self.dtype)), weights_SBT


# A router's parameters (float32): name -> (initialiser, logical axis names); shape [D], the gate [1].
ROUTER_PARAMS = dict(
    query=(nn.initializers.zeros, ("embed",)),
    gain=(nn.initializers.ones, ("embed",)),
    null_source=(nn.initializers.zeros, ("embed",)),
    gate=(nn.initializers.zeros, ("norm",)),
)


def router_param_names(gate: bool = False, null_source: bool = False) -> tuple[str, ...]:
    return ("query", "gain") + (("null_source",) if null_source else ()) + (("gate",) if gate else ())


def router_param_shape(name: str, d_model: int) -> tuple[int]:
    return (1,) if name == "gate" else (d_model,)


def _check_width(name: str, shape, d_model: int) -> None:
    """ValueError unless a router parameter's `shape` fits sources of width `d_model`."""
    if tuple(shape) != router_param_shape(name, d_model):
        raise ValueError(f"a router parameter {name} of shape {tuple(shape)} on sources of width D={d_model}: "
                         f"expected {router_param_shape(name, d_model)} (a router built for another model width?)")


def init_router_params(d_model: int, gate: bool = False, null_source: bool = False) -> dict:
    """A router's initial parameters as a plain dict (for `apply_router` in a plain-JAX model)."""
    key = jax.random.key(0)  # the router initialisers are constants
    return {name: ROUTER_PARAMS[name][0](key, router_param_shape(name, d_model), jnp.float32)
            for name in router_param_names(gate, null_source)}


def apply_router(params, sources_SBTD, inv_rms_SBT, valid, residual_BTD=None, *, impl: str = "xla",
                 interpret: bool = False, eps: float = routing.NORM_EPS, prefix=None):
    """A router's math on its parameters (`query`, `gain`, optionally `null_source`, `gate`: see
    DepthRouter, ROUTER_PARAMS); shared by the linen and NNX DepthRouter and plain parameter dicts.
    Returns `(route, weights)` or `(residual + [gate *] route, weights)`; weights are None from the kernel, or
    for listed sources routed by the Mosaic GPU kernel the sources passed through (`PassedSources`).
    `prefix` (two-phase routing): the routing over earlier sources, merged as in `routing.route_normalized`;
    that merge reads only a group's few intra-group sources and always runs in XLA (phase one, the read of
    the whole buffer, is `route_prefix`, fused under a kernel `impl`)."""
    params = nn.meta.unbox(params)  # also a linen `init`'s boxed parameters
    query, gain, null, gate = params["query"], params["gain"], params.get("null_source"), params.get("gate")
    for name, value in params.items():
        _check_width(name, jnp.shape(value), sources_SBTD[0].shape[-1])
    if gate is not None and residual_BTD is None:
        raise ValueError("a routing gate needs additive routing (a residual)")
    inner_residual = residual_BTD if gate is None else None
    impl = "xla" if impl == "auto" and null is not None else implementation_for(impl)
    if impl == "xla" or prefix is not None:
        route_BTD, weights_SBT = xla_route(sources_SBTD, inv_rms_SBT, valid, query, gain, inner_residual, null, eps,
                                           prefix)
    else:
        if null is not None:
            raise ValueError("the Pallas kernel has no null source; use impl='xla' with a null source")
        route_BTD, weights_SBT = kernel_route(sources_SBTD, valid, query, gain, inner_residual, impl, interpret, eps)
    if gate is None:
        return route_BTD, weights_SBT
    acc = routing.accumulation_dtype(route_BTD.dtype)
    out_BTD = residual_BTD.astype(acc) + gate[0].astype(acc) * route_BTD.astype(acc)
    return out_BTD.astype(sources_SBTD[0].dtype), weights_SBT


def _d_split(sources_SBTD):
    """(mesh, the shard_map spec of the buffer [S, B, T, D]) when its model dimension is split over
    mesh axes, else None (route on whole arrays). Under Explicit mesh axes the spec is the sources'
    own (their type's: the stream's sharding, whatever mesh axes the caller chose); otherwise
    the logical axis rules' (`shard_spec`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    listed = isinstance(sources_SBTD, (tuple, list))
    if explicit_mesh() is not None:
        sbtd = P(None, *type_spec(sources_SBTD[0], 3)) if listed else type_spec(sources_SBTD, 4)
    else:
        shape = (len(sources_SBTD),) + sources_SBTD[0].shape if listed else sources_SBTD.shape
        sbtd = shard_spec(mesh, SOURCES_AXES, shape)
    return None if sbtd[3] is None else (mesh, sbtd)


def _fit(tree, specs):
    """Under Explicit mesh axes, each array of `tree` resharded to its shard_map in_spec (the
    routers' parameters, 1/rms, the residual: whatever sharding the caller gave them)."""
    if explicit_mesh() is None:
        return tree
    return jax.tree.map(lambda x, spec: x if x is None else jax.sharding.reshard(x, spec), tree, specs,
                        is_leaf=lambda x: x is None or isinstance(x, P))


def _token_split(shape):
    """The mesh's shard_map spec of a buffer [S, B, T, D] of `shape` for the fused kernels, tokens
    split over the batch's mesh axes and D whole (a kernel normalises whole sources), else None
    (no mesh, or one device: call the kernel on whole arrays)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh, shard_spec(mesh, SOURCES_AXES[:3] + (None,), shape)


def xla_route(sources_SBTD, inv_rms_SBT, valid_S, query_D, gain_D, residual_BTD=None, null_D=None,
              eps: float = routing.NORM_EPS, prefix=None):
    """`routing.route_normalized`; where the logical rules split the buffer's model dimension
    (`act_embed`) over mesh axes, it runs inside `jax.shard_map` on each device's slice of D:
    partial logits, `psum` over those axes, then local softmax and weighted sum, so the source
    buffer is never gathered. Batch and model axes come from `shard_spec`. Sources (and their
    1/rms) may be a sequence of arrays (`routing.route_normalized`), and `prefix` the (out, lse)
    of a two-phase routing's first phase (`route_prefix`)."""
    listed = isinstance(sources_SBTD, (tuple, list))
    args = (sources_SBTD, inv_rms_SBT, jnp.asarray(valid_S, bool), query_D, gain_D, residual_BTD, null_D, prefix)
    split = _d_split(sources_SBTD)
    if split is None:
        return routing.route_normalized(*args[:-1], eps=eps, prefix=prefix)
    mesh, sbtd = split
    batch, length, model_axes = sbtd[1], sbtd[2], sbtd[3]
    sbt, btd, d, bt = P(None, batch, length), P(batch, length, model_axes), P(model_axes), P(batch, length)
    prefix_spec = P() if prefix is None else (btd, bt)
    if listed:
        specs = (tuple(btd for _ in sources_SBTD), tuple(bt for _ in sources_SBTD), P(), d, d, btd, d, prefix_spec)
    else:
        specs = (sbtd, sbt, P(), d, d, btd, d, prefix_spec)

    def route(*args):
        return routing.route_normalized(*args[:-1], model_axis=model_axes, eps=eps, prefix=args[-1])

    return jax.shard_map(route, mesh=mesh, in_specs=specs, out_specs=(btd, sbt))(*_fit(args, specs))


def route_prefix(sources_SBTD, inv_rms_SBT, valid_KS, query_KD, gain_KD, *, impl: str = "xla",
                 interpret: bool = False, eps: float = routing.NORM_EPS):
    """Phase one of two-phase routing (K queries, one read of the buffer): (out_KBTD, lse_KBT).
    impl "xla": `routing.route_prefix`, on each device's slice of D inside `jax.shard_map` where the
    logical rules split it (`xla_route`); otherwise the fused K-query kernel
    (kernels_pallas.depth_route.route_prefix, which renormalises the sources itself), tokens split
    over the batch's mesh axes and D whole (`_token_split`; `kernel_route` for interpret mode's check_vma)."""
    valid_KS = jnp.asarray(valid_KS, bool)
    P = jax.sharding.PartitionSpec
    impl = implementation_for(impl, phase_one=True)
    if impl != "xla":
        from kernels_pallas.depth_route import route_prefix as fused  # noqa: PLC0415 - optional fast path

        def route(sources, valid, query, gain):
            return fused(sources, valid, query, gain, implementation=impl, interpret=interpret, eps=eps)

        split = _token_split(sources_SBTD.shape)
        if split is None:
            return route(sources_SBTD, valid_KS, query_KD, gain_KD)
        mesh, sbtd = split
        kbtd, kbt = P(None, *sbtd[1:]), P(None, *sbtd[1:3])
        return jax.shard_map(route, mesh=mesh, in_specs=(sbtd, P(), P(), P()), out_specs=(kbtd, kbt),
                             check_vma=not interpret)(sources_SBTD, valid_KS, query_KD, gain_KD)
    split = _d_split(sources_SBTD)
    args = (sources_SBTD, inv_rms_SBT, valid_KS, query_KD, gain_KD)
    if split is None:
        return routing.route_prefix(*args)
    mesh, sbtd = split
    batch, length, model_axes = sbtd[1], sbtd[2], sbtd[3]
    kd, kbt = P(None, model_axes), P(None, batch, length)
    specs = (sbtd, kbt, P(), kd, kd)
    fn = functools.partial(routing.route_prefix, model_axis=model_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(P(None, batch, length, model_axes), kbt))(
        *_fit(args, specs))


def route_prefix_grad_into(d_sources_SBTD, sources_SBTD, valid_KS, query_KD, gain_KD, out_KBTD, lse_KBT, d_out_KBTD,
                           d_lse_KBT, *, impl: str, interpret: bool = False, eps: float = routing.NORM_EPS):
    """The fused kernel's VJP of `route_prefix` (impl a kernel), the sources' cotangent added into
    `d_sources_SBTD` in place (kernels_pallas.depth_route.route_prefix_grad_into): (d_sources, d_query_KD,
    d_gain_KD). Under a mesh inside `jax.shard_map` with tokens split and D whole, as `route_prefix`."""
    from kernels_pallas.depth_route import route_prefix_grad_into as fused  # noqa: PLC0415 - optional fast path

    valid_KS = jnp.asarray(valid_KS, bool)

    def grad(d_sources, sources, valid, query, gain, out, lse, d_out, d_lse):
        return fused(d_sources, sources, valid, query, gain, out, lse, d_out, d_lse, implementation=impl,
                     interpret=interpret, eps=eps)

    args = (d_sources_SBTD, sources_SBTD, valid_KS, query_KD, gain_KD, out_KBTD, lse_KBT, d_out_KBTD, d_lse_KBT)
    split = _token_split(sources_SBTD.shape)
    if split is None:
        return grad(*args)
    mesh, sbtd = split
    P = jax.sharding.PartitionSpec
    kbtd, kbt = P(None, *sbtd[1:]), P(None, *sbtd[1:3])
    batch = sbtd[1]  # the query and gain cotangents sum over the devices' tokens

    def local(*a):
        d_src, dq, dg = grad(*a)
        if batch is not None:
            dq, dg = jax.lax.psum((dq, dg), batch)
        return d_src, dq, dg

    return jax.shard_map(local, mesh=mesh, in_specs=(sbtd, sbtd, P(), P(), P(), kbtd, kbt, kbtd, kbt),
                         out_specs=(sbtd, P(), P()), check_vma=not interpret)(*args)


class PassedSources(tuple):
    """Listed sources a fused kernel passed through (`kernel_route`): what later sublayers route over,
    so that their cotangents reach this router's backward pass, where the Mosaic GPU kernel adds its own
    into them in place. `apply_router` returns it in place of the (absent) weights."""


jax.tree_util.register_pytree_node(PassedSources, lambda p: (tuple(p), None), lambda _, arrays: PassedSources(arrays))


def kernel_route(sources_SBTD, valid, query_D, gain_D, residual_BTD, impl: str, interpret: bool,
                 eps: float = routing.NORM_EPS):
    """Depth routing by the fused Pallas kernel (kernels_pallas.depth_route): (out, PassedSources or None).
    Listed sources (unrolled layers) go to the Mosaic GPU kernel as separate operands, and come back
    passed through (`PassedSources`); the other kernels read one stacked buffer. Under a mesh of
    several devices it runs inside `jax.shard_map`, tokens split over the batch's mesh axes and D
    whole (`_token_split`: the kernel normalises each source itself, so a D split over `tensor` is
    gathered)."""
    from kernels_pallas.depth_route import depth_route  # noqa: PLC0415 - optional fast path
    from kernels_pallas.depth_route.api import MOSAIC_GPU  # noqa: PLC0415

    listed = isinstance(sources_SBTD, (tuple, list))
    separate = listed and impl == MOSAIC_GPU
    if listed and not separate:  # the kernel reads one buffer
        sources_SBTD = jnp.stack(sources_SBTD)
    shape = (len(sources_SBTD),) + sources_SBTD[0].shape if separate else sources_SBTD.shape

    static = None if isinstance(valid, jax.Array) else valid  # a mask known when tracing stays known

    def route(sources, valid, query, gain, residual):
        return depth_route(tuple(sources) if separate else sources, valid if static is None else static, query,
                           gain, residual, implementation=impl, interpret=interpret, eps=eps, pass_sources=separate)

    split = _token_split(shape)
    if split is None:
        out = route(sources_SBTD, valid, query_D, gain_D, residual_BTD)
    else:
        mesh, sbtd = split
        P = jax.sharding.PartitionSpec
        btd = P(*sbtd[1:])
        src_spec = tuple(btd for _ in sources_SBTD) if separate else sbtd
        # check_vma off in interpret mode: Pallas' HLO interpreter slices varying blocks with unvarying
        # indices, which the check rejects (jax 0.10); the compiled kernels keep it
        fn = jax.shard_map(route, mesh=mesh, in_specs=(src_spec, P(), P(), P(), btd),
                           out_specs=(btd, src_spec) if separate else btd, check_vma=not interpret)
        out = fn(tuple(sources_SBTD) if separate else sources_SBTD, jnp.asarray(valid), query_D, gain_D, residual_BTD)
    if separate:
        return out[0], PassedSources(out[1])
    return out, None


__all__ = ["MLP", "ROUTER_PARAMS", "Attention", "DepthRouter", "PassedSources", "Projection", "RMSNorm", "Rope", "apply_router", "init_router_params", "rope_tables"]
