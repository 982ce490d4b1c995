"""The production Transformer routes over exactly the sources of docs/explanations/modes.md.

The oracle here is a plain, unrolled float64 NumPy re-implementation of a Qwen3
decoder with the five residual modes, written from docs/explanations/modes.md only.
It deliberately imports nothing from `deltares.nn.residual`, `deltares.nn.routing` or
`deltares.nn.decoder`: sources are rebuilt from the list of deltas v_0..v_{2L-1}
for every sublayer, with no buffers, slots or masks.

To make the comparison discriminating, every parameter is redrawn at O(1) scale
(the 0.02 init makes deltas tiny) and every router gets a random query and gain,
so routing weights depend on which tensors are the sources. The test
`test_wrong_source_sets_are_detected` checks that plausible wrong source sets
(a missing source, toggled partial, cumulative streams instead of deltas,
additive vs replacement) move the logits far beyond the tolerance used.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.nn.config import model_config
from deltares.nn.model import Transformer
from roundoff import assert_close, with_tolerance

EPS = 1e-6
MODES = ("baseline", "full_attnres", "block_attnres", "delta", "delta_block")
ROUTING_MODES = MODES[1:]
BLOCK_MODES = ("block_attnres", "delta_block")
REPLACEMENT_MODES = ("full_attnres", "block_attnres")  # x_j = route(S_j); the others add it to h_j
# Production computes in float32, the reference in float64: their tolerances come from production's own
# sensitivity to float32 rounding (tests/roundoff.py), per output.
BATCH, SEQ = 2, 5


# ----------------------------------------------------------------------------
# Reference model (float64 NumPy), one function per piece.
# ----------------------------------------------------------------------------


def rmsnorm(x, scale, eps=EPS):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def softmax(z, axis):
    z = z - np.max(z, axis=axis, keepdims=True)
    ez = np.exp(z)
    return ez / np.sum(ez, axis=axis, keepdims=True)


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x_BTNH, theta):
    """Qwen3 / Hugging Face rotate-half rotary embedding at positions 0..T-1."""
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    angles = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, H]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    x1, x2 = x_BTNH[..., : H // 2], x_BTNH[..., H // 2 :]
    rotated = np.concatenate([-x2, x1], axis=-1)
    return x_BTNH * cos + rotated * sin


def attention(x_BTD, p, cfg):
    """Causal GQA with per-head RMSNorm on q and k before rotary; no biases."""
    q = np.einsum("btd,dnh->btnh", x_BTD, p["q_proj"]["kernel"])
    k = np.einsum("btd,dkh->btkh", x_BTD, p["k_proj"]["kernel"])
    v = np.einsum("btd,dkh->btkh", x_BTD, p["v_proj"]["kernel"])
    q = rope(rmsnorm(q, p["q_norm"]["scale"], cfg.norm_eps), cfg.rope_theta)
    k = rope(rmsnorm(k, p["k_norm"]["scale"], cfg.norm_eps), cfg.rope_theta)
    T = x_BTD.shape[1]
    causal = np.tril(np.ones((T, T), bool))
    group = cfg.n_heads // cfg.n_kv_heads
    out = np.zeros_like(q)
    for n in range(cfg.n_heads):
        kv = n // group
        scores = np.einsum("bqh,bkh->bqk", q[:, :, n], k[:, :, kv]) / math.sqrt(cfg.head_dim)
        scores = np.where(causal[None], scores, -np.inf)
        out[:, :, n] = np.einsum("bqk,bkh->bqh", softmax(scores, axis=-1), v[:, :, kv])
    return np.einsum("btnh,nhd->btd", out, p["o_proj"]["kernel"])


def mlp(x_BTD, p):
    gate = x_BTD @ p["gate_proj"]["kernel"]
    up = x_BTD @ p["up_proj"]["kernel"]
    return (silu(gate) * up) @ p["down_proj"]["kernel"]


def route(sources, router, eps=EPS):
    """z_i = w . RMSNorm_g(s_i); a = softmax_i(z); returns (sum_i a_i s_i, a [S, B, T])."""
    z = np.stack([rmsnorm(s, router["gain"], eps) @ router["query"] for s in sources])
    a = softmax(z, axis=0)
    return sum(a[i][..., None] * s for i, s in enumerate(sources)), a


def n_blocks(n_layers, block_layers):
    return -(-n_layers // block_layers)


def block_sublayers(n, n_layers, block_layers):
    """Sublayer indices of block n (the last block may be shorter)."""
    return range(2 * n * block_layers, min(2 * (n + 1) * block_layers, 2 * n_layers))


def block_delta(v, n, n_layers, block_layers):
    """c_n: the sum of the deltas of block n."""
    return sum(v[k] for k in block_sublayers(n, n_layers, block_layers))


def sources_for(mode, j, e, v, n_layers, block_layers, include_partial):
    """docs/explanations/modes.md: the sources of sublayer j, in slot order. `v` holds v_0..v_{j-1}."""
    if mode in ("full_attnres", "delta"):
        return [e] + v[:j]
    n = (j // 2) // block_layers  # block of sublayer j
    first = 2 * n * block_layers  # the sublayer that opens block n
    completed = [block_delta(v, m, n_layers, block_layers) for m in range(n)]
    partial = [sum(v[first:j])] if include_partial and j != first else []  # p_j
    return [e] + completed + partial


def final_sources(mode, e, v, n_layers, block_layers):
    """The Kimi modes' output routing: all sources the model has produced."""
    if mode == "full_attnres":
        return [e] + v
    return [e] + [block_delta(v, m, n_layers, block_layers) for m in range(n_blocks(n_layers, block_layers))]


