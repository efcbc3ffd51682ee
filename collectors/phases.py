"""Where the training thread is: the current phase for heartbeats, phase times per window.

``enter`` is called from the training thread at each phase change. It replaces one immutable
mark (a single reference assignment, so the sender thread always reads a consistent phase and
time) and stamps the change: with a CUDA event on a GPU, with the thread's CPU time on the CPU
(``CpuStamps`` says why). A window's stamps are read for its timings only once the window's ring
slot completed, so its events have completed too (same stream, recorded earlier).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from collectors.markers import CudaMarker


class Phase(enum.StrEnum):
    IDLE = "idle"  # attached, no window yet
    DATA = "data"  # between windows or microbatches: waiting for the next batch
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # clipping, the optimizer step, the scheduler
    HELD = "held"  # paused by a hold directive between windows, until it is released
    SAVING = "saving"  # a checkpoint save the trainer declared, until ``checkpoint_saved``
    COMPILING = "compiling"  # torch.compile at work on the training thread (``compiles.py``)
    CLOSED = "closed"


class PhaseState(NamedTuple):
    """The current phase, as heartbeats read it."""

    phase: Phase
    since: float  # perf_counter seconds; ``PhaseClock.epoch`` converts


class Stamps(Protocol):
    """How phase changes are timed: a stamp per change, seconds between two stamps."""

    def stamp(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def release(self, stamps: list[Any]) -> None: ...


class WallStamps:
    """Wall time (``perf_counter``): tests, and any host clock that is not the thread's."""

    # The builtin itself, not a method: ``PhaseClock`` calls it with no Python frame between.
    stamp = staticmethod(time.perf_counter)

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, stamps: list[Any]) -> None:
        return None


class CpuStamps:
    """CPU, several ranks: the training thread's CPU time. On a GPU the device's own clock times
    its work; on the CPU the thread's CPU time is that clock's analog: a rank the OS gives less
    of a shared core is not a slow device, and time blocked in a collective (gloo waits, it does
    not spin) is not compute. Data wait is wall time, measured apart (``RunHealth.windows``),
    and each phase's wall time is sent beside its CPU time (``wall_durations``): a rank that
    sleeps, waits on I/O or is preempted uses no CPU while it waits, and shows only there.
    Reading it is a system call, about 7 us right after a training step on the reference CPU
    (0.4 us warm), four times a step: paid only where ranks are compared (``stamps_for``)."""

    stamp = staticmethod(time.thread_time)  # as in ``WallStamps``: no Python frame per stamp

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, stamps: list[Any]) -> None:
        return None


class CudaStamps:
    """GPU: a timing event recorded on the current stream (no sync); events are pooled, since
    creating one per phase change would cost more than recording it."""

    def __init__(self) -> None:
        self._pool: list[CudaMarker] = []

    def stamp(self) -> CudaMarker:
        marker = self._pool.pop() if self._pool else CudaMarker()
        marker.record()
        return marker

    def seconds(self, start: CudaMarker, end: CudaMarker) -> float:
        return end.seconds_since(start)

    def release(self, stamps: list[Any]) -> None:
        self._pool.extend(stamps)  # from the sender thread: a single list operation, atomic


def stamps_for(device_type: str, world_size: int) -> Stamps:
    """CUDA events on a GPU. On the CPU, the thread's CPU time when there are several ranks:
    they share the host's cores and block in collectives, and the straggler rule compares
    them. A single process has no peer to be compared with and nothing to block on: wall time,
    which costs no system call."""
    if device_type == "cuda":
        return CudaStamps()
    return CpuStamps() if world_size > 1 else WallStamps()


# One phase change: (phase, perf_counter seconds, stamp). A plain tuple, made once per change
# and used both as the current state and as the window's mark: on the training thread each
# object made costs a few microseconds once a training step has evicted the caches.
Mark = tuple[Phase, float, Any]


def durations(marks: Sequence[Mark], complete: bool, stamps: Stamps) -> dict[Phase, float] | None:
    """Seconds per timed phase of a window's marks (in order; the last one only closes the one
    before it), as ``PhaseClock.take_window`` gives them; None when they are incomplete."""
    if not complete or len(marks) < 2:
        return None
    spent = dict.fromkeys(TIMED, 0.0)
    for (phase, _, start), (_, _, end) in itertools.pairwise(marks):
        if phase in spent:
            spent[phase] += stamps.seconds(start, end)
    return spent


