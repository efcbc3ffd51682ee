"""TensorBoard event files (``monitor/judge/tfevents.py``) read by ``runhealth backtest``: real
excerpts of PyTorch Lightning's and Keras' files (``tests/data/tfevents/README.md``), and files
written here with a writer checked byte for byte against a real record. Before, an event file
was refused (``expected a .csv, .tsv or .jsonl file, ...``) and a directory of runs too
(``it is a directory``)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import polars as pl
import pytest

from monitor.judge import series_files, tfevents
from monitor.judge.backtest import BacktestError, backtest, load_series, report_json
from monitor.judge.series_files import open_text_file
from monitor.judge.tfevents import HEADER_BYTES, event_scalars, masked_crc32c, records
from policies.series import SeriesConfig

DATA = Path(__file__).parent / "data" / "tfevents"
LIGHTNING = DATA / "lightning_lstm" / "version_0" / "events.out.tfevents.1716735746.99c8c45923de.3769.0"
KERAS = DATA / "keras_mnist"


def report(path: Path, mapping: dict[str, str] | None = None, run: str | None = None) -> dict:
    loaded = load_series(path, mapping or {}, run)
    return report_json(backtest(loaded, SeriesConfig()), loaded.notes, path)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(step: int, tag: str, value: float, wall_time: float = 1716735800.0) -> bytes:
    """An Event as torch's ``SummaryWriter.add_scalar`` serializes it: wall_time, step, and a
    Summary of one Value (tag, simple_value)."""
    summary_value = _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return (
        b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + _field(5, _field(1, summary_value))
    )


def record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def write_events(path: Path, events: list[tuple[int, str, float]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(record(scalar_event(step, tag, value)) for step, tag, value in events))
    return path


def test_the_writer_here_writes_a_real_record_byte_for_byte() -> None:
    """The Lightning file's record 5: train_loss at step 49 (real bytes, real checksums)."""
    raw = LIGHTNING.read_bytes()
    offset, data, stored = list(records(LIGHTNING))[5]
    (wall_time,) = struct.unpack_from("<d", data, 1)
    value = struct.unpack("<f", struct.pack("<f", 2.0573372840881348))[0]
    assert raw[offset : offset + HEADER_BYTES + len(data) + 4] == record(
        scalar_event(49, "train_loss", value, wall_time)
    )
    assert int.from_bytes(stored, "little") == masked_crc32c(data)


def test_a_lightning_event_file_is_read_as_its_train_loss_by_step() -> None:
    """simple_value scalars: train_loss every 50 steps is the loss; epoch, hp_metric (step 0) and
    val_loss are not read, and a step with only a validation loss is no step."""
    loaded = load_series(LIGHTNING, {}, None)
    [series] = loaded.series
    steps = [point.step for point in series.points]
    assert steps[:3] == [49, 99, 149] and steps[-4:] == [13199, 13249, 13299, 13349]
    assert len(steps) == 33 + 5  # 49..1649 and 13149..13349
    assert 13261 not in steps and 0 not in steps  # val_loss's step; hp_metric's
    assert series.points[0].loss == pytest.approx(2.0573372840881348)
    assert not any(point.restart for point in series.points)
    assert "read column 'train_loss' as loss (--column train_loss=FIELD to choose)" in loaded.notes
    assert "ignored columns: hp_metric, epoch, val_loss" in loaded.notes


def test_a_keras_run_directory_reads_train_and_leaves_validation_out() -> None:
    """Keras writes tensor scalars per epoch under train/ and validation/; the validation run
    also logs by iteration (1500, 3000), which would read as restarts beside epochs 0-2."""
    text = open_text_file(KERAS)
    assert text.columns == ("step", "epoch_loss", "epoch_accuracy")
    with pytest.raises(
        BacktestError, match=r"none of the signals .*\(epoch_loss, epoch_accuracy\) with --column"
    ):
        report(KERAS)
    result = report(KERAS, {"epoch_loss": "loss"})
    assert result["steps"] == 3
    assert result["notes"][0] == "left out evaluation and epoch-average runs: validation"
    loaded = load_series(KERAS, {"epoch_loss": "loss"}, None)
    assert [round(p.loss or 0, 6) for p in loaded.series[0].points] == [0.297355, 0.136429, 0.099454]
    # The validation file alone is read as it is, its two step axes apart: no restart.
    [validation] = load_series(next((KERAS / "validation").iterdir()), {"epoch_loss": "loss"}, None).series
    assert [p.step for p in validation.points] == [0, 1, 2]
    assert not any(p.restart for p in validation.points)


