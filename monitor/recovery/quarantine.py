"""Quarantine actions: a node or device taken out of service through a configured webhook or
command template (a Slurm drain, a Kubernetes cordon), dry-run unless configured live.
Every attempt and its result is recorded, and audited by the caller."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping
from typing import Any

import httpx
from sqlalchemy.engine import Connection

from monitor.recovery.config import ActionConfig
from monitor.store import models

ACTION = models.table_of(models.Action)


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
    target = f"{node or '?'}/{device}" if device else (node or "?")
    if config.command:
        request = " ".join(shlex.quote(part) for part in shlex.split(config.command.format(**fields)))
    elif config.webhook:
        request = f"POST {config.webhook} {fields}"
    else:
        request = "no quarantine action configured (RUNHEALTH_QUARANTINE_COMMAND or _WEBHOOK)"
    mode = "live" if config.live and (config.command or config.webhook) else "dry_run"
    status, result = ("dry_run", {"would_run": request}) if mode == "dry_run" else _carry_out(config, fields)
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


def _carry_out(config: ActionConfig, fields: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    try:
        if config.command:
            done = subprocess.run(
                shlex.split(config.command.format(**fields)),
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
