"""The other depth-mixing families, beside routing: hyper-connections, manifold-constrained
hyper-connections (mHC) and DenseFormer's depth-weighted averages (docs/explanations/modes.md).

Hyper-connections (`hyper`) and mHC (`mhc`) carry R parallel residual streams H [R, B, T, D]
(the embedding repeated R times). Sublayer j reads one input from them, and writes its output
back into every stream while the streams mix:

    x_j = sum_i read_i H_i                   H'_k = sum_i mix_ik H_i + write_k f_j(x_j)

- `hyper` (static): read = e_(j mod R) + a, mix = I + M, write = 1 + b, the learned offsets
  a, M, b zero at initialisation (the paper's start, a plain residual in every stream). Dynamic
  (`dynamic=True`): each coefficient gains s * tanh(RMSNorm(H_i) W), W zero and s = 0.01 at
  initialisation.
- `mhc`: from the flattened, RMS-normalised streams h = H / rms(H) [R D], logits
  z = h phi [R (R + 2)]; read = sigmoid(s_1 z_read + b_read), write = 2 sigmoid(s_2 z_write +
  b_write), mix = Sinkhorn(s_3 z_mix + b_mix)^T: the stream-mixing matrix is doubly stochastic
  (`sinkhorn`, float32), its rows and columns summing to 1, and read and write are positive. phi
  is random (fan-in normal), s = 0.01 and b = 0 at initialisation, as MaxText and Megatron start it:
  not a plain residual.

The stack's output is the sum of the streams (before the final norm: with every stream equal,
that is R h, which the norm maps to the norm of h up to its epsilon).

DenseFormer (`denseformer`): X_0 is the embedding and X_l the stream after layer l; after layer
l (1-based) the stream becomes the depth-weighted average Y_l = sum_j alpha_lj X_j over j = 0..l
with l - j a multiple of `dilation`, and only where l is a multiple of `period`. alpha = e_l + w,
w zero at initialisation: a plain residual.

Coefficients are computed in float32 (float64 for float64 inputs) and the streams combined so, then cast to the
streams' dtype. Each function is the pure math; the linen modules (`HyperConnection`,
`DepthWeights`) hold the parameters, deltares.nn.nnx their NNX counterparts.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltares.nn import routing
from deltares.nn.axes import SOURCES_AXES, constrain

F32 = jnp.float32
acc_of = routing.accumulation_dtype  # float32, or float64 for float64 inputs (tests)
SCALE_INIT = 0.01  # the dynamic terms' and mHC's learned scales at initialisation (both papers)
SINKHORN_EPS = 1e-6


# ----------------------------------------------------------------------------- streams

def expand_streams(e_BTD, n: int):
    """H [R, B, T, D]: the embedding in each of the R = n streams."""
    return constrain(jnp.broadcast_to(e_BTD[None], (n,) + e_BTD.shape), SOURCES_AXES)


def reduce_streams(H_RBTD):
    """The stack's output: the sum of the streams [B, T, D] (float32 sum, the streams' dtype)."""
    return jnp.sum(H_RBTD.astype(acc_of(H_RBTD.dtype)), axis=0).astype(H_RBTD.dtype)


def read_streams(H_RBTD, read_BTR):
    """x = sum_i read_i H_i [B, T, D]. Written as products and a sum over the few streams (not a
    matrix product with batch axes, which XLA would feed with transposed copies of the streams), so
    that it compiles to one elementwise pass."""
    acc = acc_of(H_RBTD.dtype)
    read_RBT1 = jnp.moveaxis(read_BTR.astype(acc), -1, 0)[..., None]
    return jnp.sum(H_RBTD.astype(acc) * read_RBT1, axis=0).astype(H_RBTD.dtype)


def write_streams(H_RBTD, mix_BTRR, write_BTR, y_BTD):
    """H'_k = sum_i mix_ik H_i + write_k y [R, B, T, D], one elementwise pass (as `read_streams`)."""
    acc = acc_of(H_RBTD.dtype)
    mix_RKBT1 = jnp.moveaxis(mix_BTRR.astype(acc), (-2, -1), (0, 1))[..., None]
    write_KBT1 = jnp.moveaxis(write_BTR.astype(acc), -1, 0)[..., None]
    out = jnp.sum(H_RBTD.astype(acc)[:, None] * mix_RKBT1, axis=0) + write_KBT1 * y_BTD.astype(acc)[None]
    return constrain(out.astype(H_RBTD.dtype), SOURCES_AXES)


