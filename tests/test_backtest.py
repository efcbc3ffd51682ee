"""Backtest over real public loss curves and over small files written here."""

import json
import math
from pathlib import Path

import polars as pl
import pytest

from monitor.judge.backtest import BacktestError, backtest, load_series, parse_mapping, report_json
from policies.series import SeriesConfig

CURVES = Path(__file__).parent / "data" / "real-curves"


def run_file(path: Path, mapping: dict[str, str] | None = None, run: str | None = None) -> dict:
    loaded = load_series(path, mapping or {}, run)
    return report_json(backtest(loaded, SeriesConfig()), loaded.notes, path)


def test_megatron_control_loads_every_logged_step_and_stays_quiet() -> None:
    report = run_file(CURVES / "megatron_gpt3_15b_release_h100.csv")
    assert report["steps"] == 10_173
    assert report["incidents"] == []
    assert "num_zeros" in report["notes"][0]


def test_pythia_control_with_five_restarts_stays_quiet() -> None:
    report = run_file(CURVES / "pythia410m_seed2_clean_with_restarts.csv")
    assert report["steps"] == 143_000
    assert report["incidents"] == []


def test_bigscience_file_splits_by_run_and_catches_the_nan_step() -> None:
    report = run_file(CURVES / "bigscience_chronicle_excerpts.csv")
    assert report["run"] == ["tr1-13B", "tr8-104B", "tr8b-104B", "tr11-176B"]
    assert all("run" in item for item in report["findings"] + report["incidents"])
    nonfinite = [i for i in report["incidents"] if i["kind"] == "nonfinite"]
    assert [(i["run"], i["first_step"]) for i in nonfinite] == [("tr8-104B", 9027)]


def test_run_option_selects_one_series(tmp_path: Path) -> None:
    report = run_file(CURVES / "bigscience_chronicle_excerpts.csv", run="tr11-176B")
    assert report["run"] == "tr11-176B"
    assert "run" not in (report["incidents"] or [{}])[0]
    with pytest.raises(BacktestError, match="no run 'nope'"):
        run_file(CURVES / "bigscience_chronicle_excerpts.csv", run="nope")


def spiky_rows(n: int = 120, spike_at: int = 100) -> list[dict]:
    rows = []
    for step in range(1, n + 1):
        loss = 3.0 - step * 0.001 + 0.01 * ((step * 7) % 5 - 2)
        rows.append({"step": step, "loss": 9.0 if step == spike_at else loss})
    return rows


def test_csv_and_jsonl_give_the_same_report(tmp_path: Path) -> None:
    rows = spiky_rows()
    pl.DataFrame(rows).write_csv(tmp_path / "s.csv")
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv, jsonl = run_file(tmp_path / "s.csv"), run_file(tmp_path / "s.jsonl")
    assert csv["incidents"] == jsonl["incidents"]
    assert [(i["kind"], i["first_step"]) for i in csv["incidents"]] == [("spike", 100)]


def test_empty_cell_is_not_logged_and_nan_is_a_nan(tmp_path: Path) -> None:
    path = tmp_path / "gaps.csv"
    lines = ["step,loss,grad_norm"] + [f"{s},2.0,1.0" for s in range(1, 10)]
    lines += ["10,,1.0", "11,nan,1.0", "12,2.0,"]
    path.write_text("\n".join(lines) + "\n")
    report = run_file(path)
    assert report["steps"] == 12
    (finding,) = report["findings"]
    assert (finding["step"], finding["signal"], finding["kind"]) == (11, "loss", "nonfinite")
    assert math.isnan(finding["value"])


def test_column_mapping_and_restarts_with_repeated_steps(tmp_path: Path) -> None:
    path = tmp_path / "mapped.csv"
    lines = ["iteration,lm_loss,segment_start,extra"]
    lines += [f"{s},{2.0 + 0.01 * (s % 3)},0,x" for s in range(1, 80)]
    lines += [f"{s},{2.0 + 0.01 * (s % 3)},{1 if s == 60 else 0},x" for s in range(60, 90)]
    path.write_text("\n".join(lines) + "\n")
    mapping = parse_mapping(["iteration=step", "lm_loss=loss", "segment_start=restart"])
    report = run_file(path, mapping)
    assert report["steps"] == 79 + 30  # the resumed incarnation repeats steps 60..79
    assert report["incidents"] == []
    assert report["notes"] == ["ignored columns: extra"]


