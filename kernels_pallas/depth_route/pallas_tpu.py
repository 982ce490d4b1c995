"""Depth routing as a Mosaic (Pallas TPU) kernel.

Forward, grid (token tiles, S): each step reads one source tile [tn, D], computes its 1/rms
and logit against q = w * g, and updates a float32 online softmax (running max m, sum l and
weighted sum acc in VMEM); the last step writes out = acc / l (+ residual) and
lse = m + log l. The validity mask [S] is prefetched into SMEM: invalid sources are skipped,
and their index map points at the block already resident, so they cost no HBM traffic.

Backward, grid (token tiles, 2S): phase 0 (j < S) re-reads the valid sources to accumulate
c = sum_k a_k (dout . s_k) with a_k = exp(z_k - lse); phase 1 (j >= S) re-reads them again and
writes ds_k = a_k dout + dz_k inv_k (q - z_k inv_k s_k / D), dz_k = a_k (dout . s_k - c), zeros
for invalid sources, and accumulates dq = sum_tokens dz_k inv_k s_k per tile (summed outside).
So the backward reads every valid source twice, dout once, and writes ds once.

Per-token masks ([S, B, T]) travel as an additive float32 bias [S, tiles, 1, tn].
interpret=True runs the kernels in Pallas' generic (HLO) interpreter; interpret=
pltpu.InterpretParams() in the TPU interpret mode, which also simulates VMEM, DMAs and the
grid's pipelining (slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import out_struct

SQ = getattr(pl, "squeezed", None)  # a squeezed block dimension
VMEM_BUDGET = 12 * 2**20  # estimated VMEM per kernel, under the 16 MiB default scoped limit
MAX_TOKENS = 1024


def block_tokens(N: int, D: int, itemsize: int, per_row: int | None = None) -> int | None:
    """Tokens per tile: the largest divisor of N (a multiple of the sublane packing) whose
    blocks, double-buffered, plus the float32 accumulator and temporaries fit VMEM_BUDGET
    (`per_row` bytes per token; by default the single-query kernels')."""
    per_row = per_row or D * (6 * itemsize + 24)
    cap = max(8, min(MAX_TOKENS, VMEM_BUDGET // per_row))
    if N <= cap:
        return N
    step = 8 * max(1, 4 // itemsize)
    return next((t for t in range(cap - cap % step, 0, -step) if N % t == 0), None)


def unsupported(N: int, D: int, dtype) -> str | None:
    """Why the kernel cannot take these shapes (None if it can)."""
    if block_tokens(N, D, jnp.dtype(dtype).itemsize) is None:
        return f"no token tile divides B*T={N} within the VMEM budget at D={D}"
    return None


def fetch_index(valid_S):
    """Source block to fetch at step s: s if valid, else the last valid one before it (the first
    valid one if none), so that an invalid source re-uses the resident block instead of a DMA."""
    ar_S = jnp.arange(valid_S.shape[0], dtype=jnp.int32)
    last_S = jax.lax.cummax(jnp.where(valid_S > 0, ar_S, -1))
    return jnp.where(last_S < 0, jnp.argmax(valid_S > 0).astype(jnp.int32), last_S)


def _rem(j, S):
    return jax.lax.rem(j, jnp.asarray(S, j.dtype))


def _logit(x_TD, q_1D, eps):
    """Raw logit (q . x) / rms(x) and 1/rms(x), both [tn, 1] float32."""
    inv_T1 = jax.lax.rsqrt(jnp.mean(x_TD * x_TD, axis=-1, keepdims=True) + eps)
    return jnp.sum(x_TD * q_1D, axis=-1, keepdims=True) * inv_T1, inv_T1


def _fwd_kernel(valid_ref, idx_ref, src_ref, q_ref, *refs, eps, has_bias, has_res):
    del idx_ref
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if has_res else None
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    s = pl.program_id(1)

    @pl.when(s == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(valid_ref[s] != 0)
    def _update():
        x_TD = src_ref[...].astype(jnp.float32)
        z_T1, _ = _logit(x_TD, q_ref[...], eps)
        if has_bias:
            z_T1 = z_T1 + bias_ref[...].T
        m_T1 = m_ref[...]
        new_T1 = jnp.maximum(m_T1, z_T1)
        safe_T1 = jnp.where(new_T1 == -jnp.inf, 0.0, new_T1)  # no valid source yet (per-token masks)
        alpha_T1, p_T1 = jnp.exp(m_T1 - safe_T1), jnp.exp(z_T1 - safe_T1)
        l_ref[...] = alpha_T1 * l_ref[...] + p_T1
        acc_ref[...] = alpha_T1 * acc_ref[...] + p_T1 * x_TD
        m_ref[...] = new_T1

    @pl.when(s == pl.num_programs(1) - 1)
    def _finish():
        l_T1 = l_ref[...]
        out_TD = acc_ref[...] * (1.0 / l_T1)
        if has_res:
            out_TD = out_TD + res_ref[...].astype(jnp.float32)
        out_ref[...] = out_TD.astype(out_ref.dtype)
        lse_ref[...] = (m_ref[...] + jnp.log(l_T1)).T


def forward(src_SND, valid_S, bias_SN, q_D, res_ND, *, eps, interpret=False):
    """(out [N, D] in the sources' dtype, lse [tiles, 1, tn] float32)."""
    S, N, D = src_SND.shape
    tn = block_tokens(N, D, src_SND.dtype.itemsize)
    nt = N // tn
    idx = lambda i, s, v, f: (f[s], i, 0)  # noqa: E731
    tile = pl.BlockSpec((tn, D), lambda i, s, v, f: (i, 0))
    in_specs, args = [pl.BlockSpec((SQ, tn, D), idx), pl.BlockSpec((1, D), lambda i, s, v, f: (0, 0))], []
    if bias_SN is not None:
        in_specs.append(pl.BlockSpec((SQ, SQ, 1, tn), lambda i, s, v, f: (f[s], i, 0, 0)))
        args.append(bias_SN.reshape(S, nt, 1, tn))
    if res_ND is not None:
        in_specs.append(tile)
        args.append(res_ND)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(nt, S),
        in_specs=in_specs,
        out_specs=[tile, pl.BlockSpec((SQ, 1, tn), lambda i, s, v, f: (i, 0, 0))],
        scratch_shapes=[pltpu.VMEM((tn, 1), jnp.float32), pltpu.VMEM((tn, 1), jnp.float32),
                        pltpu.VMEM((tn, D), jnp.float32)],
    )
    kernel = functools.partial(_fwd_kernel, eps=eps, has_bias=bias_SN is not None, has_res=res_ND is not None)
    nbytes = src_SND.dtype.itemsize * (S + 1 + (res_ND is not None)) * N * D
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[out_struct((N, D), src_SND.dtype, src_SND), out_struct((nt, 1, tn), jnp.float32, src_SND)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=7 * S * N * D, transcendentals=3 * S * N, bytes_accessed=nbytes),
        interpret=interpret,
        name="depth_route_fwd",
    )(valid_S, fetch_index(valid_S), src_SND, q_D.reshape(1, D), *args)


def _bwd_kernel(valid_ref, idx_ref, src_ref, q_ref, *refs, eps, has_bias, S):
    del idx_ref
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    lse_ref, dout_ref, ds_ref, dq_ref, c_ref = refs
    j, D = pl.program_id(1), dout_ref.shape[1]
    s = _rem(j, S)
    valid = valid_ref[s] != 0

    @pl.when(j == 0)
    def _init():
        c_ref[...] = jnp.zeros(c_ref.shape, jnp.float32)
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    def recompute():
        x_TD, dout_TD = src_ref[...].astype(jnp.float32), dout_ref[...].astype(jnp.float32)
        z_T1, inv_T1 = _logit(x_TD, q_ref[...], eps)
        zb_T1 = z_T1 + bias_ref[...].T if has_bias else z_T1
        a_T1 = jnp.exp(zb_T1 - lse_ref[...].T)
        return x_TD, dout_TD, z_T1, inv_T1, a_T1, jnp.sum(dout_TD * x_TD, axis=-1, keepdims=True)

    @pl.when(jnp.logical_and(j < S, valid))
    def _phase0():
        *_, a_T1, da_T1 = recompute()
        c_ref[...] += a_T1 * da_T1

    @pl.when(jnp.logical_and(j >= S, valid))
    def _phase1():
        x_TD, dout_TD, z_T1, inv_T1, a_T1, da_T1 = recompute()
        g_T1 = a_T1 * (da_T1 - c_ref[...]) * inv_T1  # dz * inv
        ds_TD = a_T1 * dout_TD + g_T1 * (q_ref[...] - (z_T1 * inv_T1 / D) * x_TD)
        ds_ref[...] = ds_TD.astype(ds_ref.dtype)
        dq_ref[...] += jnp.sum(g_T1 * x_TD, axis=0, keepdims=True)

    @pl.when(jnp.logical_and(j >= S, jnp.logical_not(valid)))
    def _zero():
        ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)


def backward(src_SND, valid_S, bias_SN, q_D, lse, dout_ND, *, eps, interpret=False):
    """(ds [S, N, D] in the sources' dtype, dq [D] float32)."""
    S, N, D = src_SND.shape
    nt, _, tn = lse.shape
    tile = pl.BlockSpec((tn, D), lambda i, j, v, f: (i, 0))
    in_specs = [pl.BlockSpec((SQ, tn, D), lambda i, j, v, f: (f[_rem(j, S)], i, 0)),
                pl.BlockSpec((1, D), lambda i, j, v, f: (0, 0))]
    args = []
    if bias_SN is not None:
        in_specs.append(pl.BlockSpec((SQ, SQ, 1, tn), lambda i, j, v, f: (f[_rem(j, S)], i, 0, 0)))
        args.append(bias_SN.reshape(S, nt, 1, tn))
    in_specs += [pl.BlockSpec((SQ, 1, tn), lambda i, j, v, f: (i, 0, 0)), tile]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(nt, 2 * S),
        in_specs=in_specs,
        # ds: during phase 0 the block of source 0 stays resident unwritten; phase 1 writes each.
        out_specs=[pl.BlockSpec((SQ, tn, D), lambda i, j, v, f: (jnp.maximum(j - S, 0), i, 0)),
                   pl.BlockSpec((SQ, 1, D), lambda i, j, v, f: (i, 0, 0))],
        scratch_shapes=[pltpu.VMEM((tn, 1), jnp.float32)],
    )
    kernel = functools.partial(_bwd_kernel, eps=eps, has_bias=bias_SN is not None, S=S)
    nbytes = src_SND.dtype.itemsize * (3 * S + 1) * N * D
    ds_SND, dq_T1D = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[out_struct((S, N, D), src_SND.dtype, src_SND), out_struct((nt, 1, D), jnp.float32, src_SND)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=20 * S * N * D, transcendentals=4 * S * N, bytes_accessed=nbytes),
        interpret=interpret,
        name="depth_route_bwd",
    )(valid_S, fetch_index(valid_S), src_SND, q_D.reshape(1, D), *args, lse, dout_ND)
    return ds_SND, dq_T1D.sum(axis=(0, 1))


