"""Layers of real model families in `DepthStack` (linen and NNX): a pattern of layer kinds (local and
global attention, as Gemma alternates them; a remainder after the last whole repeat), a decoder layer
of three sublayers (self-attention, cross-attention, MLP), per-layer inputs and outputs (a sublayer's
auxiliary loss; a decoding cache passed in and returned), a sublayer learning its layer index, and a
hook on the stream between sublayers (stream dropout, stream intermediates).

Each run is compared against the model written out as a loop in this file: the five modes' definitions
(docs/explanations/modes.md: which sources each sublayer reads, the block partial, the final routing of
the Kimi modes) over plain lists of sources, with `depth_route` (the routing reference) and the
sublayers' math in plain JAX, reading the dropout masks the stack drew (sown, or captured with
`nnx.capture`). Values, every gradient, the outputs and the sown values must agree, scanned with the
store-once pass, as plain autodiff, two-phase, and unrolled. Tolerances are multiples of float32's
epsilon, scaled by the depth and the values' size.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deltares.nn import BLOCK_MODES, DepthStack, layer_params, stack_params
from deltares.nn.config import REPLACEMENT_MODES
from deltares.nn.nnx import DepthStack as NNXDepthStack
from deltares.nn.routing import depth_route
from tests.jax_cache import ENV
from tests.test_stack import _random_routers

B, T, D, F, M = 2, 6, 8, 12, 3  # batch, tokens, width, MLP width, memory tokens
RATE, HOOK_RATE = 0.3, 0.1
EPS = float(np.finfo(np.float32).eps)
E_BTD = jax.random.normal(jax.random.key(9), (B, T, D))
MEMORY_BMD = jax.random.normal(jax.random.key(8), (B, M, D))


def norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


# ----------------------------------------------------------------------------- the sublayers' math

def attention(p, x_BTD, window=0, keep_BTD=None, memory_BMD=None, cache=None, pos=0):
    """One head of attention: causal self-attention (within `window` tokens where > 0), or
    cross-attention over `memory_BMD`; with `cache` (keys, values [B, C, D]) the tokens sit at
    positions pos.. and the updated cache is returned too. Dropout with the mask `keep_BTD`."""
    y_BTD = norm(x_BTD)
    src = y_BTD if memory_BMD is None else norm(memory_BMD)
    q, k, v = y_BTD @ p["q"], src @ p["k"], src @ p["v"]
    q_pos = pos + jnp.arange(x_BTD.shape[1])
    if cache is not None:
        k = jax.lax.dynamic_update_slice(cache[0], k, (0, pos, 0))
        v = jax.lax.dynamic_update_slice(cache[1], v, (0, pos, 0))
    scores = jnp.einsum("btd,bcd->btc", q, k) / jnp.sqrt(D)
    if memory_BMD is None:
        k_pos = jnp.arange(k.shape[1])
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = jnp.where(allowed, scores, -jnp.inf)
    out = jnp.einsum("btc,bcd->btd", jax.nn.softmax(scores, axis=-1), v) @ p["o"]
    if keep_BTD is not None:
        out = jnp.where(keep_BTD, out / (1 - RATE), 0.0)
    return out if cache is None else (out, (k, v))


def mlp(p, x_BTD, layer_index):
    """A layer-scaled MLP returning (delta, an auxiliary loss)."""
    hidden = jax.nn.gelu(norm(x_BTD) @ p["up"])
    return hidden @ p["down"] * (1 + 0.25 * layer_index), jnp.mean(hidden ** 2)


def stream_dropout(h_BTD, keep_BTD):
    return jnp.where(keep_BTD, h_BTD / (1 - HOOK_RATE), 0.0)


# ----------------------------------------------------------------------------- linen sublayers

def _w(module, name, shape):
    return module.param(name, nn.initializers.normal(0.5), shape)


class Attn(nn.Module):
    window: int = 0

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool = True):
        p = {n: _w(self, n, (D, D)) for n in "qkvo"}
        keep = None
        if not deterministic:
            keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - RATE, x_BTD.shape)
            self.sow("intermediates", "keep", keep)
        return attention(p, x_BTD, self.window, keep)


class Cross(nn.Module):
    @nn.compact
    def __call__(self, x_BTD, memory_BMD):
        return attention({n: _w(self, n, (D, D)) for n in "qkvo"}, x_BTD, memory_BMD=memory_BMD)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x_BTD, layer_index):
        return mlp({"up": _w(self, "up", (D, F)), "down": _w(self, "down", (F, D))}, x_BTD, layer_index)


class StreamDropout(nn.Module):
    """The stream hook: sows the stream's mean, and drops stream entries."""

    @nn.compact
    def __call__(self, h_BTD, deterministic: bool = True):
        self.sow("intermediates", "mean", h_BTD.mean())
        if deterministic:
            return h_BTD
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - HOOK_RATE, h_BTD.shape)
        self.sow("intermediates", "keep", keep)
        return stream_dropout(h_BTD, keep)


