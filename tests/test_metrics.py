"""/metrics: each family read from a real store and service at scrape time, on a fresh registry."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from monitor.api.routes import create_app
from monitor.config import ConfigError, ServiceConfig
from monitor.observe.metrics import CanaryVerdict, MetricsConfig, RunHealthCollector, names
from monitor.observe.metrics.state import top_stragglers
from monitor.service import Service
from monitor.settings import service_config
from monitor.store import models
from policies.stragglers import StragglerConfig, StragglerState, straggler_scores
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, both_backends, make_run, post

T0 = 1_700_000_000.0
SKIPPED = (10, 20)  # windows whose update the AMP scaler skipped on every rank


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def step_of(attempt: int) -> int:
    return attempt - sum(1 for s in SKIPPED if s <= attempt)


def window(attempt: int, rank: int, ranks: int = 4, slow: frozenset[int] = frozenset({3})) -> dict[str, Any]:
    """Rank r sees 100 (r + 1) tokens at a mean loss of 2 + 0.1 r: the token-weighted loss of a
    4-rank window is 2.2, the mean of the ranks' means 2.15."""
    tokens = 100 * (rank + 1)
    return {
        "kind": "step",
        "incarnation": INCARNATION,
        "rank": rank,
        "attempt": attempt,
        "step": step_of(attempt),
        "time": T0 + attempt,
        "node": f"node-{rank * 2 // ranks}",
        "device_uuid": f"GPU-{rank}",
        "tokens": tokens,
        "loss_sum": (2.0 + 0.1 * rank) * tokens,
        "grad_norm": 1.0 + rank,
        "lr": 1e-3,
        "loss_scale": 32768.0 if rank == 2 else 65536.0,
        "skipped": attempt in SKIPPED,
        "data_wait_s": 0.001,
        "forward_s": 0.015 if rank in slow else 0.010,
        "backward_s": 0.02,
        "optimizer_s": 0.005,
    }


def device_sample(rank: int, seq: int) -> dict[str, Any]:
    return {
        "kind": "device_sample",
        "node": f"node-{rank // 2}",
        "device_uuid": f"GPU-{rank}",
        "seq": seq,
        "time": T0 + 10 * seq,
        "rank": rank,
        "counters": {
            "clock_event_ns": {"sw_power_cap": 1_000_000_000 * seq, "hw_thermal_slowdown": 0},
            "ecc": {"volatile": {"corrected": 5, "uncorrected": 0}, "aggregate": {"corrected": 9}},
            "pcie_replay": 3,
            "nvlink": {"0": {"replay": 1, "crc_flit": 2}, "1": {"replay": 2}},
            "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
        },
    }


def link_sample(node: int, seq: int) -> dict[str, Any]:
    return {
        "kind": "link_sample",
        "node": f"node-{node}",
        "device": "mlx5_0",
        "port": 1,
        "seq": seq,
        "time": T0 + 10 * seq,
        "state": "ACTIVE" if node == 0 else "DOWN",
        "counters": {"symbol_error": 4, "link_downed": 0, "port_rcv_errors": 1, "port_xmit_data": 99},
    }


def heartbeat(rank: int, at: float) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": INCARNATION,
        "rank": rank,
        "phase": "forward",
        "phase_since": at,
        "time": at,
        "node": f"node-{rank // 2}",
    }


def checkpoint(root: Path, step: int, manifest: bool) -> dict[str, Any]:
    """A checkpoint written to ``root``: the registry re-reads its files before trusting it."""
    directory = root / f"step-{step}"
    directory.mkdir(parents=True)
    content = f"weights at step {step}".encode()
    (directory / "model.pt").write_bytes(content)
    record: dict[str, Any] = {
        "kind": "checkpoint",
        "incarnation": INCARNATION,
        "step": step,
        "path": str(directory),
        "time": T0 + step + 1,
    }
    if manifest:
        files = [{"path": "model.pt", "size": len(content), "sha256": hashlib.sha256(content).hexdigest()}]
        record["manifest"] = {"step": step, "files": files}
    return record


