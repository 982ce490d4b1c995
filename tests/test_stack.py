"""`DepthStack` (linen deltares.nn.stack, NNX deltares.nn.nnx): a stack of the user's own layers.

Against an independent reference: the same layers written out as a loop over
`DepthRouting.input` / `add` (the per-sublayer API, itself checked against deltares'
Transformer in tests/test_own_model.py), on random weights and routers, in all five modes:
values and every gradient, for the store-once pass, plain autodiff and unrolled layers. The
NNX stack equals the linen one on the same weights. The memory saving is the point: a user's
16-layer `delta` stack keeps its compiled gradient temporaries within 1.1x of deltares' own
Transformer at the same shapes, where plain autodiff of the same scan takes several times more.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deltares.nn.config import BLOCK_MODES, model_config
from deltares.nn.layers import DepthRouter
from deltares.nn.model import Transformer
from deltares.nn.nnx import DepthStack as NNXDepthStack
from deltares.nn.routed import DepthRouting
from deltares.nn.stack import DepthStack
from examples import gpt_linen

MODES = ("baseline", "full_attnres", "block_attnres", "delta", "delta_block")
L, D = 3, 8


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


class Dense(nn.Module):
    """A toy sublayer: pre-norm, one matrix, a nonlinearity (tanh or sin), plus a broadcast `shift`."""

    kind: str

    @nn.compact
    def __call__(self, x_BTD, shift=0.0):
        w = self.param("w", nn.initializers.normal(0.5), (x_BTD.shape[-1], x_BTD.shape[-1]))
        y = _norm(x_BTD) @ w + shift
        return jnp.tanh(y) if self.kind == "tanh" else jnp.sin(y)


class NNXDense(nnx.Module):
    def __init__(self, kind, rngs):
        self.w, self.kind = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5), kind

    def __call__(self, x_BTD, shift=0.0):
        y = _norm(x_BTD) @ self.w[...] + shift
        return jnp.tanh(y) if self.kind == "tanh" else jnp.sin(y)


class Narrow(nn.Module):
    """A wrong sublayer: its output is `width` wide, not the stream's D."""

    width: int

    @nn.compact
    def __call__(self, x_BTD, shift=0.0):
        return nn.Dense(self.width)(x_BTD)


SUBLAYERS = (functools.partial(Dense, "tanh"), functools.partial(Dense, "sin"))
E_BTD = jax.random.normal(jax.random.key(9), (2, 5, D))
SHIFT = 0.25


def _random_routers(params, seed=1):
    """Every router's query and gain redrawn, so that no routing is uniform."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, (path, x) in zip(keys, leaves):
        name = jax.tree_util.keystr(path)
        if "query" in name:
            x = jax.random.normal(key, x.shape)
        elif "gain" in name:
            x = 1 + 0.3 * jax.random.normal(key, x.shape)
        out.append(x)
    return jax.tree.unflatten(tree, out)


def _stack(mode, **kw):
    return DepthStack(SUBLAYERS, L, mode, block_layers=2 if mode in BLOCK_MODES else 1, **kw)


def _params(mode):
    return _random_routers(nn.meta.unbox(_stack(mode).init(jax.random.key(0), E_BTD, SHIFT)["params"]))


def _loss(out_BTD):
    return jnp.sum(jnp.sin(out_BTD) * jnp.arange(D))


def reference(mode, params):
    """The stack written out: DepthRouting's per-sublayer API over the stacked parameters."""
    routing = DepthRouting(mode, L, 2 if mode in BLOCK_MODES else 1)
    state = routing.start(E_BTD)
    for layer in range(L):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
        for k, (name, kind) in enumerate((("attn", "tanh"), ("mlp", "sin"))):
            j = 2 * layer + k
            router = None if mode == "baseline" else DepthRouter().bind({"params": p[f"{name}_router"]})
            x_BTD = routing.input(state, j, router)
            state = routing.add(state, j, Dense(kind).apply({"params": p[name]}, x_BTD, SHIFT))
    final = DepthRouter().bind({"params": params["final_router"]}) if "final_router" in params else None
    return routing.output(state, final)


def _unrolled_params(params):
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layers_{layer}": jax.tree.map(lambda a, layer=layer: a[layer], params["layers"]) for layer in range(L)})
    return out


