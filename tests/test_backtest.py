"""Backtest over real public loss curves and over small files written here."""

import json
import math
import os
import random
import re
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from monitor.judge import series_files
from monitor.judge.backtest import (
    BacktestError,
    backtest,
    backtest_file,
    load_series,
    normalize,
    parse_mapping,
    report_json,
    series_points,
)
from policies.backtest import backtest_series
from policies.series import SeriesConfig
from policies.types import StepPoint

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


def test_jsonl_read_in_batches_has_the_keys_of_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key first seen in a later batch is a column of every batch (empty before it)."""
    monkeypatch.setattr(series_files, "BATCH_ROWS", 7)
    rows = [
        {**row, "grad_norm": 9.0 if row["step"] == 110 else 1.0} if row["step"] > 50 else row
        for row in spiky_rows()
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pl.DataFrame([{"grad_norm": None, **row} for row in rows]).select("step", "loss", "grad_norm").write_csv(
        tmp_path / "s.csv"
    )
    jsonl, csv = run_file(tmp_path / "s.jsonl"), run_file(tmp_path / "s.csv")
    assert {**jsonl, "file": ""} == {**csv, "file": ""}
    assert [(f["step"], f["signal"]) for f in jsonl["findings"]] == [(100, "loss"), (110, "grad_norm")]


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


def test_a_file_judged_without_a_loss_says_which_columns_could_be_one(tmp_path: Path) -> None:
    """birdjepa's per-step export (``step,loss_pr,loss_ce,grad_norm``): only the grad norm was
    judged, and the report said nothing but "ignored columns" while every loss jump went unseen."""
    path = tmp_path / "export.csv"
    loss = [2.9 + 0.01 * (s % 3) for s in range(1, 120)] + [8.9]
    table = {"step": range(1, 121), "loss_pr": [v + 0.1 for v in loss], "loss_ce": loss}
    pl.DataFrame({**table, "val_loss": [3.1] * 120, "grad_norm": [0.5] * 120}).write_csv(path)
    report = run_file(path, {})
    assert report["incidents"] == []  # the grad norm alone is judged, as asked
    assert "no column is read as loss; loss_pr, loss_ce could be one (--column SRC=loss)" in report["notes"]
    mapped = run_file(path, parse_mapping(["loss_ce=loss"]))
    assert [(i["first_step"], i["kind"]) for i in mapped["incidents"]] == [(120, "spike")]
    assert not any(note.startswith("no column is read as loss") for note in mapped["notes"])


def test_a_hugging_face_trainer_state_is_read_from_its_log_history(tmp_path: Path) -> None:
    """``trainer_state.json``, the one per-step record the Hugging Face Trainer keeps, was refused
    (".json" is no suffix it read). Its ``log_history`` holds training entries, evaluation entries
    and a closing summary whose ``train_loss`` is the run's mean: only the training entries are rows."""
    loss = [1.2 - 0.001 * s + 0.01 * (s % 3) for s in range(1, 121)]
    loss[99] = 4.0  # step 100 of 120
    history: list[dict[str, object]] = []
    for step, value in enumerate(loss, 1):
        history.append(
            {"epoch": step / 40, "grad_norm": 0.8, "learning_rate": 2e-5, "loss": value, "step": step}
        )
        if step % 40 == 0:
            history.append({"epoch": step / 40, "eval_loss": 1.5, "eval_runtime": 9.1, "step": step})
    history.append({"epoch": 3.0, "step": 120, "train_loss": 1.1, "train_runtime": 600.0, "total_flos": 1e15})
    state = {"global_step": 120, "log_history": history, "logging_steps": 1, "max_steps": 120}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state, indent=2))
    pl.DataFrame({"step": range(1, 121), "loss": loss, "grad_norm": [0.8] * 120}).write_csv(
        tmp_path / "s.csv"
    )
    report, table = run_file(tmp_path / "trainer_state.json", {}), run_file(tmp_path / "s.csv", {})
    assert report["steps"] == 120
    assert [(i["first_step"], i["kind"]) for i in report["incidents"]] == [(100, "spike")]
    assert report["incidents"] == table["incidents"]
    assert "read column 'learning_rate' as lr (--column learning_rate=FIELD to choose)" in report["notes"]
    (tmp_path / "other.json").write_text(json.dumps({"step": 1, "loss": 2.0}))
    with pytest.raises(BacktestError, match="no log_history"):
        run_file(tmp_path / "other.json", {})


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
        (
            "Wall time,Step,Value\n1.7e9,1,2.5\n",
            r"map one of its columns \(Wall time, Value\) with --column SRC=loss",
        ),
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


