"""A persistent XLA compilation cache shared by the slow test modules and their subprocesses.

`ENV` is the environment for a `python -m deltares...` subprocess: CPU only, the repository
importable, the same cache."""

import os
import subprocess
import sys
import tempfile

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("DELTARES_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "deltares-test-jax-cache"))
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
# A size bound turns on the cache's file lock around every read and write: without it a process can read an
# entry another is still writing (JAX writes in place) and crash deserializing it.
CACHE_MAX_SIZE = 64 * 2**30
jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_SIZE)

ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    JAX_COMPILATION_CACHE_DIR=CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    JAX_COMPILATION_CACHE_MAX_SIZE=str(CACHE_MAX_SIZE),
)


def run_module(module, *args, timeout=600):
    """`python -m module *args` from the repository root: CPU only, offline, the shared cache."""
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)
