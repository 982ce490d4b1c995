"""What Flax threads through a module passes through `DepthStack` (linen and NNX): rng streams
(dropout differing per layer and per call; the store-once backward pass recomputing a layer
with its forward's masks), values sown with `sow` and `capture_intermediates`, mutable collections
(batch statistics here; a decoding cache in tests/test_own_model.py) and keyword arguments given
only to the sublayer that takes them; scanned (store-once and plain autodiff) and unrolled.

Each run is compared against the stack written out: a Python loop over the layers in this file,
over `DepthRouting.input` / `add` and the sublayers' math in plain JAX, which reads the dropout
masks the stack sowed and must then give the same output, gradients, sown values and statistics.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deltares.nn.config import BLOCK_MODES
from deltares.nn.layers import DepthRouter
from deltares.nn.nnx import DepthStack as NNXDepthStack
from deltares.nn.routed import DepthRouting
from deltares.nn.stack import DepthStack
from tests.test_stack import _close, _random_routers
from tests.test_stack import _unrolled_params as _unrolled

L, D, B, T = 3, 8, 2, 5
E_BTD = jax.random.normal(jax.random.key(9), (B, T, D))
MASK_T = jnp.array([1.0, 0.5, 1.0, 0.0, 1.0])
RATE = 0.5


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def attn_math(w, x_BTD, mask_T):
    y_BTD = _norm(x_BTD) @ w
    return jnp.tanh(y_BTD * mask_T[None, :, None]), y_BTD.mean()


def mlp_math(w, x_BTD, keep_BTD):
    return jnp.sin(jnp.where(keep_BTD, _norm(x_BTD) @ w / (1 - RATE), 0.0))


class Attn(nn.Module):
    """Takes the keyword `mask_T` (an array), sows a statistic."""

    @nn.compact
    def __call__(self, x_BTD, *, mask_T):
        out_BTD, mean = attn_math(self.param("w", nn.initializers.normal(0.5), (D, D)), x_BTD, mask_T)
        self.sow("intermediates", "mean", mean)
        return out_BTD


class MLP(nn.Module):
    """Dropout (the keyword `deterministic`, a flag), sows its mask, keeps batch statistics."""

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool = True):
        w = self.param("w", nn.initializers.normal(0.5), (D, D))
        running = self.variable("batch_stats", "mean", jnp.zeros, (D,))
        if self.is_mutable_collection("batch_stats") and not self.is_initializing():
            running.value = 0.9 * running.value + 0.1 * x_BTD.mean((0, 1))
        keep_BTD = (jnp.ones(x_BTD.shape, bool) if deterministic else
                    jax.random.bernoulli(self.make_rng("dropout"), 1 - RATE, x_BTD.shape))
        self.sow("intermediates", "keep", keep_BTD)
        return mlp_math(w, x_BTD, keep_BTD)


def _block(mode):
    return 2 if mode in BLOCK_MODES else 1


def reference(mode, params, keep_LBTD, stats_LD):
    """The stack written out, with the dropout masks `keep_LBTD`: (out, attention's sown means [L],
    the new batch statistics [L, D])."""
    routing = DepthRouting(mode, L, _block(mode))
    state, means, new_stats = routing.start(E_BTD), [], []
    for layer in range(L):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])

        def router(name):
            return None if mode == "baseline" else DepthRouter().bind({"params": p[f"{name}_router"]})

        x_BTD = routing.input(state, 2 * layer, router("attn"))
        v_BTD, mean = attn_math(p["attn"]["w"], x_BTD, MASK_T)
        means.append(mean)
        state = routing.add(state, 2 * layer, v_BTD)
        x_BTD = routing.input(state, 2 * layer + 1, router("mlp"))
        new_stats.append(0.9 * stats_LD[layer] + 0.1 * x_BTD.mean((0, 1)))
        state = routing.add(state, 2 * layer + 1, mlp_math(p["mlp"]["w"], x_BTD, keep_LBTD[layer]))
    final = DepthRouter().bind({"params": params["final_router"]}) if "final_router" in params else None
    return routing.output(state, final), jnp.stack(means), jnp.stack(new_stats)


def _loss(out_BTD):
    return jnp.sum(jnp.sin(out_BTD) * jnp.arange(D))


def _layered(tree, scanned):
    """A collection's per-layer entries as one tree with a leading layer axis."""
    if scanned:
        return tree["layers"]
    return jax.tree.map(lambda *a: jnp.stack(a), *[tree[f"layers_{layer}"] for layer in range(L)])