TIMED = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def wall_durations(marks: Sequence[Mark], complete: bool) -> dict[Phase, float] | None:
    """Wall seconds per timed phase, from the ``perf_counter`` reading every mark carries
    anyway (no clock read of its own); None when the marks are incomplete. Sent beside thread
    CPU phases (``PhaseClock.wall_apart``): a rank that waits (sleeps, blocks on I/O, is
    preempted) shows in wall time only."""
    if not complete or len(marks) < 2:
        return None
    spent = dict.fromkeys(TIMED, 0.0)
    for (phase, start, _), (_, end, _) in itertools.pairwise(marks):
        if phase in spent:
            spent[phase] += end - start
    return spent


class PhaseClock:
    """Training-thread phase changes, at most ``max_marks`` a window (two per microbatch, plus
    three); past it the window's timings are reported as unknown rather than guessed."""

    def __init__(self, stamps: Stamps, max_marks: int, wall: Callable[[], float] = time.time) -> None:
        self.stamps = stamps
        self.host_timed = not isinstance(stamps, CudaStamps)  # stamps complete when taken
        # Thread CPU phases: their wall times are sent too (``wall_durations``).
        self.wall_apart = isinstance(stamps, CpuStamps)
        self.stamp = stamps.stamp  # bound once: marks are taken several times a step
        self.max_marks = max_marks
        # The window's marks. The hook's step-path entry points inline ``enter`` (a method call
        # costs there), without its checks: each marks a different phase, and each runs at
        # most once per microbatch, so the list is bounded by ``bound`` at every fold of
        # microbatches and by ``take_window``.
        self.marks: list[Mark] = []
        self.overflow = False
        self._wall = wall
        now = time.perf_counter()
        self._epoch_offset = wall() - now
        # Replaced whole by the training thread (one reference assignment), read by the sender
        # thread: always a consistent (phase, since) pair.
        self.current: Mark = (Phase.IDLE, now, None)

    def enter(self, phase: Phase) -> None:
        # Called several times per step on the training thread: a handful of operations, one
        # tuple, no Python call besides this one.
        if phase is self.current[0]:
            return
        mark = (phase, time.perf_counter(), self.stamp())
        self.current = mark
        if len(self.marks) < self.max_marks:
            self.marks.append(mark)
        else:
            self.overflow = True

    @property
    def state(self) -> PhaseState:
        """The current phase and since when (heartbeats, on the sender thread)."""
        phase, since, _ = self.current
        return PhaseState(phase, since)

    @property
    def since(self) -> float:
        """When the current phase began (``perf_counter`` seconds)."""
        return self.current[1]

    def epoch(self, perf_seconds: float) -> float:
        """A ``perf_counter`` reading as epoch seconds (what heartbeats and records carry)."""
        return self._epoch_offset + perf_seconds

    def resync(self) -> None:
        """Take the wall clock's offset again (the sender thread, each cycle): a wall clock
        stepped during a long run moves the epoch times of what is read after it. Moves under
        a millisecond are the two readings' jitter and are left alone, so a stuck rank's
        ``phase_since`` stays the same number."""
        offset = self._wall() - time.perf_counter()
        if abs(offset - self._epoch_offset) > 1e-3:
            self._epoch_offset = offset

    def take_window(self) -> tuple[Sequence[Mark], bool]:
        """The marks since the last call and whether they are complete (``durations`` reads
        them); whoever reads them releases them afterwards. The list itself changes hands
        (no copy): this clock starts a new one. Written out again in
        ``WindowAccounting.window_end`` (a CPU rank's window: calling this and ``_advance``
        there measured 13 us more a step): keep the two in step."""
        taken = self.marks, not self.overflow and len(self.marks) <= self.max_marks
        self.marks, self.overflow = [], False
        return taken

    def bound(self) -> None:
        """Past ``max_marks`` the window's timings are unknown: its extra marks are dropped."""
        extra = self.marks[self.max_marks :]
        if extra:
            del self.marks[self.max_marks :]
            self.overflow = True
            self.release(extra)

    def release(self, marks: Sequence[Mark]) -> None:
        if not self.host_timed:  # host stamps are plain numbers: nothing to give back
            self.stamps.release([stamp for _, _, stamp in marks])
