"""Fused depth routing: public entry point, dispatch and the custom VJP.

    z_i = w . RMSNorm_g(s_i)    a = softmax_i(z) over valid sources    out = [residual +] sum_i a_i s_i

`depth_route(sources, valid, query, gain, residual=None, *, implementation="pallas")` means what
`reference.depth_route` means (the oracle, here the "xla" implementation) and returns
the output only, in the sources' dtype. The kernels ("pallas_tpu": Mosaic, "pallas_gpu":
Triton) make one pass over the sources per token tile: each source's 1/rms and logit against
q = w * g, and a float32 online softmax (running max, sum and weighted sum), then the residual
add. They save the per-token log-sum-exp for the backward (not the weights), which is a
Pallas kernel too: it re-reads the valid sources twice (first for c = sum_k a_k dout.s_k, then
for ds_k), writes ds once, and returns per-tile partial dq, reduced outside; dw = dq g and
dg = dq w follow by autodiff of q = w * g. Bytes moved per call (input dtype):
forward (S + 1 [+ 1 residual]) N D, backward (2 S + 1) N D read + S N D written, counting
only valid sources in the reads (invalid ones are skipped without a DMA on TPU).

Masks: `valid` [S] (static or traced) or anything broadcastable to [S, B, T] (per-token; sent
to the kernels as a float32 additive bias [S, B*T]). Masked sources get zero gradient.

Dispatch: implementation="pallas" picks the kernel of the platform being targeted (the platform
of the surrounding mesh, e.g. a `jax.set_mesh` or `jax.shard_map` over TPU devices compiled
ahead of time, else `jax.default_backend()`): TPU -> pallas_tpu, GPU -> pallas_gpu, else xla.
A kernel that cannot run (another platform without interpret=True, or shapes it cannot tile)
falls back to xla with a one-time warning. Under `jax.jit` with sharded inputs a Pallas call
is not partitioned by XLA: call it inside `jax.shard_map` (tokens split, D whole).

Two-phase routing (Kimi; docs/explanations/store-once.md, "Two-phase grouped routing"):
pseudo-queries do not depend on the input, so for the K sublayers of a group the routing over
the sources completed before the group is one read of those sources:
`route_prefix(sources, valid [K, S], queries [K, D], gains [K, D])` returns each query's routed
output and log-sum-exp (float32; the oracle is `reference.route_prefix`). Its kernels
keep K online softmaxes per token tile (on TPU the logits of the K queries are one matmul per
source tile, the K float32 accumulators are the output block itself), and the backward reads the
valid sources once more: with c_k = dout_k . out_k - dlse_k from the saved output,
    ds = sum_k [a_k dout_k + dz_k inv (q_k - z_k inv s / D)],  dz_k = a_k (dout_k . s - c_k),
added into a cotangent buffer in place (`route_prefix_grad_into`; the custom VJP passes zeros).
Each sublayer then merges that result with its few intra-group sources through the lse
(`route_normalized(prefix=)`, in XLA): out = (e^{lse1} o1 + e^{lse2} o2) / (e^{lse1} + e^{lse2}).
It divides source reads by K.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from kernels_pallas import varying_axes, vary_like
from kernels_pallas.depth_route import reference
from kernels_pallas.depth_route.reference import NORM_EPS

# "pallas": the target platform's kernel (falling back to xla where none runs); "auto": the fastest
# measured on the target platform (`implementation_for`); the others force one.
# deltares' config.model.residual.impl takes these values.
IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")

_PLATFORM_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def target_platform() -> str:
    """'tpu', 'gpu', 'cpu', ...: the surrounding mesh's platform, else the default backend's."""
    try:
        platform = getattr(jax.sharding.get_abstract_mesh().abstract_device, "platform", None)
    except Exception:  # noqa: BLE001 - no mesh API or no mesh
        platform = None
    platform = platform or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def wrong_platform(implementation: str, platform: str, interpret=False) -> str | None:
    """Why the kernel `implementation` cannot compile for devices of `platform` ("tpu", "gpu"/"cuda", "cpu"),
    or None: "pallas_tpu" and "pallas_gpu" each compile for their platform only (but with `interpret`)."""
    want = _PLATFORM_OF.get(implementation)
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if want is None or interpret or platform == want:
        return None
    return f"it compiles for {want} only (or runs with interpret=True), the target is {platform}"


def implementation_for(implementation: str, phase_one: bool = False) -> str:
    """The implementation "auto" stands for on the target platform, measured on one H200
    (docs/explanations/performance.md): on a GPU the Triton kernel for a sublayer's routing
    (`depth_route`: s220m `delta_block` 95.4 against 100.5 ms a step, `delta` 139.6 against 159.5)
    and XLA for two-phase routing's phase one (`route_prefix`, `phase_one`: the K-query kernel made
    s1044m `delta` slower, 763.9 against 512.3 ms); XLA elsewhere (no TPU run has compared them).
    Any other value is returned as it is."""
    if implementation != "auto":
        return implementation
    return "pallas_gpu" if target_platform() == "gpu" and not phase_one else "xla"


def _backend(impl: str):
    if impl == "pallas_tpu":
        from kernels_pallas.depth_route import pallas_tpu as module
    else:
        from kernels_pallas.depth_route import pallas_gpu as module
    return module


def _resolve(implementation, interpret, N, D, dtype, K=None) -> str:
    """The implementation to run: `K` queries for phase one (`route_prefix`), None for `depth_route`."""
    platform = target_platform()
    impl = implementation_for(implementation, phase_one=K is not None)
    if impl == "pallas":
        impl = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "xla")
    if impl == "xla":
        return impl
    reason = wrong_platform(impl, platform, interpret)
    if reason is None:
        backend = _backend(impl)
        reason = backend.unsupported(N, D, dtype) if K is None else backend.prefix_unsupported(N, D, dtype, K)
    if reason:
        _warn_once(f"{'depth_route' if K is None else 'route_prefix'}: {impl} cannot run ({reason}); using the xla implementation")
        return "xla"
    return impl


def _masks(valid, S, B, T):
    """(valid_S int32, additive bias [S, B*T] float32 or None for a per-source mask)."""
    v = reference.valid_mask(valid, S)
    if v.shape[1:] == (1, 1):
        return jnp.broadcast_to(v[:, 0, 0], (S,)).astype(jnp.int32), None
    v_SN = jnp.broadcast_to(v, (S, B, T)).reshape(S, B * T)
    return v_SN.any(axis=1).astype(jnp.int32), jnp.where(v_SN, 0.0, -jnp.inf).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route(cfg, src_SND, valid_S, bias_SN, q_D, res_ND):
    return _route_fwd(cfg, src_SND, valid_S, bias_SN, q_D, res_ND)[0]


def _route_fwd(cfg, src_SND, valid_S, bias_SN, q_D, res_ND):
    impl, eps, interpret, _ = cfg
    out_ND, lse = _backend(impl).forward(src_SND, valid_S, bias_SN, q_D, res_ND, eps=eps, interpret=interpret)
    return out_ND, (src_SND, valid_S, bias_SN, q_D, lse)


def _route_bwd(cfg, saved, dout_ND):
    impl, eps, interpret, res_dtype = cfg
    src_SND, valid_S, bias_SN, q_D, lse = saved
    ds_SND, dq_D = _backend(impl).backward(src_SND, valid_S, bias_SN, q_D, lse, dout_ND, eps=eps,
                                           interpret=interpret)
    dres_ND = None if res_dtype is None else dout_ND.astype(res_dtype)
    return ds_SND, None, None, dq_D, dres_ND


_route.defvjp(_route_fwd, _route_bwd)


def depth_route(sources, valid, query, gain, residual=None, *, implementation="pallas", interpret=False,
                eps=NORM_EPS):
    """Route over `sources` [S, B, T, D] (see the module docstring); returns [B, T, D].

    implementation: "xla", "pallas" (the kernel of the target platform), "pallas_tpu", "pallas_gpu" or
      "auto" (`implementation_for`: the kernel on a GPU, xla elsewhere).
    interpret: run the Pallas kernel in interpret mode (on CPU, for tests): True, or for
      pallas_tpu a `pltpu.InterpretParams()` for the TPU interpret mode.
    eps: the key norm's, 1 / sqrt(mean(s^2) + eps) (config.model.norm_eps in the model).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    valid = jnp.asarray(valid, bool)
    reference.check(sources, valid, query, gain, residual)
    S, B, T, D = sources.shape
    impl = _resolve(implementation, interpret, B * T, D, sources.dtype)
    if impl == "xla":
        return reference.depth_route(sources, valid, query, gain, residual, eps=eps)
    valid_S, bias_SN = _masks(valid, S, B, T)
    q_D = query.astype(jnp.float32) * gain.astype(jnp.float32)
    res_ND = None if residual is None else residual.reshape(B * T, D)
    args = [sources.reshape(S, B * T, D), valid_S, bias_SN, q_D, res_ND]
    args = vary_like(args, frozenset().union(*(varying_axes(x) for x in args if x is not None)))
    cfg = (impl, float(eps), interpret, None if residual is None else jnp.dtype(residual.dtype).name)
    out_ND = _route(cfg, *args)
    return out_ND.reshape(B, T, D)


