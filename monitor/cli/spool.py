"""``runhealth spool list|send``: what trainers left spooled on disk, and delivering it.

A composition root: the only CLI module that imports collectors code (the trainer side's spool
reader and transport), named as such in the import contracts in pyproject.toml."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from monitor.cli.options import JsonOption
from monitor.cli.render import UserError, out, print_json, table

if TYPE_CHECKING:
    from collectors.leftovers import SendResult

SpoolDirOption = Annotated[
    Path | None,
    typer.Option(
        "--dir", help="The trainers' spool directory (default: $RUNHEALTH_SPOOL_DIR, else ./runhealth-spool)."
    ),
]
SPOOL_COLUMNS = ["run", "file", "kind", "batches", "records", "unreadable", "held", "reasons"]


def spool_directory(directory: Path | None) -> Path:
    chosen = directory or Path(os.environ.get("RUNHEALTH_SPOOL_DIR") or "runhealth-spool")
    if not chosen.is_dir():
        raise UserError(f"no spool directory at {chosen}")
    return chosen


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
    out.print(table(f"Spool {where}", SPOOL_COLUMNS, rows))


def only_run_to_send(where: Path, dead_letters: bool) -> str | None:
    """The one run with something to send, None when there is nothing; several is a user error."""
    from collectors.leftovers import list_spool

    kinds = ("spool", "dead") if dead_letters else ("spool",)
    candidates = sorted({e.run_dir for e in list_spool(where) if e.kind in kinds and not e.held})
    if len(candidates) > 1:
        raise UserError(f"several runs have spooled records ({', '.join(candidates)}): name one with --run")
    return candidates[0] if candidates else None


def service_credentials(url: str | None, token: str | None) -> tuple[str, str]:
    """The service's URL and a token, from the options or else the environment the hooks read."""
    url = url or os.environ.get("RUNHEALTH_URL")
    token = token or os.environ.get("RUNHEALTH_TOKEN")
    if not url or not token:
        raise UserError(
            "spool send needs the service's --url and a --token (or RUNHEALTH_URL, RUNHEALTH_TOKEN)"
        )
    return url, token


def print_sent(result: SendResult) -> None:
    typer.echo(
        f"run {result.run}: {result.replayed} records delivered, {result.dead_lettered} dead-lettered, "
        f"{result.unreadable} unreadable lines skipped, {result.redriven} dead-lettered records resent"
    )
    if result.held:
        typer.echo(f"left to live trainers: {', '.join(result.held)}")


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

    from collectors.leftovers import NotTaken, send_spool
    from collectors.transport import HttpTransport, TransportConfig

    where = spool_directory(directory)
    url, token = service_credentials(url, token)
    if timeout <= 0:
        raise UserError(f"--timeout must be > 0, got {timeout}")
    if run is None:
        run = only_run_to_send(where, dead_letters)
        if run is None:
            typer.echo(f"nothing to send under {where}")
            return
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
        print_sent(result)
    if not result.complete:
        typer.echo(
            "runhealth: records are still spooled (the service stopped taking them); send again", err=True
        )
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="What trainers left spooled on disk: list it, send it.", no_args_is_help=True)
    group.command("list")(spool_list)
    group.command("send")(spool_send)
    app.add_typer(group, name="spool")
