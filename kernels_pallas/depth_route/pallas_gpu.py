"""Depth routing as a Pallas Triton (GPU) kernel.

Grid over token tiles of tn rows; each program holds its rows' full D (padded to a power of
two, as Triton requires, and masked) in registers and loops over the S sources
(`fori_loop`; invalid sources are skipped by a `cond` and never loaded):

  forward:  float32 online softmax (running max, sum, weighted sum), then out = acc / l
            (+ residual) and lse = m + log l per token;
  backward: loop 1 accumulates c = sum_k a_k (dout . s_k), loop 2 writes
            ds_k = a_k dout + dz_k inv_k (q - z_k inv_k s_k / D) (zeros for invalid sources)
            and a per-program partial dq = sum_rows dz_k inv_k s_k, summed outside.

Untuned: no GPU was available when it was written; it is checked in interpret mode and by
lowering to Triton IR for CUDA on a CPU machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import out_struct

TILE_ELEMS = 8192  # tn * padded D held per program (registers)
MAX_D = 8192


def block_tokens(N: int, D: int) -> int:
    """Rows per program: a power of two with rows * next_pow2(D) <= TILE_ELEMS."""
    return max(1, min(TILE_ELEMS // pl.next_power_of_2(D), pl.next_power_of_2(N), 64))


def unsupported(N: int, D: int, dtype) -> str | None:
    del N, dtype
    return f"D={D} exceeds {MAX_D} (a row must fit one program's registers)" if D > MAX_D else None


def _params(tn, D):
    return plgpu.CompilerParams(num_warps=8 if tn * pl.next_power_of_2(D) > 2048 else 4, num_stages=2)


def _tile(N, D, tn):
    """Row and column indices of this program's tile and their masks."""
    rows = pl.program_id(0) * tn + jnp.arange(tn)
    cols = jnp.arange(pl.next_power_of_2(D))
    rmask, cmask = rows < N, cols < D
    return rows, cols, rmask, cmask, rmask[:, None] & cmask[None, :]


def _load_tile(ref, s, rows, cols, mask):
    return plgpu.load(ref.at[s, rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)


def _logit(x_TD, q_D, D, eps):
    inv_T = jax.lax.rsqrt(jnp.sum(x_TD * x_TD, axis=1) / D + eps)
    return jnp.sum(x_TD * q_D[None, :], axis=1) * inv_T, inv_T


def _fwd_kernel(valid_ref, src_ref, q_ref, *refs, N, D, tn, eps, has_bias, has_res):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if has_res else None
    out_ref, lse_ref = refs
    rows, cols, rmask, cmask, mask = _tile(N, D, tn)
    q_D = plgpu.load(q_ref.at[cols], mask=cmask, other=0.0)

    def update(s, carry):
        m_T, l_T, acc_TD = carry
        x_TD = _load_tile(src_ref, s, rows, cols, mask)
        z_T, _ = _logit(x_TD, q_D, D, eps)
        if has_bias:
            z_T = z_T + plgpu.load(bias_ref.at[s, rows], mask=rmask, other=0.0)
        new_T = jnp.maximum(m_T, z_T)
        safe_T = jnp.where(new_T == -jnp.inf, 0.0, new_T)
        alpha_T, p_T = jnp.exp(m_T - safe_T), jnp.exp(z_T - safe_T)
        return new_T, alpha_T * l_T + p_T, alpha_T[:, None] * acc_TD + p_T[:, None] * x_TD

    def body(s, carry):
        return jax.lax.cond(valid_ref[s] != 0, functools.partial(update, s), lambda c: c, carry)

    init = (jnp.full((tn,), -jnp.inf, jnp.float32), jnp.zeros((tn,), jnp.float32),
            jnp.zeros((tn, cols.shape[0]), jnp.float32))
    m_T, l_T, acc_TD = jax.lax.fori_loop(0, src_ref.shape[0], body, init)
    out_TD = acc_TD * (1.0 / l_T)[:, None]
    if has_res:
        out_TD = out_TD + plgpu.load(res_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(
            jnp.float32)
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], out_TD.astype(out_ref.dtype), mask=mask)
    plgpu.store(lse_ref.at[rows], m_T + jnp.log(l_T), mask=rmask)


