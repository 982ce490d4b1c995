"""Optimizer (`deltares.training.optim`) and train step (`deltares.training.steps`) on the debug model.

Independent expectations written here:
- the learning-rate schedule: linear warmup from 0, then a cosine from the peak to lr_min;
- AdamW fed the same gradient g twice (the first step at LR 0 because of the warmup) moves a
  parameter by exactly `-lr * (g / (|g| + eps) + wd * p * decayed)` on the second step: the bias-corrected
  moments are then g and g**2. Global-norm clipping scales g and does not change this;
- gradient accumulation: SGD(1) on the step's averaged gradient must equal `params - grad` of the mean
  cross-entropy of the whole batch, computed here with `jax.nn.log_softmax`.
"""

import importlib.util
import math
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_cache import ROOT
from deltares.nn.model import Transformer
from deltares.training.optim import is_routing_param, make_optimizer, param_labels
from deltares.training.steps import abstract_state, build, make_init, make_train_step

SEQ = 32



def debug_config(mode="delta_block"):
    spec = importlib.util.spec_from_file_location("debug_experiment", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def names(path):
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v, np.float64) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def random_tokens(seed, shape):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, 0, 257), np.int32)


# Which leaves of the debug model are routing parameters / weight matrices, by name (not by shape).
ROUTING = {"['layers']['attn_router']['gain']", "['layers']['attn_router']['query']",
           "['layers']['mlp_router']['gain']", "['layers']['mlp_router']['query']"}
MATRIX_NAMES = {"embedding", "kernel"}


def is_matrix_name(key):
    return any(f"['{n}']" in key for n in MATRIX_NAMES)


@pytest.fixture(scope="module")
def model_and_params():
    cfg = debug_config()
    model = Transformer(cfg.model)
    params = flax.linen.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32))["params"])
    # non-trivial routers, so that their gradients are not degenerate
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(len(str(p))), x.shape) if is_routing_param(p) else x,
        params,
    )
    return cfg, model, params


def reference_loss(model, params, tokens_BT):
    """Mean next-token cross-entropy, written independently of deltares.nn.losses."""
    logits = model.apply({"params": params}, tokens_BT[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    return nll.mean()


@pytest.fixture(scope="module")
def batch8():
    return random_tokens(2, (8, SEQ + 1))


@pytest.fixture(scope="module")
def reference(model_and_params, batch8):
    """(loss, grads) of the whole batch by the reference loss."""
    _, model, params = model_and_params
    loss, g = jax.jit(jax.value_and_grad(lambda p: reference_loss(model, p, batch8)))(params)
    return float(loss), g


@pytest.fixture(scope="module")
def grads(reference):
    return reference[1]


# ----------------------------------------------------------------------------- labels


def test_routing_labels_are_exactly_the_router_parameters(model_and_params):
    _, _, params = model_and_params
    labels = flat(jax.tree.map(lambda s: 1.0 if s == "routing" else 0.0, param_labels(params)))
    assert {k for k, v in labels.items() if v} == ROUTING
    assert len(labels) == 17  # every other leaf is a model parameter


def test_routing_labels_unscanned_model():
    cfg = debug_config()
    cfg.model.scan_layers = False
    model = Transformer(cfg.model)
    params = flax.linen.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32)))
    labels = jax.tree_util.tree_flatten_with_path(param_labels(params["params"]))[0]
    routing = {jax.tree_util.keystr(k) for k, v in labels if v == "routing"}
    want = {f"['layers_{i}']['{r}_router']['{n}']" for i in range(3) for r in ("attn", "mlp") for n in ("gain", "query")}
    assert routing == want


# ----------------------------------------------------------------------------- schedule


