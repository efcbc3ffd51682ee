"""The embedded default: with no service URL, the job's global rank 0 runs ``runhealth serve``.

One service per job, whatever the number of nodes: every rank of every node sends to it, so one
store holds the whole run and the engine judges each rank against all of its peers. It is a
child process (``python -m monitor serve``) listening on the interface that reaches the job's
rendezvous address (``MASTER_ADDR``; loopback when that is local or unset), port 0, over a local
SQLite file. Its admin token stays in a 0600 file beside the store; the ranks send with the
run's own token, which rank 0 shares with its URL through the job's c10d store
(``collectors.rendezvous``). The hook never imports the service: rank 0 starts it, waits for
the port it wrote, creates the run, and stops it by PID at close, after every rank said it is
done (bounded).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from collectors.transport import post_json

WILDCARDS = ("0.0.0.0", "::")

log = logging.getLogger("runhealth.collectors.embedded")

# The child asks the kernel for SIGTERM when its parent dies (a trainer killed by SIGKILL never
# reaches close()), checks the parent did not die first, then becomes ``python -m monitor``.
CHILD_PROGRAM = """\
import ctypes, os, runpy, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
sys.argv = ["runhealth", *sys.argv[2:]]
runpy.run_module("monitor", run_name="__main__", alter_sys=True)
"""


class EmbeddedError(RuntimeError):
    """The embedded service did not come up; the message says why and where its log is."""


@dataclass(frozen=True)
class EmbeddedConfig:
    """The embedded service.

    ``db``: ``runhealth.db`` in rank 0's working directory (``RUNHEALTH_DB``), as ``runhealth
    serve`` defaults; it must be on a local disk (the service refuses NFS and Lustre).
    ``host``: empty: the address of this node's interface toward ``MASTER_ADDR`` (what the
    job's own rendezvous uses, so every node can reach it), loopback without one. Set it
    (``RUNHEALTH_EMBEDDED__HOST``) to listen elsewhere; ``0.0.0.0`` only when asked for.
    ``start_timeout_s``: 60 s. The child imports FastAPI and SQLAlchemy and migrates a new file:
    2-5 s on an idle machine, much more on a node busy loading a model.
    ``stop_timeout_s``: 10 s between SIGTERM and SIGKILL.
    ``ranks_timeout_s``: 60 s at close for the node's other ranks to finish sending; a rank that
    died keeps its records in its spool for the next start. A failed close does not wait
    (``RunHealth._release_service``).
    ``revive_interval_s``, ``max_revivals``: a child that dies mid-run (killed for memory, a
    crash) is started again on its port, at most once per 10 s and 5 times in a run: a child
    that keeps dying has a reason in its log that restarting will not fix, and the records
    wait in the spools meanwhile.
    """

    db: str = "runhealth.db"
    host: str = ""
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    ranks_timeout_s: float = 60.0
    revive_interval_s: float = 10.0
    max_revivals: int = 5

    def __post_init__(self) -> None:
        if not self.db:
            raise ValueError("EmbeddedConfig.db must not be empty")
        if min(self.start_timeout_s, self.stop_timeout_s, self.ranks_timeout_s, self.revive_interval_s) <= 0:
            raise ValueError(f"EmbeddedConfig timeouts must be > 0: {self}")
        if self.max_revivals < 0:
            raise ValueError(f"EmbeddedConfig.max_revivals must be >= 0, got {self.max_revivals}")


@dataclass(frozen=True)
class Endpoint:
    """What every rank needs: where to send, with which run token."""

    url: str
    token: str


def listen_host(config: EmbeddedConfig, environ: Mapping[str, str]) -> str:
    """Where the service listens: the configured host, else this node's address toward the
    job's rendezvous (``MASTER_ADDR``), else loopback."""
    if config.host:
        return config.host
    master = environ.get("MASTER_ADDR", "").strip()
    return route_to(master, environ.get("MASTER_PORT", "")) if master else "127.0.0.1"


