"""Depth routing: a softmax over earlier sources with an input-independent query.

    z_i = w . RMSNorm_g(s_i)        a = softmax_i(z)        route(S) = sum_i a_i s_i

`depth_route` is the public, pure-jnp reference (the oracle for fused kernels).
`route_normalized` is the same math given each source's precomputed 1/rms, which
the model caches once per source instead of renormalising it at every reader.
Keys, logits and softmax are float32 (float64 for float64 sources: `accumulation_dtype`); the
output has the sources' dtype.

Two-phase routing (docs/explanations/store-once.md): `route_prefix` routes K queries over the
same sources in one pass and returns each query's result and log-sum-exp; passed
back as `prefix` to `route_normalized`, a result is one more source whose logit is
its lse, which merges it exactly with the remaining sources (softmax over a union).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


NORM_EPS = 1e-6


def accumulation_dtype(dtype):
    """Logits, softmax and sums: float32, or the input's dtype where wider (float64 tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def inv_rms(x_BTD: Array, eps: float = NORM_EPS, model_axis=None) -> Array:
    """1 / sqrt(mean(x^2) + eps) over the last axis, in float32 (float64 for float64 input); with `model_axis` (inside
    `jax.shard_map`) the axis is this device's slice of one split over that mesh axis."""
    acc = accumulation_dtype(x_BTD.dtype)
    x32 = x_BTD.astype(acc)
    sum_sq, count = jnp.sum(x32 * x32, axis=-1), x32.shape[-1]
    if model_axis is not None:
        sum_sq, count = jax.lax.psum(sum_sq, model_axis), jax.lax.psum(count, model_axis)
    return jax.lax.rsqrt(sum_sq / count + eps)


def _parts(x, dtype):
    """`x` (float32) as a stack of arrays of `dtype` whose sum is x: [x] where `dtype` holds it, else a
    high and a low part (about twice `dtype`'s precision). A product with a `dtype` operand then
    accumulates in float32 without converting that operand: no float32 copy of a source buffer."""
    if jnp.dtype(dtype) == x.dtype:
        return x[None]
    hi = x.astype(dtype)
    return jnp.stack([hi, (x - hi.astype(x.dtype)).astype(dtype)])


def _mixed(spec: str, small, big):
    """einsum(spec, small, big) with `small` in float32 (or wider) and `big` a source buffer of any
    float dtype: float32 accumulation, `big` read once and never converted (`_parts`)."""
    acc = small.dtype
    parts = _parts(small, big.dtype)
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    return jnp.einsum(f"z{lhs},{rhs}->z{out}", parts, big, preferred_element_type=acc).sum(axis=0)


def _psum(x, model_axis):
    return x if model_axis is None else jax.lax.psum(x, model_axis)


def route_prefix(sources_SBTD, inv_rms_SBT, valid_KS, query_KD, gain_KD, model_axis=None):
    """Phase one of two-phase routing: K queries over one buffer, read once. Returns (out_KBTD,
    lse_KBT), both in `accumulation_dtype` (the merge rounds once, at its output): each query's
    softmax-weighted sum over its valid sources `valid_KS` (at least one each) and the log-sum-exp
    of its logits. `model_axis` as in `route_normalized`.

    Its products with the buffer, forward and backward, read the buffer in its own dtype with
    float32 accumulation (`_mixed`): a bf16 buffer is never copied to float32, a copy as large as
    the buffer twice over that the K-query products would otherwise hold."""
    acc = accumulation_dtype(sources_SBTD.dtype)
    qg_KD = query_KD.astype(acc) * gain_KD.astype(acc)
    return _route_prefix(sources_SBTD, inv_rms_SBT, jnp.asarray(valid_KS, bool), qg_KD, model_axis)


def _prefix_weights(sources_SBTD, inv_rms_SBT, valid_KS, qg_KD, model_axis):
    """Phase one's raw logits qg . s [K, S, B, T], softmax weights and log-sum-exp."""
    raw_KSBT = _psum(_mixed("kd,sbtd->ksbt", qg_KD, sources_SBTD), model_axis)
    logits_KSBT = jnp.where(valid_KS[:, :, None, None], raw_KSBT * inv_rms_SBT[None], -jnp.inf)
    lse_KBT = jax.nn.logsumexp(logits_KSBT, axis=1)
    return raw_KSBT, jnp.exp(logits_KSBT - lse_KBT[:, None]), lse_KBT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _route_prefix(sources_SBTD, inv_rms_SBT, valid_KS, qg_KD, model_axis):
    return _route_prefix_fwd(sources_SBTD, inv_rms_SBT, valid_KS, qg_KD, model_axis)[0]


