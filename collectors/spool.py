"""The local spool: batches the service could not take, on disk, replayed in order.

One append-only JSON-lines file per rank (one batch a line, fsync'd per batch), with a replay
cursor beside it. Each file is held under an exclusive ``flock`` by the process that writes it;
a process that starts later adopts the files nobody holds (a crashed or finished trainer's) and
replays them before its own, so a spool outlives a trainer restart. Replays are safe to repeat:
the service stores a record once per key, so a batch re-sent after a crash between delivery and
cursor update is counted as duplicates, not stored twice.

A batch the service rejects as invalid goes to the dead-letter file with the reason; it is kept
for a person to inspect and is never replayed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.counters import Counters
from collectors.wire import Record, decode_line, encode_line

log = logging.getLogger("runhealth.collectors.spool")

SPOOL_SUFFIX = ".jsonl"
DEAD_SUFFIX = ".dead.jsonl"
READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class SpoolConfig:
    """Where undelivered batches wait, and how much disk they may take.

    ``directory``: ``runhealth-spool`` in the working directory (``RUNHEALTH_SPOOL_DIR``), one
    subdirectory per run. Per-rank file names carry the node, so a shared directory is safe.
    ``max_bytes``: 256 MiB per rank, about 400,000 step records of ~600 bytes: days of one
    window a second. Past it new batches are dropped and counted; nothing spooled is overwritten.
    ``fsync``: each batch reaches the disk before the sender moves on; without it a node crash
    loses what the page cache held.
    """

    directory: str = "runhealth-spool"
    max_bytes: int = 256 * 1024 * 1024
    fsync: bool = True

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("SpoolConfig.directory must not be empty")
        if self.max_bytes < 4096:
            raise ValueError(f"SpoolConfig.max_bytes must be >= 4096, got {self.max_bytes}")


def safe_name(text: str) -> str:
    """A file-name-safe rendering of a run or node name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "_"


