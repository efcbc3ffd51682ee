"""Batch arithmetic on resume: the update size kept apart from the GPU count.

The reference text ("Keep the update size separate from the GPU count"): for complete windows
of equal microbatches ``B_global = B_micro x K x D``, with ``D = N / (TP x PP x CP)`` independent
data-parallel replicas. A resume onto another layout (fewer nodes, another accumulation) that
changes ``B_global``, or the supervised tokens per update, changes the optimization trajectory,
and a schedule whose milestones are counted in updates now reaches them at other data volumes.
This rule compares each incarnation's batch with the one it resumed after and says what changed,
with the arithmetic, and whether the trainer declared its schedule's milestones remapped
(counted in examples or tokens, which a batch change leaves in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from policies.types import Finding, Severity

KIND = "batch_changed"
ScheduleUnit = Literal["updates", "examples", "tokens"]
SCHEDULE_UNITS: tuple[ScheduleUnit, ...] = ("updates", "examples", "tokens")


@dataclass(frozen=True)
class BatchConfig:
    """``tokens_change`` 0.2: a change of the supervised tokens per update (medians over
    ``windows`` windows on each side) at least this relative size is a batch change even when
    the examples per update are not known. The smallest layout change that keeps most of a run
    (4 replicas to 3) moves it by 25%; the windows' own spread is added (3 median absolute
    deviations of the earlier incarnation's, relative), so variable-length batches are not one.

    ``windows`` 8: windows read at each side of a restart; the examples per update are the
    differences of the consumed count between consecutive windows, so at least 2 are needed."""

    tokens_change: float = 0.2
    windows: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.tokens_change < 1:
            raise ValueError(f"BatchConfig.tokens_change must be in (0, 1), got {self.tokens_change}")
        if self.windows < 2:
            raise ValueError(f"BatchConfig.windows must be >= 2, got {self.windows}")


@dataclass(frozen=True)
class BatchShape:
    """One incarnation's batch, as recorded (declared by the trainer where it says so)."""

    incarnation: str
    world_size: int | None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    accumulation: int | None = None
    """K: microbatches per window, as the hook counted them (``rh.loss`` calls)."""
    micro_batch: int | None = None
    """B_micro, as the trainer declared it (sequences per replica's microbatch)."""
    examples_per_update: int | None = None
    """The consumed-example count's step between consecutive windows (the hook's or the trainer's)."""
    tokens_per_update: float | None = None
    tokens_spread: float = 0.0
    """The median absolute deviation of the tokens per update over the windows read."""
    schedule_unit: ScheduleUnit | None = None
    """What the trainer declared its scheduler's milestones are counted in."""
    first_step: int | None = None

    @property
    def replicas(self) -> int | None:
        """D = N / (TP x PP x CP)."""
        if self.world_size is None:
            return None
        return self.world_size // max(1, self.tp * self.pp * self.cp)

    @property
    def global_batch(self) -> int | None:
        """B_global = B_micro x K x D where all three are known, else the measured examples."""
        d = self.replicas
        if self.micro_batch is not None and self.accumulation is not None and d is not None:
            return self.micro_batch * self.accumulation * d
        return self.examples_per_update

    def arithmetic(self) -> str:
        d = self.replicas
        mesh = f"D = N / (TP x PP x CP) = {self.world_size} / ({self.tp} x {self.pp} x {self.cp}) = {d}"
        micro = self.micro_batch
        if micro is None and self.examples_per_update is not None and self.accumulation and d:
            micro_text = (
                f"{self.examples_per_update / (self.accumulation * d):g} (measured examples / (K x D))"
            )
        else:
            micro_text = "unknown" if micro is None else str(micro)
        batch = f"B_global = B_micro x K x D = {micro_text} x {self.accumulation} x {d}"
        measured = (
            "" if self.examples_per_update is None else f", measured {self.examples_per_update} examples"
        )
        total = self.global_batch
        return f"{mesh}; {batch}" + ("" if total is None else f" = {total}") + measured


