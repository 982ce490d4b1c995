"""`deltares.nn.routing.depth_route` against a float64 NumPy reference written here.

    z_i = query . (gain * s_i / sqrt(mean(s_i^2) + eps))     a = softmax_i(z) over valid i
    route = sum_i a_i s_i        (+ residual for the additive modes)
"""

import itertools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deltares.nn.routing import depth_route

BF16 = ml_dtypes.bfloat16


def seed_of(*parts):
    """A deterministic seed (Python's hash() of strings changes between runs)."""
    return zlib.crc32(repr(parts).encode())


# ----------------------------------------------------------------------------- reference


def ref_route(sources, valid, query, gain, residual=None, eps=1e-6):
    """Float64 reference. sources [S,B,T,D]; valid broadcastable to [S,B,T]. Returns (out, weights)."""
    s = np.asarray(sources, np.float64)
    S, B, T, D = s.shape
    valid = np.asarray(valid, bool)
    valid = valid.reshape(valid.shape + (1,) * (3 - valid.ndim))
    valid = np.broadcast_to(valid, (S, B, T))
    q = np.asarray(query, np.float64)
    g = np.asarray(gain, np.float64)
    rms = np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    z = np.einsum("sbtd,d->sbt", s / rms * g, q)
    z = np.where(valid, z, -np.inf)
    z = z - z.max(axis=0, keepdims=True)
    w = np.where(valid, np.exp(z), 0.0)
    w = w / w.sum(axis=0, keepdims=True)
    out = np.einsum("sbt,sbtd->btd", w, s)
    if residual is not None:
        out = out + np.asarray(residual, np.float64)
    return out, w


def random_mask(rng, shape, S):
    """A random bool mask of `shape` (leading axis S) with at least one valid source per token."""
    m = rng.random(shape) < 0.5
    flat = m.reshape(S, -1)
    empty = ~flat.any(axis=0)
    flat[rng.integers(0, S, size=flat.shape[1]), np.arange(flat.shape[1])] |= empty
    return flat.reshape(shape)


def make_inputs(rng, S, B, T, D, dtype=np.float32, q_scale=0.5):
    sources = rng.normal(size=(S, B, T, D)) * rng.uniform(0.2, 3.0, size=(S, B, T, 1))
    sources = sources.astype(dtype)
    query = (rng.normal(size=(D,)) * q_scale).astype(np.float32)
    gain = (1.0 + 0.3 * rng.normal(size=(D,))).astype(np.float32)
    residual = rng.normal(size=(B, T, D)).astype(dtype)
    return sources, query, gain, residual


SHAPES = [(1, 1, 1, 4), (1, 2, 3, 8), (2, 1, 5, 16), (3, 2, 4, 8), (5, 3, 2, 32), (9, 2, 3, 12)]
MASK_FORMS = ["all", "S", "SBT", "S11", "S1T"]


def build_mask(rng, form, S, B, T):
    if form == "all":
        return np.ones((S,), bool)
    if form == "S":
        return random_mask(rng, (S,), S)
    if form == "SBT":
        return random_mask(rng, (S, B, T), S)
    if form == "S11":
        return random_mask(rng, (S, 1, 1), S)
    if form == "S1T":
        return random_mask(rng, (S, 1, T), S)
    raise AssertionError(form)


# ----------------------------------------------------------------------------- float32


@pytest.mark.parametrize("additive", [False, True], ids=["replace", "add"])
@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_float32(shape, form, additive):
    S, B, T, D = shape
    rng = np.random.default_rng(seed_of(shape, form, additive))
    sources, query, gain, residual = make_inputs(rng, S, B, T, D)
    valid = build_mask(rng, form, S, B, T)
    res = residual if additive else None
    out, weights = depth_route(
        jnp.asarray(sources), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
        None if res is None else jnp.asarray(res), return_weights=True,
    )
    ref_out, ref_w = ref_route(sources, valid, query, gain, res)
    assert out.shape == (B, T, D) and out.dtype == jnp.float32
    assert weights.shape == (S, B, T)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5, atol=1e-6)
    w = np.asarray(weights)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-6)
    full_valid = np.broadcast_to(valid.reshape(valid.shape + (1,) * (3 - valid.ndim)), (S, B, T))
    assert np.all(w[~full_valid] == 0.0), "invalid sources must get exactly zero weight"
    assert np.all(w >= 0.0)