@pytest.mark.parametrize("mode", ("delta_block",))  # NNX's test below runs delta
def test_linen_stack_threads_rngs_sown_values_collections_and_keywords(mode):
    stack = DepthStack((Attn, MLP), L, mode, block_layers=_block(mode))
    variables = stack.init(jax.random.key(0), E_BTD, mask_T=MASK_T)
    assert jax.tree.map(jnp.shape, variables["batch_stats"]) == {"layers": {"mlp": {"mean": (L, D)}}}
    params = _random_routers(nn.meta.unbox(variables["params"]))
    stats_LD = jax.random.normal(jax.random.key(4), (L, D))
    for name, kw, scanned in (("store_once", {}, True), ("plain", dict(store_once=False), True),
                              ("unrolled", dict(scan=False), False)):
        stack = DepthStack((Attn, MLP), L, mode, block_layers=_block(mode), **kw)
        p = params if scanned else _unrolled(params)
        batch_stats = {"layers": {"mlp": {"mean": stats_LD}}}
        batch_stats = batch_stats if scanned else _unrolled(batch_stats)

        def loss(p, key, stack=stack, batch_stats=batch_stats):
            out_BTD, written = stack.apply({"params": p, "batch_stats": batch_stats}, E_BTD, mask_T=MASK_T,
                                           deterministic=False, rngs={"dropout": key},
                                           mutable=["intermediates", "batch_stats"])
            return _loss(out_BTD), written

        run = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (value, written), grads = run(p, jax.random.key(7))
        keep_LBTD = _layered(written["intermediates"], scanned)["mlp"]["keep"][0]
        assert keep_LBTD.shape == (L, B, T, D), name
        assert 0.3 < float(keep_LBTD.mean()) < 0.7  # dropout is on
        assert bool(jnp.any(keep_LBTD[0] != keep_LBTD[1])), f"{name}: the same mask in two layers"
        (_, again), _ = run(p, jax.random.key(8))
        assert bool(jnp.any(_layered(again["intermediates"], scanned)["mlp"]["keep"][0] != keep_LBTD)), \
            f"{name}: the same masks under another key"

        def ref_loss(p, keep_LBTD=keep_LBTD):
            out_BTD, means, new_stats = reference(mode, p, keep_LBTD, stats_LD)
            return _loss(out_BTD), (means, new_stats)

        (want, (means, new_stats)), want_grads = jax.value_and_grad(ref_loss, has_aux=True)(params)
        np.testing.assert_allclose(value, want, atol=1e-4, rtol=0, err_msg=name)
        _close(grads if scanned else {**{k: v for k, v in grads.items() if not k.startswith("layers_")},
                                       "layers": _layered(grads, False)}, want_grads)
        np.testing.assert_allclose(_layered(written["intermediates"], scanned)["attn"]["mean"][0], means, atol=1e-5)
        np.testing.assert_allclose(_layered(written["batch_stats"], scanned)["mlp"]["mean"], new_stats, atol=1e-5)
    assert float(jnp.abs(want_grads["layers"]["mlp_router"]["query"]).max()) > 1e-3  # routers learn


def test_capture_intermediates_stacks_per_layer():
    for kw in ({}, dict(store_once=False)):
        stack = DepthStack((Attn, MLP), L, "delta", **kw)
        variables = stack.init(jax.random.key(0), E_BTD, mask_T=MASK_T)
        _, written = stack.apply(variables, E_BTD, mask_T=MASK_T, capture_intermediates=True,
                                 mutable=["intermediates"])
        assert written["intermediates"]["layers"]["mlp"]["__call__"][0].shape == (L, B, T, D), kw


def test_keywords_go_to_the_sublayer_that_takes_them():
    stack = DepthStack((Attn, MLP), L, "delta")
    variables = stack.init(jax.random.key(0), E_BTD, mask_T=MASK_T)
    with pytest.raises(TypeError, match="keyword argument 'mask', which neither sublayer"):
        stack.apply(variables, E_BTD, mask=MASK_T)
    with pytest.raises(TypeError, match="hashable"):
        stack.apply(variables, E_BTD, mask_T=MASK_T, deterministic=[True])


class NNXAttn(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5)

    def __call__(self, x_BTD, *, mask_T):
        out_BTD, mean = attn_math(self.w[...], x_BTD, mask_T)
        self.sow(nnx.Intermediate, "mean", mean)
        return out_BTD


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5)
        self.mean = nnx.BatchStat(jnp.zeros((D,)))
        self.rng = rngs["dropout"].fork()

    def __call__(self, x_BTD, deterministic: bool = True):
        self.mean[...] = 0.9 * self.mean[...] + 0.1 * x_BTD.mean((0, 1))
        keep_BTD = jnp.ones(x_BTD.shape, bool) if deterministic else jax.random.bernoulli(self.rng(), 1 - RATE,
                                                                                           x_BTD.shape)
        self.sow(nnx.Intermediate, "keep", keep_BTD)
        return mlp_math(self.w[...], x_BTD, keep_BTD)


