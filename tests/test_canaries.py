"""Canary rounds in the service, from real suite runs on the CPU."""

import random
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.engine import Engine

from collectors.canary import CanaryConfig, CanaryFaults, run_canary, run_suite
from monitor.config import ServiceConfig
from monitor.recovery.decisions import list_proposals
from monitor.service import Service
from monitor.store import models, queries
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, post

CPU = torch.device("cpu")
SMALL = CanaryConfig(cpu_gemm=64, cpu_reduction=1 << 14, cpu_softmax=(4, 1024), cpu_elementwise=1 << 12)


def corrupting(rng: random.Random) -> CanaryFaults:
    def output(kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        if kernel != "gemm_fp32":
            return tensor
        flat = tensor.detach().clone().contiguous().view(-1).view(torch.int32)
        flat[rng.randrange(flat.numel())] ^= 1 << 30
        return flat.view(torch.float32).view(tensor.shape)

    return CanaryFaults(output=output)


def round_records(
    step: int, golden: dict[str, str] | None, faulty: dict[int, CanaryFaults]
) -> list[dict[str, Any]]:
    records = []
    for rank in range(4):
        outcome = run_canary(CPU, SMALL, golden=golden, faults=faulty.get(rank))
        records.append(
            {
                "kind": "canary_result",
                "incarnation": INCARNATION,
                "rank": rank,
                "step": step,
                "time": float(step),
                "node": f"node-{rank}",
                "device_uuid": f"CPU-{rank}",
                **outcome.as_wire(),
            }
        )
    return records


def windows(attempts: range) -> list[dict[str, Any]]:
    return [
        {
            "kind": "step",
            "incarnation": INCARNATION,
            "rank": r,
            "attempt": a,
            "step": a,
            "time": 1000.0 + a,
            "tokens": 10,
            "loss_sum": 20.0,
            "node": f"node-{r}",
            "device_uuid": f"CPU-{r}",
        }
        for a in attempts
        for r in range(4)
    ]


def start(service: Service, run: RunHandle) -> None:
    post(service, run, [{"kind": "run_start", "incarnation": INCARNATION, "time": 900.0, "world_size": 4}])


def incidents(store: Engine, run: RunHandle) -> list[dict[str, Any]]:
    with store.connect() as connection:
        return queries.list_incidents(connection, queries.IncidentFilter(run=run.name))


def test_a_persistent_mismatch_becomes_a_node_quarantine_proposal(
    service: Service, store: Engine, run: RunHandle
) -> None:
    start(service, run)
    post(service, run, windows(range(1, 11)))
    post(service, run, round_records(10, None, {}))  # healthy round: golden established
    with store.connect() as connection:
        assert (
            connection.execute(sa.select(sa.func.count()).select_from(models.CanaryGolden)).scalar_one() == 5
        )
    golden = {k: v.fingerprint for k, v in run_suite(CPU, SMALL).kernels.items()}
    post(service, run, windows(range(11, 21)))
    post(service, run, round_records(20, golden, {2: corrupting(random.Random(1))}))
    (incident,) = incidents(store, run)
    assert (incident["kind"], incident["severity"], incident["devices"], incident["nodes"]) == (
        "canary",
        "critical",
        ["CPU-2"],
        ["node-2"],
    )
    assert incident["first_step"] == 11  # right after the last round this device passed
    with store.connect() as connection:
        (proposal,) = list_proposals(connection, run.name)
        story = [e["action"] for e in queries.get_incident(connection, incident["id"])["story"]]
    assert proposal["verdict"] == "hardware"
    assert proposal["quarantine"] == {"node": "node-2", "device": "CPU-2"}
    assert story == ["incident_opened", "proposed"]


def test_a_round_without_golden_asks_the_odd_rank_to_re_run(
    service: Service, store: Engine, run: RunHandle
) -> None:
    start(service, run)
    post(service, run, windows(range(1, 6)))
    post(service, run, round_records(5, None, {3: corrupting(random.Random(2))}))
    assert incidents(store, run) == []
    with store.connect() as connection:
        rerun = (
            connection.execute(sa.select(models.Directive.ranks).where(models.Directive.kind == "canary"))
            .scalars()
            .all()
        )
    assert rerun == [[3]]


def test_one_transient_mismatch_is_a_warning_without_quarantine(
    service: Service, store: Engine, run: RunHandle
) -> None:
    start(service, run)
    post(service, run, windows(range(1, 6)))
    post(service, run, round_records(5, None, {}))
    golden = {k: v.fingerprint for k, v in run_suite(CPU, SMALL).kernels.items()}
    once = {"calls": 0}

    def first_call_only(kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        if kernel == "gemm_fp32" and once["calls"] == 0:
            once["calls"] += 1
            return tensor * 2
        return tensor

    post(service, run, round_records(10, golden, {1: CanaryFaults(output=first_call_only)}))
    (incident,) = incidents(store, run)
    assert incident["severity"] == "warning"
    with store.connect() as connection:
        assert list_proposals(connection, run.name) == []


def test_the_schedule_is_kept_in_the_store_and_budgeted(store: Engine, run: RunHandle) -> None:
    clock = {"now": 1000.0}
    service = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=lambda: clock["now"])
    start(service, run)
    post(service, run, windows(range(1, 30)))
    clock["now"] = 1030.0
    (first,) = service.canaries.schedule_due()
    assert service.canaries.schedule_due() == []  # not due again yet
    restarted = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=lambda: clock["now"])
    assert restarted.canaries.schedule_due() == []  # the schedule survived the restart
    post(restarted, run, round_records(40, None, {}))
    with store.connect() as connection:
        schedule = connection.execute(sa.select(models.CanarySchedule)).mappings().one()
        interval = restarted.canaries.interval_s(connection, schedule)
        budget = restarted.canaries.budget(connection, run.id)
    suite_seconds = max(r["seconds"] for r in round_records(1, None, {}))
    assert interval >= 60.0 and interval >= 0.9 * suite_seconds / 0.005
    assert budget["rounds"] == 1 and 0 < budget["canary_seconds"]
    clock["now"] += interval + 1
    post(restarted, run, windows(range(30, 32)))
    clock["now"] = 1000.0 + 31 + interval + 1
    assert restarted.canaries.schedule_due() != []
    with store.connect() as connection:
        directive = connection.execute(
            sa.select(models.Directive.act_at_step).where(models.Directive.id == first)
        ).scalar_one()
    assert directive is not None and directive > 29


