"""Writing batches by COPY on PostgreSQL (``monitor.ingest.postgres_copy``): the same answers as
the row-by-row INSERT path on the same PostgreSQL, and as SQLite, batch by batch.

Each scenario runs on four real stores side by side: an SQLite file, a PostgreSQL database
written by INSERT (``copy=False``), one written by COPY (the default's path for a kind's rows past
``inline_rows``, here every batch) and one written with each batch's rows as arrays inside the
moving statement (the default's path for a few rows, here every batch). What ``ingest_batch``
returns (or raises) and what the tables then hold must be the same on all four.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from monitor.ingest import postgres_copy
from monitor.ingest.batches import ConflictError, ingest_batch
from monitor.ingest.schemas import BatchIn
from monitor.judge.summaries import fold_new_steps
from monitor.store import migrate, models
from monitor.store.db import create_store_engine
from policies.protocol import to_wire
from tests.support import INCARNATION, PostgresServer, make_run, snapshot, step_record

NOW = 5000.0
WRITTEN = ("step_records", "device_samples", "link_samples", "heartbeats", "step_summaries")
KINDS = {"step": "step_records", "device_sample": "device_samples", "link_sample": "link_samples"}

# Text that COPY's text format must escape, or that looks like its NULL marker.
AWKWARD_TEXT = ["tab\there", "new\nline", "carriage\rreturn", "back\\slash", "\\N", "N", "ünïcødé ✓", " "]


@dataclass(frozen=True)
class Store:
    name: str
    engine: Engine
    run_id: int
    copy: bool
    inline_rows: int = 0


@pytest.fixture
def stores(postgres_server: PostgresServer, tmp_path: Path) -> Iterator[list[Store]]:
    urls = {
        "sqlite": (URL.create("sqlite", database=str(tmp_path / "store.db")), False, 0),
        "postgres-insert": (postgres_server.create_database(), False, 0),
        "postgres-copy": (postgres_server.create_database(), True, 0),
        "postgres-inline": (postgres_server.create_database(), True, 100_000),
    }
    made = []
    try:
        for name, (url, copy, inline_rows) in urls.items():
            engine = create_store_engine(url)
            made.append(Store(name, engine, 0, copy))
            migrate.upgrade(engine)
            made[-1] = Store(name, engine, make_run(engine, "run-a").id, copy, inline_rows)
        yield made
    finally:
        for store in made:
            store.engine.dispose()


def outcome(store: Store, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What one batch does, as the service does it (stored and folded in one transaction):
    the result, or the conflict, in a form that compares (NaN by name)."""
    batch = list(BatchIn.model_validate({"records": records}).records)
    try:
        with store.engine.begin() as connection:
            result = ingest_batch(
                connection, store.run_id, batch, NOW, copy=store.copy, inline_rows=store.inline_rows
            )
            fold_new_steps(connection, store.run_id, result.new_rows.get("step", []))
    except ConflictError as conflict:
        return {"conflict": (conflict.index, conflict.kind, conflict.key)}
    return {**result.as_json(), "new_rows": to_wire(result.new_rows)}


def contents(store: Store) -> dict[str, list[Any]]:
    """The written tables' rows without their ids, sorted, NaN by name."""
    found = {}
    with store.engine.connect() as connection:
        for name in WRITTEN:
            table = models.Base.metadata.tables[name]
            columns = [column for column in table.columns if column.name != "id"]
            rows = [to_wire(dict(row._mapping)) for row in connection.execute(sa.select(*columns))]
            found[name] = sorted(rows, key=repr)
    return found


