"""The embedded default: with no service URL, the node's local rank 0 runs ``runhealth serve``.

It is a child process (``python -m monitor serve``) on loopback, port 0, over a local SQLite
file, with a freshly generated admin token in its environment; every rank of the node sends with
that token. The hook never imports the service: it only starts it, waits for the port it wrote,
creates the run, and stops it by PID at close, after the node's other ranks said they are done.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from collectors.transport import post_json

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

    ``db``: ``runhealth.db`` in the working directory (``RUNHEALTH_DB``), as ``runhealth serve``
    defaults; it must be on a local disk (the service refuses NFS and Lustre).
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
    """What the node's ranks need: where to send, with which token, where to say done."""

    url: str
    token: str
    done_dir: str


def mark_done(endpoint: Endpoint, rank: int) -> None:
    """This rank has flushed its records; the service may stop once the node's ranks all have."""
    Path(endpoint.done_dir, f"rank-{rank}").touch()


class EmbeddedService:
    def __init__(self, config: EmbeddedConfig, environ: Mapping[str, str]) -> None:
        self._config = config
        self._environ = environ
        self._state = Path(tempfile.mkdtemp(prefix="runhealth-embedded-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._token = ""
        self._port = 0  # 0 until started: a revival keeps the port the node's ranks know
        self._next_revival = 0.0
        self.revivals = 0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log_path(self) -> Path:
        return self._state / "serve.log"

    def start(self, run: str) -> Endpoint:
        token = self._token = f"rh_admin_{secrets.token_urlsafe(24)}"
        self._process = self._spawn(token, 0)
        self._port = self._wait_for_port()
        url = f"http://127.0.0.1:{self._port}"
        self._create_run(url, token, run)
        done_dir = self._state / "done"
        done_dir.mkdir()
        log.info("embedded runhealth service at %s (pid %d, db %s)", url, self.pid, self._config.db)
        return Endpoint(url=url, token=token, done_dir=str(done_dir))

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
            self._process = self._spawn(self._token, self._port)
            self._wait_for_port()
        except (OSError, EmbeddedError) as exc:
            log.error("runhealth: the embedded service did not come back (%s); records stay spooled", exc)
            return False
        return True

    def stop(self, endpoint: Endpoint | None, ranks: int) -> None:
        """Wait (bounded) until ``ranks`` ranks marked done, then stop the child by its PID.
        After a normal run its scratch directory goes too; after a failed start it stays, so
        the log can say why."""
        if endpoint is not None:
            self._wait_for_ranks(Path(endpoint.done_dir), ranks)
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(self._config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(self._config.stop_timeout_s)
        if endpoint is not None:
            shutil.rmtree(self._state, ignore_errors=True)

    def _spawn(self, token: str, port: int) -> subprocess.Popen[bytes]:
        port_file = self._state / "port"
        command = [
            sys.executable,
            "-c",
            CHILD_PROGRAM,
            str(os.getpid()),
            "serve",
            "--db",
            self._config.db,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--port-file",
            str(port_file),
        ]
        environment = {**self._environ, "RUNHEALTH_ADMIN_TOKEN": token}
        with open(self.log_path, "ab") as output:
            return subprocess.Popen(
                command, env=environment, stdin=subprocess.DEVNULL, stdout=output, stderr=output
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
        self.stop(None, 0)
        raise EmbeddedError(
            f"runhealth serve did not start in {self._config.start_timeout_s} s; see {self.log_path}"
        )

    def _create_run(self, url: str, token: str, run: str) -> None:
        """Create the run; 409 means an earlier start of this job created it, which is fine."""
        status, body = post_json(url, "/v1/runs", {"name": run}, token, timeout_s=30.0)
        if status not in (201, 409):
            raise EmbeddedError(f"creating run {run!r} failed: {status} {body[:500]!r}")

    def _wait_for_ranks(self, done_dir: Path, ranks: int) -> None:
        deadline = time.monotonic() + self._config.ranks_timeout_s
        while time.monotonic() < deadline:
            if sum(1 for _ in done_dir.glob("rank-*")) >= ranks:
                return
            time.sleep(0.05)
        log.warning("stopping the embedded service before all %d ranks of the node finished", ranks)
