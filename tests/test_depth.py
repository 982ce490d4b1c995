"""The store-once depth backward (remat) gives standard AD's gradients, in memory linear in depth."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltares.nn.config import model_config
from deltares.nn.losses import lm_loss
from deltares.nn.model import Transformer
from deltares.nn.residual import make_plan
from roundoff import assert_close, with_tolerance

ROUTED = ["full_attnres", "block_attnres", "delta", "delta_block"]


def _cfg(mode, remat, n_layers=5, d_model=32, block_layers=2, **residual):
    residual = dict(dict(block_layers=block_layers), **residual)
    return model_config(
        vocab_size=64, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
        dtype="float32", remat=remat, residual=dict(mode=mode, **residual),
    )


def _loss_and_grads(model, params, tokens, tolerance=False):
    """(loss, gradients); with `tolerance`, also how far float32 rounding can move them between two
    implementations of this step (tests/roundoff.py: forward and backward stages of every sublayer)."""
    def loss(p):
        return lm_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    step = jax.jit(jax.value_and_grad(loss))
    if not tolerance:
        return step(params)
    return with_tolerance(step, params, stages=2 * (2 * model.config.n_layers + 2))


@pytest.mark.parametrize("mode, residual", [(m, {}) for m in ROUTED] + [
    ("delta", dict(gate=True, null_source=True)), ("delta_block", dict(gate=True, null_source=True)),
    # scans of several layers inside a segment (5 layers): per-sublayer runs of 3 and 2 layers, one
    # one-layer segments, one block a segment, runs of two blocks, uneven blocks without partial
    ("delta", dict(scan_segments=2)), ("full_attnres", dict(scan_segments=8)),
    ("delta_block", dict(scan_segments=8)), ("block_attnres", dict(scan_segments=2)),
    ("delta_block", dict(scan_segments=8, block_layers=3, include_partial=False))])
def test_store_once_gradients_equal_standard_ad(mode, residual, remat="full"):
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    reference = Transformer(_cfg(mode, "none", **residual))
    params = nn.meta.unbox(reference.init(jax.random.key(1), tokens[:, :-1]))["params"]
    # Non-zero queries so that routing weights, and their gradients, are not trivial.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    (loss0, grads0), tol = _loss_and_grads(reference, params, tokens, tolerance=True)
    loss1, grads1 = _loss_and_grads(Transformer(_cfg(mode, remat, **residual)), params, tokens)
    assert_close((loss1, grads1), (loss0, grads0), tol)
    router_grads = [g for p, g in jax.tree_util.tree_flatten_with_path(grads1)[0] if "router" in jax.tree_util.keystr(p)]
    assert all(np.abs(g).max() > 0 for g in router_grads)


@functools.lru_cache(maxsize=None)
def _temp_bytes(mode, remat, n_layers, scan_segments=1):
    model = Transformer(_cfg(mode, remat, n_layers=n_layers, d_model=64, scan_segments=scan_segments))
    tokens = jax.ShapeDtypeStruct((2, 65), jnp.int32)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((2, 64), jnp.int32)))
    step = jax.jit(lambda p, t: jax.grad(lambda p: lm_loss(model.apply(p, t[:, :-1]), t[:, 1:]))(p))
    return step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_delta_memory_grows_linearly_with_depth_under_remat():
    # Standard AD of a scan that carries the source buffer stores it at every layer
    # (quadratic in depth); the store-once pass stores it once.
    store_once = [_temp_bytes("delta", "full", n) for n in (8, 32)]
    standard = [_temp_bytes("delta", "none", n) for n in (8, 32)]
    assert store_once[1] < 0.25 * standard[1]
    assert store_once[1] / store_once[0] < 4.5  # linear: 4x the layers, about 4x the memory
    assert standard[1] / standard[0] > 6.0  # quadratic


@pytest.mark.parametrize("scan_segments, bound", [(1, 6.8), (8, 11.6)])
def test_per_sublayer_backward_keeps_few_buffer_copies(scan_segments, bound):
    # The per-sublayer modes differentiate sublayer by sublayer over the final buffer, writing
    # nothing: beyond baseline's temporaries they hold the buffer, its cotangent and a few
    # transients. On this CPU, in units of the buffer: one scan 6.55 (delta), 8 segments 11.09
    # (XLA's CPU buffers around the segments' loops). The MLP's read of the attention's slot as an
    # input of its own (a select over the buffer) costs about one buffer here, where CPU XLA writes
    # the select out; for TPU XLA fuses it into the reads and it saves more (7.6B delta 55.2 GiB,
    # 70.7 without it): tests/test_aot.py bounds the TPU program. The layer-level recomputation,
    # which copies the buffer at each write, held 7.4-8.0 with one scan.
    n_layers = 32
    buffer_bytes = (2 * n_layers + 1) * 2 * 64 * 64 * 4  # S x B x T x D float32
    baseline = _temp_bytes("baseline", "full", n_layers)
    for mode in ("delta", "full_attnres"):
        copies = (_temp_bytes(mode, "full", n_layers, scan_segments) - baseline) / buffer_bytes
        assert copies < bound, (mode, copies)


@pytest.mark.parametrize("n_layers", [1, 2, 5, 7, 12])
def test_recomputed_streams_are_the_forward_streams_bit_for_bit(n_layers):
    """The per-sublayer modes save no layer inputs: the backward pass recomputes each from a few
    checkpoints and the final buffer's deltas. In bfloat16, where the order of additions shows,
    every layer's recomputed stream equals the stream of a plain sequential sum."""
    from deltares.nn.depth import DepthState, _stream_at, _stream_checkpoints

    plan = make_plan("delta", n_layers)
    keys = jax.random.split(jax.random.key(n_layers), 2)
    sources = jax.random.normal(keys[0], (plan.n_slots, 2, 3, 8)).astype(jnp.bfloat16)
    h_0 = (10 * jax.random.normal(keys[1], (2, 3, 8))).astype(jnp.bfloat16)
    expected, h = [], h_0
    for j in range(2 * n_layers):  # the forward pass: h_{j+1} = h_j + v_j, v_j in sublayer j's slot
        if j % 2 == 0:
            expected.append(np.asarray(h))
        h = h + sources[plan.write[j]]
    streams = _stream_checkpoints(plan, DepthState(None, sources, None), h_0)
    at = jax.jit(lambda layer: _stream_at(streams, layer))  # a traced layer, as in the backward scan
    for layer in range(n_layers):
        np.testing.assert_array_equal(np.asarray(at(jnp.int32(layer))), expected[layer], err_msg=f"layer {layer}")
    assert len({e.tobytes() for e in expected}) == n_layers  # the layers' streams differ


