"""Which checkpoint to rewind to: chosen from evidence, never "N back".

A recovery point must be complete (its manifest re-checked against the files), finite (not
at or after a nonfinite step), safe (not at or after the first affected step of an open
incident), and strictly before the first affected step of the incident being recovered.
Among those, the newest wins: it loses the least work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointFacts:
    """One committed checkpoint as the registry knows it."""

    key: int
    step: int
    path: str
    consumed: int | None = None
    valid: bool | None = None
    """The manifest re-checked against the files: True, False, or None (not checked yet)."""
    problems: tuple[str, ...] = ()
    time: float = 0.0


@dataclass(frozen=True)
class Unsafe:
    """Why a checkpoint may not become a recovery point."""

    key: int
    reason: str


def unsafe_checkpoints(
    checkpoints: Iterable[CheckpointFacts], nonfinite_steps: Sequence[int], open_first_steps: Sequence[int]
) -> dict[int, str]:
    """Checkpoints at or after a nonfinite step, or at or after the first affected step of an
    open incident (until that incident is resolved)."""
    first_nonfinite = min(nonfinite_steps, default=None)
    first_open = min(open_first_steps, default=None)
    unsafe = {}
    for checkpoint in checkpoints:
        if first_nonfinite is not None and checkpoint.step >= first_nonfinite:
            unsafe[checkpoint.key] = f"at or after the nonfinite step {first_nonfinite}"
        elif first_open is not None and checkpoint.step >= first_open:
            unsafe[checkpoint.key] = (
                f"at or after step {first_open}, the first affected step of an open incident"
            )
    return unsafe


def rewind_target(
    checkpoints: Iterable[CheckpointFacts], first_affected_step: int, unsafe: dict[int, str]
) -> CheckpointFacts | None:
    """The newest valid, safe checkpoint strictly before the first affected step, or ``None``."""
    eligible = [
        c for c in checkpoints if c.valid is True and c.key not in unsafe and c.step < first_affected_step
    ]
    return max(eligible, key=lambda c: (c.step, c.time, c.key), default=None)


def rejected_reasons(
    checkpoints: Iterable[CheckpointFacts], first_affected_step: int, unsafe: dict[int, str]
) -> dict[int, str]:
    """Why each other checkpoint was not chosen (the proposal's evidence)."""
    reasons = {}
    for c in checkpoints:
        if c.step >= first_affected_step:
            reasons[c.key] = f"step {c.step} is not before the first affected step {first_affected_step}"
        elif c.valid is not True:
            reasons[c.key] = "not validated" if c.valid is None else "invalid: " + "; ".join(c.problems[:3])
        elif c.key in unsafe:
            reasons[c.key] = "unsafe: " + unsafe[c.key]
    return reasons
