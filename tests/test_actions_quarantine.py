"""Quarantine actions: the command's argv built from its template without a shell, and names
that could be read as flags refused where they are used."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from monitor.recovery.config import ActionConfig
from monitor.recovery.quarantine import command_argv, quarantine
from monitor.store import models
from tests.support import RunHandle

README_TEMPLATE = "scontrol update nodename={node} state=drain reason={reason}"
REASON = """runhealth incident 7: canary mismatch on "gpu 3"; it's 'bad' $(reboot)"""


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that writes the arguments it was given, as JSON, beside itself."""
    seen = tmp_path / "argv.json"
    script = tmp_path / "scontrol"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(seen)!r}, 'w'))\n"
    )
    script.chmod(0o755)
    return script, seen


def quarantined(
    store: Engine, run: RunHandle, config: ActionConfig, node: str, device: str | None = None
) -> Any:
    with store.begin() as connection:
        action = quarantine(
            connection,
            config,
            run_id=run.id,
            run=run.name,
            proposal_id=None,
            node=node,
            device=device,
            reason=REASON,
            now=1.0,
        )
        stored = connection.execute(sa.select(models.table_of(models.Action))).mappings().one()
    return action, stored


def test_readme_template_gives_one_argument_per_field_whatever_the_reason_holds() -> None:
    fields = {"node": "gpu-node-17", "device": "", "run": "r", "reason": REASON}
    assert command_argv(README_TEMPLATE, fields) == [
        "scontrol",
        "update",
        "nodename=gpu-node-17",
        "state=drain",
        f"reason={REASON}",
    ]
    quoted = 'scontrol update nodename={node} state=drain reason="{reason}"'  # the config docstring's
    assert command_argv(quoted, fields) == command_argv(README_TEMPLATE, fields)


def test_live_command_runs_with_exactly_the_intended_argv(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    script, seen = fake_scontrol(tmp_path)
    template = README_TEMPLATE.replace("scontrol", shlex.quote(str(script)), 1)
    action, stored = quarantined(store, run, ActionConfig(command=template, live=True), "gpu-node-17")
    assert action["status"] == "done", action
    assert json.loads(seen.read_text()) == [
        "update",
        "nodename=gpu-node-17",
        "state=drain",
        f"reason={REASON}",
    ]
    assert shlex.split(stored["request"])[1:] == json.loads(seen.read_text())


@pytest.mark.parametrize(
    ("node", "device"), [("--all", None), ("node-1", "-x"), ("a b", None), ("n;reboot", None)]
)
def test_a_name_that_is_not_plain_is_refused_and_nothing_runs(
    store: Engine, run: RunHandle, tmp_path: Path, node: str, device: str | None
) -> None:
    script, seen = fake_scontrol(tmp_path)
    template = README_TEMPLATE.replace("scontrol", shlex.quote(str(script)), 1)
    action, stored = quarantined(store, run, ActionConfig(command=template, live=True), node, device)
    assert not seen.exists()
    assert (action["status"], stored["status"]) == ("refused", "refused")
    bad = device if device is not None else node
    assert repr(bad) in stored["result"]["refused"] and "not a plain name" in stored["result"]["refused"]


def test_a_refusal_is_recorded_in_dry_run_too(store: Engine, run: RunHandle) -> None:
    action, _stored = quarantined(store, run, ActionConfig(command=README_TEMPLATE), "--all")
    assert (action["mode"], action["status"]) == ("dry_run", "refused")
    assert "would_run" not in action["result"]


def test_a_broken_template_is_refused_not_raised(store: Engine, run: RunHandle) -> None:
    action, _stored = quarantined(store, run, ActionConfig(command="drain {nodename}", live=True), "n1")
    assert action["status"] == "refused" and "cannot be formatted" in action["result"]["refused"]
