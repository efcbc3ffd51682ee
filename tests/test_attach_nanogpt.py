"""The README's nanoGPT-style recipe with checkpoints, resume and rollback
(``tests/trainers/nanogpt_hooked.py``) under ``torchrun`` against a real ``runhealth serve``.

A NaN on one rank at iteration 70, the proposed rollback approved from the CLI, every rank
(4 gloo ranks on the CPU) restores ``out/ckpt.pt`` (overwritten in place at every evaluation,
relative to the trainer's directory), resumes, and the resume verifies: the incident is
resolved, no second proposal, no dead letters. A corrupted batch on one rank is a spike rolled
back the same way. A NaN right after a save (judged before that checkpoint's manifest is
recorded) escalates, and the checkpoint's record, once it lands, supersedes the escalation by a
rollback to it. Then ``--init_from=resume`` in a new job continues from the checkpoint file as
the run left it. And three broken resumes of one checkpoint (the weights, the optimizer state,
the schedule's place not restored), each caught at the first resumed step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.engine import Engine

from monitor.store import queries
from monitor.store.db import create_store_engine, resolve_url
from monitor.store.operators import add_operator
from policies.continuity import ContinuityConfig
from tests.attach_support import TARGETS, WORLD, Job, cli, job, serve, token_files, wait_for_proposal, workdir
from tests.collectors_support import ServeProcess, table_rows
from tests.support import require_module

torch = require_module("torch")
pytestmark = pytest.mark.slow
__all__ = ["serve", "workdir"]  # the fixtures, used by name


PAST_FAULT = 10
"""Updates a rolled-back run trains, before the test ends it, past both the step the fault was
at, where a second rollback (a recovery loop) or a critical finding would begin, and the first
windows after its resume that the continuity rules judge (``ContinuityConfig.resume_windows``).
Its evaluation at the checkpoint's step (and the save it may make there) comes at the resume.
(It was 50 updates past the checkpoint for every test: 10 to 40 updates more than this, on 4
ranks, waited for.)"""


def stop_step(checkpoint: int, fault_step: int) -> int:
    """The step every resumed rank trains to before the test ends the run."""
    return max(checkpoint + ContinuityConfig().resume_windows, fault_step) + PAST_FAULT


def host_blind(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's incidents but straggler warnings: four ranks on two cores beside another test
    worker are really slower in wall time now and then, a warning about the host, not the run
    (the straggler rule's tests plant slow ranks of their own). At load 12 the corrupted-batch
    run raised one."""
    return [i for i in incidents if i["kind"] != "straggler"]


def held_run(
    workdir: Path, serve: ServeProcess, run: str, request: pytest.FixtureRequest, *faults: str, **environ: str
) -> tuple[Job, Engine]:
    """A new run of ``nanogpt_hooked.py`` with the test's ``faults`` (evaluating every 40
    iterations unless they say otherwise), saving only on a better val loss, and an engine on
    its store. Long (``max_iters``) and paced (``iter_sleep``) so that its hold lands before it
    ends however loaded the machine; the test ends it through its ``--stop_file``."""
    made = job(workdir, serve, run, request, **environ, **TARGETS)
    engine = create_store_engine(resolve_url(str(serve.db), {}))
    request.addfinalizer(engine.dispose)
    made.torchrun(
        "nanogpt_hooked.py", "--eval_interval=40", *faults, "--always_save_checkpoint=False",
        "--max_iters=300", "--iter_sleep=0.05", f"--stop_file={made.stop_file}",
    )  # fmt: skip
    return made, engine


