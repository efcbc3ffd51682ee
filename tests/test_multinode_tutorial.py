"""PyTorch's DDP tutorial multi-node trainer (``tests/trainers/ddp_multinode_hooked.py``) with
the hook attached by the README's recipes, on two ``torchrun --nnodes=2`` launches (2 gloo
processes each) with ``--max-restarts=3``, and no service URL: global rank 0 runs the job's
embedded service.

Rank 3, on the second node, crashes mid-epoch at step 40, between its backward and its update,
after the snapshot of step 32 was saved to ``snapshot.pt``. torchrun restarts the whole group;
rank 0, with the job's service, went down with it, so the restarted rank 0 starts the service
again on the same store and the other node's ranks learn its new address from the new start's
store. The restarted trainer loads ``snapshot.pt`` and says so (``rh.resumed``). What must
hold: one run with two incarnations (the first failed, the second ``completed``), the resume
of every rank recorded against step 32, every window of the second start stored, and no
incident at all: the crash is no skipped update (its rank's last window, closed at exit, made
none while its peers stepped), and the tutorial's plain SGD, which keeps no per-parameter state,
restored none without having lost any. ``runhealth gate`` lets the job be requeued.

torchrun 2.13 restarting two agents on one host over the rendezvous' shared TCP store left the
restarted workers' gloo mesh unconnected ("Connection refused" in ``connectFullMesh``, the
plain tutorial without runhealth alike), so the launches set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, where the restart works.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.adapters_support import run_rows
from tests.collectors_support import REPO, child_environ, wait_until
from tests.support import free_port, require_module

require_module("torch")
pytestmark = pytest.mark.slow

TRAINER = REPO / "tests" / "trainers" / "ddp_multinode_hooked.py"
WORLD = 4
STEPS_PER_EPOCH = 16  # 2,048 examples, 32 a batch, 4 ranks
EPOCHS = 3  # the crash at 40 is in the third; the restart trains 33..48 from the snapshot of 32
JOB = "ddp-tutorial"
RUN = f"run-{JOB}"  # the hook's name for a job torchrun names with --rdzv-id


def launch(root: Path, port: int, node: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
        "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={JOB}", "--max-restarts=3", str(TRAINER), str(EPOCHS), "1",
        "--crash_at=40", "--crash_rank=3", "--step_sleep=0.02",
    ]  # fmt: skip
    environ = child_environ(
        RUNHEALTH_NODE=f"node-{'ab'[node]}",
        RUNHEALTH_SPOOL_DIR=str(root / f"spool-{node}"),
        RUNHEALTH_SENDER__FLUSH_INTERVAL_S="0.2",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    with open(root / f"node-{node}.log", "ab") as log:
        return subprocess.Popen(command, cwd=root, env=environ, stdout=log, stderr=subprocess.STDOUT)


def logs(root: Path) -> str:
    return "".join((root / f"node-{node}.log").read_text(errors="replace") for node in (0, 1))


def test_a_crash_restarted_by_torchrun_resumes_from_the_snapshot_with_no_incident(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port = free_port()
    launches = [launch(tmp_path, port, node) for node in (0, 1)]

    def close() -> None:
        # A test that failed early: its launches, by PID. SIGTERM first: torchrun then ends its
        # workers, which a SIGKILL of the launcher alone leaves running.
        for process in launches:
            if process.poll() is None:
                process.terminate()
        for process in launches:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    request.addfinalizer(close)
    deadline = time.monotonic() + 240
    for process in launches:
        try:
            process.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            close()
        assert process.returncode == 0, logs(tmp_path)[-6000:]
    text = logs(tmp_path)
    assert (
        "rank 3 crashed at step 40" in text
        and text.count("Resuming training from snapshot at Epoch 2") == WORLD
    )
    db = tmp_path / "runhealth.db"
    announced = [line for line in text.splitlines() if "is recorded in" in line]
    assert len(announced) == 2 and all(f"--db {db} --run {RUN}" in line for line in announced), announced

    def rows(table: str) -> list[dict[str, Any]]:
        return run_rows(db, table, RUN)

    def judged() -> bool:
        summaries = rows("step_summaries")
        return bool(summaries) and all(s["judged"] for s in summaries)

    assert wait_until(judged, 60, 0.5)  # the service is gone: what it stored was judged before
    crashed, restarted = rows("incarnations")
    # The crashed start's finish is rank 0's: "failed" when its own collective failed first,
    # none when torchrun's SIGTERM for its node's failed rank came first (a SIGTERM the trainer
    # does not handle ends it before the hook's close); the restart-loop rule reads both alike.
    assert crashed["finish_status"] in ("failed", None) and restarted["finish_status"] == "completed"
    steps = rows("step_records")
    first = [s for s in steps if s["incarnation"] == crashed["incarnation"]]
    assert max(s["step"] for s in first) == 40 and {s["rank"] for s in first} == set(range(WORLD))
    again = sorted((s["step"], s["rank"]) for s in steps if s["incarnation"] == restarted["incarnation"])
    total = EPOCHS * STEPS_PER_EPOCH
    assert again == [(step, rank) for step in range(33, total + 1) for rank in range(WORLD)]
    resumes = rows("resume_events")
    assert sorted(r["rank"] for r in resumes) == list(range(WORLD))
    assert {(r["incarnation"], r["checkpoint_step"], r["checkpoint_path"]) for r in resumes} == {
        (restarted["incarnation"], 32, str(tmp_path / "snapshot.pt"))
    }
    assert rows("incidents") == []
    gate = subprocess.run(
        [sys.executable, "-m", "monitor", "gate", RUN, "--db", str(db)],
        capture_output=True, text=True, env=child_environ(), timeout=120, check=False,
    )  # fmt: skip
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert [p.name for p in tmp_path.glob("spool-*/**/*.dead.jsonl") if p.stat().st_size] == []
    assert not Path(f"{db}.service.json").exists()  # the last start's service stopped with it
