"""Asynchronous saves: PyTorch DCP's two completion points wired into the hook.

``torch.distributed.checkpoint.async_save`` returns the storage future, having staged the state
before it returned; with an ``async_stager`` (``DefaultStager``, PyTorch 2.9 on) it returns an
``AsyncSaveResponse`` whose ``staging_completion`` and ``upload_completion`` are two futures.
``track_async_save`` tells the hook of each as it completes, on the thread that completes it:

    rh.checkpoint_saving(step)                                   # the save starts (T_save from here)
    response = dcp.async_save(state, checkpoint_id=path, async_stager=DefaultStager())
    track_async_save(rh, step, path, response)                   # staged, then stored and published
    ...
    response.staging_completion.result()                         # before the next optimizer.step()

The checkpoint is recorded (and becomes a rollback target once its manifest is) only when its
storage completed; a storage future that raised records nothing and says so in the log. A
future wakes the threads waiting on it before it runs its callbacks, so the hook's close waits
for a staged save's publication, and a save is published only after its staging was told. The
futures stay the trainer's: it still waits on them and sees their exceptions (the reference
text: "propagate future exceptions").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from os import PathLike
from typing import Any, Protocol

log = logging.getLogger("runhealth.collectors")

STAGED_CALLBACK_WAIT_S = 10.0
"""How long a storage future's callback waits for its staging future's callbacks before it
publishes the save. Ours takes microseconds (a lock, a count); the bound only keeps a storage
thread from waiting forever on a staging callback (another's) that never returns."""


class SaveEvents(Protocol):
    """The hook's calls a save's completions make (``RunHealth`` has them)."""

    def checkpoint_staged(self, step: int | None = None) -> None: ...

    def checkpoint_failed(self, step: int | None = None) -> None: ...

    def checkpoint_saved(self, step: int, path: str | PathLike[str], **kwargs: Any) -> None: ...


def completion_futures(response: Any) -> tuple[Future[Any] | None, Future[Any]]:
    """(staging, storage) of what ``async_save`` returned: an ``AsyncSaveResponse`` has both;
    a bare future is storage alone (staging was done when ``async_save`` returned)."""
    storage = getattr(response, "upload_completion", response)
    if not isinstance(storage, Future):
        raise TypeError(
            f"track_async_save: expected a Future or an AsyncSaveResponse, got {type(response).__name__}"
        )
    return getattr(response, "staging_completion", None), storage


def track_async_save(
    rh: SaveEvents,
    step: int,
    path: str | PathLike[str],
    response: Any,
    *,
    consumed: int | None = None,
    tags: Sequence[str] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Record ``response``'s staging and storage as the hook's ``checkpoint_staged`` and
    ``checkpoint_saved`` of ``step`` at ``path`` (call ``rh.checkpoint_saving(step)`` before
    ``async_save``). Returns at once; nothing here waits on a future."""
    staging, storage = completion_futures(response)
    staged_told = threading.Event()

    def staged(future: Future[Any]) -> None:
        try:
            if not future.cancelled() and future.exception() is None:
                rh.checkpoint_staged(step)
        finally:
            staged_told.set()

    def stored(future: Future[Any]) -> None:
        # A stager's storage waits for the staging future, whose waiters wake before its callbacks
        # run: published before ``staged`` ran, the save would count as blocking (no staging time,
        # no updates before staging).
        if staging is not None and staging.done():
            staged_told.wait(STAGED_CALLBACK_WAIT_S)
        error = future.exception() if not future.cancelled() else "cancelled"
        if error is not None:
            log.warning(
                "runhealth: the asynchronous save of step %d to %s failed (%s): not recorded",
                step,
                path,
                error,
            )
            rh.checkpoint_failed(step)
            return
        rh.checkpoint_saved(step, path, consumed=consumed, tags=tags, metrics=metrics)

    if staging is None:
        rh.checkpoint_staged(step)  # async_save staged before it returned
    else:
        staging.add_done_callback(staged)  # runs now if it is done already
    storage.add_done_callback(stored)