def approve_and_verify_rollback(
    run: Job,
    engine: Engine,
    workdir: Path,
    kind: str,
    first_step: int,
    ranks: list[int],
    checkpoint: int = 40,
) -> None:
    """The run's one rollback: to the checkpoint at ``checkpoint`` for a ``kind``
    incident first seen at ``first_step`` on ``ranks`` (later windows may spread it to every
    rank). Approved from the CLI, every rank stops at one step, restores, resumes at the step
    after the checkpoint and the resume verifies: the incident is resolved, no second
    rollback, nothing else critical, no dead letters. The run is ended (``--stop_file``) once
    every rank has trained to ``stop_step``."""
    with engine.begin() as connection:
        operator = add_operator(connection, f"oncall-{run.run}", actor="tests", now=time.time())
    proposal = wait_for_proposal(run, engine)
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", checkpoint)
    assert proposal["target"]["path"] == str(workdir / "out" / "ckpt.pt")  # made absolute by the hook
    approved = cli(workdir, "approve", str(proposal["id"]), "--reason", kind, "--url", run.serve.url,
                   "--token", operator)  # fmt: skip
    assert approved["ok"], approved
    run.stop_once_resumed_to(stop_step(checkpoint, first_step))
    run.wait(timeout_s=300)

    acks = [
        a
        for a in table_rows(run.serve.db, "directive_acks")
        if a["directive_id"] == approved["proposal"]["directive"]
    ]
    assert sorted(a["rank"] for a in acks) == list(range(WORLD)) and {a["status"] for a in acks} == {"done"}
    resumes = run.rows("resume_events")
    assert len(resumes) == WORLD and {r["checkpoint_step"] for r in resumes} == {checkpoint}
    steps = run.rows("step_records")
    after = [s for s in steps if s["incarnation"] == resumes[0]["incarnation"]]
    assert min(s["step"] for s in after) == checkpoint + 1  # every rank went on from the checkpoint
    assert all(s["loss_sum"] is not None and np.isfinite(s["loss_sum"]) for s in after)
    run.judged()
    incidents = run.rows("incidents")
    found = [i for i in incidents if i["kind"] == kind]
    assert len(found) == 1 and found[0]["first_step"] == first_step, incidents
    assert found[0]["status"] == "resolved", incidents
    first = [
        f for f in run.rows("findings") if f["incident_id"] == found[0]["id"] and f["step"] == first_step
    ]
    assert sorted(f["rank"] for f in first if f["rank"] is not None) == ranks, first  # where it began
    assert [i for i in incidents if i["severity"] == "critical" and i["status"] != "resolved"] == []
    # No second rollback: no recovery loop. A spike judged before the checkpoint's manifest
    # lands (its files must be quiet first; later on a loaded machine) is escalated for want of
    # a checkpoint, and that escalation is superseded once the record lands.
    proposals = run.rows("proposals")
    assert [p["action"] for p in proposals if p["action"] == "rollback"] == ["rollback"], proposals
    assert all(p["status"] == "superseded" for p in proposals if p["action"] != "rollback"), proposals
    assert run.dead_letters() == []


