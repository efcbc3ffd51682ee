"""The audit chain's anchor: its head written outside the store after each append.

A writer that appended audit entries writes the committed head (sequence, hash, time) and an
HMAC of them under the audit key as one JSON line to an append-only file (``O_APPEND``, mode
0600): ``RUNHEALTH_AUDIT_ANCHOR``, default ``<db>.audit-anchor`` beside an SQLite store. It does
so when its connection goes back to the pool, after the commit, reading the head the store
then holds, so the file only ever names heads that were committed. ``verify`` checks that the
chain still holds every head the file names: a cut-off tail or a wiped table is caught there.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL

from monitor.store.audit_keys import Key, Keyring, KeySource, beside_store
from monitor.store.db import StoreError

ANCHOR_VARIABLE = "RUNHEALTH_AUDIT_ANCHOR"
PURPOSE = "runhealth-audit-anchor-v1"
# Set in a pooled connection's info by an append; the anchor is written when it comes back.
APPENDED = "runhealth.audit.appended"
HEAD_SQL = "SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1"

log = logging.getLogger("runhealth.audit")


class AnchorError(StoreError):
    """An anchor file that cannot be read; the message names it."""


@dataclass(frozen=True)
class Head:
    seq: int
    hash: str
    time: float
    key_id: str | None = None
    mac: str | None = None
    line: int = 0

    def signed_by(self, key: Key) -> Head:
        return Head(
            self.seq, self.hash, self.time, key.id, key.sign(PURPOSE, self.seq, self.hash, repr(self.time))
        )

    def authentic(self, keyring: Keyring) -> bool:
        key = keyring.find(self.key_id)
        return key is not None and key.signed(self.mac, PURPOSE, self.seq, self.hash, repr(self.time))


def anchor_path(url: URL, environ: Mapping[str, str]) -> Path | None:
    named = environ.get(ANCHOR_VARIABLE, "").strip()
    return Path(named).expanduser().absolute() if named else beside_store(url, ".audit-anchor")


def write_head(path: Path, head: Head) -> None:
    """One line, appended in one write (``O_APPEND``: never interleaved with another writer's)."""
    line = json.dumps(
        {"seq": head.seq, "hash": head.hash, "time": head.time, "key_id": head.key_id, "mac": head.mac}
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, stat.S_IRUSR | stat.S_IWUSR)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_heads(path: Path) -> list[Head]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AnchorError(f"cannot read the anchor file {path}: {exc.strerror}") from None
    heads = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            fields = json.loads(text)
            heads.append(
                Head(
                    int(fields["seq"]),
                    str(fields["hash"]),
                    float(fields["time"]),
                    fields.get("key_id"),
                    fields.get("mac"),
                    number,
                )
            )
        except (ValueError, KeyError, TypeError):
            raise AnchorError(f"the anchor file {path} line {number} is not an anchor line") from None
    return heads


@dataclass(frozen=True)
class Anchoring:
    """Writes the committed head to ``path`` when a connection that appended is checked in."""

    path: Path
    keys: KeySource
    clock: Callable[[], float]

    def on_checkin(self, dbapi_connection: Any, record: Any) -> None:
        if dbapi_connection is None or not record.info.pop(APPENDED, False):
            return
        try:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(HEAD_SQL)
                row = cursor.fetchone()
            finally:
                cursor.close()
                dbapi_connection.rollback()  # the read began a transaction on some drivers
            if row is not None:
                key = self.keys.keyring().signing
                write_head(self.path, Head(int(row[0]), str(row[1]), float(self.clock())).signed_by(key))
        except Exception:  # the chain is committed; a missed anchor line only weakens the check
            log.exception("could not write the audit anchor to %s", self.path)
