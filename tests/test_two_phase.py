"""Two-phase grouped routing: phase one (K queries over the completed sources, one pass) merged
with each sublayer's intra-group sources equals routing over the union, against a float64 NumPy
reference and the reference `depth_route` (forward and gradients); and the grouped store-once
depth pass gives the ungrouped one's loss and gradients in every routed mode."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.nn import depth, routing
from deltares.nn.config import model_config
from deltares.nn.layers import apply_router, route_prefix
from deltares.nn.losses import lm_loss
from deltares.nn.model import Transformer
from deltares.nn.residual import make_plan
from roundoff import assert_close, with_tolerance

EPS = 1e-6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def np_route(sources, valid, query, gain, residual=None, null=None, gate=None):
    """Float64 routing over the valid sources (and a null source) of every token."""
    s = np.asarray(sources, np.float64)
    keys = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) * np.asarray(gain, np.float64)
    logits = np.einsum("sbtd,d->sbt", keys, np.asarray(query, np.float64))
    logits = np.where(np.asarray(valid)[:, None, None], logits, -np.inf)
    values = s
    if null is not None:
        n = np.asarray(null, np.float64)
        null_logit = np.dot(n / np.sqrt(np.mean(n * n) + EPS) * gain, query)
        logits = np.concatenate([logits, np.full((1,) + logits.shape[1:], null_logit)])
        values = np.concatenate([s, np.broadcast_to(n, (1,) + s.shape[1:])])
    w = np.exp(logits - logits.max(axis=0))
    w = w / w.sum(axis=0)
    out = np.einsum("sbt,sbtd->btd", w, values)
    if gate is not None:
        out = gate * out
    return out if residual is None else np.asarray(residual, np.float64) + out


def _case(seed, S_prefix=4, S_intra=3, K=3, B=2, T=3, D=8):
    rng = np.random.default_rng(seed)
    prefix = rng.normal(size=(S_prefix, B, T, D)) * rng.uniform(0.5, 3, size=(S_prefix, 1, 1, 1))
    intra = rng.normal(size=(S_intra, B, T, D))
    queries, gains = rng.normal(size=(K, D)), rng.uniform(0.5, 1.5, size=(K, D))
    valid_prefix = np.ones((K, S_prefix), bool)
    valid_prefix[1, 2:] = False  # each query its own prefix slots, slot 0 always
    valid_prefix[2, 1] = False
    valid_intra = np.tril(np.ones((K, S_intra), bool), -1)  # query k: the k intra slots before it
    return prefix, intra, queries, gains, valid_prefix, valid_intra, rng.normal(size=(B, T, D)), rng.normal(size=D)


def _two_phase(prefix, intra, queries, gains, valid_prefix, valid_intra, k, residual=None, null=None, gate=None):
    out_KBTD, lse_KBT = route_prefix(prefix, routing.inv_rms(prefix), valid_prefix, queries, gains)
    params = {"query": queries[k], "gain": gains[k]}
    if null is not None:
        params["null_source"] = null
    if gate is not None:
        params["gate"] = gate
    out, weights = apply_router(params, intra, routing.inv_rms(intra), valid_intra[k], residual,
                                prefix=(out_KBTD[k], lse_KBT[k]))
    return out, weights


@pytest.mark.parametrize("additive, null, gate", [(False, False, False), (True, False, False), (True, True, False),
                                                  (True, True, True)])
def test_merge_equals_routing_over_the_union_float64(additive, null, gate):
    with jax.enable_x64(True):
        prefix, intra, queries, gains, vp, vi, residual, null_D = _case(0)
        gate_1 = np.array([0.7]) if gate else None
        for k in range(queries.shape[0]):
            union = np.concatenate([prefix, intra])
            valid = np.concatenate([vp[k], vi[k]])
            want = np_route(union, valid, queries[k], gains[k], residual if additive else None,
                            null_D if null else None, gate_1[0] if gate else None)
            got, weights = _two_phase(prefix, intra, queries, gains, vp, vi, k, residual if additive else None,
                                      null_D if null else None, gate_1)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
            assert weights.shape == intra.shape[:3]  # the merge's weights: the intra sources only


def test_gradients_equal_the_reference_depth_route_float64():
    """d(loss) / d(prefix sources, intra sources, queries, gains, residual) of phase one + merge
    equals autodiff of `routing.depth_route` over the union, for every query of the group."""
    with jax.enable_x64(True):
        prefix, intra, queries, gains, vp, vi, residual, _ = _case(1)
        cot = np.random.default_rng(2).normal(size=residual.shape)

        def grouped(prefix, intra, queries, gains, residual):
            return sum(jnp.vdot(cot * (k + 1), _two_phase(prefix, intra, queries, gains, vp, vi, k, residual)[0])
                       for k in range(queries.shape[0]))

        def reference(prefix, intra, queries, gains, residual):
            union = jnp.concatenate([prefix, intra])
            return sum(jnp.vdot(cot * (k + 1), routing.depth_route(union, np.concatenate([vp[k], vi[k]]), queries[k],
                                                                   gains[k], residual))
                       for k in range(queries.shape[0]))

        args = (prefix, intra, queries, gains, residual)
        got = jax.grad(grouped, argnums=range(5))(*args)
        want = jax.grad(reference, argnums=range(5))(*args)
        for name, g, w in zip(("prefix", "intra", "queries", "gains", "residual"), got, want):
            assert np.abs(w).max() > 0, name
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-12, err_msg=name)


def test_prefix_gives_each_query_its_own_routing():
    """Phase one's K results are each query's routing alone (a query's masked slots stay out)."""
    with jax.enable_x64(True):
        prefix, _, queries, gains, vp, _, _, _ = _case(3)
        out, lse = route_prefix(prefix, routing.inv_rms(prefix), vp, queries, gains)
        for k in range(queries.shape[0]):
            np.testing.assert_allclose(np.asarray(out[k]), np_route(prefix, vp[k], queries[k], gains[k]),
                                       rtol=1e-12, atol=1e-12)
        assert np.all(np.isfinite(np.asarray(lse)))


def _prefix_loss_float64(sources, inv, valid_KS, queries, gains, cot_out, cot_lse):
    """A plain float64 phase one (no custom VJP), for autodiff: the independent reference."""
    qg = queries * gains
    logits = jnp.where(valid_KS[:, :, None, None], jnp.einsum("sbtd,kd->ksbt", sources, qg) * inv[None], -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=1)
    out = jnp.einsum("ksbt,sbtd->kbtd", jnp.exp(logits - lse[:, None]), sources)
    return jnp.vdot(cot_out, out) + jnp.vdot(cot_lse, lse)


def test_prefix_of_a_bf16_buffer_keeps_float32_accuracy():
    """A bf16 buffer is read in bf16 with float32 accumulation (no float32 copy of it): out, lse and
    the gradients of sources, 1/rms, queries and gains equal float64 autodiff on the same bf16 values
    to 1e-4 (the sources' cotangent to bf16's accuracy, its own dtype). The float32 operands enter
    as a high and a low bf16 part: with the high part alone they would be off by about 1e-3."""
    prefix, _, queries, gains, vp, *_ = _case(4, S_prefix=6, K=3, B=2, T=5, D=64)
    src16 = jnp.asarray(prefix, jnp.bfloat16)
    inv = routing.inv_rms(src16.astype(jnp.float32))
    rng = np.random.default_rng(5)
    cot_out, cot_lse = rng.normal(size=(3, 2, 5, 64)), rng.normal(size=(3, 2, 5))
    q32, g32 = jnp.asarray(queries, jnp.float32), jnp.asarray(gains, jnp.float32)

    def loss(src, inv, q, g):
        out, lse = routing.route_prefix(src, inv, vp, q, g)
        assert out.dtype == lse.dtype == jnp.float32
        return jnp.vdot(jnp.asarray(cot_out, jnp.float32), out) + jnp.vdot(jnp.asarray(cot_lse, jnp.float32), lse)

    out, lse = routing.route_prefix(src16, inv, vp, q32, g32)
    got = jax.grad(loss, argnums=range(4))(src16, inv, q32, g32)
    assert got[0].dtype == jnp.bfloat16
    with jax.enable_x64(True):
        args = [np.asarray(a, np.float64) for a in (src16.astype(jnp.float32), inv, q32, g32)]
        for k in range(3):
            keys = args[0] * args[1][..., None]
            logits = np.where(vp[k][:, None, None], np.einsum("sbtd,d->sbt", keys, args[2][k] * args[3][k]), -np.inf)
            w = np.exp(logits - logits.max(axis=0))
            np.testing.assert_allclose(np.asarray(out[k]), np.einsum("sbt,sbtd->btd", w / w.sum(axis=0), args[0]),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.asarray(lse[k]), logits.max(axis=0) + np.log(w.sum(axis=0)), rtol=1e-4, atol=1e-4)
        want = jax.grad(lambda s, i, q, g: _prefix_loss_float64(s, i, jnp.asarray(vp), q, g, cot_out, cot_lse),
                        argnums=range(4))(*args)
    for name, g, w, tol in zip(("sources", "1/rms", "queries", "gains"), got, want, (1e-2, 1e-4, 1e-4, 1e-4)):
        g, w = np.asarray(g, np.float64), np.asarray(w)
        assert np.abs(w).max() > 0, name
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=name)