def sinkhorn(logits_XRR, iterations: int, eps: float = SINKHORN_EPS):
    """The Sinkhorn-Knopp projection of logits [..., R, R] onto doubly stochastic matrices, float32:
    exp of the logits normalised by rows (a softmax, so no row underflows to zeros whatever the
    logits), plus `eps`, then `iterations` alternations of column and row normalisation. Rows end
    summing to 1 exactly; columns to 1 within what the iterations reach."""
    def step(_, m):
        m = m / jnp.sum(m, axis=-2, keepdims=True)
        return m / jnp.sum(m, axis=-1, keepdims=True)

    m = jax.nn.softmax(logits_XRR.astype(acc_of(logits_XRR.dtype)), axis=-1) + eps
    return jax.lax.fori_loop(0, iterations, step, m)


# ----------------------------------------------------------------------------- hyper-connections

def hyper_params_shapes(n: int, d_model: int, dynamic: bool) -> dict:
    """The parameters of one sublayer's hyper-connection: {name: (shape, initial value or None
    for the random phi, logical axes)}."""
    out = {"read": ((n,), 0.0, (None,)), "mix": ((n, n), 0.0, (None, None)), "write": ((n,), 0.0, (None,))}
    if dynamic:
        out.update({"w_read": ((d_model,), 0.0, ("embed",)), "w_mix": ((d_model, n), 0.0, ("embed", None)),
                    "w_write": ((d_model,), 0.0, ("embed",)), "s_alpha": ((1,), SCALE_INIT, (None,)),
                    "s_beta": ((1,), SCALE_INIT, (None,))})
    return out


def mhc_params_shapes(n: int, d_model: int) -> dict:
    """The parameters of one sublayer's mHC (as `hyper_params_shapes`): phi [R, D, R (R + 2)], the
    three scales (read, write, mix) and the biases [R (R + 2)]."""
    return {"phi": ((n, d_model, n * (n + 2)), None, (None, "embed", None)), "scale": ((3,), SCALE_INIT, (None,)),
            "bias": ((n * (n + 2),), 0.0, (None,))}


def hyper_coefficients(params, H_RBTD, j, *, eps: float = routing.NORM_EPS):
    """Sublayer j's (read [B, T, R], mix [B, T, R, R], write [B, T, R]) of a hyper-connection with
    parameters `params` (`hyper_params_shapes`; dynamic where it holds `w_read`), float32."""
    n, F = H_RBTD.shape[0], acc_of(H_RBTD.dtype)
    batch = H_RBTD.shape[1:3]
    read = jax.nn.one_hot(j % n, n, dtype=F) + params["read"].astype(F)
    mix = jnp.eye(n, dtype=F) + params["mix"].astype(F)
    write = 1.0 + params["write"].astype(F)
    read, mix, write = (jnp.broadcast_to(c, batch + c.shape) for c in (read, mix, write))
    if "w_read" not in params:
        return read, mix, write
    # norm(H_i) W = (H_i W) / rms(H_i): one product of the streams with the three projections side by side
    # (W in the streams' dtype, accumulated in float32), scaled after, so no normalised copy is made
    W_DK = jnp.concatenate([params["w_read"][:, None], params["w_mix"], params["w_write"][:, None]], axis=1)
    z_BTRK = jnp.einsum("rbtd,dk->btrk", H_RBTD, W_DK.astype(H_RBTD.dtype), preferred_element_type=F)
    z_BTRK = z_BTRK * jnp.moveaxis(routing.inv_rms(H_RBTD, eps), 0, -1)[..., None]
    s_alpha, s_beta = params["s_alpha"].astype(F)[0], params["s_beta"].astype(F)[0]
    read = read + s_alpha * jnp.tanh(z_BTRK[..., 0])
    mix = mix + s_alpha * jnp.tanh(z_BTRK[..., 1: n + 1])
    write = write + s_beta * jnp.tanh(z_BTRK[..., n + 1])
    return read, mix, write


