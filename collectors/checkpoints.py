"""Checkpoint manifests: which files make up a committed checkpoint, their sizes and hashes.

A directory that exists is not a checkpoint that is complete; a manifest written after the last
file landed is the evidence a rollback needs (the boundary step, the consumed-example count, and
every file's size and sha256), and it is what ``rh.checkpoint_saved`` records in the store
(the record itself: ``records.checkpoint``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
