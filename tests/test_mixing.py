"""The mixing modes (hyper, mhc, denseformer) against plain loops written from their papers'
equations (Zhu et al. 2024, Alg. 2; DeepSeek's mHC, eqs. 5-8 with Sinkhorn-Knopp; Pagliardini et al.
2024, eq. 1 with dilation and period), forward and gradients, in linen and NNX; Sinkhorn's projection;
and the initialisations that start as a plain residual."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deltares.nn import DepthStack, layer_params
from deltares.nn import nnx as dnnx
from deltares.nn.mixing import sinkhorn
from deltares.nn.config import model_config, validate_model_config

EPS = 1e-6
NAMES = ("attn", "mlp")


class TanhDense(nn.Module):
    @nn.compact
    def __call__(self, x_BTD):
        return jnp.tanh(nn.Dense(x_BTD.shape[-1])(x_BTD))


class TanhLinear(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x_BTD):
        return jnp.tanh(self.linear(x_BTD))


# ----------------------------------------------------------------------------- references

def sinkhorn_ref(z, iterations):
    """exp of the logits normalised by rows, + 1e-6, then column and row normalisation in turn (NumPy)."""
    m = np.exp(z - z.max(axis=-1, keepdims=True))
    m = m / m.sum(axis=-1, keepdims=True) + EPS
    for _ in range(iterations):
        m = m / m.sum(axis=-2, keepdims=True)
        m = m / m.sum(axis=-1, keepdims=True)
    return m


def _rms_normed(x):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)


def _sublayer(p, x):
    w = p["Dense_0"] if "Dense_0" in p else p["linear"]
    return jnp.tanh(x @ w["kernel"] + w["bias"])


def hyper_ref(e, layers, n):
    """Hyper-connections, sublayer by sublayer: x = A_m^T H, H' = B^T y + A_r^T H, the static A_m = e_(j mod n),
    A_r = I, B = 1 plus the learned offsets, and where the parameters are dynamic s tanh(norm(H) W) added."""
    H = [e] * n
    j = 0
    for lp in layers:
        for name in NAMES:
            p = lp[f"{name}_router"]
            a_m = [(1.0 if i == j % n else 0.0) + p["read"][i] for i in range(n)]
            a_r = [[(1.0 if i == k else 0.0) + p["mix"][i, k] for k in range(n)] for i in range(n)]
            b = [1.0 + p["write"][k] for k in range(n)]
            if "w_read" in p:
                hbar = [_rms_normed(h) for h in H]
                a_m = [a_m[i] + p["s_alpha"][0] * jnp.tanh(hbar[i] @ p["w_read"]) for i in range(n)]
                a_r = [[a_r[i][k] + p["s_alpha"][0] * jnp.tanh(hbar[i] @ p["w_mix"][:, k]) for k in range(n)]
                       for i in range(n)]
                b = [b[k] + p["s_beta"][0] * jnp.tanh(hbar[k] @ p["w_write"]) for k in range(n)]
            x = sum(jnp.asarray(a_m[i])[..., None] * H[i] for i in range(n))
            y = _sublayer(lp[name], x)
            H = [sum(jnp.asarray(a_r[i][k])[..., None] * H[i] for i in range(n)) + jnp.asarray(b[k])[..., None] * y
                 for k in range(n)]
            j += 1
    return sum(H)


def mhc_ref(e, layers, n, iterations):
    """mHC: x~ = RMSNorm(vec H); H_pre = sigmoid(a_pre x~ phi_pre + b_pre), H_post = 2 sigmoid(...),
    H_res = Sinkhorn(a_res mat(x~ phi_res) + b_res); H' = H_res H + H_post^T F(H_pre H)."""
    H = [e] * n
    for lp in layers:
        for name in NAMES:
            p = lp[f"{name}_router"]
            D = e.shape[-1]
            flat = _rms_normed(jnp.concatenate(H, axis=-1))
            z = flat @ p["phi"].reshape(n * D, -1)
            a, bias = p["scale"], p["bias"]
            pre = jax.nn.sigmoid(a[0] * z[..., :n] + bias[:n])
            post = 2 * jax.nn.sigmoid(a[1] * z[..., n:2 * n] + bias[n:2 * n])
            logits = (a[2] * z[..., 2 * n:] + bias[2 * n:]).reshape(z.shape[:-1] + (n, n))
            m = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
            m = m / m.sum(axis=-1, keepdims=True) + EPS
            for _ in range(iterations):
                m = m / m.sum(axis=-2, keepdims=True)
                m = m / m.sum(axis=-1, keepdims=True)
            x = sum(pre[..., i:i + 1] * H[i] for i in range(n))
            y = _sublayer(lp[name], x)
            H = [sum(m[..., i, k:k + 1] * H[k] for k in range(n)) + post[..., i:i + 1] * y for i in range(n)]
    return sum(H)


