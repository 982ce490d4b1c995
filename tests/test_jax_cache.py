"""The tests' shared compilation cache (tests/jax_cache.py) stays writable: an entry without its
access-time file makes JAX's size-bounded cache refuse every later write, until repaired."""

import os

import pytest
from jax._src.lru_cache import LRUCache

from jax_cache import repair_cache


def test_an_entry_without_its_access_time_blocks_writes_until_repaired(tmp_path):
    cache = LRUCache(str(tmp_path), max_size=2**30)
    cache.put("first", b"1")
    os.remove(tmp_path / "first-atime")  # as a process without the size bound, or one killed mid-write, leaves it
    with pytest.raises(FileNotFoundError):
        cache.put("second", b"2")
    assert cache.get("second") is None
    assert repair_cache(str(tmp_path)) == 1
    cache.put("second", b"2")
    assert cache.get("second") == b"2" and cache.get("first") == b"1"
    assert repair_cache(str(tmp_path)) == 0