# ----------------------------------------------------------------------------- phase one: K queries, one read

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefix(cfg, src_SND, valid_S, bias_SK, q_KD):
    return _prefix_fwd(cfg, src_SND, valid_S, bias_SK, q_KD)[0]


def _prefix_fwd(cfg, src_SND, valid_S, bias_SK, q_KD):
    impl, eps, interpret = cfg
    out_KND, lse_KN = _backend(impl).prefix_forward(src_SND, valid_S, bias_SK, q_KD, eps=eps, interpret=interpret)
    return (out_KND, lse_KN), (src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN)


def _prefix_grad(cfg, acc_SND, src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN, dout_KND, dlse_KN):
    """(acc + d sources, d q) of phase one: the backward kernel, accumulating into `acc_SND`."""
    impl, eps, interpret = cfg
    dout_KND = dout_KND.astype(jnp.float32)
    c_KN = jnp.sum(dout_KND * out_KND, axis=-1) - dlse_KN  # sum_s a_ks (dout_k . s) - dlse_k
    return _backend(impl).prefix_backward(src_SND, valid_S, bias_SK, q_KD, lse_KN, c_KN, dout_KND, acc_SND, eps=eps,
                                          interpret=interpret)


def _prefix_bwd(cfg, saved, cotangents):
    src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN = saved
    ds_SND, dq_KD = _prefix_grad(cfg, jnp.zeros_like(src_SND), src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN,
                                 *cotangents)
    return ds_SND, None, None, dq_KD