def test_an_event_file_is_judged_as_the_same_series_in_a_csv(tmp_path: Path) -> None:
    losses = [3.0 - s * 0.001 + 0.01 * ((s * 7) % 5 - 2) for s in range(1, 301)]
    losses[199] = 9.0  # step 200
    events = []
    for step, loss in enumerate(losses, 1):
        events += [
            (step, "train/loss", loss),
            (step, "train/learning_rate", 3e-4),
            (step, "train/epoch", step / 300),
        ]
        if step % 100 == 0:
            events.append((step, "eval/loss", loss + 0.1))
    path = write_events(tmp_path / "events.out.tfevents.1700000000.host.1.0", events)
    rounded = [struct.unpack("<f", struct.pack("<f", v))[0] for v in losses]
    pl.DataFrame(
        {
            "step": range(1, 301),
            "loss": rounded,
            "lr": [struct.unpack("<f", struct.pack("<f", 3e-4))[0]] * 300,
        }
    ).write_csv(tmp_path / "s.csv")
    from_events, from_csv = report(path), report(tmp_path / "s.csv")
    assert from_events["steps"] == 300
    assert [(i["kind"], i["first_step"]) for i in from_events["incidents"]] == [("spike", 200)]
    assert json.dumps(from_events["findings"]) == json.dumps(from_csv["findings"])


def test_a_directory_of_runs_is_judged_run_by_run_and_a_resumed_run_restarts(tmp_path: Path) -> None:
    """Hugging Face's Trainer writes runs/<date>_<host>/events...; a resumed run writes a second
    file in the same directory, its steps starting again below the first file's last."""
    runs = tmp_path / "runs"
    write_events(
        runs / "May01_10-00-00_a" / "events.out.tfevents.1700000000.a.1.0",
        [(s, "loss", 2.0) for s in range(1, 61)],
    )
    resumed = runs / "May02_10-00-00_b"
    write_events(resumed / "events.out.tfevents.1700000100.b.1.0", [(s, "loss", 2.0) for s in range(1, 41)])
    write_events(resumed / "events.out.tfevents.1700000900.b.2.0", [(s, "loss", 2.0) for s in range(31, 81)])
    result = report(runs)
    assert result["run"] == ["May01_10-00-00_a", "May02_10-00-00_b"]
    assert result["steps"] == 60 + 40 + 50
    [one] = load_series(runs, {}, "May02_10-00-00_b").series
    assert [p.step for p in one.points if p.restart] == [31]


def test_a_file_cut_inside_a_record_is_read_to_its_last_whole_record(tmp_path: Path) -> None:
    path = write_events(
        tmp_path / "events.out.tfevents.1700000000.h", [(s, "loss", 2.0) for s in range(1, 51)]
    )
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])  # a live writer's file between flushes
    result = report(path)
    assert result["steps"] == 49
    assert (
        result["notes"][0]
        == f"{path}: read up to byte {len(whole) - len(record(scalar_event(50, 'loss', 2.0)))}: the file ends inside a record"
    )
    path.write_bytes(whole + bytes(4096))  # zeros a crashed writer left
    assert report(path)["steps"] == 50


@pytest.mark.parametrize(("flipped", "message"), [(3, "bad length checksum"), (-6, "bad data checksum")])
def test_a_corrupt_record_is_one_line_naming_its_byte(tmp_path: Path, flipped: int, message: str) -> None:
    path = write_events(
        tmp_path / "events.out.tfevents.1700000000.h", [(s, "loss", 2.0) for s in range(1, 4)]
    )
    size = len(record(scalar_event(1, "loss", 2.0)))
    corrupt = bytearray(path.read_bytes())
    corrupt[size + (flipped % size)] ^= 0x01  # the second record
    path.write_bytes(bytes(corrupt))
    with pytest.raises(BacktestError) as raised:
        report(path)
    assert (
        str(raised.value)
        == f"cannot read {path}: the record at byte {size} has a {message}: a corrupt event file"
    )


def test_an_empty_directory_or_one_of_evaluations_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(BacktestError) as raised:
        report(tmp_path)
    assert (
        str(raised.value)
        == f"cannot read {tmp_path}: it is a directory, and no TensorBoard event file (*tfevents*) is under it"
    )
    shutil.copytree(KERAS / "validation", tmp_path / "validation")
    with pytest.raises(BacktestError, match=r"only evaluation runs \(validation\)"):
        report(tmp_path)


def test_the_scalars_of_a_real_event_file_stream_in_order() -> None:
    found = list(event_scalars(LIGHTNING))
    assert found[0] == (0, {"hp_metric": -1.0})
    assert found[-6] == (13261, {"val_loss": pytest.approx(0.3606380522251129)})


