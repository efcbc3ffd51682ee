"""What every drill is given: the trainer, a work directory, the tolerances and a time bound."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monitor.drills import launch
from monitor.drills.convention import TrainerCommand
from policies.drills import DrillConfig


@dataclass(frozen=True)
class DrillContext:
    """``steps`` (N) uninterrupted updates before the interruption, ``resume_steps`` (M) after
    it; ``timeout_s`` bounds each trainer run; ``environ`` is the trainers' environment."""

    command: TrainerCommand
    workdir: Path
    config: DrillConfig = field(default_factory=DrillConfig)
    steps: int = 5
    resume_steps: int = 5
    timeout_s: float = 600.0
    environ: Mapping[str, str] | None = None

    def run(self, label: str, fields: Mapping[str, Any], nproc: int = 1) -> launch.Finished:
        """One trainer run to its end, logged to ``<workdir>/<label>.log``."""
        return launch.run(self.command, fields, self.log(label), self.timeout_s, nproc, self.environ)

    def run_together(self, runs: Mapping[str, Mapping[str, Any]]) -> dict[str, launch.Finished]:
        """Independent runs at once (by label), each to its end."""
        jobs = {label: self.start(label, fields) for label, fields in runs.items()}
        try:
            return {label: launch.finish(job, self.timeout_s) for label, job in jobs.items()}
        finally:
            for job in jobs.values():
                job.close()

    def start(
        self, label: str, fields: Mapping[str, Any], nproc: int = 1, environ: Mapping[str, str] | None = None
    ) -> launch.Job:
        """A run started and left running: the caller signals it and waits for it."""
        return launch.Job(self.command, fields, self.log(label), nproc, environ or self.environ)

    def log(self, label: str) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self.workdir / f"{label}.log"

    def directory(self, label: str) -> Path:
        path = self.workdir / label
        path.mkdir(parents=True, exist_ok=True)
        return path
