"""``runhealth``: the command line. Listing commands take ``--json`` and print one document."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import Engine

from monitor.config import ConfigError, ServiceConfig
from monitor.judge.backtest import BacktestError, backtest, load_series, parse_mapping, report_json
from monitor.recovery.replay_jobs import ReplayError
from monitor.store import migrate, queries
from monitor.store.db import StoreError, create_store_engine, resolve_url
from monitor.store.floats import dumps
from policies.series import SeriesConfig
from policies.spike import SpikeConfig

app = typer.Typer(
    name="runhealth",
    help="Run-health monitor and rollback service for large-model training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="The store's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
runs_app = typer.Typer(help="Runs: list them, or create one and get its token.")
app.add_typer(runs_app, name="runs")
operators_app = typer.Typer(help="Operators who approve or reject proposals.", no_args_is_help=True)
app.add_typer(operators_app, name="operators")
audit_app = typer.Typer(help="The hash-chained audit log.", no_args_is_help=True)
app.add_typer(audit_app, name="audit")
spool_app = typer.Typer(help="What trainers left spooled on disk: list it, send it.", no_args_is_help=True)
app.add_typer(spool_app, name="spool")

# Tables keep their width when piped (to a file, a pager, a log) instead of folding to 80 columns.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="SQLAlchemy URL or SQLite path (default: $RUNHEALTH_DB, else ./runhealth.db)"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
UrlOption = Annotated[
    str | None,
    typer.Option("--url", help="The service (default: $RUNHEALTH_URL, else http://127.0.0.1:8765)."),
]
TokenOption = Annotated[
    str | None, typer.Option("--token", help="Operator token (default: $RUNHEALTH_OPERATOR_TOKEN).")
]


class UserError(Exception):
    """Printed as one line on stderr; the exit status is 2."""


def print_json(document: Any) -> None:
    sys.stdout.write(dumps(document, indent=True).decode() + "\n")


def open_engine(db: str | None, *, must_be_current: bool = True) -> Engine:
    engine = create_store_engine(resolve_url(db, os.environ), create_dir=not must_be_current)
    if must_be_current and not migrate.is_current(engine):
        raise UserError(
            f"the store {engine.url.render_as_string(hide_password=True)} is not at the current "
            "schema (run `runhealth db upgrade`)"
        )
    return engine


@contextmanager
def reading(db: str | None) -> Iterator[sa.Connection]:
    engine = open_engine(db)
    try:
        with engine.connect() as connection:
            yield connection
    finally:
        engine.dispose()


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    view = Table(title=title, title_justify="left")
    for column in columns:
        view.add_column(column)
    for row in rows:
        view.add_row(*["" if value is None else str(value) for value in row])
    return view


def fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return ""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def parse_time(text: str | None) -> float | None:
    """ISO 8601, epoch seconds, or an age like 30m, 2h, 7d (that long ago)."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC).timestamp() - float(text[:-1]) * units[text[-1]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise UserError(f"not a time: {text!r} (use ISO 8601, epoch seconds, or 30m/2h/7d)") from exc
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