LINEN_KINDS = {  # scenario -> (sublayers, pattern)
    "local_global": ({"local": {"attn": functools.partial(Attn, 3), "mlp": MLP}, "global": {"attn": Attn, "mlp": MLP}},
                     ("local", "local", "global")),
    "decoder": ({"self": Attn, "cross": Cross, "mlp": MLP}, None),
}


# ----------------------------------------------------------------------------- NNX sublayers

class NNXAttn(nnx.Module):
    def __init__(self, rngs, window=0):
        self.q, self.k, self.v, self.o = (nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5) for _ in range(4))
        self.window = window

    def __call__(self, x_BTD, rngs: nnx.Rngs | None = None):
        p = {n: getattr(self, n)[...] for n in "qkvo"}
        keep = None
        if rngs is not None:  # dropout with the call's rngs (the Gemma example's pattern)
            keep = jax.random.bernoulli(rngs.dropout(), 1 - RATE, x_BTD.shape)
            self.sow(nnx.Intermediate, "keep", keep)
        return attention(p, x_BTD, self.window, keep)


class NNXCross(NNXAttn):
    def __call__(self, x_BTD, memory_BMD):
        return attention({n: getattr(self, n)[...] for n in "qkvo"}, x_BTD, memory_BMD=memory_BMD)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Param(jax.random.normal(rngs.params(), (D, F)) * 0.5)
        self.down = nnx.Param(jax.random.normal(rngs.params(), (F, D)) * 0.5)

    def __call__(self, x_BTD, layer_index):
        return mlp({"up": self.up[...], "down": self.down[...]}, x_BTD, layer_index)


class NNXStreamDropout(nnx.Module):
    def __init__(self, rngs):
        pass

    def __call__(self, h_BTD, rngs: nnx.Rngs | None = None):
        self.sow(nnx.Intermediate, "mean", h_BTD.mean())
        if rngs is None:
            return h_BTD
        keep = jax.random.bernoulli(rngs.dropout(), 1 - HOOK_RATE, h_BTD.shape)
        self.sow(nnx.Intermediate, "keep", keep)
        return stream_dropout(h_BTD, keep)


NNX_KINDS = {
    "local_global": ({"local": lambda rngs: {"attn": NNXAttn(rngs, 3), "mlp": NNXMLP(rngs)},
                      "global": lambda rngs: {"attn": NNXAttn(rngs), "mlp": NNXMLP(rngs)}}, ("local", "local", "global")),
    "decoder": (lambda rngs: {"self": NNXAttn(rngs), "cross": NNXCross(rngs), "mlp": NNXMLP(rngs)}, None),
}


# ----------------------------------------------------------------------------- the loop written out

def kind_of(scenario, layer):
    if scenario == "decoder":
        return ("self", "cross", "mlp"), 0
    return ("attn", "mlp"), 3 if layer % 3 < 2 else 0  # local, local, global


def reference(scenario, mode, block_layers, layers, final, masks, hook, n_layers):
    """The stack as a loop over its layers, from the modes' definitions: returns (output, the MLPs'
    auxiliary losses [L], the hook's sown stream means [J]). `layers`: per-layer parameters (routers
    included); `masks[l]`: layer l's sown dropout masks."""
    per_sublayer, additive = mode in ("delta", "full_attnres"), mode not in REPLACEMENT_MODES
    h_BTD = h_block = E_BTD
    deltas, blocks, aux, means = [], [], [], []
    for index in range(n_layers):
        names, window = kind_of(scenario, index)
        p = layers[index]
        for k, name in enumerate(names):
            opens = mode in BLOCK_MODES and index % block_layers == 0 and k == 0
            if opens:
                h_block = h_BTD
            if mode == "baseline":
                x_BTD = h_BTD
            else:
                if per_sublayer:
                    sources = [E_BTD] + deltas
                else:
                    sources = [E_BTD] + blocks + ([h_BTD - h_block] if not opens else [])
                if len(sources) == 1 and additive:
                    x_BTD = h_BTD
                else:
                    router = p[f"{name}_router"]
                    x_BTD = depth_route(jnp.stack(sources), jnp.ones(len(sources), bool), router["query"],
                                        router["gain"], residual=h_BTD if additive else None)
            if name == "mlp":
                v_BTD, loss = mlp(p["mlp"], x_BTD, index)
                aux.append(loss)
            elif name == "cross":
                v_BTD = attention(p["cross"], x_BTD, memory_BMD=MEMORY_BMD)
            else:
                v_BTD = attention(p[name], x_BTD, window, masks[index][name]["keep"][0])
            h_next = h_BTD + v_BTD
            if hook:
                means.append(h_next.mean())
                h_next = stream_dropout(h_next, masks[index][f"{name}_hook"]["keep"][0])
            v_BTD = h_next - h_BTD  # what the sublayer added: its source
            h_BTD = h_BTD + v_BTD
            deltas.append(v_BTD)
            if mode in BLOCK_MODES and k == len(names) - 1 and ((index + 1) % block_layers == 0 or index == n_layers - 1):
                blocks.append(h_BTD - h_block)
    out_BTD = h_BTD
    if not additive:
        sources = [E_BTD] + (deltas if per_sublayer else blocks)
        out_BTD = depth_route(jnp.stack(sources), jnp.ones(len(sources), bool), final["query"], final["gain"])
    return out_BTD, jnp.stack(aux), jnp.stack(means) if hook else None


