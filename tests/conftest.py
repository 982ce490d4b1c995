"""Shared test setup: make the repository root importable and keep JAX on the CPU.

The tests compile many tiny programs; XLA's CPU backend optimisation level 0 roughly
halves their compile time and does not change what they compute (no fast-math either way).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
