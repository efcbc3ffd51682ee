"""Checkpoint manifests: which files make up a committed checkpoint, their sizes and hashes.

A directory that exists is not a checkpoint that is complete; a manifest written after the last
file landed is the evidence a rollback needs (the boundary step, the consumed-example count, and
every file's size and sha256), and it is what ``rh.checkpoint_saved`` records in the store
(the record itself: ``records.checkpoint``). A checkpoint is a directory or a single file.
"""

from __future__ import annotations

import hashlib
import os
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


def checkpoint_location(path: str | os.PathLike[str]) -> str:
    """Where a checkpoint is, as every reader of the record can find it: a local path made
    absolute against this process's working directory; a URL (``s3://...``) as given."""
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def checkpoint_files(path: str | Path, exclude: Iterable[str] = ("manifest.json",)) -> list[tuple[str, Path]]:
    """The files of a checkpoint and their names in its manifest: a directory's files relative
    to it (sorted, ``exclude`` left out), or a single file as ``"."`` (the service finds each
    entry at the checkpoint path joined with the entry's, so a file is its own entry)."""
    root = Path(path)
    if root.is_file():
        return [(".", root)]
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint {root} does not exist (neither a file nor a directory)")
    skipped = set(exclude)
    named = ((file.relative_to(root).as_posix(), file) for file in sorted(root.rglob("*")) if file.is_file())
    return [(name, file) for name, file in named if name not in skipped]


def files_seen(path: str | Path, exclude: Iterable[str] = ("manifest.json",)) -> dict[str, tuple[int, int]]:
    """Each file's size and modification time (one ``stat``, no read): what a write changes."""
    seen = {}
    for name, file in checkpoint_files(path, exclude):
        stat = file.stat()
        seen[name] = (stat.st_size, stat.st_mtime_ns)
    return seen


def build_manifest(
    path: str | Path,
    step: int,
    consumed: int | None = None,
    *,
    exclude: Iterable[str] = ("manifest.json",),
) -> dict[str, Any]:
    """The manifest of a checkpoint: a directory (every file under it, paths relative to it,
    sorted) or a single file (its one entry ``"."``).

    Reads every byte to hash it. ``rh.checkpoint_saved(step, path)`` without a manifest calls
    it on a background thread (``collectors.manifests``); call it yourself only off the step
    path.
    """
    files = [
        {"path": name, "size": file.stat().st_size, "sha256": sha256_of(file)}
        for name, file in checkpoint_files(path, exclude)
    ]
    manifest: dict[str, Any] = {"step": step, "files": files}
    if consumed is not None:
        manifest["consumed"] = consumed
    return manifest
