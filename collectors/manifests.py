"""Checkpoint manifests built off the training thread: a worker thread on the rank that sends.

``rh.checkpoint_saved(step, path)`` without a manifest hands the checkpoint here and returns at
once. The worker waits until the files are quiet (no size or modification time changed over
``HookConfig.manifest_settle_s``: other ranks' files of the same save may still be landing, and
the hook adds no barrier to a save), reads every byte for the sha256, checks that nothing changed
while it read, and hands the manifest on to be sent. The checkpoint becomes a rollback target
once that record is stored. One thread at a time, first in first out, so the records leave in the
order the saves were made; it exits when it has nothing left and starts again at the next save.

A save to a path that a later save wrote over before its turn came, or while it was read, is
recorded without a manifest: the files hold the later save's bytes, and a manifest of them under
the earlier step would make that step a rollback target that restores the later state (a
trainer that overwrites ``snapshot.pt`` every epoch, faster than ``manifest_settle_s`` and a
hash, queued every save of the run behind the first and hashed the last one's bytes for each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collectors.checkpoints import build_manifest, files_seen

log = logging.getLogger("runhealth.collectors")

MAX_READS = 5
"""Reads of a checkpoint that keeps changing before its record is sent without a manifest (a
save still being written after five quiet periods is not one boundary's checkpoint)."""


class StillChanging(Exception):
    """The files changed across every read: no manifest describes one state of them."""


@dataclass(frozen=True)
class ManifestJob:
    """A checkpoint waiting for its manifest: what ``checkpoint_saved`` was told."""

    step: int
    path: str
    time: float
    consumed: int | None = None
    tags: tuple[str, ...] | None = None
    metrics: dict[str, float] | None = None


def settled_manifest(
    path: str, step: int, consumed: int | None, settle_s: float, wait: Callable[[float], Any] = time.sleep
) -> dict[str, Any]:
    """The manifest of files that stayed the same for ``settle_s`` before and while they were
    read; raises ``StillChanging`` after ``MAX_READS`` tries, ``FileNotFoundError`` when the
    checkpoint is gone."""
    seen = files_seen(path)
    for _ in range(MAX_READS):
        wait(settle_s)
        before = files_seen(path)
        if before != seen:  # still being written: wait for another quiet period
            seen = before
            continue
        manifest = build_manifest(path, step, consumed)
        seen = files_seen(path)
        if seen == before:
            return manifest
    raise StillChanging(f"checkpoint {path} kept changing over {MAX_READS} reads")


class ManifestWorker:
    """Builds each submitted checkpoint's manifest on its own thread and calls ``send(job,
    manifest)`` there (``manifest`` None when none could be made, said in the log)."""

    def __init__(
        self,
        send: Callable[[ManifestJob, dict[str, Any] | None], None],
        settle_s: float,
        wait: Callable[[float], Any] = time.sleep,
    ) -> None:
        self._send = send
        self._settle_s = settle_s
        self._wait = wait
        self._jobs: deque[tuple[int, ManifestJob]] = deque()
        self._state = threading.Condition()
        self._running = False
        self._reading = 0  # jobs taken off the queue and not yet sent (0 or 1)
        self._submitted = 0
        # Path -> the number of its newest save, while a save of it is queued or being read.
        self._newest: dict[str, int] = {}
        self._said_overwritten: set[str] = set()

    def submit(self, job: ManifestJob) -> None:
        """Queue a checkpoint; never blocks on the files."""
        with self._state:
            self._submitted += 1
            self._newest[job.path] = self._submitted
            self._jobs.append((self._submitted, job))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="runhealth-manifests", daemon=True).start()

    def finish(self, timeout: float | None = None) -> bool:
        """Wait until every queued checkpoint was sent; False if ``timeout`` passed first."""
        with self._state:
            return self._state.wait_for(lambda: not self._running, timeout)

    @property
    def pending(self) -> int:
        """Checkpoints queued or being read."""
        with self._state:
            return len(self._jobs) + self._reading

    def _run(self) -> None:
        while (taken := self._next()) is not None:
            number, job = taken
            try:
                self._send(job, self._manifest(number, job))
            except Exception:  # one checkpoint's failure must not stop the later ones' records
                log.exception("runhealth: checkpoint %s (step %d) could not be recorded", job.path, job.step)
            with self._state:
                self._reading = 0
                if self._newest.get(job.path) == number:
                    del self._newest[job.path]  # no save of that path left: the map stays small

    def _next(self) -> tuple[int, ManifestJob] | None:
        """The next job, or None when there is none (the thread then ends, marked not running
        under the same lock a ``submit`` takes, so no job is left without a thread)."""
        with self._state:
            if self._jobs:
                self._reading = 1
                return self._jobs.popleft()
            self._running = False
            self._state.notify_all()
            return None

    def _manifest(self, number: int, job: ManifestJob) -> dict[str, Any] | None:
        if self._overwritten(number, job):  # before reading: the bytes are not this save's
            return None
        try:
            manifest = settled_manifest(job.path, job.step, job.consumed, self._settle_s, self._wait)
        except (OSError, StillChanging) as exc:
            log.warning(
                "runhealth: checkpoint %s (step %d) is recorded without a manifest, so it is no "
                "rollback target: %s",
                job.path,
                job.step,
                exc,
            )
            return None
        # A save of the same path made while this one was read may be what was read. (One
        # whose ``checkpoint_saved`` comes more than a quiet period after its bytes is not seen.)
        return None if self._overwritten(number, job) else manifest

    def _overwritten(self, number: int, job: ManifestJob) -> bool:
        """Whether a later save of ``job``'s path was submitted; said once per path."""
        with self._state:
            newest = self._newest.get(job.path, number)
            if newest == number:
                return False
            first = job.path not in self._said_overwritten
            self._said_overwritten.add(job.path)
        if first:
            log.warning(
                "runhealth: checkpoint %s (step %d) was saved over by a later save before it could be "
                "hashed, so it is recorded without a manifest and is no rollback target (saves of "
                "that path come faster than their files settle for %.1f s and are read; said once)",
                job.path,
                job.step,
                self._settle_s,
            )
        return True