def forward(src_SND, valid_S, bias_SN, q_D, res_ND, *, eps, interpret=False):
    """(out [N, D] in the sources' dtype, lse [N] float32)."""
    S, N, D = src_SND.shape
    tn = block_tokens(N, D)
    args = [a for a in (bias_SN, res_ND) if a is not None]
    kernel = functools.partial(_fwd_kernel, N=N, D=D, tn=tn, eps=eps, has_bias=bias_SN is not None,
                               has_res=res_ND is not None)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, tn),),
        out_shape=[out_struct((N, D), src_SND.dtype, src_SND), out_struct((N,), jnp.float32, src_SND)],
        compiler_params=_params(tn, D),
        interpret=interpret,
        name="depth_route_fwd",
    )(valid_S, src_SND, q_D, *args)


def _bwd_kernel(valid_ref, src_ref, q_ref, *refs, N, D, tn, eps, has_bias):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    lse_ref, dout_ref, ds_ref, dq_ref = refs
    rows, cols, rmask, cmask, mask = _tile(N, D, tn)
    q_D = plgpu.load(q_ref.at[cols], mask=cmask, other=0.0)
    lse_T = plgpu.load(lse_ref.at[rows], mask=rmask, other=0.0)
    dout_TD = plgpu.load(dout_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0).astype(jnp.float32)

    def recompute(s):
        x_TD = _load_tile(src_ref, s, rows, cols, mask)
        z_T, inv_T = _logit(x_TD, q_D, D, eps)
        zb_T = z_T + plgpu.load(bias_ref.at[s, rows], mask=rmask, other=0.0) if has_bias else z_T
        return x_TD, z_T, inv_T, jnp.exp(zb_T - lse_T), jnp.sum(dout_TD * x_TD, axis=1)

    def phase0(s, c_T):
        def add(c_T):
            *_, a_T, da_T = recompute(s)
            return c_T + a_T * da_T

        return jax.lax.cond(valid_ref[s] != 0, add, lambda c: c, c_T)

    S = src_ref.shape[0]
    c_T = jax.lax.fori_loop(0, S, phase0, jnp.zeros((tn,), jnp.float32))

    def phase1(s, dq_D):
        def grad(dq_D):
            x_TD, z_T, inv_T, a_T, da_T = recompute(s)
            g_T = a_T * (da_T - c_T) * inv_T
            ds_TD = a_T[:, None] * dout_TD + g_T[:, None] * (q_D[None, :] - (z_T * inv_T / D)[:, None] * x_TD)
            plgpu.store(ds_ref.at[s, rows[:, None], cols[None, :]], ds_TD.astype(ds_ref.dtype), mask=mask)
            return dq_D + jnp.sum(g_T[:, None] * x_TD, axis=0)

        def zero(dq_D):
            plgpu.store(ds_ref.at[s, rows[:, None], cols[None, :]], jnp.zeros(dout_TD.shape, ds_ref.dtype),
                        mask=mask)
            return dq_D

        return jax.lax.cond(valid_ref[s] != 0, grad, zero, dq_D)

    dq_D = jax.lax.fori_loop(0, S, phase1, jnp.zeros(cols.shape, jnp.float32))
    plgpu.store(dq_ref.at[pl.program_id(0), cols], dq_D, mask=cmask)


def backward(src_SND, valid_S, bias_SN, q_D, lse_N, dout_ND, *, eps, interpret=False):
    """(ds [S, N, D] in the sources' dtype, dq [D] float32)."""
    S, N, D = src_SND.shape
    tn = block_tokens(N, D)
    nt = pl.cdiv(N, tn)
    kernel = functools.partial(_bwd_kernel, N=N, D=D, tn=tn, eps=eps, has_bias=bias_SN is not None)
    ds_SND, dq_TD = pl.pallas_call(
        kernel,
        grid=(nt,),
        out_shape=[out_struct((S, N, D), src_SND.dtype, src_SND), out_struct((nt, D), jnp.float32, src_SND)],
        compiler_params=_params(tn, D),
        interpret=interpret,
        name="depth_route_bwd",
    )(valid_S, src_SND, q_D, *[a for a in (bias_SN,) if a is not None], lse_N, dout_ND)
    return ds_SND, dq_TD.sum(axis=0)


