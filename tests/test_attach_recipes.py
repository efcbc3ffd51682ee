"""The README's attach recipes, run on the test trainers of ``tests/trainers/`` against a real
``runhealth serve``.

- The attach line counts (``scripts/attach_lines.py``): added lines against the same trainer
  without the hook, within issue 14's targets.
- The nanoGPT-style loop under ``torchrun``, 4 gloo ranks on the CPU. With the hook and values
  alone, a clean run: every window of every rank stored, 0 incidents, no dead letters. With
  checkpoints, resume and rollback: a NaN on one rank at iteration 70, the proposed rollback
  approved from the CLI, every rank restores ``out/ckpt.pt`` (overwritten in place at every
  evaluation, relative to the trainer's directory), resumes, and the resume verifies: the
  incident is resolved, no second proposal, no dead letters. A NaN right after a save (judged
  before that checkpoint's manifest is recorded) escalates, and the checkpoint's record, once
  it lands, supersedes the escalation by a rollback to it. Then ``--init_from=resume`` in a
  new job continues from the checkpoint file as the run left it. And three broken resumes of one
  checkpoint (the weights, the optimizer state, the schedule's place not restored), each caught
  at the first resumed step.
- A transformers ``Trainer`` subclass and a Lightning module with manual optimization, each
  attached by the README's callback line: short real runs whose windows are stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.engine import Engine

from monitor.store import queries
from monitor.store.db import create_store_engine, resolve_url
from monitor.store.operators import add_operator
from tests.adapters_support import run_rows
from tests.collectors_support import REPO, ServeProcess, child_environ, table_rows, wait_until
from tests.support import require_module

torch = require_module("torch")
pytestmark = pytest.mark.slow

TRAINERS = REPO / "tests" / "trainers"
WORLD = 4
VOCAB = 64


def token_files(root: Path) -> Path:
    """``data/train.bin`` and ``data/val.bin``: uint16 tokens of a learnable stream (each token
    mostly follows from the one before), as a tokenizer's output file would be."""
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    successor = rng.permutation(VOCAB)
    for split, length in (("train", 60_000), ("val", 6_000)):
        tokens = np.empty(length, dtype=np.uint16)
        tokens[0] = 0
        noise = rng.random(length) < 0.1
        random_tokens = rng.integers(0, VOCAB, length)
        for index in range(1, length):
            tokens[index] = random_tokens[index] if noise[index] else successor[tokens[index - 1]]
        tokens.tofile(data / f"{split}.bin")
    return data


