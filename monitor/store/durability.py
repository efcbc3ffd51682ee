"""Whether the store the service writes is the one it will read again.

SQLite keeps writing to a file deleted under it (the open descriptor holds the inode), so a
service whose store file was deleted or replaced went on acknowledging batches that the next
start would never see. ``StoreFile`` remembers the file the service opened and says when the
path no longer names it, or can no longer be written; the service then refuses batches with 503
(the hook spools and resends them) and ``/healthz`` says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import Engine

from monitor.store.db import sqlite_path


class StoreUnavailable(RuntimeError):
    """The store cannot take a write that would be read again: the message says why."""


@dataclass(frozen=True)
class StoreFile:
    path: Path
    device: int
    inode: int

    @classmethod
    def of(cls, engine: Engine) -> StoreFile | None:
        """The engine's SQLite file as it is now (None for a database server)."""
        path = sqlite_path(engine.url)
        if path is None:
            return None
        try:
            status = os.stat(path)
        except OSError:  # not there (yet): the engine's own errors say why
            return None
        return cls(path, status.st_dev, status.st_ino)

    def problem(self) -> str | None:
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return f"the store file {self.path} was deleted under the running service"
        except OSError as exc:
            return f"the store file {self.path} cannot be read: {exc}"
        if (status.st_dev, status.st_ino) != (self.device, self.inode):
            return f"the store file {self.path} was replaced under the running service"
        if not os.access(self.path, os.W_OK):
            return f"the store file {self.path} is not writable"
        return None

    def check(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise StoreUnavailable(f"{problem}: restart the service on an intact store")