def _loss(out_BTD, aux_L):
    return jnp.sum(jnp.sin(out_BTD) * jnp.arange(D)) + jnp.sum(aux_L * jnp.arange(1, len(aux_L) + 1))


def _close(got, want, depth):
    """Equal within float32 rounding accumulated over `depth` sublayers, relative to the values' size."""
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        scale = max(1.0, float(jnp.abs(w).max()))
        np.testing.assert_allclose(g, w, atol=64 * depth * EPS * scale, rtol=0, err_msg=jax.tree_util.keystr(path))


SCENARIOS = {  # name -> (scenario, mode, block_layers, n_layers, hook)
    # five layers: one repeat of (local, local, global) and a remainder of two; blocks of two layers open
    # inside a repeat (the store-once pass saves each unit's block start)
    "local_global": ("local_global", "delta_block", 2, 5, True),
    # blocks of three layers: whole repeats (two-phase groups can run), the last block the remainder
    "local_global_aligned": ("local_global", "block_attnres", 3, 5, True),
    "decoder": ("decoder", "delta", 1, 4, False),
    "decoder_kimi": ("decoder", "full_attnres", 1, 4, False),
}


@functools.lru_cache(maxsize=None)
def _reference_step(name):
    """The loop's (loss, (aux losses, stream means)) and its gradients in the layers and the final router,
    compiled once per scenario (the masks are arguments)."""
    scenario, mode, block_layers, n_layers, hook = SCENARIOS[name]

    def loss(layers, final, masks):
        out_BTD, aux_L, means = reference(scenario, mode, block_layers, layers, final, masks, hook, n_layers)
        return _loss(out_BTD, aux_L), (aux_L, means)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _reference_grads(name, layers, final, masks):
    masks = [{k: {"keep": v["keep"]} for k, v in m.items() if "keep" in v} for m in masks]  # the masks only
    return _reference_step(name)(layers, final, masks)


# ----------------------------------------------------------------------------- linen

def _linen_stack(name, **kw):
    scenario, mode, block_layers, n_layers, hook = SCENARIOS[name]
    sublayers, pattern = LINEN_KINDS[scenario]
    return DepthStack(sublayers, n_layers, mode, block_layers=block_layers, pattern=pattern,
                      stream_hook=StreamDropout if hook else None, **kw)


def _linen_call(stack, scenario, p, key):
    kw = dict(memory_BMD=MEMORY_BMD) if scenario == "decoder" else {}
    (out_BTD, outputs), written = stack.apply({"params": p}, E_BTD, deterministic=False, rngs={"dropout": key},
                                              mutable=["intermediates"], **kw)
    return out_BTD, outputs, written["intermediates"]


@pytest.mark.parametrize("name, variants", [
    ("local_global", ({}, dict(scan=False))),  # plain autodiff of the scan: test_per_layer_inputs_...
    ("decoder", ({}, dict(group_layers=2), dict(scan=False))),
])
def test_linen_pattern_equals_the_loop(name, variants):
    scenario, mode, block_layers, n_layers, hook = SCENARIOS[name]
    init_stack = _linen_stack(name)
    kw = dict(memory_BMD=MEMORY_BMD) if scenario == "decoder" else {}
    params = _random_routers(nn.meta.unbox(init_stack.init(jax.random.key(0), E_BTD, **kw)["params"]))
    layers = layer_params(params, init_stack)
    if scenario == "local_global":  # a repeat of the pattern under layers/<i>, the last two layers apart
        assert set(params) == {"layers", "remainder"} and set(params["layers"]) == {"0", "1", "2"}
        assert params["layers"]["0"]["attn"]["q"].shape == (1, D, D) and set(params["remainder"]) == {"0", "1"}
    for variant in variants:
        stack = _linen_stack(name, **variant)
        p = params
        if not variant.get("scan", True):  # the same weights, one entry per layer
            p = {**stack_params(layers, stack), **{k: v for k, v in params.items() if k not in ("layers", "remainder")}}
            assert set(p) - {"final_router"} == {f"layers_{i}" for i in range(n_layers)}

        def loss(p, stack=stack):
            out_BTD, outputs, sown = _linen_call(stack, scenario, p, jax.random.key(7))
            assert outputs["mlp"].shape == (n_layers,)  # each layer's auxiliary loss, on the layer axis
            return _loss(out_BTD, outputs["mlp"]), sown

        (value, sown), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
        masks = layer_params(sown, stack)
        keep = masks[0]["attn" if scenario == "local_global" else "self"]["keep"][0]
        assert keep.shape == (B, T, D) and 0.5 < float(keep.mean()) < 0.9, variant  # dropout is on
        (want, (aux, means)), (want_layers, want_final) = _reference_grads(name, layers, params.get("final_router"),
                                                                           masks)
        depth = sum(len(kind_of(scenario, i)[0]) for i in range(n_layers))
        np.testing.assert_allclose(value, want, atol=64 * depth * EPS * max(1.0, abs(float(want))), rtol=0,
                                   err_msg=str(variant))
        _close(layer_params(grads, stack), want_layers, depth)
        if want_final is not None:
            _close(grads["final_router"], want_final, depth)
        if hook:  # the hook's sown stream means, per layer and sublayer
            got = [m[f"{n}_hook"]["mean"][0] for m, i in zip(masks, range(n_layers)) for n in kind_of(scenario, i)[0]]
            _close(jnp.stack(got), means, depth)
    assert float(jnp.abs(want_layers[-1]["mlp_router"]["query"]).max()) > 1e-3  # the routers learn


