"""How the kernel tests run a Pallas kernel: compiled for the device when the tests run on the
kernel's own platform (on a GPU machine: `JAX_PLATFORMS=cuda python -m pytest ... -k pallas_gpu`),
else in the Pallas interpreter (the CPU, as in CI). The assertions are the same either way. Tests
that turn warnings into errors (no silent fallback to xla) turn UserWarning only: on a GPU, jax
0.11 and later warn on every Pallas Triton lowering (a DeprecationWarning)."""

import jax
from jax.experimental.pallas import tpu as pltpu

PLATFORM_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def on_device(impl: str) -> bool:
    """True where `impl` (a kernel) compiles for the default backend rather than interpreting."""
    return PLATFORM_OF.get(impl) == jax.default_backend()


def interpret(impl: str, tpu_simulator: bool = False):
    """The `interpret` argument for kernel `impl` ("xla": False). `tpu_simulator`: the TPU interpret
    mode (simulated VMEM, DMAs and the grid's pipelining) instead of the plain interpreter."""
    if impl == "xla" or on_device(impl):
        return False
    return pltpu.InterpretParams() if tpu_simulator and impl == "pallas_tpu" else True
