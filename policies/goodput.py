"""Goodput: a run's wall time split into productive training and badput by cause.

Modelled on Google's ml-goodput-measurement (``BadputType``: accelerator initialization,
training preparation and program startup, data loading, checkpoint save and restore time,
wasted progress from disruption, infrastructure recovery from disruption, custom badput events,
other), over what runhealth records: every incarnation's start and end, the reporting rank's
windows (when each ended, and the time from the previous window's end to its start), checkpoint
publications, canary rounds, holds, hang detections. The wall time from the first start to the
last sign of life is split exactly: the categories always sum to it, and what no record explains
is ``other``.

Each window's span (from the previous window's end to its own) is split in this order: the
stalls that fall in it (a checkpoint save, a canary round, a hold), then the rest of the time
between windows (data wait, as the hook measures it), then compute, which is productive unless a
later incarnation went back to before its step (then it was redone: after a rollback or after a
restart). An incarnation's start to its first window is start-up and restore; its last window to
its end is a hang before detection (when one was detected there), holds and stalls, then the
stop for the next start (``down``, with the gap before that start).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Cause(StrEnum):
    """Where wall time went; ``PRODUCTIVE`` is goodput, every other member badput."""

    PRODUCTIVE = "productive"
    STARTUP_RESTORE = "startup_restore"
    CHECKPOINT_SAVE = "checkpoint_save"
    REDONE_ROLLBACK = "redone_rollback"
    REDONE_RESTART = "redone_restart"
    HUNG = "hung_before_detection"
    CANARY = "canary"
    DATA_WAIT = "data_wait"
    HOLD = "hold"
    DOWN = "down"
    OTHER = "other"


BADPUT = tuple(cause for cause in Cause if cause is not Cause.PRODUCTIVE)

LABELS: Mapping[Cause, str] = {
    Cause.PRODUCTIVE: "productive training",
    Cause.STARTUP_RESTORE: "start-up and restore",
    Cause.CHECKPOINT_SAVE: "checkpoint save stalls",
    Cause.REDONE_ROLLBACK: "work redone after rollbacks",
    Cause.REDONE_RESTART: "work redone after restarts",
    Cause.HUNG: "hung before detection",
    Cause.CANARY: "canary rounds",
    Cause.DATA_WAIT: "data wait",
    Cause.HOLD: "held for a decision",
    Cause.DOWN: "down between incarnations",
    Cause.OTHER: "other / unaccounted",
}

HOW: Mapping[Cause, str] = {
    Cause.PRODUCTIVE: "windows' compute (each window's span less its stalls and data wait) at steps "
    "no later incarnation went back over",
    Cause.STARTUP_RESTORE: "each incarnation's start record (the hook's attach: what the process did "
    "before it is not seen) to its first window's start (that window's end less the incarnation's "
    "median window compute)",
    Cause.CHECKPOINT_SAVE: "each checkpoint's save as the hook timed it (rh.checkpoint_saving to "
    "checkpoint_saved; an asynchronous save's staging only), else its publication less the end of "
    "the window before it (logging between the two counts as save)",
    Cause.REDONE_ROLLBACK: "compute of windows at steps a rollback's restore went back over",
    Cause.REDONE_RESTART: "compute of windows at steps a restart (not a rollback) went back over",
    Cause.HUNG: "a hang incident's detection less the end of its incarnation's last window",
    Cause.CANARY: "each canary round's duration (its slowest rank) where the round fell between windows",
    Cause.DATA_WAIT: "the reporting rank's time from the previous window's end to the window's start, "
    "less the stalls in it",
    Cause.HOLD: "hold to release (audit log), where the run was between windows",
    Cause.DOWN: "an incarnation's last window (or its hang's detection) to the next incarnation's start",
    Cause.OTHER: "the rest: time after the last incarnation's last window, and what no record explains",
}


@dataclass(frozen=True)
class Window:
    """One window as the reporting rank recorded it."""

    step: int
    time: float
    """When it ended."""
    between_s: float | None = None
    """From the previous window's end to this one's start (the hook's ``data_wait_s``)."""


@dataclass(frozen=True)
class Life:
    """One incarnation: its start, its end, its windows in time order."""

    incarnation: str
    started_at: float
    ended_at: float
    """Its finish record, else its last sign of life (a window or a heartbeat)."""
    windows: tuple[Window, ...] = ()
    by_rollback: bool = False
    """It is the restore of an approved rollback."""


@dataclass(frozen=True)
class Stall:
    """Something that stopped training between windows: it ended at ``end`` after ``seconds``
    (``None``: its start was not recorded, so it began when the window before it ended)."""

    incarnation: str
    end: float
    seconds: float | None = None


@dataclass(frozen=True)
class Span:
    """A stretch of time one incarnation spent stopped (a hold, from its start to its release)."""

    incarnation: str
    start: float
    end: float


@dataclass(frozen=True)
class GoodputFacts:
    lives: tuple[Life, ...]
    checkpoints: tuple[Stall, ...] = ()
    canaries: tuple[Stall, ...] = ()
    holds: tuple[Span, ...] = ()
    hang_detections: Mapping[str, float] = field(default_factory=dict)
    """Incarnation -> when its first hang incident was opened."""


@dataclass(frozen=True)
class Category:
    cause: Cause
    seconds: float | None
    """``None``: not measurable from what was recorded (``how`` says why and where it went)."""
    how: str

    @property
    def label(self) -> str:
        return LABELS[self.cause]


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    categories: tuple[Category, ...]
    save_costs_s: tuple[float, ...]
    """Each checkpoint save's measured stall, in time order (the interval advice's C)."""
    interruptions: int
    """Incarnations a later one followed (a crash, a restart, a rollback's restore)."""

    def seconds(self, cause: Cause) -> float:
        found = next(c for c in self.categories if c.cause is cause)
        return found.seconds or 0.0

    @property
    def ratio(self) -> float | None:
        return self.seconds(Cause.PRODUCTIVE) / self.wall_s if self.wall_s > 0 else None


def goodput(facts: GoodputFacts) -> Goodput:
    """Split the run's wall time by cause (see the module docstring)."""
    lives = sorted(facts.lives, key=lambda life: life.started_at)
    totals = dict.fromkeys(Cause, 0.0)
    saves: list[float] = []
    for index, life in enumerate(lives):
        later = lives[index + 1 :]
        end = _last_sign(life)
        if later:
            # What it did after the next start is not this incarnation's time (an in-process
            # restore's heartbeats go on under the old id until the new one is agreed).
            end = max(life.started_at, min(end, later[0].started_at))
            totals[Cause.DOWN] += later[0].started_at - end
        _split_life(life, end, later, facts, totals, saves, followed=bool(later))
    wall = _last_sign(lives[-1]) - lives[0].started_at if lives else 0.0
    measured_wait = any(w.between_s is not None for life in lives for w in life.windows)
    categories = []
    for cause in Cause:
        seconds: float | None = totals[cause]
        how = HOW[cause]
        if cause is Cause.DATA_WAIT and not measured_wait and lives:
            seconds, how = None, "not measured: the hook recorded no data wait (it is counted as productive)"
        categories.append(Category(cause, seconds, how))
    return Goodput(wall, tuple(categories), tuple(saves), interruptions=max(0, len(lives) - 1))


def _last_sign(life: Life) -> float:
    return max(life.ended_at, life.started_at, life.windows[-1].time if life.windows else life.started_at)


def _split_life(
    life: Life,
    end: float,
    later: Sequence[Life],
    facts: GoodputFacts,
    totals: dict[Cause, float],
    saves: list[float],
    *,
    followed: bool,
) -> None:
    windows = [w for w in life.windows if w.time <= end]
    stalls = _stalls_of(life.incarnation, facts)
    if not windows:
        # Never reached a window: all of it was start-up (or a hang in start-up).
        _tail(life, life.started_at, end, stalls, facts, totals, saves, followed=followed, startup=True)
        return
    computes = [max(0.0, (w.time - p.time) - (w.between_s or 0.0)) for p, w in itertools.pairwise(windows)]
    typical = statistics.median(computes) if computes else 0.0
    first_start = max(life.started_at, windows[0].time - typical)
    totals[Cause.STARTUP_RESTORE] += first_start - life.started_at
    redo = _redone_from(windows, later)
    previous_end = first_start
    for window in windows:
        span = window.time - previous_end
        taken = _take_stalls(stalls, previous_end, window.time, span, totals, saves)
        # The first window's wait is the stop before it, already start-up and restore.
        between = 0.0 if window is windows[0] else min(max(window.between_s or 0.0, 0.0), span)
        wait = max(0.0, between - taken)
        totals[Cause.DATA_WAIT] += wait
        compute = max(0.0, span - taken - wait)
        totals[redo.get(window.step, Cause.PRODUCTIVE)] += compute
        previous_end = window.time
    _tail(life, previous_end, end, stalls, facts, totals, saves, followed=followed, startup=False)


def _tail(
    life: Life,
    start: float,
    end: float,
    stalls: list[tuple[Cause, Stall | Span]],
    facts: GoodputFacts,
    totals: dict[Cause, float],
    saves: list[float],
    *,
    followed: bool,
    startup: bool,
) -> None:
    """From the last window (or the start) to the incarnation's end."""
    span = max(0.0, end - start)
    taken = _take_stalls(stalls, start, end, span, totals, saves)
    rest = span - taken
    detected = facts.hang_detections.get(life.incarnation)
    if detected is not None and start < detected:
        hung = min(rest, min(detected, end) - start)
        totals[Cause.HUNG] += hung
        rest -= hung
    if startup:
        totals[Cause.STARTUP_RESTORE if not followed else Cause.DOWN] += rest
    else:
        totals[Cause.DOWN if followed else Cause.OTHER] += rest


def _stalls_of(incarnation: str, facts: GoodputFacts) -> list[tuple[Cause, Stall | Span]]:
    found: list[tuple[Cause, Stall | Span]] = [
        (Cause.CHECKPOINT_SAVE, s) for s in facts.checkpoints if s.incarnation == incarnation
    ]
    found += [(Cause.CANARY, s) for s in facts.canaries if s.incarnation == incarnation]
    found += [(Cause.HOLD, s) for s in facts.holds if s.incarnation == incarnation]
    return found


def _take_stalls(
    stalls: list[tuple[Cause, Stall | Span]],
    start: float,
    end: float,
    span: float,
    totals: dict[Cause, float],
    saves: list[float],
) -> float:
    """Attribute the stalls inside (start, end] to their causes, at most ``span`` in all."""
    taken = 0.0
    for cause, stall in stalls:
        if isinstance(stall, Span):
            part = max(0.0, min(stall.end, end) - max(stall.start, start))
        elif start < stall.end <= end:
            began = start if stall.seconds is None else max(start, stall.end - stall.seconds)
            part = stall.end - began
        else:
            continue
        part = min(part, span - taken)
        if part <= 0:
            continue
        taken += part
        totals[cause] += part
        if cause is Cause.CHECKPOINT_SAVE:
            saves.append(part)
    return taken


def _redone_from(windows: Sequence[Window], later: Sequence[Life]) -> dict[int, Cause]:
    """This incarnation's steps a later one went back over (its first window's step at or
    before them): redone, after a rollback or after a restart (the first such later one)."""
    firsts = [(min(w.step for w in life.windows), life.by_rollback) for life in later if life.windows]
    redone: dict[int, Cause] = {}
    for window in windows:
        for first, by_rollback in firsts:
            if first <= window.step:
                redone[window.step] = Cause.REDONE_ROLLBACK if by_rollback else Cause.REDONE_RESTART
                break
    return redone
