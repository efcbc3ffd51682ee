"""Saves as the hook records them (``checkpoint_events.py``, ``async_saves.py``), in real small
trainings against a service in this process, on both backends: a slow save that a preemption
warning does not cover (the budget's finding, with its arithmetic, and the slack on
``/metrics``); a PyTorch DCP ``async_save`` whose storage is held: staged but not stored, it is
no recovery point, and stored it is; an optimizer step before staging completed (a torn
snapshot: a finding, and no rollback target); the previous recovery point deleted before the
new one was published."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from collectors import RunHealth, track_async_save
from monitor.config import ServiceConfig
from monitor.observe.metrics import names
from monitor.observe.metrics.exporter import RunHealthCollector
from monitor.recovery import checkpoints
from monitor.service import Service
from monitor.store import models
from policies.async_checkpoints import ASYNC_TAG, SAVE_S, STAGING_S, UPDATES_BEFORE_STAGED
from policies.checkpoints import CheckpointFacts, rewind_target
from policies.preemption import PreemptionConfig
from tests.collectors_support import wait_until
from tests.support import ADMIN_TOKEN, RunHandle, both_backends, require_module
from tests.test_collectors_resume import ServiceTransport, TinyLM, config, get_batch, lm_loss

require_module("torch")  # before the import: skipped without torch, failed in CI

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse  # noqa: E402

pytestmark = both_backends

FINDING = models.table_of(models.FindingRow)
CHECKPOINT = models.table_of(models.CheckpointEvent)
STEP = models.table_of(models.StepRecord)
WARNING_S, MARGIN_S = 1.0, 0.25
SLOW_STORAGE_S = 1.2  # longer than the whole warning: the budget cannot fit, however fast the windows


@pytest.fixture
def service_config() -> ServiceConfig:
    config = ServiceConfig(admin_token=ADMIN_TOKEN)
    preemption = PreemptionConfig(warning_s=WARNING_S, margin_s=MARGIN_S)
    return replace(config, engine=replace(config.engine, preemption=preemption))


class Trainer:
    """A hand-written loop, the nanoGPT style: one window per optimizer step."""

    def __init__(self, service: Service, run: RunHandle, root: Path) -> None:
        torch.manual_seed(0)
        self.model = TinyLM()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        hook_config = config(root)
        hook_config = replace(hook_config, hook=replace(hook_config.hook, manifest_settle_s=0.05))
        self.rh = RunHealth(
            model=self.model,
            optimizer=self.optimizer,
            config=hook_config,
            transport=ServiceTransport(service, run),
            environ={},
            hostname=lambda: "node-a",
        ).start()
        self.iter_num = 0

    def train(self, steps: int, after_step: Any = None) -> None:
        for _ in range(steps):
            tokens, offsets = get_batch()
            self.rh.window_start(sample_ids=offsets)
            loss = lm_loss(self.model, tokens)
            self.rh.loss(loss, labels=tokens)
            loss.backward()
            self.rh.grad_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
            self.optimizer.step()
            if after_step is not None:
                after_step()
            self.optimizer.zero_grad()
            self.rh.window_end()
            self.iter_num += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "iter_num": self.iter_num}


def findings(service: Service, run: RunHandle, kind: str) -> list[dict[str, Any]]:
    with service.engine.connect() as connection:
        rows = connection.execute(
            sa.select(FINDING)
            .where(FINDING.c.run_id == run.id, FINDING.c.kind == kind)
            .order_by(FINDING.c.id)
        )
        return [dict(row) for row in rows.mappings()]


def recorded(service: Service, run: RunHandle) -> dict[int, dict[str, Any]]:
    """The run's checkpoint records by step (their newest version)."""
    with service.engine.connect() as connection:
        rows = connection.execute(
            sa.select(CHECKPOINT).where(CHECKPOINT.c.run_id == run.id).order_by(CHECKPOINT.c.time)
        )
        return {row["step"]: dict(row) for row in rows.mappings()}


def newest_step(service: Service, run: RunHandle) -> int | None:
    """The newest step a stored window reached."""
    with service.engine.connect() as connection:
        return connection.execute(sa.select(sa.func.max(STEP.c.step)).where(STEP.c.run_id == run.id)).scalar()


def recovery_point(service: Service, run: RunHandle, first_affected_step: int) -> CheckpointFacts | None:
    """The checkpoint a rollback to before ``first_affected_step`` would be proposed with."""
    with service.engine.begin() as connection:
        known, unsafe = checkpoints.confirmed_facts(connection, run.id, first_affected_step, time.time())
    return rewind_target(known, first_affected_step, unsafe)