def test_routing_is_not_uniform_in_these_tests():
    """Guard: the query scale used above makes the weights far from uniform (else tests are weak)."""
    rng = np.random.default_rng(0)
    sources, query, gain, _ = make_inputs(rng, 5, 2, 3, 32)
    _, w = depth_route(jnp.asarray(sources), jnp.ones((5,), bool), jnp.asarray(query), jnp.asarray(gain),
                       return_weights=True)
    assert float(jnp.max(w)) > 0.5


def test_default_returns_only_output():
    rng = np.random.default_rng(1)
    sources, query, gain, _ = make_inputs(rng, 3, 2, 2, 8)
    out = depth_route(jnp.asarray(sources), np.ones(3, bool), jnp.asarray(query), jnp.asarray(gain))
    assert isinstance(out, jax.Array) and out.shape == (2, 2, 8)
    np.testing.assert_allclose(np.asarray(out), ref_route(sources, np.ones(3, bool), query, gain)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 1.0])
def test_eps_enters_the_key_norm(eps):
    rng = np.random.default_rng(2)
    sources, query, gain, _ = make_inputs(rng, 4, 2, 3, 8, q_scale=2.0)
    sources = sources * 0.05  # small sources: eps matters
    valid = np.ones(4, bool)
    out, w = depth_route(jnp.asarray(sources), valid, jnp.asarray(query), jnp.asarray(gain), eps=eps,
                         return_weights=True)
    ref_out, ref_w = ref_route(sources, valid, query, gain, eps=eps)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-6)


def test_uniform_weights_with_zero_query():
    """w = 0 (the safe init) gives uniform weights over the valid sources: the mean of them."""
    rng = np.random.default_rng(3)
    S, B, T, D = 4, 2, 3, 8
    sources, _, gain, residual = make_inputs(rng, S, B, T, D)
    valid = np.array([True, False, True, True])
    out, w = depth_route(jnp.asarray(sources), valid, jnp.zeros(D), jnp.asarray(gain), jnp.asarray(residual),
                         return_weights=True)
    np.testing.assert_allclose(np.asarray(w), np.broadcast_to(np.array([1, 0, 1, 1])[:, None, None] / 3, (S, B, T)),
                               atol=1e-7)
    expected = residual.astype(np.float64) + sources[valid].astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_invalid_sources_do_not_leak():
    """Huge values in masked slots must not change the output or the weights."""
    rng = np.random.default_rng(4)
    S, B, T, D = 4, 2, 3, 8
    sources, query, gain, residual = make_inputs(rng, S, B, T, D)
    valid = random_mask(rng, (S, B, T), S)
    poisoned = sources.copy()
    poisoned[~valid] = 1e4
    out, w = depth_route(jnp.asarray(poisoned), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
                         jnp.asarray(residual), return_weights=True)
    ref_out, ref_w = ref_route(sources, valid, query, gain, residual)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)


def test_zero_source_is_finite():
    """An all-zero source (an unwritten buffer slot) has rms sqrt(eps): logit 0, no NaN."""
    rng = np.random.default_rng(5)
    sources, query, gain, _ = make_inputs(rng, 3, 2, 2, 8)
    sources[1] = 0.0
    out, w = depth_route(jnp.asarray(sources), np.ones(3, bool), jnp.asarray(query), jnp.asarray(gain),
                         return_weights=True)
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(w)))
    ref_out, ref_w = ref_route(sources, np.ones(3, bool), query, gain)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)


def test_large_logits_are_stable():
    """A large query (sharp routing, logits ~1e3) stays finite and matches the stable reference."""
    rng = np.random.default_rng(6)
    sources, query, gain, _ = make_inputs(rng, 5, 2, 3, 16, q_scale=100.0)
    valid = random_mask(rng, (5, 2, 3), 5)
    out, w = depth_route(jnp.asarray(sources), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
                         return_weights=True)
    ref_out, ref_w = ref_route(sources, valid, query, gain)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(w), ref_w, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- single valid source


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("additive", [False, True], ids=["replace", "add"])
@pytest.mark.parametrize("S", [1, 4])
def test_single_valid_source(S, additive, dtype):
    """One valid source: replacement returns it exactly, additive returns residual + it."""
    rng = np.random.default_rng(7 + S)
    B, T, D = 2, 3, 8
    sources, query, gain, residual = make_inputs(rng, S, B, T, D, dtype=dtype)
    pick = S - 1 if S > 1 else 0
    valid = np.zeros(S, bool)
    valid[pick] = True
    res = residual if additive else None
    out, w = depth_route(jnp.asarray(sources), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
                         None if res is None else jnp.asarray(res), return_weights=True)
    assert out.dtype == jnp.dtype(dtype)
    expected = np.asarray(sources[pick], np.float32)
    if additive:
        expected = (np.asarray(residual, np.float32) + expected).astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
    expected_w = np.zeros((S, B, T), np.float32)
    expected_w[pick] = 1.0
    np.testing.assert_array_equal(np.asarray(w), expected_w)


