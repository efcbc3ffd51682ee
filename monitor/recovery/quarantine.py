"""Quarantine actions: a node or device taken out of service through a configured webhook or
command template (a Slurm drain, a Kubernetes cordon), dry-run unless configured live.
Every attempt and its result is recorded, and audited by the caller.

The command template is split first and each argument formatted on its own, never through a
shell: a reason with spaces stays one argument. A node or device name that is not a plain host
or device name (one starting with ``-`` would be read as a flag) is refused where it is used,
whatever ingest let through."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Mapping
from typing import Any

import httpx
from sqlalchemy.engine import Connection

from monitor.recovery.config import ActionConfig
from monitor.store import models

ACTION = models.table_of(models.Action)

# A host name, a Kubernetes node name, a device index, UUID or PCI address: nothing that
# starts with ``-`` or holds a space, a quote, a slash, a glob or a shell character.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")


class Refused(ValueError):
    """A quarantine not carried out: the message says why."""


def command_argv(template: str, fields: Mapping[str, str]) -> list[str]:
    """The command's argv: ``template`` split as a shell would (``shlex``), then each argument
    formatted with ``fields`` on its own, so no value can add, split or join arguments."""
    try:
        return [part.format(**fields) for part in shlex.split(template)]
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise Refused(f"the quarantine command template {template!r} cannot be formatted: {exc!r}") from exc


def check_names(node: str | None, device: str | None) -> None:
    for what, name in (("node", node), ("device", device)):
        if name and not SAFE_NAME.fullmatch(name):
            raise Refused(f"{what} name {name!r} is not a plain name ({SAFE_NAME.pattern}); not passed on")


def quarantine(
    connection: Connection,
    config: ActionConfig,
    *,
    run_id: int,
    run: str,
    proposal_id: int | None,
    node: str | None,
    device: str | None,
    reason: str,
    now: float,
) -> dict[str, Any]:
    fields = {"node": node or "", "device": device or "", "run": run, "reason": reason}
    target = (f"{node or '?'}/{device}" if device else (node or "?"))[:300]  # the column's width
    mode = "live" if config.live and (config.command or config.webhook) else "dry_run"
    argv: list[str] = []
    try:
        if config.command or config.webhook:
            check_names(node, device)
        if config.command:
            argv = command_argv(config.command, fields)
            request = shlex.join(argv)
        elif config.webhook:
            request = f"POST {config.webhook} {fields}"
        else:
            request = "no quarantine action configured (RUNHEALTH_QUARANTINE_COMMAND or _WEBHOOK)"
    except Refused as exc:
        request, status, result = f"refused: {exc}", "refused", {"refused": str(exc)}
    else:
        if mode == "dry_run":
            status, result = "dry_run", {"would_run": request}
        else:
            status, result = _carry_out(config, argv, fields)
    action = {
        "kind": "quarantine",
        "target": target,
        "mode": mode,
        "request": request,
        "status": status,
        "result": result,
    }
    connection.execute(ACTION.insert(), {**action, "run_id": run_id, "proposal_id": proposal_id, "time": now})
    return action


def _carry_out(
    config: ActionConfig, argv: list[str], fields: Mapping[str, str]
) -> tuple[str, dict[str, Any]]:
    try:
        if config.command:
            done = subprocess.run(  # an argv, never a shell
                argv,
                capture_output=True,
                text=True,
                timeout=config.timeout_s,
                check=False,
            )
            result = {
                "returncode": done.returncode,
                "stdout": done.stdout[-4000:],
                "stderr": done.stderr[-4000:],
            }
            return ("done" if done.returncode == 0 else "failed"), result
        assert config.webhook is not None
        response = httpx.post(config.webhook, json=dict(fields), timeout=config.timeout_s)
        return ("done" if response.is_success else "failed"), {
            "status_code": response.status_code,
            "body": response.text[:4000],
        }
    except (OSError, subprocess.SubprocessError, httpx.HTTPError) as exc:
        return "failed", {"error": f"{type(exc).__name__}: {exc}"}
