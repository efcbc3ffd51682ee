"""From an operator's approval to every rank stopping, at the default intervals.

``python benchmarks/approval_latency.py [--repeats 3] [--iter-sleep 0.05]``

Each repeat runs the nanoGPT-style test trainer (``tests/trainers/nanogpt_hooked.py``) on 4
gloo ranks under ``torchrun --standalone``, with no service URL (the embedded default) and no
interval set: records are sent every 2 s and directives polled every 2 s
(``SenderConfig.flush_interval_s``, ``DirectiveConfig.poll_interval_s``), the ranks agree on
directives every 4th window boundary (``HookConfig.agree_every``). Rank 1's loss is NaN at
iteration 70; as soon as the rollback proposal is pending, it is approved the way an operator
would: ``runhealth approve ID --db runhealth.db`` (the discovery file beside the store). It
prints, as JSON per repeat and summarised: the seconds from the approval (the proposal's
``decided_at``) to the last rank's stop (its acknowledgement's time, the rank's clock), the
windows trained in between (the step of the newest step record at the approval, to the step
every rank stopped at), the median window time, and the bound this is held to: two poll
intervals plus one window. A benchmark, not a test; the ranks and the service share the
machine's cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

import sqlalchemy as sa  # noqa: E402

from tests.test_attach_recipes import TRAINERS, token_files  # noqa: E402

POLL_INTERVAL_S = 2.0  # DirectiveConfig's default, which this measures


def rows(db: Path, query: str, **params: Any) -> list[dict[str, Any]]:
    engine = sa.create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as connection:
            return [dict(r._mapping) for r in connection.execute(sa.text(query), params)]
    except sa.exc.OperationalError:  # the store is not there yet (the service is starting)
        return []
    finally:
        engine.dispose()


def pending_proposal(db: Path, deadline: float) -> dict[str, Any] | None:
    while time.monotonic() < deadline:
        found = rows(db, "SELECT id FROM proposals WHERE status = 'pending' ORDER BY id")
        if found:
            return found[0]
        time.sleep(0.2)
    return None


def approve(workdir: Path, db: Path, proposal_id: int) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "monitor", "approve", str(proposal_id), "--reason", "NaN", "--db", str(db), "--json"],
        cwd=workdir, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"approve failed: {result.stdout}{result.stderr}")
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def one_run(root: Path, iter_sleep: float) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="approval-", dir=root))
    token_files(workdir)
    db = workdir / "runhealth.db"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        str(TRAINERS / "nanogpt_hooked.py"), "--data_dir=data", "--nan_at=70", "--nan_rank=1",
        "--always_save_checkpoint=False", "--eval_interval=40", "--max_iters=600",
        f"--iter_sleep={iter_sleep}",
    ]  # fmt: skip
    environ = {**os.environ, "RUNHEALTH_HOOK__SHIFT_LABELS": "0", "OMP_NUM_THREADS": "1"}
    with open(workdir / "job.log", "ab") as log:
        job = subprocess.Popen(command, cwd=workdir, env=environ, stdout=log, stderr=subprocess.STDOUT)
    try:
        proposal = pending_proposal(db, time.monotonic() + 180)
        if proposal is None:
            raise RuntimeError(f"no proposal; see {workdir / 'job.log'}")
        directive = approve(workdir, db, proposal["id"])["proposal"]["directive"]
        job.wait(300)
    finally:
        if job.poll() is None:
            job.kill()  # by PID
            job.wait()
    return measured(db, proposal["id"], directive)


def measured(db: Path, proposal_id: int, directive: int) -> dict[str, Any]:
    (decided,) = rows(db, "SELECT decided_at FROM proposals WHERE id = :id", id=proposal_id)
    acks = rows(db, "SELECT rank, step, time FROM directive_acks WHERE directive_id = :d", d=directive)
    (placed,) = rows(db, "SELECT act_at_step FROM directives WHERE id = :d", d=directive)
    steps = rows(db, "SELECT step, time FROM step_records WHERE rank = 0 ORDER BY id")
    at_approval = max(s["step"] for s in steps if s["time"] <= decided["decided_at"])
    before = [s for s in steps if s["time"] <= decided["decided_at"]]
    window_s = statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(before))
    seconds = max(a["time"] for a in acks) - decided["decided_at"]
    return {
        "ranks_stopped": len(acks),
        "stopped_at_steps": sorted({a["step"] for a in acks}),
        "act_at_step": placed["act_at_step"],
        "step_at_approval": at_approval,
        "windows": max(a["step"] for a in acks) - at_approval,
        "seconds": round(seconds, 3),
        "window_s": round(window_s, 4),
        "bound_s": round(2 * POLL_INTERVAL_S + window_s, 3),
        "within_bound": seconds <= 2 * POLL_INTERVAL_S + window_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iter-sleep", type=float, default=0.05, help="seconds added to each iteration")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rh-approval-"))
    runs = [one_run(root, args.iter_sleep) for _ in range(args.repeats)]
    for run in runs:
        print(json.dumps(run), file=sys.stderr)
    print(json.dumps({
        "poll_interval_s": POLL_INTERVAL_S,
        "runs": runs,
        "seconds_max": max(r["seconds"] for r in runs),
        "windows_max": max(r["windows"] for r in runs),
        "all_within_bound": all(r["within_bound"] for r in runs),
        "workdir": str(root),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
