"""The one way a command names what it reads: `resolve_inputs` (a list of files and globs), `resolve_input`
(one path), and `DataError`, the error of an input that cannot be read as named (every tool prints its
message as one `error:` line).

A spec is a comma-separated list of entries. Each entry is a path or a glob, local (`~` expanded,
absolute or relative to the working directory) or on a bucket (`gs://`, `s3://`, through fsspec):

- a path that exists is that path, even when it holds glob characters (`data[1].jsonl`); a spec
  that as a whole names a path that exists is that one path (a file whose name holds a comma);
- otherwise an entry holding `*`, `?` or `[` is a glob (`**` crosses folders; names that start with a
  dot are matched only by a pattern that starts with one): its matches in sorted order;
- otherwise the entry names nothing: an error naming it, alone or in a list. An empty entry (a
  trailing or doubled comma) is an error naming its place.

The result: the entries in the order given, each glob's matches sorted, every file once. A local file
is given as its absolute real path (symlinks resolved), a bucket object as its URL, so a command that
checks where it writes compares real paths. The same file reached twice (listed twice, matched by two
globs, or reached through a symlink; compared by device and inode) is read once, where it first
appears, with a warning (`duplicates="warn"`), or refused (`duplicates="refuse"`, for inputs whose
place carries a meaning, such as the weights of a mixture). A symlink loop, a broken symlink, a folder
where a file is expected (or a file where a folder is), something that is not a regular file (a named
pipe, a device: taken only where a command reads its input once, `pipes=True`), and a file that cannot be
opened are each one error naming the entry and the cause.

`python -m deltares.common.inputs [--flag NAME] [--want file|folder|any] SPEC` prints what SPEC names,
one path a line, or one `error:` line (exit 1): for scripts that check their arguments as the tools do.

Imports nothing else of deltares.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
import sys
from collections.abc import Callable

BUCKET_SCHEMES = ("gs", "s3")  # read through fsspec (gcsfs, s3fs)
GLOB_CHARACTERS = "*?["
WANTS = ("file", "folder", "any")


class DataError(ValueError):
    """Input that cannot be read as named, or data that cannot be prepared or read; the message (one
    line) names the input and the cause."""


def say_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _named(flag: str | None, entry: str) -> str:
    """How a message names an entry: `--source data/x.txt`."""
    return f"{flag} {entry}" if flag else entry


def split_entries(spec: str, flag: str | None = None) -> list[str]:
    """The entries of a comma-separated spec, stripped; DataError for an empty one, naming its place."""
    if not spec or not spec.strip():
        raise DataError(f"{flag or 'the input'} is empty; name a file, a folder or a glob")
    entries = [part.strip() for part in spec.split(",")]
    for i, entry in enumerate(entries):
        if not entry:
            where = "trailing" if i == len(entries) - 1 else "leading" if i == 0 else "doubled"
            raise DataError(f"{_named(flag, repr(spec))}: entry {i + 1} of {len(entries)} is empty (a {where} "
                            "comma); remove it")
    return entries


def is_bucket(entry: str) -> bool:
    return "://" in entry


def bucket_filesystem(url: str):
    """(fsspec filesystem, path in it) of a bucket URL (gcsfs for gs://, s3fs for s3://); DataError when
    the scheme's package is missing or the URL is malformed."""
    try:
        import fsspec  # noqa: PLC0415 - buckets only

        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise DataError(f"cannot read {url}: {err} (gs:// needs gcsfs, s3:// needs s3fs)") from None


def _bucket(url: str, flag: str | None):
    """(filesystem, path in it, scheme) of a bucket URL."""
    scheme = url.split("://", 1)[0]
    if scheme not in BUCKET_SCHEMES:
        raise DataError(f"{_named(flag, url)}: {scheme}:// is not read; local paths, gs:// and s3:// are")
    return (*bucket_filesystem(url), scheme)


_KINDS = {stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


def _check_local(path: str, entry: str, flag: str | None, want: str, pipes: bool) -> tuple[str, tuple]:
    """(absolute real path, identity) of an existing local `path` that `entry` named; DataError naming the cause
    when it cannot be read as `want`. A named pipe or character device (`/dev/stdin`) when `pipes`: its absolute
    path, not opened here (it can be read once)."""
    name = _named(flag, entry) + ("" if path == os.path.expanduser(entry) else f" ({path})")
    try:
        st = os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DataError(f"{name} is a symlink loop") from None
        if os.path.islink(path) and err.errno == errno.ENOENT:
            raise DataError(f"{name} is a broken symlink (to {os.readlink(path)}, which does not exist)") from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise DataError(f"{name}: no such file or folder") from None
        raise DataError(f"{name} cannot be read: {err.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        if want == "file":
            shown = entry.rstrip("/")
            raise DataError(f"{name} is a folder, not a file; name the files in it, e.g. '{shown}/*'")
        if not os.access(path, os.R_OK | os.X_OK):
            raise DataError(f"{name} cannot be read: permission denied")
    elif stat.S_ISREG(st.st_mode):
        if want == "folder":
            raise DataError(f"{name} is a file, not a folder")
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise DataError(f"{name} cannot be read: {err.strerror}") from None
    elif pipes and want != "folder" and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        return os.path.abspath(path), (st.st_dev, st.st_ino)
    else:
        raise DataError(f"{name} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'no regular file')}, not a "
                        f"{'folder' if want == 'folder' else 'file'}")
    return os.path.realpath(path), (st.st_dev, st.st_ino)


def _local_entry(entry: str, flag: str | None, want: str, globs: bool, pipes: bool) -> list[tuple[str, tuple, str]]:
    """(real path, identity, how it was named) of each path a local entry names."""
    path = os.path.expanduser(entry)
    if os.path.lexists(path) or not globs or not any(c in entry for c in GLOB_CHARACTERS):
        if not os.path.lexists(path):
            missing = "file" if want == "file" else "folder" if want == "folder" else "file or folder"
            raise DataError(f"{_named(flag, entry)}: no such {missing}")
        return [(*_check_local(path, entry, flag, want, pipes), entry)]
    found = sorted(glob.glob(path, recursive=True))
    if not found:
        raise DataError(f"{_named(flag, repr(entry))} matches no {'folder' if want == 'folder' else 'file'}")
    return [(*_check_local(match, match, flag, want, pipes), match) for match in found]


def _bucket_entry(entry: str, flag: str | None, want: str, globs: bool, pipes: bool) -> list[tuple[str, tuple, str]]:
    fs, inner, scheme = _bucket(entry, flag)
    if fs.exists(inner) or not globs or not any(c in inner for c in GLOB_CHARACTERS):
        found = [inner] if fs.exists(inner) else []
        if not found:
            raise DataError(f"{_named(flag, entry)}: no such {'folder' if want == 'folder' else 'file'}")
    else:
        found = sorted(fs.glob(inner))
        if not found:
            raise DataError(f"{_named(flag, repr(entry))} matches no {'folder' if want == 'folder' else 'file'}")
    out = []
    for path in found:
        url = entry if path == inner else path if "://" in path else f"{scheme}://{path}"  # a literal: as given
        folder = fs.isdir(path)
        if folder and want == "file":
            raise DataError(f"{_named(flag, url)} is a folder, not a file; name the files in it, e.g. '{url}/*'")
        if not folder and want == "folder":
            raise DataError(f"{_named(flag, url)} is a file, not a folder")
        out.append((url, (scheme, path), url))  # the object as the filesystem names it: the same whichever way
    return out


def resolve_inputs(spec: str, *, flag: str | None = None, want: str = "file", globs: bool = True,
                   lists: bool = True, duplicates: str = "warn", pipes: bool = False,
                   warn: Callable[[str], None] = say_warning) -> list[str]:
    """The paths `spec` names (see the module docstring): absolute real paths of local files, URLs of bucket
    objects, in the order given. `want`: "file", "folder" or "any"; `globs`/`lists`: whether an entry may be a
    glob, and the spec a comma-separated list; `pipes`: whether a named pipe or character device is taken
    (for what a command reads once: `--prompt_file <(...)`). `flag` names the input in messages (`--source`).
    DataError naming the entry and the cause."""
    if want not in WANTS or duplicates not in ("warn", "refuse"):
        raise ValueError(f"want={want!r}, duplicates={duplicates!r}")
    whole = os.path.expanduser(spec.strip()) if spec else ""
    if lists and "," in spec and not is_bucket(spec) and os.path.lexists(whole):
        entries = [spec.strip()]  # a path that exists, with a comma in its name
    else:
        entries = split_entries(spec, flag) if lists else [spec.strip()]
        if not entries[0]:
            raise DataError(f"{flag or 'the input'} is empty; name a file, a folder or a glob")
    out, seen = [], {}
    for entry in entries:
        found = (_bucket_entry if is_bucket(entry) else _local_entry)(entry, flag, want, globs, pipes)
        for path, identity, named in found:
            if identity in seen:
                first = seen[identity]
                how = f"as {first} and as {named}" if first != named else "twice"
                if duplicates == "refuse":
                    raise DataError(f"{flag or 'the input'} names {path} {how}; name each once")
                warn(f"{flag or 'the input'} names {path} {how}; it is read once")
                continue
            seen[identity] = named
            out.append(path)
    return out


def resolve_input(spec: str, *, flag: str | None = None, want: str = "file", globs: bool = False) -> str:
    """The one path `spec` names (a single entry; a glob only when `globs`, and then one match): as
    `resolve_inputs` gives it."""
    found = resolve_inputs(spec, flag=flag, want=want, globs=globs, lists=False)
    if len(found) != 1:
        raise DataError(f"{_named(flag, repr(spec))} matches {len(found)} paths; name one")
    return found[0]


def main(argv: list[str]) -> int:
    import argparse  # noqa: PLC0415 - the command line only

    parser = argparse.ArgumentParser(prog="python -m deltares.common.inputs",
                                     description="Print the paths an input spec names, one a line.")
    parser.add_argument("spec")
    parser.add_argument("--flag", default=None, help="how messages name the input (e.g. --config)")
    parser.add_argument("--want", choices=WANTS, default="file")
    parser.add_argument("--one", action="store_true", help="exactly one path, no glob, no list")
    args = parser.parse_args(argv)
    try:
        found = ([resolve_input(args.spec, flag=args.flag, want=args.want)] if args.one else
                 resolve_inputs(args.spec, flag=args.flag, want=args.want))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