def reference_lr(step, peak, lr_min, warmup, total):
    if step < warmup:
        return peak * step / warmup
    if step >= total:
        return lr_min
    progress = (step - warmup) / (total - warmup)
    return lr_min + (peak - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_schedule_linear_warmup_then_cosine(model_and_params):
    cfg, _, params = model_and_params
    cfg = cfg.copy_and_resolve_references()
    cfg.optim.update(lr=1e-3, lr_min=1e-4, routing_lr=5e-3, warmup_steps=10)
    cfg.train.steps = 110
    _, schedules = make_optimizer(cfg, params)
    for step in (0, 1, 5, 9, 10, 11, 35, 60, 85, 109, 110, 150):
        assert float(schedules["model"](step)) == pytest.approx(reference_lr(step, 1e-3, 1e-4, 10, 110), rel=1e-5, abs=1e-10)
        # the routing group keeps the same shape, scaled to its own peak (lr_min scaled by the same ratio)
        want = reference_lr(step, 5e-3, 5e-4, 10, 110)
        assert float(schedules["routing"](step)) == pytest.approx(want, rel=1e-5, abs=1e-10)
    assert float(schedules["model"](60)) == pytest.approx(0.5 * (1e-3 + 1e-4), rel=1e-5)  # cosine midpoint


def test_schedule_routing_lr_defaults_to_lr(model_and_params):
    cfg, _, params = model_and_params
    cfg = cfg.copy_and_resolve_references()
    cfg.optim.update(lr=2e-3, lr_min=2e-4, routing_lr=None, warmup_steps=4)
    cfg.train.steps = 20
    _, schedules = make_optimizer(cfg, params)
    for step in (0, 2, 4, 12, 20):
        assert float(schedules["routing"](step)) == pytest.approx(float(schedules["model"](step)))
        assert float(schedules["model"](step)) == pytest.approx(reference_lr(step, 2e-3, 2e-4, 4, 20), rel=1e-5, abs=1e-10)


# ----------------------------------------------------------------------------- AdamW updates by group


def two_identical_steps(cfg, params, grads):
    """Params after two optimizer steps with the same gradient (the first at warmup LR 0)."""
    tx, schedules = make_optimizer(cfg, params, scanned=cfg.model.scan_layers)
    update = jax.jit(tx.update)
    state = tx.init(params)
    p = params
    u, state = update(grads, state, p)
    p1 = optax.apply_updates(p, u)
    u, state = update(grads, state, p1)
    return p1, optax.apply_updates(p1, u), schedules


def expected_second_step(params, grads, lr_of, wd, decayed, clip_norm, eps):
    """The reference AdamW move described in the module docstring (float64)."""
    p, g = flat(params), flat(grads)
    norm = math.sqrt(sum(float((v**2).sum()) for v in g.values()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    out = {}
    for key in p:
        gc = g[key] * scale
        adam = gc / (np.abs(gc) + eps)
        out[key] = p[key] - lr_of(key) * (adam + (wd * p[key] if decayed(key) else 0.0))
    return out


def configured(cfg, **optim):
    cfg = cfg.copy_and_resolve_references()
    cfg.optim.update(warmup_steps=1, **optim)
    cfg.train.steps = 100
    return cfg


def assert_close_tree(got, want, lr, what):
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-4 * lr + 1e-7, err_msg=f"{what}: {key}")


def test_lr_zero_moves_only_routing_parameters(model_and_params, grads):
    cfg, _, params = model_and_params
    cfg = configured(cfg, lr=0.0, lr_min=0.0, routing_lr=1e-2)
    p1, p2, schedules = two_identical_steps(cfg, params, grads)
    assert float(schedules["routing"](1)) == pytest.approx(1e-2)
    before, after = flat(params), flat(p2)
    np.testing.assert_array_equal(np.concatenate([flat(p1)[k].ravel() for k in before]),
                                  np.concatenate([before[k].ravel() for k in before]))  # warmup step: LR 0
    for key in before:
        if key in ROUTING:
            assert np.abs(after[key] - before[key]).max() > 1e-3, f"routing parameter {key} did not move"
        else:
            np.testing.assert_array_equal(after[key], before[key], err_msg=f"model parameter {key} moved with lr=0")
    want = expected_second_step(params, grads, lambda k: 1e-2 if k in ROUTING else 0.0, cfg.optim.weight_decay,
                                is_matrix_name, cfg.optim.clip_norm, cfg.optim.eps)
    assert_close_tree(after, want, 1e-2, "lr=0")


def test_routing_lr_zero_freezes_routing_parameters(model_and_params, grads):
    cfg, _, params = model_and_params
    cfg = configured(cfg, lr=1e-2, lr_min=1e-3, routing_lr=0.0)
    _, p2, _ = two_identical_steps(cfg, params, grads)
    before, after = flat(params), flat(p2)
    for key in before:
        if key in ROUTING:
            np.testing.assert_array_equal(after[key], before[key], err_msg=f"routing parameter {key} moved with routing_lr=0")
        else:
            assert np.abs(after[key] - before[key]).max() > 1e-3, f"model parameter {key} did not move"
    want = expected_second_step(params, grads, lambda k: 0.0 if k in ROUTING else 1e-2, cfg.optim.weight_decay,
                                is_matrix_name, cfg.optim.clip_norm, cfg.optim.eps)
    assert_close_tree(after, want, 1e-2, "routing_lr=0")


def test_group_learning_rates_and_decay(model_and_params, grads):
    cfg, _, params = model_and_params
    cfg = configured(cfg, lr=2e-3, lr_min=2e-4, routing_lr=3e-2, weight_decay=0.5)
    _, p2, _ = two_identical_steps(cfg, params, grads)
    want = expected_second_step(params, grads, lambda k: 3e-2 if k in ROUTING else 2e-3, 0.5, is_matrix_name,
                                cfg.optim.clip_norm, cfg.optim.eps)
    assert_close_tree(flat(p2), want, 2e-3, "two groups")


@pytest.mark.parametrize(
    "mask,scan", [("matrices", True), ("matrices", False), ("all", True), ("none", True)],
    ids=["matrices-scanned", "matrices-unrolled", "all", "none"],
)
def test_weight_decay_mask(mask, scan):
    """With zero gradients only weight decay moves parameters: p -> p * (1 - lr * wd) where decayed."""
    cfg = debug_config()
    cfg.model.scan_layers = scan
    cfg = configured(cfg, lr=1e-2, lr_min=1e-3, routing_lr=1e-2, weight_decay=0.5, weight_decay_mask=mask)
    model = Transformer(cfg.model)
    params = flax.linen.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32)))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) + 2.0, jnp.float32), params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    _, p2, _ = two_identical_steps(cfg, params, zeros)
    before, after = flat(params), flat(p2)
    decayed = {"matrices": is_matrix_name, "all": lambda k: True, "none": lambda k: False}[mask]
    n_decayed = 0
    for key in before:
        if decayed(key):
            n_decayed += 1
            np.testing.assert_allclose(after[key], before[key] * (1 - 1e-2 * 0.5), rtol=1e-6, err_msg=key)
        else:
            np.testing.assert_array_equal(after[key], before[key], err_msg=f"{key} decayed under mask {mask!r}")
    if mask == "matrices":
        assert n_decayed == 8 if scan else n_decayed == 1 + 3 * 7  # embedding + q,k,v,o,gate,up,down per layer


