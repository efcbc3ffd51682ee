"""The attach recipes' end-to-end runs (``tests/test_attach_recipes.py``,
``tests/test_attach_nanogpt.py``): token files, a job of a test trainer of ``tests/trainers/``
sending to a real ``runhealth serve`` configured by the environment alone, the module's serve
fixture, and the CLI a rollback is approved from."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy.engine import Engine

from monitor.store import queries
from tests.adapters_support import run_rows
from tests.collectors_support import REPO, ServeProcess, child_environ, wait_until

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

    def torchrun(self, script: str, *args: str, world: int = WORLD) -> None:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
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