# ----------------------------------------------------------------------------- phase one: K queries, one read

def prefix_block_tokens(N: int, D: int, itemsize: int, K: int) -> int | None:
    """Tokens per tile of the K-query kernels: their K float32 [tn, D] blocks (output, or dout in
    the backward), double-buffered, bound the tile, beside the source blocks and temporaries."""
    return block_tokens(N, D, itemsize, per_row=D * (4 * itemsize + 8 * K + 16))


def prefix_unsupported(N: int, D: int, dtype, K: int) -> str | None:
    if prefix_block_tokens(N, D, jnp.dtype(dtype).itemsize, K) is None:
        return f"no token tile divides B*T={N} within the VMEM budget at D={D} with {K} queries"
    return None


def _logits_TK(x_TD, q_KD, eps):
    """Raw logits [tn, K] of K queries (one matmul) and 1/rms(x) [tn, 1], float32."""
    inv_T1 = jax.lax.rsqrt(jnp.mean(x_TD * x_TD, axis=-1, keepdims=True) + eps)
    dots_TK = jax.lax.dot_general(x_TD, q_KD, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)
    return dots_TK * inv_T1, inv_T1


def _prefix_fwd_kernel(valid_ref, idx_ref, src_ref, q_ref, bias_ref, out_ref, lse_ref, m_ref, l_ref, *, eps, K):
    """out_ref (resident across the source axis) is the K float32 accumulators itself."""
    del idx_ref
    s = pl.program_id(1)

    @pl.when(s == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    @pl.when(valid_ref[s] != 0)
    def _update():
        x_TD = src_ref[...].astype(jnp.float32)
        z_TK, _ = _logits_TK(x_TD, q_ref[...], eps)
        z_TK = z_TK + bias_ref[...]  # -inf where source s is masked for query k
        m_TK = m_ref[...]
        new_TK = jnp.maximum(m_TK, z_TK)
        safe_TK = jnp.where(new_TK == -jnp.inf, 0.0, new_TK)  # query k has no valid source yet
        alpha_TK, p_TK = jnp.exp(m_TK - safe_TK), jnp.exp(z_TK - safe_TK)
        l_ref[...] = alpha_TK * l_ref[...] + p_TK
        for k in range(K):
            out_ref[k] = alpha_TK[:, k:k + 1] * out_ref[k] + p_TK[:, k:k + 1] * x_TD
        m_ref[...] = new_TK

    @pl.when(s == pl.num_programs(1) - 1)
    def _finish():
        l_TK = l_ref[...]
        inv_l_TK = 1.0 / l_TK
        for k in range(K):
            out_ref[k] = out_ref[k] * inv_l_TK[:, k:k + 1]
        lse_ref[...] = m_ref[...] + jnp.log(l_TK)


def _prefix_specs(K, D, tn):
    source = pl.BlockSpec((SQ, tn, D), lambda i, s, v, f: (f[s], i, 0))
    queries = pl.BlockSpec((K, D), lambda i, s, v, f: (0, 0))
    bias = pl.BlockSpec((SQ, 1, K), lambda i, s, v, f: (s, 0, 0))
    per_query = pl.BlockSpec((K, tn, D), lambda i, s, v, f: (0, i, 0))
    per_token = pl.BlockSpec((tn, K), lambda i, s, v, f: (i, 0))
    return source, queries, bias, per_query, per_token


def prefix_forward(src_SND, valid_S, bias_SK, q_KD, *, eps, interpret=False):
    """Phase one: (out [K, N, D] float32, lse [K, N] float32) of K queries over the sources.
    `valid_S` (int32): sources valid for some query; `bias_SK`: 0 or -inf per (source, query)."""
    S, N, D = src_SND.shape
    K = q_KD.shape[0]
    tn = prefix_block_tokens(N, D, src_SND.dtype.itemsize, K)
    source, queries, bias, per_query, per_token = _prefix_specs(K, D, tn)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(N // tn, S),
        in_specs=[source, queries, bias],
        out_specs=[per_query, per_token],
        scratch_shapes=[pltpu.VMEM((tn, K), jnp.float32), pltpu.VMEM((tn, K), jnp.float32)],
    )
    nbytes = src_SND.dtype.itemsize * S * N * D + 4 * K * N * D
    out_KND, lse_NK = pl.pallas_call(
        functools.partial(_prefix_fwd_kernel, eps=eps, K=K),
        grid_spec=grid_spec,
        out_shape=[out_struct((K, N, D), jnp.float32, src_SND), out_struct((N, K), jnp.float32, src_SND)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=(4 * K + 3) * S * N * D, transcendentals=(2 * K + 1) * S * N,
                                      bytes_accessed=nbytes),
        interpret=interpret,
        name="depth_route_prefix_fwd",
    )(valid_S, fetch_index(valid_S), src_SND, q_KD, bias_SK.reshape(S, 1, K))
    return out_KND, lse_NK.T  # the kernel keeps tokens on sublanes, K on lanes


def _prefix_bwd_kernel(valid_ref, idx_ref, src_ref, q_ref, bias_ref, lse_ref, c_ref, dout_ref, acc_ref, ds_ref, dq_ref,
                       *, eps, K):
    """ds_ref aliases acc_ref's buffer: a valid source's block is acc + ds; an invalid one is neither
    read nor written (its blocks map to the last valid source's, which stay resident)."""
    del idx_ref
    s, D = pl.program_id(1), src_ref.shape[-1]

    @pl.when(s == 0)
    def _init():
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    @pl.when(valid_ref[s] != 0)
    def _grad():
        x_TD = src_ref[...].astype(jnp.float32)
        q_KD = q_ref[...]
        z_TK, inv_T1 = _logits_TK(x_TD, q_KD, eps)
        a_TK = jnp.exp(z_TK + bias_ref[...] - lse_ref[...])
        ds_TD = acc_ref[...].astype(jnp.float32)
        zg_T1 = jnp.zeros(inv_T1.shape, jnp.float32)
        for k in range(K):
            a_T1, dout_TD = a_TK[:, k:k + 1], dout_ref[k]
            da_T1 = jnp.sum(dout_TD * x_TD, axis=-1, keepdims=True)
            g_T1 = a_T1 * (da_T1 - c_ref[:, k:k + 1]) * inv_T1  # dz_k * inv
            ds_TD = ds_TD + a_T1 * dout_TD + g_T1 * q_KD[k:k + 1, :]
            zg_T1 = zg_T1 + g_T1 * z_TK[:, k:k + 1]
            dq_ref[k:k + 1, :] += jnp.sum(g_T1 * x_TD, axis=0, keepdims=True)
        ds_ref[...] = (ds_TD - (zg_T1 * inv_T1 / D) * x_TD).astype(ds_ref.dtype)


def prefix_backward(src_SND, valid_S, bias_SK, q_KD, lse_KN, c_KN, dout_KND, acc_SND, *, eps, interpret=False):
    """(acc + ds [S, N, D], dq [K, D] float32) in one read of the valid sources, the sources'
    gradient added into `acc_SND` in place (aliased: slots no query reads are not touched);
    `c_KN` = dout_k . out_k - dlse_k per token (the softmax's shift, from the forward's output)."""
    S, N, D = src_SND.shape
    K = q_KD.shape[0]
    tn = prefix_block_tokens(N, D, src_SND.dtype.itemsize, K)
    nt = N // tn
    source, queries, bias, per_query, per_token = _prefix_specs(K, D, tn)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(nt, S),
        in_specs=[source, queries, bias, per_token, per_token, per_query, source],
        out_specs=[source, pl.BlockSpec((SQ, K, D), lambda i, s, v, f: (i, 0, 0))],
    )
    nbytes = src_SND.dtype.itemsize * 3 * S * N * D + 4 * K * N * D
    args = (valid_S, fetch_index(valid_S), src_SND, q_KD, bias_SK.reshape(S, 1, K), lse_KN.T, c_KN.T, dout_KND,
            acc_SND.astype(src_SND.dtype))
    ds_SND, dq_TKD = pl.pallas_call(
        functools.partial(_prefix_bwd_kernel, eps=eps, K=K),
        grid_spec=grid_spec,
        out_shape=[out_struct((S, N, D), src_SND.dtype, src_SND), out_struct((nt, K, D), jnp.float32, src_SND)],
        input_output_aliases={len(args) - 1: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=(10 * K + 4) * S * N * D, transcendentals=(K + 1) * S * N,
                                      bytes_accessed=nbytes),
        interpret=interpret,
        name="depth_route_prefix_bwd",
    )(*args)
    return ds_SND, dq_TKD.sum(axis=0)
