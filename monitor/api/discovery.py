"""How a CLI on the same machine finds a running service: a discovery file beside its store.

``runhealth serve`` over an SQLite file writes ``<db>.service.json`` once its socket is bound (so
the port is the real one, even for ``--port 0``) and removes it at exit; ``runhealth approve
--db`` reads it to decide over HTTP with the admin token. The file is 0600: it says where that
token is kept."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL

from monitor.store.db import sqlite_path

SUFFIX = ".service.json"
# A service answers /healthz in milliseconds; one busy for longer is treated as gone.
HEALTH_TIMEOUT_S = 2.0
# Addresses that listen on every interface: a local client reaches the service on loopback.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class DiscoveryError(Exception):
    """A discovery file that is there but cannot be read as one."""


@dataclass(frozen=True)
class Discovery:
    """What a serving process says about itself (``admin_token_file`` None: the admin token
    came from RUNHEALTH_ADMIN_TOKEN, so no file holds it)."""

    url: str
    pid: int
    admin_token_file: str | None
    db: str
    started_at: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def discovery_path(url: URL) -> Path | None:
    """``<db>.service.json`` beside an SQLite store; None for a store that is not a file."""
    path = sqlite_path(url)
    return None if path is None else path.with_name(path.name + SUFFIX)


def local_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a service bound to ``host``:``port`` at."""
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write_discovery(path: Path, found: Discovery) -> None:
    """Written whole or not at all (a temporary file replaces it), readable by this user only."""
    tmp = path.with_name(f".{path.name}.{found.pid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # a leftover temporary file keeps its old mode
        json.dump(found.as_json(), handle)
        handle.write("\n")
    tmp.replace(path)


def read_discovery(path: Path) -> Discovery | None:
    """The file's service, or None when there is no file. Only this user's own 0600 file is
    believed: the CLI sends the admin token it names to the URL it names."""
    try:
        with path.open() as handle:
            untrusted = _untrusted(os.fstat(handle.fileno()))
            if untrusted:
                raise DiscoveryError(f"the discovery file {path} is {untrusted}: not trusted")
            document = json.load(handle)
        return Discovery(
            url=str(document["url"]).rstrip("/"),
            pid=int(document["pid"]),
            admin_token_file=document.get("admin_token_file"),
            db=str(document.get("db", "")),
            started_at=float(document.get("started_at", 0.0)),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DiscoveryError(f"cannot read the discovery file {path}: {exc}") from exc


def _untrusted(status: os.stat_result) -> str | None:
    if status.st_uid != os.getuid():
        return f"owned by uid {status.st_uid}, not this user ({os.getuid()})"
    if stat.S_IMODE(status.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(status.st_mode):04o}, open to others"
    return None


def remove_discovery(path: Path, pid: int) -> None:
    """Remove the file if it still names ``pid``: a newer serve of the same store may have
    replaced it, and its file must stay. Never raises: this runs as the service exits."""
    try:
        found = read_discovery(path)
        if found is not None and found.pid == pid:
            path.unlink(missing_ok=True)
    except (DiscoveryError, OSError):
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and healthz says whether it serves
        return True
    return True


def why_not_live(found: Discovery, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when the service runs and answers /healthz; else what is wrong, for one line."""
    import httpx

    if not pid_alive(found.pid):
        return f"pid {found.pid} is not running"
    try:
        response = httpx.get(f"{found.url}/healthz", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"pid {found.pid} does not answer at {found.url} ({type(exc).__name__})"
    if response.status_code != 200:
        return f"pid {found.pid} answers {response.status_code} at {found.url}/healthz"
    return None
