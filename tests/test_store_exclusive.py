"""One ``runhealth serve`` per SQLite store: a second one is refused, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from monitor.store.exclusive import StoreInUse, lock_path, sole_service
from tests.collectors_support import REPO, ServeProcess, child_environ


def test_a_second_holder_of_one_sqlite_store_is_refused_naming_the_first(tmp_path: Path) -> None:
    url = URL.create("sqlite", database=str(tmp_path / "store.db"))
    with sole_service(url):
        with pytest.raises(StoreInUse) as refused, sole_service(url):
            pass  # pragma: no cover - refused before the body
        message = str(refused.value)
        assert f"(pid {os.getpid()})" in message and str(tmp_path / "store.db") in message
        assert "\n" not in message
    with sole_service(url):  # given back at the end of the block
        pass


def test_a_database_server_takes_several(tmp_path: Path) -> None:
    url = URL.create("postgresql+psycopg2", host="127.0.0.1", database="runhealth")
    with sole_service(url), sole_service(url):
        pass
    assert not list(tmp_path.iterdir())


def test_a_second_serve_on_one_sqlite_file_exits_2_in_one_line_and_the_first_serves_on(
    tmp_path: Path,
) -> None:
    first = ServeProcess(tmp_path, tmp_path / "store.db")
    first.start()
    try:
        second = subprocess.run(
            [sys.executable, "-m", "monitor", "serve", "--db", str(tmp_path / "store.db"), "--port", "0"],
            env=child_environ(RUNHEALTH_ADMIN_TOKEN="rh_admin_second"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode == 2 and second.stdout == ""
        assert second.stderr.startswith("runhealth: error: another runhealth serve (pid ")
        assert f"already serves {tmp_path / 'store.db'}" in second.stderr and second.stderr.count("\n") == 1
        first.create_run("still-served")  # the first one was not disturbed
    finally:
        first.stop()
    # The lock dies with its holder, whatever way it ends: a SIGKILLed service leaves none.
    killed = ServeProcess(tmp_path, tmp_path / "store.db")
    killed.start()
    killed.kill()
    with sole_service(URL.create("sqlite", database=str(tmp_path / "store.db"))):
        assert lock_path(tmp_path / "store.db").exists()