# ----------------------------------------------------------------------------- NNX

def _nnx_stack(name, params=None, **kw):
    scenario, mode, block_layers, n_layers, hook = SCENARIOS[name]
    sublayers, pattern = NNX_KINDS[scenario]
    stack = NNXDepthStack(sublayers, n_layers, D, mode, block_layers=block_layers, pattern=pattern,
                          stream_hook=(lambda rngs: NNXStreamDropout(rngs)) if hook else None, rngs=nnx.Rngs(0), **kw)
    state = nnx.state(stack, nnx.Param)
    pure = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, params if params is not None else _random_routers(pure))
    nnx.update(stack, state)
    return stack


@pytest.mark.parametrize("name, variants", [
    ("local_global_aligned", ({}, dict(group_layers=1), dict(scan=False))),
    ("decoder_kimi", ({}, dict(scan=False))),
])
def test_nnx_pattern_equals_the_loop(name, variants):
    """With an `nnx.Rngs` passed at call time (split per layer and sublayer), values sown through
    `nnx.capture`, and the layer axis in every stacked variable's sharding metadata."""
    scenario, mode, block_layers, n_layers, hook = SCENARIOS[name]
    params = nnx.to_pure_dict(nnx.state(_nnx_stack(name), nnx.Param))
    layers = layer_params(params, _nnx_stack(name, params))
    kw = dict(memory_BMD=MEMORY_BMD) if scenario == "decoder" else {}
    for variant in variants:
        stack = _nnx_stack(name, params, **variant)
        specs = nnx.get_partition_spec(nnx.state(stack, nnx.Param))
        router = specs["layers"]["0"]["attn_router"] if scenario == "local_global" else specs["layers"]["self_router"]
        assert router["query"].get_value() == jax.sharding.PartitionSpec("layers", "embed")  # the docs' logical names

        @nnx.jit
        def step(stack, rngs):
            def loss(m, rngs):
                (out_BTD, outputs), sown = nnx.capture(m, nnx.Intermediate)(E_BTD, rngs=rngs, **kw)
                return _loss(out_BTD, outputs["mlp"]), sown
            return nnx.value_and_grad(loss, has_aux=True)(stack, rngs)

        rngs = nnx.Rngs(dropout=7)
        (value, sown), grads = step(stack, rngs)
        masks = layer_params(nnx.to_pure_dict(sown), stack)
        first = "attn" if scenario == "local_global" else "self"
        keep = masks[0][first]["keep"][0]
        assert keep.shape == (B, T, D) and 0.5 < float(keep.mean()) < 0.9, variant
        assert bool(jnp.any(keep != masks[1][first]["keep"][0]))  # each layer draws its own mask
        (want, (aux, means)), (want_layers, want_final) = _reference_grads(name, layers, params.get("final_router"),
                                                                           masks)
        depth = sum(len(kind_of(scenario, i)[0]) for i in range(n_layers))
        np.testing.assert_allclose(value, want, atol=64 * depth * EPS * max(1.0, abs(float(want))), rtol=0,
                                   err_msg=str(variant))
        grads = nnx.to_pure_dict(grads)
        _close(layer_params(grads, stack), want_layers, depth)
        if want_final is not None:
            _close(grads["final_router"], want_final, depth)
        if hook:
            got = [m[f"{n}_hook"]["mean"][0] for m, i in zip(masks, range(n_layers)) for n in kind_of(scenario, i)[0]]
            _close(jnp.stack(got), means, depth)
        (_, again), _ = step(stack, rngs)  # the caller's Rngs advanced: new masks
        assert bool(jnp.any(layer_params(nnx.to_pure_dict(again), stack)[0][first]["keep"][0] != keep))


