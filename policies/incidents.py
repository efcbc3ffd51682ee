"""Grouping findings into incidents: one incident per fault, updated as evidence grows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from policies.types import Finding, IncidentView

# Findings of these kinds belong to one incident kind; a kind not listed is its own.
INCIDENT_KIND_OF_FINDING = {
    "loss_spike": "spike",
    "grad_norm_spike": "spike",
    "loss_level_shift": "level_shift",
    "grad_norm_level_shift": "spike",
    "skip_storm": "amp",
    "loss_scale_collapse": "amp",
    "lr_advanced_on_skip": "amp",
    "schedule_restarted": "broken_resume",
    "data_cursor_reset": "broken_resume",
    "data_cursor_mismatch": "broken_resume",
    "optimizer_state_lost": "broken_resume",
    "rank_loss_spike": "spike",
    "device_ecc": "device",
    "device_row_remap": "device",
    "device_lost": "device",
    "device_xid": "device",
    "device_error_rate": "device",
    "link_state": "link",
    "link_error_rate": "link",
    "counter_saturated": "link",
    "canary_mismatch": "canary",
    "updated_before_staged": "unsafe_save",
    "previous_deleted_before_publish": "unsafe_save",
}

# Incidents of these kinds are one per device, port or rank: two devices failing at nearby
# steps are two incidents, each with its own quarantine decision.
SCOPED_KINDS = {"device": "device", "link": "device", "straggler": "rank", "canary": "device"}
# A canary that names no device (NVML absent, a CPU run) is about the device its rank ran on:
# scoped by node and rank, so a persistent fault's every round joins its one open incident
# (the demo's node-2 opened a second one 75 steps after the first, past ``merge_gap``).
FALLBACK_SCOPES = {"canary": ("node", "rank")}

# A finding of the first kind resolves the open incident of the second kind in its scope.
RESOLVES = {
    "straggler_recovered": "straggler",
    "restart_loop_ended": "restart_loop",
    "preemption_budget_fits": "preemption_budget",
}

# An incident's kind is refined when stronger evidence joins it: a spike that stayed up is a
# level shift. Each entry: (current kind, finding's incident kind) -> refined kind.
REFINEMENTS = {
    ("spike", "level_shift"): "level_shift",
    # The jump after a restart was a spike until the resume rule saw it stay or reach the
    # untrained level: then it is a broken resume.
    ("spike", "broken_resume"): "broken_resume",
    ("level_shift", "broken_resume"): "broken_resume",
}


@dataclass(frozen=True)
class GroupingConfig:
    """How near in steps a finding must be to an open incident of its kind to join it.

    Default 50 steps: the BigScience chronicles' spikes run 4 to 220 logged steps from first
    evidence to recovery, and a spike that recurs right after a rollback is the same fault
    (it counts against the same incident).
    """

    merge_gap: int = 50

    def __post_init__(self) -> None:
        if self.merge_gap < 0:
            raise ValueError(f"GroupingConfig.merge_gap must be >= 0, got {self.merge_gap}")


def incident_kind(finding_kind: str) -> str:
    return INCIDENT_KIND_OF_FINDING.get(finding_kind, finding_kind)


def _joins(incident_kind_now: str, finding_incident_kind: str) -> bool:
    return (
        incident_kind_now == finding_incident_kind
        or (incident_kind_now, finding_incident_kind) in REFINEMENTS
        or (finding_incident_kind, incident_kind_now) in REFINEMENTS
    )


def scope_of(finding: Finding) -> str | None:
    """The device, port or rank an incident of this finding's kind is about, if any."""
    kind = RESOLVES.get(finding.kind) or incident_kind(finding.kind)
    attribute = SCOPED_KINDS.get(kind)
    if attribute is None:
        return None
    value = getattr(finding, attribute)
    if value is not None:
        return str(value)
    named = [(name, getattr(finding, name)) for name in FALLBACK_SCOPES.get(kind, ())]
    return " ".join(f"{name} {value}" for name, value in named if value is not None) or None


def matching_incident(
    finding: Finding, open_incidents: Iterable[IncidentView], config: GroupingConfig
) -> IncidentView | None:
    """The open incident this finding extends, or ``None`` when it starts a new one.

    A scoped incident (one device, port or rank) takes every later finding about the same
    thing while it is open; an unscoped one takes findings within ``merge_gap`` steps.
    """
    kind = incident_kind(finding.kind)
    scope = scope_of(finding)
    near = [
        incident
        for incident in open_incidents
        if _joins(incident.kind, kind)
        and incident.scope == scope
        and (
            scope is not None
            or incident.first_step - config.merge_gap <= finding.step <= incident.last_step + config.merge_gap
        )
    ]
    return max(near, key=lambda incident: incident.last_step, default=None)


def extend(incident: IncidentView, finding: Finding) -> IncidentView:
    """The incident once this finding joins it: span, severity, count and kind grow."""
    severity = finding.severity if finding.severity.rank > incident.severity.rank else incident.severity
    kind = REFINEMENTS.get((incident.kind, incident_kind(finding.kind)), incident.kind)
    return IncidentView(
        key=incident.key,
        kind=kind,
        severity=severity,
        first_step=min(incident.first_step, finding.step),
        last_step=max(incident.last_step, finding.step),
        finding_count=incident.finding_count + 1,
        scope=incident.scope,
    )


def open_incident(key: int, finding: Finding) -> IncidentView:
    return IncidentView(
        key=key,
        kind=incident_kind(finding.kind),
        severity=finding.severity,
        first_step=finding.step,
        last_step=finding.step,
        scope=scope_of(finding),
    )
