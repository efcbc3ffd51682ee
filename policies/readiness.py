"""When a window is ready to judge: every rank of its world reported, or its missing ranks
are given up on.

A window judged too early is judged without a rank whose records are still on the way, and
a fault on that rank goes unseen (its records then arrive late); a window that waits for a
dead rank stalls judgement for the whole run. Three clocks tell them apart: record times (the
trainers'), attempts (how far the run has moved on), and the service's own clock (how long the
window has waited here). Windows are judged in attempt order, so one that must wait holds back
every later window of its incarnation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class ReadinessConfig:
    """How long a window waits for its missing ranks.

    ``watermark_attempts`` 2 and ``watermark_s``: a window is judged with the ranks it has once
    a window this many attempts later has arrived and the newest record's time is this many
    seconds past the window's, so a dead rank cannot stall judgement; and the window itself has
    waited that long at this service (its first sighting, by the service's clock), so ranks
    replaying their spools after an outage are not given up on while they catch up. Each rank's
    sender batches records for up to its flush interval, so in steady state some rank is
    routinely that far behind the others: ``watermark_s`` is ``watermark_flushes`` (2) of the
    interval the run's hook states in its run_start record plus ``watermark_slack_s`` (1 s),
    else ``watermark_s`` (5 s: the hook's default 2 s interval). Attempts alone judged a quarter
    of a 4-rank scenario's windows without their late rank, which hid a corrupted batch.
    ``idle_watermarks`` 2: a run that paused, waits for a decision or ended sends nothing
    newer, so on the periodic pass a window whose newest record is two watermarks old (by the
    service's clock) is ready too.
    """

    watermark_attempts: int = 2
    watermark_s: float = 5.0
    watermark_flushes: float = 2.0
    watermark_slack_s: float = 1.0
    idle_watermarks: float = 2.0

    def __post_init__(self) -> None:
        if self.watermark_attempts < 1:
            raise ValueError("ReadinessConfig: watermark_attempts must be >= 1")
        if min(self.watermark_s, self.watermark_flushes, self.watermark_slack_s, self.idle_watermarks) < 0:
            raise ValueError(
                "ReadinessConfig: watermark_s, watermark_flushes, watermark_slack_s and"
                " idle_watermarks must be >= 0"
            )

    def watermark_for(self, flush_s: float | None) -> float:
        """The watermark of an incarnation whose hook stated ``flush_s`` (None: it did not)."""
        if flush_s is None:
            return self.watermark_s
        return self.watermark_flushes * flush_s + self.watermark_slack_s


def expected_ranks(declared: int | None, guessed: int | None, prior: int, seen: int) -> int:
    """The ranks an incarnation's windows wait for: the world size its run-start record
    declared; until that arrives (a new incarnation's first records can come from any rank,
    before rank 0's run start), the earlier guess or else ``prior`` (the run's newest declared
    world size), raised to the most ranks yet seen in one window. A guess of one rank judged a
    resumed incarnation's windows on whichever rank reported first, the others arriving late."""
    if declared is not None:
        return declared
    return max(prior if guessed is None else guessed, seen)


@dataclass(frozen=True)
class PendingWindow:
    """An unjudged window as the readiness decision sees it."""

    attempt: int
    ranks_reported: int
    last_time: float
    """The newest record time in the window (the trainers' clock)."""
    first_seen: float
    """When this service first saw the window waiting (its own clock)."""


@dataclass(frozen=True)
class IncarnationWindows:
    """One incarnation's unjudged windows and what they wait for."""

    incarnation: str
    windows: Sequence[PendingWindow]
    expected_ranks: int
    watermark_s: float


class Readiness(StrEnum):
    COMPLETE = "complete"
    """Every expected rank reported."""
    GIVEN_UP = "given_up"
    """Judged without its missing ranks: the run moved on (or went quiet) a watermark past it."""
    RESTARTED = "restarted"
    """A newer incarnation started: this one's ranks send nothing more."""
    WAIT = "wait"


@dataclass(frozen=True)
class WindowReadiness:
    incarnation: str
    attempt: int
    readiness: Readiness
    missing_ranks: int
    """Expected ranks that have not reported (judged without them when given up on)."""


@dataclass(frozen=True)
class _Pass:
    """What one pass over the newest incarnation's windows measures each window against."""

    group: IncarnationWindows
    newest_attempt: int
    newest_time: float
    seen_now: float
    """The service's clock at this pass."""
    now: float | None
    """The same clock on the periodic pass, when a run that went quiet is judged too; None
    when records just arrived."""


def _readiness(window: PendingWindow, this: _Pass, config: ReadinessConfig) -> Readiness:
    """One window of the newest incarnation, on its own (``ready_windows`` keeps the order)."""
    if window.ranks_reported >= this.group.expected_ranks:
        return Readiness.COMPLETE
    wait_s = this.group.watermark_s
    # A missing rank is given up on only once the window has also waited here that long: after
    # an outage the ranks' spools are replayed in bursts, one rank's far ahead of the others',
    # and record times alone would judge the windows between without the ranks still replaying
    # (a bad batch on one of them went unseen).
    if this.seen_now - window.first_seen < wait_s:
        return Readiness.WAIT
    overtaken = (
        window.attempt <= this.newest_attempt - config.watermark_attempts
        and this.newest_time - window.last_time >= wait_s
    )
    quiet = this.now is not None and this.now - window.last_time >= config.idle_watermarks * wait_s
    return Readiness.GIVEN_UP if overtaken or quiet else Readiness.WAIT


def ready_windows(
    incarnations: Sequence[IncarnationWindows],
    seen_now: float,
    now: float | None,
    config: ReadinessConfig,
) -> list[WindowReadiness]:
    """The windows to judge now, in the order to judge them. ``incarnations``: in the order
    they began, the newest last.

    A job that restarted sends nothing more for the incarnations before its newest, so their
    windows are all ready and come first: judged after the new one's, they would look like one
    more restart. The newest incarnation's windows are judged in attempt order up to the first
    that must wait.
    """
    if not incarnations:
        return []
    *older, newest = incarnations
    ready = [
        WindowReadiness(group.incarnation, w.attempt, Readiness.RESTARTED, _missing(w, group))
        for group in older
        for w in sorted(group.windows, key=lambda w: w.attempt)
    ]
    if not newest.windows:
        return ready
    # Measured once per pass: a backlog of thousands of windows is judged in one.
    this = _Pass(
        newest,
        newest_attempt=max(w.attempt for w in newest.windows),
        newest_time=max(w.last_time for w in newest.windows),
        seen_now=seen_now,
        now=now,
    )
    for window in sorted(newest.windows, key=lambda w: w.attempt):
        verdict = _readiness(window, this, config)
        if verdict is Readiness.WAIT:
            break  # judge in order: a later window waits for this one
        ready.append(WindowReadiness(newest.incarnation, window.attempt, verdict, _missing(window, newest)))
    return ready


def _missing(window: PendingWindow, group: IncarnationWindows) -> int:
    return max(0, group.expected_ranks - window.ranks_reported)