def n_slots(mode, n_layers, block_layers):
    if mode == "baseline":
        return 1
    if mode in BLOCK_MODES:
        return n_blocks(n_layers, block_layers) + 1
    return 2 * n_layers + 1


def reference_forward(params, tokens_BT, cfg, mode, block_layers, include_partial, *,
                      sources_rule=sources_for, replaces=None, route_eps=None):
    """Unrolled forward pass. Returns (logits, stats in production's slot order, norm outputs).

    Every norm takes `cfg.norm_eps`. `sources_rule`, `replaces` and `route_eps` (the routers'
    eps alone) exist only so tests can plug in deliberately wrong rules.
    """
    L, eps = cfg.n_layers, cfg.norm_eps
    route_eps = eps if route_eps is None else route_eps
    replaces = (mode in REPLACEMENT_MODES) if replaces is None else replaces
    emb = params["embed"]["embedding"]
    e = emb[tokens_BT]
    h = e  # h_j = e + sum_{k<j} v_k
    v = []
    S_max = n_slots(mode, L, block_layers)
    stats = dict(
        n_sources=np.zeros(2 * L, np.int64),
        weights=np.zeros((2 * L, S_max)),
        max_weight=np.zeros(2 * L),
        entropy=np.zeros(2 * L),
    )
    norm_out = []
    for j in range(2 * L):
        lp = params[f"layers_{j // 2}"]
        kind = "attn" if j % 2 == 0 else "mlp"
        if mode == "baseline":
            x = h
        else:
            S = sources_rule(mode, j, e, v, L, block_layers, include_partial)
            stats["n_sources"][j] = len(S)
            if len(S) == 1:  # one source: no routing
                x = S[0] if replaces else h
            else:
                r, a = route(S, lp[f"{kind}_router"], route_eps)
                x = r if replaces else h + r
                stats["weights"][j, : len(S)] = a.mean(axis=(1, 2))
                stats["max_weight"][j] = a.max(axis=0).mean()
                stats["entropy"][j] = (-np.sum(a * np.log(a), axis=0)).mean()
        y = rmsnorm(x, lp[f"{kind}_norm"]["scale"], eps)
        norm_out.append(y)
        v_j = attention(y, lp["attn"], cfg) if kind == "attn" else mlp(y, lp["mlp"])
        v.append(v_j)
        h = h + v_j
    if mode in REPLACEMENT_MODES:
        out, _ = route(final_sources(mode, e, v, L, block_layers), params["final_router"], route_eps)
    else:
        out = h
    logits = rmsnorm(out, params["final_norm"]["scale"], eps) @ emb.T
    return logits, stats, norm_out


