"""The depth-routing kernel on Pallas Mosaic GPU (kernels_pallas/depth_route/pallas_mosaic_gpu.py,
`implementation="pallas_mosaic_gpu"`) in the Mosaic GPU interpreter (jax 0.11 and later:
`plgpu.InterpretGPUParams`, the same kernel source that compiles for sm_90a; tests/test_aot_gpu.py
compiles it): forward and gradients against a float64 oracle (NumPy forward, float64 autodiff of a
plain re-implementation) and the pure reference, for separate sources (the unrolled layers', a
static mask leaving sources out of the call), a traced or per-token mask and the stacked buffer of
scanned layers; the cotangents accumulated in place through passed-through sources; the model's
loss and gradients with the kernel. On jax 0.10 (no interpreter) these tests skip; .ci/run runs
them in its Python 3.12 stage (jax 0.12)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.depth_route import api, depth_route, pallas_mosaic_gpu, reference

IMPL = "pallas_mosaic_gpu"
EPS = 1e-6
needs_interpreter = pytest.mark.skipif(pallas_mosaic_gpu.interpreter_missing() is not None,
                                       reason=str(pallas_mosaic_gpu.interpreter_missing()))


def make_case(S, B, T, D, dtype, mask, residual, seed=0):
    """Sources of unequal scale (as the kernel reads them, in float64), a sharp query, a mask, a residual."""
    rng = np.random.default_rng(seed)
    sources = rng.normal(size=(S, B, T, D)) * np.exp(rng.normal(size=(S, 1, 1, 1)))
    sources = np.asarray(jnp.asarray(sources, dtype).astype(jnp.float32), np.float64)
    query, gain = 3.0 * rng.normal(size=D) / np.sqrt(D), 1.0 + 0.2 * rng.normal(size=D)
    if mask == "all":
        valid = np.ones(S, bool)
    elif mask == "source":  # one source left out (not the first)
        valid = np.arange(S) != S // 2
    else:  # per token, at least one source valid for each
        valid = rng.random((S, B, T)) < 0.5
        valid[rng.integers(0, S), :, :] = True
    res = rng.normal(size=(B, T, D)) if residual else None
    res = None if res is None else np.asarray(jnp.asarray(res, dtype).astype(jnp.float32), np.float64)
    return sources, valid, query, gain, res


def oracle(sources, valid, query, gain, res):
    """Float64 NumPy: softmax over the valid sources of (q . s) / rms(s), times s, plus the residual."""
    keys = sources / np.sqrt(np.mean(sources**2, axis=-1, keepdims=True) + EPS)
    logits = np.einsum("sbtd,d->sbt", keys, query * gain)
    logits = np.where(np.broadcast_to(valid.reshape(valid.shape + (1,) * (3 - valid.ndim)), logits.shape), logits,
                      -np.inf)
    weights = np.exp(logits - logits.max(axis=0))
    out = np.einsum("sbt,sbtd->btd", weights / weights.sum(axis=0), sources)
    return out if res is None else out + res


def oracle_grads(sources, valid, query, gain, res, ct):
    """Float64 autodiff of the same math in plain jnp: d<out, ct> for sources, query, gain (and residual)."""
    with jax.enable_x64(True):
        def loss(s, q, g, r):
            keys = s * jax.lax.rsqrt(jnp.mean(s**2, axis=-1, keepdims=True) + EPS)
            logits = jnp.einsum("sbtd,d->sbt", keys, q * g)
            v = jnp.asarray(valid).reshape(valid.shape + (1,) * (3 - valid.ndim))
            out = jnp.einsum("sbt,sbtd->btd", jax.nn.softmax(jnp.where(v, logits, -jnp.inf), axis=0), s)
            return jnp.vdot(out if r is None else out + r, ct)

        args = [jnp.asarray(a, jnp.float64) for a in (sources, query, gain)] + [
            None if res is None else jnp.asarray(res, jnp.float64)]
        return [None if g is None else np.asarray(g)
                for g in jax.grad(loss, argnums=(0, 1, 2, 3) if res is not None else (0, 1, 2))(*args)]


def assert_close(x, ref, tol, what, scale=1.0):
    """Within `tol` of the reference, relative to its largest value (or `scale`, where that is larger)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol * max(scale, np.abs(ref).max()), err_msg=what)


