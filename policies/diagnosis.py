"""Who is to blame: hardware, data, or undetermined. Blame follows evidence only.

- hardware: a canary mismatch on the device, or a bitwise difference when the same span is
  replayed deterministically on two devices of the same stack;
- data: replaying the span from the checkpoint reproduces the fault, and skipping the
  suspect batches removes it;
- everything else is undetermined, which never quarantines anything by itself. Spikes often
  do not reproduce from an earlier checkpoint (published experience), so "did not reproduce"
  is not evidence against the hardware either.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    HARDWARE = "hardware"
    DATA = "data"
    UNDETERMINED = "undetermined"


@dataclass(frozen=True)
class Evidence:
    """What the replay job and the canaries established; ``None`` = not tested."""

    canary_mismatch: bool | None = None
    devices_differ: bool | None = None
    """The same span replayed deterministically on two devices of one stack differed bitwise."""
    replay_reproduced: bool | None = None
    """Replaying the span from the checkpoint reproduced the fault."""
    skip_cleared: bool | None = None
    """Replaying the span with the suspect batches skipped did not show the fault."""
    suspect_device: str | None = None
    suspect_node: str | None = None
    suspect_batches: tuple[str, ...] = ()


@dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    reason: str
    device: str | None = None
    node: str | None = None
    batches: tuple[str, ...] = ()


def diagnose(evidence: Evidence) -> Diagnosis:
    if evidence.canary_mismatch or evidence.devices_differ:
        how = "a canary mismatch" if evidence.canary_mismatch else "a bitwise difference between two devices"
        return Diagnosis(
            Verdict.HARDWARE,
            f"{how} on {evidence.suspect_device or 'the suspect device'}",
            device=evidence.suspect_device,
            node=evidence.suspect_node,
        )
    if evidence.replay_reproduced and evidence.skip_cleared:
        return Diagnosis(
            Verdict.DATA,
            f"the replay reproduced the fault and skipping {len(evidence.suspect_batches)} batch(es) removed it",
            batches=evidence.suspect_batches,
        )
    if evidence.replay_reproduced:
        reason = "the replay reproduced the fault but skipping the suspect batches did not remove it"
    elif evidence.replay_reproduced is False:
        reason = "the replay did not reproduce the fault (not evidence against the hardware)"
    else:
        reason = "no replay or canary evidence yet"
    return Diagnosis(Verdict.UNDETERMINED, reason)