def test_a_ragged_row_is_one_line_naming_its_line(tmp_path: Path) -> None:
    """polars says "found more fields than defined in 'Schema'" and a hint, on three lines."""
    path = tmp_path / "ragged.csv"
    path.write_text("step,loss\n1,2.0\n2,2.0,5\n3,2.0\n")
    with pytest.raises(BacktestError) as raised:
        run_file(path)
    assert str(raised.value) == f"cannot read {path}: line 3 has 3 fields, the header 2"


@pytest.mark.parametrize("kind", ["directory", "mode 000", "read error"])
def test_an_unreadable_file_is_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.csv"
    if kind == "directory":
        path.mkdir()
        expected = "it is a directory, and no TensorBoard event file (*tfevents*) is under it"
    elif kind == "mode 000":
        if os.geteuid() == 0:
            pytest.skip("root reads a file of mode 000 (tests/test_cli.py simulates the refusal)")
        path.write_text("step,loss\n1,2.0\n")
        path.chmod(0)
        expected = "Permission denied"
    else:
        if not Path("/proc/self/mem").exists():
            pytest.skip("no /proc/self/mem")
        path.symlink_to("/proc/self/mem")  # opens, then every read fails
        expected = "Input/output error"
    with pytest.raises(BacktestError) as raised:
        run_file(path)
    assert str(raised.value) == f"cannot read {path}: {expected}"


@pytest.mark.parametrize(
    ("suffix", "content", "message"),
    [
        (".csv", bytes(3 << 20), "a NUL byte at line 1 (byte 0): not a text file"),
        (".csv", b"step,loss\n1,2.0\n" + bytes(100), "a NUL byte at line 3 (byte 16): not a text file"),
        (".jsonl", b'{"step": 1, "loss": 2.0}\n\0', "a NUL byte at line 2 (byte 25): not a text file"),
        (".csv", b"step,loss\n1," + b"9" * (2 << 20) + b"\n", "line 2 is longer than 1 MiB: not a log"),
        (".csv", b"step,loss\n1,2.0\n\xff\xfe,3\n", "invalid utf-8 sequence"),
        (".jsonl", b'{"step": 1, "loss": 2.0}\n\xff\xfe\n', "not UTF-8 text (invalid start byte)"),
        (".csv", b"", "empty CSV"),
    ],
    ids=[
        "NUL bytes",
        "NUL bytes after rows",
        "NUL in JSONL",
        "overlong line",
        "not UTF-8",
        "JSONL not UTF-8",
        "empty",
    ],
)
def test_a_file_that_is_not_text_is_one_line(
    tmp_path: Path, suffix: str, content: bytes, message: str
) -> None:
    path = (tmp_path / "bad").with_suffix(suffix)
    path.write_bytes(content)
    with pytest.raises(BacktestError) as raised:
        run_file(path)
    assert str(raised.value) == f"cannot read {path}: {message}"


