"""``runhealth approve|reject ID --db``: as this OS user, through the store's running service
(found by its discovery file) or on the store itself, with the same answer and audit entry;
``proposals`` and ``incidents`` with ``--db``. A real ``runhealth serve`` subprocess over an
SQLite file in the test's directory, stopped by its PID."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from sqlalchemy.engine import Engine

from monitor.api.discovery import Discovery, read_discovery, write_discovery
from monitor.cli import proposals as proposals_cli
from monitor.service import Service
from monitor.store import audit
from monitor.store.operators import add_operator
from tests.support import RunHandle, cli_result, make_run
from tests.test_decisions import spiked_run

ROOT = Path(__file__).resolve().parent.parent
LOCAL_USER = f"local:{getpass.getuser()}"


class Serving:
    """``runhealth serve --db DB --port 0``, its admin token kept in ``<db>.admin-token``."""

    def __init__(self, db: Path, *extra: str) -> None:
        self.db = db
        self.port_file = db.parent / "port"
        self.log = db.parent / "serve.log"
        self.port_file.unlink(missing_ok=True)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("RUNHEALTH_")}
        command = [sys.executable, "-m", "monitor", "serve", "--db", str(db), "--port", "0",
                   "--port-file", str(self.port_file), *extra]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, env=environ, cwd=ROOT, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while not self.port_file.exists():
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"

    def stop(self) -> int:
        """SIGTERM by PID (SIGKILL after 15 s); the exit status."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


@pytest.fixture
def db(store: Engine) -> Path:
    assert store.url.database is not None
    return Path(store.url.database)