def test_block_mode_backward_keeps_few_buffer_copies():
    # Block modes save only each layer's input stream (the running partial is h - h_block, read
    # from the stream) and differentiate sublayer by sublayer over the final buffer (17 slots at
    # 32 layers of 2-layer blocks). Beyond baseline's temporaries, in units of that buffer, on this
    # CPU: delta_block 6.90, block_attnres 6.87 (with a saved partial per layer and whole-layer
    # recomputation from a rebuilt buffer: 10.69 and 8.73; standard AD of the scan: 125.9 for
    # both). The bounds are the figures plus a small margin.
    n_layers, bounds = 32, {"delta_block": 7.5, "block_attnres": 7.5}
    baseline = _temp_bytes("baseline", "full", n_layers)
    for mode, bound in bounds.items():
        buffer_bytes = make_plan(mode, n_layers, block_layers=2).n_slots * 2 * 64 * 64 * 4  # S x B x T x D float32
        copies = (_temp_bytes(mode, "full", n_layers) - baseline) / buffer_bytes
        assert copies < bound, (mode, copies)


@pytest.mark.parametrize("segments, want", [
    (8, [2, 4, 6, 8]),  # one-layer segments: layer l's routers read slots 0..2l + 1
    (2, [4, 8]),  # runs of 2 layers: slots up to the run's last sublayer's
    (1, [9]),  # one scan: the whole buffer, masked
])
def test_scanned_routers_read_their_segments_slots(segments, want, monkeypatch):
    """Forward and backward, a router of the store-once scan is handed the slots its segment can
    have written, not the whole buffer of 2L + 1."""
    from deltares.nn import layers

    seen = set()
    xla_route = layers.xla_route

    def recording(sources_SBTD, *args, **kwargs):
        seen.add(sources_SBTD.shape[0])
        return xla_route(sources_SBTD, *args, **kwargs)

    model = Transformer(_cfg("delta", "full", n_layers=4, scan_segments=segments))
    tokens = jnp.zeros((2, 9), jnp.int32)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1]))["params"]
    monkeypatch.setattr(layers, "xla_route", recording)
    jax.eval_shape(jax.grad(lambda p: lm_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])), params)
    assert sorted(seen) == want