def sample(registry: CollectorRegistry, metric: names.Metric, **labels: str) -> float | None:
    return registry.get_sample_value(metric.name, labels)


def fresh_registry(service: Service) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RunHealthCollector(service))
    return registry


@pytest.fixture
def clock() -> Clock:
    return Clock(T0 + 40)


@pytest.fixture
def watched(store: Engine, clock: Clock) -> Service:
    return Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=clock)


@pytest.fixture
def trained(watched: Service, run: RunHandle, clock: Clock, tmp_path: Path) -> Service:
    """A 4-rank run, 30 windows (two skipped), rank 3 slow in forward, heartbeats, checkpoints,
    device and link samples on two nodes, one record replayed late and one batch sent twice."""
    held = window(5, 3)
    records = [{"kind": "run_start", "incarnation": INCARNATION, "time": T0, "world_size": 4}]
    records += [window(a, r) for a in range(1, 31) for r in range(4) if (a, r) != (5, 3)]
    post(watched, run, records)
    clock.now += 30  # rank 3 given up on for window 5: judged without it
    watched.judge_waiting()
    post(watched, run, [held])  # late
    post(watched, run, [window(30, 0)])  # sent twice: a duplicate
    post(watched, run, [checkpoint(tmp_path, 8, manifest=True), checkpoint(tmp_path, 12, manifest=False)])
    post(watched, run, [device_sample(r, s) for s in (1, 2) for r in range(4)])
    post(watched, run, [link_sample(n, s) for s in (1, 2) for n in range(2)])
    clock.now = T0 + 10
    post(watched, run, [heartbeat(3, T0 + 10)])
    clock.now = T0 + 40
    post(watched, run, [heartbeat(r, T0 + 40) for r in range(3)])
    return watched


# --- per run ----------------------------------------------------------------------------------------


@both_backends
def test_a_run_is_exported_from_its_newest_windows(trained: Service, run: RunHandle) -> None:
    registry = fresh_registry(trained)
    value = lambda metric: sample(registry, metric, run=run.name)  # noqa: E731
    assert value(names.RUN_STEP) == step_of(30) == 28
    assert value(names.RUN_LOSS) == pytest.approx(2.2)  # token-weighted, not 2.15
    assert value(names.RUN_TOKENS_PER_SECOND) == pytest.approx(1000.0)  # 1,000 tokens a second
    assert value(names.RUN_GRAD_NORM) == 4.0
    assert value(names.RUN_LEARNING_RATE) == 1e-3
    assert value(names.RUN_LOSS_SCALE) == 32768.0
    assert value(names.RUN_SKIPPED_UPDATES) == len(SKIPPED)
    assert value(names.RUN_RANKS) == 4
    assert value(names.RUN_FINISHED) == 0
    assert value(names.RUN_LAST_CHECKPOINT) == T0 + 9  # the newest with a manifest
    assert value(names.RUN_LAST_CHECKPOINT_STEP) == 8


def test_a_checkpoint_path_saved_again_counts_by_its_newest_version(
    trained: Service, run: RunHandle, tmp_path: Path
) -> None:
    """step-8 saved again, at step 6 (after a rollback, say): its step-8 version is gone, so the
    newest resumable checkpoint is the step-6 one, though step 8 is higher."""
    content = b"weights at step 6"
    (tmp_path / "step-8" / "model.pt").write_bytes(content)
    files = [{"path": "model.pt", "size": len(content), "sha256": hashlib.sha256(content).hexdigest()}]
    again = {"kind": "checkpoint", "incarnation": INCARNATION, "step": 6, "path": str(tmp_path / "step-8"),
             "time": T0 + 20, "manifest": {"step": 6, "files": files}}  # fmt: skip
    post(trained, run, [again])
    registry = fresh_registry(trained)
    assert sample(registry, names.RUN_LAST_CHECKPOINT_STEP, run=run.name) == 6
    assert sample(registry, names.RUN_LAST_CHECKPOINT, run=run.name) == T0 + 20


