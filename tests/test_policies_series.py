"""The run-level series rules together (``policies/series.py``: spikes, level shifts and the
resume continuity checks), on loss files through the backtest: a restart is judged against the
timeline it returned to, and a change that begins at a restart is named a broken resume."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from monitor.judge.backtest import backtest, load_series, report_json
from policies.continuity import ContinuityConfig
from policies.series import SeriesConfig


def loss_at(step: float, rng: random.Random) -> float:
    """A pretraining curve: about 10 untrained (ln of a 22k vocabulary), 2 once trained."""
    return 2.0 + 8.0 * math.exp(-step / 100) + rng.gauss(0, 0.02)


def incidents(
    tmp_path: Path, rows: list[tuple[int, float, int]], config: SeriesConfig | None = None
) -> list[tuple[str, int]]:
    path = tmp_path / "series.csv"
    path.write_text("step,loss,restart\n" + "".join(f"{s},{loss:.5f},{r}\n" for s, loss, r in rows))
    loaded = load_series(path, {}, None)
    report = report_json(backtest(loaded, config or SeriesConfig()), loaded.notes, path)
    return [(i["kind"], i["first_step"]) for i in report["incidents"]]


def test_a_restart_whose_jump_comes_one_row_later_is_a_broken_resume_at_the_restart(tmp_path: Path) -> None:
    rng = random.Random(0)
    rows = [(s, loss_at(s, rng), 0) for s in range(1, 400)]
    rows.append((400, loss_at(400, rng), 1))  # the restart's first row: still the trained level
    rows += [(s, loss_at(s - 401, rng), 0) for s in range(401, 700)]  # then untrained, relearning
    assert incidents(tmp_path, rows) == [("broken_resume", 400)]


def test_a_restart_onto_an_earlier_step_is_judged_against_the_timeline_it_returned_to(
    tmp_path: Path,
) -> None:
    """The job crashed at 600, lost 200 steps and resumed at 400 with fresh weights: the
    abandoned steps are logged again by the new timeline."""
    rng = random.Random(1)
    rows = [(s, loss_at(s, rng), 0) for s in range(1, 601)]
    rows += [(s, loss_at(s - 400, rng), 0) for s in range(400, 800)]
    assert incidents(tmp_path, rows) == [("broken_resume", 400)]


def test_a_level_shift_not_at_a_restart_is_still_a_level_shift(tmp_path: Path) -> None:
    rng = random.Random(2)
    rows = [(s, loss_at(s, rng) + (0.5 if s >= 500 else 0.0), 1 if s == 300 else 0) for s in range(1, 800)]
    assert incidents(tmp_path, rows) == [("level_shift", 500)]


def test_a_level_shift_that_begins_at_a_restart_is_a_broken_resume(tmp_path: Path) -> None:
    """Not back toward the untrained level (6% of the way), but a new level from the restart on."""
    rng = random.Random(3)
    rows = [(s, loss_at(s, rng) + (0.5 if s > 500 else 0.0), 1 if s == 500 else 0) for s in range(1, 800)]
    assert incidents(tmp_path, rows) == [("broken_resume", 500)]


def test_a_clean_restart_raises_nothing(tmp_path: Path) -> None:
    rng = random.Random(4)
    rows = [(s, loss_at(s, rng), 1 if s == 500 else 0) for s in range(1, 800)]
    assert incidents(tmp_path, rows) == []


@pytest.mark.parametrize(("moved", "named"), [(1.02, False), (1.08, True), (0.92, True)])
def test_a_replay_of_logged_steps_away_from_what_the_run_had_there_is_a_broken_resume(
    tmp_path: Path, moved: float, named: bool
) -> None:
    """Resumed at 400 after training to 600 (a crash, an older checkpoint): the replayed steps
    should log what the run logged at them; 8% above or below, they did not resume from that
    state (as in birdjepa's resume jumps); 2% is under the rule's 3% floor. ``replay_shift`` 0
    turns the rule off."""
    rng = random.Random(5)
    rows = [(s, loss_at(s, rng), 0) for s in range(1, 601)]
    rows += [(s, loss_at(s, rng) * moved, 0) for s in range(400, 800)]
    assert incidents(tmp_path, rows) == ([("broken_resume", 400)] if named else [])
    off = SeriesConfig(continuity=ContinuityConfig(replay_shift=0.0))
    assert incidents(tmp_path, rows, off) == []
