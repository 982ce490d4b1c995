"""Phase one of two-phase routing as a fused K-query kernel (kernels_pallas.depth_route.route_prefix,
TPU and GPU, interpret mode on CPU) against a float64 reference: forward (each query's routed
output and log-sum-exp) against NumPy, gradients against float64 autodiff of a plain jnp
re-implementation. Kernels run in float32 (bfloat16 sources: float32 accumulation, ds rounded to
bfloat16); tolerance 1e-5 of the largest reference value in float32, 1e-2 for bfloat16 outputs."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_mode
from kernels_pallas.depth_route import api, pallas_gpu, pallas_tpu, route_prefix, route_prefix_grad_into

KERNELS = ("pallas_tpu", "pallas_gpu")
EPS = 1e-6


def make_case(S, B, T, D, K, dtype, seed=0, dead_source=None):
    """Sources of unequal scale, K sharp queries, a per-query mask (each query keeps at least one
    source; `dead_source`, if given, is masked for every query)."""
    rng = np.random.default_rng(seed)
    sources = rng.normal(size=(S, B, T, D)) * np.exp(rng.normal(size=(S, 1, 1, 1)))
    queries = 3.0 * rng.normal(size=(K, D)) / np.sqrt(D)
    gains = 1.0 + 0.2 * rng.normal(size=(K, D))
    valid = rng.random((K, S)) < 0.6
    valid[np.arange(K), rng.integers(0, S, K)] = True
    if dead_source is not None:
        valid[:, dead_source] = False
        valid[:, (dead_source + 1) % S] = True
    sources = np.asarray(jnp.asarray(sources, dtype).astype(jnp.float32), np.float64)  # what the kernel reads
    return sources, valid, queries, gains


def np_prefix(sources, valid, queries, gains):
    """Float64 NumPy: each query's softmax over its valid sources, (out [K, B, T, D], lse [K, B, T])."""
    keys = sources / np.sqrt(np.mean(sources**2, axis=-1, keepdims=True) + EPS)
    logits = np.einsum("sbtd,kd->ksbt", keys, queries * gains)
    logits = np.where(valid[:, :, None, None], logits, -np.inf)
    top = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return np.einsum("ksbt,sbtd->kbtd", np.exp(logits - lse[:, None]), sources), lse


def jnp_prefix(sources, valid, queries, gains):
    """The same math in plain jnp (float64 under enable_x64), for autodiff."""
    keys = sources * jax.lax.rsqrt(jnp.mean(sources**2, axis=-1, keepdims=True) + EPS)
    logits = jnp.where(valid[:, :, None, None], jnp.einsum("sbtd,kd->ksbt", keys, queries * gains), -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=1)
    return jnp.einsum("ksbt,sbtd->kbtd", jnp.exp(logits - lse[:, None]), sources), lse


def cotangents(K, B, T, D, seed=7):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(K, B, T, D)), rng.normal(size=(K, B, T))


def kernel_value_and_grads(impl, sources, valid, queries, gains, dtype, interpret=None):
    ct_out, ct_lse = cotangents(queries.shape[0], *sources.shape[1:])

    @jax.jit
    def run(s, q, g):
        def loss(s, q, g):
            out, lse = route_prefix(s, valid, q, g, implementation=impl, eps=EPS,
                                    interpret=kernel_mode.interpret(impl) if interpret is None else interpret)
            return jnp.vdot(out, ct_out.astype(np.float32)) + jnp.vdot(lse, ct_lse.astype(np.float32)), (out, lse)

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(s, q, g)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the kernel ran: no fallback to xla
        grads, (out, lse) = run(jnp.asarray(sources, dtype), jnp.asarray(queries, jnp.float32),
                                jnp.asarray(gains, jnp.float32))
    return out, lse, grads


def reference_grads(sources, valid, queries, gains):
    ct_out, ct_lse = cotangents(queries.shape[0], *sources.shape[1:])
    with jax.enable_x64(True):
        def loss(s, q, g):
            out, lse = jnp_prefix(s, jnp.asarray(valid), q, g)
            return jnp.vdot(out, ct_out) + jnp.vdot(lse, ct_lse)

        grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float64) for a in (sources, queries, gains)))
        return [np.asarray(g) for g in grads]


def assert_close(x, ref, tol, what):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()), err_msg=what)


CASES = [  # S, B, T, D, K, dtype
    (5, 2, 8, 32, 4, jnp.float32),
    (1, 1, 8, 64, 1, jnp.float32),  # one source, one query
    (6, 2, 4, 48, 6, jnp.bfloat16),  # D not a power of two (GPU pads); K = 6 (3 layers per group)
    (9, 2, 5, 40, 2, jnp.float32),  # B*T = 10 (odd tiles)
]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}-{c[2]}x{c[3]}-K{c[4]}-{jnp.dtype(c[5]).name}")
def test_prefix_kernel_matches_float64_reference(impl, case):
    S, B, T, D, K, dtype = case
    sources, valid, queries, gains = make_case(S, B, T, D, K, dtype, seed=S + K)
    out, lse, grads = kernel_value_and_grads(impl, sources, valid, queries, gains, dtype)
    want_out, want_lse = np_prefix(sources, valid, queries, gains)
    assert out.dtype == lse.dtype == jnp.float32 and out.shape == (K, B, T, D) and lse.shape == (K, B, T)
    assert_close(out, want_out, 1e-5, "out")
    assert_close(lse, want_lse, 1e-5, "lse")
    for name, g, w in zip(("sources", "queries", "gains"), grads, reference_grads(sources, valid, queries, gains)):
        assert np.abs(w).max() > 0, name
        assert_close(g, w, 1e-2 if name == "sources" and dtype == jnp.bfloat16 else 1e-5, name)