def test_two_gigabytes_of_nul_bytes_are_refused_from_the_first_megabyte(tmp_path: Path) -> None:
    """The issue's 2 GB NUL file ran 75 s to 8.2 GB: polars held it as one line. A sparse file
    costs no disk; the refusal reads one chunk."""
    path = tmp_path / "zeros.csv"
    with path.open("wb") as zeros:
        zeros.truncate(2 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(BacktestError, match="a NUL byte at line 1"):
            run_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("block_bytes", [1, 2, 3, 5, 8, 13, 21, 34])
def test_a_csv_read_in_blocks_is_read_as_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int
) -> None:
    """Blocks are cut at record ends (a line break outside quotes) and each is read after the
    header: quoted line breaks, blank lines, CRLF, a byte-order mark, no final line break."""
    monkeypatch.setattr(series_files, "BLOCK_BYTES", block_bytes)
    texts = [
        'step,loss,note\n1,2.0,"a,b\nc"\n\n2,,"x ""q"" y"\n3\n4,nan,\n',
        "\ufeffstep,loss\r\n\r\n1,2.0\r\n2,3.0\r\n\r\n",
        'step,"lo\nss"\n1,2\n"2",3',
        "step,loss\n",
        "step,loss",
    ]
    for number, text in enumerate(texts):
        path = tmp_path / f"{number}.csv"
        path.write_text(text, newline="")
        whole = pl.read_csv(path, infer_schema=False)
        text_file = series_files.open_text_file(path)
        blocks = list(text_file.batches(text_file.columns))
        assert text_file.columns == tuple(whole.columns)
        assert [row for block in blocks for row in block.rows()] == whole.rows(), text


def whole_file_series(path: Path) -> tuple[list[tuple[str | None, tuple[StepPoint, ...]]], list[str]]:
    """The reading before streaming: the whole file in one frame, then each incarnation's
    windows held until it ends."""
    table, notes = normalize(pl.read_csv(path, infer_schema=False), {})
    has_skipped = "skipped" in table.columns
    if "run" not in table.columns:
        return [(None, tuple(series_points(list(table.iter_rows(named=True)), has_skipped)))], notes
    names = list(dict.fromkeys(table["run"].drop_nulls().to_list()))
    groups = [(name, table.filter(pl.col("run") == name)) for name in names]
    return [
        (name, tuple(series_points(list(g.iter_rows(named=True)), has_skipped))) for name, g in groups
    ], notes


REAL_CURVES = sorted(str(p.relative_to(CURVES)) for p in CURVES.glob("**/*.csv") if p.name != "labels.csv")
"""Every real curve, the held-out ones under ``heldout/`` included."""


def test_the_data_readme_describes_every_real_curve() -> None:
    readme = (CURVES / "README.md").read_text()
    assert sorted(re.findall(r"^## (\S+\.csv)$", readme, re.MULTILINE)) == REAL_CURVES


