"""The sender thread: batches records, delivers them or spools them, replays, heartbeats.

The training thread only appends to a bounded in-memory queue; everything that can block
(HTTP, fsync) happens here. Order is kept: while the spool holds anything, new batches join its
tail instead of overtaking it, and the spool is replayed from its head once the service answers.
While the service cannot take a batch (down, or shedding load with 429), the sender waits a
jittered, growing delay (``backoff.py``), and at least what the service's ``Retry-After`` asked,
before it tries again; the batch waits in the spool meanwhile, so a refusal loses nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from collectors.backoff import Backoff
from collectors.counters import Counters
from collectors.spool import MemorySpool, Spool
from collectors.transport import Delivery, Outcome
from collectors.wire import Draft, NotRendered, Record

log = logging.getLogger("runhealth.collectors.sender")


class Transport(Protocol):
    def post(self, records: Sequence[Record]) -> Delivery: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SenderConfig:
    """Batching, pacing and bounds of the sender thread.

    ``batch_records``: 500 per POST, far under the service's 50,000-record limit, so one batch
    stays a few hundred kilobytes. ``flush_interval_s``: 2 s, the most a record waits in memory
    when batches do not fill. A POST costs the trainer's process about 0.45 ms of CPU (measured
    on the reference CPU right after training steps); one every 2 s is under 10 us per 20 ms
    step, and records still land well inside one heartbeat interval.
    ``heartbeat_interval_s``: 5 s (``RUNHEALTH_HEARTBEAT_S``): a hang is visible within seconds,
    while a 10,000-rank job sends 2,000 heartbeats a second at most.
    ``queue_records``: 10,000 (a few MB of dicts); the queue only fills if this thread is stuck,
    because it drains the queue to the spool while the service is down. Past it: dropped, counted.
    ``retry_initial_s``/``retry_max_s``: while the service is down, the n-th failed attempt in a
    row waits a draw from [0, min(10 s, 0.5 s x 2**n)] (``retry_jitter``: "full jitter", from the
    AWS Architecture Blog's "Exponential Backoff And Jitter", 2015: of the schemes it simulated
    for clients competing for one server, the fewest calls and about the shortest time to get
    through). An outage costs a rank a few requests a minute, a restart is noticed within 10 s,
    and ranks that lost the service together ask again spread over the interval instead of all
    at once: each rank draws from a generator seeded by its run, incarnation and rank.
    ``retry_jitter`` False waits the bound itself, the plain doubling (for comparison).
    ``retry_after_max_s``: 60 s, the most a service's ``Retry-After`` (on a 429 or 503) is
    honoured; the sender waits what it asks plus a jittered delay as above, so ranks shed
    together do not come back together. A longer ask (a proxy's, a misconfigured service's
    day) would leave the records on disk and the service blind to the run for that long.
    ``replay_batches_per_cycle``: 16, so heartbeats keep their clock during a long replay.
    ``close_timeout_s``: 30 s at close to deliver what is left; the rest stays spooled on disk.
    """

    batch_records: int = 500
    flush_interval_s: float = 2.0
    heartbeat_interval_s: float = 5.0
    queue_records: int = 10_000
    retry_initial_s: float = 0.5
    retry_max_s: float = 10.0
    retry_jitter: bool = True
    retry_after_max_s: float = 60.0
    replay_batches_per_cycle: int = 16
    close_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        positive = {
            "flush_interval_s": self.flush_interval_s,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "retry_initial_s": self.retry_initial_s,
            "retry_max_s": self.retry_max_s,
            "retry_after_max_s": self.retry_after_max_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SenderConfig.{name} must be > 0, got {value}")
        if min(self.batch_records, self.queue_records, self.replay_batches_per_cycle) < 1:
            raise ValueError("SenderConfig: batch, queue and replay sizes must be >= 1")
        if self.close_timeout_s < 0:
            raise ValueError("SenderConfig.close_timeout_s must be >= 0")


class Sender:
    """One per rank. ``submit`` from any thread; everything else runs on the sender thread."""

    def __init__(
        self,
        config: SenderConfig,
        transport: Transport,
        spool: Spool | MemorySpool,
        counters: Counters,
        *,
        heartbeat: Callable[[], Record | None] = lambda: None,
        poll: Callable[[], None] = lambda: None,
        directives: Callable[[list[dict[str, Any]]], None] = lambda items: None,
        prepare: Callable[[list[Draft]], None] = lambda drafts: None,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        grid_phase_s: float | None = None,
    ) -> None:
        self._config = config
        self._transport = transport
        self._spool = spool
        self._counters = counters
        self._heartbeat = heartbeat
        self._poll = poll
        self._directives = directives
        self._prepare = prepare  # once per batch, before its drafts are rendered one by one
        self._clock = clock
        self._queue: deque[Record | Draft] = deque()
        # ``submit`` runs on the training thread every step: its limits read without a chain.
        self._queue_records, self._batch_records = config.queue_records, config.batch_records
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runhealth-sender", daemon=True)
        self._down_until = 0.0
        # Why it is down: True when the service answered 429 (it is up, shedding load), so
        # heartbeats still go: a rank whose heartbeats stopped would look hung.
        self._shed = False
        # ``seed``: the rank's (``backoff.rank_seed``), so ranks draw different delays.
        self._backoff = Backoff(
            config.retry_initial_s, config.retry_max_s, jitter=config.retry_jitter, seed=seed
        )
        self._next_heartbeat = 0.0
        self._logged: set[str] = set()
        # With a node relay: flushes and heartbeats fall on a grid of the flush interval at this
        # phase of the (host-wide) monotonic clock, the same for every rank of the node, so the
        # relay finds the node's batches together. None: every flush interval from the last.
        self._grid_phase_s = grid_phase_s

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def spool_path(self) -> Path:
        return self._spool.path

    def start(self) -> None:
        self._thread.start()

    def submit(self, record: Record | Draft) -> None:
        """Queue a record (or a draft rendered here later); never blocks. A full queue drops
        the record and counts it."""
        queue = self._queue
        if len(queue) >= self._queue_records:
            self._counters.add("dropped")
            self._log_once("queue_full", "the record queue is full: dropping records")
            return
        queue.append(record)
        if len(queue) >= self._batch_records:
            self._wake.set()

    def close(self) -> bool:
        """Deliver what is left within the close timeout; spool the rest; stop the thread.
        True when nothing is left undelivered (nothing queued, nothing spooled)."""
        self._closing.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self._config.close_timeout_s + 10.0)
        elif self._thread.ident is None:  # never started: still keep every record
            self._final_flush()
        if self._thread.is_alive():  # stuck past its timeout: leave its files to it
            log.error("runhealth sender did not finish within its close timeout")
            return False
        delivered = not self._queue and not self._spool.backlog()
        self._transport.close()
        self._spool.close()
        return delivered

    # The thread.

    def _run(self) -> None:
        while not self._closing.is_set():
            self._wake.wait(self._sleep_s())
            self._wake.clear()
            self._guarded(self._cycle)
        self._guarded(self._final_flush)

    def _cycle(self) -> None:
        self._poll()
        if not self._down():
            self._replay()
        beat = self._due_heartbeat()
        if not self._move_queue(beat) and beat is not None:
            self._send_heartbeat(beat)

    def _final_flush(self) -> None:
        deadline = self._clock() + self._config.close_timeout_s
        self._poll()
        while self._queue or self._spool.backlog():
            if not self._down():
                self._replay()
            self._move_queue()
            if not self._spool.backlog() or self._clock() >= deadline:
                break
            time.sleep(max(0.0, min(self._down_until, deadline) - self._clock()) or 0.01)
        self._move_queue()  # anything still queued reaches the spool: nothing is lost at close
        self._maybe_heartbeat(force=True)  # the last word: the rank's final phase

    def _sleep_s(self) -> float:
        now = self._clock()
        wait = min(self._next_flush(now) - now, self._next_heartbeat - now)
        if self._down_until > now:  # wake when the drawn delay ends, not at the next flush:
            wait = min(wait, self._down_until - now)  # ranks' flushes tick together
        return max(0.0, wait)

    def _next_flush(self, now: float) -> float:
        """When the next cycle is due: a flush interval on, or the grid's next point."""
        interval = self._config.flush_interval_s
        if self._grid_phase_s is None:
            return now + interval
        return self._grid_phase_s + (math.floor((now - self._grid_phase_s) / interval) + 1) * interval

    # Delivery.

    def _move_queue(self, beat: Record | None = None) -> bool:
        """Send (or spool) what is queued; True when ``beat``, a heartbeat due this cycle, went
        with the first batch sent: one request instead of two."""
        # Only what was queued when the cycle began: while the trainer refills the queue, a slow
        # service would otherwise keep this thread here, and heartbeats and directive polls
        # (the rest of the cycle) would wait for the training to end.
        left = len(self._queue)
        carried = False
        while left > 0:
            batch, taken = self._take(left)
            left -= taken
            if not batch:
                continue
            if self._spool.backlog() or self._down():
                self._spool.append(batch)  # behind the backlog: nothing overtakes the spool
                continue
            if beat is not None and not carried:
                carried = True
                rest = self._deliver_with_heartbeat(batch, beat)
            else:
                rest = self._deliver(batch, "sent")
            if rest:
                self._spool.append(rest)
        return carried

    def _replay(self) -> None:
        for _ in range(self._config.replay_batches_per_cycle):
            batch = self._spool.head()
            if batch is None:
                return
            if self._deliver(batch.records, "replayed"):
                return  # down again; the batch stays at the head
            self._spool.advance(batch)

    def _deliver(self, records: Sequence[Record], counter: str) -> list[Record]:
        """Post ``records``; return those still to be delivered later (service down)."""
        if not records:
            return []
        return self._settle(records, self._post(records), counter)

    def _deliver_with_heartbeat(self, batch: Sequence[Record], beat: Record) -> list[Record]:
        """``batch`` with the heartbeat last. The heartbeat is state, never spooled or
        dead-lettered: when the batch is not delivered it counts as failed (the next one
        supersedes it), and a batch refused as invalid is sent again without it, so the
        heartbeat can never be what sets the batch's records aside."""
        delivery = self._post([*batch, beat])
        delivered = delivery.outcome is Outcome.DELIVERED
        self._counters.add("heartbeats_sent" if delivered else "heartbeats_failed")
        if delivery.outcome is Outcome.REJECTED:
            return self._deliver(batch, "sent")
        return self._settle(batch, delivery, "sent")

    def _post(self, records: Sequence[Record]) -> Delivery:
        try:
            return self._transport.post(records)
        except Exception as exc:  # a transport's own failure: the batch is kept, with why
            return self._transport_failed(exc)

    def _settle(self, records: Sequence[Record], delivery: Delivery, counter: str) -> list[Record]:
        """What the answer means for ``records``: those still to be delivered later."""
        if delivery.outcome is Outcome.DELIVERED:
            self._counters.add(counter, len(records))
            self._mark_up()
            if delivery.directives is not None:
                self._directives(delivery.directives)
            return []
        if delivery.outcome is Outcome.RETRY:
            if delivery.status == 429:
                self._counters.add("shed")
            self._mark_down(delivery)
            return list(records)
        return self._rejected(records, delivery, counter)

    def _transport_failed(self, exc: Exception) -> Delivery:
        """A connection error is the service's (kept for later); anything else the batch's
        or the transport's: dead-lettered with the error, never lost with the cycle."""
        self._counters.add("hook_errors")
        self._log_once("transport", f"the transport failed: {type(exc).__name__}: {exc}")
        if isinstance(exc, OSError):
            return Delivery(Outcome.RETRY, None, f"{type(exc).__name__}: {exc}")
        return Delivery(Outcome.REJECTED, None, f"not sent: {type(exc).__name__}: {exc}")

    def _rejected(self, records: Sequence[Record], delivery: Delivery, counter: str) -> list[Record]:
        """Split what the service called too large; set aside what it named; keep the rest."""
        if delivery.status == 413 and len(records) > 1:
            half = len(records) // 2
            rest = self._deliver(records[:half], counter)
            return rest + list(records[half:]) if rest else self._deliver(records[half:], counter)
        named = {i for i in delivery.bad_indexes if i < len(records)}
        if named and len(named) < len(records):
            self._spool.dead_letter([records[i] for i in sorted(named)], delivery.reason, delivery.status)
            kept = [record for i, record in enumerate(records) if i not in named]
            return self._deliver(kept, counter)
        self._spool.dead_letter(records, delivery.reason, delivery.status)
        self._log_once(f"rejected-{delivery.status}", f"batch dead-lettered: {delivery.reason}")
        return []

    def _take(self, limit: int) -> tuple[list[Record], int]:
        """Up to ``limit`` queued items as one batch, and how many items were taken (a record
        that fails to render is taken but not sent)."""
        queue = self._queue  # only this thread takes from it: its length only grows meanwhile
        items = [queue.popleft() for _ in range(min(limit, self._config.batch_records, len(queue)))]
        drafts = [item for item in items if isinstance(item, Draft)]
        if drafts:
            self._prepare_drafts(drafts)
        batch: list[Record] = []
        for item in items:
            record = self._render(item) if isinstance(item, Draft) else item
            if record is not None:
                batch.append(record)
        return batch, len(items)

    def _prepare_drafts(self, drafts: list[Draft]) -> None:
        try:
            self._prepare(drafts)
        except Exception:  # each draft still renders on its own, only slower
            self._counters.add("hook_errors")
            if "prepare" not in self._logged:
                self._logged.add("prepare")
                log.exception("runhealth sender: preparing a batch failed (logged once)")

    def _render(self, draft: Draft) -> Record | None:
        """The draft's record; one that fails to render (a value it cannot read) is not lost
        with nothing on disk: what names it is dead-lettered with the error, and the batch
        around it goes on."""
        try:
            return draft.render()
        except NotRendered as exc:  # counted where it failed
            self._set_aside([identify(draft)], f"not rendered: {exc}"[:2000])
        except Exception as exc:
            self._counters.add("hook_errors")
            if "render" not in self._logged:
                self._logged.add("render")
                log.exception("runhealth sender: rendering a record failed (logged once)")
            self._set_aside([identify(draft)], f"not rendered: {type(exc).__name__}: {exc}"[:2000])
        return None

    def _set_aside(self, records: list[Record], reason: str) -> None:
        try:
            self._spool.dead_letter(records, reason, None)
        except OSError:  # no disk for it either: counted, and the batch around it goes on
            self._counters.add("dropped", len(records))
            log.error("runhealth sender: could not dead-letter %d records (%s)", len(records), reason)

    # Heartbeats: state, not history. One that cannot be delivered is superseded by the next,
    # so it is counted, never spooled.

    def _maybe_heartbeat(self, force: bool = False) -> None:
        record = self._due_heartbeat(force)
        if record is not None:
            self._send_heartbeat(record)

    def _due_heartbeat(self, force: bool = False) -> Record | None:
        now = self._clock()
        if now < self._next_heartbeat and not force:
            return None
        self._next_heartbeat = now + self._config.heartbeat_interval_s
        if self._grid_phase_s is not None:  # on the grid, never later than the interval: the
            # node's heartbeats go in one cycle, together
            self._next_heartbeat = self._next_flush(self._next_heartbeat - self._config.flush_interval_s)
        return self._heartbeat()

    def _send_heartbeat(self, record: Record) -> None:
        if self._down() and not self._shed:
            self._counters.add("heartbeats_failed")
            return
        delivery = self._transport.post([record])
        if delivery.outcome is Outcome.DELIVERED:
            self._counters.add("heartbeats_sent")
            return
        self._counters.add("heartbeats_failed")
        if delivery.outcome is Outcome.RETRY:
            self._mark_down(delivery)

    # Service state.

    def _down(self) -> bool:
        return self._clock() < self._down_until

    def _mark_down(self, delivery: Delivery) -> None:
        """Wait before the next try: the jittered backoff, after what the service asked."""
        delay = self._backoff.next_delay_s()
        if delivery.retry_after_s is not None:
            delay += min(delivery.retry_after_s, self._config.retry_after_max_s)
        self._down_until = max(self._down_until, self._clock() + delay)
        self._shed = delivery.status == 429
        if self._shed:
            self._log_once("shed", f"the service is shedding load ({delivery.reason}); spooling to disk")
        else:
            self._log_once("down", f"the service does not take records ({delivery.reason}); spooling to disk")

    def _mark_up(self) -> None:
        if self._down_until:
            log.info("the service is back; replaying the spool")
            self._logged.difference_update(("down", "shed"))
        self._down_until = 0.0
        self._shed = False
        self._backoff.reset()

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # the thread must outlive any one failure
            self._counters.add("hook_errors")
            if "cycle" not in self._logged:
                self._logged.add("cycle")
                log.exception("runhealth sender: a cycle failed (logged once)")

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("runhealth: %s", message)


def identify(draft: Draft) -> Record:
    try:
        return draft.identify()
    except Exception:  # what names it failed too: its type still says what was lost
        return {"kind": type(draft).__name__}
