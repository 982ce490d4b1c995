"""Optimizer: AdamW with linear warmup then cosine decay, global-norm clipping, and a
separate peak learning rate for the routing parameters.

Routing parameters are those of every `*_router` module (pseudo-queries and
key-norm gains; later also gates and null sources). `config.optim`:
`lr, lr_min, routing_lr (None = lr), warmup_steps, b1, b2, eps, weight_decay,
weight_decay_mask ('matrices' | 'all' | 'none'), clip_norm`, and `config.train.steps`.
"""

from __future__ import annotations

import jax
import optax

ROUTING_MODULE_SUFFIX = "_router"
DECAY_MASKS = ("matrices", "all", "none")


def _path_names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def is_routing_param(path) -> bool:
    return any(name.endswith(ROUTING_MODULE_SUFFIX) for name in _path_names(path))


def param_labels(params):
    """'routing' or 'model' for every leaf of `params`."""
    return jax.tree_util.tree_map_with_path(lambda p, _: "routing" if is_routing_param(p) else "model", params)


def _decay_mask(params, which: str, scanned: bool):
    if which not in DECAY_MASKS:
        raise ValueError(f"config.optim.weight_decay_mask={which!r} is invalid: allowed: {', '.join(DECAY_MASKS)}")
    # Under nn.scan every layer parameter has a leading layer axis.
    def matrix(path, x):
        layered = scanned and "layers" in _path_names(path)
        return x.ndim - int(layered) >= 2

    if which == "all":
        return jax.tree.map(lambda _: True, params)
    if which == "none":
        return jax.tree.map(lambda _: False, params)
    return jax.tree_util.tree_map_with_path(matrix, params)


def schedule(peak: float, lr_min: float, warmup: int, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `peak`, then cosine to `lr_min` at `steps`."""
    if steps <= warmup:
        return optax.linear_schedule(0.0, peak, max(warmup, 1))
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1), steps, end_value=lr_min)


def make_optimizer(cfg, params, scanned: bool = True) -> tuple[optax.GradientTransformation, dict]:
    """The optimizer for `params` and the learning-rate schedule of each group."""
    opt, steps = cfg.optim, cfg.train.steps
    lr_min_ratio = opt.lr_min / opt.lr if opt.lr else 0.0
    routing_lr = opt.routing_lr if opt.routing_lr is not None else opt.lr
    schedules = {
        "model": schedule(opt.lr, opt.lr_min, opt.warmup_steps, steps),
        "routing": schedule(routing_lr, routing_lr * lr_min_ratio, opt.warmup_steps, steps),
    }
    _decay_mask(params, opt.weight_decay_mask, scanned)  # validates the option now

    def adamw(lr):
        mask = lambda p: _decay_mask(p, opt.weight_decay_mask, scanned)  # noqa: E731 (sees its group's subtree)
        return optax.adamw(lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=mask)

    tx = optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.multi_transform({group: adamw(s) for group, s in schedules.items()}, param_labels(params)),
    )
    return tx, schedules
