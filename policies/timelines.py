"""The loss a run logged at each of its recent steps, timeline by timeline.

A restart onto a step the run had already passed (a resume from an older checkpoint, a rollback)
starts a new timeline over steps an earlier one logged, so what the replayed steps log can be
compared with what the run logged at the same steps: exact values, not medians of the steps
before (early in a run the loss falls by percents a step, and such a level lags what the run had
at the step itself).

Rows are kept in logging order, in chunks of ``CHUNK``: a full chunk is a pair of ``array``
objects that is never changed again (states share it), and only the open chunk is copied by a
push, so a push costs O(``CHUNK``) and a kept row 16 bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

CHUNK = 64


@dataclass(frozen=True)
class Timeline:
    """One stretch of the run between restarts."""

    start: int
    """Its first row's position among every row ever kept."""
    first_step: int
    cut: int | None = None
    """The step of its first finding that a rollback answers (a spike, a NaN): the steps from
    there on are what a rollback abandons, no reference for a replay of them."""


@dataclass(frozen=True)
class Timelines:
    """The last rows of the run (at least the ``capacity`` given to ``push``) and the
    timelines they belong to."""

    chunks: tuple[tuple[array[int], array[float]], ...] = ()
    """Full chunks of (steps, losses), oldest first; never changed once made."""
    open_steps: tuple[int, ...] = ()
    open_losses: tuple[float, ...] = ()
    dropped: int = 0
    """Rows dropped from the front (whole chunks)."""
    timelines: tuple[Timeline, ...] = ()

    @property
    def end(self) -> int:
        """The position the next row will have."""
        return self.dropped + CHUNK * len(self.chunks) + len(self.open_steps)

    def begin(self, step: int) -> Timelines:
        """A new timeline from ``step`` on: the run's first row, or a restart."""
        return replace(self, timelines=(*self.timelines, Timeline(self.end, step)))

    def push(self, step: int, loss: float, capacity: int) -> Timelines:
        """One logged row of the current timeline; rows past the newest ``capacity`` go, a
        chunk at a time."""
        if not self.timelines:
            return self.begin(step).push(step, loss, capacity)
        steps, losses, chunks = (*self.open_steps, step), (*self.open_losses, loss), self.chunks
        if len(steps) == CHUNK:
            chunks, steps, losses = (*chunks, (array("q", steps), array("d", losses))), (), ()
        dropped = self.dropped
        if chunks and CHUNK * (len(chunks) - 1) + len(steps) >= capacity:
            chunks, dropped = chunks[1:], dropped + CHUNK
        timelines = self.timelines
        while len(timelines) > 1 and timelines[1].start <= dropped:
            timelines = timelines[1:]  # every row of the oldest one is gone
        return Timelines(chunks, steps, losses, dropped, timelines)

    def cut(self, step: int) -> Timelines:
        """The current timeline's steps from ``step`` on are no reference (the earliest cut
        stays)."""
        if not self.timelines:
            return self
        current = self.timelines[-1]
        if current.cut is not None and current.cut <= step:
            return self
        return replace(self, timelines=(*self.timelines[:-1], replace(current, cut=step)))

    def uncut(self) -> Timelines:
        """The current timeline's steps are a reference again: what was found in them was the
        restart that began it (a broken resume), not something a rollback abandons."""
        if not self.timelines or self.timelines[-1].cut is None:
            return self
        return replace(self, timelines=(*self.timelines[:-1], replace(self.timelines[-1], cut=None)))

    def reference(self, restart_step: int, steps: Sequence[int]) -> tuple[float, ...] | None:
        """What the run logged at ``steps`` before the current timeline (which restarted at
        ``restart_step``): the values of the newest earlier timeline that went through
        ``restart_step`` (began before it and logged a step at or after it: the one that
        saved the checkpoint the restart loaded), each step before that timeline's cut. None
        when no timeline went through it or it did not log every one of ``steps`` there."""
        for index in range(len(self.timelines) - 2, -1, -1):
            timeline = self.timelines[index]
            if timeline.first_step >= restart_step:
                continue  # began at or after it: another resume of the same checkpoint
            rows = list(self._rows(index))
            if not any(step >= restart_step for step, _ in rows):
                continue
            usable = {step: loss for step, loss in rows if timeline.cut is None or step < timeline.cut}
            found = tuple(usable[step] for step in steps if step in usable)
            return found if len(found) == len(steps) else None
        return None

    def _rows(self, index: int) -> Iterator[tuple[int, float]]:
        """The kept (step, loss) rows of timeline ``index``, in logging order."""
        following = self.timelines[index + 1].start if index + 1 < len(self.timelines) else self.end
        for position in range(
            max(self.timelines[index].start, self.dropped) - self.dropped, following - self.dropped
        ):
            chunk, offset = divmod(position, CHUNK)
            if chunk < len(self.chunks):
                yield self.chunks[chunk][0][offset], self.chunks[chunk][1][offset]
            else:
                yield self.open_steps[offset], self.open_losses[offset]


__all__ = ["CHUNK", "Timeline", "Timelines"]