def test_single_valid_source_per_token_mask():
    """A different single valid source at every token, through an [S, B, T] mask."""
    rng = np.random.default_rng(11)
    S, B, T, D = 4, 2, 5, 8
    sources, query, gain, residual = make_inputs(rng, S, B, T, D)
    pick = rng.integers(0, S, size=(B, T))
    valid = np.arange(S)[:, None, None] == pick[None]
    out = depth_route(jnp.asarray(sources), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
                      jnp.asarray(residual))
    chosen = np.take_along_axis(sources, pick[None, :, :, None], axis=0)[0]
    np.testing.assert_allclose(np.asarray(out), residual + chosen, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- bfloat16 and dtypes


@pytest.mark.parametrize("additive", [False, True], ids=["replace", "add"])
@pytest.mark.parametrize("form", ["S", "SBT"])
@pytest.mark.parametrize("shape", [(1, 2, 3, 8), (3, 2, 4, 16), (6, 1, 3, 32)], ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_bfloat16(shape, form, additive):
    S, B, T, D = shape
    rng = np.random.default_rng(seed_of(shape, form, additive, "bf16"))
    sources, query, gain, residual = make_inputs(rng, S, B, T, D, dtype=BF16)
    valid = build_mask(rng, form, S, B, T)
    res = residual if additive else None
    out, weights = depth_route(
        jnp.asarray(sources), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
        None if res is None else jnp.asarray(res), return_weights=True,
    )
    assert out.dtype == jnp.bfloat16
    assert weights.dtype == jnp.float32, "routing weights are computed in float32"
    # Reference on the bf16-rounded inputs, in float64.
    ref_out, ref_w = ref_route(sources.astype(np.float64), valid, query, gain,
                               None if res is None else res.astype(np.float64))
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "src_dtype,res_dtype",
    [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16),
     (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.bfloat16, None), (jnp.float32, None)],
)
def test_output_dtype_is_sources_dtype(src_dtype, res_dtype):
    rng = np.random.default_rng(12)
    sources, query, gain, residual = make_inputs(rng, 3, 2, 2, 8)
    res = None if res_dtype is None else jnp.asarray(residual, res_dtype)
    out, w = depth_route(jnp.asarray(sources, src_dtype), np.ones(3, bool), jnp.asarray(query), jnp.asarray(gain),
                         res, return_weights=True)
    assert out.dtype == src_dtype
    assert w.shape == (3, 2, 2)


def test_bfloat16_query_and_gain():
    """Routing parameters in bfloat16 still give float32 logits and a correct route."""
    rng = np.random.default_rng(13)
    sources, query, gain, _ = make_inputs(rng, 3, 2, 2, 8)
    q16, g16 = query.astype(BF16), gain.astype(BF16)
    out, w = depth_route(jnp.asarray(sources), np.ones(3, bool), jnp.asarray(q16), jnp.asarray(g16),
                         return_weights=True)
    assert out.dtype == jnp.float32
    ref_out, ref_w = ref_route(sources, np.ones(3, bool), q16.astype(np.float64), g16.astype(np.float64))
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- jit and gradients


def test_under_jit_with_traced_mask():
    rng = np.random.default_rng(14)
    S, B, T, D = 4, 2, 3, 8
    sources, query, gain, residual = make_inputs(rng, S, B, T, D)
    f = jax.jit(lambda s, v, q, g, r: depth_route(s, v, q, g, r, return_weights=True))
    for trial in range(2):
        valid = random_mask(rng, (S, B, T), S)
        out, w = f(jnp.asarray(sources), jnp.asarray(valid), jnp.asarray(query), jnp.asarray(gain),
                   jnp.asarray(residual))
        ref_out, ref_w = ref_route(sources, valid, query, gain, residual)
        np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-6)