def test_heartbeats_count_the_ranks_heard_within_the_silence_limit(trained: Service, run: RunHandle) -> None:
    registry = fresh_registry(trained)
    assert sample(registry, names.RUN_RANKS_HEARTBEATING, run=run.name) == 3  # rank 3 is 30 s silent
    assert sample(registry, names.RUN_LAST_HEARTBEAT, run=run.name) == T0 + 40
    assert sample(registry, names.RUN_OLDEST_HEARTBEAT, run=run.name) == T0 + 10
    assert sample(registry, names.RUN_LAST_RECORD, run=run.name) == T0 + 40


def test_a_finish_record_marks_the_run_finished(trained: Service, run: RunHandle) -> None:
    post(trained, run, [{"kind": "run_finish", "incarnation": INCARNATION, "time": T0 + 50}])
    assert sample(fresh_registry(trained), names.RUN_FINISHED, run=run.name) == 1


def test_ingest_counters_come_from_the_service(trained: Service, run: RunHandle) -> None:
    with TestClient(create_app(trained)) as client:
        bad = {"records": [{"kind": "step", "rank": "zero"}]}
        assert client.post(run.records_path, json=bad, headers=run.headers).status_code == 422
    registry = fresh_registry(trained)
    assert sample(registry, names.RECORDS_LATE, run=run.name) == 1
    assert sample(registry, names.RECORDS_DUPLICATE, run=run.name) == 1
    assert sample(registry, names.RECORDS_REJECTED, run=run.name) == 1
    assert sample(registry, names.JUDGE_ERRORS, run=run.name) == 0
    stored = 1 + 120 + 2 + 8 + 4 + 4  # start, windows, checkpoints, device, link samples, heartbeats
    assert sample(registry, names.RECORDS_INGESTED, run=run.name) == stored


@pytest.mark.parametrize("finished", [False, True])
def test_a_run_silent_for_longer_than_the_retention_is_not_exported(
    watched: Service, store: Engine, clock: Clock, finished: bool
) -> None:
    old = make_run(store, "old-run")
    with store.begin() as connection:
        connection.execute(sa.update(models.Run).where(models.Run.id == old.id).values(created_at=T0 - 10))
    records = [
        {"kind": "run_start", "incarnation": INCARNATION, "time": T0, "world_size": 1},
        window(1, 0, ranks=1),
    ]
    if finished:
        records.append({"kind": "run_finish", "incarnation": INCARNATION, "time": T0 + 2})
    post(watched, old, [*records, heartbeat(0, T0 + 1)])
    assert sample(fresh_registry(watched), names.RUN_STEP, run="old-run") == 1
    clock.now = T0 + MetricsConfig.run_retention_s + 100
    assert sample(fresh_registry(watched), names.RUN_STEP, run="old-run") is None


# --- incidents and proposals ---------------------------------------------------------------------------


def add_incident(
    store: Engine, run: RunHandle, kind: str, severity: str, status: str = "open", **extra: Any
) -> int:
    row = {
        "run_id": run.id,
        "kind": kind,
        "severity": severity,
        "status": status,
        "first_step": 1,
        "last_step": 1,
        "incarnation": INCARNATION,
        "summary": kind,
        "ranks": [],
        "nodes": [],
        "devices": [],
        "finding_count": 1,
        "opened_at": T0 + 5,
        "updated_at": T0 + 5,
        **extra,
    }
    with store.begin() as connection:
        return int(
            connection.execute(sa.insert(models.Incident).returning(models.Incident.id), row).scalar_one()
        )


def add_proposal(store: Engine, run: RunHandle, incident_id: int, status: str) -> None:
    row = {
        "run_id": run.id,
        "incident_id": incident_id,
        "action": "rollback",
        "status": status,
        "data_action": "replay",
        "skip_batches": [],
        "verdict": "undetermined",
        "evidence": {},
        "created_at": T0,
    }
    with store.begin() as connection:
        connection.execute(sa.insert(models.Proposal), row)


