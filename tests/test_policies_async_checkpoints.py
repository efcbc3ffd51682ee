"""An asynchronous save's ordering rules (``policies/async_checkpoints.py``): an update
before staging completed, and the previous recovery point gone before publication."""

from __future__ import annotations

from policies.async_checkpoints import (
    PREVIOUS_DELETED,
    UPDATED_BEFORE_STAGED,
    SaveFacts,
    is_hook_metric,
    save_findings,
)
from policies.incidents import incident_kind
from policies.remedies import Remedy, kind_remedy
from policies.types import Severity


def test_a_save_that_kept_both_orderings_has_no_finding() -> None:
    assert save_findings(SaveFacts(step=20, path="/ckpt/20", staging_s=0.4)) == []


def test_an_update_before_staging_completed_is_a_warning_naming_the_checkpoint() -> None:
    (finding,) = save_findings(SaveFacts(step=20, path="/ckpt/20", updates_before_staged=1, staging_s=0.4))
    assert finding.kind == UPDATED_BEFORE_STAGED and finding.severity is Severity.WARNING
    assert "1 optimizer update(s) before the checkpoint of step 20 at /ckpt/20 was staged" in finding.message
    assert "(staging took 0.4 s)" in finding.message and "no rollback target" in finding.message
    assert finding.value == 1.0 and finding.evidence["updates_before_staged"] == 1


def test_the_previous_recovery_point_deleted_early_is_named() -> None:
    facts = SaveFacts(
        step=20, path="/ckpt/20", previous_deleted=True, previous_path="/ckpt/10", previous_step=10
    )
    (finding,) = save_findings(facts)
    assert finding.kind == PREVIOUS_DELETED
    assert finding.message.startswith("the previous recovery point (step 10, /ckpt/10) was deleted")
    assert "before the checkpoint of step 20 at /ckpt/20 was published" in finding.message


def test_both_are_one_incident_kind_that_no_rollback_remedies() -> None:
    assert incident_kind(UPDATED_BEFORE_STAGED) == incident_kind(PREVIOUS_DELETED) == "unsafe_save"
    assert kind_remedy("unsafe_save") is Remedy.NONE


def test_the_hook_s_timings_are_told_from_evaluation_metrics() -> None:
    assert is_hook_metric("runhealth.save_s") and not is_hook_metric("eval_loss")
