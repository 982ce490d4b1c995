"""The values a number may take (a config field's, a command-line flag's), declared once per number.

A `Domain` is an interval with optional ends, open or closed, plus a few special values (`-1`
for a mesh axis that takes the remaining devices). Every float must be finite and every integer
must fit in 32 bits (shapes, steps and seeds end up in int32 arrays), whatever the interval says:
`nan` compares false with everything, so an interval check alone would let it through.
`problem(value)` says what is wrong in words that finish "VALUE is invalid: ..." or
"--flag=VALUE: ..." (one line), `str(domain)` what is allowed (help texts, the config reference).
No heavy imports: the command-line tools check their flags with it before JAX starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        """What is wrong with `value` (None: it is allowed), e.g. 'must be positive'."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be finite and {self}"
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            return f"must be a 32-bit integer (at most {INT_LIMIT} in size), {self}"
        if value in self.also:
            return None
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return None if low_ok and high_ok else f"must be {self}"


FINITE = Domain()
POSITIVE = Domain(0, low_open=True)  # > 0; for integers: at least 1
NON_NEGATIVE = Domain(0)
AT_LEAST_1 = Domain(1)
UNIT = Domain(0, 1)  # a fraction, both ends included
MESH_AXIS = Domain(1, also=(-1,))  # a device mesh axis: its size, or -1 for the remaining devices
