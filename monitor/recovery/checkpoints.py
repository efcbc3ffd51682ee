"""The checkpoint registry: committed checkpoints, their re-checked manifests, and tags.

A directory that merely exists proves nothing: validation opens every file the manifest
names, compares its size and sha256, and checks the manifest names one boundary step, the
checkpoint's own. A checkpoint is a path's content at one step (``policies.checkpoints``): a
later save to the same path is its newer version, and the older one is ``superseded`` (its
files are gone), never a recovery point again.

A validation holds only while the files are the ones it read: it keeps each file's size and
modification time, and a change to either makes the result stale (``valid`` unknown again) until
the files are validated again. They are, whenever the registry validates what is due, and
always right before a checkpoint becomes a rollback target (``confirmed_facts``). The service
reads only what it can see: a checkpoint on another node's disk is left unchecked, saying
which node holds it.

Tags are derived, never stored: ``latest-resumable`` (the newest valid, current, safe
checkpoint), ``best-eval`` (the best evaluation metric, kept apart from the recovery point),
``superseded`` (by the newer version) and ``unsafe`` (at or after a nonfinite step or the first
affected step of an open incident, until that incident is resolved; or a torn snapshot: the
trainer stepped the optimizer before its asynchronous save was staged,
``policies.async_checkpoints``).

A checkpoint is in the registry only once the hook recorded it, which an asynchronous save's
hook does when its storage completed (``rh.checkpoint_saved``), never at staging: a snapshot
staged and not stored is no recovery point.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.async_checkpoints import UPDATES_BEFORE_STAGED, is_hook_metric
from policies.checkpoints import (
    CheckpointFacts,
    OpenIncident,
    rewind_target,
    superseded,
    unsafe_checkpoints,
)

CHECKPOINT = models.table_of(models.CheckpointEvent)
VALIDATION = models.table_of(models.CheckpointValidation)
INCIDENT = models.table_of(models.Incident)

# Incident kinds whose fault can be in the weights or optimizer state from their first step on.
STATE_AFFECTING = ("spike", "level_shift", "nonfinite", "amp", "broken_resume", "device", "canary")

# Lower is better for metrics whose name says loss, perplexity or error; higher otherwise.
LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error", "wer", "cer")

FilesSeen = dict[str, list[int] | None]
"""Each manifest file's [size, mtime_ns] as found, or None where it was missing."""


def manifest_files(path: str, manifest: Mapping[str, Any] | None) -> list[tuple[str, Path]]:
    """Each file the manifest names and where it lies: at the checkpoint path joined with the
    entry's (a one-file checkpoint's entry is ``"."``, the file itself)."""
    root = Path(path)
    return [(str(entry["path"]), root / str(entry["path"])) for entry in (manifest or {}).get("files", [])]


def files_seen(path: str, manifest: Mapping[str, Any] | None) -> FilesSeen:
    """The files' sizes and modification times now (one ``stat`` each, no read)."""
    seen: FilesSeen = {}
    for name, file in manifest_files(path, manifest):
        try:
            stat = file.stat()
        except OSError:
            seen[name] = None
        else:
            seen[name] = [stat.st_size, stat.st_mtime_ns]
    return seen


def validate_files(path: str, step: int, manifest: Mapping[str, Any] | None) -> list[str]:
    """Problems with a checkpoint's files against its manifest (empty: valid)."""
    if not manifest:
        return ["no manifest: nothing to check the files against"]
    if not Path(path).is_absolute():
        return [f"relative path {path}: the trainer's working directory is unknown here"]
    problems = []
    if manifest.get("step") != step:
        problems.append(f"manifest names step {manifest.get('step')}, the checkpoint step {step}")
    sizes = {str(entry["path"]): entry for entry in manifest.get("files", [])}
    for entry_path, file in manifest_files(path, manifest):
        entry = sizes[entry_path]
        name = file.name if entry_path == "." else entry_path  # a one-file checkpoint: its name
        if not file.is_file():
            problems.append(f"{name}: missing")
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            problems.append(f"{name}: {size} bytes, the manifest says {entry['size']}")
            continue
        if _sha256(file) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    if not manifest.get("files"):
        problems.append("the manifest lists no files")
    return problems


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def held_elsewhere(row: Mapping[str, Any], local_node: str) -> str | None:
    """Why the service cannot read a checkpoint's files, when another node's disk holds them."""
    node = row.get("node")
    if node is None or node == local_node or Path(row["path"]).exists():
        return None
    return f"held on node {node}: {row['path']} is not readable from this service (on {local_node})"


def is_stale(row: Mapping[str, Any]) -> bool:
    """A validation whose files were rewritten, resized or removed since (or one from before
    the registry kept what it saw)."""
    if row.get("valid") is None:
        return False
    seen = row.get("files_seen")
    return seen is None or files_seen(row["path"], row["manifest"]) != seen