def kernel_grads(layout, sources, valid, query, gain, res, ct, dtype, traced_mask=False):
    """The kernel's output and d<out, ct> (sources, query, gain, residual). layout "separate": S arrays
    [B, T, D]; "stacked": one [S, B, T, D] buffer. A traced mask is an argument of the jitted function."""
    def route(s, v, q, g, r):
        srcs = tuple(s) if layout == "separate" else s
        return depth_route(srcs, v, q, g, r, implementation=IMPL, interpret=True, eps=EPS)

    @jax.jit
    def run(s, v, q, g, r):
        out, vjp = jax.vjp(lambda s, q, g, r: route(s, v if traced_mask else valid, q, g, r), s, q, g, r)
        return out, vjp(jnp.asarray(ct, dtype))

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the kernel ran: no fallback to xla
        return run(jnp.asarray(sources, dtype), jnp.asarray(valid), jnp.asarray(query, jnp.float32),
                   jnp.asarray(gain, jnp.float32), None if res is None else jnp.asarray(res, dtype))


CASES = [  # layout, S, B, T, D, dtype, mask, residual, traced mask
    ("separate", 4, 2, 16, 64, jnp.float32, "source", True, False),  # a static mask: 3 operands
    ("separate", 3, 2, 16, 128, jnp.bfloat16, "tokens", False, False),  # per-token mask: a bias, bfloat16
    ("stacked", 3, 1, 32, 96, jnp.float32, "source", True, True),  # the scanned buffer, a traced mask, D = 3 x 32
]


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-S{c[1]}-D{c[4]}-{jnp.dtype(c[5]).name}-{c[6]}")
def test_kernel_matches_float64_oracle_and_reference(case):
    layout, S, B, T, D, dtype, mask, residual, traced = case
    sources, valid, query, gain, res = make_case(S, B, T, D, dtype, mask, residual, seed=S + D)
    ct = np.asarray(jnp.asarray(np.random.default_rng(1).normal(size=(B, T, D)), dtype).astype(jnp.float32),
                    np.float64)
    out, grads = kernel_grads(layout, sources, valid, query, gain, res, ct, dtype, traced)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert out.dtype == dtype and out.shape == (B, T, D)
    assert_close(out, oracle(sources, valid, query, gain, res), tol, "out")
    want = oracle_grads(sources, valid, query, gain, res, ct)
    d_sources = np.stack(grads[0]) if layout == "separate" else grads[0]
    scale = np.abs(want[0]).max()  # the sources' gradient: the scale of this call's gradients
    for name, got, ref in zip(("sources", "query", "gain", "residual"), [d_sources, *grads[1:]], want):
        assert_close(got, ref, tol, name, scale)
    if mask == "source":  # a source the mask leaves out gets exactly zero gradient
        assert not np.any(d_sources[~valid])
    # the pure reference, the "xla" implementation, in the same dtype
    cast = lambda a, t=dtype: None if a is None else jnp.asarray(a, t)  # noqa: E731
    ref_out = reference.depth_route(cast(sources), jnp.asarray(valid), cast(query, jnp.float32),
                                    cast(gain, jnp.float32), cast(res), eps=EPS)
    assert_close(out, ref_out, tol, "out against reference.depth_route")


