"""What every command-line tool does before it parses its flags (`python -m deltares.<tool>` and the
`deltares-<tool>` console scripts share one entry function that ends in `run`).

Nothing here happens on `import deltares`: the environment of a program that uses the library is
left as it is; only the tools change their own process's environment.
"""

from __future__ import annotations

import difflib
import functools
import glob
import os
import re
import sys

from absl import app, flags

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def tpu_chips_present() -> bool:
    """Whether this machine has TPU chips (as libtpu finds them: accel or VFIO devices)."""
    return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


def quiet_libtpu_off_tpu() -> None:
    """`libtpu` (requirements.txt, the `tpu` extra: the TPU compiler behind `deltares.aot`), installed
    on a machine with no TPU, probes for one when JAX starts its backends and prints errors; the settings
    below, which a TPU VM sets itself, keep it quiet. Nothing is changed on a machine with TPU
    chips. Called before JAX starts its backends (they start lazily, on the first computation)."""
    if tpu_chips_present():
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def experiments_dir() -> str:
    """The experiment files: `deltares/experiments` in an installed package (the wheel maps the
    repository's top-level `experiments/` there), `experiments/` beside the package in a checkout."""
    shipped = os.path.join(PACKAGE_DIR, "experiments")
    return shipped if os.path.isdir(shipped) else os.path.join(os.path.dirname(PACKAGE_DIR), "experiments")


def resolve_config(value: str) -> str:
    """A `--config` value. A file that exists is kept as given; otherwise `NAME[:ARG]`, `NAME.py[:ARG]`
    or `experiments/NAME.py[:ARG]` naming a shipped experiment becomes that file's path, so
    `--config tiny:delta_block` and the README's `--config experiments/tiny.py:delta_block` work
    from any directory. Anything else is kept (the tool reports the missing file)."""
    path, sep, arg = value.partition(":")
    if os.path.exists(path) or os.path.dirname(path) not in ("", "experiments"):
        return value
    name = os.path.basename(path)
    shipped = os.path.join(experiments_dir(), name if name.endswith(".py") else name + ".py")
    return shipped + sep + arg if os.path.isfile(shipped) else value


def resolve_config_args(argv: list[str]) -> list[str]:
    """`argv` with every `--config` value passed through `resolve_config` (`--config=V`, `--config V`;
    not the `--config.field=...` overrides, nothing after `--`)."""
    out, take_next = [], False
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if take_next:
            arg, take_next = resolve_config(arg), False
        elif arg in ("--config", "-config"):
            take_next = True
        elif arg.startswith(("--config=", "-config=")):
            flag, _, value = arg.partition("=")
            arg = f"{flag}={resolve_config(value)}"
        out.append(arg)
    return out


def _help_as_under_python_m(module_name: str) -> None:
    """A console script's `__main__` is a stub, and absl's `--help` shows the docstring and flags of
    `__main__`: give it the tool's, as `python -m deltares.<tool>` has them."""
    if module_name == "__main__":
        return
    stub = sys.modules["__main__"]
    stub.__doc__ = stub.__doc__ or sys.modules[module_name].__doc__
    for flag in flags.FLAGS.get_flags_for_module(module_name):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def config_override_error(argv: list[str], err: BaseException) -> str:
    """One line for a `--config.<field>=value` override that fails while the flags are parsed: the
    first override naming no field of the schema, with the closest field that exists."""
    from deltares.training.experiment import field_names  # noqa: PLC0415 - only on this error path

    names = field_names()
    for arg in argv[1:]:
        match = re.match(r"^--?(config\.[^=\s]+)", arg)
        if match and match.group(1) not in names:
            name = match.group(1)
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f"did you mean --{close[0]}?" if close else "--helpconfig lists the fields"
            return f"--{name}: no such config field; {hint}"
    lines = str(err).strip().strip("'\"").splitlines()
    return f"a --config override failed: {type(err).__name__}: {lines[0] if lines else ''}"


def one_line(err: BaseException) -> str:
    """An error message on one line: a message of several (an experiment file that failed to load
    ends in the traceback of its cause) becomes its first line and its last."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(err).__name__
    return f"{lines[0].split(': Error whilst')[0].removesuffix(':')}: {lines[-1]}"


def _parse_flags(argv: list[str]):
    """absl's flag parsing, with every error one `error:` line (absl prints two, and config overrides
    that name no field end in a traceback)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        sys.exit(f"error: {one_line(err)} (--help lists the flags)")
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        if not any(re.match(r"^--?config\.", arg) for arg in argv[1:]):
            raise
        sys.exit(f"error: {config_override_error(argv, err)}")


def _one_line_errors(main):
    """`main` with a usage error (a missing or conflicting flag) and an operating-system error (a full
    disk, a path that cannot be read) reported as one `error:` line instead of usage text or a traceback."""

    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except app.UsageError as err:
            sys.exit(f"error: {err} (--help shows the usage)")
        except OSError as err:
            sys.exit(f"error: {one_line(err)}")

    return wrapped


def run(main, quiet_libtpu: bool = True) -> None:
    """`absl.app.run(main)` for a tool whose flags are defined: libtpu quiet (unless the tool sets
    libtpu up itself, as `deltares.aot` does), `--config` names resolved, `--help` complete, and
    every usage, flag or config-override error one `error:` line."""
    if quiet_libtpu:
        quiet_libtpu_off_tpu()
    sys.argv = resolve_config_args(sys.argv)
    _help_as_under_python_m(main.__module__)
    app.run(_one_line_errors(main), flags_parser=_parse_flags)