@both_backends
def test_open_incidents_by_kind_and_severity_and_one_by_one(
    watched: Service, store: Engine, run: RunHandle
) -> None:
    hang = add_incident(store, run, "hang", "critical")
    add_incident(store, run, "spike", "warning")
    add_incident(store, run, "spike", "warning")
    add_incident(store, run, "spike", "critical", status="resolved")
    device = add_incident(store, run, "device", "critical", scope="GPU-3")
    add_proposal(store, run, hang, "pending")
    add_proposal(store, run, device, "escalated")
    add_proposal(store, run, device, "rejected")
    registry = fresh_registry(watched)
    assert sample(registry, names.INCIDENTS_OPEN, run=run.name, kind="spike", severity="warning") == 2
    assert sample(registry, names.INCIDENTS_OPEN, run=run.name, kind="hang", severity="critical") == 1
    assert sample(registry, names.INCIDENTS_OPEN, run=run.name, kind="spike", severity="critical") is None
    labels = {
        "run": run.name,
        "incident": str(device),
        "kind": "device",
        "severity": "critical",
        "scope": "GPU-3",
    }
    assert registry.get_sample_value(names.INCIDENT_OPENED.name, labels) == T0 + 5
    assert sample(registry, names.PROPOSALS_PENDING, run=run.name) == 2  # pending and escalated


def test_per_incident_series_are_capped_per_run_at_the_newest(
    store: Engine, run: RunHandle, clock: Clock
) -> None:
    service = Service(store, ServiceConfig(metrics=MetricsConfig(open_incidents_per_run=3)), clock=clock)
    ids = [add_incident(store, run, "spike", "warning") for _ in range(5)]
    families = {f.name: f for f in fresh_registry(service).collect()}
    shown = {s.labels["incident"] for s in families[names.INCIDENT_OPENED.name].samples}
    assert shown == {str(i) for i in ids[-3:]}
    assert (
        sample(fresh_registry(service), names.INCIDENTS_OPEN, run=run.name, kind="spike", severity="warning")
        == 5
    )


# --- devices, links, stragglers, canaries ----------------------------------------------------------------


def test_device_and_link_counters_from_the_newest_readings(trained: Service, run: RunHandle) -> None:
    registry = fresh_registry(trained)
    gpu = {"run": run.name, "node": "node-1", "device": "GPU-3"}
    clock = registry.get_sample_value(names.DEVICE_CLOCK_EVENT.name, {**gpu, "reason": "sw_power_cap"})
    assert clock == 2.0  # 2e9 ns in the second sample
    assert registry.get_sample_value(names.DEVICE_ECC_ERRORS.name, {**gpu, "type": "corrected"}) == 5
    assert registry.get_sample_value(names.DEVICE_NVLINK_ERRORS.name, {**gpu, "type": "replay"}) == 3
    assert registry.get_sample_value(names.DEVICE_NVLINK_ERRORS.name, {**gpu, "type": "crc_flit"}) == 2
    assert registry.get_sample_value(names.DEVICE_NVLINK_ERRORS.name, {**gpu, "type": "crc_data"}) is None
    assert registry.get_sample_value(names.DEVICE_PCIE_REPLAYS.name, gpu) == 3
    assert registry.get_sample_value(names.DEVICE_ROW_REMAP_PENDING.name, gpu) == 0
    port = {"run": run.name, "node": "node-0", "hca": "mlx5_0", "port": "1"}
    assert registry.get_sample_value(names.LINK_ERRORS.name, {**port, "counter": "symbol_error"}) == 4
    assert registry.get_sample_value(names.LINK_ERRORS.name, {**port, "counter": "port_xmit_data"}) is None
    assert registry.get_sample_value(names.LINK_ACTIVE.name, port) == 1
    assert registry.get_sample_value(names.LINK_ACTIVE.name, {**port, "node": "node-1"}) == 0


