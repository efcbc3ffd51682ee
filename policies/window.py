"""A bounded trailing window with robust statistics, as an immutable value."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from policies.stats import mad, median_of_sorted, step_mad


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
        return median_of_sorted(self.ordered)

    def recent_median(self, count: int) -> float:
        """The median of the newest ``count`` values (all of them when fewer)."""
        return median_of_sorted(sorted(self.values[-count:]))

    def mad(self) -> float:
        return mad(self.ordered, self.median())

    def step_mad(self) -> float:
        """MAD of step-to-step changes over sqrt 2 (``policies.stats.step_mad``): blind to the
        window's slow trend, which inflates ``mad`` (a falling loss)."""
        return step_mad(self.values)
