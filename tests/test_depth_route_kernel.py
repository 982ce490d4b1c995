"""The fused depth-routing kernels (kernels_pallas.depth_route) against the oracle
`deltares.nn.routing.depth_route`: forward and gradients in interpret mode on CPU (compiled for
the GPU where the tests run on one, see kernel_mode), dispatch and
fallback, bad input, the TPU kernel compiled ahead of time for a TPU slice (in a subprocess,
as in test_aot.py) and the GPU kernel lowered to Triton IR for CUDA.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_mode
from deltares.nn import routing
from kernels_pallas.depth_route import api, depth_route, pallas_gpu, pallas_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ("pallas_tpu", "pallas_gpu")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def make_mask(kind, key, S, B, T):
    if kind == "all":
        return jnp.ones((S,), bool)
    if kind == "one":  # a single valid source, not the first
        return jnp.arange(S) == S // 2
    if kind == "random":  # per source, at least one valid
        return jax.random.bernoulli(key, 0.6, (S,)).at[S - 1].set(True)
    shape = (S, B, T) if kind == "tokens" else (S, 1, T)  # per token, or broadcastable over B
    return jax.random.bernoulli(key, 0.5, shape).at[jax.random.randint(key, (), 0, S)].set(True)


def make_inputs(S, B, T, D, dtype, mask, residual, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    sources = (jax.random.normal(k[0], (S, B, T, D)) * jnp.exp(jax.random.normal(k[1], (S, 1, 1, 1)))).astype(dtype)
    query = 3.0 * jax.random.normal(k[2], (D,)) / np.sqrt(D)  # logits of order 3: sharp routing
    gain = 1.0 + 0.2 * jax.random.normal(k[3], (D,))
    res = jax.random.normal(k[4], (B, T, D)).astype(dtype) if residual else None
    return sources, make_mask(mask, k[5], S, B, T), query, gain, res


def route_and_grads(fn, sources, valid, query, gain, res, seed=1):
    """Output and the gradients of <out, random cotangent> for sources, query, gain, residual."""
    ct = jax.random.normal(jax.random.key(seed), sources.shape[1:]).astype(sources.dtype)

    @jax.jit
    def run(sources, valid, query, gain, res, ct):
        out, vjp = jax.vjp(lambda s, w, g, r: fn(s, valid, w, g, r), sources, query, gain, res)
        return out, vjp(ct)

    return run(sources, valid, query, gain, res, ct)


def assert_close(x, ref, tol, what):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()), err_msg=what)


CASES = [  # S, B, T, D, dtype, mask, residual
    (4, 2, 8, 32, jnp.float32, "random", True),
    (1, 1, 8, 64, jnp.float32, "all", False),  # S = 1
    (5, 2, 4, 48, jnp.bfloat16, "one", True),  # D not a power of two (GPU pads)
    (6, 2, 4, 32, jnp.float32, "tokens", False),  # per-token mask [S, B, T]
    (3, 2, 5, 40, jnp.bfloat16, "bcast", True),  # mask [S, 1, T]; B*T = 10 (odd tiles)
    (73, 1, 8, 16, jnp.float32, "random", True),  # S = 2L + 1 of a 36-layer model
]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}-{c[2]}x{c[3]}-{jnp.dtype(c[4]).name}-{c[5]}-res{c[6]:d}")
def test_kernel_matches_oracle(impl, case):
    S, B, T, D, dtype, mask, residual = case
    args = make_inputs(S, B, T, D, dtype, mask, residual, seed=S)
    interpret = kernel_mode.interpret(impl)
    out, grads = route_and_grads(lambda *a: depth_route(*a, implementation=impl, interpret=interpret), *args)
    ref_out, ref_grads = route_and_grads(routing.depth_route, *args)
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == (B, T, D)
    assert_close(out, ref_out, tol, "out")
    for name, g, r in zip(("sources", "query", "gain", "residual"), grads, ref_grads):
        if r is None:
            assert g is None
            continue
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert_close(g, r, tol, name)
    if mask in ("all", "one", "random"):  # masked sources get exactly zero gradient
        assert not np.any(np.asarray(grads[0], np.float32)[~np.asarray(args[1])])


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_takes_the_key_norm_eps(impl):
    """Sources of RMS ~1e-2, where the key norm's eps matters: at eps 1e-6 and 1e-3 the kernel,
    forward and backward, follows the oracle at the same eps, and the two eps route differently."""
    sources, valid, query, gain, res = make_inputs(4, 2, 8, 32, jnp.float32, "random", True, seed=4)
    args = (sources * 1e-2, valid, query, gain, res)
    outs = {}
    for eps in (1e-6, 1e-3):
        out, grads = route_and_grads(
            lambda *a: depth_route(*a, implementation=impl, interpret=kernel_mode.interpret(impl), eps=eps), *args)
        ref_out, ref_grads = route_and_grads(lambda *a: routing.depth_route(*a, eps=eps), *args)
        assert_close(out, ref_out, 1e-5, f"out, eps={eps}")
        for name, g, r in zip(("sources", "query", "gain", "residual"), grads, ref_grads):
            assert_close(g, r, 1e-5, f"{name}, eps={eps}")
        outs[eps] = np.asarray(ref_out - res)  # the routed term
    assert np.abs(outs[1e-3] - outs[1e-6]).max() > 0.1 * np.abs(outs[1e-6]).max()


@pytest.mark.parametrize("impl", KERNELS)
def test_several_token_tiles_and_traced_mask(impl, monkeypatch):
    """Several tiles per call (on GPU a partial last one) and a mask traced under jit; the TPU
    kernel in the TPU interpret mode (simulated VMEM, DMAs and pipelining of the grid)."""
    monkeypatch.setattr(pallas_tpu, "MAX_TOKENS", 8)  # 6 tiles of 8 tokens
    monkeypatch.setattr(pallas_gpu, "TILE_ELEMS", 32 * 32)  # tiles of 32 tokens: 32 + 16
    interpret = kernel_mode.interpret(impl, tpu_simulator=True)
    sources, valid, query, gain, res = make_inputs(5, 4, 12, 32, jnp.float32, "random", True, seed=3)
    valid = valid.at[1].set(False)
    route = jax.jit(lambda s, v, w, g, r: depth_route(s, v, w, g, r, implementation=impl, interpret=interpret))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to xla
        out, grads = route_and_grads(route, sources, valid, query, gain, res)
    ref_out, ref_grads = route_and_grads(routing.depth_route, sources, valid, query, gain, res)
    assert_close(out, ref_out, 1e-5, "out")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, 1e-5, "grad")


@pytest.mark.parametrize("impl", KERNELS)
def test_lse_is_the_log_normaliser(impl):
    sources, valid, query, gain, _ = make_inputs(3, 2, 4, 32, jnp.float32, "random", False)
    S, B, T, D = sources.shape
    q_D = query * gain
    module = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[impl]
    _, lse = module.forward(sources.reshape(S, B * T, D), valid.astype(jnp.int32), None, q_D, None, eps=1e-6,
                            interpret=kernel_mode.interpret(impl))
    logits = jnp.einsum("sbtd,d->sbt", sources, q_D) * routing.inv_rms(sources)
    ref = jax.nn.logsumexp(jnp.where(valid[:, None, None], logits, -jnp.inf), axis=0)
    assert_close(lse.reshape(B, T), ref, 1e-5, "lse")


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(implementation="triton"), "implementation must be one of"),
        (dict(query=jnp.ones((7,))), "query must have shape"),
        (dict(gain=jnp.ones((1, 16))), "gain must have shape"),
        (dict(residual=jnp.ones((2, 4, 8))), "residual must have shape"),
        (dict(sources=jnp.ones((3, 8, 16))), "sources must be [S, B, T, D]"),
        (dict(valid=jnp.ones((4,), bool)), "valid has leading size 4"),
    ],
)
def test_bad_input_raises_value_error(change, words):
    kwargs = dict(sources=jnp.ones((3, 2, 4, 16)), valid=jnp.ones((3,), bool), query=jnp.ones((16,)),
                  gain=jnp.ones((16,)), residual=None, implementation="pallas_tpu", interpret=True)
    kwargs.update(change)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        depth_route(**kwargs)


def test_default_on_cpu_is_xla_and_unrunnable_kernels_fall_back():
    sources, valid, query, gain, res = make_inputs(3, 2, 4, 16, jnp.float32, "random", True)
    ref = routing.depth_route(sources, valid, query, gain, res)
    assert api.target_platform() == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the default picks xla silently
        np.testing.assert_array_equal(depth_route(sources, valid, query, gain, res), ref)
        np.testing.assert_array_equal(depth_route(sources, valid, query, gain, res, implementation="xla"), ref)
    api._WARNED.clear()
    for impl in KERNELS:  # a compiled kernel cannot run on the CPU: one warning, xla results
        with pytest.warns(UserWarning, match=f"{impl} cannot run"):
            out = depth_route(sources, valid, query, gain, res, implementation=impl)
        np.testing.assert_array_equal(out, ref)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # only once
            depth_route(sources, valid, query, gain, res, implementation=impl)
    # shapes a kernel cannot take: D above the GPU kernel's limit
    big = jnp.ones((1, 1, 1, pallas_gpu.MAX_D * 2))
    with pytest.warns(UserWarning, match="exceeds"):
        out = depth_route(big, [True], big[0, 0, 0], big[0, 0, 0], implementation="pallas_gpu", interpret=True)
    np.testing.assert_allclose(out, big[0], rtol=1e-6)


def test_auto_is_the_kernel_measured_fastest_on_each_platform(monkeypatch):
    """impl "auto": on a GPU the Triton kernel per sublayer and XLA for phase one; XLA on a TPU and a CPU, silently."""
    for platform, sublayer, phase_one in (("gpu", "pallas_gpu", "xla"), ("tpu", "xla", "xla"), ("cpu", "xla", "xla")):
        monkeypatch.setattr(api, "target_platform", lambda p=platform: p)
        assert api.implementation_for("auto") == sublayer
        assert api.implementation_for("auto", phase_one=True) == phase_one
        for impl in ("xla", "pallas", "pallas_gpu"):
            assert api.implementation_for(impl) == impl  # any other choice is kept
    monkeypatch.undo()
    sources, valid, query, gain, res = make_inputs(3, 2, 4, 16, jnp.float32, "random", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        np.testing.assert_array_equal(depth_route(sources, valid, query, gain, res, implementation="auto"),
                                      routing.depth_route(sources, valid, query, gain, res))


def test_transformer_routes_auto_in_xla_under_remat_and_for_statistics():
    """The Transformer's routers: "auto" stays "auto" (the kernel on a GPU) without remat, and is XLA under
    remat, for routing statistics and with a null source outside two-phase routing; an explicit choice is
    kept under remat."""
    from deltares.nn.decoder import router_impl
    from experiments.debug import get_config

    model = get_config("delta_block").model
    model.remat, model.residual.impl = "none", "auto"
    assert router_impl(model) == "auto" and router_impl(model, return_stats=True) == "xla"
    model.residual.null_source = True
    assert router_impl(model) == "xla" and router_impl(model, two_phase=True) == "auto"
    model.residual.null_source = False
    for remat in ("full", "dots"):
        model.remat = remat
        assert router_impl(model) == "xla"
        model.residual.impl = "pallas_gpu"
        assert router_impl(model) == "pallas_gpu"
        model.residual.impl = "auto"


@pytest.mark.parametrize("D", [1280, 8192])
def test_gpu_kernel_lowers_to_triton_for_cuda(D):
    """The Triton lowering (power-of-two blocks, masked loads) runs without a GPU: the single-query
    kernels and phase one's K-query kernels."""
    sds = jax.ShapeDtypeStruct
    S, N, K = 5, 96, 4

    def fwd_bwd(src, valid, bias, q, res, dout, bias_SK, q_KD, dout_KND):
        out, lse = pallas_gpu.forward(src, valid, bias, q, res, eps=1e-6)
        out_K, lse_K = pallas_gpu.prefix_forward(src, valid, bias_SK, q_KD, eps=1e-6)
        return (out, pallas_gpu.backward(src, valid, bias, q, lse, dout, eps=1e-6), out_K,
                pallas_gpu.prefix_backward(src, valid, bias_SK, q_KD, lse_K, lse_K, dout_KND, src, eps=1e-6))

    args = (sds((S, N, D), jnp.bfloat16), sds((S,), jnp.int32), sds((S, N), jnp.float32), sds((D,), jnp.float32),
            sds((N, D), jnp.bfloat16), sds((N, D), jnp.bfloat16), sds((S, K), jnp.float32), sds((K, D), jnp.float32),
            sds((K, N, D), jnp.float32))
    # The Triton lowering asks for the GPU it targets (jax 0.12; jax 0.10 did not): an abstract H100.
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4
    assert "depth_route_prefix_fwd" in text and "depth_route_prefix_bwd" in text