@pytest.mark.parametrize("impl", KERNELS)
def test_each_query_routes_over_its_own_sources_across_tiles(impl, monkeypatch):
    """Several token tiles (GPU: a partial last one), a source no query reads (zero gradient, skipped),
    and a query whose mask differs from the others': its result is its routing alone. The TPU kernel
    runs in the TPU interpret mode (simulated VMEM, DMAs and pipelining of the grid)."""
    monkeypatch.setattr(pallas_tpu, "MAX_TOKENS", 8)  # 6 tiles of 8 tokens
    monkeypatch.setattr(pallas_gpu, "TILE_ELEMS", 3 * 16 * 32)  # 16 rows per program: 16 + 16 + 16
    interpret = kernel_mode.interpret(impl, tpu_simulator=True)
    sources, valid, queries, gains = make_case(5, 4, 12, 32, 3, jnp.float32, seed=3, dead_source=2)
    valid[1] = [True, False, False, False, False]  # query 1 reads source 0 only: its output is that source
    out, lse, grads = kernel_value_and_grads(impl, sources, valid, queries, gains, jnp.float32, interpret)
    want_out, want_lse = np_prefix(sources, valid, queries, gains)
    assert_close(out, want_out, 1e-5, "out")
    assert_close(out[1], sources[0], 1e-5, "a single valid source")
    assert_close(lse, want_lse, 1e-5, "lse")
    want = reference_grads(sources, valid, queries, gains)
    for name, g, w in zip(("sources", "queries", "gains"), grads, want):
        assert_close(g, w, 1e-5, name)
    assert np.all(np.asarray(grads[0][2]) == 0)  # the dead source


@pytest.mark.parametrize("impl", KERNELS + ("xla",))
def test_grad_into_adds_the_source_cotangent_in_place(impl, monkeypatch):
    """`route_prefix_grad_into` (the backward the grouped depth pass uses with a kernel): given the
    forward's output and cotangents, it returns acc + d sources and the query and gain cotangents of
    the float64 reference; a slot no query reads comes back bit for bit as it went in (the kernels
    never touch it)."""
    monkeypatch.setattr(pallas_tpu, "MAX_TOKENS", 8)
    interpret = kernel_mode.interpret(impl, tpu_simulator=True)
    S, B, T, D, K = 5, 2, 8, 32, 3
    sources, valid, queries, gains = make_case(S, B, T, D, K, jnp.float32, seed=11, dead_source=1)
    ct_out, ct_lse = cotangents(K, B, T, D)
    acc = np.random.default_rng(5).normal(size=sources.shape).astype(np.float32)
    f32 = [jnp.asarray(a, jnp.float32) for a in (sources, queries, gains, ct_out, ct_lse)]
    out, lse = route_prefix(f32[0], valid, f32[1], f32[2], implementation=impl, interpret=kernel_mode.interpret(impl))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the kernel ran: no fallback to xla
        got_acc, d_queries, d_gains = jax.jit(lambda *a: route_prefix_grad_into(
            *a, implementation=impl, interpret=interpret))(jnp.asarray(acc), f32[0], valid, f32[1], f32[2], out, lse,
                                                           f32[3], f32[4])
    want = reference_grads(sources, valid, queries, gains)
    assert_close(np.asarray(got_acc, np.float64) - acc, want[0], 1e-5, "acc + d sources")
    assert_close(d_queries, want[1], 1e-5, "queries")
    assert_close(d_gains, want[2], 1e-5, "gains")
    np.testing.assert_array_equal(np.asarray(got_acc)[1], acc[1])  # the dead slot: untouched


def test_default_on_cpu_is_xla_and_a_kernel_that_cannot_run_falls_back():
    sources, valid, queries, gains = make_case(3, 2, 4, 16, 2, jnp.float32)
    args = (jnp.asarray(sources, jnp.float32), valid, jnp.asarray(queries, jnp.float32), jnp.asarray(gains, jnp.float32))
    want_out, want_lse = np_prefix(sources, valid, queries, gains)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the default picks xla silently
        out, lse = route_prefix(*args)
    assert out.dtype == lse.dtype == jnp.float32
    assert_close(out, want_out, 1e-5, "out")
    assert_close(lse, want_lse, 1e-5, "lse")
    api._WARNED.clear()
    with pytest.warns(UserWarning, match="route_prefix: pallas_tpu cannot run"):
        route_prefix(*args, implementation="pallas_tpu")  # compiled (no interpret) for TPU, on a CPU


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(implementation="triton"), "implementation must be one of"),
        (dict(sources=jnp.ones((3, 8, 16))), "sources must be [S, B, T, D]"),
        (dict(queries=jnp.ones((16,))), "queries must have shape ('K', 16)"),
        (dict(gains=jnp.ones((3, 16))), "gains must have shape (2, 16)"),
        (dict(queries=jnp.ones((2, 8))), "queries must have shape (2, 16)"),
        (dict(valid=jnp.ones((2, 4), bool)), "valid must have shape (2, 3)"),
    ],
)
def test_bad_input_raises_value_error(change, words):
    kwargs = dict(sources=jnp.ones((3, 2, 4, 16)), valid=jnp.ones((2, 3), bool), queries=jnp.ones((2, 16)),
                  gains=jnp.ones((2, 16)), implementation="pallas_gpu", interpret=True)
    kwargs.update(change)
    escaped = "".join("\\" + c if c in "[]()" else c for c in words)
    with pytest.raises(ValueError, match=escaped):
        route_prefix(**kwargs)
