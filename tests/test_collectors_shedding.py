"""Many ranks' senders against a real ``runhealth serve`` that holds one batch at a time: the
service sheds the rest with 429 and Retry-After, the senders keep what was shed and send it
again, and every record ends stored exactly once (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.backoff import rank_seed
from collectors.counters import Counters
from collectors.sender import Sender, SenderConfig
from collectors.spool import Spool, SpoolConfig
from collectors.transport import HttpTransport, TransportConfig
from monitor.store import migrate
from tests.collectors_support import ServeProcess, step_rows, store_engine
from tests.support import BACKENDS, PostgresServer

RANKS = 12
RECORDS_PER_RANK = 200
BATCH = 50  # records a POST: about 9 KB, over the exempt size set below


def step(rank: int, attempt: int) -> dict[str, Any]:
    return {"kind": "step", "incarnation": "inc-1", "rank": rank, "attempt": attempt, "step": attempt,
            "time": 1_700_000_000.0 + attempt, "tokens": 4096, "loss_sum": 8192.0}  # fmt: skip


def shed_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "runhealth_ingest_shed_batches_total":
                return float(sample.value)
    raise AssertionError("runhealth_ingest_shed_batches_total not exported")


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Path | Any:
    if request.param == "sqlite":
        return tmp_path / "store.db"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_database()
    engine = store_engine(url)
    migrate.upgrade(engine)  # `runhealth db upgrade`, as a PostgreSQL store needs before serve
    engine.dispose()
    return url


@pytest.mark.slow
def test_a_service_that_sheds_load_stores_every_record_exactly_once(
    tmp_path: Path, store: Any, request: pytest.FixtureRequest
) -> None:
    serve = ServeProcess(
        tmp_path,
        store,
        RUNHEALTH_INGEST__SHEDDING__MAX_IN_FLIGHT_BATCHES="1",
        RUNHEALTH_INGEST__SHEDDING__RETRY_AFTER_S="1",
        RUNHEALTH_INGEST__SHEDDING__EXEMPT_BYTES="512",
    )
    serve.start()
    request.addfinalizer(serve.stop)
    token = serve.create_run("shed")
    senders, counters = [], []
    for rank in range(RANKS):
        counted = Counters()
        transport = HttpTransport(TransportConfig(url=serve.url, token=token, run="shed", timeout_s=10.0))
        spool = Spool(SpoolConfig(directory=str(tmp_path / "spool")), "shed", f"n.rank{rank}", counted)
        config = SenderConfig(
            batch_records=BATCH,
            flush_interval_s=0.05,
            retry_initial_s=0.05,
            retry_max_s=0.5,
            close_timeout_s=120.0,
        )
        senders.append(Sender(config, transport, spool, counted, seed=rank_seed("shed", "inc-1", rank)))
        counters.append(counted)
        for attempt in range(RECORDS_PER_RANK):
            senders[-1].submit(step(rank, attempt))
    started = time.monotonic()
    for sender in senders:  # every rank at once, each with its whole backlog to send
        sender.start()
    closed: list[bool] = []
    closers = [threading.Thread(target=lambda s=sender: closed.append(s.close())) for sender in senders]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(150.0)
    elapsed_s = time.monotonic() - started
    assert closed == [True] * RANKS, "a sender was left with records undelivered"
    stored = step_rows(store, "shed")
    keys = sorted((row["rank"], row["attempt"]) for row in stored)
    assert keys == [(rank, attempt) for rank in range(RANKS) for attempt in range(RECORDS_PER_RANK)]
    shed_by_ranks = sum(c.snapshot()["shed"] for c in counters)
    assert shed_by_ranks > 0 and shed_total(serve.url) == shed_by_ranks
    for counted in counters:
        snapshot = counted.snapshot()
        assert snapshot["dropped"] == snapshot["dead_lettered"] == snapshot["hook_errors"] == 0, snapshot
        assert snapshot["sent"] + snapshot["replayed"] == RECORDS_PER_RANK, snapshot
    print(
        f"\n{RANKS} senders x {RECORDS_PER_RANK // BATCH} batches of {BATCH}, one batch in flight: "
        f"{shed_by_ranks} batches shed (429), {len(stored)} records stored once each, {elapsed_s:.1f} s"
    )
