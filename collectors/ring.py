"""A small ring of host buffers that device values reach without a host-device sync.

At the end of a window the hook packs its device scalars (loss sum, token count, grad norm,
loss scale) into one tensor, copies it with ``non_blocking=True`` into a slot's host buffer and
records a marker after the copy. The slot is read once ``marker.query()`` is True, typically a
window later; nothing on this path waits for the device. On a CUDA device the host buffers are
pinned: a non-blocking copy into pageable memory would be a synchronous copy.

Not thread-safe on its own: the hook serializes access (the sender thread also drains it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from collectors.markers import Marker, MarkerFactory

if TYPE_CHECKING:
    import torch

Meta = TypeVar("Meta")


@dataclass(frozen=True)
class RingConfig:
    """Sizes of the ring.

    ``slots``: 8. A trainer's host thread is usually at most one or two windows ahead of the
    device (a GradScaler step, clipping with a finite check or logging all synchronize), so
    slots are read long before the ring wraps; 8 leaves room for a trainer with no sync at all.
    A full ring waits for its oldest slot (see ``PinnedRing.pop_oldest``).
    ``width``: 8 float64 values per window; a window packs at most seven (loss sum, token
    count, reported-loss sum, grad norm, loss scale, a tensor learning rate, a fused optimizer's
    found-inf flag).
    """

    slots: int = 8
    width: int = 8

    def __post_init__(self) -> None:
        if self.slots < 1 or self.width < 1:
            raise ValueError(f"RingConfig: slots and width must be >= 1, got {self}")


@dataclass
class _Slot(Generic[Meta]):
    host: torch.Tensor
    done: Marker
    meta: Meta | None = None
    count: int = 0


class PinnedRing(Generic[Meta]):
    """Slots in push order; each carries host-side metadata beside its device values."""

    def __init__(self, config: RingConfig, *, device: torch.device, new_marker: MarkerFactory) -> None:
        import torch

        self._torch = torch
        pin = device.type == "cuda"
        # Asynchronous only where a CUDA event tells when the copy landed. Elsewhere the marker
        # is a wall clock, complete when recorded, and another accelerator's async copy to host
        # memory can still be in flight when the slot is read (MPS's is: pytorch/pytorch#139550
        # and #189690 show such copies reading or giving wrong values): a blocking copy, correct
        # at the cost of one wait a window on those devices.
        self._non_blocking = pin
        self._free = [
            _Slot[Meta](torch.empty(config.width, dtype=torch.float64, pin_memory=pin), new_marker())
            for _ in range(config.slots)
        ]
        self._busy: deque[_Slot[Meta]] = deque()
        self._width = config.width

    @property
    def full(self) -> bool:
        return not self._free

    def __len__(self) -> int:
        return len(self._busy)

    def push(self, values: Sequence[torch.Tensor], meta: Meta) -> None:
        """Start copying 0-dim device ``values`` to the host; on a CUDA device never waits for
        it (elsewhere the copy is blocking: see ``__init__``)."""
        if len(values) > self._width:
            raise ValueError(f"{len(values)} values do not fit a ring slot of {self._width}")
        slot = self._free.pop()
        if values:
            # One stack and one copy per window, however many values: each device op costs a
            # launch. float64 keeps token counts exact and holds any float dtype losslessly, if
            # each value reaches it unrounded: a plain stack first promotes them all to the
            # widest input type, and beside a bf16 or fp16 loss that is a half type (bf16 rounds
            # 32,767 tokens to 32,768; fp16 makes 100,001 inf). ``_pack`` avoids that.
            packed = self._pack(values)
            # On CUDA, non_blocking into pinned memory: an async D2H copy, no synchronization.
            slot.host[: len(values)].copy_(packed, non_blocking=self._non_blocking)
        # Recorded after the copy on the same stream: complete means the copy landed.
        slot.done.record()
        slot.meta, slot.count = meta, len(values)
        self._busy.append(slot)

    def _pack(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The values as one float64 device tensor. All fp32 or fp64: one fused stack and one
        cast, exact. Otherwise each is converted into the float64 tensor as it is stacked (a
        copy kernel each, which a stack of mixed types launches anyway)."""
        lib = self._torch  # the module, imported at run time (the name is the type here)
        dtype = values[0].dtype
        if dtype in (lib.float32, lib.float64) and all(value.dtype is dtype for value in values):
            stacked: torch.Tensor = lib.stack(list(values)).to(lib.float64)
            return stacked
        packed: torch.Tensor = lib.empty(len(values), dtype=lib.float64, device=values[0].device)
        if any(value.requires_grad for value in values):  # a stack into ``out`` refuses them
            values = [value.detach() for value in values]
        lib.stack(list(values), out=packed)
        return packed

    def pop_ready(self) -> list[tuple[Meta, list[float]]]:
        """Every slot whose copy has completed, oldest first, stopping at the first pending."""
        ready = []
        while self._busy and self._busy[0].done.query():
            ready.append(self._release(self._busy.popleft()))
        return ready

    def pop_oldest(self) -> tuple[Meta, list[float]]:
        """The oldest slot, waiting for its copy if need be.

        Only when the ring is full, or at close. A full ring means the device is ``slots``
        windows behind the host: the wait blocks the host only while the device still has
        those windows queued, so the device does not idle because of it.
        """
        slot = self._busy.popleft()
        slot.done.wait()
        return self._release(slot)

    def drain(self) -> list[tuple[Meta, list[float]]]:
        """Everything, waiting as needed (close time: a sync here is fine)."""
        return [self.pop_oldest() for _ in range(len(self._busy))]

    def _release(self, slot: _Slot[Meta]) -> tuple[Meta, list[float]]:
        # Host memory: no sync. Nothing to read for a window without device values (a CPU run):
        # even an empty tolist() is a tensor op, and that costs on every step.
        meta, values = slot.meta, slot.host[: slot.count].tolist() if slot.count else []
        slot.meta = None
        self._free.append(slot)
        assert meta is not None
        return meta, values
