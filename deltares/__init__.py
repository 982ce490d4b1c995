"""deltares: depth routing (Delta Attention Residuals and the schemes it is compared with) in JAX/Flax.

Importing it changes nothing in the environment of a program that uses it (the command-line tools
set what they need themselves: `deltares.command_line`, `deltares.aot`). A process started as one
of the tools (`python -m deltares.<tool>`, `deltares-<tool>`) handles interrupts from here on, so
that Ctrl-C during the tool's first imports ends it with one line too
(`deltares.command_line.handle_interrupts`)."""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def _started_as_a_tool() -> bool:
    """`python -m deltares.<tool>` (`sys.argv[0]` is "-m" while the module is looked up) or a console
    script `deltares-<tool>`."""
    first = _sys.argv[0] if _sys.argv else ""
    return first == "-m" or _os.path.basename(first).startswith("deltares-")


if _started_as_a_tool():
    from deltares.command_line import handle_interrupts as _handle_interrupts

    _handle_interrupts()
