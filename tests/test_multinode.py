"""One job on two "nodes" of this machine: two ``torchrun --nnodes=2`` launches (2 gloo
processes each, distinct ``RUNHEALTH_NODE``) against one c10d rendezvous on 127.0.0.1, running
the nanoGPT-style test trainer with a corrupted batch on rank 3, on the second node.

- With no service URL (the embedded default): global rank 0 starts the job's one service, the
  other three ranks, of both nodes, learn its URL and run token through the job's c10d store,
  and one store holds every rank's records. The spike on rank 3 is judged against all four
  ranks; the service (configured through the trainer's environment, which it inherits) holds
  the ranks; an operator approves with ``runhealth approve ID --db PATH`` (no URL, no token on
  the command line: the discovery file beside the store); all four ranks stop at one step,
  restore, resume and the resume verifies.
- The same job against a real ``runhealth serve`` over PostgreSQL, approved with an operator
  token over HTTP.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from monitor.store import migrate, queries
from monitor.store.operators import add_operator
from tests.adapters_support import run_rows
from tests.collectors_support import ServeProcess, child_environ, store_engine, table_rows, wait_until
from tests.support import PostgresServer, free_port, require_module
from tests.test_attach_recipes import TARGETS, TRAINERS, cli, every_rank_resumed_to, token_files

torch = require_module("torch")
pytestmark = pytest.mark.slow

WORLD = 4
# The bad batch at iteration 70, 50 iterations before the next evaluation (120), which saves
# over the one checkpoint file when the val loss improved: the hold comes well before it, also
# with the machine loaded (an evaluation every 40 left 9 iterations, too few under load). The
# test ends the job (the file ``stop``) once every rank has trained AFTER_RESUME updates past the
# checkpoint it rolled back to; max_iters only bounds it.
CORRUPTED = ["--corrupt_at=70", "--corrupt_rank=3", "--always_save_checkpoint=False",
             "--eval_interval=60", "--max_iters=300", "--iter_sleep=0.05", "--stop_file=stop"]  # fmt: skip
AFTER_RESUME = 25
"""Updates every rank trains past the checkpoint it rolled back to (60) before the test ends the
job: past the resumed evaluation at 60 and the corrupted batch's update 71, where a second spike
(a recovery loop) would be, by 14 updates (the first spike was found at 71 and the job held by
80); the test then waits for every stored window to be judged. test_attach_recipes' 50 trained
25 more updates on four ranks that no assertion reads."""


class TwoNodeJob:
    """Both launches of one job, in ``root``; ``db`` is where its records land. The job's
    rendezvous id is the run's name without its ``run-``: the name the hook gives a run by
    default (``run-`` and torchrun's ``TORCHELASTIC_RUN_ID``)."""

    def __init__(self, root: Path, db: Path | sa.URL, run: str, **environ: str) -> None:
        self.root, self.db, self.run = root, db, run
        self.environ = environ
        self.rdzv_port = free_port()
        self.launches: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> None:
        for node in (0, 1):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{self.rdzv_port}",
                f"--rdzv_id={self.run.removeprefix('run-')}", "--max_restarts=0", str(TRAINERS / "nanogpt_hooked.py"),
                "--data_dir=data", *args,
            ]  # fmt: skip
            environ = child_environ(
                RUNHEALTH_NODE=f"node-{'ab'[node]}",
                RUNHEALTH_SPOOL_DIR=str(self.root / f"spool-{node}"),
                RUNHEALTH_SENDER__FLUSH_INTERVAL_S="0.2",
                RUNHEALTH_DIRECTIVES__POLL_INTERVAL_S="0.5",
                **TARGETS,
                **self.environ,
            )
            with open(self.root / f"node-{node}.log", "ab") as log:
                self.launches.append(
                    subprocess.Popen(
                        command, cwd=self.root, env=environ, stdout=log, stderr=subprocess.STDOUT
                    )
                )

    def wait(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        for node, launch in enumerate(self.launches):
            try:
                launch.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
            assert launch.returncode == 0, self.log(node)

    def log(self, node: int) -> str:
        return (self.root / f"node-{node}.log").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        # A test that failed early: its launches, by PID. SIGTERM first: torchrun then ends its
        # workers, which a SIGKILL of the launcher alone leaves running.
        for launch in self.launches:
            if launch.poll() is None:
                launch.terminate()
        for launch in self.launches:
            try:
                launch.wait(30)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait()

    def rows(self, table: str) -> list[dict[str, Any]]:
        return run_rows(self.db, table, self.run)

    def dead_letters(self) -> list[str]:
        return [p.name for p in self.root.glob("spool-*/**/*.dead.jsonl") if p.stat().st_size]

    def pending_proposal(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """The first pending proposal, waited for from the launches: the deadline covers the
        start of two agents and four workers (40 s at load 10, and test_recovery_e2e's four ranks
        took over 120 s at load 20) and 71 updates."""
        found: list[dict[str, Any]] = []
        engine = store_engine(self.db)

        def pending() -> bool:
            if isinstance(self.db, Path) and not self.db.exists():
                return False  # rank 0's service has not created the store yet
            try:
                with engine.connect() as connection:
                    found[:] = queries.list_proposals(connection, self.run, "pending")
            except sa.exc.OperationalError:  # nor migrated it
                return False
            return bool(found)

        try:
            assert wait_until(pending, timeout_s, 0.5), self.log(0) + self.log(1)
        finally:
            engine.dispose()
        return found[0]


def run_and_verify(job: TwoNodeJob, approve: Callable[[int], dict[str, Any]]) -> None:
    """The corrupted batch at update 71 on rank 3 (node b): one spike, judged against all four
    ranks, held, approved, every rank stopped at one step, restored to 60, resumed at 61."""
    job.start(*CORRUPTED)
    proposal = job.pending_proposal()
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", 60)
    approved = approve(proposal["id"])
    assert approved["ok"], approved
    trained = wait_until(lambda: every_rank_resumed_to(job.rows, 60 + AFTER_RESUME), 240.0, 0.5)
    assert trained, job.log(0) + job.log(1)
    (job.root / "stop").touch()
    job.wait()

    steps = job.rows("step_records")
    nodes = {s["rank"]: s["node"] for s in steps}  # one store holds both nodes' ranks
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3] and set(nodes.values()) == {"node-a", "node-b"}
    acks = [a for a in job.rows("directive_acks") if a["directive_id"] == approved["proposal"]["directive"]]
    assert sorted(a["rank"] for a in acks) == list(range(WORLD)) and {a["status"] for a in acks} == {"done"}
    assert len({a["step"] for a in acks}) == 1, acks  # every rank stopped at one step
    resumes = job.rows("resume_events")
    assert len(resumes) == WORLD and {r["checkpoint_step"] for r in resumes} == {60}
    after = [s for s in steps if s["incarnation"] == resumes[0]["incarnation"]]
    assert min(s["step"] for s in after) == 61 and {s["rank"] for s in after} == set(range(WORLD))
    assert all(np.isfinite(s["loss_sum"]) for s in after)

    def judged() -> bool:
        summaries = job.rows("step_summaries")
        return bool(summaries) and all(s["judged"] for s in summaries)

    assert wait_until(judged, 60, 0.5)
    incidents = job.rows("incidents")
    assert [(i["kind"], i["first_step"]) for i in incidents] == [("spike", 71)], incidents
    assert incidents[0]["status"] == "resolved"
    first = [f for f in job.rows("findings") if f["incident_id"] == incidents[0]["id"] and f["step"] == 71]
    assert sorted(f["rank"] for f in first if f["rank"] is not None) == [3], first
    # One rollback, no recovery loop. Under load the spike can be judged before the checkpoint
    # at 60 is recorded (its manifest is hashed off the training thread): the escalation made
    # then is superseded by the rollback once the record lands.
    proposals = job.rows("proposals")
    assert [p["action"] for p in proposals if p["status"] != "superseded"] == ["rollback"], proposals
    assert job.dead_letters() == []


def test_two_nodes_with_no_url_share_one_embedded_service_and_approve_through_the_store(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    token_files(tmp_path)
    db = tmp_path / "runhealth.db"  # the default store, in the trainer's working directory
    job = TwoNodeJob(tmp_path, db, "run-embedded-2x2", RUNHEALTH_POLICIES__RESPONSE__SPIKE="hold")
    request.addfinalizer(job.close)

    def approve(proposal_id: int) -> dict[str, Any]:
        return cli(tmp_path, "approve", str(proposal_id), "--reason", "corrupted shard", "--db", str(db))

    run_and_verify(job, approve)
    (proposal,) = [p for p in job.rows("proposals") if p["action"] == "rollback"]
    assert proposal["decided_by"].startswith("local:"), proposal  # the operator at the CLI
    audit = [e for e in table_rows(db, "audit_log") if e["subject"] == f"proposal:{proposal['id']}"]
    assert ("approved", proposal["decided_by"]) in [(e["action"], e["actor"]) for e in audit], audit
    logs = job.log(0) + job.log(1)
    announced = [line for line in logs.splitlines() if "is recorded in" in line]
    assert len(announced) == 1 and f"runhealth incidents --db {db} --run {job.run}" in announced[0], logs
    assert not Path(f"{db}.service.json").exists()  # the service stopped with the job


def test_two_nodes_against_a_serve_over_postgresql(
    tmp_path: Path, postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    token_files(tmp_path)
    url = postgres_server.create_database()
    engine = store_engine(url)
    request.addfinalizer(engine.dispose)
    migrate.upgrade(engine)  # `runhealth db upgrade`, as a PostgreSQL store needs before serve
    serve = ServeProcess(tmp_path / "serve", url, RUNHEALTH_POLICIES__RESPONSE__SPIKE="hold")
    serve.root.mkdir()
    request.addfinalizer(serve.stop)  # before start: a start that timed out leaves its process
    # A serve start imports the service: at load 30 on this 2-core machine it took over 60 s.
    serve.start(timeout_s=180.0)
    run = "run-postgres-2x2"
    job = TwoNodeJob(
        tmp_path, url, run, RUNHEALTH_URL=serve.url, RUNHEALTH_TOKEN=serve.create_run(run), RUNHEALTH_RUN=run
    )
    request.addfinalizer(job.close)
    with engine.begin() as connection:
        operator = add_operator(connection, "oncall-pg", actor="tests", now=time.time())

    def approve(proposal_id: int) -> dict[str, Any]:
        return cli(tmp_path, "approve", str(proposal_id), "--reason", "corrupted shard", "--url", serve.url,
                   "--token", operator)  # fmt: skip

    run_and_verify(job, approve)
