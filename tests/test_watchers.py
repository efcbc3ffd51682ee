"""The engine's watchers on a real store: per-rank findings, hangs, devices and resumes."""

from typing import Any

import pytest
from sqlalchemy.engine import Engine

import monitor.judge.hangs
from monitor.config import ServiceConfig
from monitor.judge.config import EngineConfig
from monitor.recovery.directives import pending_for
from monitor.service import Service
from monitor.store import queries
from policies.hangs import HangConfig
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, both_backends, post, step_record

OTHER = "00000000-0000-4000-8000-0000000000aa"


class Clock:
    def __init__(self, now: float = 10_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def windows(
    attempts: range,
    ranks: int = 4,
    incarnation: str = INCARNATION,
    loss: dict[tuple[int, int], Any] | None = None,
    tokens: dict[int, int] | None = None,
    reported: str = "true",
    lr: float = 1e-3,
    consumed_per: int = 64,
    first_ids: int = 0,
) -> list[dict[str, Any]]:
    loss, tokens = loss or {}, tokens or {}
    records = []
    for attempt in attempts:
        for rank in range(ranks):
            n = tokens.get(rank, 100)
            mean = loss.get((attempt, rank), 2.0 + 0.01 * ((attempt * 7 + rank * 3) % 5))
            loss_sum = mean if isinstance(mean, str) else mean * n
            records.append(
                {
                    "kind": "step",
                    "incarnation": incarnation,
                    "rank": rank,
                    "attempt": attempt,
                    "step": attempt,
                    "time": 1000.0 + attempt,
                    "node": f"node-{rank}",
                    "device_uuid": f"GPU-{rank}",
                    "tokens": n,
                    "loss_sum": loss_sum,
                    "reported_loss": mean if reported == "local" else None,
                    "grad_norm": 1.0,
                    "lr": lr,
                    "consumed": attempt * consumed_per,
                    "skipped": False,
                    "sample_ids": [first_ids + attempt * 10 + rank],
                    "forward_s": 0.01,
                    "backward_s": 0.02,
                    "optimizer_s": 0.005,
                    "data_wait_s": 0.001,
                }
            )
    return records


def start(world: int = 4, incarnation: str = INCARNATION, time: float = 990.0) -> dict[str, Any]:
    return {"kind": "run_start", "incarnation": incarnation, "time": time, "world_size": world}


def incidents(store: Engine, run: RunHandle) -> list[dict[str, Any]]:
    with store.connect() as connection:
        return queries.list_incidents(connection, queries.IncidentFilter(run=run.name))


def test_one_ranks_corrupted_batch_names_the_rank_node_and_device(
    service: Service, store: Engine, run: RunHandle
) -> None:
    post(service, run, [start(), *windows(range(1, 60))])
    post(service, run, windows(range(60, 61), loss={(60, 2): 9.0}))
    post(service, run, windows(range(61, 64)))
    (incident,) = incidents(store, run)
    assert (incident["kind"], incident["first_step"]) == ("spike", 60)
    assert incident["ranks"] == [2] and incident["nodes"] == ["node-2"] and incident["devices"] == ["GPU-2"]


def test_a_nan_on_one_rank_is_critical_and_names_it(service: Service, store: Engine, run: RunHandle) -> None:
    post(service, run, [start(), *windows(range(1, 10), loss={(5, 1): "NaN"})])
    (incident,) = incidents(store, run)
    assert (incident["kind"], incident["severity"], incident["first_step"]) == ("nonfinite", "critical", 5)
    assert incident["ranks"] == [1]


def test_late_records_are_judged_on_arrival_into_the_open_incident(
    store: Engine, service_config: ServiceConfig, run: RunHandle
) -> None:
    clock = {"now": 2_000.0}
    service = Service(store, service_config, clock=lambda: clock["now"])
    post(service, run, [start(), *windows(range(1, 30))])
    early = [r for r in windows(range(30, 37), loss={(30, 3): "NaN", (30, 1): "NaN"}) if r["rank"] != 3]
    post(service, run, early)
    clock["now"] += 60.0  # rank 3 of window 30 is still missing: judged by watermark without it
    service.judge_waiting()
    (incident,) = incidents(store, run)
    assert incident["ranks"] == [1]
    post(service, run, [r for r in windows(range(30, 31), loss={(30, 3): "NaN"}) if r["rank"] == 3])
    (incident,) = incidents(store, run)  # the late NaN joined the incident, no second one
    assert incident["ranks"] == [1, 3]


def test_mean_of_per_rank_means_is_flagged(service: Service, store: Engine, run: RunHandle) -> None:
    tokens = {0: 4800, 1: 9600, 2: 4800, 3: 9600}
    loss = {(a, r): (2.0 if r % 2 == 0 else 3.0) for a in range(1, 6) for r in range(4)}
    post(service, run, [start(), *windows(range(1, 6), tokens=tokens, loss=loss, reported="local")])
    kinds = {i["kind"] for i in incidents(store, run)}
    assert "loss_normalization" in kinds


def test_a_straggler_carries_its_devices_slowdown_reason(
    service: Service, store: Engine, run: RunHandle
) -> None:
    def sample(device: int, seq: int, hw_thermal_ns: int) -> dict[str, Any]:
        return {
            "kind": "device_sample",
            "node": f"node-{device}",
            "device_uuid": f"GPU-{device}",
            "seq": seq,
            "time": float(seq),
            "counters": {"clock_event_ns": {"hw_thermal_slowdown": hw_thermal_ns}},
        }

    post(service, run, [sample(d, 100, 0) for d in range(4)])
    post(service, run, [sample(d, 110, 3_000_000_000 if d == 3 else 0) for d in range(4)])
    records = windows(range(1, 60))
    for record in records:
        if record["rank"] == 3:
            record["forward_s"] *= 1.3
            record["optimizer_s"] *= 1.3
    post(service, run, [start(), *records])
    (incident,) = [i for i in incidents(store, run) if i["kind"] == "straggler"]
    assert incident["ranks"] == [3] and incident["devices"] == ["GPU-3"]
    with store.connect() as connection:
        (finding,) = queries.list_findings(connection, run.id, incident_id=incident["id"])
    assert [r["reason"] for r in finding["evidence"]["clock_event_reasons"]] == ["hw_thermal_slowdown"]


def test_device_faults_open_one_incident_per_device_and_app_xids_open_none(
    service: Service, store: Engine, run: RunHandle
) -> None:
    def sample(device: str, seq: int, uncorrected: int, xids: list[int]) -> dict[str, Any]:
        return {
            "kind": "device_sample",
            "node": "node-0",
            "device_uuid": device,
            "seq": seq,
            "time": float(seq),
            "counters": {"ecc": {"volatile": {"uncorrected": uncorrected}}},
            "xids": [{"code": c, "time": float(seq)} for c in xids],
        }

    post(service, run, [sample("GPU-a", 1, 0, []), sample("GPU-b", 1, 0, [])])
    post(service, run, [sample("GPU-a", 2, 1, []), sample("GPU-b", 2, 0, [79]), sample("GPU-c", 2, 0, [13])])
    found = incidents(store, run)
    assert sorted((i["kind"], i["severity"], i["devices"][0]) for i in found) == [
        ("device", "critical", "GPU-a"),
        ("device", "critical", "GPU-b"),
    ]
    with store.connect() as connection:
        findings = queries.list_findings(connection, run.id)
    assert any(
        f["kind"] == "device_xid" and f["incident"] is None and f["severity"] == "info" for f in findings
    )


@pytest.fixture
def clocked(store: Engine) -> tuple[Service, Clock]:
    clock = Clock()
    config = ServiceConfig(
        admin_token=ADMIN_TOKEN,
        engine=EngineConfig(hangs=HangConfig(min_timeout_s=30.0, heartbeat_interval_s=5.0)),
    )
    return Service(store, config, clock=clock), clock


def beat(rank: int, phase: str, since: float, time: float, step: int = 40) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "incarnation": INCARNATION,
        "rank": rank,
        "phase": phase,
        "phase_since": since,
        "time": time,
        "step": step,
        "node": f"node-{rank}",
    }


