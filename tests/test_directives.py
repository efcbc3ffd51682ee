"""Directives: created by the service, polled by each rank, answered once."""

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from monitor.recovery.directives import create_directive
from monitor.service import Service
from monitor.store import models
from monitor.store.leases import RunLeases
from tests.support import ADMIN_TOKEN, INCARNATION, RunHandle, batch

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DIRECTIVE = models.table_of(models.Directive)


def pending(client: TestClient, run: RunHandle, rank: int, incarnation: str = INCARNATION) -> list[int]:
    response = client.get(
        f"/v1/runs/{run.name}/directives",
        params={"incarnation": incarnation, "rank": rank},
        headers=run.headers,
    )
    assert response.status_code == 200, response.text
    return [d["id"] for d in response.json()["directives"]]


def test_a_directive_reaches_its_ranks_until_each_answers(client: TestClient, run: RunHandle) -> None:
    created = client.post(
        f"/v1/runs/{run.name}/directives", json={"kind": "dump_stacks", "ranks": [1, 2]}, headers=ADMIN
    )
    assert created.status_code == 201
    new = created.json()["directive"]
    assert new in pending(client, run, 1) and new in pending(client, run, 2)
    assert new not in pending(client, run, 0)
    ack = {
        "kind": "directive_ack",
        "directive_id": new,
        "incarnation": INCARNATION,
        "rank": 1,
        "time": 1.0,
        "status": "done",
    }
    dump = {
        "kind": "stack_dump",
        "incarnation": INCARNATION,
        "rank": 1,
        "time": 1.0,
        "stacks": "Thread ...",
        "directive_id": new,
    }
    assert client.post(run.records_path, json=batch(dump, ack), headers=run.headers).status_code == 200
    assert new not in pending(client, run, 1)
    assert new in pending(client, run, 2)


def run_wide_directives(client: TestClient, run: RunHandle, count: int) -> list[int]:
    return [
        client.post(f"/v1/runs/{run.name}/directives", json={"kind": "dump_stacks"}, headers=ADMIN).json()[
            "directive"
        ]
        for _ in range(count)
    ]


def done(directive: int, rank: int) -> dict[str, Any]:
    """A rank's acknowledgement of ``directive``, done."""
    return {
        "kind": "directive_ack",
        "directive_id": directive,
        "incarnation": INCARNATION,
        "rank": rank,
        "time": 1.0,
        "status": "done",
    }


def test_a_batch_asked_with_its_rank_is_answered_with_the_directives_left_after_it(
    client: TestClient, run: RunHandle
) -> None:
    """The hook's sender asks with each batch, sparing a separate poll; an ack in the batch
    already counts, and a batch asked without a rank is answered as before."""
    first, second = run_wide_directives(client, run, 2)
    ack = done(first, rank=3)
    asked = client.post(
        run.records_path,
        params={"incarnation": INCARNATION, "rank": 3},
        json=batch(ack),
        headers=run.headers,
    )
    assert asked.status_code == 200, asked.text
    assert asked.json()["accepted"] == 1
    answered = [d["id"] for d in asked.json()["directives"]]
    assert second in answered and first not in answered
    assert answered == pending(client, run, 3)
    plain = client.post(run.records_path, json=batch(), headers=run.headers)
    assert plain.status_code == 200 and "directives" not in plain.json()


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_replicas_answer_is_read_in_the_batchs_own_transaction(
    client: TestClient, run: RunHandle, service: Service, store: Engine
) -> None:
    """A replica (``runhealth serve`` on PostgreSQL) reads the answer's directives in the
    batch's write transaction: the acks of the batch count, for one rank and for a relay's."""
    leases = RunLeases(store.url, "replica-test")
    service.replicate(leases)
    try:
        first, second = run_wide_directives(client, run, 2)
        ack = done(first, rank=3)
        transactions = count_transactions(store)
        asked = client.post(
            run.records_path,
            params=[("incarnation", INCARNATION), ("ranks", 3), ("ranks", 4)],
            json=batch(ack),
            headers=run.headers,
        )
        assert asked.status_code == 200, asked.text
        assert transactions() == 2  # the token's read, then the batch with its answer
        by_rank = asked.json()["directives_by_rank"]
        answered = {rank: [d["id"] for d in by_rank[str(rank)]] for rank in (3, 4)}
        assert second in answered[3] and first not in answered[3]
        assert {first, second} <= set(answered[4])
        assert answered == {rank: pending(client, run, rank) for rank in (3, 4)}
    finally:
        leases.close()