@needs_interpreter
def test_cotangents_accumulate_in_place_through_passed_sources(monkeypatch):
    """`pass_sources=True`: routing a second time over the passed sources (and using them otherwise) sends
    their cotangents into the first call's backward kernel, which adds its own into them (an aliased
    buffer: bit for bit the buffer plus the gradient it would write alone); a source the static mask
    leaves out is passed through untouched. Gradients equal float64 autodiff of the same chain."""
    S, B, T, D = 3, 2, 16, 64
    sources, _, query, gain, res = make_case(S, B, T, D, jnp.float32, "all", True, seed=5)
    valid = np.array([True, False, True])
    rng = np.random.default_rng(2)
    ct, ct_s = rng.normal(size=(B, T, D)), rng.normal(size=(S, B, T, D))
    seen = []
    backward = pallas_mosaic_gpu.route_backward

    def spy(*args, **kwargs):
        seen.append([a is not None for a in kwargs.get("accumulate", args[5] if len(args) > 5 else ()) or ()])
        return backward(*args, **kwargs)

    monkeypatch.setattr(pallas_mosaic_gpu, "route_backward", spy)

    def chain(route, s, q, g, r):
        out, passed = route(tuple(s), valid, q, g, r)
        out2 = route(passed, np.ones(S, bool), 0.5 * q, g, None)[0]
        return jnp.vdot(out, ct) + jnp.vdot(out2, ct) + sum(jnp.vdot(p, c) for p, c in zip(passed, ct_s))

    kernel = lambda s, v, q, g, r: depth_route(s, v, q, g, r, implementation=IMPL, interpret=True,  # noqa: E731
                                               pass_sources=True)
    grads = jax.jit(jax.grad(lambda *a: chain(kernel, *a), argnums=(0, 1, 2, 3)))(
        *(jnp.asarray(a, jnp.float32) for a in (sources, query, gain, res)))
    # the second call's passed sources are not used again (written fresh); the first call's, routed again and
    # used otherwise, come back with cotangents that its kernel adds into (3 operands: the mask leaves one out)
    assert seen == [[False] * 3, [True] * 2]
    with jax.enable_x64(True):
        plain = lambda s, v, q, g, r: (jnp.asarray(oracle_jnp(jnp.stack(s), v, q, g, r)), s)  # noqa: E731
        want = jax.grad(lambda *a: chain(plain, *a), argnums=(0, 1, 2, 3))(
            *(jnp.asarray(a, jnp.float64) for a in (sources, query, gain, res)))
    for name, got, ref in zip(("sources", "query", "gain", "residual"), grads, want):
        assert_close(got, ref, 1e-5, name)
    # in place: the buffer plus the gradient, bit for bit
    srcs = tuple(jnp.asarray(sources[s].reshape(B * T, D), jnp.float32) for s in range(S))
    q_D = jnp.asarray(query * gain, jnp.float32)
    _, lse = pallas_mosaic_gpu.route_forward(srcs, None, q_D, None, eps=EPS, interpret=True)
    dout = jnp.asarray(ct.reshape(B * T, D), jnp.float32)
    acc = tuple(jnp.asarray(c.reshape(B * T, D), jnp.float32) for c in ct_s)
    alone, _ = backward(srcs, None, q_D, lse, dout, None, eps=EPS, interpret=True)
    added, _ = backward(srcs, None, q_D, lse, dout, (acc[0], None, acc[2]), eps=EPS, interpret=True)
    for s in range(S):
        np.testing.assert_array_equal(added[s], alone[s] + acc[s] if s in (0, 2) else alone[s])


def oracle_jnp(s, valid, q, g, r):
    keys = s * jax.lax.rsqrt(jnp.mean(s**2, axis=-1, keepdims=True) + EPS)
    logits = jnp.where(jnp.asarray(valid)[:, None, None], jnp.einsum("sbtd,d->sbt", keys, q * g), -jnp.inf)
    out = jnp.einsum("sbt,sbtd->btd", jax.nn.softmax(logits, axis=0), s)
    return out if r is None else out + r


