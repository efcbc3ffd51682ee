"""Fault scenarios made with real small trainings, and what runhealth said about each.

Each scenario runs the demo's training (``scenario_worker.py``: DDP on gloo, the RunHealth hook)
against a real ``runhealth serve`` on a fresh SQLite store, with one fault planted at a known
step (or none, for the clean runs). The ``dev`` split is what the thresholds were looked at
with; the ``holdout`` split (other seeds, steps and ranks) was not, and is reported apart.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str | None
    """The incident kind that must be raised (None: a clean run, where any incident is false)."""
    first_evidence: int
    split: str
    world: int = 4
    args: tuple[str, ...] = ()
    steps: int = 160
    seed: int = 0
    hang: bool = False
    service_settings: tuple[tuple[str, str], ...] = (
        ("RUNHEALTH_HANG_MIN_TIMEOUT_S", "10"),
        ("RUNHEALTH_HEARTBEAT_S", "0.5"),
    )
    """The service's settings besides its admin token (``()``: its defaults, and the hook's)."""
    task: str = "text"
    """The demo's character-level transformer: a step of tens of milliseconds per rank, as its
    phases must be for timings to mean anything (the ``sequence`` task's phases last a few
    hundred microseconds of CPU, where cache and scheduler noise is 10-20% of a phase)."""


def corpus() -> list[Scenario]:
    scenarios = []
    for split, seed, shift, rank in (("dev", 0, 0, 2), ("holdout", 1, 17, 1)):
        at = 100 + shift
        # The job dies at update ``at`` between checkpoints (every 20) and resumes after the last.
        resumed = (at - 1) // 20 * 20 + 1
        scenarios += [
            Scenario(
                f"corrupted_batch-{split}",
                "spike",
                at,
                split,
                args=("--corrupt", f"{rank}:{at - 1}"),
                seed=seed,
            ),
            Scenario(
                f"corrupted_batch_1rank-{split}",
                "spike",
                at,
                split,
                world=1,
                args=("--corrupt", f"0:{at - 1}"),
                seed=seed,
            ),
            Scenario(f"nan_batch-{split}", "nonfinite", at, split, args=("--nan", f"{rank}:{at}"), seed=seed),
            Scenario(
                f"fp16_overflow_storm-{split}", "amp", at, split, args=("--overflow", f"{at}:6"), seed=seed
            ),
            *(
                Scenario(
                    f"slow_rank_{int(f * 100)}pct-{split}",
                    "straggler",
                    40 + shift,
                    split,
                    args=("--slow", f"{rank}:{f}:{40 + shift}"),
                    steps=140,
                    seed=seed,
                )
                for f in (0.10, 0.15, 0.30)
            ),
            Scenario(
                f"hung_rank-{split}",
                "hang",
                60 + shift,
                split,
                args=("--hang", f"{rank}:{60 + shift}"),
                steps=400,
                seed=seed,
                hang=True,
            ),
            *(
                Scenario(name, "broken_resume", resumed, split, args=("--restart", f"{at}:{mode}"), seed=seed)
                for name, mode in (
                    (f"lr_warmup_restarted-{split}", "lr_restart"),
                    (f"data_cursor_reset-{split}", "cursor_reset"),
                    (f"resume_lost_weights-{split}", "lost_weights"),
                )
            ),
            Scenario(f"clean_restart-{split}", None, 0, split, args=("--restart", f"{at}:clean"), seed=seed),
            Scenario(f"clean-{split}", None, 0, split, steps=300, seed=seed),
            Scenario(f"clean_1rank-{split}", None, 0, split, world=1, steps=300, seed=seed),
        ]
    return scenarios


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Outcome:
    scenario: Scenario
    incidents: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    hang_timeout_s: float | None = None
    hang_detected_after_s: float | None = None
    hang_in_phase_s: float | None = None
    """How long the stuck rank had been in its phase when the hang was named (its heartbeat's
    ``phase_since`` to the finding): the detection delay, on the rank's own clock."""
    seconds: float = 0.0
    error: str | None = None


