"""Restart loops: a job that starts again and again without getting past its last checkpoint.

Every incarnation that fails (a ``failed`` or ``stopped`` finish, or no finish at all before
the next one started) without committing a checkpoint beyond the newest one the run had before it
is unproductive: it cost a start, a restore and some training, and the run stands where it
stood. After ``max_unproductive`` of them in a row the run gets a critical ``restart_loop``
incident, which ``runhealth gate RUN`` turns into an exit status a launcher can stop requeueing
on. An incarnation that commits a checkpoint past the previous newest ends the streak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.types import Finding, Severity

KIND = "restart_loop"
ENDED = "restart_loop_ended"


@dataclass(frozen=True)
class RestartLoopConfig:
    """``max_unproductive`` 3: nvidia-resiliency-ext's in-job restart stops with exit code 93
    ("do not requeue") after three restart cycles that made no progress; without such a guard
    Megatron-LM's rerun machine restarted 44 times on a job that could not progress
    (Megatron-LM #5281)."""

    max_unproductive: int = 3

    def __post_init__(self) -> None:
        if self.max_unproductive < 1:
            raise ValueError(f"RestartLoopConfig.max_unproductive must be >= 1, got {self.max_unproductive}")


@dataclass(frozen=True)
class Life:
    """One incarnation of a run, as the restart-loop rule sees it."""

    incarnation: str
    started_at: float
    ended: bool
    """It failed: a ``failed`` or ``stopped`` finish, or none before a later start."""
    newest_checkpoint: int | None
    """The newest checkpoint step this incarnation committed (recorded with its manifest)."""
    last_step: int | None = None


def unproductive_streak(lives: Sequence[Life]) -> tuple[list[Life], int | None]:
    """The incarnations since the run's last progress that ended without any, oldest first,
    and the newest checkpoint step the run had reached."""
    newest: int | None = None
    streak: list[Life] = []
    for life in sorted(lives, key=lambda life: life.started_at):
        if life.newest_checkpoint is not None and (newest is None or life.newest_checkpoint > newest):
            newest, streak = life.newest_checkpoint, []
        elif life.ended:
            streak.append(life)
    return streak, newest


def restart_loop(lives: Sequence[Life], config: RestartLoopConfig) -> Finding | None:
    """A critical finding once ``max_unproductive`` incarnations in a row made no progress."""
    streak, newest = unproductive_streak(lives)
    if len(streak) < config.max_unproductive:
        return None
    where = f"past the checkpoint at step {newest}" if newest is not None else "to a first checkpoint"
    last = streak[-1]
    return Finding(
        step=newest if newest is not None else (last.last_step or 0),
        kind=KIND,
        severity=Severity.CRITICAL,
        signal="unproductive_incarnations",
        value=float(len(streak)),
        threshold=float(config.max_unproductive),
        message=(
            f"{len(streak)} starts in a row ended without getting {where}: the job is in a restart "
            "loop; stop requeueing it (`runhealth gate` exits 93) and find why it fails"
        ),
        incarnation=last.incarnation,
        evidence={
            "incarnations": [life.incarnation for life in streak],
            "newest_checkpoint_step": newest,
            "last_steps": [life.last_step for life in streak],
        },
    )


def restart_loop_ended(lives: Sequence[Life]) -> Finding:
    """The note that resolves an open ``restart_loop``: a start got past the checkpoint."""
    _, newest = unproductive_streak(lives)
    return Finding(
        step=newest or 0,
        kind=ENDED,
        severity=Severity.INFO,
        signal="unproductive_incarnations",
        value=0.0,
        threshold=None,
        message=f"a start committed a checkpoint at step {newest}: the restart loop is over",
    )
