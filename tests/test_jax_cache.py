"""The tests' shared compilation cache (tests/jax_cache.py) stays writable and small: an entry without
its access-time file makes JAX's size-bounded cache refuse every later write until it is removed, and
every write scans the whole folder. A test process frees its compiled programs, and their memory
mappings, when asked."""

import os
import time

import pytest
from jax._src.lru_cache import LRUCache

from jax_cache import memory_maps, release_compiled_programs, tidy_cache


def test_an_entry_without_its_access_time_blocks_writes_until_removed(tmp_path):
    cache = LRUCache(str(tmp_path), max_size=2**30)
    cache.put("first", b"1")
    os.remove(tmp_path / "first-atime")  # as a process without the size bound, or one killed mid-write, leaves it
    with pytest.raises(FileNotFoundError):
        cache.put("second", b"2")
    assert cache.get("second") is None
    assert tidy_cache(str(tmp_path)) == 1
    cache.put("second", b"2")
    assert cache.get("second") == b"2" and cache.get("first") is None
    assert tidy_cache(str(tmp_path)) == 0


def test_entries_unused_for_days_are_removed_and_used_ones_kept(tmp_path):
    cache = LRUCache(str(tmp_path), max_size=2**30)
    for key in ("old", "recent"):
        cache.put(key, key.encode())
    (tmp_path / "old-atime").write_bytes((time.time_ns() - int(4 * 86400e9)).to_bytes(8, "little"))
    assert tidy_cache(str(tmp_path), max_age_days=3) == 1
    assert sorted(os.listdir(tmp_path)) == [".lockfile", "recent-atime", "recent-cache"]
    assert cache.get("recent") == b"recent"


@pytest.mark.skipif(memory_maps() == 0, reason="counts the mappings in /proc/self/maps (Linux)")
def test_compiled_programs_hold_memory_mappings_until_released():
    import jax
    import jax.numpy as jnp

    def chain(a, k):
        for j in range(8):
            a = jnp.cumsum(jnp.tanh(a @ a.T + k * j), axis=0)
        return a

    functions = [jax.jit(lambda a, k=k: chain(a, k)) for k in range(20)]  # alive to the end: JAX keeps theirs
    x = jnp.ones((32, 32))
    release_compiled_programs()
    before = memory_maps()
    for f in functions:
        f(x).block_until_ready()
    compiled = memory_maps()
    assert compiled - before > 200, (before, compiled)  # about 38 each here
    assert release_compiled_programs() < before + 50, (before, compiled, memory_maps())
    assert float(functions[0](x)[0, 0]) == float(chain(x, 0)[0, 0])  # still callable: compiled again
