"""Per-window run summaries: every rank's step record folded into one row per window.

Folding is incremental (only the batch's new records are read), so history is never
rescanned; the row is locked while it is updated so two batches for the same window from
different ranks cannot lose each other's counts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models

SUMMARY = models.table_of(models.StepSummary)


def _add(a: float | int | None, b: float | int | None) -> Any:
    if a is None:
        return b
    return a if b is None else a + b


def _max(a: float | None, b: float | None) -> float | None:
    """Maximum where a NaN anywhere wins: a NaN on one rank is the run's NaN."""
    if a is None:
        return b
    if b is None:
        return a
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def _min(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return min(a, b)


def fold(summary: dict[str, Any], record: dict[str, Any]) -> None:
    """Fold one rank's step record into a summary row, in place."""
    summary["ranks_reported"] += 1
    summary["step"] = max(summary["step"], record["step"])
    summary["tokens"] = _add(summary["tokens"], record["tokens"])
    summary["loss_sum"] = _add(summary["loss_sum"], record["loss_sum"])
    if record["reported_loss"] is not None:
        summary["reported_loss_sum"] = _add(summary["reported_loss_sum"], record["reported_loss"])
        summary["reported_loss_count"] += 1
    summary["grad_norm"] = _max(summary["grad_norm"], record["grad_norm"])
    summary["lr"] = _max(summary["lr"], record["lr"])
    # The smallest scale on any rank is the one that shows a collapse.
    summary["loss_scale"] = _min(summary["loss_scale"], record["loss_scale"])
    summary["skipped_ranks"] += 1 if record["skipped"] else 0
    if record["consumed"] is not None:
        summary["consumed"] = max(summary["consumed"] or 0, record["consumed"])
    tokens, loss_sum = record["tokens"], record["loss_sum"]
    if tokens and loss_sum is not None:
        summary["rank_mean_sum"] = _add(summary["rank_mean_sum"], loss_sum / tokens)
        summary["rank_mean_count"] += 1
    if tokens is not None:
        summary["min_rank_tokens"] = min(summary["min_rank_tokens"] or tokens, tokens)
        summary["max_rank_tokens"] = max(summary["max_rank_tokens"] or 0, tokens)
    summary["first_time"] = min(summary["first_time"], record["time"])
    summary["last_time"] = max(summary["last_time"], record["time"])
    if summary["judged"]:
        summary["late_records"] += 1


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
        for record in records:
            fold(target, record)
        (updates if summary is not None else inserts).append(target)
    if inserts:
        connection.execute(SUMMARY.insert(), inserts)
    if updates:
        columns = [c.name for c in SUMMARY.columns if c.name not in ("id", "run_id")]
        statement = (
            SUMMARY.update()
            .where(SUMMARY.c.id == sa.bindparam("b_id"))
            .values({name: sa.bindparam(f"b_{name}") for name in columns})
        )
        connection.execute(
            statement, [{f"b_{k}": v for k, v in row.items() if k != "run_id"} for row in updates]
        )
    return late


def _locked_summaries(
    connection: Connection, run_id: int, keys: list[tuple[str, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        query = (
            sa.select(SUMMARY)
            .where(
                SUMMARY.c.run_id == run_id,
                sa.tuple_(SUMMARY.c.incarnation, SUMMARY.c.attempt).in_(chunk),
            )
            .with_for_update()
        )
        for row in connection.execute(query).mappings():
            found[(row["incarnation"], row["attempt"])] = dict(row)
    return found
