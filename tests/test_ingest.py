"""Writing validated batches (``monitor.ingest.batches``) and folding ranks into per-window summaries
(``monitor.judge.summaries``), on a real connection."""

from __future__ import annotations

import math
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.ingest.batches import (
    ConflictError,
    IngestResult,
    InvalidRecord,
    WorldSizes,
    content_hash,
    ingest_batch,
)
from monitor.ingest.schemas import RECORD_KINDS, BatchIn
from monitor.judge.summaries import empty_summary, fold, fold_new_steps
from monitor.store import models
from policies.checkpoints import manifest_digest
from tests.support import (
    INCARNATION,
    RunHandle,
    both_backends,
    make_run,
    record_of_each_kind,
    snapshot,
    step_record,
    steps,
    table_counts,
)

SUMMARY = models.StepSummary.__table__
INCARNATIONS = models.Incarnation.__table__
HEARTBEATS = models.Heartbeat.__table__
NOW = 5000.0


def parse(records: list[dict[str, Any]]) -> list[Any]:
    return list(BatchIn.model_validate({"records": records}).records)


def ingest(store: Engine, run: RunHandle, records: list[dict[str, Any]]) -> IngestResult:
    """What the service does with one batch: store it, fold its new steps, one transaction."""
    with store.begin() as connection:
        result = ingest_batch(connection, run.id, parse(records), NOW)
        fold_new_steps(connection, run.id, result.new_rows.get("step", []))
    return result


def summaries(store: Engine) -> list[dict[str, Any]]:
    with store.connect() as connection:
        rows = connection.execute(sa.select(SUMMARY).order_by(SUMMARY.c.attempt)).mappings()
        return [dict(row) for row in rows]


def only_summary(store: Engine) -> dict[str, Any]:
    [summary] = summaries(store)
    return summary


# --- storing ----------------------------------------------------------------------------------


@both_backends
def test_every_kind_is_stored_and_counted(store: Engine, run: RunHandle) -> None:
    result = ingest(store, run, record_of_each_kind(run.directive_id))
    assert result.by_kind == dict.fromkeys(RECORD_KINDS, 1)
    assert (result.accepted, result.duplicates) == (len(RECORD_KINDS), 0)
    counts = table_counts(store)
    for table in ("step_records", "heartbeats", "incarnations", "device_samples"):
        assert counts[table] == 1, table
    for table in ("link_samples", "checkpoint_events", "resume_events", "step_summaries"):
        assert counts[table] == 1, table


@both_backends
def test_resent_batch_is_all_duplicates_and_changes_nothing(store: Engine, run: RunHandle) -> None:
    ingest(store, run, record_of_each_kind(run.directive_id))
    before = snapshot(store)
    again = ingest(store, run, record_of_each_kind(run.directive_id))
    # Heartbeats are not keyed records: the same one again is a no-op update, not a duplicate.
    assert again.duplicates == len(RECORD_KINDS) - 1
    assert again.new_rows.get("step", []) == []
    assert snapshot(store) == before


@both_backends
def test_conflict_names_the_record_and_key(store: Engine, run: RunHandle) -> None:
    ingest(store, run, steps(3))
    before = snapshot(store)
    batch = [step_record(attempt=7), step_record(attempt=1, loss_sum=1.0)]
    with pytest.raises(ConflictError) as conflict:
        ingest(store, run, batch)
    assert conflict.value.index == 1
    assert conflict.value.kind == "step"
    assert conflict.value.key == {"incarnation": INCARNATION, "rank": 0, "attempt": 1}
    assert snapshot(store) == before


def test_conflict_inside_one_batch(store: Engine, run: RunHandle) -> None:
    with pytest.raises(ConflictError) as conflict:
        ingest(store, run, [step_record(), step_record(rank=1), step_record(grad_norm=9.0)])
    assert conflict.value.index == 2
    assert table_counts(store)["step_records"] == 0


def test_repeat_inside_one_batch_is_stored_once(store: Engine, run: RunHandle) -> None:
    result = ingest(store, run, [step_record(), step_record()])
    assert (result.accepted, result.duplicates) == (1, 1)
    assert only_summary(store)["ranks_reported"] == 1


