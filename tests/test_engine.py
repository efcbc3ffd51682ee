"""The engine: windows judged once complete, in order, with state that survives a restart."""

import json
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import sqlalchemy as sa

from monitor.config import ServiceConfig
from monitor.ingest.batches import ingest_batch
from monitor.ingest.schemas import BatchIn
from monitor.judge.config import EngineConfig
from monitor.judge.engine import PolicyEngine
from monitor.judge.summaries import fold_new_steps
from monitor.service import Service
from monitor.store import migrate, models, queries
from monitor.store.db import create_store_engine, resolve_url
from policies.peers import RankWindow
from policies.types import Finding, Severity

INCARNATION = str(uuid.uuid4())


class Clock:
    """The service's clock, moved by the test: when records arrive matters to the watermark."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_service(db: Path, clock: Clock | None = None) -> tuple[Service, int]:
    engine = create_store_engine(resolve_url(str(db), {}))
    migrate.upgrade(engine)
    with engine.begin() as connection:
        if connection.execute(sa.select(models.Run.id)).first() is None:
            queries.create_run(connection, "r")
        run_id = int(queries.run_row(connection, "r").id)
    return Service(engine, ServiceConfig(), clock=clock or Clock()), run_id


def steps(attempts: range, ranks: tuple[int, ...], loss: dict[int, float] | None = None) -> list[dict]:
    loss = loss or {}
    return [
        {
            "kind": "step",
            "incarnation": INCARNATION,
            "rank": rank,
            "attempt": a,
            "step": a,
            "time": float(a),
            "tokens": 10,
            "loss_sum": 10 * loss.get(a, 2.0 + 0.01 * (a % 3)),
        }
        for a in attempts
        for rank in ranks
    ]


def post(service: Service, run_id: int, records: list[dict]) -> None:
    batch = BatchIn.model_validate_json(json.dumps({"records": records}))
    service.ingest("r", run_id, batch.records)


def judged(service: Service) -> list[int]:
    table = models.StepSummary.__table__
    with service.engine.connect() as connection:
        return list(
            connection.execute(
                sa.select(table.c.attempt).where(table.c.judged).order_by(table.c.attempt)
            ).scalars()
        )


def incidents(service: Service) -> list[tuple[str, int, int]]:
    with service.engine.connect() as connection:
        rows = queries.list_incidents(connection, queries.IncidentFilter(run="r"))
    return [(i["kind"], i["first_step"], i["last_step"]) for i in rows]


def test_a_window_waits_for_every_rank_of_the_declared_world(tmp_path: Path) -> None:
    service, run_id = make_service(tmp_path / "s.db")
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 3}])
    post(service, run_id, steps(range(1, 2), (0, 1)))
    assert judged(service) == []
    post(service, run_id, steps(range(1, 2), (2,)))
    assert judged(service) == [1]


def test_a_dead_rank_cannot_stall_judgement_past_the_watermark(tmp_path: Path) -> None:
    clock = Clock()
    service, run_id = make_service(tmp_path / "s.db", clock)
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    post(service, run_id, steps(range(1, 5), (0,)))  # rank 1 never reports
    # Attempt 4 arrived, but one second per attempt is inside the 5 s watermark: a sender
    # batching for 2 s routinely leaves a live rank that far behind.
    assert judged(service) == []
    clock.now += 4.0
    post(service, run_id, steps(range(5, 10), (0,)))
    assert judged(service) == []  # 5 s of records behind attempt 9, but here for 4 s only
    clock.now += 1.0
    post(service, run_id, steps(range(10, 11), (0,)))
    assert judged(service) == [1, 2, 3, 4]  # here 5 s, and 5 s and 2 attempts behind; 5 came 1 s ago


def test_a_rank_replaying_its_spool_is_waited_for_while_another_races_ahead(tmp_path: Path) -> None:
    """After an outage each rank replays its spool: one rank's burst can be far ahead of the
    others' in record time. Judged by record time alone, the windows between lacked the other
    ranks, and rank 1's bad batch at step 60 reached its window after the window was judged."""
    clock = Clock()
    service, run_id = make_service(tmp_path / "s.db", clock)
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    post(service, run_id, steps(range(1, 21), (0, 1)))  # before the outage
    post(service, run_id, steps(range(21, 100), (0,)))  # rank 0's spool, replayed first
    clock.now += 0.5
    bad = {60: 9.0}
    post(service, run_id, [r for r in steps(range(21, 100), (1,), loss=bad)])  # rank 1's, just after
    assert judged(service) == list(range(1, 100))
    assert incidents(service) == [("spike", 60, 60)]
    table = models.StepSummary.__table__
    with service.engine.connect() as connection:
        assert connection.execute(sa.select(sa.func.sum(table.c.late_records))).scalar_one() == 0


