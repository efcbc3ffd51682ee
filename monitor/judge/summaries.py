"""Per-window run summaries: every rank's step record folded into one row per window.

Folding is incremental (only the batch's new records are read), so history is never
rescanned; the row is locked while it is updated so two batches for the same window from
different ranks cannot lose each other's counts.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from monitor.store import models, prepared

SUMMARY = models.table_of(models.StepSummary)
# Statements built once, not per batch: building them was most of folding's cost for a batch of
# one rank's record (the hook's shape; cProfile of the worker thread, 23e2b58).
_UPDATED = tuple(c.name for c in SUMMARY.columns if c.name not in ("id", "run_id"))
_UPDATE = (
    SUMMARY.update()
    .where(SUMMARY.c.id == sa.bindparam("b_id"))
    .values({name: sa.bindparam(f"b_{name}") for name in _UPDATED})
)
_LOCK = (
    sa.select(SUMMARY)
    .where(
        SUMMARY.c.run_id == sa.bindparam("run_id"),
        sa.tuple_(SUMMARY.c.incarnation, SUMMARY.c.attempt).in_(sa.bindparam("keys", expanding=True)),
    )
    .with_for_update()
)


def fold(summary: dict[str, Any], record: dict[str, Any]) -> None:
    """Fold one rank's step record into a summary row, in place."""
    fold_all(summary, (record,))


def fold_all(summary: dict[str, Any], records: Iterable[dict[str, Any]]) -> None:
    """Fold ranks' step records into a summary row, in place, in their order.

    One pass with the row's fields in locals: a window of a thousand ranks is a thousand
    records, and a helper call per field per record was most of folding's cost. Sums are added
    in record order (float addition is not associative); a maximum or minimum with a NaN on
    any rank is NaN (a NaN on one rank is the run's NaN); the smallest loss scale on any rank
    is the one that shows a collapse."""
    ranks, step, late = summary["ranks_reported"], summary["step"], summary["late_records"]
    tokens_sum, loss_sum_sum = summary["tokens"], summary["loss_sum"]
    reported_sum, reported_count = summary["reported_loss_sum"], summary["reported_loss_count"]
    grad, lr, scale = summary["grad_norm"], summary["lr"], summary["loss_scale"]
    skipped, consumed = summary["skipped_ranks"], summary["consumed"]
    mean_sum, mean_count = summary["rank_mean_sum"], summary["rank_mean_count"]
    min_tokens, max_tokens = summary["min_rank_tokens"], summary["max_rank_tokens"]
    first_time, last_time, judged = summary["first_time"], summary["last_time"], summary["judged"]
    nan = math.nan
    for record in records:
        ranks += 1
        step = max(step, record["step"])
        tokens, loss_sum = record["tokens"], record["loss_sum"]
        if tokens is not None:
            tokens_sum = tokens if tokens_sum is None else tokens_sum + tokens
        if loss_sum is not None:
            loss_sum_sum = loss_sum if loss_sum_sum is None else loss_sum_sum + loss_sum
        reported = record["reported_loss"]
        if reported is not None:
            reported_sum = reported if reported_sum is None else reported_sum + reported
            reported_count += 1
        # x != x: only NaN is unequal to itself.
        value = record["grad_norm"]
        if value is not None:
            grad = value if grad is None else nan if grad != grad or value != value else max(grad, value)
        value = record["lr"]
        if value is not None:
            lr = value if lr is None else nan if lr != lr or value != value else max(lr, value)
        value = record["loss_scale"]
        if value is not None:
            scale = value if scale is None else nan if scale != scale or value != value else min(scale, value)
        if record["skipped"]:
            skipped += 1
        if record["consumed"] is not None:
            consumed = max(consumed or 0, record["consumed"])
        if tokens and loss_sum is not None:
            mean = loss_sum / tokens
            mean_sum = mean if mean_sum is None else mean_sum + mean
            mean_count += 1
        if tokens is not None:
            min_tokens = min(min_tokens or tokens, tokens)
            max_tokens = max(max_tokens or 0, tokens)
        first_time = min(first_time, record["time"])
        last_time = max(last_time, record["time"])
        if judged:
            late += 1
    summary |= {
        "ranks_reported": ranks,
        "step": step,
        "tokens": tokens_sum,
        "loss_sum": loss_sum_sum,
        "reported_loss_sum": reported_sum,
        "reported_loss_count": reported_count,
        "grad_norm": grad,
        "lr": lr,
        "loss_scale": scale,
        "skipped_ranks": skipped,
        "consumed": consumed,
        "rank_mean_sum": mean_sum,
        "rank_mean_count": mean_count,
        "min_rank_tokens": min_tokens,
        "max_rank_tokens": max_tokens,
        "first_time": first_time,
        "last_time": last_time,
        "late_records": late,
    }


