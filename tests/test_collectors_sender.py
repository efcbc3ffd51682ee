"""The sender while the service cannot take its batches: jittered retries that spread ranks
apart, a 429's Retry-After honoured with the batch kept, and the training thread never waiting."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from collectors.backoff import rank_seed
from collectors.counters import Counters
from collectors.sender import Sender, SenderConfig
from collectors.spool import Spool, SpoolConfig
from collectors.transport import Delivery, Outcome
from collectors.wire import Record
from tests.collectors_support import wait_until

DELIVERED = Delivery(Outcome.DELIVERED, 200)
DOWN = Delivery(Outcome.RETRY, None, "ConnectionRefusedError: [Errno 111] Connection refused")


def shed(retry_after_s: float | None) -> Delivery:
    return Delivery(Outcome.RETRY, 429, "429 overloaded: busy", retry_after_s=retry_after_s)


def step(attempt: int) -> dict[str, Any]:
    return {"kind": "step", "incarnation": "inc-1", "rank": 0, "attempt": attempt, "step": attempt,
            "time": 1_700_000_000.0 + attempt}  # fmt: skip


class ScriptedTransport:
    """Answers each batch of records with ``answer(n)`` (n: the batches posted before it),
    heartbeats with ``heartbeat``; notes when each was posted."""

    def __init__(self, answer: Callable[[int], Delivery], heartbeat: Delivery = DELIVERED) -> None:
        self._answer = answer
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        self.batches: list[tuple[float, list[Record]]] = []
        self.heartbeats: list[float] = []
        self.delivered: list[Record] = []

    def post(self, records: Sequence[Record]) -> Delivery:
        now = time.monotonic()
        with self._lock:
            if all(record["kind"] == "heartbeat" for record in records):
                self.heartbeats.append(now)
                return self._heartbeat
            delivery = self._answer(len(self.batches))
            self.batches.append((now, list(records)))
            if delivery.outcome is Outcome.DELIVERED:
                self.delivered += records
            return delivery

    def close(self) -> None:
        return None

    def times(self) -> list[float]:
        with self._lock:
            return [at for at, _ in self.batches]


def make_sender(
    tmp_path: Path,
    name: str,
    transport: ScriptedTransport,
    counters: Counters,
    seed: int | None,
    **config: Any,
) -> Sender:
    spool = Spool(SpoolConfig(directory=str(tmp_path / "spool"), fsync=False), "r", name, counters)
    settings = {"flush_interval_s": 0.05, "heartbeat_interval_s": 60.0, "close_timeout_s": 0.5, **config}
    return Sender(SenderConfig(**settings), transport, spool, counters, seed=seed)


def first_retries(tmp_path: Path, senders: int, jitter: bool) -> list[float]:
    """``senders`` ranks lose the service together (each's first batch refused at once); the
    time from each one's first try to its second."""
    transports = [ScriptedTransport(lambda _n: DOWN) for _ in range(senders)]
    ranks = [
        make_sender(
            tmp_path / str(jitter),
            f"n.rank{rank}",
            transport,
            Counters(),
            rank_seed("r", "i", rank),
            retry_initial_s=1.0,
            retry_max_s=8.0,
            retry_jitter=jitter,
            close_timeout_s=0.0,
        )
        for rank, transport in enumerate(transports)
    ]
    for sender in ranks:
        sender.submit(step(1))
    for sender in ranks:
        sender.start()
    assert wait_until(lambda: all(len(t.times()) >= 2 for t in transports), 30.0)
    for sender in ranks:
        sender.close()
    return [t.times()[1] - t.times()[0] for t in transports]


def test_senders_that_lost_the_service_together_retry_spread_over_the_interval(tmp_path: Path) -> None:
    """Each first retry is a draw from [0, 1 s] (full jitter, seeded per rank): 24 ranks spread
    over most of the second, where the plain doubling sends every one at 1 s."""
    spread = first_retries(tmp_path, 24, jitter=True)
    assert max(spread) - min(spread) > 0.5, sorted(spread)
    assert statistics.pstdev(spread) > 0.15, sorted(spread)
    plain = first_retries(tmp_path, 24, jitter=False)
    assert min(plain) >= 0.99, sorted(plain)  # never before its delay


def test_a_429_keeps_the_batch_and_resends_it_after_retry_after_plus_jitter(tmp_path: Path) -> None:
    transport = ScriptedTransport(lambda n: shed(1.0) if n == 0 else Delivery(Outcome.DELIVERED, 200))
    counters = Counters()
    sender = make_sender(tmp_path, "n.rank0", transport, counters, seed=5, retry_initial_s=0.2)
    for attempt in range(1, 6):
        sender.submit(step(attempt))
    sender.start()
    assert wait_until(lambda: len(transport.delivered) == 5, 30.0)
    assert sender.close()
    first, second = transport.times()[:2]
    assert second - first >= 1.0  # Retry-After, and the jitter's draw on top
    assert [record["attempt"] for record in transport.delivered] == [1, 2, 3, 4, 5]
    snapshot = counters.snapshot()
    assert (snapshot["shed"], snapshot["spooled"], snapshot["replayed"]) == (1, 5, 5)
    assert snapshot["dropped"] == snapshot["dead_lettered"] == snapshot["sent"] == 0


def test_heartbeats_go_on_while_the_service_sheds_load(tmp_path: Path) -> None:
    """Shed (429), the service is up: the rank's heartbeats still go, or it would look hung."""
    transport = ScriptedTransport(lambda n: shed(2.0) if n == 0 else Delivery(Outcome.DELIVERED, 200))
    counters = Counters()
    spool = Spool(SpoolConfig(directory=str(tmp_path / "spool"), fsync=False), "r", "n.rank0", counters)
    sender = Sender(
        SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=0.1, retry_initial_s=0.1),
        transport,
        spool,
        counters,
        heartbeat=lambda: {"kind": "heartbeat", "incarnation": "inc-1", "rank": 0},
        seed=1,
    )
    sender.submit(step(1))
    sender.start()
    assert wait_until(lambda: len(transport.delivered) == 1, 30.0)
    sender.close()
    first, second = transport.times()[:2]
    during = [at for at in transport.heartbeats if first < at < second]
    assert second - first >= 2.0 and len(during) >= 3, (second - first, len(during))