def same_everywhere(stores: list[Store], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch's outcome, the same on every store; so are the tables after it."""
    outcomes = {store.name: outcome(store, records) for store in stores}
    first = outcomes[stores[0].name]
    for name, answer in outcomes.items():
        assert answer == first, name
    tables = {store.name: contents(store) for store in stores}
    for name, held in tables.items():
        assert held == tables[stores[0].name], name
    return first


def awkward_steps(attempt: int, ranks: int = 4) -> list[dict[str, Any]]:
    """A window of step records with every kind of value COPY must carry exactly."""
    nonfinite = ["NaN", "Infinity", "-Infinity", None]
    return [
        step_record(
            rank,
            attempt,
            node=AWKWARD_TEXT[(rank + attempt) % len(AWKWARD_TEXT)],
            device_uuid=f"GPU-{rank}" if rank % 2 else None,
            sample_ids=[rank, f'shard\t{attempt}\\"{rank}', -(2**63)] if rank != 1 else None,
            grad_norm=nonfinite[rank % 4],
            loss_sum=0.1 + rank / 3,  # digits a float must round-trip
            lr=5e-324 if rank == 2 else 3e-4,  # the smallest subnormal
            consumed=2**40 + rank,
            skipped=rank == 3,
            tokens=None if rank == 0 else 1024,
        )
        for rank in range(ranks)
    ]


def samples(seq: int) -> list[dict[str, Any]]:
    return [
        {
            "kind": "device_sample",
            "node": "node-0",
            "device_uuid": f"GPU-{device}",
            "seq": seq,
            "time": 1000.0 + seq,
            "power_w": "NaN" if device else 650.5,
            "counters": {"ecc": {"dbe": 0, "rate": "Infinity"}, "note": "a\tb\\c"},
            "xids": [{"xid": 79, "time": 1000.0}] if device else None,
        }
        for device in range(2)
    ] + [
        {
            "kind": "link_sample",
            "node": "node\n1",
            "device": "mlx5_0",
            "port": 1,
            "seq": seq,
            "time": 1000.0 + seq,
            "state": "ACTIVE",
            "counters": {"symbol_error": seq},
            "saturated": [],
        }
    ]


def heartbeat(rank: int, time: float) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": INCARNATION,
        "rank": rank,
        "phase": "forward",
        "phase_since": time - 1,
        "time": time,
        "node": "node\t0",
    }


# --- the same answers -----------------------------------------------------------------------


def test_new_then_resent_then_mixed_batches_answer_the_same(stores: list[Store]) -> None:
    first = awkward_steps(0) + awkward_steps(1) + samples(1) + [heartbeat(0, 10.0), heartbeat(1, 10.0)]
    assert same_everywhere(stores, first)["accepted"] == len(first)

    resent = same_everywhere(stores, first)
    assert (resent["accepted"], resent["duplicates"]) == (2, len(first) - 2)  # heartbeats are not keyed
    assert resent["new_rows"] == {"step": [], "device_sample": [], "link_sample": []}

    mixed = awkward_steps(1) + awkward_steps(2) + samples(1) + samples(2) + [heartbeat(0, 5.0)]
    answer = same_everywhere(stores, mixed)
    assert answer["duplicates"] == 4 + 3
    assert [(row["rank"], row["attempt"]) for row in answer["new_rows"]["step"]] == [(r, 2) for r in range(4)]


def test_the_stored_values_are_the_sent_ones(stores: list[Store]) -> None:
    same_everywhere(stores, awkward_steps(0, ranks=8))
    copied = next(store for store in stores if store.copy)
    table = models.table_of(models.StepRecord)
    with copied.engine.connect() as connection:
        rows = {row.rank: row for row in connection.execute(sa.select(table))}
    assert [rows[rank].node for rank in range(8)] == AWKWARD_TEXT
    assert rows[0].sample_ids == [0, 'shard\t0\\"0', -(2**63)]
    assert math.isnan(rows[0].grad_norm) and rows[1].grad_norm == math.inf and rows[2].grad_norm == -math.inf
    assert rows[3].grad_norm is None and rows[0].tokens is None
    assert rows[2].lr == 5e-324 and rows[1].loss_sum == 0.1 + 1 / 3
    assert rows[3].skipped is True and rows[1].consumed == 2**40 + 1


