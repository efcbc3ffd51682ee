"""A recorded series file (CSV, JSONL, a training log: ``log_lines``, or TensorBoard event files:
``tfevents``) read in bounded memory, for ``runhealth backtest``.

The file is first checked as bytes, a megabyte at a time: a NUL byte means it is not a text log
(a binary file, or the zeros a crashed writer preallocated), and a line longer than
``LINE_LIMIT_BYTES`` would make any reader hold it whole. Then it is read a batch of rows at a
time, every value as text: a CSV in blocks of whole records (``BLOCK_BYTES``) that polars parses
as it parses the whole file, a JSONL file line by line with the stdlib ``json`` (which reads
Python's bare ``NaN`` and ``Infinity``, which polars refuses). Not polars' own lazy scan
(``collect_batches``): it decodes ahead of its reader by a share of the file (192 MB held for a
159 MB file, 334 MB for a 477 MB one, polars 2.1), so its memory grows with the file.
Whatever cannot be read is a ``BacktestError`` of one line that names the file.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from monitor.judge.log_lines import LOG_SUFFIXES, LogSteps, log_rows
from monitor.judge.series_error import BacktestError as BacktestError  # raised here, caught by the CLI
from monitor.judge.tfevents import EventFileError, RecordEnd, event_runs, event_scalars, is_event_file

CHUNK_BYTES = 1 << 20
LINE_LIMIT_BYTES = 1 << 20
"""No log line of a training run comes near a megabyte; a file that has one is not a log."""
BLOCK_BYTES = 4 << 20
"""A CSV batch: about 4 MiB of whole records (250,000 rows of ``step,loss``)."""
BATCH_ROWS = 50_000
"""A JSONL batch, held as dicts until it becomes a frame."""
QUOTED_LIMIT_BYTES = 64 << 20
"""A quoted field may hold line breaks; one that runs this far has lost its closing quote."""

CSV_SEPARATORS = {".csv": ",", ".txt": ",", ".tsv": "\t"}
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TRAINER_STATE_SUFFIX = ".json"
"""A Hugging Face ``trainer_state.json``: its ``log_history`` (``_trainer_state_rows``)."""
NOT_TRAINING = ("eval_", "predict_", "test_", "train_runtime")
"""Keys of a ``log_history`` entry that is no training step: an evaluation, or the closing
summary (whose ``train_loss`` is the mean of the whole run)."""


Rows = Callable[[Path], Iterator[Mapping[str, str | None]]]
RunRows = Callable[[Path, str], Iterator[Mapping[str, str | None]]]


@dataclass(frozen=True)
class TextFile:
    """A checked file and its columns (for JSONL and logs, every key of any row, first seen first)."""

    path: Path
    columns: tuple[str, ...]
    separator: str | None
    """The CSV's separator; ``None`` for a file read a row at a time (``rows``)."""
    rows: Rows | None = None
    """JSONL's lines, or a log's training lines (``log_lines``), as rows of text."""
    sparse: bool = False
    """Each row holds a few of the columns (an event file's row is one event, most often one
    tag): a row with none of the columns read but its step and run is left out, so the steps of
    a tag not read (Keras' ``epoch_loss``, logged by epoch beside per-batch tags) cannot look
    like a restart."""
    notes: tuple[str, ...] = ()
    """What reading the file found that the report should say (an event file cut short)."""
    run_rows: RunRows | None = None
    """One run's rows alone, where runs are apart (event files: the run's directory only)."""

    def batches(self, columns: Sequence[str], run: str | None = None) -> Iterator[pl.DataFrame]:
        """The file's rows in order, a block (CSV) or ``BATCH_ROWS`` (JSONL) at a time,
        ``columns`` only, all as text; ``run``'s only (and maybe others'), when given."""
        with reading(self.path, self.separator, len(self.columns)):
            if self.separator is None:
                if run is not None and self.run_rows is not None:
                    rows = self.run_rows(self.path, run)
                else:
                    rows = (self.rows or _jsonl_rows)(self.path)
                values = [name for name in columns if name not in STRUCTURAL_COLUMNS]
                if self.sparse and values:
                    rows = (row for row in rows if any(name in row for name in values))
                yield from _row_batches(rows, columns)
                return
            for block in _csv_blocks(self.path):
                yield pl.read_csv(block, infer_schema=False, separator=self.separator, columns=list(columns))