# ----------------------------------------------------------------------------- decoding with a per-layer cache

class CachedAttn(nn.Module):
    """Self-attention that, given a cache (keys, values [B, C, D]) and the position of its first
    token, returns (delta, the updated cache): a per-layer input and output of the stack."""

    window: int = 0

    @nn.compact
    def __call__(self, x_BTD, cache=None, pos=0):
        return attention({n: _w(self, n, (D, D)) for n in "qkvo"}, x_BTD, self.window, cache=cache, pos=pos)


class NNXCachedAttn(NNXAttn):
    def __call__(self, x_BTD, cache=None, pos=0):
        return attention({n: getattr(self, n)[...] for n in "qkvo"}, x_BTD, self.window, cache=cache, pos=pos)


class PlainMLP(nn.Module):
    @nn.compact
    def __call__(self, x_BTD):
        return mlp({"up": _w(self, "up", (D, F)), "down": _w(self, "down", (F, D))}, x_BTD, 0)[0]


class NNXPlainMLP(NNXMLP):
    def __call__(self, x_BTD):
        return mlp({"up": self.up[...], "down": self.down[...]}, x_BTD, 0)[0]


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_decoding_with_a_per_layer_cache_equals_the_full_forward(framework):
    """Gemma's pattern (a local layer, a global one; three layers: a remainder of one) decodes with each
    layer's key/value cache passed in on the layer axis (`per_layer`) and returned as the attention
    sublayers' output: the prompt in one call, then one token per call. Every position's output equals
    the full forward pass's (no cache)."""
    n_layers, C, P = 3, T, 3
    kinds = ({"local": {"attn": functools.partial(CachedAttn, 2), "mlp": PlainMLP}, "global": {"attn": CachedAttn, "mlp": PlainMLP}}
             if framework == "linen" else
             {"local": lambda rngs: {"attn": NNXCachedAttn(rngs, 2), "mlp": NNXPlainMLP(rngs)},
              "global": lambda rngs: {"attn": NNXCachedAttn(rngs), "mlp": NNXPlainMLP(rngs)}})
    if framework == "linen":
        stack = DepthStack(kinds, n_layers, "full_attnres", pattern=("local", "global"))
        params = _random_routers(nn.meta.unbox(stack.init(jax.random.key(0), E_BTD)["params"]))

        call = jax.jit(lambda e_BTD, **kw: stack.apply({"params": params}, e_BTD, **kw))
    else:
        stack = NNXDepthStack(kinds, n_layers, D, "full_attnres", pattern=("local", "global"), rngs=nnx.Rngs(0))
        state = nnx.state(stack, nnx.Param)
        nnx.replace_by_pure_dict(state, _random_routers(nnx.to_pure_dict(state)))
        nnx.update(stack, state)
        call = nnx.jit(lambda e_BTD, **kw: stack(e_BTD, **kw))
    full_BTD = call(E_BTD)
    cache = tuple(jnp.zeros((n_layers, B, C, D)) for _ in range(2))
    out_BTD, outputs = call(E_BTD[:, :P], per_layer={"cache": cache}, pos=jnp.int32(0))
    steps = [out_BTD]
    for t in range(P, T):
        cache = outputs["attn"]
        assert jax.tree.map(jnp.shape, cache) == ((n_layers, B, C, D),) * 2
        out_BTD, outputs = call(E_BTD[:, t: t + 1], per_layer={"cache": cache}, pos=jnp.int32(t))
        steps.append(out_BTD)
    decoded_BTD = jnp.concatenate(steps, axis=1)
    np.testing.assert_allclose(decoded_BTD, full_BTD, atol=64 * 6 * EPS * max(1.0, float(jnp.abs(full_BTD).max())),
                               rtol=0)
    assert float(jnp.abs(full_BTD[:, 1:] - full_BTD[:, :1]).max()) > 0.1  # positions differ: attention matters


# ----------------------------------------------------------------------------- NNX under a mesh

def test_nnx_optimizer_steps_on_a_mesh_equal_one_device():
    """A small NNX language model whose layers are a DepthStack (local/global pattern, a remainder,
    delta_block) trains 3 AdamW steps under an Explicit mesh of fsdp=2 x tensor=2 on 4 simulated CPU
    devices (tests/nnx_mesh_worker.py: the device count is fixed when JAX starts) as on one device:
    every stacked variable carries the layer axis in front of its logical names, so its sharding
    has as many entries as the array has axes (without it the optimizer's update fails)."""
    env = dict(ENV)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "nnx_mesh_worker.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got["mesh"], got["single"], rtol=64 * EPS)
    assert got["moved"] > 1e-3  # the steps moved the parameters...
    assert got["max_param_diff"] <= 64 * EPS * got["param_scale"] * 3  # ...to the same place (3 steps)
    # logical names with the layer axis in front (the rules map layers to no mesh axis), and the array so laid out
    assert got["up_spec"] == got["up_sharding"] == "P(None, 'fsdp', 'tensor')" and got["up_shape"] == [1, 16, 32]
    assert got["router_spec"] == "P(None, 'fsdp')"
    assert got["remainder_up_spec"] == "P('fsdp', 'tensor')" and got["remainder_router_spec"] == "P('fsdp',)"


