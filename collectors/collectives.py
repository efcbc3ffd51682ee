"""The attach-time collectives, and nothing per step.

Two at most, both at attach: one broadcast of rank 0's incarnation id and run name, and, only
when the embedded service is used, one all-gather by which each rank learns its node's service.
They use the default process group, so every rank must attach (as every rank trains).
"""

from __future__ import annotations

from typing import Any, Protocol


class Collectives(Protocol):
    world_size: int

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""


class Solo:
    """A world of one (no process group): the collectives are identities."""

    world_size = 1

    def broadcast(self, value: Any) -> Any:
        return value

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


class TorchCollectives:
    """``torch.distributed`` object collectives on the default group.

    Under NCCL these stage the pickled objects on the current CUDA device, so the trainer must
    have called ``torch.cuda.set_device`` first, as it must for its own collectives.
    """

    def __init__(self, dist: Any) -> None:
        self._dist = dist
        self.world_size = int(dist.get_world_size())

    def broadcast(self, value: Any) -> Any:
        objects = [value]
        self._dist.broadcast_object_list(objects, src=0)
        return objects[0]

    def all_gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(gathered, value)
        return gathered


def collectives_for(torch: Any) -> Collectives:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return TorchCollectives(dist)
    return Solo()