def denseformer_ref(e, layers, dilation, period):
    """DenseFormer: X_0 = e, X_i = block_i(Y_(i-1)); Y_i = sum_j alpha_ij X_j over j <= i with (i - j) a multiple of
    the dilation where i is a multiple of the period (alpha = e_i + the learned w), else Y_i = X_i."""
    X, y = [e], e
    for i, lp in enumerate(layers, start=1):
        h = y
        for name in NAMES:
            h = h + _sublayer(lp[name], h)
        X.append(h)
        if i % period == 0:
            w = lp["mlp_router"]["weights"]
            y = sum(((1.0 if j == i else 0.0) + w[j]) * X[j] for j in range(i + 1) if (i - j) % dilation == 0)
        else:
            y = h
    return y


def reference(mode, e, layers, kw):
    if mode == "hyper":
        return hyper_ref(e, layers, kw["streams"])
    if mode == "mhc":
        return mhc_ref(e, layers, kw["streams"], kw.get("sinkhorn_iterations", 20))
    return denseformer_ref(e, layers, kw.get("dilation", 1), kw.get("period", 1))


def close(got, want, rel=1e-9):
    """Equal within float64 roundoff: `rel` of the largest magnitude of `want`, elementwise."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * max(1.0, float(np.abs(want).max())))


def _perturbed(params, key, scale=0.3, dtype=jnp.float64):
    """Every parameter moved by a random amount (so that the learned offsets and dynamic weights all act)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [(x + scale * jax.random.normal(k, x.shape)).astype(dtype)
                                     for x, k in zip(leaves, keys)])


CASES = [
    ("hyper", dict(streams=3, dynamic=False), (2, 5, 8), 3),
    ("hyper", dict(streams=2, dynamic=True), (1, 4, 16), 4),
    ("mhc", dict(streams=2, sinkhorn_iterations=5), (2, 4, 8), 3),
    ("mhc", dict(streams=4), (1, 3, 16), 2),
    ("denseformer", dict(), (2, 5, 8), 4),
    ("denseformer", dict(dilation=2, period=2), (1, 4, 8), 5),
]


@pytest.mark.parametrize("mode,kw,shape,n_layers,scan", [CASES[i] + (True,) for i in (0, 3, 4, 5)] +
                         [CASES[i] + (False,) for i in (1, 2, 5)])  # every mode scanned and unrolled
@jax.enable_x64(True)
def test_linen_stack_equals_the_papers_equations(mode, kw, shape, n_layers, scan):
    e = jax.random.normal(jax.random.key(0), shape, jnp.float64)
    stack = DepthStack((TanhDense, TanhDense), n_layers=n_layers, mode=mode, scan=scan, remat=scan, **kw)
    params = _perturbed(nn.meta.unbox(stack.init(jax.random.key(1), e)["params"]), jax.random.key(2))
    cot = jax.random.normal(jax.random.key(3), shape, jnp.float64)

    def loss(p, e):
        return jnp.sum(stack.apply({"params": p}, e) * cot)

    def ref_loss(layers, e):
        return jnp.sum(reference(mode, e, layers, kw) * cot)

    out, ref = stack.apply({"params": params}, e), reference(mode, e, layer_params(params, stack), kw)
    close(out, ref)
    (g_p, g_e), (r_p, r_e) = jax.grad(loss, (0, 1))(params, e), jax.grad(ref_loss, (0, 1))(layer_params(params, stack), e)
    close(g_e, r_e)
    for got, want in zip(jax.tree.leaves(layer_params(g_p, stack)), jax.tree.leaves(r_p)):
        close(got, want)
    routers = [v for lp in layer_params(g_p, stack) for k, v in lp.items() if k.endswith("_router")]
    for name in routers[-1]:  # every kind of mixing weight acts somewhere
        assert any(float(jnp.abs(r[name]).max()) > 0 for r in routers), name


