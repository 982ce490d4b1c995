"""Whether a saved checkpoint step can be used, checked from its metadata before anything restores it.

A step directory (`<workdir>/checkpoints/<step>`, written by `deltares.training.checkpoint`) holds
three orbax items: `config` and `data` (JSON) and `state` (the train state in an OCDBT key-value
store of zarr arrays). `step_problem` reads the small files only: both JSON items, the state's tree
metadata, and the OCDBT b-tree, whose leaves record for every array chunk the data file, offset and
length it was written to; a chunk whose range lies past the end of its file was cut short (a full
disk, a copy interrupted). No array data is read, so checking a 7.6B-parameter step costs the b-tree
(kilobytes) and one size lookup per data file.
"""

from __future__ import annotations

import ast
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from etils import epath

from deltares.data import paths

_LOCATION = re.compile(r"^(btreenode|value):([^:]*):(.+):(\d+):(\d+)$")  # kind:base:path:offset:length
_META_SUFFIXES = ("/.zarray", "/zarr.json")  # zarr v2 and v3 array metadata keys


def _read_json(path: epath.Path, what: str):
    if not path.exists():
        raise _Damage(f"{what} is missing")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise _Damage(f"{what} is not readable JSON (empty or cut short)") from None


class _Damage(Exception):
    """One line saying what is wrong with a step."""


def _array_names(tree_metadata: dict, params_only: bool) -> list[str]:
    """The OCDBT key prefixes of the saved arrays ('params.embed.embedding', ...), from the
    state's `_METADATA` tree (keys are tuples written as strings; empty leaves carry no data)."""
    names = []
    for key, entry in tree_metadata.items():
        value = entry.get("value_metadata", {}) if isinstance(entry, dict) else {}
        if value.get("skip_deserialize") or value.get("value_type") in (None, "None"):
            continue
        try:
            parts = ast.literal_eval(key)
        except (ValueError, SyntaxError):
            raise _Damage(f"state/_METADATA has an unreadable key {key[:60]!r}") from None
        parts = (parts,) if isinstance(parts, str) else tuple(parts)
        if not params_only or parts[:1] == ("params",):
            names.append(".".join(str(p) for p in parts))
    return names


def _ocdbt_entries(state: epath.Path) -> tuple[set[bytes], list[tuple[str, int, int]]]:
    """(every key, every (file, offset, length) the store refers to) of the OCDBT store in `state`."""
    import tensorstore as ts  # noqa: PLC0415 - orbax's storage layer, loaded with orbax anyway

    base = os.fspath(state).rstrip("/") + "/"
    try:
        kv = ts.KvStore.open(base if paths.is_remote(base) else "file://" + base).result()
        manifest = ts.ocdbt.dump(kv).result()
        versions = manifest.get("versions") or []
        if not versions:
            raise _Damage("state/manifest.ocdbt lists no version")
        keys, ranges, nodes = set(), [], [versions[-1]["root"]["location"]]
        while nodes:
            location = nodes.pop()
            ranges.append(_range(location))
            for entry in ts.ocdbt.dump(kv, location).result().get("entries", []):
                for value in entry.values():
                    if isinstance(value, str) and value.startswith("btreenode:"):
                        nodes.append(value)
                    elif isinstance(value, str) and value.startswith("value:"):
                        ranges.append(_range(value))
                if isinstance(entry.get("key"), bytes):
                    keys.add(entry["key"])
    except _Damage:
        raise
    except Exception as err:  # noqa: BLE001 - tensorstore reports any unreadable store as ValueError or similar
        raise _Damage(f"state/ is not a readable OCDBT store ({_first_line(err)})") from None
    return keys, ranges


def _range(location: str) -> tuple[str, int, int]:
    match = _LOCATION.match(location)
    if not match:
        raise _Damage(f"state/ refers to an unreadable location {location[:80]!r}")
    _, base, path, offset, length = match.groups()
    return base + path, int(offset), int(length)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def _check_state(state: epath.Path, params_only: bool) -> None:
    if not state.is_dir():
        raise _Damage("state/ is missing")
    meta = _read_json(state / "_METADATA", "state/_METADATA")
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise _Damage("state/_METADATA has no tree metadata")
    names = _array_names(tree, params_only)
    if not names:
        raise _Damage("state/_METADATA lists no parameters")
    if (state / "_sharding").exists():  # orbax reads it with the metadata: a damaged one hides every array
        _read_json(state / "_sharding", "state/_sharding")
    if not meta.get("use_ocdbt", True):
        missing = [n for n in names if not (state / n).is_dir()]
        if missing:
            raise _Damage(f"array {missing[0]} is missing")
        return
    keys, ranges = _ocdbt_entries(state)
    for name in names:
        prefix = name.encode() + b"/"
        if not any(prefix + s[1:].encode() in keys for s in _META_SUFFIXES):
            raise _Damage(f"array {name} is missing")
    files = sorted({f for f, _, _ in ranges})
    with ThreadPoolExecutor(16 if paths.is_remote(os.fspath(state)) else 1) as pool:
        sizes = dict(zip(files, pool.map(lambda f: _size(state / f), files)))
    for file, offset, length in ranges:
        if sizes[file] is None:
            raise _Damage(f"data file state/{file} is missing")
        if offset + length > sizes[file]:
            raise _Damage(f"data file state/{file} is cut short ({sizes[file]} bytes, needs {offset + length})")


def _size(path: epath.Path) -> int | None:
    try:
        return path.stat().length
    except (FileNotFoundError, OSError):
        return None


NEEDS = ("config", "params", "all")


def step_problem(step_dir, need: str = "all") -> str | None:
    """Why the checkpoint step in `step_dir` cannot be used, in one line, or None when it can.
    `need` is what the reader uses: "config" (the saved config), "params" (the config and the
    parameters: inference, evaluation, export) or "all" (resuming training: also the data-iterator
    state and every array of the train state)."""
    assert need in NEEDS, need
    step = epath.Path(step_dir)
    try:
        if not step.is_dir():
            raise _Damage("the step directory is missing")
        config = _read_json(step / "config" / "metadata", "config/metadata")
        if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
            raise _Damage("config/metadata holds no model config")
        if need == "all":
            _read_json(step / "data" / "metadata", "data/metadata")
        if need != "config":
            _check_state(step / "state", params_only=need == "params")
    except _Damage as damage:
        return str(damage)
    return None
