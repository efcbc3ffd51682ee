"""Checkpoint manifests: which files make up a committed checkpoint, their sizes and hashes.

A directory that exists is not a checkpoint that is complete; a manifest written after the last
file landed is the evidence a rollback needs (the boundary step, the consumed-example count, and
every file's size and sha256), and it is what ``rh.checkpoint_saved`` records in the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from collectors.wire import Record, to_wire

HASH_CHUNK = 1024 * 1024


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(
    directory: str | Path,
    step: int,
    consumed: int | None = None,
    *,
    exclude: Iterable[str] = ("manifest.json",),
) -> dict[str, Any]:
    """The manifest of every file under ``directory`` (paths relative to it, sorted).

    Reads every byte to hash it, so call it once the checkpoint is committed, off the step path
    when the checkpoint is large (the async-save thread is a good place).
    """
    root = Path(directory)
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint directory {root} does not exist")
    skipped = set(exclude)
    files = [
        {"path": path.relative_to(root).as_posix(), "size": path.stat().st_size, "sha256": sha256_of(path)}
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.relative_to(root).as_posix() not in skipped
    ]
    manifest: dict[str, Any] = {"step": step, "files": files}
    if consumed is not None:
        manifest["consumed"] = consumed
    return manifest


def checkpoint_record(
    step: int,
    path: str,
    time: float,
    *,
    manifest: Mapping[str, Any] | None = None,
    consumed: int | None = None,
    tags: Sequence[str] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> Record:
    """A ``checkpoint`` record, without the identity (the hook adds it when it sends)."""
    if manifest is not None and consumed is None:
        consumed = manifest.get("consumed")
    record: Record = {"kind": "checkpoint", "step": step, "path": str(path), "time": time}
    extras = {"consumed": consumed, "manifest": manifest, "tags": list(tags) if tags else None,
              "metrics": metrics}  # fmt: skip
    record.update({key: to_wire(value) for key, value in extras.items() if value is not None})
    return record