def _close(got, want, tol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=tol * max(1.0, float(jnp.abs(w).max())), rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_linen_stack_equals_the_written_out_loop(mode):
    params = _params(mode)
    want, want_grads = jax.jit(jax.value_and_grad(lambda p: _loss(reference(mode, p))))(params)
    variants = {"store_once": ({}, params), "plain": (dict(store_once=False), params),
                "unrolled": (dict(scan=False), _unrolled_params(params))}
    if mode in ("baseline", "delta"):  # no remat: plain autodiff of the scan without recomputation
        variants["no_remat"] = (dict(remat=False), params)
    for name, (kw, p) in variants.items():
        stack = _stack(mode, **kw)
        got, grads = jax.jit(jax.value_and_grad(lambda p, stack=stack: _loss(stack.apply({"params": p}, E_BTD, SHIFT))))(p)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)  # a sum of 80 terms up to 7
        _close(grads, _unrolled_params(want_grads) if name == "unrolled" else want_grads)
    if mode != "baseline":
        assert float(jnp.abs(want_grads["layers"]["mlp_router"]["query"]).max()) > 1e-3  # routers learn
        # the default is deltares.nn.depth.depth_scan's custom VJP (store-once); store_once=False is plain AD
        text = str(jax.make_jaxpr(lambda p: _stack(mode).apply({"params": p}, E_BTD, SHIFT))(params))
        plain = str(jax.make_jaxpr(lambda p: _stack(mode, store_once=False).apply({"params": p}, E_BTD, SHIFT))(params))
        assert "custom_vjp_call" in text and "custom_vjp_call" not in plain


def _nnx_stack(mode, params, **kw):
    stack = NNXDepthStack(lambda rngs: (NNXDense("tanh", rngs), NNXDense("sin", rngs)), L, D, mode, block_layers=2 if mode in BLOCK_MODES else 1,
                          rngs=nnx.Rngs(0), **kw)
    state = nnx.state(stack, nnx.Param)
    pure = {"layers": {name: ({"w": params["layers"][name]["w"]} if name in ("attn", "mlp") else
                              params["layers"][name]) for name in params["layers"]}}
    if "final_router" in params:
        pure["final_router"] = params["final_router"]
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(stack, state)
    return stack


@pytest.mark.parametrize("mode", MODES)
def test_nnx_stack_equals_linen_stack(mode):
    params = _params(mode)
    want, want_grads = jax.jit(jax.value_and_grad(lambda p: _loss(_stack(mode).apply({"params": p}, E_BTD, SHIFT))))(
        params)
    for kw in ({}, dict(store_once=False), dict(remat=False)) if mode == "delta_block" else ({},):
        stack = _nnx_stack(mode, params, **kw)
        got, grads = nnx.jit(nnx.value_and_grad(lambda m: _loss(m(E_BTD, SHIFT))))(stack)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        grads = nnx.to_pure_dict(grads)
        assert set(grads["layers"]) == set(want_grads["layers"])
        for name, sub in want_grads["layers"].items():
            _close(grads["layers"][name], sub)


def _reference_stats(mode, params):
    """Per-sublayer routing statistics of the written-out loop, in NumPy from its weights [S, B, T]."""
    routing = DepthRouting(mode, L, 2 if mode in BLOCK_MODES else 1)
    state, rows = routing.start(E_BTD), []
    for layer in range(L):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
        for k, (name, kind) in enumerate((("attn", "tanh"), ("mlp", "sin"))):
            router = DepthRouter().bind({"params": p[f"{name}_router"]})
            x_BTD, w_SBT = routing.input(state, 2 * layer + k, router, return_weights=True)
            state = routing.add(state, 2 * layer + k, Dense(kind).apply({"params": p[name]}, x_BTD, SHIFT))
            w = np.zeros((routing.plan.n_slots,) + w_SBT.shape[1:])
            w[: w_SBT.shape[0]] = np.asarray(w_SBT)
            routed = routing.plan.n_sources[2 * layer + k] > 1
            entropy = -(w * np.log(np.where(w > 0, w, 1))).sum(0).mean()
            rows.append((w.mean((1, 2)) * routed, w.max(0).mean() * routed, entropy * routed))
    return [np.stack(col) for col in zip(*rows)]


@pytest.mark.parametrize("mode", ("delta", "delta_block", "full_attnres"))
def test_stack_sows_routing_statistics(mode):
    params = _params(mode)
    weights, max_weight, entropy = _reference_stats(mode, params)
    assert entropy.max() > 0.1 and weights.max() < 0.999  # real routing, not one-hot
    for kw, p in (({}, params), (dict(store_once=False), params), (dict(scan=False), _unrolled_params(params))):
        out, sown = _stack(mode, **kw).apply({"params": p}, E_BTD, SHIFT, mutable=["routing"])
        stats = sown["routing"]["stats"][0]
        np.testing.assert_allclose(stats["weights"], weights, atol=1e-5, err_msg=str(kw))
        np.testing.assert_allclose(stats["max_weight"], max_weight, atol=1e-5)
        np.testing.assert_allclose(stats["entropy"], entropy, atol=1e-5)
        np.testing.assert_array_equal(stats["n_sources"], DepthRouting(mode, L, 2 if mode in BLOCK_MODES else 1).plan.n_sources)
        np.testing.assert_allclose(out, _stack(mode, **kw).apply({"params": p}, E_BTD, SHIFT), atol=1e-6)
    assert "routing" not in _stack(mode).init(jax.random.key(0), E_BTD, SHIFT)  # nothing sown at init


