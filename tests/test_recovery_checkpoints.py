"""The checkpoint registry (``monitor.recovery.checkpoints``) on a real store and real files:
versions of one path, validations that go stale when the files change, the re-check right
before a checkpoint becomes a rollback target, and files on another node's disk. And a
trainer in the style of a real script, against a real ``runhealth serve``: one checkpoint
file at a relative path, overwritten at every evaluation."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from monitor.ingest.batches import ingest_batch
from monitor.ingest.schemas import BatchIn
from monitor.recovery import checkpoints
from monitor.recovery.decisions import list_proposals
from monitor.service import Service
from policies.checkpoints import manifest_digest, rewind_target
from tests.adapters_support import stored
from tests.collectors_support import ServeProcess, serving
from tests.support import INCARNATION, RunHandle, cli_result, post, require_module, spiky_windows
from tests.support import checkpoint as support_checkpoint

NODE = "node-a"  # this service's node in these tests


def saved(path: Path, step: int, payload: bytes, **fields: Any) -> dict[str, Any]:
    """Write ``payload`` as a one-file checkpoint at ``path`` and return its record."""
    path.write_bytes(payload)
    manifest = {
        "step": step,
        "files": [{"path": ".", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}],
    }
    record = {"kind": "checkpoint", "incarnation": INCARNATION, "step": step, "path": str(path),
              "time": 100.0 + step, "manifest": manifest, "node": NODE}  # fmt: skip
    return {**record, **fields}


def ingest(store: Engine, run: RunHandle, records: list[dict[str, Any]]) -> None:
    parsed = BatchIn.model_validate({"records": records}).records
    with store.begin() as connection:
        ingest_batch(connection, run.id, parsed, 5000.0)


def listed(store: Engine, run: RunHandle, validate: bool = True) -> list[dict[str, Any]]:
    with store.begin() as connection:
        if validate:
            checkpoints.validate_pending(connection, 6000.0, run.id, local_node=NODE)
        return checkpoints.registry(connection, run.id, local_node=NODE)


def rewrite(path: Path, payload: bytes) -> None:
    """Overwrite a file so that its modification time moves even on a coarse clock."""
    before = path.stat().st_mtime_ns
    path.write_bytes(payload)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def test_a_path_saved_again_is_a_new_version_and_the_older_one_is_superseded(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt.pt"
    ingest(store, run, [saved(path, 10, b"weights at 10")])
    first = saved(path, 20, b"weights at 20")
    ingest(store, run, [first])
    ingest(store, run, [first, {**first, "time": 999.0, "tags": ["again"]}])  # the same checkpoint
    old, new = listed(store, run)
    assert (old["step"], new["step"]) == (10, 20)
    assert old["superseded_by"] == new["id"] and old["valid"] is False
    assert {"tag": "superseded", "by": new["id"]} in old["tags"]
    assert "was saved again" in old["problems"][0]
    assert new["valid"] is True and new["superseded_by"] is None
    assert {"tag": "latest-resumable"} in new["tags"]
    assert new["manifest_digest"] == manifest_digest(first["manifest"]) and new["node"] == NODE


def test_a_validation_is_stale_once_the_files_change_and_is_redone(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt.pt"
    ingest(store, run, [saved(path, 10, b"weights at 10")])
    assert listed(store, run)[0]["valid"] is True
    rewrite(path, b"weights at 11")  # same size, other bytes
    (stale,) = listed(store, run, validate=False)
    assert stale["valid"] is None and "changed since they were validated" in stale["problems"][0]
    (checked,) = listed(store, run)
    assert checked["valid"] is False and checked["problems"] == ["ckpt.pt: sha256 differs from the manifest"]
    rewrite(path, b"weights at 10")  # put back: valid again once re-read
    assert listed(store, run)[0]["valid"] is True


def test_a_target_whose_file_changed_after_validation_is_checked_again_before_it_is_chosen(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    """The validation of step 20 is current as far as the registry knows (same size, and the
    modification time put back), yet its bytes changed: the re-read right before it would become
    the target finds that, and the rollback goes to step 10 instead."""
    older, newer = tmp_path / "ckpt-10.pt", tmp_path / "ckpt-20.pt"
    ingest(store, run, [saved(older, 10, b"weights at 10"), saved(newer, 20, b"weights at 20")])
    assert [c["valid"] for c in listed(store, run)] == [True, True]
    stat = newer.stat()
    newer.write_bytes(b"weights at 2X")
    os.utime(newer, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the change leaves no trace in stat
    with store.begin() as connection:
        known, unsafe = checkpoints.facts(connection, run.id, NODE)
        assert rewind_target(known, 30, unsafe).step == 20  # type: ignore[union-attr]
        known, unsafe = checkpoints.confirmed_facts(connection, run.id, 30, 7000.0, local_node=NODE)
        target = rewind_target(known, 30, unsafe)
    assert target is not None and target.step == 10
    assert [c["valid"] for c in listed(store, run, validate=False)] == [True, False]


def test_files_on_another_nodes_disk_are_left_unchecked_saying_where_they_are(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    elsewhere = saved(tmp_path / "ckpt.pt", 10, b"w", node="node-b")
    (tmp_path / "ckpt.pt").unlink()  # not on this node's disk
    mine = saved(tmp_path / "mine.pt", 20, b"w")
    (tmp_path / "mine.pt").unlink()
    ingest(store, run, [elsewhere, mine])
    other, own = listed(store, run)
    assert other["valid"] is None and other["problems"][0].startswith("held on node node-b")
    assert own["valid"] is False and own["problems"] == ["mine.pt: missing"]


def test_a_relative_path_is_refused_by_validation(store: Engine, run: RunHandle, tmp_path: Path) -> None:
    record = saved(tmp_path / "ckpt.pt", 10, b"w")
    ingest(store, run, [{**record, "path": "out/ckpt.pt"}])
    (checkpoint,) = listed(store, run)
    assert checkpoint["valid"] is False and "relative path out/ckpt.pt" in checkpoint["problems"][0]


def test_an_approval_whose_checkpoint_was_saved_over_makes_a_fresh_proposal_instead(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    """Proposed: roll back to step 20. Before the operator approves, the trainer saves the same
    folder again at step 80 (one folder reused for the latest checkpoint): loading it now would
    load step 80, after the fault. The approval is refused and a fresh proposal made, which
    has no checkpoint before the fault left and escalates."""
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 100.0, "world_size": 2}])
    post(service, run, [support_checkpoint(tmp_path, 20), *spiky_windows(range(1, 65))])
    post(service, run, [*spiky_windows(range(65, 75), spike=65)])
    with service.engine.connect() as connection:
        (proposal,) = list_proposals(connection, run.name)
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", 20)
    folder = tmp_path / "ckpt-20"
    with service.engine.begin() as connection:
        assert (
            checkpoints.target_problem(connection, run.id, proposal["target"]["checkpoint"], 7000.0) is None
        )
    (folder / "model.pt").write_bytes(b"weights at 80")
    manifest = {
        "step": 80,
        "files": [{"path": "model.pt", "size": 13, "sha256": hashlib.sha256(b"weights at 80").hexdigest()}],
    }
    post(service, run, [{"kind": "checkpoint", "incarnation": INCARNATION, "step": 80, "path": str(folder),
                         "time": 180.0, "manifest": manifest}])  # fmt: skip
    outcome = service.decisions.approve(proposal["id"], "alice", "go")
    assert not outcome.ok and "was saved again after step 20" in outcome.message
    with service.engine.connect() as connection:
        listed = {p["id"]: p for p in list_proposals(connection, run.name)}
    assert listed[proposal["id"]]["status"] == "superseded"
    (fresh,) = [p for p in listed.values() if p["id"] != proposal["id"]]
    assert f"proposal {fresh['id']} replaces it" in outcome.message
    assert fresh["status"] != "executing" and fresh["action"] == "escalate" and fresh["directive"] is None


def test_an_approval_reads_a_target_again_only_when_its_files_changed(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt.pt"
    ingest(store, run, [saved(path, 10, b"weights at 10")])
    (checkpoint,) = listed(store, run)
    with store.begin() as connection:
        assert checkpoints.target_problem(connection, run.id, checkpoint["id"], 7000.0, NODE) is None
    rewrite(path, b"weights at 1X")
    with store.begin() as connection:
        problem = checkpoints.target_problem(connection, run.id, checkpoint["id"], 7000.0, NODE)
    assert (
        problem
        == f"checkpoint {checkpoint['id']} no longer matches its manifest: ckpt.pt: sha256 differs from the manifest"
    )
    assert listed(store, run, validate=False)[0]["valid"] is False


# A trainer as real scripts write one.


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory.mktemp("serve")) as process:
        yield process


@pytest.mark.slow
def test_one_checkpoint_file_overwritten_in_place_at_a_relative_path(
    serve: ServeProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """nanoGPT's way: ``out/ckpt.pt`` under the directory the script runs in, saved (and so
    overwritten) at every evaluation, with ``rh.checkpoint_saved(step, "out/ckpt.pt")``."""
    require_module("torch")
    import torch

    from collectors import HookConfig, RunHealth, RunHealthConfig
    from collectors.sender import SenderConfig
    from collectors.spool import SpoolConfig
    from collectors.transport import TransportConfig

    run = "overwritten"
    config = RunHealthConfig(
        transport=TransportConfig(url=serve.url, token=serve.create_run(run), run=run),
        spool=SpoolConfig(directory=str(tmp_path / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0),
        hook=HookConfig(manifest_settle_s=0.05),
    )
    monkeypatch.chdir(tmp_path)
    os.makedirs("out", exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    inputs = torch.randn(64, 16)
    targets = inputs @ torch.randn(16, 16)  # a steady regression: the loss falls smoothly
    rh = RunHealth(model=model, optimizer=optimizer, config=config, environ={}, hostname=lambda: NODE)
    with closing(rh.start()):
        for iter_num in range(1, 31):
            rh.window_start(sample_ids=[iter_num])
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            rh.loss(loss, tokens=64)
            loss.backward()
            rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
            rh.window_end()
            if iter_num % 10 == 0:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                }
                torch.save(checkpoint, os.path.join("out", "ckpt.pt"))
                rh.checkpoint_saved(iter_num, "out/ckpt.pt")  # hashed off this thread
    rows = stored(serve, "checkpoint_events", run, 3)
    assert [row["step"] for row in rows] == [10, 20, 30]
    assert rh.counters["dead_lettered"] == 0
    code, out, err = cli_result(capsys, "checkpoints", run, "--db", str(serve.db), "--validate", "--json")
    assert code == 0, err
    listed = json.loads(out)["checkpoints"]
    assert {c["path"] for c in listed} == {str(tmp_path / "out" / "ckpt.pt")}
    assert {c["node"] for c in listed} == {NODE}
    (current,) = [c for c in listed if c["superseded_by"] is None]
    assert current["step"] == 30 and current["valid"] is True and current["files"] == 1
    assert {"tag": "latest-resumable"} in current["tags"]
    older = [c for c in listed if c["superseded_by"] is not None]
    assert [c["step"] for c in older] == [10, 20]
    assert all(c["superseded_by"] == current["id"] and c["valid"] is False for c in older)