# ----------------------------------------------------------------------------- phase one: K queries, one read

def prefix_block_tokens(N: int, D: int, K: int) -> int:
    """Rows per program of the K-query kernels: K [rows, next_pow2(D)] accumulators in registers."""
    return max(1, min(TILE_ELEMS // (K * pl.next_power_of_2(D)), pl.next_power_of_2(N), 64))


def prefix_unsupported(N: int, D: int, dtype, K: int) -> str | None:
    del K
    return unsupported(N, D, dtype)


def _logits_K(x_TD, q_K, bias_ref, s, D, eps):
    """The K queries' logits [tn] each (bias: -inf where source s is masked for query k), and 1/rms."""
    inv_T = jax.lax.rsqrt(jnp.sum(x_TD * x_TD, axis=1) / D + eps)
    raw = [jnp.sum(x_TD * q_D[None, :], axis=1) * inv_T for q_D in q_K]
    return raw, [z_T + bias_ref[s, k] for k, z_T in enumerate(raw)], inv_T


def _prefix_fwd_kernel(valid_ref, src_ref, q_ref, bias_ref, out_ref, lse_ref, *, N, D, tn, K, eps):
    rows, cols, rmask, cmask, mask = _tile(N, D, tn)
    q_K = [plgpu.load(q_ref.at[k, cols], mask=cmask, other=0.0) for k in range(K)]

    def update(s, carry):
        x_TD = _load_tile(src_ref, s, rows, cols, mask)
        _, z_K, _ = _logits_K(x_TD, q_K, bias_ref, s, D, eps)
        new = []
        for (m_T, l_T, acc_TD), z_T in zip(carry, z_K):
            new_T = jnp.maximum(m_T, z_T)
            safe_T = jnp.where(new_T == -jnp.inf, 0.0, new_T)
            alpha_T, p_T = jnp.exp(m_T - safe_T), jnp.exp(z_T - safe_T)
            new.append((new_T, alpha_T * l_T + p_T, alpha_T[:, None] * acc_TD + p_T[:, None] * x_TD))
        return tuple(new)

    def body(s, carry):
        return jax.lax.cond(valid_ref[s] != 0, functools.partial(update, s), lambda c: c, carry)

    init = tuple((jnp.full((tn,), -jnp.inf, jnp.float32), jnp.zeros((tn,), jnp.float32),
                  jnp.zeros((tn, cols.shape[0]), jnp.float32)) for _ in range(K))
    for k, (m_T, l_T, acc_TD) in enumerate(jax.lax.fori_loop(0, src_ref.shape[0], body, init)):
        plgpu.store(out_ref.at[k, rows[:, None], cols[None, :]], acc_TD * (1.0 / l_T)[:, None], mask=mask)
        plgpu.store(lse_ref.at[k, rows], m_T + jnp.log(l_T), mask=rmask)


def prefix_forward(src_SND, valid_S, bias_SK, q_KD, *, eps, interpret=False):
    """Phase one: (out [K, N, D] float32, lse [K, N] float32) of K queries over the sources.
    `valid_S` (int32): sources valid for some query; `bias_SK`: 0 or -inf per (source, query)."""
    S, N, D = src_SND.shape
    K = q_KD.shape[0]
    tn = prefix_block_tokens(N, D, K)
    kernel = functools.partial(_prefix_fwd_kernel, N=N, D=D, tn=tn, K=K, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, tn),),
        out_shape=[out_struct((K, N, D), jnp.float32, src_SND), out_struct((K, N), jnp.float32, src_SND)],
        compiler_params=_params(tn, K * D),
        interpret=interpret,
        name="depth_route_prefix_fwd",
    )(valid_S, src_SND, q_KD, bias_SK)


