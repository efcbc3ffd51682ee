"""Points in a stream's timeline: a CUDA event on a GPU, a wall-clock reading on the CPU.

The hook records a marker where a phase begins and after each host copy, and reads it only once
``query()`` says the device got there. A CUDA event is recorded on the current stream and
queried without blocking; a wall marker is complete the moment it is recorded, so the same
code runs on a CPU-only machine with wall times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol


class Marker(Protocol):
    def record(self) -> None:
        """Mark this point of the (current) stream; markers are reused, so this re-arms."""

    def query(self) -> bool:
        """True once the stream has passed the mark; never blocks."""

    def wait(self) -> None:
        """Block until the stream has passed the mark (only where a wait is acceptable)."""

    def seconds_since(self, earlier: Any) -> float:
        """Time between ``earlier`` and this marker; both must have completed."""


MarkerFactory = Callable[[], Marker]


class WallMarker:
    """A CPU-side marker: complete when recorded, timed with ``perf_counter``."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def seconds_since(self, earlier: WallMarker) -> float:
        return self.at - earlier.at


class CudaMarker:
    """A CUDA event with timing, recorded on the current stream."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        import torch

        self.event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def record(self) -> None:
        # cudaEventRecord only enqueues the mark: no synchronization.
        self.event.record()

    def query(self) -> bool:
        # cudaEventQuery returns at once, done or not: no synchronization.
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        # A real wait (cudaEventSynchronize): callers use it only at close, or when the device
        # is a whole ring of windows behind the host (see ``PinnedRing.push``).
        self.event.synchronize()

    def seconds_since(self, earlier: CudaMarker) -> float:
        # cudaEventElapsedTime on two completed events reads their timestamps: no
        # synchronization (callers query() first; an incomplete event raises instead).
        return float(earlier.event.elapsed_time(self.event)) / 1000.0


def marker_factory(device_type: str) -> MarkerFactory:
    """CUDA events on a CUDA device, wall markers anywhere else."""
    return CudaMarker if device_type == "cuda" else WallMarker