@pytest.mark.parametrize("mode,kw,shape,n_layers", [CASES[1], CASES[2], CASES[5]])
@jax.enable_x64(True)
def test_nnx_stack_equals_the_papers_equations(mode, kw, shape, n_layers):
    e = jax.random.normal(jax.random.key(0), shape, jnp.float64)
    D = shape[-1]
    stack = dnnx.DepthStack(lambda rngs: (TanhLinear(D, rngs), TanhLinear(D, rngs)), n_layers, D, mode,
                            rngs=nnx.Rngs(1), **kw)
    graph, params, rest = nnx.split(stack, nnx.Param, ...)
    params = nnx.State(_perturbed(nnx.to_pure_dict(params), jax.random.key(2)))
    nnx.update(stack, params)
    layers = layer_params(nnx.to_pure_dict(nnx.state(stack, nnx.Param)), stack)
    close(stack(e), reference(mode, e, layers, kw))
    g = nnx.grad(lambda s: jnp.sum(s(e) ** 2))(stack)
    r = jax.grad(lambda ls: jnp.sum(reference(mode, e, ls, kw) ** 2))(layers)
    got = layer_params(nnx.to_pure_dict(g), stack)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(r)):
        close(a, b)


@pytest.mark.parametrize("mode,kw,scan", [("hyper", dict(streams=3, dynamic=False), True), ("hyper", dict(streams=4), False),
                                          ("denseformer", dict(dilation=2, period=1), True),
                                          ("denseformer", dict(period=2), False)])
def test_initialisation_starts_as_a_plain_residual(mode, kw, scan):
    """At initialisation a hyper-connection keeps n copies of the baseline stream (its output, their sum, is n
    times baseline's) and a DenseFormer is the baseline, given the same sublayers."""
    e = jax.random.normal(jax.random.key(0), (2, 6, 8))
    base = DepthStack((TanhDense, TanhDense), n_layers=3, mode="baseline", scan=scan)
    stack = DepthStack((TanhDense, TanhDense), n_layers=3, mode=mode, scan=scan, **kw)
    base_params = base.init(jax.random.key(1), e)["params"]
    params = nn.meta.unbox(stack.init(jax.random.key(2), e)["params"])
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if any("router" in str(k) for k in path) else _get(nn.meta.unbox(base_params), path), params)
    want = base.apply({"params": base_params}, e) * (kw.get("streams", 4) if mode == "hyper" else 1)
    np.testing.assert_allclose(stack.apply({"params": params}, e), want, rtol=1e-6, atol=1e-6)


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_mhc_initialisation_reads_and_writes_positively_and_mixes_doubly_stochastically():
    from deltares.nn.mixing import connection_shapes, initializer, mhc_coefficients

    n, D = 4, 16
    params = {name: initializer(v)(jax.random.key(i), shape) for i, (name, (shape, v, _)) in
              enumerate(connection_shapes(n, D, True, True).items())}
    H = jax.random.normal(jax.random.key(9), (n, 2, 3, D))
    read, mix, write = mhc_coefficients(params, H, iterations=20)
    assert bool(jnp.all((read > 0) & (read < 1))) and bool(jnp.all((write > 0) & (write < 2)))
    np.testing.assert_allclose(mix.sum(-1), 1, atol=1e-3)
    np.testing.assert_allclose(mix.sum(-2), 1, atol=1e-5)
    np.testing.assert_allclose(read, 0.5, atol=0.05)  # the scales start at 0.01: near sigmoid(0)


@pytest.mark.parametrize("scale,iterations", [(0.1, 20), (1.0, 20), (4.0, 300)])
@pytest.mark.parametrize("n", [2, 4, 6])
def test_sinkhorn_is_doubly_stochastic_and_matches_the_reference(n, scale, iterations):
    """Rows sum to 1 exactly, columns within 1e-3 (logits of a few units converge in the paper's 20 iterations;
    widely spread ones need more: with logits of scale 4, 20 leave columns up to 2% off)."""
    z = scale * np.asarray(jax.random.normal(jax.random.key(n), (5, n, n)))
    m = np.asarray(sinkhorn(jnp.asarray(z, jnp.float32), iterations))
    np.testing.assert_allclose(m, sinkhorn_ref(z.astype(np.float64), iterations), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m.sum(-1), 1, atol=1e-5)
    np.testing.assert_allclose(m.sum(-2), 1, atol=1e-3)
    assert (m >= 0).all()


