"""Fused depth routing (softmax over sources with an input-independent query), and its
two-phase first pass (K queries over the same sources, one read); see api.py."""

from kernels_pallas.depth_route.api import IMPLEMENTATIONS, depth_route, route_prefix, route_prefix_grad_into

__all__ = ["IMPLEMENTATIONS", "depth_route", "route_prefix", "route_prefix_grad_into"]
