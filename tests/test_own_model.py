"""Depth routing in your own model: deltares.nn.routed (DepthRouting), deltares.nn.nnx and examples/.

The hand-written GPTs of examples/ (their own attention, MLP, norms and rotary embeddings,
linen and NNX) route through the public API; on the same weights they must compute what
deltares' Transformer computes, in all five modes. Weights are redrawn at O(1) scale and
routers get random queries and gains, so a wrong source, mask or slot moves the logits far
beyond the tolerance. The store-once depth pass of `DepthRouting.stack` must equal plain AD
and an unrolled loop. Tolerances come from each computation's own sensitivity to float32 rounding
(tests/roundoff.py): `block_attnres` reads its block partial as the difference of two cumulative sums
(|h| / |p| up to about ten here), so its rounding differences are several times the other modes'.
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
from deltares.nn.layers import DepthRouter as LinenRouter
from deltares.nn.layers import init_router_params
from deltares.nn.model import Transformer
from deltares.nn.nnx import DepthRouter as NNXRouter
from deltares.nn.routed import DepthRouting
from examples import gpt_linen, gpt_nnx
from roundoff import assert_close, with_tolerance

MODES = ("baseline", "full_attnres", "block_attnres", "delta", "delta_block")
CFG = gpt_linen.GPTConfig(vocab_size=31, d_model=16, n_layers=3, n_heads=2, d_ff=24, block_layers=2)  # last block short
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 31, (2, 6)), jnp.int32)
STAGES = 2 * CFG.n_layers + 2  # rounding stages of a forward pass: the sublayers, the embedding, the head


@functools.lru_cache(maxsize=None)
def reference_logits(mode):
    """deltares' Transformer's logits on the example's weights of `mode` (`_linen_params`), and the
    tolerance of two implementations' logits (tests/roundoff.py), checked to stay far below the logits'
    scale, so that a wrong source, mask or slot cannot pass for rounding."""
    model = _transformer(mode)
    logits = jax.jit(lambda p: model.apply({"params": to_transformer(p, CFG.n_layers)}, TOKENS))
    ref, tol = with_tolerance(logits, _linen_params(mode), stages=STAGES)
    assert tol < 1e-3 * float(jnp.abs(ref).max()), (mode, tol)
    return ref, tol


def _cfg(mode):
    return gpt_linen.GPTConfig(**{**CFG.__dict__, "mode": mode})


def _random_like(params, seed=1):
    """Every parameter redrawn: matrices normal(0, 0.5), gains and queries around 1 (the stack's
    per-layer vectors [L, D] count as vectors)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def matrix(path, x):
        return x.ndim - ("'layers'" in jax.tree_util.keystr(path)) > 1

    new = [jax.random.normal(k, x.shape) * (0.5 if matrix(path, x) else 0.3) + (0 if matrix(path, x) else 1)
           for k, (path, x) in zip(keys, leaves)]
    return jax.tree.unflatten(tree, new)


def _linen_params(mode):
    params = nn.meta.unbox(gpt_linen.GPT(_cfg(mode)).init(jax.random.key(0), TOKENS)["params"])
    return _random_like(params)


def to_transformer(p: dict, n_layers: int) -> dict:
    """The example's linen parameters (its DepthStack's, stacked) under deltares' Transformer (unrolled) names."""
    out = {"embed": p["embed"], "final_norm": p["final_norm"]}
    if "final_router" in p["stack"]:
        out["final_router"] = p["stack"]["final_router"]
    for layer in range(n_layers):
        b = jax.tree.map(lambda a, layer=layer: a[layer], p["stack"]["layers"])
        attn = {f"{n}_proj": {"kernel": b["attn"]["body"][n]} for n in ("q", "k", "v", "o")}
        attn.update(q_norm={"scale": b["attn"]["body"]["q_norm"]}, k_norm={"scale": b["attn"]["body"]["k_norm"]})
        out[f"layers_{layer}"] = dict(
            attn=attn, mlp={f"{n}_proj": {"kernel": b["mlp"]["body"][n]} for n in ("gate", "up", "down")},
            attn_norm=b["attn"]["norm"], mlp_norm=b["mlp"]["norm"],
            **{k: b[k] for k in ("attn_router", "mlp_router") if k in b})
    return out


def linen_to_nnx(p: dict, n_layers: int) -> dict:
    """The example's linen parameters as the NNX example's pure state dict (the same stacked layout)."""
    return {"embed": p["embed"], "final_norm": p["final_norm"], "stack": p["stack"]}