def route_to(address: str, port: str) -> str:
    """The local address the kernel would send from to reach ``address`` (no packet is sent:
    connecting a UDP socket only picks the route). Loopback for a local or unresolvable name."""
    try:
        resolved = socket.getaddrinfo(address, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        if ipaddress.ip_address(resolved).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((resolved, int(port) if port.isdigit() else 29500))
            return str(probe.getsockname()[0])
    except OSError as exc:
        log.warning(
            "runhealth: cannot route to MASTER_ADDR %r (%s); the service listens on loopback", address, exc
        )
        return "127.0.0.1"


def store_path(db: str) -> Path | None:
    """The store's file, absolute, when it is one (not a database URL)."""
    if "://" in db:
        return None
    return Path(db.removeprefix("sqlite:///")).expanduser().resolve()


class EmbeddedService:
    def __init__(self, config: EmbeddedConfig, environ: Mapping[str, str]) -> None:
        self._config = config
        self._environ = environ
        self._state = Path(tempfile.mkdtemp(prefix="runhealth-embedded-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._host = "127.0.0.1"
        self._port = 0  # 0 until started: a revival keeps the port the ranks know
        self.url = ""
        self.started = False
        self._next_revival = 0.0
        self.revivals = 0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log_path(self) -> Path:
        return self._state / "serve.log"

    def start(self, run: str) -> Endpoint:
        host = listen_host(self._config, self._environ)
        self._process = self._spawn(host, 0)
        self._port = self._wait_for_port()
        advertised = (
            route_to(self._environ.get("MASTER_ADDR", "127.0.0.1"), "") if host in WILDCARDS else host
        )
        self.url = f"http://{advertised}:{self._port}"
        token = self._create_run(self.admin_token(), run)
        self.started = True
        log.info("embedded runhealth service at %s (pid %d, db %s)", self.url, self.pid, self._config.db)
        return Endpoint(url=self.url, token=token)

    def admin_token(self) -> str:
        """The service's admin token: the trainer's ``RUNHEALTH_ADMIN_TOKEN``, else the one the
        service keeps in its token file (written before it bound its port)."""
        given = self._environ.get("RUNHEALTH_ADMIN_TOKEN", "").strip()
        return given or self.token_file.read_text().strip()

    @property
    def token_file(self) -> Path:
        """Beside the store, as ``runhealth serve`` keeps it (read by ``runhealth approve --db``
        through the discovery file); in the scratch directory for a database URL."""
        path = store_path(self._config.db)
        return Path(f"{path}.admin-token") if path is not None else self._state / "admin-token"

    def revive(self) -> bool:
        """Called each sender cycle by the rank that runs the service: a child that died
        mid-run is started again on the same port with the same token, so the node's ranks,
        which know only that address, reconnect and replay their spools. True when it did."""
        process = self._process
        if process is None or process.poll() is None or not self._port:
            return False
        now = time.monotonic()
        if now < self._next_revival or self.revivals >= self._config.max_revivals:
            return False
        self._next_revival = now + self._config.revive_interval_s
        self.revivals += 1
        log.warning(
            "runhealth: the embedded service (pid %d) exited with status %s; starting it again on port %d",
            process.pid,
            process.returncode,
            self._port,
        )
        (self._state / "port").unlink(missing_ok=True)
        try:
            self._process = self._spawn(self._host, self._port)
            self._wait_for_port()
        except (OSError, EmbeddedError) as exc:
            log.error("runhealth: the embedded service did not come back (%s); records stay spooled", exc)
            return False
        return True

    def stop(self, finished: Callable[[], bool] | None) -> None:
        """Wait (bounded) until ``finished`` says every rank is done, then stop the child by its
        PID. After a normal run its scratch directory goes too; after a failed start it stays,
        so the log can say why."""
        if finished is not None:
            self._wait_for_ranks(finished)
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(self._config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(self._config.stop_timeout_s)
        if self.started:
            shutil.rmtree(self._state, ignore_errors=True)

    def _spawn(self, host: str, port: int) -> subprocess.Popen[bytes]:
        self._host = host
        command = [
            sys.executable,
            # Safe path mode (Python 3.11+): without it ``-c`` puts the trainer's working
            # directory first on sys.path, and its own ``monitor/``, ``policies/`` or
            # ``migrations/`` folder would be imported instead of runhealth's. Unlike ``-I`` it
            # keeps the PYTHON* variables and the user site the trainer's environment relies on.
            "-P",
            "-c",
            CHILD_PROGRAM,
            str(os.getpid()),
            "serve",
            "--db",
            self._config.db,
            "--host",
            host,
            "--port",
            str(port),
            "--port-file",
            str(self._state / "port"),
            "--admin-token-file",
            str(self.token_file),
        ]
        with open(self.log_path, "ab") as output:
            return subprocess.Popen(
                command, env=dict(self._environ), stdin=subprocess.DEVNULL, stdout=output, stderr=output
            )

    def _wait_for_port(self) -> int:
        port_file = self._state / "port"
        deadline = time.monotonic() + self._config.start_timeout_s
        assert self._process is not None
        while time.monotonic() < deadline:
            if port_file.exists():
                return int(port_file.read_text().strip())
            if self._process.poll() is not None:
                raise EmbeddedError(f"runhealth serve exited at start; see {self.log_path}")
            time.sleep(0.05)
        self.stop(None)
        raise EmbeddedError(
            f"runhealth serve did not start in {self._config.start_timeout_s} s; see {self.log_path}"
        )

    def _create_run(self, admin: str, run: str) -> str:
        """Create the run and return its token. 409: an earlier start of this job created it;
        the run's token is then renewed (only its digest is stored), and a trainer of that
        earlier start still sending with the old one is refused."""
        status, body = post_json(self.url, "/v1/runs", {"name": run}, admin, timeout_s=30.0)
        if status == 409:
            status, body = post_json(
                self.url, f"/v1/runs/{quote(run, safe='')}/token", {}, admin, timeout_s=30.0
            )
        if status not in (200, 201):
            raise EmbeddedError(f"creating run {run!r} failed: {status} {body[:500]!r}")
        return str(json.loads(body)["token"])

    def _wait_for_ranks(self, finished: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self._config.ranks_timeout_s
        while time.monotonic() < deadline:
            try:
                if finished():
                    return
            except Exception as exc:  # the job's store went away: no peer can say done any more
                log.warning("runhealth: cannot count the ranks that finished (%s)", exc)
                return
            time.sleep(0.05)
        log.warning("runhealth: stopping the embedded service before every rank finished sending")