AOT_SCRIPT = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from deltares import aot
from kernels_pallas.depth_route import depth_route, route_prefix

devices = aot.topology_devices("v5e:2x2")
mesh = jax.make_mesh((4,), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
S, B, T, D = 9, 4, 256, 1280
sds = lambda shape, dtype, *axes: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))
for valid, valid_spec in ((sds((S,), jnp.bool_), P()), (sds((S, B, T), jnp.bool_, None, "data"), P(None, "data"))):
    args = (sds((S, B, T, D), jnp.bfloat16, None, "data"), valid, sds((D,), jnp.float32), sds((D,), jnp.float32),
            sds((B, T, D), jnp.bfloat16, "data"))
    route = jax.shard_map(lambda *a: depth_route(*a, implementation="pallas_tpu"), mesh=mesh,
                          in_specs=(P(None, "data"), valid_spec, P(), P(), P("data")), out_specs=P("data"))
    loss = lambda *a: jnp.sum(route(*a).astype(jnp.float32) ** 2)
    with jax.set_mesh(mesh):
        forward = jax.jit(route).lower(*args).compile().as_text()
        backward = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(*args).compile().as_text()
    print("KERNELS", len(valid.shape), forward.count("tpu_custom_call"), backward.count("tpu_custom_call"))
# phase one of two-phase routing: 6 queries (a group of 3 layers), each its own sources
K = 6
args = (args[0], sds((K, S), jnp.bool_), sds((K, D), jnp.float32), sds((K, D), jnp.float32))
prefix = jax.shard_map(lambda *a: route_prefix(*a, implementation="pallas_tpu"), mesh=mesh,
                       in_specs=(P(None, "data"), P(), P(), P()), out_specs=(P(None, "data"), P(None, "data")))
