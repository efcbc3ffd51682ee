"""``runhealth serve``: the ingest API, directives, proposals, /metrics and /healthz."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from monitor.cli.options import ConfigOption, DbOption
from monitor.settings import service_config
from monitor.store.db import resolve_url


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
    config_file: ConfigOption = None,
) -> None:
    """Serve the ingest API and /healthz."""
    from monitor.api.server import admin_token_for, bind, prepare_store, uvicorn_server
    from monitor.scheduler import start_scheduler

    config = service_config(os.environ, file=config_file, db=db)
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
    scheduler = start_scheduler(service, config.scheduler)
    try:
        uvicorn_server(service, log_level).run(sockets=[sock])
    finally:
        scheduler.shutdown(wait=False)
        service.tracing.shutdown()  # exports the spans still queued


def register(app: typer.Typer) -> None:
    app.command()(serve)
