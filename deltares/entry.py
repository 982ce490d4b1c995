"""What every command-line tool does before it parses its flags (`python -m deltares.<tool>` and the
`deltares-<tool>` console scripts share one entry function that ends in `run`).

Nothing here happens on `import deltares`: the environment of a program that uses the library is
left as it is; only the tools change their own process's environment.
"""

from __future__ import annotations

import glob
import os
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


def run(main, quiet_libtpu: bool = True) -> None:
    """`absl.app.run(main)` for a tool whose flags are defined: libtpu quiet (unless the tool sets
    libtpu up itself, as `deltares.aot` does), `--config` names resolved, `--help` complete."""
    if quiet_libtpu:
        quiet_libtpu_off_tpu()
    sys.argv = resolve_config_args(sys.argv)
    _help_as_under_python_m(main.__module__)
    app.run(main)
