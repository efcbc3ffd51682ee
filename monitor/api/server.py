"""Running the service: opening the store, the admin token, and uvicorn on a socket."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import uvicorn

from monitor.api.routes import create_app
from monitor.config import ServiceConfig
from monitor.errors import ConfigError
from monitor.observe.tracing import Tracing
from monitor.service import Service
from monitor.store import audit, migrate
from monitor.store.db import StoreError, create_store_engine, resolve_url, sqlite_path
from monitor.store.tokens import new_token


def prepare_store(config: ServiceConfig, environ: Mapping[str, str]) -> Service:
    """Open the store and bring an SQLite file to the current schema.

    SQLite is the embedded default, so it is upgraded in place; a shared PostgreSQL store is
    upgraded only by ``runhealth db upgrade``, on purpose, by whoever runs the service.
    """
    url = resolve_url(config.db, environ)
    engine = create_store_engine(url)
    if not migrate.is_current(engine):
        if sqlite_path(url) is None and url.get_backend_name() != "sqlite":
            raise StoreError(
                f"the store at {url.render_as_string(hide_password=True)} is not at the current "
                "schema: run `runhealth db upgrade` first"
            )
        migrate.upgrade(engine)
    audit.attach(engine, environ, check=True)  # a missing or open audit key stops the start here
    # Tracing is off unless the OTEL_* variables configure an exporter.
    return Service(engine, config, tracing=Tracing.from_environ(environ))


def admin_token_for(config: ServiceConfig, token_file: Path) -> tuple[ServiceConfig, Path | None]:
    """Use RUNHEALTH_ADMIN_TOKEN when set; otherwise keep one in a 0600 file. An existing file
    that others may read (or write) is refused, not used: its token is no secret any more."""
    if config.admin_token is not None:
        return config, None
    if token_file.exists():
        loose = stat.S_IMODE(token_file.stat().st_mode) & ~0o600
        if loose:
            raise ConfigError(
                f"refusing the admin token file {token_file}: its mode "
                f"{stat.S_IMODE(token_file.stat().st_mode):04o} lets others read or change it; "
                f"chmod 600 it (and replace the token if it may have leaked)"
            )
        token = token_file.read_text().strip()
    else:
        token = new_token("rh_admin")
        token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
    return replace(config, admin_token=token), token_file


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol named, not 0: asyncio turns Nagle's algorithm off only on sockets whose
    # ``proto`` says TCP, and with it on every kept-alive request waited ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def uvicorn_server(service: Service, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(create_app(service), log_level=log_level, access_log=False, lifespan="off")
    return uvicorn.Server(config)


class BackgroundServer:
    """The service on a loopback socket in a thread of this process (demo and tests)."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn_server(service)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the service failed to start")
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