@pytest.mark.parametrize("name", REAL_CURVES)
def test_streamed_real_curves_equal_the_whole_file_reading(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # About 64 blocks a file, none aligned (the cutting itself: the test above, down to 1 byte).
    # Blocks of 4,099 bytes gave pythia's 5.4 MB 1,316 blocks and this test 30 s of the suite.
    block_bytes = max(4099, ((CURVES / name).stat().st_size // 64) | 1)
    monkeypatch.setattr(series_files, "BLOCK_BYTES", block_bytes)
    loaded = load_series(CURVES / name, {}, None)
    expected, notes = whole_file_series(CURVES / name)
    assert loaded.notes == notes
    # repr: a NaN loss is equal to itself only as text
    assert [(s.run, repr(s.points)) for s in loaded.series] == [(run, repr(p)) for run, p in expected]


def rank_rows(order: str) -> list[dict]:
    """Three ranks; a restart onto step 20 after step 30 where rank 2 no longer logs; a NaN on
    one rank; uneven tokens. Written step by step, rank after rank, or with each rank lagging."""
    incarnations = [
        [(s, r) for s in range(1, 31) for r in (0, 1, 2)],
        [(s, r) for s in range(20, 41) for r in (0, 1)],
    ]
    rows = []
    for number, cells in enumerate(incarnations):
        if order == "rank after rank":
            cells = sorted(cells, key=lambda cell: (cell[1], cell[0]))
        elif order == "lagging":
            cells = sorted(cells, key=lambda cell: (cell[0] + 3 * cell[1], cell[1]))
        for position, (step, rank) in enumerate(cells):
            loss = math.nan if (step, rank) == (12, 1) else 2.0 + 0.01 * ((step * 7 + rank) % 5)
            rows.append(
                {
                    "step": step,
                    "rank": rank,
                    "loss": loss,
                    "tokens": 1000 * (rank + 1),
                    "restart": number == 1 and position == 0,
                }
            )
    return rows


@pytest.mark.parametrize("order", ["step by step", "rank after rank", "lagging"])
def test_handing_windows_on_early_folds_every_layout_as_holding_them(order: str) -> None:
    rows = rank_rows(order)
    held = tuple(series_points(rows, has_skipped=False))
    streamed = tuple(series_points(rows, has_skipped=False, ranks={0, 1, 2}))
    assert repr(streamed) == repr(held)
    assert len(held) == 30 + 21 and sum(p.restart for p in held) == 1


def test_a_file_written_step_by_step_is_judged_as_it_is_read() -> None:
    """Memory holds the windows between the rows read and the points handed on: a few dozen,
    not the file."""
    steps, ranks = 5_000, 4
    rows_read = 0

    def read(rows: Iterator[dict]) -> Iterator[dict]:
        nonlocal rows_read
        for row in rows:
            rows_read += 1
            yield row

    rows = (
        {"step": s, "rank": r, "loss": 2.0, "tokens": 10} for s in range(1, steps + 1) for r in range(ranks)
    )
    held = [rows_read // ranks - point.step for point in series_points(read(rows), False, set(range(ranks)))]
    assert len(held) == steps
    assert max(held) <= 64 // ranks + 1


def test_a_run_column_without_a_run_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    path.write_text("step,loss,run\n1,2.0,\n")
    with pytest.raises(BacktestError, match="the 'run' column names no run"):
        run_file(path)


def test_the_command_path_reads_the_file_as_it_judges(tmp_path: Path) -> None:
    """``backtest_file`` (what the CLI runs) and ``load_series`` then ``backtest`` agree, on a
    file of several runs and ranks."""
    rows = [{**row, "run": "a"} for row in rank_rows("lagging")]
    rows += [
        {**row, "run": "b", "loss": 9.0 if row["step"] == 35 else row["loss"]}
        for row in rank_rows("step by step")
    ]
    pl.DataFrame(rows).write_csv(tmp_path / "runs.csv")
    reports, notes = backtest_file(tmp_path / "runs.csv", {}, None, SeriesConfig())
    streamed = report_json(reports, notes, tmp_path / "runs.csv")
    assert json.dumps(streamed) == json.dumps(run_file(tmp_path / "runs.csv"))  # NaN: as text
    assert streamed["run"] == ["a", "b"] and streamed["steps"] == 2 * 51


def test_an_incident_refined_by_a_later_finding_is_summarised_by_it() -> None:
    """A jump that stays is a level shift, and a jump after a restart back to the untrained loss is
    a broken resume: the summary says so, not the first window's spike message."""
    rng = random.Random(0)
    level = [StepPoint(step=s, loss=2.0 + 0.02 * rng.random()) for s in range(1, 201)]
    level += [StepPoint(step=s, loss=3.0 + 0.02 * rng.random()) for s in range(201, 241)]
    resumed = [StepPoint(step=s, loss=10.0 * 0.97**s + 2.0 + 0.02 * rng.random()) for s in range(1, 301)]
    resumed += [StepPoint(step=301, loss=2.01, restart=True)]
    resumed += [StepPoint(step=s, loss=11.0 + 0.02 * rng.random()) for s in range(302, 320)]
    (shift,) = backtest_series(level, SeriesConfig()).incidents
    (broken,) = backtest_series(resumed, SeriesConfig()).incidents
    assert shift.view.kind == "level_shift" and "stayed up" in shift.summary, shift.summary
    assert broken.view.kind == "broken_resume" and "weights were lost" in broken.summary, broken.summary