# ----------------------------------------------------------------------------- weights in and out

def _loop_model(scenario, layers, n_layers):
    """The unrouted model a stack converts: x = h, h += v, its layers written as a loop."""
    h_BTD = E_BTD
    for index in range(n_layers):
        names, window = kind_of(scenario, index)
        for name in names:
            if name == "mlp":
                v_BTD = mlp(layers[index]["mlp"], h_BTD, index)[0]
            elif name == "cross":
                v_BTD = attention(layers[index]["cross"], h_BTD, memory_BMD=MEMORY_BMD)
            else:
                v_BTD = attention(layers[index][name], h_BTD, window)
            h_BTD = h_BTD + v_BTD
    return h_BTD


def _loop_weights(scenario, n_layers, seed=3):
    keys = iter(jax.random.split(jax.random.key(seed), 8 * n_layers))
    layers = []
    for index in range(n_layers):
        layer = {}
        for name in kind_of(scenario, index)[0]:
            if name == "mlp":
                layer[name] = {"up": jax.random.normal(next(keys), (D, F)) * 0.5, "down": jax.random.normal(next(keys), (F, D)) * 0.5}
            else:
                layer[name] = {n: jax.random.normal(next(keys), (D, D)) * 0.5 for n in "qkvo"}
        layers.append(layer)
    return layers


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_weights_moved_in_give_the_unrouted_model_at_zero_init(framework):
    """An unrouted model's per-layer weights (a loop's list) moved into a routed stack (`stack_params`, the
    routers from the stack's own init: zero queries and, with `gate`, zero gates): the stack computes the
    loop's function. (Zero queries alone route uniformly, and in the Delta modes the sources sum to the
    stream, so pre-normed sublayers would see the same input either way: the check that it can fail
    redraws the queries, without gates.)"""
    scenario, n_layers = "local_global", 5
    loop_layers = _loop_weights(scenario, n_layers)
    want_BTD = _loop_model(scenario, loop_layers, n_layers)
    sublayers, pattern = (LINEN_KINDS if framework == "linen" else NNX_KINDS)[scenario]
    for gate, queries in ((True, "init"), (False, "random")):
        if framework == "linen":
            stack = DepthStack(sublayers, n_layers, "delta_block", block_layers=2, pattern=pattern, gate=gate)
            like = nn.meta.unbox(stack.init(jax.random.key(0), E_BTD)["params"])
            like = like if queries == "init" else _random_routers(like)
            got_BTD = stack.apply({"params": stack_params(loop_layers, stack, like=like)}, E_BTD)[0]
        else:
            stack = NNXDepthStack(sublayers, n_layers, D, "delta", pattern=pattern, gate=gate, rngs=nnx.Rngs(0))
            state = nnx.state(stack, nnx.Param)
            like = nnx.to_pure_dict(state)
            like = like if queries == "init" else _random_routers(like)
            nnx.replace_by_pure_dict(state, stack_params(loop_layers, stack, like=like))
            nnx.update(stack, state)
            got_BTD = stack(E_BTD)[0]
        close = np.allclose(got_BTD, want_BTD, atol=64 * 10 * EPS * max(1.0, float(jnp.abs(want_BTD).max())), rtol=0)
        assert close == gate, (gate, queries, float(jnp.abs(got_BTD - want_BTD).max()))


def test_weights_round_trip_exactly_in_every_layout():
    params_of = {}
    for name, stack in {
        "one kind": DepthStack((Attn, PlainMLP), 3, "delta"),
        "pattern": _linen_stack("local_global"),
        "pattern unrolled": _linen_stack("local_global", scan=False),
        "nnx pattern": _nnx_stack("local_global"),
    }.items():
        if isinstance(stack, nn.Module):
            params = nn.meta.unbox(stack.init(jax.random.key(0), E_BTD)["params"])
        else:
            params = nnx.to_pure_dict(nnx.state(stack, nnx.Param))
        layers = layer_params(params, stack)
        assert len(layers) == stack_len(stack) and {"attn", "mlp", "attn_router", "mlp_router"} <= set(layers[0])
        back = stack_params(layers, stack, like=params)
        assert jax.tree.structure(back) == jax.tree.structure(params), name
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
            assert a.dtype == b.dtype and np.array_equal(a, b), name  # exact
        named = layer_params(params, stack, names="h.{}")
        assert list(named) == [f"h.{i}" for i in range(len(layers))]
        again = stack_params(dict(reversed(list(named.items()))), stack, like=params)  # by the index in the name
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)))
        params_of[name] = (stack, params, layers)
    # the layouts: a pattern's repeats under layers/<i>, the remainder apart; unrolled one entry per layer
    _, params, layers = params_of["pattern"]
    assert np.array_equal(params["layers"]["2"]["attn"]["q"][0], layers[2]["attn"]["q"])
    assert np.array_equal(params["remainder"]["1"]["mlp"]["up"], layers[4]["mlp"]["up"])
    stack, params, _ = params_of["pattern unrolled"]
    assert {f"layers_{i}" for i in range(5)} <= set(params)