@pytest.mark.parametrize("logits", [1e4, 1e30, 3e38, 88.0])
def test_sinkhorn_gradient_is_finite_for_extreme_logits(logits):
    n = 4
    z = jnp.asarray(np.where(np.arange(n * n).reshape(n, n) % 3 == 0, logits, -logits), jnp.float32)
    cot = jax.random.normal(jax.random.key(0), (n, n))
    m, g = jax.value_and_grad(lambda z: jnp.sum(sinkhorn(z, 20) * cot))(z)
    assert np.isfinite(m) and np.isfinite(np.asarray(g)).all()
    assert np.isfinite(np.asarray(sinkhorn(z, 20))).all()


def test_sinkhorn_in_bfloat16_computes_in_float32():
    z = jax.random.normal(jax.random.key(1), (3, 3)).astype(jnp.bfloat16)
    assert sinkhorn(z, 20).dtype == jnp.float32


def test_hyper_modes_refuse_stream_hooks_and_mixers_are_required():
    from deltares.nn import DepthRouting

    e = jnp.ones((1, 2, 4))
    with pytest.raises(ValueError, match="stream hooks"):
        DepthStack((TanhDense, TanhDense), 2, mode="hyper", stream_hook=lambda h: h).init(jax.random.key(0), e)
    routing = DepthRouting("hyper", 2, streams=2)
    with pytest.raises(ValueError, match="hyper-connection"):
        routing.input(routing.start(e), 0, None)
    routing = DepthRouting("denseformer", 2)
    state = routing.start(e)
    with pytest.raises(ValueError, match="DepthWeights"):
        routing.add(state, 1, e)
    for bad in (0, -1, 65, 2**31 - 1):  # a huge count would build its tables before anything else could refuse it
        with pytest.raises(ValueError, match=rf"streams={bad} must be an integer in \[1, 64\]"):
            DepthRouting("hyper", 2, streams=bad)
    with pytest.raises(ValueError, match="sinkhorn_iterations=0"):
        DepthRouting("mhc", 2, sinkhorn_iterations=0)
    # DenseFormer's dilation and period beyond the depth would silently train something else (no averages at all,
    # or each layer averaging only its own output): refused in the layer and in the model's config
    DepthRouting("denseformer", 3, dilation=3, period=3)
    for field in ("dilation", "period"):
        with pytest.raises(ValueError, match=rf"{field}=4 must be an integer in \[1, n_layers=3\]"):
            DepthRouting("denseformer", 3, **{field: 4})
        with pytest.raises(ValueError, match=rf"residual\.{field}=4 is invalid"):
            validate_model_config(model_config(n_layers=3, residual=dict(mode="denseformer", **{field: 4})))


@pytest.mark.parametrize("mode", ["hyper", "denseformer"])
def test_a_loop_of_your_own_equals_the_stack(mode):
    """DepthRouting's input/add in a Python loop of one's own, with the linen mixers, gives the stack's result."""
    kw = dict(streams=2) if mode == "hyper" else dict(dilation=2)
    from deltares.nn import DepthRouting

    e = jax.random.normal(jax.random.key(0), (2, 3, 8))
    stack = DepthStack((TanhDense, TanhDense), n_layers=3, mode=mode, scan=False, **kw)
    params = _perturbed(nn.meta.unbox(stack.init(jax.random.key(1), e)["params"]), jax.random.key(2),
                        dtype=jnp.float32)
    layers = layer_params(params, stack)
    routing = DepthRouting(mode, 3, **kw)

    class Loop(nn.Module):
        @nn.compact
        def __call__(self, e):
            state = routing.start(e)
            for j in range(6):
                router = routing.linen_router(j % 2, 2, f"r{j}")
                x = routing.input(state, j, router)
                state = routing.add(state, j, TanhDense(name=f"s{j}")(x), router)
            return routing.output(state)

    loop_params = {}
    for j in range(6):
        lp = layers[j // 2]
        loop_params[f"s{j}"] = lp[NAMES[j % 2]]
        if f"{NAMES[j % 2]}_router" in lp:
            loop_params[f"r{j}"] = lp[f"{NAMES[j % 2]}_router"]
    np.testing.assert_allclose(Loop().apply({"params": loop_params}, e), stack.apply({"params": params}, e),
                               rtol=1e-6, atol=1e-6)


