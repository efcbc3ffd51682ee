"""Hangs: a rank whose phase has not changed for too long, or that stopped sending.

Heartbeats come from each rank's sender thread on its own clock, so a rank whose training
thread is blocked in a collective still reports, with the phase it entered and when. The
timeout is learned from the run's own step times; a run that finished is not hung, and a
rank paused by a hold (``policies.responses``; its phase is ``held``) waits on purpose, bounded
by the hold's own timeout.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from policies.types import Finding, Severity

HELD = "held"  # the hook's phase while a hold directive pauses the rank (collectors.phases)
SAVING = "saving"  # a checkpoint save the trainer declared (``rh.checkpoint_saving()``)
COMPILING = "compiling"  # torch.compile at work on the training thread (``collectors.compiles``)
TRAINING = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class HangConfig:
    """How long is too long, per phase.

    - a training phase (forward, backward, optimizer): max(``train_floor_s``,
      ``step_time_factor`` x the 90th percentile of the run's recent window durations). 10x
      p90: nothing healthy holds one phase of a step for ten slow steps. The 9 s floor: with
      the 5 s check period a rank stuck in a step of under a second is named within 15 s (the
      best published detector, ByteDance's Mycroft, flags 90% of anomalies within 15 s).
    - between windows (the data wait, and whatever the trainer does between two windows:
      evaluation, an undeclared checkpoint save, logging): the same, with the ``min_timeout_s``
      floor (60 s: start-up, compilation, a first evaluation), and at least ``pause_factor``
      (1.5) x the longest window the run has had: a save or evaluation as long as one the run
      already went through is not a hang (long checkpoint saves are the most reported source
      of false hang alarms in peers' trackers).
    - a save the trainer declared (``rh.checkpoint_saving()``, until ``checkpoint_saved``):
      ``saving_floor_s`` (30 minutes: a multi-terabyte checkpoint to a parallel file system),
      or ``pause_factor`` x the longest window if that is longer.
    - a compilation (``torch.compile``'s first forward, a recompilation; the hook's heartbeats
      say ``compiling``): as a declared save. A large model's compile with autotuning takes
      many minutes, on the first step or in the middle of a run at a new shape. But a compiler
      at work keeps a core busy, and one that itself hangs uses next to none: a rank whose
      heartbeats say its processes have not used a quarter of a core since ``compile_idle_s``
      (``cpu_busy_at``, ``collectors/cpu_use.py``) is stuck, unless another rank of the run
      compiling was busy within that time (ranks that share a compile cache wait on each
      other's locks; compiler collectives wait for the slowest rank). 120 s: 24 heartbeat
      intervals, room for a remote-cache fetch or a short wait on a peer; a compile that keeps
      a core busy still has the 30 minutes.
    - until the run has 5 windows, the floors only (``min_timeout_s`` for every phase).
    - a rank is missing when its newest heartbeat is older than ``silence_intervals`` x the
      heartbeat interval (3: one lost or late heartbeat is not silence), and never before
      ``min_silence_s`` (10 s: measured in this repository's scenario benchmark, four ranks
      training on two busy cores starved a sender thread of 3 s; a rank gone for good stays
      gone). The interval is the one the run's hook states in its run_start record, else
      ``heartbeat_interval_s`` (the hook's default, 5 s).
    """

    min_timeout_s: float = 60.0
    train_floor_s: float = 9.0
    saving_floor_s: float = 1800.0
    pause_factor: float = 1.5
    step_time_factor: float = 10.0
    heartbeat_interval_s: float = 5.0
    silence_intervals: float = 3.0
    min_silence_s: float = 10.0
    compile_idle_s: float = 120.0

    def __post_init__(self) -> None:
        if min(self.min_timeout_s, self.train_floor_s, self.saving_floor_s, self.compile_idle_s) <= 0:
            raise ValueError(
                "HangConfig: min_timeout_s, train_floor_s, saving_floor_s and compile_idle_s must be > 0"
            )
        if self.step_time_factor < 1 or self.pause_factor < 1:
            raise ValueError("HangConfig: step_time_factor >= 1, pause_factor >= 1")
        if self.heartbeat_interval_s <= 0 or self.silence_intervals < 1 or self.min_silence_s < 0:
            raise ValueError(
                "HangConfig: heartbeat_interval_s > 0, silence_intervals >= 1, min_silence_s >= 0"
            )

    def silence_s(self, stated_interval_s: float | None = None) -> float:
        interval = (
            stated_interval_s if stated_interval_s and stated_interval_s > 0 else self.heartbeat_interval_s
        )
        return max(self.silence_intervals * interval, self.min_silence_s)


@dataclass(frozen=True)
class Beat:
    """A rank's newest heartbeat, as the service holds it."""

    rank: int
    node: str | None
    step: int | None
    phase: str
    phase_since: float
    received_at: float
    attempt: int | None = None
    """The window the rank was in or last began (the hook's attempt count)."""
    cpu_busy_at: float | None = None
    """While compiling: when the rank's processes last used CPU at a compiler's rate (its
    clock, as ``phase_since``); None from a hook that cannot say."""


@dataclass(frozen=True)
class PhaseTimeouts:
    """The timeout of each kind of phase for one run (``learned_timeouts``)."""

    training: float
    between: float
    saving: float

    def of(self, phase: str) -> float:
        if phase in TRAINING:
            return self.training
        return self.saving if phase in (SAVING, COMPILING) else self.between


def learned_timeouts(
    window_durations: Sequence[float], config: HangConfig, longest_s: float = 0.0
) -> PhaseTimeouts:
    """From the run's recent window durations and the longest window it ever had."""
    durations = sorted(d for d in window_durations if d > 0)
    if len(durations) < 5:
        return PhaseTimeouts(config.min_timeout_s, config.min_timeout_s, config.saving_floor_s)
    steps = config.step_time_factor * statistics.quantiles(durations, n=10)[-1]
    longest = config.pause_factor * max(durations[-1], longest_s)
    return PhaseTimeouts(
        training=max(config.train_floor_s, steps),
        between=max(config.min_timeout_s, steps, longest),
        saving=max(config.saving_floor_s, longest),
    )


def hang_finding(
    beats: Sequence[Beat],
    expected_ranks: int | None,
    now: float,
    timeouts: PhaseTimeouts,
    incarnation: str,
    config: HangConfig,
    stated_heartbeat_s: float | None = None,
    started_at: float | None = None,
    moved_on: Collection[int] = (),
) -> Finding | None:
    """One finding naming every stuck and every missing rank, or ``None`` when all move.

    A rank never heard from is missing only once the incarnation is older than the timeout:
    ranks start seconds apart, and start-up is as slow as it is allowed to be. A rank in
    ``moved_on`` is not stuck whatever its newest heartbeat says: the caller found one of its
    windows that ended after that heartbeat's phase began (``stuck_beats``' ranks are the ones
    worth asking about).
    """
    silence = config.silence_s(stated_heartbeat_s)
    stuck = [
        b for b in stuck_beats(beats, now, timeouts, config, stated_heartbeat_s) if b.rank not in moved_on
    ]
    timeout = max((_timeout_of(b, now, timeouts, config) for b in stuck), default=timeouts.between)
    silent = [b for b in beats if now - b.received_at > silence]
    seen = {b.rank for b in beats}
    overdue = started_at is None or now - started_at > max(timeout, silence)
    never = sorted(set(range(expected_ranks)) - seen) if expected_ranks and overdue else []
    if not (stuck or silent or never):
        return None
    affected = stuck + silent
    last_steps = [b.step for b in affected if b.step is not None]
    first_step = min(last_steps) if last_steps else 0
    suspects = _suspects(beats, stuck, silent)
    parts = []
    if stuck:
        parts.append(
            "stuck: "
            + ", ".join(
                f"rank {b.rank} in {b.phase} for {now - b.phase_since:.0f} s{_idle_note(b, now, config)} "
                f"(step {b.step})"
                for b in stuck[:8]
            )
        )
    if silent or never:
        names = [
            f"rank {b.rank} (last heard {now - b.received_at:.0f} s ago, step {b.step})" for b in silent[:8]
        ]
        names += [f"rank {r} (never heard)" for r in never[:8]]
        parts.append("missing: " + ", ".join(names))
    return Finding(
        step=first_step,
        kind="hang",
        severity=Severity.CRITICAL,
        signal="heartbeat",
        value=max((now - b.phase_since for b in stuck), default=None),
        threshold=timeout,
        message=f"run hung (timeout {timeout:.0f} s): " + "; ".join(parts),
        incarnation=incarnation,
        rank=suspects[0] if len(suspects) == 1 else None,
        evidence={
            "stuck": [_describe(b, now) for b in stuck],
            "missing": [_describe(b, now) for b in silent] + [{"rank": r} for r in never],
            "suspects": suspects,
            "timeout_s": timeout,
            "wants": "stack_dumps",
        },
    )


def stuck_beats(
    beats: Sequence[Beat],
    now: float,
    timeouts: PhaseTimeouts,
    config: HangConfig,
    stated_heartbeat_s: float | None = None,
) -> list[Beat]:
    """The heartbeats that say their rank has been in one phase past its timeout (and are
    recent enough to say anything). Such a beat can be older than the rank's windows: a first
    step that compiles the model for 30 s sends heartbeats "in forward since T"; the windows
    it then trains in a second arrive together, the timeouts learned from them are short, and
    the beat still says forward until the next one comes. The caller checks these ranks'
    windows (``hang_finding``'s ``moved_on``)."""
    silence = config.silence_s(stated_heartbeat_s)
    recent = [b for b in beats if now - b.received_at <= silence and b.phase != HELD]
    compiler_busy = any(b.phase == COMPILING and not _compile_idle(b, now, config) for b in recent)
    return [
        b
        for b in recent
        if now - b.phase_since > timeouts.of(b.phase) or (not compiler_busy and _compile_idle(b, now, config))
    ]


def _compile_idle(beat: Beat, now: float, config: HangConfig) -> bool:
    """A compiling rank whose processes have used no compiler's share of CPU for
    ``compile_idle_s`` (a beat without ``cpu_busy_at`` cannot say: never)."""
    busy_at = beat.cpu_busy_at
    return beat.phase == COMPILING and busy_at is not None and now - busy_at > config.compile_idle_s


def _timeout_of(beat: Beat, now: float, timeouts: PhaseTimeouts, config: HangConfig) -> float:
    if now - beat.phase_since > timeouts.of(beat.phase):
        return timeouts.of(beat.phase)
    return config.compile_idle_s if _compile_idle(beat, now, config) else timeouts.of(beat.phase)


def _idle_note(beat: Beat, now: float, config: HangConfig) -> str:
    if not _compile_idle(beat, now, config) or beat.cpu_busy_at is None:
        return ""
    return f", its processes using no CPU for {now - beat.cpu_busy_at:.0f} s"


def _suspects(beats: Sequence[Beat], stuck: Sequence[Beat], silent: Sequence[Beat]) -> list[int]:
    """The ranks that hold the others up: silent ones, else those furthest behind or in a
    different phase from the majority (peers waiting in a collective share one phase)."""
    if silent:
        return sorted(b.rank for b in silent)
    if not stuck:
        return []
    lowest = min(b.step if b.step is not None else 0 for b in stuck)
    behind = [b.rank for b in stuck if (b.step if b.step is not None else 0) == lowest]
    if len(behind) < len(stuck):
        return sorted(behind)
    phases = [b.phase for b in beats]
    majority = max(set(phases), key=phases.count)
    odd = [b.rank for b in stuck if b.phase != majority]
    return sorted(odd) if odd and len(odd) < len(stuck) else []


def _describe(beat: Beat, now: float) -> dict[str, object]:
    return {
        "rank": beat.rank,
        "node": beat.node,
        "step": beat.step,
        "phase": beat.phase,
        "in_phase_s": round(now - beat.phase_since, 1),
        **({"cpu_idle_s": round(now - beat.cpu_busy_at, 1)} if beat.cpu_busy_at is not None else {}),
        "last_heard_s": round(now - beat.received_at, 1),
    }
