"""deltares: depth routing (Delta Attention Residuals and the schemes it is compared with) in JAX/Flax.

Importing it changes nothing in the environment of a program that uses it (the command-line tools
set what they need themselves: `deltares.command_line`, `deltares.aot`). A process started as one
of the tools (`python -m deltares.<tool>`, `deltares-<tool>`) handles interrupts from here on, so
that Ctrl-C during the tool's first imports ends it with one line too
(`deltares.command_line.handle_interrupts`), and one that lacks the trainer's packages (a core install,
without the `train` extra) ends at once with one `error:` line naming them."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# The packages of the trainer and the tools, by import name -> distribution: the `train` extra of
# pyproject.toml (tests/test_install.py checks that the two agree). The core install (jax, flax, numpy,
# ml-collections, absl-py) is what `deltares.nn` needs.
TRAIN_MODULES = {
    "optax": "optax",
    "orbax.checkpoint": "orbax-checkpoint",
    "grain": "grain",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "tqdm": "tqdm",
    "tensorboardX": "tensorboardX",
    "etils.epath": "etils[epath]",
}


def _started_as_a_tool() -> bool:
    """`python -m deltares.<tool>` (`sys.argv[0]` is "-m" while the module is looked up) or a console
    script `deltares-<tool>`."""
    first = _sys.argv[0] if _sys.argv else ""
    return first == "-m" or _os.path.basename(first).startswith("deltares-")


def missing_train_packages() -> list[str]:
    """The distributions of TRAIN_MODULES that are not installed (found without importing them)."""
    import importlib.util

    missing = []
    for module, distribution in TRAIN_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is missing
            found = False
        if not found:
            missing.append(distribution)
    return missing


def require_train(who: str = "the deltares tools need") -> None:
    """Ends the program with one `error:` line naming the trainer's packages that are missing (a core
    install, without the `train` extra), if any; `who` says what needs them (the tools, an example)."""
    missing = missing_train_packages()
    if missing:
        _sys.exit(f"error: {who} the trainer's packages, which an install without the `train` extra leaves out "
                  f"(missing: {', '.join(missing)}): pip install \".[train]\" in a checkout")


if _started_as_a_tool():
    require_train()

    from deltares.command_line import handle_interrupts as _handle_interrupts

    _handle_interrupts()