_prefix.defvjp(_prefix_fwd, _prefix_bwd)


def _prefix_args(sources, valid, queries, gains, implementation, interpret):
    """Checks; then (impl, kernel operands [src_SND, valid_S, bias_SK, q_KD] or None for xla)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if jnp.ndim(sources) != 4:
        raise ValueError(f"sources must be [S, B, T, D], got shape {jnp.shape(sources)}")
    S, B, T, D = sources.shape
    K = jnp.shape(queries)[0] if jnp.ndim(queries) == 2 else None
    for name, arr, want in (("queries", queries, (K, D)), ("gains", gains, (K, D)), ("valid", valid, (K, S))):
        if K is None or jnp.shape(arr) != want:
            raise ValueError(f"{name} must have shape {('K', D) if K is None else want} (K queries), "
                             f"got {jnp.shape(arr)}")
    valid = jnp.asarray(valid, bool)
    impl = _resolve(implementation, interpret, B * T, D, sources.dtype, K)
    if impl == "xla":
        return impl, None
    q_KD = queries.astype(jnp.float32) * gains.astype(jnp.float32)
    bias_SK = jnp.where(valid.T, 0.0, -jnp.inf).astype(jnp.float32)
    return impl, [sources.reshape(S, B * T, D), valid.any(axis=0).astype(jnp.int32), bias_SK, q_KD]


def route_prefix(sources, valid, queries, gains, *, implementation="pallas", interpret=False, eps=NORM_EPS):
    """Phase one of two-phase routing: K queries `queries`, `gains` [K, D] over `sources`
    [S, B, T, D] in one read, query k over the sources of `valid` [K, S] (at least one each).
    Returns (out [K, B, T, D], lse [K, B, T]), float32: each query's routing and the log-sum-exp
    of its logits, what deltares' routing merges with a sublayer's other sources (the oracle is
    `reference.route_prefix`, the "xla" implementation). Differentiable in sources,
    queries and gains; the backward is one more read of the valid sources (writes ds once)."""
    impl, args = _prefix_args(sources, valid, queries, gains, implementation, interpret)
    if args is None:
        return reference.route_prefix(sources, valid, queries, gains, eps=eps)
    K, (S, B, T, D) = queries.shape[0], sources.shape
    args = vary_like(args, frozenset().union(*(varying_axes(x) for x in args)))
    out_KND, lse_KN = _prefix((impl, float(eps), interpret), *args)
    return out_KND.reshape(K, B, T, D), lse_KN.reshape(K, B, T)


def route_prefix_grad_into(d_sources, sources, valid, queries, gains, out, lse, d_out, d_lse, *,
                           implementation="pallas", interpret=False, eps=NORM_EPS):
    """`route_prefix`'s VJP with the sources' cotangent added into `d_sources` [S, B, T, D]: given the
    forward's (out, lse) and their cotangents, returns (d_sources + d sources, d queries, d gains).
    The kernels write `d_sources` in place (an aliased output), touching only slots some query reads,
    so a training step needs no second buffer-sized cotangent (what the custom VJP of `route_prefix`
    must return); "xla" adds `jax.vjp`'s result."""
    impl, args = _prefix_args(sources, valid, queries, gains, implementation, interpret)
    if args is None:
        _, vjp = jax.vjp(lambda s, q, g: reference.route_prefix(s, valid, q, g, eps=eps), sources, queries, gains)
        ds, dq, dg = vjp((d_out.astype(jnp.float32), d_lse.astype(jnp.float32)))
        return d_sources + ds.astype(d_sources.dtype), dq, dg
    K, (S, B, T, D) = queries.shape[0], sources.shape
    ops = [d_sources.reshape(S, B * T, D), *args, out.reshape(K, B * T, D).astype(jnp.float32),
           lse.reshape(K, B * T).astype(jnp.float32), d_out.reshape(K, B * T, D), d_lse.reshape(K, B * T)]
    ops = vary_like(ops, frozenset().union(*(varying_axes(x) for x in ops)))
    acc, src, valid_S, bias_SK, q_KD = ops[:5]
    ds_SND, dq_KD = _prefix_grad((impl, float(eps), interpret), acc, src, valid_S, bias_SK, q_KD, *ops[5:])
    gains32, queries32 = gains.astype(jnp.float32), queries.astype(jnp.float32)
    return (ds_SND.reshape(S, B, T, D).astype(d_sources.dtype), (dq_KD * gains32).astype(queries.dtype),
            (dq_KD * queries32).astype(gains.dtype))