def stack_len(stack):
    return stack.n_layers if isinstance(stack, nn.Module) else stack.routing.n_layers


@pytest.mark.parametrize("change, words", [
    (lambda layers: layers[:-1], "4 per-layer trees for a stack of 5 layers"),
    (lambda layers: {f"layer{i}_v2": layer for i, layer in enumerate(layers)}, "exactly one layer index"),
    (lambda layers: {**{f"h.{i}": layer for i, layer in enumerate(layers)}, "x.3": layers[3]}, "both name layer 3"),
    (lambda layers: {f"h.{i + 1}": layer for i, layer in enumerate(layers)}, r"number the layers 0 \.\. n - 1"),
    (lambda layers: [{**layer, "extra": {"w": jnp.ones(3)}} if i == 2 else layer for i, layer in enumerate(layers)],
     r"layer 2 has \['extra'\]\['w'\], which the stack's layer 2 has not"),
    (lambda layers: [{**layer, "mlp": {**layer["mlp"], "up": jnp.ones((D, F + 1))}} if i == 4 else layer
                     for i, layer in enumerate(layers)], r"layer 4\['mlp'\]\['up'\] is float32\[8, 13\], the stack's is float32\[8, 12\]"),
    (lambda layers: [{**layer, "mlp": {**layer["mlp"], "up": layer["mlp"]["up"].astype(jnp.bfloat16)}} if i == 0 else layer
                     for i, layer in enumerate(layers)], r"layer 0\['mlp'\]\['up'\] is bfloat16\[8, 12\]"),
    (lambda layers: "layers", "a list of per-layer parameter trees"),
])
def test_weights_that_do_not_fit_are_one_clear_error(change, words):
    stack = _linen_stack("local_global")
    params = nn.meta.unbox(stack.init(jax.random.key(0), E_BTD)["params"])
    with pytest.raises(ValueError, match=words):
        stack_params(change(layer_params(params, stack)), stack, like=params)
    with pytest.raises(ValueError, match="have no 'remainder'"):  # another stack's parameters
        layer_params({"layers": params["layers"]}, stack)


# ----------------------------------------------------------------------------- mistakes

class OtherOutput(nn.Module):
    @nn.compact
    def __call__(self, x_BTD):
        return x_BTD * 0.0, jnp.zeros((2,))


def test_bad_layer_kinds_patterns_hooks_and_per_layer_values_are_one_clear_error():
    kinds, pattern = LINEN_KINDS["local_global"]
    cases = [
        (dict(sublayers=kinds, pattern=("local", "glob")), "pattern names 'glob', which is not a layer kind"),
        (dict(sublayers=kinds, pattern=("local",)), "layer kind 'global' is not in the pattern"),
        (dict(sublayers=kinds, pattern=("local", "global") * 3), "the pattern has 6 layers, more than the stack's n_layers=5"),
        (dict(sublayers={"attn": Attn, "local": {"mlp": MLP}}), "not a mix"),
        (dict(sublayers=kinds, pattern=pattern, names=("a", "b")), "names come from the mappings' keys"),
        (dict(sublayers=(Attn, PlainMLP), pattern=("a",)), "pattern names layer kinds"),
        (dict(sublayers=(Attn, PlainMLP, PlainMLP)), r"3 sublayers and 2 names \('attn', 'mlp'\)"),
        (dict(sublayers={"local": {}, "global": {"mlp": MLP}}), "of layer kind 'local' need names"),
        (dict(sublayers=kinds, pattern=pattern, stream_hook=StreamDropout()), "stream_hook must be a linen Module class"),
        (dict(sublayers=kinds, pattern=pattern, mode="delta_block", block_layers=2, group_layers=1),
         "needs blocks of whole pattern repeats: block_layers=2 is not a multiple of the pattern's 3 layers"),
    ]
    for kw, words in cases:
        kw = {"n_layers": 5, "mode": "delta", **kw}
        with pytest.raises(ValueError, match=words):
            DepthStack(**kw).init(jax.random.key(0), E_BTD)
    stack = DepthStack(kinds, 5, "delta", pattern=pattern)
    variables = stack.init(jax.random.key(0), E_BTD)
    with pytest.raises(ValueError, match=r"per_layer\['cache'\] holds an array of shape \(3, 2\)"):
        stack.apply(variables, E_BTD, per_layer={"cache": jnp.zeros((3, 2))})
    with pytest.raises(TypeError, match="keyword argument 'cache', which no sublayer"):
        DepthStack({"a": Attn, "b": PlainMLP, "c": PlainMLP}, 2, "delta").init(jax.random.key(0), E_BTD,
                                                                             per_layer={"cache": jnp.zeros((2, 1))})
    odd = {"local": {"attn": Attn, "mlp": MLP}, "global": {"attn": OtherOutput, "mlp": PlainMLP}}
    with pytest.raises(ValueError, match="outputs differ between layer 1 and layer 0"):
        DepthStack(odd, 2, "delta").init(jax.random.key(0), E_BTD)
    nnx_kinds, nnx_pattern = NNX_KINDS["local_global"]
    nnx_cases = [
        (dict(sublayers=nnx_kinds, pattern=("local", "glob")), "pattern names 'glob', which is not a layer kind"),
        (dict(sublayers=lambda rngs: (NNXAttn(rngs),)), r"must return 2 modules \(names \('attn', 'mlp'\)\)"),
        (dict(sublayers=nnx_kinds, pattern=nnx_pattern, stream_hook=NNXStreamDropout(nnx.Rngs(0))), "stream_hook must be"),
        (dict(sublayers=nnx_kinds, pattern=nnx_pattern, mode="block_attnres", block_layers=2, group_layers=1),
         "needs blocks of whole pattern repeats"),
    ]
    for kw, words in nnx_cases:
        kw = {"n_layers": 5, "d_model": D, "mode": "delta", "rngs": nnx.Rngs(0), **kw}
        with pytest.raises(ValueError, match=words):
            NNXDepthStack(**kw)