@both_backends
def test_nan_record_resent_is_a_duplicate_not_a_conflict(store: Engine, run: RunHandle) -> None:
    record = step_record(loss_sum="NaN", grad_norm="Infinity")
    ingest(store, run, [record])
    assert ingest(store, run, [record]).duplicates == 1
    with pytest.raises(ConflictError):
        ingest(store, run, [step_record(loss_sum=None, grad_norm="Infinity")])


def test_same_key_in_another_run_is_another_record(store: Engine, run: RunHandle) -> None:
    other = make_run(store, "run-b")
    ingest(store, run, steps(2))
    assert ingest(store, other, steps(2)).accepted == 2
    assert table_counts(store)["step_records"] == 4


@both_backends
@pytest.mark.parametrize("kind", ["step", "device_sample", "link_sample", "resume"])
def test_keyed_kinds_conflict_on_changed_content(store: Engine, run: RunHandle, kind: str) -> None:
    """Another time is other content, on PostgreSQL too, where the time-partitioned tables'
    unique key holds the time and would store the record again beside the first."""
    [record] = [r for r in record_of_each_kind(run.directive_id) if r["kind"] == kind]
    ingest(store, run, [record])
    before = snapshot(store)
    with pytest.raises(ConflictError) as conflict:
        ingest(store, run, [{**record, "time": record["time"] + 1}])
    assert conflict.value.kind == kind
    assert snapshot(store) == before


def a_checkpoint(run: RunHandle) -> dict[str, Any]:
    [record] = [r for r in record_of_each_kind(run.directive_id) if r["kind"] == "checkpoint"]
    return record


def checkpoint_rows(store: Engine) -> list[dict[str, Any]]:
    table = models.CheckpointEvent.__table__
    with store.connect() as connection:
        return [dict(row) for row in connection.execute(sa.select(table).order_by(table.c.id)).mappings()]


@both_backends
def test_the_same_checkpoint_reported_again_is_a_duplicate_whatever_else_changed(
    store: Engine, run: RunHandle
) -> None:
    """A checkpoint is its content at its path and step: re-saved with the same bytes (a script
    that saves again at its resume iteration), at another time, it is the one stored."""
    record = a_checkpoint(run)
    ingest(store, run, [record])
    again = ingest(store, run, [{**record, "time": record["time"] + 60, "tags": ["resumed"], "rank": 1}])
    assert (again.accepted, again.duplicates) == (0, 1)
    [row] = checkpoint_rows(store)
    assert row["time"] == record["time"] and row["manifest_digest"] == manifest_digest(record["manifest"])


@both_backends
def test_a_path_saved_with_other_content_is_a_new_checkpoint_not_a_conflict(
    store: Engine, run: RunHandle
) -> None:
    record = a_checkpoint(run)
    files = [{"path": "model.pt", "size": 124, "sha256": "b" * 64}]
    rewritten = {**record, "time": record["time"] + 60, "manifest": {**record["manifest"], "files": files}}
    later = {**rewritten, "step": 10, "manifest": {**rewritten["manifest"], "step": 10}}
    ingest(store, run, [record])
    assert ingest(store, run, [rewritten, later]).accepted == 2
    rows = checkpoint_rows(store)
    assert [(r["path"], r["step"]) for r in rows] == [
        (record["path"], 0),
        (record["path"], 0),
        (record["path"], 10),
    ]
    assert len({r["manifest_digest"] for r in rows}) == 3


def test_a_checkpoint_digest_that_does_not_match_its_manifest_is_refused(
    store: Engine, run: RunHandle
) -> None:
    record = a_checkpoint(run)
    with pytest.raises(InvalidRecord) as refused:
        ingest(store, run, [{**record, "manifest_digest": "0" * 64}])
    assert refused.value.field == "manifest_digest" and table_counts(store)["checkpoint_events"] == 0
    ingest(store, run, [{**record, "manifest_digest": manifest_digest(record["manifest"])}])
    assert ingest(store, run, [record]).duplicates == 1  # derived when absent: the same key


