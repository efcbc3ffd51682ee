"""A checkpoint's two completion points, and the save protocol's two ordering rules.

The reference text ("An asynchronous checkpoint separates three places where state can live"):
staging copies live state into a snapshot independent of later mutations; storage persists
that snapshot; only storage completion and publication make a recovery point. Two orderings
follow, each a finding here when the trainer broke it:

- "Wait for staging before modifying any live state whose copy is still pending": an optimizer
  step before staging completed can leave a snapshot that mixes two updates (a torn checkpoint:
  the service never offers it as a rollback target, ``monitor.recovery.checkpoints``);
- "Wait for storage completion before publishing or deleting the previous recovery point": the
  previous checkpoint gone before the new one was published leaves no recovery point at all while
  the new one is still uploading.

The hook measures both on its side, where they happen (``collectors.checkpoint_events``), and
sends them with the checkpoint's record, under the names below (in its ``metrics``, prefixed so
they are never taken for an evaluation metric, and its ``tags``). No threshold: each rule is an
ordering, broken or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.types import Finding, Severity

# What the hook adds to a checkpoint record (the record protocol's ``metrics`` and ``tags``).
METRIC_PREFIX = "runhealth."
SAVE_S = "runhealth.save_s"
"""Seconds from the save's start (``rh.checkpoint_saving``) to its publication
(``rh.checkpoint_saved``): the preemption budget's ``T_save``."""
STAGING_S = "runhealth.staging_s"
"""Seconds from the save's start to staging done (``rh.checkpoint_staged``)."""
UPDATES_BEFORE_STAGED = "runhealth.updates_before_staged"
"""Optimizer updates the trainer made after the save started and before staging completed."""
ASYNC_TAG = "async"
"""Staged and stored at two different points."""
PREVIOUS_DELETED_TAG = "previous_deleted"
"""The hook's previous recovery point was gone when this one was published."""

UPDATED_BEFORE_STAGED = "updated_before_staged"
PREVIOUS_DELETED = "previous_deleted_before_publish"
INCIDENT_KIND = "unsafe_save"


def is_hook_metric(name: str) -> bool:
    """A timing the hook measured, not an evaluation metric of the trainer's."""
    return name.startswith(METRIC_PREFIX)


@dataclass(frozen=True)
class SaveFacts:
    """One published checkpoint as the ordering rules see it."""

    step: int
    path: str
    incarnation: str = ""
    updates_before_staged: int = 0
    staging_s: float | None = None
    previous_deleted: bool = False
    previous_path: str | None = None
    previous_step: int | None = None


def save_findings(save: SaveFacts) -> list[Finding]:
    """A warning for each ordering rule the save broke (none for a save that kept both)."""
    found = []
    if save.updates_before_staged > 0:
        staged = f" (staging took {save.staging_s:.3g} s)" if save.staging_s is not None else ""
        message = (
            f"the trainer made {save.updates_before_staged} optimizer update(s) before the checkpoint "
            f"of step {save.step} at {save.path} was staged{staged}: its snapshot can mix two "
            "updates, so it is no rollback target; wait for staging "
            "(response.staging_completion.result()) before the next optimizer step"
        )
        evidence: dict[str, Any] = {
            "updates_before_staged": save.updates_before_staged,
            "staging_s": save.staging_s,
        }
        found.append(
            _warning(save, UPDATED_BEFORE_STAGED, float(save.updates_before_staged), 0.0, message, evidence)
        )
    if save.previous_deleted:
        previous = (
            f"the previous recovery point (step {save.previous_step}, {save.previous_path})"
            if save.previous_path is not None
            else "the previous recovery point"
        )
        message = (
            f"{previous} was deleted or overwritten before the checkpoint of step {save.step} at "
            f"{save.path} was published: a failure while it was stored would have left no "
            "checkpoint to restart from; delete the previous one only after rh.checkpoint_saved "
            "(storage done), and save each checkpoint under a new name"
        )
        evidence = {"previous_path": save.previous_path, "previous_step": save.previous_step}
        found.append(_warning(save, PREVIOUS_DELETED, 1.0, None, message, evidence))
    return found


def _warning(
    save: SaveFacts, kind: str, value: float, threshold: float | None, message: str, evidence: dict[str, Any]
) -> Finding:
    """A warning about this save; its signal is named for the rule (``updates_before_staged``,
    ``previous_deleted``)."""
    signal = "updates_before_staged" if kind == UPDATED_BEFORE_STAGED else "previous_deleted"
    return Finding(
        step=save.step,
        kind=kind,
        severity=Severity.WARNING,
        signal=signal,
        value=value,
        threshold=threshold,
        message=message,
        incarnation=save.incarnation,
        evidence={"path": save.path, **evidence},
    )
