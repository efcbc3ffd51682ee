"""An Accelerate custom training loop with runhealth attached by the README's recipe
(``tests/trainers/accelerate_hooked.py``: ``accelerator.prepare``, ``accumulate``,
``clip_grad_norm_`` on the updating microbatch, ``save_state("step_N")`` relative to the working
directory), under ``torchrun`` (4 gloo ranks), with the embedded service (no ``RUNHEALTH_URL``).

A NaN on rank 1 at update 23: the service holds every rank, proposes a rollback to ``step_20``,
an operator approves it with ``runhealth approve ID --db runhealth.db``, every rank restores the
folder with ``accelerator.load_state`` through ``handle_rollback`` (step 20 starts an epoch:
nothing to skip), trains on, and the resume verifies. Each of the three defects this found fails
it: the prepared (wrapped) optimizer took no step hooks, so no update was counted and every
window looked like a skipped update; the prepared scheduler made ``rh.resumed`` raise, so no
resume was recorded; a save inside ``rh.windows()`` recorded the checkpoint's consumed count one
window short, and the rollback carried that count on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.adapters_support import run_rows
from tests.collectors_support import (
    REPO,
    assert_recovered_in_the_audit,
    embedded_store,
    finish_job,
    held_job_environ,
    job_running,
    pending_rollback,
    table_rows,
)
from tests.support import require_module
from tests.test_attach_recipes import cli

torch = require_module("torch")
require_module("accelerate")
require_module("transformers")
pytestmark = pytest.mark.slow

TRAINER = REPO / "tests" / "trainers" / "accelerate_hooked.py"
WORLD = 4
RUN = "accelerate-nan"
EXAMPLES_PER_UPDATE = 4 * 2 * WORLD  # per-device batch x accumulation x ranks


def test_a_nan_is_held_rolled_back_to_a_step_folder_after_cli_approval_and_the_resume_verifies(
    tmp_path: Path,
) -> None:
    environ = held_job_environ(
        RUN,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
        str(TRAINER), "--max_train_steps=60", "--checkpointing_steps=10", "--nan_at=23",
        "--nan_rank=1", "--step_sleep=0.1",
    ]  # fmt: skip
    with job_running(command, tmp_path, environ) as (job, log_path):
        db = embedded_store(tmp_path, log_path)
        proposal = pending_rollback(db, RUN, 20, log_path)
        assert proposal["target"]["step"] == 20, proposal
        assert proposal["target"]["path"] == str(tmp_path / "step_20")  # made absolute by the hook
        approved = cli(tmp_path, "approve", str(proposal["id"]), "--db", str(db), "--reason", "NaN at 23")
        assert approved["ok"], approved
        finish_job(job, log_path)

    steps = run_rows(db, "step_records", RUN)
    first, resumed = list(dict.fromkeys(s["incarnation"] for s in steps))
    before = [s for s in steps if s["incarnation"] == first]
    # Every window is an update (counted by the inner optimizer's step hooks), with its loss,
    # grad norm and supervised tokens: 4 rows of 31 shifted labels, 2 microbatches.
    assert sorted({s["rank"] for s in before}) == list(range(WORLD))
    for rank in range(WORLD):
        mine = [s for s in before if s["rank"] == rank]
        assert [s["step"] for s in mine] == list(range(1, len(mine) + 1)), mine
    assert all(s["tokens"] == 4 * 31 * 2 and s["consumed"] == s["step"] * EXAMPLES_PER_UPDATE for s in steps)
    finite = [s for s in steps if s["incarnation"] == resumed or s["step"] < 23]
    assert all(np.isfinite(s["loss_sum"]) and np.isfinite(s["grad_norm"]) for s in finite)
    checkpoints = {c["step"]: c["consumed"] for c in run_rows(db, "checkpoint_events", RUN)}
    assert all(consumed == step * EXAMPLES_PER_UPDATE for step, consumed in checkpoints.items()), checkpoints

    after = [s for s in steps if s["incarnation"] == resumed]
    assert min(s["step"] for s in after) == 21 and max(s["step"] for s in after) == 60
    assert len(after) == WORLD * 40 and all(np.isfinite(s["loss_sum"]) for s in after)
    resumes = run_rows(db, "resume_events", RUN)
    assert sorted(r["rank"] for r in resumes) == list(range(WORLD))
    assert {(r["checkpoint_step"], r["restored"]["consumed"]) for r in resumes} == {
        (20, 20 * EXAMPLES_PER_UPDATE)
    }
    assert {r["restored"]["scheduler"]["last_epoch"] for r in resumes} == {
        20 * WORLD
    }  # read through the wrapper
    acks = table_rows(db, "directive_acks")
    assert {(a["directive_id"], a["status"]) for a in acks} >= {(approved["proposal"]["directive"], "done")}

    (incident,) = [i for i in run_rows(db, "incidents", RUN) if i["kind"] != "straggler"]
    assert (incident["kind"], incident["first_step"], incident["status"]) == ("nonfinite", 23, "resolved")
    # Four ranks on two cores beside other work: a straggler warning about the host is allowed
    # (as in tests/test_attach_recipes.py); nothing else, and nothing after the rollback.
    findings = [f for f in run_rows(db, "findings", RUN) if not f["kind"].startswith("straggler")]
    assert {f["kind"] for f in findings} == {"nonfinite"}, findings
    assert all(f["incarnation"] == first for f in findings)
    assert_recovered_in_the_audit(db, tmp_path)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:]