def mhc_coefficients(params, H_RBTD, *, iterations: int, eps: float = routing.NORM_EPS):
    """(read, mix, write) of an mHC with parameters `params` (`mhc_params_shapes`), float32: read and
    write positive, mix doubly stochastic."""
    n, F = H_RBTD.shape[0], acc_of(H_RBTD.dtype)
    H32 = H_RBTD.astype(F)
    inv_BT = jax.lax.rsqrt(jnp.mean(H32 * H32, axis=(0, 3)) + eps)  # RMS of the flattened R D
    z = jnp.einsum("rbtd,rdk->btk", H_RBTD, params["phi"].astype(H_RBTD.dtype), preferred_element_type=F)
    z = z * inv_BT[..., None]  # (H / rms) phi, scaled after the product (as `hyper_coefficients`)
    s, b = params["scale"].astype(F), params["bias"].astype(F)
    read = jax.nn.sigmoid(s[0] * z[..., :n] + b[:n])
    write = 2.0 * jax.nn.sigmoid(s[1] * z[..., n: 2 * n] + b[n: 2 * n])
    res = sinkhorn((s[2] * z[..., 2 * n:] + b[2 * n:]).reshape(z.shape[:-1] + (n, n)), iterations)  # H' = res H
    return read, jnp.swapaxes(res, -1, -2), write


# ----------------------------------------------------------------------------- DenseFormer

def dwa_tables(n_layers: int, dilation: int = 1, period: int = 1):
    """(valid [L, L + 1] bool: the outputs X_j layer l's average reads; applies [L] bool: whether
    layer l averages at all). Layer l (0-based) closes with X_(l+1)."""
    i = np.arange(1, n_layers + 1)[:, None]
    j = np.arange(n_layers + 1)[None, :]
    valid = (j <= i) & ((i - j) % dilation == 0)
    applies = (np.arange(1, n_layers + 1) % period) == 0
    return valid, applies


def dwa_weights(params, layer, n_slots: int):
    """alpha [L + 1] of layer `layer` (0-based; may be traced): e_(layer + 1) + w, float32."""
    F = acc_of(params["weights"].dtype)
    return jax.nn.one_hot(layer + 1, n_slots, dtype=F) + params["weights"].astype(F)


def dwa_average(alpha_S, sources, valid_S):
    """sum_j alpha_j X_j over the valid outputs: `sources` an array [S, B, T, D] or a tuple of the S
    outputs so far (`valid_S` a NumPy mask then, and as long)."""
    if isinstance(sources, tuple):
        terms = [alpha_S[s] * x.astype(acc_of(x.dtype)) for s, x in enumerate(sources) if valid_S[s]]
        return sum(terms[1:], terms[0]).astype(sources[0].dtype)
    a = jnp.where(jnp.asarray(valid_S), alpha_S, 0.0)[: sources.shape[0]]
    return jnp.einsum("s,sbtd->btd", a, sources.astype(acc_of(sources.dtype))).astype(sources.dtype)


def depth_average(weights_S, sources, layer, valid_S, stats: bool = False):
    """What layer `layer`'s DenseFormer weights w [L + 1] do: the average of `dwa_average` with
    alpha = e_(layer+1) + w, or with `stats` alpha's statistics over the valid outputs."""
    alpha_S = dwa_weights({"weights": weights_S}, layer, weights_S.shape[0])
    if stats:
        return weight_stats(jnp.where(jnp.asarray(valid_S), alpha_S, 0.0), True)
    return dwa_average(alpha_S, sources, valid_S)


# ----------------------------------------------------------------------------- statistics

def weight_stats(w_XS, routed):
    """The statistics `deltares.nn.routed.routing_stats` gives, of mixing weights w [..., S] that
    need not be positive nor sum to 1: the mean weight of each slot [S], the mean largest |w| and
    the mean entropy of |w| / sum |w|; zeros where not `routed`. No gradient flows through them."""
    w_XS = jax.lax.stop_gradient(w_XS.astype(F32))
    scale = jnp.asarray(routed, F32)
    p = jnp.abs(w_XS) / jnp.maximum(jnp.sum(jnp.abs(w_XS), axis=-1, keepdims=True), 1e-30)
    entropy = -jnp.sum(p * jnp.log(jnp.where(p > 0, p, 1.0)), axis=-1)
    lead = tuple(range(w_XS.ndim - 1))
    return dict(weights=w_XS.mean(axis=lead) * scale, max_weight=jnp.abs(w_XS).max(axis=-1).mean() * scale,
                entropy=entropy.mean() * scale)


# ----------------------------------------------------------------------------- linen modules