def count_transactions(store: Engine) -> Callable[[], int]:
    """How many transactions ``store`` begins from now on."""
    begun = [0]

    def count(*_args: Any) -> None:
        begun[0] += 1

    sa.event.listen(store, "begin", count)
    return lambda: begun[0]


def started(incarnation: str, time: float) -> dict[str, Any]:
    return {"kind": "run_start", "incarnation": incarnation, "time": time, "world_size": 2}


def test_a_new_incarnation_retires_what_was_pending_for_older_ones(
    client: TestClient, run: RunHandle
) -> None:
    """The ranks of an incarnation that restarted can never answer; a run-wide directive still
    applies. A late start of an even older incarnation (a spool replayed) retires nothing new."""
    assert (
        client.post(run.records_path, json=batch(started("inc-a", 100.0)), headers=run.headers).status_code
        == 200
    )

    def create(**fields: Any) -> int:
        response = client.post(
            f"/v1/runs/{run.name}/directives", json={"kind": "dump_stacks", **fields}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        return int(response.json()["directive"])

    for_a, run_wide = create(incarnation="inc-a"), create()
    assert for_a in pending(client, run, 0, incarnation="inc-a")
    assert (
        client.post(run.records_path, json=batch(started("inc-b", 200.0)), headers=run.headers).status_code
        == 200
    )
    assert for_a not in pending(client, run, 0, incarnation="inc-a")
    assert run_wide in pending(client, run, 0, incarnation="inc-b")
    for_b = create(incarnation="inc-b")
    assert (
        client.post(run.records_path, json=batch(started("inc-0", 50.0)), headers=run.headers).status_code
        == 200
    )
    assert {for_b, run_wide} <= set(pending(client, run, 0, incarnation="inc-b"))


def test_an_incarnation_scoped_directive_skips_other_incarnations(client: TestClient, run: RunHandle) -> None:
    created = client.post(
        f"/v1/runs/{run.name}/directives",
        json={"kind": "dump_stacks", "incarnation": INCARNATION},
        headers=ADMIN,
    ).json()["directive"]
    assert created in pending(client, run, 0)
    assert created not in pending(client, run, 0, incarnation="another")


def test_an_ack_for_an_unknown_directive_is_422_and_stores_nothing(
    client: TestClient, run: RunHandle
) -> None:
    ack = {
        "kind": "directive_ack",
        "directive_id": 9999,
        "incarnation": INCARNATION,
        "rank": 0,
        "time": 1.0,
        "status": "done",
    }
    response = client.post(run.records_path, json=batch(ack), headers=run.headers)
    assert response.status_code == 422
    assert response.json()["problems"][0] == {
        "index": 0,
        "field": "directive_id",
        "message": response.json()["problems"][0]["message"],
    }


def test_only_the_admin_creates_directives(client: TestClient, run: RunHandle) -> None:
    response = client.post(
        f"/v1/runs/{run.name}/directives", json={"kind": "dump_stacks"}, headers=run.headers
    )
    assert response.status_code == 403
    response = client.post(f"/v1/runs/{run.name}/directives", json={"kind": "reboot"}, headers=ADMIN)
    assert response.status_code == 422


def test_a_canary_one_rank_missed_is_withdrawn_from_the_ranks_that_armed_it(
    client: TestClient, run: RunHandle, store: Any
) -> None:
    """A scheduled canary at step 3 that rank 3 first saw past its step: left pending, ranks 0-2
    would keep it armed and the directive agreement (every rank's oldest armed id) would never
    again agree, so no later hold or rollback could act (seen in the demo under load)."""
    with store.begin() as connection:
        canary = create_directive(
            connection, run.id, "canary", created_by="schedule", now=1.0, act_at_step=3,
            payload={"golden": {}},
        )  # fmt: skip
    assert all(canary in pending(client, run, rank) for rank in range(4))
    missed = {"kind": "directive_ack", "directive_id": canary, "incarnation": INCARNATION, "rank": 3,
              "time": 2.0, "status": "missed", "step": 5}  # fmt: skip
    assert client.post(run.records_path, json=batch(missed), headers=run.headers).status_code == 200
    assert all(canary not in pending(client, run, rank) for rank in range(4))
    with store.connect() as connection:
        status = connection.execute(sa.select(DIRECTIVE.c.status).where(DIRECTIVE.c.id == canary)).scalar()
    assert status == "superseded"
