"""Batches of one run that wait for the store together, written as one.

A replica writes one batch at a time (``Service._write_lock``; on PostgreSQL a run's batches
are serialised anyway, ``monitor.store.locks.lock_run_writes``). Under load, batches queue for
that lock; whichever thread takes it next writes every batch then waiting, each run's as one
batch in one transaction (group commit): a transaction, a run lock and a window fold for all of
them, and their rows by ``COPY`` where a few records a batch went in as the statement's arrays.
No batch waits longer for it: one that finds the lock free is written at once, alone.

Each batch still gets its own answer, the same as it would have had alone (its records'
counts, from ``IngestResult.stored_at`` and ``duplicate_at``: written one after another,
the first batch of two holding one record stores it and the second counts it a duplicate,
exactly as the merged write does), and still stands or falls alone: when a group's write
fails (a conflict, a record refused, the store), it is rolled back and each of its batches is
written by itself, so the one at fault is refused and the others are stored.

Only batches of the kinds a training run sends by the thousand are grouped (step records,
heartbeats, device and link samples): the others (a run's start or finish, checkpoints,
acknowledgements) carry answers and events of their own and are written alone, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from monitor.ingest.batches import IngestResult

GROUPED_KINDS = frozenset({"step", "heartbeat", "device_sample", "link_sample"})


def groupable(records: Sequence[Any]) -> bool:
    """Whether a batch may be written with others: only high-volume kinds, and some record."""
    return bool(records) and all(record.kind in GROUPED_KINDS for record in records)


@dataclass(eq=False)
class Waiting:
    """One batch waiting for the store, and, once written, its outcome."""

    run: str
    run_id: int
    records: Sequence[Any]
    asked: Any
    """The directives question its answer carries (``monitor.service.Asked``), or None."""
    done: bool = False
    result: IngestResult | None = None
    pending: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    error: BaseException | None = None


def groups(waiting: Sequence[Waiting], max_records: int) -> Iterator[list[Waiting]]:
    """The batches waiting, by run (in the order they queued), in groups of at most
    ``max_records`` records (a batch larger than that is a group alone)."""
    by_run: dict[int, list[Waiting]] = {}
    for entry in waiting:
        by_run.setdefault(entry.run_id, []).append(entry)
    for entries in by_run.values():
        group: list[Waiting] = []
        size = 0
        for entry in entries:
            if group and size + len(entry.records) > max_records:
                yield group
                group, size = [], 0
            group.append(entry)
            size += len(entry.records)
        if group:
            yield group


def merged(group: Sequence[Waiting]) -> list[Any]:
    """The group's records as one batch, each batch's in order, the batches in queue order."""
    return [record for entry in group for record in entry.records]


def split(result: IngestResult, group: Sequence[Waiting]) -> list[IngestResult]:
    """Each batch's answer out of the merged batch's: its records counted as stored or as
    duplicates, by kind in the order its kinds first appear (as ``ingest_batch`` counts them).
    ``new_rows`` stays empty: a replica's judge reads new rows from the store."""
    stored = set(result.stored_at)
    duplicate = set(result.duplicate_at)
    answers = []
    start = 0
    for entry in group:
        answer = IngestResult()
        for index in range(start, start + len(entry.records)):
            kind = entry.records[index - start].kind
            answer.by_kind.setdefault(kind, 0)
            if index in stored:
                answer.by_kind[kind] += 1
                answer.accepted += 1
                answer.stored_at.append(index - start)
            elif index in duplicate:
                answer.duplicates += 1
                answer.duplicate_at.append(index - start)
        answers.append(answer)
        start += len(entry.records)
    return answers