def test_a_targeted_re_run_answers_for_the_original_result(
    service: Service, store: Engine, run: RunHandle
) -> None:
    start(service, run)
    post(service, run, windows(range(1, 6)))
    post(service, run, round_records(5, None, {}))  # golden established
    golden = {k: v.fingerprint for k, v in run_suite(CPU, SMALL).kernels.items()}
    post(service, run, windows(range(6, 11)))
    bad = corrupting(random.Random(4))
    records = round_records(10, None, {1: bad})  # no golden known to the hooks: no immediate re-run
    post(service, run, records)
    with store.connect() as connection:
        (directive_id,) = (
            connection.execute(sa.select(models.Directive.id).where(models.Directive.kind == "canary"))
            .scalars()
            .all()
        )
    outcome = run_canary(CPU, SMALL, golden=golden, faults=bad)
    post(
        service,
        run,
        [
            {
                "kind": "canary_result",
                "incarnation": INCARNATION,
                "rank": 1,
                "step": 12,
                "time": 12.0,
                "node": "node-1",
                "device_uuid": "CPU-1",
                "directive_id": directive_id,
                **outcome.as_wire(),
            }
        ],
    )
    (incident,) = incidents(store, run)
    assert (incident["kind"], incident["severity"], incident["devices"]) == ("canary", "critical", ["CPU-1"])


def test_the_interval_is_set_by_the_slowest_rank_of_a_round(store: Engine, run: RunHandle) -> None:
    clock = {"now": 1000.0}
    service = Service(store, ServiceConfig(admin_token=ADMIN_TOKEN), clock=lambda: clock["now"])
    start(service, run)
    post(service, run, windows(range(1, 30)))
    clock["now"] = 1030.0
    service.canaries.schedule_due()
    records = round_records(40, None, {})
    for record in records:
        record["seconds"] = 2.0 if record["rank"] == 3 else 0.5  # synchronous ranks wait for rank 3
    post(service, run, records)
    with store.connect() as connection:
        schedule = connection.execute(sa.select(models.CanarySchedule)).mappings().one()
        assert service.canaries.interval_s(connection, schedule) == pytest.approx(2.0 / 0.005)
