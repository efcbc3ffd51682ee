"""The preemption deadline drill (the reference text's third drill).

``kill -TERM`` the running trainer, then ``kill -KILL`` it when the warning runs out, as a
platform does: once with a warning that fits the measured path (``T_window + T_save +
T_margin``, from the trainer's own window and save times) and once with one that does not (a
fraction of one window). Either way the checkpoint left published must be at a completed update
boundary: a save after the signal when the warning fits, the previous durable checkpoint or a
completed save when it does not, never a half window. Then a save is interrupted (SIGKILL while
the trainer's ``save_stall_seconds`` holds it between writing and publishing), and the next
start must select the previous complete checkpoint.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monitor.drills import snapshots
from monitor.drills.context import DrillContext
from monitor.drills.launch import Job, RunFailed
from policies.drills import Check, boundary, budget

FOREVER = 10**9  # updates: the preempted runs train until they are stopped
STALL_S = 3600.0  # the interrupted save's storage write: it never finishes by itself
POLL_S = 0.02


def drill(context: DrillContext, checks: list[Check]) -> None:
    root = context.directory("checkpoints")
    every = max(1, context.steps)
    fields: dict[str, Any] = {"steps": FOREVER, "checkpoint_dir": root, "save_every": every}
    job = context.start("sigterm-fits", fields)
    try:
        # the second save carries the first one's duration: T_save is measured, not assumed
        state = _wait_for(job, context, lambda: _published_step(root) >= 2 * every, "a second checkpoint")
        window_s = max(state.get("window_seconds") or [0.0])
        save_s = float(state.get("save_seconds") or 0.0)
        fits = budget(window_s, save_s, context.config.margin_s)
        checks.append(
            _deadline(
                context,
                job,
                root,
                fits,
                "fits",
                f"{window_s:.3f} + {save_s:.3f} + {context.config.margin_s:g} s",
                window_s,
            )
        )
    finally:
        job.close()
    short = context.config.short_warning_fraction * window_s
    job = context.start("sigterm-short", {**fields, "resume_from": root})
    try:
        before = _published_step(root)
        _wait_for(job, context, lambda: _published_step(root) > before, "a checkpoint of the resumed run")
        checks.append(
            _deadline(
                context,
                job,
                root,
                short,
                "short",
                f"{context.config.short_warning_fraction:g} x {window_s:.3f} s window",
                window_s,
            )
        )
    finally:
        job.close()
    checks.append(_interrupted_save(context, root))


def _deadline(
    context: DrillContext,
    job: Job,
    root: Path,
    warning_s: float,
    which: str,
    arithmetic: str,
    window_s: float,
) -> Check:
    """SIGTERM mid-run, SIGKILL ``warning_s`` later if still running; judge what was published."""
    time.sleep(min(1.0, window_s / 2))  # into a window, past the save just published
    durable = _published_step(root)
    job.signal(signal.SIGTERM)
    sent = time.monotonic()
    while job.running() and time.monotonic() - sent < warning_s:
        time.sleep(POLL_S)
    killed = job.running()
    if killed:
        job.signal(signal.SIGKILL)
    finished = job.wait(context.timeout_s)
    after = snapshots.published(root)
    name = f"sigterm_{which}_warning"
    said = f"warning {warning_s:.2f} s ({arithmetic})"
    measured: dict[str, Any] = {"warning_s": warning_s, "durable_step": durable, "killed": killed}
    if after is None or snapshots.incomplete(after):
        return Check(name, False, f"{said}: nothing complete is published ({after})", measured)
    state = snapshots.trainer_state(after)
    on_boundary = boundary(
        name, int(state["step"]), int(state["consumed"]), int(state.get("examples_per_update", 0))
    )
    measured.update(
        on_boundary.measured, published_step=int(state["step"]), exit_codes=list(finished.returncodes)
    )
    if not on_boundary.passed:
        return Check(name, False, f"{said}: {on_boundary.detail}", measured)
    saved = int(state["step"]) > durable
    ended = "was killed at the deadline" if killed else f"exited {list(finished.returncodes)}"
    if which == "fits":
        # what must fit is the save's publication; a slow interpreter exit after it loses nothing
        if not saved:
            return Check(
                name,
                False,
                f"{said}: the trainer {ended} without a save after the signal (published: update {durable})",
                measured,
            )
        return Check(
            name,
            True,
            f"{said}: saved at update {state['step']} after the signal, then {ended} ({on_boundary.detail})",
            measured,
        )
    outcome = (
        f"a completed save at update {state['step']}"
        if saved
        else f"the previous durable checkpoint, update {durable}"
    )
    return Check(
        name, True, f"{said}: the trainer {ended}; published is {outcome} ({on_boundary.detail})", measured
    )


def _interrupted_save(context: DrillContext, root: Path) -> Check:
    """Kill a save between its files and its publication; the next start must skip it."""
    durable = _published_step(root)
    name = "interrupted_save"
    fields = {
        "steps": FOREVER,
        "checkpoint_dir": root,
        "resume_from": root,
        "save_every": 1,
        "save_stall_seconds": STALL_S,
    }
    job = context.start("interrupted-save", fields)
    torn = snapshots.step_dir(root, durable + 1)
    try:
        _wait_for(
            job, context, lambda: (torn / snapshots.STATE).exists(), "the save to stall", published=False
        )
        job.signal(signal.SIGKILL)
        job.wait(context.timeout_s)
    finally:
        job.close()
    if _published_step(root) != durable:
        return Check(
            name,
            False,
            f"the interrupted save of update {durable + 1} was published",
            {"durable_step": durable},
        )
    context.run("next-start", {"steps": durable + 1, "checkpoint_dir": root, "resume_from": root})
    latest = snapshots.published(root)
    state = snapshots.trainer_state(latest) if latest else {}
    selected = state.get("resumed_from")
    measured = {"durable_step": durable, "interrupted_step": durable + 1, "selected_step": selected}
    if selected != durable:
        return Check(
            name,
            False,
            f"the next start resumed from {selected}, not the last complete checkpoint (update {durable})",
            measured,
        )
    return Check(
        name,
        True,
        f"a save killed before its publication left update {durable} published; the next start selected it",
        measured,
    )


def _published_step(root: Path) -> int:
    path = snapshots.published(root)
    if path is None or not (path / snapshots.STATE).exists():
        return -1
    return int(snapshots.trainer_state(path)["step"])


def _wait_for(
    job: Job, context: DrillContext, ready: Callable[[], bool], what: str, published: bool = True
) -> dict[str, Any]:
    """Wait (wall clock) until ``ready``; the published checkpoint's trainer state then."""
    deadline = time.monotonic() + context.timeout_s
    while not ready():
        if not job.running():
            raise RunFailed(f"the trainer exited before {what}: see {job.log}")
        if time.monotonic() > deadline:
            raise RunFailed(f"no {what} within {context.timeout_s:g} s: see {job.log}")
        time.sleep(POLL_S)
    path = snapshots.published(job_root(context)) if published else None
    return snapshots.trainer_state(path) if path else {}


def job_root(context: DrillContext) -> Path:
    return context.workdir / "checkpoints"
