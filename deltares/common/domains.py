"""The range of every number a user gives, declared once per number (`Domain`: a config field's, a
flag's), and `define_number`, the one way a tool declares a numeric flag.

A `Domain` is an interval with optional ends, open or closed, plus a few special values (`-1`
for a mesh axis that takes the remaining devices). Every float must be finite and every integer
must fit in 32 bits (shapes, steps and seeds end up in int32 arrays), whatever the interval says:
`nan` compares false with everything, so an interval check alone would let it through.
`problem(value)` says what is wrong ("must be ..."), `str(domain)` what is allowed (help texts, the
config reference). The config schemas (deltares.nn.config, deltares.training.experiment, the data's)
and every tool's numeric flags use it. It imports nothing of deltares, so every layer may use it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from absl import flags

flags.disclaim_key_flags()  # a flag `define_number` defines is the calling tool's (its --help lists it)

INT_LIMIT = 2**31 - 1  # the largest integer a field or flag may hold (int32)


def _number(x: float) -> str:
    """`x` as written in a range: 1 not 1.0, 2147483647 in full."""
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Domain:
    """The numbers in `[low, high]` (`None`: no bound on that side; `low_open`/`high_open`: the end
    itself excluded), and also the values in `also`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()

    def __str__(self) -> str:
        lo, hi = self.low, self.high
        if hi is None and lo == 0:
            text = "positive" if self.low_open else "non-negative"
        elif hi is None and lo is not None:
            text = f"{'greater than' if self.low_open else 'at least'} {_number(lo)}"
        elif lo is None and hi is not None:
            text = f"{'less than' if self.high_open else 'at most'} {_number(hi)}"
        elif lo is None:
            text = "any finite number"
        else:
            text = f"in {'(' if self.low_open else '['}{_number(lo)}, {_number(hi)}{')' if self.high_open else ']'}"
        return text + "".join(f", or {_number(v)}" for v in self.also)

    def problem(self, value) -> str | None:
        """What is wrong with `value` (None: it is allowed), e.g. 'must be positive'. NumPy numbers
        count as Python's."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return "must be a number"
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be finite and {self}"
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            return f"must be a 32-bit integer (at most {INT_LIMIT} in size), {self}"
        if value in self.also:
            return None
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return None if low_ok and high_ok else f"must be {self}"


POSITIVE = Domain(0, low_open=True)  # > 0; for integers: at least 1
NON_NEGATIVE = Domain(0)
AT_LEAST_1 = Domain(1)
MESH_AXIS = Domain(1, also=(-1,))  # a device mesh axis: its size, or -1 for the remaining devices



def define_number(define, name: str, default, help: str, domain: Domain):
    """`define(name, default, help)` (flags.DEFINE_integer or DEFINE_float), the help ending in the
    allowed range, whose value (unless left unset: None) must lie in `domain`: checked as the flags
    are parsed, before any work, so a value outside it is one `error:` line naming the flag and the
    range. The one way every tool declares a numeric flag."""
    holder = define(name, default, f"{help.rstrip('.')}; {domain}.")
    flags.FLAGS[name].domain = domain  # for the tests that walk every numeric flag

    def check(value) -> bool:
        problem = None if value is None else domain.problem(value)
        if problem:
            raise flags.ValidationError(problem)
        return True

    flags.register_validator(name, check)
    return holder
