"""Which checkpoint to rewind to: chosen from evidence, never "N back".

A recovery point must be complete (its manifest re-checked against the files), current (not
superseded by a later save to the same path, which rewrote its files), finite (not at or after
a nonfinite step), safe (not at or after the first affected step of an open incident; a spike's
ends 50 steps after its last evidence), and
strictly before the first affected step of the incident being recovered. Among those, the
newest wins: it loses the least work.

A checkpoint is identified by its content: (path, step, manifest digest). Saving the same path
again with other content is a new version of it; the same content reported again is the same
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


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
    superseded_by: int | None = None
    """The key of a later version saved to the same path (its files are no longer these)."""


def manifest_digest(manifest: Mapping[str, Any] | None) -> str:
    """The identity of a manifest's content: a sha256 over its step, consumed count and files
    (path, size, sha256), in a canonical form, so either side computes the same digest however
    the manifest was serialized. Empty for a checkpoint recorded without a manifest."""
    if not manifest:
        return ""
    files = sorted(
        (str(entry.get("path")), entry.get("size"), entry.get("sha256"))
        for entry in manifest.get("files") or ()
    )
    canonical = {"step": manifest.get("step"), "consumed": manifest.get("consumed"), "files": files}
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(encoded.encode()).hexdigest()


def superseded(versions: Iterable[tuple[int, str, float]]) -> dict[int, int]:
    """For (key, path, time) of every checkpoint: which versions a later save to the same path
    superseded, mapped to the current version (the newest report, by time then key)."""
    newest: dict[str, tuple[float, int]] = {}
    listed = list(versions)
    for key, path, time in listed:
        if path not in newest or (time, key) > newest[path]:
            newest[path] = (time, key)
    return {key: newest[path][1] for key, path, _ in listed if newest[path][1] != key}


@dataclass(frozen=True)
class Unsafe:
    """Why a checkpoint may not become a recovery point."""

    key: int
    reason: str


@dataclass(frozen=True)
class TaintConfig:
    """How far an open incident's taint reaches over the checkpoints saved after it.

    ``spike_reach`` (50 steps): a spike incident (one the grouping never refined into a level
    shift) whose last evidence is more than this many steps before a checkpoint does not taint
    it: the run-level rule judged the windows in between within bounds, so the run came back on
    its own, and a finding that far from the spike would open a new incident (the grouping rule's
    default merge gap, ``GroupingConfig.merge_gap``). Every other kind taints every later
    checkpoint while it is open. Found attaching pytorch/examples' word language model (plain SGD
    at its default rate of 20): one grad-norm warning at step 17 stayed open, every later save was
    unsafe, and a NaN at step 110 found no rollback target.
    """

    spike_reach: int = 50

    def __post_init__(self) -> None:
        if self.spike_reach < 0:
            raise ValueError(f"TaintConfig.spike_reach must be >= 0, got {self.spike_reach}")


@dataclass(frozen=True)
class OpenIncident:
    """An open incident of a kind that can change the model's state, as far as taint goes."""

    kind: str
    first_step: int
    last_step: int

    def taints(self, step: int, config: TaintConfig) -> bool:
        """Whether a checkpoint saved at ``step`` may hold this incident's damage."""
        if step < self.first_step:
            return False
        return self.kind != "spike" or step <= self.last_step + config.spike_reach


def unsafe_checkpoints(
    checkpoints: Iterable[CheckpointFacts],
    nonfinite_steps: Sequence[int],
    open_incidents: Sequence[OpenIncident],
    config: TaintConfig | None = None,
) -> dict[int, str]:
    """Checkpoints at or after a nonfinite step, or that an open incident taints (from its
    first affected step on, a spike only within its reach: ``TaintConfig``), until that
    incident is resolved."""
    reach = config or TaintConfig()
    first_nonfinite = min(nonfinite_steps, default=None)
    unsafe = {}
    for checkpoint in checkpoints:
        tainting = [i.first_step for i in open_incidents if i.taints(checkpoint.step, reach)]
        if first_nonfinite is not None and checkpoint.step >= first_nonfinite:
            unsafe[checkpoint.key] = f"at or after the nonfinite step {first_nonfinite}"
        elif tainting:
            unsafe[checkpoint.key] = (
                f"at or after step {min(tainting)}, the first affected step of an open incident"
            )
    return unsafe


def rewind_target(
    checkpoints: Iterable[CheckpointFacts], first_affected_step: int, unsafe: dict[int, str]
) -> CheckpointFacts | None:
    """The newest valid, current, safe checkpoint strictly before the first affected step, or
    ``None``."""
    eligible = [
        c
        for c in checkpoints
        if c.valid is True
        and c.superseded_by is None
        and c.key not in unsafe
        and c.step < first_affected_step
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
        elif c.superseded_by is not None:
            reasons[c.key] = f"superseded by checkpoint {c.superseded_by}: {c.path} was saved again"
        elif c.valid is not True:
            reasons[c.key] = "not validated" if c.valid is None else "invalid: " + "; ".join(c.problems[:3])
        elif c.key in unsafe:
            reasons[c.key] = "unsafe: " + unsafe[c.key]
    return reasons