def test_stack_refuses_bad_arguments_with_one_clear_error():
    with pytest.raises(ValueError, match="mode must be one of"):
        DepthStack(SUBLAYERS, L, "deltas").init(jax.random.key(0), E_BTD)
    with pytest.raises(ValueError, match="a layer has 2 sublayers"):
        DepthStack(SUBLAYERS[:1], L, "delta").init(jax.random.key(0), E_BTD)
    with pytest.raises(ValueError, match="must be a factory"):
        DepthStack((SUBLAYERS[0], 3), L, "delta").init(jax.random.key(0), E_BTD)
    for not_a_module in (jnp.tanh, lambda name: None):
        with pytest.raises(ValueError, match=r"sublayers\[1\] must make a linen Module when called as factory\(name='mlp'\)"):
            DepthStack((SUBLAYERS[0], not_a_module), L, "delta").init(jax.random.key(0), E_BTD)
    with pytest.raises(ValueError, match=r"input is \[B, T, D\]"):
        DepthStack(SUBLAYERS, L, "delta").init(jax.random.key(0), E_BTD[0])
    with pytest.raises(ValueError, match="block_layers"):
        DepthStack(SUBLAYERS, L, "delta_block", block_layers=4).init(jax.random.key(0), E_BTD)
    for kw, which in (({}, "of a scanned layer"), (dict(scan=False), "sublayer 0 ")):
        with pytest.raises(ValueError, match=which + r".*returned a delta of shape \(2, 5, 4\); the stream is \(2, 5, 8\)"):
            DepthStack((functools.partial(Narrow, 4), SUBLAYERS[1]), L, "delta", **kw).init(jax.random.key(0), E_BTD)
    routing = DepthRouting("delta", 2)
    state = routing.start(E_BTD)
    for j in (-1, 4):
        with pytest.raises(ValueError, match=r"sublayer index .* out of range: 2 layers have sublayers 0 \.\. 3"):
            routing.add(state, j, E_BTD)
    with pytest.raises(ValueError, match="distinct strings"):
        NNXDepthStack(lambda r: (NNXDense("tanh", r), NNXDense("sin", r)), L, D, "delta", names=("a", "a"),
                      rngs=nnx.Rngs(0))


# ------------------------------------------------------------------ the memory saving, against the Transformer

MEM = dict(vocab_size=31, d_model=128, n_layers=16, n_heads=4, d_ff=256)
B, T = 2, 64


class AttentionSublayer(nn.Module):
    cfg: gpt_linen.GPTConfig

    @nn.compact
    def __call__(self, x_BTD):
        return gpt_linen.Attention(self.cfg, name="attn")(gpt_linen.RMSNorm(self.cfg.eps, name="norm")(x_BTD))


class MLPSublayer(nn.Module):
    cfg: gpt_linen.GPTConfig

    @nn.compact
    def __call__(self, x_BTD):
        return gpt_linen.MLP(self.cfg, name="mlp")(gpt_linen.RMSNorm(self.cfg.eps, name="norm")(x_BTD))


class StackGPT(nn.Module):
    """The examples' GPT with its layers as one DepthStack."""

    cfg: gpt_linen.GPTConfig
    store_once: bool = True

    @nn.compact
    def __call__(self, tokens_BT):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed")
        sublayers = (functools.partial(AttentionSublayer, cfg), functools.partial(MLPSublayer, cfg))
        out_BTD = DepthStack(sublayers, cfg.n_layers, cfg.mode, store_once=self.store_once, name="stack")(
            embed(tokens_BT))
        return embed.attend(gpt_linen.RMSNorm(cfg.eps, name="final_norm")(out_BTD))


def _temporaries(model, tokens):
    """Compiled temporaries of the loss gradient, in units of one [B, T, D] float32 array."""
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss(p):
        return gpt_linen.loss_fn(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (B * T * MEM["d_model"] * 4)


def test_users_stack_keeps_the_store_once_saving():
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, MEM["vocab_size"])
    cfg = gpt_linen.GPTConfig(**MEM, mode="delta")
    transformer = Transformer(model_config(**MEM, n_kv_heads=MEM["n_heads"], head_dim=MEM["d_model"] // MEM["n_heads"],
                                           dtype="float32", remat="full", loss_chunk=0, residual=dict(mode="delta")))
    baseline = StackGPT(gpt_linen.GPTConfig(**MEM, mode="baseline"))
    ours, theirs, plain, base = (_temporaries(m, tokens) for m in (transformer, StackGPT(cfg), StackGPT(cfg, False),
                                                                   baseline))
    print(f"gradient temporaries in [B, T, D] float32 units: Transformer {ours:.1f}, DepthStack {theirs:.1f}, "
          f"DepthStack(store_once=False) {plain:.1f}, baseline DepthStack {base:.1f}")
    assert theirs <= 1.1 * ours
    assert plain > 2 * theirs  # the measure tells the store-once pass from plain autodiff
    slots = 2 * MEM["n_layers"] + 1  # one buffer of sources: 33 units
    assert theirs - base <= 7 * slots  # on XLA:CPU about six buffers beyond baseline (the guide's figure)
