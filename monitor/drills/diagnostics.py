"""Diagnostics and recovery policy (the reference text's fourth drill).

A real ``runhealth serve`` on a temporary SQLite store, the trainer attached to it with the
hook on every rank as the README's recipe does (``RUNHEALTH_URL``, ``RUNHEALTH_TOKEN``,
``RUNHEALTH_RUN``), a nonfinite batch injected on rank 0 and a straggler on the last rank.
Then: runhealth names both (the incident's kind, step and ranks), does not offer the unsafe
state as a recovery point (the rollback target is a checkpoint strictly before the nonfinite
step, none saved at or after it), and proposes the recovery the service is configured for (a
rollback, with the configured automatic response: a hold directive when one is set).
The service's settings come from the drill's environment (``RUNHEALTH_POLICIES__...``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from monitor.drills.context import DrillContext
from monitor.drills.launch import RunFailed
from monitor.recovery.checkpoints import registry
from monitor.settings import service_config
from monitor.store import migrate, models, queries
from monitor.store.db import create_store_engine, resolve_url
from policies.drills import Check

RANKS = 3
STEPS = 50
SAVE_EVERY = 10
NONFINITE_STEP = 45
STRAGGLER_SECONDS = 0.02
DIRECTIVE = models.table_of(models.Directive)


def drill(context: DrillContext, checks: list[Check]) -> None:
    environ = dict(os.environ if context.environ is None else context.environ)
    db = context.workdir / "diagnostics.db"
    engine = create_store_engine(resolve_url(str(db), {}), create_dir=True)
    migrate.upgrade(engine)
    run = f"drill-{uuid.uuid4().hex[:8]}"
    with engine.begin() as connection:
        token = queries.create_run(connection, run)
    serve = _serve(context, db, environ)
    try:
        url = f"http://127.0.0.1:{serve[1]}"
        hooked = {
            **{k: v for k, v in environ.items() if not k.startswith("RUNHEALTH_")},
            "RUNHEALTH_URL": url,
            "RUNHEALTH_TOKEN": token,
            "RUNHEALTH_RUN": run,
            "RUNHEALTH_SPOOL_DIR": str(context.directory("spool")),
        }
        straggler = RANKS - 1
        fields = {
            "steps": STEPS,
            "checkpoint_dir": context.directory("checkpoints"),
            "save_every": SAVE_EVERY,
            "nonfinite_step": NONFINITE_STEP,
            "straggler_rank": straggler,
            "straggler_seconds": STRAGGLER_SECONDS,
        }
        job = context.start("hooked", fields, nproc=RANKS, environ=hooked)
        finished = job.wait(context.timeout_s)
        if any(code != 0 for code in finished.returncodes):
            raise RunFailed(f"the hooked trainer exited {list(finished.returncodes)}: see {job.log}")
        config = service_config(environ).decisions.responses
        _judge(context, engine, run, straggler, config.for_kind("nonfinite").value, checks)
    finally:
        serve[0].terminate()
        try:
            serve[0].wait(30)
        except subprocess.TimeoutExpired:
            serve[0].kill()
            serve[0].wait()
        engine.dispose()


def _serve(context: DrillContext, db: Path, environ: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port_file = context.workdir / "serve.port"
    log = context.log("serve").open("ab")
    command = [
        sys.executable,
        "-m",
        "monitor",
        "serve",
        "--db",
        str(db),
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    process = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + context.timeout_s
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RunFailed(f"runhealth serve did not start: see {context.log('serve')}")
        time.sleep(0.05)
    return process, int(port_file.read_text().strip())


def _judge(
    context: DrillContext, engine: sa.Engine, run: str, straggler: int, response: str, checks: list[Check]
) -> None:
    def incidents(kind: str) -> list[dict[str, Any]]:
        with engine.connect() as connection:  # a new read each time: the service is writing
            return queries.list_incidents(connection, queries.IncidentFilter(run=run, kind=kind))

    def proposals_for(incident: int) -> list[dict[str, Any]]:
        with engine.connect() as connection:
            return [p for p in queries.list_proposals(connection, run=run) if p["incident"] == incident]

    nonfinite = _until(context, lambda: incidents("nonfinite"))
    slow = _until(context, lambda: incidents("straggler"))
    if nonfinite:
        first = nonfinite[0]
        named = first["first_step"] == NONFINITE_STEP and 0 in (first["ranks"] or [])
        checks.append(
            Check(
                "nonfinite_named",
                named,
                f"incident {first['id']}: {first['summary']} (injected: rank 0, update {NONFINITE_STEP})",
                {"incident": first["id"], "first_step": first["first_step"], "ranks": first["ranks"]},
            )
        )
    else:
        checks.append(
            Check(
                "nonfinite_named", False, f"no nonfinite incident (injected: rank 0, update {NONFINITE_STEP})"
            )
        )
    if slow:
        ranks = sorted({r for incident in slow for r in incident["ranks"] or []})
        checks.append(
            Check(
                "straggler_named",
                ranks == [straggler],
                f"incident {slow[0]['id']}: {slow[0]['summary']} (injected: rank {straggler}, "
                f"{STRAGGLER_SECONDS * 1000:g} ms more compute per window; named: ranks {ranks})",
                {"incidents": [i["id"] for i in slow], "ranks": ranks},
            )
        )
    else:
        checks.append(Check("straggler_named", False, f"no straggler incident (injected: rank {straggler})"))
    # the first proposal can come before the last finite checkpoint's manifest landed (an
    # escalation), superseded by a rollback once it did: wait for the rollback
    proposals: list[dict[str, Any]] = []
    if nonfinite:
        incident = nonfinite[0]["id"]
        proposals = _until(context, lambda: [p for p in proposals_for(incident) if p["action"] == "rollback"])
        proposals = proposals or proposals_for(incident)
    with engine.connect() as connection:
        checkpoints = registry(connection, queries.run_row(connection, run).id)
        checks.append(_unsafe_state(checkpoints, proposals))
        checks.append(_recovery(connection, run, proposals, response))


def _unsafe_state(checkpoints: list[dict[str, Any]], proposals: list[dict[str, Any]]) -> Check:
    """The checkpoints the trainer saved at or after the nonfinite update (NaN weights) are
    marked unsafe, and the rollback's target is before that update."""
    name = "unsafe_state_not_a_target"
    after = [c for c in checkpoints if c["step"] >= NONFINITE_STEP]
    unmarked = [c["step"] for c in after if not any(t["tag"] == "unsafe" for t in c["tags"])]
    target = proposals[-1]["target"]["step"] if proposals else None
    measured = {
        "target_step": target,
        "nonfinite_step": NONFINITE_STEP,
        "unsafe_steps": [c["step"] for c in after if c["step"] not in unmarked],
        "unmarked_steps": unmarked,
    }
    if not after:
        return Check(
            name,
            False,
            f"no checkpoint at or after the nonfinite update {NONFINITE_STEP} was recorded",
            measured,
        )
    if unmarked:
        return Check(
            name, False, f"checkpoints of updates {unmarked} (after the NaN) are not marked unsafe", measured
        )
    if target is not None and target >= NONFINITE_STEP:
        return Check(
            name,
            False,
            f"the rollback targets update {target}, at or after the nonfinite update {NONFINITE_STEP}",
            measured,
        )
    chosen = (
        f"the rollback targets update {target}" if target is not None else "no rollback target was chosen"
    )
    steps = ", ".join(str(c["step"]) for c in after)
    return Check(
        name,
        True,
        f"checkpoint(s) of update {steps} (after the NaN at {NONFINITE_STEP}) marked unsafe; {chosen}",
        measured,
    )