loss = lambda *a: sum(jnp.sum(x ** 2) for x in prefix(*a))
with jax.set_mesh(mesh):
    forward = jax.jit(prefix).lower(*args).compile().as_text()
    backward = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*args).compile().as_text()
print("PREFIX", forward.count("tpu_custom_call"), backward.count("tpu_custom_call"))
"""


@pytest.mark.skipif(not importlib.util.find_spec("libtpu"), reason="libtpu is not installed (requirements.txt)")
def test_tpu_kernels_compile_for_a_tpu_slice_in_shard_map():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(AOT_SCRIPT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # forward: one Mosaic kernel; jax.grad: the forward and the backward kernel; [S] and [S, B, T] masks;
    # the same for the K-query kernels of phase one
    for line in ("KERNELS 1 1 2", "KERNELS 3 1 2", "PREFIX 1 2"):
        assert line in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- in the model


@pytest.mark.parametrize("mode, impl, norm_eps, group", [
    ("full_attnres", "pallas_tpu", 1e-6, 0), ("block_attnres", "pallas_tpu", 1e-6, 0), ("delta", "pallas_tpu", 1e-6, 0),
    ("delta_block", "pallas_tpu", 1e-6, 0), ("delta_block", "pallas_gpu", 1e-6, 0),
    ("block_attnres", "pallas_gpu", 1e-3, 0), ("delta_block", "pallas_tpu", 1e-3, 0),
    ("delta", "pallas_tpu", 1e-3, 2), ("delta_block", "pallas_gpu", 1e-6, 2), ("full_attnres", "pallas_gpu", 1e-6, 2),
    ("block_attnres", "pallas_tpu", 1e-6, 2)])
def test_model_with_kernel_equals_xla(mode, impl, norm_eps, group, monkeypatch):
    """`model.residual.impl` set to a kernel (interpret mode) gives the loss and gradients of "xla",
    through the scanned, rematerialised depth pass (the store-once backward) with a gate. With
    norm_eps=1e-3 the embedding (a source of every router) has RMS ~1e-2, so the kernel must
    take config.model.norm_eps: with the default eps its routing would differ. With `group`
    (residual.group_layers) the pass is two-phase: phase one is the K-query kernel (prefix_*), the
    merges XLA (the null source of `delta` there); compared with ungrouped XLA routing."""
    from deltares.nn.config import model_config
    from deltares.nn.losses import lm_loss
    from deltares.nn.model import Transformer

    names = ("prefix_forward", "prefix_backward") if group else ("forward", "backward")
    calls = dict.fromkeys(names, 0)  # the kernel really runs (no silent fallback to xla)
    backend = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}[impl]
    for name in calls:
        def counted(*args, _fn=getattr(backend, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(backend, name, counted)

    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
    results = []
    for kernel in ("xla", impl):
        cfg = model_config(vocab_size=32, d_model=16, n_layers=2 + 2 * (group > 0), n_heads=2, n_kv_heads=1,
                           head_dim=8, d_ff=32, dtype="float32", remat="full", norm_eps=norm_eps,
                           residual=dict(mode=mode, block_layers=max(1, group), impl=kernel,
                                         interpret=kernel_mode.interpret(kernel),
                                         gate=mode == "delta_block", group_layers=group if kernel != "xla" else 0,
                                         null_source=mode == "delta" and group > 0))
        model = Transformer(cfg)
        params = model.init(jax.random.key(1), tokens)["params"]
        keys = iter(jax.random.split(jax.random.key(2), 64))
        params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), params)
        if norm_eps > 1e-6:  # embedding RMS ~1e-2: mean square 1e-4, well under eps
            params["embed"] = jax.tree.map(lambda x: 0.03 * x, params["embed"])
            assert float(jnp.mean(jax.tree.leaves(params["embed"])[0] ** 2)) < 0.3 * norm_eps
        loss_fn = lambda p: lm_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
        results.append(jax.jit(jax.value_and_grad(loss_fn))(params))
    assert all(calls.values()), calls
    (loss_x, grads_x), (loss_k, grads_k) = results
    assert float(loss_k) == pytest.approx(float(loss_x), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5), grads_x, grads_k)


def test_kernel_package_is_standalone_and_its_oracle_is_deltares_routing():
    """kernels_pallas imports nothing of deltares; its own reference ("xla") computes what
    deltares.nn.routing computes, forward and backward, with every kind of mask."""
    code = "import sys, kernels_pallas.depth_route as k; k.depth_route; print(sorted(m for m in sys.modules if m.startswith('deltares')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from kernels_pallas.depth_route import reference  # noqa: PLC0415

    S, B, T, D = 5, 2, 3, 16
    for mask in ("all", "one", "random", "tokens", "broadcast"):
        sources, valid, query, gain, residual = make_inputs(S, B, T, D, jnp.float32, mask, True, seed=3)
        for res in (None, residual):
            def ours(s, q, g, res=res):
                return jnp.sum(jnp.sin(reference.depth_route(s, valid, q, g, res, eps=1e-3)))

            def theirs(s, q, g, res=res):
                return jnp.sum(jnp.sin(routing.depth_route(s, valid, q, g, res, eps=1e-3)))

            for a, b in zip(jax.grad(ours, (0, 1, 2))(sources, query, gain), jax.grad(theirs, (0, 1, 2))(sources, query, gain)):
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
            np.testing.assert_allclose(reference.depth_route(sources, valid, query, gain, res),
                                       routing.depth_route(sources, valid, query, gain, res), atol=1e-6, rtol=1e-6)
    valid_KS = jnp.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    queries, gains = jax.random.normal(jax.random.key(1), (2, 3, D))
    got = reference.route_prefix(sources, valid_KS, queries, gains, eps=1e-3)
    want = routing.route_prefix(sources, routing.inv_rms(sources, 1e-3), valid_KS, queries, gains)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="query must have shape"):
        reference.depth_route(sources, valid, query[:3], gain)
