"""Record producers that run beside the trainer (NVML, link counters): the plumbing they use.

A sampler samples on its own thread and clock, off the step path, and hands each record to the
sink it was built with. The hook's sink is ``RunHealth.submit``: it queues the record for the
sender and never blocks (before attach it keeps records, bounded, and sends them at attach).

    rh = RunHealth(model=model, optimizer=optimizer).start()
    rh.add_sampler(NvmlReader(rh.submit, rank=rh.identity.rank, node=rh.identity.node,
                              device_uuid=rh.identity.device_uuid))

The hook starts a sampler when it is added to an attached hook (or at attach), and stops it
before its own last flush, so the sampler's final records are delivered too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

RecordSink = Callable[[dict[str, Any]], None]


@runtime_checkable
class Sampler(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...