def test_nanogpt_rolls_back_a_nan_after_approval_and_its_resume_verifies(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    # A NaN at iteration 70 on rank 1 (update 71), 30 iterations after the checkpoint at 40 (its
    # manifest is recorded a second or two after the save). After the NaN the run never saves
    # (a NaN val loss is no improvement), so step 40 stays the newest valid checkpoint.
    nan, engine = held_run(workdir, serve, "nanogpt-nan", request, "--nan_at=70", "--nan_rank=1")
    approve_and_verify_rollback(nan, engine, workdir, "nonfinite", 71, [1])

    # The same checkpoint file, in a new job: --init_from=resume continues from what it holds.
    saved = int(torch.load(workdir / "out" / "ckpt.pt")["iter_num"])
    resumed = job(workdir, serve, "nanogpt-resume", request, **TARGETS)
    resumed.torchrun("nanogpt_hooked.py", "--init_from=resume", f"--max_iters={saved + 10}")
    resumed.wait()
    steps = resumed.rows("step_records")
    assert min(s["step"] for s in steps) == saved + 1 and len(steps) == WORLD * 11
    restored = resumed.rows("resume_events")
    assert {(r["checkpoint_path"], r["checkpoint_step"]) for r in restored} == {
        (str(workdir / "out" / "ckpt.pt"), saved)
    }
    resumed.judged()
    assert [i for i in resumed.rows("incidents") if i["severity"] == "critical"] == []
    assert resumed.dead_letters() == []


def test_nanogpt_a_corrupted_batch_is_a_spike_at_its_step_rolled_back_after_approval(
    workdir: Path, request: pytest.FixtureRequest
) -> None:
    """Rank 2's first microbatch of iteration 70 (update 71) is random tokens: its loss per
    token leaves its peers' at that window, and nowhere else. The script overwrites its one
    checkpoint file whenever the val loss improves, and a single bad batch does not stop it
    improving, so by the time a human approves, the checkpoint at 40 would be gone (the service
    then escalates: no valid checkpoint before the spike). The service is therefore run as the
    README says for such a trainer, holding a spike's proposal: every rank pauses a few steps
    after 71 until the operator decides. The evaluation (and save) every 60 iterations leaves
    the hold 50 iterations before the next save at 120, also on a loaded machine (every 40
    left 9, and the save at 80 sometimes came first)."""
    holding = ServeProcess(workdir / "serve", workdir / "serve" / "store.db",
                           RUNHEALTH_POLICIES__RESPONSE__SPIKE="hold")  # fmt: skip
    holding.root.mkdir()
    holding.start()
    request.addfinalizer(holding.stop)
    bad, engine = held_run(workdir, holding, "nanogpt-corrupt", request, "--corrupt_at=70", "--corrupt_rank=2",
                           "--eval_interval=60")  # fmt: skip
    approve_and_verify_rollback(bad, engine, workdir, "spike", 71, [2], checkpoint=60)
    assert {i["kind"] for i in host_blind(bad.rows("incidents"))} == {"spike"}


def test_nanogpt_a_nan_right_after_a_save_is_rolled_back_to_it_once_its_manifest_lands(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    """The NaN at iteration 41 (update 42) is judged before the checkpoint at 40 is recorded
    (its manifest waits for quiet files, held at 3 s here so the order is certain): the
    escalation for want of a checkpoint is superseded, once, by a rollback to 40 when the
    record lands; approved, the resume continues the consumed count the checkpoint recorded."""
    nan, engine = held_run(workdir, serve, "nanogpt-late-manifest", request, "--nan_at=41", "--nan_rank=1",
                           RUNHEALTH_HOOK__MANIFEST_SETTLE_S="3")  # fmt: skip
    with engine.begin() as connection:
        operator = add_operator(connection, "oncall-ann", actor="tests", now=time.time())
    proposal = wait_for_proposal(nan, engine)
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", 40)
    with engine.connect() as connection:
        escalated, pending = queries.list_proposals(connection, nan.run)
    assert (escalated["action"], escalated["status"]) == ("escalate", "superseded")
    assert "step 40 recorded with its manifest" in escalated["reason"] and pending["id"] == proposal["id"]
    approved = cli(workdir, "approve", str(proposal["id"]), "--reason", "NaN", "--url", serve.url,
                   "--token", operator)  # fmt: skip
    assert approved["ok"], approved
    nan.stop_once_resumed_to(stop_step(40, 42))
    nan.wait(timeout_s=300)
    nan.judged()
    # The rollback's target is the first save at 40: the resumed run evaluates at 40 again and
    # may save a new version of the same path there (its eval batches are drawn at random).
    saved = min((c for c in nan.rows("checkpoint_events") if c["step"] == 40), key=lambda c: c["id"])
    resumes = nan.rows("resume_events")
    assert len(resumes) == WORLD and {r["checkpoint_step"] for r in resumes} == {40}
    assert saved["consumed"] and {r["restored"]["consumed"] for r in resumes} == {saved["consumed"]}
    (incident,) = host_blind(nan.rows("incidents"))
    assert (incident["kind"], incident["first_step"], incident["status"]) == ("nonfinite", 42, "resolved")
    assert [p["status"] for p in nan.rows("proposals")] == ["superseded", "done"]
    assert nan.dead_letters() == []


BROKEN_WORLD = 2
BROKEN_RESUMES = {
    # resume_fault: the critical findings the resume must raise at its first window (step 61)
    "weights": {"broken_resume"},
    "optimizer": {"optimizer_state_lost"},
    "lr": {"schedule_restarted"},
}


@pytest.fixture(scope="module")
def broken_resumes(
    serve: ServeProcess, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, set[str]]:
    """One run: a clean job to step 60, then three ``--init_from=resume`` jobs from its
    checkpoint, each restoring with one fault; the critical findings of each resumed job at its
    first window, by fault. (A consumed-example cursor reset has no counterpart here: this
    trainer draws at random and keeps no cursor.) Each job is 2 ranks under ``torchrun``: the
    faults are judged per resume, not per rank (the rollbacks above resume 4), and each rank
    is a process importing torch (4 ranks: the fixture's 93 s of the suite)."""
    workdir = tmp_path_factory.mktemp("broken-resumes")
    token_files(workdir)
    base = job(workdir, serve, "nanogpt-base", request, **TARGETS)
    base.torchrun("nanogpt_hooked.py", "--max_iters=60", world=BROKEN_WORLD)
    base.wait()
    saved = workdir / "out" / "ckpt.pt"
    assert int(torch.load(saved)["iter_num"]) == 60
    for fault in BROKEN_RESUMES:
        out = workdir / f"out-{fault}"
        out.mkdir()
        (out / "ckpt.pt").write_bytes(saved.read_bytes())
        broken = job(workdir, serve, base.run, request, base.token, **TARGETS)  # the same run
        broken.torchrun(
            "nanogpt_hooked.py", "--init_from=resume", f"--out_dir=out-{fault}", f"--resume_fault={fault}",
            "--max_iters=70", world=BROKEN_WORLD,
        )  # fmt: skip
        broken.wait()
    base.judged()
    assert base.dead_letters() == []
    jobs = list(dict.fromkeys(r["incarnation"] for r in base.rows("resume_events")))  # in order
    assert len(jobs) == len(BROKEN_RESUMES)
    critical = [f for f in base.rows("findings") if f["severity"] == "critical"]
    assert all(f["incarnation"] in jobs for f in critical), critical  # the clean job: none
    found = {
        fault: {f["kind"] for f in critical if f["incarnation"] == incarnation}
        for fault, incarnation in zip(BROKEN_RESUMES, jobs, strict=True)
    }
    assert all(f["step"] == 61 for f in critical), critical  # each at the first resumed window
    incidents = base.rows("incidents")
    assert incidents and min(i["first_step"] for i in incidents if i["severity"] == "critical") == 61
    return found


def test_nanogpt_broken_resumes_are_each_caught_at_the_first_resumed_step(
    broken_resumes: dict[str, set[str]],
) -> None:
    for fault, kinds in BROKEN_RESUMES.items():
        assert kinds <= broken_resumes[fault], (fault, broken_resumes)


def test_nanogpt_broken_resumes_raise_nothing_else(broken_resumes: dict[str, set[str]]) -> None:
    # The optimizer's fault (a fresh optimizer, the rate the loop sets each iteration) is no
    # schedule_restarted: the resume is judged on its first window's rate (first_window_lr).
    assert broken_resumes == BROKEN_RESUMES
