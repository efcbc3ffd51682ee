"""Running the drills by name, each in its own work directory, a crashed run as a failed check."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from monitor.drills import continuity, diagnostics, preemption, topology
from monitor.drills.context import DrillContext
from monitor.drills.launch import RunFailed
from monitor.drills.reports import DrillResult
from policies.drills import Check

Drill = Callable[[DrillContext, list[Check]], None]

DRILLS: dict[str, Drill] = {
    "continuity": continuity.drill,
    "topology": topology.drill,
    "preemption": preemption.drill,
    "diagnostics": diagnostics.drill,
}


def run_drill(name: str, context: DrillContext) -> DrillResult:
    """One drill; a trainer run that crashed or hung ends it with a failed ``trainer_runs`` check
    (a loader that crashes on resume is what a drill is for), its checks so far kept."""
    own = dataclasses.replace(context, workdir=context.workdir / name)
    checks: list[Check] = []
    started = time.time()
    try:
        DRILLS[name](own, checks)
    except RunFailed as exc:
        checks.append(Check("trainer_runs", False, str(exc)))
    return DrillResult(name, tuple(checks), started, time.time(), str(own.workdir))
