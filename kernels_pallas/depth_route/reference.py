"""The "xla" implementation: the kernels' pure-jnp oracle (XLA autodiff), standalone.

    z_i = w . RMSNorm_g(s_i)    a = softmax_i(z) over valid sources    out = [residual +] sum_i a_i s_i

Logits, softmax and sums are float32 (float64 for float64 sources); the output has the sources'
dtype. deltares' own routing (deltares.nn.routing) computes the same function; its tests hold the
two to each other and to NumPy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NORM_EPS = 1e-6  # the key norm's default epsilon


def _acc(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def inv_rms(x, eps: float = NORM_EPS):
    """1 / sqrt(mean(x^2) + eps) over the last axis, in float32 (float64 for float64 input)."""
    x32 = x.astype(_acc(x.dtype))
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)


def valid_mask(valid, S: int):
    """`valid` ([S] or broadcastable to [S, B, T]) as a bool array of rank 3; ValueError on a wrong
    leading size."""
    valid = jnp.asarray(valid, bool)
    if valid.ndim and valid.shape[0] != S:
        raise ValueError(f"valid has leading size {valid.shape[0]}, expected the number of sources {S}")
    return valid.reshape(valid.shape + (1,) * (3 - valid.ndim))


def check(sources, valid, query, gain, residual=None) -> None:
    """ValueError naming the argument whose shape does not fit [S, B, T, D] sources (an array, or
    anything with its shape)."""
    shape = tuple(getattr(sources, "shape", jnp.shape(sources)))
    if len(shape) != 4:
        raise ValueError(f"sources must be [S, B, T, D], got shape {shape}")
    S, D = shape[0], shape[-1]
    for name, vec in (("query", query), ("gain", gain)):
        if jnp.shape(vec) != (D,):
            raise ValueError(f"{name} must have shape ({D},), got {jnp.shape(vec)}")
    if residual is not None and jnp.shape(residual) != shape[1:]:
        raise ValueError(f"residual must have shape {shape[1:]}, got {jnp.shape(residual)}")
    valid_mask(valid, S)


def depth_route(sources, valid, query, gain, residual=None, *, eps=NORM_EPS):
    """Route over `sources` [S, B, T, D] with pseudo-query `query` and key-norm gain `gain` [D]: the
    routed output [B, T, D] (plus `residual` where given), in the sources' dtype."""
    check(sources, valid, query, gain, residual)
    acc = _acc(sources.dtype)
    s32 = sources.astype(acc)
    logits_SBT = jnp.einsum("sbtd,d->sbt", s32, query.astype(acc) * gain.astype(acc)) * inv_rms(sources, eps)
    logits_SBT = jnp.where(valid_mask(valid, sources.shape[0]), logits_SBT, -jnp.inf)
    out = jnp.einsum("sbt,sbtd->btd", jax.nn.softmax(logits_SBT, axis=0), s32)
    if residual is not None:
        out = residual.astype(acc) + out
    return out.astype(sources.dtype)


def route_prefix(sources, valid_KS, queries_KD, gains_KD, *, eps=NORM_EPS):
    """K queries over the same sources [S, B, T, D], query k over the sources of `valid_KS`: (out [K, B, T, D],
    lse [K, B, T]) in float32, each query's routed output and the log-sum-exp of its logits."""
    acc = _acc(sources.dtype)
    s32 = sources.astype(acc)
    logits_KSBT = jnp.einsum("sbtd,kd->ksbt", s32, queries_KD.astype(acc) * gains_KD.astype(acc))
    logits_KSBT = logits_KSBT * inv_rms(sources, eps)[None]
    logits_KSBT = jnp.where(jnp.asarray(valid_KS, bool)[:, :, None, None], logits_KSBT, -jnp.inf)
    lse_KBT = jax.nn.logsumexp(logits_KSBT, axis=1)
    out_KBTD = jnp.einsum("ksbt,sbtd->kbtd", jnp.exp(logits_KSBT - lse_KBT[:, None]), s32)
    return out_KBTD.astype(jnp.float32), lse_KBT.astype(jnp.float32)
