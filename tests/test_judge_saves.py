"""Published checkpoints judged as saves (``monitor/judge/saves.py``), on both backends: the
preemption budget from the run's own window and save times (one incident while it does not
fit, resolved when it does, the slack on ``/metrics``), and the save ordering rules (a torn
snapshot is no rollback target; the previous recovery point deleted early is named)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine

from monitor.config import ServiceConfig
from monitor.observe.metrics import names
from monitor.observe.metrics.exporter import RunHealthCollector
from monitor.recovery import checkpoints
from monitor.service import Service
from monitor.store import models
from policies.async_checkpoints import PREVIOUS_DELETED_TAG, SAVE_S, STAGING_S, UPDATES_BEFORE_STAGED
from policies.checkpoints import rewind_target
from policies.preemption import PreemptionConfig
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, both_backends, post, step_record

INCIDENT = models.table_of(models.Incident)
FINDING = models.table_of(models.FindingRow)

pytestmark = both_backends


@pytest.fixture
def service_config() -> ServiceConfig:
    config = ServiceConfig(admin_token=ADMIN_TOKEN)
    preemption = PreemptionConfig(warning_s=30.0, margin_s=5.0)
    return replace(config, engine=replace(config.engine, preemption=preemption))


def windows(attempts: range, ranks: int = 2, slow_rank_s: float = 0.0) -> list[dict[str, Any]]:
    """Windows of 10 s (2 + 3 + 4 + 1 s of phases); rank 1 ``slow_rank_s`` slower in backward."""
    return [
        step_record(
            rank,
            attempt,
            data_wait_s=2.0,
            forward_s=3.0,
            backward_s=4.0 + (slow_rank_s if rank else 0.0),
            optimizer_s=1.0,
        )
        for attempt in attempts
        for rank in range(ranks)
    ]


def saved(root: Path, step: int, *, save_s: float | None, tags: list[str] | None = None,
          **metrics: float) -> dict[str, Any]:  # fmt: skip
    """A published checkpoint whose one file is on disk, with the hook's timings."""
    folder = root / f"ckpt-{step}"
    folder.mkdir()
    payload = f"weights at {step}".encode()
    (folder / "model.pt").write_bytes(payload)
    files = [{"path": "model.pt", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}]
    timed = {**({SAVE_S: save_s} if save_s is not None else {}), **metrics}
    return {"kind": "checkpoint", "incarnation": INCARNATION, "step": step, "path": str(folder),
            "time": 1000.0 + step + 0.5, "manifest": {"step": step, "files": files},
            "metrics": timed or None, "tags": tags}  # fmt: skip


def of_kind(store: Engine, table: sa.Table, run: RunHandle, kind: str) -> list[dict[str, Any]]:
    with store.connect() as connection:
        rows = connection.execute(
            sa.select(table).where(table.c.run_id == run.id, table.c.kind == kind).order_by(table.c.id)
        ).mappings()
        return [dict(row) for row in rows]


def incidents(store: Engine, run: RunHandle, kind: str) -> list[dict[str, Any]]:
    return of_kind(store, INCIDENT, run, kind)


def findings(store: Engine, run: RunHandle, kind: str) -> list[dict[str, Any]]:
    return of_kind(store, FINDING, run, kind)


def slack(service: Service, run: RunHandle) -> float | None:
    registry = CollectorRegistry()
    registry.register(RunHealthCollector(service))
    return registry.get_sample_value(names.PREEMPTION_SLACK.name, {"run": run.name})


def test_a_save_past_the_warning_is_one_incident_with_the_arithmetic_until_a_save_fits(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    post(service, run, windows(range(0, 20), slow_rank_s=0.5))  # the slower rank's 10.5 s is the window
    assert slack(service, run) is None  # no save measured yet
    post(service, run, [saved(tmp_path, 19, save_s=14.5)])  # 10.5 + 14.5 + 5 = 30: fits exactly
    assert slack(service, run) == pytest.approx(0.0) and incidents(store, run, "preemption_budget") == []
    post(service, run, [*windows(range(20, 40)), saved(tmp_path, 39, save_s=15.0)])
    (incident,) = incidents(store, run, "preemption_budget")
    assert incident["status"] == "open" and incident["severity"] == "warning"
    (finding,) = findings(store, run, "preemption_budget")
    assert "T_warning 30 s < T_window 10.5 s + T_save 15 s + T_margin 5 s = 30.5 s" in finding["message"]
    assert finding["evidence"]["slack_s"] == pytest.approx(-0.5) and slack(service, run) == pytest.approx(
        -0.5
    )
    post(service, run, [*windows(range(40, 60)), saved(tmp_path, 59, save_s=16.0)])
    assert len(findings(store, run, "preemption_budget")) == 1  # still short: the same incident, not another
    assert slack(service, run) == pytest.approx(-1.5)
    # T_save is the longest of the last five saves: five quick ones later, the budget fits again.
    for step in (79, 99, 119, 139, 159):
        post(service, run, [*windows(range(step - 19, step + 1)), saved(tmp_path, step, save_s=2.0)])
    (incident,) = incidents(store, run, "preemption_budget")
    assert incident["status"] != "open" and slack(service, run) == pytest.approx(30 - (10.5 + 2 + 5))
    (note,) = findings(store, run, "preemption_budget_fits")
    assert "T_warning 30 s >= T_window 10.5 s + T_save 2 s + T_margin 5 s = 17.5 s" in note["message"]


def test_without_a_configured_warning_nothing_is_judged_or_exported(
    store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    service = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN))
    post(service, run, [*windows(range(0, 5)), saved(tmp_path, 4, save_s=500.0)])
    assert incidents(store, run, "preemption_budget") == [] and slack(service, run) is None


def test_a_torn_snapshot_is_a_finding_and_no_rollback_target(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    post(service, run, [*windows(range(0, 25)), saved(tmp_path, 10, save_s=1.0)])
    torn = saved(tmp_path, 20, save_s=1.5, tags=["async"], **{STAGING_S: 0.7, UPDATES_BEFORE_STAGED: 1.0})
    post(service, run, [torn])
    (finding,) = findings(store, run, "updated_before_staged")
    assert "1 optimizer update(s) before the checkpoint of step 20" in finding["message"]
    assert "(staging took 0.7 s)" in finding["message"]
    with store.begin() as connection:
        known, unsafe = checkpoints.confirmed_facts(connection, run.id, first_affected_step=25, now=2000.0)
        listed = checkpoints.registry(connection, run.id)
    target = rewind_target(known, 25, unsafe)
    assert target is not None and target.step == 10  # not the newer, torn one
    tags = {row["step"]: [t["tag"] for t in row["tags"]] for row in listed}
    assert "unsafe" in tags[20] and "latest-resumable" in tags[10]
    assert SAVE_S not in {t.get("metric") for row in listed for t in row["tags"]}  # never a best-eval metric


def test_the_previous_recovery_point_deleted_before_publication_is_named(
    service: Service, store: Engine, run: RunHandle, tmp_path: Path
) -> None:
    post(service, run, [*windows(range(0, 25)), saved(tmp_path, 10, save_s=1.0)])
    post(service, run, [saved(tmp_path, 20, save_s=1.0, tags=["async", PREVIOUS_DELETED_TAG])])
    (finding,) = findings(store, run, "previous_deleted_before_publish")
    assert finding["message"].startswith(f"the previous recovery point (step 10, {tmp_path / 'ckpt-10'}) was")
    (incident,) = incidents(store, run, "unsafe_save")
    assert incident["severity"] == "warning"