def test_a_csv_export_named_for_its_event_file_is_read_as_a_csv(tmp_path: Path) -> None:
    path = tmp_path / "events.out.tfevents.1700000000.h.csv"
    path.write_text("step,loss\n1,2.0\n2,2.0\n")
    assert report(path)["steps"] == 2


def test_fairseq_tensorboard_directories_judge_train_inner_only(tmp_path: Path) -> None:
    """fairseq's --tensorboard-logdir: train_inner/ (each log interval, by num_updates), train/
    (each epoch's averages, at the epoch's last update) and valid/."""
    logs = tmp_path / "tb"
    write_events(
        logs / "train_inner" / "events.out.tfevents.1700000000.h",
        [(s, "loss", 7.0) for s in range(100, 1001, 100)],
    )
    write_events(logs / "train" / "events.out.tfevents.1700000000.h", [(1000, "loss", 7.5)])
    write_events(logs / "valid" / "events.out.tfevents.1700000000.h", [(1000, "loss", 6.9)])
    result = report(logs)
    assert result["run"] is None and result["steps"] == 10
    assert result["notes"][0] == "left out evaluation and epoch-average runs: train, valid"


def test_the_fast_layout_reads_what_the_field_by_field_reading_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's add_scalar layout is decoded in place (``simple_scalar_event``): every event of
    the real excerpts and of a written file reads the same with it as field by field."""
    written = write_events(
        tmp_path / "events.out.tfevents.1700000000.h", [(s, "train/loss", 2.5) for s in (0, 1, 300)]
    )
    paths = [LIGHTNING, written, *sorted(KERAS.rglob("*tfevents*"))]
    fast = [list(event_scalars(path)) for path in paths]
    assert (
        sum(tfevents.simple_scalar_event(data) is not None for _, data, _ in records(LIGHTNING)) == 79
    )  # all but hp_metric at step 0
    monkeypatch.setattr(tfevents, "simple_scalar_event", lambda data: None)
    assert [list(event_scalars(path)) for path in paths] == fast


def test_hugging_face_trainer_tags_are_read_as_loss_grad_norm_and_lr(tmp_path: Path) -> None:
    """The Trainer's TensorBoardCallback writes each log dict's keys as tags, train/ prefixed
    (eval_ ones as eval/), and at the end train/train_loss, the run's mean, at the last step."""
    events = []
    for step in range(10, 310, 10):
        events += [
            (step, "train/loss", 2.0),
            (step, "train/grad_norm", 1.0),
            (step, "train/learning_rate", 5e-05),
        ]
        events.append((step, "train/epoch", step / 300))
        if step % 100 == 0:
            events += [(step, "eval/loss", 2.1), (step, "eval/runtime", 4.2)]
    events += [(300, "train/train_runtime", 439.1), (300, "train/train_loss", 9.9)]
    path = write_events(
        tmp_path / "runs" / "Jan01_00-00-00_host" / "events.out.tfevents.1700000000.host.1.0", events
    )
    loaded = load_series(path.parent.parent, {}, None)
    [series] = loaded.series
    assert [p.step for p in series.points] == list(range(10, 310, 10))
    assert {(p.loss, p.grad_norm, p.lr) for p in series.points} == {
        (2.0, 1.0, struct.unpack("<f", struct.pack("<f", 5e-05))[0])
    }
    assert loaded.notes[:3] == [
        "read column 'train/loss' as loss (--column train/loss=FIELD to choose)",
        "read column 'train/grad_norm' as grad_norm (--column train/grad_norm=FIELD to choose)",
        "read column 'train/learning_rate' as lr (--column train/learning_rate=FIELD to choose)",
    ]


def test_judging_one_run_of_a_directory_reads_that_runs_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory of runs was read whole once per run judged; now once for its tags, once for
    its runs, then each run's files for that run alone."""
    runs = tmp_path / "lightning_logs"
    one = write_events(
        runs / "version_0" / "events.out.tfevents.1700000000.h.1.0", [(s, "loss", 2.0) for s in range(1, 11)]
    )
    two = write_events(
        runs / "version_1" / "events.out.tfevents.1700000100.h.1.0", [(s, "loss", 2.0) for s in range(1, 21)]
    )
    reads: list[Path] = []
    original = series_files.event_scalars

    def counted(path: Path, *args: object) -> object:
        reads.append(path)
        return original(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(series_files, "event_scalars", counted)
    assert report(runs, run="version_1")["steps"] == 20
    assert (reads.count(one), reads.count(two)) == (2, 3)
