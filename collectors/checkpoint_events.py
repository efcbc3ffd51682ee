"""Checkpoint and resume events: what the trainer saved, and what a restart restored.

A checkpoint event is sent when the trainer says the checkpoint is committed (rank 0's only:
every rank names the same files), with its path made absolute here and its manifest, built off
the training thread unless the trainer gives one (``manifests.py``). A resume event reads the
restored objects once (a sync, fine at resume), continues the step and consumed counters from
the checkpoint, and waits for the first window when it still lacks that window's first sample
ids.

A save the trainer declares (``checkpoint_saving`` before it starts) is timed to its publication
(``checkpoint_saved``): the preemption budget's ``T_save``. An asynchronous save has a second
completion point in between, staging (``checkpoint_staged``: the snapshot no longer depends on
live state); the hook counts the optimizer updates made before it, and notes a previous
recovery point gone before the new one was published (``policies.async_checkpoints``). None of
this is on the step path: it reads the counters the windows keep anyway, at the save's calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from collectors import records
from collectors.accounting import WindowAccounting
from collectors.agent import DirectiveAgent
from collectors.checkpoints import checkpoint_location
from collectors.config import RunHealthConfig
from collectors.data_state import state_digest
from collectors.guard import EntryErrors, guarded
from collectors.manifests import ManifestJob, ManifestWorker
from collectors.outbox import Outbox
from collectors.phases import Phase
from collectors.restore import gather_restored
from collectors.window import render_ids
from policies import async_checkpoints as saves
from policies.protocol import to_wire

log = logging.getLogger("runhealth.collectors")


MAX_PENDING_SAVES = 8
"""Saves declared and not yet published, kept for their timing: the reference text asks to
bound concurrent saves, and a trainer that declares saves it never finishes must not grow this."""


@dataclass
class SaveMark:
    """A save the trainer declared (``checkpoint_saving``), until it is published or failed."""

    step: int | None
    started: float  # perf_counter
    updates: int  # the hook's updates seen at the start (``CheckpointEvents._updates_seen``)
    consumed: int | None  # at the boundary the save captures
    thread: int
    staged: float | None = None
    updates_before_staged: int = 0
    previous_gone: bool = False  # the last recorded checkpoint was gone when this save started
    tags: list[str] = field(default_factory=list)


@dataclass
class PendingResume:
    """A resume event waiting for what it may still lack: the attach (for the origin) and the
    first window (for the first batch's sample ids)."""

    restored: dict[str, Any]
    checkpoint_path: str | None
    checkpoint_step: int | None
    time: float


class CheckpointEvents:
    """``new_incarnation``: the hook's restart inside this process (a restore after windows
    ran). ``agent``: runs the canary suite at each checkpoint when configured, and is told of
    a resume (it ends the rollback stop)."""

    def __init__(
        self,
        config: RunHealthConfig,
        windows: WindowAccounting,
        agent: DirectiveAgent,
        outbox: Outbox,
        faults: EntryErrors,
        clock: Callable[[], float],
        new_incarnation: Callable[[], None],
    ) -> None:
        self._config = config
        self._windows = windows
        self._agent = agent
        self._outbox = outbox
        self.faults = faults
        self._clock = clock
        self._new_incarnation = new_incarnation
        self._max_sample_ids = config.hook.max_sample_ids
        self.scheduler: Any = None  # read only at resume
        self.manifests = ManifestWorker(self._send_checkpoint, config.hook.manifest_settle_s)
        self._saves: deque[SaveMark] = deque()
        self._saves_lock = threading.Lock()  # staged and saved may come from a save's own thread
        self._saves_changed = threading.Condition(self._saves_lock)  # close waits on it
        self._publishing = 0  # ``checkpoint_saved`` calls under way, on any thread
        self._published: str | None = None  # the last checkpoint this hook recorded: the recovery point
        self.run_named_at_start: str | None = None
        """Rank 0's run name when only the start time named it (``RunId.by_start_time``)."""

    @guarded
    def checkpoint_saving(self, step: int | None = None) -> None:
        """A save begins (optional; call it right before writing or staging, then
        ``checkpoint_saved``): heartbeats say ``saving`` meanwhile, and the hang rule gives a
        declared save its own timeout (30 minutes, or longer when the run's saves were) instead
        of a step's. The save is timed from here to ``checkpoint_saved`` (the preemption
        budget's ``T_save``), and its consumed-example count is taken here, at the boundary it
        captures. ``step``: the step ``checkpoint_saved`` will name, when several saves overlap
        (asynchronous ones); otherwise the oldest declared save is the one published next. Not
        on the step path: no mark in the window's timings. A window still open whose update
        already ran is closed first: a loop that saves right after ``optimizer.step()`` inside
        ``rh.windows()`` (Accelerate's examples save inside the batch loop) would otherwise
        spend the whole save in that window's optimizer phase, where the hang rule allows a
        step's time, not a save's."""
        window = self._windows.unfinished
        if window is not None and (window.updates or window.verdicts):
            self._windows.flush()
        mark = SaveMark(
            step,
            time.perf_counter(),
            self._updates_seen(),
            self._windows.boundary_consumed(),
            threading.get_ident(),
        )
        mark.previous_gone = self._previous_gone(None)
        with self._saves_lock:
            if len(self._saves) >= MAX_PENDING_SAVES:
                dropped = self._saves.popleft()
                log.warning(
                    "runhealth hook: more than %d saves declared and not published; the save of step "
                    "%s is no longer timed (call rh.checkpoint_failed() for a save that failed)",
                    MAX_PENDING_SAVES,
                    dropped.step,
                )
            self._saves.append(mark)
        phases = getattr(self._windows, "phases", None)  # none before attach: no heartbeats yet
        if phases is not None:
            phases.current = (Phase.SAVING, time.perf_counter(), None)

    @guarded
    def checkpoint_staged(self, step: int | None = None) -> None:
        """An asynchronous save's staging completed: its snapshot no longer depends on live
        state, and the trainer may step the optimizer again (any thread: a staging future's
        callback; ``collectors.async_saves.track_async_save`` wires DCP's). Updates the trainer
        made between ``checkpoint_saving`` and now are counted: the service raises
        ``updated_before_staged`` for them and offers no rollback to that checkpoint."""
        now = time.perf_counter()
        with self._saves_lock:
            mark = self._mark(step, staged=False)
            if mark is None:
                return
            mark.staged = now
            mark.updates_before_staged = max(0, self._updates_seen() - mark.updates)
        phases = getattr(self._windows, "phases", None)
        if phases is not None and phases.current[0] is Phase.SAVING:  # training goes on while it stores
            phases.current = (Phase.DATA, now, None)

    @guarded
    def checkpoint_failed(self, step: int | None = None) -> None:
        """A declared save that will not be published (its storage raised): no longer timed."""
        with self._saves_lock:
            mark = self._mark(step, staged=None)
            if mark is not None:
                self._saves.remove(mark)
                self._saves_changed.notify_all()
        phases = getattr(self._windows, "phases", None)
        if phases is not None and phases.current[0] is Phase.SAVING:
            phases.current = (Phase.DATA, time.perf_counter(), None)

    def _mark(self, step: int | None, *, staged: bool | None) -> SaveMark | None:
        """The declared save ``step`` names (the caller holds the lock): the one declared with
        that step, else the oldest declared without one; ``staged`` False: only one not staged
        yet. None when there is none (the save was not declared)."""
        candidates = [m for m in self._saves if staged is None or (m.staged is not None) == staged]
        named = [m for m in candidates if step is not None and m.step == step]
        unnamed = [m for m in candidates if m.step is None or step is None]
        chosen = named or unnamed
        return chosen[0] if chosen else None

    def _updates_seen(self) -> int:
        """Optimizer updates so far: the ended windows' and the open or held window's (its step hook
        counted one; the step counter moves at its end). Reads two attributes, no device."""
        windows = self._windows
        window = windows.unfinished
        return windows.step + (1 if window is not None and (window.updates or window.verdicts) else 0)

    def _published_save(self, step: int, location: str) -> SaveMark | None:
        """The declared save this publication ends (taken off the list), with the tags its
        ordering rules call for."""
        with self._saves_lock:
            mark = self._mark(step, staged=None)
            if mark is not None:
                self._saves.remove(mark)
        gone = self._previous_gone(location)
        previous, self._published = self._published, location
        if mark is None:
            return None
        asynchronous = mark.staged is not None
        if asynchronous:
            mark.tags.append(saves.ASYNC_TAG)
        # A blocking save's trainer may delete the previous checkpoint once the new one is
        # written and before it calls ``checkpoint_saved`` (the transformers Trainer's rotation
        # does): only a previous one gone before the save began is early. An asynchronous save's
        # is early until its storage completed; one written over it in place replaces it then.
        in_place = asynchronous and previous == location
        if in_place or mark.previous_gone or (asynchronous and gone):
            mark.tags.append(saves.PREVIOUS_DELETED_TAG)
        return mark

    def _previous_gone(self, location: str | None) -> bool:
        """Whether the checkpoint this hook recorded last (not ``location``) is gone: one
        ``stat``, at a save's start and end only. A URL is not looked at."""
        previous = self._published
        if previous is None or previous == location or "://" in previous:
            return False
        return not os.path.exists(previous)

    @staticmethod
    def _save_metrics(mark: SaveMark, published: float) -> dict[str, float]:
        """The save's timings, as the record's ``metrics`` carry them (``policies.async_checkpoints``)."""
        timed = {saves.SAVE_S: published - mark.started}
        if mark.staged is not None:
            timed[saves.STAGING_S] = mark.staged - mark.started
            if mark.updates_before_staged:
                timed[saves.UPDATES_BEFORE_STAGED] = float(mark.updates_before_staged)
        return timed

    @guarded
    def checkpoint_saved(
        self,
        step: int,
        path: str | PathLike[str],
        *,
        manifest: Mapping[str, Any] | None = None,
        consumed: int | None = None,
        tags: Sequence[str] | None = None,
        metrics: Mapping[str, float] | None = None,
        hash_files: bool = True,
    ) -> None:
        """A committed checkpoint, a directory or one file (call it once its files landed). A
        relative path is taken from this process's working directory, now. Without a
        ``manifest`` it returns at once: a background thread hashes the files and sends the
        record when done (the checkpoint is a rollback target from then on); ``hash_files=False``
        records it without one (no rollback target). Rank 0 sends; other ranks' calls send
        nothing and hash nothing. A path saved again with other content is a new version.
        ``consumed`` defaults to the count the given manifest names, else to the hook's own
        consumed-example count now (None where the hook lost count): a rollback to this
        checkpoint continues from it. A save declared with ``checkpoint_saving`` is timed to
        this call and takes its consumed count from there; this call may come from the thread
        that stored it (an asynchronous save's storage future)."""
        with self._publishing_one():  # close waits for it: the record is made before the sender stops
            mark = self._record_saved(step, path, manifest, consumed, tags, metrics, hash_files)
        # The canary runs on the training thread only (not on a save's storage thread).
        on_training_thread = mark is None or mark.thread == threading.get_ident()
        if self._config.hook.canary_on_checkpoint and self._windows.active and on_training_thread:
            self._agent.run_canary(None)

    @contextlib.contextmanager
    def _publishing_one(self) -> Iterator[None]:
        """A ``checkpoint_saved`` under way (``_nothing_storing``)."""
        with self._saves_changed:
            self._publishing += 1
        try:
            yield
        finally:
            with self._saves_changed:
                self._publishing -= 1
                self._saves_changed.notify_all()

    def _record_saved(
        self,
        step: int,
        path: str | PathLike[str],
        manifest: Mapping[str, Any] | None,
        consumed: int | None,
        tags: Sequence[str] | None,
        metrics: Mapping[str, float] | None,
        hash_files: bool,
    ) -> SaveMark | None:
        """``checkpoint_saved``'s record, sent or handed to the manifest worker; the declared
        save it ended, if any."""
        published = time.perf_counter()
        phases = getattr(self._windows, "phases", None)
        if phases is not None and phases.current[0] is Phase.SAVING:  # over: between windows again
            phases.current = (Phase.DATA, published, None)
        location = checkpoint_location(path)  # the trainer's working directory, not the service's
        now = self._clock()
        mark = self._published_save(step, location)
        if mark is not None:
            metrics = {**(metrics or {}), **self._save_metrics(mark, published)}
            tags = [*(tags or ()), *mark.tags] or None
        if consumed is None:
            named = (manifest or {}).get("consumed")
            boundary = mark.consumed if mark is not None else self._windows.boundary_consumed()
            consumed = int(named) if named is not None else boundary
        # Built now, so a bad value is refused at the call (``guarded``), not on the thread.
        event = records.checkpoint(
            step, location, now, manifest=manifest, consumed=consumed, tags=tags, metrics=metrics
        )
        if manifest is not None or not hash_files:
            self._outbox.submit_event(event)
        elif self._sends_checkpoints():
            job_tags = tuple(tags) if tags else None
            self.manifests.submit(
                ManifestJob(step, location, now, consumed, job_tags, dict(metrics or {}) or None)
            )
        return mark

    def _sends_checkpoints(self) -> bool:
        """Rank 0, or not attached yet (the outbox decides then)."""
        origin = self._outbox.origin
        return origin is None or origin.rank == 0

    def _send_checkpoint(self, job: ManifestJob, manifest: Mapping[str, Any] | None) -> None:
        """On the manifest worker's thread: the record, with the manifest it built."""
        event = records.checkpoint(
            job.step,
            job.path,
            job.time,
            manifest=manifest,
            consumed=job.consumed,
            tags=job.tags,
            metrics=job.metrics,
        )
        self._outbox.submit_event(event)

    def finish_manifests(self) -> None:
        """At close: the asynchronous saves still storing are published (waited for as long as
        the sender's ``close_timeout_s`` gives what is left), then every checkpoint still being
        hashed is recorded before the sender stops. A storage future wakes the trainer's
        ``result()`` before it runs its callbacks: a trainer that waits for its last save and
        closes at once would otherwise close before ``track_async_save`` published it."""
        timeout_s = self._config.sender.close_timeout_s
        with self._saves_changed:
            published = self._saves_changed.wait_for(self._nothing_storing, timeout_s)
            storing = sum(mark.staged is not None for mark in self._saves)
        if not published:
            log.warning(
                "runhealth hook: %d asynchronous save(s) still storing after %.0f s at close: "
                "not recorded (wait for their storage before closing the hook)",
                storing,
                timeout_s,
            )
        self.manifests.finish()

    def _nothing_storing(self) -> bool:
        """No staged save awaits its publication and none is being published (the caller
        holds the lock). A declared save never staged is not waited for: a blocking save that
        never ended (the run failed in it) is not coming."""
        return self._publishing == 0 and all(mark.staged is None for mark in self._saves)

    @guarded
    def resumed(
        self,
        *,
        checkpoint_path: str | None = None,
        checkpoint_step: int | None = None,
        consumed: int | None = None,
        first_sample_ids: Any = None,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
        data_state: Any = None,
        deterministic_data: bool | None = None,
    ) -> None:
        """What a restart restored. Reads device values (moment norms, the scale): a sync,
        fine once at resume. Objects default to the watched ones. The step counter continues
        from ``checkpoint_step`` (else the optimizer's step counter), ``consumed`` likewise
        (unknown from a restored step without it); the first batch's ids come from the first
        window unless given. The data position is checked on what can be restored: ``consumed``,
        the digest of ``data_state`` (a ``StatefulDataLoader.state_dict()``, a sampler's state:
        ``data_state.py``), and the sample ids only when ``deterministic_data`` (default
        ``HookConfig.deterministic_data``) says the same batches follow a checkpoint every time."""
        windows = self._windows
        if windows.active and windows.attempt > 0:
            self._new_incarnation()  # restored in this process: what follows is a new start
        elif self.run_named_at_start is not None:
            self._say_resume_is_a_new_run(checkpoint_path)
        self._agent.stop = None  # the rollback it stopped for is done
        watched_optimizer = windows.optimizers[0] if windows.optimizers else None
        restored = gather_restored(  # reads device values: a sync, once, at resume
            model=model if model is not None else windows.model,
            optimizer=optimizer if optimizer is not None else watched_optimizer,
            scheduler=scheduler if scheduler is not None else self.scheduler,
            scaler=scaler if scaler is not None else windows.scaler,
        )
        restored.update(extra or {})
        step = checkpoint_step
        if step is None and "optimizer_step_max" in restored.get("optimizer", {}):
            step = int(restored["optimizer"]["optimizer_step_max"])
        if step is not None:
            windows.step = step
        if consumed is not None:
            windows.consumed = consumed
        elif step:
            windows.consumed = None  # counting on from this process's count would claim a reset
        restored.update(resumed_step=step, consumed=consumed)
        restored["data"] = self._data_position(data_state, deterministic_data)
        if checkpoint_path is not None:
            checkpoint_path = checkpoint_location(checkpoint_path)  # as ``checkpoint_saved`` records it
        if first_sample_ids is not None:
            restored["first_sample_ids"] = render_ids(first_sample_ids, self._max_sample_ids)
        pending = PendingResume(to_wire(restored), checkpoint_path, checkpoint_step, self._clock())
        windows.pending_resume = pending  # the window's start sends it (``flush_resume``)
        if first_sample_ids is not None or windows.window is not None:
            self.flush_resume()

    def _say_resume_is_a_new_run(self, checkpoint_path: str | None) -> None:
        """A start that resumes, in a run named from its own start time: the run that saved the
        checkpoint is another run, and its checkpoint record and loss are not this run's."""
        log.warning(
            "runhealth: resuming%s in run %s, a name taken from this start's time: the run that "
            "saved the checkpoint is another run, so this resume is not checked against its "
            "checkpoint record or its loss, nor counted with its restarts. Give every start of "
            "the job one name: RUNHEALTH_RUN=NAME (or torchrun --rdzv-id, or Slurm's job id)",
            f" from {checkpoint_path}" if checkpoint_path else "",
            self.run_named_at_start,
        )
        self.run_named_at_start = None

    def _data_position(self, data_state: Any, deterministic: bool | None) -> dict[str, Any]:
        """What the resume says of its data position. A state that cannot be digested is
        logged and named in the record; the rest of the resume is still sent."""
        declared = self._config.hook.deterministic_data if deterministic is None else deterministic
        position: dict[str, Any] = {"deterministic": bool(declared)}
        if data_state is not None:
            try:
                position["state_digest"] = state_digest(data_state)  # copies tensors to the host: once
            except TypeError as error:
                log.warning("runhealth hook: %s", error)
                position["state_error"] = str(error)
        return position

    def flush_resume(self) -> None:
        """Send the pending resume event, with the current window's first ids if it lacks them."""
        windows = self._windows
        resume = windows.pending_resume
        if resume is None or not windows.active:
            return
        windows.pending_resume = None
        window = windows.window
        ids = window.sample_ids if window is not None else None
        first_ids = render_ids(ids, self._max_sample_ids)
        restored = resume.restored
        if window is not None and type(window.lr) is float:
            # The rate the first window trains with. A loop that sets the rate itself each
            # iteration (nanoGPT) has not set it yet when it calls ``resumed``: with a fresh
            # optimizer the rate read then is the constructor's, not the schedule's.
            restored = {**restored, "first_window_lr": to_wire(window.lr)}
        event = records.resume(
            restored, resume.checkpoint_path, resume.checkpoint_step, resume.time, first_ids
        )
        self._outbox.submit_event(event)
