"""Depth routing as Pallas Mosaic GPU kernels (Hopper, sm_90a), each source a separate operand.

The sources come as S arrays [N, D] (the unrolled layers' slots, never stacked into one buffer)
or as one buffer [S, N, D] (the scanned layers' store-once buffer). A kernel is a grid of CTAs of
one warpgroup (128 threads, `pl.kernel` over a `plgpu.Mesh`, the machinery `plgpu.kernel` builds);
each CTA walks `TILES` tiles of ROWS = 4 tokens (one token per warp, D across its lanes, in chunks
of at most 256 columns: a TMA box's limit) and, per tile, the sources in a Python loop: each
source's [4, D] tile is copied by TMA into shared memory, `BUFFERS` tiles in flight.

  forward:  per source, 1/rms and the logit against q = w * g, a float32 online softmax (running
            max, sum and weighted sum in registers); then out = acc / l (+ residual) and
            lse = m + log l per token;
  backward: one pass over the sources for c = sum_k a_k (dout . s_k), a second that writes
            ds_k = a_k dout + dz_k inv_k (q - z_k inv_k s_k / D) and adds dz_k inv_k s_k into a
            per-CTA partial dq [4, D] (summed outside). Where a source's cotangent buffer is
            given (`accumulate`), its tile is read and ds_k is added into it in place (the buffer
            is an aliased output): no buffer-sized cotangent is made to be summed afterwards.

Masks are static per source (invalid sources are not operands at all) or an additive float32
bias [S, N] (0 or -inf; a traced or per-token mask), with which every source is read.

Untuned: written and checked without a GPU, in the Mosaic GPU interpreter (jax 0.12,
`plgpu.InterpretGPUParams`) and compiled ahead of time for sm_90a (deltares.aot --gpu).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import out_struct

ROWS = 4  # tokens per tile: one per warp of the warpgroup
BUFFERS = 3  # source tiles in flight (TMA) per CTA
MAX_CTAS = 1024  # a CTA walks enough tiles to keep the grid at most this long
SMEM_BYTES = 216 * 1024  # shared memory a CTA may take (H100/H200: 227 KiB, less Mosaic's own scratch)
TILE_GROUP = 8  # tiles per CTA come in multiples of 8: the per-token rows of a CTA (lse, bias) are one TMA box


def _chunk(D: int) -> int:
    """Columns per chunk: a TMA box is at most 256 elements along each dimension."""
    return next((c for c in (256, 128, 64, 32) if D % c == 0), 0)


def _layout(C: int):
    """A [4, C] chunk in registers: row r on warp r, the columns across the 32 lanes in vectors of
    up to 4 (a row reduction is a warp shuffle; broadcasting a row back is free)."""
    v = min(4, C // 32)
    return plgpu.Layout.TILED(plgpu.Tiling(((ROWS, 32 * v), (v,))), warp_dims=(-3,), lane_dims=(-2,),
                              vector_dim=-1)


def _load(ref, layout):
    """A shared-memory ref into registers with `layout` (jax 0.12 dropped the index argument)."""
    try:
        return plgpu.load(ref, layout=layout)
    except TypeError:
        return plgpu.load(ref, (), layout=layout)


def _tiles_per_cta(N: int) -> int:
    """Tiles each CTA walks: a multiple of TILE_GROUP dividing N / ROWS, the grid at most MAX_CTAS."""
    n = N // ROWS
    t = TILE_GROUP
    while n % t or n // t > MAX_CTAS:
        t += TILE_GROUP
    return t


def _smem_bytes(S: int, N: int, D: int, itemsize: int, bias: bool) -> int:
    """Shared memory a CTA of the backward kernel takes (the forward's is less): its scratch buffers."""
    tile, rows = ROWS * D, ROWS * _tiles_per_cta(N)
    total = BUFFERS * tile * itemsize + tile * 4  # the source ring, q
    total += 5 * tile * itemsize + tile * 4  # dout, the accumulator ring (2), the ds ring (2); dq
    return total + ((S if bias else 1) + 1) * rows * 4  # bias rows, lse rows


def interpreter_missing() -> str | None:
    """Why this jax cannot run the kernels in an interpreter (None: it can): the Mosaic GPU
    interpreter (`plgpu.InterpretGPUParams`) came with jax 0.11."""
    return None if hasattr(plgpu, "InterpretGPUParams") else (
        f"jax {jax.__version__} has no Mosaic GPU interpreter (plgpu.InterpretGPUParams, jax 0.11 and later)")


def unsupported(N: int, D: int, dtype, S: int = 1, bias: bool = True) -> str | None:
    """Why the kernels cannot take these shapes (None: they can); `bias`: a traced or per-token mask."""
    itemsize = jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (float32, bfloat16 or float16)"
    if not _chunk(D) or (itemsize < 4 and D % 64):
        return f"D={D} is not a multiple of {32 if itemsize == 4 else 64}"
    if N % (ROWS * TILE_GROUP):
        return f"{N} tokens are not a multiple of {ROWS * TILE_GROUP}"
    if bias and S > 256:
        return f"{S} sources with a traced or per-token mask (at most 256)"
    need = _smem_bytes(S, N, D, itemsize, bias)
    if need > SMEM_BYTES:
        return f"D={D} needs {need // 1024} KiB of shared memory per CTA (at most {SMEM_BYTES // 1024})"
    return None


def _kernel(body, out_type, scratch, grid: int, interpret, name: str):
    """`body(*operand refs, *output refs, *scratch refs)` over a grid of `grid` CTAs (axis "ctas").
    Operands that are `jax.Ref`s are written in place (aliased)."""
    if interpret and interpreter_missing():
        raise NotImplementedError(interpreter_missing())
    kw = {} if not interpret else dict(interpret=plgpu.InterpretGPUParams() if interpret is True else interpret)

    def kernel(*refs):
        pl.run_scoped(functools.partial(body, *refs), *scratch)

    return pl.kernel(kernel, out_type=out_type, mesh=plgpu.Mesh(grid=(grid,), grid_names=("ctas",)), name=name,
                     **kw)


class _Tiles:
    """Shapes of a call and the helpers of one CTA's tiles."""

    def __init__(self, N: int, D: int):
        self.N, self.D = N, D
        self.C = _chunk(D)
        self.K = D // self.C
        self.T = _tiles_per_cta(N)
        self.grid = N // (ROWS * self.T)
        self.layout = _layout(self.C)
        self.row_layout = self.layout.reduce(1)

    def cols(self, k: int):
        return pl.ds(k * self.C, self.C)

    def copy_in(self, src, dst, barrier):
        """TMA of a [ROWS, D] GMEM view into a [K, ROWS, C] SMEM buffer, K boxes on one barrier."""
        for k in range(self.K):
            plgpu.copy_gmem_to_smem(src.at[:, self.cols(k)], dst.at[k], barrier)

    def copy_out(self, src, dst):
        for k in range(self.K):
            plgpu.copy_smem_to_gmem(src.at[k], dst.at[:, self.cols(k)])

    def load(self, buf, f32=True):
        """The K chunks [ROWS, C] of a [K, ROWS, C] SMEM buffer, as float32."""
        return [_load(buf.at[k], self.layout).astype(jnp.float32) if f32 else _load(buf.at[k], self.layout)
                for k in range(self.K)]

    def col(self, r):
        """A per-token row [ROWS] broadcast over a chunk's columns."""
        return plgpu.layout_cast(jax.lax.broadcast_in_dim(r, (ROWS, self.C), (0,)), self.layout)

    def row_sum(self, chunks):
        return functools.reduce(jnp.add, [jnp.sum(c, axis=1) for c in chunks])


class _Sources:
    """The S sources inside a kernel: separate [N, D] refs or one [S, N, D] buffer, each read by TMA
    into a ring of BUFFERS shared-memory tiles."""

    def __init__(self, refs, stacked: bool, S: int, tiles: _Tiles, ring, barriers):
        self.refs, self.stacked, self.S, self.tiles = refs, stacked, S, tiles
        self.ring, self.barriers = ring, barriers

    def view(self, s: int, rows):
        return self.refs[0].at[s, rows] if self.stacked else self.refs[s].at[rows]

    def fetch(self, i: int, rows):
        """Issue the copy of the i-th read of this tile (sources in order, possibly twice over)."""
        self.tiles.copy_in(self.view(i % self.S, rows), self.ring.at[i % BUFFERS], self.barriers.at[i % BUFFERS])

    def walk(self, rows, passes: int, step):
        """`step(s, slot)` for each source of each pass, the next reads' copies in flight."""
        reads = passes * self.S
        for i in range(min(BUFFERS, reads)):
            self.fetch(i, rows)
        for i in range(reads):
            plgpu.barrier_wait(self.barriers.at[i % BUFFERS])
            step(i // self.S, i % self.S, self.ring.at[i % BUFFERS])
            if i + BUFFERS < reads:
                self.fetch(i + BUFFERS, rows)  # into the slot just read (copy_gmem_to_smem waits for the reads)


def _logit(tiles: _Tiles, x, q, eps, bias_row):
    """(z, inv) per token of one source tile `x` (K float32 chunks): z = (x . q) / rms(x) (+ bias)."""
    inv = jax.lax.rsqrt(tiles.row_sum([c * c for c in x]) / tiles.D + eps)
    z = tiles.row_sum([c * qc for c, qc in zip(x, q)]) * inv
    return (z if bias_row is None else z + bias_row), z, inv


# ----------------------------------------------------------------------------- forward


def prefix_unsupported(N: int, D: int, dtype, K: int) -> str | None:
    del N, D, dtype, K
    return "phase one of two-phase routing (K queries) has no Mosaic GPU kernel"


def _bias(valid_S, bias_SN, N: int):
    """The stacked layout's mask as a bias [S, N]: every slot is read (a traced [S] mask included)."""
    if bias_SN is not None:
        return bias_SN
    return jnp.broadcast_to(jnp.where(valid_S[:, None] != 0, 0.0, -jnp.inf).astype(jnp.float32), (valid_S.shape[0], N))


def forward(src_SND, valid_S, bias_SN, q_D, res_ND, *, eps, interpret=False):
    """The common backend signature (a stacked buffer [S, N, D]): (out [N, D], lse [N] float32)."""
    return route_forward(src_SND, _bias(valid_S, bias_SN, src_SND.shape[1]), q_D, res_ND, eps=eps,
                         interpret=interpret)


def backward(src_SND, valid_S, bias_SN, q_D, lse_N, dout_ND, *, eps, interpret=False):
    """The common backend signature: (ds [S, N, D], dq [D] float32)."""
    return route_backward(src_SND, _bias(valid_S, bias_SN, src_SND.shape[1]), q_D, lse_N, dout_ND, eps=eps,
                          interpret=interpret)


def route_forward(sources, bias_SN, q_D, res_ND, *, eps, interpret=False):
    """(out [N, D] in the sources' dtype, lse [N] float32). `sources`: a tuple of S arrays [N, D] or one
    [S, N, D] array; `bias_SN`: None (every source valid) or float32 [S, N] (0 / -inf)."""
    stacked = not isinstance(sources, (tuple, list))
    srcs = (sources,) if stacked else tuple(sources)
    S = sources.shape[0] if stacked else len(srcs)
    N, D = srcs[0].shape[-2:]
    dtype = srcs[0].dtype
    t = _Tiles(N, D)
    q_RD = jnp.broadcast_to(q_D.astype(jnp.float32), (ROWS, D))
    has_bias, has_res = bias_SN is not None, res_ND is not None
    res_dtype = res_ND.dtype if has_res else dtype

    def body(*refs):
        refs = list(refs)
        src_refs = [refs.pop(0) for _ in srcs]
        q_ref = refs.pop(0)
        bias_ref = refs.pop(0) if has_bias else None
        res_ref = refs.pop(0) if has_res else None
        out_ref, lse_ref, ring, q_smem, out_smem, res_smem, bias_smem, lse_smem, bars, bar1 = refs
        sources_ = _Sources(src_refs, stacked, S, t, ring, bars)
        cta = jax.lax.axis_index("ctas")
        first_row = cta * t.T * ROWS
        span = pl.ds(first_row, t.T * ROWS)
        t.copy_in(q_ref, q_smem, bars.at[BUFFERS])
        if has_bias:
            plgpu.copy_gmem_to_smem(bias_ref.at[:, span], bias_smem, bar1.at[0])
            plgpu.barrier_wait(bar1.at[0])
        plgpu.barrier_wait(bars.at[BUFFERS])

        def tile(i, carry):
            rows = pl.ds(first_row + i * ROWS, ROWS)
            if has_res:
                t.copy_in(res_ref.at[rows], res_smem, bars.at[BUFFERS + 1])
            q = t.load(q_smem)
            state = {}

            def step(_, s, slot):
                x = t.load(slot)
                bias_row = _load(bias_smem.at[s, pl.ds(i * ROWS, ROWS)], t.row_layout) if has_bias else None
                z, _, _ = _logit(t, x, q, eps, bias_row)
                if not state:  # the first source: m = z, l = 1 (0 where masked), acc = l x
                    # (1 made from z: a constant row would be a splat, which jax 0.10 cannot broadcast)
                    p = jnp.where(z == -jnp.inf, 0.0, 1.0) if has_bias else z * 0.0 + 1.0
                    state.update(m=z, l=p, acc=[t.col(p) * c for c in x] if has_bias else x)
                    return
                m, l, acc = state["m"], state["l"], state["acc"]
                new = jnp.maximum(m, z)
                safe = jnp.where(new == -jnp.inf, 0.0, new) if has_bias else new
                alpha, p = jnp.exp(m - safe), jnp.exp(z - safe)
                a_col, p_col = t.col(alpha), t.col(p)
                state.update(m=new, l=alpha * l + p, acc=[a_col * a + p_col * c for a, c in zip(acc, x)])

            sources_.walk(rows, 1, step)
            inv_l = t.col(1.0 / state["l"])
            out = [a * inv_l for a in state["acc"]]
            if has_res:
                plgpu.barrier_wait(bars.at[BUFFERS + 1])
                out = [o + r for o, r in zip(out, t.load(res_smem))]
            for k in range(t.K):
                out_smem[k] = out[k].astype(dtype)
            lse_smem[pl.ds(i * ROWS, ROWS)] = state["m"] + jnp.log(state["l"])
            plgpu.commit_smem()
            t.copy_out(out_smem, out_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)  # out_smem is written again by the next tile
            return carry

        jax.lax.fori_loop(0, t.T, tile, 0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[span])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((BUFFERS, t.K, ROWS, t.C), dtype), plgpu.SMEM((t.K, ROWS, t.C), jnp.float32),
               plgpu.SMEM((t.K, ROWS, t.C), dtype), plgpu.SMEM((t.K, ROWS, t.C), res_dtype),
               plgpu.SMEM((S if has_bias else 1, t.T * ROWS), jnp.float32), plgpu.SMEM((t.T * ROWS,), jnp.float32),
               plgpu.Barrier(num_arrivals=t.K, num_barriers=BUFFERS + 2), plgpu.Barrier(num_barriers=1)]
    out_type = (out_struct((N, D), dtype, srcs[0]), out_struct((N,), jnp.float32, srcs[0]))
    operands = [*srcs, q_RD] + ([bias_SN] if has_bias else []) + ([res_ND] if has_res else [])
    return _kernel(body, out_type, scratch, t.grid, interpret, "depth_route_mgpu_fwd")(*operands)


# ----------------------------------------------------------------------------- backward


def route_backward(sources, bias_SN, q_D, lse_N, dout_ND, accumulate=None, *, eps, interpret=False):
    """(ds, dq [D] float32). `sources` as in `forward`; ds is a tuple of S arrays [N, D] (an [S, N, D]
    array for stacked sources) in the sources' dtype. `accumulate` (separate sources only): per source
    None or a cotangent buffer [N, D] that ds is added into in place (the returned array is that buffer)."""
    stacked = not isinstance(sources, (tuple, list))
    srcs = (sources,) if stacked else tuple(sources)
    S = sources.shape[0] if stacked else len(srcs)
    N, D = srcs[0].shape[-2:]
    dtype = srcs[0].dtype
    accumulate = tuple(accumulate) if accumulate is not None else (None,) * (0 if stacked else S)
    if stacked and any(a is not None for a in accumulate):
        raise ValueError("accumulate takes separate sources")
    t = _Tiles(N, D)
    q_RD = jnp.broadcast_to(q_D.astype(jnp.float32), (ROWS, D))
    has_bias = bias_SN is not None
    acc_of = [] if stacked else [i for i, a in enumerate(accumulate) if a is not None]
    fresh = [] if stacked else [i for i, a in enumerate(accumulate) if a is None]
    acc_refs = [jax.new_ref(accumulate[i].astype(dtype)) for i in acc_of]

    def body(*refs):
        refs = list(refs)
        src_refs = [refs.pop(0) for _ in srcs]
        q_ref = refs.pop(0)
        bias_ref = refs.pop(0) if has_bias else None
        lse_ref, dout_ref = refs.pop(0), refs.pop(0)
        accs = [refs.pop(0) for _ in acc_of]
        if stacked:
            ds_ref = refs.pop(0)
            ds_view = lambda s, rows: ds_ref.at[s, rows]  # noqa: E731
        else:
            outs = dict(zip(fresh, [refs.pop(0) for _ in fresh]))
            outs.update(zip(acc_of, accs))
            ds_view = lambda s, rows: outs[s].at[rows]  # noqa: E731
        dq_ref, ring, q_smem, dout_smem, acc_ring, ds_ring, bias_smem, lse_smem, dq_smem, bars, bar1 = refs
        acc_index = {s: j for j, s in enumerate(acc_of)}
        sources_ = _Sources(src_refs, stacked, S, t, ring, bars)
        cta = jax.lax.axis_index("ctas")
        first_row = cta * t.T * ROWS
        span = pl.ds(first_row, t.T * ROWS)
        qbar, doutbar = bars.at[BUFFERS], bars.at[BUFFERS + 1]
        t.copy_in(q_ref, q_smem, qbar)
        plgpu.copy_gmem_to_smem(lse_ref.at[span], lse_smem, bar1.at[0])
        if has_bias:
            plgpu.copy_gmem_to_smem(bias_ref.at[:, span], bias_smem, bar1.at[1])
            plgpu.barrier_wait(bar1.at[1])
        plgpu.barrier_wait(bar1.at[0])
        plgpu.barrier_wait(qbar)

        def tile(i, dq):
            rows = pl.ds(first_row + i * ROWS, ROWS)
            t.copy_in(dout_ref.at[rows], dout_smem, doutbar)
            q = t.load(q_smem)
            lse = _load(lse_smem.at[pl.ds(i * ROWS, ROWS)], t.row_layout)
            plgpu.barrier_wait(doutbar)
            dout = t.load(dout_smem)
            state = dict(c=None, dq=list(dq), n_acc=0, n_out=0)

            def fetch_acc(j):  # the j-th accumulated source's cotangent tile, into the acc ring
                t.copy_in(accs[j].at[rows], acc_ring.at[j % 2], bars.at[BUFFERS + 2 + j % 2])

            if acc_of:
                fetch_acc(0)

            def step(pass_, s, slot):
                x = t.load(slot)
                bias_row = _load(bias_smem.at[s, pl.ds(i * ROWS, ROWS)], t.row_layout) if has_bias else None
                zb, z, inv = _logit(t, x, q, eps, bias_row)
                a = jnp.exp(zb - lse)
                da = t.row_sum([d * c for d, c in zip(dout, x)])
                if pass_ == 0:
                    state["c"] = a * da if state["c"] is None else state["c"] + a * da
                    return
                g = a * (da - state["c"]) * inv
                a_col, g_col, zi_col = t.col(a), t.col(g), t.col(z * inv / t.D)
                ds = [a_col * d + g_col * (qc - zi_col * c) for d, qc, c in zip(dout, q, x)]
                state["dq"] = [acc + g_col * c for acc, c in zip(state["dq"], x)]
                if s in acc_index:
                    j = acc_index[s]
                    plgpu.barrier_wait(bars.at[BUFFERS + 2 + j % 2])
                    ds = [d + p for d, p in zip(ds, t.load(acc_ring.at[j % 2]))]
                    if j + 1 < len(acc_of):
                        fetch_acc(j + 1)
                out_slot = ds_ring.at[state["n_out"] % 2]
                plgpu.wait_smem_to_gmem(t.K, wait_read_only=True)  # the slot's copies out (K before the last K) read it
                for k in range(t.K):
                    out_slot[k] = ds[k].astype(dtype)
                plgpu.commit_smem()
                t.copy_out(out_slot, ds_view(s, rows))
                state["n_out"] += 1

            sources_.walk(rows, 2, step)
            plgpu.wait_smem_to_gmem(0)  # before the next tile rewrites the slots
            return tuple(state["dq"])

        zeros = tuple(plgpu.layout_cast(jnp.zeros((ROWS, t.C), jnp.float32), t.layout) for _ in range(t.K))
        dq = jax.lax.fori_loop(0, t.T, tile, zeros)
        for k in range(t.K):
            dq_smem[k] = dq[k]
        plgpu.commit_smem()
        t.copy_out(dq_smem, dq_ref.at[pl.ds(cta * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((BUFFERS, t.K, ROWS, t.C), dtype), plgpu.SMEM((t.K, ROWS, t.C), jnp.float32),
               plgpu.SMEM((t.K, ROWS, t.C), dout_ND.dtype), plgpu.SMEM((2, t.K, ROWS, t.C), dtype),
               plgpu.SMEM((2, t.K, ROWS, t.C), dtype), plgpu.SMEM((S if has_bias else 1, t.T * ROWS), jnp.float32),
               plgpu.SMEM((t.T * ROWS,), jnp.float32), plgpu.SMEM((t.K, ROWS, t.C), jnp.float32),
               plgpu.Barrier(num_arrivals=t.K, num_barriers=BUFFERS + 4), plgpu.Barrier(num_barriers=2)]
    ds_shapes = [(S, N, D)] if stacked else [(N, D)] * len(fresh)
    ds_type = [out_struct(shape, dtype, srcs[0]) for shape in ds_shapes]
    out_type = (*ds_type, out_struct((t.grid * ROWS, D), jnp.float32, srcs[0]))
    operands = [*srcs, q_RD] + ([bias_SN] if has_bias else []) + [lse_N, dout_ND] + acc_refs
    *ds_out, dq_partial = _kernel(body, out_type, scratch, t.grid, interpret, "depth_route_mgpu_bwd")(*operands)
    dq = dq_partial.sum(axis=0)
    if stacked:
        return ds_out[0], dq
    ds = [None] * S
    for s, d in zip(fresh, ds_out):
        ds[s] = d
    for s, ref in zip(acc_of, acc_refs):
        ds[s] = ref[...]
    return tuple(ds), dq