class Job:
    """A training job of one test trainer, in ``root`` (its working directory), sending to
    ``serve`` as run ``run``: the hook configured by the environment alone, as a user would."""

    def __init__(
        self, root: Path, serve: ServeProcess, run: str, token: str | None = None, **environ: str
    ) -> None:
        self.root = root
        self.extra = environ
        self.serve = serve
        self.run = run
        self.token = token or serve.create_run(run)
        self.spool = root / "spool"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = root / f"{run}-{len(list(root.glob(f'{run}*.log')))}.log"
        self.stop_file = f"{self.log.stem}.stop"  # the trainers' --stop_file, in ``root``

    def environ(self) -> dict[str, str]:
        return child_environ(
            RUNHEALTH_URL=self.serve.url,
            RUNHEALTH_TOKEN=self.token,
            RUNHEALTH_RUN=self.run,
            RUNHEALTH_SPOOL_DIR=str(self.spool),
            # Quick pacing for a short run: records every 0.2 s, directives polled every 0.5 s.
            RUNHEALTH_SENDER__FLUSH_INTERVAL_S="0.2",
            RUNHEALTH_DIRECTIVES__POLL_INTERVAL_S="0.5",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            **self.extra,
        )

    def torchrun(self, script: str, *args: str) -> None:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
            str(TRAINERS / script), "--data_dir=data", *args,
        ]  # fmt: skip
        self.start(command)

    def python(self, script: str, *args: str) -> None:
        self.start([sys.executable, str(TRAINERS / script), "--data_dir=data", *args])

    def start(self, command: list[str]) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=self.root, env=self.environ(), stdout=log, stderr=subprocess.STDOUT
            )

    def wait(self, timeout_s: float = 240.0) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        assert self.process.returncode == 0, self.log.read_text(errors="replace")[-4000:]

    def rows(self, table: str) -> list[dict[str, Any]]:
        return run_rows(self.serve.db, table, self.run)

    def dead_letters(self) -> list[str]:
        if not self.spool.exists():
            return []
        return [p.name for p in self.spool.iterdir() if p.name.endswith(".dead.jsonl") and p.stat().st_size]

    def judged(self, timeout_s: float = 30.0) -> None:
        """Wait until the engine judged every window of the run (the end of a run is judged once
        it is idle)."""

        def done() -> bool:
            summaries = self.rows("step_summaries")
            return bool(summaries) and all(s["judged"] for s in summaries)

        assert wait_until(done, timeout_s, 0.25), self.serve.log_tail()

    def stop_once_resumed_to(self, step: int, timeout_s: float = 240.0) -> None:
        """End the job (its trainer's ``--stop_file``) once every rank of its resumed incarnation
        has trained to ``step``. A rollback test's run is long (``max_iters``) so that its hold
        lands before it ends however loaded the machine; the updates after the resume past what
        the test checks took 20 s of each test."""

        trained = wait_until(lambda: every_rank_resumed_to(self.rows, step), timeout_s, 0.5)
        assert trained, self.log.read_text(errors="replace")[-4000:]
        (self.root / self.stop_file).touch()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # a test that failed early: its job, by PID
            self.process.wait()


def every_rank_resumed_to(rows: Callable[[str], list[dict[str, Any]]], step: int) -> bool:
    """Whether every rank of a run's resumed incarnation has stored a window at ``step`` or
    later (``rows``: the run's rows of a table)."""
    resumed = {r["incarnation"] for r in rows("resume_events")}
    reached = {s["rank"] for s in rows("step_records") if s["incarnation"] in resumed and s["step"] >= step}
    return reached == set(range(WORLD))


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("serve")
    # A NaN holds every rank until its proposal is decided, as an operator who approves from the
    # CLI would set it: without the hold, a run that trains on past its last step before the
    # approval lands (a loaded machine: 43 s from proposal to approval at load 12) ends with the
    # rollback directive still pending.
    process = ServeProcess(root, root / "store.db", RUNHEALTH_POLICIES__RESPONSE__NONFINITE="hold")
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    token_files(tmp_path)
    return tmp_path


# The labels are already the targets (nanoGPT's Y, the Lightning module's): the README's setting.
TARGETS = {"RUNHEALTH_HOOK__SHIFT_LABELS": "0"}


def job(
    workdir: Path,
    serve: ServeProcess,
    run: str,
    request: pytest.FixtureRequest,
    token: str | None = None,
    **environ: str,
) -> Job:
    """A job of a new run, or of the run ``token`` belongs to."""
    made = Job(workdir, serve, run, token, **environ)
    request.addfinalizer(made.close)
    return made


def test_the_attach_line_counts_are_within_the_targets() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "attach_lines.py"), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    counts = {c["hooked"]: c for c in json.loads(result.stdout)}
    assert counts["nanogpt_values.py"]["added"] <= 5
    assert counts["nanogpt_hooked.py"]["added"] <= 10
    assert counts["hf_hooked.py"]["added"] <= 2 and counts["lightning_hooked.py"]["added"] <= 2
    assert all(not c["unexplained"] for c in counts.values()), counts
    assert result.returncode == 0, result.stdout