@pytest.fixture
def local_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """No operator or admin token in the CLI's environment: it decides as this OS user."""
    for name in ("RUNHEALTH_OPERATOR_TOKEN", "RUNHEALTH_ADMIN_TOKEN", "RUNHEALTH_URL", "RUNHEALTH_DB"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def serving(db: Path) -> Iterator[Serving]:
    server = Serving(db)
    try:
        yield server
    finally:
        server.stop()


def second_proposal(service: Service, store: Engine, tmp_path: Path) -> dict[str, Any]:
    """The same spiked run again under another name: a second pending proposal in the store."""
    (tmp_path / "b").mkdir()
    return spiked_run(service, make_run(store, "run-b"), tmp_path / "b")


def not_while_serving(*_args: object) -> NoReturn:
    raise AssertionError("decided on the store while the service runs")


def story(store: Engine, incident: int) -> list[tuple[str, str, str | None]]:
    with store.connect() as connection:
        return [(e["actor"], e["action"], e["reason"]) for e in audit.story(connection, incident)]


def test_serve_writes_its_discovery_file_and_removes_it_at_sigterm(db: Path) -> None:
    server = Serving(db)
    try:
        path = db.with_name(db.name + ".service.json")
        assert path.stat().st_mode & 0o777 == 0o600
        found = read_discovery(path)
        assert found is not None
        assert (found.url, found.pid, found.db) == (server.url, server.process.pid, str(db))
        assert found.admin_token_file == str(db.with_name(db.name + ".admin-token"))
        assert abs(found.started_at - time.time()) < 120
    finally:
        status = server.stop()
    assert status == -signal.SIGTERM  # it still dies by the signal, after its cleanup
    assert not path.exists()


def test_a_wildcard_host_is_found_on_loopback_in_the_named_discovery_file(db: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "discovery" / "service.json"
    elsewhere.parent.mkdir()
    server = Serving(db, "--host", "0.0.0.0", "--discovery-file", str(elsewhere))
    try:
        found = read_discovery(elsewhere)
        assert found is not None and found.url == server.url  # 127.0.0.1, the port bound
        assert not db.with_name(db.name + ".service.json").exists()
    finally:
        server.stop()
    assert not elsewhere.exists()


def test_approve_through_the_live_service_then_on_the_store_reads_the_same(
    service: Service,
    store: Engine,
    run: RunHandle,
    db: Path,
    tmp_path: Path,
    local_cli: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = spiked_run(service, run, tmp_path)
    second = second_proposal(service, store, tmp_path)
    server = Serving(db)
    try:
        with monkeypatch.context() as patched:  # proof that the live service decided this one
            patched.setattr(proposals_cli, "decide_on_store", not_while_serving)
            live = cli_result(
                capsys, "approve", str(first["id"]), "--db", str(db), "--reason", "go", "--json"
            )
    finally:
        server.stop()
    direct = cli_result(capsys, "approve", str(second["id"]), "--db", str(db), "--reason", "go", "--json")
    for (code, out, err), proposal in ((live, first), (direct, second)):
        assert (code, err) == (0, ""), err
        answer = json.loads(out)
        assert answer["ok"] and answer["message"] == f"proposal {proposal['id']} approved by {LOCAL_USER}"
        decided = answer["proposal"]
        assert (decided["status"], decided["decided_by"], decided["target"]["step"]) == (
            "executing",
            LOCAL_USER,
            20,
        )
        assert [(actor, action) for actor, action, _ in story(store, proposal["incident"])] == [
            ("engine", "incident_opened"),
            ("engine", "proposed"),
            (LOCAL_USER, "approved"),
            (LOCAL_USER, "directive"),
        ]
    # the same document but for what names the proposal, its run and when
    varying = {"id", "run", "incident", "directive", "created_at", "decided_at", "evidence", "target"}
    live_view, direct_view = (json.loads(out)["proposal"] for _, out, _ in (live, direct))
    assert list(live_view) == list(direct_view)
    assert {k: v for k, v in live_view.items() if k not in varying} == {
        k: v for k, v in direct_view.items() if k not in varying
    }
    code, out, err = cli_result(capsys, "approve", str(second["id"]), "--db", str(db))
    assert (code, out.strip()) == (
        1,
        f"cannot approve proposal {second['id']}: it is already executing by {LOCAL_USER}",
    )


@pytest.mark.parametrize("live", [True, False], ids=["live", "direct"])
def test_reject_needs_a_reason_and_is_recorded_as_the_local_user(
    service: Service,
    run: RunHandle,
    db: Path,
    tmp_path: Path,
    local_cli: None,
    capsys: pytest.CaptureFixture[str],
    live: bool,
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    server = Serving(db) if live else None
    try:
        code, _, err = cli_result(capsys, "reject", str(proposal["id"]), "--db", str(db))
        assert code == 2 and "--reason" in err  # a required option
        code, _, err = cli_result(capsys, "reject", str(proposal["id"]), "--db", str(db), "--reason", " ")
        assert (code, err) == (2, "runhealth: error: a rejection needs a reason\n")
        code, out, err = cli_result(
            capsys, "reject", str(proposal["id"]), "--db", str(db), "--reason", "known bad shard"
        )
        assert (code, out, err) == (0, f"proposal {proposal['id']} rejected by {LOCAL_USER}\n", "")
        code, _, err = cli_result(capsys, "approve", "999", "--db", str(db))
        assert (code, err) == (2, "runhealth: error: no proposal 999\n")
    finally:
        if server is not None:
            server.stop()
    assert (LOCAL_USER, "rejected", "known bad shard") in story(service.engine, proposal["incident"])


def test_a_stale_discovery_file_is_said_once_and_the_store_decides(
    service: Service,
    run: RunHandle,
    db: Path,
    tmp_path: Path,
    local_cli: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = db.with_name(db.name + ".service.json")
    write_discovery(path, Discovery("http://127.0.0.1:9", gone.pid, None, str(db), time.time()))
    code, out, err = cli_result(capsys, "approve", str(proposal["id"]), "--db", str(db))
    assert (code, out) == (0, f"proposal {proposal['id']} approved by {LOCAL_USER}\n")
    assert err == f"runhealth: {path}: pid {gone.pid} is not running; deciding on the store directly\n"
    assert (LOCAL_USER, "approved", None) in story(service.engine, proposal["incident"])


def test_what_the_cli_cannot_use_is_one_line(
    service: Service,
    run: RunHandle,
    db: Path,
    tmp_path: Path,
    serving: Serving,
    local_cli: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    path = db.with_name(db.name + ".service.json")
    found = read_discovery(path)
    assert found is not None
    no_token = tmp_path / "missing.admin-token"
    write_discovery(path, Discovery(found.url, found.pid, str(no_token), found.db, found.started_at))
    code, _, err = cli_result(capsys, "approve", str(proposal["id"]), "--db", str(db))
    assert (code, err) == (
        2,
        f"runhealth: error: cannot read the admin token in {no_token}: No such file or directory\n",
    )
    write_discovery(path, Discovery(found.url, found.pid, None, found.db, found.started_at))
    code, _, err = cli_result(capsys, "approve", str(proposal["id"]), "--db", str(db))
    assert code == 2 and err.count("\n") == 1 and "RUNHEALTH_ADMIN_TOKEN" in err
    path.chmod(0o644)
    code, _, err = cli_result(capsys, "approve", str(proposal["id"]), "--db", str(db))
    assert code == 2 and err.count("\n") == 1 and "open to others: not trusted" in err
    code, _, err = cli_result(capsys, "approve", "1", "--db", str(db), "--url", serving.url)
    assert code == 2 and "not both" in err
    code, _, err = cli_result(capsys, "approve", "1", "--db", str(tmp_path / "none.db"))
    assert (code, err) == (2, f"runhealth: error: no store at {tmp_path / 'none.db'}\n")
    assert not (tmp_path / "none.db").exists()
    with service.engine.connect() as connection:
        assert [e["action"] for e in audit.story(connection, proposal["incident"])][-1] == "proposed"


def test_an_operator_token_in_the_environment_still_decides_over_http(
    service: Service,
    store: Engine,
    run: RunHandle,
    tmp_path: Path,
    serving: Serving,
    local_cli: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    with store.begin() as connection:
        monkeypatch.setenv(
            "RUNHEALTH_OPERATOR_TOKEN", add_operator(connection, "alice", actor="tests", now=1.0)
        )
    monkeypatch.setenv("RUNHEALTH_URL", serving.url)
    code, out, _ = cli_result(capsys, "approve", str(proposal["id"]))
    assert (code, out) == (0, f"proposal {proposal['id']} approved by alice\n")


def test_listings_read_the_store_named_by_db(
    service: Service,
    run: RunHandle,
    db: Path,
    tmp_path: Path,
    local_cli: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proposal = spiked_run(service, run, tmp_path)
    code, out, _ = cli_result(capsys, "proposals", "--db", str(db), "--json")
    assert code == 0 and [p["id"] for p in json.loads(out)["proposals"]] == [proposal["id"]]
    code, out, _ = cli_result(capsys, "proposals", "--db", str(db))
    assert code == 0 and "Proposals" in out and "pending" in out
    code, out, _ = cli_result(capsys, "incidents", "--db", str(db), "--json")
    assert code == 0 and [i["id"] for i in json.loads(out)["incidents"]] == [proposal["incident"]]
