"""Depth routing: a softmax over earlier sources with an input-independent query.

    z_i = w . RMSNorm_g(s_i)        a = softmax_i(z)        route(S) = sum_i a_i s_i

`depth_route` is the public, pure-jnp reference (the oracle for fused kernels).
`route_normalized` is the same math given each source's precomputed 1/rms, which
the model caches once per source instead of renormalising it at every reader.
Keys, logits and softmax are float32; the output has the sources' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


NORM_EPS = 1e-6


def inv_rms(x_BTD: Array, eps: float = NORM_EPS, model_axis=None) -> Array:
    """1 / sqrt(mean(x^2) + eps) over the last axis, in float32; with `model_axis` (inside
    `jax.shard_map`) the axis is this device's slice of one split over that mesh axis."""
    x32 = x_BTD.astype(jnp.float32)
    sum_sq, count = jnp.sum(x32 * x32, axis=-1), x32.shape[-1]
    if model_axis is not None:
        sum_sq, count = jax.lax.psum(sum_sq, model_axis), jax.lax.psum(count, model_axis)
    return jax.lax.rsqrt(sum_sq / count + eps)


def route_normalized(sources_SBTD, inv_rms_SBT, valid, query_D, gain_D, residual_BTD=None, null_D=None,
                     model_axis=None, eps: float = NORM_EPS):
    """Routing given per-source 1/rms. Returns (out_BTD, weights_SBT).

    `null_D` adds one learned source shared by every token (the paper's null source for
    fine-tuning); its weight is 1 - sum(weights_SBT), its 1/rms is taken with `eps` (the
    one the cached `inv_rms_SBT` was computed with).
    With `model_axis` (inside `jax.shard_map`) every D-sized argument is this device's
    slice of a model dimension split over that mesh axis: the partial logits are summed
    with `psum`, and softmax and weighted sum run locally on the slice.

    `sources_SBTD` and `inv_rms_SBT` may also be sequences of S arrays [B, T, D] and [B, T]
    (unrolled layers keep their sources apart: no buffer is copied at a write)."""
    listed = isinstance(sources_SBTD, (tuple, list))
    S = len(sources_SBTD) if listed else sources_SBTD.shape[0]
    B, T, _ = sources_SBTD[0].shape
    dtype = sources_SBTD[0].dtype

    def sum_over_d(partial):
        return partial if model_axis is None else jax.lax.psum(partial, model_axis)

    qg_D = query_D.astype(jnp.float32) * gain_D.astype(jnp.float32)
    if listed:
        logits_SBT = jnp.stack([sum_over_d(jnp.einsum("btd,d->bt", s_BTD.astype(jnp.float32), qg_D)) * inv_BT
                                for s_BTD, inv_BT in zip(sources_SBTD, inv_rms_SBT)])
    else:
        logits_SBT = sum_over_d(jnp.einsum("sbtd,d->sbt", sources_SBTD.astype(jnp.float32), qg_D)) * inv_rms_SBT
    valid_SBT = jnp.broadcast_to(jnp.asarray(valid, bool).reshape(_mask_shape(valid, S)), (S, B, T))
    logits_SBT = jnp.where(valid_SBT, logits_SBT, -jnp.inf)
    if null_D is not None:
        null_D = null_D.astype(jnp.float32)
        null_logit = sum_over_d(jnp.dot(null_D, qg_D)) * inv_rms(null_D, eps, model_axis)
        logits_SBT = jnp.concatenate([logits_SBT, jnp.broadcast_to(null_logit, (1, B, T))], axis=0)
    all_weights = jax.nn.softmax(logits_SBT, axis=0)
    weights_SBT = all_weights[:S]
    if listed:
        out_BTD = sum(w_BT[..., None] * s_BTD.astype(jnp.float32) for w_BT, s_BTD in zip(weights_SBT, sources_SBTD))
    else:
        out_BTD = jnp.einsum("sbt,sbtd->btd", weights_SBT, sources_SBTD.astype(jnp.float32))
    if null_D is not None:
        out_BTD = out_BTD + all_weights[S][..., None] * null_D
    if residual_BTD is not None:
        out_BTD = residual_BTD.astype(jnp.float32) + out_BTD
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