def plain_prenorm_forward(params, tokens_BT, cfg):
    """The textbook pre-norm decoder: x += Attn(norm(x)); x += MLP(norm(x))."""
    emb = params["embed"]["embedding"]
    x = emb[tokens_BT]
    for l in range(cfg.n_layers):
        lp = params[f"layers_{l}"]
        x = x + attention(rmsnorm(x, lp["attn_norm"]["scale"]), lp["attn"], cfg)
        x = x + mlp(rmsnorm(x, lp["mlp_norm"]["scale"]), lp["mlp"])
    return rmsnorm(x, params["final_norm"]["scale"]) @ emb.T


# ----------------------------------------------------------------------------
# Production side: build, init, redraw parameters, run.
# ----------------------------------------------------------------------------


def make_cfg(mode, n_layers=3, block_layers=2, include_partial=True, norm_eps=EPS):
    return model_config(
        vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
        dtype="float32", scan_layers=False, norm_eps=norm_eps,
        residual=dict(mode=mode, block_layers=block_layers, include_partial=include_partial),
    )


def tokens():
    return jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, 64)


def _path_names(path):
    return tuple(k.key for k in path)


def redraw(params, seed, random_routers=True):
    """O(1)-scale parameters: so every source visibly matters. Routers random or left at init."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        names = _path_names(path)
        leaf, owner = names[-1], names[-2]
        x = np.asarray(x)
        if owner.endswith("_router"):
            if not random_routers:
                return x
            if leaf == "query":
                return rng.normal(0.0, 0.35, x.shape)
            return 1.0 + 0.3 * rng.normal(size=x.shape)  # gain
        if leaf == "scale":
            return 1.0 + 0.2 * rng.normal(size=x.shape)
        if leaf == "embedding":
            return rng.normal(size=x.shape)
        assert leaf == "kernel", names
        fan_in = x.shape[0] if owner != "o_proj" else x.shape[0] * x.shape[1]
        return rng.normal(size=x.shape) / math.sqrt(fan_in)

    return jax.tree_util.tree_map_with_path(draw, params)


def init_params(cfg, toks):
    variables = Transformer(cfg).init(jax.random.key(0), toks)
    return nn.meta.unbox(variables)["params"]


def production(cfg, params64, toks, **kw):
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params64)
    return Transformer(cfg).apply({"params": params32}, toks, **kw)


def production_and_tolerance(cfg, params64, toks, **kw):
    """Production's outputs on the float32 values of `params64`, and their tolerance against the float64
    reference: float32 rounding at each of the model's stages (the sublayers, the embedding, the head), as
    production's sensitivity to it amplifies it (tests/roundoff.py)."""
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params64)
    apply = lambda p: Transformer(cfg).apply({"params": p}, toks, **kw)  # noqa: E731 - eager: cheaper than compiling
    return with_tolerance(apply, params32, stages=2 * cfg.n_layers + 2, draws=1)  # the max over every logit


def setup(mode, n_layers=3, block_layers=2, include_partial=True, seed=0, random_routers=True, norm_eps=EPS,
          embed_scale=1.0):
    cfg = make_cfg(mode, n_layers, block_layers, include_partial, norm_eps)
    toks = tokens()
    params = redraw(init_params(cfg, toks), seed, random_routers)
    params["embed"]["embedding"] = embed_scale * params["embed"]["embedding"]
    # The reference sees exactly the float32 values production sees, in float64.
    params = jax.tree.map(lambda x: np.asarray(np.float32(x), np.float64), params)
    return cfg, np.asarray(toks), params