def test_fields_under_other_tools_names_are_recognized_and_said(tmp_path: Path) -> None:
    path = tmp_path / "megatron-style.csv"
    lines = ["iteration,lm loss,Grad Norm,learning_rate,train/num_tokens"]
    lines += [f"{s},{3.0 + 0.01 * (s % 3)},{0.5 + 0.01 * (s % 2)},1e-4,{s * 4096}" for s in range(1, 120)]
    lines += ["120,9.0,0.5,1e-4,491520"]
    path.write_text("\n".join(lines) + "\n")
    report = run_file(path, {})
    assert report["steps"] == 120
    assert [(i["first_step"], i["kind"]) for i in report["incidents"]] == [(120, "spike")]
    assert "read column 'iteration' as step (--column iteration=FIELD to choose)" in report["notes"]
    assert "read column 'Grad Norm' as grad_norm (--column Grad Norm=FIELD to choose)" in report["notes"]
    assert "ignored columns: train/num_tokens" in report["notes"]  # cumulative, not per step


def test_an_ambiguous_name_is_left_to_the_user(tmp_path: Path) -> None:
    path = tmp_path / "two-losses.csv"
    path.write_text("step,train_loss,lm loss\n" + "".join(f"{s},2.0,2.1\n" for s in range(1, 10)))
    with pytest.raises(
        BacktestError, match=r"none of the signals.*several columns could be loss \(train_loss, lm loss\)"
    ):
        run_file(path, {})
    path.write_text("step,train_loss,lm loss\n" + "".join(f"{s},2.0,2.1\n" for s in range(1, 10)))
    report = run_file(path, parse_mapping(["train_loss=loss"]))
    assert report["steps"] == 9 and report["notes"] == ["ignored columns: lm loss"]


def test_ranks_are_folded_token_weighted(tmp_path: Path) -> None:
    rows = []
    for step in range(1, 71):
        rows.append({"step": step, "rank": 0, "loss": 2.0, "tokens": 4800})
        # rank 1 carries twice the tokens; at step 65 its loss explodes
        rows.append({"step": step, "rank": 1, "loss": 30.0 if step == 65 else 2.0, "tokens": 9600})
    pl.DataFrame(rows).write_csv(tmp_path / "ranks.csv")
    report = run_file(tmp_path / "ranks.csv")
    assert report["steps"] == 70
    (incident,) = report["incidents"]
    assert incident["first_step"] == 65
    (finding,) = report["findings"]
    assert finding["value"] == pytest.approx((2.0 * 4800 + 30.0 * 9600) / 14400)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("loss\n1.0\n", "no 'step' column"),
        ("step,loss\n1,abc\n", "column 'loss', row 1: 'abc'"),
        ("step,loss\n1,2.0\n,2.0\n", "column 'step', row 2"),
        ("step,loss\n1.5,2.0\n", "column 'step', row 1"),
        ("step,other\n1,2\n", "none of the signals"),
        ("step,skipped\n1,maybe\n", "column 'skipped', row 1"),
    ],
)
def test_bad_files_name_the_column_and_row(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(BacktestError, match=message):
        run_file(path)


def test_unreadable_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(BacktestError, match="no such file"):
        run_file(tmp_path / "missing.csv")
    (tmp_path / "x.parquet").write_bytes(b"x")
    with pytest.raises(BacktestError, match=r"expected a \.csv"):
        run_file(tmp_path / "x.parquet")
    with pytest.raises(BacktestError, match="SRC=FIELD"):
        parse_mapping(["lm_loss"])
    with pytest.raises(BacktestError, match="not a field"):
        parse_mapping(["lm_loss=lossy"])


def test_bare_nan_in_jsonl_as_python_writes_it_is_a_nan(tmp_path: Path) -> None:
    """``json.dumps(float("nan"))`` writes ``NaN``, which is not JSON: polars refused the file."""
    rows = [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in range(1, 11)]
    rows += [
        {"step": 11, "loss": float("nan"), "grad_norm": 1.0},
        {"step": 12, "loss": 2.0, "grad_norm": None},
    ]
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "NaN" in path.read_text()
    report = run_file(path)
    assert report["steps"] == 12
    (finding,) = report["findings"]
    assert (finding["step"], finding["signal"], finding["kind"]) == (11, "loss", "nonfinite")
    assert math.isnan(finding["value"])


def test_a_jsonl_line_that_is_not_json_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": \n')
    with pytest.raises(BacktestError, match="line 2"):
        run_file(path)
