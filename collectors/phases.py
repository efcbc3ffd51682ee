"""Where the training thread is: the current phase for heartbeats, phase times per window.

``enter`` is called from the training thread at each phase change. It replaces one immutable
``PhaseState`` (a single reference assignment, so the sender thread always reads a consistent
pair) and stamps the change: with a CUDA event on a GPU, with the thread's CPU time on the CPU
(``CpuStamps`` says why). A window's stamps are read for its timings only once the window's ring
slot completed, so its events have completed too (same stream, recorded earlier).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from collectors.markers import CudaMarker


class Phase(enum.StrEnum):
    IDLE = "idle"  # attached, no window yet
    DATA = "data"  # between windows or microbatches: waiting for the next batch
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # clipping, the optimizer step, the scheduler
    CLOSED = "closed"


class PhaseState(NamedTuple):
    """Immutable, and cheaper to make than a dataclass: one is made per phase change."""

    phase: Phase
    since: float  # perf_counter seconds; ``PhaseClock.epoch`` converts


class Stamps(Protocol):
    """How phase changes are timed: a stamp per change, seconds between two stamps."""

    def stamp(self, now: float) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def release(self, stamps: list[Any]) -> None: ...


class WallStamps:
    """CPU: the ``perf_counter`` reading ``enter`` took anyway."""

    def stamp(self, now: float) -> float:
        return now

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, stamps: list[Any]) -> None:
        return None


class CpuStamps:
    """CPU: the training thread's CPU time. On a GPU the device's own clock times its work; on
    the CPU the thread's CPU time is that clock's analog: a rank the OS gives less of a shared
    core is not a slow device, and time blocked in a collective (gloo waits, it does not spin)
    is not compute. Data wait is wall time, measured apart (``RunHealth.windows``)."""

    def stamp(self, now: float) -> float:
        return time.thread_time()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, stamps: list[Any]) -> None:
        return None


class CudaStamps:
    """GPU: a timing event recorded on the current stream (no sync); events are pooled, since
    creating one per phase change would cost more than recording it."""

    def __init__(self) -> None:
        self._pool: list[CudaMarker] = []

    def stamp(self, now: float) -> CudaMarker:
        marker = self._pool.pop() if self._pool else CudaMarker()
        marker.record()
        return marker

    def seconds(self, start: CudaMarker, end: CudaMarker) -> float:
        return end.seconds_since(start)

    def release(self, stamps: list[Any]) -> None:
        self._pool.extend(stamps)  # from the sender thread: a single list operation, atomic


def stamps_for(device_type: str) -> Stamps:
    return CudaStamps() if device_type == "cuda" else CpuStamps()


class PhaseMarks(NamedTuple):
    """A window's phase changes, in order; the last one only closes the one before it."""

    marks: tuple[tuple[Phase, Any], ...]
    complete: bool  # False when the window had more changes than the clock keeps

    def durations(self, stamps: Stamps) -> dict[Phase, float] | None:
        if not self.complete or len(self.marks) < 2:
            return None
        spent = dict.fromkeys((Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER), 0.0)
        for (phase, start), (_, end) in zip(self.marks, self.marks[1:], strict=False):
            if phase in spent:
                spent[phase] += stamps.seconds(start, end)
        return spent


class PhaseClock:
    """Training-thread phase changes, at most ``max_marks`` a window (two per microbatch, plus
    three); past it the window's timings are reported as unknown rather than guessed."""

    def __init__(self, stamps: Stamps, max_marks: int, wall: Callable[[], float] = time.time) -> None:
        self.stamps = stamps
        self.host_timed = isinstance(stamps, WallStamps | CpuStamps)  # stamps complete when taken
        self._wall = isinstance(stamps, WallStamps)  # the perf_counter reading is the stamp
        self._max_marks = max_marks
        self._marks: list[tuple[Phase, Any]] = []
        self._overflow = False
        now = time.perf_counter()
        self._epoch_offset = wall() - now
        self.state = PhaseState(Phase.IDLE, now)

    def enter(self, phase: Phase) -> None:
        # Called several times per step on the training thread: kept to a handful of operations.
        if phase is self.state[0]:
            return
        now = time.perf_counter()
        self.state = PhaseState(phase, now)
        if len(self._marks) < self._max_marks:
            self._marks.append((phase, now if self._wall else self.stamps.stamp(now)))
        else:
            self._overflow = True

    def epoch(self, perf_seconds: float) -> float:
        """A ``perf_counter`` reading as epoch seconds (what heartbeats carry)."""
        return self._epoch_offset + perf_seconds

    def take_window(self) -> PhaseMarks:
        """The marks since the last call; whoever reads them releases them afterwards."""
        taken = PhaseMarks(tuple(self._marks), complete=not self._overflow)
        self._marks, self._overflow = [], False
        return taken

    def release(self, taken: PhaseMarks) -> None:
        self.stamps.release([stamp for _, stamp in taken.marks])
