"""``track_async_save``'s callbacks, in the order the hook must hear them whatever the threads
do: a ``concurrent.futures.Future`` wakes the threads waiting in ``result()`` before it runs its
callbacks, so a stager's storage may complete while the staging future's callbacks have not
run yet. The hook's events are recorded by a fake here; the service side is
``test_collectors_async_saves.py``."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from collectors import track_async_save


@dataclass
class HeardEvents:
    """The hook's save calls, in the order they came (``collectors.async_saves.SaveEvents``)."""

    calls: list[tuple[str, int | None]] = field(default_factory=list)

    def checkpoint_staged(self, step: int | None = None) -> None:
        self.calls.append(("staged", step))

    def checkpoint_failed(self, step: int | None = None) -> None:
        self.calls.append(("failed", step))

    def checkpoint_saved(self, step: int, path: str | PathLike[str], **kwargs: Any) -> None:
        self.calls.append(("saved", step))


@dataclass
class Response:
    """What ``async_save`` returns with an ``async_stager`` (an ``AsyncSaveResponse``'s fields)."""

    staging_completion: Future[Any]
    upload_completion: Future[Any]


def test_a_save_is_published_after_its_staging_though_the_staging_callbacks_run_late() -> None:
    heard = HeardEvents()
    response = Response(Future(), Future())
    go_on = threading.Event()
    # Another callback of the staging future, first in line: the stager thread is held there.
    response.staging_completion.add_done_callback(lambda _: go_on.wait(60))
    track_async_save(heard, 20, "ckpt-20", response)
    stager = threading.Thread(target=response.staging_completion.set_result, args=(None,))
    stager.start()
    response.staging_completion.result(60)  # the storage's wait for its staging returns now
    storer = threading.Thread(target=response.upload_completion.set_result, args=(None,))
    storer.start()
    storer.join(1.0)  # what the storage thread's callback does before staging is told
    go_on.set()
    stager.join(60)
    storer.join(60)
    assert heard.calls == [("staged", 20), ("saved", 20)]
