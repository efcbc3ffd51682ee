"""``runhealth backtest``: a recorded series (CSV or JSONL) through the policies, in bounded memory.

An empty cell is "not logged"; ``nan`` is a NaN. A row with ``restart`` = 1 (or a new
``incarnation`` value, or a step lower than that rank's previous one) begins a new
incarnation. Rows of several ranks at one step are folded into one window exactly as the
live engine folds step records (``monitor.judge.summaries.fold``).

The file is read in batches (``monitor.judge.series_files``) and each window is handed to the
policies as soon as no later row can fold into it, so memory holds the policies' state, the
findings and the windows still open, never the file. A file of several runs is read once per
run, after one pass over its ``run`` and ``rank`` columns.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any

import polars as pl

from monitor.judge.readings import point_from_summary
from monitor.judge.series_files import BacktestError as BacktestError  # raised here, caught by the CLI
from monitor.judge.series_files import TextFile, open_log_file, open_text_file
from monitor.judge.summaries import empty_summary, fold
from policies.backtest import BacktestResult, backtest_series
from policies.series import SeriesConfig
from policies.types import StepPoint

FLOAT_FIELDS = ("loss", "grad_norm", "lr", "loss_scale")
INT_FIELDS = ("step", "tokens", "rank", "consumed")
FLAG_FIELDS = ("skipped", "restart")
TEXT_FIELDS = ("incarnation", "run")
FIELDS = FLOAT_FIELDS + INT_FIELDS + FLAG_FIELDS + TEXT_FIELDS
SIGNALS = ("loss", "grad_norm", "lr", "tokens", "loss_scale", "skipped")
KINDS: Mapping[str, pl.DataType] = {
    **{name: pl.Float64() for name in FLOAT_FIELDS},
    **{name: pl.Int64() for name in INT_FIELDS},
    **{name: pl.Boolean() for name in FLAG_FIELDS},
}


@dataclass(frozen=True)
class Series:
    run: str | None
    points: tuple[StepPoint, ...]


@dataclass
class LoadedFile:
    series: list[Series]
    notes: list[str] = field(default_factory=list)


def parse_mapping(pairs: list[str]) -> dict[str, str]:
    mapping = {}
    for pair in pairs:
        source, sep, target = pair.partition("=")
        if not sep or not source or not target:
            raise BacktestError(f"--column wants SRC=FIELD, got {pair!r}")
        if target not in FIELDS:
            raise BacktestError(f"--column {pair}: {target!r} is not a field ({', '.join(FIELDS)})")
        mapping[source] = target
    return mapping


def _column(raw: pl.Series, name: str, dtype: pl.DataType, first_row: int) -> pl.Series:
    """A text column as ``dtype``; a value that is not one names its row (counted from the
    file's first row, ``first_row`` rows before this batch)."""
    raw = raw.cast(pl.String).str.strip_chars()
    raw = raw.replace("", None)
    if dtype == pl.Boolean:
        lowered = raw.str.to_lowercase()
        mapped = lowered.replace_strict(
            {"1": True, "0": False, "true": True, "false": False, "1.0": True, "0.0": False},
            default=None,
            return_dtype=pl.Boolean,
        )
        bad = raw.is_not_null() & mapped.is_null()
        converted = mapped
    else:
        converted = raw.cast(pl.Float64, strict=False)
        bad = raw.is_not_null() & converted.is_null()
        if dtype == pl.Int64 and not bad.any():
            integral = converted.is_null() | (converted.is_finite() & (converted.round(0) == converted))
            bad = ~integral
            converted = converted.cast(pl.Int64, strict=False)
    if bad.any():
        row = int(bad.arg_true()[0])
        raise BacktestError(
            f"column {name!r}, row {first_row + row + 1}: {raw[row]!r} is not a valid {dtype} value"
        )
    return converted.alias(name)


# Names other tools log these fields under (Megatron, transformers, W&B exports), read as the
# field when the file has no column of the field's own name and exactly one of these. Cumulative
# counters (W&B's train/num_tokens, Megatron's skipped-iterations count) are not the per-step
# field and are left out.
COMMON_NAMES: dict[str, tuple[str, ...]] = {
    "step": ("iteration", "iter", "global_step", "_step", "train/global_step", "trainer/global_step"),
    "loss": (
        "train/loss",
        "train_loss",
        "lm loss",
        "lm_loss",
        "train/lm_loss",
        "loss/train",
        "training_loss",
        # Lightning's self.log(..., on_step=True, on_epoch=True) writes the step's value under
        # <name>_step and the epoch's mean under <name>_epoch (never read as the loss).
        "train_loss_step",
        "train/loss_step",
        "loss_step",
    ),
    "grad_norm": (
        "grad norm",
        "grad-norm",
        "gradnorm",
        "train/grad_norm",
        "gradient_norm",
        "total_grad_norm",
        "gnorm",  # fairseq
        "grad_2.0_norm_total",  # Lightning's utilities.grad_norm(module, norm_type=2)
    ),
    "lr": ("learning_rate", "learning rate", "learning-rate", "train/learning_rate", "train/lr"),
    "loss_scale": ("loss scale", "loss-scale", "train/loss_scale", "grad_scale", "scaler/scale"),
}


EVALUATION_NAME = re.compile(r"(?:^|[^a-z])(?:val|valid|validation|eval|test)(?:[^a-z]|$)", re.IGNORECASE)
"""A column of evaluation loss (``val_loss``, ``eval/loss``): never the training loss."""


def recognized_names(columns: list[str]) -> tuple[dict[str, str], list[str]]:
    """Renames for fields logged under another tool's name (or another case), and a note
    for each."""
    present = {name.strip().lower(): name for name in columns}
    renames, notes = {}, []
    for field_name, names in COMMON_NAMES.items():
        if field_name in columns:
            continue
        found = [present[name] for name in (field_name, *names) if name in present]  # "Loss" too
        if len(found) == 1:
            renames[found[0]] = field_name
            notes.append(f"read column {found[0]!r} as {field_name} (--column {found[0]}=FIELD to choose)")
        elif found:
            notes.append(f"several columns could be {field_name} ({', '.join(found)}): map one with --column")
    return renames, notes


@dataclass(frozen=True)
class Layout:
    """How a file's columns are read: the column each field comes from, and what was said."""

    sources: Mapping[str, str]
    """field -> the file's column, in ``FIELDS`` order, for every field the file has."""
    notes: tuple[str, ...]


def layout(columns: Sequence[str], mapping: Mapping[str, str]) -> Layout:
    """The fields of a file with these columns: ``--column`` mappings first, then the names
    other tools use (``COMMON_NAMES``); a file with no step or no signal is refused here."""
    mapped = [mapping.get(name, name) for name in columns]
    missing_sources = [src for src in mapping if src not in mapped and mapping[src] not in mapped]
    notes = [f"--column {src}: no such column" for src in missing_sources]
    renames, recognized = recognized_names(mapped)
    notes += recognized
    named = [renames.get(name, name) for name in mapped]
    twice = sorted({name for name in named if named.count(name) > 1 and name in FIELDS})
    if twice:
        raise BacktestError(f"several columns would be read as {twice[0]!r}: map only one with --column")
    if "step" not in named:
        hints = "".join(f"; {note}" for note in notes if note.startswith("several columns could be step"))
        epochs = [name for name in named if name.strip().lower() == "epoch"]
        if epochs and not hints:  # Keras' CSVLogger: one row an epoch, no step
            hints = f"; a log of one row an epoch (Keras' CSVLogger) is judged by epoch with --column {epochs[0]}=step"
        raise BacktestError(f"the file has no 'step' column (map one with --column SRC=step){hints}")
    ignored = [name for name in named if name not in FIELDS]
    if ignored:
        notes.append("ignored columns: " + ", ".join(ignored))
    losses = [name for name in ignored if "loss" in name.lower() and not EVALUATION_NAME.search(name)]
    if "loss" not in named and losses:  # judged without a loss, the report alone would look clean
        notes.append(f"no column is read as loss; {', '.join(losses)} could be one (--column SRC=loss)")
    if not any(name in named for name in SIGNALS):
        hints = "".join(f"; {note}" for note in notes if note.startswith("several columns"))
        if ignored and not hints:  # a TensorBoard scalar export: Wall time, Step, Value
            hints = f"; map one of its columns ({', '.join(ignored)}) with --column SRC=loss"
        raise BacktestError(f"the file has none of the signals {', '.join(SIGNALS)}{hints}")
    source_of = dict(zip(named, columns, strict=True))
    sources = {name: source_of[name] for name in FIELDS if name in source_of}
    return Layout(sources, tuple(notes))


def convert(frame: pl.DataFrame, fields: Layout, first_row: int = 0) -> pl.DataFrame:
    """A batch of text rows as typed fields; a bad value names its row in the file."""
    columns = []
    for name, source in fields.sources.items():
        if name in TEXT_FIELDS:
            columns.append(frame[source].cast(pl.String).alias(name))
        else:
            columns.append(_column(frame[source], name, KINDS[name], first_row))
    table = pl.DataFrame(columns)
    if table["step"].null_count():
        row = int(table["step"].is_null().arg_true()[0])
        raise BacktestError(f"column 'step', row {first_row + row + 1}: every row needs a step")
    return table


def normalize(frame: pl.DataFrame, mapping: Mapping[str, str]) -> tuple[pl.DataFrame, list[str]]:
    """A whole table at once (the streamed reading does the same batch by batch)."""
    fields = layout(frame.columns, mapping)
    return convert(frame, fields), list(fields.notes)


@dataclass(frozen=True)
class SeriesFile:
    """A checked file, its layout, and the ranks each run logs under (``None``: no run column)."""

    text: TextFile
    fields: Layout
    ranks: Mapping[str | None, frozenset[int]]

    def run_names(self, run: str | None) -> list[str | None]:
        """The runs to judge, first seen first: ``run`` alone when given."""
        if "run" not in self.fields.sources:
            return [run]
        names = list(self.ranks)
        if run is not None:
            if run not in names:
                raise BacktestError(
                    f"no run {run!r} in {self.text.path} (runs: {', '.join(map(str, names))})"
                )
            return [run]
        if not names:
            raise BacktestError(f"{self.text.path}: the 'run' column names no run")
        return names

    def rows(self, run: str | None) -> Iterator[dict[str, Any]]:
        """The typed rows of ``run`` (every row without a run column), in file order."""
        first_row = 0
        apart = run if self.fields.sources.get("run") == "run" else None  # the reader's own run column
        for batch in self.text.batches(list(self.fields.sources.values()), apart):
            table = convert(batch, self.fields, first_row)
            first_row += batch.height
            if "run" in table.columns:
                table = table.filter(pl.col("run") == run)
            yield from table.iter_rows(named=True)

    def points(self, run: str | None) -> Iterator[StepPoint]:
        key = run if "run" in self.fields.sources else None
        has_skipped = "skipped" in self.fields.sources
        return series_points(self.rows(run), has_skipped, self.ranks[key])


def open_series_file(path: Path, mapping: Mapping[str, str]) -> SeriesFile:
    text = open_text_file(path)
    if path.suffix.lower() == ".txt" and not _names_a_step(text.columns, mapping):
        text = open_log_file(path) or text  # a printed log saved as .txt; else refused as a table
    fields = layout(text.columns, mapping)
    fields = replace(fields, notes=text.notes + fields.notes)
    return SeriesFile(text, fields, _ranks_by_run(text, fields))


def _names_a_step(columns: Sequence[str], mapping: Mapping[str, str]) -> bool:
    """Whether a table's header has a column ``layout`` would read as the step."""
    names = {mapping.get(name, name).strip().lower() for name in columns}
    return any(name in names for name in ("step", *COMMON_NAMES["step"]))


def _ranks_by_run(text: TextFile, fields: Layout) -> dict[str | None, frozenset[int]]:
    """One pass over the ``run`` and ``rank`` columns: each run's ranks (an empty rank is 0), the
    runs first seen first. Without either column, nothing is read."""
    has_run, has_rank = "run" in fields.sources, "rank" in fields.sources
    if not has_run and not has_rank:
        return {None: frozenset({0})}
    ranks: dict[str | None, set[int]] = {}
    first_row = 0
    for batch in text.batches([fields.sources[name] for name in ("run", "rank") if name in fields.sources]):
        runs = (
            batch[fields.sources["run"]].cast(pl.String)
            if has_run
            else pl.repeat(None, batch.height, dtype=pl.String, eager=True)
        )
        numbers = (
            _column(batch[fields.sources["rank"]], "rank", KINDS["rank"], first_row)
            if has_rank
            else pl.repeat(None, batch.height, dtype=pl.Int64, eager=True)
        )
        first_row += batch.height
        pairs = pl.DataFrame([runs.alias("run"), numbers.fill_null(0).alias("rank")])
        if has_run:
            pairs = pairs.drop_nulls("run")  # a row without a run belongs to none
        for name, number in pairs.unique(maintain_order=True).iter_rows():
            ranks.setdefault(name, set()).add(number)
    if not has_run:
        return {None: frozenset(ranks.get(None, {0}))}
    return {name: frozenset(numbers) for name, numbers in ranks.items()}


def series_points(
    rows: Iterable[Mapping[str, Any]], has_skipped: bool, ranks: Collection[int] | None = None
) -> Iterator[StepPoint]:
    """Fold rows into one point per (incarnation, step) window, in first-seen order.

    A window is handed on once no later row can fold into it: when its incarnation ends, or,
    given ``ranks`` (every rank of the series), once each of them has logged a later step in
    the incarnation (a rank's steps only rise within one; a lower step begins the next). Then
    only the windows between the slowest rank and the fastest are held: a file written step by
    step holds a few, one written rank after rank holds an incarnation. Without ``ranks``, each
    incarnation is held until it ends.
    """
    incarnation_number = 0
    last_incarnation_value: str | None = None
    last_step_of_rank: dict[int, int] = {}
    # The incarnation's windows not handed on, by step, first seen first; each with whether it
    # is the first of an incarnation after the first (a restart).
    open_windows: dict[int, tuple[dict[str, Any], bool]] = {}
    windows = 0
    begins_incarnation = False
    check_every = max(64, len(ranks or ()))  # a closing check looks at every rank once
    since_check = 0
    for row in rows:
        rank = row.get("rank") or 0
        value = row.get("incarnation")
        step = row["step"]
        restarted = bool(row.get("restart")) or (
            value is not None and last_incarnation_value is not None and value != last_incarnation_value
        )
        rewound = rank in last_step_of_rank and step < last_step_of_rank[rank]
        if (restarted or rewound) and windows:
            yield from (_point(summary, restart, has_skipped) for summary, restart in open_windows.values())
            open_windows.clear()
            incarnation_number += 1
            last_step_of_rank.clear()
            begins_incarnation = True
        last_incarnation_value = value if value is not None else last_incarnation_value
        last_step_of_rank[rank] = step
        record = _record(row)
        if record is None:
            continue
        if step not in open_windows:
            summary = empty_summary(0, str(incarnation_number), windows, record)
            open_windows[step] = (summary, begins_incarnation)
            begins_incarnation = False
            windows += 1
        fold(open_windows[step][0], record)
        since_check += 1
        if ranks is not None and since_check >= check_every:
            since_check = 0
            for closed in list(islice(open_windows, _closed(open_windows, last_step_of_rank, ranks))):
                yield _point(*open_windows.pop(closed), has_skipped)
    yield from (_point(summary, restart, has_skipped) for summary, restart in open_windows.values())


def _closed(
    open_windows: Mapping[int, Any], last_step_of_rank: Mapping[int, int], ranks: Collection[int]
) -> int:
    """How many of the first open windows no later row of the incarnation can reach: those
    before every rank's last step (none while a rank has not logged in the incarnation)."""
    if any(rank not in last_step_of_rank for rank in ranks):
        return 0
    watermark = min(last_step_of_rank[rank] for rank in ranks)
    count = 0
    for step in open_windows:
        if step >= watermark:
            break
        count += 1
    return count


def _point(summary: dict[str, Any], restart: bool, has_skipped: bool) -> StepPoint:
    """A window as the policies' point. A file has no attempt counter, a missing skipped column
    is "not logged", and a file's per-rank losses are not what the trainer reported (no
    normalization audit)."""
    point = point_from_summary(summary, restart=restart)
    return replace(
        point,
        attempt=None,
        skipped=point.skipped if has_skipped else None,
        reported_loss=None,
        naive_loss=None,
    )


def _record(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row as a step record, or ``None`` when it logged no signal at all."""
    if all(row.get(name) is None for name in SIGNALS):
        return None
    loss, tokens = row.get("loss"), row.get("tokens")
    return {
        "step": row["step"],
        "tokens": tokens,
        "loss_sum": loss * tokens if loss is not None and tokens is not None else None,
        "reported_loss": loss,
        "grad_norm": row.get("grad_norm"),
        "lr": row.get("lr"),
        "loss_scale": row.get("loss_scale"),
        "skipped": row.get("skipped"),
        "consumed": row.get("consumed"),
        "time": 0.0,
    }


def load_series(path: Path, mapping: Mapping[str, str], run: str | None) -> LoadedFile:
    """Every series of the file as a tuple of points (for tests and benchmarks: memory grows
    with the file; ``backtest_file`` does not hold the points)."""
    series_file = open_series_file(path, mapping)
    series = [Series(name, tuple(series_file.points(name))) for name in series_file.run_names(run)]
    return LoadedFile(series=series, notes=list(series_file.fields.notes))


@dataclass(frozen=True)
class BacktestReport:
    run: str | None
    result: BacktestResult


def backtest(loaded: LoadedFile, config: SeriesConfig) -> list[BacktestReport]:
    return [BacktestReport(s.run, backtest_series(s.points, config)) for s in loaded.series]


def backtest_file(
    path: Path, mapping: Mapping[str, str], run: str | None, config: SeriesConfig
) -> tuple[list[BacktestReport], list[str]]:
    """The policies over each series of the file as it is read: the reports and the notes."""
    series_file = open_series_file(path, mapping)
    reports = [
        BacktestReport(name, backtest_series(series_file.points(name), config))
        for name in series_file.run_names(run)
    ]
    return reports, list(series_file.fields.notes)


def report_json(reports: list[BacktestReport], notes: list[str], path: Path) -> dict[str, Any]:
    several = len(reports) > 1
    findings, incidents = [], []
    for report in reports:
        tag = {"run": report.run} if several else {}
        for finding, key in report.result.findings:
            findings.append(
                {
                    **tag,
                    "step": finding.step,
                    "kind": finding.kind,
                    "severity": finding.severity.value,
                    "signal": finding.signal,
                    "value": finding.value,
                    "threshold": finding.threshold,
                    "message": finding.message,
                    "incident": key,
                }
            )
        for incident in report.result.incidents:
            view = incident.view
            count = f" ({view.finding_count} findings)" if view.finding_count > 1 else ""
            incidents.append(
                {
                    **tag,
                    "id": view.key,
                    "kind": view.kind,
                    "severity": view.severity.value,
                    "first_step": view.first_step,
                    "last_step": view.last_step,
                    "summary": incident.summary + count,
                }
            )
    return {
        "file": str(path),
        "run": [r.run for r in reports] if several else reports[0].run,
        "steps": sum(r.result.steps for r in reports),
        "findings": findings,
        "incidents": incidents,
        "notes": notes,
    }