def validate(connection: Connection, row: Mapping[str, Any], now: float) -> list[str]:
    """Validate one checkpoint now (reads every byte) and keep the result; returns its problems
    (none: valid). The sizes and times are taken first, so a file rewritten while it is read is
    found stale."""
    seen = files_seen(row["path"], row["manifest"])
    problems = validate_files(row["path"], row["step"], row["manifest"])
    connection.execute(VALIDATION.delete().where(VALIDATION.c.checkpoint_id == row["id"]))
    connection.execute(
        VALIDATION.insert(),
        {
            "checkpoint_id": row["id"],
            "valid": not problems,
            "problems": problems,
            "checked_at": now,
            "files_seen": seen,
        },
    )
    return problems


def validate_pending(
    connection: Connection, now: float, run_id: int | None = None, local_node: str | None = None
) -> int:
    """Validate every current checkpoint not validated yet or whose files changed since;
    returns how many were checked."""
    return len(_validate_due(connection, now, run_id, local_node or socket.gethostname()))


def _validate_due(connection: Connection, now: float, run_id: int | None, local_node: str) -> set[int]:
    run_ids = (
        [run_id]
        if run_id is not None
        else list(connection.execute(sa.select(CHECKPOINT.c.run_id).distinct()).scalars())
    )
    checked: set[int] = set()
    for run in run_ids:
        rows = _rows(connection, run)
        replaced = superseded((row["id"], row["path"], row["time"]) for row in rows)
        for row in rows:
            due = row["valid"] is None or is_stale(row)
            if row["id"] in replaced or not due or held_elsewhere(row, local_node) is not None:
                continue
            validate(connection, row, now)
            checked.add(row["id"])
    return checked


def confirmed_facts(
    connection: Connection,
    run_id: int,
    first_affected_step: int,
    now: float,
    local_node: str | None = None,
) -> tuple[tuple[CheckpointFacts, ...], dict[int, str]]:
    """``facts`` for choosing a rollback target, with the target's files validated again right
    before it is chosen: the checkpoint ``rewind_target`` would pick is re-read unless this
    pass just read it, and if it no longer matches its manifest the next one is tried."""
    node = local_node or socket.gethostname()
    confirmed = _validate_due(connection, now, run_id, node)
    while True:
        known, unsafe = facts(connection, run_id, node)
        target = rewind_target(known, first_affected_step, unsafe)
        if target is None or target.key in confirmed:
            return known, unsafe
        row = next(row for row in _rows(connection, run_id) if row["id"] == target.key)
        validate(connection, row, now)
        confirmed.add(target.key)


def target_problem(
    connection: Connection, run_id: int, checkpoint_id: int, now: float, local_node: str | None = None
) -> str | None:
    """Why a proposal's checkpoint can no longer be its rollback target, as it is about to become
    one (the approval): a later save to its path superseded it, or its files changed since they
    were read at the proposal and no longer match the manifest (read again then; unchanged sizes
    and times are not read twice). None when it still is the checkpoint it was."""
    rows = _rows(connection, run_id)
    replaced = superseded((row["id"], row["path"], row["time"]) for row in rows)
    row = next((row for row in rows if row["id"] == checkpoint_id), None)
    if row is None:
        return f"checkpoint {checkpoint_id} is no longer in the registry"
    if checkpoint_id in replaced:
        return (
            f"{row['path']} was saved again after step {row['step']} (checkpoint {replaced[checkpoint_id]})"
        )
    elsewhere = held_elsewhere(row, local_node or socket.gethostname())
    if elsewhere is not None:
        return elsewhere
    if row["valid"] is True and not is_stale(row):
        return None
    problems = validate(connection, row, now)
    return (
        f"checkpoint {checkpoint_id} no longer matches its manifest: {'; '.join(problems[:3])}"
        if problems
        else None
    )


def _rows(connection: Connection, run_id: int) -> list[dict[str, Any]]:
    query = (
        sa.select(
            CHECKPOINT,
            VALIDATION.c.valid,
            VALIDATION.c.problems,
            VALIDATION.c.checked_at,
            VALIDATION.c.files_seen,
        )
        .outerjoin(VALIDATION, VALIDATION.c.checkpoint_id == CHECKPOINT.c.id)
        .where(CHECKPOINT.c.run_id == run_id)
        .order_by(CHECKPOINT.c.step, CHECKPOINT.c.time, CHECKPOINT.c.id)
    )
    return [dict(row) for row in connection.execute(query).mappings()]


def _current_validity(
    row: Mapping[str, Any], superseded_by: int | None, local_node: str
) -> tuple[bool | None, tuple[str, ...]]:
    """What the registry can say of a checkpoint's files now: a superseded version's files are
    the newer version's, and a stale result is no result."""
    if superseded_by is not None:
        return False, (f"superseded by checkpoint {superseded_by}: {row['path']} was saved again",)
    elsewhere = held_elsewhere(row, local_node)
    if elsewhere is not None:
        return None, (elsewhere,)
    if is_stale(row):
        return None, ("the files changed since they were validated: to be validated again",)
    return row["valid"], tuple(row["problems"] or ())