def open_text_file(path: Path) -> TextFile:
    if path.is_dir() or (is_event_file(path) and path.is_file()):
        return open_event_files(path)
    if not path.exists():
        raise BacktestError(f"no such file: {path}")
    if not path.is_file():  # a pipe or a device: it cannot be read twice, and may never end
        raise BacktestError(f"cannot read {path}: not a regular file")
    suffix = path.suffix.lower()
    known = (*CSV_SEPARATORS, *JSONL_SUFFIXES, *LOG_SUFFIXES, TRAINER_STATE_SUFFIX)
    if suffix not in known:
        raise BacktestError(
            f"{path}: expected a .csv, .tsv or .jsonl file, a training log (.log, .out), a trainer_state.json "
            "or TensorBoard event files (events.out.tfevents.*, or a directory of them)"
        )
    check_bytes(path)
    if suffix == TRAINER_STATE_SUFFIX:
        columns = dict.fromkeys(key for row in _trainer_state_rows(path) for key in row)
        return TextFile(path, tuple(columns), None, _trainer_state_rows)
    separator = CSV_SEPARATORS.get(suffix)
    if separator is None and suffix not in JSONL_SUFFIXES:
        log = open_log_file(path)
        if log is None:
            raise BacktestError(
                f"{path}: no line names a step and a loss, grad norm, learning rate or loss scale "
                "(as nanoGPT's `iter 100: loss 2.34` or Megatron's `iteration 100/ ... | lm loss: ...`)"
            )
        return log
    with reading(path, separator, None):
        if separator is None:
            columns = dict.fromkeys(key for row in _jsonl_rows(path) for key in row)
            return TextFile(path, tuple(columns), None, _jsonl_rows)
        schema = pl.scan_csv(path, infer_schema=False, separator=separator).collect_schema()
        return TextFile(path, tuple(schema.names()), separator)


def open_log_file(path: Path) -> TextFile | None:
    """The file read as a training log (``log_lines``); ``None`` when no line of it names a
    step and a signal. Also how a ``.txt`` whose first line names no step is read: a trainer's
    printed log saved as ``log.txt`` (modded-nanogpt's ``logs/<run id>.txt``), not a table."""
    steps = LogSteps()
    with reading(path, None, None):
        columns = dict.fromkeys(key for row in log_rows(path, steps) for key in row)
    notes = (
        (
            f"{steps.counted} printed dicts name no step (the Hugging Face Trainer's): their steps are "
            "their order, 1, 2, 3, ..., one per logging_steps",
        )
        if steps.counted
        else ()
    )
    return TextFile(path, tuple(columns), None, log_rows, notes=notes) if columns else None


def open_event_files(path: Path) -> TextFile:
    """TensorBoard event files (``tfevents``): one file, or every one under a directory, a run
    per directory that holds them (a ``run`` column when there are several), evaluation
    directories left out. One pass here finds the tags (the columns) and any file cut short."""
    runs = event_runs(path)
    if not runs.files:
        where = f"; only evaluation runs ({', '.join(runs.left_out)})" if runs.left_out else ""
        raise BacktestError(
            f"cannot read {path}: it is a directory, and no TensorBoard event file (*tfevents*) is under it{where}"
        )
    columns = dict.fromkeys(("step", "run") if len(runs.files) > 1 else ("step",))
    ends: dict[Path, RecordEnd] = {}
    with reading(path, None, None):
        for row in _event_rows(path, ends, checked=False):  # the judging pass checks each record
            columns.update(dict.fromkeys(row))
    notes = (
        [f"left out evaluation and epoch-average runs: {', '.join(runs.left_out)}"] if runs.left_out else []
    )
    notes += [
        f"{file}: read up to byte {end.cut_at}: {end.reason}"
        for file, end in ends.items()
        if end.cut_at is not None
    ]
    return TextFile(
        path, tuple(columns), None, _event_rows, sparse=True, notes=tuple(notes), run_rows=_run_event_rows
    )


STRUCTURAL_COLUMNS = ("step", "run")
"""An event row's own columns; a tag of either name is left out (the event's step is the step)."""


def _run_event_rows(path: Path, run: str) -> Iterator[dict[str, str | None]]:
    return _event_rows(path, run=run)


def _event_rows(
    path: Path, ends: dict[Path, RecordEnd] | None = None, checked: bool = True, run: str | None = None
) -> Iterator[dict[str, str | None]]:
    """Every event with a scalar, run after run (``run``'s alone, when given) and file after file
    in the order written, as a row of its step, its run (when there are several) and its tags'
    values."""
    runs = event_runs(path)
    several = len(runs.files) > 1
    for name, files in runs.files.items():
        if run is not None and name != run:
            continue
        for file in files:
            end = (ends if ends is not None else {}).setdefault(file, RecordEnd())
            try:
                for step, scalars in event_scalars(file, end, checked):
                    row: dict[str, str | None] = {"step": str(step), **({"run": name} if several else {})}
                    row.update(
                        (tag, repr(value)) for tag, value in scalars.items() if tag not in STRUCTURAL_COLUMNS
                    )
                    yield row
            except EventFileError as exc:
                raise BacktestError(f"cannot read {file}: {exc}") from exc


def check_bytes(path: Path) -> None:
    """Refuse a NUL byte or an overlong line, reading a megabyte at a time (a line inside one
    chunk is shorter than the limit, so only lines that cross a chunk's end are measured). A
    carriage return ends a line here too; lines are counted by line breaks."""
    line, offset, open_line = 1, 0, 0
    with reading(path, None, None), path.open("rb") as raw:
        while chunk := raw.read(CHUNK_BYTES):
            nul = chunk.find(b"\0")
            if nul >= 0:
                at = line + chunk.count(b"\n", 0, nul)
                raise BacktestError(
                    f"cannot read {path}: a NUL byte at line {at} (byte {offset + nul}): not a text file"
                )
            first_end = _first_break(chunk)
            if first_end < 0:
                open_line += len(chunk)
            else:
                open_line += first_end
            if open_line > LINE_LIMIT_BYTES:
                raise BacktestError(
                    f"cannot read {path}: line {line} is longer than {LINE_LIMIT_BYTES >> 20} MiB: not a log"
                )
            if first_end >= 0:
                open_line = len(chunk) - max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) - 1
            line += chunk.count(b"\n")
            offset += len(chunk)