class SpoolFile:
    """One locked spool file and its replay cursor. Used by one thread."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._cursor_path = path.with_name(path.name + ".cursor")
        self.cursor = self._read_cursor()

    @classmethod
    def open_locked(cls, path: Path) -> SpoolFile | None:
        """The file, created if missing and locked for this process; None if another holds it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(path, fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def pending(self) -> bool:
        return self.cursor < self.size()

    def append(self, line: bytes, fsync: bool) -> None:
        """One write call per batch: with O_APPEND it lands whole at the end of the file. A
        write the disk refuses (full, gone read-only) leaves the file as it was and raises: a
        partial line would run into the next one and make both unreadable."""
        before = self.size()
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes")
            if fsync:
                os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, before)
            raise

    def read_line(self) -> tuple[bytes, int] | None:
        """The line at the cursor and the offset after it; None at the end or a torn tail."""
        chunks, offset = [], self.cursor
        while True:
            chunk = os.pread(self._fd, READ_CHUNK, offset)
            if not chunk:
                return None  # no newline before the end: a write cut short by a crash
            cut = chunk.find(b"\n")
            if cut >= 0:
                chunks.append(chunk[: cut + 1])
                return b"".join(chunks), offset + cut + 1
            chunks.append(chunk)
            offset += len(chunk)

    def commit(self, offset: int) -> None:
        """Move the cursor; once everything is replayed, the file starts over empty."""
        if offset >= self.size():
            os.ftruncate(self._fd, 0)
            offset = 0
        self.cursor = offset
        tmp = self._cursor_path.with_name(self._cursor_path.name + ".tmp")
        tmp.write_text(str(offset))
        # A lost cursor only replays batches again, which the service deduplicates: no fsync.
        tmp.replace(self._cursor_path)

    def close(self, remove_if_empty: bool) -> None:
        if remove_if_empty and not self.pending():
            self.path.unlink(missing_ok=True)
            self._cursor_path.unlink(missing_ok=True)
        os.close(self._fd)  # releases the lock

    def _read_cursor(self) -> int:
        try:
            offset = int(self._cursor_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0
        # A cursor past the end means the file was emptied after the cursor was written.
        return offset if 0 <= offset <= self.size() else 0


@dataclass(frozen=True)
class SpooledBatch:
    source: SpoolFile | None
    """None for a batch waiting in memory."""
    records: list[Record]
    end: int


class Spool:
    """This rank's spool file, plus the unheld ones it adopted, oldest first. One thread."""

    def __init__(self, config: SpoolConfig, run: str, name: str, counters: Counters) -> None:
        self._config = config
        self._counters = counters
        self.directory = Path(config.directory) / safe_name(run)
        self.directory.mkdir(parents=True, exist_ok=True)
        own = SpoolFile.open_locked(self.directory / f"{safe_name(name)}{SPOOL_SUFFIX}")
        if own is None:
            raise RuntimeError(f"spool {name} is held by another process")
        self._own = own
        self._dead_path = self.directory / f"{safe_name(name)}{DEAD_SUFFIX}"
        self._adopted: deque[SpoolFile] = deque(self._adopt())
        # Where batches wait while the disk refuses them (full, read-only since): newer than
        # everything in the files, so replayed after them, and appended to until it drains.
        self._overflow = MemorySpool(config, run, name, counters)

    @property
    def path(self) -> Path:
        return self._own.path

    @property
    def dead_letter_path(self) -> Path:
        return self._dead_path

    def backlog(self) -> bool:
        return bool(self._adopted) or self._own.pending() or self._overflow.backlog()

    def append(self, records: Sequence[Record]) -> bool:
        """Keep a batch for replay; False (and counted as dropped) past the disk limit. A batch
        the disk refuses waits in memory (``MemorySpool``, the same byte limit), said once each
        time the disk starts refusing."""
        if self._overflow.backlog():
            return self._overflow.append(records)  # behind what already waits there
        line = encode_line({"records": list(records), "spooled_at": time.time()})
        if self._own.size() + len(line) > self._config.max_bytes:
            self._counters.add("dropped", len(records))
            log.error(
                "spool %s is at its %d-byte limit: dropped %d records",
                self._own.path,
                self._config.max_bytes,
                len(records),
            )
            return False
        try:
            self._own.append(line, self._config.fsync)
        except OSError as exc:
            log.error(
                "runhealth: spool %s cannot be written (%s): batches wait in memory, up to %d bytes, "
                "until it can",
                self._own.path,
                exc,
                self._config.max_bytes,
            )
            return self._overflow.append(records)
        self._counters.add("spooled", len(records))
        return True

    def head(self) -> SpooledBatch | None:
        """The oldest batch not yet replayed (adopted files first), skipping torn lines."""
        while self._adopted or self._own.pending():
            source = self._adopted[0] if self._adopted else self._own
            read = source.read_line()
            if read is None:
                self._finish(source)
                continue
            line, end = read
            batch = self._parse(source, line, end)
            if batch is not None:
                return batch
        return self._overflow.head()

    def advance(self, batch: SpooledBatch) -> None:
        if batch.source is None:
            self._overflow.advance(batch)
            return
        batch.source.commit(batch.end)
        if batch.source is not self._own and not batch.source.pending():
            self._finish(batch.source)

    def dead_letter(self, records: Sequence[Record], reason: str, status: int | None) -> None:
        entry = {"time": time.time(), "status": status, "reason": reason, "records": list(records)}
        with open(self._dead_path, "ab") as handle:
            handle.write(encode_line(entry))
            handle.flush()
            os.fsync(handle.fileno())
        self._counters.add("dead_lettered", len(records))

    def close(self) -> None:
        for source in self._adopted:
            source.close(remove_if_empty=True)
        self._adopted.clear()
        self._own.close(remove_if_empty=True)
        self._overflow.close()  # what still waits in memory is counted as dropped, and said

    def _adopt(self) -> list[SpoolFile]:
        found = []
        for path in sorted(self.directory.glob(f"*{SPOOL_SUFFIX}"), key=_mtime):
            if path.name.endswith(DEAD_SUFFIX) or path == self._own.path:
                continue
            spool_file = SpoolFile.open_locked(path)
            if spool_file is None:
                continue  # a live process holds it
            if spool_file.pending():
                log.info("adopting spool %s left by an earlier process", path)
                found.append(spool_file)
            else:
                spool_file.close(remove_if_empty=True)
        return found

    def _finish(self, source: SpoolFile) -> None:
        """An adopted file replayed to its end (or to a torn tail) is removed."""
        if source is self._own:
            if source.pending():  # a torn tail in our own file: skip past it
                source.commit(source.size())
            return
        self._adopted.remove(source)
        if source.pending():
            self._counters.add("spool_unreadable")
            source.commit(source.size())
        source.close(remove_if_empty=True)

    def _parse(self, source: SpoolFile, line: bytes, end: int) -> SpooledBatch | None:
        try:
            document: Any = decode_line(line)
            records = document["records"]
            if not isinstance(records, list):
                raise TypeError("records is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            self._counters.add("spool_unreadable")
            log.error("skipping an unreadable line of spool %s: %s", source.path, exc)
            source.commit(end)
            return None
        return SpooledBatch(source, records, end)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class MemorySpool:
    """Where batches wait when the spool directory cannot be written (read-only, full, no
    permission): in memory, up to the spool's byte limit, replayed in order like the file
    spool; past the limit they are dropped and counted. A dead letter is logged with its
    reason and counted. Nothing here outlives the process: ``close`` counts what was left as
    dropped. The hook says once, at attach, that it runs this way (``attach.build_sender``)."""

    def __init__(self, config: SpoolConfig, run: str, name: str, counters: Counters) -> None:
        self._config = config
        self._counters = counters
        self.directory = Path(config.directory) / safe_name(run)
        self.path = self.directory / f"{safe_name(name)}{SPOOL_SUFFIX}"
        self.dead_letter_path = self.directory / f"{safe_name(name)}{DEAD_SUFFIX}"
        self._batches: deque[tuple[list[Record], int]] = deque()
        self._bytes = 0

    def backlog(self) -> bool:
        return bool(self._batches)

    def append(self, records: Sequence[Record]) -> bool:
        size = len(encode_line({"records": list(records)}))
        if self._bytes + size > self._config.max_bytes:
            self._counters.add("dropped", len(records))
            log.error(
                "the in-memory spool is at its %d-byte limit: dropped %d records",
                self._config.max_bytes,
                len(records),
            )
            return False
        self._batches.append((list(records), size))
        self._bytes += size
        self._counters.add("spooled", len(records))
        return True

    def head(self) -> SpooledBatch | None:
        if not self._batches:
            return None
        return SpooledBatch(None, self._batches[0][0], 0)

    def advance(self, batch: SpooledBatch) -> None:
        if self._batches and self._batches[0][0] is batch.records:
            _, size = self._batches.popleft()
            self._bytes -= size

    def dead_letter(self, records: Sequence[Record], reason: str, status: int | None) -> None:
        self._counters.add("dead_lettered", len(records))
        log.error(
            "runhealth: %d records refused by the service (%s %s); the spool directory cannot be "
            "written, so they are not kept: %s",
            len(records),
            status,
            reason,
            encode_line({"records": list(records)[:3]}).decode()[:2000],
        )

    def close(self) -> None:
        left = sum(len(records) for records, _ in self._batches)
        if left:
            self._counters.add("dropped", left)
            log.error("runhealth: %d records were never delivered and had no spool to wait in", left)
        self._batches.clear()
        self._bytes = 0
