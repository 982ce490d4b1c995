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
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from deltares import paths


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
        path = paths.join(self.directory, str(step), "state")
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.ERROR)  # orbax warns that the step-level metadata file is elsewhere
        try:
            stored = ocp.StandardCheckpointer().metadata(path).item_metadata["params"]
        finally:
            logging.set_verbosity(verbosity)
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
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

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


class LoadedCheckpoint(NamedTuple):
    config: dict
    state: dict | None
    step: int
    workdir: str  # the run directory holding `checkpoints/`


def load_checkpoint(path: str, want_state: bool = True) -> LoadedCheckpoint:
    """The newest checkpoint under `path` (see `find_checkpoint`), arrays on the default device."""
    directory, step = find_checkpoint(path)
    step_dir = paths.join(directory, str(step))
    config = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(paths.join(step_dir, "config"))
    state = None
    if want_state:
        state = ocp.StandardCheckpointer().restore(paths.join(step_dir, "state"))
        state = jax.tree.map(jax.numpy.asarray, state)
    return LoadedCheckpoint(config, state, step, os.fspath(epath.Path(directory).parent))
