"""A recovery proposal for an incident: where to rewind, what to do with the data and with
the hardware, the evidence, and what it costs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from policies.checkpoints import CheckpointFacts, rejected_reasons, rewind_target
from policies.diagnosis import Diagnosis, Verdict
from policies.remedies import REMEDY_OF_KIND, Remedy, kind_remedy
from policies.responses import ResponseConfig
from policies.retries import RetryDecision


class DataAction(StrEnum):
    REPLAY = "replay"
    """Resume from the checkpoint and replay the same data as is."""
    SKIP = "skip"
    """Skip named batches: diagnosed as data, or the configured continuation policy."""


class ContinuationPolicy(StrEnum):
    REPLAY_AS_IS = "replay_as_is"
    SKIP_WINDOW = "skip_window"
    """Roll back and skip the affected window of batches without a diagnosis: a legitimate
    continuation policy, proposed and recorded as exactly that (it changes the data
    trajectory; it is not an exact recovery)."""


# Incident kinds a rollback can help, by their rule (``policies.remedies``).
RECOVERABLE_KINDS = frozenset(kind for kind, remedy in REMEDY_OF_KIND.items() if remedy is Remedy.ROLLBACK)


@dataclass(frozen=True)
class ProposalConfig:
    """How proposals are made.

    ``undetermined``: what to do with the data when nothing is diagnosed (replay as is by
    default: skipping data changes the run, and the reference text asks for a recorded,
    deliberate decision to do so). ``auto_approve``: incident kinds whose proposals are
    approved without an operator; empty by default.
    """

    undetermined: ContinuationPolicy = ContinuationPolicy.REPLAY_AS_IS
    auto_approve: frozenset[str] = frozenset()


@dataclass(frozen=True)
class IncidentFacts:
    key: int
    kind: str
    first_step: int
    last_step: int
    current_step: int
    batches: tuple[str, ...] = ()
    """Batch or sample ids of the affected windows (the skip candidates)."""
    remedy: Remedy | None = None
    """What its findings say remedies it (``policies.remedies.incident_remedy``); ``None``:
    the kind's rule."""


@dataclass(frozen=True)
class Proposal:
    incident: int
    action: str
    """``rollback``, ``quarantine`` (hardware only, no rewind possible) or ``escalate``."""
    target: CheckpointFacts | None
    data_action: DataAction
    skip_batches: tuple[str, ...]
    quarantine_node: str | None
    quarantine_device: str | None
    diagnosis: Diagnosis
    cost_steps: int | None
    reasons: tuple[str, ...]
    rejected_checkpoints: dict[int, str] = field(default_factory=dict)
    auto_approve: bool = False


def propose(
    incident: IncidentFacts,
    checkpoints: tuple[CheckpointFacts, ...],
    unsafe: dict[int, str],
    diagnosis: Diagnosis,
    retry: RetryDecision,
    config: ProposalConfig,
) -> Proposal | None:
    """The proposal for a recoverable incident, or ``None`` when rollback is not the remedy
    (by the incident's kind, or because its findings say a rollback was seen not to fix it)."""
    remedy = incident.remedy if incident.remedy is not None else kind_remedy(incident.kind)
    if remedy is not Remedy.ROLLBACK:
        return None
    hardware = diagnosis.verdict is Verdict.HARDWARE
    data_action, skip, why_data = _data_action(incident, diagnosis, config)
    target = rewind_target(checkpoints, incident.first_step, unsafe)
    reasons = [diagnosis.reason, why_data]
    action = "rollback"
    if not retry.allowed:
        action, reasons = "escalate", [retry.reason, *reasons]
    elif target is None:
        action = "quarantine" if hardware else "escalate"
        reasons.insert(0, f"no valid, finite checkpoint before step {incident.first_step}")
        reasons[1:1] = [
            *_overwritten_after(checkpoints, incident, incident.kind),
            _why_none(checkpoints, incident.first_step, unsafe),
        ]
    else:
        reasons.insert(
            0,
            f"rewind to step {target.step}: the newest valid, finite checkpoint before step "
            f"{incident.first_step}; {retry.reason}",
        )
    return Proposal(
        incident=incident.key,
        action=action,
        target=target if action == "rollback" else None,
        data_action=data_action,
        skip_batches=skip,
        quarantine_node=diagnosis.node if hardware else None,
        quarantine_device=diagnosis.device if hardware else None,
        diagnosis=diagnosis,
        cost_steps=incident.current_step - target.step
        if target is not None and action == "rollback"
        else None,
        reasons=tuple(reasons),
        rejected_checkpoints=rejected_reasons(checkpoints, incident.first_step, unsafe),
        auto_approve=action == "rollback" and incident.kind in config.auto_approve,
    )