def _route_prefix_fwd(sources_SBTD, inv_rms_SBT, valid_KS, qg_KD, model_axis):
    raw_KSBT, weights_KSBT, lse_KBT = _prefix_weights(sources_SBTD, inv_rms_SBT, valid_KS, qg_KD, model_axis)
    out_KBTD = _mixed("ksbt,sbtd->kbtd", weights_KSBT, sources_SBTD)
    return (out_KBTD, lse_KBT), (sources_SBTD, inv_rms_SBT, qg_KD, raw_KSBT, weights_KSBT)


def _route_prefix_bwd(model_axis, residuals, cotangents):
    """out_k = sum_s a_ks s_s, a_k = softmax_s(z_k), z_ks = (qg_k . s_s) r_s, lse_k = logsumexp_s z_ks:
    with d a_ks = d out_k . s_s, d z_ks = a_ks (d a_ks - sum_s' a_ks' d a_ks' + d lse_k) (exactly 0 for a
    query of one source, as softmax's own VJP gives: Adam would amplify rounding noise there);
    d s_s = sum_k a_ks d out_k + r_s d z_ks qg_k (one product over k, written in the buffer's dtype),
    d r_s = sum_k d z_ks (qg_k . s_s)."""
    sources_SBTD, inv_rms_SBT, qg_KD, raw_KSBT, weights_KSBT = residuals
    d_out_KBTD, d_lse_KBT = cotangents
    acc = qg_KD.dtype
    d_out_KBTD = d_out_KBTD.astype(acc)
    d_w_KSBT = _psum(_mixed("kbtd,sbtd->ksbt", d_out_KBTD, sources_SBTD), model_axis)
    d_mean_KBT = jnp.sum(weights_KSBT * d_w_KSBT, axis=1)
    d_z_KSBT = weights_KSBT * (d_w_KSBT - d_mean_KBT[:, None] + d_lse_KBT.astype(acc)[:, None])
    d_zr_KSBT = d_z_KSBT * inv_rms_SBT[None]
    K = qg_KD.shape[0]
    rows_KBTD = jnp.concatenate([d_out_KBTD, jnp.broadcast_to(qg_KD[:, None, None], (K,) + d_out_KBTD.shape[1:])])
    d_sources_SBTD = jnp.einsum("ksbt,kbtd->sbtd", jnp.concatenate([weights_KSBT, d_zr_KSBT]), rows_KBTD,
                                preferred_element_type=acc).astype(sources_SBTD.dtype)
    d_inv_SBT = jnp.sum(d_z_KSBT * raw_KSBT, axis=0).astype(inv_rms_SBT.dtype)
    d_qg_KD = _mixed("ksbt,sbtd->kd", d_zr_KSBT, sources_SBTD)
    return (_summed_like(d_sources_SBTD, sources_SBTD), _summed_like(d_inv_SBT, inv_rms_SBT), None,
            _summed_like(d_qg_KD, qg_KD))


