"""One ``runhealth serve`` per SQLite store.

SQLite has one writer and the service keeps each run's judging state in its own memory, so a
second service over the same file would judge every run again (two incidents for one fault) and
fight the first for the write lock. The first to start holds an exclusive ``flock`` on
``<db>.serve.lock`` while it runs; the kernel releases it when the process ends however it ends
(a SIGKILLed service leaves nothing to clean up), and a second start is refused, naming the
first. Several replicas are the PostgreSQL shape (``monitor.store.leases``).
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import URL

from monitor.store.db import StoreError, sqlite_path


class StoreInUse(StoreError):
    """Another service already serves this SQLite store; the message names it."""


def lock_path(store: Path) -> Path:
    return store.with_name(store.name + ".serve.lock")


@contextmanager
def sole_service(url: URL) -> Iterator[None]:
    """While the body runs, this process is the only service of the SQLite store at ``url``
    (nothing to hold for a database server)."""
    store = sqlite_path(url)
    if store is None:
        yield
        return
    path = lock_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, stat.S_IRUSR | stat.S_IWUSR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise StoreInUse(
                f"another runhealth serve (pid {holder}) already serves {store}: an SQLite store "
                "takes one service; use that one, stop it first, or run replicas over PostgreSQL"
            ) from None
        # Who holds it, for the message above (the lock, not this text, is what excludes).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
