"""``runhealth backtest``: load a recorded series (CSV or JSONL) and run the policies over it.

An empty cell is "not logged"; ``nan`` is a NaN. A row with ``restart`` = 1 (or a new
``incarnation`` value, or a step lower than that rank's previous one) begins a new
incarnation. Rows of several ranks at one step are folded into one window exactly as the
live engine folds step records (``monitor.judge.summaries.fold``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from monitor.judge.readings import point_from_summary
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


class BacktestError(ValueError):
    """A file that cannot be backtested as given; the message names the column and row."""


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


def read_table(path: Path) -> pl.DataFrame:
    if not path.is_file():
        raise BacktestError(f"no such file: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            try:
                frame = pl.read_ndjson(path, infer_schema_length=None)
            except pl.exceptions.PolarsError:
                # Python's json writes a NaN as a bare ``NaN`` (and ``Infinity``), which is not
                # JSON and which polars refuses; the stdlib reads it back as the float it was.
                frame = read_jsonl_lines(path)
            # JSON numbers arrive typed; text keeps one parsing path for both formats.
            return frame.select(pl.all().cast(pl.String))
        if suffix in (".csv", ".tsv", ".txt"):
            separator = "\t" if suffix == ".tsv" else ","
            return pl.read_csv(path, infer_schema=False, separator=separator)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise BacktestError(f"cannot read {path}: {exc}") from exc
    raise BacktestError(f"{path}: expected a .csv, .tsv or .jsonl file")


def read_jsonl_lines(path: Path) -> pl.DataFrame:
    """A JSONL file read line by line with the stdlib ``json``, which takes ``NaN``,
    ``Infinity`` and ``-Infinity``; every value as text, as ``read_table`` hands columns on."""
    rows = []
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
            rows.append({str(key): _as_text(value) for key, value in row.items()})
    return pl.DataFrame(rows, schema={key: pl.String for row in rows for key in row})


def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return repr(value)  # int, or float: nan, inf and -inf read back as floats


def _column(frame: pl.DataFrame, name: str, dtype: pl.DataType) -> pl.Series:
    raw = frame[name].cast(pl.String).str.strip_chars()
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
        raise BacktestError(f"column {name!r}, row {row + 1}: {raw[row]!r} is not a valid {dtype} value")
    return converted


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
    ),
    "grad_norm": (
        "grad norm",
        "grad-norm",
        "gradnorm",
        "train/grad_norm",
        "gradient_norm",
        "total_grad_norm",
    ),
    "lr": ("learning_rate", "learning rate", "learning-rate", "train/learning_rate", "train/lr"),
    "loss_scale": ("loss scale", "loss-scale", "train/loss_scale", "grad_scale", "scaler/scale"),
}


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


def normalize(frame: pl.DataFrame, mapping: Mapping[str, str]) -> tuple[pl.DataFrame, list[str]]:
    frame = frame.rename({src: dst for src, dst in mapping.items() if src in frame.columns})
    missing_sources = [
        src for src in mapping if src not in frame.columns and mapping[src] not in frame.columns
    ]
    notes = [f"--column {src}: no such column" for src in missing_sources]
    renames, recognized = recognized_names(frame.columns)
    frame = frame.rename(renames)
    notes += recognized
    if "step" not in frame.columns:
        hints = "".join(f"; {note}" for note in notes if note.startswith("several columns could be step"))
        raise BacktestError(f"the file has no 'step' column (map one with --column SRC=step){hints}")
    ignored = [name for name in frame.columns if name not in FIELDS]
    if ignored:
        notes.append("ignored columns: " + ", ".join(ignored))
    kinds: dict[str, pl.DataType] = {
        **{n: pl.Float64() for n in FLOAT_FIELDS},
        **{n: pl.Int64() for n in INT_FIELDS},
        **{n: pl.Boolean() for n in FLAG_FIELDS},
    }
    columns = []
    for name in FIELDS:
        if name not in frame.columns:
            continue
        if name in TEXT_FIELDS:
            columns.append(frame[name].cast(pl.String).alias(name))
        else:
            columns.append(_column(frame, name, kinds[name]).alias(name))
    table = pl.DataFrame(columns)
    if table["step"].null_count():
        row = int(table["step"].is_null().arg_true()[0])
        raise BacktestError(f"column 'step', row {row + 1}: every row needs a step")
    if not any(name in table.columns for name in SIGNALS):
        hints = "".join(f"; {note}" for note in notes if note.startswith("several columns"))
        raise BacktestError(f"the file has none of the signals {', '.join(SIGNALS)}{hints}")
    return table, notes


def series_points(rows: list[dict[str, Any]], has_skipped: bool) -> Iterator[StepPoint]:
    """Fold rows into one point per (incarnation, step) window, in first-seen order."""
    incarnation_number = 0
    last_incarnation_value: str | None = None
    last_step_of_rank: dict[int, int] = {}
    windows: dict[tuple[int, int], dict[str, Any]] = {}
    for row in rows:
        rank = row.get("rank") or 0
        value = row.get("incarnation")
        step = row["step"]
        restarted = bool(row.get("restart")) or (
            value is not None and last_incarnation_value is not None and value != last_incarnation_value
        )
        rewound = rank in last_step_of_rank and step < last_step_of_rank[rank]
        if (restarted or rewound) and windows:
            incarnation_number += 1
            last_step_of_rank.clear()
        last_incarnation_value = value if value is not None else last_incarnation_value
        last_step_of_rank[rank] = step
        record = _record(row)
        if record is None:
            continue
        key = (incarnation_number, step)
        if key not in windows:
            windows[key] = empty_summary(0, str(incarnation_number), len(windows), record)
        fold(windows[key], record)
    seen: set[int] = set()
    for (number, _), summary in windows.items():
        point = point_from_summary(summary, restart=number not in seen and number > 0)
        # A file has no attempt counter, a missing skipped column is "not logged", and a file's
        # per-rank losses are not what the trainer reported (no normalization audit).
        yield replace(
            point,
            attempt=None,
            skipped=point.skipped if has_skipped else None,
            reported_loss=None,
            naive_loss=None,
        )
        seen.add(number)


def _record(row: dict[str, Any]) -> dict[str, Any] | None:
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
    table, notes = normalize(read_table(path), mapping)
    if "run" in table.columns:
        names = list(dict.fromkeys(table["run"].drop_nulls().to_list()))
        if run is not None:
            if run not in names:
                raise BacktestError(f"no run {run!r} in {path} (runs: {', '.join(names)})")
            names = [run]
        groups = [(name, table.filter(pl.col("run") == name)) for name in names]
    else:
        groups = [(run, table)]
    series = [
        Series(name, tuple(series_points(list(group.iter_rows(named=True)), "skipped" in table.columns)))
        for name, group in groups
    ]
    return LoadedFile(series=series, notes=notes)


@dataclass(frozen=True)
class BacktestReport:
    run: str | None
    result: BacktestResult


def backtest(loaded: LoadedFile, config: SeriesConfig) -> list[BacktestReport]:
    return [BacktestReport(s.run, backtest_series(s.points, config)) for s in loaded.series]


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
