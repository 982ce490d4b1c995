"""Tolerances for comparing float32 computations of the same math, computed from the computation instead of
copied from what one machine gave.

Two float32 implementations of the same function differ by their rounding errors: where each sums, fuses
and orders its operations (XLA's choices, the CPU's vector width, the number of threads) decides which
rounding errors they make, not the math. How far those errors move the result is the function's own
property: its sensitivity to relative perturbations of one float32 unit roundoff (`EPS32`, 2^-24). It is
measured here, in the test, by moving every floating input by one rounding at random (`sensitivity`): the
result's change is float32's eps times the computation's condition, times its magnitude.

A rounding at any stage of a layered computation (a sublayer, the embedding, the head) perturbs that stage's
output by about EPS32 relatively, which the rest of the computation amplifies as it amplifies a perturbation of
its inputs; so two implementations of `stages` such stages each (the count is the caller's, from the model's
shape) differ by at most about 2 x stages x the sensitivity. `tolerance` returns that bound per output leaf,
and never less than what rounding the result itself costs (stages x EPS32 x its magnitude).

So an ill-conditioned computation (a block partial read as the difference of two cumulative sums, |h| / |p|
up to ten: `block_attnres`) gets a wider bound than a well-conditioned one, on every machine alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EPS32 = float(np.finfo(np.float32).eps) / 2  # float32's unit roundoff, 2^-24


def _floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def sensitivity(fn, *args, draws: int = 2, seed: int = 0):
    """(fn(*args), per leaf of it the largest change (max abs) when every floating input element moves to a
    neighbouring float of its dtype (np.nextafter, up or down at random: a relative change of 2^-24 to 2^-23
    in float32, what one rounding does), over `draws` draws). `fn` runs as given: pass it jitted where
    compiling once costs less than running it eagerly `draws` + 1 times (a gradient, a repeated call)."""
    value = fn(*args)
    base = jax.tree.map(np.asarray, value)
    worst = jax.tree.map(lambda b: 0.0, base)
    leaves, tree = jax.tree.flatten(args)
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        moved = []
        for x in leaves:
            if _floating(x):
                x = np.asarray(x)
                x = np.nextafter(x, np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(x.dtype))
            moved.append(x)
        out = fn(*jax.tree.unflatten(tree, moved))
        worst = jax.tree.map(lambda w, o, b: max(w, float(np.abs(np.asarray(o, np.float64) - b).max(initial=0.0))),
                             worst, out, base)
    return value, worst


def with_tolerance(fn, *args, stages: int, draws: int = 2):
    """(fn(*args), per leaf of it the absolute tolerance between two float32 implementations of `fn`, each of
    `stages` rounding stages: 2 x stages x max(`sensitivity`, EPS32 x the leaf's largest magnitude))."""
    value, worst = sensitivity(fn, *args, draws=draws)
    return value, jax.tree.map(
        lambda s, b: 2.0 * stages * max(s, EPS32 * float(np.abs(np.asarray(b)).max(initial=0.0))), worst, value)


def tolerance(fn, *args, stages: int, draws: int = 2):
    """The tolerance of `with_tolerance` alone."""
    return with_tolerance(fn, *args, stages=stages, draws=draws)[1]


def assert_close(got, want, tol, what: str = "") -> None:
    """Every leaf of `got` within its leaf of `tol` (absolute) of `want`'s (pytrees of the same structure)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, g), w, t in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                               jax.tree.leaves(tol)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=t, rtol=0,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)} (tolerance {t:.3g})")