def test_the_watermark_follows_the_flush_interval_the_hook_states(tmp_path: Path) -> None:
    clock = Clock()
    service, run_id = make_service(tmp_path / "s.db", clock)
    hook = {"runhealth_hook": {"flush_s": 0.5}}  # a 2 s watermark: 2 flushes and 1 s of slack
    start = {"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2, "config": hook}
    post(service, run_id, [start])
    post(service, run_id, steps(range(1, 5), (0,)))
    clock.now += 2.0
    post(service, run_id, steps(range(5, 6), (0,)))
    assert judged(service) == [1, 2, 3]


def test_windows_are_judged_in_order_even_when_they_complete_out_of_order(tmp_path: Path) -> None:
    service, run_id = make_service(tmp_path / "s.db")
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    post(service, run_id, steps(range(2, 3), (0, 1)) + steps(range(1, 2), (0,)))
    assert judged(service) == []  # window 2 is complete but waits for window 1
    post(service, run_id, steps(range(1, 2), (1,)))
    assert judged(service) == [1, 2]


def test_a_spike_right_after_a_service_restart_is_judged_without_a_new_warm_up(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    service, run_id = make_service(db)
    post(service, run_id, steps(range(1, 81), (0,)))
    service.engine.dispose()
    restarted, run_id = make_service(db)  # a new process: policy state rebuilt from the store
    post(restarted, run_id, steps(range(81, 84), (0,), loss={82: 9.0}))
    assert incidents(restarted) == [("spike", 82, 82)]


def test_consecutive_spikes_are_one_incident_and_late_records_open_nothing_new(tmp_path: Path) -> None:
    clock = Clock()
    service, run_id = make_service(tmp_path / "s.db", clock)
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    spikes = {70: 9.0, 71: 9.5, 72: 9.2}
    post(service, run_id, steps(range(1, 80), (0,), loss=spikes))
    clock.now += 60.0  # rank 1 given up on: its windows are judged without it
    service.judge_waiting()
    post(service, run_id, steps(range(1, 74), (1,), loss=spikes))  # rank 1 replayed late from a spool
    assert incidents(service) == [("spike", 70, 72)]
    table = models.StepSummary.__table__
    with service.engine.connect() as connection:
        late = connection.execute(sa.select(sa.func.sum(table.c.late_records))).scalar_one()
    assert late > 0


def _late_findings(tmp_path: Path, name: str, *, forget_kept: bool, stored_aside: bool) -> tuple[list, int]:
    """Ranks 0 and 1 judged without ranks 2 and 3, then rank 2's records arriving late (a NaN loss at
    step 36): the findings stored, and how many windows were read back from the store for it."""
    clock = Clock()
    service, run_id = make_service(tmp_path / f"{name}.db", clock)
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 4}])
    post(service, run_id, steps(range(1, 41), (0, 1)))
    clock.now += 60.0
    service.judge_waiting()
    if forget_kept:
        service.policies._states[run_id].judged_rows.clear()
    if stored_aside:  # a record the judge never saw, stored under window 38 (rank 3)
        with service.engine.begin() as connection:
            ingest_batch(
                connection,
                run_id,
                BatchIn.model_validate_json(json.dumps({"records": steps(range(38, 39), (3,))})).records,
                clock(),
            )
    reads: list[tuple[str, int]] = []
    window_rows = service.policies._window_rows
    service.policies._window_rows = lambda c, r, i, a: reads.append((i, a)) or window_rows(c, r, i, a)  # type: ignore[method-assign]
    post(service, run_id, steps(range(35, 41), (2,), loss={36: float("nan")}))
    table = models.FindingRow.__table__
    with service.engine.connect() as connection:
        found = connection.execute(
            sa.select(table.c.kind, table.c.step, table.c.rank, table.c.message).order_by(table.c.id)
        ).all()
    return [tuple(row) for row in found], len(reads)