def check_against_reference(mode, n_layers, block_layers, include_partial, **setup_kw):
    cfg, toks, params = setup(mode, n_layers, block_layers, include_partial, **setup_kw)
    (logits, stats), (logits_tol, stats_tol) = production_and_tolerance(cfg, params, toks, return_stats=True)
    ref_logits, ref_stats, _ = reference_forward(params, toks, cfg, mode, block_layers, include_partial)

    assert logits.shape == (BATCH, SEQ, cfg.vocab_size)
    assert_close(logits, ref_logits, logits_tol, "logits")
    assert logits_tol < 1e-3 * np.abs(ref_logits).max()  # far below the logits: a wrong rule cannot pass
    np.testing.assert_array_equal(np.asarray(stats["n_sources"]), ref_stats["n_sources"])
    assert stats["weights"].shape == ref_stats["weights"].shape
    for key in ("weights", "max_weight", "entropy"):
        assert_close(stats[key], ref_stats[key], stats_tol[key], key)
    return ref_stats


# ----------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------

DEPTHS = [(m, 3, 2) for m in MODES] + [(m, L, B) for m in BLOCK_MODES for (L, B) in ((4, 1), (4, 3))]


@pytest.mark.parametrize("mode,n_layers,block_layers", DEPTHS)
def test_matches_reference_with_random_routers(mode, n_layers, block_layers):
    ref_stats = check_against_reference(mode, n_layers, block_layers, include_partial=True)
    if mode != "baseline":  # the routing really is non-uniform, so source identity matters
        routed = ref_stats["n_sources"] > 1
        uniform = 1.0 / ref_stats["n_sources"][routed]
        assert np.max(np.abs(ref_stats["max_weight"][routed] - uniform)) > 0.05


@pytest.mark.parametrize("norm_eps", [1e-6, 1e-3])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_with_small_embedding_at_norm_eps(mode, norm_eps):
    """An embedding of RMS 1e-2 (slot 0 of every routing; the first sublayer's norm input), where
    norm_eps matters: production follows the reference at its eps, and a router ignoring it
    (the other eps in the routers alone) would move the logits far beyond the tolerance."""
    check_against_reference(mode, 3, 2, True, norm_eps=norm_eps, embed_scale=1e-2)
    cfg, toks, params = setup(mode, norm_eps=norm_eps, embed_scale=1e-2)
    assert np.sqrt(np.mean(params["embed"]["embedding"] ** 2)) < 1.1e-2
    ref_logits = reference_forward(params, toks, cfg, mode, 2, True)[0]
    if mode != "baseline":
        _, (logits_tol, _) = production_and_tolerance(cfg, params, toks, return_stats=True)
        other = reference_forward(params, toks, cfg, mode, 2, True, route_eps=1e-3 if norm_eps == 1e-6 else 1e-6)[0]
        assert np.max(np.abs(other - ref_logits)) > 100 * logits_tol