def _prefix_bwd_kernel(valid_ref, src_ref, q_ref, bias_ref, lse_ref, c_ref, dout_ref, acc_ref, ds_ref, dq_ref, *, N, D,
                       tn, K, eps):
    """ds_ref aliases acc_ref's buffer: a valid source's tile becomes acc + ds, an invalid one is not touched."""
    rows, cols, rmask, cmask, mask = _tile(N, D, tn)
    q_K = [plgpu.load(q_ref.at[k, cols], mask=cmask, other=0.0) for k in range(K)]
    lse_K = [plgpu.load(lse_ref.at[k, rows], mask=rmask, other=0.0) for k in range(K)]
    c_K = [plgpu.load(c_ref.at[k, rows], mask=rmask, other=0.0) for k in range(K)]
    dout_K = [plgpu.load(dout_ref.at[k, rows[:, None], cols[None, :]], mask=mask, other=0.0) for k in range(K)]

    def grad(s, dq_K):
        x_TD = _load_tile(src_ref, s, rows, cols, mask)
        raw_K, z_K, inv_T = _logits_K(x_TD, q_K, bias_ref, s, D, eps)
        ds_TD, zg_T, new_dq = _load_tile(acc_ref, s, rows, cols, mask), jnp.zeros_like(inv_T), []
        for k in range(K):
            a_T = jnp.exp(z_K[k] - lse_K[k])
            g_T = a_T * (jnp.sum(dout_K[k] * x_TD, axis=1) - c_K[k]) * inv_T  # dz_k * inv
            ds_TD = ds_TD + a_T[:, None] * dout_K[k] + g_T[:, None] * q_K[k][None, :]
            zg_T = zg_T + g_T * raw_K[k]
            new_dq.append(dq_K[k] + jnp.sum(g_T[:, None] * x_TD, axis=0))
        ds_TD = ds_TD - (zg_T * inv_T / D)[:, None] * x_TD
        plgpu.store(ds_ref.at[s, rows[:, None], cols[None, :]], ds_TD.astype(ds_ref.dtype), mask=mask)
        return tuple(new_dq)

    def body(s, dq_K):
        return jax.lax.cond(valid_ref[s] != 0, functools.partial(grad, s), lambda dq: dq, dq_K)

    init = tuple(jnp.zeros(cols.shape, jnp.float32) for _ in range(K))
    for k, dq_D in enumerate(jax.lax.fori_loop(0, src_ref.shape[0], body, init)):
        plgpu.store(dq_ref.at[pl.program_id(0), k, cols], dq_D, mask=cmask)


def prefix_backward(src_SND, valid_S, bias_SK, q_KD, lse_KN, c_KN, dout_KND, acc_SND, *, eps, interpret=False):
    """(acc + ds [S, N, D], dq [K, D] float32) in one read of the valid sources, the sources'
    gradient added into `acc_SND` in place (aliased: slots no query reads are not touched);
    `c_KN` = dout_k . out_k - dlse_k per token (the softmax's shift, from the forward's output)."""
    S, N, D = src_SND.shape
    K = q_KD.shape[0]
    tn = prefix_block_tokens(N, D, K)
    nt = pl.cdiv(N, tn)
    kernel = functools.partial(_prefix_bwd_kernel, N=N, D=D, tn=tn, K=K, eps=eps)
    args = (valid_S, src_SND, q_KD, bias_SK, lse_KN, c_KN, dout_KND, acc_SND.astype(src_SND.dtype))
    ds_SND, dq_TKD = pl.pallas_call(
        kernel,
        grid=(nt,),
        out_shape=[out_struct((S, N, D), src_SND.dtype, src_SND), out_struct((nt, K, D), jnp.float32, src_SND)],
        input_output_aliases={len(args) - 1: 0},
        compiler_params=_params(tn, K * D),
        interpret=interpret,
        name="depth_route_prefix_bwd",
    )(*args)
    return ds_SND, dq_TKD.sum(axis=0)
