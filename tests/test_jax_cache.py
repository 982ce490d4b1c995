"""The tests' shared compilation cache (tests/jax_cache.py) stays writable and small: an entry without
its access-time file makes JAX's size-bounded cache refuse every later write until it is removed, and
every write scans the whole folder."""

import os
import time

import pytest
from jax._src.lru_cache import LRUCache

from jax_cache import tidy_cache


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
