import pytest

from policies.incidents import GroupingConfig, extend, incident_kind, matching_incident, open_incident
from policies.types import Finding, Severity


def finding(step: int, kind: str = "loss_spike", severity: Severity = Severity.WARNING) -> Finding:
    return Finding(step, kind, severity, "loss", 1.0, 0.5, "m")


def test_spike_findings_share_the_spike_incident_kind() -> None:
    assert incident_kind("loss_spike") == incident_kind("grad_norm_spike") == "spike"
    assert incident_kind("nonfinite") == "nonfinite"


def test_a_finding_within_the_gap_joins_and_one_beyond_opens_a_new_incident() -> None:
    config = GroupingConfig(merge_gap=10)
    incident = open_incident(1, finding(100))
    assert matching_incident(finding(110), [incident], config) == incident
    assert matching_incident(finding(111), [incident], config) is None
    assert matching_incident(finding(90), [incident], config) == incident  # back after a rollback


def test_other_kinds_never_merge() -> None:
    incident = open_incident(1, finding(100))
    assert matching_incident(finding(100, kind="nonfinite"), [incident], GroupingConfig()) is None


def test_extend_grows_span_severity_and_count() -> None:
    incident = open_incident(4, finding(100))
    grown = extend(extend(incident, finding(105, severity=Severity.CRITICAL)), finding(98))
    assert (grown.first_step, grown.last_step) == (98, 105)
    assert grown.severity is Severity.CRITICAL
    assert grown.finding_count == 3
    assert grown.key == 4


def test_the_latest_matching_incident_wins() -> None:
    older, newer = open_incident(1, finding(100)), open_incident(2, finding(130))
    assert matching_incident(finding(120), [older, newer], GroupingConfig(merge_gap=30)) == newer


def test_negative_gap_is_rejected() -> None:
    with pytest.raises(ValueError):
        GroupingConfig(merge_gap=-1)


def canary_miss(step: int, rank: int, device: str | None = None) -> Finding:
    return Finding(step, "canary_mismatch", Severity.CRITICAL, "canary", 1.0, 0.0, "m",
                   rank=rank, node=f"node-{rank}", device=device)  # fmt: skip


def test_a_canary_without_a_device_id_joins_its_ranks_open_incident_however_late() -> None:
    # The demo (a CPU run: no device ids) opened a second incident for node-2's persistent fault
    # when its next canary round came 75 steps after the first.
    first = open_incident(2, canary_miss(126, rank=2))
    assert first.scope == "node node-2 rank 2"
    assert matching_incident(canary_miss(201, rank=2), [first], GroupingConfig()) == first
    assert matching_incident(canary_miss(201, rank=3), [first], GroupingConfig()) is None
    on_device = open_incident(3, canary_miss(126, rank=2, device="GPU-a"))
    assert on_device.scope == "GPU-a"
    assert matching_incident(canary_miss(900, rank=2, device="GPU-b"), [on_device], GroupingConfig()) is None