def test_content_hash_ignores_nested_key_order_and_tells_nan_from_null() -> None:
    # Rows come from one model, so top-level field order is fixed; free-form dicts are not.
    assert content_hash({"a": 1, "b": {"x": 1.5, "y": [2]}}) == content_hash(
        {"a": 1, "b": {"y": [2], "x": 1.5}}
    )
    assert content_hash({"a": math.nan}) != content_hash({"a": None})
    assert content_hash({"a": math.nan}) == content_hash({"a": float("nan")})
    assert content_hash({"a": {"m": math.nan}}) != content_hash({"a": {"m": None}})
    assert content_hash({"a": 1}) != content_hash({"a": 1.5})


# --- run start and finish --------------------------------------------------------------------


def start(world_size: int = 2) -> dict[str, Any]:
    return {"kind": "run_start", "incarnation": INCARNATION, "time": 10.0, "world_size": world_size}


def finish(status: str = "completed") -> dict[str, Any]:
    return {"kind": "run_finish", "incarnation": INCARNATION, "time": 90.0, "status": status}


def incarnation(store: Engine) -> dict[str, Any]:
    with store.connect() as connection:
        return dict(connection.execute(sa.select(INCARNATIONS)).mappings().one())


def test_finish_before_start_is_completed_by_the_start(store: Engine, run: RunHandle) -> None:
    assert ingest(store, run, [finish()]).accepted == 1
    assert ingest(store, run, [start()]).accepted == 1
    row = incarnation(store)
    assert (row["world_size"], row["started_at"]) == (2, 10.0)
    assert (row["finished_at"], row["finish_status"]) == (90.0, "completed")


def test_start_and_finish_are_idempotent_and_conflict_when_changed(store: Engine, run: RunHandle) -> None:
    ingest(store, run, [start(), finish()])
    assert ingest(store, run, [start(), finish()]).duplicates == 2
    with pytest.raises(ConflictError):
        ingest(store, run, [start(world_size=4)])
    with pytest.raises(ConflictError):
        ingest(store, run, [finish("failed")])
    assert incarnation(store)["world_size"] == 2


def test_a_stored_world_size_is_read_once_and_still_refuses_a_rank_past_it(
    store: Engine, run: RunHandle
) -> None:
    """The service keeps the world sizes it read (``WorldSizes``): one read per incarnation
    once its run start is stored, none kept before, and a rank past it is refused as before."""
    known = WorldSizes()
    reads: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "world_size IS NOT NULL" in statement:
            reads.append(statement)

    def ingest_known(records: list[dict[str, Any]]) -> IngestResult:
        with store.begin() as connection:
            return ingest_batch(connection, run.id, parse(records), NOW, world_sizes=known)

    sa.event.listen(store, "before_cursor_execute", count)
    try:
        assert ingest_known([step_record(rank=5, attempt=0)]).accepted == 1  # no start stored yet
        assert ingest_known([step_record(rank=6, attempt=0)]).accepted == 1
        assert ingest_known([start(world_size=4)]).accepted == 1
        assert ingest_known([step_record(rank=3, attempt=1)]).accepted == 1
        assert len(reads) == 3
        with pytest.raises(InvalidRecord, match="not below the declared world size 4"):
            ingest_known([step_record(rank=4, attempt=2)])
        assert ingest_known([step_record(rank=2, attempt=2)]).accepted == 1
    finally:
        sa.event.remove(store, "before_cursor_execute", count)
    assert len(reads) == 3
    assert known.get(run.id, INCARNATION) == 4


# --- heartbeats ------------------------------------------------------------------------------


def heartbeat(time: float, phase: str, rank: int = 0) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": INCARNATION,
        "rank": rank,
        "phase": phase,
        "phase_since": time - 1,
        "time": time,
    }


def heartbeat_phases(store: Engine) -> dict[int, tuple[float, str]]:
    with store.connect() as connection:
        rows = connection.execute(sa.select(HEARTBEATS.c.rank, HEARTBEATS.c.time, HEARTBEATS.c.phase))
        return {rank: (time, phase) for rank, time, phase in rows}


@both_backends
def test_newest_heartbeat_wins_and_a_late_older_one_is_ignored(store: Engine, run: RunHandle) -> None:
    ingest(store, run, [heartbeat(20.0, "backward"), heartbeat(10.0, "forward")])
    assert heartbeat_phases(store) == {0: (20.0, "backward")}
    ingest(store, run, [heartbeat(30.0, "optimizer"), heartbeat(5.0, "data", rank=1)])
    ingest(store, run, [heartbeat(25.0, "forward")])
    assert heartbeat_phases(store) == {0: (30.0, "optimizer"), 1: (5.0, "data")}