def test_a_slow_save_past_the_preemption_warning_is_a_finding_with_its_arithmetic(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    trainer = Trainer(service, run, tmp_path)
    ckpt = tmp_path / "out" / "ckpt.pt"
    ckpt.parent.mkdir()
    with trainer.rh:
        for _ in range(2):
            trainer.train(10)
            trainer.rh.checkpoint_saving()
            torch.save(trainer.state(), ckpt)  # overwritten in place, as nanoGPT does
            threading.Event().wait(SLOW_STORAGE_S)  # slow storage: the save is durable only now
            trainer.rh.checkpoint_saved(trainer.iter_num, ckpt)
    stored = recorded(service, run)
    assert sorted(stored) == [10, 20] and all(
        row["metrics"][SAVE_S] >= SLOW_STORAGE_S for row in stored.values()
    )
    # Judged at the first save's record already (with the windows stored by then: its record
    # comes after its files were hashed); the second save, as short, joins its incident.
    (finding,) = findings(service, run, "preemption_budget")
    evidence = finding["evidence"]
    assert evidence["save_s"] == stored[10]["metrics"][SAVE_S] and 10 <= evidence["windows"] <= 20
    assert 0 < evidence["window_s"] and evidence["slack_s"] < WARNING_S - SLOW_STORAGE_S - MARGIN_S
    arithmetic = (
        f"T_warning {WARNING_S:g} s < T_window {evidence['window_s']:.3g} s + T_save "
        f"{evidence['save_s']:.3g} s + T_margin {MARGIN_S:g} s = {evidence['needed_s']:.3g} s"
    )
    assert arithmetic in finding["message"] and finding["severity"] == "warning"
    # The gauge: the budget after the newest save (20 windows, the longer of the two saves).
    registry = CollectorRegistry()
    registry.register(RunHealthCollector(service))
    slack = registry.get_sample_value(names.PREEMPTION_SLACK.name, {"run": run.name})
    longest = max(row["metrics"][SAVE_S] for row in stored.values())
    assert slack is not None and slack < WARNING_S - longest - MARGIN_S


class HeldWriter(FileSystemWriter):
    """DCP's file system writer whose storage waits for ``release``: an upload still running."""

    def __init__(self, path: Path, release: threading.Event) -> None:
        super().__init__(str(path))
        self.release = release

    def write_data(self, plan: Any, planner: Any) -> Any:
        if not self.release.wait(60):
            raise TimeoutError("the test never released the upload")
        return super().write_data(plan, planner)


# One process without a process group: DCP saves it alone (no_dist), and says so each time.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_async_save_staged_but_not_stored_is_no_recovery_point_until_stored(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    trainer = Trainer(service, run, tmp_path)
    rh = trainer.rh
    # PyTorch 2.9's DefaultStager, staging on its own thread (CPU: no pinned memory, no CUDA copies).
    stager = DefaultStager(StagingOptions(False, False, True, False))
    released, held = threading.Event(), threading.Event()
    released.set()
    with rh:
        trainer.train(10)
        rh.checkpoint_saving(10)
        first = dcp.async_save(
            trainer.state(),
            storage_writer=HeldWriter(tmp_path / "ckpt-10", released),
            async_stager=stager,
            no_dist=True,
        )
        track_async_save(rh, 10, tmp_path / "ckpt-10", first)
        first.upload_completion.result(60)
        trainer.train(10)
        rh.checkpoint_saving(20)
        second = dcp.async_save(
            trainer.state(),
            storage_writer=HeldWriter(tmp_path / "ckpt-20", held),
            async_stager=stager,
            no_dist=True,
        )
        assert isinstance(second, AsyncSaveResponse)
        track_async_save(rh, 20, tmp_path / "ckpt-20", second)
        second.staging_completion.result(60)  # as the recipe says: staged before the next step
        trainer.train(3)
        # Everything the hook had to send by now is stored: the windows after staging, and the
        # step-10 checkpoint's record (hashed on the hook's manifest thread).
        assert wait_until(lambda: 10 in recorded(service, run) and newest_step(service, run) == 23, 60)
        assert not second.upload_completion.done()
        assert sorted(recorded(service, run)) == [10]  # the staged snapshot is not a checkpoint yet
        target = recovery_point(service, run, first_affected_step=22)
        assert target is not None and target.step == 10
        held.set()
        second.upload_completion.result(60)
        assert wait_until(lambda: recorded(service, run).get(20, {}).get("manifest") is not None, 60)
        target = recovery_point(service, run, first_affected_step=22)
        assert target is not None and target.step == 20 and target.path == str(tmp_path / "ckpt-20")
    stager.close()
    row = recorded(service, run)[20]
    assert row["tags"] == [ASYNC_TAG] and 0 <= row["metrics"][STAGING_S] < row["metrics"][SAVE_S]
    assert UPDATES_BEFORE_STAGED not in row["metrics"]
    assert findings(service, run, "updated_before_staged") == []


def test_an_optimizer_step_before_staging_completed_is_a_finding_and_no_rollback_target(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    trainer = Trainer(service, run, tmp_path)
    rh = trainer.rh
    stepped = threading.Event()
    pool = ThreadPoolExecutor(max_workers=2)  # a thread-based stager, and the storage behind it

    def save(step: int, path: Path, wait_for_step: bool) -> AsyncSaveResponse:
        def stage() -> dict[str, Any]:
            if wait_for_step and not stepped.wait(60):  # a staging copy slower than the next step
                raise TimeoutError("no step came")
            return {k: v.clone() for k, v in trainer.model.state_dict().items()}

        staging = pool.submit(stage)
        upload = pool.submit(lambda: torch.save(staging.result(), path))
        return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)

    with rh:
        trainer.train(10)
        rh.checkpoint_saving(10)
        good = save(10, tmp_path / "ckpt-10.pt", wait_for_step=False)
        track_async_save(rh, 10, tmp_path / "ckpt-10.pt", good)
        good.upload_completion.result(60)
        trainer.train(10)
        rh.checkpoint_saving(20)
        torn = save(20, tmp_path / "ckpt-20.pt", wait_for_step=True)
        track_async_save(rh, 20, tmp_path / "ckpt-20.pt", torn)
        trainer.train(1, after_step=stepped.set)  # the trainer did not wait for staging
        torn.upload_completion.result(60)
        trainer.train(2)
    pool.shutdown()
    row = recorded(service, run)[20]
    assert row["metrics"][UPDATES_BEFORE_STAGED] == 1.0 and row["tags"] == [ASYNC_TAG]
    (finding,) = findings(service, run, "updated_before_staged")
    assert "made 1 optimizer update(s) before the checkpoint of step 20" in finding["message"]
    assert str(tmp_path / "ckpt-20.pt") in finding["message"] and finding["severity"] == "warning"
    target = recovery_point(service, run, first_affected_step=22)
    assert target is not None and target.step == 10  # the newer checkpoint is torn
    assert findings(service, run, "previous_deleted_before_publish") == []


def test_a_save_the_trainer_waited_for_is_recorded_though_the_hook_closes_before_its_callbacks_ran(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    trainer = Trainer(service, run, tmp_path)
    rh = trainer.rh
    ckpt = tmp_path / "ckpt-5.pt"
    response = AsyncSaveResponse(staging_completion=Future(), upload_completion=Future())
    closed = threading.Event()
    # The storage future wakes the trainer's result() first and runs its callbacks after: here
    # another callback, first in line, holds the storage thread until the hook closed (or 3 s).
    response.upload_completion.add_done_callback(lambda _: closed.wait(3.0))
    with rh:
        trainer.train(5)
        rh.checkpoint_saving(5)
        torch.save(trainer.state(), ckpt)
        response.staging_completion.set_result(None)
        track_async_save(rh, 5, ckpt, response)
        storer = threading.Thread(target=response.upload_completion.set_result, args=(None,))
        storer.start()
        response.upload_completion.result(60)  # the last save stored: the trainer closes at once
    closed.set()
    storer.join(60)
    row = recorded(service, run).get(5)
    assert row is not None and row["tags"] == [ASYNC_TAG] and row["manifest"] is not None


def test_the_previous_recovery_point_deleted_before_the_new_one_is_published_is_named(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    trainer = Trainer(service, run, tmp_path)
    rh = trainer.rh
    with rh:
        trainer.train(5)
        rh.checkpoint_saving()
        (tmp_path / "ckpt-5").mkdir()
        torch.save(trainer.state(), tmp_path / "ckpt-5" / "model.pt")
        rh.checkpoint_saved(5, tmp_path / "ckpt-5")
        assert wait_until(lambda: 5 in recorded(service, run), 60)
        trainer.train(5)
        rh.checkpoint_saving()
        rh.checkpoint_staged()
        shutil.rmtree(tmp_path / "ckpt-5")  # "keep last 1", done before the new one is stored
        (tmp_path / "ckpt-10").mkdir()
        torch.save(trainer.state(), tmp_path / "ckpt-10" / "model.pt")
        rh.checkpoint_saved(10, tmp_path / "ckpt-10")
        trainer.train(1)
    (finding,) = findings(service, run, "previous_deleted_before_publish")
    assert finding["message"].startswith(f"the previous recovery point (step 5, {tmp_path / 'ckpt-5'}) was")
    assert "before the checkpoint of step 10" in finding["message"]


def test_a_blocking_save_rotating_the_previous_one_after_writing_is_fine_deleting_it_first_is_not(
    service: Service, run: RunHandle, tmp_path: Path
) -> None:
    trainer = Trainer(service, run, tmp_path)
    rh = trainer.rh

    def blocking_save(step: int) -> Path:
        rh.checkpoint_saving()
        folder = tmp_path / f"ckpt-{step}"
        folder.mkdir()
        torch.save(trainer.state(), folder / "model.pt")
        return folder

    with rh:
        for step in (5, 10):  # "keep last 1" after the new one is written (the Trainer's rotation)
            trainer.train(5)
            folder = blocking_save(step)
            if step == 10:
                shutil.rmtree(tmp_path / "ckpt-5")
            rh.checkpoint_saved(step, folder)
        assert wait_until(lambda: (recorded(service, run).get(10) or {}).get("manifest") is not None, 60)
        trainer.train(5)
        shutil.rmtree(tmp_path / "ckpt-10")  # gone before the next save even began
        rh.checkpoint_saved(15, blocking_save(15))
        trainer.train(1)
    (finding,) = findings(service, run, "previous_deleted_before_publish")
    assert finding["step"] == 15 and f"(step 10, {tmp_path / 'ckpt-10'})" in finding["message"]