def test_the_line_counter_counts_code_not_comments_or_blank_lines(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import attach_lines
    finally:
        sys.path.remove(str(REPO / "scripts"))
    plain = '"""doc"""\nf(1)\ny = 2\n'
    hooked = '"""other doc"""\nimport rh  # the hook\n\n# a comment\nrh.wrap(f(1))\ny = 2\nz = 3\n'
    (tmp_path / "plain.py").write_text(plain)
    (tmp_path / "hooked.py").write_text(hooked)
    counted = attach_lines.count(attach_lines.Pair("t", "plain.py", "hooked.py", 3), tmp_path)
    assert (counted.added, counted.removed, counted.unexplained) == (3, 1, [])
    assert counted.within_target
    (tmp_path / "hooked.py").write_text(hooked.replace("y = 2", "y = 3"))
    drifted = attach_lines.count(attach_lines.Pair("t", "plain.py", "hooked.py", 9), tmp_path)
    assert drifted.unexplained == ["y = 2"] and not drifted.within_target


def test_nanogpt_with_the_hook_and_values_alone_stores_every_window_and_opens_no_incident(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    clean = job(workdir, serve, "nanogpt-clean", request, **TARGETS)
    clean.torchrun("nanogpt_values.py", "--max_iters=120")
    clean.wait()
    windows = 121  # iterations 0..120
    steps = clean.rows("step_records")
    assert len(steps) == WORLD * windows, len(steps)  # the last window, closed at exit, too
    assert {s["rank"] for s in steps} == set(range(WORLD))
    last = max(steps, key=lambda s: s["attempt"])
    assert last["step"] == windows
    # Examples from the label rows: 4 rows x 2 microbatches x 4 ranks per update.
    assert last["consumed"] == windows * 4 * 2 * WORLD
    assert all(s["tokens"] == 4 * 32 * 2 for s in steps)
    assert all(s["grad_norm"] is not None and s["loss_sum"] is not None for s in steps)
    clean.judged()
    # Four ranks on two cores beside another test worker: a rank that shares its core for a
    # while is really slower in wall time (CI named rank 2 48% slower once), a straggler warning
    # about the host, not the run; the straggler rule's tests plant slow ranks of their own.
    assert [i for i in clean.rows("incidents") if i["kind"] != "straggler"] == []
    assert clean.dead_letters() == []


AFTER_RESUME = 50
"""Updates a rolled-back run trains past its checkpoint before the test ends it: well past the
resume, its evaluation at the checkpoint's step (and the save it may make there) and the step
the fault was at, where a second rollback (a recovery loop) or a critical finding would begin."""


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
    every rank has trained ``AFTER_RESUME`` updates past the checkpoint."""
    with engine.begin() as connection:
        operator = add_operator(connection, f"oncall-{run.run}", actor="tests", now=time.time())
    proposal = wait_for_proposal(run, engine)
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", checkpoint)
    assert proposal["target"]["path"] == str(workdir / "out" / "ckpt.pt")  # made absolute by the hook
    approved = cli(workdir, "approve", str(proposal["id"]), "--reason", kind, "--url", run.serve.url,
                   "--token", operator)  # fmt: skip
    assert approved["ok"], approved
    run.stop_once_resumed_to(checkpoint + AFTER_RESUME)
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
    nan = job(workdir, serve, "nanogpt-nan", request, **TARGETS)
    engine = create_store_engine(resolve_url(str(serve.db), {}))
    request.addfinalizer(engine.dispose)
    # A NaN at iteration 70 on rank 1 (update 71), 30 iterations after the checkpoint at 40 (its
    # manifest is recorded a second or two after the save). After the NaN the run never saves
    # (a NaN val loss is no improvement), so step 40 stays the newest valid checkpoint.
    nan.torchrun(
        "nanogpt_hooked.py", "--nan_at=70", "--nan_rank=1", "--always_save_checkpoint=False",
        "--eval_interval=40", "--max_iters=300", "--iter_sleep=0.05", f"--stop_file={nan.stop_file}",
    )  # fmt: skip
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
    bad = job(workdir, holding, "nanogpt-corrupt", request, **TARGETS)
    engine = create_store_engine(resolve_url(str(holding.db), {}))
    request.addfinalizer(engine.dispose)
    bad.torchrun(
        "nanogpt_hooked.py", "--corrupt_at=70", "--corrupt_rank=2", "--always_save_checkpoint=False",
        "--eval_interval=60", "--max_iters=300", "--iter_sleep=0.05", f"--stop_file={bad.stop_file}",
    )  # fmt: skip
    approve_and_verify_rollback(bad, engine, workdir, "spike", 71, [2], checkpoint=60)
    assert {i["kind"] for i in bad.rows("incidents")} == {"spike"}


def test_nanogpt_a_nan_right_after_a_save_is_rolled_back_to_it_once_its_manifest_lands(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    """The NaN at iteration 41 (update 42) is judged before the checkpoint at 40 is recorded
    (its manifest waits for quiet files, held at 3 s here so the order is certain): the
    escalation for want of a checkpoint is superseded, once, by a rollback to 40 when the
    record lands; approved, the resume continues the consumed count the checkpoint recorded."""
    nan = job(
        workdir, serve, "nanogpt-late-manifest", request, RUNHEALTH_HOOK__MANIFEST_SETTLE_S="3", **TARGETS
    )
    engine = create_store_engine(resolve_url(str(serve.db), {}))
    request.addfinalizer(engine.dispose)
    with engine.begin() as connection:
        operator = add_operator(connection, "oncall-ann", actor="tests", now=time.time())
    nan.torchrun(
        "nanogpt_hooked.py", "--nan_at=41", "--nan_rank=1", "--always_save_checkpoint=False",
        "--eval_interval=40", "--max_iters=300", "--iter_sleep=0.05", f"--stop_file={nan.stop_file}",
    )  # fmt: skip
    proposal = wait_for_proposal(nan, engine)
    assert (proposal["action"], proposal["target"]["step"]) == ("rollback", 40)
    with engine.connect() as connection:
        escalated, pending = queries.list_proposals(connection, nan.run)
    assert (escalated["action"], escalated["status"]) == ("escalate", "superseded")
    assert "step 40 recorded with its manifest" in escalated["reason"] and pending["id"] == proposal["id"]
    approved = cli(workdir, "approve", str(proposal["id"]), "--reason", "NaN", "--url", serve.url,
                   "--token", operator)  # fmt: skip
    assert approved["ok"], approved
    nan.stop_once_resumed_to(40 + AFTER_RESUME)
    nan.wait(timeout_s=300)
    nan.judged()
    # The rollback's target is the first save at 40: the resumed run evaluates at 40 again and
    # may save a new version of the same path there (its eval batches are drawn at random).
    saved = min((c for c in nan.rows("checkpoint_events") if c["step"] == 40), key=lambda c: c["id"])
    resumes = nan.rows("resume_events")
    assert len(resumes) == WORLD and {r["checkpoint_step"] for r in resumes} == {40}
    assert saved["consumed"] and {r["restored"]["consumed"] for r in resumes} == {saved["consumed"]}
    (incident,) = nan.rows("incidents")
    assert (incident["kind"], incident["first_step"], incident["status"]) == ("nonfinite", 42, "resolved")
    assert [p["status"] for p in nan.rows("proposals")] == ["superseded", "done"]
    assert nan.dead_letters() == []


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
    """One run: a clean 4-rank job to step 60, then three ``--init_from=resume`` jobs from its
    checkpoint, each restoring with one fault; the critical findings of each resumed job at its
    first window, by fault. (A consumed-example cursor reset has no counterpart here: this
    trainer draws at random and keeps no cursor.)"""
    workdir = tmp_path_factory.mktemp("broken-resumes")
    token_files(workdir)
    base = job(workdir, serve, "nanogpt-base", request, **TARGETS)
    base.torchrun("nanogpt_hooked.py", "--max_iters=60")
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
            "--max_iters=70",
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


def wait_for_proposal(run: Job, engine: Engine, timeout_s: float = 120.0) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def pending() -> bool:
        with engine.connect() as connection:
            found[:] = queries.list_proposals(connection, run.run, "pending")
        return bool(found)

    assert wait_until(pending, timeout_s, 0.5), run.serve.log_tail()
    return found[0]


def cli(root: Path, *args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "monitor", *args, "--json"],
        capture_output=True,
        text=True,
        env=child_environ(),
        cwd=root,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_a_trainer_subclass_attached_by_the_callback_line_stores_its_windows(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    require_module("transformers")
    hf = job(workdir, serve, "hf-subclass", request)
    hf.python("hf_hooked.py", "--max_steps=12", "--output_dir=out-hf")
    hf.wait()
    steps = hf.rows("step_records")
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(s["loss_sum"] is not None and s["grad_norm"] is not None for s in steps)
    checkpoints = hf.rows("checkpoint_events")
    assert {c["step"] for c in checkpoints} >= {6, 12}
    assert hf.dead_letters() == []


def test_a_trainer_subclass_on_four_ranks_resumed_without_its_data_skip_is_a_cursor_reset(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    """The Trainer subclass under ``torchrun`` (4 gloo ranks): 12 clean steps, then a resume
    from checkpoint-6 with ``ignore_data_skip``, which restores weights, optimizer and schedule
    but starts the epoch's data again. The clean job raises nothing; the resume is a
    ``data_cursor_reset`` at its first window, and only that."""
    require_module("transformers")
    hf = job(workdir, serve, "hf-four-ranks", request)
    hf.torchrun("hf_hooked.py", "--max_steps=12", "--output_dir=out-hf")
    hf.wait()
    steps = hf.rows("step_records")
    assert sorted((s["step"], s["rank"]) for s in steps) == [
        (t, r) for t in range(1, 13) for r in range(WORLD)
    ]
    hf.judged()
    assert hf.rows("incidents") == []
    resumed = job(workdir, serve, hf.run, request, hf.token)  # the same run, a new job
    resumed.torchrun("hf_hooked.py", "--max_steps=12", "--output_dir=out-hf",
                     "--resume_from=out-hf/checkpoint-6", "--ignore_data_skip")  # fmt: skip
    resumed.wait()
    restored = hf.rows("resume_events")
    assert len(restored) == WORLD and {r["restored"]["consumed"] for r in restored} == {0}
    hf.judged()
    critical = [f for f in hf.rows("findings") if f["severity"] == "critical"]
    assert {(f["kind"], f["step"]) for f in critical} == {("data_cursor_reset", 7)}, critical
    assert hf.dead_letters() == []  # the two jobs share the spool folder


def test_a_manual_optimization_module_attached_by_the_callback_line_stores_its_windows(
    workdir: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    require_module("lightning")
    module = job(workdir, serve, "lightning-manual", request, **TARGETS)
    module.python("lightning_hooked.py", "--max_steps=12")
    module.wait()
    steps = module.rows("step_records")
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(s["loss_sum"] is not None and s["grad_norm"] is not None for s in steps)
    assert all(s["tokens"] == 4 * 32 for s in steps)
    assert module.dead_letters() == []


def test_the_nanogpt_baseline_runs_without_the_hook(workdir: Path) -> None:
    """The baseline of the line count is a real trainer. (The other baselines differ from their
    hooked copies, which run above, only in the lines the counter shows: it reports any other
    difference as drift.)"""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(TRAINERS / "nanogpt_plain.py"), "--data_dir=data", "--max_iters=25",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=workdir, env=child_environ(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (workdir / "out" / "ckpt.pt").is_file()  # rank 0 saved at iteration 20