def test_a_retry_after_past_the_limit_is_honoured_up_to_the_limit(tmp_path: Path) -> None:
    transport = ScriptedTransport(lambda n: shed(86_400.0) if n == 0 else Delivery(Outcome.DELIVERED, 200))
    counters = Counters()
    sender = make_sender(
        tmp_path, "n.rank0", transport, counters, seed=2, retry_initial_s=0.1, retry_after_max_s=0.5
    )
    sender.submit(step(1))
    sender.start()
    assert wait_until(lambda: len(transport.delivered) == 1, 30.0)  # not a day
    sender.close()
    first, second = transport.times()[:2]
    assert second - first >= 0.5


def test_the_training_thread_never_waits_for_a_shedding_service(tmp_path: Path) -> None:
    """Every batch refused with a 30 s Retry-After: ``submit`` still only appends (a sleep on
    the training thread would take 30 s), and every record is kept in the spool."""
    transport = ScriptedTransport(lambda _n: shed(30.0))
    counters = Counters()
    sender = make_sender(tmp_path, "n.rank0", transport, counters, seed=3, batch_records=50)
    sender.submit(step(0))
    sender.start()
    assert wait_until(lambda: len(transport.times()) >= 1, 10.0)
    started = time.monotonic()
    for attempt in range(1, 2001):
        sender.submit(step(attempt))
    submitting_s = time.monotonic() - started
    assert submitting_s < 2.0, submitting_s
    assert not sender.close()  # undelivered at close: kept on disk
    snapshot = counters.snapshot()
    assert snapshot["dropped"] == 0 and snapshot["sent"] == 0
    assert snapshot["spooled"] == 2001 and snapshot["shed"] == 1
    assert len(transport.times()) == 1  # no second try inside the 30 s


def test_a_heartbeat_due_with_a_batch_goes_in_it_and_never_sets_its_records_aside(tmp_path: Path) -> None:
    """One request a cycle, not two: the heartbeat rides last in the cycle's first batch. A
    batch refused as invalid is sent again without it, so a heartbeat the service names is
    never what dead-letters the records (the heartbeat counts as failed; the next supersedes it)."""
    posts: list[list[str]] = []
    answers = iter([
        DELIVERED,
        Delivery(Outcome.REJECTED, 422, "422 invalid_record: record 2", bad_indexes=(2,)),
        DELIVERED,
    ])  # fmt: skip

    class Recording:
        def post(self, records: Sequence[Record]) -> Delivery:
            posts.append([record["kind"] for record in records])
            return next(answers)

        def close(self) -> None:
            return None

    counters = Counters()
    spool = Spool(SpoolConfig(directory=str(tmp_path / "spool"), fsync=False), "r", "n.rank0", counters)
    sender = Sender(
        SenderConfig(heartbeat_interval_s=0.001),
        Recording(),
        spool,
        counters,
        heartbeat=lambda: {"kind": "heartbeat", "incarnation": "inc-1", "rank": 0},
    )
    for cycle in range(2):
        sender.submit(step(2 * cycle + 1))
        sender.submit(step(2 * cycle + 2))
        time.sleep(0.01)  # the heartbeat is due
        sender._cycle()
    assert posts == [["step", "step", "heartbeat"], ["step", "step", "heartbeat"], ["step", "step"]]
    snapshot = counters.snapshot()
    assert (snapshot["sent"], snapshot["dead_lettered"], snapshot["spooled"]) == (4, 0, 0)
    assert (snapshot["heartbeats_sent"], snapshot["heartbeats_failed"]) == (1, 1)
