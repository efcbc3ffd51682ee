"""The checkpoint registry: committed checkpoints, their re-checked manifests, and tags.

A directory that merely exists proves nothing: validation opens every file the manifest
names, compares its size and sha256, and checks the manifest names one boundary step, the
checkpoint's own. Tags are derived, never stored: ``latest-resumable`` (the newest valid,
safe checkpoint), ``best-eval`` (the best evaluation metric, kept apart from the recovery
point) and ``unsafe`` (at or after a nonfinite step or the first affected step of an open
incident, until that incident is resolved).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.checkpoints import CheckpointFacts, unsafe_checkpoints

CHECKPOINT = models.table_of(models.CheckpointEvent)
VALIDATION = models.table_of(models.CheckpointValidation)
INCIDENT = models.table_of(models.Incident)

# Incident kinds whose fault can be in the weights or optimizer state from their first step on.
STATE_AFFECTING = ("spike", "level_shift", "nonfinite", "amp", "broken_resume", "device", "canary")

# Lower is better for metrics whose name says loss, perplexity or error; higher otherwise.
LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error", "wer", "cer")


def validate_files(path: str, step: int, manifest: Mapping[str, Any] | None) -> list[str]:
    """Problems with a checkpoint's files against its manifest (empty: valid)."""
    if not manifest:
        return ["no manifest: nothing to check the files against"]
    problems = []
    if manifest.get("step") != step:
        problems.append(f"manifest names step {manifest.get('step')}, the checkpoint step {step}")
    root = Path(path)
    for entry in manifest.get("files", []):
        file = root / entry["path"]
        if not file.is_file():
            problems.append(f"{entry['path']}: missing")
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            problems.append(f"{entry['path']}: {size} bytes, the manifest says {entry['size']}")
            continue
        if _sha256(file) != entry["sha256"]:
            problems.append(f"{entry['path']}: sha256 differs from the manifest")
    if not manifest.get("files"):
        problems.append("the manifest lists no files")
    return problems


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def validate_pending(connection: Connection, now: float, run_id: int | None = None) -> int:
    """Validate every checkpoint not validated yet; returns how many were checked."""
    query = (
        sa.select(CHECKPOINT)
        .outerjoin(VALIDATION, VALIDATION.c.checkpoint_id == CHECKPOINT.c.id)
        .where(VALIDATION.c.checkpoint_id.is_(None))
    )
    if run_id is not None:
        query = query.where(CHECKPOINT.c.run_id == run_id)
    rows = list(connection.execute(query).mappings())
    for row in rows:
        problems = validate_files(row["path"], row["step"], row["manifest"])
        connection.execute(
            VALIDATION.insert(),
            {"checkpoint_id": row["id"], "valid": not problems, "problems": problems, "checked_at": now},
        )
    return len(rows)


def _rows(connection: Connection, run_id: int) -> list[dict[str, Any]]:
    query = (
        sa.select(CHECKPOINT, VALIDATION.c.valid, VALIDATION.c.problems, VALIDATION.c.checked_at)
        .outerjoin(VALIDATION, VALIDATION.c.checkpoint_id == CHECKPOINT.c.id)
        .where(CHECKPOINT.c.run_id == run_id)
        .order_by(CHECKPOINT.c.step, CHECKPOINT.c.time)
    )
    return [dict(row) for row in connection.execute(query).mappings()]


def facts(connection: Connection, run_id: int) -> tuple[tuple[CheckpointFacts, ...], dict[int, str]]:
    """Every checkpoint of a run as the recovery policies see it, and which are unsafe."""
    rows = _rows(connection, run_id)
    checkpoints = tuple(
        CheckpointFacts(
            key=row["id"],
            step=row["step"],
            path=row["path"],
            consumed=row["consumed"],
            valid=row["valid"],
            problems=tuple(row["problems"] or ()),
            time=row["time"],
        )
        for row in rows
    )
    return checkpoints, unsafe_for(connection, run_id, checkpoints)


def unsafe_for(
    connection: Connection, run_id: int, checkpoints: tuple[CheckpointFacts, ...]
) -> dict[int, str]:
    """Only incidents that can have corrupted the model's state taint checkpoints: a straggler,
    a hang or a link warning slows a run without changing what it computes."""
    open_rows = connection.execute(
        sa.select(INCIDENT.c.kind, INCIDENT.c.first_step).where(
            INCIDENT.c.run_id == run_id,
            INCIDENT.c.status == "open",
            INCIDENT.c.severity != "info",
            INCIDENT.c.kind.in_(STATE_AFFECTING),
        )
    ).all()
    nonfinite = [r.first_step for r in open_rows if r.kind == "nonfinite"]
    return unsafe_checkpoints(checkpoints, nonfinite, [r.first_step for r in open_rows])


def registry(connection: Connection, run_id: int) -> list[dict[str, Any]]:
    """The run's checkpoints with validation results and tags, oldest first."""
    rows = _rows(connection, run_id)
    checkpoints, unsafe = facts(connection, run_id)
    resumable = [c for c in checkpoints if c.valid is True and c.key not in unsafe]
    latest = max(resumable, key=lambda c: (c.step, c.time), default=None)
    best = _best_eval(rows)
    listed = []
    for row in rows:
        tags: list[dict[str, Any]] = [{"tag": t} for t in (row["tags"] or [])]
        if latest is not None and row["id"] == latest.key:
            tags.append({"tag": "latest-resumable"})
        if best is not None and row["id"] == best[0]:
            tags.append({"tag": "best-eval", "metric": best[1], "value": best[2]})
        if row["id"] in unsafe:
            tags.append({"tag": "unsafe", "reason": unsafe[row["id"]]})
        listed.append(
            {
                "id": row["id"],
                "step": row["step"],
                "consumed": row["consumed"],
                "path": row["path"],
                "time": row["time"],
                "incarnation": row["incarnation"],
                "valid": row["valid"],
                "problems": row["problems"] or [],
                "files": len((row["manifest"] or {}).get("files", [])),
                "bytes": sum(f["size"] for f in (row["manifest"] or {}).get("files", [])),
                "metrics": row["metrics"] or {},
                "tags": tags,
            }
        )
    return listed


def _best_eval(rows: list[dict[str, Any]]) -> tuple[int, str, float] | None:
    """The checkpoint with the best value of the evaluation metric most checkpoints report."""
    metrics = [
        (row["id"], name, value)
        for row in rows
        for name, value in (row["metrics"] or {}).items()
        if isinstance(value, int | float) and value == value
    ]
    if not metrics:
        return None
    names = [name for _, name, _ in metrics]
    metric = max(set(names), key=names.count)
    candidates = [(key, value) for key, name, value in metrics if name == metric]
    lower = any(word in metric.lower() for word in LOWER_IS_BETTER)
    key, value = (min if lower else max)(candidates, key=lambda kv: kv[1])
    return key, metric, value
