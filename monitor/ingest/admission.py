"""Load shedding at ingest: a bound on the batches in flight, and what a refused batch is told.

A batch the API takes is held while its body is read, validated, written (one writer at a time)
and judged, and newer batches wait behind it. Past some depth the wait only grows: every waiting
batch answers later, the hooks' requests time out (10 s) and they send the same batches again,
which is the same work twice. So past a bound a new batch is answered at once with 429 and a
``Retry-After``, before its body is read: nothing of it is stored, and the hook keeps it in its
spool and sends it again after a jittered wait (``collectors.sender``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from monitor.errors import ConfigError


@dataclass(frozen=True)
class SheddingConfig:
    """When the service sheds ingest load (``ingest.shedding``,
    ``RUNHEALTH_INGEST__SHEDDING__...``).

    ``max_in_flight_batches``: 64. Issue 18 measured about 20,000 records/s into SQLite on two
    cores, 40 of the hook's 500-record batches a second: 64 waiting batches are about 1.6 s of
    the writer's work, well inside the hook's 10 s request timeout, so a batch that is admitted
    is answered before its sender gives up on it. One job's ranks on the embedded service (one
    POST per rank every 2 s) stay far below it; it also bounds the bodies held in memory
    (64 x ``max_batch_bytes`` at worst, about 20 MB of typical batches).
    ``retry_after_s``: 2, the header's whole seconds: about the time the writer takes to work
    through a full queue (1.6 s, above). The hook waits that plus its own jittered delay, so the
    ranks refused together come back spread over the following seconds.
    ``exempt_bytes``: 8192. A batch that declares a body this small (a heartbeat is about 300
    bytes, a directive acknowledgement or a run start as little) is never shed: it is too little
    work to matter, and a rank whose heartbeats were refused would look hung
    (``policies.hangs``: 15 s of silence). It still counts as in flight.
    """

    max_in_flight_batches: int = 64
    retry_after_s: int = 2
    exempt_bytes: int = 8192

    def __post_init__(self) -> None:
        for name, least in (("max_in_flight_batches", 1), ("retry_after_s", 1), ("exempt_bytes", 0)):
            value = getattr(self, name)
            if value < least:
                raise ConfigError(f"ingest.shedding.{name} must be >= {least}, got {value}")


@dataclass(frozen=True)
class AdmissionState:
    """What ``/metrics`` reads: batches in flight now, and batches shed since the start."""

    in_flight: int
    shed: int


class IngestAdmission:
    """Admits a batch while fewer than the bound are in flight; counts those it sheds.

    Thread-safe: the API admits on its event loop, ``/metrics`` reads from a worker thread.
    """

    def __init__(self, config: SheddingConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._in_flight = 0
        self._shed = 0

    def admit(self, declared_bytes: int | None) -> bool:
        """True: the batch is in flight until ``release``. False: shed (answer 429). A body of
        unknown length (chunked) is not taken for small."""
        small = declared_bytes is not None and declared_bytes <= self.config.exempt_bytes
        with self._lock:
            if self._in_flight >= self.config.max_in_flight_batches and not small:
                self._shed += 1
                return False
            self._in_flight += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def state(self) -> AdmissionState:
        with self._lock:
            return AdmissionState(self._in_flight, self._shed)