def _transformer(mode):
    res = dict(mode=mode, block_layers=CFG.block_layers)
    cfg = model_config(vocab_size=CFG.vocab_size, d_model=CFG.d_model, n_layers=CFG.n_layers, n_heads=CFG.n_heads,
                       n_kv_heads=CFG.n_heads, head_dim=CFG.d_model // CFG.n_heads, d_ff=CFG.d_ff,
                       rope_theta=CFG.rope_theta, norm_eps=CFG.eps, dtype="float32", scan_layers=False, residual=res)
    return Transformer(cfg)


def _nnx_model(mode, linen_params):
    model = gpt_nnx.GPT(_cfg(mode), nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, linen_to_nnx(linen_params, CFG.n_layers))
    nnx.update(model, state)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_linen_example_equals_transformer(mode):
    params = _linen_params(mode)
    logits = gpt_linen.GPT(_cfg(mode)).apply({"params": params}, TOKENS)
    model = _transformer(mode)
    expected_tree = jax.tree.structure(nn.meta.unbox(model.init(jax.random.key(0), TOKENS)["params"]))
    mapped = to_transformer(params, CFG.n_layers)
    assert jax.tree.structure(mapped) == expected_tree  # same parameters, no more, no fewer
    ref, tol = reference_logits(mode)
    assert_close(logits, ref, tol)
    assert float(jnp.std(ref)) > 0.5  # logits vary: the comparison is not of near-constants


@pytest.mark.parametrize("mode", MODES)
def test_nnx_example_equals_linen_values_and_gradients(mode):
    params = _linen_params(mode)
    linen_model, nnx_model = gpt_linen.GPT(_cfg(mode)), _nnx_model(mode, params)

    def linen_loss(p):
        return gpt_linen.loss_fn(linen_model.apply({"params": p}, TOKENS[:, :-1]), TOKENS[:, 1:])

    (loss, grads), (loss_tol, grads_tol) = with_tolerance(jax.jit(jax.value_and_grad(linen_loss)), params,
                                                          stages=2 * STAGES)  # forward and backward
    nnx_loss, nnx_grads = nnx.jit(nnx.value_and_grad(lambda m: gpt_linen.loss_fn(m(TOKENS[:, :-1]), TOKENS[:, 1:])))(
        nnx_model)
    assert_close(nnx_loss, loss, loss_tol, "loss")
    expected = linen_to_nnx(grads, CFG.n_layers)
    assert_close(nnx.to_pure_dict(nnx_grads), expected, linen_to_nnx(grads_tol, CFG.n_layers), "gradient ")
    if mode != "baseline":  # the routers learn
        assert float(jnp.abs(expected["stack"]["layers"]["mlp_router"]["query"][2]).max()) > 1e-4
    assert_close(nnx_model(TOKENS), *reference_logits(mode))


