"""A persistent XLA compilation cache shared by the tests and the commands they run.

`SETTINGS` turns it on (tests/conftest.py puts them in pytest's environment before JAX is imported);
`ENV` is the environment for a `python -m deltares...` subprocess: CPU only, the repository importable,
the same cache. `release_compiled_programs` keeps a long-lived test process under the kernel's limit on
memory mappings, which loading a program from the cache does not survive reaching."""

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("DELTARES_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "deltares-test-jax-cache"))
# A size bound turns on the cache's file lock around every read and write: without it a process can read an
# entry another is still writing (JAX writes in place). With it, every write first scans the whole folder
# (its eviction check): programs that compile in under 0.2 s (thousands of eager single ops) are not worth
# one. At 0.2 s rather than 1 s, three in-process test files took 173 s instead of 226 s warm (0.05 s: 168 s).
SETTINGS = {
    "JAX_COMPILATION_CACHE_DIR": CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(64 * 2**30),
}


def tidy_cache(folder: str = CACHE, max_age_days: float = 3.0) -> int:
    """Removes the entries JAX's eviction check cannot read, and those unused for `max_age_days`; returns
    how many. That check runs on every write, reads each entry's access-time file and fails on an entry
    without one (written by a process without the size bound, or killed between its two files): each
    later write would then fail too, silently. It also scans the whole folder, so old entries make every
    write slower. Under JAX's own lock."""
    import filelock  # JAX's size bound needs it installed

    if not os.path.isdir(folder):
        return 0
    oldest, removed = time.time_ns() - int(max_age_days * 86400e9), 0
    with filelock.FileLock(os.path.join(folder, ".lockfile"), timeout=60):
        for name in os.listdir(folder):
            if not name.endswith("-cache"):
                continue
            entry, atime = os.path.join(folder, name), os.path.join(folder, f"{name[:-len('-cache')]}-atime")
            try:
                with open(atime, "rb") as f:
                    keep = int.from_bytes(f.read(), "little") >= oldest
            except OSError:
                keep = False
            if not keep:
                for path in (entry, atime):
                    try:
                        os.remove(path)
                    except FileNotFoundError:
                        pass
                removed += 1
    return removed


tidy_cache()


def memory_maps() -> int:
    """How many memory mappings this process holds (Linux's /proc/self/maps; 0 where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def map_limit() -> int:
    """The kernel's limit on a process's memory mappings (vm.max_map_count; 65530 unless raised)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def release_compiled_programs() -> int:
    """Frees the programs JAX holds compiled in this process; returns the memory mappings left.

    A CPU program holds a few mappings per kernel for its code (about 40 for a small model's step), and
    JAX keeps every program it compiled or loaded while its function lives. A process at the kernel's
    limit segfaults loading the next program from the persistent cache (XLA does not check the mapping
    it asks for): a pytest worker that runs half the suite got there, and crashed in
    `get_executable_and_time`, until the tests freed their programs after each module."""
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    return memory_maps()


ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    **SETTINGS,
)


def run_module(module, *args, timeout=600):
    """`python -m module *args` from the repository root: CPU only, offline, the shared cache."""
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)