NO_F32_COPY = r"""
import math, re
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from deltares.nn import routing
from deltares.training.compile_only import topology_devices

device = SingleDeviceSharding(topology_devices("v5p:1x1x1")[0])
S, B, T, D, K = 17, 2, 256, 256, 4
valid = jnp.tril(jnp.ones((K, S), bool), k=S - K)

def loss(src, inv, q, g):
    out, lse = routing.route_prefix(src, inv, valid, q, g)
    return jnp.sum(out * out) + jnp.sum(lse)

sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(
    sds((S, B, T, D), jnp.bfloat16), sds((S, B, T), jnp.float32), sds((K, D), jnp.float32),
    sds((K, D), jnp.float32)).compile().as_text()
print(max(math.prod(map(int, m.group(1).split(","))) for m in re.finditer(r"f32\[([\d,]+)\]", text)) / (S * B * T * D))
"""


@pytest.mark.skipif(not __import__("importlib.util").util.find_spec("libtpu"), reason="libtpu is not installed")
def test_prefix_backward_holds_no_float32_copy_of_a_bf16_buffer():
    """Compiled for a TPU, phase one's forward and backward on a bf16 buffer of 17 slots with 4 queries
    hold no float32 array near the buffer's size: the largest is the queries' rows (2K of [B, T, D])."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", NO_F32_COPY], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert float(proc.stdout.split()[-1]) <= 8 / 17


# ----------------------------------------------------------------------------- the grouped depth pass

def _cfg(mode, group_layers, n_layers, block_layers, **residual):
    return model_config(
        vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
        dtype="float32", remat="full", loss_chunk=0,
        residual=dict(mode=mode, block_layers=block_layers, group_layers=group_layers, **residual))


def _loss_and_grads(cfg, params, tokens, tolerance=False):
    """(loss, gradients); with `tolerance`, also how far float32 rounding can move them between two
    implementations of this step (tests/roundoff.py: forward and backward stages of every sublayer)."""
    model = Transformer(cfg)

    def loss(p):
        return lm_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    step = jax.jit(jax.value_and_grad(loss))
    if not tolerance:
        return step(params)
    return with_tolerance(step, params, stages=2 * (2 * cfg.n_layers + 2))


@pytest.mark.parametrize("mode, n_layers, block_layers, group_layers, residual", [
    ("delta", 4, 1, 2, {}),
    ("delta", 4, 1, 4, dict(gate=True, null_source=True)),
    ("full_attnres", 6, 1, 3, {}),
    ("full_attnres", 3, 1, 1, {}),
    ("delta_block", 5, 2, 4, {}),  # uneven: the last block (one layer) is the remainder group
    ("delta_block", 4, 2, 4, dict(gate=True, null_source=True)),
    ("delta_block", 4, 1, 4, dict(include_partial=False)),
    ("delta_block", 6, 4, 2, {}),  # two groups per block, the last block short
    ("block_attnres", 5, 3, 4, {}),
    ("block_attnres", 4, 2, 4, dict(include_partial=False)),
])
def test_grouped_depth_pass_equals_ungrouped(mode, n_layers, block_layers, group_layers, residual, monkeypatch):
    calls = []
    for name in ("_grouped_forward", "_grouped_backward"):
        original = getattr(depth, name)
        monkeypatch.setattr(depth, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    ungrouped = _cfg(mode, 0, n_layers, block_layers, **residual)
    params = nn.meta.unbox(Transformer(ungrouped).init(jax.random.key(1), tokens[:, :-1]))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    (loss0, grads0), tol = _loss_and_grads(ungrouped, params, tokens, tolerance=True)
    assert not calls
    loss1, grads1 = _loss_and_grads(_cfg(mode, group_layers, n_layers, block_layers, **residual), params, tokens)
    assert calls == ["_grouped_forward", "_grouped_backward"]  # the grouped pass ran, both ways
    assert_close((loss1, grads1), (loss0, grads0), tol)


@pytest.mark.parametrize("mode, n_layers, block_layers, group_layers, residual, remat", [
    ("delta", 4, 1, 2, {}, "none"),
    ("delta", 4, 1, 2, dict(impl="pallas", interpret=True), "none"),  # phase one the fused kernel
    ("delta", 5, 1, 4, dict(gate=True, null_source=True), "full"),  # 5 layers: groups of 1 (the divisor)
    ("delta", 6, 1, 4, {}, "dots"),  # groups of 3
    ("full_attnres", 4, 1, 4, {}, "none"),
    ("delta_block", 5, 2, 2, {}, "none"),  # the last block (one layer) is the remainder group
    ("delta_block", 4, 2, 2, dict(gate=True, null_source=True), "full"),
    ("delta_block", 4, 1, 4, dict(include_partial=False), "none"),
    ("delta_block", 6, 4, 2, {}, "none"),  # two groups per block, the last block short
    ("block_attnres", 4, 2, 2, {}, "dots"),
])
def test_unrolled_grouped_layers_equal_ungrouped(mode, n_layers, block_layers, group_layers, residual, remat,
                                                 monkeypatch):
    """Unrolled layers (sources held apart, plain autodiff) route two-phase: phase one once per
    group over the stacked earlier slots, merged with each sublayer's own later slots."""
    from deltares.nn import stack

    calls = []
    original = stack.listed_group_prefix
    monkeypatch.setattr(stack, "listed_group_prefix", lambda *a, **k: calls.append(a[4]) or original(*a, **k))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)

    def cfg(group):
        c = _cfg(mode, group, n_layers, block_layers, **residual)
        c.scan_layers, c.remat = False, remat
        return c

    params = nn.meta.unbox(Transformer(cfg(0)).init(jax.random.key(1), tokens[:, :-1]))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    (loss0, grads0), tol = _loss_and_grads(cfg(0), params, tokens, tolerance=True)
    assert not calls
    grouped = cfg(group_layers)
    loss1, grads1 = _loss_and_grads(grouped, params, tokens)
    G = make_plan(mode, n_layers, block_layers, True, group_layers).group_layers
    assert calls == list(range(0, n_layers, G))  # phase one ran at each group's first layer
    assert_close((loss1, grads1), (loss0, grads0), tol)


