"""A litgpt-style Lightning Fabric script (``tests/trainers/fabric_hooked.py``) attached by the
README's hand-written-loop recipe, against a real ``runhealth serve``: Fabric launches its own
two gloo processes (no ``torchrun``), accumulates under ``fabric.no_backward_sync``, saves a
folder per step with ``fabric.save`` and restores with ``fabric.load``. A clean run and a clean
resume raise nothing; a resume that restores everything but the weights is a ``broken_resume``
at its first step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.attach_support import TARGETS, Job, job, serve, workdir
from tests.collectors_support import ServeProcess
from tests.support import require_module

require_module("torch")
pytestmark = pytest.mark.slow
__all__ = ["serve", "workdir"]  # the fixtures, used by name

RANKS = 2


def fabric_job(workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest, *args: str,
               run: Job | None = None) -> Job:  # fmt: skip
    made = job(workdir, serve, run.run if run else "fabric", request, run.token if run else None, **TARGETS)
    made.python("fabric_hooked.py", f"--devices={RANKS}", *args)
    made.wait()
    return made


def test_a_fabric_script_its_resume_and_a_resume_without_its_weights(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    require_module("lightning")
    first = fabric_job(workdir, serve, request, "--max_iters=50")
    steps = first.rows("step_records")
    assert sorted((s["step"], s["rank"]) for s in steps) == [
        (t, r) for t in range(1, 51) for r in range(RANKS)
    ]
    assert {(s["microbatches"], s["skipped"], s["tokens"]) for s in steps} == {(2, False, 2 * 4 * 32)}
    assert all(s["grad_norm"] is not None and s["loss_sum"] is not None for s in steps)
    saved = {c["step"]: c for c in first.rows("checkpoint_events")}
    assert sorted(saved) == [25, 50] and all(c["manifest"] for c in saved.values())
    assert saved[50]["path"] == str(workdir / "out" / "step-00000050")  # relative, made absolute

    fabric_job(workdir, serve, request, "--max_iters=60", "--resume=out/step-00000050", run=first)
    first.judged()
    assert first.rows("incidents") == []
    fabric_job(workdir, serve, request, "--max_iters=60", "--resume=out/step-00000050",
               "--resume_fault=weights", "--out_dir=out-weights", run=first)  # fmt: skip
    first.judged()
    resumes = first.rows("resume_events")
    assert len(resumes) == 2 * RANKS and {r["checkpoint_step"] for r in resumes} == {50}
    broken = resumes[-1]["incarnation"]
    critical = [f for f in first.rows("findings") if f["severity"] == "critical"]
    assert {(f["kind"], f["step"], f["incarnation"]) for f in critical} == {("broken_resume", 51, broken)}, (
        critical
    )
    (incident,) = first.rows("incidents")
    assert (incident["kind"], incident["first_step"]) == ("broken_resume", 51)
    assert first.dead_letters() == []