def _first_break(chunk: bytes) -> int:
    """Where the first line ends: a line break, or a carriage return, which ends a line of a
    progress bar (tqdm redraws its bar after one, and a log of a long run holds megabytes of
    them between two line breaks; the log reader splits lines at both)."""
    ends = [end for end in (chunk.find(b"\n"), chunk.find(b"\r")) if end >= 0]
    return min(ends, default=-1)


@contextmanager
def reading(path: Path, separator: str | None, width: int | None) -> Iterator[None]:
    """What the readers raise, as one line naming the file (and a ragged row's line)."""
    try:
        yield
    except OSError as exc:
        raise BacktestError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise BacktestError(f"cannot read {path}: not UTF-8 text ({exc.reason})") from exc
    except pl.exceptions.PolarsError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "more fields" in message and separator is not None and width is not None:
            message = _ragged_line(path, separator, width) or message
        raise BacktestError(f"cannot read {path}: {message}") from exc


def _ragged_line(path: Path, separator: str, width: int) -> str | None:
    """The first line with more fields than the header, found again with the stdlib reader
    (polars says only that there is one)."""
    try:
        with path.open(newline="", encoding="utf-8", errors="replace") as text:
            rows = csv.reader(text, delimiter=separator)
            for fields in rows:
                if len(fields) > width:
                    return f"line {rows.line_num} has {len(fields)} fields, the header {width}"
    except (OSError, csv.Error):
        return None
    return None


def _csv_blocks(path: Path) -> Iterator[bytes]:
    """The file in blocks of about ``BLOCK_BYTES`` of whole records, each after the header line
    (so polars reads every block's fields as it reads the whole file's). A record ends at a line
    break outside quotes: an even count of quote characters before it in the block."""
    with path.open("rb") as raw:
        pending = raw.read(BLOCK_BYTES)
        header_end = _record_end(pending, first=True)
        while header_end < 0 and (more := raw.read(BLOCK_BYTES)):
            pending += more
            header_end = _record_end(pending, first=True)
        if header_end < 0:
            return
        header, pending = pending[: header_end + 1], pending[header_end + 1 :]
        while more := raw.read(BLOCK_BYTES):
            pending += more
            end = _record_end(pending)
            if end < 0:
                if len(pending) > QUOTED_LIMIT_BYTES:
                    raise BacktestError(f"cannot read {path}: a quoted field runs past 64 MiB")
                continue
            yield header + pending[: end + 1]
            pending = pending[end + 1 :]
        if pending:
            yield header + pending


def _record_end(block: bytes, first: bool = False) -> int:
    """The index of the last (or first) line break in ``block`` that ends a record; -1 if none."""
    find = block.find if first else block.rfind
    end = find(b"\n")
    while end >= 0 and block.count(b'"', 0, end) % 2:
        end = block.find(b"\n", end + 1) if first else block.rfind(b"\n", 0, end)
    return end


def _jsonl_rows(path: Path) -> Iterator[dict[str, str | None]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise BacktestError(f"cannot read {path}: line {number}: {exc}") from exc
            if not isinstance(row, dict):
                raise BacktestError(f"cannot read {path}: line {number} is not a JSON object")
            yield {str(key): _as_text(value) for key, value in row.items()}


def _trainer_state_rows(path: Path) -> Iterator[dict[str, str | None]]:
    """The training entries of a Hugging Face ``trainer_state.json``'s ``log_history``, in order.
    Read whole: the Trainer keeps one entry per logging step, kilobytes to a few megabytes."""
    with reading(path, None, None), path.open(encoding="utf-8") as file:
        try:
            state = json.load(file)  # the Trainer writes a NaN loss as a bare NaN, which this reads
        except ValueError as exc:
            raise BacktestError(f"cannot read {path}: {exc}") from exc
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise BacktestError(
            f"{path}: no log_history list (a .json is read as a Hugging Face trainer_state.json)"
        )
    for entry in history:
        if isinstance(entry, dict) and not any(str(key).startswith(NOT_TRAINING) for key in entry):
            yield {str(key): _as_text(value) for key, value in entry.items()}


def _row_batches(rows: Iterator[Mapping[str, str | None]], columns: Sequence[str]) -> Iterator[pl.DataFrame]:
    schema = dict.fromkeys(columns, pl.String)
    batch: list[Mapping[str, str | None]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == BATCH_ROWS:
            yield pl.DataFrame({name: [r.get(name) for r in batch] for name in columns}, schema=schema)
            batch = []
    if batch:
        yield pl.DataFrame({name: [r.get(name) for r in batch] for name in columns}, schema=schema)


def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return repr(value)  # int, or float: nan, inf and -inf read back as floats
