"""Batch arithmetic on resume: the rule (``policies/batch_size.py``) and real resumes of the
nanoGPT-style test trainer (gloo, CPU) onto fewer ranks against a real ``runhealth serve``
(``monitor/judge/batches.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from collectors import RunHealth
from policies.batch_size import BatchConfig, BatchShape, batch_change, declaration, declared
from policies.types import Severity
from tests.collectors_support import RecordingTransport, ServeProcess, wait_until
from tests.test_attach_recipes import TARGETS, TRAINERS, Job, serve, token_files
from tests.test_collectors_hook import hook_config

__all__ = ["serve"]  # the fixture (a real runhealth serve for the module's runs), used by name

CONFIG = BatchConfig()


def shape(
    name: str, world: int, k: int, *, tp: int = 1, micro: int | None = None, **kw: object
) -> BatchShape:
    return BatchShape(name, world, tp=tp, accumulation=k, micro_batch=micro, first_step=31, **kw)  # type: ignore[arg-type]


def test_halving_the_replicas_halves_the_global_batch_and_says_so_with_the_arithmetic() -> None:
    before = shape("a", 8, 8, tp=2, micro=2)  # D = 8 / 2 = 4: B = 2 x 8 x 4 = 64
    after = shape("b", 4, 8, tp=2, micro=2)  # D = 2: B = 32
    finding = batch_change(before, after, CONFIG)
    assert finding is not None and finding.kind == "batch_changed" and finding.severity is Severity.WARNING
    assert "global batch 64 -> 32 examples per update" in finding.message
    assert "D = N / (TP x PP x CP) = 4 / (2 x 1 x 1) = 2" in finding.message
    assert "B_global = B_micro x K x D = 2 x 8 x 2 = 32" in finding.message
    assert "not declared remapped" in finding.message
    assert finding.step == 31 and finding.incarnation == "b"


def test_fewer_replicas_with_more_accumulation_keep_the_update_size() -> None:
    assert batch_change(shape("a", 8, 8, micro=2), shape("b", 4, 16, micro=2), CONFIG) is None


def test_tokens_per_update_are_judged_when_examples_are_unknown_and_within_their_own_spread() -> None:
    before = shape("a", 4, 2, tokens_per_update=2048.0)
    assert batch_change(before, shape("b", 2, 2, tokens_per_update=1024.0), CONFIG) is not None
    assert batch_change(before, shape("b", 4, 2, tokens_per_update=1900.0), CONFIG) is None
    noisy = shape("a", 4, 2, tokens_per_update=2048.0, tokens_spread=400.0)  # 3 x 400 / 2048 = 59%
    assert batch_change(noisy, shape("b", 2, 2, tokens_per_update=1024.0), CONFIG) is None


def test_milestones_declared_in_examples_make_it_a_note() -> None:
    finding = batch_change(
        shape("a", 8, 8, micro=2), shape("b", 4, 8, micro=2, schedule_unit="examples"), CONFIG
    )
    assert finding is not None and finding.severity is Severity.INFO
    assert "milestones in examples: they stay at the same data volume" in finding.message


def test_the_declaration_is_checked_and_read_back_leniently() -> None:
    assert declaration(micro_batch=2, schedule_unit="tokens") == {"micro_batch": 2, "schedule_unit": "tokens"}
    with pytest.raises(ValueError, match="micro_batch"):
        declaration(micro_batch=0)
    with pytest.raises(ValueError, match="schedule_unit"):
        declaration(schedule_unit="epochs")
    assert declared({"batch": {"micro_batch": 2, "accumulation": True, "schedule_unit": "x"}}) == (
        2,
        None,
        None,
    )
    assert declared(None) == (None, None, None)
    with pytest.raises(ValueError, match="tokens_change"):
        BatchConfig(tokens_change=1.5)


def test_the_declared_batch_goes_with_the_run_start_record(tmp_path: Path) -> None:
    transport = RecordingTransport()
    rh = RunHealth(config=hook_config(tmp_path), transport=transport, environ={}, hostname=lambda: "n")
    rh.declare_batch(micro_batch=2, schedule_unit="examples")
    rh.declare_batch(micro_batch=3, accumulation=8)  # what an adapter fills in: only what is missing
    rh.declare_batch(micro_batch=0)  # refused (logged and counted), training goes on
    with rh.start():
        pass
    (start,) = transport.records("run_start")
    assert start["config"]["batch"] == {"micro_batch": 2, "accumulation": 8, "schedule_unit": "examples"}
    assert rh.counters["hook_errors"] == 1


def train(job: Job, ranks: int, *args: str) -> None:
    job.start(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            str(TRAINERS / "nanogpt_hooked.py"), "--data_dir=data", "--eval_interval=10", *args,
        ]
    )  # fmt: skip
    job.wait()


@pytest.mark.slow
def test_a_resume_onto_half_the_replicas_raises_the_batch_finding_unless_accumulation_doubles(
    tmp_path: Path, serve: ServeProcess, request: pytest.FixtureRequest
) -> None:
    """4 ranks x 2 microbatches of 4 sequences; resumed on 2 ranks x 4 microbatches (D halved, K
    doubled: the same update); resumed again on 1 rank x 4 (D halved): only that one changes it."""
    workdir = tmp_path / "job"
    workdir.mkdir()
    token_files(workdir)
    run, token = "batches", serve.create_run("batches")
    starts = (
        (4, "--max_iters=10", "--gradient_accumulation_steps=2"),
        (2, "--max_iters=20", "--gradient_accumulation_steps=4", "--init_from=resume"),
        (1, "--max_iters=30", "--gradient_accumulation_steps=4", "--init_from=resume"),
    )  # each trains 11 windows from the checkpoint at its start: BatchConfig.windows (8) and 3 more
    for ranks, *args in starts:
        job = Job(workdir, serve, run, token, **TARGETS)
        request.addfinalizer(job.close)
        train(job, ranks, *args)

    def batch_findings() -> list[dict[str, object]]:
        return [f for f in job.rows("findings") if f["kind"] == "batch_changed"]

    assert wait_until(lambda: bool(batch_findings()), 60, 0.5), serve.log_tail()
    starts_in_order = sorted(job.rows("incarnations"), key=lambda row: row["started_at"])
    assert len(starts_in_order) == 3
    (finding,) = batch_findings()  # the second resume's, not the first's
    assert finding["incarnation"] == starts_in_order[2]["incarnation"]
    message = str(finding["message"])
    # Global supervised tokens: 4 sequences x 32 tokens x K x D = 4 x 32 x 4 x 2 = 1024 -> 512.
    assert "tokens per update 1024 -> 512 (-50%)" in message, message
    assert "D = N / (TP x PP x CP) = 2 / (1 x 1 x 1) = 2" in message, message
    assert "D = N / (TP x PP x CP) = 1 / (1 x 1 x 1) = 1" in message, message
    assert finding["severity"] == "warning" and finding["step"] >= 21
