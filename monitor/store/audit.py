"""The audit log: append-only, hash-chained, keyed and anchored.

Each entry's hash covers its own fields and the previous entry's hash, over a canonical
serialization (sorted keys, no whitespace, nonfinite numbers by name). Appends are
serialized by the store itself: ``prev_hash`` is unique, so two writers that read the same
tail cannot both extend it; the loser re-reads the tail and appends after the winner. On
PostgreSQL, where several service replicas append, a transaction-scoped advisory lock makes them
take turns before reading the tail (``monitor.store.locks``), so none loses.

A hash chain alone is no proof against whoever can write to the store: they can edit an entry
and recompute every hash after it. So each entry also carries an HMAC of its hash under a key
the store does not hold (``monitor.store.audit_keys``), which the engine carries to every
writer (``attach``: the service and the CLI call it when they open the store); and after each
transaction that appended, the committed head is written outside the store
(``monitor.store.anchor``), so a cut-off tail or a wiped table is caught too.

``verify`` walks the chain and names the first entry that does not hold: an unreadable one,
a deleted or reordered one (its ``prev_hash`` no longer names the entry before it), an edited
one (its hash no longer matches its fields), one whose HMAC does not match (edited, swapped or
forged with its hashes recomputed), and, against the anchor, the first entry missing from a
chain that no longer reaches a head it once had.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from monitor.store import models
from monitor.store.anchor import APPENDED, Anchoring, Head, anchor_path
from monitor.store.audit_keys import AuditKeyError, Key, Keyring, KeySource, key_source
from monitor.store.locks import lock_audit_appends
from policies.protocol import to_wire

AUDIT = models.table_of(models.AuditEntry)
GENESIS = "0" * 64
# A lost race means another writer appended, so retrying always makes progress; but under
# contention one writer can lose many times in a row (4 writers on 2 cores lost 20 in CI).
# Past this many, or on a conflict the tail did not move for, something else is wrong.
APPEND_ATTEMPTS = 10_000
# The engine's execution option that carries its audit key source to every connection.
KEYS_OPTION = "runhealth_audit_keys"
PURPOSE = "runhealth-audit-entry-v1"


def attach(
    engine: Engine,
    environ: Mapping[str, str],
    *,
    check: bool = False,
    clock: Callable[[], float] = time.time,
) -> KeySource | None:
    """Give every connection of ``engine`` the store's audit key source, and anchor the chain's
    head after each transaction that appended. ``check`` reads (or creates) the key now, so a
    missing key stops the service at start, in one line, instead of at its first entry."""
    source = key_source(engine.url, environ)
    if source is None:
        return None
    engine.update_execution_options(**{KEYS_OPTION: source})
    path = anchor_path(engine.url, environ)
    if path is not None:
        sa.event.listen(engine, "checkin", Anchoring(path, source, clock).on_checkin)
    if check:
        with engine.connect() as connection:
            signing_key(source, _tail(connection))
    return source


def signing_key(source: KeySource, tail: Any) -> Key:
    """The key to sign the entry after ``tail`` with; a new key file is created only while
    the log holds no keyed entry, and a key that cannot verify the tail is refused."""
    tail_key = tail.key_id if tail is not None else None
    keyring = source.keyring(create=tail_key is None)
    if tail_key is not None and keyring.find(tail_key) is None:
        raise AuditKeyError(
            f"the audit log's newest entry ({tail.seq}) is signed with key {tail_key}, which "
            f"{source.describe()} does not hold (key {keyring.signing.id}, retired: "
            f"{', '.join(k.id for k in keyring.retired) or 'none'}): use the key it was written with"
        )
    return keyring.signing


def _tail(connection: Connection) -> Any:
    return connection.execute(
        sa.select(AUDIT.c.seq, AUDIT.c.hash, AUDIT.c.key_id).order_by(AUDIT.c.seq.desc()).limit(1)
    ).first()


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
    source: KeySource | None = connection.get_execution_options().get(KEYS_OPTION)
    key: Key | None = None
    lost_to = -1
    # On PostgreSQL, replicas append one at a time (the lock lasts to the commit); the unique
    # prev_hash below still refuses a second writer that skipped it (an older service).
    lock_audit_appends(connection)
    for _ in range(APPEND_ATTEMPTS):
        tail = _tail(connection)
        seq = (tail.seq if tail else 0) + 1
        if seq == lost_to:
            raise RuntimeError(
                f"could not append audit entry {seq}: it conflicts, and no other writer took it"
            )
        if source is not None and key is None:
            key = signing_key(source, tail)
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
        entry["key_id"] = key.id if key else None
        entry["mac"] = key.sign(PURPOSE, entry["hash"]) if key else None
        savepoint = connection.begin_nested()
        try:
            connection.execute(AUDIT.insert(), entry)
        except sa.exc.IntegrityError:
            savepoint.rollback()  # another writer took this tail: read the new one
            lost_to = seq
            continue
        savepoint.commit()
        if source is not None:
            connection.info[APPENDED] = True  # anchored when the connection goes back to the pool
        return int(seq)
    raise RuntimeError(f"could not append to the audit log after {APPEND_ATTEMPTS} attempts")


@dataclass(frozen=True)
class Verification:
    """``keyed``: HMACs were checked; ``anchor_checked``: heads from an anchor were;
    ``anchored_seq``: the newest of them."""

    ok: bool
    entries: int
    head: str
    broken_seq: int | None = None
    problem: str | None = None
    keyed: bool = False
    anchor_checked: bool = False
    anchored_seq: int | None = None


def verify(
    connection: Connection, keyring: Keyring | None = None, anchor: Sequence[Head] | None = None
) -> Verification:
    """Walk the chain; with ``keyring`` every entry must carry a matching HMAC, with ``anchor``
    the chain must still hold every head it names."""
    expected_prev, count, previous_seq = GENESIS, 0, 0
    hashes: dict[int, str] = {}
    anchored = max((h.seq for h in anchor), default=None) if anchor else None
    intact = Verification(True, 0, GENESIS, None, None, keyring is not None, anchor is not None, anchored)
    for entry in _entries(connection):
        count += 1
        seq = entry["seq"]
        problem = _entry_problem(entry, expected_prev, previous_seq, keyring)
        if problem is not None:
            return replace(
                intact,
                ok=False,
                entries=count,
                head=expected_prev,
                broken_seq=seq,
                problem=f"entry {seq}: {problem}",
            )
        expected_prev, previous_seq = entry["hash"], seq
        if anchor:
            hashes[seq] = entry["hash"]
    problem_at = _anchor_problem(anchor or (), hashes, previous_seq, keyring)
    if problem_at is not None:
        broken_seq, problem = problem_at
        return replace(
            intact, ok=False, entries=count, head=expected_prev, broken_seq=broken_seq, problem=problem
        )
    return replace(intact, entries=count, head=expected_prev)


def _entries(connection: Connection) -> Any:
    """Every entry in order, ``details`` read as text so one that is not JSON is named, not
    raised from the driver (``details_error`` says why)."""
    columns = [c for c in AUDIT.c if c.name != "details"]
    query = sa.select(*columns, sa.cast(AUDIT.c.details, sa.Text).label("details")).order_by(AUDIT.c.seq)
    for row in connection.execute(query).mappings():
        entry = dict(row)
        try:
            entry["details"] = (
                json.loads(entry["details"]) if isinstance(entry["details"], str) else entry["details"]
            )
        except json.JSONDecodeError as exc:
            entry["details_error"] = f"its details are not valid JSON ({exc.msg} at character {exc.pos})"
        yield entry


def _entry_problem(
    entry: Mapping[str, Any], expected_prev: str, previous_seq: int, keyring: Keyring | None
) -> str | None:
    seq = entry["seq"]
    if "details_error" in entry:
        return f"unreadable: {entry['details_error']}"
    if entry["prev_hash"] != expected_prev:
        if seq != previous_seq + 1:
            return f"entries {previous_seq + 1}..{seq - 1} are missing"
        return "an entry before it was deleted, inserted or reordered"
    if entry_hash(entry) != entry["hash"]:
        return "its content was edited"
    if keyring is None:
        return None
    if entry["mac"] is None:
        return "it carries no HMAC: written without the audit key, or forged"
    key = keyring.find(entry["key_id"])
    if key is None:
        return f"it is signed with key {entry['key_id']}, which is not in the keyring"
    if not key.signed(entry["mac"], PURPOSE, entry["hash"]):
        return "its HMAC does not match: edited, reordered or forged, with its hashes recomputed"
    return None


def _anchor_problem(
    anchor: Sequence[Head], hashes: Mapping[int, str], last_seq: int, keyring: Keyring | None
) -> tuple[int | None, str] | None:
    """The first entry the anchor's heads say is wrong (or a line that is not authentic)."""
    for head in anchor:
        if keyring is not None and not head.authentic(keyring):
            return None, f"anchor line {head.line}: its HMAC does not match (not written with the audit key)"
    rewritten = [h for h in anchor if h.seq <= last_seq and hashes.get(h.seq) != h.hash]
    if rewritten:
        head = min(rewritten, key=lambda h: h.seq)
        return head.seq, (
            f"entry {head.seq}: its hash differs from the one anchored at {_when(head)} "
            f"(anchor line {head.line}): the chain was rewritten"
        )
    beyond = max((h for h in anchor if h.seq > last_seq), key=lambda h: h.seq, default=None)
    if beyond is None:
        return None
    where = (
        "the audit log is empty: it was wiped"
        if last_seq == 0
        else f"it ends at entry {last_seq}: its tail was cut off"
    )
    return last_seq + 1, (
        f"entry {last_seq + 1}: missing; the anchor (line {beyond.line}, {_when(beyond)}) "
        f"records the chain reaching entry {beyond.seq}, and {where}"
    )


def _when(head: Head) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(head.time))


def first_keyed(connection: Connection) -> Any:
    """The first entry that carries an HMAC (its seq and key id), or ``None``."""
    return connection.execute(
        sa.select(AUDIT.c.seq, AUDIT.c.key_id).where(AUDIT.c.mac.is_not(None)).order_by(AUDIT.c.seq).limit(1)
    ).first()


def story(connection: Connection, incident_id: int) -> list[dict[str, Any]]:
    """Every audit entry about one incident, in order."""
    rows = connection.execute(
        sa.select(AUDIT).where(AUDIT.c.incident_id == incident_id).order_by(AUDIT.c.seq)
    ).mappings()
    return [
        {k: row[k] for k in ("seq", "time", "actor", "action", "subject", "reason", "details")}
        for row in rows
    ]
