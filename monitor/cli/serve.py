"""``runhealth serve``: the ingest API, directives, proposals, /metrics and /healthz."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from sqlalchemy.engine import URL

from monitor.api.discovery import Discovery, discovery_path, local_url, remove_discovery, write_discovery
from monitor.cli.options import ConfigOption, DbOption
from monitor.config import ReplicaConfig
from monitor.settings import service_config
from monitor.store.db import resolve_url, sqlite_path
from monitor.store.exclusive import sole_service
from monitor.store.leases import RunLeases

if TYPE_CHECKING:
    from monitor.service import Service


def serve(
    db: DbOption = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8765,
    port_file: Annotated[Path | None, typer.Option(help="Write the bound port here.")] = None,
    admin_token_file: Annotated[
        Path | None,
        typer.Option(help="Where the admin token is kept when RUNHEALTH_ADMIN_TOKEN is unset."),
    ] = None,
    discovery_file: Annotated[
        Path | None,
        typer.Option(
            help="Where a local CLI finds this service (default: <db>.service.json beside an "
            "SQLite store; none for another store unless given)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
    config_file: ConfigOption = None,
) -> None:
    """Serve the ingest API and /healthz."""
    from monitor.api.server import admin_token_for, bind, prepare_store

    config = service_config(os.environ, file=config_file, db=db)
    token_file = admin_token_file or Path(
        f"{resolve_url(db, os.environ).database or 'runhealth'}.admin-token"
    )
    config, written = admin_token_for(config, token_file)
    store = resolve_url(config.db, os.environ)
    with sole_service(store):  # an SQLite store takes one service; PostgreSQL takes replicas
        service = prepare_store(config, os.environ)
        sock = bind(host, port)
        bound = sock.getsockname()[1]
        where = f"admin token in {written}" if written else "admin token from RUNHEALTH_ADMIN_TOKEN"
        typer.echo(f"runhealth serving on http://{host}:{bound} ({where})", err=True)
        found = this_service(local_url(host, bound), written, store)
        _serve(service, sock, port_file, found, discovery_file or discovery_path(store), log_level)


def _serve(
    service: Service,
    sock: socket.socket,
    port_file: Path | None,
    found: Discovery,
    discovery: Path | None,
    log_level: str,
) -> None:
    from monitor import garbage
    from monitor.api.server import uvicorn_server
    from monitor.replicas import ReplicaJudge
    from monitor.scheduler import start_scheduler

    garbage.apply(service.config.garbage)
    bound = sock.getsockname()[1]
    with dying_by_sigterm(), announced(discovery, found):
        # Last, after the discovery file: a launcher that waits for the port file finds
        # everything else in place (a test read the discovery file too early under load).
        if port_file is not None:
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(f"{bound}\n")
            tmp.replace(port_file)
        replica = None
        if service.engine.url.get_backend_name() == "postgresql":
            leases = RunLeases(
                service.engine.url, replica_name(service.config.replicas), service.config.replicas.dead_peer_s
            )
            replica = ReplicaJudge(service, leases, service.config.replicas).start()
        scheduler = start_scheduler(service, service.config.scheduler)
        try:
            uvicorn_server(service, log_level).run(sockets=[sock])
        finally:
            scheduler.shutdown(wait=False)
            if replica is not None:
                replica.stop()  # its runs are judged by the other replicas from now on
            service.tracing.shutdown()  # exports the spans still queued


def replica_name(config: ReplicaConfig) -> str:
    """This replica's name: the configured one, else ``<hostname>:<pid>``."""
    return config.replica_id or f"{socket.gethostname()}:{os.getpid()}"


def this_service(url: str, admin_token_file: Path | None, store: URL) -> Discovery:
    """What the discovery file says of this process."""
    return Discovery(
        url=url,
        pid=os.getpid(),
        admin_token_file=str(admin_token_file.absolute()) if admin_token_file else None,
        db=str(sqlite_path(store) or store.render_as_string(hide_password=True)),
        started_at=time.time(),
    )


@contextmanager
def announced(path: Path | None, found: Discovery) -> Iterator[None]:
    """The discovery file at ``path`` while the body runs (none when ``path`` is None)."""
    if path is None:
        yield
        return
    write_discovery(path, found)
    try:
        yield
    finally:
        remove_discovery(path, found.pid)


class Terminated(BaseException):
    """SIGTERM arrived: unwind the serving code's cleanup, then die by the signal."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def dying_by_sigterm() -> Iterator[None]:
    """uvicorn stops gracefully on SIGTERM and then raises it again under the handler it found:
    the default one ends the process at once, skipping every ``finally`` (the discovery file
    would stay). Under this one the cleanup runs, then the process dies by SIGTERM as before,
    so a supervisor reads the same exit status."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals can only be handled on the main thread
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def register(app: typer.Typer) -> None:
    app.command()(serve)