def test_a_hung_rank_opens_one_incident_asks_for_stacks_and_closes_when_it_moves(
    clocked: tuple[Service, Clock], store: Engine, run: RunHandle
) -> None:
    service, clock = clocked
    post(service, run, [start(4)])
    post(
        service,
        run,
        [beat(r, "backward", 9_900.0, 9_999.0) for r in (0, 1, 3)] + [beat(2, "forward", 9_900.0, 9_999.0)],
    )
    assert service.hangs.check() != []
    assert service.hangs.check() == []  # the same hang is not reported again
    (incident,) = incidents(store, run)
    assert incident["kind"] == "hang" and incident["ranks"] == [2]
    with store.connect() as connection:
        (directive,) = [d for d in pending_for(connection, run.id, INCARNATION, 2) if d["incident"]]
    assert directive["kind"] == "dump_stacks" and directive["incident"] == incident["id"]
    clock.now += 1
    post(service, run, [beat(r, "forward", 10_000.5, 10_000.5, step=41) for r in range(4)])
    service.hangs.check()
    (incident,) = incidents(store, run)
    assert incident["status"] == "resolved"


def test_a_compile_whose_processes_use_no_cpu_is_named_long_before_the_save_timeout(
    clocked: tuple[Service, Clock], store: Engine, run: RunHandle
) -> None:
    """Both ranks compiling for 300 s (a compilation's timeout is a save's, 30 minutes), their
    processes idle for 150 s: the compile itself hangs. Once they use CPU again, it resolves."""
    service, clock = clocked
    clock.now = 10_000.0
    idle = [{**beat(r, "compiling", 9_700.0, 9_999.0), "cpu_busy_at": 9_850.0} for r in range(2)]
    post(service, run, [start(2), *idle])
    assert service.hangs.check() != []
    (incident,) = incidents(store, run)
    assert incident["kind"] == "hang" and "rank 1 in compiling" in incident["summary"]
    assert "rank 0 in compiling for 300 s, its processes using no CPU for 150 s" in incident["summary"]
    clock.now += 5
    post(
        service, run, [{**beat(r, "compiling", 9_700.0, 10_004.0), "cpu_busy_at": 10_004.0} for r in range(2)]
    )
    service.hangs.check()
    (incident,) = incidents(store, run)
    assert incident["status"] == "resolved"


