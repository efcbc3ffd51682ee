"""The main job: a real small training on the CPU, one corrupted batch, caught."""

import json
from pathlib import Path

import pytest

from monitor.cli import main


def test_demo_catches_the_corrupted_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "demo.db"
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--db", str(db), "--json"])
    assert exit_info.value.code in (0, None)
    result = json.loads(capsys.readouterr().out)
    assert result["caught"] is True
    spikes = [i for i in result["incidents"] if i["kind"] == "spike"]
    assert [i["first_step"] for i in spikes] == [result["corrupt_step"]]
    # nothing else in a healthy run: no incident before the corrupted step
    assert all(i["first_step"] >= result["corrupt_step"] for i in result["incidents"])
    assert result["seconds"] < 120


def test_demo_rejects_a_corrupt_step_inside_warm_up(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--corrupt-step", "10"])
    assert exit_info.value.code == 2
    assert "corrupt-step" in capsys.readouterr().err