def test_device_and_link_series_can_be_turned_off(trained: Service, run: RunHandle) -> None:
    quiet = MetricsConfig(device_series="off", link_series="off")
    trained.config = replace(trained.config, metrics=quiet)  # read at every scrape
    exported = {f.name for f in fresh_registry(trained).collect() if f.samples}
    assert not any(name.startswith(("runhealth_device_", "runhealth_link_")) for name in exported)
    assert "runhealth_canary_ranks" in exported


def test_a_large_run_exports_its_device_and_port_counters_per_node(trained: Service, run: RunHandle) -> None:
    trained.config = replace(trained.config, metrics=MetricsConfig(per_device_limit=1))  # 4 devices, 2 ports
    registry = fresh_registry(trained)
    node = {"run": run.name, "node": "node-1", "device": ""}  # an empty label is no label to Prometheus
    clock = registry.get_sample_value(names.DEVICE_CLOCK_EVENT.name, {**node, "reason": "sw_power_cap"})
    assert clock == 4.0  # two devices, 2 s each
    assert registry.get_sample_value(names.DEVICE_NVLINK_ERRORS.name, {**node, "type": "replay"}) == 6
    assert registry.get_sample_value(names.DEVICE_ROW_REMAP_PENDING.name, node) == 0
    assert registry.get_sample_value(names.DEVICE_PCIE_REPLAYS.name, {**node, "device": "GPU-3"}) is None
    ports = {"run": run.name, "hca": "", "port": ""}
    assert registry.get_sample_value(names.LINK_ACTIVE.name, {**ports, "node": "node-0"}) == 1
    assert registry.get_sample_value(names.LINK_ACTIVE.name, {**ports, "node": "node-1"}) == 0
    errors = {**ports, "node": "node-0", "counter": "symbol_error"}
    assert registry.get_sample_value(names.LINK_ERRORS.name, errors) == 4
    fixed = MetricsConfig(per_device_limit=1, device_series="device", link_series="port")
    trained.config = replace(trained.config, metrics=fixed)
    gpu = {"run": run.name, "node": "node-1", "device": "GPU-3", "reason": "sw_power_cap"}
    assert fresh_registry(trained).get_sample_value(names.DEVICE_CLOCK_EVENT.name, gpu) == 2.0


def test_the_slowest_ranks_are_exported_with_their_node_and_phase(trained: Service, run: RunHandle) -> None:
    families = {f.name: f for f in fresh_registry(trained).collect()}
    scores = families[names.STRAGGLER_SLOWDOWN.name].samples
    slowest = max(scores, key=lambda s: s.value)
    assert slowest.labels == {"run": run.name, "rank": "3", "node": "node-1", "phase": "forward"}
    assert slowest.value > StragglerConfig().slow_ratio
    assert len(scores) == 4