@pytest.mark.parametrize("kw", [{}, dict(store_once=False), dict(scan=False)], ids=["store_once", "plain", "unrolled"])
def test_nnx_stack_threads_rngs_sown_values_collections_and_keywords(kw):
    mode = "delta"
    stack = NNXDepthStack(lambda rngs: (NNXAttn(rngs), NNXMLP(rngs)), L, D, mode, rngs=nnx.Rngs(0, dropout=1), **kw)
    state = nnx.state(stack, nnx.Param)
    nnx.replace_by_pure_dict(state, _random_routers(nnx.to_pure_dict(state)))
    nnx.update(stack, state)
    params = nnx.to_pure_dict(nnx.state(stack, nnx.Param))
    stats_LD = jnp.zeros((L, D))

    def loss(m):
        return _loss(m(E_BTD, mask_T=MASK_T, deterministic=False))

    step = nnx.jit(nnx.value_and_grad(loss))
    value, grads = step(stack)
    sown = nnx.to_pure_dict(nnx.pop(stack, nnx.Intermediate))["layers"]
    keep_LBTD = sown["mlp"]["keep"][0]
    assert keep_LBTD.shape == (L, B, T, D) and 0.3 < float(keep_LBTD.mean()) < 0.7
    assert bool(jnp.any(keep_LBTD[0] != keep_LBTD[1])), "the same mask in two layers"

    def ref_loss(p):
        out_BTD, means, new_stats = reference(mode, p, keep_LBTD, stats_LD)
        return _loss(out_BTD), (means, new_stats)

    (want, (means, new_stats)), want_grads = jax.value_and_grad(ref_loss, has_aux=True)(params)
    np.testing.assert_allclose(value, want, atol=1e-4, rtol=0)
    _close(nnx.to_pure_dict(grads), want_grads)
    np.testing.assert_allclose(sown["attn"]["mean"][0], means, atol=1e-5)
    np.testing.assert_allclose(stack.layers.mlp.mean[...], new_stats, atol=1e-5)
    step(stack)  # the next step draws new masks
    again = nnx.to_pure_dict(nnx.pop(stack, nnx.Intermediate))["layers"]["mlp"]["keep"][0]
    assert bool(jnp.any(again != keep_LBTD)), "the same masks in the next step"


class Plain(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x_BTD):
        y = _norm(x_BTD) @ self.param("w", nn.initializers.normal(0.5), (D, D))
        return jnp.tanh(y) if self.kind == "tanh" else jnp.sin(y)


def test_stack_takes_flax_fields_and_the_transformers_routing_options():
    """Two-phase groups (`group_layers`) compute what one pass per sublayer computes,
    values and gradients; `param_dtype`, `query_init` and `dtype` reach the routers, linen and NNX;
    bad options are one clear ValueError."""
    sub = (functools.partial(Plain, "tanh"), functools.partial(Plain, "sin"))
    params = _random_routers(nn.meta.unbox(DepthStack(sub, L, "delta").init(jax.random.key(0), E_BTD)["params"]))

    def run(**kw):
        stack = DepthStack(sub, L, "delta", **kw)
        return jax.jit(jax.value_and_grad(lambda p: _loss(stack.apply({"params": p}, E_BTD))))(params)

    want = run(store_once=False)
    for kw in (dict(group_layers=2),):
        got = run(**kw)
        np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=0, err_msg=str(kw))
        _close(got[1], want[1])
    stack = DepthStack(sub, L, "delta", param_dtype=jnp.bfloat16, query_init=nn.initializers.constant(0.5),
                       dtype=jnp.bfloat16)
    variables = nn.meta.unbox(stack.init(jax.random.key(0), E_BTD))
    query = variables["params"]["layers"]["mlp_router"]["query"]
    assert query.dtype == jnp.bfloat16 and query.shape == (L, D) and float(query[0, 0]) == 0.5
    nnx_stack = NNXDepthStack(lambda rngs: (NNXAttn(rngs), NNXAttn(rngs)), L, D, "delta", group_layers=2,
                              param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert nnx_stack.layers.attn_router.query[...].dtype == jnp.bfloat16
    for bad, words in ((dict(group_layers=-1), "group_layers"), (dict(impl="cuda"), "impl must be one of")):
        with pytest.raises(ValueError, match=words):
            DepthStack(sub, L, "delta", **bad).init(jax.random.key(0), E_BTD)
        with pytest.raises(ValueError, match=words):
            NNXDepthStack(lambda rngs: (NNXAttn(rngs), NNXAttn(rngs)), L, D, "delta", rngs=nnx.Rngs(0), **bad)


def test_nnx_stack_sows_routing_statistics_when_asked():
    stack = NNXDepthStack(lambda rngs: (NNXMLP(rngs), NNXMLP(rngs)), L, D, "delta", names=("a", "b"), stats=True,
                          rngs=nnx.Rngs(0, dropout=1))
    stack(E_BTD)
    stats = nnx.to_pure_dict(nnx.pop(stack, nnx.Intermediate))["routing_stats"][0]
    assert stats["weights"].shape == (2 * L, 2 * L + 1)
    np.testing.assert_array_equal(stats["n_sources"], DepthRouting("delta", L).plan.n_sources)
    np.testing.assert_allclose(stats["weights"][1, :2], 0.5, atol=1e-6)  # zero queries: uniform over 2 sources
