"""What trainers left in a spool directory, and sending it (``runhealth spool``).

A trainer's spool is replayed by the next trainer that starts with the same spool directory and
run: ``Spool`` adopts the files no live process holds. When no trainer starts again (the run
ended while the service was down, or a rank was killed during an outage), what it spooled waits
on disk. ``list_spool`` says what is there without touching it; ``send_spool`` delivers it
through the trainer's own sender (replay order, 413 splits, dead letters for what the service
calls invalid). A file a live process holds is its trainer's and is left alone.

Dead-lettered batches are resent only on request (``dead_letters=True``): once the cause was
fixed (a service bug, a schema). Their records go back through the spool first, so a send that
fails halfway loses nothing, and the service stores each record once by its key, so what it
had already taken comes back as duplicates.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from collectors.counters import Counters
from collectors.sender import Sender, SenderConfig, Transport
from collectors.spool import DEAD_SUFFIX, SPOOL_SUFFIX, Spool, SpoolConfig, safe_name
from collectors.transport import Outcome
from collectors.wire import decode_line


class NotTaken(Exception):
    """The service does not take this sender's records now (unreachable, token, unknown run):
    nothing was sent and the spool is as it was."""


@dataclass(frozen=True)
class SpoolEntry:
    """One file of a run's spool directory: undelivered batches or dead letters."""

    run_dir: str  # the run's name as a file name (``safe_name``)
    file: str
    kind: Literal["spool", "dead"]
    batches: int  # pending (a spool file: after its replay cursor)
    records: int
    unreadable: int  # lines that do not parse (a torn tail, a damaged file)
    held: bool  # a live process holds it: its trainer is running
    reasons: tuple[str, ...] = ()  # dead letters: the service's reasons, each once


@dataclass(frozen=True)
class SendResult:
    run: str
    replayed: int  # records the service took (stored or already stored)
    dead_lettered: int  # records it called invalid: in this sender's dead-letter file
    unreadable: int  # spool lines that could not be parsed, skipped
    redriven: int  # dead-lettered records put back in the spool to be sent again
    held: tuple[str, ...]  # files a live process holds: not sent
    complete: bool  # nothing left spooled (False: the service was unreachable, or the timeout)


def list_spool(directory: Path) -> list[SpoolEntry]:
    """Every spool and dead-letter file under ``directory`` (one subdirectory per run) that
    holds something, read only: no lock is kept and no cursor moves."""
    return [
        entry
        for run_dir in sorted(path for path in directory.iterdir() if path.is_dir())
        for entry in _run_entries(run_dir)
    ]


def _run_entries(run_dir: Path) -> list[SpoolEntry]:
    entries = [_entry(run_dir.name, path) for path in sorted(run_dir.glob(f"*{SPOOL_SUFFIX}"))]
    return [entry for entry in entries if entry.batches or entry.unreadable]


def send_spool(
    directory: Path,
    run: str,
    transport: Transport,
    *,
    name: str,
    timeout_s: float,
    dead_letters: bool = False,
) -> SendResult:
    """Deliver what ``run``'s spool holds (and its dead letters, when asked) within
    ``timeout_s``; what cannot be delivered stays spooled for the next send or trainer."""
    run_dir = directory / safe_name(run)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no spool for run {run!r} under {directory}")
    answer = transport.post([])  # an empty batch: is the service there, and takes this token?
    if answer.outcome is not Outcome.DELIVERED:
        transport.close()
        raise NotTaken(answer.reason or "no answer")
    held = tuple(entry.file for entry in _run_entries(run_dir) if entry.held)
    counters = Counters()
    spool = Spool(SpoolConfig(directory=str(directory)), run, name, counters)
    try:
        redriven = _redrive(spool, run_dir) if dead_letters else 0
    except OSError:
        spool.close()
        transport.close()
        raise
    config = SenderConfig(close_timeout_s=timeout_s, retry_max_s=max(0.5, min(10.0, timeout_s / 4)))
    complete = Sender(config, transport, spool, counters).close()  # never started: flushes here
    counts = counters.snapshot()
    return SendResult(
        run=run,
        replayed=counts["replayed"],
        dead_lettered=counts["dead_lettered"],
        unreadable=counts["spool_unreadable"],
        redriven=redriven,
        held=held,
        complete=complete,
    )


def _redrive(spool: Spool, run_dir: Path) -> int:
    """Dead letters back into ``spool`` (fsync'd), each file removed once all its records are
    in; a file whose trainer is alive (its spool file held: it may append to it) is left."""
    moved = 0
    for path in sorted(run_dir.glob(f"*{DEAD_SUFFIX}")):
        if path == spool.dead_letter_path or _held(path.with_name(_spool_file_of(path))):
            continue
        batches = [records for records, _ in _dead_batches(path) if records]
        for records in batches:
            if not spool.append(records):
                raise OSError(f"the spool is at its disk limit; {path} was left as it was")
        moved += sum(len(records) for records in batches)
        path.unlink()
    return moved


def _spool_file_of(dead: Path) -> str:
    return dead.name[: -len(DEAD_SUFFIX)] + SPOOL_SUFFIX


def _entry(run_dir: str, path: Path) -> SpoolEntry:
    dead = path.name.endswith(DEAD_SUFFIX)
    if dead:
        lines = list(_dead_batches(path))
        reasons = tuple(dict.fromkeys(reason for _, reason in lines if reason))
        held = _held(path.with_name(_spool_file_of(path)))
    else:
        lines = [(records, "") for records in _spooled_batches(path)]
        reasons, held = (), _held(path)
    readable = [records for records, _ in lines if records is not None]
    return SpoolEntry(
        run_dir=run_dir,
        file=path.name,
        kind="dead" if dead else "spool",
        batches=len(readable),
        records=sum(len(records) for records in readable),
        unreadable=len(lines) - len(readable),
        held=held,
        reasons=reasons,
    )


def _spooled_batches(path: Path) -> Iterator[list[Any] | None]:
    """The batches after the replay cursor (None for a line that does not parse)."""
    cursor_path = path.with_name(path.name + ".cursor")
    try:
        cursor = int(cursor_path.read_text().strip() or 0)
    except (OSError, ValueError):
        cursor = 0
    data = path.read_bytes()
    if not 0 <= cursor <= len(data):
        cursor = 0  # as ``SpoolFile`` reads a cursor past the end
    for line in data[cursor:].splitlines():
        yield _records(_document(line))


def _dead_batches(path: Path) -> Iterator[tuple[list[Any] | None, str]]:
    """Each dead-letter line's records and the service's reason for refusing them."""
    for line in path.read_bytes().splitlines():
        document = _document(line)
        yield _records(document), str(document.get("reason") or "")


def _document(line: bytes) -> dict[str, Any]:
    try:
        document = decode_line(line)
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def _records(document: dict[str, Any]) -> list[Any] | None:
    records = document.get("records")
    return records if isinstance(records, list) else None


def _held(path: Path) -> bool:
    """Whether a live process holds the spool file's lock (a missing file is held by none)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False