def run_scenario(scenario: Scenario, workdir: Path) -> Outcome:
    root = workdir / scenario.name
    root.mkdir(parents=True)
    admin = secrets.token_urlsafe(16)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RUNHEALTH_")}
    environ["PYTHONPATH"] = str(REPO)
    service_env = {**environ, "RUNHEALTH_ADMIN_TOKEN": admin, **dict(scenario.service_settings)}
    db, port_file = root / "store.db", root / "port"
    started = time.monotonic()
    with open(root / "serve.log", "ab") as serve_log:
        serve = subprocess.Popen(
            [
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
            ],
            env=service_env,
            stdout=serve_log,
            stderr=serve_log,
        )
    ranks: list[subprocess.Popen[bytes]] = []
    outcome = Outcome(scenario)
    try:
        while not port_file.exists():
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        token = httpx.post(
            f"{url}/v1/runs",
            json={"name": "scenario"},
            headers={"authorization": f"Bearer {admin}"},
            timeout=30,
        ).json()["token"]
        ranks = _launch(scenario, root, url, token, environ)
        hang_started = None
        deadline = time.monotonic() + 300
        while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
            if scenario.hang:
                found = _incidents(db, kind="hang")
                if hang_started is None and _stuck(db):
                    hang_started = time.monotonic()
                if found:
                    outcome.hang_detected_after_s = time.monotonic() - (hang_started or time.monotonic())
                    break
        time.sleep(2.0)  # the last records, and the watchers' next pass
        outcome.incidents = _incidents(db)
        outcome.steps = _steps(db)
        if scenario.hang:
            outcome.hang_timeout_s, outcome.hang_in_phase_s = _hang_evidence(db)
    except Exception as exc:  # a broken scenario is reported, not hidden
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        for process in [*ranks, serve]:
            if process.poll() is None:
                process.kill()
            process.wait(30)
    if any(r.returncode not in (0, -9) for r in ranks):
        outcome.error = f"a rank failed: see {root}/rank-*.log"
    outcome.seconds = time.monotonic() - started
    return outcome


def _launch(
    scenario: Scenario, root: Path, url: str, token: str, environ: dict[str, str]
) -> list[subprocess.Popen[bytes]]:
    port = str(_free_port())
    ranks = []
    for rank in range(scenario.world):
        rank_env = {
            **environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": str(scenario.world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "RUNHEALTH_URL": url,
            "RUNHEALTH_TOKEN": token,
            "RUNHEALTH_RUN": "scenario",
            "RUNHEALTH_NODE": f"node-{rank}",
            "RUNHEALTH_SPOOL_DIR": str(root / "spool"),
            "RUNHEALTH_HEARTBEAT_S": "0.5",
            "SCENARIO": scenario.name,
        }
        command = [
            sys.executable,
            str(REPO / "benchmarks" / "scenario_worker.py"),
            "--steps",
            str(scenario.steps),
            "--seed",
            str(scenario.seed),
            "--task",
            scenario.task,
            "--checkpoints",
            str(root / "ckpt"),
            *scenario.args,
        ]
        with open(root / f"rank-{rank}.log", "ab") as log:
            ranks.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=log))
    return ranks


def _query(db: Path, sql: str, **params: Any) -> list[dict[str, Any]]:
    engine = sa.create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as connection:
            return [dict(r._mapping) for r in connection.execute(sa.text(sql), params)]
    except sa.exc.OperationalError:
        return []
    finally:
        engine.dispose()


def _incidents(db: Path, kind: str | None = None) -> list[dict[str, Any]]:
    sql = "SELECT id, kind, severity, first_step, last_step, detected_step, summary, ranks FROM incidents"
    rows = _query(db, sql + (" WHERE kind = :kind" if kind else ""), kind=kind)
    for row in rows:
        row["ranks"] = json.loads(row["ranks"]) if isinstance(row["ranks"], str) else row["ranks"]
    return rows


def _hang_evidence(db: Path) -> tuple[float | None, float | None]:
    """The first hang finding's timeout and its stuck rank's time in phase."""
    rows = _query(db, "SELECT threshold, evidence FROM findings WHERE kind = 'hang' ORDER BY id LIMIT 1")
    if not rows:
        return None, None
    evidence = rows[0]["evidence"]
    evidence = json.loads(evidence) if isinstance(evidence, str) else evidence
    stuck = evidence.get("stuck") or [{}]
    return rows[0]["threshold"], stuck[0].get("in_phase_s")


def _stuck(db: Path) -> bool:
    return bool(_query(db, "SELECT 1 FROM heartbeats WHERE phase = 'forward' AND rank >= 0 LIMIT 1"))


def _steps(db: Path) -> int:
    rows = _query(db, "SELECT COUNT(*) AS n FROM step_summaries")
    return int(rows[0]["n"]) if rows else 0


def run_corpus(only: str | None = None) -> list[Outcome]:
    workdir = Path(tempfile.mkdtemp(prefix="rh-scenarios-", dir=os.environ.get("TMPDIR")))
    outcomes = []
    for scenario in corpus():
        if only and only not in scenario.name:
            continue
        outcome = run_scenario(scenario, workdir)
        print(
            f"  {scenario.name}: {[(i['kind'], i['first_step']) for i in outcome.incidents]} "
            f"({outcome.seconds:.0f} s){' ERROR ' + outcome.error if outcome.error else ''}",
            file=sys.stderr,
        )
        outcomes.append(outcome)
    return outcomes
