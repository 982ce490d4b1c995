"""Compile-only NVIDIA GPU devices (`python -m deltares.aot --gpu h100|h200[:N]`): no GPU needed.

XLA's CUDA compiler is the PJRT plugin of JAX's CUDA build (the wheel `jax-cuda12-pjrt`, which
`jax[cuda12]` installs). Given a description of the GPU, XLA's `GpuTargetConfigProto` in text
format (shipped in `deltares/training/gpu_targets/NAME.txtpb`, one per supported GPU), it makes
compile-only devices (`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`)
and compiles for them on a CPU-only machine: GPU code, Triton and Mosaic GPU (Pallas) kernels
included, and `compiled.memory_analysis()`. The plugin's topology string is
"<partitions>x<hosts per partition>x<devices per host>"; `NAME:N` asks for "1x1xN", N GPUs of one
host, as one process of the trainer sees a node's GPUs: a program sharded over them compiles with
its collectives (NCCL) and each device's own memory.

The compiler needs, besides the plugin, CUDA's `ptxas` and `libdevice` (XLA and Triton turn their
PTX into machine code with it; without libdevice XLA fails with "libdevice not found") and, for
Mosaic GPU kernels, the runtime and lowering of `jax-cuda12-plugin`. All of them install from
wheels, with no CUDA toolkit on the machine: requirements-cuda-compiler.txt (`jax-cuda12-pjrt`,
`jax-cuda12-plugin`, `nvidia-cuda-nvcc-cu12` of the CUDA version the plugin was built with).

Where they live: wherever `jax` finds them (`pip install "jax[cuda12]==<jax version>"`, or
`pip install "deltares[gpu]"`), or in a folder of its own, out of the way of every other JAX
program (a plugin installed beside jax is loaded by every JAX process, and on a machine without
a GPU it prints CUDA warnings there): `pip install --no-deps --target DIR -r
requirements-cuda-compiler.txt`, then DIR in $DELTARES_CUDA_COMPILER, or DIR = `<virtual
env>/cuda-compiler`, where .ci/run puts it. Only this module adds that folder to `sys.path`, and
it points every compiler at the folder's CUDA (`use_cuda_toolkit`): XLA's `xla_gpu_cuda_data_dir`
(jax's `cuda_path`), Mosaic GPU's MOSAIC_GPU_CUDA_ROOT and runtime library, and the front of PATH,
so that nothing of a CUDA toolkit the machine may have is read.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys

import jax

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
GPUS = ("h100", "h200")  # deltares/training/gpu_targets/<name>.txtpb
COMPILER_ENV = "DELTARES_CUDA_COMPILER"


class CudaCompilerMissing(RuntimeError):
    """The CUDA PJRT plugin (XLA's GPU compiler) is not installed where JAX or this module looks."""


def target_config(name: str) -> str:
    """The GpuTargetConfigProto text of GPU `name` ("h100", "h200"); ValueError for another name."""
    key = name.strip().lower()
    if key not in GPUS:
        raise ValueError(f"--gpu={name!r} is not a GPU of deltares/training/gpu_targets; choose one of {', '.join(GPUS)}")
    with open(os.path.join(TARGETS_DIR, f"{key}.txtpb"), encoding="utf-8") as f:
        return f.read()


MAX_GPUS = 256  # NAME:N is the GPUs of one node (one process), as jax's CUDA topology 1x1xN


def parse_gpu(spec: str) -> tuple[str, int]:
    """'h100' -> ('h100', 1), 'h200:8' -> ('h200', 8): a GPU of deltares/training/gpu_targets and how many;
    ValueError saying the form for anything else."""
    name, colon, count = spec.strip().lower().partition(":")
    target_config(name)  # ValueError for a GPU not shipped
    if not colon:
        return name, 1
    if not count.isdigit() or not 1 <= int(count) <= MAX_GPUS:
        raise ValueError(f"--gpu={spec!r}: expected NAME or NAME:N with N a number of GPUs of one node from 1 to "
                         f"{MAX_GPUS}, e.g. h100:8")
    return name, int(count)


def device_memory_bytes(name: str) -> int:
    """The GPU's memory as its target config states it (`device_memory_size`)."""
    match = re.search(r"^\s*device_memory_size:\s*(\d+)", target_config(name), re.M)
    if not match:
        raise ValueError(f"deltares/training/gpu_targets/{name}.txtpb has no device_memory_size")
    return int(match.group(1))


def compiler_dir() -> str:
    """The folder holding the plugin when it is kept apart: $DELTARES_CUDA_COMPILER, else
    `<sys.prefix>/cuda-compiler` (a virtual environment's own folder)."""
    return os.environ.get(COMPILER_ENV) or os.path.join(sys.prefix, "cuda-compiler")


def _install_hint() -> str:
    version = jax.__version__
    return (
        f'pip install "jax[cuda12]=={version}" (or, kept out of other JAX programs\' way, '
        f'pip install --no-deps --target {compiler_dir()} -r requirements-cuda-compiler.txt, for jax {version}); '
        "and run with JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (deltares.aot sets both where they are unset)"
    )


SYSTEM_LIBDEVICE = "/usr/local/cuda/nvvm/libdevice/libdevice.10.bc"  # where XLA looks last
CUDA_TOOLKIT = os.path.join("nvidia", "cuda_nvcc")  # nvidia-cuda-nvcc-cu12's folder: bin/ptxas, nvvm/libdevice
MOSAIC_RUNTIME = os.path.join("jax_cuda12_plugin", "libmosaic_gpu_runtime.so")  # jax-cuda12-plugin's


def cuda_toolkit(directory: str) -> str | None:
    """The CUDA compiler files (ptxas, libdevice) installed from wheels in `directory`, or None."""
    path = os.path.join(directory, CUDA_TOOLKIT)
    files = (("bin", "ptxas"), ("nvvm", "libdevice", "libdevice.10.bc"))
    ok = all(os.path.isfile(os.path.join(path, *f)) for f in files)
    return path if ok else None


def use_cuda_toolkit(directory: str) -> bool:
    """Points XLA, Triton and Mosaic GPU at the CUDA of folder `directory` (wheels: ptxas, libdevice,
    Mosaic GPU's runtime) rather than at a toolkit the machine may have: jax's `cuda_path` (every compile
    sets XLA's `xla_gpu_cuda_data_dir` from it, jax 0.10 to 0.12), MOSAIC_GPU_CUDA_ROOT and
    MOSAIC_GPU_RUNTIME_LIB_PATH (Mosaic GPU), and the folder's bin first on PATH (where a compiler looks
    for ptxas by name). Whether the folder has them."""
    from jax._src import lib

    path = cuda_toolkit(directory)
    if path is None:
        return False
    lib.cuda_path = path
    os.environ["CUDA_ROOT"] = path  # what jax reads at start (jax._src.lib._cuda_path), for any later process
    os.environ["MOSAIC_GPU_CUDA_ROOT"] = path
    runtime = os.path.join(directory, MOSAIC_RUNTIME)
    if os.path.isfile(runtime):
        os.environ["MOSAIC_GPU_RUNTIME_LIB_PATH"] = runtime
    mosaic = sys.modules.get("jax.experimental.mosaic.gpu.core")
    if mosaic is not None:  # imported before: it set its own default
        mosaic.cuda_root = path
    bin_dir = os.path.join(path, "bin")
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    return True


def _as_compiler() -> None:
    """The CUDA plugin used as a compiler only: JAX's backends stay on the CPU (no GPU is sought)
    and the plugin skips its check of the CUDA libraries of a GPU machine. Values already set are
    kept; JAX_PLATFORMS only matters before JAX starts its backends."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
    # A compile-only executable is written to JAX's persistent compilation cache but cannot be read
    # back (that needs a GPU client): every later compile would warn. Off for this process (where
    # JAX has not used the cache yet; it decides once).
    jax.config.update("jax_enable_compilation_cache", False)
    # Without jax-cuda12-plugin (custom calls of jax's own GPU ops: not needed to compile the train
    # step, Triton kernels included) the plugin warns "cuda_plugin_extension is not found".
    logging.getLogger("jax_plugins.xla_cuda12").setLevel(logging.ERROR)
    directory = compiler_dir()
    if os.path.isdir(os.path.join(directory, "jax_plugins")):
        if directory not in sys.path:
            sys.path.append(directory)  # jax_plugins is a namespace package: its path follows sys.path
        use_cuda_toolkit(directory)


def _register_plugin_late() -> bool:
    """JAX discovers plugins once, when it starts its backends; a plugin made importable after that
    (the folder above) is initialised here. Whether there was one."""
    try:
        module = importlib.import_module("jax_plugins.xla_cuda12")
    except ImportError:
        return False
    module.initialize()
    return True


def _version(config: str, message: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version message (`dnn_version_info`, `cuda_compute_capability`) of a target config."""
    m = re.search(rf"{message}\s*{{([^}}]*)}}", config)
    fields = dict(re.findall(r"(\w+):\s*(\d+)", m.group(1))) if m else {}
    return int(fields.get("major", 0)), int(fields.get("minor", 0)), int(fields.get("patch", 0))


def _cudnn_of_target(config: str) -> None:
    """Let `jax.nn.dot_product_attention(implementation="cudnn")` (the "cudnn" and "auto" attention) trace
    for the target GPU: JAX asks the local CUDA install for cuDNN's version and the local GPU for its
    compute capability, and a CPU machine has neither. The target config states both; XLA's CUDA
    compiler then compiles the fused attention as it does on the GPU."""
    import jax._src.cudnn.fused_attention_stablehlo as fused

    major, minor, patch = _version(config, "dnn_version_info")
    capability = _version(config, "cuda_compute_capability")[:2]

    def at_least(text: str) -> bool:
        return tuple(int(x) for x in text.split(".")) <= capability

    fused.check_cudnn_version = lambda: major * 10000 + minor * 100 + patch
    fused.check_compute_capability = at_least
    fused.is_cuda_compute_capability_equal = lambda text: tuple(int(x) for x in text.split(".")) == capability


def gpu_devices(name: str, count: int = 1) -> list:
    """Compile-only devices of `count` GPUs `name` ("h100" or "h200") of one host, for a `jax.sharding.Mesh`.
    ValueError for another name; CudaCompilerMissing (saying what to install) without the plugin.
    In this process cuDNN's fused attention then traces for that GPU (`_cudnn_of_target`)."""
    config = target_config(name)
    _as_compiler()
    _cudnn_of_target(config)
    from jax.experimental import topologies

    def make():
        return list(topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{count}").devices)

    devices = None
    try:
        devices = make()
    except NotImplementedError:  # "topology not implemented for cuda": the plugin was not discovered
        if _register_plugin_late():
            try:
                devices = make()
            except NotImplementedError:
                pass
    if devices is None:
        raise CudaCompilerMissing(f"--gpu={name}: XLA's CUDA compiler is not installed: {_install_hint()}")
    from jax._src import lib

    if lib.cuda_path is None and not os.path.isfile(SYSTEM_LIBDEVICE):
        raise CudaCompilerMissing(f"--gpu={name}: XLA's CUDA compiler has no ptxas and libdevice (the wheel "
                                  f"nvidia-cuda-nvcc-cu12 of requirements-cuda-compiler.txt): {_install_hint()}")
    return devices