class ScaledMLP(nn.Module):
    @nn.compact
    def __call__(self, x_BTD, scale_D, shift):
        delta_BTD = mlp({"up": _w(self, "up", (D, F)), "down": _w(self, "down", (F, D))}, x_BTD, 0)[0]
        return jnp.roll(delta_BTD * scale_D, shift, axis=-1)


class NNXScaledMLP(NNXMLP):
    def __call__(self, x_BTD, scale_D, shift):
        return jnp.roll(mlp({"up": self.up[...], "down": self.down[...]}, x_BTD, 0)[0] * scale_D, shift, axis=-1)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_per_layer_inputs_are_differentiated_under_store_once(framework):
    """A floating per-layer input (`per_layer`, here each layer's scale of its MLP, as per-layer embeddings
    would be) gets its gradient through the store-once pass as through plain autodiff, an integer one
    (each layer's shift of its MLP's output, as a decoder's cache positions would be) read as it is."""
    n_layers = 5  # a pattern of two: two repeats and a remainder
    scale_LD = 1 + 0.5 * jax.random.normal(jax.random.key(4), (n_layers, D))
    shift_L = jnp.arange(n_layers, dtype=jnp.int32)
    per_layer = {"scale_D": scale_LD, "shift": shift_L}

    def run(store_once):
        if framework == "linen":
            kinds = {"a": {"attn": Attn, "mlp": ScaledMLP}, "b": {"attn": functools.partial(Attn, 2), "mlp": ScaledMLP}}
            stack = DepthStack(kinds, n_layers, "delta_block", block_layers=2, store_once=store_once)
            params = _random_routers(nn.meta.unbox(stack.init(jax.random.key(0), E_BTD, per_layer=per_layer)["params"]))

            def loss(scale_LD):
                out_BTD = stack.apply({"params": params}, E_BTD, per_layer={"scale_D": scale_LD, "shift": shift_L})
                return jnp.sum(jnp.sin(out_BTD) * jnp.arange(D))
            return jax.jit(jax.value_and_grad(loss))(scale_LD)
        kinds = {"a": lambda rngs: {"attn": NNXAttn(rngs), "mlp": NNXScaledMLP(rngs)},
                 "b": lambda rngs: {"attn": NNXAttn(rngs, 2), "mlp": NNXScaledMLP(rngs)}}
        stack = NNXDepthStack(kinds, n_layers, D, "delta_block", block_layers=2, store_once=store_once,
                              rngs=nnx.Rngs(0))
        state = nnx.state(stack, nnx.Param)
        nnx.replace_by_pure_dict(state, _random_routers(nnx.to_pure_dict(state)))
        nnx.update(stack, state)
        def nnx_loss(scale_LD):
            return jnp.sum(jnp.sin(stack(E_BTD, per_layer={"scale_D": scale_LD, "shift": shift_L})) * jnp.arange(D))
        return nnx.jit(nnx.value_and_grad(nnx_loss))(scale_LD)

    (want, want_grad), (got, got_grad) = run(False), run(True)
    np.testing.assert_allclose(got, want, atol=64 * 10 * EPS * max(1.0, abs(float(want))), rtol=0)
    _close(got_grad, want_grad, 10)
    assert float(jnp.abs(want_grad).max(axis=1).min()) > 1e-3  # every layer's input matters
