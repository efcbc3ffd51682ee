"""The main job: four ranks train a small model; a bad batch and a failing device are caught,
diagnosed and recovered from through the real CLI."""

import json
from pathlib import Path

import pytest

from monitor.cli import main

pytestmark = pytest.mark.slow


def test_the_demo_recovers_from_a_bad_batch_and_flags_the_failing_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--db", str(tmp_path / "demo.db"), "--json"])
    assert exit_info.value.code in (0, None)
    result = json.loads(capsys.readouterr().out)
    spikes = [i for i in result["incidents"] if i["kind"] == "spike"]
    assert [(i["first_step"], i["ranks"], i["status"]) for i in spikes] == [(150, [1], "resolved")]
    assert result["recovered_incident"] == "resolved" and len(result["stopped_at"]) == 1
    for action in (
        "proposed",
        "replay_verdict",
        "approved",
        "directive",
        "rollback_executed",
        "resume_verified",
    ):
        assert action in result["story"]
    data = next(p for p in result["proposals"] if p["verdict"] == "data")
    assert data["status"] == "done" and data["skip_batches"] == ["r1-b149"] and data["target"]["step"] == 125
    assert data["decided_by"].startswith("local:")  # approved at the CLI through the discovery file
    # The canary's proposal may be re-issued once: when the checkpoint the canary ran at lands
    # its manifest after the first proposal, that newer target supersedes it (seen at load 5-10).
    hardware = [p for p in result["proposals"] if p["verdict"] == "hardware"]
    live = [p for p in hardware if p["status"] != "superseded"]
    assert len(live) == 1 and len(hardware) <= 2, hardware
    assert live[0]["quarantine"]["node"] == "node-2" and live[0]["status"] == "pending"
    assert all(p["quarantine"]["node"] == "node-2" for p in hardware)
    assert result["audit_ok"]
    # About a minute on this machine (README); the bound leaves room for a loaded one (two busy
    # processes beside the suite) and still catches a demo that waits something out, as a hold
    # that nothing released would (its timeout is 600 s).
    assert result["seconds"] < 300
    outage = result["outage"]  # the service was killed mid-run and came back
    assert outage["killed_at_step"] >= 75 and outage["spooled"] > 0
    assert outage["replayed"] == outage["spooled"]
    assert outage["lost"] == outage["unexpected"] == 0 and outage["stored"] == outage["windows"] > 4 * 150
    hold = result["hold"]  # the spike's proposal held every rank until it was approved
    assert hold["released"] == "approved" and hold["at_step"] >= 150
    assert result["stopped_at"] == [hold["at_step"]]  # the held ranks stopped where they held
    assert result["story"].index("hold") < result["story"].index("hold_released")
    relay = result["relay"]  # the four ranks share one machine: its relay sends their batches together
    assert relay["batches"] > relay["requests"] > 0, relay
    readers = result["readers"]  # rank 0's, which reads for the node: what it samples, or why not
    assert set(readers) == {"nvml", "links"}
    assert all(line.startswith(("sampling ", "idle: ")) for line in readers.values()), readers
    # where the run's time went: the hold, the work redone after the rollback and the canary
    # rounds are badput in their own categories, and the interval advice has its arithmetic
    shares = {c["cause"]: c["seconds"] for c in result["goodput"]["categories"]}
    assert 0 < result["goodput"]["goodput_ratio"] < 1
    assert min(shares["hold"], shares["redone_rollback"], shares["canary"]) > 0, shares
    assert result["goodput"]["interval"]["arithmetic"]


def test_the_demo_rejects_a_corrupt_step_inside_warm_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--corrupt-step", "10"])
    assert exit_info.value.code == 2
    assert "corrupt-step" in capsys.readouterr().err
