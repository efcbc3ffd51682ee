"""What the hook did with its records, counted, for ``RunHealth.counters``."""

from __future__ import annotations

import threading
from collections import Counter

# The names every snapshot carries, zero when nothing happened, so a dashboard or a test can
# read any of them without a default.
COUNTER_NAMES = (
    "sent",  # records the service accepted on first delivery
    "spooled",  # records written to the local spool while the service was down or slow
    "replayed",  # spooled records later delivered
    "dead_lettered",  # records the service rejected as invalid, kept with the reason
    "dropped",  # records lost: the spool was at its disk limit, or the queue was full
    "shed",  # batches the service refused with 429 (shedding load): kept, sent again later
    "heartbeats_sent",
    "heartbeats_failed",  # heartbeats not delivered; the next one supersedes them
    "hook_errors",  # exceptions caught at a hook entry point
    "ring_waits",  # windows whose values the host had to wait for (device far behind)
    "spool_unreadable",  # spool lines that could not be parsed (a torn write), skipped
    "relay_posts",  # local rank 0: requests its node relay made to the service
    "relay_batches",  # local rank 0: the node's batches those requests carried
    "relay_bypassed",  # batches this rank sent directly because its node's relay did not answer
)


class Counters:
    """Named counts shared by the training thread and the sender thread."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTER_NAMES})
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
