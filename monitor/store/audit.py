"""The audit log: append-only and hash-chained.

Each entry's hash covers its own fields and the previous entry's hash, over a canonical
serialization (sorted keys, no whitespace, nonfinite numbers by name). Appends are
serialized by the store itself: ``prev_hash`` is unique, so two writers that read the same
tail cannot both extend it; the loser re-reads the tail and appends after the winner.

``verify`` walks the chain and names the first entry that does not hold: an edited entry
(its hash no longer matches its fields), a deleted or reordered one (its ``prev_hash`` no
longer names the entry before it). Cutting entries off the end leaves a shorter valid chain;
``verify`` prints the head hash so it can be anchored outside the store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.protocol import to_wire

AUDIT = models.table_of(models.AuditEntry)
GENESIS = "0" * 64
# A lost race means another writer appended, so retrying always makes progress; but under
# contention one writer can lose many times in a row (4 writers on 2 cores lost 20 in CI).
# Past this many, or on a conflict the tail did not move for, something else is wrong.
APPEND_ATTEMPTS = 10_000


def canonical(entry: Mapping[str, Any]) -> bytes:
    fields = {
        k: entry[k]
        for k in (
            "seq",
            "time",
            "actor",
            "action",
            "subject",
            "run_id",
            "incident_id",
            "reason",
            "details",
            "prev_hash",
        )
    }
    return json.dumps(to_wire(fields), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def entry_hash(entry: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(entry)).hexdigest()


def append(
    connection: Connection,
    *,
    actor: str,
    action: str,
    subject: str,
    now: float,
    run_id: int | None = None,
    incident_id: int | None = None,
    reason: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> int:
    """Append one entry inside the caller's transaction; returns its sequence number."""
    lost_to = -1
    for _ in range(APPEND_ATTEMPTS):
        tail = connection.execute(
            sa.select(AUDIT.c.seq, AUDIT.c.hash).order_by(AUDIT.c.seq.desc()).limit(1)
        ).first()
        seq = (tail.seq if tail else 0) + 1
        if seq == lost_to:
            raise RuntimeError(
                f"could not append audit entry {seq}: it conflicts, and no other writer took it"
            )
        entry: dict[str, Any] = {
            "seq": seq,
            "time": now,
            "actor": actor,
            "action": action,
            "subject": subject,
            "run_id": run_id,
            "incident_id": incident_id,
            "reason": reason,
            "details": dict(details or {}),
            "prev_hash": tail.hash if tail else GENESIS,
        }
        entry["hash"] = entry_hash(entry)
        savepoint = connection.begin_nested()
        try:
            connection.execute(AUDIT.insert(), entry)
        except sa.exc.IntegrityError:
            savepoint.rollback()  # another writer took this tail: read the new one
            lost_to = seq
            continue
        savepoint.commit()
        return int(seq)
    raise RuntimeError(f"could not append to the audit log after {APPEND_ATTEMPTS} attempts")


@dataclass(frozen=True)
class Verification:
    ok: bool
    entries: int
    head: str
    broken_seq: int | None = None
    problem: str | None = None


def verify(connection: Connection) -> Verification:
    expected_prev, count, previous_seq = GENESIS, 0, 0
    for row in connection.execute(sa.select(AUDIT).order_by(AUDIT.c.seq)).mappings():
        count += 1
        if row["prev_hash"] != expected_prev:
            what = "an entry before it was deleted, inserted or reordered"
            if row["seq"] != previous_seq + 1:
                what = f"entries {previous_seq + 1}..{row['seq'] - 1} are missing"
            return Verification(False, count, expected_prev, row["seq"], f"entry {row['seq']}: {what}")
        if entry_hash(dict(row)) != row["hash"]:
            return Verification(
                False, count, expected_prev, row["seq"], f"entry {row['seq']}: its content was edited"
            )
        expected_prev, previous_seq = row["hash"], row["seq"]
    return Verification(True, count, expected_prev)


def story(connection: Connection, incident_id: int) -> list[dict[str, Any]]:
    """Every audit entry about one incident, in order."""
    rows = connection.execute(
        sa.select(AUDIT).where(AUDIT.c.incident_id == incident_id).order_by(AUDIT.c.seq)
    ).mappings()
    return [
        {k: row[k] for k in ("seq", "time", "actor", "action", "subject", "reason", "details")}
        for row in rows
    ]
