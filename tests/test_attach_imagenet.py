"""pytorch/examples' ImageNet trainer (``tests/trainers/imagenet_hooked.py``: SGD with momentum,
``StepLR``, ``DistributedSampler``, every rank saving ``checkpoint.pth.tar`` after each epoch under
``--dist-url env://``, copied to ``model_best.pth.tar`` when accuracy improved) with runhealth
attached by the README's recipe, under ``torchrun`` (4 gloo ranks) with the embedded service.

A NaN on rank 1 at update 20 (epoch 2, 8 updates an epoch). Before the hold reaches the ranks,
epoch 2 ends and every rank saves the NaN weights over ``checkpoint.pth.tar`` (step 24, unsafe);
``model_best.pth.tar`` still holds step 16 and is the rollback target. An operator approves it
with ``runhealth approve ID --db runhealth.db``, every rank restores it through
``handle_rollback`` (the ``--resume`` block made a function), trains epochs 2 and 3 again, and
the resume verifies. Every window is stored with its 32 examples of one class each (never
shifted), its grad norm (``clip_grad_norm_`` with ``max_norm=inf``) and the rate; one
checkpoint record per file and step although four ranks saved it.
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
)
from tests.support import require_module
from tests.test_attach_recipes import cli

require_module("torch")
pytestmark = pytest.mark.slow

TRAINER = REPO / "tests" / "trainers" / "imagenet_hooked.py"
WORLD = 4
RUN = "imagenet"
PER_EPOCH = 8  # 1,024 images, 32 a batch, 4 ranks
EPOCHS = 4


def test_every_rank_saving_one_file_a_nan_rolls_back_to_model_best_after_cli_approval(tmp_path: Path) -> None:
    environ = held_job_environ(RUN)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
        str(TRAINER), "--dist-url", "env://", "--dist-backend", "gloo", "--epochs", str(EPOCHS),
        "--nan-at", "20", "--nan-rank", "1",
        "--step-sleep", "0.15",  # epochs 1.2 s or more apart: each save is hashed before the next
    ]  # fmt: skip
    with job_running(command, tmp_path, environ) as (job, log_path):
        db = embedded_store(tmp_path, log_path)
        proposal = pending_rollback(db, RUN, 2 * PER_EPOCH, log_path)
        assert proposal["target"]["path"] == str(tmp_path / "model_best.pth.tar"), proposal
        approved = cli(tmp_path, "approve", str(proposal["id"]), "--db", str(db), "--reason", "NaN at 20")
        assert approved["ok"], approved
        finish_job(job, log_path)

    steps = run_rows(db, "step_records", RUN)
    incarnations = list(dict.fromkeys(s["incarnation"] for s in steps))
    assert len(incarnations) == 2, incarnations  # the start, and the rollback's resume
    for rank in range(WORLD):
        before, after = (
            [s["step"] for s in steps if s["incarnation"] == i and s["rank"] == rank] for i in incarnations
        )
        assert before == list(range(1, len(before) + 1)) and len(before) >= 20, before
        assert after == list(range(2 * PER_EPOCH + 1, EPOCHS * PER_EPOCH + 1)), after
    for s in steps:
        assert (s["tokens"], s["lr"], s["skipped"]) == (32, 0.1, False), s
        assert s["consumed"] == s["step"] * 32 * WORLD, s  # after the rollback: its checkpoint's count on
    finite = [s for s in steps if s["incarnation"] == incarnations[1] or s["step"] < 20]
    assert all(np.isfinite(s["loss_sum"]) and np.isfinite(s["grad_norm"]) for s in finite)

    # Each file once a save, whichever ranks said it; step 24 twice: the NaN epoch's save, and
    # the same epoch trained again after the rollback.
    saves = [
        (c["incarnation"], c["step"], Path(c["path"]).name) for c in run_rows(db, "checkpoint_events", RUN)
    ]
    assert len(saves) == len(set(saves)), saves
    assert [i for i, step, name in saves if (step, name) == (24, "checkpoint.pth.tar")] == incarnations, saves
    resumes = run_rows(db, "resume_events", RUN)
    assert sorted(r["rank"] for r in resumes) == list(range(WORLD))
    assert {(r["checkpoint_step"], r["restored"]["consumed"]) for r in resumes} == {(16, 16 * 32 * WORLD)}
    assert {r["restored"]["scheduler"]["last_epoch"] for r in resumes} == {2}  # StepLR after 2 epochs
    (incident,) = [i for i in run_rows(db, "incidents", RUN) if i["kind"] != "straggler"]
    assert (incident["kind"], incident["first_step"], incident["status"]) == ("nonfinite", 20, "resolved")
    findings = [f for f in run_rows(db, "findings", RUN) if f["severity"] != "info"]
    assert {f["kind"] for f in findings} <= {"nonfinite", "straggler"}, findings
    assert_recovered_in_the_audit(db, tmp_path)