def _stack_params(n_layers=3, d=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    routers = {name: {"query": jax.random.normal(k, (n_layers, d)), "gain": 1 + 0.3 * jax.random.normal(k, (n_layers, d))}
               for name, k in (("attn", keys[0]), ("mlp", keys[1]))}
    return dict(w_attn=jax.random.normal(keys[2], (n_layers, d, d)) * 0.5,
                w_mlp=jax.random.normal(keys[3], (n_layers, d, d)) * 0.5, routers=routers)


def _sublayers_of(p):
    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    return [(p["routers"]["attn"], lambda x: jnp.tanh(norm(x) @ p["w_attn"])),
            (p["routers"]["mlp"], lambda x: jnp.sin(norm(x) @ p["w_mlp"]))]


@pytest.mark.parametrize("mode", MODES)
def test_stack_store_once_equals_plain_ad_and_unrolled_loop(mode):
    routing = DepthRouting(mode, n_layers=3, block_layers=2 if mode in BLOCK_MODES else 1)
    params_L = _stack_params()
    e_BTD = jax.random.normal(jax.random.key(9), (2, 3, 8))
    final = {"query": jnp.linspace(-1, 1, 8), "gain": jnp.ones(8)}

    def loss(run, params_L, e_BTD):
        out = routing.output(run(params_L, e_BTD), final)
        return jnp.sum(jnp.sin(out) * jnp.arange(8))

    def unrolled(params_L, e_BTD):
        state = routing.start(e_BTD)
        for layer in range(routing.n_layers):
            p = jax.tree.map(lambda x, layer=layer: x[layer], params_L)
            for j, (router, fn) in zip((2 * layer, 2 * layer + 1), _sublayers_of(p)):
                state = routing.add(state, j, fn(routing.input(state, j, router)))
        return state

    runs = dict(store_once=lambda p, e: routing.stack(_sublayers_of, p, e),
                plain=lambda p, e: routing.stack(_sublayers_of, p, e, store_once=False),
                unrolled=unrolled)
    steps = {name: jax.jit(jax.value_and_grad(lambda p, e, run=run: loss(run, p, e), argnums=(0, 1)))
             for name, run in runs.items()}
    results = {name: step(params_L, e_BTD) for name, step in steps.items() if name != "unrolled"}
    (ref_value, ref_grads), tol = with_tolerance(steps["unrolled"], params_L, e_BTD,
                                                 stages=2 * (2 * routing.n_layers + 1))  # forward, backward
    for name in ("store_once", "plain"):
        assert_close(results[name], (ref_value, ref_grads), tol, f"{name} ")
    if mode != "baseline":
        assert float(jnp.abs(ref_grads[0]["routers"]["mlp"]["query"]).max()) > 1e-3
        # the store-once path is deltares.nn.depth.depth_scan's custom VJP, the plain path is not
        assert "custom_vjp_call" in str(jax.make_jaxpr(runs["store_once"])(params_L, e_BTD))
        assert "custom_vjp_call" not in str(jax.make_jaxpr(runs["plain"])(params_L, e_BTD))


@pytest.mark.parametrize("gate,null_source", [(False, False), (True, True)])
def test_nnx_router_matches_linen_names_axes_and_values(gate, null_source):
    D = 8
    sources = jax.random.normal(jax.random.key(0), (3, 2, 4, D))
    inv = jax.lax.rsqrt(jnp.mean(sources * sources, -1) + 1e-6)
    valid, residual = jnp.array([True, True, False]), jax.random.normal(jax.random.key(1), (2, 4, D))
    linen = LinenRouter(gate=gate, null_source=null_source)
    boxed = linen.init(jax.random.key(0), sources, inv, valid, residual)["params"]
    router = NNXRouter(D, gate=gate, null_source=null_source)  # default flax settings, no mesh
    state = nnx.state(router, nnx.Param)
    axes = {k: v.get_metadata()["out_sharding"] for k, v in state.items()}
    assert axes == {k: v.names for k, v in boxed.items()}
    init = nn.meta.unbox(boxed)
    assert nnx.to_pure_dict(state).keys() == init.keys() == init_router_params(D, gate, null_source).keys()
    for k in init:
        np.testing.assert_array_equal(state[k][...], init[k])
    params = _random_like(init, seed=3)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(router, state)
    out, weights = router(sources, inv, valid, residual)
    (ref, ref_weights), tol = with_tolerance(lambda p, *a: linen.apply({"params": p}, *a), params, sources, inv,
                                             valid, residual, stages=1)
    assert_close((out, weights), (ref, ref_weights), tol)
    assert float(jnp.abs(out - residual).max()) > 1e-2  # the routed term is not zero


def test_bad_use_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown residual mode"):
        DepthRouting("deltablock", n_layers=2)
    with pytest.raises(ValueError, match="block_layers"):
        DepthRouting("delta_block", n_layers=2, block_layers=3)
    routing = DepthRouting("delta", n_layers=1)
    state = routing.start(jnp.ones((1, 2, 4)))
    with pytest.raises(ValueError, match="pass a router"):
        routing.input(state, 0)
    with pytest.raises(ValueError, match="pass a final router"):
        DepthRouting("full_attnres", n_layers=1).output(DepthRouting("full_attnres", n_layers=1).start(jnp.ones((1, 2, 4))))


@pytest.mark.parametrize("example", [gpt_linen, gpt_nnx], ids=["linen", "nnx"])
def test_example_trains_on_builtin_corpus(example, tmp_path):
    cfg = gpt_linen.GPTConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, block_layers=1)
    losses = example.train(cfg, steps=8, seq_len=32, batch=4, lr=1e-2, workdir=str(tmp_path))
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5