def test_a_silent_rank_is_missing_but_a_finished_run_is_not_hung(
    clocked: tuple[Service, Clock], store: Engine, run: RunHandle
) -> None:
    service, clock = clocked
    clock.now = 9_900.0
    post(service, run, [start(2), beat(1, "forward", 9_890.0, 9_900.0)])
    clock.now = 10_000.0
    post(service, run, [beat(0, "forward", 9_990.0, 9_999.0)])
    service.hangs.check()
    (incident,) = incidents(store, run)
    assert "missing" in incident["summary"] and "rank 1" in incident["summary"]
    post(service, run, [{"kind": "run_finish", "incarnation": INCARNATION, "time": 10_000.0}])
    clock.now += 3600
    assert service.hangs.check() == []


def test_a_resume_that_lost_its_state_is_named(service: Service, store: Engine, run: RunHandle) -> None:
    post(service, run, [start(4, OTHER), *windows(range(1, 30), incarnation=OTHER, lr=1e-3)])
    post(
        service,
        run,
        [
            {
                "kind": "checkpoint",
                "incarnation": OTHER,
                "step": 20,
                "path": "/ckpt/20",
                "time": 1020.0,
                "consumed": 1280,
            }
        ],
    )
    good = {
        "optimizer_step": 20,
        "exp_avg_norm": 0.5,
        "exp_avg_sq_norm": 0.01,
        "lr": 1e-3,
        "scheduler_last_epoch": 20,
        "consumed": 1280,
        "data": {"deterministic": True},  # so the sample ids after the checkpoint are compared
    }
    resumes = [
        {
            "kind": "resume",
            "incarnation": INCARNATION,
            "rank": r,
            "time": 2000.0,
            "checkpoint_path": "/ckpt/20",
            "restored": {**good, "first_sample_ids": [21 * 10 + r]},
        }
        for r in range(3)
    ]
    resumes.append(
        {
            "kind": "resume",
            "incarnation": INCARNATION,
            "rank": 3,
            "time": 2000.0,
            "checkpoint_path": "/ckpt/20",
            "restored": {**good, "consumed": 0, "first_sample_ids": [3]},
        }
    )
    post(service, run, [start(4), *resumes])
    (incident,) = incidents(store, run)
    assert incident["kind"] == "broken_resume" and incident["ranks"] == [3]
    with store.connect() as connection:
        kinds = {f["kind"] for f in queries.list_findings(connection, run.id, incident_id=incident["id"])}
    assert kinds == {"data_cursor_reset", "data_cursor_mismatch"}