PHI_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=(0, 1), out_axis=2)


def initializer(value):
    """The initialiser of a parameter of `connection_shapes`: PHI_INIT for None, else a constant."""
    return PHI_INIT if value is None else jax.nn.initializers.constant(value)


def connection_shapes(n: int, d_model: int, mhc: bool, dynamic: bool) -> dict:
    """A (manifold-constrained) hyper-connection's parameters: {name: (shape, initial value or None, axes)}."""
    return mhc_params_shapes(n, d_model) if mhc else hyper_params_shapes(n, d_model, dynamic)


def connect(params, H_RBTD, j, y_BTD=None, stats: bool = False, *, iterations: int = 20,
            eps: float = routing.NORM_EPS):
    """What a hyper-connection with `params` (mHC where they hold `phi`) does for sublayer j: its input
    [B, T, D] from the streams; given the sublayer's output `y_BTD`, the streams after it; with `stats`,
    the read weights' statistics."""
    if "phi" in params:
        read, mix, write = mhc_coefficients(params, H_RBTD, iterations=iterations, eps=eps)
    else:
        read, mix, write = hyper_coefficients(params, H_RBTD, j, eps=eps)
    if stats:
        return weight_stats(read, True)
    if y_BTD is None:
        return read_streams(H_RBTD, read)
    return write_streams(H_RBTD, mix, write, y_BTD)


def _declare(module: nn.Module, shapes: dict, param_dtype) -> dict:
    """The parameters of `shapes` on a linen module, each with its logical axes."""
    return {name: module.param(name, nn.with_logical_partitioning(initializer(value), axes), shape, param_dtype)
            for name, (shape, value, axes) in shapes.items()}


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection (`mhc=False`) or manifold-constrained hyper-connection: its
    read, write and stream-mixing parameters (module doc). `module(H, j)` is sublayer j's input
    [B, T, D] from the streams [R, B, T, D]; `module(H, j, y)` the streams after it wrote its
    output y; `module(H, j, stats=True)` the read weights' statistics (`weight_stats`).

    Example:
        ```python
        import jax
        from deltares.nn.mixing import HyperConnection, expand_streams

        H_RBTD = expand_streams(jax.numpy.ones((2, 3, 8)), 4)
        hc = HyperConnection(streams=4)
        variables = hc.init(jax.random.key(0), H_RBTD, 0)
        x_BTD = hc.apply(variables, H_RBTD, 0)              # stream 0 at initialisation
        H_RBTD = hc.apply(variables, H_RBTD, 0, 2 * x_BTD)  # every stream gains the output
        print(x_BTD.shape, H_RBTD[:, 0, 0, 0])  # (2, 3, 8) [3. 3. 3. 3.]
        ```
    """

    streams: int = 4
    mhc: bool = False
    dynamic: bool = True
    sinkhorn_iterations: int = 20
    epsilon: float = routing.NORM_EPS
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, H_RBTD, j, y_BTD=None, stats: bool = False):
        if H_RBTD.ndim != 4 or H_RBTD.shape[0] != self.streams:
            raise ValueError(f"the hyper-connection's streams are [R={self.streams}, B, T, D], got {H_RBTD.shape}")
        params = _declare(self, connection_shapes(self.streams, H_RBTD.shape[-1], self.mhc, self.dynamic),
                          self.param_dtype)
        return connect(params, H_RBTD, j, y_BTD, stats, iterations=self.sinkhorn_iterations, eps=self.epsilon)


class DepthWeights(nn.Module):
    """One layer's DenseFormer weights w [L + 1] (zeros): `module(sources, layer, valid)` is the
    depth-weighted average of the layer outputs in `sources` (`dwa_average` with alpha =
    e_(layer+1) + w); with `stats=True` alpha's statistics over the valid outputs."""

    n_slots: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, sources, layer, valid_S, stats: bool = False):
        w = self.param("weights", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (self.n_slots,),
                       self.param_dtype)
        return depth_average(w, sources, layer, valid_S, stats)


__all__ = ["DepthWeights", "HyperConnection", "connect", "connection_shapes", "depth_average", "dwa_average", "dwa_tables", "dwa_weights", "expand_streams",
           "hyper_coefficients", "mhc_coefficients", "read_streams", "reduce_streams", "sinkhorn", "weight_stats",
           "write_streams"]
