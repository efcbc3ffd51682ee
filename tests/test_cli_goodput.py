"""``runhealth goodput RUN``: a run's records through the real ingest path into a real store
(SQLite and PostgreSQL), and the goodput and interval advice read back from it
(``monitor/cli/goodput.py``, ``monitor/judge/goodput.py``)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from sqlalchemy.engine import URL

from monitor.service import Service
from tests.support import RunHandle, both_backends, cli_result, post

FIRST, SECOND = "00000000-0000-4000-8000-00000000000a", "00000000-0000-4000-8000-00000000000b"


def window(incarnation: str, attempt: int, step: int, time: float, wait: float) -> dict[str, Any]:
    return {
        "kind": "step", "incarnation": incarnation, "rank": 0, "attempt": attempt, "step": step,
        "time": time, "tokens": 1024, "loss_sum": 2048.0, "microbatches": 2, "data_wait_s": wait,
    }  # fmt: skip


def checkpoint(incarnation: str, step: int, time: float, **timed: Any) -> dict[str, Any]:
    manifest = {"step": step, "files": [{"path": "model.pt", "size": 1, "sha256": "ab" * 32}]}
    return {
        "kind": "checkpoint", "incarnation": incarnation, "rank": 0, "step": step,
        "path": f"/ckpt/step-{step}", "time": time, "manifest": manifest, **timed,
    }  # fmt: skip


def canary(step: int, time: float, seconds: float) -> dict[str, Any]:
    return {
        "kind": "canary_result", "incarnation": FIRST, "rank": 0, "step": step, "time": time,
        "stack": {"device_name": "cpu"}, "stack_key": "cpu", "seconds": seconds,
        "kernels": {"gemm_fp32": {"fingerprint": "ab" * 32}},
    }  # fmt: skip


def crashed_and_restarted(service: Service, run: RunHandle) -> None:
    """Incarnation a: started at 1000, windows end 1010..1029 (1 s each, 0.2 s data wait), a save
    published 2 s after step 10's window and a 1 s canary after it (window 11 ends 3 s late), then
    silence: it crashed. Incarnation b starts at 1050 from the checkpoint at step 10 and runs
    steps 11-20 again (windows end 1055..1064); after step 15 it saves asynchronously, timed by
    the hook: staged in 0.5 s, published 4 s after it started (training went on), so its later
    windows end 0.5 s later."""
    records: list[dict[str, Any]] = [
        {"kind": "run_start", "incarnation": FIRST, "time": 1000.0, "world_size": 1, "layout": {"dp": 1}}
    ]
    for step in range(1, 21):
        late = 3.0 if step > 10 else 0.0
        records.append(window(FIRST, step, step, 1009.0 + step + late, 3.2 if step == 11 else 0.2))
    records += [checkpoint(FIRST, 10, 1021.0), canary(10, 1022.0, 1.0)]
    records.append({"kind": "run_start", "incarnation": SECOND, "time": 1050.0, "world_size": 1})
    for step in range(11, 21):
        late, wait = (0.5, 0.7 if step == 16 else 0.2) if step > 15 else (0.0, 0.2)
        records.append(window(SECOND, step - 10, step, 1044.0 + step + late, wait))
    timed = {"runhealth.save_s": 4.0, "runhealth.staging_s": 0.5}
    records.append(checkpoint(SECOND, 15, 1063.0, metrics=timed, tags=["async"]))
    post(service, run, records)


@both_backends
def test_goodput_by_cause_and_the_interval_advice_from_a_real_store(
    service: Service, run: RunHandle, store_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed_and_restarted(service, run)
    db = store_url.render_as_string(hide_password=False)
    code, out, err = cli_result(capsys, "goodput", run.name, "--db", db, "--json")
    assert code == 0, err
    report = json.loads(out)
    seconds = {c["cause"]: c["seconds"] for c in report["categories"]}
    assert report["wall_s"] == pytest.approx(1064.5 - 1000.0)
    assert math.fsum(seconds.values()) == pytest.approx(report["wall_s"])
    # 2 s from step 10's window to the save's publication; the asynchronous save's staging 0.5 s.
    assert seconds["checkpoint_save"] == pytest.approx(2.0 + 0.5)
    assert seconds["canary"] == pytest.approx(1.0)
    # Steps 11-20 of incarnation a were run again by b: 10 windows' compute of 0.8 s.
    assert seconds["redone_restart"] == pytest.approx(8.0)
    assert seconds["redone_rollback"] == 0
    assert seconds["down"] == pytest.approx(1050.0 - 1032.0)
    assert report["interruptions"] == 1 and report["incarnations"] == 2
    interval = report["interval"]
    assert interval["mtbi_source"] == "fleet" and interval["save_cost_s"] == pytest.approx(1.25)
    assert interval["advised"]["interval_s"] == pytest.approx(math.sqrt(2 * 1.25 * interval["mtbi_s"]))
    assert any(line.startswith("T_opt = sqrt(2 x C x M)") for line in interval["arithmetic"])

    code, out, _ = cli_result(capsys, "goodput", run.name, "--db", db)
    assert code == 0
    assert "work redone after restarts" in out and "T_opt = sqrt(2 x C x M)" in out


def test_an_unknown_run_is_one_line_and_exit_2(
    service: Service, store_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli_result(capsys, "goodput", "nope", "--db", store_url.render_as_string())
    assert code == 2 and out == "" and err.strip() == "runhealth: error: no run named 'nope'"