@pytest.mark.parametrize(("pause_s", "hung"), [(0.0, True), (300.0, False)])
def test_a_pause_as_long_as_one_the_run_already_had_is_not_a_hang(
    store: Engine, run: RunHandle, pause_s: float, hung: bool
) -> None:
    """400 windows of 40 ms, one of them (at window 50, long before the 200 the step timeout is
    learned from) followed by a ``pause_s`` save; then every rank 350 s between two windows."""
    clock = Clock()
    service = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=clock)
    times = [1000.0 + 0.04 * w + (pause_s if w > 50 else 0.0) for w in range(400)]
    records = [step_record(r, w, time=t) for w, t in enumerate(times) for r in range(2)]
    post(service, run, [start(2)])
    for first in range(0, len(records), 200):
        post(service, run, records[first : first + 200])
    clock.now = times[-1] + 350.0
    post(service, run, [beat(r, "data", times[-1], clock.now - 1, step=399) for r in range(2)])
    service.hangs.check()
    assert [i["kind"] for i in incidents(store, run)] == (["hang"] if hung else [])


@both_backends
@pytest.mark.parametrize("windows_ended_after_the_beat", [True, False])
def test_a_first_step_that_compiled_for_30_s_is_no_hang_once_its_windows_arrive(
    store: Engine, run: RunHandle, windows_ended_after_the_beat: bool
) -> None:
    """A ``torch.compile`` model's first forward compiles for 30 s: the heartbeats say "in
    forward since T, step 0". Then 60 windows of 10 ms arrive at once; the timeouts learned
    from them are the 9 s floor, and the newest heartbeat (sent before they were trained)
    still says forward since T. Seen on a real compiled trainer: a critical hang after the
    run had trained past it. The windows that ended after the beat's phase began say the rank
    left it. The control: the same heartbeat after windows that all ended before its phase
    began (a rank really stuck in forward for 30 s) is a hang."""
    clock = Clock()
    service = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=clock)
    compiled_from = 1000.0
    first = compiled_from + 29.0 if windows_ended_after_the_beat else compiled_from - 100.0
    records = [step_record(0, w, time=first + 0.01 * w) for w in range(1, 61)]
    step, attempt = (0, 1) if windows_ended_after_the_beat else (60, 61)
    clock.now = compiled_from + 30.5
    stale = {**beat(0, "forward", compiled_from, compiled_from + 27.0, step=step), "attempt": attempt}
    post(service, run, [start(1), stale, *records])
    service.hangs.check()
    found = incidents(store, run)
    assert [i["kind"] for i in found] == ([] if windows_ended_after_the_beat else ["hang"]), found
    if found:
        assert "timeout 9 s" in found[0]["summary"] and "rank 0 in forward for 30 s" in found[0]["summary"]


@pytest.mark.parametrize("listed", [True, False])
def test_only_the_rank_whose_windows_stopped_is_stuck_listed_or_grouped(
    store: Engine, run: RunHandle, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    """Two ranks whose newest heartbeats both say forward for 30 s: rank 0 stored windows that
    ended after that (it moved on), rank 1's all ended before (stuck). Read with the ranks
    listed, and grouped over every rank (a hang of more ranks than ``MAX_LISTED_RANKS``)."""
    if not listed:
        monkeypatch.setattr(monitor.judge.hangs, "MAX_LISTED_RANKS", 0)
    clock = Clock()
    service = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=clock)
    since = 1000.0
    ended = {0: since + 29.0, 1: since - 100.0}
    records = [step_record(r, w, time=ended[r] + 0.01 * w) for w in range(1, 31) for r in (0, 1)]
    clock.now = since + 30.5
    beats = [{**beat(r, "forward", since, since + 27.0, step=0), "attempt": 1} for r in (0, 1)]
    post(service, run, [start(2), *beats, *records])
    service.hangs.check()
    (incident,) = incidents(store, run)
    summary = incident["summary"]
    assert incident["kind"] == "hang" and "stuck: rank 1 in forward" in summary and "rank 0" not in summary
