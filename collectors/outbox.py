"""Where the hook's occasional records wait until the rank is attached.

Samplers' records and checkpoint or resume events can be handed over before ``start``: they
are kept (bounded by the sender's queue size) and sent at attach, in order, after rank 0's run
start. Events learn their origin (incarnation, rank) when they are sent. Step records, acks and
dumps are only made once attached and go to the sender directly.
"""

from __future__ import annotations

from collectors import records
from collectors.sender import Sender
from collectors.wire import Record


class Outbox:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._early: list[Record | records.Event] = []
        self._sender: Sender | None = None
        self._closed = False
        self.origin: records.Origin | None = None

    def open(self, sender: Sender, origin: records.Origin) -> None:
        """Attached: what was kept is sent now, in the order it came."""
        self._sender, self.origin = sender, origin
        for kept in self._early:
            if isinstance(kept, records.Event):
                self.submit_event(kept)
            else:
                sender.submit(kept)
        self._early.clear()

    def close(self) -> None:
        """Closed: later records are dropped (the sender is gone)."""
        self._sender, self._closed = None, True

    def submit(self, record: Record) -> None:
        """A wire-safe record, from any thread; never blocks."""
        if self._sender is not None:
            self._sender.submit(record)
        else:
            self._keep(record)

    def submit_event(self, event: records.Event) -> None:
        """A checkpoint or resume event: the store keys checkpoints by path, so only rank 0's
        checkpoint events are sent."""
        origin = self.origin
        if self._sender is None or origin is None:
            self._keep(event)
        elif not event.is_checkpoint or origin.rank == 0:
            self._sender.submit(records.with_origin(event, origin))

    def _keep(self, kept: Record | records.Event) -> None:
        if not self._closed and len(self._early) < self._limit:
            self._early.append(kept)