def _why_none(checkpoints: tuple[CheckpointFacts, ...], first_step: int, unsafe: dict[int, str]) -> str:
    """What the operator needs at once when nothing can be rewound to: whether no save was
    recorded yet (a save is recorded once its files are hashed, a second or more after it, and
    the incident is decided again when one lands) or every one was refused, and why."""
    before = sorted((c for c in checkpoints if c.step < first_step), key=lambda c: c.step)
    if not before:
        return (
            f"no checkpoint before step {first_step} is recorded yet: a save is recorded once its "
            "files are hashed, and this is proposed again when one lands"
        )
    refused = rejected_reasons(before, first_step, unsafe)
    listed = "; ".join(f"step {c.step}: {refused.get(c.key, 'not usable')}" for c in before[-3:])
    return f"{len(before)} checkpoint(s) before step {first_step}, none usable ({listed})"


def _overwritten_after(
    checkpoints: tuple[CheckpointFacts, ...], incident: IncidentFacts, kind: str
) -> list[str]:
    """Checkpoints from before the fault whose files a save after it wrote over (a trainer that
    saves to one path, as nanoGPT does): the good state is gone, and how to keep it next time."""
    by_key = {c.key: c for c in checkpoints}
    lost = [
        (c, by_key[c.superseded_by])
        for c in checkpoints
        if c.step < incident.first_step
        and c.superseded_by in by_key
        and by_key[c.superseded_by].step >= incident.first_step
    ]
    hold = (
        f", or hold the ranks on a {kind} (policies.response.{kind}=hold) so nothing saves before the decision"
        if kind in ResponseConfig.kinds()
        else ""
    )
    return [
        f"the checkpoint of step {old.step} ({old.path}) was saved over at step {new.step}, after "
        f"the fault: keep each checkpoint under its own name{hold}"
        for old, new in lost[-1:]
    ]


def _data_action(
    incident: IncidentFacts, diagnosis: Diagnosis, config: ProposalConfig
) -> tuple[DataAction, tuple[str, ...], str]:
    if diagnosis.verdict is Verdict.DATA:
        return (
            DataAction.SKIP,
            diagnosis.batches,
            f"skip the {len(diagnosis.batches)} batch(es) the replay blamed",
        )
    if diagnosis.verdict is Verdict.UNDETERMINED and config.undetermined is ContinuationPolicy.SKIP_WINDOW:
        return (
            DataAction.SKIP,
            incident.batches,
            "continuation policy skip_window: skip the affected window's batches without a diagnosis "
            "(a new data trajectory, not an exact recovery)",
        )
    return DataAction.REPLAY, (), "replay the data as is"


def current_step(
    highest_reported: int, reported_at: float | None, now: float | None, step_time_s: float, max_lag_s: float
) -> int:
    """Where the ranks are now: the newest reported step moved on by the time since its window
    ended, in the run's step time, by at most ``max_lag_s`` (how far behind the records can
    be: a run that paused or finished does not run ahead)."""
    if reported_at is None or now is None or step_time_s <= 0:
        return highest_reported
    lag_s = min(max(now - reported_at, 0.0), max_lag_s)
    return highest_reported + int(lag_s / step_time_s)


def act_at_step(
    highest_reported: int, step_time_s: float, poll_interval_s: float, margin: float = 2.0
) -> int:
    """The step at which every rank acts: beyond the highest reported step by enough steps to
    cover a poll interval and the sender's delay, times a safety margin, and at least 2."""
    steps = 2 if step_time_s <= 0 else int(margin * poll_interval_s / step_time_s) + 2
    return highest_reported + max(2, steps)
