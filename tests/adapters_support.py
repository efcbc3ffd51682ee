"""Helpers for the framework-adapter tests: a hook that sends to a real ``runhealth serve``,
reads of what the service stored for one run, and an in-process transport that hands the hook
a rollback directive."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from collectors import HookConfig, RunHealth, RunHealthConfig
from collectors.directives import DirectiveConfig
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.transport import TransportConfig
from tests.collectors_support import (
    REPO,
    RecordingTransport,
    ServeProcess,
    child_environ,
    step_rows,
    store_engine,
    wait_until,
)


def hook_for(serve: ServeProcess, run: str, root: Path) -> RunHealth:
    """A hook for a new run on ``serve``, flushing every 50 ms, with an empty environment (no
    launcher variables: one rank)."""
    token = serve.create_run(run)
    config = RunHealthConfig(
        transport=TransportConfig(url=serve.url, token=token, run=run),
        spool=SpoolConfig(directory=str(root / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0),
    )
    return RunHealth(config=config, environ={}, hostname=lambda: "node-a")


JSON_COLUMNS = ("manifest", "restored", "tags", "metrics", "sample_ids", "ranks", "nodes", "devices")


def run_rows(db: Path | sa.URL, table: str, run: str) -> list[dict[str, Any]]:
    """The rows of ``table`` that belong to ``run``, in insertion order, JSON columns decoded."""
    query = f"SELECT t.* FROM {table} t JOIN runs r ON r.id = t.run_id WHERE r.name = :run ORDER BY t.id"
    engine = store_engine(db)
    try:
        with engine.connect() as connection:
            rows = [dict(row._mapping) for row in connection.execute(sa.text(query), {"run": run})]
    finally:
        engine.dispose()
    return [decoded(row) for row in rows]


def decoded(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its JSON columns parsed (raw SQL on SQLite hands them over as text)."""
    return {name: json.loads(value) if name in JSON_COLUMNS and isinstance(value, str) else value
            for name, value in row.items()}  # fmt: skip


def stored_steps(serve: ServeProcess, run: str, count: int) -> list[dict[str, Any]]:
    """The run's step records once ``count`` have landed (ordered by incarnation arrival, then
    attempt)."""
    assert wait_until(lambda: len(step_rows(serve.db, run)) >= count, 30), serve.log_tail()
    rows = [decoded(row) for row in step_rows(serve.db, run)]
    first_seen: dict[str, int] = {}
    for row in sorted(rows, key=lambda row: row["id"]):
        first_seen.setdefault(row["incarnation"], row["id"])
    return sorted(rows, key=lambda row: (first_seen[row["incarnation"]], row["attempt"]))


def stored(serve: ServeProcess, table: str, run: str, count: int) -> list[dict[str, Any]]:
    assert wait_until(lambda: len(run_rows(serve.db, table, run)) >= count, 30), serve.log_tail()
    return run_rows(serve.db, table, run)


def assert_manifest_matches(root: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest names exists under ``root`` with its size and sha256."""
    assert manifest["files"]
    for entry in manifest["files"]:
        path = root / entry["path"]
        assert path.stat().st_size == entry["size"], entry["path"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], entry["path"]


ROLLBACK = {
    "id": 7,
    "kind": "rollback",
    "act_at_step": 2,
    "payload": {"checkpoint_path": "/checkpoints/step-1", "checkpoint_step": 1, "skip_batches": [3]},
}


class DirectingTransport(RecordingTransport):
    """Records in-process, and answers the directive poll with one rollback at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = 0

    def directives(self, incarnation: str, rank: int) -> list[dict[str, Any]]:
        self.polls += 1
        return [ROLLBACK]


def directed_hook(transport: DirectingTransport, root: Path) -> RunHealth:
    """A hook that polls every 50 ms and agrees on directives at every window boundary."""
    config = RunHealthConfig(
        transport=TransportConfig(run="directed"),
        spool=SpoolConfig(directory=str(root / "spool")),
        sender=SenderConfig(flush_interval_s=0.05, heartbeat_interval_s=60.0),
        hook=HookConfig(agree_every=1),
        directives=DirectiveConfig(poll_interval_s=0.05),
    )
    return RunHealth(config=config, transport=transport, environ={}, hostname=lambda: "node-a")


def wait_until_armed(transport: DirectingTransport) -> None:
    """Two polls answered: the first one's directive is armed (the sender thread arms it before
    it polls again)."""
    assert wait_until(lambda: transport.polls >= 2, 10)


def import_message_without(framework: str, adapter: str) -> str:
    """What importing ``adapter`` prints as its ImportError in a fresh interpreter where
    ``framework`` cannot be imported (``import collectors`` itself must still work)."""
    code = (
        f"import sys; sys.modules[{framework!r}] = None\n"
        "import collectors\n"
        f"try:\n    import {adapter}\nexcept ImportError as exc:\n    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_environ(),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout
