"""deltares: depth routing (Delta Attention Residuals and the schemes it is compared with) in JAX/Flax."""

import glob as _glob
import os as _os


def _quiet_libtpu_off_tpu() -> None:
    """`libtpu` is a requirement (the TPU compiler behind `deltares.aot`). Installed on a machine
    with no TPU, it probes for one whenever JAX starts and prints errors; the settings below,
    which a TPU VM sets itself, keep it quiet. Nothing is changed on a machine with TPU chips."""
    if _glob.glob("/dev/accel*") or _os.path.exists("/dev/vfio"):
        return
    _os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    _os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    _os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


_quiet_libtpu_off_tpu()