@pytest.mark.parametrize("mode", BLOCK_MODES)
@pytest.mark.parametrize("n_layers,block_layers", [(3, 2), (4, 1), (4, 3)])
def test_block_modes_without_partial(mode, n_layers, block_layers):
    ref_stats = check_against_reference(mode, n_layers, block_layers, include_partial=False)
    # Sublayer j of block n sees [e, c_0 .. c_{n-1}]: n + 1 sources, the partial slot unread.
    blocks = np.array([(j // 2) // block_layers for j in range(2 * n_layers)])
    np.testing.assert_array_equal(ref_stats["n_sources"], blocks + 1)


def test_source_counts_follow_design_table():
    """The reference's own counts, spelled out for L=3, B=2 (blocks: layers {0,1} and {2})."""
    expected = {
        "baseline": [0] * 6,
        "full_attnres": [1, 2, 3, 4, 5, 6],
        "delta": [1, 2, 3, 4, 5, 6],
        # block 0: [e] then [e, p]; block 1 opens at j=4: [e, c0], then [e, c0, p]
        "block_attnres": [1, 2, 2, 2, 2, 3],
        "delta_block": [1, 2, 2, 2, 2, 3],
    }
    for mode, counts in expected.items():
        cfg, toks, params = setup(mode)
        _, stats = production(cfg, params, toks, return_stats=True)
        np.testing.assert_array_equal(np.asarray(stats["n_sources"]), counts, err_msg=mode)
        _, ref_stats, _ = reference_forward(params, toks, cfg, mode, 2, True)
        np.testing.assert_array_equal(ref_stats["n_sources"], counts, err_msg=mode)


def _drop_newest(mode, j, e, v, L, B, partial):
    S = sources_for(mode, j, e, v, L, B, partial)
    return S[:-1] if len(S) > 1 else S


def _cumulative_streams(mode, j, e, v, L, B, partial):
    """Kimi-style redundant sources: the stream h_{k+1} instead of the delta v_k."""
    S = sources_for(mode, j, e, v, L, B, partial)
    return [e] + [sum(S[: i + 1]) for i in range(1, len(S))]


def _toggled_partial(mode, j, e, v, L, B, partial):
    return sources_for(mode, j, e, v, L, B, not partial)


def _partial_minus_last_block(mode, j, e, v, L, B, partial):
    """The authors' PyTorch Delta Block (docs/guides/fine-tuning.md: not what deltares computes): partial - blocks[-1]."""
    S = sources_for(mode, j, e, v, L, B, partial)
    n = (j // 2) // B
    if n >= 1 and partial and j != 2 * n * B:
        S = S[:-1] + [S[-1] - S[-2]]
    return S


@pytest.mark.parametrize(
    "mode,block_layers,wrong",
    [(m, 2, w) for m in ROUTING_MODES for w in ("drop_newest", "cumulative", "swap_additive")]
    + [(m, 1, w) for m in BLOCK_MODES for w in ("toggled_partial", "partial_minus_last_block")],
)
def test_wrong_source_sets_are_detected(mode, block_layers, wrong):
    """Production is far (a hundred times its tolerance) from the reference run with a plausible wrong rule."""
    n_layers = 3
    cfg, toks, params = setup(mode, n_layers, block_layers)
    logits, logits_tol = production_and_tolerance(cfg, params, toks)
    logits = np.asarray(logits)
    rules = dict(drop_newest=_drop_newest, cumulative=_cumulative_streams, toggled_partial=_toggled_partial,
                 partial_minus_last_block=_partial_minus_last_block)
    if wrong == "swap_additive":
        kw = dict(replaces=mode not in REPLACEMENT_MODES)
    else:
        kw = dict(sources_rule=rules[wrong])
    wrong_logits, _, _ = reference_forward(params, toks, cfg, mode, block_layers, True, **kw)
    assert np.max(np.abs(logits - wrong_logits)) > 100 * logits_tol


def _expected_uniform_weights(n_sources, S_max):
    weights = np.zeros((len(n_sources), S_max))
    for j, n in enumerate(n_sources):
        if n > 1:
            weights[j, :n] = 1.0 / n
    return weights


@pytest.mark.parametrize("mode", MODES)
def test_zero_queries_route_the_mean(mode):
    """At init (w = 0) every routed sublayer reads the plain mean of its sources.

    The captured attn_norm / mlp_norm outputs must be RMSNorm(h_j + mean(S_j)) for the
    additive modes, RMSNorm(mean(S_j)) for the replacement modes, RMSNorm(h_j) for a
    single-source additive sublayer (j = 0) and RMSNorm(e) for a single-source
    replacement one. h_j and the sources are rebuilt here from the reference's deltas.
    """
    n_layers, block_layers = 3, 2
    cfg, toks, params = setup(mode, n_layers, block_layers, random_routers=False)
    routers = [p for name, p in params.items() if name.endswith("_router")]
    routers += [p for lp in params.values() for name, p in lp.items() if name.endswith("_router")]
    assert len(routers) == (0 if mode == "baseline" else 2 * n_layers + (mode in REPLACEMENT_MODES))
    for r in routers:  # really the init: w = 0, g = 1
        assert np.all(r["query"] == 0) and np.all(r["gain"] == 1)

    ((logits, stats), state), ((logits_tol, stats_tol), state_tol) = production_and_tolerance(
        cfg, params, toks, return_stats=True, mutable=["intermediates"],
        capture_intermediates=lambda mdl, _: type(mdl).__name__ == "RMSNorm",
    )
    captured, captured_tol = state["intermediates"], state_tol["intermediates"]
    assert set(captured) == {f"layers_{l}" for l in range(n_layers)} | {"final_norm"}
    for l in range(n_layers):
        assert set(captured[f"layers_{l}"]) == {"attn_norm", "mlp_norm", "attn"}
        assert set(captured[f"layers_{l}"]["attn"]) == {"q_norm", "k_norm"}

    # Reference deltas (the reference's own norm outputs are checked too, against the formula).
    ref_logits, ref_stats, ref_norm_out = reference_forward(params, toks, cfg, mode, block_layers, True)
    assert_close(logits, ref_logits, logits_tol, "logits")
    e = params["embed"]["embedding"][toks]
    v = []
    for j in range(2 * n_layers):
        h_j = e + sum(v)
        lp = params[f"layers_{j // 2}"]
        kind = "attn" if j % 2 == 0 else "mlp"
        if mode == "baseline":
            x = h_j
        else:
            S = sources_for(mode, j, e, v, n_layers, block_layers, True)
            mean = sum(S) / len(S)
            x = mean if mode in REPLACEMENT_MODES else (h_j + mean if len(S) > 1 else h_j)
        expected = rmsnorm(x, lp[f"{kind}_norm"]["scale"])
        (got,) = captured[f"layers_{j // 2}"][f"{kind}_norm"]["__call__"]
        (got_tol,) = captured_tol[f"layers_{j // 2}"][f"{kind}_norm"]["__call__"]
        assert_close(got, expected, got_tol, f"sublayer {j}")
        np.testing.assert_allclose(ref_norm_out[j], expected, atol=1e-12, err_msg=f"reference sublayer {j}")
        y = expected
        v.append(attention(y, lp["attn"], cfg) if kind == "attn" else mlp(y, lp["mlp"]))

    S_max = n_slots(mode, n_layers, block_layers)
    uniform = _expected_uniform_weights(ref_stats["n_sources"], S_max)
    assert_close(stats["weights"], uniform, stats_tol["weights"], "weights")
    n = np.maximum(ref_stats["n_sources"], 1)
    routed = n > 1
    assert_close(stats["max_weight"], np.where(routed, 1.0 / n, 0.0), stats_tol["max_weight"], "max_weight")
    assert_close(stats["entropy"], np.where(routed, np.log(n), 0.0), stats_tol["entropy"], "entropy")


def test_baseline_is_plain_prenorm_transformer():
    cfg, toks, params = setup("baseline", n_layers=3)
    assert not any("router" in k for lp in params.values() for k in lp), "baseline has no routing parameters"
    assert "final_router" not in params
    (logits, stats), (logits_tol, _) = production_and_tolerance(cfg, params, toks, return_stats=True)
    expected = plain_prenorm_forward(params, toks, cfg)
    assert_close(logits, expected, logits_tol, "logits")
    np.testing.assert_array_equal(np.asarray(stats["n_sources"]), np.zeros(6))
    assert stats["weights"].shape == (6, 1)
    for key in ("weights", "max_weight", "entropy"):
        np.testing.assert_array_equal(np.asarray(stats[key]), 0.0)


@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_parameter_tree_per_mode(mode):
    cfg, toks, params = setup(mode, n_layers=3)
    assert ("final_router" in params) == (mode in REPLACEMENT_MODES)
    for l in range(3):
        lp = params[f"layers_{l}"]
        for kind in ("attn", "mlp"):
            assert lp[f"{kind}_router"]["query"].shape == (cfg.d_model,)
            assert lp[f"{kind}_router"]["gain"].shape == (cfg.d_model,)
