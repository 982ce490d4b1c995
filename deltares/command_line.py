"""What every command-line tool does before it parses its flags (`python -m deltares.<tool>` and the
`deltares-<tool>` console scripts share one entry function that ends in `run`): flag errors as one
`error:` line, `--config` names resolved, interrupts as one line. The ranges of numbers are
`deltares.common.domains`.

Nothing here happens on `import deltares`: the environment of a program that uses the library is
left as it is; only the tools change their own process's environment.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import glob
import os
import re
import signal
import socket
import sys
import threading

from absl import app, flags

from deltares.common import interrupts, lock

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
    """A `--config` value. A path that exists is kept as given (`~` expanded); otherwise `NAME[:ARG]`,
    `NAME.py[:ARG]` or `experiments/NAME.py[:ARG]` naming a shipped experiment becomes that file's path, so
    `--config tiny:delta_block` and the README's `--config experiments/tiny.py:delta_block` work
    from any directory. Anything else is kept (`config_file_error` names what is wrong with it)."""
    path, sep, arg = value.partition(":")
    if os.path.lexists(os.path.expanduser(path)):
        return os.path.expanduser(path) + sep + arg
    if os.path.dirname(path) not in ("", "experiments"):
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


def config_override_error(argv: list[str], err: BaseException, names: list[str]) -> str:
    """One line for a `--config.<field>=value` override that fails while the flags are parsed: the
    first override naming no field of the schema (`names`, dotted from `config.`), with the closest
    field that exists."""
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


def config_file_argument(argv: list[str]) -> str | None:
    """The experiment file a `--config FILE[:ARG]` (or `--config=...`) of `argv` names, or None."""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            return None
        if arg in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1].partition(":")[0]
        if arg.startswith(("--config=", "-config=")):
            return arg.partition("=")[2].partition(":")[0]
    return None


def config_file_error(path: str) -> str | None:
    """Why the experiment file `path` cannot be loaded, in one line naming it (what
    deltares.common.inputs.resolve_input says of a path that names no readable file: missing, a folder, a
    symlink loop, unreadable; text that is not UTF-8; a syntax error), or None. Checked before absl parses
    the flags: ml_collections defers a missing file to a garbled error and lets a syntax error escape as a
    traceback."""
    # imported here: `import deltares` imports this module first, and `python -m deltares.common.inputs` runs alone
    from deltares.common.inputs import DataError, resolve_input  # noqa: PLC0415

    if not path:
        return "--config names no experiment file (FILE[:ARG], e.g. experiments/tiny.py:delta_block)"
    try:
        resolve_input(path, flag="--config")
    except DataError as err:
        return str(err)
    try:
        with open(os.path.expanduser(path), encoding="utf-8-sig") as f:  # Python reads a byte-order mark too
            compile(f.read(), path, "exec")
    except SyntaxError as err:
        return f"--config {path} line {err.lineno}: {err.msg}"
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"--config {path}: {type(err).__name__}: {one_line(err)}"
    return None


def _flag_error(err: flags.Error) -> str:
    """One line of absl's error: the first flag's when several fail their ranges (a line each)."""
    lines = str(err).splitlines()
    return lines[0] if len(lines) > 1 and all(line.startswith("flag --") for line in lines) else one_line(err)


_config_fields = list  # the tool's experiment schema: its field names (`run`'s `config_fields`)


def _parse_flags(argv: list[str]):
    """absl's flag parsing, with every error one `error:` line (absl prints two, and config overrides
    that name no field, or an experiment file that cannot be loaded, end in a traceback)."""
    config_file = config_file_argument(argv)
    problem = config_file is not None and config_file_error(config_file)
    if problem:
        sys.exit(f"error: {problem}")
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        sys.exit(f"error: {_flag_error(err)} (--help lists the flags)")
    except Exception as err:  # noqa: BLE001 - a config override, or the experiment file's own code, failed
        override = any(re.match(r"^--?config\.", arg) for arg in argv[1:])
        if override and isinstance(err, (AttributeError, KeyError, TypeError, ValueError)):
            sys.exit(f"error: {config_override_error(argv, err, _config_fields())}")
        if not config_file:
            raise
        sys.exit(f"error: --config {config_file}: get_config failed: {type(err).__name__}: {one_line(err)}")


def _one_line_errors(main):
    """`main` with a usage error (a missing or conflicting flag) and an operating-system error (a full
    disk, a path that cannot be read) reported as one `error:` line instead of usage text or a traceback."""

    @functools.wraps(main)
    def wrapped(argv):
        interrupt_note("running", "")  # the flags are parsed; a tool may say more (deltares.train does)
        try:
            return main(argv)
        except app.UsageError as err:
            sys.exit(f"error: {err} (--help shows the usage)")
        except OSError as err:
            sys.exit(f"error: {one_line(err)}")

    return wrapped


# ----------------------------------------------------------------------------- interrupts

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as a shell reports it
_note = {"doing": "starting", "left": "nothing was written"}
_cleanups: list = []
_whole = interrupts.WHOLE  # held by a write that must not be cut short; the exit path takes it for good
_watching = False


def handle_interrupts() -> None:
    """From now on SIGINT and SIGTERM end the process at once, with one `error:` line (what it was doing,
    what it leaves: `interrupt_note`) and exit code 130 or 143, whatever the main thread is in: an
    import, a compilation, a wait on a device. A thread does it, woken by the signal (`signal.set_wakeup_fd`),
    and ends the process with `os._exit`: a KeyboardInterrupt unwinding through jax's threads ended in a
    segmentation fault at exit. A handler installed later (the training loop's `StopRequest`) takes
    its signals over while it is installed. Only in the main thread of the main process; once."""
    global _watching
    if _watching or threading.current_thread() is not threading.main_thread() or _in_worker_process():
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    for signum in EXIT_CODES:
        signal.signal(signum, _wake)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(reader, writer), name="deltares-interrupts", daemon=True).start()
    _watching = True


def _in_worker_process() -> bool:
    """Whether this is a worker that `multiprocessing` started (its parent handles interrupts)."""
    mp = sys.modules.get("multiprocessing")
    return mp is not None and mp.parent_process() is not None


def _wake(signum, frame) -> None:
    """The Python-level handler: nothing. Python's C-level handler writes the signal's number to the
    wakeup socket, and `_watch` acts on it at once, even while the main thread runs native code."""


def _watch(reader: socket.socket, writer: socket.socket) -> None:
    """The interrupt thread: the numbers of the signals caught, as they come (`writer` is kept open here)."""
    while received := reader.recv(64):
        for signum in received:
            if signum in EXIT_CODES and signal.getsignal(signum) is _wake:  # not taken over
                _exit_interrupted(signal.Signals(signum))


def interrupt_note(doing: str, left: str) -> None:
    """What the line of an interrupt says from now on: what the command is `doing`, and what it leaves
    written (`left`, or "" to say nothing of it)."""
    _note.update(doing=doing, left=left)


@contextlib.contextmanager
def on_interrupt(cleanup):
    """`cleanup()` runs (on the interrupt thread) if an interrupt ends the process inside this block."""
    with _whole:
        _cleanups.append(cleanup)
    try:
        yield
    finally:
        with _whole:
            _cleanups.remove(cleanup)


whole = interrupts.whole  # a block that an interrupt does not cut short


def _exit_interrupted(sig: signal.Signals) -> None:
    """Waits for a write that must be whole (and lets no other start), runs the cleanups, releases the
    locks this process holds, ends the worker processes, prints the line and exits."""
    _whole.acquire(timeout=30)
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except Exception:  # noqa: BLE001, S110 - exiting anyway: the next run handles what is left
            pass
    lock.release_all()
    _end_worker_processes()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    line = f"error: interrupted by {sig.name} while {_note['doing']}" + (f"; {_note['left']}" if _note["left"] else "")
    os.write(2, f"\n{line}\n".encode())  # after a progress bar or the terminal's ^C
    os._exit(EXIT_CODES[sig])


def _end_worker_processes() -> None:
    """Ends the processes that `multiprocessing` started (a worker pool's: waited for, so that none is left
    starting), then unlinks the named semaphores of its pools and queues, which `os._exit` would leave to
    the resource tracker (it warns of them as leaked)."""
    mp = sys.modules.get("multiprocessing")
    children = mp.active_children() if mp is not None else []
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=10)
    util, synchronize = sys.modules.get("multiprocessing.util"), sys.modules.get("multiprocessing.synchronize")
    if util is None or synchronize is None:
        return
    for finalizer in list(getattr(util, "_finalizer_registry", {}).values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            with contextlib.suppress(Exception):
                finalizer()


def run(main, quiet_libtpu: bool = True, config_fields=list) -> None:
    """`absl.app.run(main)` for a tool whose flags are defined: libtpu quiet (unless the tool sets
    libtpu up itself, as `deltares.aot` does), `--config` names resolved, `--help` complete, and
    every usage, flag or config-override error one `error:` line; an interrupt at any moment one
    line too (`handle_interrupts`). A tool with a `--config` passes `config_fields` (a function
    returning the schema's dotted field names) for the line of an override naming no field."""
    global _config_fields
    _config_fields = config_fields
    handle_interrupts()
    if quiet_libtpu:
        quiet_libtpu_off_tpu()
    sys.argv = resolve_config_args(sys.argv)
    _help_as_under_python_m(main.__module__)
    app.run(_one_line_errors(main), flags_parser=_parse_flags)
