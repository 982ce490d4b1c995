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


def route_prefix(sources_SBTD, inv_rms_SBT, valid_KS, query_KD, gain_KD, model_axis=None):
    """Phase one of two-phase routing: K queries over one buffer, read once. Returns (out_KBTD,
    lse_KBT), both in `accumulation_dtype` (the merge rounds once, at its output): each query's
    softmax-weighted sum over its valid sources `valid_KS` (at least one each) and the log-sum-exp
    of its logits. `model_axis` as in `route_normalized`."""
    acc = accumulation_dtype(sources_SBTD.dtype)
    qg_KD = query_KD.astype(acc) * gain_KD.astype(acc)
    sources32 = sources_SBTD.astype(acc)
    logits_KSBT = jnp.einsum("sbtd,kd->ksbt", sources32, qg_KD)
    if model_axis is not None:
        logits_KSBT = jax.lax.psum(logits_KSBT, model_axis)
    logits_KSBT = jnp.where(jnp.asarray(valid_KS, bool)[:, :, None, None], logits_KSBT * inv_rms_SBT[None], -jnp.inf)
    lse_KBT = jax.nn.logsumexp(logits_KSBT, axis=1)
    weights_KSBT = jnp.exp(logits_KSBT - lse_KBT[:, None])
    out_KBTD = jnp.einsum("ksbt,sbtd->kbtd", weights_KSBT, sources32)
    return out_KBTD, lse_KBT


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

    def sum_over_d(partial):
        return partial if model_axis is None else jax.lax.psum(partial, model_axis)

    acc = accumulation_dtype(dtype)
    qg_D = query_D.astype(acc) * gain_D.astype(acc)
    if listed:
        logits_SBT = jnp.stack([sum_over_d(jnp.einsum("btd,d->bt", s_BTD.astype(acc), qg_D)) * inv_BT
                                for s_BTD, inv_BT in zip(sources_SBTD, inv_rms_SBT)])
    else:
        logits_SBT = sum_over_d(jnp.einsum("sbtd,d->sbt", sources_SBTD.astype(acc), qg_D)) * inv_rms_SBT
    valid_SBT = jnp.broadcast_to(jnp.asarray(valid, bool).reshape(_mask_shape(valid, S)), (S, B, T))
    logits_SBT = jnp.where(valid_SBT, logits_SBT, -jnp.inf)
    if null_D is not None:
        null_D = null_D.astype(acc)
        null_logit = sum_over_d(jnp.dot(null_D, qg_D)) * inv_rms(null_D, eps, model_axis)
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
    """Route over `sources` [S, B, T, D] with pseudo-query `query` and key-norm gain `gain` [D].

    `valid` is [S] bool or broadcastable to [S, B, T]; at least one source must be
    valid per token. With `residual` [B, T, D] the result is `residual + route(S)`
    (additive routing, the Delta modes), otherwise `route(S)` (replacement, Kimi).
    With `return_weights` also returns the softmax weights [S, B, T] (float32).
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
