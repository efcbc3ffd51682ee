"""The discovery file: where it sits, its URL, how it is written, read, trusted and removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from monitor.api.discovery import (
    Discovery,
    DiscoveryError,
    discovery_path,
    local_url,
    read_discovery,
    remove_discovery,
    why_not_live,
    write_discovery,
)


def found(path: Path, pid: int) -> Discovery:
    return Discovery("http://127.0.0.1:9", pid, None, str(path), 1000.0)


def test_the_file_sits_beside_an_sqlite_store_only(tmp_path: Path) -> None:
    db = tmp_path / "runhealth.db"
    assert discovery_path(make_url(f"sqlite:///{db}")) == tmp_path / "runhealth.db.service.json"
    assert discovery_path(make_url("postgresql+psycopg2://u@h/db")) is None
    assert discovery_path(make_url("sqlite://")) is None


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:80"),
        ("0.0.0.0", "http://127.0.0.1:80"),
        ("::", "http://127.0.0.1:80"),
        ("::1", "http://[::1]:80"),
        ("10.1.2.3", "http://10.1.2.3:80"),
    ],
)
def test_a_wildcard_address_is_reached_on_loopback(host: str, url: str) -> None:
    assert local_url(host, 80) == url


def test_written_whole_for_this_user_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "x.db.service.json"
    (tmp_path / f".{path.name}.7.tmp").write_text("left over")
    write_discovery(path, found(path, 7))
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["pid"] == 7
    assert read_discovery(path) == found(path, 7)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert read_discovery(tmp_path / "none.json") is None


def test_a_file_others_could_have_written_or_garbled_is_not_believed(tmp_path: Path) -> None:
    path = tmp_path / "x.db.service.json"
    write_discovery(path, found(path, 7))
    path.chmod(0o664)
    with pytest.raises(DiscoveryError, match="open to others: not trusted"):
        read_discovery(path)
    path.chmod(0o600)
    path.write_text("{not json")
    with pytest.raises(DiscoveryError, match="cannot read"):
        read_discovery(path)


def test_removed_only_by_the_process_it_names(tmp_path: Path) -> None:
    path = tmp_path / "x.db.service.json"
    write_discovery(path, found(path, 8))  # a newer serve replaced the file of pid 7
    remove_discovery(path, 7)
    assert path.exists()
    remove_discovery(path, 8)
    assert not path.exists()
    remove_discovery(path, 8)  # gone already: nothing to do, nothing raised


def test_a_dead_pid_or_a_silent_port_is_not_live(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert why_not_live(found(tmp_path, gone.pid)) == f"pid {gone.pid} is not running"
    # this process is alive, but nothing listens on port 9 (discard)
    silent = found(tmp_path, os.getpid())
    assert (why_not_live(silent, timeout_s=0.5) or "").startswith(f"pid {silent.pid} does not answer at")