def test_weight_decay_mask_invalid(model_and_params):
    cfg, _, params = model_and_params
    cfg = configured(cfg, weight_decay_mask="vectors")
    with pytest.raises(ValueError, match="weight_decay_mask"):
        make_optimizer(cfg, params)


# ----------------------------------------------------------------------------- gradient accumulation


def test_accumulated_gradient_equals_full_batch_gradient(model_and_params, batch8, reference):
    """4 micro-batches of 2 under SGD with LR 1: new params = params - (gradient of the whole batch of 8)."""
    _, model, params = model_and_params
    ref_loss, ref_grads = reference
    tx = optax.sgd(1.0)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    new_state, out = jax.jit(make_train_step(model, tx, 4))(state, batch8)
    assert int(new_state["step"]) == 1
    assert float(out["loss"]) == pytest.approx(ref_loss, abs=1e-5)
    want_norm = math.sqrt(sum(float((v**2).sum()) for v in flat(ref_grads).values()))
    assert float(out["grad_norm"]) == pytest.approx(want_norm, rel=1e-5)
    before, got, g = flat(params), flat(new_state["params"]), flat(ref_grads)
    for key in before:
        np.testing.assert_allclose(before[key] - got[key], g[key], atol=1e-5, rtol=1e-4, err_msg=key)


def test_accumulation_with_the_real_optimizer(model_and_params):
    """4 micro-batches of 2 vs one batch of 8 with the experiment's AdamW: equal losses and params over 3 steps
    (the first is at warmup LR 0, the next two move the params)."""
    cfg, _, _ = model_and_params
    cfg = cfg.copy_and_resolve_references()
    cfg.optim.update(warmup_steps=1, lr=1e-3)
    model, tx, *_ = build(cfg)
    init = jax.jit(make_init(model, tx, SEQ))
    start = init(0)
    states = {m: jax.tree.map(jnp.array, start) for m in (1, 4)}  # copies: the steps donate nothing, but be safe
    steps = {m: jax.jit(make_train_step(model, tx, m)) for m in (1, 4)}
    for i in range(3):
        batch = random_tokens(10 + i, (8, SEQ + 1))
        outs = {}
        for m in (1, 4):
            states[m], outs[m] = steps[m](states[m], batch)
        assert float(outs[4]["loss"]) == pytest.approx(float(outs[1]["loss"]), abs=1e-5)
        assert float(outs[4]["grad_norm"]) == pytest.approx(float(outs[1]["grad_norm"]), rel=1e-4)
    a, b, first = flat(states[1]["params"]), flat(states[4]["params"]), flat(start["params"])
    assert a.keys() == b.keys()
    assert all(np.abs(a[k] - first[k]).max() > 1e-4 for k in a if k not in ROUTING), "some model parameter never moved"
    for key in a:
        np.testing.assert_allclose(b[key], a[key], atol=1e-5, err_msg=key)


@pytest.mark.parametrize("mode, scan, routing_lr", [("delta_block", False, None), ("delta", True, 0.03),
                                                    ("baseline", False, None)])
def test_abstract_state_is_the_shape_of_the_initial_state(mode, scan, routing_lr):
    """`abstract_state` (from the parameters' shapes, no second trace) has the tree, shapes and dtypes that
    `jax.eval_shape` of the initialiser itself gives: the optimizer's groups and moments included."""
    cfg = debug_config(mode)
    cfg.model.scan_layers = scan
    if routing_lr is not None:
        cfg.optim.routing_lr = routing_lr
    model, tx, _, boxed = build(cfg)
    want = jax.eval_shape(make_init(model, tx, cfg.data.seq_len), 0)
    got = abstract_state(boxed, tx)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), got, want)) == \
        [True] * len(jax.tree.leaves(want))