def _recovery(connection: sa.Connection, run: str, proposals: list[dict[str, Any]], response: str) -> Check:
    name = "configured_recovery"
    if not proposals:
        return Check(name, False, f"no rollback proposed (configured response: {response})")
    proposal = proposals[-1]
    measured = {"proposal": proposal["id"], "action": proposal["action"], "response": response}
    if proposal["action"] != "rollback":
        return Check(
            name, False, f"proposal {proposal['id']} is a {proposal['action']}, not a rollback", measured
        )
    if response == "hold":
        run_id = queries.run_row(connection, run).id
        holds = connection.execute(
            sa.select(sa.func.count()).where(DIRECTIVE.c.run_id == run_id, DIRECTIVE.c.kind == "hold")
        ).scalar_one()
        measured["hold_directives"] = holds
        if not holds:
            return Check(
                name, False, f"proposal {proposal['id']} but no hold directive (configured: hold)", measured
            )
    # the retry bound is in the proposal's reasons (policies.retries: "rollback 1 of 2 ...")
    reasons = [str(r) for r in (proposal["evidence"] or {}).get("reasons", [])]
    parts = [part for reason in reasons for part in reason.split("; ")]
    bound = next((part for part in parts if part.endswith("for this incident")), "no retry bound stated")
    measured["retry"] = bound
    return Check(
        name,
        True,
        f"proposal {proposal['id']}: rollback to update {proposal['target']['step']}, {proposal['status']}, "
        f"{bound}; automatic response: {response}",
        measured,
    )


def _until(
    context: DrillContext, found: Callable[[], list[dict[str, Any]]], within_s: float = 30.0
) -> list[dict[str, Any]]:
    """The service judges asynchronously: wait (wall clock) for what it should have found."""
    deadline = time.monotonic() + min(within_s, context.timeout_s)
    while True:
        result = found()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.25)
