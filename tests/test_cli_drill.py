"""``runhealth drill`` and ``runhealth drills RUN`` against a real store (SQLite and
PostgreSQL): reports recorded and listed, bad input one line and exit 2. The drills
themselves against real trainers: tests/test_drills.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import URL, Engine

from monitor.drills.reports import DrillResult, list_reports, record
from policies.drills import Check
from tests.support import both_backends, cli_result


def result(drill: str, *checks: Check) -> DrillResult:
    now = time.time()
    return DrillResult(drill, checks, now - 12.0, now, "/tmp/drills")


@both_backends
def test_reports_are_recorded_and_listed_by_run(
    store: Engine, store_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = Check("adam_moments", False, "12 of 18 optimizer values differ", {"max_abs_diff": 0.046})
    with store.begin() as connection:
        first = record(
            connection,
            "sft-v4",
            result("continuity", Check("weights", True, "6 match"), failed),
            "python t.py",
            {"atol": 1e-6},
            "cli:me",
        )
        record(
            connection,
            "other",
            result("topology", Check("resharded_model", True, "ok")),
            "python t.py",
            {},
            "cli:me",
        )
    with store.connect() as connection:
        reports = list_reports(connection, "sft-v4")
    assert [r["id"] for r in reports] == [first]
    assert reports[0]["verdict"] == "fail" and reports[0]["checks"][1]["measured"] == {"max_abs_diff": 0.046}

    db = store_url.render_as_string(hide_password=False)
    code, out, err = cli_result(capsys, "drills", "sft-v4", "--db", db, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [(r["drill"], r["verdict"], r["created_by"]) for r in listed] == [("continuity", "fail", "cli:me")]
    code, out, _ = cli_result(capsys, "drills", "sft-v4", "--db", db)
    assert code == 0 and "continuity" in out and "1/2" in out and "adam_moments" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuch", "--command", "python t.py", "--run", "r"], "no drill 'nosuch'"),
        (["continuity", "--run", "r"], "--command is required"),
        (["continuity", "--command", "python t.py"], "--run is required"),
        (["continuity", "--command", "python t.py --n {step}", "--run", "r"], "unknown fields ['step']"),
        (
            ["continuity", "--command", "python t.py", "--run", "r", "--steps", "0"],
            "--steps and --resume-steps must be >= 1",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    store: Engine,
    store_url: URL,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    db = store_url.render_as_string(hide_password=False)
    code, out, err = cli_result(capsys, "drill", *args, "--db", db, "--workdir", str(tmp_path / "w"))
    assert code == 2, (out, err)
    assert err.startswith("runhealth: error: ") and message in err and len(err.strip().splitlines()) == 1
    with store.connect() as connection:
        assert list_reports(connection, "r") == []  # nothing recorded


def test_a_missing_store_is_refused_before_any_drill_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli_result(
        capsys, "drill", "continuity", "--command", "python t.py", "--run", "r",
        "--db", str(tmp_path / "none.db"), "--workdir", str(tmp_path / "w"),
    )  # fmt: skip
    assert code == 2 and "no store at" in err
    assert not (tmp_path / "w").exists()


def test_a_trainer_that_crashes_fails_the_drill_and_is_recorded(
    store: Engine, store_url: URL, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loader that crashes is what a drill is for: a failed check with the run's output, exit 1."""
    db = store_url.render_as_string(hide_password=False)
    crash = "python -c 'import sys; print(\"loader: KeyError optimizer\"); sys.exit(3)'"
    code, out, err = cli_result(
        capsys, "drill", "continuity", "--command", crash, "--run", "r", "--db", db,
        "--workdir", str(tmp_path / "w"), "--json",
    )  # fmt: skip
    assert code == 1, err
    report = json.loads(out)
    assert report["verdict"] == "fail"
    [check] = report["drills"][0]["checks"]
    assert check["name"] == "trainer_runs" and not check["passed"]
    assert "exited 3" in check["detail"] and "loader: KeyError optimizer" in check["detail"]
    with store.connect() as connection:
        [recorded] = list_reports(connection, "r")
    assert recorded["verdict"] == "fail" and recorded["checks"][0]["name"] == "trainer_runs"
