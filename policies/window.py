"""A bounded trailing window with robust statistics, as an immutable value."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Scales a median absolute deviation to a standard deviation for normal noise.
MAD_TO_SIGMA = 1.4826
SQRT2 = 2.0**0.5


@dataclass(frozen=True)
class RobustWindow:
    """The last ``capacity`` finite values, in arrival order and sorted.

    Kept as tuples so a policy state that holds one stays a frozen value; a push costs
    O(capacity), which is what a trailing median needs anyway.
    """

    capacity: int
    values: tuple[float, ...] = ()
    ordered: tuple[float, ...] = ()
    steps: tuple[int, ...] = ()
    """The step each value came from (-1 where none was given), for ``before``."""

    def push(self, value: float, step: int = -1) -> RobustWindow:
        values, ordered, steps = self.values, list(self.ordered), self.steps
        if len(values) >= self.capacity:
            oldest = values[0]
            del ordered[bisect.bisect_left(ordered, oldest)]
            values, steps = values[1:], steps[1:]
        bisect.insort(ordered, value)
        return RobustWindow(self.capacity, (*values, value), tuple(ordered), (*steps, step))

    def before(self, step: int) -> RobustWindow:
        """Only the values from steps before ``step``: a run resumed from an older checkpoint
        abandoned the steps it had gone past, and they no longer describe its history."""
        kept = [(v, s) for v, s in zip(self.values, self.steps, strict=True) if s < step]
        if len(kept) == len(self.values):
            return self
        return RobustWindow(
            self.capacity,
            tuple(v for v, _ in kept),
            tuple(sorted(v for v, _ in kept)),
            tuple(s for _, s in kept),
        )

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        return _median_sorted(self.ordered)

    def mad(self) -> float:
        center = self.median()
        return _median_sorted(sorted(abs(v - center) for v in self.ordered))

    def step_mad(self) -> float:
        """MAD of step-to-step changes, divided by sqrt(2): the noise of one value whatever
        the slow trend of the window (a falling loss inflates ``mad`` with the fall itself)."""
        if len(self.values) < 3:
            return self.mad()
        changes = sorted(b - a for a, b in zip(self.values, self.values[1:], strict=False))
        center = _median_sorted(changes)
        return _median_sorted(sorted(abs(c - center) for c in changes)) / SQRT2


def _median_sorted(ordered: tuple[float, ...] | list[float]) -> float:
    n = len(ordered)
    if n == 0:
        raise ValueError("median of an empty window")
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