def _facts_of(rows: list[dict[str, Any]], local_node: str) -> tuple[CheckpointFacts, ...]:
    replaced = superseded((row["id"], row["path"], row["time"]) for row in rows)
    listed = []
    for row in rows:
        valid, problems = _current_validity(row, replaced.get(row["id"]), local_node)
        listed.append(
            CheckpointFacts(
                key=row["id"],
                step=row["step"],
                path=row["path"],
                consumed=row["consumed"],
                valid=valid,
                problems=problems,
                time=row["time"],
                superseded_by=replaced.get(row["id"]),
            )
        )
    return tuple(listed)


def facts(
    connection: Connection, run_id: int, local_node: str | None = None
) -> tuple[tuple[CheckpointFacts, ...], dict[int, str]]:
    """Every checkpoint of a run as the recovery policies see it, and which are unsafe."""
    checkpoints = _facts_of(_rows(connection, run_id), local_node or socket.gethostname())
    return checkpoints, unsafe_for(connection, run_id, checkpoints)


def unsafe_for(
    connection: Connection, run_id: int, checkpoints: tuple[CheckpointFacts, ...]
) -> dict[int, str]:
    """Only incidents that can have corrupted the model's state taint checkpoints: a straggler,
    a hang or a link warning slows a run without changing what it computes."""
    open_rows = connection.execute(
        sa.select(INCIDENT.c.kind, INCIDENT.c.first_step, INCIDENT.c.last_step).where(
            INCIDENT.c.run_id == run_id,
            INCIDENT.c.status == "open",
            INCIDENT.c.severity != "info",
            INCIDENT.c.kind.in_(STATE_AFFECTING),
        )
    ).all()
    nonfinite = [r.first_step for r in open_rows if r.kind == "nonfinite"]
    incidents = [OpenIncident(r.kind, r.first_step, r.last_step) for r in open_rows]
    unsafe = unsafe_checkpoints(checkpoints, nonfinite, incidents)
    return {**torn_snapshots(connection, run_id), **unsafe}


def torn_snapshots(connection: Connection, run_id: int) -> dict[int, str]:
    """Checkpoints whose trainer made optimizer updates before their staging completed: the
    snapshot can hold part of a later update, whatever its manifest says."""
    rows = connection.execute(
        sa.select(CHECKPOINT.c.id, CHECKPOINT.c.metrics).where(
            CHECKPOINT.c.run_id == run_id, CHECKPOINT.c.metrics.is_not(None)
        )
    ).all()
    torn = {}
    for key, metrics in rows:
        updates = (metrics or {}).get(UPDATES_BEFORE_STAGED)
        if isinstance(updates, int | float) and updates > 0:
            torn[key] = f"torn snapshot: {updates:g} optimizer update(s) before its staging completed"
    return torn


def registry(connection: Connection, run_id: int, local_node: str | None = None) -> list[dict[str, Any]]:
    """The run's checkpoints with validation results and tags, oldest first."""
    rows = _rows(connection, run_id)
    checkpoints = _facts_of(rows, local_node or socket.gethostname())
    unsafe = unsafe_for(connection, run_id, checkpoints)
    resumable = [
        c for c in checkpoints if c.valid is True and c.superseded_by is None and c.key not in unsafe
    ]
    latest = max(resumable, key=lambda c: (c.step, c.time), default=None)
    best = _best_eval(rows)
    listed = []
    for row, checkpoint in zip(rows, checkpoints, strict=True):
        tags: list[dict[str, Any]] = [{"tag": t} for t in (row["tags"] or [])]
        if latest is not None and row["id"] == latest.key:
            tags.append({"tag": "latest-resumable"})
        if best is not None and row["id"] == best[0]:
            tags.append({"tag": "best-eval", "metric": best[1], "value": best[2]})
        if checkpoint.superseded_by is not None:
            tags.append({"tag": "superseded", "by": checkpoint.superseded_by})
        if row["id"] in unsafe:
            tags.append({"tag": "unsafe", "reason": unsafe[row["id"]]})
        listed.append(
            {
                "id": row["id"],
                "step": row["step"],
                "consumed": row["consumed"],
                "path": row["path"],
                "node": row["node"],
                "manifest_digest": row["manifest_digest"],
                "time": row["time"],
                "incarnation": row["incarnation"],
                "valid": checkpoint.valid,
                "problems": list(checkpoint.problems),
                "checked_at": row["checked_at"],
                "superseded_by": checkpoint.superseded_by,
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
        if isinstance(value, int | float) and value == value and not is_hook_metric(name)
    ]
    if not metrics:
        return None
    names = [name for _, name, _ in metrics]
    metric = max(set(names), key=names.count)
    candidates = [(key, value) for key, name, value in metrics if name == metric]
    lower = any(word in metric.lower() for word in LOWER_IS_BETTER)
    key, value = (min if lower else max)(candidates, key=lambda kv: kv[1])
    return key, metric, value
