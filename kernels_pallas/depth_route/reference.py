"""The "xla" implementation: the pure-jnp oracle `deltares.nn.routing.depth_route` (XLA autodiff)."""

from __future__ import annotations

from deltares.nn import routing


def depth_route(sources, valid, query, gain, residual=None, *, eps=routing.NORM_EPS):
    """`deltares.nn.routing.depth_route`, returning only the routed output."""
    return routing.depth_route(sources, valid, query, gain, residual, eps=eps)
