"""Fused depth routing (softmax over sources with an input-independent query); see api.py."""

from kernels_pallas.depth_route.api import IMPLEMENTATIONS, depth_route

__all__ = ["IMPLEMENTATIONS", "depth_route"]
