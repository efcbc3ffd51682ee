"""The restart-loop guard: the rule at its boundaries (``policies/restart_loop.py``), and real
short trainings of the nanoGPT-style test trainer that crash before their first checkpoint,
against a real ``runhealth serve``: after the third such start the run has a ``restart_loop``
incident and ``runhealth gate`` exits 93; a start that commits a checkpoint ends it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from policies.restart_loop import Life, RestartLoopConfig, restart_loop
from policies.types import Severity
from tests.collectors_support import ServeProcess, child_environ, wait_until
from tests.test_attach_recipes import TARGETS, job, token_files

CONFIG = RestartLoopConfig()


def life(n: int, *, ended: bool = True, checkpoint: int | None = None) -> Life:
    return Life(f"inc-{n}", float(n), ended, checkpoint, last_step=5)


def test_three_failed_starts_without_a_checkpoint_are_a_loop_and_two_are_not() -> None:
    assert restart_loop([life(1), life(2)], CONFIG) is None
    finding = restart_loop([life(1), life(2), life(3)], CONFIG)
    assert finding is not None and finding.kind == "restart_loop" and finding.severity is Severity.CRITICAL
    assert finding.evidence["incarnations"] == ["inc-1", "inc-2", "inc-3"]
    assert finding.incarnation == "inc-3" and "to a first checkpoint" in finding.message


def test_a_start_that_commits_a_checkpoint_past_the_newest_ends_the_streak() -> None:
    lives = [life(1, checkpoint=100), life(2), life(3), life(4, checkpoint=200), life(5), life(6)]
    assert restart_loop(lives, CONFIG) is None
    finding = restart_loop([*lives, life(7)], CONFIG)
    assert (
        finding is not None and finding.step == 200 and "past the checkpoint at step 200" in finding.message
    )


def test_a_checkpoint_saved_again_at_the_same_step_is_no_progress() -> None:
    lives = [life(1, ended=False, checkpoint=100), life(2, checkpoint=100), life(3, checkpoint=50), life(4)]
    finding = restart_loop(lives, CONFIG)
    assert finding is not None and finding.evidence["incarnations"] == ["inc-2", "inc-3", "inc-4"]


def test_a_running_or_completed_start_is_not_counted() -> None:
    assert restart_loop([life(1), life(2), life(3, ended=False)], CONFIG) is None
    assert restart_loop([life(1), life(2), life(3, ended=False), life(4)], CONFIG) is not None


def test_the_bound_is_configurable_and_validated() -> None:
    assert restart_loop([life(1)], RestartLoopConfig(max_unproductive=1)) is not None
    with pytest.raises(ValueError, match="max_unproductive"):
        RestartLoopConfig(max_unproductive=0)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[ServeProcess]:
    process = ServeProcess(tmp_path / "serve", tmp_path / "serve" / "store.db")
    process.root.mkdir()
    process.start()
    try:
        yield process
    finally:
        process.stop()


def gate(serve: ServeProcess, run: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "monitor", "gate", run, "--db", str(serve.db), "--json"],
        capture_output=True, text=True, env=child_environ(), timeout=120, check=False,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout)


@pytest.mark.slow
def test_a_job_that_crashes_before_its_first_checkpoint_three_times_must_not_be_requeued(
    tmp_path: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    workdir = tmp_path / "job"
    workdir.mkdir()
    token_files(workdir)
    run, token = "crashing", serve.create_run("crashing")
    for start in range(3):
        crashing = job(workdir, serve, run, request, token, **TARGETS)
        crashing.python("nanogpt_hooked.py", "--crash_at=5", "--max_iters=100")
        assert crashing.process is not None and crashing.process.wait(120) != 0
        status, said = gate(serve, run)
        assert status == (93 if start == 2 else 0), said
    assert said["reasons"][0]["kind"] == "restart_loop" and not said["ok"]
    (incident,) = [i for i in crashing.rows("incidents") if i["kind"] == "restart_loop"]
    assert incident["severity"] == "critical" and incident["status"] == "open"
    assert [p["action"] for p in crashing.rows("proposals") if p["incident_id"] == incident["id"]] in (
        [],
        ["none"],
    )

    # A start that gets past iteration 10 commits the checkpoint there: the loop is over.
    fixed = job(workdir, serve, run, request, token, **TARGETS)
    fixed.python("nanogpt_hooked.py", "--max_iters=15", "--eval_interval=10")
    fixed.wait()
    assert wait_until(lambda: gate(serve, run)[0] == 0, 30, 0.5)
    (incident,) = [i for i in fixed.rows("incidents") if i["kind"] == "restart_loop"]
    assert incident["status"] == "resolved"