def test_a_missing_document_is_stored_as_the_insert_path_stores_it(stores: list[Store]) -> None:
    """A list or document left out is JSON null on both PostgreSQL paths, not SQL NULL on one."""
    same_everywhere(stores, awkward_steps(0) + samples(1))
    counts = []
    for store in stores[1:]:
        with store.engine.connect() as connection:
            counts.append(
                connection.exec_driver_sql(
                    "SELECT (SELECT count(*) FROM step_records WHERE sample_ids IS NULL), "
                    "(SELECT count(*) FROM device_samples WHERE xids IS NULL)"
                ).one()
            )
    assert counts[0] == counts[1] == counts[2]


def test_a_conflict_refuses_the_whole_batch_everywhere(stores: list[Store]) -> None:
    same_everywhere(stores, awkward_steps(0) + samples(1) + [heartbeat(0, 10.0)])
    before = {store.name: to_wire(snapshot(store.engine)) for store in stores}  # NaN by name
    changed = [*awkward_steps(1), *samples(2), heartbeat(0, 20.0), step_record(2, 0, loss_sum=1.0)]
    answer = same_everywhere(stores, changed)
    assert answer == {
        "conflict": (len(changed) - 1, "step", {"incarnation": INCARNATION, "rank": 2, "attempt": 0})
    }
    for store in stores:
        assert to_wire(snapshot(store.engine)) == before[store.name], store.name


def test_of_several_conflicts_the_first_in_the_batch_is_named(stores: list[Store]) -> None:
    same_everywhere(stores, awkward_steps(0, ranks=8))
    changed = [step_record(rank, 0, grad_norm=9.0) for rank in (6, 5, 7)]
    resent_then_changed = awkward_steps(0, ranks=8)[:4] + changed
    assert same_everywhere(stores, resent_then_changed)["conflict"][0] == 4


def test_changed_samples_conflict_and_nan_resent_does_not(stores: list[Store]) -> None:
    same_everywhere(stores, samples(1))
    assert same_everywhere(stores, samples(1))["duplicates"] == 3
    [device, _other, link] = samples(1)
    assert same_everywhere(stores, [{**device, "power_w": 1.0}])["conflict"][1] == "device_sample"
    assert (
        same_everywhere(stores, [{**link, "counters": {"symbol_error": 2}}])["conflict"][1] == "link_sample"
    )


def test_a_record_resent_at_another_time_conflicts_everywhere(stores: list[Store]) -> None:
    """On PostgreSQL the time-partitioned tables' unique key holds the record's time: a record
    re-sent with another time must still be refused as on SQLite, its whole batch with it, the
    first such record in the batch named, whichever partition the other time falls in."""
    same_everywhere(stores, awkward_steps(0) + samples(1))
    before = {store.name: to_wire(snapshot(store.engine)) for store in stores}
    stored = awkward_steps(0)[3]
    later_day = {**stored, "time": stored["time"] + 3 * 86_400}
    [device, _other, link] = samples(1)
    moved = [*awkward_steps(1), later_day, {**device, "time": device["time"] + 1}]
    assert same_everywhere(stores, moved) == {
        "conflict": (4, "step", {"incarnation": INCARNATION, "rank": 3, "attempt": 0})
    }
    assert same_everywhere(stores, [{**link, "time": link["time"] - 1}])["conflict"][1] == "link_sample"
    for store in stores:
        assert to_wire(snapshot(store.engine)) == before[store.name], store.name
    # The same records at their own times are re-sent records, not conflicts.
    assert same_everywhere(stores, awkward_steps(0) + samples(1))["duplicates"] == 4 + 3


def test_repeats_and_conflicts_inside_one_batch(stores: list[Store]) -> None:
    window = awkward_steps(0)
    assert same_everywhere(stores, window + window)["duplicates"] == len(window)
    answer = same_everywhere(stores, [step_record(0, 5), step_record(0, 5, lr=1.0)])
    assert answer["conflict"][0] == 1


