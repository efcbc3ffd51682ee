"""Replay jobs: the trainer's registered replay entry point, run for one incident.

The trainer registers a command template in its run-start config (``replay_command``) with
``{spec}`` and ``{result}`` placeholders. ``runhealth replay INCIDENT`` writes the spec (the
checkpoint to start from, the span to replay, the suspect batches and devices), runs the
command, and reads its result:

    {"reproduced": bool, "skip_cleared": bool | null, "devices_differ": bool | null,
     "canary_mismatch": bool | null, "device": str | null, "node": str | null,
     "batches": [ids of the batches whose skipping cleared the fault]}

The evidence is recorded with the verdict the diagnosis policy draws from it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from monitor.store import models
from policies.diagnosis import Diagnosis, Evidence, diagnose

REPLAY = models.table_of(models.Replay)
INCARNATION = models.table_of(models.Incarnation)


class ReplayError(Exception):
    pass


def registered_command(connection: Connection, run_id: int) -> str | None:
    configs = connection.execute(
        sa.select(INCARNATION.c.config)
        .where(INCARNATION.c.run_id == run_id)
        .order_by(INCARNATION.c.id.desc())
    ).scalars()
    for config in configs:
        if config and config.get("replay_command"):
            return str(config["replay_command"])
    return None


def evidence_of(result: dict[str, Any]) -> Evidence:
    return Evidence(
        canary_mismatch=result.get("canary_mismatch"),
        devices_differ=result.get("devices_differ"),
        replay_reproduced=result.get("reproduced"),
        skip_cleared=result.get("skip_cleared"),
        suspect_device=result.get("device"),
        suspect_node=result.get("node"),
        suspect_batches=tuple(str(b) for b in result.get("batches") or ()),
    )


def run_replay(command: str, spec: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], str]:
    """Run the entry point on a spec; returns its result document and its output tail."""
    with tempfile.TemporaryDirectory(prefix="runhealth-replay-") as workdir:
        spec_file, result_file = Path(workdir, "spec.json"), Path(workdir, "result.json")
        spec_file.write_text(json.dumps(spec))
        argv = shlex.split(
            command.format(spec=shlex.quote(str(spec_file)), result=shlex.quote(str(result_file)))
        )
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ReplayError(f"the replay command failed to run: {exc}") from exc
        output = (done.stdout + done.stderr)[-8000:]
        if done.returncode != 0 or not result_file.exists():
            raise ReplayError(
                f"the replay command exited {done.returncode} without a result: {output[-500:]}"
            )
        return json.loads(result_file.read_text()), output


def record_replay(
    connection: Connection,
    run_id: int,
    incident_id: int,
    command: str,
    spec: dict[str, Any],
    result: dict[str, Any] | None,
    output: str,
    started: float,
    finished: float,
) -> Diagnosis | None:
    diagnosis = diagnose(evidence_of(result)) if result is not None else None
    connection.execute(
        REPLAY.insert(),
        {
            "run_id": run_id,
            "incident_id": incident_id,
            "status": "done" if result is not None else "failed",
            "command": command,
            "spec": spec,
            "evidence": result,
            "verdict": diagnosis.verdict.value if diagnosis else None,
            "started_at": started,
            "finished_at": finished,
            "output": output,
        },
    )
    return diagnosis


def latest_evidence(connection: Connection, incident_id: int) -> Evidence:
    """All replay evidence for an incident, newest result winning field by field."""
    merged: dict[str, Any] = {}
    rows = connection.execute(
        sa.select(REPLAY.c.evidence)
        .where(REPLAY.c.incident_id == incident_id, REPLAY.c.status == "done")
        .order_by(REPLAY.c.id)
    ).scalars()
    for evidence in rows:
        merged.update({k: v for k, v in (evidence or {}).items() if v is not None})
    return evidence_of(merged)