@needs_interpreter
@pytest.mark.parametrize("mode", ["delta_block"])  # a gate, blocks (a running slot replaced), 1 to 3 sources
def test_model_with_mosaic_gpu_kernel_equals_xla(mode, monkeypatch):
    """`model.residual.impl=pallas_mosaic_gpu` (interpret mode) on unrolled layers gives the loss and
    gradients of "xla"; each router's backward adds into the cotangents its sources came back with.
    (The interpreter's effects do not pass jax's remat or flax's scan: the scanned, rematerialised
    layers with this kernel are compiled, not interpreted, in tests/test_aot_gpu.py.)"""
    from deltares.nn.config import model_config
    from deltares.nn.losses import lm_loss
    from deltares.nn.model import Transformer

    calls = {"forward": 0, "backward": 0, "accumulated": 0}
    fwd, bwd = pallas_mosaic_gpu.route_forward, pallas_mosaic_gpu.route_backward

    def count_fwd(*args, **kwargs):
        calls["forward"] += 1
        return fwd(*args, **kwargs)

    def count_bwd(*args, **kwargs):
        calls["backward"] += 1
        calls["accumulated"] += sum(a is not None for a in (args[5] if len(args) > 5 else kwargs["accumulate"]))
        return bwd(*args, **kwargs)

    monkeypatch.setattr(pallas_mosaic_gpu, "route_forward", count_fwd)
    monkeypatch.setattr(pallas_mosaic_gpu, "route_backward", count_bwd)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 32)  # 32 tokens a call
    results = []
    for kernel in ("xla", IMPL):
        cfg = model_config(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32,
                           dtype="float32", remat="none", scan_layers=False,
                           residual=dict(mode=mode, block_layers=1, impl=kernel, interpret=kernel != "xla",
                                         gate=mode == "delta_block"))
        model = Transformer(cfg)
        params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
        keys = iter(jax.random.split(jax.random.key(2), 64))
        params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), params)
        loss_fn = lambda p: lm_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
        results.append(jax.jit(jax.value_and_grad(loss_fn))(params))
    assert calls["forward"] and calls["backward"] and calls["accumulated"], calls
    (loss_x, grads_x), (loss_k, grads_k) = results
    assert float(loss_k) == pytest.approx(float(loss_x), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5), grads_x, grads_k)


def test_unrunnable_mosaic_gpu_kernel_falls_back_with_one_reason(monkeypatch):
    """On a CPU without interpret, for token counts it cannot tile, D it cannot split, and on a jax without
    the Mosaic GPU interpreter: one warning naming why, and the xla result. "auto" never picks it (only a
    GPU measurement may); `pass_sources` needs a sequence of sources."""
    rng = np.random.default_rng(0)
    api._WARNED.clear()
    for (B, T, D), interpret, words in (((2, 16, 64), False, "compiles for gpu only"),
                                        ((2, 5, 64), True, "not a multiple of 32"),
                                        ((2, 16, 40), True, "D=40")):
        sources = [jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32) for _ in range(3)]
        query, gain = jnp.asarray(rng.normal(size=D), jnp.float32), jnp.ones(D)
        with pytest.warns(UserWarning, match=words):
            out = depth_route(sources, [True, False, True], query, gain, implementation=IMPL, interpret=interpret)
        np.testing.assert_allclose(out, reference.depth_route(jnp.stack(sources), jnp.array([True, False, True]),
                                                              query, gain), rtol=1e-6)
    for platform in ("gpu", "tpu", "cpu"):
        monkeypatch.setattr(api, "target_platform", lambda p=platform: p)
        assert api.implementation_for("auto") != IMPL and api.implementation_for(IMPL) == IMPL
    monkeypatch.undo()
    with pytest.raises(ValueError, match="pass_sources takes a sequence"):
        depth_route(jnp.ones((2, 1, 32, 32)), [True, True], jnp.ones(32), jnp.ones(32), pass_sources=True)
    with pytest.raises(ValueError, match="one shape and dtype"):
        depth_route([jnp.ones((1, 32, 32)), jnp.ones((1, 32, 16))], [True, True], jnp.ones(32), jnp.ones(32))
