"""The real-curve corpus: public loss series with labels, scored case by case.

- The two clean controls (Pythia-410M with five restarts, Megatron 15B) are streams: every
  incident there is a false one, counted per 100,000 steps.
- The BigScience excerpts are short and non-contiguous, so each labeled incident is scored
  on its own rows (its ``incident_id``), not as part of a stream.

Those three files are the ``development`` set. The ``added`` set (``added_cases``) holds series
from other codebases: clean streams scored like the controls, and streams with several labeled
events (``Case.events``), scored event by event on the one stream. The ``heldout`` set
(``heldout_cases``, files and labels under ``heldout/``) is built the same way from codebases in
neither set, and no threshold was set while looking at it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from monitor.judge.backtest import load_series, normalize, series_points
from policies.types import StepPoint

CURVES = Path(__file__).resolve().parent.parent / "tests" / "data" / "real-curves"
BIGSCIENCE = "bigscience_chronicle_excerpts.csv"
# The added set: clean streams (every incident false) and streams with labeled events.
ADDED_CLEAN = ("modded_nanogpt_scaleup1b_clean.csv",)
ADDED_LABELED = ("birdjepa_resume_loss_jumps.csv", "torchtitan_agpt20b_resume_blip.csv")
HELDOUT = CURVES / "heldout"
HELDOUT_CLEAN = (
    "llmc_gpt2_124m_clean.csv",
    "modded_nanogpt_records_sample.csv",
    "hf_whisper_large_v2_ja_clean.csv",
)
HELDOUT_LABELED = ("nanogpt_termux_nan.csv",)


@dataclass(frozen=True)
class Event:
    """One labeled event of a stream: steps ``lo``..``hi`` of one incarnation (the one that
    begins at ``lo`` when the label starts at a restart; any incarnation when ``None``)."""

    kind: str
    positive: bool
    lo: int
    hi: int
    incarnation: str | None


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    positive: bool
    points: tuple[StepPoint, ...]
    label: tuple[int, int] | None
    split: str
    note: str = ""
    set: str = "development"
    events: tuple[Event, ...] = ()


def clean_controls() -> list[Case]:
    cases = []
    for name in ("pythia410m_seed2_clean_with_restarts.csv", "megatron_gpt3_15b_release_h100.csv"):
        (series,) = load_series(CURVES / name, {}, None).series
        cases.append(Case(name, "clean", False, series.points, None, "dev"))
    return cases


def _labels() -> pl.DataFrame:
    labels = pl.read_csv(CURVES / "labels.csv")
    return labels.filter(pl.col("file").str.starts_with(BIGSCIENCE)).with_columns(
        pl.col("file").str.extract(r"run=([^\]]+)").alias("run")
    )


def bigscience_cases() -> list[Case]:
    raw = pl.read_csv(CURVES / BIGSCIENCE, infer_schema=False)
    table, _ = normalize(raw, {})
    table = table.with_columns(raw["incident_id"].alias("incident_id"))
    cases = []
    for label in _labels().iter_rows(named=True):
        rows = table.filter(
            (pl.col("run") == label["run"])
            & (pl.col("step") >= label["step_start"] - 50)
            & (pl.col("step") <= label["step_end"] + 50)
        )
        ids = rows["incident_id"].unique().to_list()
        rows = table.filter(pl.col("incident_id").is_in(ids))  # the whole excerpt of that incident
        points = tuple(series_points(list(rows.iter_rows(named=True)), has_skipped=False))
        cases.append(
            Case(
                name=f"{label['run']}:{ids[0] if ids else '?'}",
                kind=label["kind"],
                positive=bool(label["positive"]),
                points=points,
                label=(label["step_start"], label["step_end"]),
                split="dev",
                note=f"{len(points)} logged rows",
            )
        )
    return cases


def _label_rows(file: str, folder: Path = CURVES) -> pl.DataFrame:
    labels = pl.read_csv(folder / "labels.csv")
    return labels.filter(pl.col("file").str.starts_with(file)).with_columns(
        pl.col("file").str.extract(r"run=([^\]]+)").alias("run")
    )


def _events(points: tuple[StepPoint, ...], labels: pl.DataFrame) -> tuple[Event, ...]:
    starts = {p.step: p.incarnation for p in points if p.restart}
    return tuple(
        Event(
            kind=row["kind"],
            positive=bool(row["positive"]),
            lo=row["step_start"],
            hi=row["step_end"],
            incarnation=starts.get(row["step_start"]),
        )
        for row in labels.iter_rows(named=True)
    )


def added_cases() -> list[Case]:
    return _stream_cases(CURVES, ADDED_CLEAN, ADDED_LABELED, "added", "dev")


def heldout_cases() -> list[Case]:
    return _stream_cases(HELDOUT, HELDOUT_CLEAN, HELDOUT_LABELED, "heldout", "holdout")


def _stream_cases(
    folder: Path, clean: tuple[str, ...], labeled: tuple[str, ...], set_name: str, split: str
) -> list[Case]:
    """Clean streams (every incident false) and labeled streams (``labels.csv`` in ``folder``),
    one case per ``run`` of a file."""
    cases = []
    for name in clean:
        for series in load_series(folder / name, {}, None).series:
            label = f"{name} [run={series.run}]" if series.run else name
            cases.append(Case(label, "clean", False, series.points, None, split, set=set_name))
    for name in labeled:
        labels = _label_rows(name, folder)
        for series in load_series(folder / name, {}, None).series:
            mine = labels.filter(pl.col("run") == series.run) if series.run else labels
            events = _events(series.points, mine)
            label = f"{name} [run={series.run}]" if series.run else name
            cases.append(
                Case(
                    label,
                    "stream",
                    False,
                    series.points,
                    None,
                    split,
                    note=f"{len(events)} labeled events",
                    set=set_name,
                    events=events,
                )
            )
    return cases
