"""Whether a rollback can remedy a finding: a per-kind rule, and the finding's own word over it.

A rollback rewinds the model state to a checkpoint before the first affected step and restores
it through the trainer's own load function. It undoes what went wrong in the state since then
(a spike, a NaN, a device that computed wrong answers, a resume that restored the wrong state by
hand). It cannot undo what the restore itself does wrong: when the resume that follows a rollback
fails its continuity check, another rollback restores through the same code and fails again (the
loop the reference text's "bounded retries" guards against). Such a finding says so itself
(``evidence["remedy"]``), and no rollback is proposed for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from enum import StrEnum
from typing import Any

from policies.types import Finding


class Remedy(StrEnum):
    ROLLBACK = "rollback"
    """Rewinding to a checkpoint before the first affected step undoes it."""
    FIX_RESTORE = "fix_restore"
    """The trainer's restore must change: a rollback restores through it again."""
    NONE = "none"
    """No rewind helps (a slow rank, a hang, a link, a note): other responses or none."""


# Incident kinds whose model state after the first affected step is suspect, so a rollback is
# the remedy. A straggler, a hang or a link warning needs a different one.
REMEDY_OF_KIND: Mapping[str, Remedy] = {
    kind: Remedy.ROLLBACK
    for kind in ("spike", "level_shift", "nonfinite", "amp", "broken_resume", "device", "canary")
}

EVIDENCE_KEY = "remedy"


def kind_remedy(incident_kind: str) -> Remedy:
    return REMEDY_OF_KIND.get(incident_kind, Remedy.NONE)


def with_remedy(finding: Finding, remedy: Remedy, why: str) -> Finding:
    """The finding, saying that its remedy is ``remedy`` (and why) over its kind's rule."""
    return replace(
        finding,
        message=f"{finding.message} ({why})",
        evidence={**finding.evidence, EVIDENCE_KEY: remedy.value},
    )


def stated_remedy(evidence: Mapping[str, Any] | None) -> Remedy | None:
    """The remedy a stored finding's evidence names, if it names a known one."""
    value = (evidence or {}).get(EVIDENCE_KEY)
    return next((remedy for remedy in Remedy if remedy.value == value), None)


def incident_remedy(incident_kind: str, stated: Iterable[Remedy | None]) -> Remedy:
    """An incident's remedy: any finding's own non-rollback remedy wins (one finding that a
    rollback was already seen not to fix is enough), else the kind's rule."""
    overriding = [remedy for remedy in stated if remedy is not None and remedy is not Remedy.ROLLBACK]
    return overriding[0] if overriding else kind_remedy(incident_kind)


__all__ = [
    "REMEDY_OF_KIND",
    "Remedy",
    "incident_remedy",
    "kind_remedy",
    "stated_remedy",
    "with_remedy",
]
