"""Compile-only devices and the abstract train step, for ahead-of-time compiles on a machine without the
accelerator: TPU topologies from libtpu (`topology_devices`), the mesh a compile uses (`mesh_config`) and
the real sharded train step (`train_step`). Used by the `deltares.aot` tool and the step-time estimate."""

from __future__ import annotations

import math
import os
import re

import ml_collections

MEGACORE_GENERATIONS = ("v4", "v5p", "v5")
EXAMPLE_TOPOLOGIES = "v4:2x2x2, v5p:2x2x2, v5e:2x2, v5e:4x4, v6e:4x4, v6e:8x8"
_TOPOLOGY_RE = re.compile(r"^([a-zA-Z0-9_ ]+):(\d+(?:x\d+){1,2})(_twisted|_untwisted)?$")


class AotError(RuntimeError):
    """A problem with the request (topology, config, mesh); the message says which."""


def check_config(cfg) -> None:
    """AotError naming the first field of `cfg` outside the schema (its type, choices or range):
    checked before any device is made or anything compiled."""
    from deltares.training.experiment import validate_config

    try:
        validate_config(cfg)
    except ValueError as err:
        raise AotError(str(err)) from None


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """'v5p:2x2x2' -> ('v5p', (2, 2, 2)); raises AotError on anything else."""
    match = _TOPOLOGY_RE.match(name.strip())
    if not match:
        raise AotError(
            f"--topology={name!r} is not a TPU topology of the form GENERATION:AxB[xC], e.g. {EXAMPLE_TOPOLOGIES}"
        )
    dims = tuple(int(d) for d in match.group(2).split("x"))
    if any(d < 1 for d in dims):
        raise AotError(f"--topology={name!r}: every dimension must be at least 1")
    return match.group(1).lower(), dims


def _accelerator_type(generation: str, dims: tuple[int, ...]) -> str:
    """The TPU_ACCELERATOR_TYPE a real slice of this shape reports (silences a libtpu warning)."""
    chips = math.prod(dims)
    if generation in ("v2", "v3", "v4", "v5p", "tpu7x"):
        return f"{generation}-{chips * 2}"  # these count TensorCores
    if generation == "v5e":
        return f"v5litepod-{chips}"
    if generation == "v6e":
        return f"v6e-{chips}"
    return ""


def _libtpu_as_compiler(accelerator_type: str) -> None:
    """libtpu is used only as a compiler here: skip the cloud metadata queries, name the slice
    (silences a warning), and allow several compiling processes at once (libtpu otherwise takes
    a machine-wide lock file). Set when aot needs libtpu, before libtpu initialises; values
    already set are kept."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if accelerator_type:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)


def topology_devices(name: str) -> list:
    """Compile-only devices of the TPU topology `name` (no TPU needed)."""
    generation, dims = parse_topology(name)
    _libtpu_as_compiler(_accelerator_type(generation, dims))
    from jax.experimental import topologies

    kwargs = dict(
        chip_config_name="megacore" if generation in MEGACORE_GENERATIONS else "default",
        # a host holds 2x2 chips where the slice allows it, as on Cloud TPU VMs
        chips_per_host_bounds=(2 if dims[0] % 2 == 0 else 1, 2 if dims[1] % 2 == 0 else 1, 1),
    )
    try:
        return list(topologies.get_topology_desc(topology_name=name.strip(), platform="tpu", **kwargs).devices)
    except RuntimeError as err:  # JaxRuntimeError from libtpu, or "JAX TPU support not installed"
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "not installed" in message:
            message += " (pip install 'deltares[tpu]', or the libtpu pinned in requirements.txt)"
        raise AotError(f"--topology={name!r}: {message}. Examples: {EXAMPLE_TOPOLOGIES}") from None


def mesh_config(cfg, override: str | None) -> ml_collections.ConfigDict:
    """The mesh sizes of `cfg` (config.mesh, else fsdp over every device), or `override` "DATA,FSDP,TENSOR"."""
    if override:
        parts = [p.strip() for p in override.split(",")]
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            sizes = []
        if len(sizes) != 3:
            raise AotError(
                f"--mesh={override!r}: expected three integers DATA,FSDP,TENSOR (one may be -1), e.g. 1,-1,1"
            )
        return ml_collections.ConfigDict(dict(zip(("data", "fsdp", "tensor"), sizes)))
    if "mesh" in cfg and cfg.mesh is not None:
        return cfg.mesh
    return ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))


def step_mesh(cfg, devices, where: str, override: str | None = None):
    """The train step's mesh over `devices` (`mesh_config`), checked so that the global batch and
    each micro-batch split over data x fsdp; `where` names the devices in errors (AotError)."""
    from deltares.training.sharding import check_batch_split, make_mesh

    try:
        mesh = make_mesh(mesh_config(cfg, override), devices)
    except ValueError as err:
        raise AotError(f"mesh for {len(devices)} devices of {where}: {err}") from None
    try:
        check_batch_split(cfg.train, mesh)
    except ValueError as err:
        raise AotError(f"{err}; pass --config.train.global_batch or --mesh") from None
    return mesh


def train_step(cfg, mesh):
    """(step, abstract_state, batch_sharding) of deltares.training.sharding for `cfg` on `mesh`."""
    from deltares.training.program import sharded_train_step

    training = sharded_train_step(cfg, mesh)
    return training.step, training.abstract_state, training.batch_sharding