def test_late_records_are_judged_with_the_records_their_window_was_judged_with(tmp_path: Path) -> None:
    """The window a late record is judged against is the judged one plus it, not read back from
    the store, unless the store holds a record of the window that neither is."""
    kept, kept_reads = _late_findings(tmp_path, "kept", forget_kept=False, stored_aside=False)
    read, read_reads = _late_findings(tmp_path, "read", forget_kept=True, stored_aside=False)
    assert kept == read
    assert any(kind == "nonfinite" and step == 36 and rank == 2 for kind, step, rank, _ in kept), kept
    assert (kept_reads, read_reads) == (0, 6)
    _, aside_reads = _late_findings(tmp_path, "aside", forget_kept=False, stored_aside=True)
    assert aside_reads == 1  # window 38 counted one record more than it knows: read


def test_judged_windows_kept_for_late_records_are_bounded_by_windows_and_records(tmp_path: Path) -> None:
    """A small run keeps its newest 32 judged windows, not 32,768 records' worth of them (8,192
    windows of 4 ranks); a large one is bounded by records."""
    clock = Clock()
    service, run_id = make_service(tmp_path / "s.db", clock)
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    post(service, run_id, steps(range(1, 101), (0, 1)))
    kept = service.policies._states[run_id].judged_rows
    config = service.policies._config
    assert (config.late_windows_kept, config.late_rows_kept) == (32, 32_768)
    assert [attempt for _, attempt in kept] == judged(service)[-32:]
    assert all(len(rows) == 2 for rows in kept.values())


def _rank_loss_findings(service: Service) -> list[tuple[int, str, int | None]]:
    table = models.FindingRow.__table__
    with service.engine.connect() as connection:
        rows = connection.execute(
            sa.select(table.c.rank, table.c.severity, table.c.incident_id)
            .where(table.c.kind == "rank_loss_spike")
            .order_by(table.c.id)
        ).all()
    return [tuple(row) for row in rows]


def _short_sequence_at(records: list[dict], step: int, loss: float) -> list[dict]:
    """One supervised token at ``step``: a rank far off its peers that barely moves the run's loss."""
    return [{**r, "tokens": 1, "loss_sum": loss} if r["step"] == step else r for r in records]


