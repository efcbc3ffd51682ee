"""``runhealth export``: a run's history as Parquet or CSV, for the tools people already use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
from sqlalchemy.engine import Connection

from monitor.store import queries

EXPORTS = ("steps", "records", "findings", "incidents")


def _rows(connection: Connection, run: str, what: str) -> list[dict[str, Any]]:
    run_id = int(queries.run_row(connection, run).id)
    if what == "steps":
        return queries.list_steps(connection, run_id, None, None, limit=10**9)
    if what == "records":
        return queries.step_records(connection, run_id)
    if what == "findings":
        return queries.list_findings(connection, run_id, limit=10**9)
    return queries.list_incidents(connection, queries.IncidentFilter(run=run), limit=10**9)


def _frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    if not rows:
        return pl.DataFrame()
    # Lists and dicts (sample ids, evidence) become JSON text: one flat table, any tool.
    from monitor.store.floats import dumps_str

    flat = [{k: dumps_str(v) if isinstance(v, dict | list) else v for k, v in row.items()} for row in rows]
    return pl.DataFrame(flat, infer_schema_length=None, nan_to_null=False)


def write_export(connection: Connection, run: str, what: str, output: Path) -> int:
    frame = _frame(_rows(connection, run, what))
    output.parent.mkdir(parents=True, exist_ok=True)
    suffix = output.suffix.lower()
    if suffix == ".parquet":
        frame.write_parquet(output)
    elif suffix == ".csv":
        # NaN stays "NaN" and an empty cell stays "not logged", as backtest reads them.
        frame.write_csv(output, float_precision=None)
    else:
        raise ValueError(f"{output}: the file name must end in .parquet or .csv")  # checked by the CLI
    return frame.height