def test_straggler_series_stay_at_k_however_many_ranks(watched: Service, run: RunHandle) -> None:
    ranks, slow = 64, frozenset({5, 17, 40})
    post(watched, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": T0, "world_size": ranks}])
    post(watched, run, [window(a, r, ranks, slow) for a in range(1, 26) for r in range(ranks)])
    families = {f.name: f for f in fresh_registry(watched).collect()}
    scores = families[names.STRAGGLER_SLOWDOWN.name].samples
    assert len(scores) == MetricsConfig.top_stragglers
    assert {s.labels["rank"] for s in sorted(scores, key=lambda s: -s.value)[:3]} == {"5", "17", "40"}


@pytest.mark.parametrize("seed", range(5))
def test_top_stragglers_are_the_policys_highest_scores(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = 200
    smoothed = {p: rng.normal(0, 0.1, size) for p in ("data_wait", "forward", "backward", "optimizer")}
    smoothed["forward"][:10] = smoothed["backward"][:10]  # ties: the first phase wins, in both
    ids = np.arange(size, dtype=np.int64) * 7  # rank ids need not be 0..n-1
    state = StragglerState(smoothed, rng.integers(0, 40, size).astype(float), rank_ids=ids)
    config = StragglerConfig()
    expected = sorted(straggler_scores(state, config), key=lambda s: -s.ratio)[:8]
    found = top_stragglers(state, config.min_windows, 8)
    assert [(s.rank, s.phase) for s in found] == [(s.rank, s.phase) for s in expected]
    assert [s.ratio for s in found] == pytest.approx([s.ratio for s in expected])


def add_canary(store: Engine, run: RunHandle, rank: int, step: int, verdict: str | None) -> None:
    """A canary result as monitor.judge.canaries leaves it once judged (``verdict`` None: not yet)."""
    row = {
        "run_id": run.id,
        "incarnation": INCARNATION,
        "rank": rank,
        "step": step,
        "node": f"node-{rank // 2}",
        "device_uuid": f"GPU-{rank}",
        "stack_key": "cpu-stack",
        "stack": {},
        "kernels": {},
        "seconds": 0.1,
        "over_budget": False,
        "time": T0 + step,
        "received_at": T0 + step,
        "content_hash": f"{rank}-{step}",
        "judged": verdict is not None,
        "verdict": verdict,
    }
    with store.begin() as connection:
        connection.execute(sa.insert(models.CanaryResult), row)


def test_canary_verdicts_per_run_and_the_devices_that_missed(
    trained: Service, store: Engine, run: RunHandle
) -> None:
    for rank in range(4):
        add_canary(store, run, rank, 10, "ok")
    for rank in range(3):
        add_canary(store, run, rank, 20, "ok")
    add_canary(store, run, 3, 20, "rerun")
    add_canary(store, run, 3, 21, "mismatch")  # its re-run missed again
    add_canary(store, run, 0, 30, None)  # a round still open: not judged yet
    registry = fresh_registry(trained)
    results = ("match", "mismatch", "rerun", "unchecked")
    counts = {r: sample(registry, names.CANARY_RANKS, run=run.name, result=r) for r in results}
    assert counts == {"match": 3, "mismatch": 1, "rerun": 0, "unchecked": 0}
    device = {"run": run.name, "node": "node-1", "device": "GPU-3"}
    assert registry.get_sample_value(names.CANARY_MISMATCH.name, device) == T0 + 21
    assert registry.get_sample_value(names.CANARY_MISMATCH.name, {**device, "device": "GPU-2"}) is None


def test_before_any_canary_every_rank_is_unchecked(trained: Service, run: RunHandle) -> None:
    registry = fresh_registry(trained)
    assert sample(registry, names.CANARY_RANKS, run=run.name, result="unchecked") == 4
    assert sample(registry, names.CANARY_RANKS, run=run.name, result="mismatch") == 0


def test_another_component_can_feed_the_canary_verdicts(trained: Service, run: RunHandle) -> None:
    trained.metric_sources.canary_verdicts = lambda _connection, _ranks: [
        CanaryVerdict(run.id, 2, "node-1", "GPU-2", "rerun", T0)
    ]
    registry = fresh_registry(trained)
    assert sample(registry, names.CANARY_RANKS, run=run.name, result="rerun") == 1
    assert sample(registry, names.CANARY_RANKS, run=run.name, result="unchecked") == 3


# --- the endpoint, the cost, the names --------------------------------------------------------------------


@both_backends
def test_the_endpoint_serves_the_text_format(trained: Service, run: RunHandle) -> None:
    with TestClient(create_app(trained)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    (step,) = families["runhealth_run_step"].samples
    assert step.labels == {"run": run.name} and step.value == 28


def test_two_apps_in_one_process_have_their_own_registries(trained: Service, store: Engine) -> None:
    other = Service(store, ServiceConfig())
    first, second = create_app(trained), create_app(other)
    assert first.state.metrics is not second.state.metrics
    with TestClient(first) as client:
        assert client.get("/metrics").status_code == 200  # no duplicate-registration error


def test_a_scrape_makes_the_same_queries_however_long_the_run(watched: Service, run: RunHandle) -> None:
    post(watched, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": T0, "world_size": 4}])
    post(watched, run, [window(a, r) for a in range(1, 21) for r in range(4)])
    short = scrape_statements(watched)
    post(watched, run, [window(a, r) for a in range(21, 301) for r in range(4)])
    assert scrape_statements(watched) == short


def scrape_statements(service: Service) -> list[str]:
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(args[2])

    sa.event.listen(service.engine, "before_cursor_execute", record)
    try:
        list(fresh_registry(service).collect())
    finally:
        sa.event.remove(service.engine, "before_cursor_execute", record)
    return seen


def test_series_count_of_a_4_rank_run_follows_the_formula(trained: Service, run: RunHandle) -> None:
    """26 per run + 13 for its goodput (the ratio, 10 badput causes, today's and the advised
    checkpoint interval) + min(k, N) stragglers + 13 per device (5 clock reasons offered by the device,
    2 ECC types, 4 NVLink types, PCIe, remap) + 5 per port + open incidents + 2 of the service
    itself (ingest load); here the devices report 2 clock reasons and 2 NVLink types, so 8 per
    device, and each port 3 error counters."""
    families = list(fresh_registry(trained).collect())
    count = sum(len(f.samples) for f in families)
    per_run, stragglers, devices, ports = 26 + 13, 4, 4 * (2 + 2 + 2 + 1 + 1), 2 * (3 + 1)
    incidents = sum(len(f.samples) for f in families if f.name.startswith("runhealth_incident"))
    assert count == per_run + stragglers + devices + ports + incidents + len(names.SERVICE_WIDE)


def test_names_follow_the_prometheus_conventions() -> None:
    assert len(names.BY_NAME) == len(names.ALL)
    for metric in names.ALL:
        assert metric.name.startswith("runhealth_") and metric.name == metric.name.lower()
        assert not metric.name.endswith(("_count", "_sum", "_bucket", "_info")), metric.name
        if metric in names.SERVICE_WIDE:
            assert not metric.labels, metric.name
        else:
            assert metric.labels and metric.labels[0] == "run", metric.name
    with pytest.raises(ValueError):
        names.Metric("runhealth_errors", "counter", ("run",), "a counter without _total")
    with pytest.raises(ValueError):
        names.Metric("errors_total", "counter", ("run",), "no prefix")


def test_config_from_the_environment() -> None:
    config = service_config(
        {
            "RUNHEALTH_METRICS_TOP_STRAGGLERS": "3",
            "RUNHEALTH_METRICS_DEVICE_SERIES": "node",
            "RUNHEALTH_METRICS_PER_DEVICE_LIMIT": "64",
        }
    ).metrics
    assert config == MetricsConfig(top_stragglers=3, device_series="node", per_device_limit=64)
    assert service_config({}).metrics == MetricsConfig()
    assert service_config({"RUNHEALTH_METRICS_LINK_SERIES": "off"}).metrics.link_series == "off"
    with pytest.raises(ConfigError):
        service_config({"RUNHEALTH_METRICS_TOP_STRAGGLERS": "many"})
    with pytest.raises(ConfigError):
        service_config({"RUNHEALTH_METRICS_LINK_SERIES": "device"})
    with pytest.raises(ValueError):
        MetricsConfig(recent_windows=1)
    assert MetricsConfig().device_grain(1024) == "device" and MetricsConfig().device_grain(1025) == "node"
    assert MetricsConfig(link_series="off").link_grain(1) == "off"


def test_a_nan_loss_is_exported_as_nan(watched: Service, run: RunHandle) -> None:
    records = [window(a, r) for a in range(1, 8) for r in range(4)]
    records += [{**window(8, r), "loss_sum": "NaN"} for r in range(4)]
    post(watched, run, records)
    value = sample(fresh_registry(watched), names.RUN_LOSS, run=run.name)
    assert value is not None and math.isnan(value)