def test_a_late_rank_that_makes_an_on_time_ranks_spike_critical_upgrades_its_incident(tmp_path: Path) -> None:
    """Rank 0's loss per token at step 40 (6.0) against 2 peers (1.0 and 2.5: median 2.5, threshold
    5.0, critical from 7.5) is a warning; with rank 3 (1.0) late in its window, against 3 peers
    (median 1.75, critical from 5.25) it is critical. The incident is upgraded and the decisions
    asked again; the warning is not recorded twice, and a late record that changes nothing adds no
    finding. (Rank 0 has one supervised token there: the run's loss stays level, no run spike.)"""
    clock = Clock()
    service, run_id = make_service(tmp_path / "s.db", clock)
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 4}])
    attempts = range(1, 46)
    on_time = _short_sequence_at(steps(attempts, (0,)), 40, 6.0)
    post(service, run_id, on_time + steps(attempts, (1,), {40: 1.0}) + steps(attempts, (2,), {40: 2.5}))
    clock.now += 60.0  # rank 3 given up on: its windows are judged without it
    service.judge_waiting()
    assert [(rank, severity) for rank, severity, _ in _rank_loss_findings(service)] == [(0, "warning")]
    with service.engine.connect() as connection:
        (incident,) = queries.list_incidents(connection, queries.IncidentFilter(run="r"))
    assert (incident["kind"], incident["severity"]) == ("spike", "warning")
    considered: list[list[int]] = []
    consider = service.decisions.consider
    service.decisions.consider = lambda run, touched: (
        considered.append(list(touched)) or consider(run, touched)
    )  # type: ignore[method-assign]
    post(service, run_id, steps(range(1, 40), (3,)))  # late, but not in step 40's window
    assert len(_rank_loss_findings(service)) == 1
    post(service, run_id, steps(range(40, 46), (3,), {40: 1.0}))
    found = _rank_loss_findings(service)
    assert [(rank, severity) for rank, severity, _ in found] == [(0, "warning"), (0, "critical")]
    assert found[0][2] == found[1][2] == incident["id"]
    with service.engine.connect() as connection:
        (upgraded,) = queries.list_incidents(connection, queries.IncidentFilter(run="r"))
    assert (upgraded["id"], upgraded["severity"]) == (incident["id"], "critical")
    assert [incident["id"]] in considered
    post(service, run_id, steps(range(40, 41), (3,), {40: 1.0}))  # sent again: stored once, no news
    assert len(_rank_loss_findings(service)) == 2


def test_hook_settings_are_read_only_when_usable() -> None:
    from monitor.store.hook_settings import stated

    assert stated({"runhealth_hook": {"flush_s": 0.5, "agree_every": 4}}, "flush_s") == 0.5
    assert stated({"runhealth_hook": {"agree_every": 4}}, "agree_every") == 4.0
    for config in (None, {}, {"runhealth_hook": "x"}, {"runhealth_hook": {"flush_s": "NaN"}}):
        assert stated(config, "flush_s") is None
    assert stated({"runhealth_hook": {"flush_s": -1}}, "flush_s") is None
    assert stated({"runhealth_hook": {"flush_s": True}}, "flush_s") is None