def _summed_like(cotangent, primal):
    """Inside `jax.shard_map`: the cotangent summed over the mesh axes it varies along and its primal
    does not (the queries' over the token axes), as autodiff would transpose the primal's broadcast."""
    extra = _varying(cotangent) - _varying(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def _varying(x) -> frozenset:
    """The mesh axes along which `x` varies inside `jax.shard_map` (empty outside, or unchecked)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # where jax names it so; jax 0.10 to 0.12: manual_axis_type.varying
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


_route_prefix.defvjp(_route_prefix_fwd, _route_prefix_bwd)


def route_normalized(sources_SBTD, inv_rms_SBT, valid, query_D, gain_D, residual_BTD=None, null_D=None,
                     model_axis=None, eps: float = NORM_EPS, prefix=None):
    """Routing given per-source 1/rms. Returns (out_BTD, weights_SBT).

    `null_D` adds one learned source shared by every token (the paper's null source for
    fine-tuning); its weight is 1 - sum(weights_SBT), its 1/rms is taken with `eps` (the
    one the cached `inv_rms_SBT` was computed with).
    With `model_axis` (inside `jax.shard_map`) every D-sized argument is this device's
    slice of a model dimension split over that mesh axis: the partial logits are summed
    with `psum`, and softmax and weighted sum run locally on the slice.

    `sources_SBTD` and `inv_rms_SBT` may also be sequences of S arrays [B, T, D] and [B, T]
    (unrolled layers keep their sources apart: no buffer is copied at a write).

    `prefix` = (out_BTD, lse_BT) from `route_prefix`: the routing over sources outside
    `sources_SBTD`, merged in as one more source of logit lse (`weights_SBT` then covers
    `sources_SBTD` only). Every token needs one valid source, the prefix counting as one."""
    listed = isinstance(sources_SBTD, (tuple, list))
    S = len(sources_SBTD) if listed else sources_SBTD.shape[0]
    B, T, _ = sources_SBTD[0].shape
    dtype = sources_SBTD[0].dtype

    acc = accumulation_dtype(dtype)
    qg_D = query_D.astype(acc) * gain_D.astype(acc)
    if listed:
        logits_SBT = jnp.stack([_psum(jnp.einsum("btd,d->bt", s_BTD.astype(acc), qg_D), model_axis) * inv_BT
                                for s_BTD, inv_BT in zip(sources_SBTD, inv_rms_SBT)])
    else:
        logits_SBT = _psum(jnp.einsum("sbtd,d->sbt", sources_SBTD.astype(acc), qg_D), model_axis) * inv_rms_SBT
    valid_SBT = jnp.broadcast_to(jnp.asarray(valid, bool).reshape(_mask_shape(valid, S)), (S, B, T))
    logits_SBT = jnp.where(valid_SBT, logits_SBT, -jnp.inf)
    if null_D is not None:
        null_D = null_D.astype(acc)
        null_logit = _psum(jnp.dot(null_D, qg_D), model_axis) * inv_rms(null_D, eps, model_axis)
        logits_SBT = jnp.concatenate([logits_SBT, jnp.broadcast_to(null_logit, (1, B, T))], axis=0)
    if prefix is not None:
        logits_SBT = jnp.concatenate([logits_SBT, prefix[1][None].astype(acc)], axis=0)
    all_weights = jax.nn.softmax(logits_SBT, axis=0)
    weights_SBT = all_weights[:S]
    if listed:
        out_BTD = sum(w_BT[..., None] * s_BTD.astype(acc) for w_BT, s_BTD in zip(weights_SBT, sources_SBTD))
    else:
        out_BTD = jnp.einsum("sbt,sbtd->btd", weights_SBT, sources_SBTD.astype(acc))
    if null_D is not None:
        out_BTD = out_BTD + all_weights[S][..., None] * null_D
    if prefix is not None:
        out_BTD = out_BTD + all_weights[-1][..., None] * prefix[0].astype(acc)
    if residual_BTD is not None:
        out_BTD = residual_BTD.astype(acc) + out_BTD
    return out_BTD.astype(dtype), weights_SBT


def _mask_shape(valid, S: int):
    shape = jnp.shape(valid)
    if shape and shape[0] != S:
        raise ValueError(f"valid has leading size {shape[0]}, expected the number of sources {S}")
    return shape + (1,) * (3 - len(shape))


def depth_route(sources, valid, query, gain, residual=None, *, eps=NORM_EPS, return_weights=False):
    """Route over `sources` with a pseudo-query and a key-norm gain: softmax over the sources of
    z_i = query . RMSNorm_gain(s_i), then the weighted sum of the sources. The reference every fast
    path (the cached-1/rms routing of the stacks, the fused kernels) is tested against.

    Args:
        sources: the sources [S, B, T, D].
        valid: [S] bool, or broadcastable to [S, B, T]: the sources routed over (at least one per token).
        query: the pseudo-query [D].
        gain: the key norm's gain [D].
        residual: the stream [B, T, D]: with it the result is residual + route(S) (additive routing,
            the Delta modes), else route(S) (replacement, the Kimi modes).
        eps: the key norm's epsilon.
        return_weights: also return the softmax weights.

    Returns:
        The routed [B, T, D] (the sources' dtype), with `return_weights` also the weights [S, B, T]
        (float32). Logits and softmax are float32 (float64 for float64 sources).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from deltares.nn import depth_route

        S, B, T, D = 4, 2, 16, 64
        sources_SBTD = jax.random.normal(jax.random.key(0), (S, B, T, D))
        valid_S = jnp.array([True, True, True, False])        # the last slot is not filled yet
        query_D, gain_D = jnp.zeros(D), jnp.ones(D)           # learned per sublayer
        stream_BTD = jax.random.normal(jax.random.key(1), (B, T, D))
        x_BTD = depth_route(sources_SBTD, valid_S, query_D, gain_D, residual=stream_BTD)    # Delta: h + route(S)
        x_BTD, weights_SBT = depth_route(sources_SBTD, valid_S, query_D, gain_D, return_weights=True)  # Kimi
        print(x_BTD.shape, weights_SBT[:, 0, 0])  # a zero query: uniform over the valid sources
        ```
    """
    if sources.ndim != 4:
        raise ValueError(f"sources must be [S, B, T, D], got shape {sources.shape}")
    D = sources.shape[-1]
    for name, vec in (("query", query), ("gain", gain)):
        if jnp.shape(vec) != (D,):
            raise ValueError(f"{name} must have shape ({D},), got {jnp.shape(vec)}")
    if residual is not None and jnp.shape(residual) != sources.shape[1:]:
        raise ValueError(f"residual must have shape {sources.shape[1:]}, got {jnp.shape(residual)}")
    out, weights = route_normalized(sources, inv_rms(sources, eps), valid, query, gain, residual)
    return (out, weights) if return_weights else out


__all__ = ["NORM_EPS", "accumulation_dtype", "depth_route", "inv_rms", "route_normalized", "route_prefix"]
