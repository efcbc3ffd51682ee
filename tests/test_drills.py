"""The four restart drills end to end: ``runhealth drill`` against the example trainer
(``monitor/demo/drill_trainer.py``), which passes every check, and its broken variant
(``--broken``: the resume restarts the scheduler and drops the optimizer state), which fails
exactly the checks that see it. Both run side by side, each a real ``runhealth drill`` process
starting real trainer processes (gloo on the CPU for several ranks), recording into one store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL, Engine

from monitor.drills.reports import list_reports

TRAINER = "python -m monitor.demo.drill_trainer"
BROKEN = f"{TRAINER} --broken"
TIMEOUT_S = 600


def drill_both(
    tmp_path: Path, store_url: URL, drill: str, trainer_args: str = "", *args: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``runhealth drill DRILL`` on the good and the broken trainer at once; their reports."""
    documents = drill_reports(
        tmp_path, store_url, drill, {"good": TRAINER, "broken": BROKEN}, trainer_args, *args
    )
    return documents["good"], documents["broken"]


def drill_reports(
    tmp_path: Path, store_url: URL, drill: str, trainers: dict[str, str], trainer_args: str = "", *args: str
) -> dict[str, dict[str, Any]]:
    """``runhealth drill DRILL`` on each of ``trainers`` (name: command) at once; their reports."""
    db = store_url.render_as_string(hide_password=False)
    processes = {}
    for name, command in trainers.items():
        argv = [
            sys.executable,
            "-m",
            "monitor",
            "drill",
            drill,
            "--command",
            f"{command} {trainer_args}".strip(),
        ]
        argv += ["--run", f"drill-{name}", "--db", db, "--workdir", str(tmp_path / name), "--json", *args]
        processes[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    documents = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=TIMEOUT_S)
        assert process.returncode in (0, 1), err[-2000:]
        document = json.loads(out)
        assert (process.returncode == 0) == (document["verdict"] == "pass")
        documents[name] = document["drills"][0]
    return documents


def outcomes(report: dict[str, Any]) -> dict[str, bool]:
    return {check["name"]: check["passed"] for check in report["checks"]}


def detail(report: dict[str, Any], name: str) -> str:
    return next(str(check["detail"]) for check in report["checks"] if check["name"] == name)


def measured(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(dict(check["measured"]) for check in report["checks"] if check["name"] == name)


def test_continuity_passes_the_example_and_fails_the_broken_resume(
    store: Engine, store_url: URL, tmp_path: Path
) -> None:
    good, broken = drill_both(tmp_path, store_url, "continuity")
    assert good["verdict"] == "pass", good
    assert outcomes(good) == dict.fromkeys(
        ("weights", "adam_moments", "learning_rate", "next_sample_ids", "next_update"), True
    )
    assert measured(good, "weights")["max_abs_diff"] <= 1e-6
    # the broken resume keeps the weights and the data cursor only
    assert outcomes(broken) == {
        "weights": False,
        "adam_moments": False,
        "learning_rate": False,
        "next_sample_ids": True,
        "next_update": False,
    }, broken
    differing = measured(broken, "adam_moments")["differing"]  # fresh moments and step counts
    assert {name.rsplit(".", 1)[1] for name in differing} == {"exp_avg", "exp_avg_sq", "step"}
    assert measured(broken, "learning_rate")["resumed"] != measured(broken, "learning_rate")["reference"]
    with store.connect() as connection:
        recorded = list_reports(connection, "drill-broken")
    assert [(r["drill"], r["verdict"]) for r in recorded] == [("continuity", "fail")]
    assert {c["name"] for c in recorded[0]["checks"] if not c["passed"]} == {
        "weights",
        "adam_moments",
        "learning_rate",
        "next_update",
    }


def test_topology_2_to_4_ranks_passes_the_example_and_fails_the_broken_resume(
    store: Engine, store_url: URL, tmp_path: Path
) -> None:
    good, broken = drill_both(tmp_path, store_url, "topology")
    assert good["verdict"] == "pass", good
    assert "(2 ranks -> 4)" in detail(good, "resharded_model")
    assert measured(good, "data_partition")["per_rank"] == {"0": 24, "1": 24, "2": 24, "3": 24}
    peaks = measured(good, "peak_restore_memory")["peak_mib"]
    assert sorted(peaks) == ["0", "1", "2", "3"] and all(50 < mib < 4096 for mib in peaks.values())
    assert outcomes(broken) == {
        "resharded_model": True,
        "resharded_optimizer": False,
        "learning_rate": False,
        "data_partition": True,
        "peak_restore_memory": True,
    }, broken


def test_preemption_with_a_warning_that_fits_and_one_that_does_not(
    store: Engine, store_url: URL, tmp_path: Path
) -> None:
    # 0.1 s per microbatch: a window long enough for a SIGTERM to land inside it
    good, broken = drill_both(tmp_path, store_url, "preemption", "--microbatch-seconds 0.1", "--steps", "3")
    for report in (good, broken):  # the broken resume loses optimizer state, not checkpoints
        assert report["verdict"] == "pass", report
        assert list(outcomes(report)) == ["sigterm_fits_warning", "sigterm_short_warning", "interrupted_save"]
        fits = measured(report, "sigterm_fits_warning")
        assert fits["published_step"] > fits["durable_step"]  # saved at the boundary after the signal
        assert fits["consumed"] == fits["step"] * fits["examples_per_update"]
        assert fits["warning_s"] > 5  # T_window + T_save + the default 5 s margin
        short = measured(report, "sigterm_short_warning")
        assert short["warning_s"] < fits["warning_s"]
        assert short["consumed"] == short["step"] * short["examples_per_update"]
        interrupted = measured(report, "interrupted_save")
        assert interrupted["selected_step"] == interrupted["durable_step"]


def test_diagnostics_names_the_nonfinite_batch_and_the_straggler(
    store: Engine, store_url: URL, tmp_path: Path
) -> None:
    """The example trainer alone: nothing in this drill resumes, so the broken variant (which
    differs only in its resume) ran the same checks to the same verdicts, at twice the cost."""
    # 3 ms of compute per microbatch: the forward phase the straggler rule judges is over its 2 ms floor
    (report,) = drill_reports(
        tmp_path, store_url, "diagnostics", {"good": TRAINER}, "--microbatch-seconds 0.003"
    ).values()
    assert report["verdict"] == "pass", report
    assert measured(report, "nonfinite_named")["first_step"] == 45
    assert measured(report, "straggler_named")["ranks"] == [2]
    assert measured(report, "unsafe_state_not_a_target")["target_step"] < 45
    assert measured(report, "configured_recovery")["action"] == "rollback"
    assert measured(report, "configured_recovery")["retry"] == "rollback 1 of 2 for this incident"
