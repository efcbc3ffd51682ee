"""Recovery end to end: four gloo ranks, a real service, the operator's CLI.

1. A corrupted batch: spike -> proposal (the right checkpoint) -> the replay job says data ->
   an operator approves from the CLI -> every rank stops at one step, restores, skips the
   batch, resumes -> the continuity check passes and the incident is resolved.
2. A fault in one rank's computation: its canary (run at checkpoints) misses persistently ->
   hardware -> the proposal quarantines that rank's node.
3. A fault with no reproducible cause: undetermined, nothing quarantined.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from monitor.recovery.decisions import list_proposals
from monitor.store import audit, queries
from monitor.store.db import create_store_engine, resolve_url
from monitor.store.operators import add_operator
from tests.collectors_support import (
    ServeProcess,
    child_environ,
    finish_ranks,
    launch_ranks,
    table_rows,
    wait_until,
)
from tests.support import require_module

WORLD = 4
require_module("torch")
pytestmark = pytest.mark.slow


def launch(
    root: Path, serve: ServeProcess, run: str, token: str, *extra: str, step_sleep: float = 0.02
) -> list[subprocess.Popen[bytes]]:
    command = [
        sys.executable, "-m", "monitor.demo.worker", "--task", "sequence", "--step-sleep", str(step_sleep),
        "--checkpoints", str(root / "ckpt"), "--out", str(root / "results"), *extra,
    ]  # fmt: skip
    # Each rank its own node: a quarantine names one rank's node, not all four.
    return launch_ranks(
        root, WORLD, command, lambda rank: {"RUNHEALTH_NODE": f"node-{rank}"},
        RUNHEALTH_URL=serve.url, RUNHEALTH_TOKEN=token, RUNHEALTH_RUN=run,
        RUNHEALTH_SPOOL_DIR=str(root / "spool"),
    )  # fmt: skip


def finish(
    ranks: list[subprocess.Popen[bytes]], root: Path, timeout_s: float = 240.0
) -> list[dict[str, Any]]:
    return finish_ranks(ranks, root, timeout_s)


class Service:
    """The module's one ``runhealth serve`` and its store; each test trains its own run there
    (a serve start is a process importing the service, seconds of a loaded 2-core machine)."""

    def __init__(self, root: Path) -> None:
        self.db = root / "store.db"
        self.serve = ServeProcess(root, self.db)
        try:
            self.serve.start(timeout_s=180.0)  # at load 30 a start took over 60 s (test_multinode)
        except RuntimeError:
            self.serve.stop()  # a start that timed out leaves its process
            raise
        self.engine = create_store_engine(resolve_url(str(self.db), {}))
        with self.engine.begin() as connection:
            self.operator = add_operator(connection, "oncall-alice", actor="tests", now=time.time())

    def close(self) -> None:
        self.engine.dispose()
        self.serve.stop()


class Scenario:
    """One test's run on the module's service: its ranks, files and rows in ``root``."""

    def __init__(self, root: Path, service: Service, run: str) -> None:
        self.root, self.run = root, run
        self.db, self.serve, self.engine = service.db, service.serve, service.engine
        self.operator = service.operator
        self.token = self.serve.create_run(self.run)
        self.ranks: list[subprocess.Popen[bytes]] = []

    def launch(self, *extra: str, step_sleep: float = 0.02) -> list[subprocess.Popen[bytes]]:
        """The ranks, once their job started: four ranks importing torch at once took over 120 s
        at load 20 (every test's first wait then timed out before a step); the tests' deadlines
        are for events of a running job."""
        self.ranks = launch(self.root, self.serve, self.run, self.token, *extra, step_sleep=step_sleep)

        def started() -> bool:
            return bool(self.rows("incarnations")) or any(r.poll() is not None for r in self.ranks)

        assert wait_until(started, 300.0, 0.5) and self.rows("incarnations"), self.logs()
        return self.ranks

    def logs(self) -> str:
        return "\n".join(
            path.read_text(errors="replace")[-2000:] for path in sorted(self.root.glob("rank-*.log"))
        )

    def rows(self, table: str) -> list[dict[str, Any]]:
        """This run's rows of ``table`` (the store holds the module's other runs too)."""
        (run_id,) = [r["id"] for r in table_rows(self.db, "runs") if r["name"] == self.run]
        return [r for r in table_rows(self.db, table) if r["run_id"] == run_id]

    def proposals(self) -> list[dict[str, Any]]:
        with self.engine.connect() as connection:
            return list_proposals(connection, self.run)

    def wait_proposal(self, check: Any, timeout_s: float = 120.0) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def ready() -> bool:
            found[:] = [p for p in self.proposals() if check(p)]
            return bool(found)

        assert wait_until(ready, timeout_s, 0.25), (
            f"no such proposal; have {self.proposals()}\n{self.serve.log_tail()}"
        )
        return found[-1]

    def cli(self, *args: str) -> dict[str, Any]:
        out = self.root / "cli.json"
        with open(out, "w") as handle:
            result = subprocess.run(
                [sys.executable, "-m", "monitor", *args, "--json"],
                stdout=handle,
                stderr=subprocess.PIPE,
                text=True,
                env=child_environ(),
                cwd=self.root,
                timeout=300,
            )
        assert result.returncode == 0, result.stderr
        return json.loads(out.read_text())

    def close(self) -> None:
        # A test that failed before finish() leaves its ranks training: end them by PID.
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made = Service(tmp_path_factory.mktemp("serve"))
    yield made
    made.close()


@pytest.fixture
def scenario(tmp_path: Path, service: Service, request: pytest.FixtureRequest) -> Any:
    made = Scenario(tmp_path, service, "-".join(request.node.name.split("_")[1:4]))  # a-corrupted-batch
    yield made
    made.close()


def test_a_corrupted_batch_is_diagnosed_as_data_and_rolled_back_past_it(scenario: Scenario) -> None:
    corrupt = "2:44"  # rank 2's batch 44: trained at update 45
    replay = (
        f"{sys.executable} -m monitor.demo.replay --task sequence --corrupt {corrupt} {{spec}} {{result}}"
    )
    # The ranks train on while the replay and the operator's approval run (wall-clock waits of
    # two CLI processes and a replay): a 0.1 s step trains fewer throwaway updates then and
    # leaves the machine's CPU to those processes (at 0.02 four ranks trained 1,100 updates, 87 s
    # of a 2-core machine under load, before the approval came).
    ranks = scenario.launch(
        "--corrupt",
        corrupt,
        "--wait-rollback",
        "--replay-command",
        replay,
        step_sleep=0.1,
    )
    first = scenario.wait_proposal(lambda p: p["status"] == "pending")
    assert first["evidence"]["incident"]["first_step"] == 45
    assert first["target"]["step"] == 40  # the newest valid checkpoint strictly before update 45
    replayed = scenario.cli("replay", str(first["incident"]), "--db", str(scenario.db))
    assert replayed["verdict"] == "data", replayed
    second = scenario.wait_proposal(lambda p: p["verdict"] == "data" and p["status"] == "pending")
    assert second["data_action"] == "skip" and "r2-b44" in second["skip_batches"]
    assert second["quarantine"] == {"node": None, "device": None}
    approved = scenario.cli(
        "approve",
        str(second["id"]),
        "--reason",
        "bad shard",
        "--url",
        scenario.serve.url,
        "--token",
        scenario.operator,
    )
    assert approved["ok"] and approved["proposal"]["decided_by"] == "oncall-alice"
    results = finish(ranks, scenario.root)

    stopped = {r["rollbacks"][0]["stopped_at"] for r in results}
    assert len(stopped) == 1, results  # every rank stopped at the same step
    assert all(r["rollbacks"][0]["to"] == 40 for r in results)
    # The proposal's rollback: reissued at a later step when a rank was already past the one it
    # named (a loaded machine's ranks can outrun the service's placement), then done by every rank.
    rollbacks = [
        d
        for d in scenario.rows("directives")
        if d["kind"] == "rollback" and json.loads(str(d["payload"]))["proposal"] == approved["proposal"]["id"]
    ]
    assert rollbacks[0]["id"] == approved["proposal"]["directive"]
    assert [d["status"] for d in rollbacks] == ["superseded"] * (len(rollbacks) - 1) + ["done"], rollbacks
    acks = scenario.rows("directive_acks")
    rollback_acks = [a for a in acks if a["directive_id"] == rollbacks[-1]["id"]]
    assert sorted(a["rank"] for a in rollback_acks) == list(range(WORLD)) and {
        a["status"] for a in rollback_acks
    } == {"done"}
    steps = scenario.rows("step_records")
    resumed = [s for s in steps if s["incarnation"] == results[0]["incarnation"]]
    assert min(s["step"] for s in resumed) == 41
    assert not any("r2-b44" in (s["sample_ids"] or "") for s in resumed)
    with scenario.engine.connect() as connection:
        incident = queries.get_incident(connection, second["incident"])
        assert audit.verify(connection).ok
    assert incident["status"] == "resolved"
    story = [e["action"] for e in incident["story"]]
    for action in (
        "incident_opened",
        "proposed",
        "replay_verdict",
        "approved",
        "directive",
        "acknowledged",
        "rollback_executed",
        "resume_verified",
        "incident_resolved",
    ):
        assert action in story, story
    verdict = next(e for e in incident["story"] if e["action"] == "resume_verified")
    assert verdict["details"]["verdict"] == "passed"


def test_a_faulty_device_is_found_by_its_canary_and_its_node_quarantined(scenario: Scenario) -> None:
    ranks = scenario.launch(
        "--faulty-rank",
        "2",
        "--training-flips",
        "0.02",
        # Canaries at every checkpoint (10, 20, 30, 40): rank 2's first mismatch and its re-run
        # come by update 27 and the hardware proposal follows them; 60 updates trained 20 more.
        "--steps",
        "40",
    )
    results = finish(ranks, scenario.root)
    assert all(not r["rollbacks"] for r in results)
    hardware = scenario.wait_proposal(lambda p: p["verdict"] == "hardware", timeout_s=30)
    assert hardware["quarantine"]["node"] == "node-2"
    canaries = scenario.rows("canary_results")
    assert {c["verdict"] for c in canaries if c["rank"] != 2} == {"ok"}
    assert "mismatch" in {c["verdict"] for c in canaries if c["rank"] == 2}
    with scenario.engine.connect() as connection:
        kinds = {
            i["kind"] for i in queries.list_incidents(connection, queries.IncidentFilter(run=scenario.run))
        }
    assert "canary" in kinds


def test_a_fault_without_a_reproducible_cause_stays_undetermined_and_quarantines_nothing(
    scenario: Scenario,
) -> None:
    replay = f"{sys.executable} -m monitor.demo.replay --task sequence {{spec}} {{result}}"
    ranks = scenario.launch(
        "--transient",
        "1:45",
        "--steps",
        "60",
        "--replay-command",
        replay,
    )
    proposal = scenario.wait_proposal(lambda p: p["status"] == "pending")
    replayed = scenario.cli("replay", str(proposal["incident"]), "--db", str(scenario.db))
    assert replayed["verdict"] == "undetermined" and "did not reproduce" in replayed["reason"]
    finish(ranks, scenario.root)
    latest = scenario.proposals()[-1]
    assert latest["verdict"] == "undetermined"
    assert latest["quarantine"] == {"node": None, "device": None} and latest["data_action"] == "replay"
    assert scenario.rows("actions") == []
