"""The hook never raises into the training loop: entry points catch, count and log once."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from collectors.counters import Counters

log = logging.getLogger("runhealth.collectors")

P = ParamSpec("P")
R = TypeVar("R")


class EntryErrors:
    """Exceptions caught at entry points: each counted, each place's first one logged."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._logged: set[str] = set()

    def record(self, where: str) -> None:
        """Call from an ``except`` block."""
        self._counters.add("hook_errors")
        if where not in self._logged:
            self._logged.add(where)
            log.exception("runhealth hook: %s failed; training continues (logged once)", where)


class HasFaults(Protocol):
    faults: EntryErrors


S = TypeVar("S", bound=HasFaults)


def guarded(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R | None]:
    """Run ``method``; on an exception, record it and return None."""

    @functools.wraps(method)
    def entry(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(self, *args, **kwargs)
        except Exception:
            self.faults.record(method.__name__)
            return None

    return entry