@app.command()
def serve(
    db: DbOption = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8765,
    port_file: Annotated[Path | None, typer.Option(help="Write the bound port here.")] = None,
    admin_token_file: Annotated[
        Path | None,
        typer.Option(help="Where the admin token is kept when RUNHEALTH_ADMIN_TOKEN is unset."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Serve the ingest API and /healthz."""
    from monitor.api.server import admin_token_for, bind, prepare_store, uvicorn_server
    from monitor.scheduler import ScheduleConfig, start_scheduler

    config = ServiceConfig.from_environ(os.environ, db=db)
    token_file = admin_token_file or Path(
        f"{resolve_url(db, os.environ).database or 'runhealth'}.admin-token"
    )
    config, written = admin_token_for(config, token_file)
    service = prepare_store(config, os.environ)
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(f"{bound}\n")
        tmp.replace(port_file)
    where = f"admin token in {written}" if written else "admin token from RUNHEALTH_ADMIN_TOKEN"
    typer.echo(f"runhealth serving on http://{host}:{bound} ({where})", err=True)
    scheduler = start_scheduler(service, ScheduleConfig())
    try:
        uvicorn_server(service, log_level).run(sockets=[sock])
    finally:
        scheduler.shutdown(wait=False)
        service.tracing.shutdown()  # exports the spans still queued


@db_app.command("upgrade")
def db_upgrade(
    db: DbOption = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Bring the store to the current schema (creates it when new)."""
    engine = open_engine(db, must_be_current=False)
    migrate.upgrade(engine, revision)
    typer.echo(f"store at revision {migrate.current_revision(engine)}")


@db_app.command("downgrade")
def db_downgrade(revision: str, db: DbOption = None) -> None:
    """Step the store's schema back to REVISION (``base`` removes every table)."""
    engine = open_engine(db, must_be_current=False)
    migrate.downgrade(engine, revision)
    typer.echo(f"store at revision {migrate.current_revision(engine)}")


@db_app.command("current")
def db_current(db: DbOption = None) -> None:
    """Print the store's schema revision and the newest one this version knows."""
    engine = open_engine(db, must_be_current=False)
    typer.echo(f"current {migrate.current_revision(engine)}, head {migrate.head_revision()}")


@runs_app.callback(invoke_without_command=True)
def runs(ctx: typer.Context, db: DbOption = None, as_json: JsonOption = False) -> None:
    """List runs."""
    if ctx.invoked_subcommand is not None:
        return
    with reading(db) as connection:
        rows = queries.list_runs(connection)
    if as_json:
        print_json({"runs": rows})
        return
    out.print(
        table(
            "Runs",
            ["run", "created", "latest step", "windows", "last record", "open incidents"],
            [
                [
                    r["name"],
                    fmt_time(r["created_at"]),
                    r["latest_step"],
                    r["windows"],
                    fmt_time(r["last_record_at"]),
                    r["open_incidents"],
                ]
                for r in rows
            ],
        )
    )


@runs_app.command("create")
def runs_create(name: str, db: DbOption = None, as_json: JsonOption = False) -> None:
    """Create a run and print its ingest token (shown once; only a digest is stored)."""
    engine = open_engine(db)
    try:
        with engine.begin() as connection:
            token = queries.create_run(connection, name)
    except queries.AlreadyExists as exc:
        raise UserError(str(exc)) from exc
    if as_json:
        print_json({"run": name, "token": token})
    else:
        typer.echo(token)


@app.command()
def incidents(
    db: DbOption = None,
    run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind (spike, nonfinite, ...).")] = None,
    severity: Annotated[str | None, typer.Option(help="info, warning or critical.")] = None,
    status: Annotated[str | None, typer.Option(help="open or resolved.")] = None,
    node: Annotated[str | None, typer.Option(help="Only incidents involving this node.")] = None,
    since: Annotated[str | None, typer.Option(help="Opened at or after (ISO, epoch, or 2h).")] = None,
    until: Annotated[str | None, typer.Option(help="Opened at or before.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List incidents, newest last."""
    if severity is not None and severity not in ("info", "warning", "critical"):
        raise UserError(f"--severity must be info, warning or critical, not {severity!r}")
    where = queries.IncidentFilter(
        run=run,
        kind=kind,
        severity=severity,
        status=status,
        node=node,
        since=parse_time(since),
        until=parse_time(until),
    )
    with reading(db) as connection:
        rows = queries.list_incidents(connection, where)
    if as_json:
        print_json({"incidents": rows})
        return
    out.print(
        table(
            "Incidents",
            [
                "id",
                "run",
                "kind",
                "severity",
                "status",
                "first step",
                "last step",
                "opened",
                "summary",
            ],
            [
                [
                    r["id"],
                    r["run"],
                    r["kind"],
                    r["severity"],
                    r["status"],
                    r["first_step"],
                    r["last_step"],
                    fmt_time(r["opened_at"]),
                    r["summary"],
                ]
                for r in rows
            ],
        )
    )


@app.command()
def incident(
    incident_id: Annotated[int, typer.Argument(metavar="ID")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show one incident and its evidence, in order."""
    with reading(db) as connection:
        try:
            found = queries.get_incident(connection, incident_id)
        except queries.NotFound as exc:
            raise UserError(str(exc)) from exc
    if as_json:
        print_json(found)
        return
    out.print(
        f"[bold]Incident {found['id']}[/bold] {found['kind']} ({found['severity']}, {found['status']}) "
        f"run {found['run']}, steps {found['first_step']}..{found['last_step']}"
    )
    out.print(found["summary"])
    if found.get("story"):
        out.print(
            table(
                "Story",
                ["#", "time", "who", "what", "subject", "why"],
                [
                    [e["seq"], fmt_time(e["time"]), e["actor"], e["action"], e["subject"], e["reason"] or ""]
                    for e in found["story"]
                ],
            )
        )
    out.print(
        table(
            "Evidence",
            ["step", "kind", "signal", "severity", "value", "threshold", "rank", "message"],
            [
                [
                    f["step"],
                    f["kind"],
                    f["signal"],
                    f["severity"],
                    _num(f["value"]),
                    _num(f["threshold"]),
                    f["rank"],
                    f["message"],
                ]
                for f in found["evidence"]
            ],
        )
    )


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


@app.command("backtest")
def backtest_command(
    file: Path,
    run: Annotated[str | None, typer.Option(help="Only this run (when the file has a run column).")] = None,
    column: Annotated[
        list[str] | None,
        typer.Option(help="Map a column of the file to a field: SRC=FIELD (repeatable)."),
    ] = None,
    preset: Annotated[
        str,
        typer.Option(help="Spike thresholds: calibrated (default) or authored (median+3sd/50)."),
    ] = "calibrated",
    as_json: JsonOption = False,
) -> None:
    """Run the policies over a recorded series (CSV or JSONL with a step column)."""
    presets: dict[str, Callable[[], SpikeConfig]] = {
        "calibrated": SpikeConfig,
        "authored": SpikeConfig.authored,
    }
    if preset not in presets:
        raise UserError(f"--preset must be one of {', '.join(presets)}, not {preset!r}")
    loaded = load_series(file, parse_mapping(column or []), run)
    reports = backtest(loaded, SeriesConfig(loss_spike=presets[preset]()))
    document = report_json(reports, loaded.notes, file)
    if as_json:
        print_json(document)
        return
    for note in document["notes"]:
        typer.echo(f"note: {note}", err=True)
    several = isinstance(document["run"], list)
    out.print(
        f"{document['steps']} logged steps, {len(document['incidents'])} incidents, {len(document['findings'])} findings"
    )
    out.print(
        table(
            "Incidents",
            (["run"] if several else []) + ["id", "kind", "severity", "first step", "last step", "summary"],
            [
                ([i["run"]] if several else [])
                + [i["id"], i["kind"], i["severity"], i["first_step"], i["last_step"], i["summary"]]
                for i in document["incidents"]
            ],
        )
    )


@app.command()
def export(
    run: str,
    output: Annotated[Path, typer.Option("--out", "-o", help="File to write (.parquet or .csv).")],
    what: Annotated[str, typer.Option(help="steps, records, findings or incidents.")] = "steps",
    db: DbOption = None,
) -> None:
    """Write a run's steps, per-rank records, findings or incident history to Parquet or CSV."""
    from monitor.store.export import EXPORTS, write_export

    if what not in EXPORTS:
        raise UserError(f"--what must be one of {', '.join(EXPORTS)}, not {what!r}")
    if output.suffix.lower() not in (".parquet", ".csv"):
        raise UserError(f"--out {output}: the file name must end in .parquet or .csv")
    with reading(db) as connection:
        try:
            count = write_export(connection, run, what, output)
        except queries.NotFound as exc:
            raise UserError(str(exc)) from exc
    typer.echo(f"wrote {count} {what} rows to {output}")


@app.command()
def demo(
    db: Annotated[
        str | None, typer.Option("--db", help="Store for the demo (default: ./runhealth-demo/runhealth.db).")
    ] = None,
    corrupt_step: Annotated[int, typer.Option(help="The update whose batch (on rank 1) is corrupted.")] = 150,
    as_json: JsonOption = False,
) -> None:
    """Four ranks train a small model on the CPU; a bad batch and a failing device are caught,
    diagnosed, approved from the CLI and recovered from."""
    from monitor.demo import DemoConfig, DemoError, run_demo

    try:
        config = DemoConfig(db=db, corrupt_step=corrupt_step, faulty_from=corrupt_step)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    try:
        result = run_demo(config, out, quiet=as_json)
    except DemoError as exc:
        raise UserError(str(exc)) from exc
    if as_json:
        print_json(result)


def service_url(url: str | None) -> str:
    return (url or os.environ.get("RUNHEALTH_URL") or "http://127.0.0.1:8765").rstrip("/")


def operator_token(token: str | None) -> str:
    found = token or os.environ.get("RUNHEALTH_OPERATOR_TOKEN")
    if not found:
        raise UserError("an operator token is needed: --token or RUNHEALTH_OPERATOR_TOKEN")
    return found


def call_service(method: str, url: str, path: str, token: str, body: dict[str, Any] | None = None) -> Any:
    import httpx

    try:
        response = httpx.request(
            method, url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
    except httpx.HTTPError as exc:
        raise UserError(f"the service at {url} is unreachable: {exc}") from exc
    document = (
        response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    )
    if response.status_code in (401, 403):
        raise UserError(f"refused by the service: {document.get('message', response.status_code)}")
    if response.status_code >= 400 and not (response.status_code == 409 and "proposal" in document):
        raise UserError(document.get("message") or f"the service answered {response.status_code}")
    return document


def proposal_rows(proposals: Sequence[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            p["id"],
            p["run"],
            p["incident"],
            p["status"],
            p["action"],
            f"step {p['target']['step']}" if p["target"]["step"] is not None else "",
            p["data_action"] + (f" {len(p['skip_batches'])} batches" if p["skip_batches"] else ""),
            "/".join(x for x in (p["quarantine"]["node"], p["quarantine"]["device"]) if x) or "",
            p["verdict"],
            p["cost_steps"],
            p["decided_by"] or "",
        ]
        for p in proposals
    ]


PROPOSAL_COLUMNS = [
    "id",
    "run",
    "incident",
    "status",
    "action",
    "rewind to",
    "data",
    "quarantine",
    "verdict",
    "lost steps",
    "decided by",
]


@app.command()
def proposals(
    db: DbOption = None,
    run: Annotated[str | None, typer.Option(help="Only this run.")] = None,
    status: Annotated[
        str | None, typer.Option(help="pending, approved, executing, done, rejected, ...")
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List recovery proposals (from the service with --url, else from the store)."""
    if url or token:
        query = "&".join(f"{k}={v}" for k, v in (("run", run), ("status", status)) if v)
        listed = call_service("GET", service_url(url), f"/v1/proposals?{query}", operator_token(token))[
            "proposals"
        ]
    else:
        from monitor.recovery.decisions import list_proposals

        with reading(db) as connection:
            listed = list_proposals(connection, run, status)
    if as_json:
        print_json({"proposals": listed})
        return
    out.print(table("Proposals", PROPOSAL_COLUMNS, proposal_rows(listed)))


def _decide(
    verb: str, proposal_id: int, reason: str | None, url: str | None, token: str | None, as_json: bool
) -> None:
    document = call_service(
        "POST",
        service_url(url),
        f"/v1/proposals/{proposal_id}/{verb}",
        operator_token(token),
        {"reason": reason},
    )
    if as_json:
        print_json(document)
    else:
        typer.echo(document["message"])
    if not document.get("ok"):
        raise SystemExit(1)


@app.command()
def approve(
    proposal_id: Annotated[int, typer.Argument(metavar="ID")],
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the audit log).")] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Approve a proposal as the operator the token belongs to."""
    _decide("approve", proposal_id, reason, url, token, as_json)


@app.command()
def reject(
    proposal_id: Annotated[int, typer.Argument(metavar="ID")],
    reason: Annotated[str, typer.Option(help="Why (required; recorded in the audit log).")],
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Reject a proposal, with a reason."""
    _decide("reject", proposal_id, reason, url, token, as_json)


@operators_app.command("add")
def operators_add(name: str, db: DbOption = None, as_json: JsonOption = False) -> None:
    """Create an operator and print their token (shown once)."""
    from monitor.store.operators import OperatorError, add_operator

    engine = open_engine(db)
    try:
        with engine.begin() as connection:
            token = add_operator(connection, name, actor=f"cli:{_local_user()}", now=time.time())
    except OperatorError as exc:
        raise UserError(str(exc)) from exc
    if as_json:
        print_json({"operator": name, "token": token})
    else:
        typer.echo(token)


@operators_app.command("revoke")
def operators_revoke(
    name: str, reason: Annotated[str | None, typer.Option(help="Why.")] = None, db: DbOption = None
) -> None:
    """Revoke an operator's token: it can no longer approve or reject."""
    from monitor.store.operators import OperatorError, revoke_operator

    engine = open_engine(db)
    try:
        with engine.begin() as connection:
            revoke_operator(connection, name, actor=f"cli:{_local_user()}", now=time.time(), reason=reason)
    except OperatorError as exc:
        raise UserError(str(exc)) from exc
    typer.echo(f"operator {name} revoked")


@operators_app.command("list")
def operators_list(db: DbOption = None, as_json: JsonOption = False) -> None:
    """List operators."""
    from monitor.store.operators import list_operators

    with reading(db) as connection:
        listed = list_operators(connection)
    if as_json:
        print_json({"operators": listed})
        return
    out.print(
        table(
            "Operators",
            ["name", "created", "revoked"],
            [[o["name"], fmt_time(o["created_at"]), fmt_time(o["revoked_at"])] for o in listed],
        )
    )


def _local_user() -> str:
    import getpass

    return getpass.getuser()


@app.command("checkpoints")
def checkpoints_command(
    run: Annotated[str, typer.Argument(help="The run.")],
    db: DbOption = None,
    validate: Annotated[
        bool, typer.Option(help="Re-check manifests not checked yet (reads the files).")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """List a run's checkpoints: validation, latest-resumable, best-eval, unsafe."""
    from monitor.recovery.checkpoints import registry, validate_pending

    engine = open_engine(db)
    with engine.begin() as connection:
        run_id = int(queries.run_row(connection, run).id)
        if validate:
            validate_pending(connection, time.time(), run_id)
        listed = registry(connection, run_id)
    if as_json:
        print_json({"run": run, "checkpoints": listed})
        return
    out.print(
        table(
            f"Checkpoints of {run}",
            ["id", "step", "consumed", "valid", "tags", "path"],
            [
                [
                    c["id"],
                    c["step"],
                    c["consumed"],
                    {True: "yes", False: "NO", None: "unchecked"}[c["valid"]],
                    ", ".join(
                        t["tag"] + (f" ({t['metric']}={t['value']:.4g})" if "metric" in t else "")
                        for t in c["tags"]
                    ),
                    c["path"],
                ]
                for c in listed
            ],
        )
    )


@app.command()
def replay(
    incident_id: Annotated[int, typer.Argument(metavar="INCIDENT")],
    db: DbOption = None,
    command: Annotated[
        str | None,
        typer.Option(help="Replay entry point with {spec} and {result} (default: the registered one)."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds the replay may take.")] = 3600.0,
    as_json: JsonOption = False,
) -> None:
    """Run the trainer's replay entry point for an incident and record the verdict."""
    from monitor.recovery.replay_verdicts import replay_incident

    engine = open_engine(db)
    result = replay_incident(engine, incident_id, command, timeout, actor=f"cli:{_local_user()}")
    if as_json:
        print_json(result)
    else:
        typer.echo(f"replay of incident {incident_id}: {result['verdict']} ({result['reason']})")
        if result.get("proposal"):
            typer.echo(f"new proposal {result['proposal']}")


@audit_app.command("verify")
def audit_verify(db: DbOption = None, as_json: JsonOption = False) -> None:
    """Check the audit log's hash chain; name the first broken entry."""
    from monitor.store.audit import verify

    with reading(db) as connection:
        checked = verify(connection)
    document = {
        "ok": checked.ok,
        "entries": checked.entries,
        "head": checked.head,
        "broken_seq": checked.broken_seq,
        "problem": checked.problem,
    }
    if as_json:
        print_json(document)
    elif checked.ok:
        typer.echo(f"audit log intact: {checked.entries} entries, head {checked.head}")
    else:
        typer.echo(f"audit log BROKEN at {checked.problem}", err=True)
    if not checked.ok:
        raise SystemExit(1)


SpoolDirOption = Annotated[
    Path | None,
    typer.Option(
        "--dir", help="The trainers' spool directory (default: $RUNHEALTH_SPOOL_DIR, else ./runhealth-spool)."
    ),
]


def spool_directory(directory: Path | None) -> Path:
    chosen = directory or Path(os.environ.get("RUNHEALTH_SPOOL_DIR") or "runhealth-spool")
    if not chosen.is_dir():
        raise UserError(f"no spool directory at {chosen}")
    return chosen


@spool_app.command("list")
def spool_list(directory: SpoolDirOption = None, as_json: JsonOption = False) -> None:
    """List what trainers left spooled: undelivered batches and dead letters.

    Per run and rank file; a file a live trainer holds is marked (it replays its own), and dead
    letters (batches the service called invalid) come with the service's reasons."""
    from collectors.leftovers import list_spool

    where = spool_directory(directory)
    entries = list_spool(where)
    if as_json:
        print_json({"directory": str(where), "files": [asdict(entry) for entry in entries]})
        return
    if not entries:
        typer.echo(f"nothing spooled under {where}")
        return
    rows = [
        [
            e.run_dir,
            e.file,
            e.kind,
            e.batches,
            e.records,
            e.unreadable,
            "yes" if e.held else "",
            "; ".join(e.reasons),
        ]
        for e in entries
    ]
    columns = ["run", "file", "kind", "batches", "records", "unreadable", "held", "reasons"]
    out.print(table(f"Spool {where}", columns, rows))


@spool_app.command("send")
def spool_send(
    run: Annotated[
        str | None, typer.Option(help="The run (default: the only one with something to send).")
    ] = None,
    directory: SpoolDirOption = None,
    url: Annotated[str | None, typer.Option(help="The service (default: $RUNHEALTH_URL).")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="The run's ingest token, or the service's admin token (default: $RUNHEALTH_TOKEN)."
        ),
    ] = None,
    dead_letters: Annotated[
        bool,
        typer.Option("--dead-letters", help="Also resend dead-lettered batches (once the cause is fixed)."),
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to keep trying while the service is down.")] = 30.0,
    as_json: JsonOption = False,
) -> None:
    """Send a run's spooled records to the service.

    For when no trainer will start again to replay them (the next trainer of the run would).
    Each record is stored once by its key, so sending again is safe. Exit status 1 when
    something is still spooled."""
    import socket

    from collectors.leftovers import NotTaken, list_spool, send_spool
    from collectors.transport import HttpTransport, TransportConfig

    where = spool_directory(directory)
    url = url or os.environ.get("RUNHEALTH_URL")
    token = token or os.environ.get("RUNHEALTH_TOKEN")
    if not url or not token:
        raise UserError(
            "spool send needs the service's --url and a --token (or RUNHEALTH_URL, RUNHEALTH_TOKEN)"
        )
    if timeout <= 0:
        raise UserError(f"--timeout must be > 0, got {timeout}")
    if run is None:
        kinds = ("spool", "dead") if dead_letters else ("spool",)
        candidates = sorted({e.run_dir for e in list_spool(where) if e.kind in kinds and not e.held})
        if not candidates:
            typer.echo(f"nothing to send under {where}")
            return
        if len(candidates) > 1:
            raise UserError(
                f"several runs have spooled records ({', '.join(candidates)}): name one with --run"
            )
        run = candidates[0]
    try:
        transport = HttpTransport(TransportConfig(url=url, token=token, run=run))
        name = f"spool-send.{socket.gethostname()}.{os.getpid()}"
        result = send_spool(where, run, transport, name=name, timeout_s=timeout, dead_letters=dead_letters)
    except ValueError as exc:  # the URL
        raise UserError(str(exc)) from exc
    except FileNotFoundError:
        raise  # no spool for that run: already one line
    except OSError as exc:  # the spool's disk limit, a file that cannot be read or removed
        raise UserError(f"the spool under {where}: {exc}") from exc
    except NotTaken as exc:
        typer.echo(f"runhealth: the service did not take records ({exc}); nothing was sent", err=True)
        raise SystemExit(1) from None
    if as_json:
        print_json(asdict(result))
    else:
        typer.echo(
            f"run {result.run}: {result.replayed} records delivered, {result.dead_lettered} dead-lettered, "
            f"{result.unreadable} unreadable lines skipped, {result.redriven} dead-lettered records resent"
        )
        if result.held:
            typer.echo(f"left to live trainers: {', '.join(result.held)}")
    if not result.complete:
        typer.echo(
            "runhealth: records are still spooled (the service stopped taking them); send again", err=True
        )
        raise SystemExit(1)


USER_ERRORS = (
    UserError,
    ReplayError,
    StoreError,
    BacktestError,
    ConfigError,
    queries.NotFound,
    FileNotFoundError,
)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI; a user error is one line on stderr and exit status 2, never a traceback."""
    try:
        # standalone mode: usage errors print click's own message and exit 2
        app(args=list(argv) if argv is not None else None, standalone_mode=True)
    except USER_ERRORS as exc:
        typer.echo(f"runhealth: error: {exc}", err=True)
        raise SystemExit(2) from None
    except sa.exc.OperationalError as exc:
        typer.echo(f"runhealth: error: the store is unavailable: {exc.orig}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
