"""Checkpoint manifests off the training thread (``collectors.manifests``), on real files: the
worker waits for files still being written, hashes what settled, and hands every checkpoint on
in the order it was saved, with or without a manifest."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest

from collectors.checkpoints import build_manifest
from collectors.manifests import MAX_READS, ManifestJob, ManifestWorker, StillChanging, settled_manifest


def test_a_single_file_is_its_own_entry(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_bytes(b"weights")
    manifest = build_manifest(checkpoint, step=7, consumed=70)
    assert manifest == {
        "step": 7,
        "consumed": 70,
        "files": [{"path": ".", "size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}],
    }


def test_a_missing_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a file nor a directory"):
        build_manifest(tmp_path / "nothing", step=1)


def test_files_still_being_written_are_hashed_once_they_settle(tmp_path: Path) -> None:
    """Another rank's shard lands during the first quiet period: the manifest has it whole."""
    folder = tmp_path / "ckpt-5"
    folder.mkdir()
    (folder / "rank0.pt").write_bytes(b"a" * 100)
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 1:
            (folder / "rank1.pt").write_bytes(b"b" * 50)

    manifest = settled_manifest(str(folder), 5, None, 0.25, wait)
    assert [(f["path"], f["size"]) for f in manifest["files"]] == [("rank0.pt", 100), ("rank1.pt", 50)]
    assert waits == [0.25, 0.25]  # the change was seen, so it waited for another quiet period


def test_a_checkpoint_that_never_settles_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_bytes(b"")

    def grow(seconds: float) -> None:
        with checkpoint.open("ab") as handle:
            handle.write(b"x")

    with pytest.raises(StillChanging, match=f"over {MAX_READS} reads"):
        settled_manifest(str(checkpoint), 1, None, 0.0, grow)


def test_the_worker_sends_in_save_order_off_the_calling_thread(tmp_path: Path) -> None:
    sent: list[tuple[int, str, dict[str, Any] | None]] = []
    release = threading.Event()

    def send(job: ManifestJob, manifest: dict[str, Any] | None) -> None:
        release.wait(10)
        sent.append((job.step, threading.current_thread().name, manifest))

    worker = ManifestWorker(send, settle_s=0.0)
    for step in (1, 2, 3):
        path = tmp_path / f"ckpt-{step}.pt"
        path.write_bytes(bytes([step]) * step)
        worker.submit(ManifestJob(step, str(path), float(step)))
    worker.submit(ManifestJob(4, str(tmp_path / "gone.pt"), 4.0))
    assert worker.pending == 4 and sent == []  # submit returned before any was read
    release.set()
    assert worker.finish(10)
    assert [step for step, _, _ in sent] == [1, 2, 3, 4]
    assert {thread for _, thread, _ in sent} == {"runhealth-manifests"}
    assert [m["files"][0]["size"] for _, _, m in sent[:3] if m is not None] == [1, 2, 3]
    assert sent[3][2] is None  # the file was gone: recorded without a manifest
    assert worker.pending == 0


def test_a_failing_send_does_not_stop_the_later_checkpoints(tmp_path: Path) -> None:
    sent: list[int] = []

    def send(job: ManifestJob, manifest: dict[str, Any] | None) -> None:
        if job.step == 1:
            raise RuntimeError("the outbox refused it")
        sent.append(job.step)

    worker = ManifestWorker(send, settle_s=0.0)
    for step in (1, 2):
        (tmp_path / f"{step}.pt").write_bytes(b"w")
        worker.submit(ManifestJob(step, str(tmp_path / f"{step}.pt"), 0.0))
    assert worker.finish(10)
    assert sent == [2]


def test_a_save_written_over_by_a_later_save_of_its_path_gets_no_manifest(tmp_path: Path) -> None:
    """One ``snapshot.pt`` saved again every epoch (the DDP tutorial's trainer): a save still
    queued when the next one lands, or read while it lands, holds the next one's bytes, so it is
    recorded without a manifest; the newest save is hashed as it is."""
    snapshot, other = tmp_path / "snapshot.pt", tmp_path / "other.pt"
    other.write_bytes(b"o")
    sent: list[tuple[int, dict[str, Any] | None]] = []
    release, reading = threading.Event(), threading.Event()

    def send(job: ManifestJob, manifest: dict[str, Any] | None) -> None:
        release.wait(10)
        sent.append((job.step, manifest))

    def wait(seconds: float) -> None:
        if not reading.is_set():  # the first save of snapshot.pt is being read
            reading.set()
            snapshot.write_bytes(b"epoch 2, longer")  # the next save lands meanwhile
            worker.submit(ManifestJob(2, str(snapshot), 2.0))

    worker = ManifestWorker(send, settle_s=0.0, wait=wait)
    snapshot.write_bytes(b"epoch 1")
    worker.submit(ManifestJob(1, str(snapshot), 1.0))
    assert reading.wait(10)
    release.set()
    assert worker.finish(10)
    release.clear()
    worker.submit(ManifestJob(9, str(other), 9.0))  # holds the worker while two saves queue
    for step, content in ((3, b"epoch 3"), (4, b"epoch 4, last")):
        snapshot.write_bytes(content)
        worker.submit(ManifestJob(step, str(snapshot), float(step)))
    release.set()
    assert worker.finish(10)
    hashes = {step: manifest and manifest["files"][0]["sha256"] for step, manifest in sent}
    assert [step for step, _ in sent] == [1, 2, 9, 3, 4]  # every save recorded, in order
    assert hashes[1] is None and hashes[3] is None  # saved over: no manifest
    assert hashes[2] == hashlib.sha256(b"epoch 2, longer").hexdigest()
    assert hashes[4] == hashlib.sha256(b"epoch 4, last").hexdigest()
