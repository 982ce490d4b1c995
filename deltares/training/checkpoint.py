"""Checkpoints with orbax: train state, data-iterator state and config in one step directory.

`<workdir>/checkpoints/<step>/{state,data,config}`; saves are asynchronous and
atomic (orbax writes a temporary directory and renames it when complete), so an
interrupted or failed save leaves the previous checkpoint usable. Keeps the last
`keep_last` checkpoints plus every step that is a multiple of `keep_every`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from deltares.data import paths
from deltares.nn.model import Transformer
from deltares.training.configs import with_schema_defaults
from deltares.training.sharding import state_shardings
from deltares.training.steps import abstract_params


class Checkpointer:
    def __init__(self, workdir: str, keep_last: int = 3, keep_every: int = 0, async_save: bool = True):
        self.directory = paths.join(paths.run_dir(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config),
            ),
            force=True,
        )

    def check_params(self, step: int, abstract_params) -> None:
        """Raises ValueError naming the first parameter whose stored shape differs (or is missing)."""
        stored = stored_params(paths.join(self.directory, str(step), "state"))
        stored = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
        for key, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
            name = jax.tree_util.keystr(key)
            if stored.get(name) != tuple(leaf.shape):
                raise ValueError(f"parameter {name}: checkpoint has {stored.get(name, 'none')}, config needs {leaf.shape}")

    def restore(self, step: int, abstract_state):
        """(state, data_state) of `step`, with `abstract_state`'s structure, shapes and shardings."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
        )
        return out.state, out.data

    def config(self, step: int) -> dict:
        """The saved config of `step`, with fields added since it was written at their defaults."""
        saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
        return with_schema_defaults(saved)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def find_checkpoint(path: str) -> tuple[str, int]:
    """(checkpoints directory, step) for a workdir, its `checkpoints/` directory, or one step directory."""
    path = epath.Path(paths.run_dir(path))
    if (path / "state").is_dir() and path.name.isdigit():
        return os.fspath(path.parent), int(path.name)
    directory = path if path.name == "checkpoints" else path / "checkpoints"
    steps = ocp.utils.checkpoint_steps(directory) if directory.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return os.fspath(directory), max(steps)


def stored_params(state_dir: str):
    """The metadata (shape, dtype) of every parameter of a saved train state: orbax reads each
    array's small header (zarr metadata), no array data."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # orbax warns that the step-level metadata file is elsewhere
    try:
        return ocp.StandardCheckpointer().metadata(state_dir).item_metadata["params"]
    finally:
        logging.set_verbosity(verbosity)


def restore_params(state_dir: str, model_cfg, mesh=None) -> dict:
    """`{"params": ...}` of a saved train state: an orbax partial restore that reads no other
    array's data (the optimizer state, Adam's two moments, twice the parameters, is never read).
    On the first device, or with `mesh` each parameter split by the logical rules of `model_cfg`
    (deltares.training.sharding, as training places them), so no device holds more than its shards."""
    stored = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), stored_params(state_dir))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, stored)
    else:
        boxed = abstract_params(Transformer(model_cfg), 1)
        shardings = state_shardings(boxed, stored, mesh)
    item = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                   stored, shardings)}
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        return ocp.PyTreeCheckpointer().restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
            ),
        )
    finally:
        logging.set_verbosity(verbosity)


class LoadedCheckpoint(NamedTuple):
    config: dict
    state: dict | None  # {"params": ...} only: inference never needs the optimizer state
    step: int
    workdir: str  # the run directory holding `checkpoints/`


def load_checkpoint(path: str, want_state: bool = True, mesh=None) -> LoadedCheckpoint:
    """The config and parameters of the newest checkpoint under `path` (see `find_checkpoint`),
    restored without the optimizer state (`restore_params`): on the first device, or split over
    `mesh` by the logical rules of the saved model config."""
    directory, step = find_checkpoint(path)
    step_dir = paths.join(directory, str(step))
    config = with_schema_defaults(ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(paths.join(step_dir, "config")))
    state = None
    if want_state:
        state = restore_params(paths.join(step_dir, "state"), ml_collections.ConfigDict(config).model, mesh)
    return LoadedCheckpoint(config, state, step, os.fspath(epath.Path(directory).parent))