def test_a_paused_runs_last_windows_are_judged_by_the_periodic_pass(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    engine = create_store_engine(resolve_url(str(db), {}))
    migrate.upgrade(engine)
    with engine.begin() as connection:
        queries.create_run(connection, "r")
        run_id = int(queries.run_row(connection, "r").id)
    clock = {"now": 10.0}
    service = Service(engine, ServiceConfig(), clock=lambda: clock["now"])
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    post(service, run_id, steps(range(1, 10), (0, 1)) + steps(range(10, 12), (0,)))  # then it waits
    assert judged(service) == list(range(1, 10))  # 10 and 11 lack rank 1, and nothing newer came
    assert service.policies.waiting_runs() == [run_id]
    clock["now"] = 19.0  # 8 s after window 11: under two 5 s watermarks
    service.judge_waiting()
    assert judged(service) == list(range(1, 10))
    clock["now"] = 21.5
    service.judge_waiting()
    assert judged(service) == list(range(1, 12))
    assert service.policies.waiting_runs() == []


def test_a_restart_releases_the_old_incarnations_windows_first(tmp_path: Path) -> None:
    service, run_id = make_service(tmp_path / "s.db")
    old, new = str(uuid.uuid4()), str(uuid.uuid4())

    def window(incarnation: str, a: int, rank: int, lr: float) -> dict:
        return {**steps(range(a, a + 1), (rank,))[0], "incarnation": incarnation, "lr": lr}

    post(service, run_id, [{"kind": "run_start", "incarnation": old, "time": 0.0, "world_size": 2}])
    records = [window(old, a, r, 1e-4 if a == 1 else 1e-3) for a in range(1, 11) for r in (0, 1)]
    post(service, run_id, [r for r in records if not (r["attempt"] >= 9 and r["rank"] == 1)])
    assert judged(service) == list(range(1, 9))  # 9 and 10 wait for rank 1, which died
    post(service, run_id, [{"kind": "run_start", "incarnation": new, "time": 11.0, "world_size": 2}])
    # Resumed from step 8 with the schedule back at its warm-up value.
    post(service, run_id, [window(new, a, r, 1e-4) for a in range(9, 12) for r in (0, 1)])
    table = models.StepSummary.__table__
    with service.engine.connect() as connection:
        order = connection.execute(
            sa.select(table.c.incarnation, table.c.attempt).where(table.c.judged).order_by(table.c.id)
        ).all()
        findings = queries.list_findings(connection, run_id)
    assert [(i == old, a) for i, a in order][8:10] == [(True, 9), (True, 10)]
    assert [f["step"] for f in findings if f["kind"] == "schedule_restarted"] == [9]


def test_a_new_incarnations_windows_wait_for_its_world_before_its_run_start_arrives(tmp_path: Path) -> None:
    """After an in-process rollback rank 0 sends the new incarnation's run start, but any rank's
    step records may reach the service first. The world was taken as the most ranks seen (one):
    every window was judged on the first rank to report, the others' records arriving late."""
    service, run_id = make_service(tmp_path / "s.db")
    post(service, run_id, [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}])
    post(service, run_id, steps(range(1, 11), (0, 1)))
    resumed = str(uuid.uuid4())
    first = [{**record, "incarnation": resumed} for record in steps(range(1, 4), (1,))]
    post(service, run_id, first)  # rank 1 first: its window waits for the world of 2
    assert judged(service) == list(range(1, 11))
    start = {"kind": "run_start", "incarnation": resumed, "time": 11.0, "world_size": 2}
    post(
        service, run_id, [start, *[{**record, "incarnation": resumed} for record in steps(range(1, 4), (0,))]]
    )
    table = models.StepSummary.__table__
    with service.engine.connect() as connection:
        rows = connection.execute(
            sa.select(table.c.attempt, table.c.ranks_reported, table.c.late_records).where(
                table.c.incarnation == resumed, table.c.judged
            )
        ).all()
    assert sorted((r.attempt, r.ranks_reported, r.late_records) for r in rows) == [
        (1, 2, 0),
        (2, 2, 0),
        (3, 2, 0),
    ]


@dataclass(frozen=True)
class WindowCounter:
    """A per-rank policy registered from a test: it counts windows in its state and finds
    rank 0 slow at the third, so its finding takes the device evidence path too."""

    config: None = None
    name: str = "window_counter"
    late: bool = False
    device_evidence: bool = True

    def start(self) -> int:
        return 0

    def judge(self, state: int, observed: RankWindow) -> tuple[int, list[Finding]]:
        found = []
        if state + 1 == 3:
            found.append(
                Finding(
                    step=observed.step,
                    kind="straggler",
                    severity=Severity.WARNING,
                    signal="forward_s",
                    value=2.0,
                    threshold=1.09,
                    message="rank 0 counted slow",
                    incarnation=observed.incarnation,
                    rank=0,
                )
            )
        return state + 1, found


