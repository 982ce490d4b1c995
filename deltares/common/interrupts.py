"""Blocks that an interrupt does not cut short (`whole`): a tool's interrupt (deltares.command_line) ends
the process only outside them, and holds WHOLE from its start to the end of the process, so that a
thread that enters `whole()` then waits for that end (prepare's, whose workers the interrupt ends,
rather than reporting their deaths). Here, below every layer, so that the data's worker pool uses it."""

from __future__ import annotations

import contextlib
import threading

WHOLE = threading.RLock()  # held by a block that must not be cut short; the exit path takes it for good


@contextlib.contextmanager
def whole():
    """A block that an interrupt does not cut short: the process ends after it, not inside it."""
    with WHOLE:
        yield