def test_a_large_batch_with_duplicates_and_new_rows(stores: list[Store]) -> None:
    """4,096 ranks' window, then the next one sent with half of the first again."""
    ranks = 4_096  # 16,384 took 38 s over the three paths, 4,096 takes 6 s
    first = [step_record(rank, 0, node=f"node-{rank // 8}") for rank in range(ranks)]
    assert same_everywhere(stores, first)["accepted"] == ranks
    second = first[::2] + [step_record(rank, 1, node=f"node-{rank // 8}") for rank in range(ranks)]
    answer = same_everywhere(stores, second)
    assert (answer["accepted"], answer["duplicates"]) == (ranks, ranks // 2)


def test_two_batches_in_one_transaction(stores: list[Store]) -> None:
    """The staging table is emptied before each batch, not only at commit."""
    copied = next(store for store in stores if store.copy)
    first, second = (list(BatchIn.model_validate({"records": awkward_steps(a)}).records) for a in (0, 1))
    with copied.engine.begin() as connection:
        assert ingest_batch(connection, copied.run_id, first, NOW, inline_rows=0).accepted == 4
        again = ingest_batch(connection, copied.run_id, second + first[:1], NOW, inline_rows=0)
    assert (again.accepted, again.duplicates) == (4, 1)


def test_each_kind_answers_the_newest_id_it_stored(stores: list[Store]) -> None:
    """By COPY and as arrays, the id of each kind's newest stored row (a judging replica's own
    rows are handed to its judge up to it, ``monitor.judge.arrivals``); a re-send stores none and
    answers none, and a batch half re-sent answers its new rows' newest."""
    tables = {kind: models.Base.metadata.tables[name] for kind, name in KINDS.items()}

    def stored_newest(store: Store) -> dict[str, int]:
        with store.engine.connect() as connection:
            return {
                kind: connection.execute(sa.select(sa.func.max(table.c.id))).scalar_one()
                for kind, table in tables.items()
            }

    for store in (store for store in stores if store.copy):
        first = list(BatchIn.model_validate({"records": awkward_steps(0) + samples(1)}).records)
        with store.engine.begin() as connection:
            answered = ingest_batch(connection, store.run_id, first, NOW, inline_rows=store.inline_rows)
        assert answered.newest_id == stored_newest(store), store.name
        with store.engine.begin() as connection:
            assert (
                ingest_batch(connection, store.run_id, first, NOW, inline_rows=store.inline_rows).newest_id
                == {}
            )
        half = list(BatchIn.model_validate({"records": awkward_steps(0) + awkward_steps(1)}).records)
        with store.engine.begin() as connection:
            answered = ingest_batch(connection, store.run_id, half, NOW, inline_rows=store.inline_rows)
        assert answered.newest_id == {"step": stored_newest(store)["step"]}, store.name


# --- where COPY is used ---------------------------------------------------------------------


def test_copy_is_used_on_psycopg2_only(stores: list[Store]) -> None:
    sqlite, postgres = stores[0], stores[2]
    with sqlite.engine.connect() as connection:
        assert not postgres_copy.available(connection)
    with postgres.engine.connect() as connection:
        assert postgres_copy.available(connection)


def test_the_copy_path_writes_through_its_staging_table(stores: list[Store]) -> None:
    """The COPY store made its session's staging table; the INSERT store never did, nor the
    store whose batches went in as arrays."""
    names = {}
    for store in stores[1:]:
        batch = list(BatchIn.model_validate({"records": awkward_steps(0)}).records)
        with store.engine.begin() as connection:
            ingest_batch(connection, store.run_id, batch, NOW, copy=store.copy, inline_rows=store.inline_rows)
            names[store.name] = (
                connection.exec_driver_sql(
                    "SELECT relname FROM pg_class WHERE relpersistence = 't' AND relkind = 'r'"
                )
                .scalars()
                .all()
            )
    assert names == {
        "postgres-insert": [],
        "postgres-copy": ["runhealth_stage_step_records"],
        "postgres-inline": [],
    }