# --- folding ranks into windows --------------------------------------------------------------


def four_ranks() -> list[dict[str, Any]]:
    return [
        step_record(0, tokens=100, loss_sum=200.0, grad_norm=1.0, loss_scale=65536.0,
                    reported_loss=2.0, consumed=64, time=10.0),
        step_record(1, tokens=200, loss_sum=500.0, grad_norm="NaN", loss_scale=32768.0,
                    reported_loss=2.5, consumed=64, time=12.0, skipped=True),
        step_record(2, tokens=300, loss_sum=600.0, grad_norm=3.0, loss_scale=65536.0,
                    consumed=64, time=11.0),
        step_record(3, tokens=400, loss_sum=900.0, grad_norm=2.0, loss_scale=65536.0,
                    consumed=64, time=9.0),
    ]  # fmt: skip


def assert_four_ranks_folded(summary: dict[str, Any]) -> None:
    assert summary["ranks_reported"] == 4
    assert summary["tokens"] == 1000
    assert summary["loss_sum"] == 2200.0
    assert (summary["reported_loss_sum"], summary["reported_loss_count"]) == (4.5, 2)
    assert math.isnan(summary["grad_norm"])  # a NaN on one rank is the run's NaN
    assert summary["loss_scale"] == 32768.0  # the smallest scale shows a collapse
    assert summary["skipped_ranks"] == 1
    assert summary["consumed"] == 64
    assert (summary["first_time"], summary["last_time"]) == (9.0, 12.0)
    assert summary["late_records"] == 0


@both_backends
def test_ranks_of_one_window_fold_into_one_summary(store: Engine, run: RunHandle) -> None:
    ingest(store, run, four_ranks())
    assert_four_ranks_folded(only_summary(store))


@both_backends
def test_a_window_split_over_batches_folds_the_same(store: Engine, run: RunHandle) -> None:
    records = four_ranks()
    ingest(store, run, records[:1])
    ingest(store, run, records[1:3])
    ingest(store, run, records[3:])
    assert_four_ranks_folded(only_summary(store))


@both_backends
def test_duplicates_are_not_folded_twice(store: Engine, run: RunHandle) -> None:
    ingest(store, run, four_ranks())
    ingest(store, run, four_ranks()[2:])
    assert_four_ranks_folded(only_summary(store))


@both_backends
def test_records_after_judging_are_counted_late(store: Engine, run: RunHandle) -> None:
    records = four_ranks()
    ingest(store, run, records[:2])
    with store.begin() as connection:
        connection.execute(sa.update(models.StepSummary).values(judged=True))
    ingest(store, run, records[2:])
    summary = only_summary(store)
    assert (summary["ranks_reported"], summary["late_records"]) == (4, 2)
    assert summary["tokens"] == 1000


def test_each_window_gets_its_own_summary(store: Engine, run: RunHandle) -> None:
    ingest(store, run, steps(3, ranks=2))
    rows = summaries(store)
    assert [(r["attempt"], r["ranks_reported"], r["tokens"]) for r in rows] == [
        (0, 2, 2048),
        (1, 2, 2048),
        (2, 2, 2048),
    ]


def test_fold_treats_none_as_not_logged() -> None:
    logged = step_record(tokens=10, loss_sum=5.0, grad_norm=2.0, consumed=8)
    silent = step_record(rank=1, tokens=None, loss_sum=None, grad_norm=None, loss_scale=None)
    summary = empty_summary(1, INCARNATION, 0, silent)
    fold(summary, {**silent, "reported_loss": None, "consumed": None})
    fold(summary, {**logged, "reported_loss": None})
    assert (summary["tokens"], summary["loss_sum"], summary["grad_norm"]) == (10, 5.0, 2.0)
    assert summary["loss_scale"] == 65536.0
    assert summary["consumed"] == 8
    assert summary["reported_loss_count"] == 0


def test_folding_nothing_writes_nothing(store: Engine, run: RunHandle) -> None:
    with store.begin() as connection:
        fold_new_steps(connection, run.id, [])
    assert summaries(store) == []
