"""deltares: depth routing (Delta Attention Residuals and the schemes it is compared with) in JAX/Flax.

Importing it changes nothing in the environment (the command-line tools set what they need
themselves: `deltares.command_line`, `deltares.aot`)."""

__version__ = "0.1.0"
