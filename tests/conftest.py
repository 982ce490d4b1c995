"""Shared test setup: the repository root importable, JAX on the CPU with the shared compilation cache.

The tests compile many tiny programs; XLA's CPU backend optimisation level 0 roughly
halves their compile time and does not change what they compute (no fast-math either way).
"""

import os
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.jax_cache import SETTINGS, map_limit, release_compiled_programs  # noqa: E402

os.environ.update(SETTINGS)  # the persistent compilation cache, here and in the commands the tests run

TINY_HF = os.path.join(ROOT, "tests", "fixtures", "qwen3_tiny")  # a tiny Qwen3 written by transformers

# Test files by how long they take on 2 cores, longest first (their tests' seconds summed, both workers
# busy, 2026-12-06: 1355 s for the first, about 80 s for the last); the rest follow in name order. With
# `-n N` each file runs whole on one worker (`pytest_xdist_make_scheduler`), in this order: a file's module
# fixtures (a subprocess of minutes in several) run once, and no long file starts last.
LONGEST_FIRST = ("test_documented_commands.py", "test_aot.py", "test_train.py", "test_faults.py", "test_generate.py",
                 "test_configs.py", "test_two_phase.py", "test_aot_gpu.py", "test_model.py", "test_sharding.py",
                 "test_depth.py", "test_slurm.py", "test_hf.py", "test_depth_route_kernel.py", "test_multihost.py",
                 "test_harness.py", "test_own_model.py", "test_step_time.py", "test_analysis_tools.py",
                 "test_layer_patterns.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: name order otherwise


def pytest_configure(config):
    """A crashed worker stops the run (pytest-xdist's file scheduler would hand the crashing test to each
    replacement worker in turn, and once hung waiting for one); `--max-worker-restart N` overrides. One
    warning filter (below)."""
    if getattr(config.option, "maxworkerrestart", "unset") is None:
        config.option.maxworkerrestart = "0"
    # A restore that fails on purpose (tests/test_eval.py) leaves orbax's read coroutines to the garbage
    # collector, which finalizes them during whatever test runs later: dozens of warnings in its name.
    config.addinivalue_line("filterwarnings", "ignore:Exception ignored in. <coroutine object "
                            "_read_array_index_and_device_put:pytest.PytestUnraisableExceptionWarning")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole files, in collection order (not reordered by their number of tests)."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file, JAX's compiled programs are freed: a worker that kept them all would reach
    the kernel's limit on memory mappings and crash loading a program from the cache (tests/jax_cache.py).
    A file that leaves half the limit behind even so is an error here, not a crash later."""
    yield
    left, limit = release_compiled_programs(), map_limit()
    if left > limit // 2:
        raise RuntimeError(f"this test process holds {left} memory mappings after freeing JAX's programs "
                           f"(the limit is {limit}): something else keeps them")


@pytest.fixture(scope="module")
def converted_run_dir(tmp_path_factory):
    """A deltares run directory holding the tiny Qwen3 converted to delta_block (exact)."""
    from deltares.convert import hf_to_workdir

    path = tmp_path_factory.mktemp("gen") / "run"
    hf_to_workdir(TINY_HF, str(path), {"mode": "delta_block", "block_layers": 2})
    return str(path)


class CountingBucket:
    """`gs://` served from a local directory through fsspec, counting the bytes written to it."""

    def __init__(self, root):
        from fake_bucket import local_bucket

        self.root, self.written = root, 0
        self.filesystem = local_bucket(root, on_write=self._count)

    def _count(self, n: int) -> None:
        self.written += n


@pytest.fixture
def fake_bucket(tmp_path, monkeypatch):
    """`gs://` served from tmp_path/bucket through fsspec (what gcsfs does for real buckets), with
    the built-in corpus cached under tmp_path/cache; yields the CountingBucket."""
    import importlib

    from etils.epath import backend

    fake = CountingBucket(str(tmp_path / "bucket"))
    os.makedirs(fake.root)
    for name in ("gs", "gcs"):
        monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, name, fake.filesystem)
    backend.fsspec_backend._get_filesystem.cache_clear()
    monkeypatch.setenv("DELTARES_CACHE", str(tmp_path / "cache"))
    yield fake
    backend.fsspec_backend._get_filesystem.cache_clear()


# The debug runs shared by tests/test_train.py and tests/test_faults.py (helpers: tests/debug_runs.py).


@pytest.fixture(scope="session")
def builtin_dataset(tmp_path_factory):
    """The built-in corpus with the bytes tokenizer, prepared as `train` prepares it for 'builtin'."""
    from deltares.data.prepare import prepare

    out = tmp_path_factory.mktemp("builtin") / "dataset"
    prepare("builtin", "bytes", str(out), val_fraction=0.05, progress=False)
    return out


@pytest.fixture(scope="session")
def reference(builtin_dataset, tmp_path_factory):
    """An uninterrupted 30-step run logging every step, checkpointing every 4 (in-process)."""
    from debug_runs import RESUME_OVERRIDES, STEPS, config_with, read_metrics
    from deltares.train import train

    workdir = tmp_path_factory.mktemp("reference")
    result = train(config_with(builtin_dataset, **RESUME_OVERRIDES), str(workdir))
    records = read_metrics(str(workdir))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return dict(workdir=str(workdir), result=result, loss={r["step"]: r["loss"] for r in records})