def batch_change(before: BatchShape, after: BatchShape, config: BatchConfig) -> Finding | None:
    """A ``batch_changed`` finding when the global batch or the tokens per update moved."""
    changes: list[str] = []
    old_batch, new_batch = before.global_batch, after.global_batch
    if old_batch is not None and new_batch is not None and old_batch != new_batch:
        changes.append(f"global batch {old_batch} -> {new_batch} examples per update")
    old_tokens, new_tokens = before.tokens_per_update, after.tokens_per_update
    relative = None
    if old_tokens and new_tokens is not None:
        relative = new_tokens / old_tokens - 1
        noise = 3 * before.tokens_spread / old_tokens
        if abs(relative) >= config.tokens_change + noise:
            changes.append(f"tokens per update {old_tokens:g} -> {new_tokens:g} ({100 * relative:+.0f}%)")
    if not changes:
        return None
    unit = after.schedule_unit
    if unit in ("examples", "tokens"):
        schedule = (
            f"the trainer declared its schedule's milestones in {unit}: they stay at the same data volume"
        )
        severity = Severity.INFO
    elif unit == "updates":
        schedule = (
            "the trainer declared its schedule's milestones in updates: they now fall at other data "
            "volumes (remap them to examples or tokens, or keep the update size)"
        )
        severity = Severity.WARNING
    else:
        schedule = (
            "the schedule's milestones were not declared remapped (updates, examples or tokens): a "
            "schedule counted in updates now reaches them at other data volumes"
        )
        severity = Severity.WARNING
    message = (
        f"the resume changed the update size: {'; '.join(changes)}. Before: {before.arithmetic()}. "
        f"After: {after.arithmetic()}. {schedule[0].upper()}{schedule[1:]}"
    )
    return Finding(
        step=after.first_step or 0,
        kind=KIND,
        severity=severity,
        signal="global_batch" if old_batch != new_batch else "tokens_per_update",
        value=float(new_batch) if new_batch is not None else new_tokens,
        threshold=float(old_batch) if old_batch is not None else old_tokens,
        message=message,
        incarnation=after.incarnation,
        evidence={
            "before": _evidence(before),
            "after": _evidence(after),
            "tokens_relative_change": relative,
            "schedule_unit": unit,
        },
    )


def _evidence(shape: BatchShape) -> dict[str, object]:
    return {
        "incarnation": shape.incarnation,
        "world_size": shape.world_size,
        "tp": shape.tp,
        "pp": shape.pp,
        "cp": shape.cp,
        "replicas": shape.replicas,
        "accumulation": shape.accumulation,
        "micro_batch": shape.micro_batch,
        "examples_per_update": shape.examples_per_update,
        "global_batch": shape.global_batch,
        "tokens_per_update": shape.tokens_per_update,
        "schedule_unit": shape.schedule_unit,
    }


def declaration(
    *, micro_batch: int | None = None, accumulation: int | None = None, schedule_unit: str | None = None
) -> dict[str, object]:
    """What a trainer declares of its batch (``RunHealth.declare_batch``), checked: sent in its
    run-start record's ``config["batch"]``."""
    for name, value in (("micro_batch", micro_batch), ("accumulation", accumulation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if schedule_unit is not None and schedule_unit not in SCHEDULE_UNITS:
        raise ValueError(f"schedule_unit must be one of {', '.join(SCHEDULE_UNITS)}, got {schedule_unit!r}")
    found = {"micro_batch": micro_batch, "accumulation": accumulation, "schedule_unit": schedule_unit}
    return {name: value for name, value in found.items() if value is not None}


def declared(config: object) -> tuple[int | None, int | None, ScheduleUnit | None]:
    """(micro batch, accumulation, schedule unit) from a run-start record's config, what of it
    is well formed (the record is the trainer's: anything else is ignored)."""
    batch = config.get("batch") if isinstance(config, dict) else None
    if not isinstance(batch, dict):
        return None, None, None

    def count(name: str) -> int | None:
        value = batch.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    unit = batch.get("schedule_unit")
    return count("micro_batch"), count("accumulation"), next((u for u in SCHEDULE_UNITS if u == unit), None)