def test_the_engine_runs_the_rank_policies_registered_with_it(tmp_path: Path) -> None:
    """A new per-rank policy is its module and a place in the list the engine is given: the
    engine keeps its state by name and records its findings, evidence added where it asks."""
    service, run_id = make_service(tmp_path / "s.db")
    records = [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}]
    records += steps(range(1, 5), (0, 1))
    with service.engine.begin() as connection:
        stored = ingest_batch(connection, run_id, BatchIn.model_validate({"records": records}).records, 1.0)
        fold_new_steps(connection, run_id, stored.new_rows["step"])
    engine = PolicyEngine(service.engine, EngineConfig(), Clock(), rank_policies=[WindowCounter()])
    engine.add_device_evidence = lambda _run, f: replace(f, evidence={"added": True})
    touched = engine.judge(run_id)
    assert engine.policy_state(run_id, "window_counter") == 4
    assert engine.policy_state(run_id, "stragglers") is None  # not registered: not run
    with service.engine.connect() as connection:
        (finding,) = queries.list_findings(connection, run_id)
    assert (finding["kind"], finding["step"], finding["rank"], finding["evidence"]) == (
        "straggler",
        3,
        0,
        {"added": True},
    )
    assert len(touched) == 1


def test_a_windows_records_are_read_through_an_index_not_a_scan_of_the_incarnation(tmp_path: Path) -> None:
    """The lookup of a late window (run, incarnation, attempt) scanned every record of the
    incarnation under the write lock without ``ix_step_records_window``: 500 late records of one
    rank into a 64-rank incarnation of 255,500 took 21 s here, 0.7 s with it."""
    engine = create_store_engine(resolve_url(str(tmp_path / "s.db"), {}))
    migrate.upgrade(engine)
    step = models.table_of(models.StepRecord)
    query = sa.select(step).where(step.c.run_id == 1, step.c.incarnation == "i", step.c.attempt == 7)
    with engine.connect() as connection:
        compiled = query.compile(connection, compile_kwargs={"literal_binds": True})
        plan = " ".join(str(row) for row in connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}"))
    engine.dispose()
    assert "ix_step_records_window" in plan, plan


@dataclass
class RankSpikeAt:
    """A per-rank policy registered from a test: rank 1's loss spiked at ``step`` (a rank's
    spike the run's mean does not show)."""

    step: int
    config: None = None
    name: str = "rank_spike_at"
    late: bool = False
    device_evidence: bool = False

    def start(self) -> None:
        return None

    def judge(self, state: None, observed: RankWindow) -> tuple[None, list[Finding]]:
        if observed.step != self.step or observed.incarnation != INCARNATION:
            return None, []
        return None, [Finding(self.step, "rank_loss_spike", Severity.CRITICAL, "loss", 9.0, 3.0, "", rank=1)]


def test_a_ranks_spike_ends_what_a_replay_is_compared_with(tmp_path: Path) -> None:
    """Rolled back onto 38 after rank 1 spiked at 40: the abandoned steps from 40 on are no
    reference, and 38-39 are too few, so a replay 20% away is not judged there; with the rank's
    spike elsewhere (at 55), the same replay is a broken resume."""
    for spiked_at, named in ((40, False), (55, True)):
        service, run_id = make_service(tmp_path / f"{spiked_at}.db")
        records = [{"kind": "run_start", "incarnation": INCARNATION, "time": 0.0, "world_size": 2}]
        records += steps(range(1, 61), (0, 1))
        resumed = str(uuid.uuid4())
        records += [{"kind": "run_start", "incarnation": resumed, "time": 61.0, "world_size": 2}]
        replay = {a: 1.2 * (2.0 + 0.01 * (a % 3)) for a in range(38, 50)}
        records += [
            {**r, "incarnation": resumed, "time": 61.0 + r["time"]}
            for r in steps(range(38, 50), (0, 1), replay)
        ]
        with service.engine.begin() as connection:
            stored = ingest_batch(
                connection, run_id, BatchIn.model_validate({"records": records}).records, 1.0
            )
            fold_new_steps(connection, run_id, stored.new_rows["step"])
        engine = PolicyEngine(service.engine, EngineConfig(), Clock(), rank_policies=[RankSpikeAt(spiked_at)])
        engine.judge(run_id)
        with service.engine.connect() as connection:
            kinds = [(f["kind"], f["step"]) for f in queries.list_findings(connection, run_id)]
        assert kinds == [("rank_loss_spike", spiked_at), *([("broken_resume", 38)] if named else [])]