def _numeric_grad(fn, x, h=1e-6):
    """Central finite differences of a float64 scalar function."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    for idx in itertools.product(*map(range, x.shape)):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (fn(xp) - fn(xm)) / (2 * h)
    return g


@pytest.mark.parametrize("additive", [False, True], ids=["replace", "add"])
def test_gradients_match_finite_differences(additive):
    """d loss / d (query, gain, sources, residual) of depth_route vs float64 finite differences."""
    rng = np.random.default_rng(15)
    S, B, T, D = 3, 2, 2, 6
    sources, query, gain, residual = make_inputs(rng, S, B, T, D)
    valid = random_mask(rng, (S, B, T), S)
    valid[:, 0, 0] = True  # at least one token routes over all three
    cot = rng.normal(size=(B, T, D))
    res = residual if additive else None

    def jax_loss(q, g, s, r):
        out = depth_route(s, jnp.asarray(valid), q, g, r if additive else None)
        return jnp.sum(out * jnp.asarray(cot, jnp.float32))

    grads = jax.grad(jax_loss, argnums=(0, 1, 2, 3))(
        jnp.asarray(query), jnp.asarray(gain), jnp.asarray(sources), jnp.asarray(residual))

    def np_loss(q=query, g=gain, s=sources, r=res):
        return float(np.sum(ref_route(s, valid, q, g, r)[0] * cot))

    num_q = _numeric_grad(lambda q: np_loss(q=q), query)
    num_g = _numeric_grad(lambda g: np_loss(g=g), gain)
    num_s = _numeric_grad(lambda s: np_loss(s=s), sources)
    assert np.abs(num_q).max() > 1e-3, "query must influence the output"
    np.testing.assert_allclose(np.asarray(grads[0]), num_q, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads[1]), num_g, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads[2]), num_s, rtol=1e-4, atol=1e-5)
    expected_r = cot if additive else np.zeros_like(cot)
    np.testing.assert_allclose(np.asarray(grads[3]), expected_r, rtol=1e-6, atol=1e-7)


def test_zero_query_still_gets_gradient():
    """At the safe init w = 0 the query gradient is non-zero (routing can start learning)."""
    rng = np.random.default_rng(16)
    sources, _, _, residual = make_inputs(rng, 3, 2, 2, 8)
    cot = jnp.asarray(rng.normal(size=(2, 2, 8)), jnp.float32)
    g = jax.grad(lambda q: jnp.sum(depth_route(jnp.asarray(sources), np.ones(3, bool), q, jnp.ones(8),
                                               jnp.asarray(residual)) * cot))(jnp.zeros(8))
    assert float(jnp.abs(g).max()) > 1e-4

    def np_loss(q):
        return float(np.sum(ref_route(sources, np.ones(3, bool), q, np.ones(8), residual)[0] * np.asarray(cot)))

    np.testing.assert_allclose(np.asarray(g), _numeric_grad(np_loss, np.zeros(8)), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _ok_inputs():
    rng = np.random.default_rng(17)
    sources, query, gain, residual = make_inputs(rng, 3, 2, 4, 8)
    return jnp.asarray(sources), np.ones(3, bool), jnp.asarray(query), jnp.asarray(gain), jnp.asarray(residual)


@pytest.mark.parametrize(
    "case",
    ["sources_3d", "sources_5d", "query_len", "query_2d", "gain_len", "residual_shape", "residual_2d",
     "valid_leading", "valid_sbt_bad"],
)
def test_bad_shapes_raise_value_error(case):
    s, v, q, g, r = _ok_inputs()
    if case == "sources_3d":
        s = s[0]
    elif case == "sources_5d":
        s = s[None]
    elif case == "query_len":
        q = q[:-1]
    elif case == "query_2d":
        q = q[None]
    elif case == "gain_len":
        g = jnp.concatenate([g, g])
    elif case == "residual_shape":
        r = r[:, :-1]
    elif case == "residual_2d":
        r = r[0]
    elif case == "valid_leading":
        v = np.ones(4, bool)
    elif case == "valid_sbt_bad":
        v = np.ones((3, 3, 4), bool)  # B is 2
    with pytest.raises(ValueError):
        depth_route(s, v, q, g, r)


@pytest.mark.parametrize("additive", [False, True])
def test_null_source_is_one_more_source(additive):
    """The paper's null source equals routing over the buffer plus the null vector at every token."""
    from deltares.nn.routing import inv_rms, route_normalized

    rng = np.random.default_rng(seed_of("null", additive))
    S, B, T, D = 4, 2, 3, 8
    sources, query, gain, residual = make_inputs(rng, S, B, T, D)
    null = rng.normal(size=(D,)).astype(np.float32)
    valid = np.array([True, False, True, True])
    res = residual if additive else None
    out, weights = route_normalized(jnp.asarray(sources), inv_rms(jnp.asarray(sources)), valid, query, gain, res, null)
    with_null = np.concatenate([sources, np.broadcast_to(null, (1, B, T, D))], axis=0)
    want, want_w = ref_route(with_null, np.append(valid, True), query, gain, res)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(weights), want_w[:S], rtol=1e-5, atol=1e-6)