def empty_summary(run_id: int, incarnation: str, attempt: int, record: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "incarnation": incarnation,
        "attempt": attempt,
        "step": record["step"],
        "ranks_reported": 0,
        "tokens": None,
        "loss_sum": None,
        "reported_loss_sum": None,
        "reported_loss_count": 0,
        "grad_norm": None,
        "lr": None,
        "loss_scale": None,
        "skipped_ranks": 0,
        "consumed": None,
        "rank_mean_sum": None,
        "rank_mean_count": 0,
        "min_rank_tokens": None,
        "max_rank_tokens": None,
        "first_time": record["time"],
        "last_time": record["time"],
        "judged": False,
        "late_records": 0,
    }


def fold_new_steps(
    connection: Connection, run_id: int, rows: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Fold a batch's newly stored step records into their windows' summaries.

    Returns the records that arrived after their window was judged (late, e.g. replayed
    from a spool), which the engine judges on their own.
    """
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        grouped[(row["incarnation"], row["attempt"])].append(row)
    if not grouped:
        return []
    existing = _locked_summaries(connection, run_id, list(grouped))
    late = [
        r for key, records in grouped.items() if key in existing and existing[key]["judged"] for r in records
    ]
    inserts: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    for key, records in grouped.items():
        summary = existing.get(key)
        target = summary if summary is not None else empty_summary(run_id, *key, records[0])
        fold_all(target, records)
        (updates if summary is not None else inserts).append(target)
    if inserts:
        connection.execute(SUMMARY.insert(), inserts)
    if updates and prepared.available(connection):
        prepared.execute(connection, _pg_statements()[1], _columns_of(updates, ("id", *_UPDATED)))
    elif updates:
        connection.execute(
            _UPDATE, [{f"b_{k}": v for k, v in row.items() if k != "run_id"} for row in updates]
        )
    return late


def _columns_of(rows: list[dict[str, Any]], names: Iterable[str]) -> list[list[Any]]:
    return [[row[name] for row in rows] for name in names]


@functools.cache
def _pg_statements() -> tuple[str, str]:
    """On PostgreSQL, the lock of a batch's windows and the update of their rows, each one
    prepared statement (``monitor.store.prepared``) over one array per column: SQLAlchemy's
    expanding ``IN`` and its ``executemany`` of the update (one round trip per window) cost
    the service more than folding itself, and PostgreSQL planned each anew (pg_stat_statements,
    one rank's post: 218 + 354 us of planning beside 73 + 130 us of executing)."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    names = [column.name for column in SUMMARY.columns]
    typed = {column.name: column.type.compile(dialect) for column in SUMMARY.columns}
    lock = (
        f"SELECT {', '.join(names)} FROM {SUMMARY.name} WHERE run_id = %s AND (incarnation, attempt) IN "
        f"(SELECT * FROM unnest(%s::{typed['incarnation']}[], %s::{typed['attempt']}[])) "
        f"FOR UPDATE OF {SUMMARY.name}"
    )
    columns = ("id", *_UPDATED)
    arrays = ", ".join(f"%s::{typed[name]}[]" for name in columns)
    sets = ", ".join(f"{name} = u.{name}" for name in _UPDATED)
    update = (
        f"UPDATE {SUMMARY.name} t SET {sets} FROM unnest({arrays}) AS u({', '.join(columns)}) "
        "WHERE t.id = u.id"
    )
    return lock, update


def _locked_summaries(
    connection: Connection, run_id: int, keys: list[tuple[str, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    found: dict[tuple[str, int], dict[str, Any]] = {}
    if prepared.available(connection):
        names = tuple(column.name for column in SUMMARY.columns)
        parameters = (run_id, [k[0] for k in keys], [k[1] for k in keys])
        for values in prepared.execute(connection, _pg_statements()[0], parameters):
            summary = dict(zip(names, values, strict=True))
            found[(summary["incarnation"], summary["attempt"])] = summary
        return found
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        for row in connection.execute(_LOCK, {"run_id": run_id, "keys": chunk}).mappings():
            found[(row["incarnation"], row["attempt"])] = dict(row)
    return found