@pytest.mark.parametrize("mode, n_layers, block_layers, group_layers, want", [
    ("delta", 36, 1, 4, 4), ("delta", 6, 1, 4, 3), ("delta", 5, 1, 4, 1), ("full_attnres", 12, 1, 8, 6),
    ("delta_block", 6, 4, 4, 4), ("delta_block", 6, 4, 1, 1), ("delta_block", 5, 4, 3, 2), ("block_attnres", 36, 6, 4, 3),
])
def test_group_size(mode, n_layers, block_layers, group_layers, want):
    """The largest divisor up to group_layers of the block (block modes) or of the depth."""
    assert make_plan(mode, n_layers, block_layers, True, group_layers).group_layers == want


def test_prefix_and_intra_split_the_reads():
    plan = make_plan("delta", 4, group_layers=2)
    np.testing.assert_array_equal(plan.prefix_read | plan.intra_read, plan.read)
    assert not (plan.prefix_read & plan.intra_read).any()
    np.testing.assert_array_equal(plan.prefix_read[4:].sum(axis=1), [5, 5, 5, 5])  # e and sublayers 0..3
    np.testing.assert_array_equal(plan.intra_read[4:].sum(axis=1), [0, 1, 2, 3])
    block = make_plan("delta_block", 4, block_layers=2)
    np.testing.assert_array_equal(block.intra_read.sum(axis=1), [0, 1, 1, 1, 0, 1, 1, 1])  # the partial