def test_block_size_and_router_width_errors_name_the_problem():
    for mode in ("delta", "full_attnres", "baseline"):
        with pytest.raises(ValueError, match=f"block_layers=3 means nothing in mode '{mode}'"):
            DepthRouting(mode, n_layers=4, block_layers=3)
    assert DepthRouting("delta_block", n_layers=4, block_layers=3).plan.n_slots == 3  # blocks of 3 and 1
    sources_SBTD, inv_SBT, valid_S = jnp.ones((2, 1, 3, 8)), jnp.ones((2, 1, 3)), jnp.ones(2, bool)
    linen_params = LinenRouter().init(jax.random.key(0), sources_SBTD, inv_SBT, valid_S)
    narrow_SBTD = jnp.ones((2, 1, 3, 4))
    for call in (lambda: LinenRouter().apply(linen_params, narrow_SBTD, inv_SBT, valid_S),
                 lambda: DepthRouting("delta", n_layers=1).input(DepthRouting("delta", n_layers=1).start(narrow_SBTD[0]),
                                                                 0, linen_params["params"]),
                 lambda: NNXRouter(8)(narrow_SBTD, inv_SBT, valid_S)):
        with pytest.raises(ValueError, match=r"shape \(8,\) on sources of width D=4"):
            call()


def test_router_takes_flax_style_dtype_and_initialisers():
    sources_SBTD, inv_SBT, valid_S = jnp.ones((2, 1, 3, 8)), jnp.ones((2, 1, 3)), jnp.ones(2, bool)
    router = LinenRouter(param_dtype=jnp.bfloat16, query_init=nn.initializers.constant(0.5), epsilon=1e-3)
    params = nn.meta.unbox(router.init(jax.random.key(0), sources_SBTD, inv_SBT, valid_S)["params"])
    assert params["query"].dtype == jnp.bfloat16 and float(params["query"][0]) == 0.5
    nnx_router = NNXRouter(8, param_dtype=jnp.bfloat16, query_init=nn.initializers.constant(0.5), epsilon=1e-3)
    assert nnx_router.query[...].dtype == jnp.bfloat16 and float(nnx_router.query[...][0]) == 0.5
    for call in (lambda: router.apply({"params": params}, sources_SBTD, inv_SBT, valid_S),
                 lambda: nnx_router(sources_SBTD, inv_SBT, valid_S)):
        out_BTD, weights_SBT = call()
        np.testing.assert_allclose(np.asarray(weights_SBT), 0.5)  # equal sources: equal weights, any query
        np.testing.assert_allclose(np.asarray(out_BTD), 1.0)
        assert out_BTD.dtype == jnp.float32  # the sources' dtype
    out_BTD, _ = LinenRouter(dtype=jnp.bfloat16).apply({"params": params}, sources_SBTD, inv_SBT, valid_S)
    assert out_BTD.dtype == jnp.bfloat16
    assert NNXRouter(8, dtype=jnp.bfloat16)(sources_SBTD, inv_SBT, valid_S)[0].dtype == jnp.bfloat16


def test_small_model_config_works_as_it_stands():
    cfg = model_config(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, vocab_size=11)
    assert cfg.residual.mode == "delta_block" and cfg.residual.block_layers == 2
    tokens_BT = jnp.zeros((1, 4), jnp.int32)
    logits = Transformer(cfg).apply(Transformer(cfg).init(jax.random.key(0), tokens_BT), tokens_BT)
    assert logits.shape == (1, 4, 11)
    with pytest.raises(ValueError, match="block_layers"):  # a block size given explicitly is still checked
        Transformer(model_config(n_layers=2, residual=dict(block_layers=3)))


@pytest.mark.parametrize("mode", ("full_attnres",))  # one mode (with a final router): routing is per token in all
def test_linen_example_generates_with_its_kv_cache_as_its_full_forward_pass(mode):
    """The example's GPT decodes through its DepthStack with a key/value cache (the `cache`
    collection, stacked per layer): the prompt in one call, then one token per call. Every step's
    logits equal the full forward pass's at that position on the same tokens."""
    params = _linen_params(mode)
    prompt_BP = TOKENS[:, :3]
    tokens_BS, logits_BSV = gpt_linen.generate(_cfg(mode), params, prompt_BP, steps=4)
    assert tokens_BS.shape == (2, 4) and logits_BSV.shape == (2, 4, CFG.vocab_size)
    full = jax.jit(lambda p: gpt_linen.GPT(_cfg(mode)).apply({"params": p}, jnp.concatenate([prompt_BP, tokens_BS[:, :-1]], 1)))
    full_BTV, tol = with_tolerance(full, params, stages=STAGES)
    assert_close(logits_BSV, full_BTV[:, 2:], tol)  # the tolerance of every position
    np.testing.assert_array_equal(tokens_BS, jnp.argmax(full_BTV[:, 2:], -1))
    assert float(jnp.std(full_BTV)) > 0.5  # logits vary
    assert len(set(np.asarray(tokens_BS).ravel().tolist())) > 1  # not one token over and over
